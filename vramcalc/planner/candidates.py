"""Candidate strategies of one plan search: every valid layout of the cluster with its speed.

A layout group is (tp, pp, cp, dp, sp, ep) with its micro-batch splits: tp within a node,
dividing the attention heads (and the KV heads, or a multiple of them); pp dividing the
layers; cp dividing the sequence (an even share per rank); dp the rest, dividing the global
batch; ep for MoE models, dividing the experts and dp·cp. A candidate adds the sharding
(ZeRO 0-3 without pipelining; ZeRO 0-1, FSDP shard-grad-op / full with it; FSDP hybrid within
a node), offload, recompute, a power-of-two micro-batch dividing the per-rank batch, 1F1B or
interleaved (v = 2) pipelines and — when allowed — precision, optimizer and fine-tuning
method. Sequence parallelism is on whenever tp > 1 (same traffic, never more memory).

Nothing the engine refuses is proposed: each (sharding, offload) is checked once per group
with the engine's `resolve_layout`, each changed training setup once per tp with its
`check_lowprec` and `check_finetune` (their one sharding-dependent refusal, FP8 with ZeRO-3 /
FSDP full, is caught per candidate by the bound). Speed comes from vramcalc.speed (plain
float arithmetic per candidate). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

from vramcalc.errors import InputError
from vramcalc.finetune import check_finetune
from vramcalc.hardware import GPUProfile
from vramcalc.parallel import ParallelConfig, resolve_layout
from vramcalc.planner.request import UNSUPPORTED, PlanRequest, recomputes_of
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario, capability_problem
from vramcalc.speed import Layout, SpeedModel, training_peft
from vramcalc.stack_rules import stack_training_problem
from vramcalc.terms.lowprec import check_lowprec
from vramcalc.training import FINETUNES, TrainingConfig

REC_ORDER = {"none": 0, "selective": 1, "full": 2}

Group = tuple  # (tp, pp, cp, dp, sp, ep, [(b, m, [(sched, v), ...]), ...])
Sharding = tuple[int, str, "int | None", int]  # (zero, fsdp, shard_group, shard_stage)
StatesKey = tuple  # (tp, pp, cp, ep, dp, sp, sharding, off, sched, v, prec, opt, ft)


class Candidate(NamedTuple):
    """One candidate strategy (plain tuple: a search builds hundreds of thousands)."""

    tps: float  # tokens/s
    nchg: int  # training settings changed from the request
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
                REC_ORDER[self.rec], self.b, self.sched, self.off, self.prec, self.opt,
                self.ft or "")

    def layout(self, offload_device: str) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                      sequence_parallel=self.sp, shard_stage=self.stage, shard_group=self.group,
                      micro_batch_size=self.b, num_microbatches=self.m, recompute=self.rec,
                      pp_schedule=self.sched, virtual_stages=self.v, offload=self.off,
                      offload_device=offload_device)


# ---- scenarios of candidates ---------------------------------------------------------------
def training_for(base: Scenario, prec: str, opt: str, ft: str | None,
                 update: Mapping[str, Any] | None = None) -> TrainingConfig:
    """The base's training settings with this precision, optimizer and fine-tuning method
    (None: the base's) and any further `update` (the planner's own valid values)."""
    upd: dict[str, Any] = {**(update or {}), "precision": prec, "optimizer": opt}
    if ft is not None:
        upd["finetune"] = ft
    return base.training.model_copy(update=upd)


def parallel_for(base: Scenario, dp: int, tp: int, pp: int, cp: int, ep: int, sp: bool,
                 sharding: Sharding, off: tuple[str, ...], sched: str = "1f1b",
                 v: int = 1) -> ParallelConfig:
    """The planner's ParallelConfig; keeps --etp, --fsdp-impl and the DeepSpeed keys."""
    zero, fsdp, group, _ = sharding
    return ParallelConfig.model_construct(
        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=base.parallel.etp, sequence_parallel=sp,
        zero=zero, fsdp=fsdp, shard_group=group, offload=off,  # type: ignore[arg-type]
        fsdp_impl=base.parallel.fsdp_impl if fsdp != "none" else None,
        offload_device=base.parallel.offload_device, deepspeed=base.parallel.deepspeed,
        pp_schedule=sched, virtual_stages=v,  # type: ignore[arg-type]
        capacity_factor=base.parallel.capacity_factor)


