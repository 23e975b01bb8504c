"""transformers' T5 and BART configs for an encoder-decoder ModelSpec (the trace engine's
hf profile builds them with AutoModelForSeq2SeqLM.from_config; vramcalc/trace/hf_models.py).

The config carries the spec's shapes and dropout (T5's one dropout_rate; BART's dropout,
attention_dropout and activation_dropout; `--dropout 0` turns them off), so the traced step
keeps the dropout masks the run keeps; under --attention flash BART's attention_dropout is
built at 0, as for encoders (vramcalc/trace/hf_models.py `encoder_config`): CUDA's fused SDPA
kernel keeps no mask (its RNG seed and offset only), while CPU SDPA with dropout would take
the math kernel, not `_scaled_dot_product_flash_attention_for_cpu`, which
vramcalc/trace/cuda_rules.py allocates as CUDA's flash kernel. T5's attention dropout
(its dropout_rate, modeling_t5.py L362) stays: its calls carry the position bias as a float
mask and run CUDA's memory-efficient kernel in the trace (`cuda_rules.cuda_biased_sdpa`),
which takes the dropout inside and keeps no mask. Token ids are those of the released checkpoints (T5 pads with 0 and
starts the decoder with 0; BART pads with 1 and starts with 2): `labels` are shifted right
into decoder_input_ids by the model itself.
"""

from __future__ import annotations

from typing import Any

from vramcalc.model import ModelSpec
from vramcalc.training import TrainingConfig


def seq2seq_config(tf: Any, spec: ModelSpec, training: TrainingConfig | None = None) -> Any:
    """T5Config or BartConfig with the spec's shapes and its dropout (no cache; BART's
    attention dropout 0 under --attention flash, see the module doc)."""
    off = training is not None and training.dropout == 0
    hidden = 0.0 if off else spec.hidden_dropout_prob
    if spec.model_type in ("t5", "mt5"):
        gated = spec.mlp_kind == "gated"
        act = "gelu" if gated and spec.hidden_act == "gelu_new" else spec.hidden_act
        cls = tf.MT5Config if spec.model_type == "mt5" else tf.T5Config
        return cls(
            vocab_size=spec.vocab_size, d_model=spec.hidden_size, d_kv=spec.head_size,
            d_ff=spec.intermediate_size, num_layers=spec.num_hidden_layers,
            num_decoder_layers=spec.num_decoder_layers, num_heads=spec.num_attention_heads,
            relative_attention_num_buckets=spec.relative_attention_num_buckets,
            dropout_rate=hidden, feed_forward_proj=("gated-" if gated else "") + act,
            tie_word_embeddings=spec.tie_word_embeddings, use_cache=False,
            pad_token_id=0, decoder_start_token_id=0)  # T5's tokenizer: pad 0 starts
    return tf.BartConfig(
        vocab_size=spec.vocab_size, d_model=spec.hidden_size,
        max_position_embeddings=spec.max_position_embeddings,
        encoder_layers=spec.num_hidden_layers, decoder_layers=spec.num_decoder_layers,
        encoder_attention_heads=spec.num_attention_heads,
        decoder_attention_heads=spec.num_attention_heads,
        encoder_ffn_dim=spec.intermediate_size, decoder_ffn_dim=spec.intermediate_size,
        activation_function=spec.hidden_act, dropout=hidden,
        attention_dropout=0.0 if off or training is not None and training.attention == "flash"
        else spec.attention_probs_dropout_prob,
        activation_dropout=0.0 if off else spec.activation_dropout,
        tie_word_embeddings=spec.tie_word_embeddings, use_cache=False,
        pad_token_id=1, decoder_start_token_id=2)  # BartConfig's defaults
