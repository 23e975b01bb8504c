"""Term: optimizer_states — optimizer state tensors plus the fp32 master copy.

Per parameter tensor of numel n (after sharding), in the state dtype (fp32 by default):

| optimizer    | state elements                     | source |
|--------------|------------------------------------|--------|
| adam, adamw  | 2n (exp_avg, exp_avg_sq)           | torch.optim.AdamW |
| sgd          | 0                                  | torch.optim.SGD (momentum=0) |
| sgd-momentum | n (momentum_buffer)                | torch.optim.SGD |
| lion         | n (exp_avg)                        | Chen et al. 2023, Alg. 2 |
| adafactor    | rows/shard + cols for a matrix (dim-0 shards), n for a vector | torch.optim.Adafactor (beta1=None) |
| adamw-8bit   | 2n uint8 + 2·⌈n/2048⌉ fp32 absmax  | bitsandbytes blockwise 8-bit Adam (Dettmers et al. 2022, block 2048) |

Mixed precision `bf16`/`fp16` adds an fp32 master copy (4n): the ZeRO paper's K = 12 with
Adam = 4 (master) + 8 (m, v). Sharded ÷N_d from ZeRO-1; offloaded ones leave the device.
"""

from __future__ import annotations

from vramcalc.sharding import RankTensor, sharded_numel
from vramcalc.terms.context import RankContext
from vramcalc.units import alloc, ceil_div

BNB_BLOCK = 2048  # bitsandbytes blockwise quantization block for optimizer states
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes Optimizer8bit default min_8bit_size


def state_bytes_for_tensor(t: RankTensor, optimizer: str, state_dtype: str, shard: int) -> int:
    """Optimizer-state bytes of one tensor (one copy), allocator-rounded per state tensor."""
    n = sharded_numel(t.numel, shard)
    if optimizer in ("adam", "adamw"):
        return 2 * alloc(n, state_dtype)
    if optimizer in ("sgd-momentum", "lion"):
        return alloc(n, state_dtype)
    if optimizer == "sgd":
        return 0
    if optimizer == "adafactor":
        if t.rows:
            # factored second moment of the (dim-0 sharded, as FSDP2 shards) matrix
            cols = t.numel // t.rows
            return alloc(sharded_numel(t.rows, shard), state_dtype) + alloc(cols, state_dtype)
        return alloc(n, state_dtype)
    if optimizer == "adamw-8bit":
        if n < BNB_MIN_8BIT_SIZE:  # small tensors keep 32-bit states in bitsandbytes
            return 2 * alloc(n, "fp32")
        blocks = ceil_div(n, BNB_BLOCK)
        return 2 * alloc(n, "uint8") + 2 * alloc(blocks, "fp32")
    raise ValueError(f"unknown optimizer {optimizer}")


def optimizer_state_split(ctx: RankContext) -> dict[str, int]:
    """Device bytes: {'states': ..., 'master': ...} on this rank."""
    if "optimizer" in ctx.parallel.offload:
        return {"states": 0, "master": 0}
    tr = ctx.training
    shard = ctx.state_shard
    states = sum(
        t.count * state_bytes_for_tensor(t, tr.optimizer, tr.state_dtype, shard)
        for t in ctx.tensors
    )
    master = 0
    if tr.has_master_weights:
        master = sum(t.count * alloc(sharded_numel(t.numel, shard), "fp32") for t in ctx.tensors)
    return {"states": states, "master": master}


def optimizer_states_bytes(ctx: RankContext) -> int:
    """Total device bytes of optimizer states and master weights on this rank."""
    return sum(optimizer_state_split(ctx).values())
