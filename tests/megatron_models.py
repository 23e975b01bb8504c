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
