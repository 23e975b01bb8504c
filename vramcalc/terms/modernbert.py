"""ModernBERT as transformers 5.24 trains it (models/modernbert/modeling_modernbert.py): what
one pre-LayerNorm layer, the embeddings and the heads save for backward, and the instants
of a layer's backward. Legend: vramcalc/terms/saved.py; the parameters:
vramcalc/encoder_shapes.py. Every dropout is 0 (vramcalc/hf_modernbert.py refuses others), so
no mask is kept. The installed code has no unpadding and no compiled path: every attention
implementation runs on the padded (b, s) batch.

A layer (ModernBertEncoderLayer), x its input (r):

    n = attn_norm(x)                  LayerNorm (layer 0: nn.Identity, n = x)
    qkv = Wqkv(n)                     n kept (its c cast under autocast); (T, 3h) in c
    q, k, v = qkv.view(b, s, 3, a, d).unbind(2), each transposed to (b, a, s, d)
    q', k' = apply_rotary_pos_emb     q.float() · cos + rotate_half(q.float()) · sin, then
                                      .to(c): the muls keep cos and sin only; q', k' keep
                                      (b, s, a, d) memory order (q.float() preserves the
                                      strides of the strided view)
    o = attention(q', k', v)          SDPA: q', k', v (a view: the whole qkv storage),
                                      output, fp32 logsumexp; local layers pass a bool mask
                                      that SDPA turns into a c-typed (b, 1, s, s) bias
                                      (convert_boolean_attn_mask) kept by the kernel.
                                      eager: matmul copies q' and k'ᵀ (their memory order
                                      does not fold into bmm's batch), softmax in fp32
                                      (kept), its c copy and a contiguous v (kept by p @ v),
                                      the output's contiguous (b, s, a, d) copy
    h1 = x + Wo(o)                    o kept by Wo (SDPA's output is already (b, s, a, d))
    h2 = h1 + Wo'(gelu(i) · g)        mlp_norm keeps h1, mean, rstd; Wi keeps its input;
                                      i, g = Wi(.).chunk(2): gelu keeps i (a view: the whole
                                      (T, 2f) storage), the product keeps gelu(i) and g, Wo'
                                      keeps the product

The table lists per layer the LayerNorm that reads the layer's output (the next layer's
attn_norm, or final_norm after the last): layer 0's missing attn_norm then makes every row
alike (layer 0's Wqkv keeps the embedding norm's output instead of an attn_norm output).
"""

from __future__ import annotations

from vramcalc.rank import RankContext
from vramcalc.terms.encoder import _layer_norm, _linear_input
from vramcalc.terms.encoder import head_saved as bert_head_saved
from vramcalc.terms.saved import Dims, Moment, Saved, bsh, dims, flash_scratch_bytes
from vramcalc.units import alloc


def is_modernbert(ctx: RankContext) -> bool:
    return ctx.spec.model_type == "modernbert"


def num_local_layers(ctx: RankContext) -> int:
    """Layers whose attention is local (sliding window) in this model."""
    return ctx.spec.num_sliding_layers


def local_mask_built(ctx: RankContext) -> bool:
    """Whether transformers builds the local layers' mask: masking_utils
    `_ignore_bidirectional_mask_sdpa` skips it when kv_length < local_size (config
    .sliding_window = local_attention // 2), and eager_mask likewise."""
    spec = ctx.spec
    return bool(num_local_layers(ctx)) and ctx.training.seq_len >= (spec.sliding_window or 0) // 2


def layer_saved(ctx: RankContext) -> list[Saved]:
    """One ModernBERT layer's saved tensors, one micro-batch (see the module docstring)."""
    x = dims(ctx)
    c, T, f = x.c, x.T, x.f
    out = _linear_input(x, "attn.input", T * x.h, 1, "(T, h) normed layer input")
    if ctx.training.attention == "eager":
        probs = x.b * x.a * x.s * x.s
        out += [Saved("attn.q", T * x.h, c, "(b, a, s, d)", "contiguous q' for q' @ k'ᵀ"),
                Saved("attn.k", T * x.h, c, "(b, a, d, s)", "contiguous k'ᵀ"),
                Saved("attn.probs", probs, "fp32", "(b, a, s, s)", "fp32 softmax output")]
        if c != "fp32":
            out.append(Saved("attn.probs_c", probs, c, "(b, a, s, s)", "c copy, kept by p @ v"))
        out += [Saved("attn.v", T * x.h, c, "(b, a, s, d)", "contiguous v for p @ v"),
                Saved("attn.o_input", T * x.h, c, "(b, s, a·d)", "contiguous copy for Wo")]
    else:
        out += [Saved("attn.qkv", T * 3 * x.h, c, "(T, 3h)", "Wqkv output, kept through v"),
                Saved("attn.q", T * x.h, c, "(b, s, a, d)", "rotated q', SDPA input"),
                Saved("attn.k", T * x.h, c, "(b, s, a, d)", "rotated k', SDPA input"),
                Saved("attn.out", T * x.h, c, "(b, s, a, d)", "SDPA output, Wo's input"),
                Saved("attn.lse", x.b * x.a * x.s, "fp32", "(b, a, s)", "logsumexp")]
    out += _layer_norm(x, "mlp_norm", T)
    out += _linear_input(x, "mlp.input", T * x.h, 1, "(T, h) normed")
    out += [Saved("mlp.wi", T * 2 * f, c, "(T, 2f)", "Wi output, kept through gelu's input"),
            Saved("mlp.act", T * f, c, "(T, f)", "gelu output, kept by the product"),
            Saved("mlp.prod", T * f, c, "(T, f)", "gelu(i) · g, Wo's input")]
    out += _layer_norm(x, "next_norm", T)  # the layer output, read by the next LayerNorm
    return out


