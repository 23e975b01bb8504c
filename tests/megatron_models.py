"""Model shapes the Megatron-LM tests share.

GPT_SMALL is the GPT of Megatron-LM's functional tests (tests/functional_tests/test_cases/gpt:
12 layers, hidden 512, 8 heads, sequence 1024, vocabulary padded to 50304; Megatron's
defaults: LayerNorm, learned positions, GELU 4h MLP with biases, tied embeddings).
"""

from vramcalc.model import ModelSpec

GPT_SMALL = ModelSpec(hidden_size=512, num_hidden_layers=12, num_attention_heads=8,
                      intermediate_size=2048, vocab_size=50304, mlp_kind="standard",
                      hidden_act="gelu", norm_kind="layernorm", norm_bias=True,
                      attention_bias=True, attention_out_bias=True, mlp_bias=True,
                      position_embedding="learned", tie_word_embeddings=True,
                      max_position_embeddings=1024)

# The MoE GPT of Megatron-LM's functional test gpt3_mcore_te_tp2_pp1_te_8experts2parallel_
# dist_optimizer (tests/functional_tests/test_cases/moe): GPT_SMALL with 8 experts of FFN
# 2048, top-1 routing, --disable-bias-linear.
GPT_MOE = GPT_SMALL.model_copy(update={
    "num_local_experts": 8, "num_experts_per_tok": 1, "moe_intermediate_size": 2048,
    "attention_bias": False, "attention_out_bias": False, "mlp_bias": False})
