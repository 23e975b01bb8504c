"""Encoder-only models (BERT, RoBERTa) as transformers 5.24 trains them: what one
post-LayerNorm layer, the embeddings and the head save for backward, with the dropout masks
training keeps, and the instants of a layer's backward. Legend: vramcalc/terms/saved.py;
the parameters: vramcalc/model.py `encoder_tensors`. One profile (transformers' modeling
code, `--framework hf`); vramcalc/scenario.py `encoder_unsupported` refuses the rest.

A layer (modeling_bert.py BertLayer; modeling_roberta.py is the same code), x its input:

    q, k, v = query(x), key(x), value(x)                     x kept by the 3 linears
    p = softmax(q @ kᵀ · scale)                              eager: q, kᵀ contiguous copies
    p' = dropout(p, attention_probs_dropout_prob)            bool mask; p' kept by p' @ v
    c = (p' @ v).transpose(1, 2).contiguous()                v copy; c kept by dense
    a = LayerNorm(dropout(dense(c)) + x)                     bool mask; LN input, mean, rstd
    y = LayerNorm(dropout(out(gelu(inter(a)))) + a)          a; inter output; gelu output;
                                                             bool mask; LN input, mean, rstd

Dropout is ATen's fused `native_dropout` on CUDA (aten/src/ATen/native/Dropout.cpp
`dropout` -> `is_fused_kernel_acceptable`), whose backward keeps only the bool mask; under
--attention flash the probability dropout runs inside the kernel, which keeps its RNG seed
and offset instead (vramcalc/trace/hf_models.py `encoder_config`). Under autocast
LayerNorm and softmax run in fp32 (CUDA's fp32 lists): the residual stream is fp32 and each
linear keeps its own 16-bit cast of its input.

Before torch 1.11 (`--torch-version`, TrainingConfig.softmax_keeps_input) softmax's and
log_softmax's autograd nodes keep their input beside their output: eager attention keeps the
masked scores (b, a, s, s) in the probabilities' dtype, and the loss its logits.
"""

from __future__ import annotations

from vramcalc.hf_config import ROBERTA_TYPES
from vramcalc.model import ModelSpec
from vramcalc.rank import RankContext
from vramcalc.terms.saved import Dims, Moment, Saved, bsh, dims, flash_scratch_bytes
from vramcalc.training import TrainingConfig
from vramcalc.units import ALLOC_ROUND_BYTES, alloc, ceil_div


def encoder_dropout(spec: ModelSpec, training: TrainingConfig | None) -> tuple[float, float]:
    """(hidden, attention-probability) dropout of an encoder run: the config's
    hidden_dropout_prob and attention_probs_dropout_prob; `--dropout 0` turns both off."""
    if training is not None and training.dropout == 0:
        return 0.0, 0.0
    return spec.hidden_dropout_prob, spec.attention_probs_dropout_prob


def _drop(ctx: RankContext) -> tuple[bool, bool]:
    """Whether hidden and attention-probability dropout keep masks in this run."""
    hidden, attn = encoder_dropout(ctx.spec, ctx.training)
    return hidden > 0, attn > 0 and ctx.training.attention == "eager"


def _linear_input(x: Dims, name: str, numel: int, readers: int, shape: str) -> list[Saved]:
    """A linear's input: kept once, or under autocast one c-typed cast per reader."""
    if x.amp:
        return [Saved(f"{name}.cast", numel, x.c, shape, "autocast's copy, one per linear",
                      readers)]
    return [Saved(name, numel, x.c, shape, "input of the linear(s)")]


def _layer_norm(x: Dims, name: str, tokens: int) -> list[Saved]:
    """nn.LayerNorm: its input (r; fp32 under autocast) and fp32 mean and 1/std."""
    return [Saved(f"{name}.input", tokens * x.h, x.r, "(T, h)", "LayerNorm input"),
            Saved(f"{name}.mean", tokens, "fp32", "(T)", "fp32 mean"),
            Saved(f"{name}.rstd", tokens, "fp32", "(T)", "fp32 1/std")]


