"""What a compiled region keeps for backward, asked of torch itself.

`torch.compile` hands a region's joint forward-backward graph to AOTAutograd, which splits
it with inductor's partitioner (`min_cut_rematerialization_partition`, after inductor's
decompositions, torch/_inductor/compile_fx.py): the forward graph returns the region's
outputs followed by the tensors the backward graph needs. `compiled_saved` runs a function
through the same partitioner under FakeTensorMode with a compiler that only records the
forward graph, so the answer is torch's, not vramcalc's; no kernel is generated or run.

`torchtune_cross_entropy` is torchtune's compiled function, written from its source
(pytorch/torchtune 1814feb, torchtune/modules/loss/ce_chunked_output_loss.py
`CEWithChunkedOutputLoss.compute_cross_entropy`, which `training.compile_loss` compiles).

torch is imported only when these run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SavedTensor:
    """One tensor the forward graph hands to the backward graph."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_input: bool  # a graph input kept alive (no new allocation of the region)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def torchtune_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                            ignore_index: int = -100) -> torch.Tensor:
    """Upcast one chunk's logits to fp32 and sum its token losses (torchtune's
    `compute_cross_entropy`)."""
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index,
                           reduction="sum")


def compiled_saved(fn: Callable[..., Any], *args: torch.Tensor,
                   inductor: bool = True) -> list[SavedTensor]:
    """The tensors `fn`'s compiled forward keeps for its backward. `args` are fake or meta
    tensors (a FakeTensorMode must be active for fake ones). `inductor=False` partitions
    the undecomposed graph with AOTAutograd's default partitioner, which keeps what the
    eager operators' autograd formulas keep."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import (
        default_partition,
        min_cut_rematerialization_partition,
    )

    graphs: list[Any] = []

    def record(gm: Any, _inputs: Any) -> Any:
        graphs.append(gm)
        return gm

    def noop(gm: Any, _inputs: Any) -> Any:
        return gm

    kwargs: dict[str, Any] = {"fw_compiler": record, "bw_compiler": noop}
    if inductor:
        from torch._inductor.decomposition import select_decomp_table

        kwargs.update(partition_fn=min_cut_rematerialization_partition,
                      decompositions=select_decomp_table())
    else:
        kwargs.update(partition_fn=default_partition)
    out = aot_function(fn, **kwargs)(*args)
    n_out = len(out) if isinstance(out, (tuple, list)) else 1
    (gm,) = graphs
    return _forward_saved(gm, n_out)


def _forward_saved(gm: Any, n_out: int) -> list[SavedTensor]:
    """The tensors a partitioned forward graph returns after its `n_out` outputs, each
    storage once (a view of a saved tensor, or of an input, shares its storage)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    aten = torch.ops.aten
    views = {aten.detach.default, aten.alias.default, aten.t.default, aten.permute.default,
             aten.view.default, aten._unsafe_view.default, aten.transpose.int,
             aten.expand.default, aten.select.int, aten.slice.Tensor, aten.unsqueeze.default,
             aten.squeeze.dim, aten.squeeze.default, aten.as_strided.default}

    def base(node: Any) -> Any:
        while node.op == "call_function" and node.target in views:
            node = node.args[0]
        return node

    saved: dict[str, SavedTensor] = {}
    for node in output.args[0][n_out:]:
        root = base(node)
        val = root.meta.get("val")
        if isinstance(val, torch.Tensor) and root.name not in saved:
            saved[root.name] = SavedTensor(root.name, tuple(int(d) for d in val.shape),
                                           val.dtype, root.op == "placeholder")
    return list(saved.values())


def dynamo_saved(fn: Callable[..., Any], *args: torch.Tensor) -> list[SavedTensor]:
    """What `torch.compile(fn)` keeps for its backward: dynamo captures the graph (tensor
    subclasses and autograd.Functions as torch.compile really traces them), then the same
    decompositions and min-cut partitioner as `compiled_saved`; `args` are small real CPU
    tensors (the graph is traced and run once, no code is generated). Parameters and other
    graph inputs are marked `is_input`."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs: list[Any] = []

    def record(gm: Any, _inputs: Any) -> Any:
        graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=record, bw_compiler=lambda gm, _i: gm,
                           partition_fn=min_cut_rematerialization_partition,
                           decompositions=select_decomp_table())
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return _forward_saved(graphs[-1], len(out) if isinstance(out, (tuple, list)) else 1)


# ---- torchtune's transformer layer, written from its source (1814feb) --------------------
def _rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """torchtune/modules/rms_norm.py `RMSNorm.forward`."""
    x_fp32 = x.float()
    normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)
    return normed * scale


def _rope(x: torch.Tensor, cache: torch.Tensor,
          input_pos: torch.Tensor | None = None) -> torch.Tensor:
    """torchtune/modules/position_embeddings.py `RotaryPositionalEmbeddings.forward`: the
    cache's first s rows, or with input_pos (packed batches) the gather `cache[input_pos]`."""
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    rows = cache[: x.size(1)] if input_pos is None else cache[input_pos]
    rope = rows.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
    out = torch.stack([xshaped[..., 0] * rope[..., 0] - xshaped[..., 1] * rope[..., 1],
                       xshaped[..., 1] * rope[..., 0] + xshaped[..., 0] * rope[..., 1]], -1)
    return out.flatten(3).type_as(x)


