"""FSDP1 flat parameters (`--fsdp-impl fsdp1`, the lightning profile's default): what
torch.distributed.fsdp.FullyShardedDataParallel holds that FSDP2 does not.

Sources: PyTorch 2.x torch/distributed/fsdp (read at torch 2.13.0; the same logic as the
2.1.0 that Lightning 2.1 ran), Lightning-AI/pytorch-lightning 2.1.0.rc0 (c98fb36b)
src/lightning/fabric/strategies/fsdp.py, LitGPT 8641822 finetune/lora.py.

- **Units.** Lightning's FSDPStrategy(auto_wrap_policy={Block}) wraps each transformer block
  in its own FSDP unit (`transformer_auto_wrap_policy`) and the root in one more (embedding,
  final norm, head). Each unit flattens its parameters into one FlatParameter
  (_flat_param.py `FlatParamHandle`), sharded in ceil(N_u / W) chunks over the W ranks.
- **Mixed frozen and trained parameters.** FSDPStrategy sets `use_orig_params=True` on torch
  >= 2.0 (fabric/strategies/fsdp.py `__init__`), which permits non-uniform requires_grad in
  one FlatParameter; the FlatParameter requires grad when any of its tensors does
  (_flat_param.py `_validate_tensors_to_flatten`: the logical OR). In forward, the
  original parameters are replaced by plain views of the unsharded flat parameter
  (`_use_unsharded_views(as_params=False)`), so they all require grad: autograd computes the
  gradient of the *whole* unit, frozen weights included, and saves every linear's input as
  full training does. torch warns about it (_wrap_utils.py `_validate_frozen_params`: "the
  gradient memory usage will be higher than expected (N numel instead of n numel before
  sharding via reduce-scatter)"). Under LoRA every block is such a unit; the root, all
  frozen, gets no gradient.
- **Gradients.** After each unit's backward, `_post_backward_hook` (_runtime_utils.py)
  reduce-scatters the unsharded flat gradient (unit numel) into a ceil(N_u / W) shard kept
  as the gradient. Inside `no_sync()` it returns before the reduce-scatter
  (`if not state._sync_gradients: ... return`): the unsharded gradient of every unit is
  accumulated across micro-batches. LitGPT accumulates under `fabric.no_backward_sync`,
  which for FSDP is `module.no_sync()` (fabric/strategies/fsdp.py
  `_FSDPBackwardSyncControl`): with --grad-accum > 1 the lightning profile holds the
  unsharded gradients of all trained units, N_u per unit, until the last micro-batch of the
  step reduce-scatters them. HF Trainer does the same through accelerate's `no_sync`
  (hf_stack.py `trainer_no_sync`). Other profiles are modelled reducing every micro-batch.
- **Adapters in units of their own (torchtune).** torchtune's FSDP1 recipe
  (fef3ed10 recipes/lora_finetune_distributed.py `_setup_model`: FullyShardedDataParallel
  with FULL_SHARD, no mixed precision, the default `use_orig_params=False`) wraps with
  `lora_fsdp_wrap_policy` (torchtune/utils/_distributed.py): every module whose `weight`
  requires grad, i.e. each LoRA A and B `nn.Linear`, becomes a unit of its own before the
  TransformerDecoderLayer units. A block's flat parameter then holds only frozen tensors
  (`use_orig_params=False` demands uniform requires_grad) and does not require grad: no
  gradient, no linear input kept, and FSDP1 reshards it once the gradient of the block's
  input is computed (_runtime_utils.py `_register_post_backward_reshard_only_hook`, a
  multi-grad hook on the block's inputs). Every trained tensor is one flat parameter, so the
  gradients are FSDP2's per-parameter shards: the scenario is counted as FSDP2
  (`flat` is false; `wrapped_adapters` says why).
- **Unsharded parameters.** The root unit is not resharded after forward (it is needed first
  in backward), each block is all-gathered for its forward and again for its backward,
  with the next block prefetched (BACKWARD_PRE, the default) and at most two all-gathers
  in flight (limit_all_gathers=True, FSDPStrategy's default): the same count as FSDP2's
  (vramcalc/terms/comm.py `gather_bytes`, `reduce_bytes`).

The gradient dtype: the flat parameter's (the policy's gradient dtype); the unsharded
gradient under no_sync stays in the dtype autograd produced it in, the compute dtype.
"""

from __future__ import annotations

from vramcalc.features import finetunes
from vramcalc.hf_stack import trainer_no_sync, trainer_wraps_adapters
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.training import TrainingConfig
from vramcalc.units import alloc, ceil_div

_BLOCK = ("layer", "expert")


