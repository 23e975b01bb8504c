"""Model catalog: preset parameter counts, alias resolution, Hugging Face config import.

Golden counts come from outside the code (model cards, papers, nanoGPT); the transformers
cross-checks build the real model on the meta device (no memory, no download) and count
`sum(p.numel() for p in model.parameters())`, which counts tied weights once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from vramcalc.catalog import (
    PRESETS_DIR,
    get_preset,
    list_preset_entries,
    list_presets,
    load_preset,
    preset_index,
    resolve_model,
)
from vramcalc.errors import InputError
from vramcalc.hf_config import from_hf_config
from vramcalc.model import ModelSpec

# ---- golden parameter counts ----------------------------------------------------------
GOLDEN = [
    # ../shared/reference/published-figures.md (model cards / config.json)
    ("gpt2", 124_439_808),
    ("gpt2-medium", 354_823_168),
    ("llama2-7b", 6_738_415_616),
    ("llama2-70b", 68_976_648_192),
    ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496),
    ("llama3.1-405b", 405_853_388_800),
    ("mistral-7b", 7_241_732_096),
    # safetensors totals on the Hugging Face model pages:
    ("mixtral-8x7b", 46_702_792_704),  # huggingface.co/mistralai/Mixtral-8x7B-v0.1
    ("qwen2.5-7b", 7_615_616_512),  # huggingface.co/Qwen/Qwen2.5-7B
    ("qwen2.5-72b", 72_706_203_648),  # huggingface.co/Qwen/Qwen2.5-72B
    ("phi3-mini", 3_821_079_552),  # huggingface.co/microsoft/Phi-3-mini-4k-instruct
    ("gemma-2b", 2_506_172_416),  # huggingface.co/google/gemma-2b
]
PYTHIA_160M = 162_322_944  # huggingface.co/EleutherAI/pythia-160m (GPTNeoXForCausalLM numel)
NANOGPT_NO_BIAS = 124_337_664  # karpathy/nanoGPT transformer_sizing.ipynb, bias=False


def preset(name: str) -> ModelSpec:
    return get_preset(name).spec


@pytest.mark.parametrize(("name", "expected"), GOLDEN)
def test_golden_param_counts(name: str, expected: int) -> None:
    assert preset(name).num_params == expected


@pytest.mark.parametrize(("name", "expected"), GOLDEN)
def test_presets_record_the_published_count(name: str, expected: int) -> None:
    assert get_preset(name).meta.num_params_published == expected


def test_every_recorded_published_count_matches() -> None:
    checked = 0
    for entry in list_preset_entries():
        if entry.meta.num_params_published is not None:
            assert entry.spec.num_params == entry.meta.num_params_published, entry.spec.name
            checked += 1
    assert checked >= len(GOLDEN)


def test_gpt3_matches_megatron_formula() -> None:
    # Narayanan et al. 2021 (arXiv:2104.04473) eq. 2:
    # P = 12·L·h²·(1 + 13/(12h) + (V+s)/(12·L·h)) = 12Lh² + 13Lh + h(V+s); it leaves out the
    # final LayerNorm (2h). Brown et al. 2020 print the total rounded as "175.0B".
    spec = preset("gpt3-175b")
    L, h, V, s = 96, 12288, 50257, 2048
    assert spec.num_params == 12 * L * h * h + 13 * L * h + h * (V + s) + 2 * h
    assert spec.num_params == pytest.approx(175.0e9, rel=0.005)


def test_nanogpt_gpt2_without_biases() -> None:
    # nanoGPT bias=False drops every bias, LayerNorm's included; it keeps the tied
    # embedding and the learned positions. A fresh spec, so no cached count is carried over.
    fresh = ModelSpec(**preset("gpt2").model_dump())
    no_bias = fresh.model_copy(
        update={
            "attention_bias": False,
            "attention_out_bias": False,
            "mlp_bias": False,
            "norm_bias": False,
        }
    )
    assert no_bias.num_params == NANOGPT_NO_BIAS


def test_model_copy_recounts_after_counting() -> None:
    spec = ModelSpec(**preset("gpt2").model_dump())
    assert spec.num_params == 124_439_808
    no_bias = spec.model_copy(
        update={
            "attention_bias": False,
            "attention_out_bias": False,
            "mlp_bias": False,
            "norm_bias": False,
        }
    )
    assert no_bias.num_params == NANOGPT_NO_BIAS


# ---- catalog integrity ----------------------------------------------------------------
REQUIRED = [
    "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-175b", "llama2-7b", "llama2-13b",
    "llama2-70b", "llama3-8b", "llama3-70b", "llama3.1-8b", "llama3.1-70b", "llama3.1-405b",
    "mistral-7b", "mixtral-8x7b", "qwen2.5-7b", "qwen2.5-72b", "qwen3-8b", "phi3-mini",
]  # fmt: skip


def test_required_presets_present() -> None:
    names = {s.name for s in list_presets()}
    assert set(REQUIRED) <= names


def test_preset_files_match_names_and_cite_sources() -> None:
    files = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml") if p.name != "_index.yaml")
    assert files == sorted(s.name for s in list_presets())
    for entry in list_preset_entries():
        assert entry.meta.sources, entry.spec.name
        assert all(src.startswith("https://") for src in entry.meta.sources)
        assert entry.spec.source == f"preset {entry.spec.name}"


def test_index_matches_the_presets() -> None:
    """The lookup index (presets/_index.yaml, written by scripts/catalog_index.py) says
    what each preset file says: a name resolves without reading every file."""
    for path in sorted(PRESETS_DIR.glob("*.yaml")):
        if path.name == "_index.yaml":
            continue
        data = yaml.safe_load(path.read_text())
        assert preset_index()[path.stem] == (tuple(data.get("aliases", ())),
                                             data.get("hf_repo")), path.name


def test_resolving_a_name_reads_one_preset() -> None:
    load_preset.cache_clear()
    resolve_model("70b")
    assert load_preset.cache_info().currsize == 1


def test_list_presets_is_cached_and_copied() -> None:
    first = list_presets()
    first.clear()
    assert list_presets() and list_presets()[0] is list_presets()[0]


# ---- alias resolution -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("gpt2", "gpt2"),
        ("GPT2-Small", "gpt2"),
        ("openai-community/gpt2", "gpt2"),
        ("gpt2-medium", "gpt2-medium"),
        ("llama2_7b", "llama2-7b"),
        ("Llama-2-7B", "llama2-7b"),
        ("meta-llama/Llama-2-7b-hf", "llama2-7b"),
        ("meta-llama/Llama-2-7b-chat-hf", "llama2-7b"),
        ("meta-llama/Meta-Llama-3-8B", "llama3-8b"),
        ("meta-llama/Meta-Llama-3-8B-Instruct", "llama3-8b"),
        ("meta-llama/Llama-3.1-405B", "llama3.1-405b"),
        ("llama3_1-70b", "llama3.1-70b"),
        ("mistralai/Mistral-7B-v0.1", "mistral-7b"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
        ("Qwen/Qwen2.5-72B-Instruct", "qwen2.5-72b"),
        ("QWEN2.5-7B", "qwen2.5-7b"),
        ("microsoft/Phi-3-mini-4k-instruct", "phi3-mini"),
        ("google/gemma-2b-it", "gemma-2b"),
        ("gpt3", "gpt3-175b"),
    ],
)
def test_aliases(text: str, name: str) -> None:
    spec, _ = resolve_model(text)
    assert spec.name == name


@pytest.mark.parametrize(
    ("text", "name", "repo"),
    [
        ("7b", "llama2-7b", "Llama-2-7b-hf"),
        ("8b", "llama3-8b", "Meta-Llama-3-8B"),
        ("13b", "llama2-13b", "Llama-2-13b-hf"),
        ("70b", "llama3-70b", "Meta-Llama-3-70B"),
        ("405b", "llama3.1-405b", "Llama-3.1-405B"),
        ("175B", "gpt3-175b", None),
    ],
)
def test_size_aliases_say_which_model(text: str, name: str, repo: str | None) -> None:
    spec, note = resolve_model(text)
    assert spec.name == name
    expected = f"{text} resolved to {name}" + (f" ({repo})" if repo else "")
    assert note == expected


@pytest.mark.parametrize("text", ["llama3-70b", "LLAMA3-70B", "meta-llama/Meta-Llama-3-70B"])
def test_no_note_for_the_canonical_name(text: str) -> None:
    spec, note = resolve_model(text)
    assert spec.name == "llama3-70b" and note is None


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_name_spelling_variants_resolve(data: st.DataObject) -> None:
    spec = data.draw(st.sampled_from(list_presets()))
    chars = []
    for ch in spec.name:
        if ch in "-_.":
            ch = data.draw(st.sampled_from(["-", "_", ".", ""]))
        elif ch.isalpha() and data.draw(st.booleans()):
            ch = ch.upper()
        chars.append(ch)
    assert resolve_model("".join(chars))[0].name == spec.name


# ---- Hugging Face config.json import --------------------------------------------------
# Shaped as the config.json files in the Hugging Face repos named in each comment.
LLAMA2_7B = {  # meta-llama/Llama-2-7b-hf
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.31.0.dev0", "use_cache": True, "vocab_size": 32000,
}  # fmt: skip
MISTRAL_7B = {  # mistralai/Mistral-7B-v0.1
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}  # fmt: skip
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000,
}  # fmt: skip
QWEN25_7B = {  # Qwen/Qwen2.5-7B
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False,
    "use_sliding_window": False, "vocab_size": 152064,
}  # fmt: skip
GPT2 = {  # openai-community/gpt2
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256,
    "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2",
    "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
    "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}  # fmt: skip
PYTHIA_160M_CFG = {  # EleutherAI/pythia-160m
    "architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0,
    "hidden_act": "gelu", "hidden_size": 768, "initializer_range": 0.02,
    "intermediate_size": 3072, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
    "model_type": "gpt_neox", "num_attention_heads": 12, "num_hidden_layers": 12,
    "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.24.0", "use_cache": True,
    "use_parallel_residual": True, "vocab_size": 50304,
}  # fmt: skip
PHI3_MINI = {  # microsoft/Phi-3-mini-4k-instruct (auto_map must be ignored)
    "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                 "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
    "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
    "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.2", "use_cache": True, "vocab_size": 32064,
}  # fmt: skip
GEMMA_2B = {  # google/gemma-2b (no tie_word_embeddings key: Gemma ties by default)
    "architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 2, "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 16384,
    "max_position_embeddings": 8192, "model_type": "gemma", "num_attention_heads": 8,
    "num_hidden_layers": 18, "num_key_value_heads": 1, "pad_token_id": 0,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "transformers_version": "4.38.0.dev0", "use_cache": True,
    "vocab_size": 256000,
}  # fmt: skip
QWEN15_MOE = {  # Qwen/Qwen1.5-MoE-A2.7B
    "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5632,
    "max_position_embeddings": 8192, "model_type": "qwen2_moe",
    "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "shared_expert_intermediate_size": 5632, "tie_word_embeddings": False,
    "vocab_size": 151936,
}  # fmt: skip
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "vocab_size": 151936,
}  # fmt: skip
QWEN3_8B = {  # Qwen/Qwen3-8B
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "model_type": "qwen3", "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "tie_word_embeddings": False, "vocab_size": 151936,
}  # fmt: skip
GEMMA2_9B = {  # google/gemma-2-9b
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_size": 3584, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16,
    "num_hidden_layers": 42, "num_key_value_heads": 8, "query_pre_attn_scalar": 256,
    "vocab_size": 256000,
}  # fmt: skip

# deepseek-ai/DeepSeek-V3 config.json (the keys that shape parameters; multi-latent
# attention, 3 dense then 58 MoE layers)
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "vocab_size": 129280, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840, "tie_word_embeddings": False,
    "architectures": ["DeepseekV3ForCausalLM"],
}  # fmt: skip

# deepseek-ai/DeepSeek-V2-Lite config.json: no q compression (q_lora_rank null)
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "vocab_size": 102400, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
}  # fmt: skip

# (config, repo directory name, published count or None, preset with the same shapes or None)
HF_CASES = [
    (LLAMA2_7B, "Llama-2-7b-hf", 6_738_415_616, "llama2-7b"),
    (MISTRAL_7B, "Mistral-7B-v0.1", 7_241_732_096, "mistral-7b"),
    (MIXTRAL_8X7B, "Mixtral-8x7B-v0.1", 46_702_792_704, "mixtral-8x7b"),
    (QWEN25_7B, "Qwen2.5-7B", 7_615_616_512, "qwen2.5-7b"),
    (GPT2, "gpt2", 124_439_808, "gpt2"),
    (PYTHIA_160M_CFG, "pythia-160m", PYTHIA_160M, None),
    (PHI3_MINI, "Phi-3-mini-4k-instruct", 3_821_079_552, "phi3-mini"),
    (GEMMA_2B, "gemma-2b", 2_506_172_416, "gemma-2b"),
    (QWEN3_8B, "Qwen3-8B", None, "qwen3-8b"),
    (QWEN15_MOE, "Qwen1.5-MoE-A2.7B", None, None),
    (QWEN3_30B_A3B, "Qwen3-30B-A3B", None, None),
    (DEEPSEEK_V3, "DeepSeek-V3", None, "deepseek-v3"),
    (DEEPSEEK_V2_LITE, "DeepSeek-V2-Lite", None, None),
]
HF_IDS = [case[1] for case in HF_CASES]


def write_config(tmp_path: Path, dirname: str, cfg: dict[str, Any]) -> Path:
    folder = tmp_path / dirname
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


@pytest.mark.parametrize(("cfg", "dirname", "published", "preset_name"), HF_CASES, ids=HF_IDS)
def test_hf_config_import(
    tmp_path: Path, cfg: dict, dirname: str, published: int | None, preset_name: str | None
) -> None:
    folder = write_config(tmp_path, dirname, cfg)
    from_dir, note = resolve_model(str(folder))
    from_file, _ = resolve_model(str(folder / "config.json"))
    assert note is None
    assert from_dir == from_file
    assert from_dir.name == dirname and from_dir.source == str(folder / "config.json")
    if published is not None:
        assert from_dir.num_params == published
    if preset_name is not None:
        built_in = preset(preset_name)
        assert from_dir.num_params == built_in.num_params
        assert from_dir.num_active_params == built_in.num_active_params
        same = ("hidden_size", "num_hidden_layers", "kv_heads", "head_size", "vocab_size",
                "tie_word_embeddings", "mlp_kind", "norm_kind", "position_embedding",
                "max_position_embeddings")  # fmt: skip
        for attr in same:
            assert getattr(from_dir, attr) == getattr(built_in, attr), attr


def test_hf_config_mapping_details() -> None:
    qwen = from_hf_config(QWEN25_7B, "cfg.json")
    assert qwen.attention_bias and not qwen.attention_out_bias
    neox = from_hf_config(PYTHIA_160M_CFG, "cfg.json")
    assert (neox.attention_bias, neox.attention_out_bias, neox.mlp_bias) == (True, True, True)
    assert neox.norm_kind == "layernorm" and neox.norm_bias and not neox.tie_word_embeddings
    gemma = from_hf_config(GEMMA_2B, "cfg.json")
    assert gemma.tie_word_embeddings and gemma.head_size == 256 and not gemma.norm_bias
    gpt2 = from_hf_config(GPT2, "cfg.json")
    assert gpt2.intermediate_size == 4 * 768 and gpt2.position_embedding == "learned"
    moe = from_hf_config(QWEN15_MOE, "cfg.json")
    assert (moe.num_shared_experts, moe.shared_expert_gate, moe.router_bias) == (1, True, False)
    assert moe.num_moe_layers == 24


def test_qwen_moe_leading_dense_layers() -> None:
    cfg = {**QWEN3_30B_A3B, "mlp_only_layers": [0, 1]}
    spec = from_hf_config(cfg, "cfg.json")
    assert spec.first_k_dense_replace == 2 and spec.num_moe_layers == 46


@pytest.mark.parametrize(
    ("update", "moe_layers"),
    [({"decoder_sparse_step": 2}, tuple(range(1, 24, 2))),
     ({"mlp_only_layers": [5]}, tuple(i for i in range(24) if i != 5))],
    ids=["step", "middle"],
)
def test_qwen_moe_interleaved_layers(update: dict, moe_layers: tuple[int, ...]) -> None:
    # transformers modeling_qwen2_moe.py: layer i is sparse when i is not in mlp_only_layers
    # and (i + 1) % decoder_sparse_step == 0
    spec = from_hf_config({**QWEN15_MOE, **update}, "cfg.json")
    assert spec.moe_layers == moe_layers and spec.first_k_dense_replace == 0
    assert spec.num_moe_layers == len(moe_layers)
    assert spec.num_params == transformers_count({**QWEN15_MOE, **update})


def test_unknown_model_type_uses_generic_keys() -> None:
    cfg = {k: v for k, v in LLAMA2_7B.items() if k != "model_type"} | {"model_type": "my_llama"}
    spec = from_hf_config(cfg, "x/config.json")
    assert spec.num_params == 6_738_415_616 and spec.model_type == "my_llama"


def test_unknown_model_type_moe_rejected() -> None:
    cfg = {**LLAMA2_7B, "model_type": "new_moe", "n_routed_experts": 64}
    with pytest.raises(InputError, match="mixture-of-experts"):
        from_hf_config(cfg, "x/config.json")


def test_gemma2_four_norms() -> None:
    if "num_layer_norms" in ModelSpec.model_fields:
        # 9,241,705,984: google/gemma-2-9b safetensors total (also the meta-device count below)
        assert from_hf_config(GEMMA2_9B, "cfg.json").num_params == 9_241_705_984
    else:
        with pytest.raises(InputError, match="4 norms per layer"):
            from_hf_config(GEMMA2_9B, "cfg.json")


# ---- transformers cross-check (meta device) -------------------------------------------
def transformers_count(cfg: dict[str, Any]) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    clean = {k: v for k, v in cfg.items() if k not in ("auto_map", "architectures")}
    config = transformers.AutoConfig.for_model(**clean)
    arch = (cfg.get("architectures") or [""])[0]  # encoders: the head their config names
    auto = (transformers.AutoModelForSequenceClassification
            if arch.endswith("ForSequenceClassification") else transformers.AutoModelForMaskedLM
            if arch.endswith("ForMaskedLM") else transformers.AutoModelForSeq2SeqLM
            if arch.endswith("ForConditionalGeneration") else transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        model = auto.from_config(config)
    return sum(p.numel() for p in model.parameters())


def preset_as_hf_config(spec: ModelSpec) -> dict[str, Any]:
    """A preset written as the config.json transformers would read for its model_type."""
    if spec.model_type == "t5":  # configuration_t5.py key names
        return {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
                "d_model": spec.hidden_size, "d_kv": spec.head_size, "d_ff": spec.intermediate_size,
                "num_layers": spec.num_hidden_layers, "num_heads": spec.num_attention_heads,
                "num_decoder_layers": spec.num_decoder_layers, "vocab_size": spec.vocab_size}
    if spec.model_type == "bart":  # configuration_bart.py key names
        return {"model_type": "bart", "architectures": ["BartForConditionalGeneration"],
                "d_model": spec.hidden_size, "encoder_layers": spec.num_hidden_layers,
                "decoder_layers": spec.num_decoder_layers, "vocab_size": spec.vocab_size,
                "encoder_attention_heads": spec.num_attention_heads,
                "decoder_attention_heads": spec.num_attention_heads,
                "encoder_ffn_dim": spec.intermediate_size,
                "decoder_ffn_dim": spec.intermediate_size,
                "max_position_embeddings": spec.max_position_embeddings}
    if spec.model_type == "gpt2":
        return {
            "model_type": "gpt2", "n_embd": spec.hidden_size, "n_layer": spec.num_hidden_layers,
            "n_head": spec.num_attention_heads, "n_inner": spec.intermediate_size,
            "vocab_size": spec.vocab_size, "n_positions": spec.max_position_embeddings,
            "tie_word_embeddings": spec.tie_word_embeddings,
        }  # fmt: skip
    cfg = {
        "model_type": spec.model_type, "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_size, "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size, "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
    }  # fmt: skip
    if spec.is_mla:  # DeepSeek-V3: the shared MLP is moe_intermediate_size · n_shared_experts
        cfg |= {
            "q_lora_rank": spec.q_lora_rank, "kv_lora_rank": spec.kv_lora_rank,
            "qk_nope_head_dim": spec.qk_nope_head_dim,
            "qk_rope_head_dim": spec.qk_rope_head_dim, "v_head_dim": spec.v_head_dim,
            "n_routed_experts": spec.num_local_experts,
            "num_experts_per_tok": spec.num_experts_per_tok,
            "moe_intermediate_size": spec.expert_ffn,
            "n_shared_experts": spec.shared_ffn // spec.expert_ffn,
            "first_k_dense_replace": spec.first_k_dense_replace,
        }  # fmt: skip
    if spec.model_type == "qwen3_moe":
        cfg |= {
            "num_experts": spec.num_local_experts, "moe_intermediate_size": spec.expert_ffn,
            "num_experts_per_tok": spec.num_experts_per_tok, "mlp_only_layers": [],
        }  # fmt: skip
    if spec.model_type == "mixtral":
        cfg |= {
            "num_local_experts": spec.num_local_experts,
            "num_experts_per_tok": spec.num_experts_per_tok,
        }
    if spec.is_encoder:  # BERT / RoBERTa: token types, and the head the preset names
        head = {"sequence_classification": "ForSequenceClassification",
                "masked_lm": "ForMaskedLM"}[spec.task]
        cfg |= {"type_vocab_size": spec.type_vocab_size, "num_labels": spec.num_labels,
                "architectures": [spec.model_type.capitalize() + head]}
        for key in ("num_key_value_heads", "head_dim"):
            cfg.pop(key)
    return cfg


@pytest.mark.parametrize(("cfg", "dirname", "published", "preset_name"), HF_CASES, ids=HF_IDS)
def test_hf_import_matches_transformers(
    cfg: dict, dirname: str, published: int | None, preset_name: str | None
) -> None:
    assert from_hf_config(cfg, "config.json").num_params == transformers_count(cfg)


@pytest.mark.parametrize("name", [s.name for s in list_presets()])
def test_preset_matches_transformers(name: str) -> None:
    spec = preset(name)
    cfg = preset_as_hf_config(spec)
    assert spec.num_params == transformers_count(cfg)
    assert from_hf_config(cfg, "config.json").num_params == spec.num_params


def test_gemma2_count_from_transformers() -> None:
    # The figure test_gemma2_four_norms expects once ModelSpec counts 4 norms per layer.
    assert transformers_count(GEMMA2_9B) == 9_241_705_984


# ---- errors ---------------------------------------------------------------------------
def test_missing_keys_are_named() -> None:
    cfg = {k: v for k, v in LLAMA2_7B.items() if k not in ("hidden_size", "vocab_size")}
    with pytest.raises(InputError, match="lacks hidden_size, vocab_size"):
        from_hf_config(cfg, "cfg.json")
    with pytest.raises(InputError, match="lacks n_embd"):
        from_hf_config({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "vocab_size": 9}, "x")


@pytest.mark.parametrize(
    ("update", "pattern"),
    [
        ({"hidden_size": "4096"}, "hidden_size must be an integer"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
        ({"num_key_value_heads": 5}, "not divisible by num_key_value_heads"),
        ({"hidden_size": -1}, "hidden_size"),
    ],
)
def test_bad_values_are_input_errors(update: dict, pattern: str) -> None:
    with pytest.raises(InputError, match=pattern) as info:
        from_hf_config({**LLAMA2_7B, **update}, "cfg.json")
    assert "\n" not in str(info.value)


def test_malformed_json(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"model_type": "llama", "hidden_size": 4096,,}')
    with pytest.raises(InputError, match=r"broken\.json: malformed JSON: .* line 1") as info:
        resolve_model(str(path))
    assert "\n" not in str(info.value)


def test_json_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(InputError, match="expected a JSON object"):
        resolve_model(str(path))


def test_malformed_yaml(tmp_path: Path) -> None:
    path = tmp_path / "model.yaml"
    path.write_text("hidden_size: [1, 2\nnum_hidden_layers: 3\n")
    with pytest.raises(InputError, match=r"model\.yaml: malformed YAML") as info:
        resolve_model(str(path))
    assert "\n" not in str(info.value)


def test_yaml_spec_file(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yml"
    path.write_text(
        "hidden_size: 64\nnum_hidden_layers: 2\nnum_attention_heads: 4\n"
        "intermediate_size: 128\nvocab_size: 100\naliases: [t]\n"
    )
    spec, note = resolve_model(str(path))
    assert (spec.name, spec.source, note) == ("tiny", str(path), None)
    # 2 layers x (4·64² attention + 3·64·128 MLP + 2·64 norms) + 2·100·64 + 64 final norm
    assert spec.num_params == 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 2 * 100 * 64 + 64


def test_yaml_unknown_field_suggests(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text(
        "hidden_size: 64\nnum_hidden_layer: 2\nnum_attention_heads: 4\n"
        "intermediate_size: 128\nvocab_size: 100\n"
    )
    with pytest.raises(InputError, match="unknown field 'num_hidden_layer'.*num_hidden_layers"):
        resolve_model(str(path))


def test_unknown_preset_suggests() -> None:
    with pytest.raises(InputError) as info:
        resolve_model("llama3-7b")
    msg = str(info.value)
    assert msg.startswith("unknown model 'llama3-7b'; did you mean: ")
    assert "llama3-8b" in msg and msg.endswith("(or pass a path to a Hugging Face config.json)")


def test_unknown_hf_repo_id_is_not_a_path_error() -> None:
    with pytest.raises(InputError, match="unknown model 'acme/SuperModel-9B'"):
        resolve_model("acme/SuperModel-9B")


@pytest.mark.parametrize("text", ["missing/config.json", "./nope", "models/x/y", "no.yaml"])
def test_nonexistent_path(tmp_path: Path, text: str) -> None:
    with pytest.raises(InputError, match="no such file: "):
        resolve_model(str(tmp_path / text) if text.startswith("missing") else text)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no config.json in directory"):
        resolve_model(str(tmp_path))


def test_empty_name() -> None:
    with pytest.raises(InputError, match="empty"):
        resolve_model("  ")


# ---- purity ---------------------------------------------------------------------------
def test_catalog_does_not_import_torch_or_transformers() -> None:
    code = (
        "import sys; from vramcalc.catalog import resolve_model, list_presets;"
        "list_presets(); resolve_model('70b');"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
