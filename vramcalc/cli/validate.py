"""`vramcalc validate`: the engines side by side over the scenario grid, or stored probe
records against the estimates; exit 1 when out of tolerance."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from vramcalc.cli.app import emit_json
from vramcalc.errors import InputError
from vramcalc.render.console import make_console, with_progress
from vramcalc.render.validation import print_validation


def validate_cmd(
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    records: Optional[Path] = typer.Option(None, "--records",
                                           help="Compare stored probe records in this folder."),
    quick: bool = typer.Option(False, "--quick", help="A small subset of the grid."),
) -> None:
    """Analytic vs trace over the scenario grid; exit 1 when out of tolerance, 2 when a
    package the trace needs is missing or --records holds nothing to compare."""
    if records is not None:
        from vramcalc.probe.compare import compare_records  # the probe engine's records

        result = compare_records(records)
    else:
        try:  # the trace engine loads for this command only (torch is an optional extra)
            from vramcalc.validate import default_grid, run_validation
        except ImportError as err:
            raise InputError(f"validate needs PyTorch: pip install torch "
                             f"({err})") from None
        grid = default_grid()
        if quick:
            grid = grid[::8]
        result = with_progress("validating",
                               lambda progress: run_validation(grid, progress=progress),
                               as_json)
    if as_json:
        emit_json(result)
    else:
        print_validation(make_console(), result)
    if result["summary"].get("num_failed", 0):
        raise typer.Exit(1)
