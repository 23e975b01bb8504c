"""Encoder-only models (BERT, RoBERTa): config.json import, exact parameter counts against
transformers' own `numel` on the meta device, the dropout masks training keeps (hand-derived
from transformers 5.24 modeling_bert.py and ATen's Dropout.cpp), agreement with the trace
engine, and the combinations vramcalc refuses (exit 2, one `error:` line)."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest

from vramcalc.cli import main
from vramcalc.hf_config import from_hf_config, with_task
from vramcalc.model import ModelSpec
from vramcalc.model_tensors import param_tensors
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import activations as act
from vramcalc.training import TrainingConfig
from vramcalc.units import round_alloc
from vramcalc.validate.shapes import SHAPES

# google-bert/bert-large-uncased and FacebookAI/roberta-base config.json (Hugging Face hub)
BERT_LARGE: dict[str, Any] = {
    "architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 1024,
    "intermediate_size": 4096, "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
    "model_type": "bert", "num_attention_heads": 16, "num_hidden_layers": 24,
    "pad_token_id": 0, "position_embedding_type": "absolute", "type_vocab_size": 2,
    "vocab_size": 30522}
ROBERTA_BASE: dict[str, Any] = {
    "architectures": ["RobertaForMaskedLM"], "attention_probs_dropout_prob": 0.1,
    "bos_token_id": 0, "eos_token_id": 2, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
    "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072,
    "layer_norm_eps": 1e-05, "max_position_embeddings": 514, "model_type": "roberta",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1,
    "type_vocab_size": 1, "vocab_size": 50265}
CLS = {"architectures": ["BertForSequenceClassification"]}
CONFIGS = {
    "bert-large-mlm": BERT_LARGE,
    "bert-large-cls": {**BERT_LARGE, **CLS},
    "bert-large-cls-3labels": {**BERT_LARGE, **CLS, "id2label": {"0": "a", "1": "b", "2": "c"}},
    "bert-large-mlm-untied": {**BERT_LARGE, "tie_word_embeddings": False},
    "roberta-base-mlm": ROBERTA_BASE,
    "roberta-base-cls": {**ROBERTA_BASE, "architectures": ["RobertaForSequenceClassification"]},
    # FacebookAI/xlm-roberta-base config.json (RoBERTa's code, a 250k vocabulary)
    "xlm-roberta-base-cls": {**ROBERTA_BASE, "model_type": "xlm-roberta", "vocab_size": 250002,
                             "architectures": ["XLMRobertaForSequenceClassification"]},
    "camembert-base-mlm": {**ROBERTA_BASE, "model_type": "camembert", "vocab_size": 32005,
                           "architectures": ["CamembertForMaskedLM"]},
}


def transformers_numel(cfg: dict[str, Any]) -> int:
    """sum(p.numel()) of the model transformers builds for the config's architectures."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    config = tf.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    auto = (tf.AutoModelForSequenceClassification
            if cfg["architectures"][0].endswith("ForSequenceClassification")
            else tf.AutoModelForMaskedLM)
    with torch.device("meta"):
        model = auto.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_counts_match_transformers(name: str) -> None:
    spec = from_hf_config(CONFIGS[name], f"{name}/config.json")
    assert spec.is_encoder
    assert spec.num_params == transformers_numel(CONFIGS[name])
    assert sum(t.numel * t.count for t in param_tensors(spec)) == spec.num_params


def test_task_switch_counts_match_transformers() -> None:
    # --task: the preset's classification head, or the tied masked-LM head
    from vramcalc.catalog import resolve_model

    spec, _ = resolve_model("bert-large")
    assert spec.num_params == transformers_numel({**BERT_LARGE, **CLS})
    assert with_task(spec, "masked-lm").num_params == transformers_numel(BERT_LARGE)


def test_published_sizes() -> None:
    # Devlin et al. 2019 (arXiv:1810.04805) §3: BERT-base 110M, BERT-large 340M (rounded);
    # Liu et al. 2019 (RoBERTa): base 125M (fairseq's count, rounded)
    from vramcalc.catalog import resolve_model

    for name, published in (("bert-base", 110e6), ("bert-large", 340e6),
                            ("roberta-base", 125e6)):
        n = with_task(resolve_model(name)[0], "masked-lm").num_params
        assert abs(n - published) / published < 0.02, (name, n)


