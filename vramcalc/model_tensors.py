"""The parameter tensors of a model, one entry per distinct shape and role, for the
sharding, fine-tuning and serving layouts (`param_tensors`; counts as in vramcalc/model.py:
their sum equals `ModelSpec.num_params`, tests/test_model.py and the transformers numel
checks)."""

from __future__ import annotations

from collections.abc import Callable

from vramcalc.model import ModelSpec, ParamTensor, encoder_tensors, mla_tensors
from vramcalc.seq2seq_shapes import seq2seq_rows


def param_tensors(spec: ModelSpec) -> tuple[ParamTensor, ...]:
    """Every parameter tensor of the model with its element count (matches ModelSpec.num_params).

    Cached per spec (ModelSpec is frozen and hashable): the planner calls this per estimate.
    """
    if spec.is_encoder_decoder:  # T5, BART: vramcalc/seq2seq_shapes.py
        return tuple(ParamTensor(name, numel, count, group, tp_split=False, rows=rows)
                     for name, numel, count, group, rows in seq2seq_rows(spec))
    h, a, g, d = spec.hidden_size, spec.num_attention_heads, spec.kv_heads, spec.head_size
    out: list[ParamTensor] = [ParamTensor(name="embed_tokens", numel=spec.vocab_size * h, count=1,
                                          group="embedding", rows=spec.vocab_size)]
    if spec.position_embedding == "learned":
        out.append(ParamTensor(name="embed_positions", numel=spec.max_position_embeddings * h,
                               count=1, group="embedding", tp_split=False,
                               rows=spec.max_position_embeddings))

    def norm(name: str, width: int, count: int, group: str) -> None:
        out.append(ParamTensor(name=f"{name}.weight", numel=width, count=count, group=group,
                               tp_split=False))
        if spec.norm_bias:
            out.append(ParamTensor(name=f"{name}.bias", numel=width, count=count, group=group,
                                   tp_split=False))

    def mlp(prefix: str, ffn: int, count: int, group: str) -> None:
        mats = ["gate_proj", "up_proj", "down_proj"] if spec.mlp_kind == "gated" else ["fc", "proj"]
        for m in mats:
            rows = h if m in ("down_proj", "proj") else ffn
            out.append(ParamTensor(name=f"{prefix}.{m}.weight", numel=h * ffn, count=count,
                                   group=group, rows=rows))
            if spec.mlp_bias:
                width = h if m in ("down_proj", "proj") else ffn
                out.append(ParamTensor(name=f"{prefix}.{m}.bias", numel=width, count=count,
                                       group=group, tp_split=width == ffn))

    L = spec.num_hidden_layers
    if spec.model_type == "modernbert":  # fused Wqkv (h->3h) and Wi (h->2f), one tensor each
        return _modernbert_tensors(spec, out, norm)
    if spec.is_mla:
        out += [ParamTensor(name=f"attn.{n}", numel=numel, count=L, group="layer", rows=rows,
                            tp_split=split) for n, numel, rows, split in mla_tensors(spec)]
    else:
        out.append(ParamTensor(name="attn.q_proj.weight", numel=h * a * d, count=L,
                               group="layer", rows=a * d))
        out.append(ParamTensor(name="attn.k_proj.weight", numel=h * g * d, count=L,
                               group="layer", rows=g * d))
        out.append(ParamTensor(name="attn.v_proj.weight", numel=h * g * d, count=L,
                               group="layer", rows=g * d))
        out.append(ParamTensor(name="attn.o_proj.weight", numel=a * d * h, count=L,
                               group="layer", rows=h))
        if spec.attention_bias:
            out.append(ParamTensor(name="attn.q_proj.bias", numel=a * d, count=L, group="layer"))
            out.append(ParamTensor(name="attn.k_proj.bias", numel=g * d, count=L, group="layer"))
            out.append(ParamTensor(name="attn.v_proj.bias", numel=g * d, count=L, group="layer"))
        if spec.attention_out_bias:
            out.append(ParamTensor(name="attn.o_proj.bias", numel=h, count=L, group="layer",
                                   tp_split=False))
        if spec.qk_norm:
            norm("attn.q_norm", d, L, "layer")
            norm("attn.k_norm", d, L, "layer")
    norm("input_layernorm", h, L, "layer")
    if spec.num_layer_norms >= 2:
        norm("post_attention_layernorm", h, L, "layer")
    for i in range(spec.num_layer_norms - 2):
        norm(f"extra_layernorm_{i}", h, L, "layer")
    if spec.num_dense_layers:
        mlp("mlp", spec.intermediate_size, spec.num_dense_layers, "layer")
    if spec.num_moe_layers:
        n_moe = spec.num_moe_layers
        mlp("experts", spec.expert_ffn, n_moe * spec.num_local_experts, "expert")
        out.append(ParamTensor(name="router.weight", numel=h * spec.num_local_experts,
                               count=n_moe, group="layer", tp_split=False,
                               rows=spec.num_local_experts))
        if spec.router_bias:
            out.append(ParamTensor(name="router.bias", numel=spec.num_local_experts, count=n_moe,
                                   group="layer", tp_split=False))
        if spec.num_shared_experts:
            mlp("shared_expert", spec.shared_ffn, n_moe * spec.num_shared_experts, "layer")
            if spec.shared_expert_gate:
                out.append(ParamTensor(name="shared_expert_gate.weight", numel=h, count=n_moe,
                                       group="layer", tp_split=False, rows=1))
    if spec.final_norm:
        norm("norm", h, 1, "final")
    if spec.is_encoder:
        return tuple(out) + encoder_tensors(spec)
    if not spec.tie_word_embeddings:
        out.append(ParamTensor(name="lm_head.weight", numel=spec.vocab_size * h, count=1,
                               group="head", rows=spec.vocab_size))
    if spec.lm_head_bias:
        out.append(ParamTensor(name="lm_head.bias", numel=spec.vocab_size, count=1,
                               group="head", rows=spec.vocab_size))
    return tuple(out)


def _modernbert_tensors(spec: ModelSpec, out: list[ParamTensor],
                        norm: Callable[[str, int, int, str], None]) -> tuple[ParamTensor, ...]:
    """ModernBERT's layers (modeling_modernbert.py): Wqkv (h->3h) and Wo, Wi (h->2f) and the
    MLP's Wo, each with a bias when attention_bias / mlp_bias; mlp_norm in every layer,
    attn_norm in all but layer 0 (nn.Identity); the final norm; then the encoder's rows."""
    h, f, L = spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers
    mats = [("attn.Wqkv", 3 * h, h, spec.attention_bias), ("attn.o_proj", h, h,
            spec.attention_bias), ("mlp.Wi", 2 * f, h, spec.mlp_bias),
            ("mlp.down_proj", h, f, spec.mlp_bias)]
    for name, rows, cols, bias in mats:
        out.append(ParamTensor(name=f"{name}.weight", numel=rows * cols, count=L,
                               group="layer", rows=rows))
        if bias:
            out.append(ParamTensor(name=f"{name}.bias", numel=rows, count=L, group="layer",
                                   tp_split=False))
    norm("mlp_norm", h, L, "layer")
    # L - 1 attn_norms: held beside the final norm (per-layer counts must divide by L,
    # vramcalc/sharding.py); encoders run on one pipeline stage
    norm("attn_norm", h, L - 1, "final")
    norm("norm", h, 1, "final")
    return tuple(out) + encoder_tensors(spec)
