"""Encoder-decoder models (T5, mT5, BART) as transformers 5.24 trains them (`--framework
hf`): what each encoder and decoder layer, the two embeddings, the encoder output and the
head save for backward, with the dropout masks training keeps. The sweep that turns these
into phase peaks: vramcalc/analytic_seq2seq.py. The parameters: vramcalc/seq2seq_shapes.py.

Legend: b micro-batch, s source tokens (--seq-len, the encoder's), t target tokens
(--target-len, the decoder's; seq_len when not given), h d_model, a heads, d head width
(T5 d_kv), f FFN width, V vocab, Le / Ld encoder / decoder layers. Dtypes: c compute, r
the residual stream's (the weights': fp32 under autocast). Every storage is rounded to the
allocator's 512 B.

T5 (models/t5/modeling_t5.py), per sub-layer (T5LayerSelfAttention, T5LayerCrossAttention,
T5LayerFF), x the residual:

    n = T5LayerNorm(x)        L51-73: x.to(fp32).pow(2).mean -> rsqrt (kept, fp32 (T));
                              x · rsqrt = x̂ (kept by `weight *`, fp32); weight · x̂ = n
    q, k, v = q(n), k(n|e), v(n|e)   L327, L345-346: n kept by the linears (autocast: one
                              c cast per linear; cross-attention's k, v read the encoder
                              output e, at s tokens, two casts per decoder layer)
    layer 0 only: compute_bias L269-285: the (q_len, k_len) int64 bucket ids kept by the
                              relative_attention_bias embedding; the bias is shared by the
                              stack's later layers (L197) and saves nothing else
    eager_attention_forward L166-191: q @ kᵀ (contiguous q, kᵀ copies, c); + bias; softmax
                              (kept; fp32 under autocast, CUDA's list); dropout(p, rate)
                              (bool mask, and p' kept by p' @ v: fp32 in c, autocast keeps
                              its c cast instead); v copy; out.transpose.contiguous kept by o
    x = x + dropout(o(...))   L418, L446: bool mask; the sum is the next sub-layer's x
    FF (T5DenseActDense L76-95): wi(n); relu (its output kept: threshold_backward reads
                              it); dropout (mask; p' kept by wo in fp32; autocast: the
                              `.to(wo.weight.dtype)` fp32 copy is cast back to c by wo,
                              that cast is kept)
    stack end (T5Stack L201-202): final_layer_norm (rsqrt, x̂) and dropout (mask; the
                              encoder's output e, kept by every cross-attention's k and v)
    head (T5ForConditionalGeneration): decoder output · d_model^-0.5 (tied embeddings;
                              the dropout output is freed), kept by lm_head

BART (models/bart/modeling_bart.py), post-LayerNorm:

    embeddings L517-524 / L644-650: ids, learned positions (+ offset 2; encoder (b, s),
                              decoder (1, t) int64, kept by embed_positions), their sum
                              kept by layernorm_embedding (+ fp32 mean, rstd), its output
                              through dropout (mask) = the first layer's input
    attention L205-262: q_proj/k_proj/v_proj read the layer input (autocast: c casts);
                              eager attention as T5's (scores scaled, no bias); SDPA below
    x = LN(x + dropout(out_proj(...)))   L302-305: mask; LN input (r), mean, rstd; the LN
                              output is the next block's input and residual
    FF L307-313: fc1 output kept by the activation (gelu); activation_dropout (mask, output)
                              or the activation output, kept by fc2; dropout (mask); LN
    decoder layer: self-attention, encoder_attn over e (k, v at s tokens), FF, each
                              followed by its LayerNorm (L355-395)
    head: lm_head(decoder output) + final_logits_bias (a (1, V) buffer; the sum is in the
                              bias's dtype, fp32 under autocast)

Dropout is CUDA's fused native_dropout, which keeps only its bool mask
(aten/src/ATen/native/Dropout.cpp); p = 0 returns its input (no mask, no copy).

BART under --attention flash (attn_implementation "sdpa", transformers' default): a batch
without padding gets no mask at all (masking_utils.py `_ignore_bidirectional_mask_sdpa`
L354 for the encoder and the cross-attention, `_ignore_causal_mask_sdpa` L292 for the
decoder, whose all-ones (b, t) mask, modeling_bart.py L627, is dropped), so
integrations/sdpa_attention.py L148 passes is_causal to the decoder's self-attention only
and CUDA runs the flash kernel (memory-efficient for fp32). Each attention keeps q, k, v
(views of the projections, L207, L227-228), the kernel's output, which out_proj reads
without a copy (FlashAttention-2 writes (b, q, a, d): the transpose and reshape, sdpa L195
and modeling_bart.py L254, are views), and the fp32 logsumexp (b, a, q); the attention
dropout runs inside the kernel, which keeps its RNG seed and offset, no mask.

T5 under --attention flash: the position bias reaches SDPA as a float attn_mask
(sdpa_attention.py L54-91, L176-191), which requires grad for the self-attentions, so CUDA
runs the memory-efficient kernel (torch's sdp_utils_cpp.h `check_attn_mask_shape` keeps
cuDNN off such a mask; flash takes none). It keeps q, k, v, its output, the fp32 logsumexp
(b, a, q₃₂) and the mask (`sdpa_bias`); the attention dropout runs inside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramcalc.rank import RankContext
from vramcalc.terms.saved import Saved
from vramcalc.units import ALLOC_ROUND_BYTES, alloc


@dataclass(frozen=True)
class S2S:
    """One rank's encoder-decoder dimensions and switches (see the legend)."""

    b: int
    s: int
    t: int
    h: int
    a: int
    d: int
    f: int
    V: int
    c: str
    r: str
    t5: bool  # T5 / mT5 (else BART)
    eager: bool
    hid: bool  # hidden dropout (T5 dropout_rate, BART dropout) keeps masks
    att: bool  # attention-probability dropout (T5 dropout_rate, BART attention_dropout)
    act: bool  # dropout after the FF activation (T5 dropout_rate, BART activation_dropout)
    Le: int
    Ld: int
    gated: bool = False  # T5 v1.1 / mT5 gated-gelu FF
    full: bool = False  # gradient checkpointing (--recompute full): `checkpoint_saved`

    @property
    def amp(self) -> bool:
        return self.r != self.c

    @property
    def biased(self) -> bool:
        """T5 under SDPA: the position bias is a float attn_mask (memory-efficient kernel)."""
        return self.t5 and not self.eager


