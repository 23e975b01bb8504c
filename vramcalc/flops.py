"""Training FLOPs per token of a model spec, for the speed model (vramcalc/speed.py).

Legend: N_mm = parameters that take part in matrix multiplies per token (active parameters
minus the input-embedding lookup; a tied head counts once), L = layers, s = sequence length,
a = heads, d_qk / d_v = width of a query-key head / a value head (both the head dim d but
under multi-latent attention: d_qk = qk_nope_head_dim + qk_rope_head_dim, d_v =
v_head_dim), A = a·(d_qk + d_v)/2 (= a·d for ordinary attention), D = multi-token
prediction depths (Megatron-LM --mtp-num-layers), V = vocabulary, h = hidden size.

    F_model per token = 6·N_mm + 12·L·s·A                    (PaLM App. B; Kaplan et al. 2020)

The attention core per layer and token: q·kᵀ, 2·s·a·d_qk forward FLOPs, and p·v,
2·s·a·d_v, so 2·s·a·(d_qk + d_v) = 4·s·A forward and three times that with backward,
12·s·A. Multi-latent attention's projections (q/kv down and up projections, o_proj) are
ordinary matmuls, counted in N_mm from the spec's exact parameter count; its core attends
over d_qk = dn + dr with q·kᵀ and over d_v = dv with p·v (DeepSeek-V2, arXiv:2405.04434
§2.1.2-2.1.3, eqs. 12-19; NVIDIA/Megatron-LM d98e8a64 multi_latent_attention.py builds
the core with k_channels = qk_head_dim + qk_pos_emb_head_dim, v_channels = v_head_dim).

Multi-token prediction (DeepSeek-V3, arXiv:2412.19437 §2.2): each depth runs one more
transformer layer (of the decoder's last layer's kind), its projection eh_proj (2h -> h) and
norms, and the shared output head (h -> V) on every token; the shared embedding is a lookup:

    F_mtp per token = D·(6·N_depth + 12·s·A),   N_depth = N_layer + N_mtp-own + V·h

with N_layer the active parameters of that layer and N_mtp-own the depth's own tensors
(vramcalc/sharding.py `mtp_tensors`: eh_proj and three norms).

Recomputation adds forward FLOPs: full recompute the layers' forward again (MTP depths
included, whose checkpoint runs eh_proj and the layer, not the head), 2·(N_mm − V·h) +
4·L·s·A + D·(2·(N_depth − V·h) + 4·s·A); selective the attention core, 4·(L + D)·s·A
(Korthikanti et al. 2022).

Encoder-decoders (T5, mT5, BART; `seq2seq_flops`) run the encoder over the s source tokens
and the decoder over the t target tokens (--target-len), and each decoder layer's
cross-attention projects queries at t tokens but keys and values of the encoder output at
s. Per sequence, forward:

    encoder     2·Le·(P_att + P_ff)·s + 4·Le·s²·A
    decoder     2·Ld·(P_att + P_ff)·t                 self-attention and feed-forward
                + 2·Ld·(P_q + P_o)·t + 2·Ld·(P_k + P_v)·s   cross-attention projections
                + 4·Ld·t²·A + 4·Ld·t·s·A              self- and cross-attention products
    head        2·V·h·t

with A = a·d, P_att = 4·h·A (q, k, v: h -> A, o: A -> h; P_q = P_k = P_v = P_o = h·A),
P_ff = 2·h·f (3·h·f for T5 v1.1's gated feed-forward), shapes as vramcalc/seq2seq_shapes.py
lists them (biases, norms and T5's relative-position bias left out, as above). Training is
three forwards; full recompute runs the layers' forward once more, not the head. Per
source token: the sequence's total / s, so that `plan`'s tokens/s count the source tokens
its global batch counts. With t = s this is 6·N_mm + 12·(Le + 2·Ld)·s·A
(tests/test_seq2seq_plan.py: equal to torch's FlopCounterMode on transformers' models).
"""

from __future__ import annotations

from vramcalc.hardware import GPUProfile
from vramcalc.model import ModelSpec
from vramcalc.sharding import mtp_tensors
from vramcalc.terms.torchtitan import op_sac_recompute_flops_per_token


def matmul_params(spec: ModelSpec) -> int:
    """N_mm: active parameters minus the input-embedding lookup (a tied head counts once)."""
    n = spec.num_active_params - spec.embedding_params
    if spec.tie_word_embeddings:
        n += spec.vocab_size * spec.hidden_size
    return n


def attention_width(spec: ModelSpec) -> float:
    """A = a·(d_qk + d_v)/2: a·d for ordinary attention; multi-latent attention's q/k heads
    are qk_nope_head_dim + qk_rope_head_dim wide and its v heads v_head_dim (module doc)."""
    d = spec.head_size
    return spec.num_attention_heads * (d + (spec.v_head_dim or d)) / 2


def mtp_depth_params(spec: ModelSpec) -> int:
    """N_depth: parameters one multi-token-prediction depth multiplies per token: its
    transformer layer (the decoder's last layer's kind; MoE: top-k routed experts), its own
    eh_proj and norms (vramcalc/sharding.py `mtp_tensors`) and the shared head's V·h."""
    if spec.is_moe_layer(spec.num_hidden_layers - 1):
        layer = spec.moe_layer_params - (
            spec.num_local_experts - spec.num_experts_per_tok) * spec.expert_params
    else:
        layer = spec.dense_layer_params
    own = sum(t.numel * t.count for t in mtp_tensors(spec, 1, 1, True))
    return layer + own + spec.vocab_size * spec.hidden_size


