"""T5 / mT5 under `--attention flash` (transformers 5.24's attn_implementation "sdpa",
T5PreTrainedModel._supports_sdpa, modeling_t5.py L547): the relative position bias reaches
`F.scaled_dot_product_attention` as a float attn_mask (integrations/sdpa_attention.py L176-191),
one that requires grad for the self-attentions, so CUDA runs the memory-efficient kernel
(torch's sdp_utils_cpp.h `check_attn_mask_shape` refuses a mask that requires grad to cuDNN
and flash takes no mask). Pinned here: one attention's kept tensors by hand, the trace's
kernel calls, the kernel's backward scratch against the trace's, the analytic engine against
the trace (bf16 and autocast, no and full recompute, plain and gated FF, lengths that are and
are not multiples of 8)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_seq2seq_flash import op_calls
from vramcalc.hf_config import from_hf_config
from vramcalc.scenario import Scenario
from vramcalc.terms.seq2seq import S2S, decoder_layer_saved, edges_saved, encoder_layer_saved
from vramcalc.training import TrainingConfig
from vramcalc.units import round_alloc

# t5-small-like widths (google-t5/t5-small config.json: d_kv 64, dropout_rate 0.1), small
T5: dict[str, Any] = {
    "architectures": ["T5ForConditionalGeneration"], "d_ff": 512, "d_kv": 32, "d_model": 128,
    "dropout_rate": 0.1, "is_encoder_decoder": True, "model_type": "t5", "num_heads": 4,
    "num_layers": 2, "num_decoder_layers": 2, "relative_attention_num_buckets": 32,
    "vocab_size": 1024}
# T5 v1.1's gated-gelu FF, three encoder layers, d_kv·heads != d_model
GATED: dict[str, Any] = {**T5, "feed_forward_proj": "gated-gelu", "num_layers": 3,
                         "d_kv": 40, "num_heads": 3, "d_model": 96, "d_ff": 200,
                         "vocab_size": 1000}


def _x(b: int, s: int, t: int, a: int, d: int, c: str, r: str) -> S2S:
    return S2S(b=b, s=s, t=t, h=a * d, a=a, d=d, f=4 * a * d, V=1024, c=c, r=r, t5=True,
               eager=False, hid=True, att=False, act=True, Le=2, Ld=2)


def _core(saved: list[Any], block: str) -> dict[str, int]:
    keep = ("bias", "causal", "q", "k", "v", "out", "lse")
    return {t.name: t.nbytes for t in saved if t.name.split(".")[0] == block
            and len(t.name.split(".")) == 2 and t.name.split(".")[1] in keep}


def test_one_attention_by_hand() -> None:
    """One T5 self-attention under SDPA in bf16 (b = 2, s = 512 tokens, a = 8 heads of d = 64),
    hand-counted. compute_bias returns a permuted (1, a, s, s) view of the (s, s, a) embedding
    output (modeling_t5.py L279); create_position_bias_mask ends in `.contiguous()`
    (sdpa_attention.py L91): a (1, a, s, s) bf16 copy per layer, which the kernel keeps (its
    expand to (b, a, s, s) in attention.cpp `preprocess_mask` is a view; s is a multiple of 8,
    no pad). q, k, v: views of the projections (modeling_t5.py L327-346); the kernel's output
    (b, s, a, d) bf16; the logsumexp (b, a, s₃₂) fp32 (torch's meta kernel for
    `_scaled_dot_product_efficient_attention`: rows rounded up to 32). No (b, a, s, s) scores,
    probabilities or dropout mask (the attention dropout, dropout_rate at L362, runs in the
    kernel)."""
    b, s, a, d = 2, 512, 8, 64
    x = _x(b, s, 128, a, d, "bf16", "bf16")
    assert _core(encoder_layer_saved(x), "attn") == {
        "attn.bias": 2 * a * s * s, "attn.q": 2 * b * s * a * d, "attn.k": 2 * b * s * a * d,
        "attn.v": 2 * b * s * a * d, "attn.out": 2 * b * s * a * d, "attn.lse": 4 * b * a * s}
    assert not any("probs" in t.name for t in encoder_layer_saved(x))


def test_decoder_attentions_by_hand() -> None:
    """The decoder (t = 100 targets, s = 300 sources, amp-bf16, b = 2, a = 4, d = 32): its
    self-attention's mask is `torch.where(causal, bias, min)` (sdpa_attention.py L80), whose
    backward keeps the (1, 1, t, t) bool condition, cast to bf16 by autocast (SDPA is on its
    lower-precision list), padded to t₈ = 104 columns as t % 8 != 0 (attention.cpp
    `pad_bias`); the logsumexp has t₃₂ = 128 rows. The cross-attention's zeros (1, a, t, s)
    in q's dtype (modeling_t5.py L340) is one tensor all decoder layers pass on; s = 300 is
    no multiple of 8, so each layer's kernel keeps its own padded copy (1, a, t, 304). Each
    storage is rounded to the allocator's 512 B."""
    b, s, t, a, d = 2, 300, 100, 4, 32
    x = _x(b, s, t, a, d, "bf16", "fp32")
    dec = decoder_layer_saved(x)
    assert _core(dec, "attn")["attn.bias"] == round_alloc(2 * a * t * 104)
    assert _core(dec, "attn")["attn.causal"] == round_alloc(t * t)
    assert _core(dec, "attn")["attn.lse"] == round_alloc(4 * b * a * 128)
    assert _core(dec, "cross")["cross.bias"] == round_alloc(2 * a * t * 304)
    assert not any(e.name == "cross_bias" for e in edges_saved(x))
    aligned = _x(b, 304, t, a, d, "bf16", "fp32")  # s % 8 == 0: the shared zeros, once
    assert "cross.bias" not in _core(decoder_layer_saved(aligned), "cross")
    assert [e.nbytes for e in edges_saved(aligned) if e.name == "cross_bias"] == [
        round_alloc(2 * a * t * 304)]


