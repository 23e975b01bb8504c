"""MLP activations: what relu and squared relu (relu2) keep, Nemotron's config, refusals.

- relu keeps its output (aten threshold_backward reads `result`), which is also the down
  projection's input: a 2-matrix relu MLP keeps one (T, f) tensor where GELU keeps two.
- relu2 is square(relu(x)) (transformers ReLUSquaredActivation, Megatron-LM squared_relu):
  relu's output (kept by relu and by pow, whose backward reads `self`) and the square (the
  projection's input). pow is on CUDA autocast's fp32 list (aten/src/ATen/autocast_mode.h),
  so under autocast the square runs on an fp32 copy of relu's output, which it keeps.
- An adapted down projection of a 2-matrix MLP gives its input two gradients (the adapter's
  and the base's). On (b, s, f) activations each is a view of its matmul's 2-D output, so
  autograd's input buffer sums them out of place (torch/csrc/autograd/input_buffer.cpp
  `can_accumulate_inplace` needs the last reference to the storage): 3·T·f at that moment.
- Each figure is checked against the trace engine, which runs these ops under
  FakeTensorMode; the byte differences below are derived by hand from the rules above.
"""

from __future__ import annotations

from typing import Any

import pytest

from vramcalc.errors import InputError
from vramcalc.hf_config import from_hf_config
from vramcalc.model import ModelSpec, spec_from_fields
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import activations as act
from vramcalc.training import TrainingConfig
from vramcalc.validate.compare import compare
from vramcalc.validate.shapes import SHAPES, scenario_for

L, H, F, V = 4, 1024, 4096, 1024  # layers, hidden, ffn, vocab
BASE = dict(name="mlp", hidden_size=H, num_hidden_layers=L, num_attention_heads=16,
            num_key_value_heads=4, intermediate_size=F, vocab_size=V, mlp_kind="standard",
            norm_kind="layernorm", norm_bias=True)


def layer_bytes(act: str, **kw: Any) -> int:
    """One layer's saved bytes (vramcalc.terms.activations.layer_saved)."""
    from vramcalc.rank import RankContext
    from vramcalc.terms.activations import layer_saved

    spec = ModelSpec(**BASE, hidden_act=act)
    tr = TrainingConfig(seq_len=512, micro_batch_size=2, **kw)
    return sum(t.nbytes for t in layer_saved(RankContext(spec, tr, ParallelConfig(dp=1))))


def test_relu_keeps_one_tensor_relu2_two() -> None:
    T = 2 * 512
    gelu = layer_bytes("gelu", precision="bf16-pure")
    assert gelu - layer_bytes("relu", precision="bf16-pure") == T * F * 2
    assert layer_bytes("relu2", precision="bf16-pure") == gelu


def test_relu2_keeps_an_fp32_copy_under_autocast() -> None:
    T = 2 * 512
    extra = layer_bytes("relu2", precision="amp-bf16") - layer_bytes("gelu", precision="amp-bf16")
    assert extra == T * F * 4


CASES = [
    ("gpt2-relu", {"framework": "hf", "precision": "bf16-pure"}),
    ("gpt2-relu", {"finetune": "lora", "lora_targets": "all-linear"}),
    ("gpt2-relu", {"framework": "hf", "precision": "amp-bf16"}),
    ("gpt2-relu", {"finetune": "qlora", "lora_targets": "all-linear"}),
    ("gpt2-relu", {"precision": "fp8"}),
    ("nemotron-relu2", {"precision": "bf16-pure"}),
    ("nemotron-relu2", {"precision": "amp-bf16"}),
    ("nemotron-relu2", {"finetune": "lora", "lora_targets": "all-linear"}),
    ("nemotron-relu2", {"qat": "int8"}),
]


@pytest.mark.parametrize(("shape", "kw"), CASES,
                         ids=[f"{s}-{','.join(map(str, k.values()))}" for s, k in CASES])
def test_analytic_agrees_with_trace(shape: str, kw: dict[str, Any]) -> None:
    pytest.importorskip("torch")
    from vramcalc.validate import compare

    name, scn = scenario_for(shape, **kw)
    r = compare(name, scn)
    assert "error" not in r, r.get("error")
    assert r["terms"]["activations"]["analytic"] == pytest.approx(
        r["terms"]["activations"]["trace"], rel=1e-3)
    assert abs(r["rel_error"]) <= 0.003, r["rel_error"]


