"""What an older PyTorch release keeps for backward, replayed by the trace on the current one.

torch < 1.11 (`--torch-version`, TrainingConfig.softmax_keeps_input): the autograd formulas
of softmax and log_softmax were `_softmax_backward_data(grad, result, dim, self)` and
`_log_softmax_backward_data(grad, result, dim, self)`, so their nodes kept the input beside
the output although the kernels read only the output (pytorch/pytorch#64000);
pytorch/pytorch#66018 (October 2021) passes the input's dtype instead, first released in
1.11 (transformers v4.20.0 src/transformers/pytorch_utils.py `softmax_backward_data` passes
the input tensor when `is_torch_less_than_1_11`).

`keep_softmax_input()` swaps `F.softmax`, `F.log_softmax` and `F.cross_entropy` (ATen's
`cross_entropy_loss` is `nll_loss(log_softmax(input, 1))` for class targets) for versions
whose node keeps the input, as those releases did, while a trace runs. Under autocast the
input kept is CUDA's fp32 copy (softmax and log_softmax are on its fp32 list).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _keeping_function() -> Any:
    import torch

    class KeepInput(torch.autograd.Function):
        """softmax / log_softmax whose node keeps (input, output), as torch < 1.11."""

        @staticmethod
        def forward(ctx: Any, x: Any, dim: int, log: bool, dtype: Any) -> Any:
            low = x.dtype in (torch.float16, torch.bfloat16)
            if dtype is None and low and torch.is_autocast_enabled("cpu"):
                dtype = torch.float32  # CUDA autocast's fp32 policy for (log_)softmax
            xin = x.to(dtype) if dtype is not None and dtype != x.dtype else x
            out = (torch._log_softmax if log else torch._softmax)(xin, dim, False)
            ctx.save_for_backward(xin, out)
            ctx.dim, ctx.log, ctx.in_dtype = dim, log, x.dtype
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            xin, out = ctx.saved_tensors
            fn = torch._log_softmax_backward_data if ctx.log else torch._softmax_backward_data
            dx = fn(grad, out, ctx.dim, xin.dtype)
            return dx.to(ctx.in_dtype), None, None, None

    return KeepInput


@contextlib.contextmanager
def keep_softmax_input() -> Iterator[None]:
    """While active, softmax and log_softmax keep their input for backward (module doc)."""
    import torch.nn.functional as F

    keep = _keeping_function()
    saved = F.softmax, F.log_softmax, F.cross_entropy

    def softmax(x: Any, dim: int | None = None, _stacklevel: int = 3,
                dtype: Any = None) -> Any:
        return keep.apply(x, dim if dim is not None else -1, False, dtype)

    def log_softmax(x: Any, dim: int | None = None, _stacklevel: int = 3,
                    dtype: Any = None) -> Any:
        return keep.apply(x, dim if dim is not None else -1, True, dtype)

    def cross_entropy(x: Any, target: Any, weight: Any = None, size_average: Any = None,
                      ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                      label_smoothing: float = 0.0) -> Any:
        if label_smoothing or target.is_floating_point():
            raise NotImplementedError("--torch-version < 1.11: cross entropy with label "
                                      "smoothing or probability targets is not replayed")
        return F.nll_loss(log_softmax(x, 1), target, weight, None, ignore_index, None,
                          reduction)

    F.softmax, F.log_softmax, F.cross_entropy = softmax, log_softmax, cross_entropy  # type: ignore[assignment]
    try:
        yield
    finally:
        F.softmax, F.log_softmax, F.cross_entropy = saved  # type: ignore[assignment]
