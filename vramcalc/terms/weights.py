"""Term: weights — the parameters one rank stores, in the policy's weight dtype.

bytes = Σ_tensors count · round512(⌈numel/tp⌉ / shard · bits/8), shard = the ZeRO-3/FSDP
group (1 otherwise), in the engine's layout (vramcalc.sharding: FSDP2 pads dim 0,
DeepSpeed ZeRO-3 keeps tensors ≤ stage3_param_persistence_threshold (1e5) elements whole and partitions the rest into one flat
buffer, ZeRO-1/2 flatten the weights into one buffer). Parameter offload (ZeRO-3
offload_param, FSDP2 CPUOffloadPolicy) leaves none on the device.
Source: ZeRO paper (Rajbhandari et al. 2019) Sec. 5 for the ÷N_d of P_os+g+p.
Under LoRA/QLoRA/DoRA the base is frozen (QLoRA: NF4) and adapters are added
(`finetune_weight_parts`, shapes from vramcalc/finetune.py).
"""

from __future__ import annotations

from vramcalc.features import finetunes
from vramcalc.finetune import nf4_constant_bytes, shapes_for
from vramcalc.rank import RankContext
from vramcalc.terms.torchtitan import freqs_cis_bytes
from vramcalc.terms.torchtune import rope_buffer_bytes
from vramcalc.units import alloc

GROUPS: tuple[str, ...] = ("embedding", "layer", "expert", "final", "head")


def weights_by_group(ctx: RankContext) -> dict[str, int]:
    """Device bytes of weights per group (embedding, layer, expert, final, head); under
    parameter offload only bitsandbytes' NF4 constants (`resident_constants`)."""
    if "params" in ctx.parallel.offload:
        kept = resident_constants(ctx)
        return {"nf4_constants": kept} if kept else {}
    return _weight_groups(ctx)


def resident_constants(ctx: RankContext) -> int:
    """What parameter offload leaves on the device: bitsandbytes' QuantState (absmax and
    codes), module metadata rather than a parameter, which ZeRO-3's and FSDP's offload do not
    move (torchao's scalers are parameters and move with their NF4Tensor)."""
    if not finetunes(ctx.training) or ctx.training.nf4.impl != "bnb":
        return 0
    return finetune_weight_parts(ctx).get("weights/nf4_constants", 0)


def offloaded_weight_bytes(ctx: RankContext) -> int:
    """Host bytes of this rank's parameters under parameter offload: what the device would
    hold without it (the frozen base in its storage, NF4 data, adapters), less
    `resident_constants`."""
    return sum(_weight_groups(ctx).values()) - resident_constants(ctx)


def _weight_groups(ctx: RankContext) -> dict[str, int]:
    if finetunes(ctx.training):  # frozen base, NF4 data and constants, adapters
        return {k.split("/", 1)[1]: v for k, v in finetune_weight_parts(ctx).items()}
    dtype = ctx.training.weight_dtype
    shard = ctx.param_shard
    es = ctx.expert_shard(shard)
    layout = ctx.weight_layout
    shapes = ctx.shapes
    present = {t.group for t in shapes.tensors}
    keep = ctx.parallel.deepspeed.param_persistence_threshold
    return {g: shapes.nbytes(dtype, shard, es, layout, (g,), keep) for g in GROUPS if g in present}


def weight_parts(ctx: RankContext) -> dict[str, int]:
    """The weights term as report keys: {"weights": bytes}, or under LoRA/QLoRA/DoRA its
    sub-terms weights/frozen, weights/nf4, weights/nf4_constants, weights/adapters."""
    groups = weights_by_group(ctx)
    if ctx.training.framework == "torchtitan":  # + the freqs_cis buffer, on every rank
        return {"weights": sum(groups.values()), "weights/buffers": freqs_cis_bytes(ctx)}
    if ctx.spec.model_type == "modernbert":  # inv_freq, original_inv_freq (d/2) per type
        types = 2 if ctx.spec.num_sliding_layers else 1
        return {"weights": sum(groups.values()),
                "weights/buffers": 2 * types * alloc(ctx.spec.head_size // 2, "fp32")}
    if ctx.spec.is_encoder:  # BertEmbeddings' position_ids and token_type_ids (1, P) int64
        return {"weights": sum(groups.values()),
                "weights/buffers": 2 * alloc(ctx.spec.max_position_embeddings, "int64")}
    if not finetunes(ctx.training) or not groups:
        out = {"weights": sum(groups.values())}
    else:
        out = {f"weights/{k}": v for k, v in groups.items()}
    if ctx.training.framework == "torchtune" and (rope := rope_buffer_bytes(ctx)):
        out["weights/buffers"] = rope  # RoPE's theta and cache
    return out


def finetune_weight_parts(ctx: RankContext) -> dict[str, int]:
    """Device bytes of the rank's weights by sub-term under LoRA/QLoRA/DoRA: weights/frozen
    (base in the policy's dtype), weights/nf4 (packed 4-bit data), weights/nf4_constants
    (absmax, codes), weights/adapters. Sharded like any parameter under ZeRO-3/FSDP;
    bitsandbytes' NF4 constants are kept whole on every rank (its QuantState is not a
    parameter), torchao's scalers are sharded with their NF4Tensor under FSDP2
    (vramcalc.qlora.nf4_constant_bytes)."""
    fs = shapes_for(ctx)
    tr = ctx.training
    shard = ctx.param_shard
    es = ctx.expert_shard(shard)
    layout = ctx.weight_layout
    keep = ctx.parallel.deepspeed.param_persistence_threshold
    out = {"weights/frozen": fs.frozen.nbytes(tr.weight_dtype, shard, es, layout, None, keep)}
    if fs.quantized.tensors:
        out["weights/nf4"] = fs.quantized.nbytes("nf4", shard, es, layout, None, keep)
        nf4 = tr.nf4
        split = ctx.engine == "fsdp2"
        out["weights/nf4_constants"] = sum(
            t.count * nf4_constant_bytes(t.numel, nf4, (es if t.is_expert else shard)
                                         if split else 1)
            for t in fs.quantized.tensors)
    out["weights/adapters"] = fs.adapters.nbytes(
        tr.adapter_dtype, shard, es, layout, None, keep)
    return out


def weights_bytes(ctx: RankContext) -> int:
    """Total device bytes of weights on this rank."""
    return sum(weights_by_group(ctx).values())