def test_task_from_architectures() -> None:
    assert from_hf_config(BERT_LARGE, "c.json").task == "masked_lm"
    assert from_hf_config({**BERT_LARGE, **CLS}, "c.json").task == "sequence_classification"
    bare = {k: v for k, v in BERT_LARGE.items() if k != "architectures"}
    assert from_hf_config(bare, "c.json").task == "sequence_classification"


# ---- dropout masks -------------------------------------------------------------------------
def _activations(spec: ModelSpec, **kw: Any) -> int:
    tr = TrainingConfig(**{"framework": "hf", "seq_len": 128, "micro_batch_size": 2,
                           "precision": "fp32", "attention": "eager", **kw})
    scn = Scenario(model=spec, training=tr).resolved()
    return act.microbatch_activation_bytes(RankContext(scn.model, scn.training, scn.parallel, 0))


def test_dropout_masks_hand_derived() -> None:
    """What dropout 0.1 adds to one micro-batch's saved tensors (fp32, eager), from
    modeling_bert.py: per layer the attention probabilities' 1-byte mask and the dropout
    output p' (p @ v keeps p', the softmax keeps p), the masks after the attention output and
    the MLP output (T·h each); the embedding dropout's mask; the classifier dropout's (b, h)
    mask and its output (without dropout the classifier reads tanh's output itself)."""
    spec = SHAPES["bert"]
    b, s, h, a, L = 2, 128, spec.hidden_size, spec.num_attention_heads, spec.num_hidden_layers
    T = b * s
    per_layer = round_alloc(b * a * s * s) + round_alloc(4 * b * a * s * s) + 2 * round_alloc(T * h)
    head = round_alloc(b * h) + round_alloc(4 * b * h)
    expected = L * per_layer + round_alloc(T * h) + head
    assert _activations(spec) - _activations(spec, dropout=0) == expected


def test_flash_keeps_no_probability_mask() -> None:
    """Under SDPA the probability dropout runs inside the kernel (RNG seed/offset only):
    dropout adds the three T·h masks per layer, the embedding's and the classifier's."""
    spec = SHAPES["bert"]
    b, s, h, L = 2, 128, spec.hidden_size, spec.num_hidden_layers
    T = b * s
    expected = 2 * L * round_alloc(T * h) + round_alloc(T * h) + round_alloc(b * h) + (
        round_alloc(4 * b * h))
    diff = _activations(spec, attention="flash") - _activations(spec, attention="flash",
                                                               dropout=0)
    assert diff == expected


# ---- the trace engine as referee ------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    {"precision": "fp32", "attention": "eager"},
    {"precision": "amp-fp16", "attention": "eager", "recompute": "full", "grad_accum": 2},
    {"precision": "amp-bf16", "attention": "flash"},
])
def test_trace_agrees(kw: dict[str, Any]) -> None:
    pytest.importorskip("transformers")
    from vramcalc.analytic import estimate
    from vramcalc.trace.engine import trace

    spec = ModelSpec(**{**SHAPES["bert"].model_dump(), "hidden_size": 256,
                        "num_attention_heads": 4, "intermediate_size": 1024})
    scn = Scenario(model=spec, training=TrainingConfig(framework="hf", seq_len=128,
                                                       micro_batch_size=2, **kw))
    traced, analytic = trace(scn), estimate(scn)
    fwd = traced.marks["end_forward"].terms()
    assert analytic.terms.weights == traced.param_bytes + 2 * round_alloc(8 * 512)
    ctx = RankContext(scn.resolved().model, scn.resolved().training, scn.resolved().parallel, 0)
    assert act.microbatch_activation_bytes(ctx) == fwd["activations"]
    rel = analytic.peak_allocated_bytes / traced.report.peak_allocated_bytes - 1
    assert abs(rel) < 0.01, rel


