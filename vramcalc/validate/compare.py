"""`vramcalc validate`: the analytic engine against the trace engine over a scenario grid.

`run_validation(scenarios)` runs both engines on each scenario (vramcalc.validate.grid lists
them) and returns plain data (the CLI prints it and sets the exit code).

What is compared, per scenario (steady state, the trace's second iteration):

| quantity          | analytic                          | trace                               | tolerance |
|-------------------|-----------------------------------|-------------------------------------|-----------|
| peak              | peak_allocated_bytes              | peak_allocated_bytes                | PEAK_MAX_REL_ERROR each, PEAK_MEDIAN_REL_ERROR median |
| phases            | forward / backward / optimizer    | same                                | reported  |
| weights           | weights term                      | parameter storages                  | exact     |
| gradients         | gradients term                    | gradients alive at end of backward  | exact     |
| optimizer_states  | states + fp32 masters             | alive at end of the step            | exact     |
| activations       | k·A_mb (forward phase)            | alive at end of forward, labelled activations | ACTIVATIONS_REL_ERROR |
| logits            | fp32 log-probabilities kept (+ a recipe's logits) | alive at end of forward, labelled logits | LOGITS_REL_ERROR |

rel_error = (analytic − trace) / trace. The trace is the referee.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

from vramcalc.analytic import estimate, stage_phases
from vramcalc.errors import InputError
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import activations as act
from vramcalc.terms import logits as lg
from vramcalc.terms import seq2seq as s2
from vramcalc.terms.torchtune import recipe_held

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
    phases, _first, _live = stage_phases(scn, 0, scn.cluster.gpu if scn.cluster else None)
    by_name = {p.name: p.terms() for p in phases}
    # parameters only: the trace's point counts parameter storages, not buffers (torchtitan's
    # freqs_cis is a weights sub-term of the analytic report)
    buffers = next(p.parts for p in phases if p.name == "optimizer").get("weights/buffers", 0)
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    if scn.model.is_encoder_decoder:  # vramcalc/terms/seq2seq.py
        x = s2.s2s_dims(ctx)
        activations, logits = s2.microbatch_activation_bytes(x), s2.logits_saved_bytes(x)
    else:
        activations, logits = act.microbatch_activation_bytes(ctx), lg.logits_saved_bytes(ctx)
        logits += sum(recipe_held(ctx).values())  # torchtune before 0.3: the loop's copy
    return {
        "weights": by_name["optimizer"].get("weights", 0) - buffers,
        "gradients": by_name["optimizer"].get("gradients", 0),
        "optimizer_states": by_name["optimizer"].get("optimizer_states", 0),
        "activations": activations,
        "logits": logits,
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
    except ImportError as err:  # a missing package is the user's to install, not a row
        raise InputError(f"validate runs the trace engine, which needs a package that is not "
                         f"installed ({err}): pip install {err.name or 'torch'}") from None
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


def missing_packages(scenarios: list[tuple[str, Scenario]]) -> list[str]:
    """The Python packages the trace engine needs for these scenarios that are not installed:
    torch always, transformers for the hf profile, peft for its adapters."""
    need = ["torch"]
    hf = [scn.training for _, scn in scenarios if scn.training.framework == "hf"]
    if hf:
        need.append("transformers")
    if any(tr.finetune != "full" for tr in hf):
        need.append("peft")
    return [name for name in need if importlib.util.find_spec(name) is None]


def check_dependencies(scenarios: list[tuple[str, Scenario]]) -> None:
    """InputError naming what to install when the trace engine cannot run these scenarios."""
    missing = missing_packages(scenarios)
    if missing:
        names = " ".join(missing)
        raise InputError(f"validate runs the trace engine, which needs {', '.join(missing)} "
                         f"(not installed): pip install {names}")


def run_validation(scenarios: list[tuple[str, Scenario]],
                   progress: Progress | None = None) -> dict[str, Any]:
    """Compare the engines on every scenario; rows plus a summary (see module docstring).

    Returns {"scenarios": [row, ...], "summary": {"median_abs_rel_error",
    "max_abs_rel_error", "num_scenarios", "num_failed", "within_tolerance", "tolerances"}}.
    Missing packages are an InputError before any scenario runs (`check_dependencies`).
    """
    check_dependencies(scenarios)
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
