"""The analytic engine for encoder-decoder models (T5, mT5, BART; `--framework hf`, one GPU or
DDP, full training, no or full recompute): the step's phases from the saved-tensor tables of
vramcalc/terms/seq2seq.py (legend there), refereed by the trace engine, which runs
transformers' own T5ForConditionalGeneration / BartForConditionalGeneration.

Forward: the encoder's Le layers at s tokens, then the decoder's Ld layers at t tokens, each
reading the encoder output e (b, s, h) in its cross-attention; the peak is at the loss
(every saved tensor, the logits and the loss's fp32 buffers, and what the model's output
object still references: e, and T5's unscaled decoder output), or, with a small
vocabulary, at the top decoder layer's FF output projection (the decoder stack's locals:
vramcalc.terms.seq2seq `decoder_forward_locals`).

Backward runs the decoder top-down, then the encoder (autograd's order: e's gradient, which
every decoder layer's cross-attention k, v add into, is complete only when the decoder's
bottom layer is done). Its instants:

- the loss backward (every activation and three fp32 (b·t, V) buffers);
- the top decoder layer, at its FF output projection (d residual, d FF hidden beside the
  saved input) and at its cross-attention core (eager: d p', d p at (b, a, t, s)), with
  what lies above each freed: every activation but the head's, and the lm_head's weight
  gradient waiting in autograd's input buffer for the two embeddings' shares
  (transformers ties lm_head, encoder and decoder embed_tokens to `shared`);
- the decoder embedding's backward: the encoder's activations, every decoder gradient, the
  encoder output's gradient (b, s, h; every cross-attention's k, v added into it) and
  3·V·h (the buffer, the embedding's share and their sum): with a large vocabulary the
  backward's peak;
- the top encoder layer, likewise at s tokens: the encoder's activations, every decoder
  gradient and the tied buffer;
- the encoder embedding's backward: every gradient, the tied buffer, the embedding's own
  (V, h) gradient and their sum (3 copies of V·h).
"""

from __future__ import annotations

from vramcalc.errors import InputError
from vramcalc.hardware import GPUProfile
from vramcalc.phases import Phase, StageBase
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import seq2seq as s2
from vramcalc.terms import transients as tr
from vramcalc.terms.gradients import gradients_at_step_bytes, gradients_bytes, gradients_persistent
from vramcalc.terms.load import init_reserved_bytes, load_parts
from vramcalc.terms.optimizer_states import optimizer_state_split
from vramcalc.terms.reserved import reserved_pad_bytes
from vramcalc.terms.saved import Saved, efficient_scratch_bytes, flash_scratch_bytes
from vramcalc.terms.weights import weight_parts
from vramcalc.units import alloc


def seq2seq_unsupported(scn: Scenario) -> str | None:
    """What of this (resolved) scenario the encoder-decoder tables do not model, or None."""
    tr_, spec = scn.training, scn.model
    pieces = ((f"--recompute {tr_.recompute}", tr_.recompute == "selective"),
              (f"--precision {tr_.precision} (fp16 weights: T5's inf clamps)",
               spec.model_type != "bart" and tr_.weight_dtype == "fp16"),
              ("--optimizer-in-backward", tr_.optimizer_in_backward),
              ("tie_word_embeddings false (BART's unused `shared` keeps no gradient)",
               not spec.tie_word_embeddings))
    return next((piece for piece, on in pieces if on), None)


def check_seq2seq(scn: Scenario) -> None:
    """InputError naming what the analytic engine does not model for this encoder-decoder."""
    missing = seq2seq_unsupported(scn)
    if missing:
        raise InputError(f"{scn.model.name}: the analytic engine models encoder-decoder "
                         "training (T5 and BART, eager or flash attention; no or full "
                         f"recompute) so far; not {missing}: run `vramcalc trace` with "
                         "the same options to measure it")


def _bytes(saved: list[Saved], prefixes: tuple[str, ...] = ()) -> int:
    return sum(t.nbytes for t in saved if not prefixes or t.name.startswith(prefixes))


