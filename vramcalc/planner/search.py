"""Best-first plan search: the fastest strategies that fit, ranked.

1. **Enumerate** the layouts of the cluster (vramcalc/planner/candidates.py), lazily: each
   layout group's candidates at one precision and fine-tuning method are listed fastest
   speed bound first, while that bound is at least the speed of the best candidate waiting,
   so candidates are visited in exactly the order a full sort would give.
2. **Prune** a candidate whose memory lower bound (vramcalc/planner/bound.py: model states from
   the engine's term functions, an activation floor, what earlier estimates taught) plus the
   CUDA context exceeds the usable memory, and skip one that differs from a valid candidate
   only by a larger micro-batch and is no faster (dominance).
3. **Estimate** the rest with `analytic.estimate`, fastest first, and stop once `top_n` fit
   and no remaining candidate can be faster than the last of them.

Ranking: tokens/s (descending); ties: fewer changes to the requested training settings,
then more headroom, then a fixed order of the strategy fields (deterministic).
Pure: no I/O; progress goes to an optional callback.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from vramcalc.analytic import estimate
from vramcalc.errors import InputError
from vramcalc.hf_stack import trainer_no_sync
from vramcalc.planner.bound import MemoryBound
from vramcalc.planner.candidates import (
    REC_ORDER,
    Candidate,
    Enumerator,
    enumerate_candidates,
    scenario_for,
    speed_model,
)
from vramcalc.planner.layouts import split_refusal
from vramcalc.planner.request import PlanRequest, ProgressFn
from vramcalc.rank import RankContext
from vramcalc.report import MemoryReport
from vramcalc.scenario import Scenario, capability_problem, mla_problem
from vramcalc.speed import SpeedReport
from vramcalc.terms.optimizer_states import paged_state_bytes


@dataclass(frozen=True)
class PlanEntry:
    """One estimated strategy: scenario, memory report and speed."""

    scenario: Scenario
    report: MemoryReport
    speed: SpeedReport
    changes: tuple[str, ...] = ()  # training settings changed from the request

    @property
    def fits(self) -> bool:
        return bool(self.report.fits)

    @property
    def usable_bytes(self) -> int:
        return self.scenario.usable_bytes or 0

    @property
    def over_bytes(self) -> int:
        """Bytes above the usable memory (negative: free below it)."""
        return self.report.device_total_bytes - self.usable_bytes

    def to_json(self) -> dict[str, Any]:
        """The `--json` candidate object (schema fixed by issue 5)."""
        return {
            "strategy": self.report.strategy,
            "fits": self.fits,
            "peak_allocated_bytes": self.report.peak_allocated_bytes,
            "device_total_bytes": self.report.device_total_bytes,
            "tokens_per_s": self.speed.tokens_per_s,
            "step_time_s": self.speed.step_time_s,
            "mfu": self.speed.mfu,
        }


def with_every_stage(entry: PlanEntry | None) -> PlanEntry | None:
    """The entry with its report listing every pipeline stage (the search estimates only the
    stages that can be the worst, `analytic.candidate_stages`: same totals, fewer stages)."""
    if entry is None or entry.scenario.parallel.pp == 1:
        return entry
    return replace(entry, report=estimate(entry.scenario))


@dataclass
class PlanResult:
    """Fitting entries ranked best first; `closest` when none fits."""

    entries: list[PlanEntry]
    closest: PlanEntry | None
    global_batch_size: int
    num_candidates: int = 0  # valid candidates (counted, not all expanded)
    num_expanded: int = 0  # candidates whose speed was computed
    num_dominated: int = 0
    num_bound_pruned: int = 0
    num_estimated: int = 0
    num_rejected: int = 0  # refused by the engine's own validation
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return bool(self.entries)


def rank_key(e: PlanEntry, tail: tuple) -> tuple:
    """Sort key of a fitting entry (module docstring, "Ranking")."""
    return (-e.speed.tokens_per_s, len(e.changes), -(e.report.free_bytes or 0), tail)


def estimate_candidate(c: Candidate, base: Scenario, req: PlanRequest) -> PlanEntry | None:
    """The candidate's entry: the engine's estimate (worst rank exact; `with_every_stage`
    for display) and its speed; None when the engine's validation refuses the layout."""
    try:
        scn = scenario_for(c, base)
        rep = estimate(scn, every_stage=False)
    except (InputError, ValueError):
        return None
    layout = replace(c.layout(base.parallel.offload_device),
                     reduce_once=trainer_no_sync(scn.training, scn.parallel))
    spilled = paged_host_bytes(scn, rep)
    if spilled:
        layout = replace(layout, paged_host_bytes=spilled)
    speed = speed_model(base, c.prec, c.ft, req.efficiency).report(layout)
    return PlanEntry(scenario=scn, report=rep, speed=speed, changes=c.changes)


