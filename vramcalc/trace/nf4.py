"""An NF4 linear layer with bitsandbytes' (or torchao's) storage layout, for fake-tensor
traces of QLoRA.

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

Other layouts (vramcalc/qlora.py, `NF4Layout`): without double quantization the absmax is
fp32 and there is no state2 or offset; torchao's NF4Tensor keeps int8 scalers, bf16 scaler
factors (⌈n/64/256⌉, or a ⌈n/64⌉ storage before v0.3), a bf16 mean and a bf16 table.

They are registered as frozen parameters so the trace counts them as weights; under FSDP2
bitsandbytes' quantization state is kept whole on every rank (`quant_state_to_buffers`:
buffers, which FSDP does not shard) and the packed uint8 weight is sharded along its first
dimension, as FSDP-QLoRA shards bitsandbytes' packed storage (docs/finetuning.md); torchao's
scalers and factors stay parameters, sharded and gathered with the packed data.

The matmul follows `MatMul4Bit` (autograd/_functions.py) on the dequantize-then-matmul path
(`_dequant_linear_fallback` in backends/cuda/ops.py: every token count above 1536, and all
bitsandbytes releases before 0.50): forward decodes the absmax to fp32, adds the offset (a
second fp32 buffer), dequantizes the weight into a (out, in) tensor in the input's dtype and
calls F.linear; nothing is saved for backward but the packed weight (resident) — except on
bitsandbytes before 0.43.2, whose `ctx.tensors = (A, B)` holds the input as an attribute of
the node until the graph is freed; backward dequantizes again (`dequantize_4bit`: fp32
absmax, += offset in place, the weight) and computes dL/dx = dL/dy · W. torchao's
`linear_nf4` dequantizes through `get_original_weight` (int64 codes, looked-up and scaled
halves, `torch.stack`) and keeps nothing. The weight gets no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vramcalc.qlora import (
    DEFAULT_LAYOUT,
    NF4_BLOCK,
    NF4_CODE_ELEMS,
    NF4_SCALER_BLOCK,
    NF4_STATE2_CODE_ELEMS,
    TORCHAO_CONTIGUOUS_FACTOR,
    NF4Layout,
)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class _NF4MatMul(torch.autograd.Function):
    """y = x Wᵀ (+ b) with W dequantized on the fly; saves no activation (but bitsandbytes
    before 0.43.2 holds x as a node attribute)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: torch.Tensor, layer: NF4Linear,
                bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.layer = layer
        ctx.has_bias = bias is not None
        if layer.layout.keeps_input and any(ctx.needs_input_grad[:2]):
            ctx.tensors = (x, packed)  # MatMul4Bit before 9e753741: kept until graph freed
        w = layer.dequantize(x.dtype)
        y = F.linear(x, w, bias)
        del w
        layer.release()  # _dequant_linear_fallback: absmax buffers live through F.linear
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        layer: NF4Linear = ctx.layer
        w = layer.dequantize(grad.dtype, inplace_offset=True)
        layer.release()  # freed when dequantize_4bit / get_original_weight returns
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
                 compute_dtype: torch.dtype | None = None,
                 layout: NF4Layout = DEFAULT_LAYOUT) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.layout = layout
        self._temps: list[torch.Tensor] = []
        n = in_features * out_features
        blocks = -(-n // NF4_BLOCK)
        kw = {"device": device}
        f32, bf16 = torch.float32, torch.bfloat16
        state: dict[str, tuple[tuple[int, ...], torch.dtype]]
        self.weight = _frozen(torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, **kw))
        if layout.impl == "torchao":  # NF4Tensor.from_tensor / double_quantize_scalers
            factor = (-(-blocks // NF4_SCALER_BLOCK)
                      if layout.version >= TORCHAO_CONTIGUOUS_FACTOR else blocks)
            state = {"absmax": ((blocks,), torch.int8), "state2_absmax": ((factor,), bf16),
                     "offset": ((), bf16), "code": ((NF4_CODE_ELEMS,), bf16)}
        elif layout.double_quant:
            state = {"absmax": ((blocks,), torch.uint8),
                     "state2_absmax": ((-(-blocks // NF4_SCALER_BLOCK),), f32),
                     "state2_code": ((NF4_STATE2_CODE_ELEMS,), f32), "offset": ((), f32),
                     "code": ((NF4_CODE_ELEMS,), f32)}
        else:
            state = {"absmax": ((blocks,), f32), "code": ((NF4_CODE_ELEMS,), f32)}
        self.quant_state_names = tuple(state)
        for name, (shape, dt) in state.items():
            setattr(self, name, _frozen(torch.empty(shape, dtype=dt, **kw)))
        self.compute_dtype = compute_dtype or dtype or torch.float32  # bnb_4bit_compute_dtype
        # nn.Linear's bias is None when absent; torch's annotation says Parameter
        self.bias = (_frozen(torch.empty(out_features, dtype=dtype, **kw))  # type: ignore[assignment]
                     if bias else None)

    def quant_state_to_buffers(self) -> tuple[str, ...]:
        """Re-register the quantization state every rank keeps whole as buffers and return
        their names. bitsandbytes keeps it all in `Params4bit.quant_state`, module metadata
        rather than parameters, so FSDP leaves it whole on every rank (and FSDP2 refuses
        0-dim parameters such as `offset`); torchao's NF4Tensor is itself the parameter and
        FSDP2 splits its scalers and factors with the packed data (nf4tensor.py
        `_INNER_TENSOR_NAMES_FOR_SHARDING`), keeping only the mean and the table whole. The
        distributed trace calls this before `fully_shard` and counts these buffers as
        weights."""
        names = (("offset", "code") if self.layout.impl == "torchao"
                 else self.quant_state_names)
        for name in names:
            t = getattr(self, name).data
            del self._parameters[name]
            self.register_buffer(name, t)
        return names

    def new_absmax(self) -> torch.Tensor:
        """The fp32 absmax decoded from its 8-bit form (one value per 64-element block)."""
        absmax: torch.Tensor = self.absmax  # type: ignore[assignment]
        return torch.empty(absmax.shape[0], dtype=torch.float32, device=self.weight.device)

    def new_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized (out, in) weight."""
        return torch.empty((self.out_features, self.in_features), dtype=dtype,
                           device=self.weight.device)

    def dequantize(self, dtype: torch.dtype, inplace_offset: bool = False) -> torch.Tensor:
        """The (out, in) weight in `dtype`, with the dequantization's temporaries alive in
        `_temps` until `release()`: bitsandbytes' decoded absmax and its `+ offset` copy
        (double quantization only; `dequantize_4bit` in backward adds the offset in place:
        one buffer); torchao's int64 high/low codes and looked-up and scaled
        halves (`get_original_weight`, bf16) are gone before its bf16 result is cast to
        `dtype` (torchao v0.5.0 nf4tensor.py `_to_copy`)."""
        dev = self.weight.device
        half = self.weight.shape[0]
        if self.layout.impl == "torchao":
            self._temps = [torch.empty(half, dtype=torch.int64, device=dev) for _ in range(2)]
            self._temps += [torch.empty(half, dtype=torch.bfloat16, device=dev)
                            for _ in range(4)]
            w = self.new_weight(torch.bfloat16)
            self.release()  # the locals go when it returns, before `_to_copy`'s `.to(dtype)`
            return w.to(dtype)
        if self.layout.double_quant:
            absmax = self.new_absmax()
            offset: torch.Tensor = self.offset  # type: ignore[assignment]
            self._temps = [absmax] if inplace_offset else [absmax, absmax + offset]
        return self.new_weight(dtype)

    def release(self) -> None:
        """Drop the dequantization's temporaries (see `dequantize`); bitsandbytes' forward
        keeps its absmax buffers through F.linear, so the forward calls this after it."""
        self._temps = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Linear4bit.forward: x to bnb_4bit_compute_dtype, matmul, back to x's dtype
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        bias = self.bias.to(self.compute_dtype) if self.bias is not None else None
        return _NF4MatMul.apply(x, self.weight, self, bias).to(inp_dtype)

    @classmethod
    def from_linear(cls, lin: nn.Module, compute_dtype: torch.dtype,
                    layout: NF4Layout = DEFAULT_LAYOUT) -> NF4Linear:
        """A 4-bit copy of an nn.Linear, or of transformers' Conv1D (GPT-2), whose (in, out)
        weight its bitsandbytes integration also makes a Linear4bit(in, out) of
        (integrations/bitsandbytes.py `_replace_with_bnb_linear`)."""
        w: torch.Tensor = lin.weight  # type: ignore[assignment]
        in_f, out_f = ((lin.in_features, lin.out_features) if isinstance(lin, nn.Linear)
                       else (w.shape[0], w.shape[1]))
        return cls(in_f, out_f, bias=lin.bias is not None, device=w.device, dtype=w.dtype,
                   compute_dtype=compute_dtype, layout=layout)