def scenario_for(c: Candidate, base: Scenario) -> Scenario:
    """The Scenario of a candidate (validated by the engine's resolve_layout)."""
    update: dict[str, Any] = {"recompute": c.rec, "micro_batch_size": c.b, "grad_accum": c.m}
    if c.rec != "selective" and base.training.recompute_every is not None:
        update["recompute_every"] = None  # torchtitan's per-layer SAC is a selective mode
    training = training_for(base, c.prec, c.opt, c.ft, update)
    parallel = parallel_for(base, c.dp, c.tp, c.pp, c.cp, c.ep, c.sp,
                            (c.zero, c.fsdp, c.group, c.stage), c.off, c.sched, c.v)
    return base.model_copy(update={"training": training, "parallel": parallel}).resolved()


def speed_model(base: Scenario, prec: str, ft: str | None,
                efficiency: float | None) -> SpeedModel:
    """The base scenario's speed model at precision `prec`, fine-tuning `ft` (None: base's)."""
    assert base.cluster is not None
    tr = base.training.model_copy(update={"finetune": ft or base.training.finetune,
                                          "precision": prec})
    return SpeedModel(base.model, base.cluster.gpu, base.cluster.gpus_per_node, tr.seq_len,
                      prec, efficiency, base.parallel.capacity_factor,
                      training_peft(base.model, tr), tr.selective_kind, tr.float8,
                      tr.target_len)


# ---- the search space ------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _pow2_upto(n: int) -> list[int]:
    return [1 << k for k in range(n.bit_length())] if n >= 1 else []


def finetune_supported() -> bool:
    """Whether `--allow finetune` has methods to search (vramcalc/finetune.py)."""
    return len(FINETUNES) > 1


def given(pinned: Mapping[str, Any], key: str) -> bool:
    return pinned.get(key) is not None


def _pick(pinned: Mapping[str, Any], key: str, values: Iterable[Any]) -> list[Any]:
    if given(pinned, key):
        return [v for v in values if v == pinned[key]]
    return list(values)


def _shardings(dp: int, cp: int, tp: int, pp: int, ep: int, gpn: int,
               pinned: Mapping[str, Any], fsdp_only: bool = False) -> list[Sharding]:
    """(zero, fsdp, shard_group, shard_stage) options for this data-parallel size.

    ZeRO 0-3 without pipelining; with pipelining ZeRO 0-1 and FSDP shard-grad-op / full
    (DeepSpeed runs ZeRO-2/3 without pipeline parallelism only; Megatron and torchtitan
    pipeline with a distributed optimizer or FSDP). FSDP hybrid shards within a node.
    """
    opts: list[Sharding] = [(0, "none", None, 0), (1, "none", None, 1)]  # dp 1: for offload
    if dp > 1:
        if pp == 1:  # torchtitan (fsdp_only): FSDP2 full; its ZeRO stages are refused
            opts += [(0, "full", None, 3)] if fsdp_only else [(2, "none", None, 2), (3, "none", None, 3)]
        else:
            opts += [(0, "grad-op", None, 2), (0, "full", None, 3)]
        per_node = gpn // (tp * cp) if tp * cp <= gpn else 0
        if 1 < per_node < dp and dp % per_node == 0 and per_node % ep == 0:
            opts.append((0, "hybrid", per_node, 3))
    if given(pinned, "fsdp") or given(pinned, "zero") or given(pinned, "shard_group"):
        f = pinned.get("fsdp") or "none"
        z = pinned.get("zero") or 0
        if f == "none":
            return [(z, "none", None, z)]
        stage = {"full": 3, "hybrid": 3, "grad-op": 2}[f]
        group = pinned.get("shard_group") if f == "hybrid" else None
        if f == "hybrid" and (not group or dp % group):
            return []
        return [(z, f, group, stage)]  # both pinned: the engine refuses ZeRO with FSDP
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


