"""ModernBERT (transformers 5.24 models/modernbert): config.json import, exact parameter
counts against transformers' own `numel` on the meta device, the configurations vramcalc
refuses, and agreement of the analytic tables (vramcalc/terms/modernbert.py) with the trace
engine running transformers' ModernBERT."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from tests.test_encoder import _run, transformers_numel
from vramcalc.cli import main
from vramcalc.hf_config import from_hf_config, with_task
from vramcalc.model_tensors import param_tensors

# answerdotai/ModernBERT-base and -large config.json (Hugging Face hub)
BASE: dict[str, Any] = {
    "architectures": ["ModernBertForMaskedLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 50281, "classifier_activation": "gelu",
    "classifier_bias": False, "classifier_dropout": 0.0, "classifier_pooling": "mean",
    "cls_token_id": 50281, "decoder_bias": True, "deterministic_flash_attn": False,
    "embedding_dropout": 0.0, "eos_token_id": 50282, "global_attn_every_n_layers": 3,
    "global_rope_theta": 160000.0, "gradient_checkpointing": False,
    "hidden_activation": "gelu", "hidden_size": 768, "initializer_cutoff_factor": 2.0,
    "initializer_range": 0.02, "intermediate_size": 1152, "layer_norm_eps": 1e-05,
    "local_attention": 128, "local_rope_theta": 10000.0, "max_position_embeddings": 8192,
    "mlp_bias": False, "mlp_dropout": 0.0, "model_type": "modernbert", "norm_bias": False,
    "norm_eps": 1e-05, "num_attention_heads": 12, "num_hidden_layers": 22,
    "pad_token_id": 50283, "position_embedding_type": "absolute", "sep_token_id": 50282,
    "tie_word_embeddings": True, "torch_dtype": "float32", "vocab_size": 50368}
LARGE = {**BASE, "hidden_size": 1024, "intermediate_size": 2624, "num_attention_heads": 16,
         "num_hidden_layers": 28}
CLS = {"architectures": ["ModernBertForSequenceClassification"]}
CONFIGS = {
    "base-mlm": BASE, "large-mlm": LARGE, "base-cls": {**BASE, **CLS},
    "large-cls-3labels": {**LARGE, **CLS, "id2label": {"0": "a", "1": "b", "2": "c"}},
    "biases-mlm": {**BASE, "norm_bias": True, "attention_bias": True, "mlp_bias": True,
                   "classifier_bias": True, "num_hidden_layers": 4},
    "biases-cls": {**BASE, **CLS, "norm_bias": True, "attention_bias": True,
                   "mlp_bias": True, "classifier_bias": True, "num_hidden_layers": 4},
    "no-decoder-bias-untied": {**BASE, "decoder_bias": False, "tie_word_embeddings": False,
                               "num_hidden_layers": 2},
    "one-layer": {**BASE, "num_hidden_layers": 1},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_counts_match_transformers(name: str) -> None:
    spec = from_hf_config(CONFIGS[name], f"{name}/config.json")
    assert spec.is_encoder and spec.model_type == "modernbert"
    assert spec.num_params == transformers_numel(CONFIGS[name])
    assert sum(t.numel * t.count for t in param_tensors(spec)) == spec.num_params


def test_presets_and_task_switch_match_transformers() -> None:
    from vramcalc.catalog import resolve_model

    for name, cfg in (("modernbert-base", BASE), ("modernbert-large", LARGE)):
        spec, _ = resolve_model(name)
        assert spec.num_params == transformers_numel({**cfg, **CLS})
        assert with_task(spec, "masked-lm").num_params == transformers_numel(cfg)


def test_published_sizes() -> None:
    # the model card (answerdotai/ModernBERT-base README): base 149M, large 395M parameters
    from vramcalc.catalog import resolve_model

    for name, published in (("modernbert-base", 149e6), ("modernbert-large", 395e6)):
        n = with_task(resolve_model(name)[0], "masked-lm").num_params
        assert abs(n - published) / published < 0.005, (name, n)


def test_layer_pattern_follows_transformers() -> None:
    """ModernBertConfig.__post_init__: layer i is sliding when i % global_attn_every_n_layers."""
    tf = pytest.importorskip("transformers")
    for every in (1, 2, 3, 5):
        cfg = {**BASE, "num_hidden_layers": 7, "global_attn_every_n_layers": every}
        spec = from_hf_config(cfg, "c.json")
        theirs = tf.ModernBertConfig(**{k: v for k, v in cfg.items()
                                        if k not in ("architectures", "model_type")})
        assert [spec.layer_is_sliding(i) for i in range(7)] == [
            t == "sliding_attention" for t in theirs.layer_types]
    types = ["full_attention", "sliding_attention"] * 2
    spec = from_hf_config({**BASE, "num_hidden_layers": 4, "layer_types": types}, "c.json")
    assert [spec.layer_is_sliding(i) for i in range(4)] == [False, True, False, True]


@pytest.mark.parametrize("change", [
    {"mlp_dropout": 0.1}, {"attention_dropout": 0.1}, {"embedding_dropout": 0.1},
    {"classifier_dropout": 0.2}, {"sparse_prediction": True}, {"classifier_pooling": "max"},
    {"layer_types": ["sliding_attention", "full_attention"], "num_hidden_layers": 2},
])
def test_unmodelled_configs_are_refused(tmp_path: Any, change: dict[str, Any]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, **change}))
    code, err = _run(["estimate", "--model", str(path), "--seq-len", "512"])
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ")


@pytest.mark.parametrize("name", ["base-cls", "biases-mlm", "no-decoder-bias-untied"])
def test_tensor_list_matches_transformers(name: str) -> None:
    """One entry per real tensor (the fused Wqkv and Wi included): optimizer states and
    per-tensor allocator rounding depend on the tensor count, not only the total."""
    from collections import Counter

    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    cfg = CONFIGS[name]
    config = tf.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    auto = (tf.AutoModelForSequenceClassification
            if cfg["architectures"][0].endswith("ForSequenceClassification")
            else tf.AutoModelForMaskedLM)
    with torch.device("meta"):
        model = auto.from_config(config)
    theirs = Counter(p.numel() for p in model.parameters())
    ours: Counter[int] = Counter()
    for t in param_tensors(from_hf_config(cfg, "c.json")):
        ours[t.numel] += t.count
    assert ours == theirs


# ---- the trace engine as referee ------------------------------------------------------------
def _small(task: str, **update: Any) -> Any:
    from vramcalc.catalog import resolve_model

    spec = resolve_model("modernbert-base")[0].model_copy(update={
        "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 384,
        "num_hidden_layers": 4, "vocab_size": 1000, **update})
    return with_task(spec, task)


@pytest.mark.parametrize(("task", "kw", "update"), [
    ("sequence-classification", {"precision": "amp-bf16", "attention": "eager"}, {}),
    ("sequence-classification", {"precision": "fp32", "attention": "flash"},
     {"classifier_pooling": "cls"}),
    ("sequence-classification", {"precision": "amp-bf16", "attention": "flash"},
     {"classifier_pooling": "cls"}),
    ("masked-lm", {"precision": "fp32", "attention": "eager"}, {}),
    ("masked-lm", {"precision": "bf16", "attention": "flash", "grad_accum": 2}, {}),
    ("sequence-classification", {"precision": "bf16", "attention": "flash",
                                 "recompute": "full"}, {}),
    ("masked-lm", {"precision": "amp-bf16", "attention": "eager", "recompute": "full"}, {}),
])
def test_trace_agrees(task: str, kw: dict[str, Any], update: dict[str, Any]) -> None:
    """The analytic tables against transformers' ModernBERT run under the trace engine:
    saved activations exact, weights / gradients / optimizer states exact, peak within 3 %.
    4 layers (global, local, local, global) at s = 512: the local layers' mask is built;
    under full recompute the checkpoints keep the layer inputs and the model's mask."""
    pytest.importorskip("transformers")
    from vramcalc.analytic import estimate
    from vramcalc.rank import RankContext
    from vramcalc.scenario import Scenario
    from vramcalc.terms import activations as act
    from vramcalc.trace.engine import trace
    from vramcalc.training import TrainingConfig

    scn = Scenario(model=_small(task, **update), training=TrainingConfig(
        framework="hf", seq_len=512, micro_batch_size=4, **kw))
    traced, analytic = trace(scn), estimate(scn)
    fwd = traced.marks["end_forward"].terms()
    r = scn.resolved()
    ctx = RankContext(r.model, r.training, r.parallel, 0)
    assert act.microbatch_activation_bytes(ctx) == fwd["activations"]
    assert analytic.terms.weights == fwd["weights"] + fwd.get("weights/buffers", 0)
    step = traced.marks["end_step"].terms()
    states = sum(v for k, v in step.items() if k.startswith("optimizer_states"))
    assert analytic.terms.optimizer_states == states
    rel = analytic.peak_allocated_bytes / traced.report.peak_allocated_bytes - 1
    assert abs(rel) < 0.03, rel


