"""Rendering one scenario's memory report (estimate, trace, check) and the explain sections."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from vramcalc.evidence import ALL, band_for, within_band
from vramcalc.report import MemoryReport, fit_phrase, paged_resident_bytes
from vramcalc.units import GB, GiB, fmt_gb, fmt_gib

TERM_LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "logits": "logits + loss",
    "transients": "transients",
    "overhead": "overhead",
}
BAR_WIDTH = 28


def _bar(frac: float) -> str:
    n = max(0, min(BAR_WIDTH, round(frac * BAR_WIDTH)))
    return "█" * n + "·" * (BAR_WIDTH - n)


def strategy_line(strategy: dict[str, Any]) -> str:
    """A compact one-line description of a strategy."""
    s = strategy
    if s.get("load_only"):  # no training step: how the model is loaded is the strategy
        return ", ".join([f"load {s['load']} only", s["precision"]] + (
            [f"profile {s['framework']}"] if s.get("framework", "reference") != "reference"
            else []) + ([f"torch {s['torch_version']}"] if s.get("torch_version") else []))
    parts = [f"seq {s['seq_len']}", f"mbs {s['micro_batch_size']}"]
    if s.get("target_len"):  # encoder-decoders: the decoder's tokens
        parts[0] += f", target {s['target_len']}"
    if s.get("grad_accum", 1) > 1:
        parts.append(f"accum {s['grad_accum']}")
    impl = s.get("optimizer_impl")
    optimizer = s["optimizer"] + (f" {impl}" if impl and impl != "foreach" else "") + (
        " in backward" if s.get("optimizer_in_backward") else "")
    parts += [s["precision"], optimizer, f"attn {s['attention']}",
              f"recompute {s['recompute']}"]
    deg = [f"{k}{s[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if s.get(k) and s[k] > 1]
    if deg:
        parts.append("×".join(deg))
    if s.get("sequence_parallel"):
        parts.append("sp")
    if s.get("fsdp", "none") != "none":
        parts.append(f"fsdp {s['fsdp']}" + (" (edge units)" if s.get("fsdp_edge_units") else ""))
    elif s.get("zero"):
        parts.append(f"zero-{s['zero']}")
    if s.get("offload"):
        parts.append("offload " + "+".join(s["offload"]) + f"→{s.get('offload_device', 'cpu')}")
    if s.get("pp", 1) > 1:
        parts.append(s["pp_schedule"])
    if s.get("framework", "reference") != "reference":
        parts.append(f"profile {s['framework']}")
    parts += [w.replace("_", " ") for w in ("compile", "float8", "async_tp") if s.get(w)]
    if s.get("float8_all_gather"):
        parts.append("fp8 all-gather")
    if s.get("packed"):
        parts.append(f"packed ({s.get('packed_mask') or 'flex'} mask)")
    if s.get("dropout") is not None:
        parts.append(f"dropout {s['dropout']}")
    if s.get("finetune") == "peft":
        parts.append(f"peft config {s.get('peft_config')}")
    elif s.get("finetune", "full") != "full":
        ft = f"{s['finetune']} r{s.get('lora_rank')} on {s.get('lora_targets')}"
        if s.get("lora_dropout"):
            ft += f" dropout {s['lora_dropout']}"
        parts.append(ft)
    if s.get("qat", "none") != "none":
        parts.append(f"qat {s['qat']}")
    if s.get("torch_version"):
        parts.append(f"torch {s['torch_version']}")
    if s.get("transformers_version"):
        parts.append(f"transformers {s['transformers_version']}")
    return ", ".join(parts)


_SUB_ROWS = {
    "weights": (("weights/frozen", "frozen base"), ("weights/nf4", "NF4 4-bit data"),
                ("weights/nf4_constants", "NF4 absmax/codes"), ("weights/adapters", "adapters"),
                ("weights/buffers", "buffers")),
    "transients": (("transients/fp8_weight_cache", "FP8 weight cache"),
                   ("transients/fp8_meta", "FP8 scales/amax"),
                   ("transients/qat_qparams", "QAT scales/zero pts")),
    "overhead": (("overhead/paged_optimizer_states", "paged optimizer states"),
                 ("overhead/symm_mem_workspace", "async TP workspace")),
}


def report_table(report: MemoryReport) -> Table:
    """The term table: GB, GiB, share of the device total and a bar per term, then the
    allocated peak and the device total."""
    total = max(report.device_total_bytes, 1)
    title = f"Per-GPU memory ({report.engine})"
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("term")
    table.add_column("GB", justify="right")
    table.add_column("GiB", justify="right")
    table.add_column("share", justify="right")
    table.add_column("", no_wrap=True)
    terms = report.terms.as_dict()
    for key, val in terms.items():
        table.add_row(TERM_LABELS[key], f"{val / GB:,.2f}", f"{val / GiB:,.2f}",
                      f"{100 * val / total:4.1f}%", _bar(val / total))
        # fine-tuning's weight parts and paged optimizer states (vramcalc/finetune.py)
        for sub, label in _SUB_ROWS.get(key, ()):
            v = report.subterms.get(sub)
            if v is not None and (v or key == "weights"):
                table.add_row(f"  {label}", f"{v / GB:,.2f}", f"{v / GiB:,.2f}", "", "")
    table.add_section()
    table.add_row("peak allocated", f"{report.peak_allocated_bytes / GB:,.2f}",
                  f"{report.peak_allocated_bytes / GiB:,.2f}", "", f"({report.peak_phase} phase)")
    expandable = report.strategy.get("expandable_segments")
    # cached blocks above the fit floor (freed by the allocator before an out-of-memory)
    cached = (report.peak_reserved_bytes - report.peak_allocated_bytes
              - report.subterms.get("overhead/fragmentation", 0))
    table.add_row("peak reserved", f"{report.peak_reserved_bytes / GB:,.2f}",
                  f"{report.peak_reserved_bytes / GiB:,.2f}", "",
                  "(caching allocator" + (", expandable segments)" if expandable else ")"))
    if cached > 0:
        table.add_row("  of it cached", f"{cached / GB:,.2f}", f"{cached / GiB:,.2f}", "",
                      "(an OOM retry frees it)")
    table.add_row(Text("device total", style="bold"), f"{report.device_total_bytes / GB:,.2f}",
                  f"{report.device_total_bytes / GiB:,.2f}", "", "")
    return table


def verdict_text(report: MemoryReport) -> Text:
    """FITS / DOES NOT FIT on the GPU, with the margin (or why there is no fit check)."""
    if report.fits is None or report.gpu is None or report.usable_bytes is None:
        return Text("no GPU given: no fit check")
    words = fit_phrase(report.device_total_bytes, report.usable_bytes,
                       report.gpu.memory_total_bytes, paged=paged_resident_bytes(report))
    head = ("FITS", "bold green") if report.fits else ("DOES NOT FIT", "bold red")
    return Text.assemble(head, f" on {report.gpu.name}: {words}")


def print_report(console: Console, report: MemoryReport) -> None:
    """The estimate/trace report: header, term table with bars, phases, verdict, notes."""
    m = report.model
    console.print(f"[bold]{m.name}[/bold]: {m.num_params:,} parameters"
                  + (f" ({m.num_active_params:,} active)" if m.num_active_params != m.num_params
                     else ""))
    if report.gpu:
        g = report.gpu
        console.print(f"GPUs: {g.num_gpus} x {g.name} ({g.num_nodes} node"
                      f"{'s' if g.num_nodes > 1 else ''}), {fmt_gb(g.memory_total_bytes)} "
                      f"= {fmt_gib(g.memory_total_bytes)} usable each")
    console.print(f"Strategy: {strategy_line(report.strategy)}")
    console.print()
    console.print(report_table(report))
    console.print()
    ph = ", ".join(f"{k} {v / GB:,.2f}" for k, v in report.phases.items())
    if list(report.phases) == ["load"]:  # --load-only: the reading right after loading
        console.print(f"Phase peaks (GB): {ph} (right after loading; no training step)")
    else:
        console.print(f"Phase peaks (GB, steady state): {ph}; first step {report.first_step_peak_bytes / GB:,.2f}")
    if report.stages:
        rows = "; ".join(f"stage {s.stage} ({s.num_layers} layers) {s.device_total_bytes / GB:,.2f}"
                         for s in report.stages)
        console.print(f"Pipeline stages (device total, GB): {rows}")
    if report.host_bytes_per_node:
        console.print(f"Host RAM for offload and paging: {fmt_gb(report.host_bytes_per_node)} per node")
    if report.nvme_bytes_per_node:
        console.print(f"NVMe for offload: {fmt_gb(report.nvme_bytes_per_node)} per node")
    console.print(verdict_text(report))
    if (line := evidence_line(report)) is not None:
        console.print(line)
    hint = tight_fit_hint(report)
    if hint:
        console.print(note_markup(hint))
    for note in report.notes:
        console.print(note_markup(note))


def evidence_line(report: MemoryReport) -> str | None:
    """How far vramcalc fell from published runs of this stack profile (vramcalc/evidence.py),
    and whether the fit margin lies inside that: beyond the error of one run in ten."""
    if report.fits is None or report.free_bytes is None:
        return None
    framework = str(report.strategy.get("framework", "reference"))
    who, band = band_for(framework)
    runs = (f"{band.runs} published {framework} runs" if who != ALL else
            f"{band.runs} published runs of all stacks (none with the {framework} profile)")
    wide = band.p90_pct / 100 * report.device_total_bytes
    if not within_band(band, report.device_total_bytes, report.free_bytes):
        return (f"evidence: {runs}: half within ±{band.median_pct:.1f}%, 9 in 10 within "
                f"±{band.p90_pct:.1f}%, the worst {band.worst_pct:.1f}% off "
                "(docs/validation.md)")
    gap = (f"the {fmt_gb(report.free_bytes)} margin" if report.fits else
           f"the {fmt_gb(-report.free_bytes)} excess")
    return (f"evidence: {gap} is less than the error of 1 in 10 of {runs} (±{band.p90_pct:.1f}% "
            f"= {fmt_gb(round(wide))}; half within ±{band.median_pct:.1f}%, "
            "docs/validation.md): confirm on the GPU with `vramcalc probe`")


TIGHT_FRACTION = 0.2  # the most the trace's fit added to the floor on docs/trace.md's rows


def tight_fit_hint(report: MemoryReport) -> str | None:
    """For an analytic fit within TIGHT_FRACTION of the card: its device total is the
    allocator's packing floor, and near the limit segments split by live tensors keep their
    free rest, which only the trace replays (docs/trace.md, "The fit")."""
    if (report.engine != "analytic" or not report.fits or report.usable_bytes is None
            or report.free_bytes is None
            or report.free_bytes >= TIGHT_FRACTION * report.usable_bytes):
        return None
    return ("close to the card: the device total is the allocator's packing floor; near "
            "the limit the segments live tensors split keep their free rest (up to ~20 % "
            "more on long sequences): `vramcalc trace` with the same flags replays that")


def print_explain(console: Console, doc: dict[str, Any]) -> None:
    """`vramcalc explain`: each section's title and its formula lines."""
    for sec in doc["sections"]:
        console.print(f"[bold]{sec['title']}[/bold]")
        for line in sec["lines"]:
            console.print(f"  {line}", soft_wrap=True)
        console.print()


def note_markup(note: str) -> str:
    """A report note as rich markup: warnings (text starting "warning:") in yellow, the
    others dimmed after "note:"."""
    if note.startswith("warning:"):
        return f"[yellow]{escape(note)}[/yellow]"
    return f"[dim]note: {escape(note)}[/dim]"
