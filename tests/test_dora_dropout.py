"""PEFT's DoRA with dropout (hf profile): peft 0.21.2 tuners/lora/variants.py
`DoraLinearVariant.forward` drops the input and passes `base_result=None`, so
`DoraLinearLayer.forward` (dora.py) recomputes the base output as
`F.linear(x, W.to(x.dtype))` from the dropped input, which PEFT cast to the fp32 adapters'
dtype: that output is fp32 without autocast, and the matmul keeps its weight operand, the
fp32 copy of a 16-bit weight, for dL/dx. Expected values from those lines, by hand; the
trace engine runs PEFT itself as the referee.
"""

from __future__ import annotations

import pytest

from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms.finetune_activations import adapter_saved, dora_weight_copy_bytes
from vramcalc.terms.saved import dims
from vramcalc.validate import scenario_for


def _ctx(precision: str, dropout: float) -> RankContext:
    scn = build_scenario({"model": "llama3.1-8b", "framework": "hf", "finetune": "dora",
                          "lora_targets": "all-linear", "precision": precision,
                          "lora_dropout": dropout, "seq_len": 2048}).resolved()
    return RankContext(scn.model, scn.training, scn.parallel)


def _dtypes(ctx: RankContext) -> dict[str, str]:
    saved, _ = adapter_saved(ctx, dims(ctx), "q")
    return {t.name.split(".", 2)[2]: t.dtype for t in saved}


def test_the_recomputed_base_output_is_in_the_inputs_dtype() -> None:
    assert _dtypes(_ctx("bf16-pure", 0.0))["dora_base_out"] == "bf16"  # the base layer's
    assert _dtypes(_ctx("bf16-pure", 0.1))["dora_base_out"] == "fp32"
    auto = _dtypes(_ctx("bf16-autocast", 0.1))  # autocast runs the matmul in bf16
    assert auto["dora_base_out"] == "bf16" and auto["dora_weight_cast"] == "bf16"


def test_each_layer_keeps_fp32_copies_of_its_adapted_weights() -> None:
    # Llama-3.1-8B: q, o 4096 x 4096; k, v 1024 x 4096; gate, up, down 4096 x 14336
    elements = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336
    assert dora_weight_copy_bytes(_ctx("bf16-pure", 0.1)) == elements * 4
    assert dora_weight_copy_bytes(_ctx("bf16-pure", 0.0)) == 0
    assert dora_weight_copy_bytes(_ctx("amp-bf16", 0.1)) == elements * 2  # a second cast


def test_the_trace_agrees_on_what_the_layers_keep() -> None:
    pytest.importorskip("peft")
    from vramcalc.validate.compare import compare

    name, scn = scenario_for("llama-gqa", framework="hf", precision="bf16-pure",
                             finetune="dora", lora_targets="all-linear", lora_dropout=0.1,
                             micro_batch_size=4, seq_len=2048, trl_chunked_ce=True)
    row = compare(name, scn)  # what the micro-batch keeps at the end of forward
    assert abs(row["terms"]["activations"]["rel_error"]) < 1e-3
    # the forward's DoRA temporaries are still short (methodology §20): within 3 %
    assert abs(row["rel_error"]) < 0.03
