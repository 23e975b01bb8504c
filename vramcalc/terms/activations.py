"""Term: activations — tensors the forward pass saves for backward, per layer, per micro-batch.

The full-training tables (vramcalc/terms/saved_layers.py, legend in vramcalc/terms/saved.py)
composed with the rank's modifiers (vramcalc/terms/modifiers.py: fine-tuning, low
precision, activation offload, chunked cross entropy): each function here takes the plain
value and passes it through every modifier's hook, in order. The instants inside a layer
are in vramcalc/terms/moments.py; vramcalc/terms/profile.py gathers what the analytic
engine needs once per rank.
"""

from __future__ import annotations

from vramcalc.rank import RankContext
from vramcalc.terms import moments as mo
from vramcalc.terms import torchtitan as tt
from vramcalc.terms import torchtune as ttn
from vramcalc.terms.megatron_layer import megatron_layer_bytes
from vramcalc.terms.megatron_mtp import mtp_saved
from vramcalc.terms.megatron_recompute import LayerPlan, layer_plan
from vramcalc.terms.modifiers import modifiers
from vramcalc.terms.moe_instants import moe_combine_forward_bytes
from vramcalc.terms.saved import Moment, Saved, first_layer_moe, mostly_moe
from vramcalc.terms.saved_layers import (
    checkpoint_saved,
    embedding_saved,
    plain_head_saved,
    plain_layer_saved,
)


def without_recompute(ctx: RankContext) -> RankContext:
    """The same rank without activation recomputation (what a recomputed layer holds while
    its backward runs); memoised on the context."""
    if ctx.training.recompute == "none":
        return ctx
    plain = ctx.__dict__.get("_without_recompute")
    if plain is None:
        plain = ctx.__dict__["_without_recompute"] = RankContext(
            ctx.spec, ctx.training.model_copy(update={"recompute": "none"}), ctx.parallel,
            ctx.stage)
    return plain


# ---- per layer -------------------------------------------------------------------------
def layer_saved(ctx: RankContext, moe: bool | None = None) -> list[Saved]:
    """Saved tensors of one transformer layer for one micro-batch (reference/hf profiles):
    the full-training table, changed by each modifier's `layer_saved` hook; under full
    recompute the checkpoint's layer input alone (each modifier's `checkpoint_saved` hook).

    `moe` picks a dense or MoE layer; by default the kind most of this rank's layers are.
    Memoised per context (a profile asks for the same layer several times); callers get
    their own list.
    """
    if moe is None:
        moe = mostly_moe(ctx)
    memo = ctx.__dict__.setdefault("_layer_saved", {})
    if moe not in memo:
        memo[moe] = tuple(_layer_saved(ctx, moe))
    return list(memo[moe])


def _layer_saved(ctx: RankContext, moe: bool) -> list[Saved]:
    if ctx.training.framework == "torchtitan":  # vramcalc/terms/torchtitan.py
        return tt.layer_saved(ctx)
    if ctx.training.recompute == "full":
        kept = checkpoint_saved(ctx)
        for m in modifiers(ctx):  # DeepSpeed's partitioned / CPU checkpoints
            kept = m.checkpoint_saved(ctx, kept)
        return kept
    tune = ctx.training.framework == "torchtune"  # vramcalc/terms/torchtune.py
    out = ttn.plain_layer_saved(ctx, moe) if tune else plain_layer_saved(ctx, moe)
    for m in modifiers(ctx):
        out = m.layer_saved(ctx, out)
    return out


def layer_activation_bytes(ctx: RankContext, moe: bool | None = None) -> int:
    """Bytes one layer keeps for backward, one micro-batch, on this rank."""
    if ctx.training.framework == "megatron":
        return megatron_layer_bytes(ctx, mostly_moe(ctx) if moe is None else moe)
    return sum(t.nbytes for t in layer_saved(ctx, moe))


def recompute_plan(ctx: RankContext) -> LayerPlan | None:
    """The megatron profile's layers under Megatron-LM's --recompute-method: checkpointed
    ones keep their (b, s, h) input, the others Table 2's full set
    (vramcalc/terms/megatron_recompute.py); None otherwise (every layer alike)."""
    if ctx.training.framework == "torchtitan":  # per-layer SAC (--recompute-every)
        return tt.layer_plan(ctx, sum(t.nbytes for t in checkpoint_saved(ctx)),
                             sum(t.nbytes for t in layer_saved(without_recompute(ctx))))
    if ctx.training.framework != "megatron" or ctx.training.recompute_method is None:
        return None
    moe = mostly_moe(ctx)
    return layer_plan(ctx, megatron_layer_bytes(ctx, moe),
                      megatron_layer_bytes(without_recompute(ctx), moe))


def stage_layer_bytes(ctx: RankContext) -> tuple[int, int, int, int]:
    """(dense layers, bytes per dense layer, MoE layers, bytes per MoE layer) on this rank;
    dense layers come first (first_k_dense_replace)."""
    n_moe = ctx.shapes.num_moe_layers if ctx.spec.is_moe else 0
    n_dense = ctx.num_layers - n_moe
    dense = layer_activation_bytes(ctx, moe=False) if n_dense else 0
    moe = layer_activation_bytes(ctx, moe=True) if n_moe else 0
    return n_dense, dense, n_moe, moe


