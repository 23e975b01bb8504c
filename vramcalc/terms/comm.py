"""Communication buffers of the parallel engines, per rank (counted under `transients`).

Four lifetimes, so the phase model can place each buffer where it is alive:

| function                  | alive                         | what |
|---------------------------|-------------------------------|------|
| `persistent_buffer_bytes` | the whole step                | DDP gradient buckets; DeepSpeed ZeRO-3 reduce bucket |
| `gather_bytes`            | forward and backward          | ZeRO-3 / FSDP2 unsharded parameters |
| `backward_buffer_bytes`   | backward                      | DeepSpeed ZeRO-1/2 reduce (ipg) buckets |
| `reduce_bytes`            | one layer's backward          | one layer's unsharded gradients before reduce-scatter |
| `layer_forward_comm_bytes` / `layer_backward_comm_bytes` | inside one layer | sequence-parallel all-gathers, ring-attention K/V exchange (CP), MoE token dispatch (EP) |

Defaults and sources (docs/parallelism.md has the derivations and pinning tests):

- DeepSpeed 0.16.5 (commit 38327e07, deepspeed/runtime/zero/config.py): reduce_bucket_size
  5e8 elements, contiguous_gradients True, overlap_comm False for stages 1-2 and True for
  stage 3 (`overlap_comm_valid`), stage3_prefetch_bucket_size 5e7,
  stage3_max_live_parameters 1e9, stage3_max_reuse_distance 1e9,
  stage3_param_persistence_threshold 1e5, sub_group_size 1e9 — per scenario in
  `ctx.parallel.deepspeed` (vramcalc.ds_config; docs/methodology.md, "DeepSpeed
  configuration keys"). With contiguous_gradients (forced on by optimizer offload in ZeRO-1/2,
  stage_1_and_2.py `contiguous_gradients or self.cpu_offload`) ZeRO-1/2 allocate the
  reduce bucket (two with overlap_comm) at the start of every backward
  (stage_1_and_2.py `backward`) and release it after the reduction epilogue; ZeRO-3
  allocates one at initialisation (stage3.py `__ipg_bucket_flat_buffer`) and keeps it.
  Without contiguous_gradients there is no bucket buffer: up to reduce_bucket_size elements
  of gradients wait as separate tensors and are flattened into a new tensor to be reduced
  (stage_1_and_2.py `allreduce_bucket`: `self.flatten(bucket)`; stage3.py
  `__avg_scatter_grads` → `reduce_scatter_coalesced`).
- DeepSpeed ZeRO-3 parameter fetching (partitioned_param_coordinator.py): parameters are
  gathered per module; after a module's forward they are released unless the module is
  used again within max_reuse_distance elements of fetches, which keeps the tail of the
  model (always the output head) gathered across the forward/backward turn; the
  prefetcher gathers the next modules until prefetch_bucket_size elements are queued.
- PyTorch DDP (torch.nn.parallel.DistributedDataParallel, gradient_as_bucket_view=False by
  default): the reducer keeps flat bucket tensors holding a copy of every gradient
  ("gradient_as_bucket_view ... saved memory size will be equal to the total gradients
  size", DDP docstring).
- PyTorch FSDP2 (torch 2.13 torch/distributed/fsdp/_fully_shard): the root module keeps its
  parameters (embedding, final norm, head) unsharded from forward into backward
  (`_auto_reshard_after_forward`: "For the root, do not reshard after forward"); each
  block is all-gathered (MixedPrecisionPolicy.param_dtype = the compute dtype) for its
  forward and again for its backward, one block at a time plus the implicit prefetch;
  `reshard_after_forward=False` (--fsdp grad-op) keeps every block unsharded from its forward
  to its backward. A block's backward ends with its unsharded gradients copied into a
  reduce-scatter input in the reduce dtype (the sharded parameter dtype).
- TransformerEngine ring attention (context_parallel.py, AttnFuncWithCPAndKVP2P, Megatron's
  default cp_comm_type "p2p"): the forward appends one received K/V chunk per ring step to
  `p2p_comm_buffers` (cp chunks alive by the last step) and keeps per-step outputs and
  fp32 softmax statistics (`out_per_step`, `softmax_lse_per_step`) until the final
  correction; the backward double-buffers K/V with their gradients (two chunks each).
- Megatron-LM MoE all-to-all token dispatcher (moe/token_dispatcher.py): tokens are
  permuted into expert order (b·s·k rows of h) and exchanged with the EP group; each rank
  receives b·s·k·capacity_factor rows in the balanced case (·etp/tp with an expert TP
  degree etp != tp: the rows are gathered over the etp expert-TP ranks).
"""