def _mask(name: str, numel: int, shape: str, on: bool) -> list[Saved]:
    return [Saved(name, numel, "bool", shape, "native_dropout's mask")] if on else []


def probs_dtype(x: Dims) -> str:
    """BERT's eager softmax has no dtype argument: fp32 under autocast (CUDA's list), else c."""
    return "fp32" if x.amp else x.c


def layer_saved(ctx: RankContext) -> list[Saved]:
    """One encoder layer's saved tensors, one micro-batch (see the module docstring)."""
    x = dims(ctx)
    c, T = x.c, x.T
    hid, att = _drop(ctx)
    bsad = x.b * x.s * x.a * x.d
    f = ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp)
    out = _linear_input(x, "attn.input", bsh(x), 3, "(b, s, h) layer input")
    if ctx.training.attention == "eager":
        probs = x.b * x.a * x.s * x.s
        p_dt = probs_dtype(x)
        out += [Saved("attn.q", bsad, c, "(b, a, s, d)", "contiguous q for q @ kᵀ"),
                Saved("attn.k", bsad, c, "(b, a, d, s)", "contiguous kᵀ"),
                Saved("attn.probs", probs, p_dt, "(b, a, s, s)", "softmax output")]
        if ctx.training.softmax_keeps_input:  # torch < 1.11 (TrainingConfig)
            out.append(Saved("attn.probs_input", probs, p_dt, "(b, a, s, s)",
                             "softmax input (scores + mask; fp32 under autocast)"))
        out += _mask("attn.probs_mask", probs, "(b, a, s, s)", att)
        if att or p_dt != c:
            out.append(Saved("attn.probs_c", probs, c, "(b, a, s, s)",
                             "dropout output (or its c cast), kept by p' @ v"))
        out.append(Saved("attn.v", bsad, c, "(b, a, s, d)", "contiguous v for p' @ v"))
    else:  # SDPA: q, k, v views of the projections, output and logsumexp
        out += [Saved(f"attn.{n}", bsad, c, "(b, s, a, d)", "SDPA input") for n in "qkv"]
        out += [Saved("attn.out", bsad, c, "(b, s, a, d)", "SDPA output"),
                Saved("attn.lse", x.b * x.a * x.s, "fp32", "(b, a, s)", "logsumexp")]
    if ctx.training.attention == "eager":  # (SDPA: its output is dense's input)
        out.append(Saved("attn.o_input", bsad, c, "(b, s, a·d)", "contiguous copy for dense"))
    out += _mask("attn.out_mask", T * x.h, "(T, h)", hid)
    out += _layer_norm(x, "post_attention_norm", T)
    out += _linear_input(x, "mlp.input", T * x.h, 1, "(T, h) attention output")
    out += [Saved("mlp.fc_out", T * f, c, "(T, f)", "intermediate output, kept by gelu"),
            Saved("mlp.act", T * f, c, "(T, f)", "gelu output, kept by the output dense")]
    out += _mask("mlp.out_mask", T * x.h, "(T, h)", hid)
    out += _layer_norm(x, "output_norm", T)
    return out


def embedding_saved(ctx: RankContext) -> list[Saved]:
    """Per micro-batch: token ids, labels, token-type ids (BertEmbeddings gathers a (1, s)
    row of its buffer), RoBERTa's position ids (int64 (b, s), computed from the ids), the
    embedding LayerNorm and the embedding dropout's mask. BERT's position ids are a view of
    a buffer (weights/buffers)."""
    x = dims(ctx)
    spec = ctx.spec
    hid, _ = _drop(ctx)
    cls = spec.task == "sequence_classification"
    out = [Saved("input_ids", x.b * x.s, "int64", "(b, s)", "kept by the embedding"),
           Saved("labels", x.b if cls else x.b * x.s, "int64", "(b)" if cls else "(b, s)",
                 "the loader's batch")]
    if spec.type_vocab_size:
        out.append(Saved("token_type_ids", x.s, "int64", "(1, s)", "gathered from the buffer"))
    if spec.model_type in ROBERTA_TYPES:
        out.append(Saved("position_ids", x.b * x.s, "int64", "(b, s)",
                         "create_position_ids_from_input_ids, kept by the embedding"))
    out += _layer_norm(x, "embed_norm", x.T)
    out += _mask("embed.mask", x.T * x.h, "(T, h)", hid)
    return out


