"""Parallel attention + MLP blocks (`parallel_residual`): x + attn(norm(x)) + mlp(norm'(x)).

- Parameter counts against transformers' own models on the meta device (phi: one shared
  LayerNorm, biases everywhere, a biased lm_head; GPT-NeoX: two norms,
  use_parallel_residual) and microsoft/phi-1_5's published 1.42B (1,418,270,720 on the
  meta device: the figure below is transformers', not ours).
- Activations against the trace engine: the reference model's parallel block
  (vramcalc/trace/reference_model.py) under FakeTensorMode, for full training, autocast,
  LoRA (whose first layer's MLP branch reads only frozen tensors and saves nothing), QLoRA,
  eager attention and both recompute modes.
"""

from __future__ import annotations

from typing import Any

import pytest

from vramcalc.errors import InputError
from vramcalc.hf_config import from_hf_config
from vramcalc.model import ModelSpec, spec_from_fields
from vramcalc.model_tensors import param_tensors
from vramcalc.scenario import Scenario
from vramcalc.training import TrainingConfig

# microsoft/phi-1_5 and microsoft/phi-2 config.json (the keys that set shapes)
PHI15 = {"model_type": "phi", "vocab_size": 51200, "hidden_size": 2048,
         "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
         "hidden_act": "gelu_new", "max_position_embeddings": 2048,
         "partial_rotary_factor": 0.5, "tie_word_embeddings": False}
PHI2 = {**PHI15, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 32,
        "partial_rotary_factor": 0.4}
NEOX = {"model_type": "gpt_neox", "vocab_size": 50432, "hidden_size": 512,
        "intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 8,
        "max_position_embeddings": 2048, "rotary_pct": 0.25, "use_parallel_residual": True}

TINY_PHI = ModelSpec(
    name="tiny-phi", model_type="phi", hidden_size=256, num_hidden_layers=2,
    num_attention_heads=4, intermediate_size=1024, vocab_size=1024, mlp_kind="standard",
    hidden_act="gelu_pytorch_tanh", norm_kind="layernorm", norm_bias=True, attention_bias=True,
    attention_out_bias=True, mlp_bias=True, num_layer_norms=1, parallel_residual=True,
    lm_head_bias=True)
TINY_NEOX = TINY_PHI.model_copy(update={"name": "tiny-neox", "num_layer_norms": 2,
                                        "lm_head_bias": False})


def transformers_count(cfg: dict[str, Any]) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("cfg", [PHI15, PHI2, NEOX, {**NEOX, "use_parallel_residual": False}],
                         ids=["phi-1.5", "phi-2", "neox-parallel", "neox-sequential"])
def test_counts_match_transformers(cfg: dict[str, Any]) -> None:
    spec = from_hf_config(cfg, "config.json")
    assert spec.num_params == transformers_count(cfg)
    assert sum(t.numel * t.count for t in param_tensors(spec)) == spec.num_params
    assert spec.parallel_residual == cfg.get("use_parallel_residual", True)


def test_phi15_published_count() -> None:
    spec = from_hf_config(PHI15, "phi-1_5/config.json")
    assert spec.num_params == 1_418_270_720
    assert spec.num_layer_norms == 1 and spec.lm_head_bias


def test_bad_specs_are_refused() -> None:
    with pytest.raises(InputError, match="needs parallel_residual"):
        spec_from_fields({"name": "x", "hidden_size": 64, "num_hidden_layers": 1,
                          "num_attention_heads": 4, "intermediate_size": 128,
                          "vocab_size": 100, "num_layer_norms": 1}, "x.yaml")
    with pytest.raises(InputError, match="qk_layernorm"):
        from_hf_config({**PHI15, "qk_layernorm": True}, "config.json")
    with pytest.raises(InputError, match="parallel attention"):
        Scenario(model=TINY_PHI, training=TrainingConfig(framework="hf")).resolved()


@pytest.mark.parametrize("spec", [TINY_PHI, TINY_NEOX], ids=["phi", "neox"])
def test_reference_model_has_the_spec_parameters(spec: ModelSpec) -> None:
    torch = pytest.importorskip("torch")
    from vramcalc.trace.reference_model import ReferenceModel

    with torch.device("meta"):
        model = ReferenceModel(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


CASES = [
    {"precision": "fp32"},
    {"precision": "amp-bf16"},
    {"precision": "bf16-pure", "attention": "eager"},
    {"precision": "bf16-pure", "recompute": "full"},
    {"precision": "bf16-pure", "recompute": "selective"},
    {"precision": "bf16-pure", "finetune": "lora", "lora_dropout": 0.05},
    {"precision": "bf16-pure", "finetune": "lora", "lora_targets": "all-linear"},
    {"precision": "bf16-pure", "finetune": "qlora"},
]


@pytest.mark.parametrize("spec", [TINY_PHI, TINY_NEOX], ids=["phi", "neox"])
@pytest.mark.parametrize("kw", CASES, ids=[",".join(f"{v}" for v in c.values()) for c in CASES])
def test_analytic_agrees_with_trace(spec: ModelSpec, kw: dict[str, Any]) -> None:
    pytest.importorskip("torch")
    from vramcalc.validate import compare

    scn = Scenario(model=spec, training=TrainingConfig(seq_len=256, micro_batch_size=2, **kw))
    r = compare(spec.name, scn)
    assert "error" not in r, r.get("error")
    for term in ("weights", "gradients", "optimizer_states", "activations"):
        assert r["terms"][term]["analytic"] == r["terms"][term]["trace"], term
    assert abs(r["rel_error"]) <= 0.001


def test_autocast_lora_first_layer_casts_are_an_overestimate() -> None:
    """Known gap: under autocast with LoRA, the first parallel block's frozen MLP branch
    saves no weight casts (nothing in it needs a gradient); vramcalc still counts the
    per-layer casts, about 2·h·f·2 bytes too many (1.9 % of this tiny shape's peak)."""
    pytest.importorskip("torch")
    from vramcalc.validate import compare

    scn = Scenario(model=TINY_PHI, training=TrainingConfig(
        seq_len=256, micro_batch_size=2, precision="amp-bf16", finetune="lora",
        lora_dropout=0.1))
    r = compare("phi-amp-lora", scn)
    assert r["terms"]["activations"]["analytic"] == r["terms"]["activations"]["trace"]
    over = r["analytic_bytes"] - r["trace_bytes"]
    casts = 2 * 256 * 1024 * 2  # fc and proj weights in bf16 (their biases' casts besides)
    assert casts <= over <= 1.01 * casts
