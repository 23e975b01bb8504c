"""The first layer of the first stage under a PEFT method: autograd records an op only when
one of its inputs requires grad, and the frozen embedding's output does not. Nothing before
the layer's first adapter records a tensor, and after it an op keeps only what the
gradients of its grad-requiring inputs read (torch's saved-tensor rule: `mul` keeps b for
dL/da only when a requires grad). The trace engine referees it: transformers' and the
reference model's layers keep exactly that on fake tensors.
"""

from __future__ import annotations

from vramcalc.rank import RankContext
from vramcalc.terms.expert_lora import wrapped
from vramcalc.terms.finetune_activations import (
    _DROP_QKV,
    _QKV,
    _covers,
    _targets,
    adapter_saved,
    bnb_keeps_inputs,
    embedding_trained,
)
from vramcalc.terms.fsdp1 import mixed_units
from vramcalc.terms.saved import Saved, dims


def first_layer_unsaved_bytes(ctx: RankContext, saved: list[Saved]) -> int:
    """Bytes the first layer of the first stage does not keep because its input (the frozen
    embedding's output) needs no gradient: its input norm's tensors, the q/k/v adapters'
    dropout masks, eager attention's q (k) copy when k (q) has no adapter, and, when no q/k/v
    is adapted, the attention core's and what `_before_the_first_adapter` lists (a 2-matrix
    or MoE MLP is counted as in the other layers: docs/finetuning.md).
    `saved`: the first layer's saved list."""
    if not ctx.is_first_stage or not ctx.num_layers or (
            embedding_trained(ctx.training)):  # the embedding's output needs a gradient
        return 0
    if mixed_units(ctx):  # FSDP1: the block's weights get gradients; only the masks go
        return sum(t.nbytes for t in saved if t.name.endswith(".dropout_mask")
                   and t.name.startswith(("lora.q", "lora.k", "lora.v")))
    if ctx.training.recompute == "full":
        # only an old release's 4-bit q/k/v inputs, not held here — except under PEFT with
        # checkpointing, which makes the embedding output require grad (peft 0.21.2
        # peft_model.py `_prepare_model_for_gradient_checkpointing`: enable_input_require_grads)
        held = bnb_keeps_inputs(ctx) and ctx.training.framework == "reference"
        return sum(t.nbytes for t in saved if t.name in _DROP_QKV) if held else 0
    # the input norm, and dropout masks on its output (no grad flows into the dropout)
    gone = sum(t.nbytes for t in saved if t.name.startswith("input_norm.") or t.name in (
        "lora.q.dropout_mask", "lora.k.dropout_mask", "lora.v.dropout_mask",
        "lora.qkv.dropout_mask"))
    targets = _covers(_targets(ctx))
    if bnb_keeps_inputs(ctx) and targets & set(_QKV) and not any(
            adapter_saved(ctx, dims(ctx), t)[1] for t in _targets(ctx) if t in _QKV):
        # the 4-bit q/k/v matmuls keep nothing here (neither input needs a gradient) and no
        # adapter keeps their input itself
        gone += sum(t.nbytes for t in saved if t.name in _DROP_QKV)
    if ctx.spec.parallel_residual:  # its second norm reads the embedding output too
        gone += sum(t.nbytes for t in saved if t.name.startswith("post_norm."))
    if ctx.spec.parallel_residual and not targets & {"gate", "up", "down"}:
        # a parallel block's MLP reads the (frozen) norm of the embedding output: nothing
        # in that branch needs a gradient, so it saves nothing
        gone += sum(t.nbytes for t in saved if t.name.startswith("mlp."))
    if not targets & set(_QKV):
        gone += sum(t.nbytes for t in saved if t.name.startswith("attn.")
                    and t.name != "attn.out")
        if not bnb_keeps_inputs(ctx) and not ctx.spec.parallel_residual:
            gone += _before_the_first_adapter(ctx, saved, targets)
    else:
        # a q (k) norm whose input needs no gradient records nothing (Qwen3's qk-norm)
        norms = tuple(f"attn.{letter}_norm." for letter in "qk" if letter not in targets)
        gone += sum(t.nbytes for t in saved if norms and t.name.startswith(norms))
        if ctx.training.attention == "eager" and ctx.training.recompute != "selective":
            # q @ kᵀ keeps q only for dk and k only for dq: one of them needs no grad here
            # (a checkpointed core keeps its inputs, q, k and v, whether they need one or not)
            for operand, other in (("attn.q", "k"), ("attn.k", "q")):
                if other not in targets:
                    gone += sum(t.nbytes for t in saved if t.name == operand)
    return gone


def _before_the_first_adapter(ctx: RankContext, saved: list[Saved], targets: set[str]) -> int:
    """No q/k/v adapter: the attention core records nothing, so its output is kept only by
    an o adapter that reads it itself (no cast, no dropout), and that adapter's dropout mask
    goes. Without an o adapter the residual needs no gradient until the MLP: the second norm
    records nothing, and in a dense gated MLP `silu(gate)` keeps gate only if gate has an
    adapter, `act · up` keeps up for dL/dact only if gate has one and act for dL/dup only if
    up has one (Liger's fused SiLU-mul keeps both or, with neither adapted, none); the masks
    of adapters whose input needs no gradient go too."""
    o_shares = "o" in targets and adapter_saved(ctx, dims(ctx), "o")[1]
    gone = sum(t.nbytes for t in saved if (t.name == "attn.out" and not o_shares)
               or t.name == "lora.o.dropout_mask")
    if "o" in targets:
        return gone
    gone += sum(t.nbytes for t in saved if t.name.startswith("post_norm."))
    if any(t.name.startswith("moe.") for t in saved):
        return gone + _frozen_input_experts(ctx, saved)
    if ctx.spec.mlp_kind != "gated":
        return gone
    gate, up = "gate" in targets, "up" in targets
    fused = ctx.training.liger  # LigerSiLUMulFunction saves (gate, up) when it records
    dropped = {"mlp.gate": not (gate or up) if fused else not gate,
               "mlp.up": not (gate or up) if fused else not gate, "mlp.act": not up,
               "mlp.gate_up": not (gate or up),
               "lora.gate.dropout_mask": True, "lora.up.dropout_mask": True,
               "lora.gate_up.dropout_mask": True,
               "lora.down.dropout_mask": not (gate or up)}
    return gone + sum(t.nbytes for t in saved if dropped.get(t.name, False))


def _frozen_input_experts(ctx: RankContext, saved: list[Saved]) -> int:
    """PEFT's wrapped MoE parameters (terms/expert_lora.py) on an input that needs no
    gradient: the router's and gate_up_proj's linears keep their input for dL/dW' but not
    W' (no dL/dx); without a wrapped gate_up_proj nothing up to down_proj needs a gradient,
    so down_proj keeps no W' either and the SiLU, act · up and the routing weights' product
    keep nothing; without a wrapped router the routing weights need no gradient."""
    w = wrapped(ctx)
    names = {"moe.lora.router.weight", "moe.lora.gate_up.weight"}
    if "router" not in w:  # a frozen router on such an input: no routing weight needs a
        # gradient, so the softmax, the top-k normalisation and the product keep nothing
        names |= {"moe.router_probs", "moe.topk_weight", "moe.topk_sum", "moe.down_out"}
    if "gate_up" not in w:
        names |= {"moe.lora.down.weight", "moe.gate_up", "moe.act", "moe.down_out"}
    return sum(t.nbytes for t in saved if t.name in names)
