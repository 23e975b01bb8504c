"""The analytic engine's reserved-memory estimate: peak allocated + segment rounding.

`torch.cuda.max_memory_reserved` exceeds `max_memory_allocated` by the caching allocator's
segments that are not handed out (vramcalc/allocator.py has the rules, from
c10/cuda/CUDACachingAllocator.cpp at pytorch/pytorch 001074d25084fdb87a799823e395a50f5ec044d3).
The analytic engine takes the tensors live at the peak moment, one block each, and packs
them as tightly as the rules allow (`allocator.packed_reserved`): each request of at least
kMinLargeAlloc (10 MiB) in a segment rounded up to kRoundLarge (2 MiB), the bytes of the
1-10 MiB requests rounded up to whole 20 MiB (kLargeBuffer) segments, those of requests up
to 1 MiB to 2 MiB (kSmallBuffer) segments:

    reserved = peak allocated + packed_reserved(live blocks) − Σ live blocks

The live blocks: every model-state tensor on the device at its per-rank (sharded) size —
weights, gradients when the peak phase holds them, each optimizer-state tensor and the fp32
master — and every saved activation of the rank's layers (the profile's per-layer table,
`activations.layer_saved`, × layers × micro-batches in flight) when the peak is in forward
or backward (reference and hf profiles: the megatron profile's layer bytes come from a
formula, not a table of tensors, and are not counted). Flat ZeRO / Megatron buffers are counted per tensor (their rounding differs
by less than one 2 MiB unit per buffer); the few logits and loss buffers and the layer
temporaries are not counted (a few 2 MiB units at most).

Not modelled: blocks cached from other phases that the peak cannot reuse. The trace engine
replays every allocation through the allocator model and sees it: in a steady-state step
the optimizer states created lazily by the first step sit in segments the first step's
logits and activations left, so the second step's large buffers need new segments. The
gap is measured in docs/validation.md; this estimate is the packing floor. (A replay of
these tables through the allocator model closes most of the gap but is not monotone in the
micro-batch size, which the planner's dominance assumes, and costs ~50× an estimate: see
docs/validation.md.)
`expandable_segments` packs the same blocks into pages of the same sizes, so the floor is
the same.

The reported reserved peak adds one cached block to this floor: the loss's freed c-typed
logits (vramcalc/terms/logits.py `freed_logits_bytes`, vramcalc/analytic.py). The fit check
leaves it out: the allocator frees cached whole segments and retries before an
out-of-memory error. The fit is this floor too: under memory pressure a segment split by a
block that is still live keeps its free rest, which depends on the order of every request;
the trace engine replays that order under a capacity (vramcalc/allocator.py
`min_capacity`, docs/trace.md).

Streams (`side_stream_bytes`): the caching allocator hands a freed block only to requests
on the stream it was allocated on (`get_free_block` compares the block's stream; with
expandable segments each stream has its own segment). FSDP2 allocates each reduce-scatter's
output on its reduce-scatter stream (torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py `foreach_reduce`: `reduce_output = reduce_scatter_input.new_empty(...)`
inside `torch.cuda.stream(reduce_scatter_stream)`), and the sharded gradients are views of
it. `zero_grad` frees them, but their blocks stay reserved for that stream, so a peak of the
compute stream that holds no gradients (the loss, the layers' backward before their
reduce-scatters) still finds them reserved beside it. Its all-gather copy-in stream keeps the
flat all-gather outputs and the cast shards (`comm.copy_in_stream_bytes`). The analytic
engine takes the compute stream's high-water mark as the largest phase less its gradients
and adds every sharded gradient and the copy-in stream's high-water mark; the trace engine
replays each stream's requests in pools of their own (vramcalc/allocator.py,
trace/tracker.py). Cached, like the freed logits: the fit check leaves them out.
"""

from __future__ import annotations

from vramcalc.allocator import packed_reserved
from vramcalc.rank import RankContext
from vramcalc.sharding import dim0_numel, sharded_numel
from vramcalc.terms.activations import layer_saved
from vramcalc.terms.comm import copy_in_stream_bytes
from vramcalc.terms.gradients import grad_dtype, gradients_at_step_bytes
from vramcalc.terms.optimizer_states import muon_matrix
from vramcalc.terms.saved import mostly_moe
from vramcalc.units import alloc