def _qkv(x: torch.Tensor, n1: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
         wv: torch.Tensor, heads: int, kv_heads: int, *rope: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention.py `MultiHeadAttention.forward` up to `_attention_call`: the normed input's
    projections, RoPE on q and k, k and v expanded to `heads` (b, heads, s, d)."""
    b, s, _ = x.shape
    d = wq.shape[0] // heads
    y = _rms_norm(x, n1)
    q = _rope(F.linear(y, wq).view(b, s, heads, d), *rope).transpose(1, 2)
    k = _rope(F.linear(y, wk).view(b, s, kv_heads, d), *rope).transpose(1, 2)
    v = F.linear(y, wv).view(b, s, kv_heads, d).transpose(1, 2)
    if heads != kv_heads:
        shape = (b, kv_heads, heads // kv_heads, s, d)
        k = k.unsqueeze(2).expand(shape).flatten(1, 2)
        v = v.unsqueeze(2).expand(shape).flatten(1, 2)
    return q, k, v


def _after_attention(x: torch.Tensor, out: torch.Tensor, wo: torch.Tensor, n2: torch.Tensor,
                     w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """The layer after `_attention_call`: output_proj, residual, the MLP's norm and SwiGLU."""
    b, s, _ = x.shape
    h = x + F.linear(out.transpose(1, 2).contiguous().view(b, s, -1), wo)
    z = _rms_norm(h, n2)
    return h + F.linear(F.silu(F.linear(z, w1)) * F.linear(z, w3), w2)


def torchtune_layer(heads: int, kv_heads: int) -> Callable[..., torch.Tensor]:
    """A `TransformerSelfAttentionLayer` of torchtune's Llama (modules/transformer.py,
    attention.py `MultiHeadAttention.forward` without a mask or KV cache, feed_forward.py
    SwiGLU), as a function of (x, the weights, the rope cache[, input_pos])."""

    def layer(x: torch.Tensor, n1: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
              wv: torch.Tensor, wo: torch.Tensor, n2: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, w3: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        q, k, v = _qkv(x, n1, wq, wk, wv, heads, kv_heads, *rope)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return _after_attention(x, out, wo, n2, w1, w2, w3)

    return layer


def torchtune_layer_parts(heads: int, kv_heads: int
                          ) -> tuple[Callable[..., Any], Callable[..., torch.Tensor]]:
    """The two graphs of a compiled torchtune layer on packed batches with flex attention:
    attention_utils.py `compile_friendly_flex_attention` is `torch.compiler.disable`d, so
    the compiled layer breaks there. The first maps (x, n1, wq, wk, wv, cache, input_pos)
    to (q, k, v); the second (x, the attention output, wo, n2, w1, w2, w3) to the layer's
    output."""

    def before(x: torch.Tensor, n1: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
               wv: torch.Tensor, cache: torch.Tensor, input_pos: torch.Tensor) -> Any:
        return _qkv(x, n1, wq, wk, wv, heads, kv_heads, cache, input_pos)

    return before, _after_attention


# ---- torchao's NF4 linear (QLoRA in torchtune), written from its source (v0.5.0) --------
def _nf4_weight(shape: tuple[int, int], packed: torch.Tensor, scalers: torch.Tensor,
                factor: torch.Tensor, mean: torch.Tensor, table: torch.Tensor
                ) -> torch.Tensor:
    """torchao/dtypes/nf4tensor.py `NF4Tensor.get_original_weight` with
    `dequantize_scalers`: the high and low 4-bit codes widened to int64 and looked up in the
    bf16 table, the int8 scalers divided by their per-256 factors plus the mean, each code
    scaled by its block's scaler (64 elements), the halves interleaved by `torch.stack`."""
    first, second = (packed >> 4).to(torch.long), (packed & 0b1111).to(torch.long)
    blocks = scalers.numel() // factor.numel()
    scale = (scalers.view(-1, blocks) / factor.unsqueeze(-1)).flatten().to(table.dtype) + mean
    rep = scale.unsqueeze(-1).expand(scale.size(0), 32).flatten()  # block_size // 2
    lo = (table[first] * rep).unsqueeze(-1).transpose(0, 1)
    hi = (table[second] * rep).unsqueeze(-1).transpose(0, 1)
    return torch.stack([lo, hi], dim=-1).reshape(shape)


class _LinearNF4(torch.autograd.Function):
    """nf4tensor.py `LinearNF4`: forward saves the NF4 weight (its inner tensors) and runs
    F.linear on the dequantized weight; backward dequantizes again for dL/dx."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shape: tuple[int, int],
                *nf4: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(*nf4)
        ctx.shape = shape
        return F.linear(x, _nf4_weight(shape, *nf4).to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        weight = _nf4_weight(ctx.shape, *ctx.saved_tensors).to(grad.dtype)
        return (grad @ weight, None, *([None] * len(ctx.saved_tensors)))


def torchao_nf4_linear(out_features: int, in_features: int) -> Callable[..., torch.Tensor]:
    """`linear_nf4(x, weight)` of a frozen (out, in) NF4 weight, as a function of x and the
    weight's packed codes (uint8, n/2), int8 scalers (n/64), bf16 factors (n/64/256), bf16
    mean and 16-entry bf16 table."""

    def linear(x: torch.Tensor, *nf4: torch.Tensor) -> torch.Tensor:
        return _LinearNF4.apply(x, (out_features, in_features), *nf4)

    return linear
