"""`vramcalc validate --records DIR`: stored probe records against the current engines.

Each record keeps the option values it was measured with; the analytic (and, with torch,
trace) engines are re-run on them now, so a formula change shows up against the same
measurements. Tolerances (issue: probe acceptance): analytic peak within 5% of measured
`max_memory_allocated`, and the analytic device total at or above measured reserved + context.
A folder with no record to compare is an InputError (exit 2), never a pass with 0 rows.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from vramcalc.errors import InputError
from vramcalc.probe.record import read_records, rel_error

PEAK_TOLERANCE = 0.05


def compare_records(folder: Path, with_trace: bool = False) -> dict[str, Any]:
    """Rows per record plus a summary in the shape `vramcalc validate --json` prints."""
    from vramcalc.analytic import estimate
    from vramcalc.options import build_scenario

    records = read_records(folder)
    if not records:
        raise InputError(f"no probe records (*.json) in {folder}: nothing to validate (write "
                         "some with `vramcalc probe --out DIR` on a GPU)")
    rows = []
    for rec in records:
        if (rec.get("status") != "ok" or rec.get("kind") != "builtin"
                or rec["scenario"].get("peft_config")):  # a --peft-config run: trace only
            continue
        measured = rec["measured"]
        peak = measured.get("max_memory_allocated_bytes")
        if not peak:
            continue
        try:
            scn = build_scenario(dict(rec["scenario"]))
        except InputError as err:  # the record's option values, checked as the CLI's
            raise InputError(f"{rec['_path']}: {err}") from None
        rep = estimate(scn)
        row: dict[str, Any] = {
            "name": Path(rec["_path"]).stem,
            "gpu": rec["device"]["name"],
            "framework": rec["scenario"].get("framework", "reference"),
            "strategy": _short(rec["scenario"]),
            "analytic_bytes": rep.peak_allocated_bytes,
            "trace_bytes": peak,  # the measured value takes the referee's column
            "measured_bytes": peak,
            "rel_error": rel_error(rep.peak_allocated_bytes, peak),
            "dry_run": bool(measured.get("dry_run")),
        }
        reserved = measured.get("max_memory_reserved_bytes")
        context = measured.get("context_bytes")
        if reserved:
            # the reserved estimate beside measured max_memory_reserved (reported, no tolerance)
            row["analytic_reserved_bytes"] = rep.peak_reserved_bytes
            row["measured_reserved_bytes"] = reserved
            row["reserved_rel_error"] = rel_error(rep.peak_reserved_bytes, reserved)
        if reserved is not None and context is not None:
            row["measured_device_bytes"] = reserved + context
            row["analytic_device_bytes"] = rep.device_total_bytes
            row["device_total_covers"] = rep.device_total_bytes >= reserved + context
        if with_trace:
            from vramcalc.trace.engine import run_trace

            row["trace_rel_error"] = rel_error(run_trace(scn).peak_allocated_bytes, peak)
        rows.append(row)
    if not rows:
        raise InputError(f"none of the {len(records)} probe records in {folder} is a completed "
                         "built-in measurement (kind builtin, status ok, a measured peak) of a "
                         "scenario the analytic engine models (a --peft-config run's record "
                         "holds its trace comparison): nothing to validate")
    errs = [abs(r["rel_error"]) for r in rows if r["rel_error"] is not None]
    failed = [r for r in rows if (r["rel_error"] is not None and abs(r["rel_error"]) >
                                  PEAK_TOLERANCE) or r.get("device_total_covers") is False]
    return {
        "scenarios": rows,
        "summary": {
            "num_scenarios": len(rows),
            "median_abs_rel_error": statistics.median(errs) if errs else 0.0,
            "max_abs_rel_error": max(errs) if errs else 0.0,
            "num_failed": len(failed),
            "tolerance": PEAK_TOLERANCE,
        },
    }


def _short(values: dict[str, Any]) -> str:
    keys = ("model", "seq_len", "micro_batch_size", "precision", "optimizer", "attention",
            "recompute")
    return " ".join(str(values[k]) for k in keys if k in values)