def embedding_saved(ctx: RankContext) -> list[Saved]:
    """Per micro-batch: token ids, labels, the embedding LayerNorm's input and statistics,
    the rotary tables (cos, sin (1, s, d) in r for each layer type, kept by the muls of
    every layer of that type) and, under SDPA, each local layer's c-typed (b, 1, s, s) bias."""
    x = dims(ctx)
    cls = ctx.spec.task == "sequence_classification"
    out = [Saved("input_ids", x.b * x.s, "int64", "(b, s)", "kept by the embedding"),
           Saved("labels", x.b if cls else x.b * x.s, "int64", "(b)" if cls else "(b, s)",
                 "the loader's batch")]
    out += _layer_norm(x, "embed_norm", x.T)
    types = 2 if num_local_layers(ctx) else 1
    out.append(Saved("rope.cos_sin", x.s * x.d, x.r, "(1, s, d)",
                     "rotary tables, two per layer type", 2 * types))
    if not local_mask_built(ctx):
        return out
    if ctx.training.recompute == "full":  # the checkpoints keep the model's mask instead
        out.append(_mask_saved(ctx, x))
    elif ctx.training.attention != "eager":
        out.append(Saved("attn.local_bias", x.b * x.s * x.s, x.c, "(b, 1, s, s)",
                         "SDPA's bias from the bool mask, one per local layer",
                         num_local_layers(ctx)))
    return out


def _mask_saved(ctx: RankContext, x: Dims) -> Saved:
    """The model's local-layer mask: SDPA's bool mask (sdpa_mask expands a (1, 1, s, s)
    storage to the batch), eager's float (b, 1, s, s) in r (torch.where materialises it)."""
    if ctx.training.attention == "eager":
        return Saved("attn.mask", x.b * x.s * x.s, x.r, "(b, 1, s, s)", "eager's float mask")
    return Saved("attn.mask", x.s * x.s, "bool", "(1, 1, s, s)", "SDPA's bool mask")


def head_saved(ctx: RankContext) -> list[Saved]:
    """The head's saved tensors (final_norm's input and statistics are the last layer's
    `next_norm`). Masked LM: ModernBertPredictionHead (dense, gelu, LayerNorm) and the
    decoder's input, as BERT's transform (vramcalc/terms/encoder.py `head_saved`).
    Classification, `cls` pooling: y[:, 0] is a view, which head.dense keeps with y's whole
    (T, h) storage (autocast keeps a (b, h) cast instead); `mean` pooling: the all-ones bool
    (b, s) mask (kept by y · mask) and its int64 (b, 1) sum (kept by the division); then
    dense, gelu, LayerNorm (fp32 copy of the gelu output under autocast) and the classifier's
    input."""
    x = dims(ctx)
    # under full recompute the last layer's checkpoint drops its `next_norm` row: final_norm
    # keeps its input and statistics itself
    out = _layer_norm(x, "final_norm", x.T) if ctx.training.recompute == "full" else []
    if ctx.spec.task == "masked_lm":
        return out + bert_head_saved(ctx)
    b, h, c = x.b, x.h, x.c
    if ctx.spec.classifier_pooling == "mean":
        out += [Saved("pool.mask", b * x.s, "bool", "(b, s)", "all-ones mask, kept by y · mask"),
                Saved("pool.count", b, "int64", "(b, 1)", "mask sum, kept by the division")]
        out += _linear_input(x, "head.input", b * h, 1, "(b, h) mean")
    elif x.amp:
        out += _linear_input(x, "head.input", b * h, 1, "(b, h) first token")
    else:
        out.append(Saved("head.input", bsh(x), x.r, "(b, s, h)",
                         "y, kept whole through the y[:, 0] view"))
    out += [Saved("head.dense_out", b * h, c, "(b, h)", "kept by gelu"),
            Saved("head.norm.input", b * h, x.r, "(b, h)", "gelu output (fp32 copy)"),
            Saved("head.norm.mean", b, "fp32", "(b)", "fp32 mean"),
            Saved("head.norm.rstd", b, "fp32", "(b)", "fp32 1/std")]
    out += _linear_input(x, "classifier.input", b * h, 1, "(b, h) normed")
    return out


# ---- instants ------------------------------------------------------------------------------
def _mask_bytes(ctx: RankContext, x: Dims) -> int:
    """The model's local-layer mask (`_mask_saved`), alive through its forward."""
    return _mask_saved(ctx, x).nbytes if local_mask_built(ctx) else 0


