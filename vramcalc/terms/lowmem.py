"""Chunked cross entropy and activation offloading: what they leave on the device.

Legend as in vramcalc/terms/saved.py; n = --chunked-ce, N_i = b·s_i tokens of chunk i
(the sequence split by `tensor_split`: the first s mod n chunks have ⌈s/n⌉ positions), V the
vocabulary on this rank, c the compute dtype.

Chunked cross entropy (torchtune LinearCrossEntropyLoss, eager; vramcalc/trace/lowmem.py):

| moment            | logits-side bytes |
|-------------------|-------------------|
| kept for backward | Σ_i round512(N_i·V·4) log-probabilities + one 0-dim total weight per chunk (+ each chunk's labels copy when b > 1) + the loss |
| forward peak      | the above, with the last chunk's logits (N·V·c) and fp32 upcast (N·V·4) alive |
| backward peak     | the kept log-probabilities + dL/dlog-probs and dL/dlogits of one chunk (2·N·V·4) |

against 2·b·s·V·4 (+ b·s·V·c) and 3·b·s·V·4 without chunking: the fp32 buffers of the loss
exist one chunk at a time, the log-probabilities are still all kept (eager mode; a compiled
loss can keep less).

Activation offload (torchtune OffloadActivations, min_offload_size 1 KiB): every tensor a
transformer layer saves for backward, except parameters and tensors under 1 KiB, is copied to
pinned host memory in forward and comes back in backward one layer at a time. On the device:
the embedding- and head-side tensors, the layer being computed and, in backward, the layer
being differentiated; in host memory: every other layer's saved tensors of every micro-batch in
flight (`offload_host_bytes`).
"""

from __future__ import annotations

from vramcalc.features import chunks_loss, finetunes, offloads_activations
from vramcalc.rank import RankContext
from vramcalc.terms import linear_ce as lce
from vramcalc.terms.gradients import grad_dtype
from vramcalc.terms.saved import SAVED_BITS, Modifier, Moment, Saved, dims
from vramcalc.terms.saved_layers import embedding_saved
from vramcalc.units import ALLOC_ROUND_BYTES, alloc, ceil_div

MIN_OFFLOAD_BYTES = 1024  # torchtune OffloadActivations(min_offload_size=1024)


def chunk_tokens(ctx: RankContext) -> list[int]:
    """Tokens (b·s_i) of each cross-entropy chunk on this rank."""
    x = dims(ctx)
    n = min(ctx.training.chunked_ce, x.s)
    q, r = divmod(x.s, n)
    return [x.b * (q + (1 if i < r else 0)) for i in range(n)]


def head_input_split(ctx: RankContext) -> bool:
    """Whether a trained output layer keeps one input storage per chunk: a chunk of a
    (b > 1, s, h) tensor is not contiguous, so the matmul keeps a contiguous copy, and under
    autocast each chunk's 16-bit cast is a new tensor. Otherwise it keeps views of the final
    norm's output, which is then one storage."""
    x = dims(ctx)
    if lce.applies(ctx.training):  # the flattened rows' chunks are contiguous row ranges
        return False
    return not finetunes(ctx.training) and (x.b > 1 or x.amp)


def adjust_head_saved_chunked(ctx: RankContext, saved: list[Saved]) -> list[Saved]:
    """The head-side saved list under chunked cross entropy: when the output layer keeps a
    copy per chunk (`head_input_split`), the first chunk's is kept before the loss starts
    (an activation) and the others are counted with the loss (`chunked_saved_bytes`)."""
    if not head_input_split(ctx):
        return saved
    x = dims(ctx)
    first = chunk_tokens(ctx)[0]
    return [Saved(t.name, first * x.h, t.dtype, "(b, s/n, h)", t.why + ", first chunk")
            if t.name.startswith("lm_head.input") else t for t in saved]


