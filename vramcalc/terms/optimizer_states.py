"""Term: optimizer_states — optimizer state tensors plus the fp32 master copy.

Per parameter tensor of numel n (after sharding), in the state dtype (fp32 by default):

| optimizer    | state elements                     | source |
|--------------|------------------------------------|--------|
| adam, adamw  | 2n (exp_avg, exp_avg_sq)           | torch.optim.AdamW |
| sgd          | 0                                  | torch.optim.SGD (momentum=0) |
| sgd-momentum | n (momentum_buffer)                | torch.optim.SGD |
| lion         | n (exp_avg)                        | Chen et al. 2023, Alg. 2 |
| adafactor    | rows + cols for a matrix, n for a vector | torch.optim.Adafactor (beta1=None) |
| adamw-8bit   | 2n uint8 + 2·⌈n/256⌉ fp32 absmax; 2n fp32 when n < 4096 | bitsandbytes blockwise 8-bit AdamW (Dettmers et al. 2022; block 256 since 0.44, min_8bit_size 4096) |
| paged-adamw  | 2n fp32 (bitsandbytes 32-bit kernel) | bitsandbytes PagedAdamW |
| paged-adamw-8bit | as adamw-8bit                  | bitsandbytes PagedAdamW8bit |
| muon         | n (momentum_buffer) for a layer's matrix, 2n (AdamW) for the rest | torch.optim.Muon (torch 2.9+; Jordan et al. 2024), AdamW on embeddings, head, norms, biases |

Paged optimizers keep the state buffers of tensors with at least 1e5 elements in CUDA unified
memory (bitsandbytes optim/optimizer.py `get_state_buffer`): those bytes are not in these
device terms (the allocator does not see them) but in `paged_split` (reported as overhead).
Only trainable tensors have states (`ctx.train_shapes`: the adapters under LoRA/QLoRA/DoRA).

Mixed precision `bf16`/`fp16` adds an fp32 master copy (4n): the ZeRO paper's K = 12 with
Adam = 4 (master) + 8 (m, v). Sharded ÷N_d from ZeRO-1 (DeepSpeed flat partitions,
Megatron's distributed optimizer over DP×CP, FSDP2 DTensor shards). Megatron-LM with fp16
weights also makes fp32 main gradients (4n, sharded as the master; Megatron docs, fp16 row
20 = 2 + 2 + 16), but only for the step: `_copy_model_grads_to_main_grads` sets each main
parameter's `.grad = main_grad.float()` (core/optimizer/optimizer.py, distrib_optimizer.py
at d98e8a64) and train_step's `optimizer.zero_grad()` drops them before the next forward
(training/training.py), so they are 'main_grads', counted in the optimizer phase only.
Offloaded ones move to host RAM (`host_bytes_per_node`).
"""

from __future__ import annotations

from vramcalc.features import finetunes
from vramcalc.finetune import module_param_count
from vramcalc.rank import RankContext
from vramcalc.sharding import RankTensor, dim0_numel, sharded_numel
from vramcalc.units import alloc, ceil_div, nbytes

# bitsandbytes 8-bit optimizer states: one fp32 absmax per block of 256 elements since
# bitsandbytes 0.44.0 (bitsandbytes#1365, 2024-09-20; 2048 before), and tensors with fewer
# than min_8bit_size = 4096 elements keep 32-bit states (optim/optimizer.py
# Optimizer2State.init_state, 0.50.1 @ 95f9af30). Paged states: tensors of >= 1e5 elements.
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
BNB_PAGED_MIN_NUMEL = 100_000
BNB_OPTIMIZERS = ("adamw-8bit", "paged-adamw", "paged-adamw-8bit")
PAGED_OPTIMIZERS = ("paged-adamw", "paged-adamw-8bit")
# the "dynamic" and "udynamic" 8-bit quantization maps (256 fp32 each), shared by all states
BNB_QMAP_BYTES = 2 * alloc(256, "fp32")