def head_saved(ctx: RankContext) -> list[Saved]:
    """The head's saved tensors. Classification: BertPooler takes y[:, 0] (a view, which a
    16/32-bit linear keeps with y's whole storage; autocast keeps a (b, h) cast instead),
    tanh, dropout, classifier (RoBERTa: dropout on y[:, 0] first, a (b, h) copy, then dense,
    tanh, dropout, out_proj). Masked LM: the transform (dense, gelu, LayerNorm) and the
    vocabulary projection's input."""
    x = dims(ctx)
    spec = ctx.spec
    hid, _ = _drop(ctx)
    b, h, c = x.b, x.h, x.c
    if spec.task == "masked_lm":
        out = _linear_input(x, "mlm.input", bsh(x), 1, "(T, h) last layer output")
        out += [Saved("mlm.dense_out", bsh(x), c, "(T, h)", "kept by gelu")]
        # LayerNorm under autocast: an fp32 copy of the 16-bit gelu output is its input
        out += [Saved("mlm.norm.input", bsh(x), x.r, "(T, h)", "gelu output (fp32 copy)"),
                Saved("mlm.norm.mean", x.T, "fp32", "(T)", "fp32 mean"),
                Saved("mlm.norm.rstd", x.T, "fp32", "(T)", "fp32 1/std")]
        out += _linear_input(x, "lm_head.input", bsh(x), 1, "(T, h) normed")
        return out
    out = []
    roberta = spec.model_type in ROBERTA_TYPES
    if roberta and hid:
        out += [Saved("pooler.drop_mask", b * h, "bool", "(b, h)", "dropout on y[:, 0]")]
        out += _linear_input(x, "pooler.input", b * h, 1, "(b, h) dropped first token")
    elif x.amp:
        out += _linear_input(x, "pooler.input", b * h, 1, "(b, h) first token")
    else:
        out.append(Saved("pooler.input", bsh(x), x.r, "(b, s, h)",
                         "y, kept whole through the y[:, 0] view"))
    out.append(Saved("pooler.tanh", b * h, c, "(b, h)", "tanh output"))
    if hid:
        out += [Saved("classifier.drop_mask", b * h, "bool", "(b, h)", "dropout mask"),
                Saved("classifier.input", b * h, c, "(b, h)", "dropout output")]
    return out


# ---- loss -------------------------------------------------------------------------------
def _rows(ctx: RankContext) -> tuple[int, int]:
    """(rows, classes) of the cross entropy: (b, num_labels) or (b·s, V) for masked LM."""
    x = dims(ctx)
    if ctx.spec.task == "sequence_classification":
        return x.b, ctx.spec.num_labels
    return x.b * x.s, x.V


def _loss_input_kept(ctx: RankContext) -> int:
    """torch < 1.11: log_softmax keeps its input too, the logits (their fp32 copy under
    autocast), alive at the loss's forward peak anyway (TrainingConfig.softmax_keeps_input)."""
    if not ctx.training.softmax_keeps_input:
        return 0
    n, k = _rows(ctx)
    return alloc(n * k, _loss_dtype(ctx))


def _loss_dtype(ctx: RankContext) -> str:
    """log_softmax's dtype: fp32 under autocast (CUDA's fp32 list) and for ModernBERT, whose
    loss (transformers loss_utils `ForMaskedLMLoss`) upcasts the logits; else the logits'
    (BERT's and RoBERTa's CrossEntropyLoss on 16-bit logits runs in 16 bits)."""
    if dims(ctx).amp or ctx.spec.model_type == "modernbert":
        return "fp32"
    return ctx.training.compute_dtype