def test_local_bias_per_local_layer_hand_derived() -> None:
    """Under SDPA each local layer keeps a c-typed (b, 1, s, s) bias once s >= local_attention
    // 2 (masking_utils `_ignore_bidirectional_mask_sdpa`; ATen's convert_boolean_attn_mask):
    4 layers with every 3rd global from layer 0 have 2 local layers."""
    from vramcalc.rank import RankContext
    from vramcalc.scenario import Scenario
    from vramcalc.terms import activations as act
    from vramcalc.training import TrainingConfig
    from vramcalc.units import round_alloc

    def saved(s: int, every: int) -> int:
        spec = _small("masked-lm", sliding_window_pattern=every)
        scn = Scenario(model=spec, training=TrainingConfig(
            framework="hf", seq_len=s, micro_batch_size=2, precision="bf16")).resolved()
        return act.microbatch_activation_bytes(RankContext(scn.model, scn.training,
                                                           scn.parallel, 0))

    # every=3 -> layers 1, 2 local; every=4 -> layers 1, 2, 3 local: one bias more, and the
    # rest of the table is the same
    assert saved(256, 4) - saved(256, 3) == round_alloc(2 * 2 * 256 * 256)
    # below the half window no mask is built: the two patterns save the same
    assert saved(32, 4) == saved(32, 3)


def test_estimate_runs_from_a_config_json(tmp_path: Any) -> None:
    """`vramcalc estimate --model <ModernBERT config.json> --task ...`: both heads, the
    task switch changes the parameter count as transformers' heads do."""
    path = tmp_path / "ModernBERT-base" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(BASE))
    counts = {}
    for task in ("masked-lm", "sequence-classification"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["estimate", "--model", str(path), "--task", task, "--seq-len", "1024",
                         "--micro-batch-size", "8", "--gpus", "A100", "--json"])
        assert code in (0, 1)
        counts[task] = json.loads(out.getvalue())["model"]["num_params"]
    assert counts["masked-lm"] == transformers_numel(BASE)
    assert counts["sequence-classification"] == transformers_numel({**BASE, **CLS})


@pytest.mark.parametrize(("extra", "words"), [
    (["--tp", "2", "--gpus", "2xA100"], "tp=2"), (["--finetune", "lora"], "lora"),
    (["--recompute", "selective"], "selective"),
])
def test_unmodelled_combinations_are_refused(extra: list[str], words: str) -> None:
    code, err = _run(["estimate", "--model", "modernbert-base", "--seq-len", "512", *extra])
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ")
    assert words in lines[0]
