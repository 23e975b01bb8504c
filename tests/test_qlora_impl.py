"""QLoRA's 4-bit base per implementation and release (vramcalc/qlora.py).

Expected values come from the libraries' source, derived by hand here:

- bitsandbytes `MatMul4Bit.forward` (bitsandbytes/autograd/_functions.py) set
  `ctx.tensors = (A, B)` up to 0.43.1 (@ 4a6fb352) and `(None, B)` from 0.43.2 (@ ce53caf3;
  commit 9e753741, PR #1270): before, every 4-bit linear whose input needs a gradient holds
  that input;
- bitsandbytes `quantize_4bit(compress_statistics=False)` keeps an fp32 absmax per 64 values
  and the 16-entry fp32 NF4 code (0.41.1 @ 18e827d6, 0.50.1 @ 95f9af30);
- torchao `NF4Tensor.from_tensor` (torchao/dtypes/nf4tensor.py, v0.1 and v0.5.0): uint8 codes
  two per byte, int8 scalers per 64 values, bf16 quantization factors per 256 scalers
  (before v0.3, 9dbc5542: a strided view of a storage with one bf16 per 64 values), a bf16
  mean and a 16-entry bf16 table; `LinearNF4` saves the NF4 weight only.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from vramcalc.analytic import estimate
from vramcalc.cli import app, main
from vramcalc.options import build_scenario
from vramcalc.qlora import nf4_constant_bytes, nf4_layout
from vramcalc.training import TrainingConfig

runner = CliRunner()
R = 512  # CUDA caching allocator block


def rnd(n: int) -> int:
    return -(-n // R) * R


LLAMA2_7B = dict(model="llama2-7b", gpus="1xA100-40GB", precision="bf16-pure",
                 finetune="qlora", lora_targets="q,v", seq_len=1304, optimizer="paged-adamw")
T, H, F, L = 1304, 4096, 11008, 32  # Llama-2-7B, one sequence of 1304 tokens


@pytest.mark.parametrize("version,keeps", [("0.41.1", True), ("0.43.1", True),
                                           ("0.43.2", False), ("0.50.1", False),
                                           (None, False)])
def test_bnb_keeps_the_input_before_0_43_2(version: str | None, keeps: bool) -> None:
    tr = TrainingConfig(finetune="qlora", bnb_version=version)
    assert tr.nf4.keeps_input is keeps
    assert not TrainingConfig(finetune="qlora", qlora_impl="torchao").nf4.keeps_input


def test_old_bnb_adds_the_mlp_inputs_when_lora_keeps_the_attention_input() -> None:
    """q,v adapters without dropout keep the normed attention input themselves, so
    bitsandbytes 0.41.1 adds, per layer, the MLP input (T, h) that gate/up read and the
    down projection's input (T, f), both bf16; o's input is the attention output, kept
    anyway by SDPA's backward."""
    new = estimate(build_scenario(LLAMA2_7B))
    old = estimate(build_scenario({**LLAMA2_7B, "bnb_version": "0.41.1"}))
    per_layer = rnd(T * H * 2) + rnd(T * F * 2)
    for phase in ("forward", "backward"):
        assert old.phases[phase] - new.phases[phase] == L * per_layer
    assert old.phases["optimizer"] == new.phases["optimizer"]


def test_old_bnb_adds_the_attention_input_with_lora_dropout() -> None:
    """With lora_dropout > 0 the adapters keep their dropout output, not the normed input:
    bitsandbytes 0.41.1 then also holds the q/k/v input (one storage, T·h bf16) in every
    layer but the first, whose input needs no gradient (`ctx.tensors = (None, None)`)."""
    flags = {**LLAMA2_7B, "lora_dropout": 0.05}
    new = estimate(build_scenario(flags))
    old = estimate(build_scenario({**flags, "bnb_version": "0.41.1"}))
    expected = L * (2 * rnd(T * H * 2) + rnd(T * F * 2)) - rnd(T * H * 2)
    assert old.phases["forward"] - new.phases["forward"] == expected