def test_lora_on_a_gelu_down_projection_sums_two_gradients() -> None:
    """GELU's 2-matrix MLP with every linear adapted, small vocabulary: the peak is the
    down projection's backward (before: 2·T·f of work, 2.3 % under the trace)."""
    pytest.importorskip("torch")
    from vramcalc.validate import compare

    spec = SHAPES["nemotron-relu2"].model_copy(update={"hidden_act": "gelu"})
    scn = Scenario(model=spec, training=TrainingConfig(
        seq_len=1024, micro_batch_size=4, finetune="lora", lora_targets="all-linear"))
    r = compare("gelu-lora", scn)
    assert r["trace_peak_phase"] == "backward"
    assert abs(r["rel_error"]) <= 0.001, r["rel_error"]


# nvidia/Minitron-4B-Base's shape (config.json): NemotronConfig's relu2, 2-matrix MLP
MINITRON = {"model_type": "nemotron", "hidden_size": 3072, "intermediate_size": 9216,
            "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 256000, "max_position_embeddings": 4096,
            "partial_rotary_factor": 0.5, "tie_word_embeddings": False}


def test_nemotron_config_counts_match_transformers() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    spec = from_hf_config(MINITRON, "config.json")
    assert (spec.mlp_kind, spec.hidden_act, spec.norm_kind, spec.norm_bias) == (
        "standard", "relu2", "layernorm", True)
    config = transformers.AutoConfig.for_model(**MINITRON)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert spec.num_params == sum(p.numel() for p in model.parameters())


def test_unknown_activations_and_unmodelled_stacks_are_refused() -> None:
    with pytest.raises(InputError, match="hidden_act"):
        spec_from_fields({**BASE, "hidden_act": "quick_gelu"}, "m.yaml")
    with pytest.raises(InputError, match="hidden_act"):
        from_hf_config({**MINITRON, "hidden_act": "relu6"}, "config.json")
    nemotron = from_hf_config(MINITRON, "config.json")
    with pytest.raises(InputError, match="GPT-2's shape"):
        Scenario(model=nemotron, training=TrainingConfig(framework="hf")).resolved()
    with pytest.raises(InputError, match="gated MLP with relu2"):
        Scenario(model=ModelSpec(**{**BASE, "mlp_kind": "gated"}, hidden_act="relu2"),
                 training=TrainingConfig()).resolved()
    relu = ModelSpec(**BASE, hidden_act="relu")
    with pytest.raises(InputError, match="Megatron-LM's MLP"):
        Scenario(model=relu, training=TrainingConfig(framework="megatron"),
                 parallel=ParallelConfig()).resolved()


# ---- autocast with a frozen or 4-bit base, where the layer's own work is the peak -----------
AUTOCAST_CELLS = [
    # QLoRA: bitsandbytes' Linear4bit returns its input's dtype, fp32 under autocast, so the
    # checkpointed MLP's up, act and act·up (forward) and its gradients (backward) are fp32
    # (were -11.2 % with full recompute, -4.6 … -5.9 % without)
    ("reference", {"finetune": "qlora", "recompute": "full"}),
    ("hf", {"finetune": "qlora", "recompute": "full"}),
    ("reference", {"finetune": "qlora", "recompute": "none"}),
    # selective recompute: the checkpointed core keeps the 4-bit projections' fp32 q, k, v
    # (was -10.0 %)
    ("reference", {"finetune": "qlora", "recompute": "selective"}),
    # LoRA / DoRA: the recomputed layer casts its frozen fp32 weights again and each matmul
    # keeps its cast (autocast caches only casts of weights that need a gradient) (were -4.1 %)
    ("reference", {"finetune": "lora", "recompute": "full"}),
    ("hf", {"finetune": "dora", "recompute": "full"}),
]


@pytest.mark.parametrize(("framework", "kw"), AUTOCAST_CELLS,
                         ids=[f"{f}-{k['finetune']}-{k['recompute']}" for f, k in AUTOCAST_CELLS])
def test_autocast_frozen_base_layer_peak_agrees_with_trace(framework: str,
                                                           kw: dict[str, Any]) -> None:
    pytest.importorskip("torch")
    from vramcalc.validate import compare

    name, scn = scenario_for("llama-deep", framework=framework, precision="amp-bf16", **kw)
    r = compare(name, scn)
    assert "error" not in r, r.get("error")
    assert r["trace_peak_phase"] == "backward"
    assert abs(r["rel_error"]) <= 0.001, r["rel_error"]


