"""Encoder-decoder `config.json`s (T5, BART) -> ModelSpec fields, with the defaults
transformers 5.24 gives keys a file leaves out (configuration_t5.py, configuration_bart.py).
The parameters: vramcalc/seq2seq_shapes.py. What is not modelled is refused (InputError)."""

from __future__ import annotations

from typing import Any

from vramcalc.errors import InputError
from vramcalc.hf_reader import Cfg

SEQ2SEQ_TYPES = ("t5", "mt5", "bart")
T5_TYPES = ("t5", "mt5")  # mT5 runs T5's code (modeling_mt5.py), gated-gelu by default
# T5Config / MT5Config defaults: vocab, d_model, d_ff, num_layers, num_heads, feed_forward_proj
_T5_DEFAULTS = {"t5": (32128, 512, 2048, 6, 8, "relu"),
                "mt5": (250112, 512, 1024, 8, 6, "gated-gelu")}


def _prob(c: Cfg, key: str, default: float) -> float:
    value = c._raw(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise InputError(f"{c.source}: {key} must be a number in [0, 1), got {value!r}")
    return float(value)


def _t5_fields(c: Cfg, model_type: str) -> dict[str, Any]:
    """T5Config: d_model 512, d_kv 64, d_ff 2048, num_layers 6, num_decoder_layers =
    num_layers, num_heads 8, 32 relative buckets, dropout_rate 0.1, feed_forward_proj "relu"
    ("gated-gelu": wi_0, wi_1 with gelu_new); MT5Config: vocab 250112, d_ff 1024, 8 layers,
    6 heads, "gated-gelu". The head is always tied to `shared`: T5Config
    and MT5Config set tie_word_embeddings = True whatever the file says (a T5 v1.1 `false` only turns off
    the decoder-output scaling, `scale_decoder_outputs`, which keeps no tensor)."""
    vocab, d_model, d_ff, num_layers, heads, default_proj = _T5_DEFAULTS[model_type]
    proj = c.get_str("feed_forward_proj", default_proj)
    parts = proj.split("-")
    if len(parts) > 2 or len(parts) == 2 and parts[0] != "gated":
        raise InputError(f"{c.source}: feed_forward_proj {proj!r} is not `ACT` or `gated-ACT`")
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]
    layers = c.get_int("num_layers", num_layers)
    drop = _prob(c, "dropout_rate", 0.1)
    return {
        "hidden_size": c.get_int("d_model", d_model), "head_dim": c.get_int("d_kv", 64),
        "num_attention_heads": c.get_int("num_heads", heads),
        "intermediate_size": c.get_int("d_ff", d_ff), "vocab_size": c.get_int("vocab_size", vocab),
        "num_hidden_layers": layers, "num_decoder_layers": c.get_int("num_decoder_layers", layers),
        "relative_attention_num_buckets": c.get_int("relative_attention_num_buckets", 32),
        "hidden_act": act, "mlp_kind": "gated" if len(parts) == 2 else "standard",
        "norm_kind": "rmsnorm", "position_embedding": "relative",
        "tie_word_embeddings": True,
        "hidden_dropout_prob": drop, "attention_probs_dropout_prob": drop,
    }


def _bart_fields(c: Cfg) -> dict[str, Any]:
    """BartConfig: d_model 1024, 12 + 12 layers, 16 heads, FFN 4096, 1024 positions, dropout
    0.1, attention and activation dropout 0, gelu, tied lm_head. Encoder and decoder must
    share heads and FFN width; layerdrop (random layer skipping) is refused."""
    pairs = (("encoder_attention_heads", "decoder_attention_heads", 16),
             ("encoder_ffn_dim", "decoder_ffn_dim", 4096))
    for enc, dec, default in pairs:
        if c.get_int(enc, default) != c.get_int(dec, default):
            raise InputError(f"{c.source}: {enc} != {dec} is not modelled (the encoder and "
                             "decoder layers must have one shape)")
    for key in ("encoder_layerdrop", "decoder_layerdrop"):
        if _prob(c, key, 0.0):
            raise InputError(f"{c.source}: {key} > 0 (layers skipped at random) is not modelled")
    return {
        "hidden_size": c.get_int("d_model", 1024),
        "num_attention_heads": c.get_int("encoder_attention_heads", 16),
        "intermediate_size": c.get_int("encoder_ffn_dim", 4096),
        "vocab_size": c.get_int("vocab_size", 50265),
        "max_position_embeddings": c.get_int("max_position_embeddings", 1024),
        "num_hidden_layers": c.get_int("encoder_layers", 12),
        "num_decoder_layers": c.get_int("decoder_layers", 12),
        "hidden_act": c.get_str("activation_function", "gelu"), "mlp_kind": "standard",
        "norm_kind": "layernorm", "norm_bias": True, "attention_bias": True,
        "attention_out_bias": True, "mlp_bias": True, "position_embedding": "learned",
        "final_norm": False, "tie_word_embeddings": c.get_bool("tie_word_embeddings", True),
        "hidden_dropout_prob": _prob(c, "dropout", 0.1),
        "attention_probs_dropout_prob": _prob(c, "attention_dropout", 0.0),
        "activation_dropout": _prob(c, "activation_dropout", 0.0),
    }


def seq2seq_fields(c: Cfg, model_type: str) -> dict[str, Any]:
    """ModelSpec fields of a T5 or BART config (model_type in SEQ2SEQ_TYPES)."""
    fields = _t5_fields(c, model_type) if model_type in T5_TYPES else _bart_fields(c)
    return {**fields, "architecture": "encoder_decoder", "task": "seq2seq_lm"}