def chunked_saved_bytes(ctx: RankContext) -> int:
    """Kept from the end of forward into backward (table in the module docstring)."""
    if not ctx.is_last_stage:
        return 0
    x = dims(ctx)
    out = ALLOC_ROUND_BYTES  # the loss
    chunks = chunk_tokens(ctx)
    for n in chunks:
        out += alloc(n * x.V, "fp32") + ALLOC_ROUND_BYTES  # log-probs, total weight
        if x.b > 1:
            out += alloc(n, "int64")  # the chunk's labels, reshaped (copied) for nll_loss
    if head_input_split(ctx):  # the other chunks' copies of the output layer's input
        out += sum(alloc(n * x.h, x.c) for n in chunks[1:])
    return out


def chunked_forward_peak_bytes(ctx: RankContext) -> int:
    """The loss in forward: everything kept plus the last chunk's logits and upcast."""
    if not ctx.is_last_stage:
        return 0
    x = dims(ctx)
    last = chunk_tokens(ctx)[-1]
    return chunked_saved_bytes(ctx) + alloc(last * x.V, x.c) + alloc(last * x.V, "fp32")


def chunked_backward_peak_bytes(ctx: RankContext) -> int:
    """The loss backward: kept log-probabilities + one chunk's two fp32 gradient buffers;
    with a trained output layer, also the instant its second chunk's weight gradient is
    summed into the first (gradient, new chunk's gradient and their sum: 3·V·h in the
    gradient dtype) while the log-probabilities of the n − 2 chunks not yet reached are
    kept."""
    if not ctx.is_last_stage:
        return 0
    x = dims(ctx)
    chunks = chunk_tokens(ctx)
    saved = chunked_saved_bytes(ctx)
    first = saved + 2 * alloc(chunks[-1] * x.V, "fp32")
    if finetunes(ctx.training) or len(chunks) < 2 or x.amp:
        # under autocast the chunks' 16-bit weight gradients are upcast one at a time as
        # they arrive, which the trace shows never outgrows the first instant
        return first
    done = sum(alloc(n * x.V, "fp32") for n in chunks[-2:])
    return max(first, saved - done + 3 * alloc(x.V * x.h, grad_dtype(ctx)))


# ---- activation offload ----------------------------------------------------------------
def stays_on_device(t: Saved) -> bool:
    """Tensors under min_offload_size stay on the device."""
    return ceil_div(t.numel * SAVED_BITS[t.dtype], 8) < MIN_OFFLOAD_BYTES


def device_layer_bytes(saved: list[Saved]) -> int:
    """The part of one layer's saved tensors offloading leaves on the device."""
    return sum(t.nbytes for t in saved if stays_on_device(t))


def offload_host_bytes(ctx: RankContext, saved: list[Saved], in_flight: float = 1.0) -> int:
    """Pinned host memory for the offloaded activations of `in_flight` micro-batches, each
    layer saving `saved`."""
    per_layer = sum(t.nbytes for t in saved if not stays_on_device(t))
    return int(in_flight * ctx.num_layers * per_layer)


def offload_forward_working_bytes(ctx: RankContext) -> int:
    """The top layer's forward under offloading: its saved tensors are in host memory, so
    what is alive is what the code still references — the residual (T·h, r) and, inside the
    MLP, its normed input, gate, up, act and act·up (gated: T·h + 4·T·f; 2-matrix: fc and
    act), or at the layer's end the MLP output and the new residual (adapters' and QLoRA's
    temporaries: vramcalc.terms.finetune_activations, without the saved tensors)."""
    x = dims(ctx)
    f = ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp)
    n_f = 3 if ctx.spec.mlp_kind == "gated" else 2
    residual = alloc(x.T * x.h, x.r)
    mlp = residual + alloc(x.T * x.h, x.r) + n_f * alloc(x.N * f, x.c)
    end = residual + alloc(x.T * x.h, x.c) + alloc(x.T * x.h, x.r)
    return max(mlp, end)


