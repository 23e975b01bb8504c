"""transformers' model-level locals: what the model's forward keeps bound beside the layers'
saved tensors (the embedding output, GPT-2's position embeddings, the last residual and the
eager attention's additive mask) at a layer's forward instants and at the final norm."""

from __future__ import annotations

from vramcalc.features import finetunes
from vramcalc.rank import RankContext
from vramcalc.terms.saved import bsh, dims, hf_family
from vramcalc.units import alloc


def embedding_locals_bytes(ctx: RankContext) -> int:
    """transformers' models with learned positions (GPT-2's `GPT2Model.forward`) bind the
    token and the position embeddings in locals beside their sum, the first layer's input,
    until the model's forward returns: they exist at every layer's forward instant (first
    stage). The rotary decoders (`LlamaModel.forward`: `hidden_states = inputs_embeds`) keep
    the embedding output, the first layer's input, bound likewise; a 16-bit one is no saved
    tensor (the first RMSNorm keeps an fp32 copy), an fp32 one is that norm's input, and a
    checkpointed first layer keeps it as its input. Under PEFT the frozen embedding's output
    needs no gradient, so the first layer keeps nothing of it: a local in any dtype."""
    if ctx.training.framework != "hf" or ctx.spec.is_encoder or not ctx.is_first_stage:
        return 0
    x = dims(ctx)
    if ctx.spec.position_embedding == "learned":
        return alloc(bsh(x), x.r) + alloc(x.s * x.h, x.r)
    if ctx.training.recompute == "full":
        return 0
    if finetunes(ctx.training):  # a frozen embedding's output: the first layer keeps none of it
        return alloc(bsh(x), x.r)
    return alloc(bsh(x), x.r) if ctx.spec.norm_kind == "rmsnorm" and x.r != "fp32" else 0


def work_locals_bytes(ctx: RankContext) -> int:
    """`embedding_locals_bytes` beside a layer's forward work, where the adapters' instants
    (vramcalc/terms/adapter_instants.py `worst_forward_instant`) do not count a rotary
    model's `inputs_embeds` already."""
    if finetunes(ctx.training) and ctx.spec.position_embedding != "learned":
        return 0
    return embedding_locals_bytes(ctx)


def forward_end_extra_bytes(ctx: RankContext) -> int:
    """Beyond the saved tensors, while the final norm runs (last stage): transformers keeps
    the embedding output (and GPT-2's position embeddings) and the last residual in locals
    of the model's forward, its RMSNorm makes an fp32 x̂ before the cast (both only when the
    residual is 16-bit), and eager attention's additive mask lives until the model returns."""
    if not ctx.is_last_stage or ctx.training.framework != "hf" or ctx.spec.is_encoder:
        return 0
    x = dims(ctx)
    extra = 0
    if ctx.spec.norm_kind == "layernorm":
        extra += alloc(bsh(x), x.r)  # inputs_embeds next to inputs_embeds + positions
        if ctx.is_first_stage and ctx.spec.position_embedding == "learned":
            extra += alloc(x.s * x.h, x.r)
    elif x.r != "fp32" and ctx.training.liger:
        # LigerRMSNorm keeps the last residual and makes its output Y: no fp32 x̂
        extra += 2 * alloc(bsh(x), x.r)
    elif x.r != "fp32":
        extra += 2 * alloc(bsh(x), x.r) + alloc(bsh(x), "fp32")
        if hf_family(ctx) == "gemma":
            extra += alloc(bsh(x), "fp32")  # its fp32 x̂ is saved; the product is fp32 too
    if ctx.training.attention == "eager" and ctx.training.recompute == "none":
        extra += alloc(x.b * x.s * x.s, x.r)
    return extra