from __future__ import annotations

from functools import lru_cache

from vramcalc.allocator import CachingAllocator
from vramcalc.ds_config import DeepSpeedConfig
from vramcalc.features import finetunes
from vramcalc.finetune import gathered_layer_bytes, trained_layer_numels
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.sharding import layer_param_numels
from vramcalc.terms import activations as act
from vramcalc.terms import fsdp1
from vramcalc.terms.float8_fsdp import float8_gather, float8_gathered_layer_bytes
from vramcalc.terms.gradients import (
    accumulates_unsharded,
    grad_dtype,
    layer_gradient_bytes,
    reduce_dtype,
)
from vramcalc.units import DTYPE_BITS, alloc, ceil_div

ROOT_GROUPS: tuple[str, ...] = ("embedding", "final", "head")


# ---- persistent ------------------------------------------------------------------------
def ddp_bucket_bytes(ctx: RankContext) -> int:
    """DDP's reducer buckets: one more copy of every gradient (reference/hf profiles) —
    of the trained parameters only: the reducer builds its buckets from the parameters that
    require grad (`Reducer` skips the others), so under LoRA/QLoRA the adapters'."""
    if ctx.engine != "ddp":
        return 0
    return ctx.train_shapes.nbytes(grad_dtype(ctx), 1, 1, "flat")


def ds_reduce_bucket_bytes(ctx: RankContext) -> int:
    """One DeepSpeed reduce (ipg) bucket: reduce_bucket_size elements in the weight dtype
    (stage_1_and_2.py `backward`: `torch.empty(int(self.reduce_bucket_size),
    dtype=self.dtype)`; stage3.py `__ipg_bucket_flat_buffer`)."""
    return alloc(ctx.parallel.deepspeed.reduce_bucket_size, ctx.training.weight_dtype)


def ds_contiguous(ctx: RankContext) -> bool:
    """Whether DeepSpeed copies gradients into the contiguous reduce bucket: the config's
    contiguous_gradients, forced on in ZeRO-1/2 by optimizer offload (stage_1_and_2.py:
    `self.contiguous_gradients = contiguous_gradients or self.cpu_offload`)."""
    par = ctx.parallel
    forced = par.zero in (1, 2) and "optimizer" in par.offload
    return par.deepspeed.contiguous_gradients or forced


def ds_unbucketed_bytes(ctx: RankContext) -> int:
    """Without contiguous_gradients, the bucket's gradients as separate tensors (up to
    reduce_bucket_size elements, at most this rank's trained elements) — beyond what the
    gradients term holds from ZeRO-2 on — and their flattened copy while reduced."""
    n = min(ctx.parallel.deepspeed.reduce_bucket_size, ctx.train_shapes.numel())
    copies = 1 if ctx.parallel.zero == 1 else 2  # ZeRO-1's full gradients are counted already
    return copies * alloc(n, grad_dtype(ctx))


def persistent_buffer_bytes(ctx: RankContext) -> int:
    """Communication buffers held for the whole step (optimizer phase included)."""
    if ctx.engine == "ddp":
        return ddp_bucket_bytes(ctx)
    if ctx.engine == "deepspeed" and ctx.parallel.zero >= 3 and ds_contiguous(ctx):
        return ds_reduce_bucket_bytes(ctx)
    return 0


