"""The analytic engine's reserved-memory estimate: peak allocated + the allocator's gap.

`torch.cuda.max_memory_reserved` exceeds `max_memory_allocated` by the caching allocator's
segments that are not handed out (vramcalc/allocator.py has the rules, from
c10/cuda/CUDACachingAllocator.cpp at pytorch/pytorch 001074d25084fdb87a799823e395a50f5ec044d3).
The analytic engine estimates that gap two ways from its own tensor tables and keeps the
larger:

    reserved = peak allocated + max(packing floor, step replay gap)

**Packing floor.** The tensors live at the peak, one block each, packed as tightly as the
rules allow (`allocator.packed_reserved`): each request of at least kMinLargeAlloc (10 MiB)
in a segment rounded up to kRoundLarge (2 MiB), the bytes of the 1-10 MiB requests rounded
up to whole 20 MiB (kLargeBuffer) segments, those of requests up to 1 MiB to 2 MiB
(kSmallBuffer) segments. The live blocks: every model-state tensor at its per-rank
(sharded) size — weights, gradients when the peak phase holds them, each optimizer-state
tensor and the fp32 master — and every saved activation of the rank's layers (the profile's
per-layer table, `activations.layer_saved`, × layers × micro-batches in flight) when the
peak is in forward or backward (reference and hf profiles: the megatron profile's layer
bytes come from a formula, not a table of tensors).

**Step replay.** Blocks cached by one phase that a later phase cannot reuse (best fit takes
only a block at least as large; segments are never returned) are the larger part of the
gap: the optimizer states, created lazily by the first step, take pieces of the blocks the
first step's logits and activations left, so the second step's large buffers need new
segments; optimizer-step temporaries larger than every cached activation block need their
own. `replay_gap` replays two training steps of the same tables, in the training step's
order, through the allocator model (large pool only; the small pool is its packing floor):

    build: weights, fp32 masters
    each step: forward, layer by layer: the layer's saved tensors (× micro-batches in
      flight); the loss (vramcalc/terms/logits.py): 16-bit logits, their fp32 upcast,
      log-probabilities; backward: dL/dlogprobs, dL/dlogits, the 16-bit logits gradient;
      the head's and embedding's gradients, then per layer from the top: its gradients,
      its saved tensors freed; optimizer step: the states (first step only, lazily), the
      step's fp32 temporaries (copies of every trainable tensor, as many as the profile's
      optimizer-step bytes hold), then freed; gradients freed (set_to_none) unless kept

and takes its reserved high-water mark minus its allocated high-water mark. Layer
temporaries, communication buffers and autocast caches are not replayed. Memoised per
rank; a 70B rank replays in tens of milliseconds.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from vramcalc.allocator import K_SMALL_SIZE, CachingAllocator, packed_reserved
from vramcalc.features import chunks_loss
from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.sharding import RankTensor, dim0_numel, sharded_numel
from vramcalc.terms.activations import layer_saved
from vramcalc.terms.gradients import grad_dtype, gradients_bytes, gradients_persistent
from vramcalc.terms.optimizer_states import optimizer_state_split
from vramcalc.terms.profile import profile
from vramcalc.terms.saved import dims, mostly_moe
from vramcalc.training import TrainingConfig
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
    """Reserved minus allocated at the peak: the larger of the packing floor of its live
    blocks and the step replay's gap (see the module docstring)."""
    blocks = live_blocks(ctx, phase, grads, states, master, in_flight)
    floor = packed_reserved(blocks) - sum(b * n for b, n in blocks)
    small = [(b, n) for b, n in blocks if b <= K_SMALL_SIZE]
    small_floor = packed_reserved(small) - sum(b * n for b, n in small)
    gap = replay_gap(ctx.spec, ctx.training, ctx.parallel, ctx.stage, in_flight)
    return max(floor, gap + small_floor)


class _Replay:
    """Large-pool requests through the allocator model, with the requested high-water mark."""

    def __init__(self, expandable: bool) -> None:
        self.alloc = CachingAllocator(expandable=expandable)
        self.live = self.peak = 0

    def malloc(self, nbytes: int, count: int = 1) -> list[tuple[int, int]]:
        if nbytes <= K_SMALL_SIZE:  # the small pool: its packing floor instead
            return []
        malloc = self.alloc.malloc
        out = [(malloc(nbytes), nbytes) for _ in range(count)]
        self.live += nbytes * count
        if self.live > self.peak:
            self.peak = self.live
        return out

    def free(self, handles: list[tuple[int, int]]) -> None:
        for handle, nbytes in handles:
            self.alloc.free(handle)
            self.live -= nbytes


