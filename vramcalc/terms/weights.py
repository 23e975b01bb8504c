"""Term: weights — the parameters one rank stores, in the policy's weight dtype.

bytes = Σ_tensors count · round512(⌈numel/tp⌉ / shard · bits/8), shard = the ZeRO-3/FSDP
group (1 otherwise), in the engine's layout (vramcalc.sharding: FSDP2 pads dim 0,
DeepSpeed ZeRO-3 keeps tensors ≤ 1e5 elements whole and partitions the rest into one flat
buffer, ZeRO-1/2 flatten the weights into one buffer). Parameter offload (ZeRO-3
offload_param, FSDP2 CPUOffloadPolicy) leaves none on the device.
Source: ZeRO paper (Rajbhandari et al. 2019) Sec. 5 for the ÷N_d of P_os+g+p.
Under LoRA/QLoRA/DoRA the base is frozen (QLoRA: NF4) and adapters are added:
vramcalc/finetune.py `weight_parts`.
"""

from __future__ import annotations

from vramcalc.terms.context import RankContext

GROUPS: tuple[str, ...] = ("embedding", "layer", "expert", "final", "head")


def weights_by_group(ctx: RankContext) -> dict[str, int]:
    """Device bytes of weights per group (embedding, layer, expert, final, head)."""
    if "params" in ctx.parallel.offload:
        return {}
    if ctx.training.finetune != "full":  # frozen base, NF4 data and constants, adapters
        from vramcalc.finetune import weight_parts as ft_parts

        return {k.split("/", 1)[1]: v for k, v in ft_parts(ctx).items()}
    dtype = ctx.training.weight_dtype
    shard = ctx.param_shard
    es = ctx.expert_shard(shard)
    layout = ctx.weight_layout
    shapes = ctx.shapes
    present = {t.group for t in shapes.tensors}
    return {g: shapes.nbytes(dtype, shard, es, layout, (g,)) for g in GROUPS if g in present}


def weight_parts(ctx: RankContext) -> dict[str, int]:
    """The weights term as report keys: {"weights": bytes}, or under LoRA/QLoRA/DoRA its
    sub-terms weights/frozen, weights/nf4, weights/nf4_constants, weights/adapters."""
    groups = weights_by_group(ctx)
    if ctx.training.finetune == "full" or not groups:
        return {"weights": sum(groups.values())}
    return {f"weights/{k}": v for k, v in groups.items()}


def weights_bytes(ctx: RankContext) -> int:
    """Total device bytes of weights on this rank."""
    return sum(weights_by_group(ctx).values())
