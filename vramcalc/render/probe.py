"""Rendering `vramcalc probe`: a measured record beside the estimates, and `--run` records."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from vramcalc.units import GB, GiB


def _gb(v: int | None) -> str:
    return "-" if v is None else f"{v / GB:,.3f} GB ({v / GiB:,.3f} GiB)"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.2f}%"


def print_probe_record(console: Console, rec: dict[str, Any]) -> None:
    """One probe record: the device, measured vs analytic and trace peaks, reserved peak."""
    dev = rec["device"]
    m = rec["measured"]
    console.print(f"Device: {dev['name']} ({dev['type']})"
                  + (" — dry run: the trace tracker stands in for the device" if m.get("dry_run")
                     else ""))
    if rec["status"] == "oom":
        failed = (rec.get("oom") or {}).get("failed_alloc_bytes")
        console.print("[bold red]DID NOT FIT[/bold red]: out of memory"
                      + (f" while allocating {_gb(failed)}" if failed else ""))
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("")
    table.add_column("peak allocated", justify="right")
    table.add_column("vs measured", justify="right")
    table.add_row("measured", _gb(m.get("max_memory_allocated_bytes")), "")
    for eng in ("analytic", "trace"):
        part = rec.get(eng)
        if part:
            table.add_row(eng, _gb(part["peak_allocated_bytes"]), _pct(part.get("rel_error")))
    console.print(table)
    if m.get("max_memory_reserved_bytes") is not None:
        total = (f", analytic device total {_gb(rec['analytic']['device_total_bytes'])}"
                 if rec.get("analytic") else "")
        console.print(f"reserved peak {_gb(m['max_memory_reserved_bytes'])}, context "
                      f"{_gb(m.get('context_bytes'))}{total}")
    if rec.get("_written_to"):
        console.print(f"record: {rec['_written_to']}")


def print_run_records(console: Console, doc: dict[str, Any]) -> None:
    """`probe --run`: one row per rank's record, and the `--compare` estimate if any."""
    table = Table(title=f"{' '.join(doc['command'])} (exit {doc['exit_code']})",
                  title_justify="left", show_edge=False, pad_edge=False)
    for col in ("rank", "device", "max allocated", "max reserved", "nvidia-smi (NVML)",
                "host peak RSS"):
        table.add_column(col, justify="left" if col in ("rank", "device") else "right")
    for r in doc["ranks"]:
        d = r.get("device", {})
        table.add_row(str(r.get("rank")), str(d.get("name", d.get("type"))),
                      _gb(d.get("max_memory_allocated_bytes")),
                      _gb(d.get("max_memory_reserved_bytes")), _gb(r.get("nvml_used_bytes")),
                      _gb(r.get("host_peak_rss_bytes")))
    console.print(table)
    if not doc["ranks"]:
        console.print("no record was written (did the command start Python?)")
    est = doc.get("estimate")
    if est:
        console.print(f"estimate for {est['config']}: peak allocated "
                      f"{_gb(est['peak_allocated_bytes'])}, device total "
                      f"{_gb(est['device_total_bytes'])}")
