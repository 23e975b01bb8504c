"""Markdown for pull-request comments, `plan --markdown` and `estimate --markdown` (the
per-scenario table is `check --markdown`'s, vramcalc.render.plan.check_markdown), and the
summary at the top of `plan --json`."""

from __future__ import annotations

import re
from typing import Any

from vramcalc.render.plan import (
    check_markdown,
    layout_text,
    offload_text,
    paged_text,
    pipeline_text,
    sharding_text,
    suggestion_line,
)
from vramcalc.report import MemoryReport, fit_phrase
from vramcalc.units import GB, fmt_gb

_MARKUP = re.compile(r"\[/?[a-z ]+\]")  # rich markup in the plan's fixed line


def estimate_markdown(report: MemoryReport, headroom: float, command_line: str,
                      notes: list[str], plan_command: str | None = None) -> str:
    """One scenario's breakdown and fit verdict, as `check --markdown` writes it."""
    usable = report.usable_bytes if report.usable_bytes is not None else 0
    return check_markdown(report, usable, headroom, command_line, notes, command="estimate",
                          plan_command=plan_command)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def plan_markdown(doc: dict[str, Any]) -> str:
    """The plan: what was searched, the ranked strategies that fit (or the closest and the
    smallest changes that would fit), and the best strategy's breakdown."""
    res, base = doc["result"], doc["base"]
    gpu, m, cl = base.cluster.gpu, base.model, base.cluster
    usable = base.usable_bytes
    n = len(res.entries)
    head = f"✅ {n} strateg{'y' if n == 1 else 'ies'} fit" if n else "❌ nothing fits"
    lines = [f"### vramcalc plan: {head} — {m.name} on {cl.num_gpus} × {gpu.name}", "",
             f"**{m.name}** ({m.num_params:,} parameters) on **{cl.num_gpus} × {gpu.name}** "
             f"({cl.num_nodes} node{'s' if cl.num_nodes > 1 else ''}, "
             f"{fmt_gb(gpu.memory_total_bytes)} each, {base.headroom_fraction:.0%} kept free)  ",
             _MARKUP.sub("", doc["fixed_line"]), ""]
    for text in doc["notes"]:
        lines.append(f"> note: {text}")
    if doc["notes"]:
        lines.append("")
    if res.entries:
        lines += ["| # | tokens/s | MFU | layout | ZeRO/FSDP | recompute | mbs×acc | pipeline | "
                  "offload | GB | free GB |", "|---:|---:|---:|---|---|---|---:|---|---|---:|---:|"]
        for i, e in enumerate(res.entries, 1):
            s = e.report.strategy
            cells = [str(i), f"{e.speed.tokens_per_s:,.0f}", f"{100 * e.speed.mfu:.1f}%",
                     layout_text(s), sharding_text(s), str(s.get("recompute", "none")),
                     f"{s.get('micro_batch_size', 1)}×{s.get('grad_accum', 1)}",
                     pipeline_text(s), paged_text(offload_text(s), e),
                     f"{e.report.device_total_bytes / GB:,.1f}",
                     f"{(usable - e.report.device_total_bytes) / GB:,.1f}"]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines += ["", "Best strategy (#1), to see it alone:", "",
                  f"```\n{doc['estimate_cmd']}\n```", ""]
        best = res.entries[0].report
        body = check_markdown(best, usable, base.headroom_fraction, "#1", [],
                              command="plan, best strategy")
        return "\n".join(lines) + "\n" + body
    if res.closest is not None:
        c = res.closest.report
        lines.append(f"Closest strategy "
                     f"{fit_phrase(c.device_total_bytes, usable, gpu.memory_total_bytes)}.")
        lines.append("")
    if doc["suggestions"]:
        lines.append("**Smallest changes that fit:**")
        lines.append("")
        for i, sg in enumerate(doc["suggestions"], 1):
            lines.append(f"{i}. {suggestion_line(sg)}: `{doc['apply'][i - 1]}`")
    else:
        lines.append("No single change tried makes it fit.")
    return "\n".join(lines) + "\n"


def plan_summary(base: Any, result: Any) -> dict[str, Any]:
    """The top-level summary of `plan --json`: model, cluster, whether anything fits and
    the best layout (the closest one when nothing fits), bytes as ints."""
    cl = base.cluster
    entry = result.entries[0] if result.entries else result.closest
    best = None
    if entry is not None:
        s = entry.report.strategy
        best = {"layout": layout_text(s), "sharding": sharding_text(s),
                "recompute": s.get("recompute"), "micro_batch_size": s.get("micro_batch_size"),
                "grad_accum": s.get("grad_accum"),
                "pipeline": None if pipeline_text(s) == "-" else pipeline_text(s),
                "offload": None if offload_text(s) == "-" else offload_text(s),
                "fits": entry.fits,
                "device_total_bytes": entry.report.device_total_bytes,
                "free_bytes": entry.report.free_bytes, "tokens_per_s": entry.speed.tokens_per_s,
                "mfu": entry.speed.mfu}
    return {"model": {"name": base.model.name, "num_params": base.model.num_params},
            "cluster": {"gpu": cl.gpu.id, "gpu_name": cl.gpu.name, "num_gpus": cl.num_gpus,
                        "num_nodes": cl.num_nodes,
                        "memory_total_bytes": cl.gpu.memory_total_bytes,
                        "usable_bytes": base.usable_bytes},
            "fits": bool(result.entries), "num_fitting": len(result.entries),
            "global_batch_size": result.global_batch_size, "best": best}
