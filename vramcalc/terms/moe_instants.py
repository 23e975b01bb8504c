"""The reference MoE layer's instants (`vramcalc/trace/reference_model.py` `MoE.forward`,
which torchtune's profile runs too): index_add in forward, a checkpointed layer's first
forward and re-run, QLoRA's last 4-bit expert, and in backward the combine and the last
expert. docs/methodology.md §4, "The reference MoE layer's instants"; legend:
vramcalc/terms/saved.py.
"""

from __future__ import annotations

from vramcalc.qlora import dequant_backward_bytes, dequant_matmul_bytes
from vramcalc.rank import RankContext
from vramcalc.terms.saved import (
    Dims,
    Moment,
    Saved,
    dims,
    expert_capacity,
    qlora_fp32_outputs,
)
from vramcalc.units import alloc, ceil_div


def moe_combine_forward_bytes(ctx: RankContext, saved: list[Saved]) -> int:
    """The MoE layer's forward at `index_add`, above every tensor the layer saves: its zeros
    (T, h) and index_add's output (T, h), both in the weighted product's dtype r, beside
    the locals nothing saves (`moe_combine_locals`) and `caller_input_bytes`. `saved`: a
    MoE layer's saved list (empty without MoE layers); under full recompute, whose first
    forward saves nothing, the function's locals (`checkpointed_combine_bytes`, QLoRA's
    `last_expert_down_bytes`)."""
    tr = ctx.training
    if tr.framework == "hf":
        return 0
    if tr.recompute == "full":
        return max(checkpointed_combine_bytes(ctx), last_expert_down_bytes(ctx, [], True)[1])
    if not saved:
        return 0
    x = dims(ctx)
    return moe_combine_locals(ctx, saved) + alloc(x.T * x.h, x.r) + caller_input_bytes(ctx)


def checkpointed_combine_bytes(ctx: RankContext) -> int:
    """A checkpointed reference MoE layer's first forward at index_add: nothing is saved,
    and alive are the function's locals — the residual after attention and the normed
    input (T, h, r each), the router's softmax (T, E, fp32), the top-k weights and
    indices, the slot, token and fill indices and the routing weights (E·C), the gathered
    tokens, the experts' concatenated output and its weighted product (E·C, h each; the
    output in the experts' dtype), the zeros and index_add's output (T, h, r each). The
    experts' own intermediates went with each expert (nothing saves them)."""
    x = dims(ctx)
    spec = ctx.spec
    E, k = spec.num_local_experts, spec.num_experts_per_tok
    C = expert_capacity(ctx, x.T)
    EC = E * C
    ys = x.r if qlora_fp32_outputs(ctx, x) else x.c
    return (4 * alloc(x.T * x.h, x.r) + 2 * alloc(EC * x.h, x.r) + alloc(EC * x.h, ys)
            + _routing_bytes(x, E, k, EC))


def _routing_bytes(x: Dims, E: int, k: int, EC: int) -> int:
    """The router's locals: its softmax (T, E, fp32), the top-k weights (fp32) and indices
    (int64), the slot and token indices (E·C, int64), the fill mask (E·C, bool) and the
    routing weight per slot (E·C, r)."""
    return (alloc(x.T * E, "fp32") + alloc(x.T * k, "fp32") + alloc(x.T * k, "int64")
            + 2 * alloc(EC, "int64") + alloc(EC, "bool") + alloc(EC, x.r))


def last_expert_down_bytes(ctx: RankContext, saved: list[Saved], nosave: bool = False
                           ) -> tuple[int, int]:
    """(the layer's tensors saved so far, what else is alive) at the reference MoE's last
    expert's 4-bit down projection (QLoRA; 0s otherwise): the dequantized weight and its
    temporaries and the output (C, h) (vramcalc.qlora `dequant_matmul_bytes`; under
    autocast Linear4bit's 16-bit copy of its input and its output cast back to fp32),
    beside the other experts' outputs, not yet concatenated ((E − 1)·C rows of h), act·up
    (C, fe) when nothing saves it, and the locals of `moe_combine_locals` but the zeros.
    Everything the layer saves but the experts' output and its weighted product exists;
    in a checkpointed layer's first forward (`nosave`) nothing is saved and the routing
    tensors, the normed input and the residual are locals."""
    tr = ctx.training
    if tr.framework == "hf" or tr.finetune != "qlora" or not ctx.shapes.num_moe_layers:
        return 0, 0
    x = dims(ctx)
    spec = ctx.spec
    E, k = spec.num_local_experts, spec.num_experts_per_tok
    fe = ceil_div(spec.expert_ffn, ctx.parallel.expert_tp)
    C = expert_capacity(ctx, x.T)
    amp_4bit = qlora_fp32_outputs(ctx, x)
    ys = x.r if amp_4bit else x.c
    if amp_4bit:
        y_c = alloc(C * x.h, x.c)
        base = alloc(C * fe, x.c) + max(dequant_matmul_bytes(x.h * fe, x.c, tr.nf4, y_c),
                                        y_c + alloc(C * x.h, ys))
    else:
        base = dequant_matmul_bytes(x.h * fe, x.c, tr.nf4, alloc(C * x.h, ys))
    out = (E - 1) * alloc(C * x.h, ys) + base
    if nosave:
        return 0, out + alloc(C * fe, ys) + 2 * alloc(x.T * x.h, x.r) + alloc(
            E * C * x.h, x.r) + _routing_bytes(x, E, k, E * C)
    names = {t.name for t in saved}
    if "moe.expert.down_input" not in names:
        out += alloc(C * fe, ys)
    kept = sum(t.nbytes for t in saved if t.name not in ("moe.expert_output", "moe.weighted"))
    return kept, out + moe_combine_locals(ctx, saved) - alloc(x.T * x.h, x.r)


