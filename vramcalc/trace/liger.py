"""Liger's kernels as the trace runs them (`--liger`; what they keep: vramcalc/terms/liger.py).

Liger's kernels are Triton programs that do not run on the CPU. The trace runs fake tensors,
whose values do not matter, so these autograd Functions stand in for Liger's own
(linkedin/Liger-Kernel ead96b61) with the same allocations: each `torch.empty` /
`zeros_like` Liger makes, the same tensors saved for backward, the same gradients written
in place, and the fused loss's chunk loop with its real matmuls (so autocast casts as it
does on a GPU). `apply_liger(model)` patches the model as `_apply_liger_kernel_to_instance`
does for Llama, Mistral and Qwen2: every RMSNorm, every MLP, the causal LM's forward (the
fused linear cross entropy) and, through `liger_rope()`, the modeling module's
`apply_rotary_pos_emb`.

torch is imported only when a trace runs.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import MethodType
from typing import Any

import torch
from torch import nn

IGNORE_INDEX = -100


class _RMSNorm(torch.autograd.Function):
    """ops/rms_norm.py LigerRMSNormFunction: Y = empty (n_rows, n_cols) in X's dtype, RSTD
    (n_rows,) fp32 ("llama" casting), `save_for_backward(X, W, RSTD)`; backward writes dX
    into dY (in_place=True) and reduces an (SMs, n_cols) fp32 partial dW."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows = x.view(-1, x.shape[-1])
        y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        ctx.save_for_backward(rows, w, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, w, _ = ctx.saved_tensors
        partial = torch.empty((1, w.shape[0]), dtype=torch.float32, device=w.device)
        return dy, partial.sum(dim=0).to(w.dtype)


class _SiLUMul(torch.autograd.Function):
    """ops/swiglu.py LigerSiLUMulFunction: c = empty_like(a), `save_for_backward(a, b)`;
    swiglu_backward writes d a and d b into a and b and returns them."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a, b)
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx: Any, dc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return a, b


class _Rope(torch.autograd.Function):
    """ops/rope.py LigerRopeFunction: q and k rotated in place in their (b, s, heads, d)
    storage (a transpose and a no-op `contiguous` of transformers' layout), `save_for_
    backward(cos, sin)`; backward rotates dq, dk the same way."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q2, k2 = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        ctx.save_for_backward(cos.contiguous(), sin.contiguous())
        return q2.transpose(1, 2), k2.transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple[Any, ...]:
        dq2, dk2 = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
        return dq2.transpose(1, 2), dk2.transpose(1, 2), None, None


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """ops/fused_linear_cross_entropy.py `fused_linear_cross_entropy_forward` (reduction
    "mean", no bias, the addmm out_dtype path of torch >= 2.8 on compute capability >= 8)
    and LigerFusedLinearCrossEntropyFunction: grad_input and grad_weight made in forward,
    saved, scaled in place by backward's `element_mul_kernel`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                target: torch.Tensor) -> torch.Tensor:
        # Liger's own locals, so that each lives as long as there: a chunk's logits until the
        # next chunk's are made, the addmm operand cast until the next one
        bt, h = x.shape
        v = weight.shape[0]
        inc_factor = -(-v // h)
        chunk_size = 1 << max(-(-bt // inc_factor) - 1, 0).bit_length()
        grad_input = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        loss_1d = torch.zeros(bt, dtype=torch.float32, device=x.device)
        target_mask = target != IGNORE_INDEX
        for start in range(0, bt, chunk_size):
            _input_chunk = x[start:start + chunk_size]
            logits_chunk = _input_chunk @ weight.t()
            logits_chunk = logits_chunk.contiguous()  # the CE kernel writes its gradient here
            grad_logits_chunk = logits_chunk
            grad_input[start:start + chunk_size] = grad_logits_chunk @ weight
            if grad_weight is not None:  # torch.addmm(..., out_dtype=float32, out=grad_weight)
                grad_logits_t = grad_logits_chunk.t()
                input_chunk = _input_chunk
                if input_chunk.dtype != grad_logits_t.dtype:
                    input_chunk = input_chunk.to(grad_logits_t.dtype)
        del target_mask
        ctx.save_for_backward(grad_input, grad_weight)
        return torch.sum(loss_1d)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad_input, grad_weight = ctx.saved_tensors
        return grad_input, grad_weight, None


class FusedLoss(nn.Module):
    """model/loss_utils.py LigerForCausalLMLoss as a module, so that the trace can mark where
    the loss starts (vramcalc/trace/engine.py `watch_logits`): labels padded by one
    ignore_index and shifted, hidden states viewed as (b·s, h), the fused loss."""

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        padded = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)
        shift = padded[..., 1:].contiguous().view(-1)
        return _FusedLinearCrossEntropy.apply(hidden.view(-1, hidden.shape[-1]), weight, shift)


def _norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return _RMSNorm.apply(hidden_states, self.weight)


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_SiLUMul.apply(self.gate_proj(x), self.up_proj(x)))


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          position_ids: Any = None, unsqueeze_dim: int = 1) -> tuple[torch.Tensor, ...]:
    return _Rope.apply(q, k, cos, sin)


def _lce_forward(self: Any, input_ids: torch.Tensor, labels: torch.Tensor,
                 **_: Any) -> Any:
    """model/llama.py `lce_forward` in training with labels: the decoder's hidden states
    into LigerForCausalLMLoss (`FusedLoss`); no logits."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    hidden = self.model(input_ids=input_ids)[0]
    return CausalLMOutputWithPast(loss=self.liger_loss(hidden, self.lm_head.weight, labels))


def apply_liger(model: Any) -> Any:
    """Patch a transformers causal LM (or a PEFT model around one) in place, as Liger's
    `apply_liger_kernel_to_llama` (mistral, qwen2) does with a model instance."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for mod in base.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm"):
            mod.forward = MethodType(_norm_forward, mod)
        elif name.endswith("MLP"):
            mod.forward = MethodType(_mlp_forward, mod)
    base.liger_loss = FusedLoss()
    base.forward = MethodType(_lce_forward, base)
    model.vramcalc_liger = True
    return model


def watch_fused_loss(tracker: Any, model: Any) -> None:
    """The trace's "logits" region for a model without logits: from the fused loss's start
    to the moment d loss / d hidden is ready (vramcalc/trace/engine.py `watch_logits`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model

    def loss_pre(_mod: Any, inp: Any) -> None:
        tracker.region = "logits"
        if inp[0].requires_grad:
            inp[0].register_hook(lambda _grad: setattr(tracker, "region", None))

    base.liger_loss.register_forward_pre_hook(loss_pre)


@contextlib.contextmanager
def liger_rope(model: Any, on: bool = True) -> Iterator[None]:
    """The model's modeling module's `apply_rotary_pos_emb` replaced by Liger's while the
    trace runs (Liger patches that module attribute); nothing when not `on`."""
    if not on:
        yield
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    module: Any = sys.modules[type(base).__module__]
    orig = module.apply_rotary_pos_emb
    module.apply_rotary_pos_emb = _rope
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = orig
