"""`vramcalc estimate`, `explain` and `trace`: one scenario's memory, its formulas, and the
fake-tensor dry run of the same scenario."""

from __future__ import annotations

from typing import Any

from vramcalc.analytic import estimate
from vramcalc.cli.app import emit_json, scenario_command, split_values
from vramcalc.errors import InputError
from vramcalc.explain import explain
from vramcalc.options import build_scenario
from vramcalc.render.console import make_console, with_progress
from vramcalc.render.report import print_explain, print_report
from vramcalc.report import MemoryReport


def show_report(report: MemoryReport, as_json: bool) -> None:
    """A memory report as JSON or as the table with the fit verdict."""
    if as_json:
        emit_json(report.to_json_dict())
    else:
        print_report(make_console(), report)


@scenario_command("One scenario's per-GPU memory breakdown and fit check.")
def estimate_cmd(**kwargs: Any) -> None:
    values, dirs, as_json = split_values(kwargs)
    show_report(estimate(build_scenario(values, dirs)), as_json)


@scenario_command("Every formula with this scenario's numbers substituted.")
def explain_cmd(**kwargs: Any) -> None:
    values, dirs, as_json = split_values(kwargs)
    doc = explain(build_scenario(values, dirs))
    if as_json:
        emit_json(doc)
    else:
        print_explain(make_console(), doc)


@scenario_command("Fake-tensor dry run of a real PyTorch training step (needs torch).")
def trace_cmd(**kwargs: Any) -> None:
    values, dirs, as_json = split_values(kwargs)
    scn = build_scenario(values, dirs)
    try:  # the torch engine loads for this command only (torch is an optional extra)
        from vramcalc.trace import distributed, engine
    except ImportError as err:
        raise InputError(f"trace needs PyTorch: pip install 'vramcalc[torch]' ({err})") from None
    # FSDP2 data parallelism runs on a fake process group
    run_trace = engine.run_trace if scn.parallel.fsdp == "none" else (
        distributed.run_distributed_trace)
    report = with_progress("tracing", lambda progress: run_trace(scn, progress=progress),
                           as_json)
    show_report(report, as_json)
