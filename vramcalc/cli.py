"""Command-line interface: the only module that reads argv, prints and sets exit codes.

Every bad input ends as one line on stderr and exit code 2 (InputError, malformed
files, usage errors); `--json` prints exactly one JSON document on stdout.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

from vramcalc.errors import InputError
from vramcalc.options import SCENARIO_OPTIONS, Opt
from vramcalc.output import console as _console
from vramcalc.output import emit_json as _emit_json
from vramcalc.output import run_estimate
from vramcalc.output import show_report as _show_report

app = typer.Typer(
    name="vramcalc",
    help="Will this training job fit in GPU memory, how should it run, what should I buy?",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

EXIT_BAD_INPUT = 2


# ---- shared scenario options -------------------------------------------------
def _param(opt: Opt, default_override: Any = inspect.Parameter.empty) -> inspect.Parameter:
    default = opt.default if default_override is inspect.Parameter.empty else default_override
    if opt.kind is bool:
        info = typer.Option(default, f"{opt.flag}/--no-{opt.flag[2:]}", help=opt.help)
        annotation: Any = bool
    else:
        info = typer.Option(default, opt.flag, help=opt.help)
        annotation = Optional[str] if opt.kind is str or opt.choices else Optional[opt.kind]
        if opt.kind is float:
            annotation = Optional[float]
    return inspect.Parameter(opt.name, inspect.Parameter.KEYWORD_ONLY, default=info,
                             annotation=annotation)


_COMMON = [
    inspect.Parameter("profiles_dir", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                      default=typer.Option(None, "--profiles-dir",
                                           help="Extra folder of GPU profile YAML files "
                                                "(also: VRAMCALC_PROFILES).")),
    inspect.Parameter("as_json", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--json", help="One JSON document on stdout.")),
]


def scenario_command(name: str, help_text: str, extra: list[inspect.Parameter] | None = None,
                     defaults: dict[str, Any] | None = None, with_context: bool = False,
                     context_settings: dict[str, Any] | None = None) -> Callable:
    """Register a command taking every scenario option (one table: vramcalc.options).

    `extra` adds the command's own options; `with_context` passes typer's Context as `ctx`
    (for commands that take trailing arguments, e.g. `probe --run -- CMD`).
    """

    def decorate(func: Callable) -> Callable:
        params = []
        if with_context:
            params.append(inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                            annotation=typer.Context))
        params += [_param(o, (defaults or {}).get(o.name, inspect.Parameter.empty))
                   for o in SCENARIO_OPTIONS]
        params += list(extra or []) + _COMMON

        def wrapper(**kwargs: Any) -> None:
            func(**kwargs)

        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__name__ = func.__name__
        wrapper.__doc__ = help_text
        app.command(name, help=help_text, context_settings=context_settings)(wrapper)
        return func

    return decorate


def option(name: str, annotation: Any, default: Any, *flags: str, help: str) -> inspect.Parameter:
    """A command's own option, for `scenario_command(extra=[...])`."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *flags, help=help))


def _split(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[Path] | None, bool]:
    values = {o.name: kwargs.pop(o.name) for o in SCENARIO_OPTIONS}
    values = {k: v for k, v in values.items() if v is not None}
    pdir = kwargs.pop("profiles_dir", None)
    as_json = kwargs.pop("as_json", False)
    return values, [pdir] if pdir else None, as_json


def _scenario(values: dict[str, Any], dirs: list[Path] | None):  # noqa: ANN202
    from vramcalc.options import build_scenario

    return build_scenario(values, dirs)


def _with_progress(label: str, run: Callable[[Any], Any], quiet: bool) -> Any:
    """`run(progress)` under a transient rich progress bar (`progress(message, fraction)`);
    without one when `quiet` (JSON output)."""
    if quiet:
        return run(None)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(label, total=1.0)
        return run(lambda msg, frac: bar.update(task, completed=frac, description=msg))


@scenario_command("estimate", "One scenario's per-GPU memory breakdown and fit check.")
def estimate_cmd(**kwargs: Any) -> None:
    run_estimate(*_split(kwargs))  # also run without typer: vramcalc/entry.py


@scenario_command("explain", "Every formula with this scenario's numbers substituted.")
def explain_cmd(**kwargs: Any) -> None:
    from vramcalc.explain import explain

    values, dirs, as_json = _split(kwargs)
    doc = explain(_scenario(values, dirs))
    if as_json:
        _emit_json(doc)
        return
    from vramcalc.render import print_explain

    print_explain(_console(), doc)