def variants(base: Scenario, req: PlanRequest, gpu: GPUProfile
             ) -> list[tuple[str, str, str | None, tuple[str, ...]]]:
    """(precision, optimizer, finetune, changed settings) combinations allowed."""
    tr = base.training
    precs: list[str] = [tr.precision]
    if "precision" in req.allow:
        extra: tuple[str, ...] = ("bf16", "bf16-pure") if gpu.peak_tflops("bf16") else ("fp16",)
        if gpu.peak_tflops("fp8"):  # FP8 tensor cores; what the engine refuses goes later
            extra += ("fp8",)
        precs = [p for p in precs + [x for x in extra if x not in precs]  # what the GPU runs
                 if not capability_problem(tr.model_copy(update={"precision": p}), gpu)]
    opts: list[str] = [tr.optimizer]
    if "optimizer" in req.allow and tr.optimizer in ("adam", "adamw"):
        opts.append("adamw-8bit")
    fts: list[str | None] = [tr.finetune]
    if "finetune" in req.allow:
        fts += [f for f in FINETUNES if f != tr.finetune]
    out: list[tuple[str, str, str | None, tuple[str, ...]]] = []
    for p in precs:
        for o in opts:
            for f in fts:
                changed = tuple(n for n, new, old in (("precision", p, tr.precision),
                                                     ("optimizer", o, tr.optimizer),
                                                     ("finetune", f, tr.finetune)) if new != old)
                out.append((p, o, f, changed))
    return out


