"""Plan search speed: wall time of whole `vramcalc plan` runs and the full estimates they do.

    python benchmarks/bench_plan.py [--runs 9]   # the two reference commands

Each run is a fresh process (start-up included) of this checkout's code, timed from start
to exit with the bytecode already compiled (one untimed warm-up run). The child counts its
calls to `analytic.estimate` (full estimates, the search's and the display's).
benchmarks/bench_cli.py times the same commands from a fresh venv. Prints figures; asserts nothing (tests never assert wall-clock times). On a
shared machine the best of the runs is the figure to quote.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = [
    ["plan", "--model", "70b", "--gpus", "64xH100"],
    ["plan", "--model", "70b", "--gpus", "64xH100", "--allow",
     "precision,optimizer,offload,finetune"],
]

# the child: count full estimates, run the CLI
CHILD = """
import atexit, sys
import vramcalc.analytic as an
calls = [0]
inner = an.estimate
def counted(scn, every_stage=True):
    calls[0] += 1
    return inner(scn, every_stage)
an.estimate = counted
atexit.register(lambda: sys.stderr.write(f"full estimates: {calls[0]}\\n"))
sys.argv = ["vramcalc", *sys.argv[1:]]
from vramcalc.cli import main
sys.exit(main())
"""


def timed(argv: list[str], runs: int, env: dict[str, str]) -> tuple[list[float], int]:
    """Wall seconds of each run (after a warm-up run) and the full estimates of one run."""
    cmd = [sys.executable, "-c", CHILD, *argv]
    warm = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    found = re.search(r"full estimates: (\d+)", warm.stderr)
    estimates = int(found.group(1)) if found else -1
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
        walls.append(time.perf_counter() - t0)
    return walls, estimates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as pyc:  # the children's bytecode folder
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env.update(PYTHONPYCACHEPREFIX=pyc, PYTHONPATH=str(ROOT), COLUMNS="120")
        for argv in COMMANDS:
            walls, estimates = timed(argv, args.runs, env)
            print(f"vramcalc {' '.join(argv)}\n  best {min(walls):.2f} s, median "
                  f"{statistics.median(walls):.2f} s over {args.runs} runs; "
                  f"{estimates:,} full estimates")


if __name__ == "__main__":
    main()
