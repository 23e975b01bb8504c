"""Term: optimizer_states — optimizer state tensors plus the fp32 master copy.

Per parameter tensor of numel n (after sharding), in the state dtype (fp32 by default):

| optimizer    | state elements                     | source |
|--------------|------------------------------------|--------|
| adam, adamw  | 2n (exp_avg, exp_avg_sq)           | torch.optim.AdamW |
| sgd          | 0                                  | torch.optim.SGD (momentum=0) |
| sgd-momentum | n (momentum_buffer)                | torch.optim.SGD |
| lion         | n (exp_avg)                        | Chen et al. 2023, Alg. 2 |
| adafactor    | rows + cols for a matrix, n for a vector | torch.optim.Adafactor (beta1=None) |
| adamw-8bit   | 2n uint8 + 2·⌈n/2048⌉ fp32 absmax  | bitsandbytes blockwise 8-bit Adam (Dettmers et al. 2022, block 2048) |

Mixed precision `bf16`/`fp16` adds an fp32 master copy (4n): the ZeRO paper's K = 12 with
Adam = 4 (master) + 8 (m, v). Sharded ÷N_d from ZeRO-1 (DeepSpeed flat partitions,
Megatron's distributed optimizer over DP×CP, FSDP2 DTensor shards). Megatron-LM with fp16
weights also keeps fp32 main gradients in the optimizer (4n, counted with the master:
Megatron docs, fp16 row 20 = 2 + 2 + 16). Offloaded ones move to host RAM
(`host_bytes_per_node`).
"""

from __future__ import annotations

from vramcalc.sharding import RankTensor, dim0_numel, sharded_numel
from vramcalc.terms.context import RankContext
from vramcalc.units import alloc, ceil_div

BNB_BLOCK = 2048  # bitsandbytes blockwise quantization block for optimizer states


def state_bytes_for_tensor(t: RankTensor, optimizer: str, state_dtype: str, shard: int,
                           dim0: bool = False) -> int:
    """Optimizer-state bytes of one tensor (one copy), allocator-rounded per state tensor."""
    n = dim0_numel(t, shard) if dim0 else sharded_numel(t.numel, shard)
    if optimizer in ("adam", "adamw"):
        return 2 * alloc(n, state_dtype)
    if optimizer in ("sgd-momentum", "lion"):
        return alloc(n, state_dtype)
    if optimizer == "sgd":
        return 0
    if optimizer == "adafactor":
        if t.rows and shard == 1:
            cols = t.numel // t.rows
            return alloc(t.rows, state_dtype) + alloc(cols, state_dtype)
        return alloc(n, state_dtype)
    if optimizer == "adamw-8bit":
        blocks = ceil_div(n, BNB_BLOCK)
        return 2 * alloc(n, "uint8") + 2 * alloc(blocks, "fp32")
    raise ValueError(f"unknown optimizer {optimizer}")


def _flat_state_bytes(n: int, optimizer: str, state_dtype: str) -> int:
    """States of one flat fp32 partition of n elements (DeepSpeed / Megatron buffers)."""
    if optimizer in ("adam", "adamw"):
        return 2 * alloc(n, state_dtype)
    if optimizer in ("sgd-momentum", "lion", "adafactor"):
        return alloc(n, state_dtype)  # a 1-D flat buffer: Adafactor cannot factor it
    if optimizer == "sgd":
        return 0
    if optimizer == "adamw-8bit":
        return 2 * alloc(n, "uint8") + 2 * alloc(ceil_div(n, BNB_BLOCK), "fp32")
    raise ValueError(f"unknown optimizer {optimizer}")


def has_master(ctx: RankContext) -> bool:
    """An fp32 master copy of the weights exists (16-bit weights, or Megatron fp16)."""
    return ctx.training.has_master_weights


def optimizer_state_split(ctx: RankContext) -> dict[str, int]:
    """Device bytes: {'states': ..., 'master': ...} on this rank."""
    if "optimizer" in ctx.parallel.offload or (ctx.engine == "fsdp2" and ctx.parallel.offload):
        return {"states": 0, "master": 0}
    return optimizer_state_split_on_device(ctx)


def optimizer_state_split_on_device(ctx: RankContext) -> dict[str, int]:
    """{'states', 'master'} as if nothing were offloaded (host RAM uses the same numbers)."""
    tr = ctx.training
    shard = ctx.state_shard
    es = ctx.expert_shard(shard)
    layout = ctx.state_layout
    shapes = ctx.shapes
    key = ("opt", tr.optimizer, tr.state_dtype, shard, es, layout, has_master(ctx),
           ctx.engine == "megatron" and ctx.training.weight_dtype == "fp16")
    hit = shapes._memo.get(key)
    if hit is not None:
        return dict(hit)
    if layout == "flat" and (shard > 1 or es > 1 or ctx.engine == "deepspeed"):
        states = 0
        for experts, n in ((False, shard), (True, es)):
            numel = sum(t.numel * t.count for t in shapes.tensors if t.is_expert == experts)
            if numel:
                states += _flat_state_bytes(ceil_div(numel, n), tr.optimizer, tr.state_dtype)
    else:
        dim0 = layout == "dim0"
        states = sum(
            t.count * state_bytes_for_tensor(t, tr.optimizer, tr.state_dtype,
                                             es if t.is_expert else shard, dim0)
            for t in shapes.tensors
        )
    master = 0
    if has_master(ctx):
        master = shapes.nbytes("fp32", shard, es, layout)
        if key[-1]:  # Megatron fp16: fp32 main gradients live in the optimizer too
            master *= 2
    shapes._memo[key] = (("states", states), ("master", master))
    return {"states": states, "master": master}


def optimizer_states_bytes(ctx: RankContext) -> int:
    """Total device bytes of optimizer states and master weights on this rank."""
    return sum(optimizer_state_split(ctx).values())
