"""The planner: enumerate layouts, estimate, keep what fits, rank by speed; suggest changes.

Pure: no printing, no files, no exit codes. The CLI passes a progress callback and the list
of GPU profiles (for "another GPU type" suggestions).

Search (docs/planning.md has the details):

1. **Enumerate** every valid layout of the cluster: tp within a node (dividing the heads),
   pp dividing the layers, cp dividing the sequence, dp the rest (dividing the global
   batch), ep for MoE models, ZeRO 0-3 / FSDP (full, shard-grad-op with pipelining;
   hybrid within a node), recompute none/selective/full, every
   power-of-two micro-batch that divides the per-rank batch, 1F1B or interleaved (v = 2)
   pipelines, and — when allowed — offload, precision, optimizer. Sequence parallelism is
   always on when tp > 1 (same traffic as plain TP, never more memory).
2. **Speed** of each from vramcalc.speed (microseconds), and a **memory lower bound**
   (model states ÷ sharding plus an activation floor); candidates over the usable memory
   are dropped before any estimate.
3. **Dominance**: a candidate that differs from another only by a larger micro-batch and
   is no faster is skipped once that other one turns out valid: activations grow with the
   micro-batch, so it would rank below it. (ZeRO stages are not assumed ordered: fixed
   communication buckets can make a higher stage use more memory on a small model.)
4. **Best first**: walk candidates from the fastest; skip those whose lower bound —
   tightened by what earlier estimates taught (activations of the same shapes, the
   optimizer-step total of the same model states) — exceeds the usable memory, estimate
   the rest with vramcalc.analytic.estimate, and stop once `top_n` fit and no remaining
   candidate can be faster than the last of them.

Ranking: tokens/s (descending); ties: fewer changes to the requested training settings,
then more headroom, then a fixed order of the strategy fields (deterministic).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from vramcalc.errors import InputError
from vramcalc.speed import Layout, SpeedModel, SpeedReport
from vramcalc.training import TrainingConfig
from vramcalc.units import DTYPE_BITS

if TYPE_CHECKING:  # the engine and schemas load on first use: `import vramcalc.cli` stays fast
    from vramcalc.hardware import GPUProfile
    from vramcalc.report import MemoryReport
    from vramcalc.scenario import Scenario

# Global batch when none is given: the power of two nearest below 4M tokens per step
# (Llama 2 trained every size with a global batch of 4M tokens; Llama 2 MODEL_CARD.md).
DEFAULT_BATCH_TOKENS = 4 * 2**20
MAX_MICRO_BATCH = 64
# Multiplier on the memory lower bound before pruning: a margin so that a small change in
# the engine's rounding can never prune a candidate that fits.
LOWER_BOUND_MARGIN = 0.95

ProgressFn = Callable[[str, int, int], None]


# ---- request and result ----------------------------------------------------------------
@dataclass(frozen=True)
class PlanRequest:
    """What to search. Exactly one of the batch fields may be set (else the default)."""

    global_batch_size: int | None = None  # sequences per step
    global_batch_tokens: int | None = None
    top_n: int = 5
    allow: frozenset[str] = frozenset()
    pinned: Mapping[str, Any] = field(default_factory=dict)  # normalized option values
    efficiency: float | None = None  # --mfu override of the profile's mfu_fraction
    max_micro_batch: int = MAX_MICRO_BATCH

    def batch_for(self, seq_len: int) -> int:
        """Global batch in sequences for this sequence length."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        if self.global_batch_tokens is not None:
            return max(1, round(self.global_batch_tokens / seq_len))
        per = max(1, DEFAULT_BATCH_TOKENS // seq_len)
        return 1 << (per.bit_length() - 1)


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
    from vramcalc.analytic import estimate

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


@dataclass(frozen=True)
class Suggestion:
    """A change that makes the job fit, with the best plan under it."""

    kind: str  # more_gpus | other_gpu | offload | optimizer | seq_len | finetune
    title: str
    change: Mapping[str, Any]  # option values to apply (CLI option names, snake_case)
    entry: PlanEntry
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "title": self.title, "change": dict(self.change),
                **dict(self.details), "candidate": self.entry.to_json()}


# ---- candidates --------------------------------------------------------------------------
class _Cand(NamedTuple):
    """One candidate strategy (plain tuple: the search builds tens of thousands)."""

    tps: float
    nchg: int
    tp: int
    pp: int
    cp: int
    ep: int
    sp: bool
    dp: int
    b: int  # micro-batch
    m: int  # micro-batches per step (gradient accumulation)
    rec: str
    sched: str
    v: int
    zero: int
    fsdp: str
    group: int | None
    stage: int
    off: tuple[str, ...]
    prec: str
    opt: str
    ft: str | None
    changes: tuple[str, ...]
    idx: int = -1  # position in the enumeration
    dom: tuple[int, ...] = ()  # candidates (by idx) at least as fast with no more memory

    def tail(self) -> tuple:
        """A fixed order of the strategy fields, for deterministic ties (a dominating
        candidate, with a smaller micro-batch, comes first)."""
        return (self.tp, self.pp, self.cp, self.ep, -self.stage, self.fsdp,
                _REC_ORDER[self.rec], self.b, self.sched, self.off, self.prec, self.opt,
                self.ft or "")

    def layout(self, offload_device: str) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                      sequence_parallel=self.sp, shard_stage=self.stage, shard_group=self.group,
                      micro_batch_size=self.b, num_microbatches=self.m, recompute=self.rec,
                      pp_schedule=self.sched, virtual_stages=self.v, offload=self.off,
                      offload_device=offload_device)


