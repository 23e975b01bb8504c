"""Everything the analytic engine needs of one rank's activations, logits and per-layer
transients, computed once per (model, training, layout, stage): the planner asks for the
same rank often."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.sharding import pipeline_chunks, stage_moe_mask
from vramcalc.terms import activations as act
from vramcalc.terms import liger, trl_loss
from vramcalc.terms import litgpt_loop as loop
from vramcalc.terms import logits as lg
from vramcalc.terms import model_locals as ml
from vramcalc.terms import moments as mo
from vramcalc.terms import transients as tr
from vramcalc.terms.megatron_recompute import LayerPlan
from vramcalc.terms.saved import Moment
from vramcalc.training import TrainingConfig


@dataclass(frozen=True)
class Profile:
    """Per-micro-batch activation quantities of one rank (bytes); see vramcalc.terms.activations,
    .moments, .logits and .transients."""

    n_dense: int
    dense_layer: int
    # whether each layer of the rank is a MoE layer, bottom to top (ModelSpec.is_moe_layer)
    moe_mask: tuple[bool, ...]
    n_moe: int
    moe_layer: int
    embedding_side: int  # ids, labels, rope tables, masks (embedding_saved)
    embedding_side_end: int  # what of it the embedding's backward still finds
    head_side: int  # final norm and lm_head input (head_saved)
    top_moments: tuple[Moment, ...]
    bottom_moments: tuple[Moment, ...]
    eager_forward: tuple[int, int]
    forward_work: int  # the top layer's kind's (MoE or dense)
    forward_end_extra: int
    final_norm_work: int
    head_freed_at_final_norm: int  # lm_head input and the norm's x̂ copy (hf)
    grad_fraction: dict[str, float]
    # a rank with dense and MoE layers: per kind (dense, MoE) its gradient relative to the
    # average layer's and its grad_fraction; None when its layers are of one kind
    kind_grads: tuple[tuple[float, dict[str, float]], ...] | None
    logits_keep: int
    logits_forward: int
    logits_backward: int
    logits_freed: int  # reserved beside the loss backward (terms/logits.py)
    head_forward_extra: int
    loss_root: int
    autocast_cache_layer: int  # vramcalc.terms.transients, cached here with the rest
    autocast_cache_head: int
    optimizer_step: int
    first_layer_gap: int  # what the model's first layer does not save (frozen embedding)
    resident_layer: int | None  # per layer on the device when saved tensors are offloaded
    # Megatron-LM's --recompute-method: layers keep different bytes (None: all alike)
    recompute_plan: LayerPlan | None = None
    # MoE layers interleaved with dense ones (ModelSpec.moe_layers): the topmost layer of the
    # kind the top layer is not (index from the top) and its backward moments; else (0, ())
    other_top: tuple[int, tuple[Moment, ...]] = (0, ())
    # … and the bottommost layer of the kind the bottom layer is not
    other_bottom: tuple[int, tuple[Moment, ...]] = (0, ())
    # a rank with both kinds: the topmost layer of the kind the top layer is not (index from
    # the top) and that kind's forward work; else (0, 0)
    other_forward: tuple[int, int] = (0, 0)
    # Liger's fused loss: the head weight casts at its forward peak (terms/liger.py)
    loss_forward_casts: int = 0
    loss_backward_casts: int = 0  # vramcalc.terms.trl_loss
    # LitGPT's loop (terms/litgpt_loop.py): the head's lists at the model's return (compute
    # dtype + fp32), and the previous micro-batch's fp32 list and held 4-bit inputs
    lit_returned: int = 0
    previous_graph: tuple[int, int] = (0, 0)

    def bottom(self, n: int) -> int:
        """Activations of the bottom n layers of this rank (per micro-batch), in layer order."""
        return sum(self.moe_layer if moe else self.dense_layer for moe in self.moe_mask[:n])

    def is_moe_from_top(self, i: int) -> bool:
        """Whether the i-th layer from the top (0-based) of this rank is a MoE layer."""
        return self.moe_mask[len(self.moe_mask) - 1 - i]

    def kind_share(self, i: int, part: str, full: bool) -> tuple[float, float]:
        """With dense and MoE layers (`kind_grads`): at instant `part` of the i-th layer from
        the top, the gradients made (the layers above, this one's share) and the autocast
        casts still held (this layer's rest; without full recompute also the layers
        below), in average layers, each layer counted by its kind's elements."""
        assert self.kind_grads is not None
        shares = [self.kind_grads[self.is_moe_from_top(j)][0] for j in range(len(self.moe_mask))]
        frac = self.kind_grads[self.is_moe_from_top(i)][1][part] * shares[i]
        return sum(shares[:i]) + frac, (shares[i] if full else sum(shares[i:])) - frac

    @property
    def layers(self) -> int:
        if self.recompute_plan is not None:
            return self.recompute_plan.bottom(self.n_dense + self.n_moe)
        return self.n_dense * self.dense_layer + self.n_moe * self.moe_layer


def profile(ctx: RankContext) -> Profile:
    """The activation profile of a rank (cached: the planner asks for the same one often)."""
    return _profile(ctx.spec, ctx.training, ctx.parallel, ctx.stage)


@lru_cache(maxsize=8192)
def _profile(spec: ModelSpec, training: TrainingConfig, parallel: ParallelConfig,
             stage: int) -> Profile:
    ctx = RankContext(spec, training, parallel, stage)
    lit = training.framework == "lightning" and ctx.is_last_stage
    n_dense, dense, n_moe, moe = act.stage_layer_bytes(ctx)
    mask = stage_moe_mask(spec, pipeline_chunks(spec, parallel), stage)
    top_moe, bottom_moe = bool(mask) and mask[-1], bool(mask) and mask[0]
    emb = act.embedding_saved(ctx)
    return Profile(
        n_dense=n_dense, dense_layer=dense, n_moe=n_moe, moe_layer=moe, moe_mask=mask,
        embedding_side=sum(t.nbytes for t in emb),
        # the layers' rotary tables and the checkpoints' mask and position ids go with the
        # first layer's backward (hf, reference: autograd and checkpoint hold them, no module)
        embedding_side_end=sum(t.nbytes for t in emb if not (
            training.framework in ("hf", "reference")
            and t.name in ("rope.cos_sin", "attn.mask", "position_ids"))),
        head_side=act.head_side_bytes(ctx),
        top_moments=tuple(act.layer_backward_moments(ctx, top_moe)) if ctx.num_layers else (),
        bottom_moments=tuple(act.layer_backward_moments(ctx, bottom_moe)) if ctx.num_layers
        else (),
        # (a layer's forward instants beside the model forward's own locals)
        eager_forward=_with_locals(act.eager_forward_moment(ctx), ml.embedding_locals_bytes(ctx)),
        forward_work=act.layer_forward_working_bytes(ctx, top_moe) + ml.work_locals_bytes(ctx),
        forward_end_extra=ml.forward_end_extra_bytes(ctx),
        final_norm_work=mo.final_norm_backward_work_bytes(ctx),
        head_freed_at_final_norm=sum(t.nbytes for t in act.head_saved(ctx) if t.name.startswith(
            ("lm_head.", "final_norm.xhat"))),
        grad_fraction={part: mo.layer_grad_fraction(ctx, part) for part in mo.GRAD_PARTS},
        kind_grads=_kind_grads(ctx),
        logits_keep=lg.logits_saved_bytes(ctx),
        logits_forward=lg.logits_forward_peak_bytes(ctx),
        logits_backward=lg.logits_backward_peak_bytes(ctx),
        logits_freed=lg.freed_logits_bytes(ctx),
        head_forward_extra=lg.head_forward_extra_bytes(ctx),
        loss_root=lg.loss_root_bytes(ctx),
        autocast_cache_layer=tr._autocast_cache_layer_bytes(ctx),
        autocast_cache_head=tr.autocast_cache_head_bytes(ctx),
        optimizer_step=tr._optimizer_step_temp_bytes(ctx),
        first_layer_gap=act.first_layer_gap(ctx),
        resident_layer=act.resident_layer_bytes(ctx),
        recompute_plan=act.recompute_plan(ctx),
        other_top=_other_top(ctx, mask),
        other_bottom=_other_bottom(ctx, mask),
        other_forward=_other_forward(ctx, mask),
        loss_forward_casts=liger.forward_cast_bytes(ctx) + (
            trl_loss.forward_parts(ctx)[1] if trl_loss.applies(ctx) else 0),
        loss_backward_casts=trl_loss.backward_parts(ctx)[1] if trl_loss.applies(ctx) else 0,
        lit_returned=max(sum(lg.lit_logits_lists(ctx)), lg.nf4_head_forward_bytes(ctx))
        if lit else 0,
        previous_graph=(loop.previous_logits_bytes(ctx), loop.previous_held_bytes(ctx)),
    )


def _kind_grads(ctx: RankContext) -> tuple[tuple[float, dict[str, float]], ...] | None:
    """Per layer kind (dense, MoE): its gradient relative to the average layer's and its
    parts' fractions, when the rank has layers of both kinds; else None."""
    shares = mo.kind_grad_shares(ctx)
    if shares is None:
        return None
    return tuple((share, {part: mo.layer_grad_fraction(ctx, part, moe)
                          for part in mo.GRAD_PARTS})
                 for moe, share in ((False, shares[0]), (True, shares[1])))


def _other_forward(ctx: RankContext, mask: tuple[bool, ...]) -> tuple[int, int]:
    """(index from the top, forward work) of the topmost layer whose kind differs from the
    top layer's (interleaved MoE, or dense layers below MoE ones); else (0, 0)."""
    n = len(mask)
    other = next((i for i in range(1, n) if mask[n - 1 - i] != mask[-1]), None)
    if other is None:
        return 0, 0
    return other, act.layer_forward_working_bytes(ctx, mask[n - 1 - other]) + (
        ml.work_locals_bytes(ctx))


def _with_locals(moment: tuple[int, int], local: int) -> tuple[int, int]:
    """An eager-attention forward moment (held, work) with the model forward's locals."""
    return (moment[0] + local, moment[1]) if moment[1] else moment


def _other_top(ctx: RankContext, mask: tuple[bool, ...]) -> tuple[int, tuple[Moment, ...]]:
    """(index from the top, backward moments) of the topmost layer whose kind (MoE or dense)
    differs from the top layer's, when the model interleaves them; else (0, ())."""
    n = len(mask)
    other = next((i for i in range(1, n - 1) if mask[n - 1 - i] != mask[-1]), None)
    if other is None or ctx.spec.moe_layers is None:
        return 0, ()
    return other, tuple(act.layer_backward_moments(ctx, mask[n - 1 - other]))


def _other_bottom(ctx: RankContext, mask: tuple[bool, ...]) -> tuple[int, tuple[Moment, ...]]:
    """(index from the top, backward moments) of the bottommost layer whose kind differs
    from the bottom layer's, when the model interleaves them; else (0, ()). An instant's
    bytes change by the same amount from one layer of a kind to the next of that kind
    (gradients made above, activations held below), so each kind peaks at its topmost or
    its bottommost layer."""
    n = len(mask)
    other = next((j for j in range(1, n - 1) if mask[j] != mask[0]), None)
    if other is None or ctx.spec.moe_layers is None:
        return 0, ()
    return n - 1 - other, tuple(act.layer_backward_moments(ctx, mask[other]))
