"""What a CUDA device does differently from the CPU kernels the trace runs on.

Fake tensors on device "cuda" cannot run autograd in a CPU-only PyTorch build (autograd's
InputMetadata asks the CUDA device guard, which aborts the process), so the trace runs on
fake CPU tensors and this module makes them allocate what CUDA would:

1. Autocast op lists. CPU autocast lacks most of CUDA's fp32 list (softmax, log_softmax,
   layer_norm, rms_norm, pow, rsqrt, exp, sum, ...; aten/src/ATen/autocast_mode.h
   AT_FORALL_FP32 / AT_FORALL_FP32_SET_OPT_DTYPE). `cuda_autocast_rules()` registers
   AutocastCPU kernels with CUDA's policy for those ops while a trace runs and removes them
   afterwards. The lower-precision list (mm, bmm, addmm, linear, matmul, baddbmm, SDPA) is
   the same on both devices, including the cast cache for fp32 leaf parameters.
2. Kernel outputs (`rewrite_op`, called by the tracker for every op):
   - SDPA: the CPU flash kernel saves what CUDA's flash kernel saves (q, k, v, output,
     fp32 logsumexp (b, a, s)), but allocates its output (b, a, s, d)-contiguous; CUDA's
     FlashAttention-2 writes (b, s, a, d) and returns a transposed view, so the
     `transpose(1, 2).reshape(b, s, a·d)` before o_proj is free on CUDA. Backward:
     FlashAttention-2's mha_bwd allocates, besides dq, dk, dv, `softmax_d` (b, a, s₁₂₈)
     fp32, `dq_accum` (b, s₁₂₈, a, d₃₂) fp32 and, for grouped-query attention,
     `dk_expanded`, `dv_expanded` (b, s, a, d) (flash_api.cpp mha_bwd; s₁₂₈ = s rounded up
     to 128, d₃₂ = d rounded up to 32 (64 above 128)). fp32 inputs run the memory-efficient
     kernel on CUDA, which saves the same tensors; its workspace is modelled like flash's.
   - SDPA with a float mask that requires grad (T5's position bias): `cuda_biased_sdpa`
     runs CUDA's memory-efficient kernel (`efficient_sdpa`), whose philox seed and offset are
     host tensors (the tracker does not count them); its backward allocates dq, dk, dv, the
     bias gradient (b, a, q, k₁₆) in the bias dtype and `efficient_backward_workspace`.
   - softmax / log_softmax on a strided input (a transposed (b, V, s) logits view): CUDA's
     `host_softmax` makes a contiguous copy first (`input_.contiguous()`), and its
     backward copies a strided gradient or output (aten/src/ATen/native/cuda/SoftMax.cu),
     scratch freed when the op returns; the CPU meta kernels allocate the output only.
   - LayerNorm: CUDA keeps mean and rstd in fp32 for 16-bit inputs (acc type); the CPU
     meta kernel returns them in the input dtype.
   - `.item()` (aten._local_scalar_dense) reads a value on the host: answered with 1, no
     memory involved (Adafactor reads its step and norms this way).
   - Tensors made from Python numbers (`torch.tensor(0.0)`, aten.lift_fresh) live on the
     host, like the optimizers' step counters: not counted.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten
_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_LOW = (torch.bfloat16, torch.float16)

# CUDA's fp32 policy (AT_FORALL_FP32) for ops CPU autocast leaves alone, as
# (op name, overload) pairs; only ops a transformer can reach are listed.
FP32_OPS: tuple[tuple[str, str], ...] = (
    ("acos", "default"), ("asin", "default"), ("cosh", "default"), ("erfinv", "default"),
    ("exp", "default"), ("expm1", "default"), ("log", "default"), ("log10", "default"),
    ("log2", "default"), ("log1p", "default"), ("reciprocal", "default"),
    ("rsqrt", "default"), ("sinh", "default"), ("tan", "default"),
    ("pow", "Tensor_Scalar"), ("pow", "Tensor_Tensor"), ("pow", "Scalar"),
    ("softplus", "default"), ("layer_norm", "default"), ("native_layer_norm", "default"),
    ("rms_norm", "default"), ("group_norm", "default"), ("logsumexp", "default"),
    ("cosine_similarity", "default"), ("dist", "default"), ("renorm", "default"),
)
# CUDA's fp32_set_opt_dtype policy: a 16-bit input gets dtype=float32 unless one is given.
SET_OPT_DTYPE_OPS: tuple[tuple[str, str], ...] = (
    ("softmax", "int"), ("log_softmax", "int"), ("cumsum", "default"), ("cumprod", "default"),
    ("sum", "default"), ("sum", "dim_IntList"), ("prod", "default"), ("prod", "dim_int"),
    ("linalg_vector_norm", "default"),
)
# CUDA's promote policy (AT_FORALL_PROMOTE): all floating inputs to the widest dtype.
PROMOTE_OPS: tuple[tuple[str, str], ...] = (
    ("addcdiv", "default"), ("addcmul", "default"), ("index_put", "default"),
    ("scatter_add", "default"), ("dot", "default"), ("atan2", "default"),
)


def _is_low(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in _LOW


def _fp32_kernel(op: Any):  # noqa: ANN202
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            args, kwargs = tree_map(
                lambda t: t.to(torch.float32) if _is_low(t) else t, (args, kwargs))
            return op(*args, **kwargs)
    return kernel


def _set_opt_dtype_kernel(op: Any):  # noqa: ANN202
    dtype_pos = [i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"][0]
    kw_only = op._schema.arguments[dtype_pos].kwarg_only

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            given = kwargs.get("dtype") if kw_only or len(args) <= dtype_pos else args[dtype_pos]
            if given is None and args and isinstance(args[0], torch.Tensor) and (
                args[0].is_floating_point() and args[0].dtype != torch.float64
            ):
                if kw_only or len(args) <= dtype_pos:
                    kwargs = {**kwargs, "dtype": torch.float32}
                else:
                    args = (*args[:dtype_pos], torch.float32, *args[dtype_pos + 1:])
            return op(*args, **kwargs)
    return kernel


def _promote_kernel(op: Any):  # noqa: ANN202
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            floats: list[torch.dtype] = []
            tree_map(lambda t: floats.append(t.dtype) if isinstance(t, torch.Tensor)
                     and t.is_floating_point() else None, (args, kwargs))
            if floats:
                widest = floats[0]
                for dt in floats[1:]:
                    widest = torch.promote_types(widest, dt)
                args, kwargs = tree_map(
                    lambda t: t.to(widest) if isinstance(t, torch.Tensor)
                    and t.is_floating_point() and t.dtype != widest else t, (args, kwargs))
            return op(*args, **kwargs)
    return kernel


@contextlib.contextmanager
def cuda_autocast_rules() -> Iterator[None]:
    """Give CPU autocast CUDA's fp32 / set-opt-dtype / promote policies while active."""
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for table, make in ((FP32_OPS, _fp32_kernel), (SET_OPT_DTYPE_OPS, _set_opt_dtype_kernel),
                                (PROMOTE_OPS, _promote_kernel)):
                for name, overload in table:
                    packet = getattr(aten, name, None)
                    op = getattr(packet, overload, None) if packet is not None else None
                    if op is None:
                        continue
                    qual = name if overload == "default" else f"{name}.{overload}"
                    lib.impl(qual, make(op), "AutocastCPU")
        yield
    finally:
        lib._destroy()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def flash_backward_workspace(q: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:
    """FlashAttention-2 mha_bwd scratch buffers for q (b, a, s, d), k (b, g, s_k, d)."""
    b, a, s, d = q.shape
    sk = k.shape[2]
    d_r = _round_up(d, 32 if d <= 128 else 64)
    out = [q.new_empty((b, a, _round_up(s, 128)), dtype=torch.float32),  # softmax_d
           q.new_empty((b, _round_up(s, 128), a, d_r), dtype=torch.float32)]  # dq_accum
    if k.shape[1] != a:
        out += [q.new_empty((b, sk, a, d)), q.new_empty((b, sk, a, d))]  # dk/dv_expanded
    return out


def efficient_backward_workspace(q: torch.Tensor) -> list[torch.Tensor]:
    """The memory-efficient kernel's backward scratch for q (b, a, s, d) in 16-bit (CUTLASS
    kernels that compute delta themselves: attention_backward.cu `_efficient_attention_backward`
    allocates `delta` (b, a, s) fp32 and the `p.workspace_size()` bytes, whose grad-Q
    accumulator is fp32 per (batch, head) at s rounded up to kBlockSizeI (64) by d rounded
    up to the grad-Q tile's width (64): kernel_backward.h `workspace_elements_gq`). fp32
    inputs form delta from an fp32 (b, s, a, d) product of d out and out instead."""
    b, a, s, d = q.shape
    out = [q.new_empty((b, a, s), dtype=torch.float32),  # delta
           q.new_empty((b, a, _round_up(s, 64), _round_up(d, 64)), dtype=torch.float32)]
    if q.dtype == torch.float32:
        out.append(q.new_empty((b, s, a, d)))  # (grad_out * out) before its sum
    return out


def efficient_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    """scaled_dot_product_attention with a float attn_mask as CUDA runs it when the mask
    requires grad (T5's position bias): sdp_utils_cpp.h `check_attn_mask_shape` refuses a mask
    that requires grad, so neither cuDNN nor CPU flash takes it, flash takes no mask at all
    (`check_for_attn_mask`), and the memory-efficient kernel runs (attention.cpp
    `scaled_dot_product_attention`, efficient_attention case): `preprocess_mask` pads the
    mask's last dimension to 8 elements (`pad_bias`) unless every stride but the last is a
    multiple of 8 and the last is 1, then expands it to (b, a, q, k) (a view), and
    `_scaled_dot_product_efficient_attention` saves q, k, v, that mask, its output and the
    fp32 logsumexp (b, a, q₃₂) (derivatives.yaml; torch's meta kernel gives the shapes). Under
    autocast SDPA is on the lower-precision list: fp32 inputs, the mask too, are cast."""
    if torch.is_autocast_enabled("cpu"):
        low = torch.get_autocast_dtype("cpu")
        q, k, v, mask = (t.to(low) if t.dtype == torch.float32 else t for t in (q, k, v, mask))
    if any(st % 8 for st in mask.stride()[:-1]) or mask.stride(-1) != 1:
        n = mask.shape[-1]
        mask = torch.nn.functional.pad(mask, (0, 8 - n % 8))[..., :n]
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    with torch.autocast("cpu", enabled=False):
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, lse, dropout_p, is_causal, scale=scale)[0]


