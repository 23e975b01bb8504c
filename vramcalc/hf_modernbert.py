"""ModernBERT `config.json` -> ModelSpec fields, with the defaults transformers 5.24 gives keys
a file leaves out (models/modernbert/configuration_modernbert.py `ModernBertConfig`). The
parameters: vramcalc/encoder_shapes.py; the saved tensors: vramcalc/terms/modernbert.py.

ModernBertConfig: vocab 50368, hidden 768, intermediate 1152, 22 layers, 12 heads,
hidden_activation "gelu", max_position_embeddings 8192, norm_bias / attention_bias /
mlp_bias / classifier_bias false, decoder_bias true, tie_word_embeddings true,
classifier_pooling "cls", local_attention 128, layer i global when i % 3 == 0
(`global_attn_every_n_layers`, or an explicit `layer_types` list), every dropout 0.
"""

from __future__ import annotations

from typing import Any

from vramcalc.errors import InputError
from vramcalc.hf_reader import Cfg

MODERNBERT_TYPES = ("modernbert",)
_DROPOUTS = ("embedding_dropout", "attention_dropout", "mlp_dropout", "classifier_dropout")


def _global_every(c: Cfg, layers: int) -> int:
    """N of `layer i is global when i % N == 0`: layer_types when given (it must follow that
    pattern), else global_attn_every_n_layers (3)."""
    types = c.cfg.get("layer_types")
    if types is None:
        n = c.get_int("global_attn_every_n_layers", 3)
        if n < 1:
            raise InputError(f"{c.source}: global_attn_every_n_layers must be >= 1, got {n}")
        return n
    if not isinstance(types, list) or len(types) != layers or not all(
            t in ("sliding_attention", "full_attention") for t in types):
        raise InputError(f"{c.source}: layer_types must list 'full_attention' or "
                         f"'sliding_attention' for each of the {layers} layers")
    local = [t == "sliding_attention" for t in types]
    for n in range(1, layers + 1):
        if local == [i % n != 0 for i in range(layers)]:
            return n
    raise InputError(f"{c.source}: layer_types must make every N-th layer global from "
                     "layer 0 on (ModernBERT's pattern)")


def modernbert_fields(c: Cfg) -> dict[str, Any]:
    """ModelSpec fields of a ModernBERT config (modeling_modernbert.py): a fused Wqkv and Wo,
    a GeGLU MLP (Wi h -> 2f, Wo f -> h), pre-LayerNorm (layer 0's attn_norm is Identity),
    RoPE, a final norm, no token types or learned positions. Local layers attend within
    local_attention // 2 tokens either side (`sliding_window` = local_attention, pattern N
    with layer i global when i % N == 0). Dropout other than 0 and sparse_prediction are
    refused (not modelled); the head comes from `architectures`."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    c.require(keys, "modernbert")
    for key in _DROPOUTS:
        value = c._raw(key, 0.0)
        if value != 0 or isinstance(value, bool):
            raise InputError(f"{c.source}: {key} {value!r}: ModernBERT is modelled with every "
                             "dropout 0 (its published configs)")
    if c.get_bool("sparse_prediction", False):
        raise InputError(f"{c.source}: sparse_prediction (the masked-LM head on masked tokens "
                         "only) is not modelled")
    pooling = c.get_str("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise InputError(f"{c.source}: classifier_pooling must be 'cls' or 'mean', got "
                         f"{pooling!r}")
    layers = c.get_int("num_hidden_layers")
    every = _global_every(c, layers)
    local = c.get_int("local_attention", 128)
    norm_bias = c.get_bool("norm_bias", False)
    attn_bias = c.get_bool("attention_bias", False)
    labels = c.cfg.get("id2label")
    sliding = {"sliding_window": local, "sliding_window_pattern": every} if every > 1 else {}
    return {
        "architecture": "encoder",
        "num_labels": len(labels) if isinstance(labels, dict) and labels else c.get_int(
            "num_labels", 2),
        "hidden_size": c.get_int("hidden_size"),
        "num_hidden_layers": layers,
        "num_attention_heads": c.get_int("num_attention_heads"),
        "intermediate_size": c.get_int("intermediate_size"),
        "vocab_size": c.get_int("vocab_size", 50368),
        "max_position_embeddings": c.get_int("max_position_embeddings", 8192),
        "hidden_act": c.get_str("hidden_activation", "gelu"),
        "tie_word_embeddings": c.get_bool("tie_word_embeddings", True),
        "mlp_kind": "gated", "norm_kind": "layernorm", "norm_bias": norm_bias,
        "attention_bias": attn_bias, "attention_out_bias": attn_bias,
        "mlp_bias": c.get_bool("mlp_bias", False), "position_embedding": "rope",
        "final_norm": True, "classifier_pooling": pooling,
        "decoder_bias": c.get_bool("decoder_bias", True),
        "classifier_bias": c.get_bool("classifier_bias", False), **sliding,
    }
