"""The fine-tuning modifier (LoRA / QLoRA / DoRA): the backward instants adapters change,
and the `Modifier` that applies vramcalc/terms/finetune_activations.py's saved-tensor
tables, forward working sets and QLoRA corrections to a layer (see that module's docstring
for the tables and their sources)."""

from __future__ import annotations

from vramcalc.features import finetunes
from vramcalc.finetune import shapes_for
from vramcalc.qlora import dequant_backward_bytes
from vramcalc.rank import RankContext
from vramcalc.terms.adapter_instants import (
    compiled_nf4,
    forward_working_bytes,
    recomputed_casts,
    rerun_pending_bytes,
    worst_forward_instant,
)
from vramcalc.terms.expert_lora import (
    checkpointed_experts_bytes,
    combine_instant_bytes,
    expert_moments,
)
from vramcalc.terms.finetune_activations import (
    _targets,
    adjust_head_saved,
    adjust_layer_saved,
    bnb_keeps_inputs,
    dora_weight_copies,
    dora_weight_copy_bytes,
    embedding_trained,
    held_4bit_inputs,
)
from vramcalc.terms.first_layer import first_layer_unsaved_bytes
from vramcalc.terms.moe_instants import (
    caller_input_bytes,
    last_expert_down_bytes,
    moe_combine_locals,
)
from vramcalc.terms.moments import checkpoint_input_extra
from vramcalc.terms.saved import (
    Modifier,
    Moment,
    Saved,
    dims,
    qlora_fp32_outputs,
    relu_output_is_down_input,
)
from vramcalc.units import alloc


# ---- backward moments --------------------------------------------------------------------
def adjust_moments(ctx: RankContext, moments: list[Moment], saved: list[Saved]
                   ) -> list[Moment]:
    """The full-fine-tuning backward instants of a layer (activations.layer_backward_moments)
    corrected for adapters, plus QLoRA's dequantization instant:

    - at the MLP instant the down adapter's backward has run: its tensors are freed;
    - at the attention-core instant the q/k/v adapters' tensors are still held (they go
      when the projections' backward runs, after the core's);
    - QLoRA, down projection: its adapter's backward runs first (its nodes were created
      last), then bitsandbytes dequantizes the weight (c) and computes dL/dx (T·f, c)
      while dL/d residual (T·h, r) is held and nothing else of the layer is freed."""
    x = dims(ctx)
    down = sum(t.nbytes for t in saved if t.name.startswith("lora.down."))
    qkv = sum(t.nbytes for t in saved if t.name.startswith(("lora.q.", "lora.k.", "lora.v.",
                                                             "lora.qkv.")))
    # a 2-matrix MLP with an adapted down projection: its input gets two gradients, the
    # adapter's and the base's, whose sum is a new tensor while both live (3·T·f in c)
    g_res = alloc(x.T * x.h, x.r)
    two = g_res + 3 * alloc(x.N * x.f, x.c) if ctx.spec.mlp_kind != "gated" and (
        "down" in _targets(ctx)) else 0
    casts = _recomputed_casts(ctx)
    out = []
    if ctx.training.recompute == "full":
        # the checkpointed layer's forward runs again before its backward, while dL/d its
        # output waits: the saved tensors made so far and the worst adapter's temporaries
        # (DoRA's weight-norm and combination ones, peft 0.21.2 tuners/lora/dora.py), as
        # in forward
        kept, rest = worst_forward_instant(ctx, saved, rerun=True)
        out.append(Moment("recompute", kept, g_res + rerun_pending_bytes(ctx) + rest, "none"))
        if ctx.training.framework != "hf" and any(m.name == "moe" for m in moments):
            # the reference MoE's re-run ends at index_add (moe_instants.moe_combine_locals):
            # every saved tensor of the layer and the frozen weights' casts exist again;
            # IndexAddBackward's unpack started it, so only dL/d the output waits
            rerun_held = checkpoint_input_extra(ctx) + moe_rerun_cast_bytes(ctx)
            out.append(Moment("recompute_moe", sum(t.nbytes for t in saved) + rerun_held,
                              g_res + moe_combine_locals(ctx, saved), "none"))
            kept, rest = last_expert_down_bytes(ctx, saved)
            if rest:  # QLoRA: the last expert's 4-bit down projection
                out.append(Moment("recompute_moe_down", kept + rerun_held, g_res + rest, "none"))
    for m in moments:
        if m.name == "moe":  # PEFT's adapters on the experts' parameters
            out += expert_moments(ctx, m.held, saved)
            m = Moment(m.name, m.held + casts.get("mlp", 0), m.work, m.grads)
        elif m.name == "mlp":
            held = m.held - down + casts.get("mlp", 0)
            if casts.get("down") and not down:
                # a frozen down projection's dL/dx matmul ends with its weight's cast still
                # held, beside dL/d its input, dL/d the MLP output and its 16-bit cast
                out.append(Moment("down_dx", held + casts["down"], g_res + alloc(
                    x.N * x.f, x.c) + (alloc(x.T * x.h, x.c) if x.r != x.c else 0), m.grads))
            m = Moment(m.name, held, max(m.work, two), m.grads)
        elif m.name == "attention":
            m = Moment(m.name, m.held + qkv + casts.get("attention", 0), m.work, m.grads)
        elif m.name == "post_norm":  # no attention projection's backward has run
            m = Moment(m.name, m.held + casts.get("post_norm", 0), m.work, m.grads)
        out.append(m)
    # a dense layer's 4-bit down projection (a MoE layer's experts: expert_moments)
    if ctx.training.finetune == "qlora" and not any(m.name == "moe" for m in moments):
        total = sum(t.nbytes for t in saved)
        dx = alloc(x.T * x.f, x.c)
        if compiled_nf4(ctx):  # down's kept dequantized weight is read by its dL/dx
            kept = sum(t.nbytes for t in saved if t.name == "lora.down.w_deq")
            out.append(Moment("dequant_down", total - down + kept, g_res + dx, "down"))
        else:
            # an adapted down projection's adapter ran its backward first: its dL/dx waits
            # to be summed with the base's, and the input its A matrix kept is gone unless
            # relu or an old 4-bit linear (bnb_keeps_inputs) keeps it too
            pending, freed = 0, 0
            amp_4bit = qlora_fp32_outputs(ctx, x)
            dx_in = alloc(x.T * x.f, x.r) if amp_4bit else dx
            if "down" in _targets(ctx):
                pending = dx_in
                if not (relu_output_is_down_input(ctx) or bnb_keeps_inputs(ctx)):
                    name = "mlp.down_input" if ctx.spec.mlp_kind == "gated" else "mlp.act"
                    freed = sum(t.nbytes for t in saved if t.name == name)
            work = dequant_backward_bytes(x.h * x.f, x.c, ctx.training.nf4, dx)
            if amp_4bit:
                # under autocast Linear4bit casts x to the compute dtype and its output back
                # to x's: their backwards cast dL/dy to it and dL/dx back (bitsandbytes
                # nn/modules.py Linear4bit.forward)
                work = max(work + alloc(x.T * x.h, x.c), dx + dx_in)
            out.append(Moment("dequant_down", total - down - freed, g_res + pending + work,
                              "down"))
    return out