def bnb_state_split(n: int, optimizer: str) -> tuple[int, int]:
    """(device, unified-memory) bytes of a bitsandbytes AdamW's states for n elements: two
    uint8 states + two fp32 absmax per block (8-bit, n >= 4096) or two fp32 states; paged
    optimizers move the state buffers (not the absmax) of tensors >= 1e5 elements to unified
    memory, allocated outside the caching allocator (no 512-byte rounding)."""
    if optimizer.endswith("8bit") and n >= BNB_MIN_8BIT_SIZE:
        dtype, absmax = "uint8", 2 * alloc(ceil_div(n, BNB_BLOCK), "fp32")
    else:
        dtype, absmax = "fp32", 0
    if optimizer.startswith("paged-") and n >= BNB_PAGED_MIN_NUMEL:
        return absmax, 2 * nbytes(n, dtype)
    return 2 * alloc(n, dtype) + absmax, 0


def muon_matrix(t: RankTensor) -> bool:
    """A tensor torch.optim.Muon steps: a 2-D weight inside the layers (attention, MLP,
    experts, router); embeddings, the head, norms and biases go to AdamW."""
    return bool(t.rows) and t.group in ("layer", "expert")


def state_bytes_for_tensor(t: RankTensor, optimizer: str, state_dtype: str, shard: int,
                           dim0: bool = False) -> int:
    """Optimizer-state bytes of one tensor (one copy), allocator-rounded per state tensor."""
    n = dim0_numel(t, shard) if dim0 else sharded_numel(t.numel, shard)
    if optimizer == "muon":
        return (1 if muon_matrix(t) else 2) * alloc(n, state_dtype)
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
    if optimizer in BNB_OPTIMIZERS:
        return bnb_state_split(n, optimizer)[0]
    raise ValueError(f"unknown optimizer {optimizer}")


def _flat_state_bytes(n: int, optimizer: str, state_dtype: str) -> int:
    """States of one flat fp32 partition of n elements (DeepSpeed / Megatron buffers)."""
    if optimizer in ("adam", "adamw"):
        return 2 * alloc(n, state_dtype)
    if optimizer in ("sgd-momentum", "lion", "adafactor"):
        return alloc(n, state_dtype)  # a 1-D flat buffer: Adafactor cannot factor it
    if optimizer == "sgd":
        return 0
    if optimizer in BNB_OPTIMIZERS:
        return bnb_state_split(n, optimizer)[0]
    raise ValueError(f"unknown optimizer {optimizer}")


def has_master(ctx: RankContext) -> bool:
    """An fp32 master copy of the weights exists (16-bit weights, or Megatron fp16)."""
    return ctx.training.has_master_weights


def optimizer_state_split(ctx: RankContext) -> dict[str, int]:
    """Device bytes: {'states': ..., 'master': ..., 'main_grads': ...} on this rank."""
    if "optimizer" in ctx.parallel.offload or (ctx.engine == "fsdp2" and ctx.parallel.offload):
        return {"states": 0, "master": 0, "main_grads": 0}
    return optimizer_state_split_on_device(ctx)


def optimizer_state_split_on_device(ctx: RankContext) -> dict[str, int]:
    """{'states', 'master', 'main_grads'} as if nothing were offloaded (host RAM uses the
    same numbers)."""
    tr = ctx.training
    shard = ctx.state_shard
    es = ctx.expert_shard(shard)
    layout = ctx.state_layout
    shapes = ctx.train_shapes
    # fused torch Adam/AdamW keeps each parameter's step count on the device, a 0-dim fp32
    # tensor (torch/optim/adam.py `_init_group`: `device=p.device` when `group["fused"]`);
    # otherwise it is a host scalar. DeepSpeed and Megatron step their own fused optimizers.
    steps = (tr.optimizer in ("adam", "adamw") and tr.step_impl == "fused"
             and ctx.engine in ("single", "ddp", "fsdp2"))
    key = ("opt", tr.optimizer, tr.state_dtype, shard, es, layout, has_master(ctx),
           tr.optimizer_in_backward,
           ctx.engine == "megatron" and ctx.training.weight_dtype == "fp16", steps)
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
    if tr.optimizer.endswith("8bit"):
        # the two quantization maps, moved to the device once per optimizer
        # (`Optimizer2State.init_state`: `self.name2qmap[...].to(p.device)`): once, or per
        # 8-bit tensor with one optimizer per parameter (vramcalc/terms/optim_in_bwd.py)
        eight = sum(t.count for t in shapes.tensors if t.numel >= BNB_MIN_8BIT_SIZE)
        states += BNB_QMAP_BYTES * (eight if tr.optimizer_in_backward else min(eight, 1))
    if steps:
        count = (sum(t.count for t in shapes.tensors) if finetunes(tr) else
                 module_param_count(ctx.spec, tr.framework, shapes))
        states += count * alloc(1, "fp32")
    master = shapes.nbytes("fp32", shard, es, layout) if has_master(ctx) else 0
    main_grads = master if key[-2] else 0  # Megatron fp16: for the step (module docstring)
    shapes._memo[key] = (("states", states), ("master", master), ("main_grads", main_grads))
    return {"states": states, "master": master, "main_grads": main_grads}


