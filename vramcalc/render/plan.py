"""Rendering for `plan`, `size` and `check`: rich tables, plain lines and markdown."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text

from vramcalc.planner.search import paged_host_bytes
from vramcalc.provenance import provenance
from vramcalc.render.console import print_command
from vramcalc.render.report import (
    TERM_LABELS,
    evidence_line,
    note_markup,
    print_report,
    strategy_line,
)
from vramcalc.render.tables import Column, fitted_table
from vramcalc.report import MemoryReport, fit_phrase, paged_resident_bytes
from vramcalc.units import GB, GiB, fmt_gb

SPEED_LABELS = {"compute": "compute", "bubble": "pipeline bubble", "tp_comm": "TP comm",
                "cp_comm": "CP comm", "ep_comm": "EP comm", "dp_comm": "DP/ZeRO comm",
                "pp_comm": "PP p2p", "offload": "offload", "dequant": "NF4 dequant"}


# ---- small formatters -------------------------------------------------------------------
def layout_text(s: dict[str, Any]) -> str:
    """Parallel degrees above 1, e.g. 'dp2×tp4 sp'; '1 GPU' when none."""
    deg = [f"{k}{s[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if s.get(k, 1) > 1]
    text = "×".join(deg) if deg else "1 GPU"
    if s.get("sequence_parallel"):
        text += " sp"
    return text


def sharding_text(s: dict[str, Any]) -> str:
    """'fsdp full (8)' or 'zero-N'."""
    if s.get("fsdp", "none") != "none":
        extra = f" ({s['shard_group']})" if s.get("shard_group") else ""
        return f"fsdp {s['fsdp']}{extra}"
    return f"zero-{s.get('zero', 0)}"


def pipeline_text(s: dict[str, Any]) -> str:
    """The pipeline schedule, '-' without pipeline parallelism."""
    if s.get("pp", 1) == 1:
        return "-"
    if s.get("pp_schedule") == "interleaved":
        return f"interl. v{s.get('virtual_stages', 1)}"
    return str(s.get("pp_schedule", "1f1b"))


def offload_text(s: dict[str, Any]) -> str:
    """What is offloaded and where, e.g. 'opt+grads→cpu'; '-' for nothing."""
    off = s.get("offload") or []
    if not off:
        return "-"
    short = {"optimizer": "opt", "gradients": "grads", "params": "params"}
    return "+".join(short.get(o, o) for o in off) + (
        "→nvme" if s.get("offload_device") == "nvme" else "→cpu")


def paged_text(offload: str, entry: Any) -> str:
    """The offload cell, with the paged optimizer pages that live in host RAM ("paged→cpu":
    the driver migrates them at each step, vramcalc/terms/optimizer_states.py)."""
    if not paged_host_bytes(entry.scenario, entry.report):
        return offload
    return "paged→cpu" if offload == "-" else f"{offload}, paged→cpu"


def duration_text(seconds: float) -> str:
    """Seconds as s, min or h."""
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.1f} h"


def strategy_flags(s: dict[str, Any]) -> list[str]:
    """CLI flags that reproduce a strategy with `vramcalc estimate` (non-default values)."""
    flags = []
    for key, default in (("dp", None), ("tp", 1), ("pp", 1), ("cp", 1), ("ep", 1),
                         ("etp", None)):
        if s.get(key) is not None and s[key] != default and (key != "dp" or s[key] > 1):
            flags += [f"--{key}", str(s[key])]
    if s.get("sequence_parallel"):
        flags.append("--sequence-parallel")
    if s.get("fsdp", "none") != "none":
        flags += ["--fsdp", s["fsdp"]]
        if s.get("shard_group"):
            flags += ["--shard-group", str(s["shard_group"])]
    elif s.get("zero"):
        flags += ["--zero", str(s["zero"])]
    if s.get("offload"):
        flags += ["--offload", ",".join(s["offload"])]
        if s.get("offload_device") == "nvme":
            flags += ["--offload-device", "nvme"]
    if s.get("pp", 1) > 1 and s.get("pp_schedule") != "1f1b":
        flags += ["--pp-schedule", s["pp_schedule"]]
        if s.get("virtual_stages", 1) > 1:
            flags += ["--virtual-stages", str(s["virtual_stages"])]
    if s.get("recompute", "none") != "none":
        flags += ["--recompute", s["recompute"]]
    flags += ["--micro-batch-size", str(s.get("micro_batch_size", 1))]
    if s.get("grad_accum", 1) > 1:
        flags += ["--grad-accum", str(s["grad_accum"])]
    for key, usual in (("seq_len", 4096), ("precision", "bf16"), ("optimizer", "adamw")):
        if key in s and s[key] != usual:
            flags += ["--" + key.replace("_", "-"), str(s[key])]
    if s.get("finetune") not in (None, "full", "none"):
        flags += ["--finetune", str(s["finetune"])]
    if s.get("optimizer_in_backward"):
        flags.append("--optimizer-in-backward")
    for key in ("first_stage_layers", "last_stage_layers"):
        if s.get(key):
            flags += ["--" + key.replace("_", "-"), str(s[key])]
    if s.get("stage_layers"):
        flags += ["--stage-layers", ",".join(map(str, s["stage_layers"]))]
    for key in ("embedding_in_split", "loss_in_split"):
        if s.get(key):
            flags.append("--" + key.replace("_", "-"))
    if s.get("mtp_layers"):
        flags += ["--mtp-layers", str(s["mtp_layers"])]
    return flags


def config_yaml(model: str, gpus: str, s: dict[str, Any], carried: dict[str, Any]) -> str:
    """A `vramcalc check` config for a strategy and the options carried with it (keys =
    option names)."""
    flags = strategy_flags(s)
    lines = [f"model: {model}", f"gpus: {gpus}"]
    i = 0
    while i < len(flags):
        key = flags[i][2:].replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            lines.append(f"{key}: {flags[i + 1]}")
            i += 2
        else:
            lines.append(f"{key}: true")
            i += 1
    for key, v in carried.items():
        text = (str(v).lower() if isinstance(v, bool) else ",".join(v)
                if isinstance(v, (tuple, list)) else f"{v:g}" if isinstance(v, float) else v)
        if isinstance(v, str) and yaml.safe_load(text) != v:
            text = json.dumps(v)  # a release such as 0.2 would read back as a number
        lines.append(f"{key}: {text}")
    return "\n".join(lines)


# ---- plan -------------------------------------------------------------------------------
def changed_value(s: dict[str, Any], key: str) -> str:
    """A changed setting's new value; torchtitan's FP8 is its compiled Float8Linear (the
    planner's precision "fp8" there, planner/candidates.py `precision_update`)."""
    if key == "precision" and s.get("float8"):
        return "float8"
    return str(s[key])


def plan_table(entries: Sequence[Any], usable_bytes: int, title: str,
               width: int = 120) -> Table:
    """Ranked strategies: speed, layout, sharding, memory and what is left free. Columns of
    less value are dropped to fit `width`; numbers are never cut."""
    changed = any(e.changes for e in entries)
    columns = [Column("#", "right"), Column("tokens/s", "right"), Column("MFU", "right", 3),
               Column("layout", wrap=True), Column("ZeRO/FSDP", rank=4, wrap=True),
               Column("recompute", rank=5), Column("mbs×acc", "right", 6),
               Column("pipeline", rank=7), Column("offload", rank=8), Column("GB", "right"),
               Column("free", "right", 2)]
    if changed:
        columns.append(Column("changed", rank=1, wrap=True))
    rows = []
    for i, e in enumerate(entries, 1):
        s = e.report.strategy
        extra = [", ".join(changed_value(s, k) for k in e.changes) or "-"] if changed else []
        rows.append([
            str(i), f"{e.speed.tokens_per_s:,.0f}", f"{100 * e.speed.mfu:.1f}%",
            layout_text(s), sharding_text(s), str(s.get("recompute", "none")),
            f"{s.get('micro_batch_size', 1)}×{s.get('grad_accum', 1)}", pipeline_text(s),
            paged_text(offload_text(s), e), f"{e.report.device_total_bytes / GB:,.1f}",
            f"{(usable_bytes - e.report.device_total_bytes) / GB:,.1f}", *extra])
    table, dropped = fitted_table(title, columns, rows, width)
    if dropped:
        table.caption = f"(narrow terminal: {', '.join(dropped)} not shown; --json has all)"
        table.caption_justify = "left"
    return table


def speed_text(speed: Any) -> str:
    """Tokens/s, step time, MFU and where the step time goes."""
    step = speed.step_time_s
    parts = ", ".join(f"{SPEED_LABELS[k]} {100 * v / step:.0f}%"
                      for k, v in speed.parts_s.items() if v > 0.0005 * step)
    return (f"Speed: {speed.tokens_per_s:,.0f} tokens/s, step {duration_text(step)} "
            f"(MFU {100 * speed.mfu:.1f}% at {speed.efficiency:.0%} achievable of "
            f"{speed.peak_flops_per_gpu / 1e12:,.0f} TFLOP/s peak): {parts}")


def print_plan(console: Console, doc: dict[str, Any]) -> None:
    """The plan command's output; `doc` is assembled by vramcalc/cli/plan.py."""
    res = doc["result"]
    base = doc["base"]
    gpu = base.cluster.gpu
    m = base.model
    console.print(f"[bold]{m.name}[/bold]: {m.num_params:,} parameters on "
                  f"{base.cluster.num_gpus} x {gpu.name} ({base.cluster.num_nodes} node"
                  f"{'s' if base.cluster.num_nodes > 1 else ''}, {fmt_gb(gpu.memory_total_bytes)}"
                  f" each, {base.headroom_fraction:.0%} kept free)")
    console.print(doc["fixed_line"])
    console.print(f"[dim]Considered {res.num_candidates:,} strategies in {doc['elapsed_s']:.2f} s:"
                  f" speed computed for {res.num_expanded:,}, {res.num_bound_pruned:,} over a "
                  f"memory lower bound, {res.num_estimated:,} estimated"
                  + (f", {res.num_dominated:,} dominated" if res.num_dominated else "")
                  + (f", {res.num_rejected:,} refused by the engine" if res.num_rejected else "")
                  + "[/dim]")
    for note in doc["notes"]:
        console.print(note_markup(note))
    console.print()
    usable = base.usable_bytes
    if res.entries:
        console.print(plan_table(res.entries, usable,
                                 f"Top {len(res.entries)} strategies that fit, fastest first",
                                 console.width))
        console.print()
        best = res.entries[0]
        console.print("[bold]Best strategy (#1)[/bold]")
        print_report(console, best.report)
        console.print(speed_text(best.speed))
        console.print()
        console.print("[bold]Next[/bold]")
        print_command(console, "  see one strategy:  ", doc["estimate_cmd"])
        console.print("  guard it in CI:    save the config below as train.yaml and run "
                      "`vramcalc check train.yaml` (docs/ci.md)")
        console.print(Text(_indent(doc["config_yaml"], 4), style="dim"))
        return
    console.print(Text.assemble(("NOTHING FITS", "bold red"),
                                f": no strategy for {m.name} fits in {fmt_gb(usable)} per GPU "
                                f"on {base.cluster.num_gpus} x {gpu.name}."))
    if res.closest is not None:
        c = res.closest
        console.print(f"Closest strategy "
                      f"{fit_phrase(c.report.device_total_bytes, usable, gpu.memory_total_bytes)}:")
        console.print()
        print_report(console, c.report)
    console.print()
    sugg = doc["suggestions"]
    if not sugg:
        console.print("No single change tried makes it fit (more GPUs, another GPU type, "
                      "offload, 8-bit optimizer, shorter sequences).")
        return
    console.print("[bold]Smallest changes that fit[/bold] (each with its best strategy; "
                  f"found in {doc['suggest_s']:.1f} s):")
    for i, s in enumerate(sugg, 1):
        console.print(f"  {i}. {suggestion_line(s)}")
        console.print(f"     [dim]{s.entry.report.strategy and _short(s.entry)}[/dim]")
        print_command(console, "     try: ", doc["apply"][i - 1], style="dim")


def suggestion_line(s: Any) -> str:
    """One change that would fit: its speed, memory and host RAM."""
    e = s.entry
    text = (f"{s.title}: {e.speed.tokens_per_s:,.0f} tokens/s, "
            f"{fmt_gb(e.report.device_total_bytes)} per GPU")
    host = s.details.get("host_bytes_per_node")
    if host:
        text += f", needs {fmt_gb(host, 0)} of host RAM per node"
    return text


def _short(entry: Any) -> str:
    s = entry.report.strategy
    return (f"{layout_text(s)}, {sharding_text(s)}, recompute {s.get('recompute')}, "
            f"micro-batch {s.get('micro_batch_size')}×{s.get('grad_accum')}, "
            f"pipeline {pipeline_text(s)}, offload {offload_text(s)}")


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())