def logits_saved_bytes(ctx: RankContext) -> int:
    """CrossEntropyLoss on the logits (modeling_bert.py): log_softmax keeps its output
    (`_loss_dtype`), nll_loss the loss and its total weight (0-dim); before torch 1.11
    log_softmax's input as well (`_loss_input_kept`)."""
    n, k = _rows(ctx)
    return alloc(n * k, _loss_dtype(ctx)) + 2 * ALLOC_ROUND_BYTES + _loss_input_kept(ctx)


def logits_forward_peak_bytes(ctx: RankContext) -> int:
    """End of the loss forward: the saved set + the c-typed logits (and under autocast the
    fp32 copy log_softmax converts)."""
    n, k = _rows(ctx)
    c = ctx.training.compute_dtype
    upcast = alloc(n * k, "fp32") if _loss_dtype(ctx) != c else 0
    return logits_saved_bytes(ctx) - _loss_input_kept(ctx) + alloc(n * k, c) + upcast


def logits_backward_peak_bytes(ctx: RankContext) -> int:
    """Loss backward: saved log-probabilities + dL/dlogprobs + dL/dlogits (`_loss_dtype`)
    + 3 scalars."""
    n, k = _rows(ctx)
    return 3 * alloc(n * k, _loss_dtype(ctx)) + 3 * ALLOC_ROUND_BYTES + _loss_input_kept(ctx)


# ---- instants inside a layer -------------------------------------------------------------
def _held(saved: list[Saved], gone: tuple[str, ...], prefixes: tuple[str, ...] = ()) -> int:
    return sum(t.nbytes for t in saved if t.name not in gone and (
        not prefixes or t.name.startswith(prefixes)))


def backward_moments(ctx: RankContext, saved: list[Saved], extra: int) -> list[Moment]:
    """The instants where one encoder layer's backward can peak (top-down). `saved`: the
    layer's saved list without recompute (a recomputed layer holds it again), `extra`: the
    checkpoint's input kept beside it under full recompute. g = dL/d residual (T·h in r) is
    held throughout.

    - output dense: the output LayerNorm's backward has run (its input, statistics and the
      dropout mask are freed); d y after the dropout (T·h) and d gelu-output (T·f in c)
      exist beside g, the weight gradient becomes `.grad` ("down"; under gradient
      accumulation or zero_grad(set_to_none=False) it is a temporary added into it);
    - (full recompute) the end of the layer's forward run again, before its backward: the
      whole saved set and the forward's temporaries at its output LayerNorm;
    - attention core: everything above it is freed; eager: the dropout's backward turns
      d p' into d p (both (b, a, s, s) in the probabilities' dtype) beside d v (b, s, a, d)
      while p, the mask, q and kᵀ are held; flash/SDPA: d out, dq, dk, dv and
      FlashAttention-2's scratch (vramcalc.terms.moments)."""
    x = dims(ctx)
    c, r = x.c, x.r
    g_res = alloc(bsh(x), r)
    f = ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp)
    top_gone = ("output_norm.input", "output_norm.mean", "output_norm.rstd", "mlp.out_mask")
    # with gradients kept from an earlier micro-batch, the weight gradient is a new tensor
    # that AccumulateGrad adds into `.grad` (vramcalc.terms.gradients.embedding_backward_bytes)
    accumulating = (ctx.parallel.num_microbatches or ctx.training.grad_accum) > 1 or (
        not ctx.training.set_to_none)
    dw = alloc(x.h * f, ctx.training.grad_dtype) if accumulating else 0
    out = [Moment("mlp", extra + _held(saved, top_gone),
                  2 * g_res + alloc(x.T * f, c) + dw, "down")]
    bsad = alloc(x.b * x.s * x.a * x.d, c)
    held = extra + _held(saved, ("attn.o_input", "attn.probs_c", "attn.v"), ("attn.",))
    if ctx.training.attention == "eager":
        p_dt = probs_dtype(x)
        work = g_res + bsad + 2 * alloc(x.b * x.a * x.s * x.s, p_dt)
    else:
        work = g_res + 4 * bsad + flash_scratch_bytes(x.b, x.a, x.s, x.d)
    out.append(Moment("attention", held, work, "mlp+o"))
    if ctx.training.recompute == "full":  # the end of the layer's recomputed forward
        out.append(Moment("recompute", extra + _held(saved, ()), _layer_end_work(ctx, False),
                          "none"))
    return out


