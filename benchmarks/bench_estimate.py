"""Benchmark: cold start of `vramcalc estimate` and in-process estimates per second.

Targets (issue 2): < 0.3 s cold start, > 20,000 estimates/s on a 2-core machine.
Run: python benchmarks/bench_estimate.py [--runs 9]

Cold start is measured as a user sees it after `pip install` (which compiles bytecode) and
one earlier run (which fills the YAML parse cache, vramcalc/yamlio.py): the child gets a
private bytecode folder (PYTHONPYCACHEPREFIX) even where PYTHONDONTWRITEBYTECODE is set, and
one warm-up run. Next to it the script prints what a command typer parses pays before
vramcalc runs (`import typer` + pydantic's BaseModel: typer 0.29 coerces options through
pydantic), which `estimate` avoids (vramcalc/entry.py, vramcalc/record.py), and the same
estimate with the table output (rich).
Wall times on a shared machine are noisy: the minimum is the figure to quote; child CPU
time (user + sys) is printed too. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ESTIMATE = ["-m", "vramcalc", "estimate", "--model", "70b", "--gpus", "8xH100", "--zero", "3",
            "--json"]


def _child_env(pyc: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = pyc
    return env


def timed(args: list[str], env: dict[str, str], runs: int) -> tuple[list[float], list[float]]:
    """Wall and child-CPU seconds of `python ARGS`, after one untimed warm-up run."""
    cmd = [sys.executable, *args]
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return walls, cpus


def _scenarios() -> list:
    from vramcalc.options import build_scenario

    return [
        build_scenario({"model": "70b", "gpus": "64xH100", "zero": 3}),
        build_scenario({"model": "8b", "gpus": "8xH100", "tp": 2, "zero": 1}),
        build_scenario({"model": "70b", "gpus": "64xH100", "tp": 8, "pp": 4,
                        "grad_accum": 8, "recompute": "selective"}),
    ]


def throughput(seconds: float = 2.0) -> dict[str, float]:
    """Estimates/s: the same three scenarios again and again (activation profiles cached),
    and scenarios never seen before (new micro-batch size x recompute x precision each, the
    planner's workload), with every_stage=False as the planner calls it."""
    from vramcalc.analytic import estimate

    base = _scenarios()
    for s in base:
        estimate(s)
    out: dict[str, float] = {}
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for s in base:
            estimate(s)
        n += len(base)
    out["repeated scenarios"] = n / (time.perf_counter() - t0)

    def fresh() -> list:
        combos = itertools.product(range(1, 1_000_000), ("none", "selective", "full"),
                                   ("bf16", "amp-bf16"))
        for mbs, rc, prec in combos:
            for s in base:
                yield s.model_copy(update={"training": s.training.model_copy(update={
                    "micro_batch_size": mbs, "recompute": rc, "precision": prec})})

    gen = fresh()  # shared: the second loop gets scenarios the first never saw
    for label, every in (("new scenarios", True), ("new scenarios, every_stage=False", False)):
        todo = [next(gen) for _ in range(600)]  # built outside the timed loop
        n, t0 = 0, time.perf_counter()
        for s in todo:
            estimate(s, every_stage=every)
            n += 1
            if time.perf_counter() - t0 > seconds:
                break
        out[label] = n / (time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as pyc:
        env = _child_env(pyc)
        rows = [
            ("python -c pass", ["-c", "pass"]),
            ("typer path floor: import typer + pydantic",
             ["-c", "import typer; from pydantic import BaseModel"]),
            ("vramcalc estimate (70b, 8xH100, --json)", ESTIMATE),
            ("vramcalc estimate (70b, 8xH100, table)", ESTIMATE[:-1]),
        ]
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
        for label, argv in rows:
            walls, cpus = timed(argv, env, args.runs)
            print(f"{label:45s} min {min(walls):.3f} s  median {statistics.median(walls):.3f} s"
                  f"  CPU min {min(cpus):.3f} s")
    print("cold-start target < 0.3 s")
    for label, rate in throughput().items():
        print(f"estimates/s, {label:34s} {rate:9,.0f}   target > 20,000")


if __name__ == "__main__":
    main()
