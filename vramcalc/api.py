"""The public Python API: the CLI's `estimate` and `plan` as functions, and model loading.

Keyword names are the command-line option names in snake_case (`--seq-len` is `seq_len=`,
`--zero` is `zero=`), with the same defaults, choices and checks: `vramcalc estimate --help`
lists them. Values may be given as the CLI takes them (`offload="optimizer,params"`,
`allow="precision,optimizer"`) or as Python values (`offload=("optimizer",)`,
`sequence_parallel=True`). Bad input raises `vramcalc.InputError` (a ValueError) with the
one-line message the CLI prints. Nothing here prints, writes files or imports torch.

Stable names (docs/api.md): estimate, plan, load_model, MemoryReport, PlanResult, PlanEntry,
ModelSpec, InputError. Everything else in the package may change between releases.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vramcalc.analytic import estimate as _estimate
from vramcalc.catalog import resolve_model
from vramcalc.errors import InputError
from vramcalc.model import ModelSpec
from vramcalc.options import build_scenario
from vramcalc.planner import PlanEntry, PlanResult, search
from vramcalc.planner.prepare import prepare_plan
from vramcalc.report import MemoryReport

__all__ = ["InputError", "MemoryReport", "ModelSpec", "PlanEntry", "PlanResult", "estimate",
           "load_model", "plan"]

PathLike = str | os.PathLike[str]


def _profile_dirs(profiles_dir: PathLike | None) -> list[Path] | None:
    return [Path(profiles_dir)] if profiles_dir is not None else None


def load_model(path_or_id: PathLike) -> ModelSpec:
    """The model spec for a preset name or alias (`"70b"`, `"llama3-8b"`), a Hugging Face
    repo id of a preset, or a local path: a `config.json`, its folder, or a model YAML.
    Never downloads and never runs remote code. `num_params` is the exact count."""
    spec, _note = resolve_model(os.fspath(path_or_id))
    return spec


def estimate(model: PathLike, gpus: str = "1xH100", *, profiles_dir: PathLike | None = None,
             **strategy: Any) -> MemoryReport:
    """Per-GPU memory of one training scenario: `vramcalc estimate --json` as an object.

    `model` and `gpus` as on the command line (`"70b"`, `"8xH100"`, `"2x8xA100-80GB"`);
    `strategy` takes the other options (seq_len, micro_batch_size, zero, tp, pp, recompute,
    precision, optimizer, finetune, framework, headroom, ...). Bytes are ints;
    `report.fits` compares `device_total_bytes` with the GPU's memory less the headroom.
    """
    values = {"model": os.fspath(model), "gpus": gpus, **strategy}
    return _estimate(build_scenario(values, _profile_dirs(profiles_dir)))


def plan(model: PathLike, gpus: str = "1xH100", *, global_batch_size: int | None = None,
         global_batch_tokens: str | int | None = None, allow: str | Iterable[str] | None = None,
         top: int = 5, mfu: float | None = None, profiles_dir: PathLike | None = None,
         **options: Any) -> PlanResult:
    """The layouts that fit on the cluster, fastest first: `vramcalc plan` as an object.

    Layout options given (dp, tp, pp, zero, fsdp, recompute, micro_batch_size, ...) pin the
    search; `allow` names the training settings it may change (precision, optimizer,
    offload, finetune). `result.entries` holds up to `top` fitting PlanEntry objects (each
    with `.report`, `.speed`, `.scenario`); when none fits it is empty and `result.closest`
    is the layout that came nearest.
    """
    if allow is not None and not isinstance(allow, str):
        allow = ",".join(allow)
    tokens = str(global_batch_tokens) if global_batch_tokens is not None else None
    values = {"model": os.fspath(model), "gpus": gpus, **options}
    base, req, notes = prepare_plan(values, global_batch_size, tokens, allow, top, mfu,
                                    _profile_dirs(profiles_dir))
    result = search(base, req)
    result.notes[:0] = notes
    return result