# ---- size -------------------------------------------------------------------------------
def _size_shown(r: Any, most: int = 8) -> list[Any]:
    """The rows shown for one GPU type (--json lists every size): the smallest size that
    fits, the answer, twice and four times the answer, and power-of-two node counts in
    between, thinned to at most `most` rows."""
    gpn = r.gpu.gpus_per_node
    first, answer = r.table[0].num_gpus, r.num_gpus

    def pow2(n: int) -> bool:
        nodes, part = divmod(n, gpn)
        return part != 0 or (nodes & (nodes - 1)) == 0

    between = [o for o in r.table if first < o.num_gpus < answer and pow2(o.num_gpus)]
    room = max(most - 4, 0)
    if len(between) > room:
        step = len(between) / room if room else len(between) + 1
        between = [between[int(i * step)] for i in range(room)]
    keep = {first, answer, 2 * answer, 4 * answer} | {o.num_gpus for o in between}
    return [o for o in r.table if o.num_gpus in keep]


def size_table(rows: Sequence[Any], title: str, width: int = 120) -> Table:
    """`vramcalc size`: per GPU type, cluster sizes from the smallest that fits towards the
    knee, with days, GPU-hours and cost; the answer is marked with an arrow."""
    columns = [Column("GPU"), Column("GPUs", "right"), Column("nodes", "right", 5),
               Column("days", "right"), Column("GPU-hours", "right"),
               Column("cost USD", "right", 1), Column("tokens/s", "right", 4),
               Column("MFU", "right"), Column("layout", rank=2, wrap=True),
               Column("ZeRO/FSDP", rank=3, wrap=True), Column("recompute", rank=6)]
    cells: list[list[str | Text]] = []
    for r in rows:
        if r.entry is None:
            cells.append([r.gpu.id, "-", "-", "-", "-", "-", "-", "-",
                          "; ".join(r.notes) or "does not fit", "", ""])
            continue
        gpn = r.gpu.gpus_per_node
        for i, o in enumerate(_size_shown(r)):
            s = o.entry.report.strategy
            mark = " ◀" if o.num_gpus == r.num_gpus else ""
            cells.append([
                r.gpu.id if i == 0 else "", f"{o.num_gpus:,}{mark}",
                f"{o.num_gpus // gpn:,}" if o.num_gpus >= gpn else f"{o.num_gpus}/{gpn}",
                f"{o.days:,.1f}" if o.days >= 1 else f"{o.days:.2g}", f"{o.gpu_hours:,.0f}",
                f"{o.cost_usd:,.0f}" if o.cost_usd is not None else "?",
                f"{o.entry.speed.tokens_per_s:,.0f}", f"{100 * o.entry.speed.mfu:.1f}%",
                layout_text(s), sharding_text(s), str(s.get("recompute", "none"))])
    table, dropped = fitted_table(title, columns, cells, width)
    if dropped:
        table.caption = f"(narrow terminal: {', '.join(dropped)} not shown; --json has all)"
        table.caption_justify = "left"
    return table


