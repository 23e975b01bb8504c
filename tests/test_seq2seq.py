"""Encoder-decoder models (T5, BART): config.json import with transformers' defaults, exact
parameter counts against transformers' own `numel` on the meta device, the trace engine's
seq2seq step (source at --seq-len, decoder at --target-len), and what vramcalc refuses
(exit 2, one `error:` line)."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest

from vramcalc.cli import main
from vramcalc.hf_config import from_hf_config
from vramcalc.model_tensors import param_tensors
from vramcalc.scenario import Scenario
from vramcalc.training import TrainingConfig

# config.json of google-t5/t5-base, google/t5-v1_1-base (gated-gelu; its untied head is tied
# by transformers 5.24, configuration_t5.py forces tie_word_embeddings = True) and
# facebook/bart-large (Hugging Face hub), the keys that shape parameters and dropout
T5_BASE: dict[str, Any] = {
    "architectures": ["T5ForConditionalGeneration"], "d_ff": 3072, "d_kv": 64, "d_model": 768,
    "dropout_rate": 0.1, "is_encoder_decoder": True, "model_type": "t5", "num_heads": 12,
    "num_layers": 12, "relative_attention_num_buckets": 32, "vocab_size": 32128}
T5_V11_BASE: dict[str, Any] = {
    "architectures": ["T5ForConditionalGeneration"], "d_ff": 2048, "d_kv": 64, "d_model": 768,
    "dropout_rate": 0.1, "feed_forward_proj": "gated-gelu", "is_encoder_decoder": True,
    "model_type": "t5", "num_decoder_layers": 12, "num_heads": 12, "num_layers": 12,
    "relative_attention_num_buckets": 32, "tie_word_embeddings": False, "vocab_size": 32128}
BART_LARGE: dict[str, Any] = {
    "activation_dropout": 0.1, "activation_function": "gelu", "architectures":
    ["BartModel"], "attention_dropout": 0.1, "d_model": 1024, "decoder_attention_heads": 16,
    "decoder_ffn_dim": 4096, "decoder_layers": 12, "dropout": 0.1,
    "encoder_attention_heads": 16, "encoder_ffn_dim": 4096, "encoder_layers": 12,
    "is_encoder_decoder": True, "max_position_embeddings": 1024, "model_type": "bart",
    "scale_embedding": False, "vocab_size": 50265}
# google/mt5-base config.json (T5 v1.1's code with a 250k vocabulary)
MT5_BASE: dict[str, Any] = {
    "architectures": ["MT5ForConditionalGeneration"], "d_ff": 2048, "d_kv": 64, "d_model": 768,
    "dropout_rate": 0.1, "feed_forward_proj": "gated-gelu", "is_encoder_decoder": True,
    "model_type": "mt5", "num_decoder_layers": 12, "num_heads": 12, "num_layers": 12,
    "relative_attention_num_buckets": 32, "tie_word_embeddings": False, "vocab_size": 250112}
CONFIGS = {
    "t5-base": T5_BASE,
    "mt5-base": MT5_BASE,
    "t5-v1_1-base": T5_V11_BASE,
    "bart-large": BART_LARGE,
    # small shapes that separate the terms: deeper decoder, d_kv·heads != d_model; BART untied
    "t5-odd": {**T5_BASE, "d_model": 96, "d_kv": 40, "num_heads": 3, "d_ff": 200,
               "num_layers": 2, "num_decoder_layers": 3, "vocab_size": 1000,
               "relative_attention_num_buckets": 16, "tie_word_embeddings": False},
    "bart-odd": {**BART_LARGE, "d_model": 64, "encoder_layers": 1, "decoder_layers": 3,
                 "encoder_ffn_dim": 96, "decoder_ffn_dim": 96, "encoder_attention_heads": 4,
                 "decoder_attention_heads": 4, "max_position_embeddings": 100,
                 "vocab_size": 1000, "tie_word_embeddings": False},
}


def transformers_numel(cfg: dict[str, Any]) -> int:
    """sum(p.numel()) of AutoModelForSeq2SeqLM (T5ForConditionalGeneration,
    BartForConditionalGeneration) built by transformers for the config, on the meta device."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    config = tf.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = tf.AutoModelForSeq2SeqLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_counts_match_transformers(name: str) -> None:
    spec = from_hf_config(CONFIGS[name], f"{name}/config.json")
    assert spec.is_encoder_decoder and spec.task == "seq2seq_lm"
    assert spec.num_params == transformers_numel(CONFIGS[name])
    assert sum(t.numel * t.count for t in param_tensors(spec)) == spec.num_params


