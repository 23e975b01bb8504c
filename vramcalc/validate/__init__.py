"""`vramcalc validate`: the analytic engine against the trace engine over a scenario grid
(`grid.default_grid`, `compare.run_validation`; the trace engine loads torch on first use)."""

from vramcalc.validate.compare import (
    PEAK_MAX_REL_ERROR,
    PEAK_MEDIAN_REL_ERROR,
    TERM_TOLERANCES,
    analytic_points,
    compare,
    rel_error,
    run_validation,
    trace_points,
)
from vramcalc.validate.grid import default_grid, fsdp_grid
from vramcalc.validate.shapes import SHAPES, scenario_for

__all__ = ["PEAK_MAX_REL_ERROR", "PEAK_MEDIAN_REL_ERROR", "SHAPES", "TERM_TOLERANCES",
           "analytic_points", "compare", "default_grid", "fsdp_grid", "rel_error",
           "run_validation", "scenario_for", "trace_points"]
