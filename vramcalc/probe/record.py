"""Probe records: one JSON document per measured run (and per rank for multi-GPU runs).

Schema (stable keys, bytes as ints):
{
  "schema": "vramcalc.probe/1",
  "kind": "builtin" | "run",
  "device": {"name", "type" (cuda|rocm|npu|cpu), "total_memory_bytes", "index"},
  "versions": {"torch", "cuda", "hip", "driver", "python", "vramcalc"},
  "scenario": {option values as given to vramcalc.options.build_scenario},
  "rank": int, "world_size": int,
  "status": "ok" | "oom",
  "oom": {"message", "failed_alloc_bytes"} | null,
  "measured": {"max_memory_allocated_bytes", "max_memory_reserved_bytes", "context_bytes",
               "num_alloc_retries", "active_peak_bytes", "nvml_used_bytes"},
  "analytic": {"peak_allocated_bytes", "device_total_bytes", "rel_error"} | null,
  "trace": {"peak_allocated_bytes", "rel_error"} | null
}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

import vramcalc.safeio as safeio
from vramcalc.errors import InputError, shown_path

SCHEMA = "vramcalc.probe/1"


def rel_error(predicted: int | None, measured: int | None) -> float | None:
    """(predicted − measured) / measured, or None when either is missing."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def write_record(record: dict[str, Any], path: Path) -> Path:
    """Write one record as indented JSON; returns the path. InputError when the folder
    cannot be made or the file written (e.g. --out names a file)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2, sort_keys=True, allow_nan=False) + "\n",
                        encoding="utf-8")
    except OSError as err:
        raise InputError(f"cannot write the probe record {shown_path(path)}: "
                         f"{err.strerror or type(err).__name__}") from None
    return path


class _Measured(BaseModel):
    """The measured figures `validate --records` reads (others are kept, unchecked)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    max_memory_allocated_bytes: int | None = Field(None, ge=0)
    max_memory_reserved_bytes: int | None = Field(None, ge=0)
    context_bytes: int | None = Field(None, ge=0)
    dry_run: bool = False


class _Device(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=300)


class _Record(BaseModel):
    """What a stored probe record must hold to be compared: a measured run's figures, the
    device's name and the option values it ran with."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    schema_: str = Field(alias="schema")
    kind: str
    status: str
    scenario: dict[str, Any]
    device: _Device
    measured: _Measured = Field(default_factory=_Measured)


def read_records(folder: Path) -> list[dict[str, Any]]:
    """All probe records (*.json with the probe schema) in a folder, sorted by file name;
    each read through vramcalc.safeio and checked for the fields `validate --records`
    uses (InputError naming the file and the field)."""
    if safeio.path_kind(folder) != "dir":
        raise InputError(f"no such folder: {shown_path(folder)}")
    out = []
    for path in safeio.list_dir(folder, "records folder"):
        if path.suffix != ".json":
            continue
        doc = safeio.read_json(path, "probe record")
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise InputError(f"{shown_path(path)}: not a vramcalc probe record (schema "
                             f"{SCHEMA!r})")
        try:
            _Record.model_validate(doc)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(x) for x in first["loc"]).replace("schema_", "schema")
            raise InputError(f"{shown_path(path)}: probe record field {where or 'record'}: "
                             f"{first['msg']}") from None
        doc["_path"] = str(path)
        out.append(doc)
    return out
