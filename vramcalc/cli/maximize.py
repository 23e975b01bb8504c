"""`vramcalc max`: the longest sequence or the largest micro-batch that fits one layout, with
a chart of memory against it (and, with --plot, an image file)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import typer

from vramcalc.analytic import estimate
from vramcalc.cli.app import (
    ENGINE,
    command_line,
    emit_json,
    fit_engine,
    option,
    scenario_command,
    split_values,
)
from vramcalc.options import build_scenario
from vramcalc.planner.maximize import DIMENSIONS, most_that_fits, scenario_at
from vramcalc.render.console import make_console
from vramcalc.render.maxchart import check_plot_path, print_max, save_plot

MAX_PARAMS = [
    option("maximize", str, "seq-len", "--maximize",
           help="What to maximize: " + " or ".join(DIMENSIONS) + " (the rest of the layout "
                "as given)."),
    option("step", int, 256, "--step",
           help="Sequence-length step in tokens (rounded up to what the layout accepts: "
                "seq/cp even, tp x cp dividing it under sequence parallelism)."),
    ENGINE,
    option("plot", Optional[Path], None, "--plot",
           help="Also draw the chart into FILE.png or FILE.svg (needs matplotlib: "
                "pip install 'llm-vramcalc[plot]')."),
]


@scenario_command(
    "The most that fits: the longest sequence (--maximize seq-len) or the largest "
    "micro-batch (--maximize micro-batch) for the given layout and GPUs, with a chart of "
    "per-GPU memory against it. Exit 0 when a value fits, 1 when even the smallest does not.",
    extra=MAX_PARAMS)
def max_cmd(**kwargs: Any) -> None:
    dimension: str = kwargs.pop("maximize")
    step: int = kwargs.pop("step")
    plot: Path | None = kwargs.pop("plot")
    engine_name: str = kwargs.pop("engine")
    values, dirs, as_json = split_values(kwargs)
    if plot is not None:
        check_plot_path(plot)
    base = build_scenario(values, dirs)
    engine = fit_engine(engine_name, base)
    res = most_that_fits(base, dimension, step, engine=engine)
    if res.answer is not None and engine is None:  # the answer's report, every stage
        res = replace(res, report=estimate(scenario_at(base, dimension, res.answer)))
    if plot is not None:
        title = base.model.name + (f" on {base.world_size} x {base.cluster.gpu.name}"
                                   if base.cluster else "")
        save_plot(plot, res, title)
    if as_json:
        emit_json({"maximize": res.to_json()})
    else:
        print_max(make_console(), res, command_line("plan", values, {
            "--profiles-dir": dirs[0] if dirs else None}))
        if plot is not None:
            make_console().print(f"chart written to {plot}")
    if res.answer is None:
        raise typer.Exit(1)