# optimizer-state tensors per parameter tensor (torch.optim: exp_avg and exp_avg_sq; one
# momentum buffer; bitsandbytes' two 8-bit states; Adafactor's factored rows/columns are
# small and counted as one)
_STATE_TENSORS = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "lion": 1, "adafactor": 1}


def _numel(t_numel: int, rows: int, shard: int, dim0: bool) -> int:
    if dim0 and rows and shard > 1:
        return -(-rows // shard) * (t_numel // rows)
    return sharded_numel(t_numel, shard)


def live_blocks(ctx: RankContext, phase: str, grads: int, states: int, master: int,
                in_flight: float) -> list[tuple[int, int]]:
    """(bytes, count) of the blocks live at the peak of `phase` (see the module docstring);
    `grads`, `states`, `master`: the peak's bytes of each (0: none on the device)."""
    tr = ctx.training
    out: list[tuple[int, int]] = []
    dim0 = ctx.engine == "fsdp2"
    for t in ctx.tensors:
        shard = ctx.expert_shard(ctx.param_shard) if t.is_expert else ctx.param_shard
        n = dim0_numel(t, shard) if dim0 else sharded_numel(t.numel, shard)
        out.append((alloc(n, t.dtype or tr.weight_dtype), t.count))
    n_states = _STATE_TENSORS.get(tr.optimizer, 2 if tr.optimizer.endswith("8bit") else 0)
    for t in ctx.train_tensors:
        if tr.optimizer == "muon":  # a layer matrix's momentum, AdamW's two states else
            n_states = 1 if muon_matrix(t) else 2
        gshard = ctx.expert_shard(ctx.grad_shard) if t.is_expert else ctx.grad_shard
        sshard = ctx.expert_shard(ctx.state_shard) if t.is_expert else ctx.state_shard
        if grads:
            out.append((alloc(_numel(t.numel, t.rows, gshard, dim0), grad_dtype(ctx)), t.count))
        n = _numel(t.numel, t.rows, sshard, dim0)
        if states and n_states:
            dtype = "int8" if tr.optimizer.endswith("8bit") else tr.state_dtype
            out.append((alloc(n, dtype), t.count * n_states))
        if master:
            out.append((alloc(n, "fp32"), t.count))
    if phase != "optimizer" and tr.framework != "megatron" and ctx.num_layers:
        layers = int(ctx.num_layers * in_flight)
        moe = mostly_moe(ctx)
        for s in layer_saved(ctx, moe):
            out.append((s.nbytes // s.count, s.count * layers))
    return out


def reserved_pad_bytes(ctx: RankContext, phase: str, grads: int, states: int, master: int,
                       in_flight: float) -> int:
    """Reserved minus allocated at the peak: the packing of its live blocks into segments."""
    blocks = live_blocks(ctx, phase, grads, states, master, in_flight)
    return packed_reserved(blocks) - sum(b * n for b, n in blocks)


def side_stream_bytes(ctx: RankContext, phases: list[tuple[int, int, int]]) -> int:
    """Reserved bytes FSDP's side streams add above the allocated peak. `phases`:
    (allocated, gradient bytes, all-gather output bytes) at each phase's peak. The compute
    stream's high-water mark is the largest phase without its gradients and all-gather
    outputs; the reduce-scatter stream's is every
    sharded gradient (module docstring; FSDP1's `_post_backward_hook` likewise runs
    `_reduce_grad`, whose `new_sharded_grad = torch.empty_like(chunks[0])` becomes the flat
    parameter's gradient, on its post-backward stream); FSDP2's all-gather copy-in stream
    keeps its own (comm.copy_in_stream_bytes). 0 outside FSDP (DeepSpeed reduces into its
    own buffers)."""
    if ctx.engine != "fsdp2" or not phases:
        return 0
    copy_in = copy_in_stream_bytes(ctx)
    compute = max(total - grads - min(flat, copy_in) for total, grads, flat in phases)
    side = gradients_at_step_bytes(ctx) + copy_in
    return max(compute + side - max(t for t, _, _ in phases), 0)