def forward_working_bytes(ctx: RankContext) -> int:
    """The top layer's forward at its end: Wo'(.) (T·h in c), the new residual (T·h in r),
    beside the model's masks. Under full recompute (a checkpointed layer keeps nothing) the
    MLP's product can be larger: Wi's output, gelu(i) and the product (4·T·f in c) beside
    h1 and mlp_norm's output (T·h in r each; under autocast also Wi's c cast)."""
    x = dims(ctx)
    end = alloc(bsh(x), x.c) + alloc(bsh(x), x.r)
    if ctx.training.recompute == "full":
        mlp = alloc(x.T * 2 * x.f, x.c) + 2 * alloc(x.T * x.f, x.c) + 2 * alloc(bsh(x), x.r)
        end = max(end, mlp + (alloc(bsh(x), x.c) if x.amp else 0))
    return end + _mask_bytes(ctx, x)


def _held(saved: list[Saved], prefixes: tuple[str, ...]) -> int:
    return sum(t.nbytes for t in saved if t.name.startswith(prefixes))


def backward_moments(ctx: RankContext, saved: list[Saved], extra: int) -> list[Moment]:
    """The instants where one layer's backward can peak (top-down), g = dL/d residual
    (T·h in r) held throughout:

    - MLP: Wo' has run; the product's backward leaves d gelu(i) and d g, gelu's backward
      d i, and chunk's backward concatenates them into d Wi-output (T, 2f): d i, d g and
      the (T, 2f) concatenation exist at once (4·T·f in c);
    - attention core: the MLP and mlp_norm are freed; SDPA: d out, dq, dk, dv and the
      kernel's scratch (FlashAttention-2's softmax_d and dq_accum, vramcalc.terms.moments);
      eager: the softmax backward turns d p into d scores ((b, a, s, s) in fp32, beside d p
      in c) while p, q, kᵀ are held, next to d v."""
    x = dims(ctx)
    c = x.c
    g_res = alloc(bsh(x), x.r)
    extra = 0  # the recomputed row holds the layer's input where the table has its output
    if ctx.training.recompute == "full" and local_mask_built(ctx) and (
            ctx.training.attention != "eager"):
        extra = alloc(x.b * x.s * x.s, c)  # a local layer's recomputed SDPA bias
    mlp_held = extra + _held(saved, ("attn.", "mlp_norm.", "mlp.input", "mlp.wi"))
    out = [Moment("mlp", mlp_held, g_res + 2 * alloc(x.T * x.f, c) + alloc(x.T * 2 * x.f, c),
                  "down")]
    bsad = alloc(bsh(x), c)
    held = extra + _held(saved, ("attn.input", "attn.qkv", "attn.q", "attn.k", "attn.lse"))
    if ctx.training.attention == "eager":  # p @ v's backward has freed p's c copy and v
        probs = x.b * x.a * x.s * x.s
        held += sum(t.nbytes for t in saved if t.name == "attn.probs")
        work = g_res + bsad + 2 * alloc(probs, "fp32")
    else:
        scratch = flash_scratch_bytes(x.b, x.a, x.s, x.d)
        held += alloc(bsh(x), c)  # SDPA's output, kept by the kernel's backward
        work = g_res + 4 * bsad + scratch
    out.append(Moment("attention", held, work, "mlp+o"))
    if ctx.training.recompute == "full":  # the end of the layer's recomputed forward
        out.append(Moment("recompute", extra + sum(t.nbytes for t in saved),
                          alloc(bsh(x), c) + alloc(bsh(x), x.r), "none"))
    return out


def _forward_locals(x: Dims) -> int:
    """Under autocast, (T, h) tensors in r that only locals hold inside a layer's attention:
    the attn_norm output (Wqkv keeps its cast) and the embedding output, which
    ModernBertModel.forward keeps in `mask_kwargs` until it returns."""
    return 2 * alloc(bsh(x), x.r) if x.amp else 0


def eager_forward_moment(ctx: RankContext, saved: list[Saved]) -> tuple[int, int]:
    """Eager attention in forward, at the top layer's softmax: (saved bytes existing by then,
    temporaries). Held: Wqkv's input, the q' and k' copies, and as locals the qkv output
    (v is a view of it), q' and k' themselves and the autocast locals (`_forward_locals`).
    Working: the scaled scores (c), softmax's fp32 input (the copy softmax(dtype=fp32)
    makes, or on a local layer the fp32 sum with the r-typed mask) and its fp32 output,
    beside the model's masks."""
    x = dims(ctx)
    probs = x.b * x.a * x.s * x.s
    pre = _held(saved, ("attn.input", "attn.q", "attn.k"))
    locals_ = alloc(x.T * 3 * x.h, x.c) + 2 * alloc(bsh(x), x.c) + _forward_locals(x)
    work = alloc(probs, x.c) + (alloc(probs, "fp32") if x.c != "fp32" else 0)
    if ctx.training.recompute == "full":  # a checkpointed layer keeps nothing
        return 0, pre + work + alloc(probs, "fp32") + locals_ + _mask_bytes(ctx, x)
    return pre, work + alloc(probs, "fp32") + locals_ + _mask_bytes(ctx, x)