def _recomputed_casts(ctx: RankContext) -> dict[str, int]:
    """The recomputed layer's weight casts (finetune_activations.recomputed_casts) and
    DoRA's weight copies its matmuls keep (`dora_weight_copies`) at the MLP instant, every
    one but down_proj's (its backward ran), at the attention core's the q, k and v ones
    (o's ran), at the post-attention norm's the attention's four."""
    casts = recomputed_casts(ctx)
    if ctx.training.recompute == "full":
        for t, b in dora_weight_copies(ctx).items():
            casts[t] = casts.get(t, 0) + b
    if not casts:
        return {}
    return {"mlp": sum(v for k, v in casts.items() if k != "down"),
            "attention": sum(v for k, v in casts.items() if k in ("q", "k", "v")),
            "post_norm": sum(v for k, v in casts.items() if k in ("q", "k", "v", "o")),
            "down": casts.get("down", 0)}


def dequantized_saved(ctx: RankContext) -> list[Saved]:
    """A compiled torchao QLoRA layer's dequantized bf16 weights, kept for the backward's
    dL/dx (vramcalc.qlora.compiled_dequant_kept), named after each linear's adapter group
    so that the backward instants free them after their dL/dx: o's and down's before the
    core's and the MLP's instants, q, k, v's after the core."""
    if not compiled_nf4(ctx):
        return []
    x = dims(ctx)
    out_in = {"q": (x.a * x.d, x.h), "k": (x.g * x.d, x.h), "v": (x.g * x.d, x.h),
              "o": (x.h, x.a * x.d), "gate": (x.f, x.h), "up": (x.f, x.h), "down": (x.h, x.f)}
    if ctx.spec.mlp_kind != "gated":
        del out_in["gate"]
    return [Saved(f"lora.{t}.w_deq", rows * cols, "bf16", "(out, in)",
                  "dequantized NF4 weight (compiled)") for t, (rows, cols) in out_in.items()]


