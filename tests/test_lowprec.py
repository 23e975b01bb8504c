"""FP8 (Transformer Engine) and quantization-aware training: trace, analytic engine, CLI.

Independent sources for the expected values (hand-derived here, never read back from the
analytic engine):
- Transformer Engine @ d0067d0d (github:NVIDIA/TransformerEngine):
  common/recipe/__init__.py `DelayedScaling.amax_history_len = 1024`;
  pytorch/module/base.py `set_meta_tensor`: 3 FP8 tensors per GEMM in forward (input,
  weight, output), 2 in backward (grad_output, grad_input); pytorch/quantization.py
  `DelayedScalingRecipeState`: `scale` (k,) fp32 and `amax_history` (1024, k) fp32;
  tensor/float8_tensor.py: a Float8Tensor holds `_data` (shape) and, without non-TN FP8
  GEMMs, `_transpose` (last dim first), uint8-sized, plus a (1,) fp32 `_scale_inv`;
  module/linear.py: the input is quantized row- and column-wise and only the column-wise
  copy is kept for backward (`update_usage(rowwise_usage=False)`); the weight workspace is
  cached (`_fp8_workspaces`) when `is_first_microbatch` is passed. TE maintainers confirm
  the resulting memory picture in TE issues #1261 / #1764 (transpose cache, ~50 % less
  linear-input activation memory) and #1429 (FP8 uses more memory than BF16 overall).
- PyTorch: `fake_quantize_per_channel_affine` dispatches to
  `fake_quantize_per_channel_affine_cachemask`, whose backward needs only the bool mask
  (tools/autograd/derivatives.yaml); F.linear keeps its input and weight.
- torchao QAT (github:pytorch/ao @ 36027d82, qat/fake_quantizer.py): int4 weights per group
  of 32, int8 per-token activations with fp32 scales and int32 zero points kept on the
  fake quantizer.
Every tensor below is a multiple of 512 bytes, so the allocator's rounding is exact.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from vramcalc.analytic import estimate
from vramcalc.catalog import resolve_model
from vramcalc.cli import app, main
from vramcalc.errors import InputError
from vramcalc.model import ModelSpec
from vramcalc.options import build_scenario
from vramcalc.parallel import ParallelConfig
from vramcalc.scenario import Scenario
from vramcalc.training import TrainingConfig

runner = CliRunner()

# a small Llama-style shape: every tensor a multiple of 512 bytes, traces in ~1 s
H, L, A, G, F_, V = 256, 2, 4, 2, 768, 1024
D = H // A
B, S = 2, 256
T = B * S
SPEC = ModelSpec(name="tiny", hidden_size=H, num_hidden_layers=L, num_attention_heads=A,
                 num_key_value_heads=G, intermediate_size=F_, vocab_size=V)
# block linears (out, in): q, k, v, o, gate, up, down
LINEARS = [(A * D, H), (G * D, H), (G * D, H), (H, A * D), (F_, H), (F_, H), (H, F_)]
N_LAYER = sum(o * i for o, i in LINEARS)


def scn(**kw) -> Scenario:  # noqa: ANN003
    return Scenario(model=SPEC, training=TrainingConfig(seq_len=S, micro_batch_size=B, **kw),
                    parallel=ParallelConfig())


def traced(s: Scenario):  # noqa: ANN201
    pytest.importorskip("torch")
    from vramcalc.trace.engine import trace

    return trace(s)


def end_forward(res, key: str) -> int:  # noqa: ANN001
    return res.marks["end_forward"].terms().get(key, 0) if "/" not in key else (
        res.marks["end_forward"].parts.get(key, 0))


# ---- FP8: the trace's stand-in against Transformer Engine's storages ---------------------
def test_fp8_saved_inputs_are_one_byte_transposes_hand_derived() -> None:
    """End-of-forward activations, FP8 minus bf16 (both traced), per layer: bf16 keeps the
    normed attention input, the MLP input and down_proj's input (2 B each; o_proj reads a
    view of the SDPA output); FP8 keeps one e4m3 copy (1 B) of each distinct linear input —
    o_proj's included — plus a 512-byte block for each (1,) fp32 scale_inv."""
    bf16 = traced(scn(precision="bf16"))
    fp8 = traced(scn(precision="fp8"))
    bf16_inputs = 2 * T * H + 2 * T * H + 2 * T * F_
    fp8_inputs = T * H + T * A * D + T * H + T * F_ + 4 * 512
    expected = L * (fp8_inputs - bf16_inputs)
    assert end_forward(fp8, "activations") - end_forward(bf16, "activations") == expected
    assert expected < 0  # TE issue #1764: FP8 halves the linear inputs' memory


