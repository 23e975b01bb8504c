"""Candidate strategies of one plan search: every valid layout of the cluster with its speed.

The layout groups (tp, pp, cp, dp, sp, ep) with their micro-batch splits come from
vramcalc/planner/layouts.py. A candidate adds the sharding
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
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from vramcalc.errors import InputError
from vramcalc.finetune import check_finetune
from vramcalc.hf_stack import reduces_once
from vramcalc.parallel import ParallelConfig, resolve_layout
from vramcalc.planner.layouts import (
    SPLIT_KEYS,
    Group,
    Sharding,
    given,
    layouts,
    mla_refusal,
    offload_options,
    pick,
    sharding_options,
    variants,
)
from vramcalc.planner.request import PlanRequest, recomputes_of
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.speed import Layout, SpeedModel, training_peft
from vramcalc.stack_rules import stack_training_problem
from vramcalc.terms.lowprec import check_lowprec
from vramcalc.training import TrainingConfig

REC_ORDER = {"none": 0, "selective": 1, "full": 2}
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
    upd: dict[str, Any] = {**(update or {}), **precision_update(base.training, prec),
                           "optimizer": opt}
    if ft is not None:
        upd["finetune"] = ft
    return base.training.model_copy(update=upd)


def precision_update(tr: TrainingConfig, prec: str) -> dict[str, Any]:
    """The training settings of precision `prec`: torchtitan trains in FP8 only through
    torchao's Float8Linear under torch.compile, on FSDP2's bf16 mixed precision (float8.py
    `Float8Handler`; the engine's --float8 needs --compile and amp-bf16), so its "fp8" is
    amp-bf16 with --float8 --compile."""
    if prec == "fp8" and tr.framework == "torchtitan":
        return {"precision": "amp-bf16", "float8": True, "compile": True}
    return {"precision": prec}


def parallel_for(base: Scenario, dp: int, tp: int, pp: int, cp: int, ep: int, sp: bool,
                 sharding: Sharding, off: tuple[str, ...], sched: str = "1f1b",
                 v: int = 1) -> ParallelConfig:
    """The planner's ParallelConfig; keeps --etp, --fsdp-impl, --fsdp-edge-units (FSDP
    layouts), --mtp-layers, an uneven pipeline split (layouts.py SPLIT_KEYS) and the
    DeepSpeed keys."""
    zero, fsdp, group, _ = sharding
    return ParallelConfig.model_construct(
        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=base.parallel.etp, sequence_parallel=sp,
        zero=zero, fsdp=fsdp, shard_group=group, offload=off,  # type: ignore[arg-type]
        fsdp_impl=base.parallel.fsdp_impl if fsdp != "none" else None,
        fsdp_edge_units=base.parallel.fsdp_edge_units and fsdp != "none",
        offload_device=base.parallel.offload_device, deepspeed=base.parallel.deepspeed,
        pp_schedule=sched, virtual_stages=v,  # type: ignore[arg-type]
        capacity_factor=base.parallel.capacity_factor, mtp_layers=base.parallel.mtp_layers,
        **{k: getattr(base.parallel, k) for k in SPLIT_KEYS})


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
    tr = base.training
    if ft is not None and ft != tr.finetune:
        tr = tr.model_copy(update={"finetune": ft})
    tr = tr.model_copy(update=precision_update(tr, prec)) if prec != tr.precision else tr
    return SpeedModel(base.model, base.cluster.gpu, base.cluster.gpus_per_node, tr.seq_len,
                      tr.precision, efficiency, base.parallel.capacity_factor,
                      training_peft(base.model, tr), tr.selective_kind, tr.float8,
                      base.parallel.mtp_layers, tr.target_len,
                      tr.float8 and tr.float8_all_gather)


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
        self.recomputes = pick(pinned, "recompute", recomputes_of(base.training.framework))
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
        self.groups = list(layouts(base, req))
        self.next_idx = 0
        self.pruned = 0
        self.refused = 0
        self._valid: dict[int, dict[tuple[str, str | None], list]] = {}
        self._shardings: dict[tuple, list[tuple[Sharding, tuple[str, ...]]]] = {}

    def _accepted(self, tp: int, prec: str, opt: str, ft: str | None) -> bool:
        """Whether the engine accepts this training setup on `tp` unsharded ranks."""
        training = training_for(self.base, prec, opt, ft)
        parallel = ParallelConfig.model_construct(tp=tp)
        if stack_training_problem(training) or mla_refusal(self.base, tp, 1, training):
            return False  # a precision / optimizer / method the stack (or its MLA) does not run
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
        for sh in sharding_options(dp, cp, tp, pp, ep, cluster.gpus_per_node, self.req.pinned,
                             training.framework in ("torchtitan", "torchtune")):
            for off in offload_options(sh[3], self.allow_off, self.req.pinned):
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

    def upper_bound(self, g: Group, pkey: tuple[str, str | None]) -> float:
        """Tokens/s no candidate of the group at precision and fine-tuning method `pkey`
        exceeds: no recomputation, no data-parallel or offload time, the smallest bubble;
        TP, CP, EP and PP traffic per step does not depend on how the batch is split into
        micro-batches (PP: with v = 1)."""
        tp, pp, cp, dp, sp, ep, batches = g
        b, m, scheds = batches[0]  # smallest micro-batch: most micro-batches
        v_max = max(v for _, v in scheds)
        comp, _, ttp, tcp, tep, tpp, _, _ = self.models[pkey].base_parts(
            dp, tp, pp, cp, ep, sp, b, m, "none", 1)
        bubble = comp * (pp - 1) / (v_max * m)
        tokens = dp * b * m * self.base.training.seq_len
        return tokens / (comp + bubble + ttp + tcp + tep + tpp) * (1 + 1e-9)

    def _admitted(self, g: Group, pkey: tuple, sched: str, v: int, b: int, m: int, rec: str,
                  vlist: list) -> list[list]:
        """Per (sharding, offload) of `g`, the variants of `vlist` the pruner admits."""
        assert self.pruner is not None
        keeps, refused, pruned = self.pruner.admitted(g, self.shardings(g), pkey, sched, v, b,
                                                      m, rec, self.limit, vlist)
        self.refused, self.pruned = self.refused + refused, self.pruned + pruned
        return keeps

    def expand(self, g: Group, only: tuple[str, str | None] | None = None,
               recompute: str | None = None) -> list[Candidate]:
        """The group's candidates with their speed (`only`: those at this precision and
        fine-tuning method; `recompute`: those with this recompute mode)."""
        tp, pp, cp, dp, sp, ep, batches = g
        seq = self.base.training.seq_len
        shardings = self.shardings(g)
        out: list[Candidate] = []
        for rec in self.recomputes:
            if recompute is not None and rec != recompute:
                continue
            for pkey, vlist in self.valid_variants(tp).items():
                if only is not None and pkey != only:
                    continue
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
                            once = reduces_once(self.base.training, sh[1], m)
                            tdp, toff = sm.sharding_parts(dp, tp, pp, cp, ep, m, sh[3], sh[2],
                                                          off, self.off_dev, t_fwd, t_bwd,
                                                          once)
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
