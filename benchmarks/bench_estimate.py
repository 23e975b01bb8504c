"""Benchmark: cold start of `vramcalc estimate` and in-process estimates per second.

Targets (issue 2): < 0.3 s cold start, > 20,000 estimates/s on a 2-core machine.
Run: python benchmarks/bench_estimate.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time


def cold_start(runs: int = 7) -> list[float]:
    cmd = [sys.executable, "-m", "vramcalc", "estimate", "--model", "70b", "--gpus", "8xH100",
           "--zero", "3", "--json"]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return times


def python_start(runs: int = 7) -> list[float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        times.append(time.perf_counter() - t0)
    return times


def throughput(seconds: float = 2.0) -> tuple[float, float]:
    from vramcalc.analytic import estimate
    from vramcalc.options import build_scenario

    scenarios = [
        build_scenario({"model": "70b", "gpus": "64xH100", "zero": 3}),
        build_scenario({"model": "8b", "gpus": "8xH100", "tp": 2, "zero": 1}),
        build_scenario({"model": "70b", "gpus": "64xH100", "tp": 8, "pp": 4,
                        "grad_accum": 8, "recompute": "selective"}),
    ]
    for s in scenarios:
        estimate(s)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for s in scenarios:
            estimate(s)
        n += len(scenarios)
    dt = time.perf_counter() - t0
    # the planner varies copies of a scenario; fresh (uncached) copies cost more
    m = 0
    t1 = time.perf_counter()
    while time.perf_counter() - t1 < seconds:
        for mbs in range(1, 9):
            estimate(scenarios[0].model_copy(update={
                "training": scenarios[0].training.model_copy(update={"micro_batch_size": mbs})}))
            m += 1
    return n / dt, m / (time.perf_counter() - t1)


if __name__ == "__main__":
    base = python_start()
    cs = cold_start()
    same, varied = throughput()
    print(f"python -c pass:               median {statistics.median(base):.3f} s")
    print(f"vramcalc estimate cold start: median {statistics.median(cs):.3f} s "
          f"(min {min(cs):.3f} s)  target < 0.3 s")
    print(f"estimates/s (same scenarios): {same:,.0f}  target > 20,000")
    print(f"estimates/s (varied copies):  {varied:,.0f}")