def layer_backward_moments(ctx: RankContext, moe: bool | None = None) -> list[Moment]:
    """The instants where one layer's backward can peak (vramcalc.terms.moments
    `plain_backward_moments`), changed by each modifier's `backward_moments` hook."""
    if moe is None:
        moe = mostly_moe(ctx)
    plain = without_recompute(ctx)
    saved = layer_saved(plain, moe)
    # before the attention core the layer holds its own saved set (selective: the core is
    # only recomputed when its backward comes; full: the whole layer is recomputed first)
    # (torchtitan: a checkpointed block is re-run whole before its backward starts)
    mlp_saved = saved if ctx.training.recompute == "full" or (
        ctx.training.framework == "torchtitan") else layer_saved(ctx, moe)
    out = mo.plain_backward_moments(ctx, moe, saved, mlp_saved)
    for m in modifiers(ctx):
        out = m.backward_moments(ctx, out, saved)
    return out


def layer_backward_working_bytes(ctx: RankContext) -> int:
    """Largest gradient-temporary set of one layer's backward (see `layer_backward_moments`)."""
    return max((m.work for m in layer_backward_moments(ctx)), default=0)


def layer_forward_working_bytes(ctx: RankContext, moe: bool) -> int:
    """Worst temporaries of the forward of one layer of a kind (`moe`: a MoE layer) beyond
    what the micro-batch's layers up to it save: the full-training value
    (vramcalc.terms.moments `plain_forward_working_bytes`) or a larger modifier's candidate
    (adapters' sums, QLoRA's dequantized weights, the FP8 / QAT down projection, the live
    tensors of a layer whose saved ones are in host memory)."""
    out = mo.plain_forward_working_bytes(ctx)
    mods = modifiers(ctx)
    saved = layer_saved(ctx, moe) if mods or moe else []
    if moe and ctx.training.framework != "hf" and ctx.training.recompute == "full":
        # no dense MLP in the layer: its checkpointed forward peaks in the combine
        out = moe_combine_forward_bytes(ctx, saved)
    elif moe:
        out = max(out, moe_combine_forward_bytes(ctx, saved))
    if mods:
        on_device = all(m.keeps_layers_on_device for m in mods)
        out = max([out] + [m.forward_working_bytes(ctx, saved, on_device, moe) for m in mods])
    return out


def eager_forward_moment(ctx: RankContext) -> tuple[int, int]:
    """Eager attention's softmax in forward (vramcalc.terms.moments); (0, 0) under flash."""
    if ctx.training.attention != "eager":
        return 0, 0
    return mo.eager_forward_moment(ctx, layer_saved(without_recompute(ctx), False))


def first_layer_gap(ctx: RankContext) -> int:
    """Bytes the first layer of the model keeps less than the others (a frozen embedding's
    output needs no gradient under fine-tuning); 0 without such a modifier."""
    mods = modifiers(ctx)
    if not mods:
        return 0
    saved = layer_saved(ctx, first_layer_moe(ctx))
    return sum(m.first_layer_gap(ctx, saved) for m in mods)


def resident_layer_bytes(ctx: RankContext) -> int | None:
    """Bytes of one layer's saved tensors left on the device when a modifier moves them off
    it (activation offload), else None."""
    mods = modifiers(ctx)
    saved = layer_saved(ctx) if mods else []
    for m in mods:
        kept = m.resident_layer_bytes(ctx, saved)
        if kept is not None:
            return kept
    return None


def activation_host_bytes(ctx: RankContext, in_flight: float = 1.0) -> int:
    """Host memory for the saved activations of `in_flight` micro-batches that a modifier
    moves off the device (0 without one)."""
    mods = modifiers(ctx)
    if not mods:
        return 0
    saved = layer_saved(ctx)
    return sum(m.host_bytes(ctx, saved, in_flight) for m in mods)


# ---- per micro-batch, outside the layers -----------------------------------------------
def head_side_bytes(ctx: RankContext) -> int:
    """The head's saved bytes on the device (some modifiers move part of them to the host)."""
    head = head_saved(ctx)
    return sum(t.nbytes for t in head) - sum(m.offloaded_head_bytes(ctx, head)
                                             for m in modifiers(ctx))


def head_saved(ctx: RankContext) -> list[Saved]:
    """Last stage: final norm input/statistics and the lm_head input, changed by each
    modifier's `head_saved` hook (a frozen lm_head, per-chunk inputs)."""
    if not ctx.is_last_stage:
        return []
    out = plain_head_saved(ctx)
    for m in modifiers(ctx):
        out = m.head_saved(ctx, out)
    return out + mtp_saved(ctx)


def microbatch_activation_bytes(ctx: RankContext) -> int:
    """Everything one micro-batch keeps for backward on this rank at the end of its forward:
    the stage's layers plus the embedding-side and head-side tensors."""
    edges = sum(t.nbytes for t in embedding_saved(ctx)) + head_side_bytes(ctx)
    resident = resident_layer_bytes(ctx)
    if resident is not None:
        # the rest is in host memory, the rotary tables and mask the layers saved included
        off_edges = sum(m.offloaded_edge_bytes(ctx) for m in modifiers(ctx))
        return ctx.num_layers * resident + edges - off_edges
    plan = recompute_plan(ctx)
    if plan is not None:
        return plan.bottom(ctx.num_layers) + edges
    n_dense, a_dense, n_moe, a_moe = stage_layer_bytes(ctx)
    return n_dense * a_dense + n_moe * a_moe + edges - first_layer_gap(ctx)