def adapters_autocast_cache_bytes(ctx: RankContext) -> int:
    """Per-layer average of the 16-bit weight casts alive in forward under autocast: the
    trained fp32 adapters' (cached; 16-bit ones are not cast) and, unless layers are
    recomputed, the frozen fp32 linear weights' (saved by their matmuls for dL/dx; 16-bit
    ones, bf16-autocast, are not cast).
    NF4 weights are not cast; frozen biases' casts are not saved. The first layer's q/k/v
    casts and DoRA weight copies are not saved (no grad there) unless a trained embedding
    copy (modules_to_save) sends a gradient into it."""
    n = ctx.num_layers
    if not n:
        return 0
    # the first layer's q/k/v DoRA weight copies: their matmuls need no dL/dx there
    first = sum(v for t, v in dora_weight_copies(ctx).items() if t in ("q", "k", "v", "qkv")) if (
        ctx.is_first_stage and not embedding_trained(ctx.training)
        and ctx.training.recompute != "full") else 0
    if not ctx.training.runs_autocast:
        return (n * dora_weight_copy_bytes(ctx) - first) // n
    c = ctx.training.compute_dtype
    fs = shapes_for(ctx)
    total = n * dora_weight_copy_bytes(ctx) - first + sum(
        t.count * alloc(t.numel, c) for t in fs.adapters.tensors
        if t.group in ("layer", "expert") and t.rows and t.dtype != c)
    if ctx.training.recompute != "full" and ctx.training.is_autocast:
        frozen = [t for t in fs.frozen.tensors if t.group in ("layer", "expert") and t.rows
                  and t.name.endswith(".weight") and "norm" not in t.name]
        total += sum(t.count * alloc(t.numel, c) for t in frozen)
        if ctx.is_first_stage and not embedding_trained(ctx.training):
            total -= sum(alloc(t.numel, c) for t in frozen
                         if t.name in ("attn.q_proj.weight", "attn.k_proj.weight",
                                       "attn.v_proj.weight"))
    return max(total, 0) // n


def moe_rerun_cast_bytes(ctx: RankContext) -> int:
    """A MoE layer's frozen 16-bit casts in a LoRA/DoRA re-run under autocast: each frozen
    fp32 weight (attention, router, every expert; NF4 ones are dequantized, not cast) is
    cast again and saved by its matmul for dL/dx (autocast caches only weights that need
    a gradient). Per MoE layer: one of each attention and router matrix, E experts'."""
    tr = ctx.training
    if tr.recompute != "full" or not dims(ctx).amp or tr.finetune not in ("lora", "dora"):
        return 0
    n_moe = ctx.shapes.num_moe_layers
    if not n_moe or not ctx.num_layers:
        return 0
    out = 0
    for t in shapes_for(ctx).frozen.tensors:
        if (t.group not in ("layer", "expert") or not t.rows or "norm" in t.name
                or not t.name.endswith(".weight") or t.name.startswith("mlp.")):
            continue
        per_moe = t.name.startswith(("experts.", "router.", "shared_expert"))
        out += t.count // (n_moe if per_moe else ctx.num_layers) * alloc(
            t.numel, tr.compute_dtype)
    return out


class FinetuneActivations(Modifier):
    """LoRA / QLoRA / DoRA: frozen base, trained adapters (the functions above)."""

    name = "finetune"

    def applies(self, ctx: RankContext) -> bool:
        return finetunes(ctx.training)

    def layer_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        return adjust_layer_saved(ctx, saved) + dequantized_saved(ctx)

    def head_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        return adjust_head_saved(ctx, saved)

    def backward_moments(self, ctx: RankContext, moments: list[Moment],
                         saved: list[Saved]) -> list[Moment]:
        return adjust_moments(ctx, moments, saved)

    def forward_working_bytes(self, ctx: RankContext, saved: list[Saved],
                              layers_on_device: bool, moe: bool) -> int:
        """Adapters' sums and QLoRA's dequantized weights; in a MoE layer also the
        experts' instants; with the layers' saved tensors in host memory, the temporaries
        alone next to the residual (T·h, r)."""
        if layers_on_device:
            work = forward_working_bytes(ctx, saved, moe=moe)
            if not moe:
                return work
            kept, rest = last_expert_down_bytes(ctx, saved)  # (a checkpointed first
            # forward's: moe_instants.moe_combine_forward_bytes)
            down = kept + rest + caller_input_bytes(ctx) - sum(t.nbytes for t in saved) if (
                rest and ctx.training.recompute != "full") else 0
            return max(work, checkpointed_experts_bytes(ctx), combine_instant_bytes(ctx, saved),
                       down)
        x = dims(ctx)
        return alloc(x.T * x.h, x.r) + forward_working_bytes(ctx, saved, held=False, moe=moe)

    def checkpoint_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        """An old bitsandbytes release's held 4-bit inputs next to each checkpoint."""
        return saved + held_4bit_inputs(ctx)

    def first_layer_gap(self, ctx: RankContext, saved: list[Saved]) -> int:
        return first_layer_unsaved_bytes(ctx, saved)

    def autocast_cache_layer_bytes(self, ctx: RankContext, cache: int) -> int:
        """Frozen weights' casts replace full training's (`adapters_autocast_cache_bytes`)."""
        return adapters_autocast_cache_bytes(ctx)