def _scenario(cfg: dict[str, Any], **training: Any) -> Scenario:
    spec = from_hf_config(cfg, "t5-small/config.json")
    kw: dict[str, Any] = {"framework": "hf", "seq_len": 256, "target_len": 64,
                          "micro_batch_size": 2, "attention": "flash", "optimizer": "adamw"}
    return Scenario(model=spec, training=TrainingConfig(**{**kw, **training}))


def _kernel_calls(scn: Scenario) -> tuple[list[tuple[Any, ...]], dict[str, int]]:
    """(q length, k length, mask shape, mask batch stride, mask requires grad) of each
    memory-efficient kernel call, and how often each attention-ish op ran."""
    return op_calls(scn, "_scaled_dot_product_efficient_attention.default", lambda a, kw: (
        a[0].shape[2], a[1].shape[2], tuple(a[3].shape), a[3].stride(0), a[3].requires_grad))


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_trace_runs_the_efficient_kernel_with_the_bias(recompute: str) -> None:
    """Every one of the step's 2 + 2·2 attentions runs `_scaled_dot_product_efficient_attention`
    with the bias expanded to (b, a, q, k) (batch stride 0: `preprocess_mask`'s expand), the
    self-attentions' requiring grad, the cross-attentions' zeros only under gradient checkpointing
    (modeling_t5.py L346); each has its backward; no softmax runs but the loss's, and no
    dropout acts on (b, a, q, k) probabilities: the native_dropout calls are T5's hidden ones (3
    per encoder layer, 4 per decoder layer, 2 per stack), whatever the recompute re-runs."""
    s, t, a = 256, 64, 4
    calls, seen = _kernel_calls(_scenario(T5, precision="bf16", recompute=recompute))
    ck = recompute == "full"
    expect = ([(s, s, (2, a, s, s), 0, True)] * 2 + [(t, t, (2, a, t, t), 0, True)] * 2
              + [(t, s, (2, a, t, s), 0, ck)] * 2)
    if ck:  # every layer's forward runs again in backward
        expect = expect * 2
    assert sorted(calls) == sorted(expect)
    assert seen["_scaled_dot_product_efficient_attention_backward.default"] == 6
    assert "_softmax.default" not in seen and "_safe_softmax.default" not in seen
    assert seen["native_dropout.default"] == (2 * 3 + 2 * 4 + 4) * (2 if ck else 1) - (
        4 if ck else 0)  # (recompute: each layer's dropouts again, not the stacks')


@pytest.mark.parametrize(("b", "a", "q", "d", "dtype"), [
    (2, 8, 512, 64, "bfloat16"), (1, 12, 100, 40, "bfloat16"), (3, 4, 77, 64, "float32")])
def test_efficient_scratch_is_the_traces(b: int, a: int, q: int, d: int, dtype: str) -> None:
    """The analytic memory-efficient backward scratch (`efficient_scratch_bytes`) is what the
    trace allocates for it (vramcalc/trace/cuda_rules.py `efficient_backward_workspace`, real
    tensors of the kernel's shapes, each storage rounded to 512 B)."""
    torch = pytest.importorskip("torch")
    from vramcalc.terms.saved import efficient_scratch_bytes
    from vramcalc.trace.cuda_rules import efficient_backward_workspace
    from vramcalc.units import round_alloc

    with torch.device("meta"):
        made = efficient_backward_workspace(torch.empty(b, a, q, d, dtype=getattr(torch, dtype)))
    assert efficient_scratch_bytes(b, a, q, d, dtype == "float32") == sum(
        round_alloc(t.numel() * t.element_size()) for t in made)


@pytest.mark.parametrize("cfg", [T5, GATED], ids=["t5", "gated"])
@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("lengths", [(256, 64), (100, 37)], ids=["aligned", "padded"])
def test_analytic_agrees_with_trace(cfg: dict[str, Any], precision: str, recompute: str,
                                    lengths: tuple[int, int]) -> None:
    """The analytic engine against the trace of transformers' own T5 under SDPA: saved
    activations (checkpoints under recompute), loss buffers, weights, gradients and optimizer
    states exactly; without recompute each phase within 1 %, the step's peak within 1.5 %
    (the re-run layer's instants under recompute are modelled as for eager attention)."""
    pytest.importorskip("transformers")
    from vramcalc.validate.compare import compare

    s, t = lengths
    row = compare("t5/sdpa", _scenario(cfg, precision=precision, recompute=recompute,
                                       seq_len=s, target_len=t))
    assert "error" not in row, row.get("error")
    for term in ("weights", "gradients", "optimizer_states", "activations", "logits"):
        pair = row["terms"][term]
        assert pair["analytic"] == pair["trace"], (term, pair)
    assert abs(row["rel_error"]) <= 0.015, row["phases"]
    if recompute == "none":
        for phase, pair in row["phases"].items():
            assert abs(pair["rel_error"]) <= 0.01, (phase, pair)