def backward_buffer_bytes(ctx: RankContext) -> int:
    """Buffers alive through the whole backward: DeepSpeed ZeRO-1/2 reduce buckets (two
    with overlap_comm: stage_1_and_2.py `backward`, "double buffers"), or without
    contiguous_gradients the waiting gradients and their flattened copy (ZeRO-1/2/3)."""
    if ctx.engine != "deepspeed" or not ctx.parallel.zero:
        return 0
    if not ds_contiguous(ctx):
        return ds_unbucketed_bytes(ctx)
    if ctx.parallel.zero in (1, 2):
        n = 2 if ctx.parallel.deepspeed.overlap(ctx.parallel.zero) else 1
        return n * ds_reduce_bucket_bytes(ctx)
    return 0


# ---- gathered parameters ------------------------------------------------------------------
def _layer_numel(ctx: RankContext) -> int:
    return sum(layer_param_numels(ctx.spec, ctx.parallel))


def edge_units(ctx: RankContext) -> bool:
    """--fsdp-edge-units: the embedding and the output projection are FSDP2 units of their
    own (torchtune's `custom_sharded_layers: ['tok_embeddings', 'output']`, full_finetune_
    distributed.py: a `fully_shard` each before the root's), resharded after forward like
    the blocks, so the root keeps only the final norm. Under --fsdp grad-op nothing is
    resharded after forward and the units change nothing."""
    return (ctx.parallel.fsdp_edge_units and ctx.engine == "fsdp2"
            and ctx.parallel.fsdp != "grad-op")


def unsharded_bytes(ctx: RankContext, groups: tuple[str, ...]) -> int:
    """These parameter groups of this stage, unsharded, in the compute dtype."""
    return ctx.shapes.nbytes(ctx.training.compute_dtype, 1, 1, "tensor", groups)


def fsdp_root_bytes(ctx: RankContext) -> int:
    """FSDP2 root parameters (embedding, final norm, head on this stage), unsharded; with
    edge units the final norm alone."""
    return unsharded_bytes(ctx, ("final",) if edge_units(ctx) else ROOT_GROUPS)


def fsdp_layer_bytes(ctx: RankContext) -> int:
    """One transformer block's parameters, unsharded, in the all-gather (compute) dtype;
    under LoRA/QLoRA/DoRA the frozen base + adapters, a QLoRA weight as its packed 4-bit
    data (vramcalc.finetune.gathered_layer_bytes); with torchao's fp8 all-gather
    (--float8-all-gather) the Float8Linear weights in fp8 (vramcalc/terms/float8_fsdp.py)."""
    if float8_gather(ctx):
        return float8_gathered_layer_bytes(ctx)
    if finetunes(ctx.training):
        return alloc(sum(gathered_layer_bytes(ctx, ctx.training.compute_dtype)), "uint8")
    return alloc(_layer_numel(ctx), ctx.training.compute_dtype)


