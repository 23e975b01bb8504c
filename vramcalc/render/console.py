"""The console the CLI prints through, and progress bars for long runs."""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.text import Text


def make_console() -> Console:
    """A rich Console on stdout. Its width is the terminal's; when stdout is not a terminal
    (pipes, CI logs), $COLUMNS when set, else 120."""
    out = Console(highlight=False)
    if not out.is_terminal:
        cols = os.environ.get("COLUMNS", "")
        width = int(cols) if cols.isdigit() and 20 <= int(cols) <= 1000 else 120
        out = Console(highlight=False, width=width)
    return out


def print_command(console: Console, lead: str, cmd: str, style: str = "") -> None:
    """A shell command after `lead`, folded to the console's width between options, each
    line but the last ending in ` \\`: it fits the terminal and still pastes as one
    command. An option and its value stay together; quoting is kept."""
    words = [shlex.quote(w) for w in shlex.split(cmd)]
    units: list[str] = []
    for w in words:  # "--flag value" as one unit
        if units and units[-1].startswith("--") and " " not in units[-1] \
                and not w.startswith("--"):
            units[-1] += " " + w
        else:
            units.append(w)
    pad = " " * (len(lead) - len(lead.lstrip()) + 4)
    lines, line = [], lead
    for u in units:
        if line.strip() and line != lead and len(line) + 1 + len(u) + 2 > console.width:
            lines.append(line + " \\")
            line = pad + u
        else:
            line = f"{line} {u}" if line != lead else lead + u
    lines.append(line)
    for text in lines:
        console.print(Text(text, style=style), soft_wrap=True)


def print_plan_hint(console: Console, plan_command: str) -> None:
    """Where a run that does not fit goes next: the plan of the same options."""
    print_command(console, "try: ", plan_command)
    console.print("  (it lists the smallest changes that fit: recomputation, sharding, "
                  "fine-tuning, optimizer, offload, more or other GPUs)")


def with_progress(label: str, run: Callable[[Any], Any], quiet: bool) -> Any:
    """`run(progress)` under a transient progress bar (`progress(message, fraction)`);
    without one when `quiet` (JSON output)."""
    if quiet:
        return run(None)
    with Progress(transient=True) as bar:
        task = bar.add_task(label, total=1.0)
        return run(lambda msg, frac: bar.update(task, completed=frac, description=msg))


class LazyProgress:
    """A progress bar on stderr that appears only when a search runs long
    (`progress(message, done, total)`, the planner's progress callback)."""

    def __init__(self, enabled: bool, after_s: float = 0.3) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.after_s = after_s
        self.start = time.perf_counter()
        self.bar: Progress | None = None
        self.task: Any = None

    def __call__(self, message: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            if time.perf_counter() - self.start < self.after_s:
                return
            self.bar = Progress(transient=True, console=Console(stderr=True))
            self.bar.start()
            self.task = self.bar.add_task(message, total=max(total, 1))
        self.bar.update(self.task, completed=done, total=max(total, 1), description=message)

    def close(self) -> None:
        """Remove the bar (if it appeared)."""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
