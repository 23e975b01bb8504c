"""Rendering a serving report (`vramcalc serve`): the breakdown table with bars, the KV-cache
lines and the verdict, as a rich table or markdown."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from vramcalc.render.report import _bar
from vramcalc.serve import ServeReport
from vramcalc.serve.plan import ServeOption
from vramcalc.units import GB, GiB, fmt_gb, fmt_gib

SERVE_LABELS = {
    "weights": "weights",
    "lora_slots": "LoRA slots",
    "activation_peak": "activation peak",
    "non_torch": "non-torch",
    "kv_cache": "KV cache",
    "cuda_graphs": "CUDA graphs",
    "context_nccl": "CUDA context + NCCL",
    "unused": "unused budget",
}


def _header(r: ServeReport) -> list[str]:
    layout = f"TP {r.tp} × PP {r.pp}, {r.replicas} replica{'s' if r.replicas > 1 else ''}"
    budget = {"vllm": "gpu_memory_utilization", "vllm-v0": "gpu_memory_utilization",
              "sglang": "mem_fraction_static"}.get(r.engine)
    lines = [f"{r.model}: {r.num_params:,} parameters, served by {r.engine}",
             f"GPUs: {r.num_gpus} x {r.gpu} ({fmt_gb(r.memory_total_bytes)} = "
             f"{fmt_gib(r.memory_total_bytes)} each), {layout}",
             f"max-model-len {r.max_model_len:,}, max-num-seqs {r.max_num_seqs}, "
             f"max-num-batched-tokens {r.max_num_batched_tokens:,}, quantization "
             f"{r.quantization}, kv-cache-dtype {r.kv_cache_dtype}"
             + (f", {budget} {r.budget_fraction:g}" if budget else "")]
    return lines


def _kv_lines(r: ServeReport) -> list[str]:
    k = r.kv
    if k.mla:
        shape = (f"{k.num_layers} layers × latent {k.head_dim} (kv_lora_rank + rope dim) × "
                 f"{k.dtype_bytes} B")
    else:
        shape = (f"{k.num_layers} layers × {k.kv_heads_per_gpu} KV heads × head dim "
                 f"{k.head_dim} × 2 (K, V) × {k.dtype_bytes} B")
    lines = [f"KV cache per token (per GPU): {shape} = {k.bytes_per_token:,} B "
             f"({k.bytes_per_token / 1024:,.1f} KiB)"]
    if k.num_sliding_layers:
        lines.append(f"  {k.num_sliding_layers} of {k.num_layers} layers keep a sliding "
                     f"window of {k.sliding_window:,} tokens")
    lines.append(f"One {r.max_model_len:,}-token sequence: {fmt_gib(k.bytes_per_sequence)}")
    if r.engine == "hf":
        lines.append(f"Room for {r.max_concurrency:.2f} such sequences beside the weights")
    else:
        unit = f"blocks of {r.block_tokens} tokens" if r.block_tokens > 1 else "token slots"
        lines.append(f"KV capacity: {r.kv_capacity_tokens:,} tokens ({r.kv_capacity_blocks:,} "
                     f"{unit}); max concurrency at {r.max_model_len:,} tokens: "
                     f"{r.max_concurrency:.2f}x, {r.max_concurrent_seqs} sequences per replica")
    return lines


def _shown_terms(r: ServeReport) -> list[tuple[str, int]]:
    """The terms in table order; LoRA slots only when --enable-lora made some."""
    return [(k, v) for k, v in r.terms.as_dict().items() if k != "lora_slots" or v]


def serve_table(r: ServeReport) -> Table:
    total = max(r.device_total_bytes, 1)
    table = Table(title=f"Per-GPU memory ({r.engine})", title_justify="left", show_edge=False,
                  pad_edge=False)
    for name, justify in (("term", "left"), ("GB", "right"), ("GiB", "right"),
                          ("share", "right"), ("", "left")):
        table.add_column(name, justify=justify, no_wrap=name == "")  # type: ignore[arg-type]
    for key, val in _shown_terms(r):
        table.add_row(SERVE_LABELS[key], f"{val / GB:,.2f}", f"{val / GiB:,.2f}",
                      f"{100 * val / total:4.1f}%", _bar(val / total))
    table.add_section()
    table.add_row(Text("device total", style="bold"), f"{r.device_total_bytes / GB:,.2f}",
                  f"{r.device_total_bytes / GiB:,.2f}", "", "")
    return table


def verdict(r: ServeReport) -> Text:
    if r.fits:
        return Text.assemble(("FITS", "bold green"), f" on {r.gpu}: "
                             f"{fmt_gb(r.device_total_bytes)} of {fmt_gb(r.memory_total_bytes)}")
    return Text.assemble(("DOES NOT FIT", "bold red"), f" on {r.gpu}: " + "; ".join(r.reasons))


def print_serve(console: Console, r: ServeReport) -> None:
    for line in _header(r):
        console.print(line, soft_wrap=True)
    console.print()
    console.print(serve_table(r))
    console.print()
    for line in _kv_lines(r):
        console.print(line, soft_wrap=True)
    console.print(verdict(r))
    for note in r.notes:
        console.print(f"[dim]note: {note}[/dim]", soft_wrap=True)


def serve_markdown(r: ServeReport) -> str:
    """The same report as markdown (a pull-request comment, a wiki page)."""
    total = max(r.device_total_bytes, 1)
    out = [f"### vramcalc serve: {'fits' if r.fits else 'does not fit'}", ""]
    out += [f"- {line}" for line in _header(r)]
    out += ["", "| term | GB | GiB | share |", "|---|---:|---:|---:|"]
    for key, val in _shown_terms(r):
        out.append(f"| {SERVE_LABELS[key]} | {val / GB:,.2f} | {val / GiB:,.2f} | "
                   f"{100 * val / total:.1f}% |")
    out.append(f"| **device total** | **{r.device_total_bytes / GB:,.2f}** | "
               f"**{r.device_total_bytes / GiB:,.2f}** | |")
    out.append("")
    out += [f"- {line.strip()}" for line in _kv_lines(r)]
    out.append(f"- verdict: {verdict(r).plain}")
    out += [f"- note: {n}" for n in r.notes]
    return "\n".join(out) + "\n"


def print_serve_options(console: Console, options: list[ServeOption], title: str,
                        with_cost: bool, notes: list[str]) -> None:
    """`plan --serve` / `size --serve`: one row per layout, fewest GPUs first."""
    console.print(title, soft_wrap=True)
    if not options:
        console.print(Text("NOTHING FITS", style="bold red"), soft_wrap=True)
    else:
        table = Table(show_edge=False, pad_edge=False)
        cols = ["GPU", "TP", "PP", "copies", "GPUs", "seqs/copy", "KV tokens/copy",
                "GB/GPU"] + (["$/hour", "$/month"] if with_cost else [])
        for c in cols:
            table.add_column(c, justify="left" if c == "GPU" else "right")
        for o in options:
            r = o.report
            row = [o.gpu.name, str(o.tp), str(o.pp), str(o.replicas), str(o.num_gpus),
                   str(r.max_concurrent_seqs), f"{r.kv_capacity_tokens:,}",
                   f"{r.device_total_bytes / GB:,.1f}"]
            if with_cost:
                row += ["?" if o.usd_per_hour is None else f"{o.usd_per_hour:,.2f}",
                        "?" if o.usd_per_month is None else f"{o.usd_per_month:,.0f}"]
            table.add_row(*row)
        console.print(table)
    for n in notes:
        console.print(f"[dim]note: {n}[/dim]", soft_wrap=True)
