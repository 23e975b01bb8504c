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


def test_a_recomputed_layer_keeps_its_weight_copies_until_their_backward() -> None:
    # full recompute: the re-run's base matmuls keep W.to(fp32) (q: 1024 x 1024, v: 256 x
    # 1024 in llama-deep) until each linear's dL/dx, so the MLP's and the MoE's backward
    # instants hold both copies; at q's re-run instant v has kept nothing yet, and W.to(fp32)
    # is the weight norm's own copy (counted once)
    from vramcalc.terms.finetune_modifier import _recomputed_casts

    kw = {"finetune": "dora", "recompute": "full", "precision": "bf16", "lora_dropout": 0.1,
          "lora_targets": "q,v", "micro_batch_size": 1, "seq_len": 512}
    _, scn = scenario_for("llama-deep", framework="hf", **kw)
    scn = scn.resolved()
    casts = _recomputed_casts(RankContext(scn.model, scn.training, scn.parallel))
    # (at the post-attention norm's instant no attention projection's backward has run)
    assert casts == {"mlp": (1024 + 256) * 1024 * 4, "attention": (1024 + 256) * 1024 * 4,
                     "post_norm": (1024 + 256) * 1024 * 4, "down": 0}
    pytest.importorskip("peft")
    from vramcalc.validate.compare import compare

    for shape in ("llama-deep", "qwen3-moe"):  # were +0.5 % and +1.8 % (forward +2.2 %)
        row = compare(*scenario_for(shape, framework="hf", **kw))
        for phase in ("forward", "backward"):
            assert abs(row["phases"][phase]["rel_error"]) < 1e-3, (shape, phase, row["phases"])


def test_eager_attention_returns_its_probabilities_to_the_layer() -> None:
    # transformers' decoder layer binds the eager attention's returned probabilities
    # (b, a, s, s in the query's dtype) until it returns: under a checkpointed core they are
    # not saved, so they are one more local through the MLP (llama-deep: 16 heads)
    from vramcalc.terms.saved import dims, returned_attn_weights

    kw = {"finetune": "dora", "recompute": "selective", "attention": "eager",
          "precision": "fp32", "lora_dropout": 0.1, "lora_targets": "all-linear",
          "micro_batch_size": 2, "seq_len": 512}
    _, scn = scenario_for("llama-deep", framework="hf", **kw)
    scn = scn.resolved()
    ctx = RankContext(scn.model, scn.training, scn.parallel)
    assert returned_attn_weights(ctx, dims(ctx)) == 2 * 16 * 512 * 512 * 4
    none = scn.model_copy(update={"training": scn.training.model_copy(
        update={"recompute": "none"})})
    ctx = RankContext(none.model, none.training, none.parallel)
    assert returned_attn_weights(ctx, dims(ctx)) == 0  # saved by the attention anyway
    pytest.importorskip("peft")
    from vramcalc.validate.compare import compare

    row = compare(*scenario_for("llama-deep", framework="hf", **kw))  # forward was -3.2 %
    assert abs(row["phases"]["forward"]["rel_error"]) < 1e-3, row["phases"]
