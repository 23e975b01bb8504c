"""Hugging Face `config.json` -> ModelSpec, with the defaults transformers gives keys a file
leaves out (transformers 5.x `configuration_*.py`). Pure: takes the parsed dict; reading the
file is vramcalc.catalog's job. Never the hub, never `trust_remote_code`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vramcalc.errors import InputError
from vramcalc.model import ModelSpec, spec_from_fields

_MISSING = object()
_GENERIC_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)
_GPT2_KEYS = ("n_embd", "n_layer", "n_head", "vocab_size")

# Defaults transformers 5.x gives keys a config.json leaves out (configuration_<type>.py).
# kv: num_key_value_heads (None = as many as attention heads); head_dim None = h / a.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"kv": None, "head_dim": None, "tie": False, "act": "silu", "pos": 2048},
    "mistral": {"kv": 8, "head_dim": None, "tie": False, "act": "silu", "pos": 131072},
    "mixtral": {"kv": 8, "head_dim": None, "tie": False, "act": "silu", "pos": 131072},
    "qwen2": {"kv": 32, "head_dim": None, "tie": False, "act": "silu", "pos": 32768},
    "qwen2_moe": {"kv": 16, "head_dim": None, "tie": False, "act": "silu", "pos": 32768},
    "qwen3": {"kv": 32, "head_dim": 128, "tie": False, "act": "silu", "pos": 32768},
    "qwen3_moe": {"kv": 4, "head_dim": None, "tie": False, "act": "silu", "pos": 32768},
    "phi3": {"kv": None, "head_dim": None, "tie": False, "act": "silu", "pos": 4096},
    "gemma": {"kv": 16, "head_dim": 256, "tie": True, "act": "gelu_pytorch_tanh", "pos": 8192},
    "gemma2": {"kv": 4, "head_dim": 256, "tie": True, "act": "gelu_pytorch_tanh", "pos": 8192},
    "gemma3_text": {
        "kv": 4,
        "head_dim": 256,
        "tie": True,
        "act": "gelu_pytorch_tanh",
        "pos": 131072,
    },
    "gpt_neox": {"kv": None, "head_dim": None, "tie": False, "act": "gelu", "pos": 2048},
    "deepseek_v2": {"kv": None, "head_dim": None, "tie": False, "act": "silu", "pos": 2048},
    "deepseek_v3": {"kv": 128, "head_dim": None, "tie": False, "act": "silu", "pos": 4096},
    "llama4_text": {"kv": 8, "head_dim": 128, "tie": False, "act": "silu", "pos": 131072},
}
# Multi-latent attention and MoE defaults (configuration_deepseek_v2.py / _v3.py):
# kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
# n_routed_experts, n_shared_experts, moe_intermediate_size, num_experts_per_tok,
# first_k_dense_replace (num_experts_per_tok None: V2 has no default, the key is required).
_MLA_DEFAULTS: dict[str, tuple[int | None, ...]] = {
    "deepseek_v2": (512, 1536, 128, 64, 128, 64, 2, 1407, None, 0),
    "deepseek_v3": (512, 1536, 128, 64, 128, 256, 1, 2048, 8, 3),
}
# Unknown model types: llama-like (gated MLP, RMSNorm, no biases unless the keys say so).
_GENERIC_DEFAULTS: dict[str, Any] = {
    "kv": None,
    "head_dim": None,
    "tie": False,
    "act": "silu",
    "pos": 4096,
}
SUPPORTED_MODEL_TYPES = ("gpt2", *_DEFAULTS)


class _Cfg:
    """Typed reads from a config dict; every bad value is a one-line InputError."""

    def __init__(self, cfg: dict[str, Any], source: str) -> None:
        self.cfg, self.source = cfg, source

    def _raw(self, key: str, default: Any) -> Any:
        value = self.cfg.get(key, _MISSING)
        return default if value is _MISSING or value is None else value

    def get_int(self, key: str, default: Any = None) -> Any:
        value = self._raw(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InputError(f"{self.source}: {key} must be an integer, got {value!r}")
        return value

    def get_bool(self, key: str, default: bool) -> bool:
        value = self._raw(key, default)
        if not isinstance(value, bool):
            raise InputError(f"{self.source}: {key} must be true or false, got {value!r}")
        return value

    def get_str(self, key: str, default: str) -> str:
        value = self._raw(key, default)
        if not isinstance(value, str):
            raise InputError(f"{self.source}: {key} must be a string, got {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self._raw(key, [])
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise InputError(f"{self.source}: {key} must be a list of integers, got {value!r}")
        return value

    def require(self, keys: tuple[str, ...], model_type: str) -> None:
        missing = [k for k in keys if self.cfg.get(k) is None]
        if missing:
            raise InputError(
                f"{self.source}: model_type '{model_type}' config lacks {', '.join(missing)}"
            )


def _name_from_source(source: str) -> str:
    path = Path(source)
    if path.name == "config.json" and path.parent.name:
        return path.parent.name
    return path.stem or "custom"


def _decoder_fields(c: _Cfg, model_type: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """Fields shared by the rotary decoders (llama family, gemma, phi3, qwen, gpt_neox)."""
    c.require(_GENERIC_KEYS, model_type)
    return {
        "hidden_size": c.get_int("hidden_size"),
        "num_hidden_layers": c.get_int("num_hidden_layers"),
        "num_attention_heads": c.get_int("num_attention_heads"),
        "num_key_value_heads": c.get_int("num_key_value_heads", defaults["kv"]),
        "head_dim": c.get_int("head_dim", defaults["head_dim"]),
        "intermediate_size": c.get_int("intermediate_size"),
        "vocab_size": c.get_int("vocab_size"),
        "max_position_embeddings": c.get_int("max_position_embeddings", defaults["pos"]),
        # Gemma configs carry both; transformers prefers hidden_activation.
        "hidden_act": c.get_str("hidden_activation", c.get_str("hidden_act", defaults["act"])),
        "tie_word_embeddings": c.get_bool("tie_word_embeddings", defaults["tie"]),
        "mlp_kind": "gated",
        "norm_kind": "rmsnorm",
        "position_embedding": "rope",
    }


def _gpt2_fields(c: _Cfg) -> dict[str, Any]:
    """GPT-2: Conv1D projections with biases, LayerNorm with bias, learned positions, tied."""
    c.require(_GPT2_KEYS, "gpt2")
    h = c.get_int("n_embd")
    return {
        "hidden_size": h,
        "num_hidden_layers": c.get_int("n_layer"),
        "num_attention_heads": c.get_int("n_head"),
        "intermediate_size": c.get_int("n_inner", 4 * h),
        "vocab_size": c.get_int("vocab_size"),
        "max_position_embeddings": c.get_int("n_positions", 1024),
        "hidden_act": c.get_str("activation_function", "gelu_new"),
        "tie_word_embeddings": c.get_bool("tie_word_embeddings", True),
        "mlp_kind": "standard",
        "norm_kind": "layernorm",
        "norm_bias": True,
        "attention_bias": True,
        "attention_out_bias": True,
        "mlp_bias": True,
        "position_embedding": "learned",
    }


def _moe_layout(c: _Cfg, num_layers: int, sparse: list[int]) -> dict[str, Any]:
    """ModelSpec fields for the MoE layers `sparse` (indices): first_k_dense_replace when the
    dense layers all come first, else the explicit moe_layers list."""
    if not sparse:
        raise InputError(f"{c.source}: a mixture-of-experts config with no MoE layer")
    first_k = num_layers - len(sparse)
    if sparse == list(range(first_k, num_layers)):
        return {"first_k_dense_replace": first_k}
    return {"moe_layers": tuple(sparse)}


def _qwen_moe_fields(c: _Cfg, model_type: str, num_layers: int, shared: bool) -> dict[str, Any]:
    """Qwen2-MoE / Qwen3-MoE experts. Layer i is sparse when i is not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0 (transformers 5.x modeling_qwen3_moe.py
    `Qwen3MoeDecoderLayer.__init__`)."""
    d = {"qwen2_moe": (60, 4, 1408), "qwen3_moe": (128, 8, 768)}[model_type]
    num_experts = c.get_int("num_experts", d[0])
    if num_experts == 0:
        return {}
    step = c.get_int("decoder_sparse_step", 1)
    if step < 1:
        raise InputError(f"{c.source}: decoder_sparse_step must be >= 1, got {step}")
    dense_only = set(c.int_list("mlp_only_layers"))
    sparse = [i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0]
    fields: dict[str, Any] = {
        "num_local_experts": num_experts,
        "num_experts_per_tok": c.get_int("num_experts_per_tok", d[1]),
        "moe_intermediate_size": c.get_int("moe_intermediate_size", d[2]),
        **_moe_layout(c, num_layers, sparse),
    }
    if shared:
        # Qwen2-MoE: one always-on shared expert plus a h->1 sigmoid gate on it.
        shared_ffn = c.get_int("shared_expert_intermediate_size", 5632)
        if shared_ffn:
            fields.update(
                num_shared_experts=1,
                shared_expert_intermediate_size=shared_ffn,
                shared_expert_gate=True,
            )
    return fields


def _llama4_fields(c: _Cfg, fields: dict[str, Any]) -> dict[str, Any]:
    """Llama-4's text model (transformers 5.x configuration_llama4.py `Llama4TextConfig`,
    modeling_llama4.py): MoE layers are `moe_layers`, else every interleave_moe_layer_step-th
    (range(step − 1, L, step)); a MoE layer has num_local_experts routed experts of
    intermediate_size (fused 3-D gate_up_proj, down_proj), a bias-free router and one
    ungated shared expert of intermediate_size; dense layers' MLP is intermediate_size_mlp
    wide; q, k, v and o take attention_bias; the q/k norm is a weightless L2 norm."""
    n = fields["num_hidden_layers"]
    step = c.get_int("interleave_moe_layer_step", 1)
    if step < 1:
        raise InputError(f"{c.source}: interleave_moe_layer_step must be >= 1, got {step}")
    listed = c.cfg.get("moe_layers")
    sparse = c.int_list("moe_layers") if listed is not None else list(range(step - 1, n, step))
    if any(not 0 <= i < n for i in sparse):
        raise InputError(f"{c.source}: moe_layers must be layer indices below {n}")
    experts = c.get_int("num_local_experts", 16)
    if experts < 1:
        raise InputError(f"{c.source}: num_local_experts must be >= 1, got {experts}")
    ffn = fields["intermediate_size"]
    bias = c.get_bool("attention_bias", False)
    return {
        "intermediate_size": c.get_int("intermediate_size_mlp", 16384),
        "attention_bias": bias, "attention_out_bias": bias,
        "num_local_experts": experts,
        "num_experts_per_tok": c.get_int("num_experts_per_tok", 1),
        "moe_intermediate_size": ffn,
        "num_shared_experts": 1, "shared_expert_intermediate_size": ffn,
        **_moe_layout(c, n, sorted(set(sparse))),
    }


def _four_norms(c: _Cfg, model_type: str) -> dict[str, Any]:
    """Gemma 2/3 have pre- and post-norms around attention and the MLP: 4 norms per layer."""
    if "num_layer_norms" not in ModelSpec.model_fields:
        raise InputError(
            f"{c.source}: model_type '{model_type}' has 4 norms per layer, which vramcalc "
            "cannot count exactly yet"
        )
    return {"num_layer_norms": 4}


def _mla_fields(c: _Cfg, model_type: str, fields: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3: multi-latent attention, and MoE layers after the first
    `first_k_dense_replace` dense ones (modeling_deepseek_v3.py `DeepseekV3DecoderLayer`).
    The shared experts are one MLP of width moe_intermediate_size · n_shared_experts
    (`DeepseekV3MoE`); the router is a h->E weight (its e_score_correction_bias is a buffer,
    not a parameter). The multi-token-prediction layers (num_nextn_predict_layers) are not
    built by transformers and not counted."""
    kr, qr, dn, dr, dv, experts, shared, fe, k, first = _MLA_DEFAULTS[model_type]
    # q_lora_rank: an explicit null means no q compression (DeepSeek-V2-Lite)
    q_rank = None if "q_lora_rank" in c.cfg and c.cfg["q_lora_rank"] is None else (
        c.get_int("q_lora_rank", qr))
    dq = c.get_int("qk_nope_head_dim", dn) + c.get_int("qk_rope_head_dim", dr)
    if model_type == "deepseek_v2" and c.get_bool("mlp_bias", False):
        raise InputError(f"{c.source}: deepseek_v2 with mlp_bias (biases on the dense and "
                         "shared MLPs, none on the experts) cannot be counted exactly yet")
    num_experts = c.get_int("n_routed_experts", experts)
    if num_experts < 1:
        raise InputError(f"{c.source}: n_routed_experts must be >= 1, got {num_experts}")
    c.require(("num_experts_per_tok",) if k is None else (), model_type)
    n_shared = c.get_int("n_shared_experts", shared)
    moe_ffn = c.get_int("moe_intermediate_size", fe)
    bias = c.get_bool("attention_bias", False)
    out = {
        "num_key_value_heads": fields["num_attention_heads"],  # no kv-head grouping in MLA
        "head_dim": dq,
        "q_lora_rank": q_rank,
        "kv_lora_rank": c.get_int("kv_lora_rank", kr),
        "qk_nope_head_dim": c.get_int("qk_nope_head_dim", dn),
        "qk_rope_head_dim": c.get_int("qk_rope_head_dim", dr),
        "v_head_dim": c.get_int("v_head_dim", dv),
        "attention_bias": bias,
        "attention_out_bias": bias,
        "num_local_experts": num_experts,
        "num_experts_per_tok": c.get_int("num_experts_per_tok", k),
        "moe_intermediate_size": moe_ffn,
        "first_k_dense_replace": min(c.get_int("first_k_dense_replace", first),
                                     fields["num_hidden_layers"]),
    }
    if n_shared:
        out.update(num_shared_experts=1, shared_expert_intermediate_size=moe_ffn * n_shared)
    return out


