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

from vramcalc.errors import InputError

SCHEMA = "vramcalc.probe/1"


def rel_error(predicted: int | None, measured: int | None) -> float | None:
    """(predicted − measured) / measured, or None when either is missing."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def write_record(record: dict[str, Any], path: Path) -> Path:
    """Write one record as indented JSON; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def read_records(folder: Path) -> list[dict[str, Any]]:
    """All probe records (*.json with the probe schema) in a folder, sorted by file name."""
    if not folder.is_dir():
        raise InputError(f"no such folder: {folder}")
    out = []
    for path in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise InputError(f"{path}: not a JSON probe record ({err})") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise InputError(f"{path}: not a vramcalc probe record (schema {SCHEMA!r})")
        doc["_path"] = str(path)
        out.append(doc)
    return out