def s2s_dims(ctx: RankContext) -> S2S:
    """The rank's dimensions; `--dropout 0` turns every dropout off."""
    spec, tr = ctx.spec, ctx.training
    on = tr.dropout != 0
    t5 = spec.model_type in ("t5", "mt5")
    hid = on and spec.hidden_dropout_prob > 0
    att = on and spec.attention_probs_dropout_prob > 0 and tr.attention == "eager"
    act = on and (spec.hidden_dropout_prob if t5 else spec.activation_dropout) > 0
    return S2S(b=tr.micro_batch_size, s=tr.seq_len, t=tr.target_len or tr.seq_len,
               h=spec.hidden_size, a=spec.num_attention_heads, d=spec.head_size,
               f=spec.intermediate_size, V=spec.vocab_size, c=tr.compute_dtype,
               r=tr.weight_dtype, t5=t5, eager=tr.attention == "eager", hid=hid, att=att,
               act=act, Le=spec.num_hidden_layers, Ld=spec.num_decoder_layers,
               gated=spec.mlp_kind == "gated", full=tr.recompute == "full")


def _mask(x: S2S, name: str, numel: int, shape: str, on: bool) -> list[Saved]:
    return [Saved(name, numel, "bool", shape, "native_dropout's mask")] if on else []


def _inputs(x: S2S, name: str, numel: int, readers: int, shape: str, stored: bool
            ) -> list[Saved]:
    """A tensor read by `readers` linears: under autocast one c cast per linear; else the
    tensor itself when no other entry keeps it (`stored` False)."""
    if x.amp:
        return [Saved(f"{name}.cast", numel, x.c, shape, "autocast's copy, one per linear",
                      readers)] if readers else []
    return [] if stored else [Saved(name, numel, x.r, shape, "read by the linear(s)")]


