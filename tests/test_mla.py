"""Multi-latent attention (DeepSeek-V2/V3): exact parameter counts and per-rank TP shapes.

Expected counts come from transformers itself: the model is built from the config on the
meta device and `sum(p.numel() for p in model.parameters())` is counted
(tests/test_catalog.py `transformers_count`). TP shapes are derived by hand from
Megatron-LM's MLASelfAttention (megatron/core/transformer/multi_latent_attention.py
@ d98e8a64: linear_q_down_proj / linear_kv_down_proj are TELinear(parallel_mode=
"duplicated"), linear_q_up_proj / linear_kv_up_proj column-parallel, linear_proj
row-parallel).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# the two config.json files (cited there) and transformers' meta-device numel count
from test_catalog import DEEPSEEK_V2_LITE, DEEPSEEK_V3, transformers_count

from vramcalc.analytic import estimate
from vramcalc.cli import main
from vramcalc.errors import InputError
from vramcalc.hf_config import from_hf_config
from vramcalc.model import ModelSpec, spec_from_fields
from vramcalc.model_tensors import param_tensors
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.report import ALLOCATED_TERMS
from vramcalc.scenario import Scenario
from vramcalc.sharding import rank_tensors
from vramcalc.terms import activations as act
from vramcalc.training import TrainingConfig

# A small DeepSeek-V3: 4 layers, the first dense, 8 routed experts, 2 shared experts.
SMALL_V3: dict[str, Any] = {
    "model_type": "deepseek_v3", "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 512,
    "moe_intermediate_size": 64, "vocab_size": 1000, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_shared_experts": 2, "first_k_dense_replace": 1,
    "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
    "v_head_dim": 24, "n_group": 2, "topk_group": 1,
}  # fmt: skip

SMALL_CASES = {
    "v3_small": SMALL_V3,
    "v3_no_q_lora": {**SMALL_V3, "q_lora_rank": None},
    "v3_attention_bias_all_moe": {**SMALL_V3, "attention_bias": True, "first_k_dense_replace": 0},
    "v3_all_dense": {**SMALL_V3, "first_k_dense_replace": 4},
    "v3_no_shared": {**SMALL_V3, "n_shared_experts": 0},
    "v2_small": {**SMALL_V3, "model_type": "deepseek_v2", "first_k_dense_replace": 2},
}


@pytest.mark.parametrize("cfg", SMALL_CASES.values(), ids=SMALL_CASES.keys())
def test_small_mla_counts_match_transformers(cfg: dict[str, Any]) -> None:
    assert from_hf_config(cfg, "config.json").num_params == transformers_count(cfg)


def test_deepseek_v3_count() -> None:
    # 671B: the DeepSeek-V3 model card's main-model figure (the 685B on the hub adds the
    # 14B multi-token-prediction module, which transformers does not build)
    expected = transformers_count(DEEPSEEK_V3)
    assert 670.5e9 < expected < 671.5e9
    spec = from_hf_config(DEEPSEEK_V3, "deepseek-v3/config.json")
    assert spec.num_params == expected
    assert spec.is_mla and spec.q_lora_rank == 1536 and spec.num_moe_layers == 58


def test_deepseek_v2_lite_count() -> None:
    # 15.7B total: the DeepSeek-V2-Lite model card
    expected = transformers_count(DEEPSEEK_V2_LITE)
    assert round(expected / 1e8) == 157
    spec = from_hf_config(DEEPSEEK_V2_LITE, "config.json")
    assert spec.q_lora_rank is None  # an explicit null is not the 1536 default
    assert spec.num_params == expected


def test_mla_attention_params_by_hand() -> None:
    # modeling_deepseek_v3.py DeepseekV3Attention: h=256, a=8, qr=96, kr=64, dn=32, dr=16,
    # dv=24: q_a 256·96 + norm 96 + q_b 96·8·48 + kv_a 256·80 + norm 64 + kv_b 64·8·56
    # + o 8·24·256
    spec = from_hf_config(SMALL_V3, "config.json")
    assert spec.attention_params == (256 * 96 + 96 + 96 * 8 * 48 + 256 * 80 + 64
                                     + 64 * 8 * 56 + 8 * 24 * 256)


def test_mla_tp_shapes() -> None:
    spec = from_hf_config(SMALL_V3, "config.json")
    local = {t.name: t.numel for t in rank_tensors(spec, ParallelConfig(tp=2))}
    assert local["attn.q_a_proj.weight"] == 256 * 96  # duplicated down-projection
    assert local["attn.kv_a_proj_with_mqa.weight"] == 256 * (64 + 16)
    assert local["attn.q_a_layernorm.weight"] == 96
    assert local["attn.kv_a_layernorm.weight"] == 64
    assert local["attn.q_b_proj.weight"] == 96 * 4 * 48  # 4 of 8 heads
    assert local["attn.kv_b_proj.weight"] == 64 * 4 * (32 + 24)
    assert local["attn.o_proj.weight"] == 4 * 24 * 256  # row-parallel: a·dv split


@pytest.mark.parametrize(
    ("update", "pattern"),
    [
        ({"q_lora_rank": 8}, "need kv_lora_rank"),
        ({"kv_lora_rank": 8}, "needs kv_lora_rank, qk_nope_head_dim"),
        ({"kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8},
         "head_dim"),
    ],
)
def test_bad_mla_fields(update: dict[str, Any], pattern: str) -> None:
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100}
    with pytest.raises(InputError, match=pattern):
        spec_from_fields({**base, **update}, "spec.yaml")


def test_v2_without_top_k_is_refused() -> None:
    cfg = {k: v for k, v in DEEPSEEK_V2_LITE.items() if k != "num_experts_per_tok"}
    with pytest.raises(InputError, match="lacks num_experts_per_tok"):
        from_hf_config(cfg, "config.json")


def _write(tmp_path: Path, cfg: dict[str, Any]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize(
    ("extra", "missing"),
    [
        (["--framework", "megatron", "--cp", "2", "--gpus", "2xH100"], "cp=2"),
        (["--framework", "hf"], "the hf profile"),
        (["--framework", "torchtitan", "--precision", "fp32"], "the torchtitan profile"),
        (["--tp", "2", "--gpus", "2xH100"], "tp=2"),
        (["--cp", "2", "--gpus", "2xH100"], "cp=2"),
        (["--finetune", "lora"], "fine-tuning"),
    ],
)
def test_uncovered_scenarios_refused_with_one_line(tmp_path: Path, capsys: Any,
                                                    extra: list[str], missing: str) -> None:
    assert main(["estimate", "--model", _write(tmp_path, SMALL_V3), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "multi-latent attention" in err and f"; not {missing}" in err


@pytest.mark.parametrize("args", [["plan", "--gpus", "64xH100"],
                                  ["size", "--tokens", "1T", "--gpu", "H100"]])
def test_plan_and_size_refuse_uncovered_profiles_with_one_line(tmp_path: Path, capsys: Any,
                                                                args: list[str]) -> None:
    """plan and size search MLA models (tests/test_plan_mla.py) where the profile's MLA
    activations cover some layout; under the hf profile none is covered: the estimate's
    own one-line refusal."""
    model = _write(tmp_path, DEEPSEEK_V3)
    assert main([args[0], "--model", model, *args[1:], "--framework", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "multi-latent attention" in err and "hf profile" in err
    assert main([args[0], "--model", model, *args[1:], "--framework", "megatron",
                 "--json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)


def test_estimate_runs_for_the_reference_profile(tmp_path: Path, capsys: Any) -> None:
    assert main(["estimate", "--model", _write(tmp_path, SMALL_V3), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["num_params"] == transformers_count(SMALL_V3)


# ---- the analytic table refereed by the trace (tests/test_trace.py tolerances) ---------
AGREE_CASES = {
    "dense": {**SMALL_V3, "num_hidden_layers": 2, "first_k_dense_replace": 2},
    "no_q_lora": {**SMALL_V3, "num_hidden_layers": 2, "first_k_dense_replace": 2,
                  "q_lora_rank": None},
    "moe": {**SMALL_V3, "num_hidden_layers": 2},
    "v_as_wide_as_qk": {**SMALL_V3, "num_hidden_layers": 2, "v_head_dim": 48},
}


@pytest.mark.parametrize(("attention", "precision", "recompute"),
                         [("flash", "bf16", "none"), ("flash", "amp-bf16", "none"),
                          ("flash", "amp-bf16", "full"), ("flash", "fp32", "none"),
                          ("flash", "amp-bf16", "selective"), ("eager", "bf16", "none"),
                          ("eager", "amp-bf16", "selective"), ("eager", "amp-bf16", "full")])
@pytest.mark.parametrize("cfg", AGREE_CASES.values(), ids=AGREE_CASES.keys())
def test_mla_analytic_agrees_with_trace(cfg: dict[str, Any], attention: str, precision: str,
                                        recompute: str) -> None:
    pytest.importorskip("torch")
    from vramcalc.validate import compare

    spec = from_hf_config(cfg, "mla/config.json")
    training = TrainingConfig(seq_len=256, micro_batch_size=2, precision=precision,
                              recompute=recompute, attention=attention)  # type: ignore[arg-type]
    row = compare("mla", Scenario(model=spec, training=training))
    assert "error" not in row, row.get("error")
    assert abs(row["rel_error"]) <= 0.03  # PEAK_MAX
    terms = row["terms"]
    assert abs(terms["activations"]["rel_error"]) <= 0.03  # ACTIVATIONS
    for term in ("weights", "gradients", "optimizer_states"):
        assert terms[term]["analytic"] == terms[term]["trace"], term


# ---- the reference model's MLA (groundwork for the activation tables) ------------------
def _reference_model(spec: Any, **kw: Any) -> Any:
    pytest.importorskip("torch")
    from vramcalc.trace.reference_model import ReferenceModel

    return ReferenceModel(spec, **kw)


@pytest.mark.parametrize("cfg", SMALL_CASES.values(), ids=SMALL_CASES.keys())
def test_reference_model_has_the_mla_parameters(cfg: dict[str, Any]) -> None:
    import re
    from collections import Counter

    torch = pytest.importorskip("torch")
    spec = from_hf_config(cfg, "config.json")
    with torch.device("meta"):
        model = _reference_model(spec)
    got: Counter[tuple[str, int]] = Counter()
    for name, p in model.named_parameters():
        name = re.sub(r"^layers\.\d+\.", "", name)
        name = re.sub(r"^mlp\.(?=router|experts|shared_experts)", "", name)
        name = re.sub(r"^experts\.\d+\.", "experts.", name)
        name = re.sub(r"^shared_experts\.\d+\.", "shared_expert.", name)
        got[({"embed_tokens.weight": "embed_tokens"}.get(name, name), p.numel())] += 1
    want: Counter[tuple[str, int]] = Counter()
    for t in param_tensors(spec):
        want[(t.name, t.numel)] += t.count
    assert got == want
    assert sum(p.numel() for p in model.parameters()) == transformers_count(cfg)


@pytest.mark.parametrize("q_lora_rank", [96, None])
def test_reference_mla_flash_eager_and_selective_agree(q_lora_rank: int | None) -> None:
    # SDPA with q/k heads of dn+dr = 48 and v heads of dv = 24 against the written-out
    # softmax(q kᵀ/√48) v, on real tensors
    torch = pytest.importorskip("torch")
    cfg = {**SMALL_V3, "q_lora_rank": q_lora_rank, "first_k_dense_replace": 4}
    spec = from_hf_config(cfg, "config.json")
    torch.manual_seed(0)
    flash = _reference_model(spec, attention="flash")
    eager = _reference_model(spec, attention="eager")
    selective = _reference_model(spec, attention="flash", recompute="selective")
    eager.load_state_dict(flash.state_dict())
    selective.load_state_dict(flash.state_dict())
    ids = torch.randint(0, spec.vocab_size, (2, 16))
    labels = torch.randint(0, spec.vocab_size, (2, 16))
    loss = flash(ids, labels)
    assert torch.allclose(loss, eager(ids, labels), atol=1e-4)
    assert torch.allclose(loss, selective(ids, labels), atol=1e-4)


# ---- invariants (STYLE.md) on MLA specs ------------------------------------------------
@st.composite
def mla_specs(draw: st.DrawFn) -> ModelSpec:
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    dn, dr = draw(st.sampled_from([0, 16, 32])), draw(st.sampled_from([8, 16]))
    layers = draw(st.integers(1, 4))
    moe = draw(st.booleans())
    return ModelSpec(
        model_type="deepseek_v3", hidden_size=draw(st.sampled_from([64, 128, 256])),
        num_hidden_layers=layers, num_attention_heads=heads, head_dim=dn + dr,
        intermediate_size=draw(st.sampled_from([64, 256])),
        vocab_size=draw(st.integers(100, 3000)),
        q_lora_rank=draw(st.sampled_from([None, 32, 96])),
        kv_lora_rank=draw(st.sampled_from([16, 64])), qk_nope_head_dim=dn,
        qk_rope_head_dim=dr, v_head_dim=draw(st.sampled_from([8, 24, dn + dr])),
        num_local_experts=4 if moe else 0, num_experts_per_tok=2 if moe else 0,
        moe_intermediate_size=32 if moe else None,
        first_k_dense_replace=draw(st.integers(0, layers)) if moe else 0,
    )


mla_trainings = st.builds(
    TrainingConfig,
    seq_len=st.sampled_from([16, 64, 256, 1024]),
    micro_batch_size=st.integers(1, 4),
    precision=st.sampled_from(["fp32", "amp-bf16", "bf16", "bf16-pure"]),
    attention=st.sampled_from(["flash", "eager"]),
    recompute=st.sampled_from(["none", "selective", "full"]),
)


@settings(max_examples=60, deadline=None)
@given(mla_specs(), mla_trainings)
def test_mla_recompute_never_increases_activations(spec: ModelSpec, tr: TrainingConfig) -> None:
    per = {}
    for rec in ("none", "selective", "full"):
        ctx = RankContext(spec, tr.model_copy(update={"recompute": rec}), ParallelConfig(dp=1))
        per[rec] = act.layer_activation_bytes(ctx)
    assert per["full"] <= per["selective"]
    if tr.attention == "flash":
        assert per["selective"] <= per["none"]
    # a real exception: eager selective recompute keeps v's view of kv_b_proj's whole output
    # (T·a·(dn+dv)) as a checkpoint input, which outweighs the (b, a, s, s) probabilities it
    # saves when s < dn (the trace agrees: test_mla_analytic_agrees_with_trace)


@settings(max_examples=60, deadline=None)
@given(mla_specs(), mla_trainings, st.integers(2, 4))
def test_mla_activations_linear_in_micro_batch(spec: ModelSpec, tr: TrainingConfig,
                                               k: int) -> None:
    one = RankContext(spec, tr.model_copy(update={"micro_batch_size": 1}), ParallelConfig(dp=1))
    many = RankContext(spec, tr.model_copy(update={"micro_batch_size": k}), ParallelConfig(dp=1))
    a1, ak = act.layer_activation_bytes(one), act.layer_activation_bytes(many)
    assert abs(ak - k * a1) <= k * len(act.layer_saved(one)) * 512


@settings(max_examples=30, deadline=None)
@given(mla_specs(), mla_trainings)
def test_mla_terms_are_non_negative_ints_and_add_up(spec: ModelSpec, tr: TrainingConfig) -> None:
    rep = estimate(Scenario(model=spec, training=tr))
    terms = rep.terms.as_dict()
    assert all(isinstance(v, int) and v >= 0 for v in terms.values())
    assert sum(terms[t] for t in ALLOCATED_TERMS) == rep.peak_allocated_bytes
    assert rep.peak_allocated_bytes == max(rep.phases.values())