def test_published_counts() -> None:
    """The exact sums, hand-derived from modeling_t5.py / modeling_bart.py:
    T5-Base = V·h + 12·(4h² + 2h·f + 2h) + 12·(8h² + 2h·f + 3h) + 2·32·12 + 2h (tied head),
    the T5 paper's "220M" for Base; BART-large against KerasHub's bart_large_en preset
    (keras_hub/src/models/bart/bart_presets.py, "params": 406287360), whose positional
    tables have P rows where transformers' BartLearnedPositionalEmbedding has P + 2 (2·2·h
    more), and fairseq's bart.large "400M"."""
    h, f, V = 768, 3072, 32128
    t5 = V * h + 12 * (4 * h * h + 2 * h * f + 2 * h) + 12 * (8 * h * h + 2 * h * f + 3 * h)
    t5 += 2 * 32 * 12 + 2 * h
    assert from_hf_config(T5_BASE, "t5-base/config.json").num_params == t5 == 222_903_552
    assert abs(t5 / 220e6 - 1) < 0.02
    h, f, V, P = 1024, 4096, 50265, 1026
    layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
    dec = layer + 4 * (h * h + h) + 2 * h
    bart = V * h + 2 * P * h + 2 * 2 * h + 12 * layer + 12 * dec
    assert from_hf_config(BART_LARGE, "bart-large/config.json").num_params == bart
    assert bart == 406_287_360 + 2 * 2 * h
    assert abs(bart / 400e6 - 1) < 0.02


def test_defaults_and_dropout() -> None:
    """Keys left out take T5Config's / BartConfig's defaults (transformers 5.24)."""
    t5 = from_hf_config({"model_type": "t5"}, "t5/config.json")
    assert (t5.hidden_size, t5.num_hidden_layers, t5.num_decoder_layers, t5.intermediate_size,
            t5.hidden_act, t5.mlp_kind, t5.tie_word_embeddings) == (
        512, 6, 6, 2048, "relu", "standard", True)
    assert t5.hidden_dropout_prob == t5.attention_probs_dropout_prob == 0.1
    mt5 = from_hf_config({"model_type": "mt5"}, "mt5/config.json")
    assert (mt5.vocab_size, mt5.intermediate_size, mt5.num_hidden_layers,
            mt5.num_attention_heads, mt5.mlp_kind) == (250112, 1024, 8, 6, "gated")
    v11 = from_hf_config(T5_V11_BASE, "v11/config.json")
    assert (v11.mlp_kind, v11.hidden_act, v11.tie_word_embeddings) == ("gated", "gelu_new", True)
    bart = from_hf_config(BART_LARGE, "bart/config.json")
    assert (bart.hidden_dropout_prob, bart.attention_probs_dropout_prob,
            bart.activation_dropout) == (0.1, 0.1, 0.1)


# ---- trace ------------------------------------------------------------------------------------
def _trace(cfg: dict[str, Any], **training: Any) -> Any:
    pytest.importorskip("transformers")
    from vramcalc.trace.engine import trace

    spec = from_hf_config(cfg, "small/config.json")
    scn = Scenario(model=spec, training=TrainingConfig(framework="hf", **training))
    return trace(scn, iterations=1)


@pytest.mark.parametrize("name", ["t5-odd", "bart-odd"])
def test_trace_builds_the_spec_and_scores_target_tokens(name: str) -> None:
    """The traced model holds the spec's parameters (fp32: 4 bytes each, each tensor rounded
    up to 512 B), and its peak grows with the decoder's tokens at a fixed source length by at
    least the head's output, (b, t, V) fp32 = 4·b·t·V bytes (V dominates h here)."""
    cfg, b, V = CONFIGS[name], 2, 1000
    spec = from_hf_config(cfg, "small/config.json")
    short = _trace(cfg, seq_len=64, target_len=16, micro_batch_size=b, precision="fp32",
                   optimizer="sgd")
    long = _trace(cfg, seq_len=64, target_len=48, micro_batch_size=b, precision="fp32",
                  optimizer="sgd")
    weights = short.param_bytes
    assert 4 * spec.num_params <= weights <= 4 * spec.num_params + 512 * 200
    for t, res in ((16, short), (48, long)):
        assert res.report.peak_allocated_bytes >= weights + 4 * b * t * V
    grow = long.report.peak_allocated_bytes - short.report.peak_allocated_bytes
    assert grow >= 4 * b * 32 * V


