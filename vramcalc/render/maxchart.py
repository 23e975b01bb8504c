"""The most that fits (vramcalc.planner.maximize), in words, as a terminal chart and as an
image file.

The terminal chart has one bar per value of the dimension: its length is the per-GPU device
total, the `┃` column is the usable memory (the GPU's memory less the headroom) and the `│`
column the GPU's whole memory. matplotlib (the `plot` extra) draws the same thing into a
PNG or SVG file; it is imported only when a file is asked for.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.text import Text

from vramcalc.errors import InputError
from vramcalc.planner.maximize import MaxResult, Point
from vramcalc.render.console import print_plan_hint
from vramcalc.render.report import strategy_line
from vramcalc.report import fit_phrase
from vramcalc.safeio import path_kind
from vramcalc.units import GB

_LABEL = {"seq-len": "sequence length (tokens)", "micro-batch": "micro-batch (sequences)"}
_AXIS = {"seq-len": "tokens", "micro-batch": "sequences"}
_WORD = {"seq-len": "sequence", "micro-batch": "micro-batch"}
PLOT_SUFFIXES = (".png", ".svg")


def answer_line(res: MaxResult) -> str:
    """The answer in one sentence."""
    what = "longest sequence" if res.dimension == "seq-len" else "largest micro-batch"
    unit = " tokens" if res.dimension == "seq-len" else " sequences"
    if res.answer is None or res.report is None:
        smallest = res.points[0]
        return (f"Nothing fits: even {_WORD[res.dimension]} {smallest.value:,} "
                f"{fit_phrase(smallest.device_total_bytes, res.usable_bytes, res.capacity_bytes)}")
    rep = res.report
    nxt = ""
    if res.next_value is not None:
        nxt = f"; {res.next_value:,} does not"
    beyond = ""
    if res.dimension == "seq-len" and res.context_tokens and res.answer > res.context_tokens:
        beyond = (f" Note: longer than the model's trained context of {res.context_tokens:,} "
                  "tokens (max_position_embeddings).")
    return (f"The {what} that fits: {res.answer:,}{unit} (searched in steps of {res.step:,}"
            f"{nxt}). At {res.answer:,} it "
            f"{fit_phrase(rep.device_total_bytes, res.usable_bytes, res.capacity_bytes)}."
            + beyond)


def chart_lines(points: tuple[Point, ...], usable_bytes: int, capacity_bytes: int,
                dimension: str, width: int) -> list[Text]:
    """One bar per point, scaled so the largest of the bars and the GPU memory fills the
    chart; `┃` marks the usable memory and `│` the GPU's memory."""
    label_w = max(len(_AXIS[dimension]), *(len(f"{p.value:,}") for p in points))
    num_w = max(len(f"{p.device_total_bytes / GB:,.1f} GB") for p in points)
    bar_w = max(10, width - label_w - num_w - 4)
    top = max(capacity_bytes, *(p.device_total_bytes for p in points))
    usable_col = min(bar_w - 1, round(usable_bytes / top * bar_w))
    cap_col = min(bar_w - 1, round(capacity_bytes / top * bar_w))
    out = [Text(f"{_AXIS[dimension]:>{label_w}}  GB per GPU; ┃ usable, │ GPU memory",
                style="dim")]
    for p in points:
        n = round(p.device_total_bytes / top * bar_w)
        # a bar that fits ends at or before the usable line; one that does not, past it
        n = min(n, usable_col) if p.fits else max(n, usable_col + 2)
        cells = []
        for col in range(bar_w):
            if col == usable_col:
                cells.append(("┃", "bold"))
            elif col == cap_col:
                cells.append(("│", "dim"))
            elif col < n:
                cells.append(("█", "green" if p.fits else "red"))
            else:
                cells.append((" ", ""))
        line = Text(f"{p.value:>{label_w},}  ")
        for ch, style in cells:
            line.append(ch, style=style)
        line.append(f"  {p.device_total_bytes / GB:,.1f} GB")
        out.append(line)
    return out


def print_max(console: Console, res: MaxResult, plan_command: str | None = None) -> None:
    """The answer, the layout it holds for, and the chart (and when nothing fits,
    `plan_command`: the plan of the same options)."""
    if res.report is not None:
        m, g = res.report.model, res.report.gpu
        gpus = f" on {g.num_gpus} x {g.name}" if g else ""
        console.print(f"[bold]{m.name}[/bold]{gpus}")
        console.print(f"Strategy: {strategy_line(res.report.strategy)}")
    console.print(answer_line(res))
    if res.answer is None:
        print_plan_hint(console, plan_command or "vramcalc plan")
    elif res.report is not None and res.report.engine == "analytic":
        console.print("[dim]note: the answer's device total is the allocator's packing floor; "
                      "near the limit segments that live tensors split keep their free rest; "
                      "where the trace runs the layout, --engine trace bisects with its fit "
                      "(docs/trace.md)[/dim]")
    if len(res.points) > 1:
        console.print()
        for line in chart_lines(res.points, res.usable_bytes, res.capacity_bytes,
                                res.dimension, console.width):
            console.print(line)


def check_plot_path(path: Path) -> None:
    """A plot file must end in .png or .svg, in a folder that exists."""
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise InputError(f"--plot {path}: the file must end in .png or .svg")
    if path_kind(path.parent) != "dir":
        raise InputError(f"--plot {path}: no such folder: {path.parent}")


def save_plot(path: Path, res: MaxResult, title: str) -> None:
    """Draw memory against the dimension, the usable memory and the GPU memory into a PNG
    or SVG file (needs matplotlib, the `plot` extra)."""
    check_plot_path(path)
    try:
        from matplotlib.figure import Figure  # no pyplot: a file, never a window
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install 'llm-vramcalc[plot]'") from None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    xs = [p.value for p in res.points]
    ax.plot(xs, [p.device_total_bytes / GB for p in res.points], marker="o",
            label="per-GPU device total")
    ax.axhline(res.usable_bytes / GB, color="tab:red", linestyle="--", label="usable")
    ax.axhline(res.capacity_bytes / GB, color="grey", linestyle=":", label="GPU memory")
    if res.answer is not None:
        ax.axvline(res.answer, color="tab:green", linestyle="-.",
                   label=f"most that fits: {res.answer:,}")
    ax.set_xlabel(_LABEL[res.dimension])
    ax.set_ylabel("GB (10^9 bytes)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as err:
        raise InputError(f"--plot {path}: cannot write: {err}") from None