def copy_in_stream_bytes(ctx: RankContext) -> int:
    """Bytes FSDP2's all-gather copy-in stream keeps reserved: the high-water mark of its
    own pool (the caching allocator reuses a block only on its stream; terms/reserved.py).

    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_all_gather` allocates,
    inside `device_handle.stream(all_gather_copy_in_stream)` (the stream
    `FSDPCommContext.get_all_gather_streams` picks in forward and backward when the unshard
    is not explicitly prefetched), the shards cast to the all-gather dtype
    (`_get_param_all_gather_inputs`: one flat foreach copy of the fp32 shards to bf16 under
    a MixedPrecisionPolicy, torchao's fp8 casts under --float8-all-gather; none when the
    shards already have that dtype), then the flat all-gather output, world × shard
    (`all_gather_copy_in`), and frees the cast shards once copied in. The unsharded
    parameters are copied out of the output on the compute stream. In forward
    (`FSDPParamGroup.wait_for_unshard`) a group's output is kept in `all_gather_state` until
    the next group's copy-out, so the next group's cast and output are allocated beside it;
    in backward each output is freed at its own copy-out, one unit ahead at most. Forward
    order: the root (embedding, final norm and head; the final norm alone with edge units),
    the embedding unit, the blocks, the output unit. These requests are replayed through
    the caching-allocator model (vramcalc/allocator.py; the pattern repeats from the second
    block on). 0 outside FSDP2 (FSDP1 gathers into each flat parameter's own padded
    storage, which the phases count as gathered parameters).
    """
    if ctx.engine != "fsdp2" or ctx.parallel.flat_fsdp(ctx.training.framework):
        return 0
    world = ctx.parallel.shard_degree
    if world <= 1:
        return 0
    cast = ctx.training.is_autocast or float8_gather(ctx)
    edge = edge_units(ctx)
    outs = [fsdp_root_bytes(ctx)] + ([unsharded_bytes(ctx, ("embedding",))] if edge else [])
    outs += [fsdp_layer_bytes(ctx)] * min(ctx.num_layers, 3)
    outs += [unsharded_bytes(ctx, ("head",))] if edge else []
    pool = CachingAllocator(expandable=ctx.training.expandable)
    prev = 0
    for out in (n for n in outs if n):
        shards = pool.malloc(ceil_div(out, world)) if cast else 0
        gathered = pool.malloc(out)
        if shards:
            pool.free(shards)
        if prev:  # the previous group's output, freed at this group's copy-out
            pool.free(prev)
        prev = gathered
    return pool.peak_reserved


def _ds_key(ctx: RankContext) -> tuple:
    root = tuple((t.name, t.numel) for t in ctx.tensors if t.group in ROOT_GROUPS)
    layer: tuple[int, ...] = ()
    if finetunes(ctx.training):
        # frozen base + adapters; a QLoRA weight is its packed data in a container of the
        # weight dtype (bnb_4bit_quant_storage): n/2 bytes = n/(2·w) elements for DeepSpeed
        w = ctx.training.weight_dtype
        unit = DTYPE_BITS[w] // 8 or 1
        layer = tuple(ceil_div(b, unit) for b in gathered_layer_bytes(ctx, w))
    return (ctx.spec, ctx.parallel.tp, ctx.parallel.ep, ctx.num_layers, ctx.is_first_stage,
            ctx.is_last_stage, root, layer)


def _ds_knobs(ds: DeepSpeedConfig) -> tuple[int, int, int, int]:
    return (ds.max_reuse_distance, ds.prefetch_bucket_size, ds.max_live_parameters,
            ds.param_persistence_threshold)


def ds_module_order(ctx: RankContext) -> tuple[int, ...]:
    """Forward-order numels of the modules DeepSpeed ZeRO-3 fetches on this rank."""
    return _ds_module_order(*_ds_key(ctx))


@lru_cache(maxsize=1024)
def _ds_module_order(spec, tp: int, ep: int, n_layers: int, first: bool, last: bool,  # noqa: ANN001
                     root: tuple[tuple[str, int], ...],
                     layer: tuple[int, ...] = ()) -> tuple[int, ...]:
    if not layer:  # full training: the model's own tensors
        layer = tuple(layer_param_numels(spec, ParallelConfig.model_construct(tp=tp, ep=ep)))
    emb = tuple(n for name, n in root if name.startswith("embed"))
    tail = tuple(n for name, n in root if not name.startswith("embed"))
    return (emb if first else ()) + layer * n_layers + (tail if last else ())


