"""`vramcalc validate`: the analytic engine against the trace engine over a scenario grid.

Pure functions: `default_grid()` lists the scenarios, `run_validation(scenarios)` runs both
engines on each and returns plain data (the CLI prints it and sets the exit code).

What is compared, per scenario (steady state, the trace's second iteration):

| quantity          | analytic                          | trace                               | tolerance |
|-------------------|-----------------------------------|-------------------------------------|-----------|
| peak              | peak_allocated_bytes              | peak_allocated_bytes                | PEAK_MAX_REL_ERROR each, PEAK_MEDIAN_REL_ERROR median |
| phases            | forward / backward / optimizer    | same                                | reported  |
| weights           | weights term                      | parameter storages                  | exact     |
| gradients         | gradients term                    | gradients alive at end of backward  | exact     |
| optimizer_states  | states + fp32 masters             | alive at end of the step            | exact     |
| activations       | k·A_mb (forward phase)            | alive at end of forward, labelled activations | ACTIVATIONS_REL_ERROR |
| logits            | fp32 log-probabilities kept       | alive at end of forward, labelled logits | LOGITS_REL_ERROR |

rel_error = (analytic − trace) / trace. The trace is the referee.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from vramcalc.analytic import _stage_phases, estimate
from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import activations as act
from vramcalc.terms import logits as lg
from vramcalc.training import TrainingConfig

PEAK_MEDIAN_REL_ERROR = 0.01  # median |error| of the peak over the grid
PEAK_MAX_REL_ERROR = 0.03  # every scenario's peak
ACTIVATIONS_REL_ERROR = 0.03
LOGITS_REL_ERROR = 0.03
EXACT_TERMS: tuple[str, ...] = ("weights", "gradients", "optimizer_states")
TERM_TOLERANCES: dict[str, float] = {
    "weights": 0.0, "gradients": 0.0, "optimizer_states": 0.0,
    "activations": ACTIVATIONS_REL_ERROR, "logits": LOGITS_REL_ERROR,
}
Progress = Callable[[str, float], None]


# ---- the grid -------------------------------------------------------------------------
# Shapes keep real widths (fake tensors cost nothing per element) and few layers (the
# trace's cost is per op). Each is a family the analytic model must cover.
SHAPES: dict[str, ModelSpec] = {
    # Llama-3-style grouped-query attention (8:2 heads), SwiGLU, untied
    "llama-gqa": ModelSpec(name="llama-gqa", hidden_size=1024, num_hidden_layers=2,
                           num_attention_heads=16, num_key_value_heads=4,
                           intermediate_size=2816, vocab_size=32000),
    # Llama-2-style multi-head attention, head_dim 128
    "llama-mha": ModelSpec(name="llama-mha", hidden_size=1024, num_hidden_layers=2,
                           num_attention_heads=8, intermediate_size=2752, vocab_size=32000),
    # Qwen2-style: q/k/v biases, tied embeddings; Qwen3-style qk_norm with head_dim 128
    "qwen2-bias": ModelSpec(name="qwen2-bias", hidden_size=896, num_hidden_layers=2,
                            num_attention_heads=14, num_key_value_heads=2,
                            intermediate_size=4864, vocab_size=32768, attention_bias=True,
                            tie_word_embeddings=True),
    "qwen3-qknorm": ModelSpec(name="qwen3-qknorm", hidden_size=1024, num_hidden_layers=2,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                              intermediate_size=3072, vocab_size=32768, qk_norm=True,
                              tie_word_embeddings=True),
    # GPT-2 small widths: LayerNorm with bias, learned positions, GELU, tied, odd vocab
    "gpt2": ModelSpec(name="gpt2", model_type="gpt2", hidden_size=768, num_hidden_layers=2,
                      num_attention_heads=12, intermediate_size=3072, vocab_size=50257,
                      max_position_embeddings=1024, mlp_kind="standard",
                      hidden_act="gelu_new", norm_kind="layernorm", norm_bias=True,
                      attention_bias=True, attention_out_bias=True, mlp_bias=True,
                      position_embedding="learned", tie_word_embeddings=True),
    # deeper, with a small vocabulary: the peak moves from the loss into the layers
    "llama-deep": ModelSpec(name="llama-deep", hidden_size=1024, num_hidden_layers=4,
                            num_attention_heads=16, num_key_value_heads=4,
                            intermediate_size=2816, vocab_size=1024),
    # Phi-3-style fused qkv and gate_up projections; Gemma-style MQA, head_dim 256, GeGLU,
    # (1 + w) RMSNorm and scaled embeddings (the hf profile follows each family's code)
    "phi3-fused": ModelSpec(name="phi3-fused", model_type="phi3", hidden_size=1024,
                            num_hidden_layers=2, num_attention_heads=16,
                            intermediate_size=2816, vocab_size=32064),
    "gemma-mqa": ModelSpec(name="gemma-mqa", model_type="gemma", hidden_size=1024,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1,
                           head_dim=256, intermediate_size=4096, vocab_size=32000,
                           hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
    # Mixtral-style MoE: 8 experts, top-2
    "moe": ModelSpec(name="moe", hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
                     num_key_value_heads=4, intermediate_size=1408, vocab_size=32000,
                     num_local_experts=8, num_experts_per_tok=2),
    # Qwen2-MoE-style: a dense first layer, 4 experts top-2, a gated shared expert
    "moe-shared": ModelSpec(name="moe-shared", hidden_size=1024, num_hidden_layers=2,
                            num_attention_heads=16, num_key_value_heads=4,
                            intermediate_size=2816, vocab_size=32000, num_local_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=704,
                            num_shared_experts=1, shared_expert_intermediate_size=1408,
                            shared_expert_gate=True, first_k_dense_replace=1,
                            attention_bias=True),
}


def _scn(shape: str, framework: str = "reference", **kw: Any) -> tuple[str, Scenario]:
    tr = TrainingConfig(framework=framework, **{
        "seq_len": 1024, "micro_batch_size": 2, "precision": "bf16", "optimizer": "adamw",
        **kw})
    name = (f"{framework}/{shape}/{tr.precision}/{tr.optimizer}/{tr.attention}/{tr.recompute}"
            f"/b{tr.micro_batch_size}s{tr.seq_len}" + (f"ga{tr.grad_accum}" if tr.grad_accum > 1
                                                       else ""))
    return name, Scenario(model=SHAPES[shape], training=tr, parallel=ParallelConfig())


def default_grid() -> list[tuple[str, Scenario]]:
    """The validation grid: (name, scenario) pairs, both profiles, every policy and kernel."""
    grid: list[tuple[str, Scenario]] = []
    for profile in ("reference", "hf"):
        fw = {"framework": profile}
        # every precision policy, on the GQA shape
        for prec in ("fp32", "amp-bf16", "amp-fp16", "bf16", "fp16", "bf16-pure"):
            grid.append(_scn("llama-gqa", **fw, precision=prec))
        # optimizers
        for opt in ("adam", "sgd", "sgd-momentum", "lion", "adafactor", "adamw-8bit"):
            grid.append(_scn("llama-gqa", **fw, optimizer=opt))
        # attention kernels x recompute modes
        for att in ("flash", "eager"):
            for rec in ("none", "selective", "full"):
                grid.append(_scn("llama-mha", **fw, attention=att, recompute=rec,
                                 seq_len=2048, micro_batch_size=1))
        # micro-batch, sequence and gradient accumulation
        grid.append(_scn("llama-gqa", **fw, micro_batch_size=4, seq_len=512))
        grid.append(_scn("llama-gqa", **fw, micro_batch_size=1, seq_len=4096))
        grid.append(_scn("llama-gqa", **fw, grad_accum=4, micro_batch_size=1))
        grid.append(_scn("llama-gqa", **fw, precision="amp-bf16", attention="eager",
                         seq_len=512))
        # other families
        grid.append(_scn("gpt2", **fw))
        grid.append(_scn("gpt2", **fw, precision="amp-bf16", attention="eager", seq_len=512))
        grid.append(_scn("gpt2", **fw, recompute="selective", optimizer="sgd-momentum"))
        grid.append(_scn("qwen2-bias", **fw, seq_len=2048))
        grid.append(_scn("qwen3-qknorm", **fw, precision="bf16-pure", optimizer="lion"))
        grid.append(_scn("moe", **fw))
        grid.append(_scn("moe", **fw, recompute="full", micro_batch_size=4))
        grid.append(_scn("moe-shared", **fw, precision="bf16-pure", attention="eager",
                         seq_len=512))
        # a small vocabulary: the peak moves into the layers' backward
        grid.append(_scn("llama-deep", **fw, seq_len=2048))
        grid.append(_scn("llama-deep", **fw, precision="amp-bf16", attention="eager",
                         recompute="selective", micro_batch_size=1))
    for shape in ("gpt2", "phi3-fused", "gemma-mqa"):
        grid.append(_scn(shape, framework="hf", attention="eager", seq_len=1024))
    grid.append(_scn("phi3-fused", framework="hf", precision="amp-bf16", recompute="selective"))
    grid.append(_scn("moe", precision="amp-bf16", recompute="selective"))
    grid.append(_scn("llama-gqa", optimizer="paged-adamw-8bit"))
    grid.append(_scn("gpt2", precision="fp32", optimizer="adafactor", seq_len=1024))
    from vramcalc.validate_finetune import finetune_grid

    grid += finetune_grid()  # LoRA / QLoRA / DoRA, 8-bit and paged optimizers
    from vramcalc.validate_lowprec import lowprec_grid

    grid += lowprec_grid()  # FP8 (Transformer Engine stand-in) and QAT
    grid += fsdp_grid()
    return grid


def fsdp_grid() -> list[tuple[str, Scenario]]:
    """FSDP2 data parallelism at world sizes 2, 4, 8 (vramcalc.trace.distributed)."""
    cases = [
        ("llama-gqa", 2, "full", {"precision": "amp-bf16"}),
        ("llama-gqa", 4, "full", {"precision": "amp-bf16", "grad_accum": 2}),
        ("llama-gqa", 8, "full", {"precision": "bf16"}),
        ("gpt2", 2, "full", {"precision": "amp-bf16", "framework": "hf"}),
        ("qwen2-bias", 4, "grad-op", {"precision": "amp-bf16"}),
        ("llama-mha", 8, "hybrid", {"precision": "amp-bf16", "recompute": "selective"}),
        ("moe", 8, "full", {"precision": "bf16-pure"}),
    ]
    out = []
    for shape, world, fsdp, kw in cases:
        name, scn = _scn(shape, **kw)
        par = ParallelConfig(dp=world, fsdp=fsdp,
                             shard_group=world // 2 if fsdp == "hybrid" else None)
        out.append((f"{name}/fsdp-{fsdp}{world}", scn.model_copy(update={"parallel": par})))
    return out


# ---- comparison -----------------------------------------------------------------------
def rel_error(analytic: int, trace: int) -> float:
    """(analytic − trace) / trace; 0 when both are 0."""
    if trace == 0:
        return 0.0 if analytic == 0 else float("inf")
    return (analytic - trace) / trace


def _pair(analytic: int, trace: int) -> dict[str, Any]:
    return {"analytic": analytic, "trace": trace, "rel_error": rel_error(analytic, trace)}


def analytic_points(scn: Scenario) -> dict[str, int]:
    """The analytic engine's values at the comparison points of the module docstring."""
    scn = scn.resolved()
    phases, _first, _live = _stage_phases(scn, 0, scn.cluster.gpu if scn.cluster else None)
    by_name = {p.name: p.terms() for p in phases}
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    return {
        "weights": by_name["optimizer"].get("weights", 0),
        "gradients": by_name["optimizer"].get("gradients", 0),
        "optimizer_states": by_name["optimizer"].get("optimizer_states", 0),
        "activations": act.microbatch_activation_bytes(ctx),
        "logits": lg.logits_saved_bytes(ctx),
    }