def t5_stats(x: S2S, name: str, n: int) -> list[Saved]:
    """T5LayerNorm's statistics over n tokens: fp32 rsqrt and x̂ (fp32 residuals); with
    16-bit weights, the fp32 copy of x that pow keeps and x̂'s cast to the weights' dtype."""
    out = [Saved(f"{name}.rstd", n, "fp32", "(T, 1)", "rsqrt, kept by x · rsqrt")]
    if x.r != "fp32":
        out.append(Saved(f"{name}.x32", n * x.h, "fp32", "(T, h)", "x.to(fp32), kept by pow"))
    return out + [Saved(f"{name}.xhat", n * x.h, x.r, "(T, h)", "x̂, kept by weight ·")]


def _t5_norm(x: S2S, name: str, n: int, readers: int) -> list[Saved]:
    """T5LayerNorm over n tokens (`t5_stats`), its output read by `readers` linears."""
    return t5_stats(x, name, n) + _inputs(x, f"{name}.out", n * x.h, readers, "(T, h)", False)


def _layer_norm(x: S2S, name: str, n: int) -> list[Saved]:
    """nn.LayerNorm over n tokens: fp32 mean and 1/std, and its output (the next block's
    input and residual, r), which only the next linears keep (under autocast their c casts
    instead: the residual add saves nothing); its input is listed by the caller."""
    out = [Saved(f"{name}.mean", n, "fp32", "(T)", "fp32 mean"),
           Saved(f"{name}.rstd", n, "fp32", "(T)", "fp32 1/std")]
    return out + _inputs(x, f"{name}.out", n * x.h, 0, "(T, h)", False)


