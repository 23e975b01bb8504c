"""The console the CLI prints through, and progress bars for long runs."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import Progress


def make_console() -> Console:
    """A rich Console on stdout. Its width is the terminal's; when stdout is not a terminal
    (pipes, CI logs), $COLUMNS when set, else 120."""
    out = Console(highlight=False)
    if not out.is_terminal:
        cols = os.environ.get("COLUMNS", "")
        width = int(cols) if cols.isdigit() and 20 <= int(cols) <= 1000 else 120
        out = Console(highlight=False, width=width)
    return out


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
