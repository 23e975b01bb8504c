"""FP8 and QAT scenarios for `vramcalc validate` (included in vramcalc.validate.default_grid).

The reference profile only (vramcalc/terms/lowprec.py says why): FP8 traces the Transformer
Engine stand-in `FP8Linear`, QAT real torch fake-quant ops (`QATLinear`), both in
vramcalc/trace/lowprec.py. Shapes are the validation grid's; names extend the grid's with
the mode so they stay unique.
"""

from __future__ import annotations

from typing import Any

from vramcalc.scenario import Scenario

# (shape, training options)
CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("llama-gqa", {"precision": "fp8"}),
    ("llama-gqa", {"precision": "fp8", "attention": "eager", "seq_len": 512}),
    ("llama-mha", {"precision": "fp8", "recompute": "selective", "seq_len": 2048,
                   "micro_batch_size": 1}),
    ("llama-mha", {"precision": "fp8", "attention": "eager", "recompute": "selective",
                   "seq_len": 2048, "micro_batch_size": 1}),
    ("llama-mha", {"precision": "fp8", "recompute": "full", "seq_len": 2048,
                   "micro_batch_size": 1}),
    ("llama-deep", {"precision": "fp8", "seq_len": 2048}),
    ("llama-deep", {"precision": "fp8", "attention": "eager", "micro_batch_size": 1}),
    ("qwen2-bias", {"precision": "fp8", "grad_accum": 2}),
    ("qwen3-qknorm", {"precision": "fp8", "optimizer": "lion"}),
    ("gpt2", {"precision": "fp8"}),
    ("llama-gqa", {"qat": "int8"}),
    ("llama-gqa", {"qat": "int4"}),
    ("llama-gqa", {"qat": "int4", "precision": "bf16-pure", "attention": "eager",
                   "seq_len": 512}),
    ("llama-mha", {"qat": "int8", "recompute": "selective", "seq_len": 2048,
                   "micro_batch_size": 1}),
    ("llama-mha", {"qat": "int4", "attention": "eager", "recompute": "selective",
                   "seq_len": 2048, "micro_batch_size": 1}),
    ("llama-mha", {"qat": "int4", "recompute": "full", "seq_len": 2048,
                   "micro_batch_size": 1}),
    ("llama-deep", {"qat": "int4", "seq_len": 2048}),
    ("llama-deep", {"qat": "int8", "attention": "eager", "micro_batch_size": 1}),
    ("qwen2-bias", {"qat": "int8", "precision": "fp32", "seq_len": 512}),
    ("gpt2", {"qat": "int4", "grad_accum": 2}),
)


def lowprec_grid() -> list[tuple[str, Scenario]]:
    """(name, scenario) pairs of the FP8 / QAT cases above."""
    from vramcalc.validate import _scn

    out = []
    for shape, kw in CASES:
        name, scn = _scn(shape, **kw)
        tr = scn.training
        tag = "fp8" if tr.precision == "fp8" else f"qat-{tr.qat}"
        out.append((f"{name}/{tag}", scn))
    return out