def from_hf_config(cfg: dict[str, Any], source: str) -> ModelSpec:
    """Map a Hugging Face `config.json` dict to a ModelSpec.

    Supported model_type: gpt2, gpt_neox, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3,
    qwen3_moe, llama4 / llama4_text (the language model of a Llama-4 checkpoint), phi3, deepseek_v2, deepseek_v3 (multi-latent attention), gemma (gemma2 / gemma3_text need 4 norms per layer, see `_four_norms`);
    any other model_type is read as a llama-like decoder from the generic keys
    (hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size),
    honouring attention_bias / mlp_bias / tie_word_embeddings when present. Keys a file
    leaves out take transformers' defaults for that type. `auto_map` (remote code),
    rope_scaling, dropout and dtype keys are ignored. Bad input raises InputError.
    """
    if not isinstance(cfg, dict):
        raise InputError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    c = _Cfg(cfg, source)
    model_type = c.get_str("model_type", "")
    name = _name_from_source(source)
    if model_type == "llama4":
        # the multimodal checkpoint: its language model is text_config (the vision encoder
        # and projector are not described; the spec is named "<name>-text" to say so)
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise InputError(f"{source}: model_type 'llama4' config lacks a text_config object")
        c, model_type, name = _Cfg({**text, "model_type": "llama4_text"}, source), (
            "llama4_text"), f"{name}-text"

    fields: dict[str, Any]
    if model_type == "gpt2":
        fields = _gpt2_fields(c)
    else:
        defaults = _DEFAULTS.get(model_type, _GENERIC_DEFAULTS)
        fields = _decoder_fields(c, model_type or "(none)", defaults)
        if model_type in ("llama", "gemma", "qwen3", "qwen3_moe", "gemma2", "gemma3_text"):
            # q, k, v and o all take `bias=config.attention_bias`
            bias = c.get_bool("attention_bias", False)
            fields.update(attention_bias=bias, attention_out_bias=bias)
        if model_type == "llama":
            fields["mlp_bias"] = c.get_bool("mlp_bias", False)
        elif model_type == "qwen2":
            fields["attention_bias"] = True  # q, k, v biases, none on o (modeling_qwen2.py)
        elif model_type == "qwen2_moe":
            fields["attention_bias"] = c.get_bool("qkv_bias", True)
            fields.update(_qwen_moe_fields(c, model_type, fields["num_hidden_layers"], True))
        elif model_type == "qwen3":
            fields["qk_norm"] = True
        elif model_type == "qwen3_moe":
            fields["qk_norm"] = True
            fields.update(_qwen_moe_fields(c, model_type, fields["num_hidden_layers"], False))
        elif model_type == "mixtral":
            fields.update(
                num_local_experts=c.get_int("num_local_experts", 8),
                num_experts_per_tok=c.get_int("num_experts_per_tok", 2),
            )
        elif model_type in _MLA_DEFAULTS:
            fields.update(_mla_fields(c, model_type, fields))
        elif model_type == "llama4_text":
            fields.update(_llama4_fields(c, fields))
        elif model_type == "gpt_neox":
            bias = c.get_bool("attention_bias", True)  # query_key_value and dense
            fields.update(
                mlp_kind="standard",
                mlp_bias=True,
                norm_kind="layernorm",
                norm_bias=True,
                attention_bias=bias,
                attention_out_bias=bias,
            )
        elif model_type == "gemma" and fields["hidden_act"] == "gelu":
            # configuration_gemma.py: legacy "gelu" means the tanh approximation
            fields["hidden_act"] = "gelu_pytorch_tanh"
        elif model_type in ("gemma2", "gemma3_text"):
            fields.update(_four_norms(c, model_type))
            if model_type == "gemma3_text":
                fields["qk_norm"] = True
        elif model_type not in _DEFAULTS:
            experts = [
                k
                for k in ("num_local_experts", "num_experts", "n_routed_experts")
                if c.get_int(k, 0)
            ]
            if experts:
                raise InputError(
                    f"{source}: mixture-of-experts config of unsupported model_type "
                    f"'{model_type}' (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
                )
            bias = c.get_bool("attention_bias", False)
            fields.update(
                attention_bias=bias,
                attention_out_bias=bias,
                mlp_bias=c.get_bool("mlp_bias", False),
            )
    fields.update(name=name, model_type=model_type or "unknown", source=source)
    return spec_from_fields(fields, source)
