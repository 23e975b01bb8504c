"""Term: gradients — one gradient per trained parameter, in the engine's gradient dtype and layout.

Frozen base weights (LoRA/QLoRA/DoRA, vramcalc/finetune.py) have none: only
`ctx.train_shapes` (the adapters) are counted.

bytes = Σ_tensors count · round512(numel_local / shard · bits/8), shard = the ZeRO-2+/FSDP
group. Per engine (docs/parallelism.md):

- single / DDP / DeepSpeed ZeRO-1: `param.grad`, full size, weight dtype (ZeRO paper P_os:
  2Ψ gradients); DeepSpeed ZeRO-1 reduces into a partition only at the accumulation boundary.
- DeepSpeed ZeRO-2/3: a flat 16-bit partition buffer, 2Ψ/N, allocated once and kept
  (stage_1_and_2.py `grads_in_partition`, stage3.py `grad_partitions_flat_buffer`).
- FSDP2: sharded DTensor gradients (dim-0 shards), created layer by layer in backward.
  Under torch.distributed.pipelining (torchtitan with --pp, `pipelined_fsdp`) every
  micro-batch's backward runs with gradient sync off and the whole stage's gradients
  accumulate unsharded until the last micro-batch's reduce-scatter.
- FSDP1 (--fsdp-impl fsdp1): one flat gradient per unit, the whole unit's even when only
  adapters train, unsharded while accumulating under no_sync (vramcalc/terms/fsdp1.py).
- Megatron-LM: a contiguous fp32 main-grad buffer (`--accumulate-allreduce-grads-in-fp32`,
  the bf16 default) kept for the whole run, full size even with the distributed optimizer
  (Megatron docs: bf16 6 + 12/d bytes/param = 2 weights + 4 grads + 12/d); fp16 keeps a
  16-bit grad buffer and an fp32 copy inside the optimizer (4 + 16/d).

Offload: DeepSpeed ZeRO-Offload (ZeRO-2/3 + optimizer offload) writes gradients straight
into pinned host buffers; FSDP2 CPUOffloadPolicy moves them to the host after reduce-scatter.
"""

from __future__ import annotations

from vramcalc.features import chunks_loss, finetunes
from vramcalc.hf_stack import trainer_no_sync
from vramcalc.rank import RankContext
from vramcalc.terms import fsdp1
from vramcalc.training import TrainingConfig
from vramcalc.units import alloc


def grad_dtype(ctx: RankContext) -> str:
    """Gradient dtype on this rank: Megatron accumulates bf16/fp32 models' grads in fp32."""
    if ctx.engine == "megatron" and ctx.training.weight_dtype in ("bf16", "fp32"):
        return "fp32"
    return ctx.training.grad_dtype


def _offloaded(ctx: RankContext) -> bool:
    off = ctx.parallel.offload
    if ctx.engine == "fsdp2":
        return bool(off)
    if ctx.engine == "deepspeed":
        return "optimizer" in off and ctx.parallel.zero >= 2
    return False


def gradients_persistent(ctx: RankContext) -> bool:
    """Whether the gradient buffer exists for the whole step (forward included): DeepSpeed
    ZeRO-2/3 partition buffers and Megatron's main-grad buffer are allocated once; on one
    GPU or DDP, `.grad` tensors that zero_grad(set_to_none=False) zeroes and keeps."""
    if _offloaded(ctx):
        return False
    if not ctx.training.set_to_none and ctx.engine in ("single", "ddp"):
        return True
    return ctx.engine == "megatron" or (ctx.engine == "deepspeed" and ctx.parallel.zero >= 2)


def pipelined_fsdp(ctx: RankContext) -> bool:
    """FSDP2 under torch.distributed.pipelining (the torchtitan profile with --pp).

    torch/distributed/pipelining/stage.py `backward_maybe_with_nosync` (torch 2.5 to 2.13):
    for an FSDPModule stage, every micro-batch's backward runs after
    `set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)`; after the
    last one it calls each param group's `post_backward` with gradient sync back on. With
    sync off, FSDP2's post_backward keeps each unsharded gradient as
    `unsharded_accumulated_grad`, upcast to the reduce dtype (`to_accumulated_grad_if_needed`,
    `accumulate_unsharded_grad_if_needed`: fp32 under torchtitan's MixedPrecisionPolicy), so
    from the first micro-batch's backward to the last one's reduce-scatter the stage holds
    every gradient unsharded (TP-local); the reduce-scatter leaves the sharded ones for the
    step."""
    return (ctx.engine == "fsdp2" and ctx.parallel.pp > 1
            and ctx.training.framework == "torchtitan" and not fsdp1.flat(ctx))