def wraps_adapters(training: TrainingConfig, parallel: ParallelConfig) -> bool:
    """FSDP1 with each LoRA matrix in a unit of its own (torchtune's `lora_fsdp_wrap_policy`,
    HF Trainer's PEFT `fsdp_auto_wrap_policy`, hf_stack.py `trainer_wraps_adapters`): the
    blocks' flat parameters are frozen, the trained ones one tensor each."""
    return (parallel.flat_fsdp(training.framework) and finetunes(training)
            and (training.framework == "torchtune" or trainer_wraps_adapters(training)))


def wrapped_adapters(ctx: RankContext) -> bool:
    """`wraps_adapters` for this rank's scenario."""
    return wraps_adapters(ctx.training, ctx.parallel)


def flat(ctx: RankContext) -> bool:
    """Whether this rank's gradients are FSDP1 flat ones (whole units): FSDP1, except where
    every trained tensor is a unit of its own (`wrapped_adapters`)."""
    return ctx.parallel.flat_fsdp(ctx.training.framework) and not wrapped_adapters(ctx)


def no_sync(ctx: RankContext) -> bool:
    """Whether gradients accumulate unsharded inside FSDP1's `no_sync()` (LitGPT's
    `fabric.no_backward_sync` with gradient accumulation; HF Trainer's, hf_stack.py
    `trainer_no_sync`)."""
    tr = ctx.training
    return flat(ctx) and (tr.framework == "lightning" and tr.grad_accum > 1
                          or trainer_no_sync(tr, ctx.parallel))


def mixed_units(ctx: RankContext) -> bool:
    """Fine-tuning under FSDP1: each block's flat parameter mixes frozen and trained tensors,
    so the frozen ones get gradients too (and their linears keep their inputs)."""
    return flat(ctx) and finetunes(ctx.training)


def block_numel(ctx: RankContext) -> int:
    """Elements of one block's flat parameter (base weights and, under a PEFT method, the
    adapters), before sharding."""
    n = ctx.num_layers
    return ceil_div(ctx.shapes.numel(_BLOCK), n) if n else 0


def root_numel(ctx: RankContext) -> int:
    """Elements of the root unit's flat parameter (embedding, final norm, head)."""
    return ctx.shapes.numel() - ctx.shapes.numel(_BLOCK)


def _units(ctx: RankContext) -> list[int]:
    """Element counts of the units that get a gradient: every block, and the root in full
    training (under LoRA it holds no trained tensor)."""
    out = [block_numel(ctx)] * ctx.num_layers
    if not finetunes(ctx.training) and root_numel(ctx):
        out.append(root_numel(ctx))
    return out


def gradient_bytes(ctx: RankContext, dtype: str, sharded: bool) -> int:
    """Gradients of all trained units: ceil(N_u / W) each once reduce-scattered, N_u each
    while accumulating unsharded (`sharded=False`)."""
    shard = ctx.parallel.shard_degree if sharded else 1
    return sum(alloc(ceil_div(n, shard), dtype) for n in _units(ctx))


def held_gradient_bytes(ctx: RankContext, dtype: str) -> int:
    """Gradients held across the step's micro-batches: unsharded in the compute dtype under
    no_sync, else the sharded ones."""
    if no_sync(ctx):
        return gradient_bytes(ctx, ctx.training.compute_dtype, sharded=False)
    return gradient_bytes(ctx, dtype, sharded=True)


def layer_gradient_bytes(ctx: RankContext, dtype: str) -> int:
    """One block's share of `held_gradient_bytes`."""
    n = block_numel(ctx)
    if no_sync(ctx):
        return alloc(n, ctx.training.compute_dtype)
    return alloc(ceil_div(n, ctx.parallel.shard_degree), dtype)


def reduce_bytes(ctx: RankContext, g_layer: int, done: float, freed: int,
                 prefetch: int) -> int:
    """Extra at one instant of a block's backward (vramcalc/terms/comm.py `reduce_bytes`):
    while it runs, `done` of its unsharded flat gradient (compute dtype) instead of done·g;
    once it is over, the whole unsharded gradient and the reduce-scatter output (one shard,
    `new_sharded_grad` in _runtime_utils.py `_reduce_grad`) minus what the block freed.
    Under no_sync the unsharded gradients are already held: the shard only (the last
    micro-batch's reduce-scatter). Plus the next block's prefetched parameters."""
    n = block_numel(ctx)
    shard = alloc(ceil_div(n, ctx.parallel.shard_degree), ctx.training.grad_dtype)
    if no_sync(ctx):
        return shard + prefetch
    whole = alloc(n, ctx.training.compute_dtype)
    early = int(done * (whole - g_layer))
    late = int((1 - done) * g_layer) + whole + shard - freed
    return max(early, late, 0) + prefetch
