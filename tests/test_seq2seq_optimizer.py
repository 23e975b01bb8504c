"""The optimizer step of encoder-decoders (T5, BART) walks the parameters in model order:
the mixed-precision copy loop (an fp32 gradient per 16-bit one, one tensor at a time) and
the per-parameter AdamW loop peak where a large tensor meets the prefix before it. The
order is checked against transformers' own `model.parameters()`, the phase against the
trace engine."""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_seq2seq import CONFIGS
from vramcalc.analytic import estimate
from vramcalc.hf_config import from_hf_config
from vramcalc.scenario import Scenario
from vramcalc.seq2seq_shapes import seq2seq_param_order
from vramcalc.training import TrainingConfig


@pytest.mark.parametrize("name", ["t5-base", "mt5-base", "t5-v1_1-base", "bart-large",
                                  "t5-odd"])
def test_order_is_transformers_parameters_order(name: str) -> None:
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    cfg = CONFIGS[name]
    config = tf.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = tf.AutoModelForSeq2SeqLM.from_config(config)
    spec = from_hf_config(cfg, f"{name}/config.json")
    assert seq2seq_param_order(spec) == [p.numel() for p in model.parameters()]


@pytest.mark.parametrize(("name", "training"), [
    ("t5-odd", {"precision": "bf16"}),  # fp32 masters: the copy loop
    ("bart-odd", {"precision": "bf16", "optimizer_impl": "fused"}),
    ("t5-odd", {"precision": "fp32", "optimizer_impl": "loop"}),  # per-parameter AdamW
    ("bart-odd", {"precision": "fp32", "optimizer_impl": "loop"}),
])
def test_optimizer_phase_equals_the_trace(name: str, training: dict[str, Any]) -> None:
    pytest.importorskip("transformers")
    from vramcalc.trace.engine import trace

    cfg = {**CONFIGS[name], "tie_word_embeddings": True}
    spec = from_hf_config(cfg, f"{name}/config.json")
    scn = Scenario(model=spec, training=TrainingConfig(
        framework="hf", attention="eager", seq_len=48, target_len=16, micro_batch_size=2,
        **training))
    # steady state (the trace's second step): the states exist while the loops run
    assert estimate(scn).phases["optimizer"] == trace(scn).phases["optimizer"].total
