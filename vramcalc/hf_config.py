"""Hugging Face `config.json` -> ModelSpec, with the defaults transformers gives keys a file
leaves out (transformers 5.x `configuration_*.py`). Pure: takes the parsed dict; reading the
file is vramcalc.catalog's job. Never the hub, never `trust_remote_code`.
"""

from __future__ import annotations

from typing import Any

from vramcalc.errors import InputError
from vramcalc.hf_modernbert import MODERNBERT_TYPES, modernbert_fields
from vramcalc.hf_reader import Cfg as _Cfg
from vramcalc.hf_reader import name_from_source as _name_from_source
from vramcalc.hf_seq2seq import SEQ2SEQ_TYPES, seq2seq_fields
from vramcalc.model import ModelSpec, spec_from_fields

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
    "gemma3_text": {"kv": 4, "head_dim": 256, "tie": True, "act": "gelu_pytorch_tanh",
                    "pos": 131072},
    "gpt_neox": {"kv": None, "head_dim": None, "tie": False, "act": "gelu", "pos": 2048},
    "phi": {"kv": None, "head_dim": None, "tie": False, "act": "gelu_new", "pos": 2048},
    "deepseek_v2": {"kv": None, "head_dim": None, "tie": False, "act": "silu", "pos": 2048},
    "deepseek_v3": {"kv": 128, "head_dim": None, "tie": False, "act": "silu", "pos": 4096},
    "llama4_text": {"kv": 8, "head_dim": 128, "tie": False, "act": "silu", "pos": 131072},
    "nemotron": {"kv": None, "head_dim": None, "tie": False, "act": "relu2", "pos": 4096},
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
# Encoders (configuration_bert.py, configuration_roberta.py @ transformers 5.24): vocab,
# max positions, token types; hidden_act "gelu", dropout 0.1, tied MLM decoder by default.
_ENCODER_DEFAULTS: dict[str, tuple[int, int, int]] = {
    "bert": (30522, 512, 2),
    "roberta": (50265, 512, 2),
    "xlm-roberta": (30522, 512, 2),  # configuration_xlm_roberta.py (RoBERTa's code)
    "camembert": (30522, 512, 2),  # configuration_camembert.py (RoBERTa's code)
}
# RoBERTa's modeling code: positions from the token ids, starting at padding_idx + 1 = 2
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")
# architectures[0] suffix -> the head (`task`); anything else takes a classification head
_ENCODER_TASKS = {"ForSequenceClassification": "sequence_classification",
                  "ForMaskedLM": "masked_lm"}
# encoder-only and encoder-decoder types not modelled yet (`_refuse_other_encoders`)
_OTHER_ENCODERS = ("distilbert", "albert", "electra", "deberta", "deberta-v2",
                   "mpnet", "longformer", "umt5",
                   "mbart", "pegasus", "marian", "led", "xlm", "flaubert", "funnel",
                   "roformer", "squeezebert", "nomic_bert", "jina_bert", "ernie", "megatron-bert")
SUPPORTED_MODEL_TYPES = ("gpt2", *_DEFAULTS, *_ENCODER_DEFAULTS, *MODERNBERT_TYPES,
                         *SEQ2SEQ_TYPES)


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
        "rope_scaling": "llama3" if c.rope_type() == "llama3" else None,
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


def encoder_task(cfg: dict[str, Any]) -> str:
    """The head an encoder config's `architectures` names (BertForMaskedLM -> masked_lm);
    sequence_classification when it names neither head (BertModel, BertForPreTraining, none)."""
    archs = cfg.get("architectures")
    first = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    return next((t for suffix, t in _ENCODER_TASKS.items() if first.endswith(suffix)),
                "sequence_classification")


def _refuse_other_encoders(c: _Cfg, model_type: str) -> None:
    """Encoder-only and encoder-decoder configs other than BERT / RoBERTa would otherwise be
    read as llama-like decoders (many carry hidden_size, num_hidden_layers, ...): refused.
    Recognised by `is_encoder_decoder`, the type, or (for types vramcalc does not know) an
    encoder's head in `architectures` (decoders with a classification head keep theirs)."""
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    archs = c.cfg.get("architectures")
    first = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    heads = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
             "ForQuestionAnswering", "ForMultipleChoice")
    if (c.cfg.get("is_encoder_decoder") is True or first.endswith(heads)
            or model_type in _OTHER_ENCODERS):
        raise InputError(
            f"{c.source}: model_type '{model_type}' is an encoder or encoder-decoder model "
            f"vramcalc does not model yet (encoders: "
            f"{', '.join((*_ENCODER_DEFAULTS, *MODERNBERT_TYPES))}; "
            f"encoder-decoders: {', '.join(SEQ2SEQ_TYPES)})")


