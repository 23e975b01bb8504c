"""BART with `--attention flash` (transformers' attn_implementation "sdpa", its default):
what one attention keeps, hand-counted from transformers 5.24's modeling_bart.py and
integrations/sdpa_attention.py; that the trace runs PyTorch's flash kernel (which
vramcalc/trace/cuda_rules.py turns into CUDA's) with no attention mask and no attention
dropout mask; the analytic engine against that trace; and T5 under flash answering."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

import pytest

from vramcalc.cli import main
from vramcalc.hf_config import from_hf_config
from vramcalc.scenario import Scenario
from vramcalc.terms.seq2seq import S2S, attention_core, checkpoint_saved
from vramcalc.training import TrainingConfig

# facebook/bart-base's dropout (0.1 each, as bart-large's config.json), small widths
SMALL: dict[str, Any] = {
    "model_type": "bart", "d_model": 128, "encoder_layers": 2, "decoder_layers": 2,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 512,
    "decoder_ffn_dim": 512, "vocab_size": 1024, "max_position_embeddings": 512,
    "dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1}


def test_one_attention_by_hand() -> None:
    """One BART attention under SDPA in bf16 (b = 2, q = 128 queries over k = 512 keys, a =
    12 heads of d = 64: a cross-attention), hand-counted: q, k, v are views of the
    q_proj / k_proj / v_proj outputs (modeling_bart.py L207, L227-228), b·{q,k}·a·d bf16
    each; the kernel's output (b, q, a, d) bf16, which out_proj reads as it is (sdpa_attention.py
    L195's transpose(1, 2).contiguous() and modeling_bart.py L254's reshape are views of
    FlashAttention-2's (b, q, a, d) output); the logsumexp (b, a, q) in fp32. No (b, a, q, k)
    tensor: no scores, probabilities, dropout mask or out_proj input copy."""
    b, q, k, a, d = 2, 128, 512, 12, 64
    x = S2S(b=b, s=k, t=q, h=a * d, a=a, d=d, f=3072, V=1024, c="bf16", r="bf16", t5=False,
            eager=False, hid=True, att=False, act=True, Le=2, Ld=2)
    kept = {t.name: t.nbytes for t in attention_core(x, "cross", q, k)}
    assert kept == {"cross.q": 2 * b * q * a * d, "cross.k": 2 * b * k * a * d,
                    "cross.v": 2 * b * k * a * d, "cross.out": 2 * b * q * a * d,
                    "cross.lse": 4 * b * a * q}
    # under gradient checkpointing the decoder's causal mask is no checkpoint input: SDPA
    # takes is_causal (sdpa_attention.py L148), eager a (b, 1, t, t) additive mask
    assert not any("causal_mask" in t.name for t in checkpoint_saved(x))
    eager = S2S(**{**x.__dict__, "eager": True})
    assert [t.nbytes for t in checkpoint_saved(eager) if "causal_mask" in t.name] == [
        2 * b * q * q]


@pytest.mark.parametrize(("b", "a", "q", "k", "d"), [
    (2, 12, 128, 512, 64), (1, 16, 1000, 1000, 80), (3, 4, 77, 200, 160)])
def test_flash_scratch_is_the_traces(b: int, a: int, q: int, k: int, d: int) -> None:
    """The analytic FlashAttention-2 backward scratch (`flash_scratch_bytes`) is what the
    trace allocates for it (vramcalc/trace/cuda_rules.py `flash_backward_workspace`: real
    tensors of the kernel's shapes, each storage rounded to 512 B), for the queries' length
    whatever the keys' (the cross-attention's dq_accum is (b, t₁₂₈, a, d₃₂))."""
    torch = pytest.importorskip("torch")
    from vramcalc.terms.saved import flash_scratch_bytes
    from vramcalc.trace.cuda_rules import flash_backward_workspace
    from vramcalc.units import round_alloc

    with torch.device("meta"):
        qt, kt = torch.empty(b, a, q, d, dtype=torch.bfloat16), torch.empty(b, a, k, d)
        made = flash_backward_workspace(qt, kt)
    assert len(made) == 2 and all(t.dtype == torch.float32 for t in made)
    assert flash_scratch_bytes(b, a, q, d) == sum(
        round_alloc(t.numel() * t.element_size()) for t in made)


def _scenario(**training: Any) -> Scenario:
    spec = from_hf_config(SMALL, "bart-small/config.json")
    return Scenario(model=spec, training=TrainingConfig(
        framework="hf", seq_len=256, target_len=64, micro_batch_size=2, attention="flash",
        optimizer="adamw", **training))


def op_calls(scn: Scenario, op: str, record: Callable[[Any, Any], tuple[Any, ...]]
             ) -> tuple[list[tuple[Any, ...]], dict[str, int]]:
    """Trace `scn` (one step): `record(args, kwargs)` of every call of the aten op named
    `op` (as vramcalc/trace/cuda_rules.py `rewrite_op` sees it), and how often each
    attention, softmax and dropout op ran."""
    pytest.importorskip("transformers")
    import vramcalc.trace.cuda_rules as rules
    from vramcalc.trace.engine import trace

    calls: list[tuple[Any, ...]] = []
    seen: dict[str, int] = {}
    original = rules.rewrite_op

    def spy(func: Any, args: Any, kwargs: Any, track: Any) -> Any:
        name = func.__name__
        if any(w in name for w in ("attention", "dropout", "softmax")):
            seen[name] = seen.get(name, 0) + 1
        if name == op:
            calls.append(record(args, kwargs))
        return original(func, args, kwargs, track)

    rules.rewrite_op = spy
    try:
        trace(scn, iterations=1)
    finally:
        rules.rewrite_op = original
    return calls, seen


def _flash_calls(scn: Scenario) -> tuple[list[tuple[Any, ...]], dict[str, int]]:
    """(query length, key length, is_causal, attn_mask, dropout_p) of every call of
    PyTorch's CPU flash kernel."""
    return op_calls(scn, "_scaled_dot_product_flash_attention_for_cpu.default", lambda a, kw: (
        a[0].shape[2], a[1].shape[2], bool(a[4]) if len(a) > 4 else False,
        kw.get("attn_mask"), a[3] if len(a) > 3 else 0.0))