def _layer_grads(ctx: RankContext, dtype: str, linear: bool = False) -> tuple[int, int, int]:
    """(one encoder layer's, one decoder layer's, the rest's) gradient bytes (`linear`: the
    linears' parameters only, autocast's casts): per tensor, rounded; the decoder has 2 of
    every attention tensor and 3 norms to the encoder's 2."""
    enc = dec = 0
    for t in ctx.tensors:
        if t.group != "layer" or "relative_attention_bias" in t.name or (
                linear and "norm" in t.name):
            continue
        one = alloc(t.numel, dtype)
        if t.name.startswith("attn."):
            enc, dec = enc + one, dec + 2 * one
        elif t.name.startswith("layer_norm"):
            enc, dec = enc + 2 * one, dec + 3 * one
        else:
            enc, dec = enc + one, dec + one
    x = s2.s2s_dims(ctx)
    return enc, dec, gradients_bytes(ctx) - x.Le * enc - x.Ld * dec


def _part(ctx: RankContext, prefixes: tuple[str, ...], dtype: str, casts: bool = False) -> int:
    """One layer's copy of the tensors named `prefixes` in `dtype`; `casts`: autocast's
    copies, linears' parameters only (0 without autocast)."""
    if casts and not ctx.training.is_autocast:
        return 0
    return sum(alloc(t.numel, dtype) for t in ctx.tensors if t.group == "layer"
               and t.name.startswith(prefixes) and not (casts and "norm" in t.name))


def _autocast_cache(ctx: RankContext) -> int:
    """torch.autocast's cast cache at the end of forward: every linear weight (and bias) in
    c once, the tied lm_head's `shared` included (embeddings are not cast)."""
    if not ctx.training.is_autocast:
        return 0
    c = ctx.training.compute_dtype
    out = sum(t.count * alloc(t.numel, c) for t in ctx.tensors
              if t.group in ("layer", "head") and "norm" not in t.name
              and "relative_attention_bias" not in t.name)
    return out + (alloc(ctx.spec.vocab_size * ctx.spec.hidden_size, c)
                  if ctx.spec.tie_word_embeddings else 0)


def _ff_work(x: s2.S2S, n: int) -> int:
    """The FF's backward at its output projection: d residual (n·h in r, held for the
    residual path and read by the output dropout's backward), and the projection's input
    gradient beside the activation's saved input (n·f in c each)."""
    return alloc(n * x.h, x.r) + 2 * alloc(n * x.f, x.c)


