"""The activation peak of an inference forward pass, and the sampler's logits buffers.

Legend: T = tokens in the forward, h = hidden_size, f = intermediate size, fe = expert
intermediate size, k = experts per token, a = attention heads, g = KV heads, d = head_dim,
t = tensor-parallel degree, V = vocabulary, R = sequences sampled, B = activation dtype
bytes (2, bf16).

Under `torch.inference_mode` nothing is saved for a backward pass: the peak is the largest
set of tensors alive at one moment inside a layer (one layer at a time), plus the residual
stream carried between layers. vLLM's decoder layer (vllm/model_executor/models/llama.py
`LlamaDecoderLayer.forward`) keeps `residual` (T·h) and the normed input `hidden_states`
(T·h, referenced by the caller while the MLP runs):

- gated MLP: gate_up (T·2f/t) and the SiluAndMul output (T·f/t) are alive together:
  T·(2h + 3f/t)·B;  2-matrix MLP: T·(2h + 2f/t)·B;
- fused MoE (vllm/model_executor/layers/fused_moe/fused_moe.py `fused_experts_impl`):
  intermediate_cache1 (T·k·2fe/t), cache2 (T·k·fe/t) and cache3 (T·k·h):
  T·(2h + k·(3fe/t + h))·B;
- attention: qkv (T·(a + 2g)·d/t) and the attention output (T·a·d/t):
  T·(2h + (2a + 2g)·d/t)·B; multi-latent attention: q (T·a·(dn+dr)/t), the up-projected
  k and v (T·a·(dn+dr+dv)/t) and the output (T·a·dv/t).

The sampler (vllm/v1/sample/sampler.py @ 00ec9781) takes the last hidden state of
R = min(max_num_seqs, T) sequences: logits R·V in the model dtype, their fp32 copy
(`apply_temperature`), the fp32 softmax (`get_probs`) and the exponential noise it divides
by (`random_sample`: `q = torch.empty_like(probs)`): R·V·(2 + 4 + 4 + 4) bytes, while the
forward's output (T·h·B) is still referenced.
"""

from __future__ import annotations

from vramcalc.model import ModelSpec
from vramcalc.units import ceil_div

ACT_BYTES = 2
SAMPLER_BYTES_PER_LOGIT = 2 + 4 + 4 + 4  # bf16 logits, fp32 copy, fp32 probs, fp32 noise


def forward_peak_bytes(spec: ModelSpec, num_tokens: int, tp: int) -> int:
    """Largest working set of one layer for `num_tokens` tokens on one TP rank (docstring)."""
    T, h, t = num_tokens, spec.hidden_size, tp
    a, g, d = spec.num_attention_heads, spec.kv_heads, spec.head_size
    if spec.is_mla:
        dq, dv = spec.qk_head_dim, spec.v_head_dim or 0
        attn = 2 * h + ceil_div(a * (dq + dq + dv + dv), t)
    else:
        attn = 2 * h + ceil_div((2 * a + 2 * g) * d, t)
    mlp_factor = 3 if spec.mlp_kind == "gated" else 2
    dense = 2 * h + ceil_div(mlp_factor * spec.intermediate_size, t)
    width = max(attn, dense if spec.num_dense_layers else 0)
    if spec.is_moe:
        k, fe = spec.num_experts_per_tok, spec.expert_ffn
        width = max(width, 2 * h + k * (ceil_div(mlp_factor * fe, t) + h))
    return T * width * ACT_BYTES


def sampler_peak_bytes(spec: ModelSpec, num_seqs: int, num_tokens: int) -> int:
    """The sampler's logits buffers for `num_seqs` sequences plus the forward's output of
    `num_tokens` tokens it keeps alive (docstring). Logits are gathered to the full
    vocabulary on the last pipeline stage."""
    return (num_seqs * spec.vocab_size * SAMPLER_BYTES_PER_LOGIT
            + num_tokens * spec.hidden_size * ACT_BYTES)


def hf_prefill_peak_bytes(spec: ModelSpec, batch: int, prompt: int) -> int:
    """HF generate's prefill forward (transformers modeling_llama.py, under inference mode):
    the model keeps `inputs_embeds` and the layer's input alive while a layer runs, and the
    layer keeps `residual` and the normed input: 4 residual-stream tensors (3 in a one-layer
    model) beside the MLP's gate activation, up projection and their product (3f; a 2-matrix
    MLP 2f), plus the rotary cos/sin (2·P·d, batch-broadcast) and the int64 input ids. With
    the static cache and SDPA no attention mask is built on a CUDA device (transformers
    masking_utils, data-dependent `is_causal` path). Refereed by the trace engine
    (tests/test_serve_trace.py)."""
    T, h = batch * prompt, spec.hidden_size
    stream = 4 if spec.num_hidden_layers > 1 else 3
    mlp = (3 if spec.mlp_kind == "gated" else 2) * spec.intermediate_size
    width = stream * h + mlp
    if spec.is_moe:
        width = max(width, stream * h + spec.num_experts_per_tok * (
            (3 if spec.mlp_kind == "gated" else 2) * spec.expert_ffn + h))
    return T * width * ACT_BYTES + 2 * prompt * spec.head_size * ACT_BYTES + T * 8


def prefill_logits_bytes(spec: ModelSpec, batch: int) -> int:
    """HF generate: logits of the last position only (`logits_to_keep=1`), upcast to fp32
    by generate (`outputs.logits[:, -1, :].to(torch.float32)`), plus the bf16 original."""
    return batch * spec.vocab_size * (ACT_BYTES + 4)