# ---- refusals ---------------------------------------------------------------------------------
def _run(args: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, err.getvalue()


def _one_error(code: int, err: str, words: str) -> None:
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert words in lines[0], lines[0]


@pytest.fixture()
def bart_json(tmp_path: Any) -> Any:
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(BART_LARGE))
    return path


@pytest.mark.parametrize(("cmd", "extra", "words"), [
    ("estimate", ["--attention", "eager", "--recompute", "selective"], "--recompute selective"),
    ("plan", ["--tp", "2", "--gpus", "2xA100"], "not tp=2"),
    ("estimate", ["--tp", "2", "--gpus", "2xA100"], "tp=2"),
    ("trace", ["--pp", "2", "--gpus", "2xA100"], "pp=2"),
    ("trace", ["--finetune", "lora"], "lora"),
    ("trace", ["--target-len", "2000"], "--target-len 2000"),
    ("trace", ["--seq-len", "2000"], "--seq-len 2000"),
    ("trace", ["--task", "masked-lm"], "is an encoder-decoder"),
    # torchtune's tables are its decoders'; the trace runs transformers' BART
    ("estimate", ["--framework", "torchtune"], "--framework torchtune"),
])
def test_unmodelled_is_refused(bart_json: Any, cmd: str, extra: list[str], words: str) -> None:
    code, err = _run([cmd, "--model", str(bart_json), "--seq-len", "512", *extra])
    _one_error(code, err, words)


@pytest.mark.parametrize(("args", "words"), [
    (["serve", "--model", "t5-base"], "serving encoder-decoder"),
    # an encoder keeps no KV cache: vLLM serves BERT-style models with its pooling runner
    (["serve", "--model", "bert-base"], "serving encoder-only"),
])
def test_other_commands_refuse(args: list[str], words: str) -> None:
    code, err = _run(args)
    _one_error(code, err, words)


def test_target_len_needs_an_encoder_decoder() -> None:
    code, err = _run(["estimate", "--model", "gpt2", "--seq-len", "512", "--target-len", "64"])
    _one_error(code, err, "not an encoder-decoder")


@pytest.mark.parametrize(("update", "words"), [
    ({"decoder_ffn_dim": 2048}, "encoder_ffn_dim != decoder_ffn_dim"),
    ({"decoder_attention_heads": 8}, "encoder_attention_heads"),
    ({"encoder_layerdrop": 0.1}, "layerdrop"),
])
def test_bart_shapes_not_modelled(update: dict[str, Any], words: str) -> None:
    from vramcalc.errors import InputError

    with pytest.raises(InputError, match=words):
        from_hf_config({**BART_LARGE, **update}, "bart/config.json")


# google-t5/t5-large config.json
T5_LARGE = {**T5_BASE, "d_ff": 4096, "d_model": 1024, "num_heads": 16, "num_layers": 24}


@pytest.mark.parametrize(("preset", "cfg"), [("t5-base", T5_BASE), ("t5-large", T5_LARGE),
                                             ("bart-large", BART_LARGE)])
def test_presets_are_their_configs(preset: str, cfg: dict[str, Any]) -> None:
    """The shipped presets describe the model the hub's config.json describes, parameter for
    parameter (transformers' numel)."""
    from vramcalc.catalog import load_preset

    spec = load_preset(preset).spec
    read = from_hf_config(cfg, f"{preset}/config.json")
    assert spec.model_dump(exclude={"name", "source"}) == read.model_dump(
        exclude={"name", "source"})
    assert spec.num_params == transformers_numel(cfg)