def _core_work(x: s2.S2S, q: int, k: int, bias_grad: bool = False) -> int:
    """The attention core's backward beside d residual (b, q, h in r). Eager: d v and d p',
    d p (b, a, q, k) in the probabilities' dtype (fp32 under autocast). SDPA (CUDA's flash
    kernel; memory-efficient for fp32): its incoming d out (b, q, a·d), dq (b, a, q, d), dk,
    dv (b, a, k, d), all in c, and FlashAttention-2's fp32 scratch (`flash_scratch_bytes`);
    T5's memory-efficient kernel its scratch (`efficient_scratch_bytes`) and, for a bias that
    requires grad (`bias_grad`), the bias gradient (b, a, q, k₁₆) in c (attention_backward.cu
    `_efficient_attention_backward`: the last dimension aligned to 16, then sliced)."""
    res = alloc(x.b * q * x.h, x.r)
    if not x.eager:
        scratch = efficient_scratch_bytes(x.b, x.a, q, x.d, x.c == "fp32") if x.biased else (
            flash_scratch_bytes(x.b, x.a, q, x.d))
        grad_bias = alloc(x.b * x.a * q * (-(-k // 16) * 16), x.c) if bias_grad else 0
        return (res + 2 * alloc(x.b * q * x.a * x.d, x.c) + 2 * alloc(x.b * k * x.a * x.d, x.c)
                + scratch + grad_bias)
    probs = x.b * x.a * q * k
    p_dt = "fp32" if x.amp else x.c
    return res + alloc(x.b * k * x.a * x.d, x.c) + 2 * alloc(probs, p_dt)


def _core_done(x: s2.S2S, block: str) -> tuple[str, ...]:
    """What of the attention `block` ("attn", "cross") is freed when its core's backward
    runs: eager, p' @ v's backward has run (out_proj's input copy, p's c copy and v); SDPA
    keeps q, k, v, its output and logsumexp until its own backward returns."""
    return tuple(f"{block}.{n}" for n in (("o_input", "probs_c", "v") if x.eager else ()))


def _checkpointed_moments(x: s2.S2S) -> list[tuple[int, tuple[str, ...]]]:
    """Inside the top encoder layer's forward under gradient checkpointing, which saves
    nothing: (live bytes of the layer, the linears whose autocast casts are not made yet).

    SDPA (BART): at SDPA, q, k, v and its output (b·s·a·d, c each) and the fp32 logsumexp
    (b, a, s), out_proj and the FF not cast yet (T5: the logsumexp's rows to 32, the layer's
    (1, a, s, s₈) bias copy in c beside its fp32 original under autocast, the normed input); at the FF's activation dropout, the
    attention LN's output (the block's residual, b·s·h in r), the GELU output and the
    dropout's output (b·s·f, c each) and mask (bool), fc2 not cast yet.
    Eager: at the attention dropout, q, k, v (b·s·a·d, c), the softmax output p and the
    dropout's output and mask (b·a·s², p in fp32 under autocast), then under autocast p'
    with its c cast for p' @ v; T5 also its normed input (a local of T5LayerSelfAttention,
    r) and, with one layer, the (1, a, s, s) bias values. BART also at its softmax: the
    scaled scores (c), under autocast their fp32 copy (CUDA's fp32 list; ATen's softmax
    converts a bf16 input), and p."""
    late = ("mlp.", "attn.o.")
    n = x.b * x.s
    qkv = 3 * alloc(n * x.a * x.d, x.c)
    if not x.eager and x.biased:  # T5: the lse rows to 32; the layer's bias copy (under
        # autocast beside its fp32 original), its normed input, with one layer the bias values
        s8 = -(-x.s // 8) * 8
        sdpa = qkv + alloc(n * x.a * x.d, x.c) + alloc(x.b * x.a * (-(-x.s // 32) * 32), "fp32")
        sdpa += alloc(x.a * x.s * s8, x.c) + (alloc(x.a * x.s * x.s, "fp32") if x.amp else 0)
        sdpa += alloc(n * x.h, x.r) + (alloc(x.s * x.s * x.a, x.r) if x.Le == 1 else 0)
        ff = alloc(n * x.h, x.r) + 2 * alloc(n * x.f, x.c) + (alloc(n * x.f, "bool")
                                                               if x.act else 0)
        return [(sdpa, late), (ff, ("mlp.wo.",))]
    if not x.eager:
        sdpa = qkv + alloc(n * x.a * x.d, x.c) + alloc(x.b * x.a * x.s, "fp32")
        ff = alloc(n * x.h, x.r) + 2 * alloc(n * x.f, x.c) + (alloc(n * x.f, "bool")
                                                               if x.act else 0)
        return [(sdpa, late), (ff, ("mlp.wo.",))]
    probs = x.b * x.a * x.s * x.s
    p_dt = "fp32" if x.amp else x.c
    drop = alloc(probs, p_dt) + alloc(probs, "bool") if x.att else 0
    core = alloc(probs, p_dt) + max(drop, drop + (alloc(probs, x.c) - alloc(probs, p_dt)
                                                  if x.amp else 0))
    if x.t5:
        extra = alloc(n * x.h, x.r) + (alloc(x.s * x.s * x.a, x.r) if x.Le == 1 else 0)
        return [(qkv + core + extra, late)]
    soft = alloc(probs, x.c) + (alloc(probs, "fp32") if x.amp else 0) + alloc(probs, p_dt)
    return [(qkv + core, late), (qkv + soft, late)]


def seq2seq_stage_phases(scn: Scenario, gpu: GPUProfile | None
                         ) -> tuple[list[Phase], int, tuple[int, int]]:
    """Phases (steady state), the first-step peak, and reserved minus allocated at the peak
    (see vramcalc.analytic.stage_phases) of an encoder-decoder on one rank."""
    check_seq2seq(scn)
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    train = scn.training
    x = s2.s2s_dims(ctx)
    opt = optimizer_state_split(ctx)
    G = gradients_bytes(ctx)
    keep_grads = train.grad_accum > 1 or gradients_persistent(ctx)
    g_acc = G if keep_grads else 0
    buffers = {"weights/buffers": _buffers(ctx)} if _buffers(ctx) else {}
    B = StageBase({**weight_parts(ctx), **buffers,
                   "optimizer_states/states": opt["states"],
                   "optimizer_states/master": opt["master"]},
                  {"transients/cublas_workspace": tr.cublas_workspace_bytes(gpu, train),
                   "transients/comm_buffers": tr.persistent_buffer_bytes(ctx)})

    edges = s2.edges_saved(x)
    enc_layers = (x.Le - 1) * _bytes(s2.encoder_layer_saved(x)) + _bytes(
        s2.encoder_layer_saved(x, True))
    dec_top = s2.decoder_layer_saved(x, x.Ld == 1)
    dec_layers = (x.Ld - 1) * _bytes(s2.decoder_layer_saved(x)) + _bytes(
        s2.decoder_layer_saved(x, True))
    head = _bytes(edges, ("dec_final.", "lm_head."))
    enc_edges = _bytes(edges, ("input_ids", "enc_embed.", "enc_final.", "enc_out"))
    A = enc_layers + dec_layers + _bytes(edges)
    enc_all = enc_layers + enc_edges + _bytes(edges, ("labels", "decoder_input_ids"))
    dec_held = A - head  # below the head, in the decoder's backward
    enc_held = enc_all - _bytes(edges, ("enc_final.", "enc_out", "decoder_input_ids"))
    cache = _autocast_cache(ctx)
    enc_cast = x.Le * _layer_grads(ctx, x.c, True)[0] if cache else 0
    body_cast = cache - alloc(x.V * x.h, x.c) if cache else 0
    ck = s2.checkpoint_saved(x) if x.full else []
    if x.full:  # checkpoints only; a layer holds its whole set again once re-run
        A, head = _bytes(ck), _bytes(ck, ("dec_final.", "lm_head."))
        top_out = alloc(x.b * x.t * x.h, x.r) if x.t5 or not x.amp else 0  # read by the head
        dec_held = A - head - top_out + _bytes(dec_top)
        enc_all = _bytes(ck, ("input_ids", "labels", "decoder_input_ids", "enc_embed.",
                              "enc_final.", "enc_out", "enc."))
        enc_held = enc_all - _bytes(ck, ("enc_final.", "enc_out", "decoder_input_ids")) - (
            alloc(x.b * x.s * x.h, x.r)) + _bytes(s2.encoder_layer_saved(x, x.Le == 1))
        enc_cast //= max(x.Le, 1)  # the re-run layer's casts only
        body_cast = _layer_grads(ctx, x.c, True)[1] if cache else 0

    # forward: at the loss, the model's output still references e (and the decoder output:
    # T5's before the d_model^-0.5 scaling; under autocast BART's, whose lm_head keeps a c
    # cast) where no saved tensor is that storage
    refs = (alloc(x.b * x.s * x.h, x.r) if x.amp and not x.full else 0) + (
        alloc(x.b * x.t * x.h, x.r) if x.t5 or x.amp else 0)
    forward = Phase("forward", B, g_acc, {
        "activations": A + refs, "transients/autocast_cache": cache,
        "logits": s2.logits_forward_peak_bytes(x)})
    # or at the top decoder layer's wo, before its output dropout and residual exist
    top_ff_tail = _bytes(dec_top, ("ff.out_mask", "ff.residual", "ff.sum", "ff.norm."))
    layer_end = Phase("forward", B, g_acc, {
        "activations": A - head - top_ff_tail + s2.decoder_forward_locals(x),
        "transients/autocast_cache": cache - (alloc(x.V * x.h, x.c) if cache else 0),
        "transients/layer_forward": alloc(x.b * x.t * x.h, x.c)})
    if not x.full:
        forward = max(forward, layer_end, key=lambda p: p.total)
    else:  # inside the top encoder layer's (unsaved) forward: `_checkpointed_moments`
        # BART's encoder forward also holds its locals `inputs_embeds` and `embed_pos`
        # (modeling_bart.py BartEncoder.forward), (b, s, h) in r each
        so_far = _bytes(ck, ("input_ids", "labels", "enc_embed.", "enc.bias")) + (
            x.Le - 1 + (0 if x.t5 else 2)) * alloc(x.b * x.s * x.h, x.r)
        for live, late in _checkpointed_moments(x):
            inner = Phase("forward", B, g_acc, {
                "activations": so_far + live, "transients/autocast_cache": x.Le * _layer_grads(
                    ctx, x.c, True)[0] - _part(ctx, late, x.c, True) if cache else 0})
            forward = max(forward, inner, key=lambda p: p.total)
    loss_bwd = Phase("backward", B, g_acc, {
        "activations": A, "transients/autocast_cache": cache if not x.full else (
            cache - body_cast * x.Ld - enc_cast * x.Le),
        "logits": s2.logits_backward_peak_bytes(x)}, 0)

    g_enc, g_dec, g_rest = _layer_grads(ctx, train.grad_dtype)
    vh = alloc(x.V * x.h, train.grad_dtype)
    tied = vh  # lm_head's share of `shared`'s gradient, waiting in autograd's input buffer
    e_grad = alloc(x.b * x.s * x.h, x.r)
    root = 2 * 512  # the loss and its gradient (0-dim)

    # autocast's casts live on in the matmuls that saved them: freed with each layer's
    # backward (the lm_head's first); under recompute the re-run layer's own

    def point(grads: int, act: int, work: int, casts: int) -> Phase:
        return Phase("backward", B, G if keep_grads else min(grads, G), {
            "activations": act, "transients/autocast_cache": casts,
            "transients/layer_backward": work, "logits": root})

    cands = [loss_bwd]
    # the top decoder layer: its FF output projection's backward, then its
    # cross-attention core (the FF, the cross block's output side and p' @ v done; e's
    # gradient comes with its k, v projections, after the core)
    ff = ("mlp.", "layer_norm")
    post = () if x.t5 else ("cross.sum", "cross.norm.")  # BART's LN after the block
    gone = _bytes(dec_top, ("ff.", "cross.residual", "cross.out_mask", *post,
                            *_core_done(x, "cross")))
    # freed above the FF's output projection; T5's FF norm is a pre-norm, still held
    tail = ("ff.out_mask", "ff.residual", "ff.sum") + (() if x.t5 else ("ff.norm.",))
    cands.append(point(0, dec_held - _bytes(dec_top, tail),
                       tied + _ff_work(x, x.b * x.t), body_cast))
    o_ff = (*ff, "attn.o.")
    cands.append(point(_part(ctx, o_ff, train.grad_dtype), dec_held - gone,
                       tied + _core_work(x, x.t, x.s, x.biased and x.full),
                       body_cast - _part(ctx, o_ff, x.c, True)))
    # the decoder embedding's backward: every decoder gradient; the encoder's activations
    # and e's gradient held; the buffer (or T5 v1.1's lm_head gradient), the incoming
    # (b, t, h) gradient and the embedding's own (V, h) share; then, with a tied head,
    # their sum: a new tensor when the head's share is a view of its matmul's output (no
    # autocast cast; terms/gradients.py `tied_sum_in_place`). e itself, where no encoder op
    # but the cross-attentions' k, v keep it (fp32 runs: T5's `enc_out`, BART's top LN
    # output), is freed with the last of them
    stack_extra = max(g_rest - vh, 0) // 2  # T5's bias and final norm, BART's positions
    dec_grads = x.Ld * g_dec + stack_extra
    # (under recompute e is only the decoder checkpoints' input, and T5's zeros
    # cross-attention bias leaf holds its gradient, summed over the decoder layers)
    e_kept = alloc(x.b * x.s * x.h, x.r) if x.full else (
        _bytes(edges, ("enc_out",)) if x.t5 else _bytes(
            s2.encoder_layer_saved(x, x.Le == 1), ("ff.norm.out",)))
    leaf = 2 * _bytes(ck, ("cross.bias",)) if x.full and x.t5 else 0
    new_sum = tied if ctx.spec.tie_word_embeddings and not x.amp else 0
    cands.append(point(dec_grads, enc_all - e_kept + leaf,
                       2 * tied + max(new_sum, alloc(x.b * x.t * x.h, x.r)) + e_grad,
                       0 if x.full else enc_cast))
    # the top encoder layer, e's gradient its incoming one
    enc_top = s2.encoder_layer_saved(x, x.Le == 1)
    cands.append(point(dec_grads, enc_held - _bytes(enc_top, tail),
                       tied + _ff_work(x, x.b * x.s), enc_cast))
    above = ("ff.", "attn.residual", "attn.sum", "attn.norm.out", "attn.norm.m",
             "attn.norm.rstd", "attn.out_mask", *_core_done(x, "attn"))
    gone = _bytes(enc_top, above)
    cands.append(point(dec_grads + _part(ctx, o_ff, train.grad_dtype), enc_held - gone,
                       tied + _core_work(x, x.s, x.s, x.biased),
                       enc_cast - _part(ctx, o_ff, x.c, True)))
    # the bottom encoder layer (every other gradient exists): at its attention core, and
    # under recompute inside its re-run forward, at the FF output projection (the block's
    # locals as in `decoder_forward_locals`); T5: the position bias's gradient (1, a, s, s)
    # summed from every layer's scores, and under recompute the re-run bias (s, s, a)
    src = ck if x.full else edges
    enc0 = s2.encoder_layer_saved(x, True)
    base = _bytes(src, ("input_ids", "labels", "enc_embed."))
    below = dec_grads + (x.Le - 1) * g_enc
    bias = alloc(x.a * x.s * x.s, x.r if x.biased else "fp32") if x.t5 else 0
    rebias = alloc(x.s * x.s * x.a, x.r) if x.t5 else 0  # the re-run bias, in its forward
    casts0 = enc_cast if x.full else enc_cast // max(x.Le, 1)
    gone0 = _bytes(enc0, above)
    if x.full and x.t5:  # the zeros cross-attention bias, a leaf: its .grad (1, a, t, s)
        bias += alloc(x.a * x.t * x.s, x.c)
    cands.append(point(below + _part(ctx, o_ff, train.grad_dtype), base + _bytes(enc0) - gone0,
                       tied + bias + _core_work(x, x.s, x.s, x.biased),
                       casts0 - _part(ctx, o_ff, x.c, True)))
    cands.append(point(below, base + _bytes(enc0) - _bytes(enc0, tail), tied + bias + _ff_work(
        x, x.b * x.s), casts0))
    if x.full:
        n = x.b * x.s
        locals_ = (alloc(n * x.h, x.r) + (alloc(x.b * x.a * x.s * x.s, "fp32") if x.att else 0)
                   + (alloc(n * x.f, x.r) if x.t5 else 0)) if x.amp else 0
        cands.append(point(below, base + _bytes(enc0) - _bytes(enc0, tail) + locals_,
                           tied + bias + rebias + alloc(n * x.h, x.r) + alloc(n * x.h, x.c),
                           casts0))
    # the encoder embedding: every gradient (`G` stands for `shared`'s, not made yet); while
    # its backward runs, the buffer, the incoming (b, s, h) gradient and its own share,
    # which is then added into the buffer in place (a plain tensor by now)
    # (T5 under recompute: the zeros cross-attention bias leaf and its .grad, as above)
    leaf = alloc(x.a * x.t * x.s, x.c) if x.full and x.t5 else 0
    cands.append(point(G, _bytes(src, ("input_ids", "labels", "cross.bias")),
                       tied + alloc(x.b * x.s * x.h, x.r) + leaf, 0))
    backward = max(cands, key=lambda p: p.total)

    optimizer = Phase("optimizer", B, gradients_at_step_bytes(ctx), {
        "transients/optimizer_step": tr.optimizer_step_temp_bytes(ctx),
        "optimizer_states/main_grads": opt["main_grads"]})
    load = load_parts(ctx)
    phases = [forward, backward, optimizer] + ([Phase("load", StageBase({}, {}), 0, load)]
                                               if load else [])
    S = opt["states"]
    first = max(forward.total - S, optimizer.total, backward.total - S)
    peak = max(phases, key=lambda p: p.total)
    pad = reserved_pad_bytes(ctx, peak.name, peak.grads, *((0, 0, 0) if peak.name == "load"
                                                           else (S, opt["master"], 1)))
    high = max(loss_bwd.total, init_reserved_bytes(ctx))
    return phases, first, (pad, max(high - peak.total - pad, 0))


def _buffers(ctx: RankContext) -> int:
    """BART's final_logits_bias, a (1, V) buffer in the weights' dtype (modeling_bart.py
    BartForConditionalGeneration.__init__); T5 registers none."""
    if ctx.spec.model_type != "bart":
        return 0
    return alloc(ctx.spec.vocab_size, ctx.training.weight_dtype)
