"""Term: transients — short-lived buffers: optimizer-step temporaries, autocast weight
casts, ZeRO/FSDP gather and reduce buffers, the cuBLAS workspace.
"""

from __future__ import annotations

from vramcalc.sharding import layer_param_numels, sharded_numel
from vramcalc.terms import comm
from vramcalc.terms.context import RankContext
from vramcalc.units import MiB, alloc

# PyTorch allocates cuBLAS workspaces through the caching allocator, so they show in
# max_memory_allocated: CUBLAS_WORKSPACE_CONFIG default ":4096:8" on Hopper and newer
# (8 x 4 MiB = 32 MiB), ":4096:2:16:8" before (2 x 4 MiB + 8 x 16 KiB).
# Source: aten/src/ATen/cuda/CublasHandlePool.cpp (getChosenWorkspaceSize).
CUBLAS_WORKSPACE_HOPPER_BYTES = 32 * MiB
CUBLAS_WORKSPACE_OLDER_BYTES = 8 * MiB + 8 * 16 * 1024


def cublas_workspace_bytes(gpu_id: str | None) -> int:
    """cuBLAS workspace held once per process on the device."""
    if gpu_id is None:
        return CUBLAS_WORKSPACE_HOPPER_BYTES
    hopper_plus = any(k in gpu_id for k in ("h100", "h200", "h800", "h20", "b200", "b300", "gb"))
    return CUBLAS_WORKSPACE_HOPPER_BYTES if hopper_plus else CUBLAS_WORKSPACE_OLDER_BYTES


def optimizer_step_temp_bytes(ctx: RankContext) -> int:
    """Temporaries of the optimizer step on this rank.

    - mixed precision (bf16/fp16 + fp32 master): each 16-bit grad is replaced by an fp32
      copy for the master update (+2 bytes/param net once the 16-bit grad is freed);
    - adam/adamw foreach (PyTorch's default on CUDA): `_foreach_sqrt(exp_avg_sq)` makes a
      full copy of the second moments (one state-sized tensor per param);
    - lion: the update direction, one state-sized tensor per param;
    - sgd, sgd-momentum: updates in place; adafactor and adamw-8bit: per-tensor kernels,
      at most the largest tensor's worth.
    """
    if "optimizer" in ctx.parallel.offload or (ctx.engine == "fsdp2" and ctx.parallel.offload):
        return 0
    if ctx.engine in ("deepspeed", "megatron"):
        return fused_step_temp_bytes(ctx)
    tr = ctx.training
    shard = ctx.state_shard
    numels = [(sharded_numel(t.numel, shard), t.count) for t in ctx.tensors]
    temp = 0
    if tr.has_master_weights:
        temp += sum(c * (alloc(n, "fp32") - alloc(n, tr.grad_dtype)) for n, c in numels)
    if tr.optimizer in ("adam", "adamw", "lion"):
        temp += sum(c * alloc(n, tr.state_dtype) for n, c in numels)
    elif tr.optimizer in ("adafactor", "adamw-8bit"):
        temp += max((alloc(n, "fp32") for n, _ in numels), default=0)
    return temp


def autocast_cache_layer_bytes(ctx: RankContext) -> int:
    """torch.autocast casts each fp32 weight to the compute dtype once per forward and the
    matmul saves the cast for backward: one layer's matrices in 16 bits."""
    if not ctx.training.is_autocast or ctx.engine == "fsdp2":  # FSDP2 casts via its MP policy
        return 0
    return sum(alloc(n, ctx.training.compute_dtype) for n in layer_param_numels(
        ctx.spec, ctx.parallel) if n > ctx.spec.hidden_size)


def autocast_cache_head_bytes(ctx: RankContext) -> int:
    """The lm_head weight cast (last stage) under autocast."""
    if not ctx.training.is_autocast or not ctx.is_last_stage or ctx.engine == "fsdp2":
        return 0
    x = sharded_numel(ctx.spec.vocab_size * ctx.spec.hidden_size, ctx.parallel.tp)
    return alloc(x, ctx.training.compute_dtype)


def gather_buffer_bytes(ctx: RankContext) -> int:
    """Communication buffers alive during forward and backward: ZeRO-3 / FSDP2 unsharded
    parameters (vramcalc.terms.comm.gather_bytes) and, from the start of backward on,
    DeepSpeed ZeRO-1/2 reduce buckets (comm.backward_buffer_bytes; counted from forward on,
    which only matters when forward is the peak). Persistent buffers (DDP buckets,
    ZeRO-3's reduce bucket) are `persistent_buffer_bytes`."""
    return comm.gather_bytes(ctx) + comm.backward_buffer_bytes(ctx)


def reduce_buffer_bytes(ctx: RankContext) -> int:
    """Extra during one layer's backward: its unsharded gradients before reduce-scatter
    (vramcalc.terms.comm.reduce_bytes)."""
    return comm.reduce_bytes(ctx)


def persistent_buffer_bytes(ctx: RankContext) -> int:
    """Communication buffers held for the whole step (vramcalc.terms.comm)."""
    return comm.persistent_buffer_bytes(ctx)


def fused_step_temp_bytes(ctx: RankContext) -> int:
    """Optimizer-step temporaries of DeepSpeed ZeRO and Megatron-LM (fused multi-tensor Adam:
    no `_foreach_sqrt` copy).

    DeepSpeed ZeRO-1/2 convert this rank's flat 16-bit gradient partition to fp32 for the
    step (stage_1_and_2.py step(): `single_grad_partition = flatten(...).to(fp32)`), 4Ψ/N on
    top of the 16-bit partition (the estimator's 18Ψ/N = 2 + 4 + 4 + 8); ZeRO-3 does the same
    one sub-group (sub_group_size = 1e9 elements) at a time (stage3.py
    `_prepare_fp32_grad_for_sub_group`). Megatron-LM points the fp32 master's .grad at its
    fp32 main-grad buffer (no copy).
    """
    if ctx.engine != "deepspeed" or not ctx.training.has_master_weights:
        return 0
    shard = ctx.parallel.shard_degree
    numel = -(-ctx.shapes.numel() // shard)
    if ctx.parallel.zero >= 3:
        numel = min(numel, comm.DS_SUB_GROUP_NUMEL)
    return alloc(numel, "fp32")