def model_flops_per_token(spec: ModelSpec, seq_len: int, adapter_params: int | None = None,
                          mtp_layers: int = 0) -> float:
    """6·N_mm + 12·L·s·A (+ the MTP depths' 6·N_depth + 12·s·A each): training FLOPs per
    token without recomputation (module docstring). With `adapter_params` (LoRA/QLoRA/DoRA:
    frozen base) 4·N_mm + 6·N_ad + 12·L·s·A: the frozen weights' gradient matmuls are
    skipped (vramcalc/speed.py)."""
    A = attention_width(spec)
    base = 6.0 * matmul_params(spec) if adapter_params is None else (
        4.0 * matmul_params(spec) + 6.0 * adapter_params)
    out = base + 12.0 * spec.num_hidden_layers * seq_len * A
    if mtp_layers:
        out += mtp_layers * (6.0 * mtp_depth_params(spec) + 12.0 * seq_len * A)
    return out


def recompute_flops_per_token(spec: ModelSpec, seq_len: int, recompute: str,
                              selective: str | int = "core", mtp_layers: int = 0) -> float:
    """Extra forward FLOPs per token: full = 2·(N_mm − V·h) + 4·L·s·A (the transformer
    layers run forward again; the output head does not) and, per MTP depth, 2·(N_depth −
    V·h) + 4·s·A; selective (`selective_kind`) = 4·(L + D)·s·A (the attention core),
    torchtitan's per-op SAC ("op"), or full on ⌊L/N⌋ layers."""
    L, A = spec.num_hidden_layers, attention_width(spec)
    attn_fwd = 4.0 * (L + mtp_layers) * seq_len * A  # the attention cores' forward
    vh = spec.vocab_size * spec.hidden_size
    full = 2.0 * (matmul_params(spec) - vh) + attn_fwd
    if mtp_layers:
        full += mtp_layers * 2.0 * (mtp_depth_params(spec) - vh)
    if recompute != "selective":
        return full if recompute == "full" else 0.0
    if selective == "op":
        return op_sac_recompute_flops_per_token(spec)
    return full * (L // selective) / L if isinstance(selective, int) else attn_fwd


def seq2seq_flops(spec: ModelSpec, s: int, t: int) -> tuple[float, dict[str, float]]:
    """Training FLOPs per source token, and the hardware FLOPs per recompute mode (none,
    full; selective is not run for these models) (module docstring)."""
    h, f, V = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    A = spec.num_attention_heads * spec.head_size
    Le, Ld = spec.num_hidden_layers, spec.num_decoder_layers
    p_att = 4 * h * A
    p_ff = (3 if spec.mlp_kind == "gated" else 2) * h * f
    layers = (2.0 * Le * (p_att + p_ff) * s + 4.0 * Le * s * s * A
              + 2.0 * Ld * (p_att + p_ff) * t
              + 2.0 * Ld * (2 * h * A) * t + 2.0 * Ld * (2 * h * A) * s
              + 4.0 * Ld * t * t * A + 4.0 * Ld * t * s * A)
    head = 2.0 * V * h * t
    model = 3.0 * (layers + head) / s
    return model, {"none": model, "selective": model, "full": model + layers / s}


def peak_flops(gpu: GPUProfile, dtype: str) -> tuple[float, str | None]:
    """Dense peak FLOP/s for `dtype`; falls back to fp16, then fp32, with a note."""
    tflops = gpu.peak_tflops(dtype)
    if tflops is not None:
        return tflops * 1e12, None
    for alt in ("fp16", "fp32", "bf16"):
        t = gpu.peak_tflops(alt)
        if t is not None:
            return t * 1e12, (f"{gpu.name} has no {dtype} peak in its profile; "
                              f"speed uses its {alt} peak ({t:g} TFLOP/s)")
    return 1e12, f"{gpu.name} has no TFLOP/s figure; speed assumes 1 TFLOP/s"


def fp8_peak_flops(spec: ModelSpec, gpu: GPUProfile, seq_len: int,
                   mtp_layers: int = 0) -> tuple[float, str | None]:
    """Effective dense FLOP/s of an FP8 step: the block linears' 6·N_layers FLOPs per token
    at the profile's FP8 peak, the rest (lm_head, attention 12·L·s·a·d) at its BF16 peak
    (Transformer Engine runs only the linears in FP8, vramcalc/terms/lowprec.py; torchtitan's
    --float8 every linear but the output projection): F / (F_fp8/P_fp8 + F_bf16/P_bf16). MTP
    depths (vramcalc/flops.py) add their layer and eh_proj to the FP8 part (Megatron-LM runs
    `_concat_embeddings` and the layer in the FP8 context), the shared head's V·h to the
    BF16 part. Falls back to the BF16 peak, with a note, when the profile has no FP8 figure."""
    p16, note = peak_flops(gpu, "bf16")
    fp8 = gpu.peak_tflops("fp8")
    if fp8 is None:
        return p16, f"{gpu.name} has no fp8 peak in its profile; speed uses its bf16 peak"
    n_lin = (spec.num_active_params - spec.embedding_params - spec.head_params
             - spec.final_norm_params)
    if mtp_layers:
        n_lin += mtp_layers * (mtp_depth_params(spec) - spec.vocab_size * spec.hidden_size)
    total = model_flops_per_token(spec, seq_len, mtp_layers=mtp_layers)
    f_fp8 = min(6.0 * n_lin, total)
    return total / (f_fp8 / (fp8 * 1e12) + (total - f_fp8) / p16), note