def ds_gathered_numel(ctx: RankContext) -> int:
    """Elements DeepSpeed ZeRO-3 holds gathered at the forward/backward turn.

    Module i (forward order, numel n_i, S_i = Σ_{j>i} n_j) stays gathered from its forward to
    its backward when 2·S_i < max_reuse_distance (the fetches between its two uses), so the
    tail of the model (always the head) is kept; the prefetcher then queues the next modules
    until prefetch_bucket_size elements (it stops after the one that crosses the limit),
    capped by max_live_parameters (partitioned_param_coordinator.py `fetch_sub_module`:
    `min(max_n_available_params - n_available_params, prefetch_bucket_sz)`). Persistent
    parameters (≤ stage3_param_persistence_threshold elements) are never gathered (they are
    counted as weights). The four values are the scenario's (`ctx.parallel.deepspeed`).
    """
    return _ds_gathered_numel(_ds_key(ctx), _ds_knobs(ctx.parallel.deepspeed))


@lru_cache(maxsize=1024)
def _ds_gathered_numel(key: tuple, knobs: tuple[int, int, int, int]) -> int:
    reuse, prefetch_size, max_live, keep = knobs
    order = _ds_module_order(*key)
    retained, suffix, i = 0, 0, len(order) - 1
    while i >= 0 and 2 * suffix < reuse:
        n = order[i]
        if n > keep:
            retained += n
        suffix += n
        i -= 1
    prefetch = 0
    budget = min(prefetch_size, max(max_live - retained, 0))
    while i >= 0 and prefetch < budget:
        if order[i] > keep:
            prefetch += order[i]
        i -= 1
    largest = max((n for n in order if n > keep), default=0)
    return max(retained, largest) + prefetch


def gather_bytes(ctx: RankContext, at: str = "blocks") -> int:
    """Unsharded parameters alive during forward and backward (ZeRO-3 / FSDP2). With edge
    units (`edge_units`) the blocks' instants hold the root and one block; at the "head"
    (the output projection's forward, the loss backward) the output unit and one block (the
    top block, prefetched for its backward); at the "embedding"'s backward that unit."""
    if at != "blocks" and edge_units(ctx):
        unit = unsharded_bytes(ctx, (at,))
        return fsdp_root_bytes(ctx) + unit + (fsdp_layer_bytes(ctx) if at == "head" else 0)
    if ctx.engine == "deepspeed" and ctx.parallel.zero >= 3:
        return alloc(ds_gathered_numel(ctx), ctx.training.weight_dtype)
    if ctx.engine != "fsdp2":
        return 0
    root = fsdp_root_bytes(ctx)
    if ctx.parallel.fsdp == "grad-op":
        # reshard_after_forward=False: every block stays unsharded into backward, and the
        # last block's all-gather output exists next to its copy-out (foreach_all_gather_copy_out)
        # at the start of its forward, when all the others are already unsharded (counted
        # through backward too: one block conservative there)
        return root + (ctx.num_layers + 1) * fsdp_layer_bytes(ctx)
    return root + fsdp_layer_bytes(ctx)


def prefetch_bytes(ctx: RankContext, layer: int) -> int:
    """FSDP2: the next unit's all-gather output during the backward of the `layer`-th layer
    from the top (FSDPParamGroup.pre_backward prefetches it; it lives until that unit's
    copy-out, on the all-gather copy-in stream: copy_in_stream_bytes). grad-op keeps every
    block unsharded and gathers none."""
    if ctx.engine != "fsdp2" or ctx.parallel.fsdp == "grad-op":
        return 0
    if layer == ctx.num_layers - 1 and edge_units(ctx):  # the embedding unit comes next
        return unsharded_bytes(ctx, ("embedding",))
    return fsdp_layer_bytes(ctx) if layer < ctx.num_layers - 1 else 0