# ---- refusals ---------------------------------------------------------------------------------
def _run(args: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, err.getvalue()


@pytest.mark.parametrize(("extra", "words"), [
    (["--tp", "2", "--gpus", "2xA100"], "tp=2"),
    (["--framework", "megatron"], "megatron"),
    (["--framework", "torchtitan"], "torchtitan"),
    (["--framework", "torchtune"], "torchtune"),
    (["--framework", "lightning"], "lightning"),
    (["--finetune", "lora"], "lora"),
    (["--recompute", "selective"], "selective"),
    (["--zero", "3", "--gpus", "8xA100"], "zero=3"),
    (["--seq-len", "1024"], "--seq-len 1024"),
])
def test_unmodelled_combinations_are_refused(extra: list[str], words: str) -> None:
    code, err = _run(["estimate", "--model", "bert-large", "--seq-len", "512", *extra])
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ")
    assert words in lines[0]


def test_task_on_a_decoder_is_refused() -> None:
    code, err = _run(["estimate", "--model", "llama3-8b", "--task", "masked-lm"])
    assert code == 2 and err.startswith("error: --task masked-lm: llama3-8b is a decoder")


@pytest.mark.parametrize("change", [
    {"position_embedding_type": "relative_key"}, {"is_decoder": True},
    {"hidden_dropout_prob": 1.5}, {"classifier_dropout": 0.3},
])
def test_unmodelled_configs_are_refused(tmp_path: Any, change: dict[str, Any]) -> None:
    path = tmp_path / "config.json"
    import json

    path.write_text(json.dumps({**BERT_LARGE, **change}))
    code, err = _run(["estimate", "--model", str(path), "--seq-len", "512"])
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ")


def test_estimate_runs_from_a_config_json(tmp_path: Any) -> None:
    import json

    path = tmp_path / "bert-large-uncased" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(BERT_LARGE))
    # fp32, as the calibration runs on this GPU did (a V100 has no bf16)
    code, _ = _run(["estimate", "--model", str(path), "--seq-len", "512", "--gpus", "V100",
                    "--micro-batch-size", "4", "--precision", "fp32", "--json"])
    assert code in (0, 1)


# ---- zero_grad(set_to_none=False) ---------------------------------------------------------------
def test_kept_zeroed_gradients_add_to_forward() -> None:
    """torch < 2.0's zero_grad() zeroes `.grad` and keeps it: every forward then holds one
    fp32 gradient per parameter (each rounded to the allocator's 512 B)."""
    from vramcalc.analytic import estimate

    spec = SHAPES["bert"]
    grads = sum(t.count * round_alloc(4 * t.numel) for t in param_tensors(spec))

    def forward(set_to_none: bool) -> int:
        tr = TrainingConfig(framework="hf", seq_len=128, micro_batch_size=2, precision="fp32",
                            set_to_none=set_to_none)
        return estimate(Scenario(model=spec, training=tr)).phases["forward"]

    assert forward(False) - forward(True) == grads


@pytest.mark.parametrize("extra", [["--precision", "bf16"], ["--zero", "2", "--gpus", "8xA100"],
                                   ["--fsdp", "full", "--gpus", "8xA100"]])
def test_kept_gradients_refused_where_not_modelled(extra: list[str]) -> None:
    code, err = _run(["estimate", "--model", "llama3-8b", "--no-set-to-none", *extra])
    assert code == 2 and err.startswith("error: --no-set-to-none is modelled on one GPU or DDP")


@pytest.mark.parametrize("cfg", [
    {"model_type": "deberta-v2", "hidden_size": 768, "num_hidden_layers": 12,
     "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 128100},
    {"model_type": "umt5", "d_model": 512, "num_layers": 6, "num_heads": 8, "d_ff": 2048,
     "vocab_size": 32128, "is_encoder_decoder": True},
    {"model_type": "my_encoder", "architectures": ["MyEncoderForMaskedLM"], "hidden_size": 64,
     "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256,
     "vocab_size": 1000},
])
def test_other_encoders_are_refused_not_read_as_decoders(cfg: dict[str, Any]) -> None:
    from vramcalc.errors import InputError

    with pytest.raises(InputError, match="encoder or encoder-decoder model"):
        from_hf_config(cfg, "config.json")


def test_a_decoder_with_a_classification_head_is_still_read() -> None:
    cfg = {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"],
           "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 256, "vocab_size": 1000}
    assert not from_hf_config(cfg, "config.json").is_encoder
