"""Term: gradients — one gradient per parameter in the policy's grad dtype.

bytes = Σ_tensors count · round512(numel_local / shard · bits/8), shard = ZeRO-2+/FSDP group.
Under ZeRO-2 the full-size gradient of a bucket exists transiently before its
reduce-scatter (counted in transients). Gradient offload keeps none on the device.
Source: ZeRO paper Sec. 5 (P_os+g: 2Ψ + 14Ψ/N_d includes 2Ψ/N_d gradients).
"""

from __future__ import annotations

from vramcalc.sharding import sharded_numel
from vramcalc.terms.context import RankContext
from vramcalc.units import alloc


def gradients_bytes(ctx: RankContext) -> int:
    """Device bytes of all gradients held on this rank once backward has finished."""
    if "gradients" in ctx.parallel.offload:
        return 0
    dtype = ctx.training.grad_dtype
    shard = ctx.grad_shard
    return sum(t.count * alloc(sharded_numel(t.numel, shard), dtype) for t in ctx.tensors)


def layer_gradient_bytes(ctx: RankContext) -> int:
    """Gradient bytes of one transformer layer on this rank (per-layer backward step)."""
    if "gradients" in ctx.parallel.offload:
        return 0
    dtype = ctx.training.grad_dtype
    shard = ctx.grad_shard
    n = ctx.num_layers
    total = sum(
        t.count * alloc(sharded_numel(t.numel, shard), dtype)
        for t in ctx.tensors
        if t.group in ("layer", "expert")
    )
    return total // n if n else 0