def eager_forward_moment(ctx: RankContext, saved: list[Saved]) -> tuple[int, int]:
    """Eager attention in forward, inside the top layer: (saved bytes existing by then,
    temporaries). The larger of: the softmax, with the scaled scores (c), under autocast
    CUDA's fp32 copy of them, and the probabilities; and p' @ v's input cast under
    autocast, with p, the mask and the fp32 dropout output held and its c copy made."""
    x = dims(ctx)
    probs = x.b * x.a * x.s * x.s
    p_dt = probs_dtype(x)
    pre = _held(saved, (), ("attn.input", "attn.q", "attn.k"))
    soft = alloc(probs, x.c) + alloc(probs, p_dt) + (alloc(probs, "fp32") if x.amp else 0)
    moments = [(pre, soft)]
    if x.amp:
        _, att = _drop(ctx)
        kept = _held(saved, (), ("attn.probs",))  # p, the mask and the c copy being made
        dropped = alloc(probs, p_dt) if att else 0  # the fp32 dropout output it casts
        moments.append((pre, kept + dropped))
    if ctx.training.recompute == "full":  # a checkpointed layer keeps nothing
        moments = [(0, pre + work) for _, work in moments]
    locals_ = _forward_locals(ctx)
    return max(((held, work + locals_) for held, work in moments), key=lambda m: m[0] + m[1])


def _forward_locals(ctx: RankContext) -> int:
    """Under autocast without recompute, (b, s, h) tensors in r that only the forward's
    locals hold in the top layer: its input x and the embedding output (BertModel.forward
    keeps `embedding_output` until the encoder returns; one tensor with one layer)."""
    x = dims(ctx)
    if not x.amp or ctx.training.recompute == "full":
        return 0
    return alloc(bsh(x), x.r) * (2 if ctx.num_layers > 1 else 1)


def _layer_locals(ctx: RankContext, full: bool) -> int:
    """Held by a layer's forward locals from its attention on (`full`: a checkpointed
    forward, which saves nothing): the attention output a (kept for the residual; r, saved
    itself only without autocast and recompute) and BertLayer's `_`, the attention weights
    the attention returns (the dropout output, in the probabilities' dtype), where nothing
    else keeps them."""
    x = dims(ctx)
    _, att = _drop(ctx)
    probs = alloc(x.b * x.a * x.s * x.s, probs_dtype(x))
    weights = probs if ctx.training.attention == "eager" and (full or x.amp and att) else 0
    return (alloc(bsh(x), x.r) if (full or x.amp) else 0) + weights


def _layer_end_work(ctx: RankContext, full: bool) -> int:
    """At a layer's output LayerNorm, beyond what it saves: the output dropout's result (c),
    the new output y (r), the sum the LayerNorm reads (r, saved unless `full`) and the
    locals (`_layer_locals`)."""
    x = dims(ctx)
    y = alloc(bsh(x), x.r)
    return alloc(bsh(x), x.c) + y + (y if full else 0) + _layer_locals(ctx, full)


def forward_working_bytes(ctx: RankContext) -> int:
    """The top layer's forward at its output LayerNorm (`_layer_end_work`) plus the
    autocast locals (`_forward_locals`). Under full recompute the gelu's input and output
    (T·f in c each; under autocast beside a's c cast) can be the larger set."""
    x = dims(ctx)
    full = ctx.training.recompute == "full"
    end = _layer_end_work(ctx, full)
    if full:
        f = ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp)
        gelu = 2 * alloc(x.T * f, x.c) + (alloc(bsh(x), x.c) if x.amp else 0)
        end = max(end, gelu + _layer_locals(ctx, full))
    return end + _forward_locals(ctx)