def accumulates_unsharded(ctx: RankContext) -> bool:
    """FSDP2 with gradient sync off until a step's last micro-batch: under pipelining
    (`pipelined_fsdp`) or in HF Trainer's accumulation loop (hf_stack.py
    `trainer_no_sync`). Every gradient is then held unsharded, in the reduce dtype, from the
    first micro-batch's backward to the last one's reduce-scatter."""
    return pipelined_fsdp(ctx) or (trainer_no_sync(ctx.training, ctx.parallel)
                                   and ctx.engine == "fsdp2" and not fsdp1.flat(ctx))


def reduce_dtype(tr: TrainingConfig) -> str:
    """FSDP2's MixedPrecisionPolicy.reduce_dtype, the dtype of the reduce-scatter input and
    of unsharded accumulated gradients (`to_accumulated_grad_if_needed`). Under autocast
    precisions torchtitan reduces in fp32 (9dec370 config_manager.py
    mixed_precision_reduce float32), the reference profile likewise; accelerate's policy
    reduces in its param dtype (accelerate utils/dataclasses.py
    FullyShardedDataParallelPlugin.set_mixed_precision: reduce_dtype = param_dtype), the
    hf profile's compute dtype. Without a policy: the parameters' own dtype."""
    if tr.framework == "hf":
        return tr.compute_dtype if tr.is_autocast else tr.trainable_dtype
    return tr.weight_dtype if tr.is_autocast else tr.trainable_dtype


def gradients_bytes(ctx: RankContext) -> int:
    """Device bytes of all gradients held on this rank once backward has finished (under
    `accumulates_unsharded`, before the last micro-batch's reduce-scatter: unsharded, on the
    device even with CPUOffloadPolicy, which moves only the reduce-scattered shards)."""
    if accumulates_unsharded(ctx):
        return ctx.train_shapes.nbytes(reduce_dtype(ctx.training), 1, ctx.expert_shard(1),
                                       ctx.grad_layout)
    if _offloaded(ctx) or "gradients" in ctx.parallel.offload and ctx.engine != "deepspeed":
        return 0
    if fsdp1.flat(ctx):
        return fsdp1.held_gradient_bytes(ctx, grad_dtype(ctx))
    return _sharded_bytes(ctx, ctx.grad_shard)


def _sharded_bytes(ctx: RankContext, shard: int) -> int:
    return ctx.train_shapes.nbytes(grad_dtype(ctx), shard, ctx.expert_shard(shard),
                                   ctx.grad_layout)


def gradients_at_step_bytes(ctx: RankContext) -> int:
    """Gradients held during the optimizer step. DeepSpeed ZeRO-1 frees the full 16-bit
    gradients outside this rank's partition before the step (stage_1_and_2.py step():
    free_grad_in_param_list(params_not_in_partition)) and keeps a flat partition. With the
    optimizer inside backward none are left (vramcalc/terms/optim_in_bwd.py)."""
    if ctx.training.optimizer_in_backward:
        return 0
    if fsdp1.flat(ctx):  # the last micro-batch reduce-scattered them
        return fsdp1.gradient_bytes(ctx, grad_dtype(ctx), sharded=True)
    if ctx.engine == "deepspeed" and ctx.parallel.zero == 1:
        shard = ctx.parallel.shard_degree
        return ctx.train_shapes.nbytes(grad_dtype(ctx), shard, ctx.expert_shard(shard), "flat")
    if accumulates_unsharded(ctx):  # reduce-scattered after the last one
        return 0 if _offloaded(ctx) else _sharded_bytes(ctx, ctx.grad_shard)
    return gradients_bytes(ctx)


def layer_gradient_bytes(ctx: RankContext) -> int:
    """Gradient bytes of one transformer layer on this rank (per-layer backward step)."""
    if _offloaded(ctx) and not accumulates_unsharded(ctx):
        return 0
    n = ctx.num_layers
    if not n:
        return 0
    if fsdp1.flat(ctx):
        return fsdp1.layer_gradient_bytes(ctx, grad_dtype(ctx))
    if accumulates_unsharded(ctx):
        total = ctx.train_shapes.nbytes(reduce_dtype(ctx.training), 1, ctx.expert_shard(1),
                                        ctx.grad_layout, ("layer", "expert"))
    else:
        total = ctx.train_shapes.nbytes(grad_dtype(ctx), ctx.grad_shard,
                                        ctx.expert_shard(ctx.grad_shard), ctx.grad_layout,
                                        ("layer", "expert"))
    return total // n