def test_fp8_weight_cache_and_meta_hand_derived() -> None:
    """Cached FP8 weights: data + transpose (1 B each) + a 512-byte scale_inv block per
    linear on Hopper; data only on B200 (non-TN GEMMs). Delayed-scaling meta per linear:
    scale (3,) and (2,) fp32 -> 512 B each, amax_history (1024, 3) and (1024, 2) fp32."""
    meta_per_linear = 512 + 1024 * 3 * 4 + 512 + 1024 * 2 * 4
    assert meta_per_linear == 21_504
    h100 = build_scenario({"model": "llama3-8b", "gpus": "1xH100", "precision": "fp8",
                           "seq_len": S, "micro_batch_size": B})
    res = traced(h100.model_copy(update={"model": SPEC}))
    parts = res.marks["end_step"].parts
    assert parts["transients/fp8_weight_cache"] == L * (2 * N_LAYER + 7 * 512)
    assert parts["transients/fp8_meta"] == L * 7 * meta_per_linear
    # Llama-3-8B: 32 layers x 218,103,808 block-linear weights (h 4096, kv 1024, f 14336)
    n_8b = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert n_8b == 6_979_321_856
    for gpus, copies in (("1xH100", 2), ("1xB200", 1)):
        rep = estimate(build_scenario({"model": "llama3-8b", "gpus": gpus, "precision": "fp8",
                                       "seq_len": 1024}))
        assert rep.subterms["transients/fp8_weight_cache"] == copies * n_8b + 224 * 512
        assert rep.subterms["transients/fp8_meta"] == 224 * meta_per_linear


def test_fp8_b200_trace_has_no_transposes() -> None:
    s = build_scenario({"model": "llama3-8b", "gpus": "1xB200", "precision": "fp8"})
    res = traced(s.model_copy(update={"model": SPEC, "training": scn(precision="fp8").training}))
    assert res.marks["end_step"].parts["transients/fp8_weight_cache"] == L * (N_LAYER + 7 * 512)


