"""The typer app, the shared scenario options, output helpers and `main`: argv in, exit
code out.

Every bad input ends as one line on stderr and exit code 2 (InputError, malformed files,
usage errors); `--json` prints exactly one JSON document on stdout. The commands live in
the sibling modules; vramcalc/cli/__init__.py registers them on `app`, in help order.
"""

from __future__ import annotations

import inspect
import io
import json
import os
import shlex
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

from vramcalc.errors import InputError, one_line
from vramcalc.options import OPTIONS_BY_NAME, SCENARIO_OPTIONS, Opt
from vramcalc.provenance import provenance

app = typer.Typer(
    name="vramcalc",
    help="Will this training job fit in GPU memory, how should it run, what should I buy?",
    add_completion=True,  # typer's --install-completion / --show-completion (bash, zsh, fish)
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

EXIT_BAD_INPUT = 2
KW = inspect.Parameter.KEYWORD_ONLY


def _print_version(value: bool) -> None:
    if value:
        info = provenance()
        sys.stdout.write(f"vramcalc {info['vramcalc_version']} (GPU profiles "
                         f"{info['gpu_profiles_revision']}, model catalog "
                         f"{info['model_catalog_revision']})\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    show_version: bool = typer.Option(False, "--version", callback=_print_version,
                                      is_eager=True,
                                      help="Print the version and the catalog revisions."),
) -> None:
    """Will this training job fit in GPU memory, how should it run, what should I buy?"""


# ---- command lines ----------------------------------------------------------------
def option_words(name: str, v: Any) -> list[str]:
    """An option's value as command-line words (a list as its comma-joined names)."""
    opt = OPTIONS_BY_NAME[name]
    if opt.kind is bool:
        return [opt.flag if v else "--no-" + opt.flag[2:]]
    return [opt.flag, (",".join(map(str, v)) or "none") if isinstance(v, (tuple, list))
            else str(v)]


def command_line(command: str, values: dict[str, Any], extra: dict[str, Any],
                 defaults: dict[str, Any] | None = None) -> str:
    """The command that reruns with `values`, leaving out options at their defaults (the
    scenario options' own, or `defaults` where the command has others)."""
    parts = ["vramcalc", command]
    default = {o.name: o.default for o in SCENARIO_OPTIONS} | (defaults or {})
    for opt in SCENARIO_OPTIONS:
        v = values.get(opt.name)
        if v is None or (v == default[opt.name] and opt.name not in ("model", "gpus")):
            continue
        parts += option_words(opt.name, v)
    for flag, v in extra.items():
        if v is not None:
            parts += [flag, str(v)]
    return " ".join(shlex.quote(p) for p in parts)


# ---- shared scenario options -------------------------------------------------
def _param(opt: Opt, default_override: Any = inspect.Parameter.empty) -> inspect.Parameter:
    default = opt.default if default_override is inspect.Parameter.empty else default_override
    if opt.kind is bool:
        info = typer.Option(default, f"{opt.flag}/--no-{opt.flag[2:]}", help=opt.help)
        annotation: Any = bool if default is not None else Optional[bool]
    else:
        info = typer.Option(default, opt.flag, help=opt.help)
        annotation = Optional[str] if opt.kind is str or opt.choices else Optional[opt.kind]
        if opt.kind is float:
            annotation = Optional[float]
    return inspect.Parameter(opt.name, KW, default=info, annotation=annotation)


def option(name: str, annotation: Any, default: Any, *flags: str, help: str) -> inspect.Parameter:
    """A command's own option, for `scenario_command(extra=[...])`."""
    return inspect.Parameter(name, KW, annotation=annotation,
                             default=typer.Option(default, *flags, help=help))


PROFILES_DIR = option("profiles_dir", Optional[Path], None, "--profiles-dir",
                      help="Extra folder of GPU profile YAML files (also: VRAMCALC_PROFILES).")
AS_JSON = option("as_json", bool, False, "--json", help="One JSON document on stdout.")


ENGINE = option("engine", str, "analytic", "--engine",
                help="analytic (default) or trace: the trace engine's fit, which replays the "
                     "caching allocator near the card's limit (needs torch; a fake-tensor "
                     "training step per scenario tried).")


def fit_engine(name: str, scn: Any) -> Callable[[Any], Any] | None:
    """The report function `--engine` names for `scn`: None for the analytic estimate, the
    trace engine's (torch loaded here only) after checking the trace runs the layout."""
    if name not in ("analytic", "trace"):
        raise InputError(f"--engine must be analytic or trace, got {name!r}")
    if name == "analytic":
        return None
    try:  # the torch engine loads for this option only (torch is an optional extra)
        from vramcalc.trace.distributed import check_any_traceable, trace_any
    except ImportError as err:
        raise InputError(f"--engine trace needs PyTorch: pip install torch ({err})") from None
    check_any_traceable(scn)
    return trace_any