def trace_points(result: Any) -> dict[str, int]:
    """The trace engine's values at the same points (see `analytic_points`)."""
    fwd = result.marks["end_forward"].terms()
    return {
        "weights": result.param_bytes,
        "gradients": result.marks["end_backward"].terms().get("gradients", 0),
        "optimizer_states": result.marks["end_step"].terms().get("optimizer_states", 0),
        "activations": fwd.get("activations", 0),
        "logits": fwd.get("logits", 0),
    }


def compare(name: str, scn: Scenario) -> dict[str, Any]:
    """Run both engines on one scenario; the row `run_validation` reports."""
    from vramcalc.trace.distributed import distributed_trace
    from vramcalc.trace.engine import trace

    tr = scn.training
    row: dict[str, Any] = {
        "name": name, "model": scn.model.name, "framework": tr.framework,
        "precision": tr.precision, "optimizer": tr.optimizer, "attention": tr.attention,
        "recompute": tr.recompute, "micro_batch_size": tr.micro_batch_size,
        "seq_len": tr.seq_len, "grad_accum": tr.grad_accum,
    }
    t0 = time.perf_counter()
    try:
        ana = estimate(scn)
        res = distributed_trace(scn) if scn.parallel.fsdp != "none" else trace(scn)
    except Exception as err:  # a scenario that cannot run is a failed row, not a crash
        row.update(error=f"{type(err).__name__}: {err}", ok=False, failures=["error"],
                   analytic_bytes=0, trace_bytes=0, rel_error=float("inf"), terms={},
                   phases={})
        return row
    row["trace_seconds"] = round(time.perf_counter() - t0, 3)
    rep = res.report
    row["analytic_bytes"] = ana.peak_allocated_bytes
    row["trace_bytes"] = rep.peak_allocated_bytes
    row["rel_error"] = rel_error(ana.peak_allocated_bytes, rep.peak_allocated_bytes)
    row["analytic_peak_phase"], row["trace_peak_phase"] = ana.peak_phase, rep.peak_phase
    row["phases"] = {ph: _pair(ana.phases[ph], rep.phases[ph]) for ph in rep.phases}
    row["first_step"] = _pair(ana.first_step_peak_bytes, rep.first_step_peak_bytes)
    a_pts, t_pts = analytic_points(scn), trace_points(res)
    row["terms"] = {k: _pair(a_pts[k], t_pts[k]) for k in a_pts}
    failures = []
    if abs(row["rel_error"]) > PEAK_MAX_REL_ERROR:
        failures.append("peak")
    for term, tol in TERM_TOLERANCES.items():
        if abs(row["terms"][term]["rel_error"]) > tol:
            failures.append(term)
    row["failures"] = failures
    row["ok"] = not failures
    return row


