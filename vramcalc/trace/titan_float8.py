"""torchao's Float8Linear as torchtitan 9dec370 runs it, for the partitioner
(vramcalc/trace/compiled.py `compiled_saved`), written from pytorch/ao
eab345c2268a7506355d506ebfc27b5d28e5e7d0 (the torchao of torchtitan's Dec 2024
benchmarks, benchmarks/llama3_h100_202412_torchtitan.md):

- torchtitan/float8.py (torchtitan 9dec370) `Float8Handler`: `convert_to_float8_training`
  swaps every nn.Linear but the `output` projection; scaling input / weight / grad_output
  "dynamic" (config_manager.py defaults), tensorwise;
- torchao/float8/float8_linear.py `Float8Linear.forward`: the input and the weight are cast
  to float8_e4m3fn each with its own dynamic scale (`hp_tensor_to_float8_dynamic`,
  `get_weight_scale`, `cast_weight_to_float8_t`), then
  `manual_float8_matmul_with_args_in_float8` saves both fp8 tensors (data + fp32 scale)
  and runs the scaled mm; `cast_output_to_float8_in_bw` (`NoopFwToFloat8BwDynamic`) casts
  the output's gradient to float8_e5m2 in backward;
- float8_utils.py: amax = max(|x|), scale = finfo.max / clamp(amax, 1e-12) in fp64, then
  fp32 (`amax_to_scale`); `to_fp8_saturated` clamps to ±finfo.max; float8_tensor.py
  `_ToFloat8ConstrFunc`: `x.to(float32) * scale`, saturated, `.to(float8)`;
- float8_ops.py: the mm is `torch._scaled_mm(a, b, scale_a=1/a.scale, scale_b=1/b.scale,
  out_dtype=<the input's dtype>)`.

This is vramcalc's own code, not torchao's. torch is imported at module import.
"""

from __future__ import annotations

from typing import Any

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # float8_utils.py EPS


class _ToFloat8(torch.autograd.Function):
    """float8_tensor.py `_ToFloat8ConstrFunc`: the saturated scaled cast; its backward hands
    the gradient through unchanged (none to the scale)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        fmax = torch.finfo(dtype).max
        return (x.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return grad, None, None


def to_float8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 data, fp32 scale) of a dynamic tensorwise cast."""
    fmax = torch.finfo(dtype).max
    amax = torch.max(torch.abs(x)).to(torch.float64)
    scale = (fmax / torch.clamp(amax, min=EPS)).to(torch.float32)
    return _ToFloat8.apply(x, scale, dtype), scale


def _scaled_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    return torch._scaled_mm(a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                            out_dtype=out_dtype)


def _mm_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_input, grad_weight (out, in)): grad_output cast to e5m2; float8_ops.py
    `preprocess_addmm` makes the right operand column-major (`.t().contiguous().t()`)."""
    x8, sx, w8t, sw = ctx.saved_tensors
    g8, sg = to_float8(grad, E5M2)
    grad_x = _scaled_mm(g8, sg, w8t.contiguous().t(), sw, ctx.out_dtype)
    grad_w = _scaled_mm(g8.t().contiguous(), sg, x8.t().contiguous().t(), sx, ctx.out_dtype)
    return grad_x, grad_w


class _Float8MM(torch.autograd.Function):
    """`manual_float8_matmul_with_args_in_float8` with the e5m2 cast of the output's
    gradient (`NoopFwToFloat8BwDynamic`) folded into its backward."""

    @staticmethod
    def forward(ctx: Any, x8: torch.Tensor, sx: torch.Tensor, w8t: torch.Tensor,
                sw: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(x8, sx, w8t, sw)
        ctx.out_dtype = out_dtype
        return _scaled_mm(x8, sx, w8t, sw, out_dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad_x, grad_w = _mm_backward(ctx, grad)
        return grad_x, None, grad_w.t(), None, None


def float8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Float8Linear.forward (no bias): (..., in) @ weight (out, in)^T, bf16 out."""
    shape = x.shape
    x8, sx = to_float8(x.reshape(-1, shape[-1]), E4M3)
    w8, sw = to_float8(weight, E4M3)
    out = _Float8MM.apply(x8, sx, w8.t(), sw, x.dtype)
    return out.reshape(*shape[:-1], out.shape[-1])


class Float8Linear(torch.nn.Linear):
    """nn.Linear whose forward is `float8_linear` (no bias: torchtitan's Llama has none)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return float8_linear(input, self.weight)


class _GatheredFloat8MM(torch.autograd.Function):
    """The mm when FSDP2 gathered the weight in fp8 (fsdp_utils.py `fsdp_post_all_gather`:
    a Float8Tensor of the gathered data and the shard's scale): `cast_weight_to_float8_t`
    returns `weight.t()` uncast. `weight` (the bf16 parameter) only carries the gradient, as
    the Float8Tensor parameter does; the mm reads the fp8 data."""

    @staticmethod
    def forward(ctx: Any, x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor,
                sw: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x8, sx, w8.t(), sw)
        ctx.out_dtype = weight.dtype
        return _scaled_mm(x8, sx, w8.t(), sw, weight.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad_x, grad_w = _mm_backward(ctx, grad)
        return grad_x, None, None, None, grad_w


class GatheredFloat8Linear(torch.nn.Linear):
    """Float8Linear under fp8 all-gather: buffers `weight_fp8` (out, in) e4m3 and
    `weight_scale` (fp32) stand for the gathered Float8Tensor; no weight cast."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        shape = input.shape
        x8, sx = to_float8(input.reshape(-1, shape[-1]), E4M3)
        out = _GatheredFloat8MM.apply(x8, sx, self.weight_fp8, self.weight_scale, self.weight)
        return out.reshape(*shape[:-1], out.shape[-1])


def convert_to_float8(model: torch.nn.Module, gathered: bool = False) -> torch.nn.Module:
    """Swap every nn.Linear but the one named `output` (torchtitan's module_filter_fn),
    in place, keeping its parameter; `gathered`: the fp8 all-gather variant."""
    for name, child in list(model.named_children()):
        if type(child) is torch.nn.Linear and name != "output":
            cls = GatheredFloat8Linear if gathered else Float8Linear
            new = cls.__new__(cls)
            new.__dict__ = child.__dict__
            if gathered:
                w = child.weight
                new.register_buffer("weight_fp8", torch.empty(w.shape, dtype=E4M3,
                                                              device=w.device))
                new.register_buffer("weight_scale", torch.ones((), device=w.device))
            setattr(model, name, new)
        else:
            convert_to_float8(child, gathered)
    return model
