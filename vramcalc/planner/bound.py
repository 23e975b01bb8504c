"""The planner's memory lower bound: bytes per GPU no estimate of a candidate can go below.

A candidate is pruned, without running the engine, when its bound plus the GPU's CUDA
context exceeds the usable memory. The bound must never exceed
`analytic.estimate(...).device_total_bytes` (tests/test_plan.py checks it over many
candidates), so pruning never drops a plan that fits.

Model states come from the engine's own term functions, per pipeline stage s the engine
may report as the worst (`analytic.candidate_stages`), on the candidate's `RankContext`:

    base_s = W_s + O_s + X_s
        W_s  weights (terms/weights.py `weight_parts`: the frozen base and the adapters under
             LoRA/QLoRA/DoRA, none when offloaded) + FP8/QAT persistent buffers
             (terms/lowprec.py `persistent_parts`)
        O_s  optimizer states + fp32 master (terms/optimizer_states.py
             `optimizer_state_split`: trained tensors only, sharded from ZeRO-1, none when
             offloaded)
        X_s  cuBLAS workspace + persistent communication buffers (terms/transients.py)
    step  = max_s (base_s + G_step,s)      the optimizer step (terms/gradients.py
                                           `gradients_at_step_bytes`)
    fwd   = base_0 + gather_0 + [m > 1 or persistent] · G_0 + 0.95 · A_floor
                                           the end of forward on the first stage
                                           (`gather_buffer_bytes`, `gradients_bytes`,
                                           `gradients_persistent`)
    act   = min_s base_s + 0.95 · A        A: the larger of the floor and what estimates of
                                           candidates with the same activation shapes taught
    bound = max(step, fwd, act)

Computed once per split of the layers over the stages, not per pipeline schedule (the
schedule reaches the model states only through how many layers and MoE layers each stage
holds, `sharding.pipeline_chunks`), and W_s, X_s, gradients and gather buffers once for
every optimizer (only O_s depends on it).

The activation floor counts, on the first stage, per layer and token, what every profile
saves: under full recompute, or LoRA/QLoRA/DoRA (frozen weights need no saved inputs), the
layer input (h, ÷tp under sequence parallelism); otherwise every input a weight gradient
needs: the attention and MLP inputs (2h, ÷tp under sequence parallelism), q, k, v and the
attention output ((a + g)·(d + dv), ÷tp: q a·d, k g·d, v g·dv, output a·dv, with dv = d but
under multi-latent attention, whose v heads are v_head_dim wide and whose q/k heads
qk_nope_head_dim + qk_rope_head_dim, g = a) and the MLP down-projection input (f, ÷tp; not
counted for MoE) — in the compute dtype (1 byte under FP8), for the min(pp, m) micro-batches 1F1B
keeps in flight there (Narayanan et al. 2021), over its L/pp layers (an uneven split's
first stage: the fewer of its 1F1B and interleaved counts; one fewer under
LoRA/QLoRA/DoRA, whose first layer keeps less: vramcalc/terms/first_layer.py
`first_layer_unsaved_bytes`); none with activation offload. The margin 0.95 (`LOWER_BOUND_MARGIN`) applies to the activation parts
only, the one formula here that is not the engine's.

Learned values: an estimate gives the optimizer-step total of its model states (a later
candidate with the same states has the same step) and its activations + logits (they do not
depend on ZeRO, offload or optimizer and grow with the micro-batch, linearly without
pipelining; reused for the same recompute mode only: under LoRA or activation offload more
recomputation can keep more on the device).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from vramcalc.analytic import candidate_stages
from vramcalc.errors import InputError
from vramcalc.parallel import ParallelConfig
from vramcalc.planner.candidates import (
    REC_ORDER,
    Candidate,
    StatesKey,
    parallel_for,
    training_for,
)
from vramcalc.planner.layouts import SPLIT_KEYS
from vramcalc.rank import RankContext
from vramcalc.report import MemoryReport
from vramcalc.scenario import Scenario
from vramcalc.sharding import chunk_layers, moe_layers_on_stage, pipeline_chunks
from vramcalc.terms.gradients import (
    gradients_at_step_bytes,
    gradients_bytes,
    gradients_persistent,
)
from vramcalc.terms.lowprec import check_lowprec
from vramcalc.terms.megatron_layer import local_attention_buffer_bytes
from vramcalc.terms.modifiers import persistent_parts
from vramcalc.terms.optimizer_states import optimizer_state_split
from vramcalc.terms.transients import (
    cublas_workspace_bytes,
    gather_buffer_bytes,
    persistent_buffer_bytes,
)
from vramcalc.terms.weights import weight_parts
from vramcalc.training import COMPUTE_DTYPE, TrainingConfig
from vramcalc.units import DTYPE_BITS

# Multiplier on the activation parts of the bound: a margin so that a small change in the
# engine's saved tensors can never prune a candidate that fits.
LOWER_BOUND_MARGIN = 0.95


class ModelStates(NamedTuple):
    """Model-state bytes of one candidate's settings (no micro-batch, no recompute)."""

    step: int  # max over stages of base + gradients at the optimizer step
    first: int  # first stage: base + gather buffers
    first_grads: int  # first stage: all gradients
    first_kept: bool  # first stage: the gradient buffer lives through forward
    base_min: int  # min over stages of base

    def forward(self, m: int) -> int:
        """First stage at the end of forward, less activations (m micro-batches per step)."""
        return self.first + (self.first_grads if m > 1 or self.first_kept else 0)


