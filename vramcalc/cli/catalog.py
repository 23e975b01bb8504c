"""`vramcalc gpus` and `vramcalc models`: the GPU profiles and the built-in models."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from vramcalc.catalog import list_preset_entries
from vramcalc.cli.app import emit_json
from vramcalc.hardware import load_profiles
from vramcalc.render.catalog import gpus_table, models_table
from vramcalc.render.console import make_console


def gpus_cmd(
    profiles_dir: Optional[Path] = typer.Option(None, "--profiles-dir",
                                                help="Extra folder of GPU profile YAML files."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """The GPU catalog: usable memory, peak BF16 TFLOP/s, links, price."""
    profiles = load_profiles([profiles_dir] if profiles_dir else None)
    if as_json:
        emit_json({"gpus": [p.model_dump(mode="json") for p in profiles.values()]})
        return
    console = make_console()
    console.print(gpus_table(list(profiles.values()), console.width))


def models_cmd(
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """The built-in model catalog with aliases and exact parameter counts."""
    entries = list_preset_entries()
    if as_json:
        emit_json({"models": [
            {**e.spec.model_dump(mode="json"), "num_params": e.spec.num_params,
             "aliases": list(e.meta.aliases)} for e in entries]})
        return
    console = make_console()
    console.print(models_table(entries, console.width))