def optimizer_states_bytes(ctx: RankContext) -> int:
    """Total device bytes of optimizer states and master weights on this rank."""
    return sum(optimizer_state_split(ctx).values())


def paged_split(ctx: RankContext) -> tuple[int, int]:
    """(device, unified-memory) optimizer-state bytes of a paged bitsandbytes optimizer on
    this rank (per-tensor states; flat partitions under DeepSpeed/Megatron count as one
    tensor each). (0, 0) for other optimizers or when the states are offloaded."""
    tr = ctx.training
    if not tr.optimizer.startswith("paged-") or "optimizer" in ctx.parallel.offload or (
            ctx.engine == "fsdp2" and ctx.parallel.offload):
        return 0, 0
    shard = ctx.state_shard
    es = ctx.expert_shard(shard)
    shapes = ctx.train_shapes
    key = ("paged", tr.optimizer, shard, es, ctx.state_layout)
    hit = shapes._memo.get(key)
    if hit is not None:
        return hit
    parts: list[tuple[int, int]] = []
    if ctx.state_layout == "flat" and (shard > 1 or es > 1 or ctx.engine == "deepspeed"):
        for experts, n in ((False, shard), (True, es)):
            numel = sum(t.numel * t.count for t in shapes.tensors if t.is_expert == experts)
            if numel:
                parts.append((ceil_div(numel, n), 1))
    else:
        for t in shapes.tensors:
            n = es if t.is_expert else shard
            numel = dim0_numel(t, n) if ctx.state_layout == "dim0" else sharded_numel(t.numel, n)
            parts.append((numel, t.count))
    device = paged = 0
    for numel, count in parts:
        d, p = bnb_state_split(numel, tr.optimizer)
        device += count * d
        paged += count * p
    shapes._memo[key] = (device, paged)
    return device, paged


def paged_residency(paged: int, usable: int | None, rest: int) -> tuple[int, int]:
    """(resident, spilled) bytes of `paged` unified-memory optimizer states beside `rest`
    bytes of ordinary device memory on a GPU with `usable` bytes (None: no GPU, all
    resident). Unified memory oversubscribes the device: the driver evicts managed pages to
    host RAM when device allocations need the room, and migrates them back on access
    (bitsandbytes' optimizer docs: paged optimizers "transfer memory from the GPU to the
    CPU when GPU memory is exhausted"), so only the free part stays resident and the rest
    lives in host RAM; torchtune fef3ed10's README runs a 7B full fine-tune with 54 GB of
    paged AdamW states on a 24 GB RTX 4090."""
    if usable is None:
        return paged, 0
    resident = min(paged, max(0, usable - rest))
    return resident, paged - resident


def paged_state_bytes(ctx: RankContext) -> int:
    """Optimizer-state bytes a paged bitsandbytes optimizer keeps in unified memory: the
    state buffers of trainable tensors with at least 1e5 elements (absmax buffers and small
    tensors stay in ordinary device memory); reported as overhead, not in the peak."""
    if ctx.training.optimizer not in PAGED_OPTIMIZERS:
        return 0
    return paged_split(ctx)[1]
