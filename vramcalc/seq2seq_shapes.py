"""The parameter tensors of an encoder-decoder model (T5, BART) as transformers 5.x builds
T5ForConditionalGeneration and BartForConditionalGeneration: one row per distinct shape and
role, (name, numel, count, group, rows), summed by `ModelSpec.num_params` and turned into
ParamTensors by vramcalc/model_tensors.py. Checked against transformers' own numel on the
meta device (tests/test_seq2seq.py).

Letters: h = d_model, a = heads, d = head width (T5 d_kv), f = FFN width, Le / Ld = encoder /
decoder layers, V = vocab, P = max_position_embeddings, B = relative_attention_num_buckets.

T5 and mT5 (modeling_t5.py, modeling_mt5.py): `shared` (V, h), shared by both stacks; per encoder block a
self-attention (q, k, v: h -> a·d, o: a·d -> h, no biases) and the feed-forward (wi: h -> f,
wo: f -> h; gated-gelu: wi_0, wi_1, wo), each behind a T5LayerNorm (weight only); a decoder
block adds the cross-attention (EncDecAttention) and its norm; block 0 of each stack owns
the relative_attention_bias (B, a); a final_layer_norm per stack; lm_head tied to `shared`
(configuration_t5.py forces tie_word_embeddings = True).

BART (modeling_bart.py): `shared` (V, h) shared by both stacks; each stack has
BartLearnedPositionalEmbedding (P + 2, h) (positions start at offset 2) and
layernorm_embedding; every projection (q, k, v, out_proj, fc1, fc2) has a bias and every
LayerNorm a bias; the decoder adds encoder_attn and its LayerNorm; lm_head is tied to
`shared` (final_logits_bias is a buffer, not a parameter). With tie_word_embeddings false,
transformers 5.x unties every `_tied_weights_keys` entry: the encoder's and decoder's
embed_tokens become (V, h) tensors of their own beside `shared`, and lm_head a third.
"""

from __future__ import annotations

from typing import Any

Row = tuple[str, int, int, str, int]  # name, numel, count, group, rows (0 for vectors)
BART_POSITION_OFFSET = 2  # modeling_bart.py BartLearnedPositionalEmbedding.offset


def seq2seq_rows(spec: Any) -> tuple[Row, ...]:
    """The parameter rows of the encoder-decoder `spec` (a ModelSpec); see the module doc."""
    h, a, d = spec.hidden_size, spec.num_attention_heads, spec.head_size
    f, V = spec.intermediate_size, spec.vocab_size
    Le, Ld = spec.num_hidden_layers, spec.num_decoder_layers
    attn = Le + 2 * Ld  # encoder self-attention, decoder self- and cross-attention
    bias = spec.model_type == "bart"  # T5 and mT5: no biases
    out: list[Row] = [("shared", V * h, 1, "embedding", V)]
    if bias:  # BART
        P = spec.max_position_embeddings + BART_POSITION_OFFSET
        out += [("embed_positions", P * h, 2, "embedding", P),
                ("layernorm_embedding.weight", h, 2, "embedding", 0),
                ("layernorm_embedding.bias", h, 2, "embedding", 0)]
    else:
        B = spec.relative_attention_num_buckets
        out.append(("relative_attention_bias", B * a, 2, "layer", B))
    for m, rows in (("q", a * d), ("k", a * d), ("v", a * d), ("o", h)):
        out.append((f"attn.{m}.weight", h * a * d, attn, "layer", rows))
        if bias:
            out.append((f"attn.{m}.bias", rows, attn, "layer", 0))
    mats = (("wi_0", f), ("wi_1", f), ("wo", h)) if spec.mlp_kind == "gated" else (
        ("wi", f), ("wo", h))
    for m, rows in mats:
        out.append((f"mlp.{m}.weight", h * f, Le + Ld, "layer", rows))
        if bias:
            out.append((f"mlp.{m}.bias", rows, Le + Ld, "layer", 0))
    norms = 2 * Le + 3 * Ld
    out.append(("layer_norm.weight", h, norms, "layer", 0))
    if bias:
        out.append(("layer_norm.bias", h, norms, "layer", 0))
    else:
        out.append(("final_layer_norm.weight", h, 2, "final", 0))
    if not spec.tie_word_embeddings:  # (BART only: T5 always ties)
        out += [("embed_tokens", V * h, 2, "embedding", V), ("lm_head.weight", V * h, 1, "head", V)]
    return tuple(out)


def seq2seq_num_params(spec: Any) -> int:
    """Exact parameter count of the encoder-decoder `spec` (sum of `seq2seq_rows`)."""
    return sum(numel * count for _, numel, count, _, _ in seq2seq_rows(spec))


def seq2seq_param_order(spec: Any) -> list[int]:
    """Element counts of the parameters in `model.parameters()` order (transformers 5.24,
    tied embeddings): `shared`, then per stack its blocks and final norms, the decoder
    blocks adding their cross-attention. T5 block: attention q, k, v, o (block 0 then its
    relative_attention_bias), its layer_norm, (decoder: the EncDecAttention and its norm),
    the FF's wi (wi_0, wi_1) and wo and its norm; each stack ends with final_layer_norm. BART
    (modeling_bart.py): each stack's embed_positions first, per layer k, v, q, out_proj
    (weights and biases), its LayerNorm, (decoder: encoder_attn and its LayerNorm), fc1, fc2,
    final_layer_norm, and layernorm_embedding last."""
    h, a, d, f = spec.hidden_size, spec.num_attention_heads, spec.head_size, spec.intermediate_size
    out = [spec.vocab_size * h]
    if spec.model_type in ("t5", "mt5"):
        mats = [h * f] * (2 if spec.mlp_kind == "gated" else 1) + [f * h]
        for layers, cross in ((spec.num_hidden_layers, False), (spec.num_decoder_layers, True)):
            for i in range(layers):
                out += [h * a * d] * 4
                if i == 0:
                    out.append(spec.relative_attention_num_buckets * a)
                out.append(h)
                if cross:
                    out += [h * a * d] * 4 + [h]
                out += mats + [h]
            out.append(h)
        return out
    attn = [h * a * d, a * d] * 3 + [a * d * h, h] + [h, h]  # k, v, q, out_proj; its norm
    ff = [h * f, f, f * h, h, h, h]  # fc1, fc2, final_layer_norm
    P = spec.max_position_embeddings + BART_POSITION_OFFSET
    for layers, cross in ((spec.num_hidden_layers, False), (spec.num_decoder_layers, True)):
        out.append(P * h)
        for _ in range(layers):
            out += attn + (attn if cross else []) + ff
        out += [h, h]
    return out
