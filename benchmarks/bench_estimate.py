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
time (user + sys) is printed too.

Throughput is printed for three workloads (see `throughput`): (a) the same scenarios
again, (b) new micro-batch sizes of structures seen before (the engine compiles a
structure's report as a function of the micro-batch size, vramcalc/affine.py), (c)
structures never seen before, which pay for the whole engine. Prints figures; asserts
nothing.
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


def _with(s, **update):  # noqa: ANN001, ANN202
    """`s` with training options changed (a new scenario object, as the planner makes)."""
    par = {k: update.pop(k) for k in ("tp", "zero") if k in update}
    return s.model_copy(update={"training": s.training.model_copy(update=update),
                                "parallel": s.parallel.model_copy(update=par)})


def _valid(s) -> bool:  # noqa: ANN001
    from vramcalc.errors import InputError

    try:
        s.resolved()
    except InputError:
        return False
    return True


def _rate(todo: list, every: bool, seconds: float) -> float:
    from vramcalc.analytic import estimate

    n, t0 = 0, time.perf_counter()
    for s in todo:
        estimate(s, every_stage=every)
        n += 1
        if time.perf_counter() - t0 > seconds:
            break
    return n / (time.perf_counter() - t0)


def throughput(seconds: float = 1.0, repeats: int = 3) -> dict[str, list[float]]:
    """Estimates/s in-process, three workloads, each with every_stage True (the default)
    and False (what the planner calls), `repeats` times `seconds`; scenarios are built
    outside the timed loops, and each repeat gets scenarios of its own.

    - (a) repeated: the same three scenarios again and again;
    - (b) new micro-batch sizes of known structures (the planner's inner loop): 18
      structures (the three scenarios x recompute x precision), each estimated once at
      b = 2 beforehand, then new micro-batch sizes b = 3, 4, ... each once (compiling a
      structure's report for a range of b is part of the timed work);
    - (c) never-seen structures: every scenario has a sequence length no earlier one had
      (x micro-batch x tp x ZeRO x precision x recompute), so no cache of any kind helps.
    """
    from vramcalc.analytic import estimate

    base = _scenarios()
    for s in base:
        estimate(s)
    out: dict[str, list[float]] = {}
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for s in base:
                estimate(s)
            n += len(base)
        out.setdefault("(a) repeated scenarios", []).append(n / (time.perf_counter() - t0))

    structures = [_with(s, recompute=rc, precision=prec) for s in base
                  for rc in ("none", "selective", "full") for prec in ("bf16", "amp-bf16")]
    first_b = 3
    for every in (True, False):
        for s in structures:
            estimate(_with(s, micro_batch_size=2), every_stage=every)  # the structure is known
        label = "(b) new micro-batch sizes, known structure" + (
            "" if every else ", every_stage=False")
        for _ in range(repeats):
            mbs = range(first_b, first_b + 1000)
            first_b += 1000
            todo = [_with(s, micro_batch_size=b) for b in mbs for s in structures]
            out.setdefault(label, []).append(_rate(todo, every, seconds))

    combos = itertools.product(range(1, 1_000_000), (1, 2), (0, 1, 3), ("bf16", "amp-bf16"),
                               ("none", "selective", "full"))
    fresh = (_with(base[i % 3], seq_len=128 * (i + 7), micro_batch_size=1 + i % 4, tp=tp,
                   zero=z, precision=prec, recompute=rc) for i, tp, z, prec, rc in combos)
    for every in (True, False):
        label = "(c) never-seen structures" + ("" if every else ", every_stage=False")
        for _ in range(repeats):
            todo = [s for s in itertools.islice(fresh, 1500) if _valid(s)]
            out.setdefault(label, []).append(_rate(todo, every, seconds))
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
    print("estimates/s (best and median of 3 one-second runs; target > 20,000):")
    for label, rates in throughput().items():
        print(f"  {label:62s} {max(rates):9,.0f}  {statistics.median(rates):9,.0f}")


if __name__ == "__main__":
    main()