# the saved tensors each backward instant reads (brought back from host memory for it)
_MOMENT_INPUTS = {
    "mlp": ("mlp.act", "mlp.up", "mlp.fc_out", "mlp.gelu.half_x", "mlp.gelu.one_plus"),
    "attention": ("attn.q", "attn.k", "attn.v", "attn.out", "attn.lse", "attn.probs",
                  "attn.probs_c"),
    "post_norm": ("post_norm.x_fp32",),
    "input_norm": ("input_norm.x_fp32",),
}


def offload_moments(ctx: RankContext, moments: list[Moment], saved: list[Saved]
                    ) -> list[Moment]:
    """Backward instants under offloading: of the layer's saved tensors only those the
    running node reads are on the device (copied back for it), plus the small ones that
    never left."""
    small = device_layer_bytes(saved)
    out = []
    for m in moments:
        names = _MOMENT_INPUTS.get(m.name, ())
        held = small + sum(t.nbytes for t in saved if t.name in names
                           and not stays_on_device(t))
        out.append(Moment(m.name, held, m.work, m.grads))
    return out


def offloaded_edge_bytes(ctx: RankContext) -> int:
    """Embedding-side tensors the layers save (rotary tables, the eager mask): offloading
    copies them to the host with each layer, so once the forward returns (its locals gone)
    the device no longer holds them."""
    return sum(t.nbytes for t in embedding_saved(ctx) if t.name.startswith(
        ("rope.", "attn.mask", "position_ids")) and not stays_on_device(t))


def offloaded_head_bytes(ctx: RankContext, head: list[Saved]) -> int:
    """Of the head's saved tensors (`head`), those in host memory: torchtune's recipes wrap
    the whole model's forward but the output projection in the offloading hooks
    (`get_act_offloading_ctx_manager`), so under checkpointing the final norm's go too."""
    if ctx.training.framework != "torchtune" or ctx.training.recompute != "full":
        return 0
    return sum(t.nbytes for t in head
               if t.name.startswith("final_norm.") and not stays_on_device(t))


class ActivationOffload(Modifier):
    """The layers' saved tensors in pinned host memory between forward and backward."""

    name = "activation_offload"
    keeps_layers_on_device = False

    def applies(self, ctx: RankContext) -> bool:
        return offloads_activations(ctx.training)

    def backward_moments(self, ctx: RankContext, moments: list[Moment],
                         saved: list[Saved]) -> list[Moment]:
        if ctx.training.recompute == "full":  # the recompute runs in backward, outside the
            return moments  # offloading hooks: the recomputed layer's set is on the device
        return offload_moments(ctx, moments, saved)

    def forward_working_bytes(self, ctx: RankContext, saved: list[Saved],
                              layers_on_device: bool, moe: bool) -> int:
        if ctx.training.recompute == "full":  # a checkpointed layer saves nothing itself
            return 0
        return offload_forward_working_bytes(ctx)

    def resident_layer_bytes(self, ctx: RankContext, saved: list[Saved]) -> int | None:
        return device_layer_bytes(saved)

    def offloaded_edge_bytes(self, ctx: RankContext) -> int:
        return offloaded_edge_bytes(ctx)

    def offloaded_head_bytes(self, ctx: RankContext, head: list[Saved]) -> int:
        return offloaded_head_bytes(ctx, head)

    def host_bytes(self, ctx: RankContext, saved: list[Saved], in_flight: float) -> int:
        return offload_host_bytes(ctx, saved, in_flight)


class ChunkedLoss(Modifier):
    """Cross entropy over token chunks: the head side keeps the first chunk's lm_head input
    (the loss-side buffers are the logits term's, vramcalc.terms.logits)."""

    name = "chunked_ce"

    def applies(self, ctx: RankContext) -> bool:
        return chunks_loss(ctx.training)

    def head_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        return adjust_head_saved_chunked(ctx, saved)
