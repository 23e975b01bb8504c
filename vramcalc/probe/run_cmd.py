"""`vramcalc probe --run -- CMD`: run an unmodified training command with the probe hook."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import vramcalc.safeio as safeio
from vramcalc.errors import InputError, shown, shown_path

HOOK_DIR = Path(__file__).resolve().parent / "hook"


def run_command(cmd: list[str], interval: float = 0.0,
                out_dir: Path | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Run `cmd` with the hook on PYTHONPATH; return its exit code and one record per rank.

    torchrun's workers inherit the environment, so every rank writes its own file: into
    `out_dir`, or a temporary folder removed once the records are read.
    """
    if not cmd:
        raise InputError("--run needs a command after '--', e.g. vramcalc probe --run -- python train.py")
    if out_dir is None:
        with _terminate_cleanly(), tempfile.TemporaryDirectory(prefix="vramcalc-probe-") as tmp:
            return _run(cmd, interval, Path(tmp))
    return _run(cmd, interval, Path(out_dir))


@contextlib.contextmanager
def _terminate_cleanly() -> Iterator[None]:
    """SIGTERM (a CI job cancelled) raises SystemExit(143) here, so the job is killed by
    subprocess.run and the temporary folder is removed, instead of the default exit that
    leaves both behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(*_: Any) -> None:
        raise SystemExit(128 + signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(cmd: list[str], interval: float, work: Path) -> tuple[int, list[dict[str, Any]]]:
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"--out {shown_path(work)}: cannot make the folder: "
                         f"{err.strerror or type(err).__name__}") from None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK_DIR)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["VRAMCALC_PROBE_DIR"] = str(work)
    env["VRAMCALC_PROBE_INTERVAL"] = str(interval)
    try:
        proc = subprocess.run(cmd, env=env, check=False)
    except FileNotFoundError:
        raise InputError(f"command not found: {shown(cmd[0])}") from None
    except (OSError, ValueError) as err:  # not executable, not a program, a NUL in argv
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise InputError(f"cannot run {shown(cmd[0])}: {reason}") from None
    records = []
    for path in sorted(work.glob("rank*.json")):
        try:
            records.append(safeio.read_json(path, "probe record"))
        except InputError:  # a record cut short (the job was killed while writing)
            continue
    # torchrun's own launcher process holds no device memory: keep the workers only
    records = [r for r in records if r.get("role") != "launcher"]
    records.sort(key=lambda r: (r.get("rank", 0), r.get("pid", 0)))
    return proc.returncode, records