def _gpus(n: int) -> str:
    return f"{n:,} GPU" + ("" if n == 1 else "s")


def _duration(days: float) -> str:
    """Days from one day up, else hours, else minutes."""
    if days >= 1:
        return f"{days:,.1f} days"
    hours = 24 * days
    return f"{hours:.1f} hours" if hours >= 1 else f"{60 * hours:.0f} minutes"


def print_size(console: Console, rows: Sequence[Any], title: str, notes: Sequence[str]) -> None:
    """The size table, the answer per GPU type, the GPU names and the notes."""
    console.print(size_table(rows, title, console.width))
    for r in rows:
        if r.entry is None:
            continue
        price = (f" at ${r.price_usd_per_hour:,.2f}/GPU-hour" if r.price_usd_per_hour
                 is not None else "")
        cost = f", ${r.cost_usd:,.0f}{price}" if r.cost_usd is not None else ""
        console.print(f"{r.gpu.name}: {_gpus(r.num_gpus)}, {_duration(r.days)}, "
                      f"{r.gpu_hours:,.0f} GPU-hours{cost} (smallest that fits: "
                      f"{_gpus(r.min_gpus)})")
        for n in r.notes:
            console.print(f"[dim]note ({r.gpu.id}): {n}[/dim]")
    for n in notes:
        console.print(note_markup(n))