class _Step(NamedTuple):
    """A replay's inputs as (bytes, count) blocks: what `_run` needs, hashable for its cache
    (scenarios with the same per-rank blocks, e.g. other dp degrees, share one replay)."""

    expandable: bool
    weights: tuple[tuple[int, int], ...]  # weights, then fp32 masters
    states: tuple[tuple[int, int], ...]  # created by the first optimizer step
    temps: tuple[tuple[int, int], ...]  # optimizer-step temporaries
    other_grads: tuple[tuple[int, int], ...]  # head, embedding, final norm
    layer_grads: tuple[tuple[int, int], ...]  # one layer's
    saved: tuple[tuple[int, int], ...]  # one layer's saved tensors, one micro-batch
    slots: int  # layers x micro-batches in flight
    loss: tuple[int, int]  # 16-bit (0: none) and fp32 logits bytes; (0, 0): no loss here
    kept: bool  # gradients kept across steps (ZeRO-2/3, Megatron buffers)


def replay_gap(spec: ModelSpec, training: TrainingConfig, parallel: ParallelConfig,
               stage: int, in_flight: float) -> int:
    """Reserved minus allocated high-water marks of two replayed steps (module docstring)."""
    return _run(_step(RankContext(spec, training, parallel, stage), in_flight))


def _step(ctx: RankContext, in_flight: float) -> _Step:
    tr, n_layers = ctx.training, ctx.num_layers
    dim0 = ctx.engine == "fsdp2"

    def size(t: RankTensor, shard: int, dtype: str) -> int:
        return alloc(_numel(t.numel, t.rows, ctx.expert_shard(shard) if t.is_expert else shard,
                            dim0), dtype)

    opt = optimizer_state_split(ctx)
    train = ctx.train_tensors
    weights = [(size(t, ctx.param_shard, t.dtype or tr.weight_dtype), t.count)
               for t in ctx.tensors]
    if opt["master"]:
        weights += [(size(t, ctx.state_shard, "fp32"), t.count) for t in train]
    n_states = _STATE_TENSORS.get(tr.optimizer, 2 if tr.optimizer.endswith("8bit") else 0)
    state_dtype = "int8" if tr.optimizer.endswith("8bit") else tr.state_dtype
    states = [(size(t, ctx.state_shard, state_dtype), t.count * n_states)
              for t in train] if opt["states"] and n_states else []
    fp32 = [(size(t, ctx.state_shard, "fp32"), t.count) for t in train]
    total32 = sum(b * n for b, n in fp32)
    copies = profile(ctx).optimizer_step // total32 if total32 else 0
    per_layer = [t for t in train if n_layers and t.count >= n_layers and not t.count % n_layers]
    g_dtype = grad_dtype(ctx)
    has_grads = gradients_bytes(ctx) > 0
    other = [(size(t, ctx.grad_shard, g_dtype), t.count) for t in train
             if t not in per_layer] if has_grads else []
    layer = [(size(t, ctx.grad_shard, g_dtype), t.count // n_layers)
             for t in per_layer] if has_grads else []
    saved = [] if tr.framework == "megatron" or tr.activation_offload else [
        (s.nbytes // s.count, s.count) for s in layer_saved(ctx, mostly_moe(ctx))]
    x = dims(ctx)
    nv = x.b * x.s * x.V // (tr.chunked_ce if chunks_loss(tr) else 1)
    loss = (0, 0)
    if ctx.is_last_stage and tr.framework != "megatron":
        loss = (alloc(nv, tr.compute_dtype) if tr.compute_dtype != "fp32" else 0,
                alloc(nv, "fp32"))
    return _Step(tr.expandable_segments, tuple(weights), tuple(states),
                 tuple(fp32) * copies, tuple(other), tuple(layer), tuple(saved),
                 int(n_layers * in_flight), loss, gradients_persistent(ctx))


@lru_cache(maxsize=4096)
def _run(st: _Step) -> int:
    r = _Replay(st.expandable)
    for b, n in st.weights:
        r.malloc(b, n)
    grads: list[tuple[int, int]] = []
    c16, f32 = st.loss
    for step in (1, 2):
        acts = [[h for b, n in st.saved for h in r.malloc(b, n)] for _ in range(st.slots)]
        loss_grad: list[tuple[int, int]] = []
        if f32:
            logits = r.malloc(c16) if c16 else []
            upcast = r.malloc(f32)
            r.free(logits)
            logprobs = r.malloc(f32)
            r.free(upcast)
            d_logprobs, d_logits = r.malloc(f32), r.malloc(f32)
            r.free(d_logprobs + logprobs)
            loss_grad = r.malloc(c16) if c16 else []
            r.free(d_logits)
        new_grads = step == 1 or not st.kept
        if new_grads:
            grads += [h for b, n in st.other_grads for h in r.malloc(b, n)]
        for i, layer in enumerate(reversed(acts)):
            if new_grads:
                grads += [h for b, n in st.layer_grads for h in r.malloc(b, n)]
            r.free(layer)
            if i == 0:
                r.free(loss_grad)
        if step == 1:
            for b, n in st.states:
                r.malloc(b, n)
        r.free([h for b, n in st.temps for h in r.malloc(b, n)])
        if not st.kept:
            r.free(grads)
            grads = []
    return max(r.alloc.peak_reserved - r.peak, 0)