def states_key(c: Candidate) -> StatesKey:
    return (c.tp, c.pp, c.cp, c.ep, c.dp, c.sp, (c.zero, c.fsdp, c.group, c.stage), c.off,
            c.sched, c.v, c.prec, c.opt, c.ft)


_UNSEEN = object()  # states not computed yet (None means refused)


class MemoryBound:
    """Memory lower bounds of one search's candidates, in bytes per GPU (module docstring)."""

    def __init__(self, base: Scenario) -> None:
        spec = self.spec = base.model
        self.base = base
        self.gpu = base.cluster.gpu if base.cluster else None
        self.seq = base.training.seq_len
        # offloaded activations leave the device: no floor (vramcalc/terms/lowmem.py)
        self.offload_acts = base.training.activation_offload
        self.acts: dict[tuple, dict[tuple[int, int], float]] = {}
        self.opt_phase: dict[StatesKey, float] = {}
        self._states: dict[StatesKey, ModelStates | None] = {}
        self._shared: dict[tuple, ModelStates | None] = {}  # by stage split, not schedule
        self._helds: dict[tuple, list[tuple[int, tuple]]] = {}  # … and not optimizer
        self._group_states: dict[tuple, list[list]] = {}  # for `admitted`
        self._trainings: dict[tuple[str, str, str | None], TrainingConfig] = {}
        self._parallels: dict[tuple, ParallelConfig] = {}
        a, g, d = spec.num_attention_heads, spec.kv_heads, spec.head_size
        dv = spec.v_head_dim or d  # multi-latent attention: v heads dv wide, q/k heads d
        self._sharded_inputs = ((a + g) * (d + dv)
                                + (0 if spec.is_moe else spec.intermediate_size))
        self._compute_bytes: dict[str, float] = {}
        self._first_layers: dict[int, int] = {}

    # ---- model states, from the term functions ------------------------------------------
    def _training(self, prec: str, opt: str, ft: str | None) -> TrainingConfig:
        key = (prec, opt, ft)
        tr = self._trainings.get(key)
        if tr is None:
            tr = self._trainings[key] = training_for(self.base, prec, opt, ft)
        return tr

    def _held(self, ctx: RankContext) -> tuple[int, int, int, bool, int]:
        """(W_s + X_s, gradients, gradients at the step, gradients persistent, gather
        buffers): what the rank holds besides its optimizer states."""
        held = (sum(weight_parts(ctx).values()) + sum(persistent_parts(ctx, self.gpu).values())
                + cublas_workspace_bytes(self.gpu, ctx.training) + persistent_buffer_bytes(ctx)
                + local_attention_buffer_bytes(ctx))
        return (held, gradients_bytes(ctx), gradients_at_step_bytes(ctx),
                gradients_persistent(ctx), gather_buffer_bytes(ctx))

    def states(self, key: StatesKey) -> ModelStates | None:
        """Model states of these settings; None when the engine refuses them (the same
        checks and term functions raise as in `analytic.estimate`)."""
        hit = self._states.get(key, _UNSEEN)
        if hit is not _UNSEEN:
            return hit  # type: ignore[return-value]
        tp, pp, cp, ep, dp, sp, sharding, off, sched, v, prec, opt, ft = key
        layout = key[:10]  # the same layout under every training variant: built once
        parallel = self._parallels.get(layout)
        if parallel is None:
            parallel = self._parallels[layout] = parallel_for(
                self.base, dp, tp, pp, cp, ep, sp, sharding, off, sched, v)
        chunks = pipeline_chunks(self.spec, parallel)
        split = tuple((sum(row[st] for row in chunks),
                       moe_layers_on_stage(self.spec, chunks, st)) for st in range(pp))
        shared = (*key[:8], split, prec, opt, ft)  # the schedule only through `split`
        if shared not in self._shared:
            self._shared[shared] = self._compute(shared, self._training(prec, opt, ft),
                                                 parallel)
        out = self._states[key] = self._shared[shared]
        return out

    def _compute(self, shared: tuple, training: TrainingConfig, parallel: ParallelConfig
                 ) -> ModelStates | None:
        scn = self.base.model_copy(update={"training": training, "parallel": parallel})
        try:
            check_lowprec(scn)  # FP8 / QAT combinations the engine does not model
            held_key = shared[:-2] + shared[-1:]  # the same under every optimizer
            held = self._helds.get(held_key)
            if held is None:
                held = self._helds[held_key] = [
                    (st, self._held(RankContext(self.spec, training, parallel, st)))
                    for st in candidate_stages(scn)]
            rows = [(h[0] + sum(optimizer_state_split(
                RankContext(self.spec, training, parallel, st)).values()), *h[1:])
                for st, h in held]
        except (InputError, ValueError):
            return None
        first = rows[0]
        return ModelStates(step=max(r[0] + r[2] for r in rows), first=first[0] + first[4],
                           first_grads=first[1], first_kept=first[3],
                           base_min=min(r[0] for r in rows))

    # ---- activations ------------------------------------------------------------------------
    def floor(self, tp: int, pp: int, cp: int, sp: bool, b: int, m: int, rec: str, prec: str,
              ft: str | None = None) -> float:
        """Activation floor on the first pipeline stage, bytes (module docstring)."""
        if self.offload_acts and rec != "full":
            return 0.0
        spec = self.spec
        h = spec.hidden_size
        sp_div = tp if sp else 1
        if rec == "full" or ft not in (None, "full"):
            per_token = h / sp_div
        else:
            per_token = 2 * h / sp_div + self._sharded_inputs / tp
        layers = self._first_stage_layers(pp) - (0 if ft in (None, "full") else 1)
        tokens = min(pp, m) * b * (self.seq / cp)
        return layers * tokens * per_token * self._bytes_per_value(prec)

    def _first_stage_layers(self, pp: int) -> int:
        """Layers of the first pipeline stage: L/pp for an even split; for the base's uneven
        split (Megatron-LM's --decoder-first-pipeline-num-layers, ..., or --stage-layers) the
        fewest of its 1F1B and interleaved (v = 2) chunks (`sharding.chunk_layers`)."""
        hit = self._first_layers.get(pp)
        if hit is None:
            par, L = self.base.parallel, self.spec.num_hidden_layers
            if pp == 1 or not any(getattr(par, k) for k in SPLIT_KEYS):
                hit = L // pp
            else:  # a given --stage-layers fits one pipeline size and chunk count at most
                vs = [v for v in (1, 2) if par.stage_layers is None
                      or len(par.stage_layers) == pp * v]
                hit = max(0, min((sum(row[0] for row in chunk_layers(
                    L, pp, v, par.first_stage_layers, par.last_stage_layers,
                    par.embedding_in_split, par.loss_in_split, par.stage_layers))
                    for v in vs), default=0))
            self._first_layers[pp] = hit
        return hit

    def _bytes_per_value(self, prec: str) -> float:
        hit = self._compute_bytes.get(prec)
        if hit is None:
            # FP8 linears save 1-byte inputs (terms/lowprec.py)
            hit = 1.0 if prec == "fp8" else DTYPE_BITS[COMPUTE_DTYPE[prec]] / 8
            self._compute_bytes[prec] = hit
        return hit

    @staticmethod
    def act_key(c: Candidate) -> tuple:
        return (c.tp, c.pp, c.cp, c.ep, c.sp, c.sched, c.v, c.prec, c.ft)

    def activations(self, c: Candidate) -> float:
        """The larger of the floor and what estimates with the same shapes taught."""
        best = self.floor(c.tp, c.pp, c.cp, c.sp, c.b, c.m, c.rec, c.prec, c.ft)
        d = self.acts.get(self.act_key(c))
        if d:
            rec = REC_ORDER[c.rec]
            for (b, r), act in d.items():
                if b <= c.b and r == rec:
                    best = max(best, act * (c.b / b if c.pp == 1 else 1.0))
        return best

    def learn(self, c: Candidate, report: MemoryReport) -> None:
        """Remember the optimizer-step total (it depends on the model states only) and the
        activations of an estimated candidate."""
        key = states_key(c)
        opt = float(report.phases.get("optimizer", 0))
        self.opt_phase[key] = max(self.opt_phase.get(key, 0.0), opt)
        if report.peak_phase not in ("forward", "backward"):
            return
        act = float(report.terms.activations + report.terms.logits)
        d = self.acts.setdefault(self.act_key(c), {})
        k = (c.b, REC_ORDER[c.rec])
        d[k] = max(d.get(k, 0.0), act)

    # ---- the bound ----------------------------------------------------------------------------
    def admitted(self, g: tuple, shardings: list, pkey: tuple, sched: str, v: int, b: int,
                 m: int, rec: str, limit: float, variants: list) -> tuple[list[list], int, int]:
        """Per (sharding, offload) of layout group `g`, its `variants` (optimizer, …) at
        precision and fine-tuning method `pkey` whose model states and activation floor may
        fit in `limit` bytes; how many the engine refuses; how many the bound prunes. The
        states are looked up once per group, not per recompute mode and micro-batch."""
        tp, pp, cp, dp, sp, ep = g[:6]
        prec, ft = pkey
        sts = self._group_states.get((g[:6], pkey, sched, v))
        if sts is None:
            sts = self._group_states[(g[:6], pkey, sched, v)] = [
                [(var, self.states((tp, pp, cp, ep, dp, sp, sh, off, sched, v, prec, var[0],
                                    var[1]))) for var in variants] for sh, off in shardings]
        keeps, refused, pruned = [], 0, 0
        floor = None
        for var_states in sts:
            keep = []
            for var, st in var_states:
                if st is None:
                    refused += 1
                    continue
                if st.step <= limit:
                    if floor is None:
                        floor = LOWER_BOUND_MARGIN * self.floor(tp, pp, cp, sp, b, m, rec, prec,
                                                                ft)
                    if st.forward(m) + floor <= limit:
                        keep.append(var)
                        continue
                pruned += 1
            keeps.append(keep)
        return keeps, refused, pruned

    def total(self, c: Candidate) -> float:
        """The bound of a candidate (module docstring); infinite when the engine refuses it."""
        key = states_key(c)
        st = self.states(key)
        if st is None:
            return math.inf
        step = max(float(st.step), self.opt_phase.get(key, 0.0))
        floor = self.floor(c.tp, c.pp, c.cp, c.sp, c.b, c.m, c.rec, c.prec, c.ft)
        fwd = st.forward(c.m) + LOWER_BOUND_MARGIN * floor
        act = st.base_min + LOWER_BOUND_MARGIN * self.activations(c)
        return max(step, fwd, act)
