"""The model shapes of the validation grid, and one scenario of a shape."""

from __future__ import annotations

from typing import Any

from vramcalc.hf_config import from_hf_config
from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.scenario import Scenario
from vramcalc.training import TrainingConfig

_MODERNBERT: dict[str, Any] = {
    "hidden_size": 768, "num_hidden_layers": 4, "num_attention_heads": 12,
    "intermediate_size": 1152, "vocab_size": 50368, "max_position_embeddings": 8192,
    "mlp_kind": "gated", "hidden_act": "gelu", "norm_kind": "layernorm",
    "position_embedding": "rope", "final_norm": True, "sliding_window": 128,
    "sliding_window_pattern": 3}
_ENCODER: dict[str, Any] = {
    "mlp_kind": "standard", "hidden_act": "gelu", "norm_kind": "layernorm", "norm_bias": True,
    "attention_bias": True, "attention_out_bias": True, "mlp_bias": True,
    "position_embedding": "learned", "final_norm": False, "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1}
# Shapes keep real widths (fake tensors cost nothing per element) and few layers (the
# trace's cost is per op). Each is a family the analytic model must cover.
SHAPES: dict[str, ModelSpec] = {
    # Llama-3-style grouped-query attention (8:2 heads), SwiGLU, untied
    "llama-gqa": ModelSpec(name="llama-gqa", hidden_size=1024, num_hidden_layers=2,
                           num_attention_heads=16, num_key_value_heads=4,
                           intermediate_size=2816, vocab_size=32000),
    # Llama-2-style multi-head attention, head_dim 128
    "llama-mha": ModelSpec(name="llama-mha", hidden_size=1024, num_hidden_layers=2,
                           num_attention_heads=8, intermediate_size=2752, vocab_size=32000),
    # Qwen2-style: q/k/v biases, tied embeddings; Qwen3-style qk_norm with head_dim 128
    "qwen2-bias": ModelSpec(name="qwen2-bias", hidden_size=896, num_hidden_layers=2,
                            num_attention_heads=14, num_key_value_heads=2,
                            intermediate_size=4864, vocab_size=32768, attention_bias=True,
                            tie_word_embeddings=True),
    "qwen3-qknorm": ModelSpec(name="qwen3-qknorm", hidden_size=1024, num_hidden_layers=2,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                              intermediate_size=3072, vocab_size=32768, qk_norm=True,
                              tie_word_embeddings=True),
    # GPT-2 small widths: LayerNorm with bias, learned positions, GELU, tied, odd vocab
    "gpt2": ModelSpec(name="gpt2", model_type="gpt2", hidden_size=768, num_hidden_layers=2,
                      num_attention_heads=12, intermediate_size=3072, vocab_size=50257,
                      max_position_embeddings=1024, mlp_kind="standard",
                      hidden_act="gelu_new", norm_kind="layernorm", norm_bias=True,
                      attention_bias=True, attention_out_bias=True, mlp_bias=True,
                      position_embedding="learned", tie_word_embeddings=True),
    # Nemotron's squared relu with a biased LayerNorm, GQA and a small vocabulary (peak in
    # the layers); "gpt2-relu" below: OPT's relu (its output is proj's input), GPT-2's shape
    "nemotron-relu2": ModelSpec(name="nemotron-relu2", model_type="nemotron", hidden_size=1024,
                                num_hidden_layers=4, num_attention_heads=16,
                                num_key_value_heads=4, intermediate_size=4096,
                                vocab_size=1024, mlp_kind="standard", hidden_act="relu2",
                                norm_kind="layernorm", norm_bias=True),
    # deeper, with a small vocabulary: the peak moves from the loss into the layers
    "llama-deep": ModelSpec(name="llama-deep", hidden_size=1024, num_hidden_layers=4,
                            num_attention_heads=16, num_key_value_heads=4,
                            intermediate_size=2816, vocab_size=1024),
    # Phi-3-style fused qkv and gate_up projections; Gemma-style MQA, head_dim 256, GeGLU,
    # (1 + w) RMSNorm and scaled embeddings (the hf profile follows each family's code)
    "phi3-fused": ModelSpec(name="phi3-fused", model_type="phi3", hidden_size=1024,
                            num_hidden_layers=2, num_attention_heads=16,
                            intermediate_size=2816, vocab_size=32064),
    "gemma-mqa": ModelSpec(name="gemma-mqa", model_type="gemma", hidden_size=1024,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1,
                           head_dim=256, intermediate_size=4096, vocab_size=32000,
                           hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
    # Mixtral-style MoE: 8 experts, top-2
    "moe": ModelSpec(name="moe", hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
                     num_key_value_heads=4, intermediate_size=1408, vocab_size=32000,
                     num_local_experts=8, num_experts_per_tok=2),
    # Qwen2-MoE-style: a dense first layer, 4 experts top-2, a gated shared expert
    "moe-shared": ModelSpec(name="moe-shared", hidden_size=1024, num_hidden_layers=2,
                            num_attention_heads=16, num_key_value_heads=4,
                            intermediate_size=2816, vocab_size=32000, num_local_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=704,
                            num_shared_experts=1, shared_expert_intermediate_size=1408,
                            shared_expert_gate=True, first_k_dense_replace=1,
                            attention_bias=True),
    # BERT-large widths (post-LayerNorm encoder, dropout 0.1, classification head) and a
    # RoBERTa-base-like masked-LM encoder (position ids from the token ids)
    "bert": ModelSpec(name="bert", model_type="bert", architecture="encoder",
                      task="sequence_classification", hidden_size=1024, num_hidden_layers=2,
                      num_attention_heads=16, intermediate_size=4096, vocab_size=30522,
                      max_position_embeddings=512, type_vocab_size=2, **_ENCODER),
    "roberta-mlm": ModelSpec(name="roberta-mlm", model_type="roberta", architecture="encoder",
                             task="masked_lm", hidden_size=768, num_hidden_layers=2,
                             num_attention_heads=12, intermediate_size=3072, vocab_size=50265,
                             max_position_embeddings=514, type_vocab_size=1,
                             tie_word_embeddings=True, **_ENCODER),
    # ModernBERT-base widths, 4 layers: global, local, local, global (every 3rd from layer 0,
    # 128-token local window); mean-pooled classification head, and the tied masked-LM head
    "modernbert": ModelSpec(name="modernbert", model_type="modernbert", architecture="encoder",
                            task="sequence_classification", classifier_pooling="mean",
                            **_MODERNBERT),
    "modernbert-mlm": ModelSpec(name="modernbert-mlm", model_type="modernbert",
                                architecture="encoder", task="masked_lm",
                                tie_word_embeddings=True, **_MODERNBERT),
    # Qwen3-MoE with decoder_sparse_step 2 (Llama-4 Maverick's interleave_moe_layer_step 2
    # likewise): dense and MoE layers alternate, the top layer MoE; a small vocabulary puts
    # the peak in the layers' backward
    "moe-interleaved": ModelSpec(name="moe-interleaved", hidden_size=1024, num_hidden_layers=4,
                                 num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                 intermediate_size=2816, vocab_size=1024, num_local_experts=8,
                                 num_experts_per_tok=2, moe_intermediate_size=704,
                                 qk_norm=True, moe_layers=(1, 3)),
}
# Qwen3-MoE with every layer MoE (Qwen3-30B-A3B's layout): under PEFT its experts' fused
# parameters take adapters (vramcalc/peft_moe.py), each layer's W' the size of its experts
SHAPES["qwen3-moe"] = SHAPES["moe-interleaved"].model_copy(
    update={"name": "qwen3-moe", "moe_layers": None, "num_hidden_layers": 2})
SHAPES["gpt2-relu"] = SHAPES["gpt2"].model_copy(
    update={"name": "gpt2-relu", "hidden_act": "relu", "vocab_size": 1024})


def scenario_for(shape: str, framework: str = "reference", **kw: Any) -> tuple[str, Scenario]:
    """(name, scenario) of one validation shape with these training options (one rank)."""
    tr = TrainingConfig(framework=framework, **{
        "seq_len": 1024, "micro_batch_size": 2, "precision": "bf16", "optimizer": "adamw",
        **kw})
    name = (f"{framework}/{shape}/{tr.precision}/{tr.optimizer}/{tr.attention}/{tr.recompute}"
            f"/b{tr.micro_batch_size}s{tr.seq_len}" + (f"ga{tr.grad_accum}" if tr.grad_accum > 1
                                                       else "")
            + (f"/{tr.optimizer_impl}" if tr.optimizer_impl else "")
            + (f"/{tr.hf_optim}" if tr.hf_optim else "")
            + ("/reentrant" if tr.use_reentrant else "")
            + ("/kbit-prepare" if tr.kbit_prepare else "")
            + (f"/t{tr.target_len}" if tr.target_len else ""))
    model = SHAPES[shape] if shape in SHAPES else SEQ2SEQ_SHAPES[shape]
    return name, Scenario(model=model, training=tr, parallel=ParallelConfig())


# Encoder-decoders (vramcalc/terms/seq2seq.py) from config.json keys: google-t5/t5-small's
# widths (relu FF, dropout_rate 0.1), google/t5-v1_1-small's (gated-gelu, d_ff 1024, 6
# heads) and facebook/bart-base's (dropout, attention_dropout
# and activation_dropout 0.1 as bart-large's config.json sets them), two layers per stack;
# "-v1k" variants with a 1,024-token vocabulary put the peak in the layers
_T5: dict[str, Any] = {"model_type": "t5", "d_model": 512, "d_kv": 64, "d_ff": 2048,
                       "num_heads": 8, "num_layers": 2, "vocab_size": 32128}
_BART: dict[str, Any] = {
    "model_type": "bart", "d_model": 768, "encoder_layers": 2, "decoder_layers": 2,
    "encoder_attention_heads": 12, "decoder_attention_heads": 12, "encoder_ffn_dim": 3072,
    "decoder_ffn_dim": 3072, "vocab_size": 50265, "dropout": 0.1, "attention_dropout": 0.1,
    "activation_dropout": 0.1}
SEQ2SEQ_SHAPES: dict[str, ModelSpec] = {
    name: from_hf_config(cfg, f"{name}/config.json").model_copy(update={"name": name})
    for name, cfg in (("t5", _T5), ("t5-v1k", {**_T5, "vocab_size": 1024}),
                      ("t5-v11", {**_T5, "feed_forward_proj": "gated-gelu", "d_ff": 1024,
                                  "num_heads": 6}), ("bart", _BART),
                      ("bart-v1k", {**_BART, "vocab_size": 1024}))}