_REC_ORDER = {"none": 0, "selective": 1, "full": 2}


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _pow2_upto(n: int) -> list[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


def _finetune_choices() -> tuple[str, ...] | None:
    """Fine-tuning methods, when the training schema supports them (another issue)."""
    from vramcalc.options import OPTIONS_BY_NAME

    opt = OPTIONS_BY_NAME.get("finetune")
    if opt is None or "finetune" not in TrainingConfig.model_fields:
        return None
    return tuple(opt.choices or ())


def finetune_supported() -> bool:
    return _finetune_choices() is not None


def _given(pinned: Mapping[str, Any], key: str) -> bool:
    return pinned.get(key) is not None


def _shardings(dp: int, cp: int, tp: int, pp: int, ep: int, gpn: int,
               pinned: Mapping[str, Any]) -> list[tuple[int, str, int | None, int]]:
    """(zero, fsdp, shard_group, shard_stage) options for this data-parallel size.

    ZeRO 0-3 without pipelining; with pipelining ZeRO 0-1 and FSDP shard-grad-op / full
    (DeepSpeed runs ZeRO-2/3 without pipeline parallelism only; Megatron and torchtitan
    pipeline with a distributed optimizer or FSDP). FSDP hybrid shards within a node.
    """
    if dp == 1:
        opts = [(0, "none", None, 0), (1, "none", None, 1)]  # zero-1 only for offload
    else:
        opts = [(0, "none", None, 0), (1, "none", None, 1)]
        if pp == 1:
            opts += [(2, "none", None, 2), (3, "none", None, 3)]
        else:
            opts += [(0, "grad-op", None, 2), (0, "full", None, 3)]
        per_node = gpn // (tp * cp) if tp * cp <= gpn else 0
        if 1 < per_node < dp and dp % per_node == 0 and per_node % ep == 0:
            opts.append((0, "hybrid", per_node, 3))
    if _given(pinned, "fsdp") or _given(pinned, "zero") or _given(pinned, "shard_group"):
        f = pinned.get("fsdp") or "none"
        z = pinned.get("zero") or 0
        if f == "none":
            return [(z, "none", None, z)]
        stage = {"full": 3, "hybrid": 3, "grad-op": 2}[f]
        group = pinned.get("shard_group") if f == "hybrid" else None
        if f == "hybrid" and (not group or dp % group):
            return []
        return [(0, f, group, stage)]
    return opts


def _offloads(stage: int, allowed: bool, pinned: Mapping[str, Any]) -> list[tuple[str, ...]]:
    if "offload" in pinned and pinned["offload"] is not None:
        off = tuple(pinned["offload"])
        if (off and stage == 0) or ("params" in off and stage != 3) or (
                "gradients" in off and stage < 2):
            return []
        return [off]
    if not allowed:
        return [()]
    out: list[tuple[str, ...]] = [()]
    if stage >= 1:
        out.append(("optimizer",))
    if stage == 3:
        out.append(("optimizer", "params"))
    return out


def _fp8_allowed(base: Scenario) -> bool:
    """FP8 is proposed where vramcalc models it: dense models, full training, the reference
    profile, no QAT or activation offload (vramcalc/terms/lowprec.py check_lowprec)."""
    tr = base.training
    return (not base.model.is_moe and tr.framework == "reference" and tr.finetune == "full"
            and tr.qat == "none" and not tr.activation_offload)


def _pick(pinned: Mapping[str, Any], key: str, values: Iterable[Any]) -> list[Any]:
    if _given(pinned, key):
        return [v for v in values if v == pinned[key]]
    return list(values)


def _variants(base: Scenario, req: PlanRequest, gpu: GPUProfile
              ) -> list[tuple[str, str, str | None, tuple[str, ...]]]:
    """(precision, optimizer, finetune, changed settings) combinations allowed."""
    tr = base.training
    precs = [tr.precision]
    if "precision" in req.allow:
        extra = ("bf16", "bf16-pure") if gpu.peak_tflops("bf16") else ("fp16",)
        if gpu.peak_tflops("fp8") and _fp8_allowed(base):  # FP8 tensor cores (terms/lowprec.py)
            extra += ("fp8",)
        precs += [p for p in extra if p not in precs]
    opts = [tr.optimizer]
    if "optimizer" in req.allow and tr.optimizer in ("adam", "adamw"):
        opts.append("adamw-8bit")
    cur_ft = getattr(tr, "finetune", None)
    fts: list[str | None] = [cur_ft]
    choices = _finetune_choices()
    if "finetune" in req.allow and choices:
        fts += [f for f in choices if f != cur_ft]
    out = []
    for p in precs:
        for o in opts:
            for f in fts:
                changed = tuple(n for n, new, old in (("precision", p, tr.precision),
                                                     ("optimizer", o, tr.optimizer),
                                                     ("finetune", f, cur_ft)) if new != old)
                out.append((p, o, f, changed))
    return out


def _layouts(base: Scenario, req: PlanRequest) -> Iterator[tuple]:
    """(tp, pp, cp, dp, sp, ep, [(b, m, [(sched, v), ...]), ...]) of every valid layout,
    micro-batches ascending."""
    assert base.cluster is not None
    spec, tr, cl = base.model, base.training, base.cluster
    pinned = req.pinned
    W, gpn = cl.num_gpus, cl.gpus_per_node
    seq = tr.seq_len
    B = req.batch_for(seq)
    L = spec.num_hidden_layers
    heads, kv = spec.num_attention_heads, spec.kv_heads
    accum_pin = pinned.get("grad_accum") or pinned.get("num_microbatches")
    for tp in _pick(pinned, "tp", _divisors(min(gpn, W))):
        if W % tp or heads % tp or (kv % tp and tp % kv):
            continue
        for pp in _pick(pinned, "pp", _divisors(W // tp)):
            if L % pp:
                continue
            for cp in _pick(pinned, "cp", _divisors(W // (tp * pp))):
                if seq % cp or (cp > 1 and (seq // cp) % 2):
                    continue
                dp = W // (tp * pp * cp)
                if (_given(pinned, "dp") and pinned["dp"] != dp) or B % dp:
                    continue
                sp_ok = tp > 1 and seq % (tp * cp) == 0
                if _given(pinned, "sequence_parallel"):
                    sps = [pinned["sequence_parallel"]] if (
                        sp_ok or not pinned["sequence_parallel"]) else []
                else:
                    sps = [sp_ok]
                eps = [1]
                if spec.is_moe:
                    eps = [e for e in _divisors(spec.num_local_experts) if (dp * cp) % e == 0]
                eps = _pick(pinned, "ep", eps)
                per_rank = B // dp
                if _given(pinned, "micro_batch_size"):
                    b0 = pinned["micro_batch_size"]
                    mbs_list = [b0] if per_rank % b0 == 0 else []
                else:
                    mbs_list = [b for b in _pow2_upto(min(per_rank, req.max_micro_batch))
                                if per_rank % b == 0]
                    if per_rank <= req.max_micro_batch and per_rank not in mbs_list:
                        mbs_list.append(per_rank)
                batches = []
                for b in mbs_list:
                    m = per_rank // b
                    if accum_pin is not None and m != accum_pin:
                        continue
                    if _given(pinned, "pp_schedule"):
                        sch = pinned["pp_schedule"]
                        v = pinned.get("virtual_stages") or (2 if sch == "interleaved" else 1)
                        scheds = [(sch, v)] if pp > 1 or sch == "1f1b" else []
                    else:
                        # GPipe keeps all m micro-batches in flight for the same bubble as
                        # 1F1B, so it is never better; searched only when asked for.
                        scheds = [("1f1b", 1)]
                        if pp > 1 and L % (pp * 2) == 0 and m % pp == 0:
                            scheds.append(("interleaved", 2))
                    if scheds:
                        batches.append((b, m, scheds))
                if not batches:
                    continue
                for sp in sps:
                    for ep in eps:
                        yield tp, pp, cp, dp, sp, ep, batches


class _Enumerator:
    """Candidates of one search, layout group by layout group (tp, pp, cp, dp, sp, ep).

    `count` sizes a group without computing anything, `upper_bound` caps the tokens/s of
    any candidate in it, `expand` lists its candidates with their speed — so the search can
    expand groups lazily, fastest bound first.

    With `bound` and `limit_bytes`, candidates whose memory lower bound (model states and the
    activation floor) exceeds `limit_bytes` are counted in `pruned` but not returned.
    Dominance (module docstring; off with `dominance=False`): each candidate lists in `dom`
    the candidates that differ only by a smaller micro-batch and are at least as fast; the
    search skips it once one of those turns out valid (the engine may refuse a layout).
    """

    def __init__(self, base: Scenario, req: PlanRequest, bound: _Bound | None = None,
                 limit_bytes: float | None = None, dominance: bool = True) -> None:
        assert base.cluster is not None
        cl = base.cluster
        self.base, self.req, self.bound, self.dominance = base, req, bound, dominance
        self.limit = limit_bytes if (bound is not None and limit_bytes is not None) else None
        pinned = req.pinned
        self.recomputes = _pick(pinned, "recompute", ("none", "selective", "full"))
        self.allow_off = "offload" in req.allow
        self.zero_pinned = _given(pinned, "zero")
        self.off_dev = base.parallel.offload_device
        # variants grouped by (precision, finetune): the speed model depends on both (a
        # frozen base skips its weight-gradient matmuls; vramcalc/speed.py)
        self.by_prec: dict[tuple[str, str | None], list[tuple[str, str | None,
                                                              tuple[str, ...]]]] = {}
        for prec, opt, ft, changed in _variants(base, req, cl.gpu):
            self.by_prec.setdefault((prec, ft), []).append((opt, ft, changed))
        self.models = {k: _speed_model(base, k[0], k[1], req.efficiency) for k in self.by_prec}
        self.groups = list(_layouts(base, req))
        self.next_idx = 0
        self.pruned = 0

    def shardings(self, g: tuple) -> list[tuple[tuple, tuple[str, ...]]]:
        tp, pp, cp, dp, sp, ep, _ = g
        assert self.base.cluster is not None
        return [(sh, off) for sh in _shardings(dp, cp, tp, pp, ep,
                                               self.base.cluster.gpus_per_node,
                                               self.req.pinned)
                for off in _offloads(sh[3], self.allow_off, self.req.pinned)
                if not (dp == 1 and sh[0] == 1 and not off and not self.zero_pinned)]

    def count(self, g: tuple) -> int:
        """Valid candidates in a group."""
        per_batch = sum(len(scheds) for _, _, scheds in g[6])
        variants = sum(len(v) for v in self.by_prec.values())
        return len(self.shardings(g)) * len(self.recomputes) * variants * per_batch

    def upper_bound(self, g: tuple) -> float:
        """Tokens/s no candidate of the group exceeds: no recomputation, no data-parallel or
        offload time, the smallest bubble; TP, CP, EP and PP traffic per step does not
        depend on how the batch is split into micro-batches (PP: with v = 1)."""
        tp, pp, cp, dp, sp, ep, batches = g
        b, m, scheds = batches[0]  # smallest micro-batch: most micro-batches
        v_max = max(v for _, v in scheds)
        best = 0.0
        for sm in self.models.values():
            comp, _, ttp, tcp, tep, tpp, _, _ = sm.base_parts(dp, tp, pp, cp, ep, sp, b, m,
                                                              "none", 1)
            bubble = comp * (pp - 1) / (v_max * m)
            tokens = dp * b * m * self.base.training.seq_len
            best = max(best, tokens / (comp + bubble + ttp + tcp + tep + tpp))
        return best * (1 + 1e-9)

    def expand(self, g: tuple) -> list[_Cand]:
        tp, pp, cp, dp, sp, ep, batches = g
        bound, limit, seq = self.bound, self.limit, self.base.training.seq_len
        shardings = self.shardings(g)
        # model-state bounds per (sharding, offload, precision): [(variant, weights, total)]
        states: dict[tuple, list[tuple[tuple, float, float]]] = {}
        if limit is not None:
            assert bound is not None
            for sh, off in shardings:
                for pkey, vlist in self.by_prec.items():
                    prec = pkey[0]
                    states[(sh, off, pkey)] = [
                        (var, *bound.states(tp, pp, ep, dp, cp, sh[3], sh[2], off, prec,
                                            var[0], var[1])[:2], bound.states(
                            tp, pp, ep, dp, cp, sh[3], sh[2], off, prec, var[0], var[1])[3])
                        for var in vlist]
        out: list[_Cand] = []
        for rec in self.recomputes:
            for pkey, sm in self.models.items():
                prec = pkey[0]
                vlist = self.by_prec[pkey]
                smaller: dict[tuple, list[tuple[int, float]]] = {}  # key -> [(b, tps)]
                index: dict[tuple, int] = {}  # (b, key, opt, ft) -> idx
                for b, m, scheds in batches:
                    tokens = dp * b * m * seq
                    floor = bound.floor(tp, pp, cp, sp, b, m, rec, prec) if bound else 0.0
                    w_room = (limit - floor) if limit is not None else 0.0
                    row: list[tuple[tuple, float, list]] = []
                    for sched, v in scheds:
                        comp, bub, ttp, tcp, tep, tpp, t_fwd, t_bwd = sm.base_parts(
                            dp, tp, pp, cp, ep, sp, b, m, rec, v)
                        fixed = comp + bub + ttp + tcp + tep + tpp
                        for sh, off in shardings:
                            if limit is not None:
                                keep_v = [var for var, wo, g, ms in states[(sh, off, pkey)]
                                          if ms <= limit and wo + g * (m > 1) <= w_room]
                                if len(keep_v) < len(vlist):
                                    self.pruned += len(vlist) - len(keep_v)
                                    if not keep_v:
                                        continue
                            else:
                                keep_v = vlist
                            tdp, toff = sm.sharding_parts(dp, tp, pp, cp, ep, m, sh[3], sh[2],
                                                          off, self.off_dev, t_fwd, t_bwd)
                            row.append(((sched, v, sh, off), tokens / (fixed + tdp + toff),
                                        keep_v))
                    for key, tps, keep_v in row:
                        # smaller micro-batches at least as fast dominate (activations grow
                        # with the micro-batch; not applied when this one needs no
                        # accumulation, which frees the accumulated gradients)
                        bdoms = [bb for bb, tt in smaller.get(key, ()) if tt >= tps] if (
                            self.dominance and m > 1) else []
                        sched, v, (zero, fsdp, group, stage), off = key
                        for opt, ft, changed in keep_v:
                            dom = tuple(index[d] for d in
                                        [(bb, key, opt, ft) for bb in bdoms] if d in index
                                        ) if bdoms else ()
                            idx = self.next_idx
                            self.next_idx += 1
                            index[(b, key, opt, ft)] = idx
                            out.append(_Cand(tps, len(changed), tp, pp, cp, ep, sp, dp, b, m,
                                             rec, sched, v, zero, fsdp, group, stage, off, prec,
                                             opt, ft, changed, idx, dom))
                    for key, tps, _ in row:
                        smaller.setdefault(key, []).append((b, tps))
        return out


def enumerate_candidates(base: Scenario, req: PlanRequest, bound: _Bound | None = None,
                         limit_bytes: float | None = None, dominance: bool = True,
                         ) -> tuple[list[_Cand], int, int]:
    """Every valid candidate on `base.cluster` with its tokens/s (see _Enumerator).

    Returns (candidates, valid candidates enumerated, pruned by the bound); each
    candidate's `idx` is its position in the list.
    """
    en = _Enumerator(base, req, bound, limit_bytes, dominance)
    out: list[_Cand] = []
    for g in en.groups:
        out += en.expand(g)
    return out, sum(en.count(g) for g in en.groups), en.pruned


# ---- memory lower bound -------------------------------------------------------------------
_PRECISIONS = ("fp32", "amp-bf16", "amp-fp16", "bf16", "fp16", "bf16-pure")
_STATE_ELEMS = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1, "lion": 1,
                "adafactor": 0, "adamw-8bit": 0}


class _Bound:
    """Memory lower bounds per rank, in bytes, without running the engine.

    The end of the forward pass on the first pipeline stage, in steady state, holds the
    weights, the optimizer states, the gradients accumulated so far (with more than one
    micro-batch) and the activations in flight (at least the floor below).
    Model states: weights + gradients + optimizer states (+ fp32 master) of the larger of
    the first pipeline stage (embedding + its layers) and the last (its layers + head),
    ÷tp (experts also ÷ep), ÷ the ZeRO shard group (dp·cp, or the hybrid group) from the
    stage that shards each; an offloaded one counts 0 and any offload drops the gradients.
    They all live together in the optimizer step (or, once a candidate with the same model
    states was estimated, its optimizer-step total).
    Activations: at least the tensors every profile saves (see `floor`), or more when learned
    from an estimated candidate with the same shapes: activations do not depend on ZeRO,
    offload or optimizer, never grow with more recomputation, grow with the micro-batch
    (linearly without pipelining).
    """

    def __init__(self, base: Scenario) -> None:
        spec = base.model
        self.spec = spec
        n_exp = spec.num_moe_layers * spec.num_local_experts * spec.expert_params
        n_layers = (spec.num_params - spec.embedding_params - spec.head_params
                    - spec.final_norm_params)
        self.n_exp = n_exp
        self.n_layer_dense = n_layers - n_exp
        self.emb = spec.embedding_params
        self.head = spec.head_params + spec.final_norm_params
        self.tied = spec.tie_word_embeddings
        self.seq = base.training.seq_len
        # offloaded activations leave the device: no floor (vramcalc/terms/lowmem.py)
        self.offload_acts = base.training.activation_offload
        self.opt_dtype = base.training.optimizer_dtype
        self.acts: dict[tuple, dict[tuple[int, int], float]] = {}
        self.opt_phase: dict[tuple, float] = {}
        d = spec.head_size
        self._sharded_inputs = (2 * spec.num_attention_heads * d + 2 * spec.kv_heads * d
                                + (0 if spec.is_moe else spec.intermediate_size))
        self._bytes: dict[tuple[str, str], tuple[float, float, float]] = {}
        self._compute_bytes = {p: DTYPE_BITS[TrainingConfig.model_construct(
            precision=p).compute_dtype] / 8 for p in _PRECISIONS}
        self._compute_bytes["fp8"] = 1.0  # FP8 linears save 1-byte inputs (terms/lowprec.py)

    def _per_param(self, prec: str, opt: str) -> tuple[float, float, float]:
        key = (prec, opt)
        if key not in self._bytes:
            tr = TrainingConfig.model_construct(precision=prec, optimizer=opt,
                                                optimizer_dtype=self.opt_dtype)
            wb = DTYPE_BITS[tr.weight_dtype] / 8
            per = 2.0 if opt == "adamw-8bit" else _STATE_ELEMS.get(opt, 0) * (
                DTYPE_BITS[tr.state_dtype] / 8)
            if tr.has_master_weights:
                per += 4.0
            self._bytes[key] = (wb, per, DTYPE_BITS[tr.compute_dtype] / 8)
        return self._bytes[key]

    def states(self, tp: int, pp: int, ep: int, dp: int, cp: int, stage: int,
               group: int | None, off: tuple[str, ...], prec: str, opt: str, ft: str | None
               ) -> tuple[float, float, float, float]:
        """Model-state bounds per rank, bytes: (first-stage weights + optimizer states,
        first-stage gradients, the smaller stage's weights, the larger stage's weights +
        gradients + optimizer states)."""
        if ft not in (None, "full", "none"):
            return 0.0, 0.0, 0.0, 0.0  # frozen or quantized weights: left to the engine
        wb, per, _ = self._per_param(prec, opt)
        layers = self.n_layer_dense / pp + self.n_exp / (pp * ep)
        if pp == 1:
            first = last = layers + self.emb + self.head
        else:
            first = layers + self.emb
            last = layers + self.head + (self.emb if self.tied else 0)
        shard = group or dp * cp  # the widest group that may shard (ZeRO over dp·cp)
        w_div = tp * (shard if stage >= 3 else 1)
        g_div = tp * (shard if stage >= 2 else 1)
        o_div = tp * (shard if stage >= 1 else 1)
        w_b = 0.0 if "params" in off else wb
        g_b = 0.0 if off else wb
        o_b = 0.0 if "optimizer" in off else per
        per_param = w_b / w_div + g_b / g_div + o_b / o_div
        return (first * (w_b / w_div + o_b / o_div), first * g_b / g_div,
                min(first, last) * w_b / w_div, max(first, last) * per_param)

    def model_states(self, c: _Cand) -> tuple[float, float]:
        """(weights of the smaller stage, weights + gradients + optimizer states of the
        larger)."""
        _, _, w_min, total = self.states(c.tp, c.pp, c.ep, c.dp, c.cp, c.stage, c.group, c.off,
                                         c.prec, c.opt, c.ft)
        return w_min, total

    def floor(self, tp: int, pp: int, cp: int, sp: bool, b: int, m: int, rec: str,
              prec: str) -> float:
        """Activation floor on the first pipeline stage, per layer and token: full recompute
        keeps the layer input (h); otherwise every matmul input a weight gradient needs:
        the attention and MLP inputs (2h, ÷tp under sequence parallelism), q, k, v and the
        attention output (2·a·d + 2·g·d, ÷tp) and the MLP down-projection input (f, ÷tp;
        not counted for MoE) — for each of the min(pp, m) micro-batches 1F1B keeps in flight
        there (Narayanan et al. 2021). Every profile saves at least these tensors."""
        spec = self.spec
        h = spec.hidden_size
        sp_div = tp if sp else 1
        if self.offload_acts and rec != "full":
            return 0.0
        if rec == "full":
            per_token = h / sp_div
        else:
            per_token = 2 * h / sp_div + self._sharded_inputs / tp
        tokens = min(pp, m) * b * (self.seq / cp)
        return (spec.num_hidden_layers / pp) * tokens * per_token * self._compute_bytes[prec]

    @staticmethod
    def act_key(c: _Cand) -> tuple:
        return (c.tp, c.pp, c.cp, c.ep, c.sp, c.sched, c.v, c.prec, c.ft)

    @staticmethod
    def states_key(c: _Cand) -> tuple:
        return (c.tp, c.pp, c.ep, c.dp, c.stage, c.group, c.off, c.prec, c.opt, c.ft)

    def learn(self, c: _Cand, report: MemoryReport) -> None:
        """Remember the optimizer-step total (it depends on the model states only) and the
        activations of an estimated candidate."""
        key = self.states_key(c)
        opt = float(report.phases.get("optimizer", 0))
        self.opt_phase[key] = max(self.opt_phase.get(key, 0.0), opt)
        if report.peak_phase not in ("forward", "backward"):
            return
        act = float(report.terms.activations + report.terms.logits)
        d = self.acts.setdefault(self.act_key(c), {})
        key = (c.b, _REC_ORDER[c.rec])
        d[key] = max(d.get(key, 0.0), act)

    def activations(self, c: _Cand) -> float:
        best = self.floor(c.tp, c.pp, c.cp, c.sp, c.b, c.m, c.rec, c.prec)
        d = self.acts.get(self.act_key(c))
        if d:
            rec = _REC_ORDER[c.rec]
            for (b, r), act in d.items():
                if b <= c.b and r >= rec:
                    best = max(best, act * (c.b / b if c.pp == 1 else 1.0))
        return best

    def total(self, c: _Cand) -> float:
        wo0, g0, w_min, ms = self.states(c.tp, c.pp, c.ep, c.dp, c.cp, c.stage, c.group,
                                         c.off, c.prec, c.opt, c.ft)
        ms = max(ms, self.opt_phase.get(self.states_key(c), 0.0))
        # end of forward on the first stage, steady state: weights, optimizer states,
        # gradients kept across micro-batches when accumulating, activations in flight
        fwd = wo0 + (g0 if c.m > 1 else 0.0) + self.floor(c.tp, c.pp, c.cp, c.sp, c.b, c.m,
                                                           c.rec, c.prec)
        return LOWER_BOUND_MARGIN * max(ms, fwd, w_min + self.activations(c))


# ---- scenario building ----------------------------------------------------------------------
def scenario_for(c: _Cand, base: Scenario) -> Scenario:
    """The Scenario of a candidate (validated by the engine's resolve_layout)."""
    from vramcalc.parallel import ParallelConfig

    upd: dict[str, Any] = {"recompute": c.rec, "micro_batch_size": c.b, "grad_accum": c.m,
                           "precision": c.prec, "optimizer": c.opt}
    if c.ft is not None:
        upd["finetune"] = c.ft
    training = base.training.model_copy(update=upd)  # the planner's own valid values
    parallel = ParallelConfig.model_construct(
        dp=c.dp, tp=c.tp, pp=c.pp, cp=c.cp, ep=c.ep, sequence_parallel=c.sp, zero=c.zero,
        fsdp=c.fsdp, shard_group=c.group, offload=c.off,  # type: ignore[arg-type]
        offload_device=base.parallel.offload_device,
        pp_schedule=c.sched, virtual_stages=c.v,  # type: ignore[arg-type]
        capacity_factor=base.parallel.capacity_factor)
    return base.model_copy(update={"training": training, "parallel": parallel}).resolved()


def _rank_key(e: PlanEntry, tail: tuple) -> tuple:
    return (-e.speed.tokens_per_s, len(e.changes), -(e.report.headroom_bytes or 0), tail)


# ---- search ---------------------------------------------------------------------------------
def search(base: Scenario, req: PlanRequest, progress: ProgressFn | None = None,
           want_closest: bool = True) -> PlanResult:
    """Best `req.top_n` strategies that fit on `base.cluster`, ranked (module docstring).

    Layout groups are expanded lazily, highest speed bound first: a group is expanded only
    while its bound is at least the speed of the best candidate waiting, so candidates are
    visited in exactly the order a full sort would give.
    """
    if base.cluster is None:
        raise InputError("plan needs --gpus (GPU type and count)")
    if req.top_n < 1:
        raise InputError(f"--top must be at least 1, got {req.top_n}")
    gpu = base.cluster.gpu
    usable = gpu.memory_total_bytes * (1 - base.headroom_fraction)
    context = gpu.context_overhead_bytes
    B = req.batch_for(base.training.seq_len)
    result = PlanResult(entries=[], closest=None, global_batch_size=B)
    bound = _Bound(base)
    en = _Enumerator(base, req, bound, (usable - context) / LOWER_BOUND_MARGIN)
    result.num_candidates = sum(en.count(g) for g in en.groups)
    if not result.num_candidates:
        raise InputError(
            f"no valid layout of {base.cluster.num_gpus} GPUs for a global batch of {B} "
            f"sequences{_pin_text(req.pinned)}: the data-parallel size must divide the batch "
            "(try a global batch that is a multiple of the GPU count)")
    groups = sorted(((en.upper_bound(g), i) for i, g in enumerate(en.groups)),
                    key=lambda t: (-t[0], t[1]))
    heap: list[tuple[tuple, _Cand]] = []
    seen: list[_Cand] = []
    gi = 0
    valid: dict[int, bool] = {}  # idx -> not refused by the engine (or dominated by such)
    fitting: list[tuple[tuple, PlanEntry]] = []
    estimated: list[tuple[PlanEntry, tuple]] = []
    while True:
        while gi < len(groups) and (not heap or groups[gi][0] >= heap[0][1].tps):
            for c in en.expand(en.groups[groups[gi][1]]):
                heapq.heappush(heap, ((-c.tps, c.nchg, c.tail(), c.idx), c))
                seen.append(c)
            gi += 1
            if progress is not None and gi % 16 == 0:
                progress("searching layouts", gi, len(groups))
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
        entry = _estimate(c, base, req)
        valid[c.idx] = entry is not None
        if entry is None:
            result.num_rejected += 1
            continue
        result.num_estimated += 1
        bound.learn(c, entry.report)
        estimated.append((entry, c.tail()))
        if entry.fits:
            fitting.append((_rank_key(entry, c.tail()), entry))
            fitting.sort(key=lambda t: t[0])
    result.num_bound_pruned += en.pruned
    result.num_expanded = len(seen)
    if progress is not None:
        progress("searching layouts", len(groups), len(groups))
    result.entries = [e for _, e in fitting[: req.top_n]]
    if not result.entries and want_closest:
        if en.pruned:  # the closest may be among the pruned: probe them all
            seen, _, _ = enumerate_candidates(base, req)
        result.closest = _closest(seen, bound, estimated, base, req)
    return result


def _pin_text(pinned: Mapping[str, Any]) -> str:
    items = [(k, v) for k, v in sorted(pinned.items()) if v is not None]
    if not items:
        return ""
    return " with " + ", ".join(f"{k}={v}" for k, v in items)


def _speed_model(base: Scenario, prec: str, ft: str | None,
                 efficiency: float | None) -> SpeedModel:
    """The speed model of the base scenario at precision `prec` and fine-tuning method `ft`
    (None: the base's)."""
    from vramcalc.speed import training_peft

    assert base.cluster is not None
    tr = base.training
    if ft is not None and ft != getattr(tr, "finetune", "full"):
        tr = tr.model_copy(update={"finetune": ft})
    tr = tr.model_copy(update={"precision": prec}) if prec != tr.precision else tr
    return SpeedModel(base.model, base.cluster.gpu, base.cluster.gpus_per_node, tr.seq_len,
                      prec, efficiency, base.parallel.capacity_factor,
                      training_peft(base.model, tr))


def _estimate(c: _Cand, base: Scenario, req: PlanRequest) -> PlanEntry | None:
    from vramcalc.analytic import estimate

    try:
        scn = scenario_for(c, base)
        rep = estimate(scn, every_stage=False)  # worst rank exact; `with_every_stage` for display
    except (InputError, ValueError):
        return None  # the engine's validation refuses this layout
    assert base.cluster is not None
    speed = _speed_model(base, c.prec, c.ft, req.efficiency).report(
        c.layout(base.parallel.offload_device))
    return PlanEntry(scenario=scn, report=rep, speed=speed, changes=c.changes)


def _closest(cands: list[_Cand], bound: _Bound, estimated: list[tuple[PlanEntry, tuple]],
             base: Scenario, req: PlanRequest, probes: int = 12) -> PlanEntry | None:
    """The estimated candidate with the smallest device total (also estimating the
    `probes` candidates with the smallest model-state bounds)."""
    pool = list(estimated)
    done = {tail for _, tail in estimated}
    order = sorted(cands, key=lambda c: (bound.model_states(c)[1], _REC_ORDER[c.rec], c.b,
                                         c.tail()))
    for c in order[:probes]:
        if c.tail() in done:
            continue
        e = _estimate(c, base, req)
        if e is not None:
            pool.append((e, c.tail()))
    if not pool:
        return None
    return min(pool, key=lambda t: (t[0].report.device_total_bytes, -t[0].speed.tokens_per_s,
                                    t[1]))[0]


def feasible(base: Scenario, req: PlanRequest, probes: int = 16) -> bool:
    """Quick check that some layout fits: estimate the most memory-frugal candidates
    (full recompute, smallest micro-batch, smallest model-state bound) until one fits."""
    if base.cluster is None:
        return False
    usable = base.cluster.gpu.memory_total_bytes * (1 - base.headroom_fraction)
    context = base.cluster.gpu.context_overhead_bytes
    bound = _Bound(base)
    try:
        cands, _, _ = enumerate_candidates(base, req, bound, (usable - context) /
                                           LOWER_BOUND_MARGIN)
    except InputError:
        return False
    scored = []
    for c in cands:
        ms = bound.model_states(c)[1]
        if LOWER_BOUND_MARGIN * ms + context <= usable:
            scored.append((-_REC_ORDER[c.rec], c.b, ms, c.tail(), c))
    scored.sort(key=lambda t: t[:4])
    for *_, c in scored[:probes]:
        if bound.total(c) + context > usable:
            continue
        e = _estimate(c, base, req)
        if e is not None and e.fits:
            return True
    return False


# ---- suggestions ----------------------------------------------------------------------------
def _cluster_text(num_gpus: int, gpu: GPUProfile) -> str | None:
    gpn = gpu.gpus_per_node
    name = gpu.aliases[0] if gpu.aliases else gpu.id
    if num_gpus <= gpn:
        return f"{num_gpus}x{name}"
    if num_gpus % gpn:
        return None
    return f"{num_gpus // gpn}x{gpn}x{name}"


def _with_cluster(base: Scenario, num_gpus: int, gpu: GPUProfile) -> Scenario | None:
    from vramcalc.hardware import Cluster

    gpn = gpu.gpus_per_node
    if num_gpus <= gpn:
        cl = Cluster.model_construct(gpu=gpu, num_nodes=1, gpus_per_node=num_gpus)
    elif num_gpus % gpn == 0:
        cl = Cluster.model_construct(gpu=gpu, num_nodes=num_gpus // gpn, gpus_per_node=gpn)
    else:
        return None
    return base.model_copy(update={"cluster": cl, "gpu_note": None})


def gpu_counts(start: int, gpn: int, limit: int) -> list[int]:
    """Counts tried when adding GPUs: doubling within a node, then doubling whole nodes."""
    out = []
    n = start * 2
    while n <= limit:
        if n <= gpn or n % gpn == 0:
            out.append(n)
        n *= 2
    if start < gpn and gpn not in out and gpn <= limit:
        out.append(gpn)
    return sorted(set(out))


def _best(base: Scenario, req: PlanRequest) -> PlanEntry | None:
    try:
        res = search(base, replace(req, top_n=1), want_closest=False)
    except InputError:
        return None
    return res.entries[0] if res.entries else None


def suggest_changes(base: Scenario, req: PlanRequest, profiles: Sequence[GPUProfile] = (),
                    progress: ProgressFn | None = None, max_gpus: int = 16384,
                    max_other_gpus: int = 3) -> list[Suggestion]:
    """The smallest changes that make the job fit, each with the best plan under it."""
    assert base.cluster is not None
    out: list[Suggestion] = []
    cl = base.cluster
    gpu = cl.gpu
    steps = ["gpus", "gpu type", "offload", "optimizer", "finetune", "sequence"]

    def tick(i: int) -> None:
        if progress is not None:
            progress(f"looking for changes that fit ({steps[i]})", i, len(steps))

    # 1. more GPUs of the same type
    tick(0)
    for n in gpu_counts(cl.num_gpus, gpu.gpus_per_node, max_gpus):
        scn = _with_cluster(base, n, gpu)
        if scn is None or not feasible(scn, req):
            continue
        entry = _best(scn, req)
        if entry is not None:
            text = _cluster_text(n, gpu)
            out.append(Suggestion("more_gpus", f"use {n} {gpu.name} GPUs instead of {cl.num_gpus}",
                                  {"gpus": text}, entry, {"num_gpus": n}))
            break
    # 2. another GPU type, same count
    tick(1)
    others = sorted((p for p in profiles if p.memory_total_bytes > gpu.memory_total_bytes
                     and p.id != gpu.id), key=lambda p: (p.memory_total_bytes, p.id))
    found = 0
    for p in others:
        if found >= max_other_gpus:
            break
        scn = _with_cluster(base, cl.num_gpus, p)
        if scn is None or not feasible(scn, req):
            continue
        entry = _best(scn, req)
        if entry is not None:
            found += 1
            out.append(Suggestion("other_gpu", f"use {cl.num_gpus} x {p.name}",
                                  {"gpus": _cluster_text(cl.num_gpus, p)}, entry,
                                  {"gpu": p.id, "num_gpus": cl.num_gpus}))
    # 3. offload to host RAM
    tick(2)
    if "offload" not in req.allow and "offload" not in req.pinned:
        for off in (("optimizer",), ("optimizer", "params")):
            r2 = replace(req, pinned={**req.pinned, "offload": off})
            if not feasible(base, r2):
                continue
            entry = _best(base, r2)
            if entry is not None:
                host = entry.report.host_bytes_per_node
                out.append(Suggestion(
                    "offload", f"offload {' and '.join(off)} to CPU RAM", {"offload": ",".join(off)},
                    entry, {"host_bytes_per_node": host}))
                break
    # 4. 8-bit optimizer
    tick(3)
    tr = base.training
    if tr.optimizer in ("adam", "adamw") and "optimizer" not in req.allow:
        scn = _retrain(base, optimizer="adamw-8bit")
        if scn is not None and feasible(scn, req):
            entry = _best(scn, req)
            if entry is not None:
                out.append(Suggestion("optimizer", "use 8-bit AdamW (bitsandbytes)",
                                      {"optimizer": "adamw-8bit"}, entry))
    # 5. LoRA / QLoRA, when the engine supports fine-tuning methods
    tick(4)
    choices = _finetune_choices()
    if choices and "finetune" not in req.allow:
        cur = getattr(tr, "finetune", None)
        for ft in choices:
            if ft == cur or ft in ("full", "none"):
                continue
            scn = _retrain(base, finetune=ft)
            if scn is not None and feasible(scn, req):
                entry = _best(scn, req)
                if entry is not None:
                    out.append(Suggestion("finetune", f"fine-tune with {ft}",
                                          {"finetune": ft}, entry))
                    break
    # 6. shorter sequence (largest power-of-two fraction that fits)
    tick(5)
    s = tr.seq_len // 2
    while s >= 128:
        scn = _retrain(base, seq_len=s)
        if scn is not None and feasible(scn, req):
            entry = _best(scn, req)
            if entry is not None:
                out.append(Suggestion("seq_len", f"train on sequences of {s} tokens",
                                      {"seq_len": s}, entry, {"seq_len": s}))
                break
        s //= 2
    if progress is not None:
        progress("done", len(steps), len(steps))
    return out


def _retrain(base: Scenario, **update: Any) -> Scenario | None:
    """`base` with these training values; None when one is out of its declared bounds."""
    from pydantic import ValidationError

    try:
        training = TrainingConfig(**{**base.training.model_dump(), **update})
    except ValidationError:
        return None
    return base.model_copy(update={"training": training})