def _layouts(base: Scenario, req: PlanRequest) -> Iterator[Group]:
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
    off_limits = UNSUPPORTED.get(tr.framework, (frozenset(), ""))[0]
    for tp in _pick(pinned, "tp", _divisors(min(gpn, W))):
        if W % tp or heads % tp or (kv % tp and tp % kv):
            continue
        for pp in _pick(pinned, "pp", _divisors(W // tp)):
            if L % pp or (pp > 1 and "pp" in off_limits):
                continue
            for cp in _pick(pinned, "cp", _divisors(W // (tp * pp))):
                if seq % cp or (cp > 1 and (seq // cp) % 2):
                    continue
                dp = W // (tp * pp * cp)
                if (given(pinned, "dp") and pinned["dp"] != dp) or B % dp:
                    continue
                sp_ok = tp > 1 and seq % (tp * cp) == 0
                if given(pinned, "sequence_parallel"):
                    sps = [pinned["sequence_parallel"]] if (
                        sp_ok or not pinned["sequence_parallel"]) else []
                else:
                    sps = [sp_ok]
                eps = [1]
                if spec.is_moe:
                    eps = [e for e in _divisors(spec.num_local_experts) if (dp * cp) % e == 0]
                eps = [e for e in _pick(pinned, "ep", eps) if e == 1 or "ep" not in off_limits]
                per_rank = B // dp
                if given(pinned, "micro_batch_size"):
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
                    if given(pinned, "pp_schedule"):
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


# ---- enumeration -------------------------------------------------------------------------------
class Pruner(Protocol):
    """What the enumerator asks of a memory bound (vramcalc/planner/bound.py `MemoryBound`):
    which variants of some settings may fit in `limit` bytes, and how many the engine
    refuses and the bound prunes."""

    def admitted(self, g: Group, shardings: list, pkey: tuple, sched: str, v: int, b: int,
                 m: int, rec: str, limit: float, variants: list) -> tuple[list[list], int, int]:
        ...


class Enumerator:
    """Candidates of one search, layout group by layout group (tp, pp, cp, dp, sp, ep).

    `count` sizes a group without computing anything, `upper_bound` caps the tokens/s of
    any candidate in it, `expand` lists its candidates with their speed — so the search can
    expand groups lazily, fastest bound first.

    With `pruner` and `limit_bytes`, candidates whose memory lower bound exceeds
    `limit_bytes` are counted in `pruned`, and those whose settings the engine refuses in
    `refused`; neither is returned.
    Dominance (off with `dominance=False`): each candidate lists in `dom` the candidates
    that differ only by a smaller micro-batch and are at least as fast; the search skips it
    once one of those turns out valid (activations grow with the micro-batch, so it would
    rank below that one). ZeRO stages are not assumed ordered: fixed communication buckets
    can make a higher stage use more memory on a small model.
    """

    def __init__(self, base: Scenario, req: PlanRequest, pruner: Pruner | None = None,
                 limit_bytes: float | None = None, dominance: bool = True) -> None:
        assert base.cluster is not None
        cl = base.cluster
        self.base, self.req, self.dominance = base, req, dominance
        self.pruner = pruner if limit_bytes is not None else None
        self.limit = limit_bytes if limit_bytes is not None else math.inf
        pinned = req.pinned
        self.recomputes = _pick(pinned, "recompute", recomputes_of(base.training.framework))
        self.allow_off = "offload" in req.allow
        self.zero_pinned = given(pinned, "zero")
        self.off_dev = base.parallel.offload_device
        # variants grouped by (precision, finetune): the speed model depends on both (a
        # frozen base skips its weight-gradient matmuls; vramcalc/speed.py)
        self.by_prec: dict[tuple[str, str | None], list[tuple[str, str | None,
                                                              tuple[str, ...]]]] = {}
        for prec, opt, ft, changed in variants(base, req, cl.gpu):
            self.by_prec.setdefault((prec, ft), []).append((opt, ft, changed))
        self.models = {k: speed_model(base, k[0], k[1], req.efficiency) for k in self.by_prec}
        self.groups = list(_layouts(base, req))
        self.next_idx = 0
        self.pruned = 0
        self.refused = 0
        self._valid: dict[int, dict[tuple[str, str | None], list]] = {}
        self._shardings: dict[tuple, list[tuple[Sharding, tuple[str, ...]]]] = {}

    def _accepted(self, tp: int, prec: str, opt: str, ft: str | None) -> bool:
        """Whether the engine accepts this training setup on `tp` unsharded ranks."""
        training = training_for(self.base, prec, opt, ft)
        parallel = ParallelConfig.model_construct(tp=tp)
        if stack_training_problem(training):
            return False  # a precision / optimizer / method the stack does not run
        try:
            check_lowprec(self.base.model_copy(update={"training": training,
                                                       "parallel": parallel}))
            if training.finetune != "full":
                check_finetune(RankContext(self.base.model, training, parallel))
        except InputError:
            return False
        return True

    def valid_variants(self, tp: int) -> dict[tuple[str, str | None], list]:
        """`by_prec` less the changed training setups the engine refuses at this tp (the
        request's own setup is kept: the engine then tells the user why)."""
        hit = self._valid.get(tp)
        if hit is None:
            hit = self._valid[tp] = {}
            for pkey, vlist in self.by_prec.items():
                keep = [var for var in vlist
                        if not var[2] or self._accepted(tp, pkey[0], var[0], var[1])]
                if keep:
                    hit[pkey] = keep
        return hit

    def shardings(self, g: Group) -> list[tuple[Sharding, tuple[str, ...]]]:
        """(sharding, offload) pairs of a group that `resolve_layout` accepts."""
        tp, pp, cp, dp, sp, ep, _ = g
        hit = self._shardings.get(g[:6])
        if hit is not None:
            return hit
        spec, training, cluster = self.base.model, self.base.training, self.base.cluster
        assert cluster is not None
        hit = []
        for sh in _shardings(dp, cp, tp, pp, ep, cluster.gpus_per_node, self.req.pinned,
                             training.framework == "torchtitan"):
            for off in _offloads(sh[3], self.allow_off, self.req.pinned):
                if dp == 1 and sh[0] == 1 and not off and not self.zero_pinned:
                    continue
                try:
                    resolve_layout(spec, training,
                                   parallel_for(self.base, dp, tp, pp, cp, ep, sp, sh, off),
                                   cluster.num_gpus)
                except InputError:
                    continue
                hit.append((sh, off))
        self._shardings[g[:6]] = hit
        return hit

    def count(self, g: Group) -> int:  # candidates in a group, none computed
        per_batch = sum(len(scheds) for _, _, scheds in g[6])
        num_variants = sum(len(v) for v in self.valid_variants(g[0]).values())
        return len(self.shardings(g)) * len(self.recomputes) * num_variants * per_batch

    def upper_bound(self, g: Group) -> float:
        """Tokens/s no candidate of the group exceeds: no recomputation, no data-parallel or
        offload time, the smallest bubble; TP, CP, EP and PP traffic per step does not
        depend on how the batch is split into micro-batches (PP: with v = 1)."""
        tp, pp, cp, dp, sp, ep, batches = g
        b, m, scheds = batches[0]  # smallest micro-batch: most micro-batches
        v_max = max(v for _, v in scheds)
        best = 0.0
        for pkey in self.valid_variants(tp):
            comp, _, ttp, tcp, tep, tpp, _, _ = self.models[pkey].base_parts(
                dp, tp, pp, cp, ep, sp, b, m, "none", 1)
            bubble = comp * (pp - 1) / (v_max * m)
            tokens = dp * b * m * self.base.training.seq_len
            best = max(best, tokens / (comp + bubble + ttp + tcp + tep + tpp))
        return best * (1 + 1e-9)

    def _admitted(self, g: Group, pkey: tuple, sched: str, v: int, b: int, m: int, rec: str,
                  vlist: list) -> list[list]:
        """Per (sharding, offload) of `g`, the variants of `vlist` the pruner admits."""
        assert self.pruner is not None
        keeps, refused, pruned = self.pruner.admitted(g, self.shardings(g), pkey, sched, v, b,
                                                      m, rec, self.limit, vlist)
        self.refused, self.pruned = self.refused + refused, self.pruned + pruned
        return keeps

    def expand(self, g: Group) -> list[Candidate]:
        tp, pp, cp, dp, sp, ep, batches = g
        seq = self.base.training.seq_len
        shardings = self.shardings(g)
        out: list[Candidate] = []
        for rec in self.recomputes:
            for pkey, vlist in self.valid_variants(tp).items():
                sm = self.models[pkey]
                prec = pkey[0]
                smaller: dict[tuple, list[tuple[int, float]]] = {}  # key -> [(b, tps)]
                index: dict[tuple, int] = {}  # (b, key, opt, ft) -> idx
                for b, m, scheds in batches:
                    tokens = dp * b * m * seq
                    row: list[tuple[tuple, float, list]] = []
                    for sched, v in scheds:
                        comp, bub, ttp, tcp, tep, tpp, t_fwd, t_bwd = sm.base_parts(
                            dp, tp, pp, cp, ep, sp, b, m, rec, v)
                        fixed = comp + bub + ttp + tcp + tep + tpp
                        keeps = [vlist] * len(shardings) if self.pruner is None else (
                            self._admitted(g, pkey, sched, v, b, m, rec, vlist))
                        for (sh, off), keep_v in zip(shardings, keeps, strict=True):
                            if not keep_v:
                                continue
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
                            dom = tuple(i for bb in bdoms
                                        if (i := index.get((bb, key, opt, ft))) is not None)
                            idx = self.next_idx
                            self.next_idx += 1
                            index[(b, key, opt, ft)] = idx
                            out.append(Candidate(tps, len(changed), tp, pp, cp, ep, sp, dp, b,
                                                 m, rec, sched, v, zero, fsdp, group, stage,
                                                 off, prec, opt, ft, changed, idx, dom))
                    for key, tps, _ in row:
                        smaller.setdefault(key, []).append((b, tps))
        return out


def enumerate_candidates(base: Scenario, req: PlanRequest, pruner: Pruner | None = None,
                         limit_bytes: float | None = None, dominance: bool = True,
                         ) -> tuple[list[Candidate], int, int]:
    """Every valid candidate on `base.cluster` with its tokens/s (see Enumerator).

    Returns (candidates, valid candidates enumerated, pruned by the bound); each
    candidate's `idx` is its position in the list.
    """
    en = Enumerator(base, req, pruner, limit_bytes, dominance)
    out: list[Candidate] = []
    for g in en.groups:
        out += en.expand(g)
    return out, sum(en.count(g) for g in en.groups), en.pruned