@pytest.mark.parametrize("shape", ["gpt2", "phi3-fused"])
def test_a_checkpointed_core_keeps_a_fused_4bit_qkv_in_fp32(shape: str) -> None:
    # GPT-2's c_attn and Phi-3's qkv_proj are one 4-bit linear: under autocast it returns
    # its fp32 input's dtype, and the selective checkpoint keeps that whole output (were
    # -1.0 % and -1.7 %: counted 16-bit)
    kw = {"finetune": "qlora", "recompute": "selective", "precision": "amp-bf16",
          "lora_targets": "q,k,v,o", "micro_batch_size": 2, "seq_len": 1024}
    _, scn = scenario_for(shape, framework="hf", **kw)
    scn = scn.resolved()
    saved = act.layer_saved(RankContext(scn.model, scn.training, scn.parallel), False)
    assert {t.name: t.dtype for t in saved}["attn.qkv"] == "fp32"
    pytest.importorskip("torch")
    from vramcalc.validate import compare

    r = compare(*scenario_for(shape, framework="hf", **kw))
    assert abs(r["terms"]["activations"]["rel_error"]) < 1e-3, r["terms"]["activations"]
    assert abs(r["rel_error"]) < 0.001, r["rel_error"]


def test_eager_mqa_keeps_full_casts_of_fp32_k_and_v() -> None:
    # Gemma-style MQA at batch 1: repeat_kv's expand + reshape is a view, which the eager
    # matmuls keep as it is, unless k or v is fp32 — k rotated by the fp32 cos and sin under
    # amp, v from a 4-bit projection under autocast: autocast's cast for the matmul is then
    # a full (b, a, s, d) tensor (8 heads of 256)
    full, view = 512 * 8 * 256 * 2, 512 * 1 * 256 * 2
    cells = (("qlora", "amp-bf16", full, full), ("qlora", "bf16", view, view),
             ("lora", "amp-bf16", full, view), ("lora", "bf16-pure", view, view))
    for finetune, precision, k, v in cells:
        kw = {"finetune": finetune, "attention": "eager", "micro_batch_size": 1,
              "seq_len": 512, "lora_targets": "q,v", "precision": precision}
        _, scn = scenario_for("gemma-mqa", framework="hf", **kw)
        scn = scn.resolved()
        saved = act.layer_saved(RankContext(scn.model, scn.training, scn.parallel), False)
        sizes = {t.name: t.nbytes for t in saved}
        assert (sizes["attn.k"], sizes["attn.v"]) == (k, v), (finetune, precision)
    pytest.importorskip("torch")
    from vramcalc.validate import compare

    for finetune in ("qlora", "lora"):  # were -1.3 % and -0.7 %
        r = compare(*scenario_for("gemma-mqa", framework="hf", finetune=finetune,
                                  attention="eager", micro_batch_size=1, seq_len=512,
                                  lora_targets="q,v", precision="amp-bf16"))
        assert abs(r["rel_error"]) < 0.001, (finetune, r["rel_error"])


@pytest.mark.parametrize("finetune,precision,recompute", [
    ("lora", "fp32", "none"),  # forward was -0.9 %
    ("qlora", "fp32", "full"),  # forward was -3.1 %
    ("full", "bf16", "full"),  # forward was -0.9 %
])
def test_eager_forward_peaks_with_q_k_v_and_the_checkpointed_input(
        finetune: str, precision: str, recompute: str) -> None:
    # eager attention's forward peaks at the scores (scores and their scaled copy, then the
    # masked scores and the probabilities), with q, k and v all made (the reference
    # attention projects v before the scores), and in a checkpointed layer its input, the
    # checkpoint's; a 1,024-token vocabulary puts the forward peak in the top layer
    pytest.importorskip("torch")
    kw = {"lora_targets": "all-linear"} if finetune != "full" else {}
    name, scn = scenario_for("gpt2-relu", finetune=finetune, precision=precision,
                             recompute=recompute, attention="eager", micro_batch_size=1,
                             seq_len=1024, **kw)
    row = compare(name, scn)
    assert abs(row["phases"]["forward"]["rel_error"]) < 0.001, row["phases"]["forward"]
