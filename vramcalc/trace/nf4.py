"""An NF4 linear layer with bitsandbytes' storage layout, for fake-tensor traces of QLoRA.

bitsandbytes cannot run on fake tensors (its kernels are CUDA/C++ ops without fake
implementations for the trace's CPU fake device), so `NF4Linear` stands in for
`bnb.nn.Linear4bit(quant_type="nf4", compress_statistics=True)` with exactly the storages
bitsandbytes 0.50.1 (@ 95f9af30) allocates per weight of n = out·in elements
(functional.py `quantize_4bit`, `quantize_blockwise`, `get_4bit_type`):

| attribute          | bitsandbytes                    | shape / dtype              |
|--------------------|---------------------------------|----------------------------|
| weight             | Params4bit data                 | (⌈n/2⌉, 1) uint8           |
| absmax             | quant_state.absmax (8-bit)      | (⌈n/64⌉,) uint8            |
| state2_absmax      | quant_state.state2.absmax       | (⌈⌈n/64⌉/256⌉,) fp32       |
| state2_code        | quant_state.state2.code (copy)  | (256,) fp32                |
| offset             | quant_state.offset              | () fp32                    |
| code               | quant_state.code (NF4 table)    | (16,) fp32                 |

They are registered as frozen parameters so the trace counts them as weights; under FSDP2
the quantization state is kept whole on every rank (`quant_state_to_buffers`: buffers,
which FSDP does not shard) and the packed uint8 weight is sharded along its first dimension, as
FSDP-QLoRA shards bitsandbytes' packed storage (docs/finetuning.md).

The matmul follows `MatMul4Bit` (autograd/_functions.py) on the dequantize-then-matmul path
(`_dequant_linear_fallback` in backends/cuda/ops.py: every token count above 1536, and all
bitsandbytes releases before 0.50): forward decodes the absmax to fp32, adds the offset (a
second fp32 buffer), dequantizes the weight into a (out, in) tensor in the input's dtype and
calls F.linear; nothing is saved for backward but the packed weight (resident); backward
dequantizes again (`dequantize_4bit`: fp32 absmax, += offset in place, the weight) and
computes dL/dx = dL/dy · W. The weight gets no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vramcalc.finetune import NF4_ABSMAX_BLOCK, NF4_BLOCK, NF4_CODE_ELEMS, NF4_STATE2_CODE_ELEMS


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class _NF4MatMul(torch.autograd.Function):
    """y = x Wᵀ (+ b) with W dequantized on the fly; saves no activation."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: torch.Tensor, layer: NF4Linear,
                bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.layer = layer
        ctx.has_bias = bias is not None
        # _dequant_linear_fallback: both absmax buffers and the weight live through F.linear
        absmax_dq = layer.new_absmax()
        absmax = absmax_dq + layer.offset
        w = layer.new_weight(x.dtype)  # (out, in)
        y = F.linear(x, w, bias)
        del absmax_dq, absmax, w
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        layer: NF4Linear = ctx.layer
        absmax = layer.new_absmax()  # dequantize_4bit: decoded absmax, += offset in place
        absmax += layer.offset
        w = layer.new_weight(grad.dtype)
        del absmax  # freed when dequantize_4bit returns, before the matmul
        dx = torch.matmul(grad, w)  # (..., in)
        del w
        db = None
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = grad.reshape(-1, grad.shape[-1]).sum(0)
        return dx, None, None, db


class NF4Linear(nn.Linear):
    """A frozen NF4 linear (see the module docstring). Subclasses nn.Linear, as
    bnb.nn.Linear4bit does, so PEFT wraps it with its LoRA layer; the packed uint8 weight
    makes PEFT keep the adapters in fp32, as with a real 4-bit base."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 device: Any = None, dtype: torch.dtype | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        n = in_features * out_features
        blocks = -(-n // NF4_BLOCK)
        kw = {"device": device}
        self.weight = _frozen(torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, **kw))
        self.absmax = _frozen(torch.empty(blocks, dtype=torch.uint8, **kw))
        self.state2_absmax = _frozen(torch.empty(-(-blocks // NF4_ABSMAX_BLOCK),
                                                 dtype=torch.float32, **kw))
        self.state2_code = _frozen(torch.empty(NF4_STATE2_CODE_ELEMS, dtype=torch.float32, **kw))
        self.offset = _frozen(torch.empty((), dtype=torch.float32, **kw))
        self.code = _frozen(torch.empty(NF4_CODE_ELEMS, dtype=torch.float32, **kw))
        self.compute_dtype = compute_dtype or dtype or torch.float32  # bnb_4bit_compute_dtype
        # nn.Linear's bias is None when absent; torch's annotation says Parameter
        self.bias = (_frozen(torch.empty(out_features, dtype=dtype, **kw))  # type: ignore[assignment]
                     if bias else None)

    QUANT_STATE = ("absmax", "state2_absmax", "state2_code", "offset", "code")

    def quant_state_to_buffers(self) -> list[torch.Tensor]:
        """Re-register the quantization state as buffers and return them. bitsandbytes keeps
        it in `Params4bit.quant_state`, module metadata rather than parameters, so FSDP leaves
        it whole on every rank (and FSDP2 refuses 0-dim parameters such as `offset`); the
        distributed trace calls this before `fully_shard` so that only the packed weight is
        sharded, and counts these buffers as weights."""
        out = []
        for name in self.QUANT_STATE:
            t = getattr(self, name).data
            del self._parameters[name]
            self.register_buffer(name, t)
            out.append(t)
        return out

    def new_absmax(self) -> torch.Tensor:
        """The fp32 absmax decoded from its 8-bit form (one value per 64-element block)."""
        return torch.empty(self.absmax.shape[0], dtype=torch.float32, device=self.weight.device)

    def new_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized (out, in) weight."""
        return torch.empty((self.out_features, self.in_features), dtype=dtype,
                           device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Linear4bit.forward: x to bnb_4bit_compute_dtype, matmul, back to x's dtype
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        bias = self.bias.to(self.compute_dtype) if self.bias is not None else None
        return _NF4MatMul.apply(x, self.weight, self, bias).to(inp_dtype)

    @classmethod
    def from_linear(cls, lin: nn.Linear, compute_dtype: torch.dtype) -> NF4Linear:
        return cls(lin.in_features, lin.out_features, bias=lin.bias is not None,
                   device=lin.weight.device, dtype=lin.weight.dtype, compute_dtype=compute_dtype)
