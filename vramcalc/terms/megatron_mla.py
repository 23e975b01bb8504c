"""The megatron profile's multi-latent attention (DeepSeek-V2/V3): what Megatron-LM's
MLASelfAttention keeps for backward, tensor by tensor; `megatron_layer_tensors` puts these
rows in place of Korthikanti's attention rows."""

from __future__ import annotations

from vramcalc.rank import RankContext
from vramcalc.terms.saved import dims


def megatron_mla_tensors(ctx: RankContext, drop: bool) -> list[tuple[str, str, float]]:
    """MLA's attention rows of one Megatron-LM layer, one micro-batch, as (name, size per
    token, bytes on this rank): NVIDIA/Megatron-LM d98e8a64, the Transformer Engine layer
    spec (megatron/core/models/gpt/gpt_layer_specs.py
    `get_gpt_layer_with_transformer_engine_submodules`, multi_latent_attention without
    `mla_down_proj_fusion`) with `--qk-layernorm` (the latent norms of DeepSeek's
    q_a_layernorm / kv_a_layernorm; mla_qk_norm_config.py QKNormConfigResolver then builds
    linear_q_up_proj / linear_kv_up_proj as TELayerNormColumnParallelLinear, the norm fused
    into the up projection) and TE's flash attention. T = s·b tokens; a = heads, split over
    t (the up projections are column-parallel, linear_proj row-parallel); qr = q_lora_rank,
    kr = kv_lora_rank, dn, dr, dv the head dims, d = dn + dr. "rep" rows are whole on each
    TP rank without sequence parallelism and ÷t with it; head rows are ÷t.

    multi_latent_attention.py (MLASelfAttention):
    - input_layernorm is a separate TENorm (`backend.layer_norm(has_residual=True)`): it
      keeps its input, 2·h (rep);
    - `_qkv_down_projection`: linear_q_down_proj and linear_kv_down_proj are TELinear with
      parallel_mode="duplicated" (weights whole, no TP group, no gather: under SP they run
      on the local s/t shard); both keep the same input, the norm output, 2·h (rep);
    - linear_q_up_proj (norm + GEMM) keeps q_compressed, its norm's input, 2·qr, and the
      norm output ln_out, its GEMM input, 2·qr (rep; TE keeps the local shard under SP and
      gathers it again in backward, as Table 2 assumes);
    - `get_query_key_value_tensors`: kv_compressed and k_pos_emb are `torch.split` views of
      the (kr + dr) down-projection output; linear_kv_up_proj keeps kv_compressed as its
      norm's input (TE's `inp.view((-1, in_features))`, a view), which keeps the whole
      output alive: 2·(kr + dr) (rep), and its ln_out 2·kr (rep);
    - `qkv_up_proj_and_rope_apply`: with `--apply-rope-fusion` (yarn RoPE)
      fused_apply_mla_rope_for_q / _for_kv write query (T, a, d), key (T, a, d) and value
      (T, a, dv); without it `apply_rotary_pos_emb` rotates q_pos_emb and k_pos_emb,
      `torch.cat` builds query and key (k_pos_emb expanded over the heads) and
      `value.contiguous()` copies the dv split. Either way the up projections' outputs are
      freed (split, cat and the rotation by the constant cos/sin keep no activation) and
      the kept tensors are query and key 2·a·d/t each and value 2·a·dv/t;
    - core_attention (TEDotProductAttention, k_channels = d, v_channels = dv: no padding of
      v outside THD packing, `_prepare_mla_core_attention_value`) keeps q, k, v (above),
      its output (T, a·dv/t), which linear_proj keeps as its input (one tensor), and the
      fp32 logsumexp, 4·a/t per token; `--recompute selective` (checkpoint_core_attention)
      recomputes the core: the logsumexp goes, q, k, v stay as the checkpoint's inputs and
      the output as linear_proj's input;
    - the attention bias-dropout-add mask, h·1 (rep), when dropout > 0.

    Not counted (as in Table 2): the norms' fp32 per-token statistics and the (s, dr) cos /
    sin tables of the unfused RoPE.
    """
    x = dims(ctx)
    spec, par = ctx.spec, ctx.parallel
    t, T, h = par.tp, x.s * x.b, x.h
    a = spec.num_attention_heads
    qr, kr = spec.q_lora_rank or 0, spec.kv_lora_rank or 0
    dr, dv = spec.qk_rope_head_dim or 0, spec.v_head_dim or 0
    d = (spec.qk_nope_head_dim or 0) + dr
    div = t if par.sequence_parallel else 1

    def rep(width: int, nbytes: int = 2) -> float:
        return T * width * nbytes / div

    def heads(width: int, nbytes: int = 2) -> float:
        return T * a * width * nbytes / t

    out = [("input_layernorm input", "2 sbh", rep(h)),
           ("q/kv down projections' input (norm output)", "2 sbh", rep(h))]
    if qr:
        out += [("q_compressed (q_layernorm input)", "2 sb·qr", rep(qr)),
                ("q_layernorm output (linear_q_up_proj input)", "2 sb·qr", rep(qr))]
    out += [("kv down-projection output (kv_layernorm input)", "2 sb·(kr + dr)", rep(kr + dr)),
            ("kv_layernorm output (linear_kv_up_proj input)", "2 sb·kr", rep(kr)),
            ("query (rotated)", "2 sb·a·d", heads(d)),
            ("key (rotated)", "2 sb·a·d", heads(d)),
            ("value", "2 sb·a·dv", heads(dv))]
    if ctx.training.recompute == "selective":
        out.append(("flash logsumexp", "recomputed (core_attn)", 0.0))
    elif ctx.training.attention == "eager":  # TE's UnfusedDotProductAttention: Table 2's core
        scores = x.b * a * x.s * x.s / t
        out.append(("softmax output", "2 as²b", 2 * scores))
        if drop:
            out += [("attention dropout mask", "as²b", scores),
                    ("attention dropout output", "2 as²b", 2 * scores)]
    else:
        out.append(("flash softmax statistics (fp32 logsumexp)", "4 asb", heads(1, 4)))
    out.append(("core output (linear_proj input)", "2 sb·a·dv", heads(dv)))
    if drop:
        out.append(("bias-dropout-add mask (attention)", "sbh", rep(h, 1)))
    return out