def scenario_command(help_text: str, extra: list[inspect.Parameter] | None = None,
                     defaults: dict[str, Any] | None = None, with_context: bool = False,
                     exclude: tuple[str, ...] = (),
                     ) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Make `func(**kwargs)` a typer command taking every scenario option (one table:
    vramcalc.options) but those in `exclude`, to register on `app` (vramcalc/cli/__init__.py).

    `extra` adds the command's own options and `defaults` overrides the table's; with
    `with_context` the command gets typer's Context as `ctx` (for commands that take
    trailing arguments, e.g. `probe --run -- CMD`).
    """

    def decorate(func: Callable[..., None]) -> Callable[..., None]:
        params = []
        if with_context:
            params.append(inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                            annotation=typer.Context))
        params += [_param(o, (defaults or {}).get(o.name, inspect.Parameter.empty))
                   for o in SCENARIO_OPTIONS if o.name not in exclude]
        params += list(extra or []) + [PROFILES_DIR, AS_JSON]

        def command(**kwargs: Any) -> None:
            func(**kwargs)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__name__ = func.__name__
        command.__doc__ = help_text
        return command

    return decorate


def given_values(ctx: typer.Context, values: dict[str, Any]) -> dict[str, Any]:
    """The option values typed on the command line (not left at their defaults), so that a
    DeepSpeed file fills only the rest."""
    return {k: v for k, v in values.items()
            if getattr(ctx.get_parameter_source(k), "name", "") != "DEFAULT"}


def split_values(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[Path] | None, bool]:
    """Take the scenario options out of a command's `kwargs`: (the values given, the
    profile folders, --json). What is left in `kwargs` are the command's own options."""
    values = {o.name: kwargs.pop(o.name) for o in SCENARIO_OPTIONS if o.name in kwargs}
    values = {k: v for k, v in values.items() if v is not None}
    pdir = kwargs.pop("profiles_dir", None)
    as_json = kwargs.pop("as_json", False)
    return values, [pdir] if pdir else None, as_json


# ---- output and exit codes -----------------------------------------------------
def emit_json(doc: dict[str, Any]) -> None:
    """One JSON document on stdout: the version and catalog revisions that produced it
    (vramcalc.provenance), then the command's own keys (strict JSON: a NaN or infinity is
    an error, never printed as the invalid `NaN` / `Infinity`)."""
    sys.stdout.write(json.dumps({**provenance(), **doc}, indent=2, sort_keys=False,
                                allow_nan=False) + "\n")


def emit_text(text: str) -> None:
    """Plain text (markdown) on stdout, as it is."""
    sys.stdout.write(text)


def note(text: str) -> None:
    """A `note:` line on stderr (beside JSON on stdout)."""
    sys.stderr.write(f"note: {text}\n")


def fail(text: str, code: int) -> typer.Exit:
    """Write `error: text` on stderr; the Exit to raise with `code`."""
    sys.stderr.write(f"error: {one_line(text)}\n")
    return typer.Exit(code)


DEBUG_ENV = "VRAMCALC_DEBUG"  # =1: the last-resort handler prints the traceback too


def main(argv: list[str] | None = None) -> int:
    """Run one command line (sys.argv when None); the exit code. Bad input is one line on
    stderr and exit code 2, never a traceback: InputError and usage errors say what to fix;
    anything unexpected is one `error: internal error ...` line (the traceback only with
    VRAMCALC_DEBUG=1). A reader that closes stdout early (`| head`) ends the run quietly."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # a closed stdout raises here, not at interpreter exit
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return 1
    except Exception as err:  # the last resort: never a traceback
        if os.environ.get(DEBUG_ENV) == "1":
            traceback.print_exc()
        sys.stderr.write(
            f"error: internal error ({type(err).__name__}: {one_line(str(err), 200)}); "
            f"please report it, with the command line, on the project's issue tracker (set "
            f"{DEBUG_ENV}=1 for the traceback)\n")
        return EXIT_BAD_INPUT


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass


def _run(argv: list[str] | None) -> int:
    try:
        rv = app(args=argv, standalone_mode=False, prog_name="vramcalc")
        if isinstance(rv, int):  # click returns Exit codes instead of raising here
            return rv
    except InputError as err:
        sys.stderr.write(f"error: {one_line(str(err))}\n")
        return EXIT_BAD_INPUT
    except (typer.Exit, SystemExit) as err:
        code = getattr(err, "exit_code", getattr(err, "code", 0))
        return int(code or 0)
    except Exception as err:  # typer vendors click in some versions: match its exceptions by shape
        name = type(err).__name__
        if name == "Exit":
            return int(getattr(err, "exit_code", 0) or 0)
        if name == "Abort":
            sys.stderr.write("aborted\n")
            return 130
        if hasattr(err, "format_message") and hasattr(err, "exit_code"):  # usage errors
            sys.stderr.write(f"error: {one_line(err.format_message())}\n")
            return EXIT_BAD_INPUT
        raise
    return 0

