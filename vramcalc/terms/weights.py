"""Term: weights — the parameters one rank stores, in the policy's weight dtype.

bytes = Σ_tensors count · round512(⌈numel/tp⌉ / shard · bits/8), shard = ZeRO-3/FSDP group
(1 otherwise). Parameter offload (ZeRO-3 offload_param) leaves none on the device.
Source: ZeRO paper (Rajbhandari et al. 2019) Sec. 5 for the ÷N_d of P_os+g+p.
"""

from __future__ import annotations

from vramcalc.sharding import sharded_numel
from vramcalc.terms.context import RankContext
from vramcalc.units import alloc


def weights_by_group(ctx: RankContext) -> dict[str, int]:
    """Device bytes of weights per group (embedding, layer, expert, final, head)."""
    if "params" in ctx.parallel.offload:
        return {}
    dtype = ctx.training.weight_dtype
    shard = ctx.param_shard
    out: dict[str, int] = {}
    for t in ctx.tensors:
        b = t.count * alloc(sharded_numel(t.numel, shard), dtype)
        out[t.group] = out.get(t.group, 0) + b
    return out


def weights_bytes(ctx: RankContext) -> int:
    """Total device bytes of weights on this rank."""
    return sum(weights_by_group(ctx).values())
