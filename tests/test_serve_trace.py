"""Referee for `vramcalc serve --engine hf`: the analytic estimate (weights + static cache +
prefill peak) against a fake-tensor trace of the transformers model running prefill and
greedy decode steps with a `StaticCache` (vramcalc/trace/generate.py). Real model widths with
few layers keep the trace fast; the formulas are per layer."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from vramcalc.catalog import resolve_model  # noqa: E402
from vramcalc.hardware import parse_gpus  # noqa: E402
from vramcalc.serve import ServeConfig, serve_estimate  # noqa: E402
from vramcalc.trace.generate import trace_generate  # noqa: E402

TOLERANCE = 0.001  # the allocator's 512-byte rounding of small tensors


@pytest.mark.parametrize(("model", "layers", "batch", "prompt", "max_len"), [
    ("llama3-8b", 2, 2, 1024, 2048),  # GQA, untied head
    ("qwen2.5-7b", 3, 1, 2048, 4096),  # q/k/v biases
    ("gemma-2b", 2, 4, 512, 1024),  # MQA, tied embeddings, head_dim 256
])
def test_hf_generate_static_cache_matches_trace(model: str, layers: int, batch: int,
                                                 prompt: int, max_len: int) -> None:
    spec = resolve_model(model)[0].model_copy(update={"num_hidden_layers": layers})
    traced = trace_generate(spec, batch, prompt, max_len)
    report = serve_estimate(spec, parse_gpus("H200"), ServeConfig(
        engine="hf", max_model_len=max_len, max_num_seqs=batch,
        max_num_batched_tokens=prompt))
    t = report.terms
    assert t.kv_cache == traced.cache_bytes
    assert t.weights == pytest.approx(traced.weights_bytes, rel=TOLERANCE)
    assert t.weights + t.kv_cache + t.activation_peak == pytest.approx(
        traced.prefill_peak_bytes, rel=TOLERANCE)
    # decoding one token at a time never exceeds the prefill
    assert traced.decode_peak_bytes < traced.prefill_peak_bytes