def reduce_bytes(ctx: RankContext, layer: int = 0, done: float = 1.0,
                 freed: int | None = None) -> int:
    """Extra at one instant of the backward of the `layer`-th layer from the top, because
    its gradients are whole until they are reduced and FSDP2 prefetches the next block. The phase model counts `done` (the share of the layer's gradients computed
    so far) of one layer's *sharded* gradients (`layer_gradient_bytes`, g); what is really
    alive:

    - DeepSpeed ZeRO-2/3: autograd's gradient of one parameter until its hook copies it into
      the reduce bucket (contiguous_gradients: `param.grad` then points into the bucket, which
      `backward_buffer_bytes` / `persistent_buffer_bytes` count): the largest matrix.
    - FSDP2, while the block runs: `done` of its unsharded gradients (compute dtype) instead
      of done·g; for every block below the top the previous block's reduce-scatter input,
      kept until this block's reduce-scatter (`reduce_scatter_max_input_buffers` = 1,
      _fsdp_param_group.py post_backward); for every block above the bottom the next block,
      all-gathered ahead by the backward prefetch (FSDPParamGroup.pre_backward).
    - FSDP2, once the block's backward is over (its gradient temporaries and remaining saved
      tensors, `freed`, are gone): the unsharded gradients, the reduce-scatter input they are
      copied into (the sharded parameters' dtype) and the block's sharded gradient.
    - FSDP2 with sync off (gradients.accumulates_unsharded): no reduce-scatter until the last
      micro-batch; `done` of the block's compute-dtype gradients beside the accumulated
      ones they are added into (none extra when both have one dtype).
    """
    trained: tuple[int, ...] | None = None
    if finetunes(ctx.training):  # only the adapters get gradients
        trained = trained_layer_numels(ctx)
    if ctx.engine == "deepspeed" and ctx.parallel.zero >= 2:
        largest = max(trained or (0,)) if trained is not None else max(
            layer_param_numels(ctx.spec, ctx.parallel))
        return alloc(largest, grad_dtype(ctx))
    if ctx.engine != "fsdp2":
        return 0
    g = layer_gradient_bytes(ctx)
    if fsdp1.flat(ctx):  # the whole block's flat gradient (vramcalc/terms/fsdp1.py)
        if freed is None:
            freed = act.layer_backward_working_bytes(ctx) + act.layer_activation_bytes(ctx)
        nxt = fsdp_layer_bytes(ctx) if (ctx.parallel.fsdp != "grad-op"
                                        and layer < ctx.num_layers - 1) else 0
        return fsdp1.reduce_bytes(ctx, g, done, freed, nxt)
    tr = ctx.training
    if trained is None:
        n, whole_dt, rs_dt = _layer_numel(ctx), tr.compute_dtype, reduce_dtype(ctx.training)
    else:  # adapters: unsharded grads in the gather dtype, reduce-scatter in the policy's
        a_dt = tr.adapter_dtype
        n, whole_dt = sum(trained), tr.compute_dtype if tr.is_autocast else a_dt
        rs_dt = reduce_dtype(ctx.training) if tr.is_autocast else a_dt
    whole, rs_input = alloc(n, whole_dt), alloc(n, rs_dt)
    if accumulates_unsharded(ctx):  # sync off: the block's gradients, added into the
        # accumulated ones (gradients.py), exist beside them only when the two dtypes differ
        return int(done * whole) if whole_dt != rs_dt else 0
    if freed is None:
        freed = act.layer_backward_working_bytes(ctx) + act.layer_activation_bytes(ctx)
    prefetch = prefetch_bytes(ctx, layer)
    early = int(done * (whole - g)) + (rs_input if layer > 0 else 0)
    # post_backward reshards the block (its parameters freed), then foreach_reduce copies
    # the gradients into the input (whole + input), frees them, and casts the output to
    # the sharded parameters' dtype (input + output + g; the output is g when one dtype)
    sharded_dt = tr.weight_dtype if trained is None else a_dt
    rs_out = alloc(ceil_div(n, ctx.parallel.shard_degree), rs_dt) if rs_dt != sharded_dt else 0
    late = (int((1 - done) * g) + max(whole + rs_input - g, rs_input + rs_out) - freed
            - fsdp_layer_bytes(ctx))
    return max(early, late, 0) + prefetch


# ---- inside one layer: SP, CP, EP ----------------------------------------------------------
def _tokens(ctx: RankContext) -> int:
    """Tokens of one micro-batch on this rank's sequence shard (÷cp, before ÷tp of SP)."""
    tr = ctx.training
    return tr.micro_batch_size * ceil_div(tr.seq_len, ctx.parallel.cp)


