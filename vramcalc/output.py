"""Writing results: the rich console, JSON documents, memory reports.

Kept apart from vramcalc/cli.py (which builds the typer app) so that the typer-free fast
path for `estimate` (vramcalc/entry.py) prints exactly what the typer command prints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def console():  # noqa: ANN201
    """A rich Console; 120 columns when stdout is not a terminal (pipes and CI logs)."""
    from rich.console import Console

    out = Console(highlight=False)
    if not out.is_terminal:
        out = Console(highlight=False, width=120)
    return out


def emit_json(doc: Any) -> None:
    """One JSON document on stdout."""
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def show_report(report: Any, as_json: bool) -> None:
    """A MemoryReport as JSON or as the rich table with the fit verdict."""
    if as_json:
        emit_json(report.to_json_dict())
        return
    from vramcalc.render import print_report

    print_report(console(), report)


def run_estimate(values: dict[str, Any], dirs: list[Path] | None, as_json: bool) -> None:
    """`vramcalc estimate`: option values (vramcalc/options.py names) to a printed report."""
    from vramcalc.analytic import estimate
    from vramcalc.options import build_scenario

    show_report(estimate(build_scenario(values, dirs)), as_json)