def paged_host_bytes(scn: Scenario, rep: MemoryReport) -> int:
    """The worst rank's paged optimizer pages that have no room on the device (0 unless the
    optimizer is paged): its paged states less the resident part the report counts."""
    resident = rep.subterms.get("overhead/paged_optimizer_states")
    if resident is None:
        return 0
    res = scn.resolved()
    # the worst rank: the stage whose device total is the report's (stage 0 without pp)
    stage = next((st.stage for st in rep.stages
                  if st.device_total_bytes == rep.device_total_bytes), 0)
    ctx = RankContext(res.model, res.training, res.parallel, stage)
    return max(0, paged_state_bytes(ctx) - resident)


def usable_and_context(base: Scenario) -> tuple[float, int]:
    """(usable bytes per GPU, CUDA context bytes) of the base's GPU."""
    assert base.cluster is not None
    gpu = base.cluster.gpu
    return gpu.memory_total_bytes * (1 - base.headroom_fraction), gpu.context_overhead_bytes


def check_searchable(base: Scenario, req: PlanRequest | None = None) -> None:
    """Refuse what the planner cannot search (InputError): a multi-latent attention model
    whose training setup the profile's MLA activations do not cover on any layout (the
    estimate's own message, vramcalc/scenario.py `mla_problem` at tp = cp = 1; the layouts
    they cover are searched, vramcalc/planner/layouts.py `mla_refusal`), and a precision the
    GPU cannot run unless --allow precision."""
    if base.model.is_mla:
        one = base.parallel.model_copy(update={"tp": 1, "cp": 1})
        problem = mla_problem(base.model_copy(update={"parallel": one}))
        if problem:
            raise InputError(problem)
    if req is not None and base.cluster is not None and "precision" not in req.allow:
        problem = capability_problem(base.training, base.cluster.gpu)
        if problem:
            raise InputError(problem + "; or --allow precision to search the others")