@contextlib.contextmanager
def cuda_biased_sdpa() -> Iterator[None]:
    """While active, F.scaled_dot_product_attention with a float attn_mask runs CUDA's
    memory-efficient kernel (`efficient_sdpa`) instead of the CPU math path (the CPU takes
    math for a mask that requires grad, which keeps the (b, a, q, k) scores). transformers'
    sdpa_attention_forward looks the function up at call time."""
    F = torch.nn.functional
    original = F.scaled_dot_product_attention

    def sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
             is_causal: bool = False, scale: float | None = None, **kw: Any) -> Any:
        if attn_mask is None or attn_mask.dtype == torch.bool or kw.get("enable_gqa"):
            return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, **kw)
        return efficient_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)

    F.scaled_dot_product_attention = sdpa  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original  # type: ignore[assignment]


# softmax and log_softmax (forward: the input; backward: the gradient and the output) on
# strided tensors: host_softmax / host_softmax_backward copy them contiguous first
_SOFTMAX_OPS = {aten._softmax.default: 1, aten._log_softmax.default: 1,
                aten._softmax_backward_data.default: 2,
                aten._log_softmax_backward_data.default: 2}


def rewrite_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               track: Callable[[Any], None]) -> tuple[bool, Any]:
    """Run `func` as CUDA would allocate it, when that differs from CPU: (handled, result).

    `track` counts tensors the CUDA kernel allocates internally (scratch buffers), which
    are freed again before the result returns.
    """
    if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
        q = args[0]
        out, lse = func(*args, **kwargs)
        b, a, s, d = out.shape
        out = q.new_empty((b, s, a, d)).transpose(1, 2)  # FlashAttention-2 layout
        lse = q.new_empty((b, a, s), dtype=torch.float32)
        return True, (out, lse)
    if func is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        result = func(*args, **kwargs)  # dq, dk, dv are allocated first, then the scratch
        tree_map(track, result)
        scratch = flash_backward_workspace(args[1], args[2])
        for t in scratch:
            track(t)
        del scratch, t
        return True, result
    if func is aten._scaled_dot_product_efficient_attention_backward.default:
        result = func(*args, **kwargs)  # dq, dk, dv, d bias, then the scratch
        tree_map(track, result)
        scratch = efficient_backward_workspace(args[1])
        for t in scratch:
            track(t)
        del scratch, t
        return True, result
    if func in _SOFTMAX_OPS and not all(
            t.is_contiguous() for t in args[:_SOFTMAX_OPS[func]]):
        result = func(*args, **kwargs)  # the output first (the structured kernel's), then
        track(result)                   # the contiguous copies of its strided inputs
        scratch = [t.new_empty(t.shape) for t in args[:_SOFTMAX_OPS[func]]
                   if not t.is_contiguous()]
        for t in scratch:
            track(t)
        del scratch, t
        return True, result
    if func is aten.native_layer_norm.default and args[0].dtype in _LOW:
        out, mean, rstd = func(*args, **kwargs)
        return True, (out, mean.new_empty(mean.shape, dtype=torch.float32),
                      rstd.new_empty(rstd.shape, dtype=torch.float32))
    if func is aten._local_scalar_dense.default:
        t = args[0]
        if t.dtype == torch.bool:
            return True, True
        return True, 1.0 if t.is_floating_point() else 1
    return False, None