# ---- check ------------------------------------------------------------------------------
def check_markdown(report: MemoryReport, usable_bytes: int, headroom: float, source: str,
                   notes: Sequence[str] = (), command: str = "check",
                   plan_command: str | None = None) -> str:
    """A markdown summary to paste into a pull-request comment (`command` names the
    vramcalc command in the heading; `plan_command`, for a run that does not fit, the plan
    of the same options)."""
    fits = bool(report.fits)
    total = max(report.device_total_bytes, 1)
    head = "✅ fits" if fits else "❌ does not fit"
    g = report.gpu
    lines = [f"### vramcalc {command}: {head} — `{source}`", ""]
    gpu_text = f"{g.num_gpus} × {g.name}" if g else "no GPU"
    lines.append(f"**{report.model.name}** ({report.model.num_params:,} parameters) on "
                 f"**{gpu_text}**  ")
    lines.append(f"Strategy: {strategy_line(report.strategy)}")
    lines.append("")
    lines.append("| term | GB | GiB | share |")
    lines.append("|---|---:|---:|---:|")
    for key, val in report.terms.as_dict().items():
        lines.append(f"| {TERM_LABELS[key]} | {val / GB:,.2f} | {val / GiB:,.2f} | "
                     f"{100 * val / total:.1f}% |")
    lines.append(f"| peak allocated ({report.peak_phase}) | {report.peak_allocated_bytes / GB:,.2f}"
                 f" | {report.peak_allocated_bytes / GiB:,.2f} | |")
    lines.append(f"| peak reserved | {report.peak_reserved_bytes / GB:,.2f} | "
                 f"{report.peak_reserved_bytes / GiB:,.2f} | |")
    lines.append(f"| **device total** | **{report.device_total_bytes / GB:,.2f}** | "
                 f"**{report.device_total_bytes / GiB:,.2f}** | |")
    lines.append("")
    cap = g.memory_total_bytes if g else usable_bytes
    words = fit_phrase(report.device_total_bytes, usable_bytes, cap,
                       paged=paged_resident_bytes(report))
    lines.append(f"Per GPU: **{words}** "
                 f"({headroom:.0%} headroom requested).")
    if (evidence := evidence_line(report)) is not None:
        lines.append(f"{evidence}  ")
    if not fits and plan_command:
        lines.append(f"Next: `{plan_command}` lists the smallest changes that fit.")
    if report.host_bytes_per_node:
        lines.append(f"Host RAM for offload and paging: {report.host_bytes_per_node / GB:,.2f} GB per node.")
    for n in list(report.notes) + list(notes):
        lines.append(f"> {n}" if n.startswith("warning:") else f"> note: {n}")
    lines.append("")
    info = provenance()
    lines.append(f"<sub>vramcalc {info['vramcalc_version']} analytic estimate (GPU profiles "
                 f"{info['gpu_profiles_revision']}, model catalog "
                 f"{info['model_catalog_revision']}); GB = 10^9 bytes, GiB = 2^30 bytes.</sub>")
    return "\n".join(lines) + "\n"