@scenario_command("trace", "Fake-tensor dry run of a real PyTorch training step (needs torch).")
def trace_cmd(**kwargs: Any) -> None:
    values, dirs, as_json = _split(kwargs)
    scn = _scenario(values, dirs)
    try:
        from vramcalc.trace.engine import run_trace

        if scn.parallel.fsdp != "none":  # FSDP2 data parallelism: fake process group
            from vramcalc.trace.distributed import run_distributed_trace as run_trace
    except ImportError as err:
        raise InputError(f"trace needs PyTorch: pip install 'vramcalc[torch]' ({err})") from None
    report = _with_progress("tracing", lambda progress: run_trace(scn, progress=progress),
                            as_json)
    _show_report(report, as_json)


@app.command("gpus")
def gpus_cmd(
    profiles_dir: Optional[Path] = typer.Option(None, "--profiles-dir",
                                                help="Extra folder of GPU profile YAML files."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """The GPU catalog: usable memory, peak BF16 TFLOP/s, links, price."""
    from vramcalc.hardware import load_profiles

    profiles = load_profiles([profiles_dir] if profiles_dir else None)
    if as_json:
        _emit_json({"gpus": [p.model_dump(mode="json") for p in profiles.values()]})
        return
    from vramcalc.render import gpus_table

    _console().print(gpus_table(list(profiles.values())))


@app.command("models")
def models_cmd(
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """The built-in model catalog with aliases and exact parameter counts."""
    from vramcalc.catalog import list_preset_entries

    entries = list_preset_entries()
    if as_json:
        _emit_json({"models": [
            {**e.spec.model_dump(mode="json"), "num_params": e.spec.num_params,
             "aliases": list(e.meta.aliases)} for e in entries]})
        return
    from vramcalc.render import models_table

    _console().print(models_table(entries))


@app.command("validate")
def validate_cmd(
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    records: Optional[Path] = typer.Option(None, "--records",
                                           help="Compare stored probe records in this folder."),
    quick: bool = typer.Option(False, "--quick", help="A small subset of the grid."),
) -> None:
    """Analytic vs trace over the scenario grid; exit 1 when out of tolerance."""
    if records is not None:
        from vramcalc.probe.compare import compare_records

        result = compare_records(records)
    else:
        try:
            from vramcalc.validate import default_grid, run_validation
        except ImportError as err:
            raise InputError(f"validate needs PyTorch: pip install 'vramcalc[torch]' ({err})") from None
        grid = default_grid()
        if quick:
            grid = grid[::8]
        result = _with_progress("validating",
                                lambda progress: run_validation(grid, progress=progress),
                                as_json)
    if as_json:
        _emit_json(result)
    else:
        from vramcalc.render import print_validation

        print_validation(_console(), result)
    if result["summary"].get("num_failed", 0):
        raise typer.Exit(1)


# commands defined in their own modules register themselves on `app` when imported; the
# entry point imports only the module of the command it runs (start-up time, issue 2)
_COMMAND_MODULES: dict[str, str] = {
    "plan": "vramcalc.cli_plan", "size": "vramcalc.cli_plan", "check": "vramcalc.cli_plan",
    "probe": "vramcalc.cli_probe",
}


def load_commands(argv: list[str] | None = None) -> None:
    """Register the commands `argv` runs; every command when it names none we know (help,
    typos: the usage error lists and suggests them all) or when argv is None."""
    import importlib

    name = next((a for a in argv or [] if not a.startswith("-")), None)
    if argv is not None and name is not None and name not in _COMMAND_MODULES and (
            name in {c.name for c in app.registered_commands}):
        return
    wanted = [_COMMAND_MODULES[name]] if argv is not None and name in _COMMAND_MODULES else (
        sorted(set(_COMMAND_MODULES.values())))
    for module in wanted:
        importlib.import_module(module)


def full_app() -> typer.Typer:
    """The app with every command registered (for tests and docs that drive `app`)."""
    load_commands(None)
    return app


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app, turning bad input into one line and exit code 2."""
    try:
        load_commands(sys.argv[1:] if argv is None else argv)
        rv = app(args=argv, standalone_mode=False, prog_name="vramcalc")
        if isinstance(rv, int):  # click returns Exit codes instead of raising here
            return rv
    except InputError as err:
        sys.stderr.write(f"error: {err}\n")
        return EXIT_BAD_INPUT
    except (typer.Exit, SystemExit) as err:
        code = getattr(err, "exit_code", getattr(err, "code", 0))
        return int(code or 0)
    except Exception as err:  # typer vendors click: match its exceptions by shape
        name = type(err).__name__
        if name == "Exit":
            return int(getattr(err, "exit_code", 0) or 0)
        if name == "Abort":
            sys.stderr.write("aborted\n")
            return 130
        if hasattr(err, "format_message") and hasattr(err, "exit_code"):
            sys.stderr.write(f"error: {' '.join(err.format_message().split())}\n")
            return EXIT_BAD_INPUT
        raise
    except BrokenPipeError:
        return 0
    return 0


def run() -> None:
    """Console-script entry."""
    sys.exit(main())