def attention_core(x: S2S, name: str, q: int, k: int) -> list[Saved]:
    """The attention of q query over k key tokens: eager keeps q, kᵀ, the probabilities,
    their dropout, v and the output copy; SDPA keeps q, k, v, its output and logsumexp."""
    b, a, d, c = x.b, x.a, x.d, x.c
    if not x.eager:  # memory-efficient kernel (T5): logsumexp rows padded to 32
        rows = -(-q // 32) * 32 if x.biased else q
        return [Saved(f"{name}.q", b * q * a * d, c, "(b, a, q, d)", "SDPA input"),
                Saved(f"{name}.k", b * k * a * d, c, "(b, a, k, d)", "SDPA input"),
                Saved(f"{name}.v", b * k * a * d, c, "(b, a, k, d)", "SDPA input"),
                Saved(f"{name}.out", b * q * a * d, c, "(b, a, q, d)", "SDPA output"),
                Saved(f"{name}.lse", b * a * rows, "fp32", "(b, a, q)", "logsumexp")]
    probs = b * a * q * k
    p_dt = "fp32" if x.amp else c
    out = [Saved(f"{name}.q", b * a * q * d, c, "(b, a, q, d)", "contiguous q for q @ kᵀ"),
           Saved(f"{name}.k", b * a * d * k, c, "(b, a, d, k)", "contiguous kᵀ"),
           Saved(f"{name}.probs", probs, p_dt, "(b, a, q, k)", "softmax output")]
    out += _mask(x, f"{name}.probs_mask", probs, "(b, a, q, k)", x.att)
    if x.att or x.amp:
        out.append(Saved(f"{name}.probs_c", probs, c, "(b, a, q, k)",
                         "dropout output (autocast: its c cast), kept by p' @ v"))
    out += [Saved(f"{name}.v", b * a * k * d, c, "(b, a, k, d)", "contiguous v for p' @ v"),
            Saved(f"{name}.o_input", b * q * a * d, c, "(b, q, a·d)", "kept by o")]
    return out


def sdpa_bias(x: S2S, name: str, q: int, k: int, causal: bool, cross: bool) -> list[Saved]:
    """T5 under SDPA: the attn_mask one attention's kernel keeps (sdpa_attention.py L54-91
    `create_position_bias_mask`: the self-attention's bias `.contiguous()`, a (1, a, q, k) copy
    per layer (compute_bias returns a permuted view, modeling_t5.py L279); the decoder's
    `torch.where(causal, bias, min)`, whose backward keeps the (q, k) bool condition; under
    autocast its c cast), padded to k₈ when k is no multiple of 8 (attention.cpp
    `preprocess_mask`). The cross-attention's zeros (1, a, q, k) in c (modeling_t5.py L340) is
    one tensor shared by the decoder's layers (`edges_saved`) unless padded per layer."""
    k8 = -(-k // 8) * 8
    out = [] if cross and k8 == k else [
        Saved(f"{name}.bias", x.a * q * k8, x.c, "(1, a, q, k₈)", "the kernel's attn_mask")]
    if causal:
        out.append(Saved(f"{name}.causal", q * k, "bool", "(1, 1, q, k)", "where's condition"))
    return out


def _t5_attention(x: S2S, name: str, n: int, kv: int, cross: bool, first: bool,
                  causal: bool = False) -> list[Saved]:
    out = _t5_norm(x, f"{name}.norm", n, 1 if cross else 3)
    if cross:
        out += _inputs(x, f"{name}.enc_out", x.b * kv * x.h, 2, "(b, s, h)", True)
    if first and not cross:
        out.append(Saved(f"{name}.buckets", n // x.b * kv, "int64", "(q, k)",
                         "relative position buckets, kept by relative_attention_bias"))
    if x.biased:
        out += sdpa_bias(x, name, n // x.b, kv, causal, cross)
    out += attention_core(x, name, n // x.b, kv)
    out += _mask(x, f"{name}.out_mask", n * x.h, "(T, h)", x.hid)
    out.append(Saved(f"{name}.residual", n * x.h, x.r, "(T, h)", "x + dropout(o(...))"))
    return out


def _t5_gated_ff(x: S2S, n: int) -> list[Saved]:
    """T5DenseGatedActDense (L98-122) with gelu_new (activations.py NewGELUActivation,
    0.5·u·(1 + tanh(√(2/π)·(u + 0.044715·u³))), u = wi_0(n)): 0.5·u (c), tanh's output, 1 +
    tanh and the GELU output (kept by the products), u kept by pow (under autocast pow is
    on CUDA's fp32 list: an fp32 copy of u, and the tanh chain and GELU output are fp32),
    wi_1's output (c), the dropout mask and wo's input (the fp32 product's c cast under
    autocast)."""
    w = "fp32" if x.amp else x.c
    out = _t5_norm(x, "ff.norm", n, 2)
    out += [Saved("ff.u", n * x.f, w, "(T, f)", "wi_0 output (autocast: fp32 copy), pow"),
            Saved("ff.half_u", n * x.f, x.c, "(T, f)", "0.5·u, kept by · (1 + tanh)"),
            Saved("ff.tanh", n * x.f, w, "(T, f)", "tanh output"),
            Saved("ff.one_plus", n * x.f, w, "(T, f)", "1 + tanh, kept by 0.5·u ·"),
            Saved("ff.gelu", n * x.f, w, "(T, f)", "GELU output, kept by · wi_1 output"),
            Saved("ff.linear", n * x.f, x.c, "(T, f)", "wi_1 output, kept by the product")]
    out += _mask(x, "ff.act_mask", n * x.f, "(T, f)", x.act)
    out.append(Saved("ff.wo_input", n * x.f, x.c, "(T, f)",
                     "the (dropped) product (autocast: wo's c cast), kept by wo"))
    out += _mask(x, "ff.out_mask", n * x.h, "(T, h)", x.hid)
    out.append(Saved("ff.residual", n * x.h, x.r, "(T, h)", "x + dropout(wo(...))"))
    return out


def _t5_ff(x: S2S, n: int) -> list[Saved]:
    if x.gated:
        return _t5_gated_ff(x, n)
    out = _t5_norm(x, "ff.norm", n, 1)
    out.append(Saved("ff.relu", n * x.f, x.c, "(T, f)", "relu output (threshold_backward)"))
    out += _mask(x, "ff.act_mask", n * x.f, "(T, f)", x.act)
    if x.amp:
        out.append(Saved("ff.wo_input.cast", n * x.f, x.c, "(T, f)", "wo's cast of the fp32 copy"))
    elif x.act:
        out.append(Saved("ff.wo_input", n * x.f, x.r, "(T, f)", "dropout output, kept by wo"))
    out += _mask(x, "ff.out_mask", n * x.h, "(T, h)", x.hid)
    out.append(Saved("ff.residual", n * x.h, x.r, "(T, h)", "x + dropout(wo(...))"))
    return out


def _bart_attention(x: S2S, name: str, n: int, kv: int, cross: bool) -> list[Saved]:
    out = _inputs(x, f"{name}.input", n * x.h, 1 if cross else 3, "(T, h)", True)
    if cross:
        out += _inputs(x, f"{name}.enc_out", x.b * kv * x.h, 2, "(b, s, h)", True)
    out += attention_core(x, name, n // x.b, kv)
    out += _mask(x, f"{name}.out_mask", n * x.h, "(T, h)", x.hid)
    out.append(Saved(f"{name}.sum", n * x.h, x.r, "(T, h)", "LN input"))
    return out + _layer_norm(x, f"{name}.norm", n)


def _bart_ff(x: S2S, n: int) -> list[Saved]:
    out = _inputs(x, "ff.input", n * x.h, 1, "(T, h)", True)
    out += [Saved("ff.fc1", n * x.f, x.c, "(T, f)", "fc1 output, kept by gelu"),
            Saved("ff.fc2_input", n * x.f, x.c, "(T, f)", "activation (dropout) output")]
    out += _mask(x, "ff.act_mask", n * x.f, "(T, f)", x.act)
    out += _mask(x, "ff.out_mask", n * x.h, "(T, h)", x.hid)
    out.append(Saved("ff.sum", n * x.h, x.r, "(T, h)", "LN input"))
    return out + _layer_norm(x, "ff.norm", n)


def encoder_layer_saved(x: S2S, first: bool = False) -> list[Saved]:
    """One encoder layer, one micro-batch (`first`: layer 0, which computes T5's bias)."""
    n = x.b * x.s
    if x.t5:
        return _t5_attention(x, "attn", n, x.s, False, first) + _t5_ff(x, n)
    return _bart_attention(x, "attn", n, x.s, False) + _bart_ff(x, n)


def decoder_layer_saved(x: S2S, first: bool = False) -> list[Saved]:
    """One decoder layer: causal self-attention over t, cross-attention of t queries over
    the s encoder tokens, the FF."""
    n = x.b * x.t
    if x.t5:
        return (_t5_attention(x, "attn", n, x.t, False, first, True)
                + _t5_attention(x, "cross", n, x.s, True, False) + _t5_ff(x, n))
    return (_bart_attention(x, "attn", n, x.t, False)
            + _bart_attention(x, "cross", n, x.s, True) + _bart_ff(x, n))


def _embedding(x: S2S, name: str, n: int, positions: int) -> list[Saved]:
    """A stack's embedding output (the first layer's input): T5, dropout(embed(ids));
    BART, dropout(LN(embed(ids) + positions))."""
    out: list[Saved] = []
    if not x.t5:
        out += [Saved(f"{name}.positions", positions, "int64", "(b|1, n)", "position ids"),
                Saved(f"{name}.sum", n * x.h, x.r, "(T, h)", "LN input"),
                Saved(f"{name}.mean", n, "fp32", "(T)", "fp32 mean"),
                Saved(f"{name}.rstd", n, "fp32", "(T)", "fp32 1/std")]
    out += _mask(x, f"{name}.mask", n * x.h, "(T, h)", x.hid)
    if x.t5 or not x.amp:  # (BART under autocast: the first layer's linears keep c casts)
        out.append(Saved(f"{name}.out", n * x.h, x.r, "(T, h)", "first layer's input"))
    return out


def edges_saved(x: S2S) -> list[Saved]:
    """Outside the layers: ids, labels and the shifted decoder ids (int64), both
    embeddings, T5's encoder final norm and output, the decoder's final norm and the
    lm_head input."""
    bs, bt = x.b * x.s, x.b * x.t
    out = [Saved("input_ids", bs, "int64", "(b, s)", "kept by the embedding"),
           Saved("labels", bt, "int64", "(b, t)", "the loader's batch"),
           Saved("decoder_input_ids", bt, "int64", "(b, t)", "labels shifted right")]
    out += _embedding(x, "enc_embed", bs, bs)
    out += _embedding(x, "dec_embed", bt, x.t)
    if x.t5:
        out += t5_stats(x, "enc_final", bs)
        out += _mask(x, "enc_final.mask", bs * x.h, "(T, h)", x.hid)
        if not x.amp:  # (autocast: the cross-attentions keep c casts of it instead)
            out.append(Saved("enc_out", bs * x.h, x.r, "(b, s, h)", "read by k, v"))
        out += t5_stats(x, "dec_final", bt)
        out += _mask(x, "dec_final.mask", bt * x.h, "(T, h)", x.hid)
        out.append(Saved("lm_head.input", bt * x.h, x.c, "(T, h)",
                         "scaled output (autocast: its c cast), kept by lm_head"))
        if x.biased and x.s % 8 == 0:
            out.append(Saved("cross_bias", x.a * x.t * x.s, x.c, "(1, a, t, s)",
                             "zeros, every cross-attention kernel's attn_mask"))
    elif x.amp:  # BART: the last LN output (in the layer) is the head's input, cast
        out.append(Saved("lm_head.input.cast", bt * x.h, x.c, "(T, h)", "autocast's copy"))
    return out


def checkpoint_saved(x: S2S) -> list[Saved]:
    """Under gradient checkpointing (each T5Block / Bart*Layer is a
    GradientCheckpointingLayer; torch's non-reentrant checkpoint keeps only its tensor
    inputs): every layer's output (the next layer's input, the last one's kept by what
    follows), the stacks' edges as without recompute (the embeddings, T5's final norms, the
    lm_head input), e (fp32: a checkpoint input of every decoder layer), the decoder's
    additive causal mask (b, 1, t, t; eager only, SDPA takes is_causal); T5's position
    biases computed inside layer 0 and passed on ((s, s, a) and (t, t, a) in r, where a
    later layer takes them), and the
    cross-attention's zeros bias (1, a, t, s) in q's dtype, a leaf made to require grad
    under checkpointing (modeling_t5.py L356-362) that the graph holds."""
    bs, bt = x.b * x.s, x.b * x.t
    out = [t for t in edges_saved(x) if (t.name != "lm_head.input.cast" or x.t5)
           and t.name != "cross_bias"]  # (T5 SDPA: the zeros leaf below)
    out += [Saved("enc.layer_out", bs * x.h, x.r, "(b, s, h)", "checkpoint input", x.Le),
            Saved("dec.layer_out", bt * x.h, x.r, "(b, t, h)", "checkpoint input",
                  x.Ld - (1 if x.amp and not x.t5 else 0)),
            *([Saved("dec.causal_mask", bt * x.t, x.r, "(b, 1, t, t)", "checkpoint input")]
              if x.eager else [])]  # SDPA: no mask, is_causal
    if not x.t5:  # BART: the encoder's last output is e; under autocast lm_head's cast,
        # and the embeddings' outputs, checkpoint inputs (no linear casts them outside)
        return out + ([Saved("lm_head.input.cast", bt * x.h, x.c, "(T, h)", "kept by lm_head"),
                       Saved("enc_embed.out", bs * x.h, x.r, "(T, h)", "checkpoint input"),
                       Saved("dec_embed.out", bt * x.h, x.r, "(T, h)", "checkpoint input")]
                      if x.amp else [])
    if x.amp:
        out.append(Saved("enc_out", bs * x.h, x.r, "(b, s, h)", "checkpoint input"))
    if x.Le > 1:
        out.append(Saved("enc.bias", x.s * x.s * x.a, x.r, "(s, s, a)", "checkpoint input"))
    if x.Ld > 1:
        out.append(Saved("dec.bias", x.t * x.t * x.a, x.r, "(t, t, a)", "checkpoint input"))
    out.append(Saved("cross.bias", x.a * x.t * x.s, x.c, "(1, a, t, s)", "zeros, a leaf"))
    return out


def microbatch_activation_bytes(x: S2S) -> int:
    """Everything one micro-batch keeps for backward at the end of its forward (the
    loss's log-probabilities apart: `logits_saved_bytes`)."""
    if x.full:
        return sum(t.nbytes for t in checkpoint_saved(x))
    layers = (sum(t.nbytes for t in encoder_layer_saved(x)) * (x.Le - 1)
              + sum(t.nbytes for t in encoder_layer_saved(x, True))
              + sum(t.nbytes for t in decoder_layer_saved(x)) * (x.Ld - 1)
              + sum(t.nbytes for t in decoder_layer_saved(x, True)))
    return layers + sum(t.nbytes for t in edges_saved(x))


def decoder_forward_locals(x: S2S) -> int:
    """Held only by the decoder stack's forward locals while its layers run: under autocast
    the encoder output e (b, s, h; fp32 runs save it), the stack's input embeddings (b, t, h)
    and, eager, its additive causal mask (b, 1, t, t), in r; T5 also the shared position
    biases (T5Stack L179-199: the self-attention's (1, a, t, t) from compute_bias in r, and the
    cross-attention's zeros (1, a, t, s) in q's dtype, T5Attention L356-362); BART its
    positions (t, h). Inside the top layer's FF, under autocast: the block's `_`, the
    cross-attention's fp32 attention weights p' where dropout made them a tensor of their
    own (T5Block L421-437, BartDecoderLayer); T5's normed FF input (`forwarded_states`, fp32)
    and the fp32 `.to(wo.weight.dtype)` copy of wo's input (n·f); BART's `residual`, the
    cross block's fp32 LN output."""
    out = alloc(x.b * x.s * x.h, x.r) if x.amp else 0
    out += alloc(x.b * x.t * x.h, x.r) + (alloc(x.b * x.t * x.t, x.r) if x.eager else 0)
    n = x.b * x.t
    if x.amp:
        out += alloc(n * x.h, x.r) + (alloc(x.b * x.a * x.t * x.s, "fp32") if x.att else 0)
    if x.t5:  # (SDPA, s a multiple of 8: the zeros are kept, `edges_saved`)
        out += alloc(n * x.f, x.r) if x.amp else 0
        return out + alloc(x.a * x.t * x.t, x.r) + (
            alloc(x.a * x.t * x.s, x.c) if x.eager or x.s % 8 else 0)
    return out + alloc(x.t * x.h, x.r)


# ---- loss ----------------------------------------------------------------------------------
def logits_dtype(x: S2S) -> str:
    """The logits' dtype: lm_head's output (c); BART's sum with final_logits_bias, a
    buffer in the weights' dtype, is in r (fp32 under autocast)."""
    return x.c if x.t5 else x.r


def _lsm_dtype(x: S2S) -> str:
    """log_softmax's dtype: CrossEntropyLoss on the logits as they are (no `.float()`):
    fp32 under autocast (CUDA's fp32 list) or for fp32 logits, else the logits'."""
    return "fp32" if x.amp else logits_dtype(x)


def logits_saved_bytes(x: S2S) -> int:
    """CrossEntropyLoss over (b·t, V): log_softmax keeps its output, nll_loss the loss and
    its total weight (0-dim)."""
    return alloc(x.b * x.t * x.V, _lsm_dtype(x)) + 2 * ALLOC_ROUND_BYTES


def logits_forward_peak_bytes(x: S2S) -> int:
    """The loss's forward: log-probabilities and scalars, the logits, and the fp32 copy
    log_softmax makes of 16-bit logits under autocast."""
    n = x.b * x.t * x.V
    dt = logits_dtype(x)
    return logits_saved_bytes(x) + alloc(n, dt) + (
        alloc(n, "fp32") if dt != _lsm_dtype(x) else 0)


def logits_backward_peak_bytes(x: S2S) -> int:
    """Loss backward: log-probabilities + d log-probabilities + d logits in log_softmax's
    dtype, 3 scalars."""
    return 3 * alloc(x.b * x.t * x.V, _lsm_dtype(x)) + 3 * ALLOC_ROUND_BYTES
