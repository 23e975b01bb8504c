"""FP8 (Transformer Engine) and QAT block linears for fake-tensor traces of the reference model.

`apply_lowprec(model, scn)` replaces every nn.Linear inside the transformer blocks (not
lm_head, not the embedding) by one of the modules below, keeping the same Parameter
objects (so parameter order, optimizer and gradients are unchanged). What each allocates
and keeps is documented in vramcalc/terms/lowprec.py and docs/methodology.md section 11.

- `FP8Linear` is a stand-in, like vramcalc/trace/nf4.py: Transformer Engine is CUDA-only
  and cannot run on fake tensors, so its `_Linear` autograd function is replaced by one that
  allocates the storages TE allocates, as real `torch.float8_e4m3fn` / `float8_e5m2`
  tensors: the cached FP8 weight workspace (data + transpose + scale_inv) and the delayed
  scaling meta (scale, amax_history for forward and backward) per module, built once; in
  forward the input cast row- and column-wise (the row-wise data dropped after the GEMM,
  the transpose and scale_inv saved), a bf16 GEMM output; in backward the grad_output cast
  to e5m2 row- and column-wise, dgrad and wgrad in bf16. Inputs already quantized by a
  sibling linear (q/k/v, gate/up read the same tensor) are reused, as TE's fused
  LayerNormLinear keeps one FP8 copy. No value is computed (the trace counts memory only).
- `QATLinear` runs real PyTorch fake quantization (`torch.fake_quantize_per_channel_affine`,
  which saves a bool STE mask): dynamic per-token int8 on the input, per-channel int8 or
  per-group-32 int4 on the weight, qparams from `torch.aminmax` under no_grad, copied into
  the module's kept scale / zero-point tensors (as torchao's fake quantizers keep theirs);
  then F.linear on the fake-quantized input and weight.

Persistent tensors are reported by `vramcalc_state()` so the engine labels them.
torch is imported only when a trace runs.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vramcalc.terms.lowprec import (
    FP8_AMAX_HISTORY_LEN,
    FP8_BWD_TENSORS_PER_GEMM,
    FP8_FWD_TENSORS_PER_GEMM,
    QAT_INT4_GROUP,
    fp8_transpose,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
QAT_EPS = torch.finfo(torch.float32).eps  # scale floor, as choose_qparams_affine applies one


class _InputCache:
    """The last quantized input (weak references): siblings reading the same tensor reuse it."""

    def __init__(self) -> None:
        self.key: Any = None
        self.value: tuple[Any, Any] | None = None

    def get(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.key is None or self.key() is not x or self.value is None:
            return None
        saved, sinv = self.value[0](), self.value[1]()
        return None if saved is None or sinv is None else (saved, sinv)

    def put(self, x: torch.Tensor, saved: torch.Tensor, sinv: torch.Tensor) -> None:
        self.key = weakref.ref(x)
        self.value = (weakref.ref(saved), weakref.ref(sinv))


class _FP8LinearFn(torch.autograd.Function):
    """TE `_Linear` memory behaviour under DelayedScaling (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                mod: FP8Linear) -> torch.Tensor:  # type: ignore[override]
        out_f, in_f = weight.shape
        shape = x.shape
        T = x.numel() // in_f
        hit = mod.cache.get(x)
        if hit is None:
            # tex.quantize (cast + transpose): row-wise (T, in) for the forward GEMM and
            # column-wise (in, T) for wgrad, one fp32 scale_inv
            data = x.new_empty((T, in_f), dtype=E4M3)
            trans = x.new_empty((in_f, T), dtype=E4M3) if mod.transpose else None
            sinv = x.new_empty((1,), dtype=torch.float32)
            saved = trans if trans is not None else data
            mod.cache.put(x, saved, sinv)
        else:
            data, (saved, sinv) = None, hit
        y = x.new_empty((T, out_f), dtype=x.dtype)  # FP8 GEMM, bias in the epilogue, bf16 out
        # update_usage(rowwise_usage=False): the row-wise data goes once the GEMM is done
        del data
        ctx.save_for_backward(saved, sinv)
        ctx.mod, ctx.has_bias, ctx.shape = mod, bias is not None, shape
        return y.view(*shape[:-1], out_f)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        mod: FP8Linear = ctx.mod
        out_f, in_f = mod.weight.shape
        T = grad.numel() // out_f
        # grad_output to e5m2, row-wise (dgrad) and column-wise (wgrad), scale_inv; the
        # bias gradient comes out of the same fused kernel
        g_data = grad.new_empty((T, out_f), dtype=E5M2)
        g_trans = grad.new_empty((out_f, T), dtype=E5M2) if mod.transpose else None
        g_sinv = grad.new_empty((1,), dtype=torch.float32)
        db = grad.new_empty((out_f,), dtype=grad.dtype) if (
            ctx.has_bias and ctx.needs_input_grad[2]) else None
        dx = grad.new_empty((T, in_f), dtype=grad.dtype) if ctx.needs_input_grad[0] else None
        dw = grad.new_empty((out_f, in_f), dtype=mod.weight.dtype) if (
            ctx.needs_input_grad[1]) else None
        del g_data, g_trans, g_sinv
        return (dx.view(ctx.shape) if dx is not None else None), dw, db, None


