"""Rendering: reports to rich tables, markdown and plain text. The only module that imports rich."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from vramcalc.report import ALLOCATED_TERMS, MemoryReport
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
    parts = [f"seq {s['seq_len']}", f"mbs {s['micro_batch_size']}"]
    if s.get("grad_accum", 1) > 1:
        parts.append(f"accum {s['grad_accum']}")
    parts += [s["precision"], s["optimizer"], f"attn {s['attention']}",
              f"recompute {s['recompute']}"]
    deg = [f"{k}{s[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if s.get(k) and s[k] > 1]
    if deg:
        parts.append("×".join(deg))
    if s.get("sequence_parallel"):
        parts.append("sp")
    if s.get("fsdp", "none") != "none":
        parts.append(f"fsdp {s['fsdp']}")
    elif s.get("zero"):
        parts.append(f"zero-{s['zero']}")
    if s.get("offload"):
        parts.append("offload " + "+".join(s["offload"]) + f"→{s.get('offload_device', 'cpu')}")
    if s.get("pp", 1) > 1:
        parts.append(s["pp_schedule"])
    if s.get("framework", "reference") != "reference":
        parts.append(f"profile {s['framework']}")
    if s.get("finetune", "full") != "full":
        ft = f"{s['finetune']} r{s.get('lora_rank')} on {s.get('lora_targets')}"
        if s.get("lora_dropout"):
            ft += f" dropout {s['lora_dropout']}"
        parts.append(ft)
    if s.get("qat", "none") != "none":
        parts.append(f"qat {s['qat']}")
    return ", ".join(parts)


_SUB_ROWS = {
    "weights": (("weights/frozen", "frozen base"), ("weights/nf4", "NF4 4-bit data"),
                ("weights/nf4_constants", "NF4 absmax/codes"), ("weights/adapters", "adapters")),
    "transients": (("transients/fp8_weight_cache", "FP8 weight cache"),
                   ("transients/fp8_meta", "FP8 scales/amax"),
                   ("transients/qat_qparams", "QAT scales/zero pts")),
    "overhead": (("overhead/paged_optimizer_states", "paged optimizer states"),),
}


def report_table(report: MemoryReport) -> Table:
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
    table.add_row(Text("device total", style="bold"), f"{report.device_total_bytes / GB:,.2f}",
                  f"{report.device_total_bytes / GiB:,.2f}", "", "")
    return table


def verdict_text(report: MemoryReport) -> Text:
    if report.fits is None or report.gpu is None or report.headroom_bytes is None:
        return Text("no GPU given: no fit check")
    cap = report.gpu.memory_total_bytes
    if report.fits:
        return Text.assemble(("FITS", "bold green"), f" on {report.gpu.name}: "
                             f"{fmt_gb(report.device_total_bytes)} of {fmt_gb(cap)} "
                             f"({fmt_gb(report.headroom_bytes)} free)")
    if report.headroom_bytes >= 0:
        return Text.assemble(("DOES NOT FIT", "bold red"), f" on {report.gpu.name}: "
                             f"{fmt_gb(report.device_total_bytes)} leaves less than the "
                             f"requested headroom of {fmt_gb(cap)}")
    return Text.assemble(("DOES NOT FIT", "bold red"), f" on {report.gpu.name}: needs "
                         f"{fmt_gb(report.device_total_bytes)}, has {fmt_gb(cap)} "
                         f"(over by {fmt_gb(-report.headroom_bytes)})")


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
    console.print(f"Phase peaks (GB, steady state): {ph}; first step {report.first_step_peak_bytes / GB:,.2f}")
    if report.stages:
        rows = "; ".join(f"stage {s.stage} ({s.num_layers} layers) {s.device_total_bytes / GB:,.2f}"
                         for s in report.stages)
        console.print(f"Pipeline stages (device total, GB): {rows}")
    if report.host_bytes_per_node:
        console.print(f"Host RAM for offload: {fmt_gb(report.host_bytes_per_node)} per node")
    if report.nvme_bytes_per_node:
        console.print(f"NVMe for offload: {fmt_gb(report.nvme_bytes_per_node)} per node")
    console.print(verdict_text(report))
    for note in report.notes:
        console.print(f"[dim]note: {note}[/dim]")


def subterm_lines(report: MemoryReport) -> list[str]:
    return [f"{k}: {v / GB:,.3f} GB" for k, v in sorted(report.subterms.items())]


def allocated_terms(report: MemoryReport) -> dict[str, int]:
    return {t: getattr(report.terms, t) for t in ALLOCATED_TERMS}


def print_explain(console: Console, doc: dict[str, Any]) -> None:
    for sec in doc["sections"]:
        console.print(f"[bold]{sec['title']}[/bold]")
        for line in sec["lines"]:
            console.print(f"  {line}", soft_wrap=True)
        console.print()


def gpus_table(profiles: list[Any]) -> Table:
    table = Table(title="GPU profiles (usable memory as the runtime reports it)",
                  title_justify="left", show_edge=False, pad_edge=False)
    for col, just in (("id", "left"), ("name", "left"), ("GB", "right"), ("GiB", "right"),
                      ("BF16 TFLOP/s", "right"), ("per node", "right"), ("$/GPU-h", "right"),
                      ("aliases", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for p in sorted(profiles, key=lambda p: p.id):
        bf16 = p.dense_tflops.get("bf16")
        table.add_row(p.id, p.name, f"{p.memory_total_bytes / GB:,.1f}",
                      f"{p.memory_total_bytes / GiB:,.1f}", f"{bf16:,.0f}" if bf16 else "-",
                      str(p.gpus_per_node),
                      f"{p.price_usd_per_hour:.2f}" if p.price_usd_per_hour else "-",
                      ", ".join(p.aliases[:4]))
    return table


def models_table(entries: list[Any]) -> Table:
    table = Table(title="Built-in models (exact parameter counts)", title_justify="left",
                  show_edge=False, pad_edge=False)
    for col, just in (("name", "left"), ("params", "right"), ("layers", "right"),
                      ("hidden", "right"), ("heads/kv", "right"), ("vocab", "right"),
                      ("aliases", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for e in entries:
        s = e.spec
        table.add_row(s.name, f"{s.num_params:,}", str(s.num_hidden_layers), str(s.hidden_size),
                      f"{s.num_attention_heads}/{s.kv_heads}", f"{s.vocab_size:,}",
                      ", ".join(e.meta.aliases))
    return table


def print_validation(console: Console, result: dict[str, Any]) -> None:
    table = Table(title="Analytic vs trace (peak allocated)", title_justify="left",
                  show_edge=False, pad_edge=False)
    for col in ("scenario", "analytic GB", "trace GB", "error", "worst term"):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for row in result["scenarios"]:
        worst = ""
        terms = row.get("terms") or {}
        if terms:
            name, val = max(terms.items(), key=lambda kv: abs(kv[1].get("rel_error") or 0))
            worst = f"{name} {100 * (val.get('rel_error') or 0):+.2f}%"
        err = row.get("rel_error")
        table.add_row(str(row.get("name")), f"{row['analytic_bytes'] / GB:,.4f}",
                      f"{row['trace_bytes'] / GB:,.4f}",
                      f"{100 * err:+.2f}%" if err is not None else "-", worst)
    console.print(table)
    s = result["summary"]
    console.print(
        f"{s.get('num_scenarios', len(result['scenarios']))} scenarios: median |error| "
        f"{100 * s['median_abs_rel_error']:.2f}%, max {100 * s['max_abs_rel_error']:.2f}%, "
        f"{s.get('num_failed', 0)} out of tolerance"
    )