def search(base: Scenario, req: PlanRequest, progress: ProgressFn | None = None,
           want_closest: bool = True) -> PlanResult:
    """Best `req.top_n` strategies that fit on `base.cluster`, ranked (module docstring)."""
    if base.cluster is None:
        raise InputError("plan needs --gpus (GPU type and count)")
    if req.top_n < 1:
        raise InputError(f"--top must be at least 1, got {req.top_n}")
    check_searchable(base, req)
    usable, context = usable_and_context(base)
    B = req.batch_for(base.training.seq_len)
    result = PlanResult(entries=[], closest=None, global_batch_size=B)
    bound = MemoryBound(base)
    en = Enumerator(base, req, bound, usable - context)
    result.num_candidates = sum(en.count(g) for g in en.groups)
    if not result.num_candidates:
        why = split_refusal(base, base.cluster.num_gpus) or pinned_refusal(
            base, req.pinned) or (
            "the data-parallel size must divide the batch (try a global batch that is a "
            "multiple of the GPU count)")
        raise InputError(
            f"no valid layout of {base.cluster.num_gpus} GPUs for a global batch of {B} "
            f"sequences{_pin_text(req.pinned)}: {why}")
    # a group's slower precisions and methods are never listed once faster plans fill the top
    units = sorted(((en.upper_bound(g, pkey), i, j, pkey) for i, g in enumerate(en.groups)
                    for j, pkey in enumerate(en.valid_variants(g[0]))),
                   key=lambda t: (-t[0], t[1], t[2]))
    heap: list[tuple[tuple, Candidate]] = []
    seen: list[Candidate] = []
    gi = 0
    valid: dict[int, bool] = {}  # idx -> not refused by the engine (or dominated by such)
    fitting: list[tuple[tuple, PlanEntry]] = []
    estimated: list[tuple[PlanEntry, tuple]] = []
    while True:
        while gi < len(units) and (not heap or units[gi][0] >= heap[0][1].tps):
            for c in en.expand(en.groups[units[gi][1]], units[gi][3]):
                heapq.heappush(heap, ((-c.tps, c.nchg, c.tail(), c.idx), c))
                seen.append(c)
            gi += 1
            if progress is not None and gi % 16 == 0:
                progress("searching layouts", gi, len(units))
        if not heap:
            break
        _, c = heapq.heappop(heap)
        if len(fitting) >= req.top_n:
            nth = fitting[req.top_n - 1][0]
            if (-c.tps, c.nchg) > nth[:2]:
                break
        if c.dom and any(valid.get(d, False) for d in c.dom):
            result.num_dominated += 1
            valid[c.idx] = True
            continue
        if bound.total(c) + context > usable:
            result.num_bound_pruned += 1  # validity unknown: what it dominates is checked
            continue
        entry = estimate_candidate(c, base, req)
        valid[c.idx] = entry is not None
        if entry is None:
            result.num_rejected += 1
            continue
        result.num_estimated += 1
        bound.learn(c, entry.report)
        estimated.append((entry, c.tail()))
        if entry.fits:
            fitting.append((rank_key(entry, c.tail()), entry))
            fitting.sort(key=lambda t: t[0])
    result.num_bound_pruned += en.pruned
    result.num_rejected += en.refused
    result.num_expanded = len(seen)
    if progress is not None:
        progress("searching layouts", len(units), len(units))
    result.entries = [e for _, e in fitting[: req.top_n]]
    if not result.entries and want_closest:
        if en.pruned:  # the closest may be among the pruned: probe them all
            seen, _, _ = enumerate_candidates(base, req)
        result.closest = closest(seen, bound, estimated, base, req)
        if result.closest is None:  # every layout refused: say why, not "nothing fits"
            reason = refusal(seen, base) or pinned_refusal(base, req.pinned)
            W = base.cluster.num_gpus
            hint = (f" (a global batch divisible by {W} would let every GPU be a "
                    "data-parallel rank)" if B % W and req.pinned.get("dp") is None else "")
            raise InputError(f"no layout of {W} GPUs can run{_pin_text(req.pinned)}: "
                             f"{reason or 'the engine refused every layout'}{hint}")
    return result


def refusal(cands: list[Candidate], base: Scenario) -> str | None:
    """Why the engine refuses these candidates: the first one's own message."""
    for c in cands[:1]:
        try:
            estimate(scenario_for(c, base), every_stage=False)
        except (InputError, ValueError) as err:
            return str(err)
    return None


_TRAINING_PINS = ("micro_batch_size", "grad_accum", "recompute")


def pinned_refusal(base: Scenario, pinned: Mapping[str, Any]) -> str | None:
    """The engine's message for the base scenario with the pinned values applied (the
    unpinned ones at the base's), or None when it estimates: why no layout can run."""
    pins = {k: v for k, v in pinned.items() if v is not None}
    training = {k: v for k, v in pins.items() if k in _TRAINING_PINS}
    parallel = {k: v for k, v in pins.items() if k not in _TRAINING_PINS}
    try:
        scn = base.model_copy(update={
            "training": base.training.model_copy(update=training),
            "parallel": base.parallel.model_copy(update=parallel)}).resolved()
        estimate(scn, every_stage=False)
    except (InputError, ValueError) as err:
        return str(err)
    return None


def _pin_text(pinned: Mapping[str, Any]) -> str:
    items = [(k, v) for k, v in sorted(pinned.items()) if v is not None]
    if not items:
        return ""
    return " with " + ", ".join(f"{k}={v}" for k, v in items)


def closest(cands: list[Candidate], bound: MemoryBound,
            estimated: list[tuple[PlanEntry, tuple]], base: Scenario, req: PlanRequest,
            probes: int = 12) -> PlanEntry | None:
    """The estimated candidate with the smallest device total (also estimating the
    `probes` candidates with the smallest memory lower bounds)."""
    pool = list(estimated)
    done = {tail for _, tail in estimated}
    order = sorted(cands, key=lambda c: (bound.total(c), REC_ORDER[c.rec], c.b, c.tail()))
    for c in order[:probes]:
        if c.tail() in done:
            continue
        e = estimate_candidate(c, base, req)
        if e is not None:
            pool.append((e, c.tail()))
    if not pool:
        return None
    return min(pool, key=lambda t: (t[0].report.device_total_bytes, -t[0].speed.tokens_per_s,
                                    t[1]))[0]