def tied_embedding_grad_bytes(ctx: RankContext, shard: int | None = None,
                              dtype: str | None = None) -> int:
    """One copy of the tied token embedding's gradient, sharded as the gradients are (or
    over `shard`, in `dtype`); 0 when the head is untied, and under LoRA/QLoRA/DoRA, where
    the tied matrix is frozen: an adapted or copied embedding trains tensors of its own,
    apart from the head's."""
    if not ctx.spec.tie_word_embeddings or finetunes(ctx.training):
        return 0
    n, dt = shard or ctx.grad_shard, dtype or grad_dtype(ctx)
    return sum(t.count * alloc(-(-t.numel // n), dt) for t in ctx.tensors
               if t.name == "embed_tokens")


def tied_sum_in_place(ctx: RankContext) -> bool:
    """Whether autograd adds the embedding's share of a tied matrix's gradient into the
    head's share in place. torch/csrc/autograd/input_buffer.cpp `accumulate` adds into the
    buffered tensor when it holds that tensor's last reference (`can_accumulate_inplace`),
    else it makes a new tensor. The head's share is the transpose of its weight-gradient
    matmul, a view that keeps its base alive: a new tensor. It is a plain tensor when the
    head ran in chunks (each chunk's share is summed into a new one from the second on) or
    when autocast cast the fp32 weight (`ToCopyBackward` returns a new tensor). FSDP2 casts
    outside autograd; Liger's fused loss returns a gradient it saved; Megatron writes the
    head's into its main-grad buffer."""
    tr = ctx.training
    if chunks_loss(tr):
        return True
    return tr.is_autocast and ctx.engine not in ("fsdp2", "megatron") and not tr.liger


def embedding_backward_bytes(ctx: RankContext, keep_grads: bool) -> tuple[int, int]:
    """(gradients beside `gradients_bytes` when the token embedding's backward ends the
    sweep, the temporaries there). Tied: the head's share waits in autograd's input buffer
    and the embedding's share is added to it (`tied_sum_in_place`): 2 or 3 copies of the
    unsharded V·h gradient, in the dtype autograd computes it (FSDP2: the all-gathered
    parameters'). The sum becomes `.grad` on one GPU and DDP (counted in
    `gradients_bytes`, unless an earlier micro-batch's is there); ZeRO-2/3 and FSDP2 reduce
    it after, so the shard `gradients_bytes` counts is not made yet. Untied, on one GPU or
    DDP, with gradients kept from an earlier micro-batch: embedding_dense_backward returns a
    new V·h gradient that AccumulateGrad adds into the existing `.grad`
    (torch/csrc/autograd/functions/accumulate_grad.h: stolen only when `.grad` is
    undefined). Encoders only so far (decoders' untied embeddings are refereed without
    it)."""
    tied = tied_embedding_grad_bytes(ctx)
    if tied and ctx.engine != "megatron":
        copies = 2 if tied_sum_in_place(ctx) else 3
        if ctx.grad_shard == 1:
            return (tied if keep_grads else 0), (copies - 1) * tied
        full = tied_embedding_grad_bytes(ctx, 1, ctx.training.compute_dtype
                                         if ctx.engine == "fsdp2" else None)
        return (0 if keep_grads else -tied), copies * full
    if tied or not keep_grads or ctx.engine not in ("single", "ddp") or not ctx.spec.is_encoder:
        return (tied if keep_grads else 0), 2 * tied
    dtype = grad_dtype(ctx)
    return 0, sum(t.count * alloc(t.numel, dtype) for t in ctx.train_tensors
                  if t.name == "embed_tokens")


def late_gradient_bytes(ctx: RankContext) -> int:
    """Gradients that only appear after the bottom layer's backward: the token embedding's
    (untied) and the learned position embedding's."""
    if not ctx.is_first_stage:
        return 0
    names = ("embed_positions",) if ctx.spec.tie_word_embeddings else (
        "embed_tokens", "embed_positions")
    shard = ctx.grad_shard
    dtype = grad_dtype(ctx)
    return sum(t.count * alloc(-(-t.numel // shard), dtype) for t in ctx.train_tensors
               if t.name.split(".")[0] in names)  # embed_tokens.lora_embedding_A / _B too