class FP8Linear(nn.Module):
    """A te.Linear stand-in on the same parameters (see the module docstring)."""

    def __init__(self, lin: nn.Linear, transpose: bool, cache: _InputCache) -> None:
        super().__init__()
        self.weight = lin.weight
        self.bias = lin.bias
        self.transpose, self.cache = transpose, cache
        out_f, in_f = lin.weight.shape
        dev = lin.weight.device
        # _fp8_workspaces["weight"]: Float8Tensor _data, _transpose, _scale_inv
        self.w_data = torch.empty((out_f, in_f), dtype=E4M3, device=dev)
        self.w_trans = torch.empty((in_f, out_f), dtype=E4M3, device=dev) if transpose else None
        self.w_sinv = torch.empty((1,), dtype=torch.float32, device=dev)
        # DelayedScalingRecipeState, forward and backward
        self.meta = []
        for k in (FP8_FWD_TENSORS_PER_GEMM, FP8_BWD_TENSORS_PER_GEMM):
            self.meta += [torch.ones(k, dtype=torch.float32, device=dev),
                          torch.zeros((FP8_AMAX_HISTORY_LEN, k), dtype=torch.float32,
                                      device=dev)]

    def vramcalc_state(self) -> list[tuple[torch.Tensor, str]]:
        ws = [t for t in (self.w_data, self.w_trans, self.w_sinv) if t is not None]
        return [(t, "transients/fp8_weight_cache") for t in ws] + [
            (t, "transients/fp8_meta") for t in self.meta]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FP8LinearFn.apply(x, self.weight, self.bias, self)


class QATLinear(nn.Module):
    """Fake-quantized linear with torch's fake-quant ops (see the module docstring)."""

    def __init__(self, lin: nn.Linear, scheme: str, tokens: int) -> None:
        super().__init__()
        self.weight = lin.weight
        self.bias = lin.bias
        self.scheme = scheme
        out_f, in_f = lin.weight.shape
        dev = lin.weight.device
        groups = out_f if scheme == "int8" else out_f * in_f // QAT_INT4_GROUP
        self.w_scale = torch.empty(groups, dtype=torch.float32, device=dev)
        self.w_zero = torch.empty(groups, dtype=torch.int32, device=dev)
        self.a_scale = torch.empty(tokens, dtype=torch.float32, device=dev)
        self.a_zero = torch.empty(tokens, dtype=torch.int32, device=dev)

    def vramcalc_state(self) -> list[tuple[torch.Tensor, str]]:
        return [(t, "transients/qat_qparams")
                for t in (self.w_scale, self.w_zero, self.a_scale, self.a_zero)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        in_f = shape[-1]
        x2 = x.reshape(-1, in_f)  # (T, in)
        with torch.no_grad():  # dynamic asymmetric per-token int8 qparams
            lo, hi = torch.aminmax(x2, dim=1)  # (T,), (T,)
            scale = ((hi - lo).float() / 255.0).clamp_(min=QAT_EPS)
            self.a_scale.copy_(scale)
            self.a_zero.copy_(torch.round(-128.0 - lo.float() / scale).clamp_(-128, 127)
                              .to(torch.int32))
            del lo, hi, scale
        xq = torch.fake_quantize_per_channel_affine(x2, self.a_scale, self.a_zero, 0, -128, 127)
        w = self.weight
        if self.scheme == "int8":  # symmetric per output channel
            wg, qmin, qmax = w, -128, 127
        else:  # symmetric int4 per group of 32 columns
            wg, qmin, qmax = w.view(-1, QAT_INT4_GROUP), -8, 7
        with torch.no_grad():
            lo, hi = torch.aminmax(wg, dim=1)
            self.w_scale.copy_((torch.maximum(lo.abs(), hi.abs()).float() / qmax)
                               .clamp_(min=QAT_EPS))
            self.w_zero.zero_()
            del lo, hi
        wq = torch.fake_quantize_per_channel_affine(wg, self.w_scale, self.w_zero, 0, qmin, qmax)
        return F.linear(xq.view(shape), wq.view(w.shape), self.bias)


def _block_linears(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every nn.Linear inside one reference block."""
    out = []
    for name, mod in list(block.named_modules()):
        if isinstance(mod, nn.Linear) and "." in name:
            parent = block.get_submodule(name.rsplit(".", 1)[0])
            out.append((parent, name.rsplit(".", 1)[1]))
    return out


def apply_lowprec(model: nn.Module, scn: Any) -> nn.Module:
    """Swap the block linears for FP8Linear or QATLinear (inside the trace's FakeTensorMode)."""
    tr = scn.training
    gpu = scn.cluster.gpu if scn.cluster is not None else None
    cache = _InputCache()
    tokens = tr.micro_batch_size * tr.seq_len
    layers: Any = model.layers  # the reference model's blocks (an nn.ModuleList)
    for block in layers:
        for parent, attr in _block_linears(block):
            lin = getattr(parent, attr)
            if tr.precision == "fp8":
                new: nn.Module = FP8Linear(lin, fp8_transpose(gpu), cache)
            else:
                new = QATLinear(lin, tr.qat, tokens)
            setattr(parent, attr, new)
    return model
