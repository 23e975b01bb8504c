"""torchtune's RoPE buffers (vramcalc/terms/torchtune.py `rope_buffer_bytes`) and multi-query
k, v (vramcalc/terms/saved.py `repeats_kv_by_copy`).

Independent sources: pytorch/torchtune's code (modules/position_embeddings.py
`RotaryPositionalEmbeddings.rope_init` / `build_rope_cache`: theta (d/2) and cache
(max_seq_len, d/2, 2), both fp32, registered as buffers; qwen2/_positional_embeddings.py:
cache (max_seq_len, 2d); modules/transformer.py `_get_clones` deep-copies the layer, each
copy with its own RoPE module, until the builders make every layer around one: llama3_1 from
b0895a79 (#1554, first in v0.3.1), the others from 23896c30 (#2282, first in v0.6.0)), the
bytes counted by hand, and the trace engine, whose torchtune model registers the buffers.
"""

from __future__ import annotations

import pytest

from vramcalc.catalog import resolve_model
from vramcalc.hf_config import from_hf_config
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms.torchtune import rope_buffer_bytes
from vramcalc.training import TrainingConfig
from vramcalc.validate.shapes import scenario_for


def _rope(model: str, version: str | None) -> int:
    spec, _ = resolve_model(model)
    tr = TrainingConfig(framework="torchtune", precision="bf16-pure", seq_len=2048,
                        torchtune_version=version)
    return rope_buffer_bytes(RankContext(spec, tr, Scenario(model=spec).parallel, 0))


@pytest.mark.parametrize(("model", "version", "modules", "cache"), [
    # Llama 3.1 (Llama3ScaledRoPE, max_seq_len 131,072, d 128): per layer before v0.3.1
    ("llama3.1-8b", "0.3.0", 32, 131_072 * 64 * 2 * 4),
    ("llama3.1-8b", "0.3.1", 1, 131_072 * 64 * 2 * 4),
    ("llama3.1-8b", None, 1, 131_072 * 64 * 2 * 4),
    # Llama 3 (max_seq_len 8,192): the llama3 builder shared it from v0.6.0
    ("llama3-8b", "0.5.0", 32, 8_192 * 64 * 2 * 4),
    ("llama3-8b", "0.6.0", 1, 8_192 * 64 * 2 * 4),
    # Qwen2.5-7B: Qwen2's cache holds cos and sin of the doubled angles, (P, 2d)
    ("qwen2.5-7b", "0.5.0", 28, 131_072 * 256 * 4),
])
def test_rope_buffers_by_hand(model: str, version: str | None, modules: int,
                              cache: int) -> None:
    theta = 512  # d/2 fp32 (at most 256 B): one 512-byte block
    if model == "qwen2.5-7b":
        assert resolve_model(model)[0].max_position_embeddings == 131_072
    assert _rope(model, version) == modules * (theta + cache)


def test_llama31_before_its_shared_rope_holds_two_gigabytes() -> None:
    # the module docstring's figure: 32 x 131,072 x 64 x 2 x 4 B = 2.15 GB of caches
    assert _rope("llama3.1-8b", "0.3.0") == 32 * (512 + 67_108_864) == 2_147_500_032


def test_rope_scaling_kind_comes_from_the_config() -> None:
    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}
    assert from_hf_config({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                               "a/config.json").rope_scaling == "llama3"
    assert from_hf_config({**base, "rope_parameters": {"rope_type": "llama3"}},
                               "a/config.json").rope_scaling == "llama3"
    assert from_hf_config({**base, "rope_scaling": {"type": "linear"}},
                               "a/config.json").rope_scaling is None
    assert from_hf_config({**base, "rope_scaling": "llama3"},
                               "a/config.json").rope_scaling is None
    assert from_hf_config(base, "a/config.json").rope_scaling is None


@pytest.mark.parametrize(("shape", "version"), [
    ("gemma-mqa", "0.2.1"), ("gemma-mqa", None), ("phi3-fused", "0.5.0"),
    ("llama-gqa", "0.1.0")])
def test_trace_holds_the_buffers_the_analytic_engine_counts(shape: str,
                                                            version: str | None) -> None:
    from vramcalc.analytic import stage_phases
    from vramcalc.trace.engine import trace

    _, scn = scenario_for(shape, framework="torchtune", precision="bf16-pure",
                          recompute="full", micro_batch_size=1, seq_len=128,
                          torchtune_version=version)
    scn = scn.resolved()
    traced = trace(scn).phases["optimizer"].parts["weights/buffers"]
    phases, _, _ = stage_phases(scn, 0, None)
    analytic = next(p for p in phases if p.name == "optimizer").parts["weights/buffers"]
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    assert traced == analytic == rope_buffer_bytes(ctx) > 0


@pytest.mark.parametrize("precision", ["bf16-pure", "fp32"])
def test_mqa_layer_against_the_trace(precision: str) -> None:
    # one kv head: torchtune's expand + flatten of k and v is a view, SDPA keeps (b, s, 1, d)
    from vramcalc.validate.compare import compare

    name, scn = scenario_for("gemma-mqa", framework="torchtune", precision=precision,
                             recompute="none", micro_batch_size=2, seq_len=256)
    row = compare(name, scn)
    assert all(abs(p["rel_error"]) < 1e-4 for p in row["phases"].values()), row["phases"]


def test_the_report_says_which_release_shares_the_cache(capsys: pytest.CaptureFixture[str]) -> None:
    from vramcalc.cli import main

    flags = ["estimate", "--model", "llama3.1-8b", "--framework", "torchtune", "--precision",
             "bf16-pure", "--gpus", "1xRTX4090", "--finetune", "qlora", "--seq-len", "2048"]
    assert main([*flags, "--torchtune-version", "0.3.0"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # 2,147,500,032 B (test_llama31_before_its_shared_rope_holds_two_gigabytes)
    assert "own copy of the RoPE cache (131,072 positions, fp32): 2.15 GB for 32 layers" in out
    assert "releases from 0.3.1 build one cache" in out
    assert main(flags) == 0
    assert "RoPE cache" not in capsys.readouterr().out
