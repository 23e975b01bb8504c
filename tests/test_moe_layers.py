"""MoE layers interleaved with dense ones (ModelSpec.moe_layers): Qwen2/3-MoE's
decoder_sparse_step / mlp_only_layers and Llama-4's interleave_moe_layer_step / moe_layers.

Expected values: parameter counts from transformers' own models on the meta device
(`transformers_count`), the published Llama-4 totals (model cards), layer indices from the
rules in transformers' modelling code (cited per test), and the trace engine for the
activation profile (tests/test_trace.py runs the grid rows of the `moe-interleaved` shape).
"""

from __future__ import annotations

import pytest

from tests.test_catalog import QWEN3_30B_A3B, transformers_count
from vramcalc.errors import InputError
from vramcalc.hf_config import from_hf_config
from vramcalc.model import ModelSpec, spec_from_fields
from vramcalc.parallel import ParallelConfig
from vramcalc.sharding import moe_layers_on_stage, pipeline_chunks

# meta-llama/Llama-4-Scout-17B-16E config.json, text_config (the keys that shape parameters)
SCOUT_TEXT = {
    "model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 16,
    "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "vocab_size": 202048,
    "use_qk_norm": True, "attention_bias": False, "tie_word_embeddings": False,
    "max_position_embeddings": 10485760, "hidden_act": "silu",
}  # fmt: skip
# meta-llama/Llama-4-Maverick-17B-128E: 128 experts on every other layer (the text_config
# NVIDIA/TensorRT-LLM's tests copy as LLAMA_4_MAVERICK_TWO_LAYER_CONFIG, with its 48 layers)
MAVERICK_TEXT = {**SCOUT_TEXT, "num_local_experts": 128, "interleave_moe_layer_step": 2,
                 "use_qk_norm": False, "max_position_embeddings": 1048576}


def test_qwen3_moe_every_other_layer_matches_transformers() -> None:
    cfg = {**QWEN3_30B_A3B, "decoder_sparse_step": 2}
    spec = from_hf_config(cfg, "cfg.json")
    # (i + 1) % 2 == 0: layers 1, 3, ..., 47 (modeling_qwen3_moe.py Qwen3MoeDecoderLayer)
    assert spec.moe_layers == tuple(range(1, 48, 2))
    assert spec.num_moe_layers == 24 and spec.num_dense_layers == 24
    assert spec.num_params == transformers_count(cfg)


def test_leading_dense_layers_keep_first_k() -> None:
    spec = from_hf_config({**QWEN3_30B_A3B, "mlp_only_layers": [0, 1, 2]}, "cfg.json")
    assert spec.moe_layers is None and spec.first_k_dense_replace == 3


@pytest.mark.parametrize(("cfg", "moe_layers"), [
    (SCOUT_TEXT, None), (MAVERICK_TEXT, tuple(range(1, 48, 2))),
    ({**SCOUT_TEXT, "moe_layers": [0, 5, 7]}, (0, 5, 7))], ids=["scout", "maverick", "listed"])
def test_llama4_text_matches_transformers(cfg: dict, moe_layers: tuple[int, ...] | None) -> None:
    spec = from_hf_config(cfg, "cfg.json")
    assert spec.moe_layers == moe_layers
    assert spec.num_shared_experts == 1 and not spec.shared_expert_gate
    assert spec.num_params == transformers_count(cfg)


def test_llama4_multimodal_config_reads_its_text_model() -> None:
    cfg = {"model_type": "llama4", "text_config": MAVERICK_TEXT,
           "vision_config": {"model_type": "llama4_vision_model"}}
    spec = from_hf_config(cfg, "Llama-4-Maverick/config.json")
    assert spec.name == "Llama-4-Maverick-text"
    assert spec.num_params == from_hf_config(MAVERICK_TEXT, "x.json").num_params
    with pytest.raises(InputError, match="text_config"):
        from_hf_config({"model_type": "llama4"}, "cfg.json")


@pytest.mark.parametrize(("cfg", "published"), [(SCOUT_TEXT, 109e9), (MAVERICK_TEXT, 400e9)],
                         ids=["scout", "maverick"])
def test_llama4_totals_near_the_model_cards(cfg: dict, published: float) -> None:
    # the model cards' rounded totals (109B, 400B) include the vision encoder, which the
    # text model lacks (well under 2 % of either)
    n = from_hf_config(cfg, "cfg.json").num_params
    assert abs(n - published) < 0.02 * published


def test_llama4_active_params_near_17b() -> None:
    # "17B active parameters" (both model cards): top-1 routed + shared expert per token
    for cfg in (SCOUT_TEXT, MAVERICK_TEXT):
        assert 16.5e9 < from_hf_config(cfg, "cfg.json").num_active_params < 17.5e9


TINY_MOE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                intermediate_size=128, vocab_size=100, num_local_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32)


def test_counts_follow_the_listed_layers() -> None:
    every = ModelSpec(**TINY_MOE)
    half = ModelSpec(**TINY_MOE, moe_layers=(1, 3))
    # two layers swap 4 experts + router for one dense MLP (hand count)
    moe_mlp = 4 * 3 * 64 * 32 + 64 * 4
    dense_mlp = 3 * 64 * 128
    assert every.num_params - half.num_params == 2 * (moe_mlp - dense_mlp)
    assert [half.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def test_pipeline_stages_count_their_moe_layers() -> None:
    # layers 0, 1 on stage 0 and 2, 3 on stage 1; MoE layers (1, 2): one each. With
    # leading dense layers (first_k_dense_replace=2) stage 0 has none and stage 1 two
    par = ParallelConfig(pp=2)
    for spec, want in ((ModelSpec(**TINY_MOE, moe_layers=(1, 2)), (1, 1)),
                       (ModelSpec(**TINY_MOE, first_k_dense_replace=2), (0, 2))):
        chunks = pipeline_chunks(spec, par)
        assert tuple(moe_layers_on_stage(spec, chunks, s) for s in (0, 1)) == want


@pytest.mark.parametrize(("update", "pattern"), [
    ({"moe_layers": (3, 1)}, "increasing"), ({"moe_layers": (1, 4)}, "increasing"),
    ({"moe_layers": (1,), "first_k_dense_replace": 1}, "not both"),
    ({"moe_layers": (1,), "num_local_experts": 0, "num_experts_per_tok": 0}, "num_local_experts")])
def test_bad_moe_layers(update: dict, pattern: str) -> None:
    with pytest.raises(InputError, match=pattern):
        spec_from_fields({**TINY_MOE, **update}, "spec.yaml")


def test_bad_interleave_step() -> None:
    with pytest.raises(InputError, match="interleave_moe_layer_step"):
        from_hf_config({**SCOUT_TEXT, "interleave_moe_layer_step": 0}, "cfg.json")
    with pytest.raises(InputError, match="decoder_sparse_step"):
        from_hf_config({**QWEN3_30B_A3B, "decoder_sparse_step": 0}, "cfg.json")


def test_llama4_under_the_hf_profile_is_refused(tmp_path, capsys) -> None:  # noqa: ANN001
    # transformers' Llama4TextMoe.forward repeats every token for every expert: not the
    # routed-token activations the hf profile models, so the estimate says so (exit 2)
    import json

    from vramcalc.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**SCOUT_TEXT, "num_hidden_layers": 2}))
    assert main(["estimate", "--model", str(cfg), "--framework", "hf"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "every expert on every token" in err[0]
    assert main(["estimate", "--model", str(cfg)]) in (0, 1)  # the reference profile: a fit verdict