def test_fp8_stand_in_keeps_real_float8_tensors() -> None:
    torch = pytest.importorskip("torch")
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.lowprec import FP8Linear, QATLinear, _InputCache

    packed: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def pack(t):  # noqa: ANN001, ANN202
        packed.append((t.dtype, tuple(t.shape)))
        return t

    with FakeTensorMode():
        lin = nn.Linear(H, F_, bias=False, dtype=torch.bfloat16)
        fp8 = FP8Linear(lin, transpose=True, cache=_InputCache())
        assert fp8.w_data.dtype == torch.float8_e4m3fn and fp8.w_trans.shape == (H, F_)
        x = torch.empty(B, S, H, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fp8(x)
        assert y.shape == (B, S, F_) and y.dtype == torch.bfloat16
        assert packed == [(torch.float8_e4m3fn, (H, T)), (torch.float32, (1,))]
        packed.clear()
        qat = QATLinear(nn.Linear(H, F_, bias=False, dtype=torch.bfloat16), "int4", T)
        assert qat.w_scale.shape == (F_ * H // 32,) and qat.a_zero.dtype == torch.int32
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            qat(x)
    masks = [p for p in packed if p[0] == torch.bool]
    assert sorted(m[1] for m in masks) == sorted([(T, H), (F_ * H // 32, 32)])
    # F.linear keeps the fake-quantized weight (out, in) in bf16, not the parameter
    assert (torch.bfloat16, (F_, H)) in packed or (torch.bfloat16, (H, F_)) in packed


# ---- QAT: real torch fake-quant ops ----------------------------------------------------------
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_qat_saved_tensors_hand_derived(scheme: str) -> None:
    """Per layer and linear, the fake-quant ops keep a bool mask of their input and F.linear
    the fake-quantized input and weight (bf16): (T·in + n)·(2 + 1) bytes; q, k and v each
    quantize the normed input. bf16 kept the normed input, MLP input and down input once."""
    bf16 = traced(scn(precision="bf16"))
    qat = traced(scn(precision="bf16", qat=scheme))
    per_layer = sum(3 * (T * i + o * i) for o, i in LINEARS) - (2 * T * H + 2 * T * H
                                                               + 2 * T * F_)
    assert end_forward(qat, "activations") - end_forward(bf16, "activations") == L * per_layer
    # qparams kept by the fake quantizers: weights per channel (int8) or per 32 columns
    # (int4), activations per token; fp32 scale + int32 zero point (4 B each)
    groups = sum(o if scheme == "int8" else o * i // 32 for o, i in LINEARS)
    qp = L * 2 * 4 * (groups + 7 * T)
    assert qat.marks["end_step"].parts["transients/qat_qparams"] == qp


# ---- the analytic engine against the trace ---------------------------------------------
AGREEMENT = [
    {"precision": "fp8"},
    {"precision": "fp8", "attention": "eager"},
    {"precision": "fp8", "recompute": "selective"},
    {"precision": "fp8", "recompute": "full"},
    {"precision": "fp8", "attention": "eager", "recompute": "selective", "grad_accum": 2},
    {"qat": "int8"},
    {"qat": "int4", "attention": "eager"},
    {"qat": "int4", "recompute": "selective"},
    {"qat": "int8", "recompute": "full", "precision": "bf16-pure"},
    {"qat": "int4", "precision": "fp32", "attention": "eager", "recompute": "selective"},
]


@pytest.mark.parametrize("kw", AGREEMENT, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_analytic_matches_trace(kw: dict) -> None:
    pytest.importorskip("torch")
    from vramcalc.validate import PEAK_MAX_REL_ERROR, compare

    row = compare("tiny", scn(**kw))
    assert "error" not in row, row.get("error")
    assert abs(row["rel_error"]) <= PEAK_MAX_REL_ERROR, row["rel_error"]
    for term in ("weights", "gradients", "optimizer_states"):
        assert row["terms"][term]["analytic"] == row["terms"][term]["trace"], term
    assert abs(row["terms"]["activations"]["rel_error"]) <= 0.03


def test_model_states_of_fp8_are_bf16_mixed_precision() -> None:
    """TE + Megatron: bf16 weights and gradients, fp32 master + fp32 Adam (2 + 2 + 12 B)."""
    for zero in (0, 1):
        par = ParallelConfig(dp=8, zero=zero)
        a = estimate(Scenario(model=SPEC, training=TrainingConfig(precision="fp8"),
                              parallel=par))
        b = estimate(Scenario(model=SPEC, training=TrainingConfig(precision="bf16"),
                              parallel=par))
        for term in ("weights", "optimizer_states"):
            assert getattr(a.terms, term) == getattr(b.terms, term)


# ---- options, errors, CLI, planner, speed -----------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["--precision", "fp8", "--gpus", "1xA100"], "FP8 tensor cores"),
    (["--precision", "fp8", "--finetune", "qlora"], "NF4"),
    (["--qat", "int4", "--finetune", "qlora"], "not modelled"),
    (["--qat", "int4", "--precision", "fp8"], "cannot be combined"),
    (["--qat", "int8", "--precision", "amp-bf16"], "autocast"),
    (["--qat", "int8", "--framework", "hf"], "reference profile"),
    (["--precision", "fp8", "--gpus", "8xH100", "--zero", "3"], "ZeRO-3"),
    (["--qat", "int2"], "unknown value"),
])
def test_bad_combinations_exit_2_with_one_line(args: list[str], needle: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--model", "8b", "--seq-len", "1024", *args]
    if "--gpus" not in args:
        argv += ["--gpus", "1xH100"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1, err


def test_moe_is_refused() -> None:
    with pytest.raises(InputError, match="mixture-of-experts"):
        estimate(build_scenario({"model": "mixtral-8x7b", "gpus": "8xH100", "qat": "int8"}))


def test_config_file_keys_and_json(tmp_path) -> None:  # noqa: ANN001
    cfg = tmp_path / "train.yaml"
    cfg.write_text("model: 8b\ngpus: 8xH100\nprecision: fp8\nzero: 1\nseq_len: 2048\n")
    result = runner.invoke(app, ["check", str(cfg), "--json"])
    assert result.exit_code in (0, 1), result.output
    doc = json.loads(result.output)
    rep = doc.get("report", doc)
    assert rep["strategy"]["precision"] == "fp8"
    assert rep["subterms"]["transients/fp8_weight_cache"] > 0
    s = build_scenario({"model": "8b", "gpus": "1xH100", "qat": "int4"})
    assert s.training.qat == "int4"


def test_explain_states_the_fp8_and_qat_formulas() -> None:
    for flag, title in ((["--precision", "fp8"], "FP8"), (["--qat", "int4"], "Quantization")):
        result = runner.invoke(app, ["explain", "--model", "8b", "--gpus", "8xH100",
                                     "--zero", "1", *flag])
        assert result.exit_code == 0, result.output
        assert title in result.output
    # 6,979,321,856 block-linear weights in Llama-3-8B (32 x 218,103,808, counted above)
    assert "6,979,321,856" in result.output


def test_planner_proposes_fp8_only_on_fp8_gpus() -> None:
    from vramcalc.cli.plan import prepare_plan
    from vramcalc.planner import search

    seen = {}
    for gpus in ("8xH100", "8xA100"):
        base, req, _ = prepare_plan({"model": "8b", "gpus": gpus}, allow="precision")
        res = search(base, req)
        seen[gpus] = {e.report.strategy["precision"] for e in res.entries}
        for e in res.entries:
            assert e.report.fits
    assert "fp8" not in seen["8xA100"]
    assert "fp8" in seen["8xH100"]  # 2x the dense peak on the block linears wins


def test_fp8_speed_between_bf16_and_fp8_peaks() -> None:
    from vramcalc.hardware import load_profiles
    from vramcalc.speed import SpeedModel

    gpu = load_profiles()["h100_sxm"]
    spec, _ = resolve_model("8b")
    fp8 = SpeedModel(spec, gpu, 8, 4096, "fp8").peak
    bf16 = SpeedModel(spec, gpu, 8, 4096, "bf16").peak
    # datasheet dense peaks in the profile: 989 (bf16) and 1979 (fp8) TFLOP/s
    assert bf16 == 989e12
    assert bf16 < fp8 < 1979e12


def test_planner_memory_bound_is_sound_for_fp8() -> None:
    """The planner's lower bound (1-byte activation floor for FP8) never exceeds the engine."""
    import random

    from vramcalc.cli.plan import prepare_plan
    from vramcalc.planner import MemoryBound, enumerate_candidates, estimate_candidate

    base, req, _ = prepare_plan({"model": "8b", "gpus": "8xH100", "precision": "fp8",
                                 "seq_len": 8192})
    cands, _, _ = enumerate_candidates(base, req)
    bound = MemoryBound(base)
    checked = 0
    for c in random.Random(7).sample(cands, min(80, len(cands))):
        e = estimate_candidate(c, base, req)
        if e is None:
            continue
        assert bound.total(c) <= e.report.device_total_bytes, c
        checked += 1
    assert checked > 10


def test_fp8_odd_widths_get_a_note_int4_odd_groups_an_error() -> None:
    """TE asserts FP8 GEMM dims divisible by 16 (assert_dim_for_fp8_exec): a note, since
    padding fixes it; int4 groups of 32 cannot split 1000 columns: an error."""
    odd = SPEC.model_copy(update={"intermediate_size": 1000})
    rep = estimate(Scenario(model=odd, training=TrainingConfig(precision="fp8")))
    assert any("padded" in n and "1000" in n for n in rep.notes)
    with pytest.raises(InputError, match="multiple of the group size 32"):
        estimate(Scenario(model=odd, training=TrainingConfig(qat="int4")))