def test_trace_keeps_the_configs_dropout_masks() -> None:
    """BART with dropout and activation_dropout 0.1 (attention_dropout 0) against the same
    step with `--dropout 0`: at the end of forward the trace holds one bool mask more per
    dropout (CUDA's native_dropout keeps its mask; the next op saves the dropout output
    where it would save the input, the same size), hand-counted from modeling_bart.py:
    encoder: after layernorm_embedding (b·s·h), per layer after self-attention and after fc2
    (b·s·h each) and after the activation (b·s·f); decoder alike at t tokens with one more,
    after the cross-attention."""
    from vramcalc.units import round_alloc

    cfg = {**CONFIGS["bart-odd"], "attention_dropout": 0.0, "encoder_layers": 1,
           "decoder_layers": 2}
    b, s, t, h, f = 2, 64, 32, 64, 96
    kw = {"seq_len": s, "target_len": t, "micro_batch_size": b, "precision": "fp32",
          "attention": "eager", "optimizer": "sgd"}
    on = _trace(cfg, **kw).marks["end_forward"].terms()["activations"]
    off = _trace(cfg, dropout=0, **kw).marks["end_forward"].terms()["activations"]
    enc = round_alloc(b * s * h) * (1 + 2 * 1) + round_alloc(b * s * f) * 1
    dec = round_alloc(b * t * h) * (1 + 3 * 2) + round_alloc(b * t * f) * 2
    assert on - off == enc + dec


@pytest.mark.parametrize("proj", ["relu", "gated-gelu"])
def test_trace_keeps_t5s_dropout_masks(proj: str) -> None:
    """T5 (dropout_rate 0.1, fp32, eager) against `--dropout 0`, hand-counted from
    modeling_t5.py: a bool mask per nn.Dropout (after the embedding, after each
    self-/cross-attention and feed-forward block, inside the feed-forward before wo, after
    each stack's final_layer_norm); per attention the probabilities' mask and the dropout
    output p' (fp32) that p' @ v keeps where it would keep the softmax output. Inside the
    ReLU feed-forward (T5-Base's) ReLU keeps its own output for backward (threshold_backward
    takes the result), so wo's fp32 input, the dropout output, is kept beside it; in the
    gated one (T5 v1.1) the product gelu(wi_0 x) · wi_1 x keeps its operands, not its
    output, and the dropout output only replaces it."""
    from vramcalc.units import round_alloc

    cfg = {**CONFIGS["t5-odd"], "feed_forward_proj": proj}
    b, s, t, h, a, f = 2, 64, 32, 96, 3, 200
    Le, Ld = cfg["num_layers"], cfg["num_decoder_layers"]
    kw = {"seq_len": s, "target_len": t, "micro_batch_size": b, "precision": "fp32",
          "attention": "eager", "optimizer": "sgd"}
    on = _trace(cfg, **kw).marks["end_forward"].terms()["activations"]
    off = _trace(cfg, dropout=0, **kw).marks["end_forward"].terms()["activations"]

    def probs(q: int, k: int) -> int:  # bool mask + fp32 p'
        return round_alloc(b * a * q * k) + round_alloc(4 * b * a * q * k)

    def ff(q: int) -> int:  # bool mask (+ fp32 dropout output beside ReLU's)
        return round_alloc(b * q * f) + (round_alloc(4 * b * q * f) if proj == "relu" else 0)

    enc = round_alloc(b * s * h) * (2 + 2 * Le) + Le * (ff(s) + probs(s, s))
    dec = round_alloc(b * t * h) * (2 + 3 * Ld) + Ld * (ff(t) + probs(t, t) + probs(t, s))
    assert on - off == enc + dec


# ---- the analytic engine against the trace -----------------------------------------------
def _validation_rows() -> list[Any]:
    """validate's encoder-decoder scenarios, and T5 with a deeper decoder (2 + 3 layers)
    and d_kv·heads != d_model."""
    from vramcalc.validate.grid import seq2seq_grid

    odd = Scenario(model=from_hf_config(CONFIGS["t5-odd"], "t5-odd/config.json"),
                   training=TrainingConfig(framework="hf", seq_len=256, target_len=64,
                                           micro_batch_size=2, precision="amp-bf16",
                                           attention="eager", optimizer="adamw"))
    return [*seq2seq_grid(), ("t5-odd/amp-bf16", odd)]