def run_validation(scenarios: list[tuple[str, Scenario]],
                   progress: Progress | None = None) -> dict[str, Any]:
    """Compare the engines on every scenario; rows plus a summary (see module docstring).

    Returns {"scenarios": [row, ...], "summary": {"median_abs_rel_error",
    "max_abs_rel_error", "num_scenarios", "num_failed", "within_tolerance", "tolerances"}}.
    """
    rows = []
    for i, (name, scn) in enumerate(scenarios):
        if progress:
            progress(name, i / max(len(scenarios), 1))
        rows.append(compare(name, scn))
    if progress:
        progress("done", 1.0)
    errs = [abs(r["rel_error"]) for r in rows]
    median = statistics.median(errs) if errs else 0.0
    worst = max(errs) if errs else 0.0
    failed = sum(1 for r in rows if not r["ok"])
    term_max = {t: max((abs(r["terms"][t]["rel_error"]) for r in rows if r.get("terms")),
                       default=0.0) for t in TERM_TOLERANCES}
    return {
        "scenarios": rows,
        "summary": {
            "median_abs_rel_error": median,
            "max_abs_rel_error": worst,
            "max_abs_rel_error_by_term": term_max,
            "num_scenarios": len(rows),
            "num_failed": failed,
            "within_tolerance": failed == 0 and median <= PEAK_MEDIAN_REL_ERROR,
            "tolerances": {"peak_median": PEAK_MEDIAN_REL_ERROR, "peak_max": PEAK_MAX_REL_ERROR,
                           **{f"term_{k}": v for k, v in TERM_TOLERANCES.items()}},
        },
    }
