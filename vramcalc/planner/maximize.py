"""The most that fits: the longest sequence or the largest micro-batch that fits one layout.

The device total of `analytic.estimate` grows with the sequence length and with the
micro-batch (activations and logits are linear in b·s, attention scores quadratic in s under
eager attention; every other term is constant in both), so the largest value that fits is
found by doubling until a value does not fit, then bisecting between the last value that fit
and the first that did not. The answer is the boundary of the same fit check every command
uses (vramcalc.report.fit_verdict): the answer fits and the next step does not.

Values searched:
- seq-len: multiples of `step` tokens (at least the smallest length the layout accepts:
  context parallelism needs seq/cp even, sequence parallelism needs tp·cp to divide it), up
  to the learned position table of a model with learned positions (GPT-2); a rotary model's
  answer may pass its trained context, and the result says so;
- micro-batch: every integer, or, with a global batch, the micro-batches that divide the
  sequences each data-parallel rank gets (global batch / dp).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from math import lcm
from typing import Any

from vramcalc.analytic import estimate
from vramcalc.errors import InputError
from vramcalc.report import MemoryReport
from vramcalc.scenario import Scenario

DIMENSIONS = ("seq-len", "micro-batch")
_FIELD = {"seq-len": "seq_len", "micro-batch": "micro_batch_size"}
_LIMIT = {"seq-len": 100_000_000, "micro-batch": 1_000_000}  # TrainingConfig's bounds


@dataclass(frozen=True)
class Point:
    """One value of the dimension and the per-GPU device total it needs."""

    value: int
    device_total_bytes: int
    fits: bool

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "device_total_bytes": self.device_total_bytes,
                "fits": self.fits}


@dataclass(frozen=True)
class MaxResult:
    """The largest value that fits (None when even the smallest does not), the step the
    search moved in, the report at the answer and memory at points around it."""

    dimension: str
    step: int
    answer: int | None
    next_value: int | None  # the next value searched above the answer (it does not fit)
    report: MemoryReport | None  # at the answer (or at the smallest value when none fits)
    usable_bytes: int
    capacity_bytes: int
    points: tuple[Point, ...]
    context_tokens: int = 0  # the model's trained context (max_position_embeddings)

    def to_json(self) -> dict[str, Any]:
        return {"dimension": self.dimension, "step": self.step, "answer": self.answer,
                "next_value": self.next_value, "usable_bytes": self.usable_bytes,
                "capacity_bytes": self.capacity_bytes, "context_tokens": self.context_tokens,
                "points": [p.to_json() for p in self.points],
                "report": self.report.to_json_dict() if self.report is not None else None}


def seq_step(scn: Scenario, step: int) -> int:
    """The sequence-length step: `step` rounded up to a multiple the layout accepts."""
    if not 1 <= step <= _LIMIT["seq-len"]:
        raise InputError(f"--step must be between 1 and {_LIMIT['seq-len']:,} tokens, got {step}")
    par = scn.parallel
    need = 2 * par.cp if par.cp > 1 else 1
    if par.sequence_parallel:
        need = lcm(need, par.tp * par.cp)
    return lcm(step, need)


def scenario_at(base: Scenario, dimension: str, value: int) -> Scenario:
    """`base` with the sequence length or micro-batch set to `value`, validated again."""
    training = base.training.model_copy(update={_FIELD[dimension]: value})
    parallel = base.parallel
    if dimension == "micro-batch" and parallel.global_batch_size is not None:
        parallel = parallel.model_copy(update={"num_microbatches": None})
    return base.model_copy(update={"training": training, "parallel": parallel}).resolved()


def _values(base: Scenario, dimension: str, step: int) -> list[int] | None:
    """The values to search, when they are a short explicit list (micro-batch with a global
    batch); None means every multiple of `step` up to the limit."""
    gb = base.parallel.global_batch_size
    if dimension != "micro-batch" or gb is None:
        return None
    per_rank = gb // base.parallel.dp_degree
    return [d for d in range(1, per_rank + 1) if per_rank % d == 0]


class _Probe:
    """Reports at values of the dimension, each once: the analytic estimate, or `engine`'s
    report (the trace engine's, from the CLI)."""

    def __init__(self, base: Scenario, dimension: str,
                 engine: Callable[[Scenario], MemoryReport] | None = None) -> None:
        self.base, self.dimension, self.engine = base, dimension, engine
        self.seen: dict[int, MemoryReport] = {}

    def report(self, value: int) -> MemoryReport:
        if value not in self.seen:
            scn = scenario_at(self.base, self.dimension, value)
            self.seen[value] = (estimate(scn, every_stage=False) if self.engine is None
                                else self.engine(scn))
        return self.seen[value]

    def fits(self, value: int) -> bool:
        return bool(self.report(value).fits)


def _largest(fits: Any, count: int) -> int:
    """The largest index i < count with fits(i) True, given fits is True then False along
    the indices and fits(0) is True: doubling, then bisection."""
    lo, hi = 0, 1
    while hi < count and fits(hi):
        lo, hi = hi, min(2 * hi, count)
    if hi >= count:
        hi = count
        if fits(count - 1):
            return count - 1
    while hi - lo > 1:  # fits(lo) is True, fits(hi) is False (or hi == count)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _chart_values(values: list[int] | None, step: int, answer: int, limit: int,
                  num: int) -> list[int]:
    """About `num` values from the smallest to twice the answer, for the chart."""
    if values is not None:
        shown = [v for v in values if v <= 2 * answer]
        after = [v for v in values if v > answer][:1]
        return sorted(set(shown[::max(1, len(shown) // num)]) | {answer} | set(after))
    top = min(2 * answer, limit)
    out = {answer, min(answer + step, limit)}
    for i in range(1, num + 1):
        v = max(step, round(top * i / num / step) * step)
        out.add(min(v, limit))
    return sorted(out)


def most_that_fits(base: Scenario, dimension: str, step: int = 1,
                   chart_points: int = 10,
                   engine: Callable[[Scenario], MemoryReport] | None = None) -> MaxResult:
    """The largest sequence length (in multiples of the layout's step) or micro-batch that
    fits `base`'s cluster, with the device total at about `chart_points` values from the
    smallest to twice the answer.

    The boundary: `estimate(answer).fits` and not `estimate(next_value).fits`, where
    next_value is the next value searched above the answer (None at the limit).

    With `engine` (the trace engine's report, whose fit replays the caching allocator near
    the limit and is at least the analytic floor), the analytic answer bounds the search:
    the engine's fit is bisected from the smallest value up to the analytic answer's next
    value, and the chart shows only the values it traced.
    """
    if engine is not None:
        bound = most_that_fits(base, dimension, step, chart_points)
        if bound.answer is None:
            return bound
        return _engine_search(base, dimension, bound, engine)
    if dimension not in DIMENSIONS:
        raise InputError(f"--maximize must be one of {', '.join(DIMENSIONS)}, got {dimension!r}")
    if base.cluster is None or base.usable_bytes is None:
        raise InputError("--gpus is required: the most that fits is measured against a GPU")
    if base.training.load_only:
        raise InputError("--load-only: no training step runs, so no sequence or batch is "
                         "held; the most that fits is a training question")
    step = seq_step(base, step) if dimension == "seq-len" else 1
    probe = _Probe(base, dimension)
    values = _values(base, dimension, step)
    limit = _LIMIT[dimension]
    if dimension == "seq-len" and base.model.position_embedding == "learned":
        limit = base.model.max_position_embeddings  # no position beyond the learned table
        if limit < step:
            raise InputError(f"{base.model.name} has {limit:,} learned positions: --step "
                             f"{step} is longer")
    if values is not None:
        def value_at(i: int) -> int:
            return values[i]
        count = len(values)
    else:
        def value_at(i: int) -> int:
            return (i + 1) * step
        count = limit // step
    usable, capacity = base.usable_bytes, base.cluster.gpu.memory_total_bytes
    if not probe.fits(value_at(0)):
        first = value_at(0)
        rep = probe.report(first)
        return MaxResult(dimension, step, None, first, rep, usable, capacity,
                         (Point(first, rep.device_total_bytes, False),),
                         base.model.max_position_embeddings)
    i = _largest(lambda k: probe.fits(value_at(k)), count)
    answer = value_at(i)
    next_value = value_at(i + 1) if i + 1 < count else None
    points = tuple(Point(v, probe.report(v).device_total_bytes, probe.fits(v))
                   for v in _chart_values(values, step, answer, value_at(count - 1),
                                          chart_points))
    return MaxResult(dimension, step, answer, next_value, probe.report(answer), usable,
                     capacity, points, base.model.max_position_embeddings)


def _engine_search(base: Scenario, dimension: str, bound: MaxResult,
                   engine: Callable[[Scenario], MemoryReport]) -> MaxResult:
    """`most_that_fits` with `engine`'s fit, over the values up to the analytic answer's
    next one (`bound`)."""
    assert bound.answer is not None and base.usable_bytes is not None
    step = bound.step
    values = _values(base, dimension, step)
    top = bound.next_value if bound.next_value is not None else bound.answer
    if values is not None:
        searched = [v for v in values if v <= top]
    else:
        searched = list(range(step, top + 1, step))
    probe = _Probe(base, dimension, engine)
    if not probe.fits(searched[0]):
        rep = probe.report(searched[0])
        return replace(bound, answer=None, next_value=searched[0], report=rep,
                       points=(Point(searched[0], rep.device_total_bytes, False),))
    i = _largest(lambda k: probe.fits(searched[k]), len(searched))
    answer = searched[i]
    points = tuple(Point(v, r.device_total_bytes, bool(r.fits))
                   for v, r in sorted(probe.seen.items()))
    return replace(bound, answer=answer,
                   next_value=searched[i + 1] if i + 1 < len(searched) else None,
                   report=probe.report(answer), points=points)