def with_task(spec: ModelSpec, task: str) -> ModelSpec:
    """The encoder `spec` with the head `task` (sequence-classification | masked-lm, the
    --task option). A masked-LM head ties its decoder to the word embedding, as BERT's and
    RoBERTa's configs do (tie_word_embeddings: false needs a model YAML)."""
    if not spec.is_encoder:
        kind = "an encoder-decoder" if spec.is_encoder_decoder else "a decoder (causal LM)"
        raise InputError(f"--task {task}: {spec.name} is {kind}; --task picks "
                         "an encoder's head (bert, roberta, modernbert)")
    name = task.replace("-", "_")
    return spec.model_copy(update={"task": name,
                                   "tie_word_embeddings": name == "masked_lm"})


def _encoder_fields(c: _Cfg, model_type: str) -> dict[str, Any]:
    """BERT / RoBERTa (modeling_bert.py, modeling_roberta.py): q, k, v, o and both MLP
    matrices with biases, post-LayerNorm with bias, absolute learned positions, token types.
    The head comes from `architectures` (`encoder_task`); num_labels from id2label, else
    num_labels (2)."""
    vocab, pos, types = _ENCODER_DEFAULTS[model_type]
    keys = tuple(k for k in _GENERIC_KEYS if k != "vocab_size")
    c.require(keys, model_type)
    if c.get_str("position_embedding_type", "absolute") != "absolute":
        raise InputError(f"{c.source}: only absolute position embeddings are modelled "
                         f"(position_embedding_type={c.cfg['position_embedding_type']!r})")
    if c.get_bool("is_decoder", False) or c.get_bool("add_cross_attention", False):
        raise InputError(f"{c.source}: {model_type} as a decoder (is_decoder, "
                         "add_cross_attention) is not modelled; encoders only")
    labels = c.cfg.get("id2label")
    dropout = {}
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        value = c._raw(key, 0.1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise InputError(f"{c.source}: {key} must be a number in [0, 1), got {value!r}")
        dropout[key] = float(value)
    if c.cfg.get("classifier_dropout") not in (None, dropout["hidden_dropout_prob"]):
        raise InputError(f"{c.source}: a classifier_dropout other than hidden_dropout_prob "
                         "is not modelled")
    return {
        "architecture": "encoder",
        "task": encoder_task(c.cfg),
        "num_labels": len(labels) if isinstance(labels, dict) and labels else c.get_int(
            "num_labels", 2),
        "hidden_size": c.get_int("hidden_size"),
        "num_hidden_layers": c.get_int("num_hidden_layers"),
        "num_attention_heads": c.get_int("num_attention_heads"),
        "intermediate_size": c.get_int("intermediate_size"),
        "vocab_size": c.get_int("vocab_size", vocab),
        "max_position_embeddings": c.get_int("max_position_embeddings", pos),
        "type_vocab_size": c.get_int("type_vocab_size", types),
        "hidden_act": c.get_str("hidden_act", "gelu"),
        "tie_word_embeddings": c.get_bool("tie_word_embeddings", True),
        "mlp_kind": "standard", "norm_kind": "layernorm", "norm_bias": True,
        "attention_bias": True, "attention_out_bias": True, "mlp_bias": True,
        "position_embedding": "learned", "final_norm": False, **dropout,
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


def _sliding_fields(c: _Cfg, model_type: str) -> dict[str, Any]:
    """Sliding-window attention: Mistral applies `sliding_window` to every layer (null: none;
    transformers MistralConfig default 4096); Gemma 2 alternates local and global layers
    (Gemma2Config: window 4096, layer i local when (i + 1) % 2); Gemma 3 has five local
    layers per global one (Gemma3TextConfig: window 4096, `sliding_window_pattern` 6). An
    explicit `layer_types` list must follow one of these patterns."""
    default_window, default_pattern = {"mistral": (4096, 0), "gemma2": (4096, 2),
                                       "gemma3_text": (4096, 6)}[model_type]
    if "sliding_window" in c.cfg and c.cfg["sliding_window"] is None:
        return {}
    window = c.get_int("sliding_window", default_window)
    pattern = c.get_int("sliding_window_pattern", default_pattern)
    types = c.cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not types or not all(
                t in ("sliding_attention", "full_attention") for t in types):
            raise InputError(f"{c.source}: layer_types must be a list of 'sliding_attention' "
                             "and 'full_attention'")
        local = [t == "sliding_attention" for t in types]
        candidates = [0] if all(local) else list(range(2, len(local) + 2))
        match = [n for n in candidates
                 if local == [n == 0 or (i + 1) % n != 0 for i in range(len(local))]]
        if not any(local):
            return {}
        if not match:
            raise InputError(f"{c.source}: layer_types mixes local and global layers in a "
                             "pattern vramcalc cannot represent (one global layer every N)")
        pattern = match[0]
    return {"sliding_window": window, "sliding_window_pattern": pattern}


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

    Supported model_type: bert, roberta, xlm-roberta, camembert (encoders,
    `_encoder_fields`), modernbert (vramcalc/hf_modernbert.py), t5, bart (encoder-decoders, vramcalc/hf_seq2seq.py), gpt2, gpt_neox, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3,
    qwen3_moe, llama4 / llama4_text (the language model of a Llama-4 checkpoint), phi (phi-1,
    phi-1.5, phi-2), phi3, deepseek_v2, deepseek_v3 (multi-latent attention), gemma (gemma2 / gemma3_text need 4 norms per layer, see `_four_norms`);
    any other model_type is read as a llama-like decoder from the generic keys
    (hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size),
    honouring attention_bias / mlp_bias / tie_word_embeddings when present. Keys a file
    leaves out take transformers' defaults for that type. `auto_map` (remote code) and dtype
    keys are ignored, and dropout keys too except an encoder's; of rope_scaling only its kind
    is read (Llama 3.1's "llama3": torchtune builds its own RoPE for it).
    Bad input raises InputError.
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
    if model_type in SEQ2SEQ_TYPES:  # T5, BART: vramcalc/hf_seq2seq.py
        fields = seq2seq_fields(c, model_type)
        fields.update(name=name, model_type=model_type, source=source)
        return spec_from_fields(fields, source)
    _refuse_other_encoders(c, model_type)
    if model_type == "gpt2":
        fields = _gpt2_fields(c)
    elif model_type in _ENCODER_DEFAULTS:
        fields = _encoder_fields(c, model_type)
    elif model_type in MODERNBERT_TYPES:  # vramcalc/hf_modernbert.py
        fields = {**modernbert_fields(c), "task": encoder_task(c.cfg)}
    else:
        defaults = _DEFAULTS.get(model_type, _GENERIC_DEFAULTS)
        fields = _decoder_fields(c, model_type or "(none)", defaults)
        if model_type in ("llama", "gemma", "qwen3", "qwen3_moe", "gemma2", "gemma3_text",
                          "nemotron"):
            # q, k, v and o all take `bias=config.attention_bias`
            bias = c.get_bool("attention_bias", False)
            fields.update(attention_bias=bias, attention_out_bias=bias)
        if model_type in ("llama", "nemotron"):
            fields["mlp_bias"] = c.get_bool("mlp_bias", False)
        if model_type == "nemotron":
            # modeling_nemotron.py: NemotronMLP is up_proj, act, down_proj (no gate);
            # NemotronLayerNorm1P a LayerNorm with a bias (weight + 1 at run time); the
            # partial rotary embedding holds no parameters
            fields.update(mlp_kind="standard", norm_kind="layernorm", norm_bias=True)
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
        elif model_type == "mistral":
            fields.update(_sliding_fields(c, model_type))
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
                # GPTNeoXLayer: x + attn(ln1(x)) + mlp(ln2(x)) when use_parallel_residual
                parallel_residual=c.get_bool("use_parallel_residual", True),
            )
        elif model_type == "phi":
            # modeling_phi.py PhiDecoderLayer: one input_layernorm feeds attention and the
            # MLP, added to the residual together; biases on q, k, v, dense, fc1, fc2, the
            # LayerNorms and lm_head; partial rotary embeddings keep the parameter count
            if c.get_bool("qk_layernorm", False):
                raise InputError(f"{source}: phi with qk_layernorm is not modelled")
            fields.update(mlp_kind="standard", mlp_bias=True, norm_kind="layernorm",
                          norm_bias=True, attention_bias=True, attention_out_bias=True,
                          num_layer_norms=1, parallel_residual=True, lm_head_bias=True)
        elif model_type == "gemma" and fields["hidden_act"] == "gelu":
            # configuration_gemma.py: legacy "gelu" means the tanh approximation
            fields["hidden_act"] = "gelu_pytorch_tanh"
        elif model_type in ("gemma2", "gemma3_text"):
            fields.update(_four_norms(c, model_type))
            fields.update(_sliding_fields(c, model_type))
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