def _kv_chunk_bytes(ctx: RankContext) -> int:
    """This rank's K and V for one micro-batch: 2 · b · s/cp · g/tp · d."""
    spec, par = ctx.spec, ctx.parallel
    g = max(spec.kv_heads // par.tp, 1)
    return alloc(2 * _tokens(ctx) * g * spec.head_size, ctx.training.compute_dtype)


def cp_forward_bytes(ctx: RankContext) -> int:
    """Ring attention (TransformerEngine p2p) forward: cp K/V chunks received by the last
    ring step, plus per-step partial outputs and fp32 log-sum-exp statistics."""
    cp = ctx.parallel.cp
    if cp <= 1:
        return 0
    spec, par = ctx.spec, ctx.parallel
    a = ceil_div(spec.num_attention_heads, par.tp)
    out_chunk = alloc(_tokens(ctx) * a * spec.head_size, ctx.training.compute_dtype)
    lse_chunk = alloc(_tokens(ctx) * a, "fp32")
    return (cp - 1) * _kv_chunk_bytes(ctx) + cp * (out_chunk + lse_chunk)


def cp_backward_bytes(ctx: RankContext) -> int:
    """Ring attention backward: K/V and their gradients double-buffered (2 chunks each)."""
    if ctx.parallel.cp <= 1:
        return 0
    return 4 * _kv_chunk_bytes(ctx)


def sp_gather_bytes(ctx: RankContext) -> int:
    """Sequence parallelism: the all-gathered (b, s/cp, h) input of a column-parallel linear
    (not saved: Korthikanti et al. 2022 Sec. 4.2.2 re-gathers it in backward)."""
    if not ctx.parallel.sequence_parallel:
        return 0
    return alloc(_tokens(ctx) * ctx.spec.hidden_size, ctx.training.compute_dtype)


def moe_routed_tokens(ctx: RankContext) -> int:
    """Token rows one rank's experts process per MoE layer: b·s·k·capacity_factor (balanced
    routing; dropless routers process b·s·k on average, capacity caps each expert). With
    Megatron-LM's expert TP e != t (--etp) the rank's experts see the tokens of e
    sequence shards, not t (n = T·e·k, vramcalc/terms/megatron_layer.py
    `megatron_moe_bytes`): b·s·k·e/t."""
    if not ctx.spec.is_moe:
        return 0
    k = ctx.spec.num_experts_per_tok
    tokens, par = _tokens(ctx), ctx.parallel
    if par.etp is not None and (par.sequence_parallel or par.tp == 1):
        tokens = tokens * par.expert_tp // par.tp
    return ceil_div(int(tokens * k * par.capacity_factor * 1000), 1000)


def ep_dispatch_bytes(ctx: RankContext) -> int:
    """EP all-to-all: permuted tokens sent (b·s·k rows of h) and received (·capacity)."""
    if ctx.parallel.ep <= 1 or not ctx.spec.is_moe:
        return 0
    h, c = ctx.spec.hidden_size, ctx.training.compute_dtype
    sent = _tokens(ctx) * ctx.spec.num_experts_per_tok
    return alloc(sent * h, c) + alloc(moe_routed_tokens(ctx) * h, c)


def layer_forward_comm_bytes(ctx: RankContext) -> int:
    """Communication buffers alive inside one layer's forward (worst moment)."""
    return max(sp_gather_bytes(ctx), cp_forward_bytes(ctx), ep_dispatch_bytes(ctx))


def layer_backward_comm_bytes(ctx: RankContext) -> int:
    """Communication buffers alive inside one layer's backward (worst moment): SP
    re-gathers the input and reduce-scatters the input gradient."""
    return max(2 * sp_gather_bytes(ctx), cp_backward_bytes(ctx), ep_dispatch_bytes(ctx))