def test_trace_runs_the_flash_kernel_without_masks() -> None:
    """Without padding transformers passes SDPA no mask (masking_utils.py L292, L354): the
    encoder's and the cross-attentions' calls are not causal, the decoder's self-attentions
    are (sdpa_attention.py L148), and none gets an attn_mask. The config's
    attention_dropout 0.1 is built as 0 under flash (CUDA's fused kernel keeps no mask; CPU
    SDPA with dropout would take the math path), so all 2 + 2·2 attentions of the step run
    `_scaled_dot_product_flash_attention_for_cpu` (which vramcalc/trace/cuda_rules.py
    allocates as CUDA's flash kernel), forward and backward, and no softmax runs but the
    loss's; the dropouts left are the 3 per encoder layer and 4 per decoder layer outside
    attention and one per embedding (modeling_bart.py BartEncoderLayer, BartDecoderLayer,
    the stacks' forward)."""
    s, t = 256, 64
    calls, seen = _flash_calls(_scenario(precision="bf16"))
    assert sorted(calls, key=str) == sorted(
        [(s, s, False, None, 0.0)] * 2 + [(t, t, True, None, 0.0)] * 2
        + [(t, s, False, None, 0.0)] * 2, key=str)
    assert seen["_scaled_dot_product_flash_attention_for_cpu_backward.default"] == 6
    assert seen["native_dropout.default"] == 2 * 3 + 2 * 4 + 2
    assert "_softmax.default" not in seen


@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_analytic_agrees_with_trace(precision: str, recompute: str) -> None:
    """The analytic engine against the trace of transformers' own BART under SDPA: saved
    activations (checkpoints under recompute), loss buffers, weights, gradients and
    optimizer states exactly; the step's peak within validate's 3 %, and without recompute
    each phase within 1 % (as tests/test_seq2seq.py asks of eager attention)."""
    pytest.importorskip("transformers")
    from vramcalc.validate.compare import PEAK_MAX_REL_ERROR, compare

    row = compare("bart-small/flash", _scenario(precision=precision, recompute=recompute))
    assert "error" not in row, row.get("error")
    for term in ("weights", "gradients", "optimizer_states", "activations", "logits"):
        pair = row["terms"][term]
        assert pair["analytic"] == pair["trace"], (term, pair)
    assert abs(row["rel_error"]) <= PEAK_MAX_REL_ERROR, row["phases"]
    if recompute == "none":
        for phase, pair in row["phases"].items():
            assert abs(pair["rel_error"]) <= 0.01, (phase, pair)


def _run(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("model", ["bart-large", "t5-base"])
def test_default_flash_estimates(model: str) -> None:
    """The commands that were refused: `estimate --model bart-large --seq-len 1024` and
    `--model t5-base` (T5PreTrainedModel._supports_sdpa) with the default flash attention
    answer, with the same weights as eager and a lower forward (no (b, a, s, s)
    probabilities, dropout masks or scores are kept; tests/test_t5_sdpa.py pins what T5
    keeps)."""
    import json

    base = ["estimate", "--model", model, "--seq-len", "1024" if model == "bart-large" else
            "512", "--gpus", "1xA100-80GB", "--json"]
    code, out, err = _run(base)
    assert code == 0, err
    flash = json.loads(out)
    code, out, err = _run([*base, "--attention", "eager"])
    assert code == 0, err
    eager = json.loads(out)
    assert flash["terms"]["weights"] == eager["terms"]["weights"]
    assert flash["phases"]["forward"] < eager["phases"]["forward"]