def moe_combine_locals(ctx: RankContext, saved: list[Saved]) -> int:
    """What is alive and unsaved in the reference MoE's forward once `ys · gate` exists and
    index_add is called, beyond the layer's saved tensors: the zeros index_add writes into
    (T, h, r), the tokens gathered per expert (E·C, h, r) when the experts keep only casts
    of them (autocast) or nothing (frozen experts), the normed input (T, h, r) when the
    router keeps only casts or nothing, and the residual after attention (T, h, r) when
    torchtune's norm keeps an fp32 copy of it instead. A checkpointed layer's re-run ends
    here: index_add's saved source is its last saved tensor. `saved`: the layer's saved
    list without recompute."""
    x = dims(ctx)
    EC = ctx.spec.num_local_experts * expert_capacity(ctx, x.T)
    names = {t.name for t in saved}
    out = alloc(x.T * x.h, x.r)
    if "moe.expert_input" not in names:
        out += alloc(EC * x.h, x.r)
    if "moe.input" not in names:
        out += alloc(x.T * x.h, x.r)
    if tune_norm_copies(ctx):
        out += alloc(x.T * x.h, x.r)
    return out


def caller_input_bytes(ctx: RankContext) -> int:
    """The layer's input, the caller's variable while the layer's forward runs: unsaved
    (so not counted with the layer's tensors) under torchtune's norms (fp32 copies)."""
    x = dims(ctx)
    return alloc(x.T * x.h, x.r) if tune_norm_copies(ctx) else 0


def tune_norm_copies(ctx: RankContext) -> bool:
    """torchtune's RMSNorm keeps an fp32 copy of a 16-bit input, not the input itself."""
    return ctx.training.framework == "torchtune" and dims(ctx).r != "fp32"


def last_expert_moment(ctx: RankContext, x: Dims, E: int, C: int, fe: int, held: int,
                        mlp_saved: list[Saved], g_res: int) -> Moment:
    """The reference MoE's last expert backward (the first expert: autograd runs the
    experts in reverse), at its down projection: the combine's backward has run (the
    weighted product and the experts' output are freed), dL/d ys (E·C, h) is alive until
    this last slice of it is consumed, the other E − 1 experts' dL/d their input slices
    (C, h each, in the input's dtype r: autocast's casts send fp32 gradients back) wait
    for the split's backward, and the down projection's MmBackward makes dL/d act·up
    (C, fe) and, for a trained expert, dL/dW_down (h, fe; cast to the gradient's dtype by
    the engine while both live). A 4-bit expert dequantizes its weight for dL/dx instead.
    Every other routed expert's gradients exist ("experts_but_one") and its own saved
    tensors are freed."""
    tr = ctx.training
    ys = next((t.dtype for t in mlp_saved if t.name == "moe.expert_output"), x.c)
    combined = sum(t.nbytes for t in mlp_saved if t.name in ("moe.weighted",
                                                             "moe.expert_output"))
    # the other experts' own saved tensors (one per expert) went with their backward
    own = sum(t.nbytes for t in mlp_saved if t.name.startswith(("moe.expert.",
                                                                 "moe.expert_input.cast")))
    dx = alloc(C * fe, ys)
    if tr.finetune == "qlora":
        down = dequant_backward_bytes(x.h * fe, x.c, tr.nf4, dx)
    elif tr.finetune == "full":
        g_dt = tr.grad_dtype
        down = dx + alloc(x.h * fe, x.c) + (alloc(x.h * fe, g_dt) if g_dt != x.c else 0)
    else:
        down = dx
    work = g_res + alloc(E * C * x.h, ys) + (E - 1) * alloc(C * x.h, x.r) + down
    return Moment("moe", held - combined - own * (E - 1) // E, work, "experts_but_one")


def combine_moment(x: Dims, slots: int, held: int, mlp_saved: list[Saved],
                    g_res: int, checkpointed: bool) -> Moment:
    """The combine's backward in the reference MoE (`index_add(0, token, ys · gate)`):
    IndexAddBackward has run (its source, the weighted product, is freed) and gathered
    dL/d source (E·C, h, the product's dtype r); MulBackward0 then makes dL/d ys = dL/d
    source · gate and dL/d gate = dL/d source · ys, both full (E·C, h) in the promoted
    dtype r, before the engine reduces the second to gate's (E·C, 1) and casts the first
    to ys' dtype (torch/csrc/autograd/engine.cpp `validate_outputs`, outputs in order).
    In a checkpointed layer MulBackward0 unpacked ys from the re-run's storage, and that
    copy dies when the node returns, before the cast: the cast takes ys' place."""
    weighted = sum(t.nbytes for t in mlp_saved if t.name == "moe.weighted")
    # ys is c, or r where 4-bit experts return their (fp32) input's dtype under autocast
    ys = next((t.dtype for t in mlp_saved if t.name == "moe.expert_output"), x.c)
    work = g_res + 3 * alloc(slots * x.h, x.r) + (
        alloc(slots * x.h, ys) if ys != x.r and not checkpointed else 0)
    return Moment("combine", held - weighted, work, "shared")
