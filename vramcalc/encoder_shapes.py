"""An encoder's parameters outside its layers, as (name, numel, group, rows) rows (none for
other architectures); vramcalc/model.py `encoder_tensors` wraps them as ParamTensors.

transformers 5.24 modeling_bert.py (modeling_roberta.py alike): BertEmbeddings'
token_type_embeddings (T, h) and LayerNorm; BertForSequenceClassification's pooler dense
(h->h) and classifier (h->n) (RobertaClassificationHead's dense and out_proj: the same
counts); BertForMaskedLM's transform dense (h->h) and LayerNorm, `cls.predictions.bias` (V),
the decoder tied to the word embedding and sharing that bias (untied: its own V·h weight and
V bias).

modeling_modernbert.py: ModernBertEmbeddings' norm (LayerNorm, bias=norm_bias); the
ModernBertPredictionHead both heads share (dense h->h with bias=classifier_bias, LayerNorm
with bias=norm_bias); ForMaskedLM's decoder (h->V, tied to tok_embeddings, bias=decoder_bias);
ForSequenceClassification's classifier (h->n, always with a bias). A ModernBERT layer's
norms: vramcalc/model.py (layer 0's attn_norm is nn.Identity: one norm fewer).
"""

from __future__ import annotations

from typing import Any

Row = tuple[str, int, str, int]


def _modernbert_rows(spec: Any) -> list[Row]:
    h, V, n = spec.hidden_size, spec.vocab_size, spec.num_labels
    norm = [("embed_norm.weight", h, "embedding", 0)]
    head = [("head.dense.weight", h * h, "head", h), ("head.norm.weight", h, "head", 0)]
    if spec.norm_bias:
        norm.append(("embed_norm.bias", h, "embedding", 0))
        head.append(("head.norm.bias", h, "head", 0))
    if spec.classifier_bias:
        head.append(("head.dense.bias", h, "head", 0))
    if spec.task == "sequence_classification":
        return norm + head + [("classifier.weight", n * h, "head", n),
                              ("classifier.bias", n, "head", 0)]
    if spec.decoder_bias:
        head.append(("decoder.bias", V, "head", 0))
    if not spec.tie_word_embeddings:
        head.append(("decoder.weight", V * h, "head", V))
    return norm + head


def encoder_rows(spec: Any) -> tuple[Row, ...]:
    """The rows described in the module docstring (T = type_vocab_size, n = num_labels)."""
    if not spec.is_encoder:
        return ()
    if spec.model_type == "modernbert":
        return tuple(_modernbert_rows(spec))
    h, V, T = spec.hidden_size, spec.vocab_size, spec.type_vocab_size
    out: list[Row] = [("embed_token_types", T * h, "embedding", T)] if T else []
    out += [("embed_norm.weight", h, "embedding", 0), ("embed_norm.bias", h, "embedding", 0)]
    if spec.task == "sequence_classification":
        n = spec.num_labels
        out += [("pooler.dense.weight", h * h, "head", h), ("pooler.dense.bias", h, "head", 0),
                ("classifier.weight", n * h, "head", n), ("classifier.bias", n, "head", 0)]
    else:
        out += [("mlm.transform.weight", h * h, "head", h), ("mlm.transform.bias", h, "head", 0),
                ("mlm.norm.weight", h, "head", 0), ("mlm.norm.bias", h, "head", 0),
                ("mlm.bias", V, "head", 0)]
        if not spec.tie_word_embeddings:  # the decoder's own weight and bias
            out += [("lm_head.weight", V * h, "head", V), ("lm_head.bias", V, "head", 0)]
    return tuple(out)