@pytest.mark.parametrize(("name", "scn"), _validation_rows(), ids=lambda v: str(v)[:60])
def test_analytic_agrees_with_trace(name: str, scn: Scenario) -> None:
    """The analytic engine (vramcalc/analytic_seq2seq.py) against the trace engine running
    transformers' own T5 / BART (FakeTensorMode; eager attention and SDPA, which
    tests/test_seq2seq_flash.py and tests/test_t5_sdpa.py pin further): the saved activations and the loss's
    buffers at the end of forward exactly (the tables of vramcalc/terms/seq2seq.py list every
    storage, the checkpoints under recompute), weights, gradients and optimizer states
    exactly, each phase's peak within 1 % (without recompute), the step's peak within 1 %
    (validate's own bound is 3 %)."""
    pytest.importorskip("transformers")
    from vramcalc.validate.compare import PEAK_MAX_REL_ERROR, compare

    row = compare(name, scn)
    assert "error" not in row, row.get("error")
    for term in ("weights", "gradients", "optimizer_states", "activations", "logits"):
        pair = row["terms"][term]
        assert pair["analytic"] == pair["trace"], (term, pair)
    # without recompute every phase within 1 %; with it the re-run layer's instants are
    # modelled more coarsely (methodology §22), the step's peak still within 1 %
    phases = ("forward", "backward", "optimizer") if scn.training.recompute == "none" else (
        "optimizer",)
    for phase in phases:
        assert abs(row["phases"][phase]["rel_error"]) <= 0.01, (phase, row["phases"][phase])
    assert abs(row["rel_error"]) <= min(PEAK_MAX_REL_ERROR, 0.01), row["phases"]


def test_saved_tables_hand_count() -> None:
    """One T5 encoder layer in fp32 with dropout (eager), hand-counted from modeling_t5.py
    (b = 1, s = 512, h = 512, a = 8, d = 64, f = 2048; every storage a multiple of 512 B):
    self-attention: rsqrt (s fp32), x̂ and the normed output (s·h fp32 each), q, kᵀ, v and
    the output copy (4·s·a·d fp32), softmax and its dropout output (2·a·s² fp32) and mask
    (a·s² bool), the output dropout's mask (s·h bool), the residual (s·h fp32); FF: rsqrt,
    x̂, normed output, relu output and its dropout output (2·s·f fp32), mask (s·f bool), the
    output mask and residual."""
    from vramcalc.terms.seq2seq import S2S, encoder_layer_saved

    b, s, h, a, d, f = 1, 512, 512, 8, 64, 2048
    x = S2S(b=b, s=s, t=128, h=h, a=a, d=d, f=f, V=32128, c="fp32", r="fp32", t5=True,
            eager=True, hid=True, att=True, act=True, Le=2, Ld=2)
    attn = 4 * s + 2 * 4 * s * h + 4 * 4 * s * a * d + 2 * 4 * a * s * s + a * s * s + s * h
    attn += 4 * s * h
    ff = 4 * s + 2 * 4 * s * h + 2 * 4 * s * f + s * f + s * h + 4 * s * h
    assert sum(t.nbytes for t in encoder_layer_saved(x)) == attn + ff
    # layer 0 also keeps the (s, s) int64 relative-position buckets
    assert sum(t.nbytes for t in encoder_layer_saved(x, True)) == attn + ff + 8 * s * s


def test_estimate_cli_json() -> None:
    """`vramcalc estimate` answers for a T5 preset with eager attention: its weights are the
    preset's exact parameter count in fp32 (4 bytes each, 222,903,552 parameters for
    T5-Base: test_published_counts), each tensor rounded up to 512 B."""
    import json

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["estimate", "--model", "t5-base", "--gpus", "1xA100-80GB", "--seq-len",
                     "512", "--target-len", "128", "--attention", "eager", "--precision",
                     "amp-bf16", "--json"])
    assert code == 0, err.getvalue()
    rep = json.loads(out.getvalue())
    weights = rep["terms"]["weights"]
    assert 4 * 222_903_552 <= weights <= 4 * 222_903_552 + 512 * 200
    assert rep["peak_allocated_bytes"] > weights + rep["terms"]["optimizer_states"]
    assert rep["fits"] is True


def test_untied_bart_is_refused(tmp_path: Any) -> None:
    """An untied BART leaves `shared` without a gradient in transformers 5.x (each stack
    has its own embed_tokens): the analytic engine refuses it rather than count one."""
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS["bart-odd"]))
    code, err = _run(["estimate", "--model", str(path), "--seq-len", "96", "--target-len",
                      "32", "--attention", "eager"])
    _one_error(code, err, "tie_word_embeddings false")
