"""Rendering `vramcalc validate`: the engines side by side over a scenario grid."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from vramcalc.units import GB


def print_validation(console: Console, result: dict[str, Any]) -> None:
    """Analytic vs trace per scenario (with the worst term) and the summary line."""
    table = Table(title="Analytic vs trace (peak allocated)", title_justify="left",
                  show_edge=False, pad_edge=False)
    for col in ("scenario", "analytic GB", "trace GB", "error", "worst term"):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for row in result["scenarios"]:
        worst = ""
        terms = row.get("terms") or {}
        if terms:
            name, val = max(terms.items(), key=lambda kv: abs(kv[1].get("rel_error") or 0))
            worst = f"{name} {100 * (val.get('rel_error') or 0):+.2f}%"
        err = row.get("rel_error")
        table.add_row(str(row.get("name")), f"{row['analytic_bytes'] / GB:,.4f}",
                      f"{row['trace_bytes'] / GB:,.4f}",
                      f"{100 * err:+.2f}%" if err is not None else "-", worst)
    console.print(table)
    s = result["summary"]
    console.print(
        f"{s.get('num_scenarios', len(result['scenarios']))} scenarios: median |error| "
        f"{100 * s['median_abs_rel_error']:.2f}%, max {100 * s['max_abs_rel_error']:.2f}%, "
        f"{s.get('num_failed', 0)} out of tolerance"
    )
