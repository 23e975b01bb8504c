"""Console-script entry: a typer-free fast path for plain `estimate` command lines.

typer 0.29 (the version on our index) coerces every option through a pydantic TypeAdapter,
so any command it parses imports pydantic (~0.16 s) and typer (~0.06 s) before vramcalc
runs: more than half the 0.3 s start-up budget of issue 2. `vramcalc estimate` is the
command users and scripts call most, so a command line that is unambiguous by the rules
below is parsed here, against the same option table (vramcalc/options.py), and runs the
same function the typer command runs (vramcalc/output.py: run_estimate):

- `estimate` followed only by `--flag value`, `--flag=value`, boolean flags and their
  `--no-` forms, `--json` and `--profiles-dir DIR`, each at most once;
- values that typer would pass through unchanged: plain digits for whole numbers, digits
  with one optional decimal point for numbers, anything not starting with "-" for text.

Anything else (help, another command, a typo, a repeated flag, a value typer would have
to coerce or reject) goes to typer (vramcalc/cli.py: main), which then prints what it
always printed. tests/test_cli_robust.py checks that both paths give the same output,
error line and exit code for drawn command lines.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from vramcalc.errors import InputError

_WHOLE = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?")


def parse_estimate(args: list[str]) -> tuple[dict[str, Any], list[Path] | None, bool] | None:
    """(option values, profile dirs, --json) of an `estimate` command line (without the
    command), or None when the line is not one the fast path takes (see the docstring)."""
    from vramcalc.options import SCENARIO_OPTIONS

    valued = {o.flag: o for o in SCENARIO_OPTIONS if o.kind is not bool}
    switches = {o.flag: (o.name, True) for o in SCENARIO_OPTIONS if o.kind is bool}
    switches.update({"--no-" + o.flag[2:]: (o.name, False)
                     for o in SCENARIO_OPTIONS if o.kind is bool})
    values: dict[str, Any] = {}
    dirs: list[Path] | None = None
    as_json = False
    seen: set[str] = set()
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        key = switches[flag][0] if flag in switches else flag  # --x and --no-x: one option
        if key in seen:
            return None
        seen.add(key)
        if not eq and (flag in switches or flag == "--json"):
            if flag == "--json":
                as_json = True
            else:
                values[key] = switches[flag][1]
            i += 1
            continue
        if flag not in valued and flag != "--profiles-dir":
            return None
        if not eq:
            if i + 1 >= len(args):
                return None
            value = args[i + 1]
            i += 1
        i += 1
        if not value or value.startswith("-"):
            return None
        if flag == "--profiles-dir":
            dirs = [Path(value)]
            continue
        opt = valued[flag]
        if opt.kind is int and not opt.choices:
            if not _WHOLE.fullmatch(value):
                return None
            values[opt.name] = int(value)
        elif opt.kind is float:
            if not _NUMBER.fullmatch(value):
                return None
            values[opt.name] = float(value)
        else:
            values[opt.name] = value
    # in the table's order, as typer passes them: the first bad value is the one reported
    return {o.name: values[o.name] for o in SCENARIO_OPTIONS if o.name in values}, dirs, as_json


def main(argv: list[str] | None = None) -> int:
    """Run one command line; the exit code (2 for bad input, one line on stderr)."""
    args = sys.argv[1:] if argv is None else argv
    parsed = parse_estimate(args[1:]) if args[:1] == ["estimate"] else None
    if parsed is None:
        from vramcalc.cli import main as typer_main

        return typer_main(argv)
    from vramcalc.output import run_estimate

    try:
        run_estimate(*parsed)
    except InputError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    return 0


def run() -> None:
    """Console-script entry (`vramcalc`, `python -m vramcalc`)."""
    sys.exit(main())