def test_single_quantization_keeps_an_fp32_absmax() -> None:
    n = F * H
    single = nf4_layout("bnb", "0.41.1", None, False, False)
    assert nf4_constant_bytes(n, single) == rnd(n // 64 * 4) + rnd(16 * 4)
    double = nf4_layout(None, None, None, None, False)
    assert nf4_constant_bytes(n, double) == (rnd(n // 64) + rnd(n // 64 // 256 * 4)
                                             + rnd(256 * 4) + rnd(4) + rnd(16 * 4))


@pytest.mark.parametrize("version,factor_elems", [("0.1", F * H // 64),
                                                  ("0.5.0", F * H // 64 // 256)])
def test_torchao_nf4tensor_constants(version: str, factor_elems: int) -> None:
    n = F * H
    layout = nf4_layout("torchao", None, version, None, False)
    assert layout.double_quant and not layout.keeps_input
    assert nf4_constant_bytes(n, layout) == (rnd(n // 64) + rnd(factor_elems * 2) + rnd(2)
                                             + rnd(16 * 2))


def test_quantize_head_stores_lm_head_in_nf4() -> None:
    base = estimate(build_scenario(LLAMA2_7B))
    head = estimate(build_scenario({**LLAMA2_7B, "quantize_head": True}))
    n = 32000 * H  # Llama-2's lm_head
    assert base.subterms["weights/frozen"] - head.subterms["weights/frozen"] == rnd(n * 2)
    assert head.subterms["weights/nf4"] - base.subterms["weights/nf4"] == rnd(n // 2)


def test_quantize_head_refuses_a_tied_head(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "gpt2", "--finetune", "qlora", "--quantize-head"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "ties lm_head" in err[0]


@pytest.mark.parametrize("args,needle", [
    (["--bnb-version", "new"], "--bnb-version"),
    (["--torchao-version", "0.x"], "--torchao-version"),
    (["--qlora-impl", "torchao", "--no-nf4-double-quant"], "always quantizes"),
    (["--qlora-impl", "gptq"], "--qlora-impl"),
])
def test_bad_layout_options_exit_2(args: list[str], needle: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "7b", "--finetune", "qlora", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]


def test_json_strategy_names_the_layout_only_when_given() -> None:
    plain = runner.invoke(app, ["estimate", "--model", "7b", "--finetune", "qlora", "--json"])
    old = runner.invoke(app, ["estimate", "--model", "7b", "--finetune", "qlora", "--json",
                              "--bnb-version", "0.41.1"])
    assert "bnb_version" not in json.loads(plain.output)["strategy"]
    assert json.loads(old.output)["strategy"]["bnb_version"] == "0.41.1"


@pytest.mark.parametrize("extra", [
    {"bnb_version": "0.41.1", "lora_targets": "all-linear"},
    {"bnb_version": "0.41.1", "lora_dropout": 0.1},
    {"bnb_version": "0.41.1", "precision": "amp-bf16"},
    {"bnb_version": "0.41.1", "recompute": "full"},
    {"bnb_version": "0.41.1", "framework": "hf", "recompute": "full",
     "lora_targets": "all-linear"},
    {"bnb_version": "0.41.1", "framework": "hf", "precision": "amp-bf16"},
    {"nf4_double_quant": False},
    {"qlora_impl": "torchao", "precision": "bf16-pure"},
    {"qlora_impl": "torchao", "torchao_version": "0.1", "precision": "bf16-pure"},
])
def test_trace_of_the_layout_agrees(extra: dict[str, object]) -> None:
    """The trace engine runs the stand-in (vramcalc/trace/nf4.py) with the same layout:
    real autograd decides what the old MatMul4Bit's node attribute keeps alive — under
    autocast the 16-bit casts Linear4bit makes, under non-reentrant checkpointing every
    layer's 4-bit inputs (the attribute escapes the saved-tensor hooks)."""
    pytest.importorskip("torch")
    from vramcalc.scenario import Scenario
    from vramcalc.validate import SHAPES, compare

    tr = TrainingConfig(**{"finetune": "qlora", "seq_len": 256, **extra})  # type: ignore[arg-type]
    row = compare("qlora-layout", Scenario(model=SHAPES["llama-gqa"], training=tr))
    assert row["ok"], row
    assert row["terms"]["weights"]["rel_error"] == 0


def test_nf4_head_dequantizes_at_the_loss() -> None:
    """LitGPT's lm_head in NF4 with --chunked-ce 11 over 1304 tokens (chunks of 119 ×6 and
    118 ×5): the last chunk's head backward holds the other chunks' fp32 log-probabilities
    (+ their 0-dim total weight, + the loss), its bf16 dL/dlogits, the dequantized 32000 ×
    4096 bf16 weight (single quantization: no absmax decoding) and dL/dx (118, 4096)."""
    from vramcalc.rank import RankContext
    from vramcalc.terms.logits import logits_backward_peak_bytes

    flags = {**LLAMA2_7B, "chunked_ce": 11, "lora_dropout": 0.05, "bnb_version": "0.41.1",
             "nf4_double_quant": False, "quantize_head": True}
    scn = build_scenario(flags).resolved()
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    V = 32000
    chunks = [119] * 6 + [118] * 5
    others = R + sum(rnd(n * V * 4) + R for n in chunks[:-1])
    expected = others + rnd(118 * V * 2) + rnd(V * H * 2) + rnd(118 * H * 2)
    assert logits_backward_peak_bytes(ctx) == expected
