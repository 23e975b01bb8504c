"""Command-line interface (typer): the one owner of argv, stdout, stderr and exit codes.

`main(argv)` runs one command line and returns its exit code (the `vramcalc` console script
and `python -m vramcalc`). The commands live in one module per family (estimate, catalog,
validate, plan, probe, serve) and are registered on `app` below, in the order `--help` lists them.
Bad input is one `error:` line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vramcalc.cli import catalog, estimate, maximize, plan, probe, serve, validate
from vramcalc.cli.app import app, main

# (name, command, click context settings), in help order
COMMANDS: tuple[tuple[str, Callable[..., None], dict[str, Any] | None], ...] = (
    ("estimate", estimate.estimate_cmd, None),
    ("explain", estimate.explain_cmd, None),
    ("trace", estimate.trace_cmd, None),
    ("gpus", catalog.gpus_cmd, None),
    ("models", catalog.models_cmd, None),
    ("validate", validate.validate_cmd, None),
    ("plan", plan.plan_cmd, None),
    ("size", plan.size_cmd, None),
    ("check", plan.check_cmd, None),
    ("max", maximize.max_cmd, None),
    ("serve", serve.serve_cmd, None),
    ("probe", probe.probe_cmd, probe.CONTEXT_SETTINGS),
)
for _name, _command, _settings in COMMANDS:
    app.command(_name, context_settings=_settings)(_command)
# `infer`: the same command under the name people try first (not listed in --help)
app.command("infer", hidden=True)(serve.serve_cmd)

__all__ = ["COMMANDS", "app", "main"]
