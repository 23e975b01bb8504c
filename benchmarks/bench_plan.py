"""Plan search speed: in-process search time and candidates/s, and the whole CLI run.

    python benchmarks/bench_plan.py            # the issue's target: 70B on 64 x H100
    python benchmarks/bench_plan.py --repeat 9 --model 405b --gpus 2048x8xH100

Prints figures; asserts nothing (tests never assert wall-clock times). Wall-clock times on
a shared machine are noisy: the minimum over repeats is the figure to quote, and CPU time
(user + sys of the child) is printed next to it.
"""

from __future__ import annotations

import argparse
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


def in_process(model: str, gpus: str, repeat: int) -> None:
    from vramcalc.cli.plan import prepare_plan
    from vramcalc.plan import search

    base, req, _ = prepare_plan({"model": model, "gpus": gpus})
    times, cpu = [], []
    res = None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        res = search(base, req)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    assert res is not None
    best = min(times)
    print(f"search only ({model} on {gpus}), best of {repeat}: {best * 1000:.0f} ms wall "
          f"(median {statistics.median(times) * 1000:.0f} ms), {min(cpu) * 1000:.0f} ms CPU")
    print(f"  {res.num_candidates:,} valid candidates -> {res.num_candidates / best:,.0f} "
          f"candidates/s; speed computed for {res.num_expanded:,} "
          f"({res.num_expanded / best:,.0f}/s), {res.num_bound_pruned:,} pruned by the memory "
          f"bound, {res.num_dominated:,} dominated, {res.num_estimated:,} full estimates "
          f"({res.num_rejected:,} refused by the engine), {len(res.entries)} returned")
    if res.entries:
        e = res.entries[0]
        print(f"  best: {e.speed.tokens_per_s:,.0f} tokens/s, MFU {100 * e.speed.mfu:.1f}%, "
              f"{e.report.device_total_bytes / 1e9:.1f} GB per GPU")


def whole_cli(model: str, gpus: str, repeat: int, as_json: bool, pyc: str) -> None:
    exe = Path(sys.executable).with_name("vramcalc")
    cmd = [str(exe) if exe.exists() else sys.executable, *([] if exe.exists() else
                                                          ["-m", "vramcalc"]),
           "plan", "--model", model, "--gpus", gpus] + (["--json"] if as_json else [])
    walls, cpus = [], []
    # as after `pip install` (bytecode compiled) and one earlier run (parse cache filled):
    # see bench_estimate.py
    from bench_estimate import _child_env

    env = {**_child_env(pyc), "COLUMNS": "120"}
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)  # warm-up
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    kind = "--json" if as_json else "table"
    print(f"whole CLI run ({kind}, start-up included), best of {repeat}: {min(walls):.2f} s "
          f"wall (median {statistics.median(walls):.2f} s); CPU {min(cpus):.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="70b")
    ap.add_argument("--gpus", default="8x8xH100")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    in_process(args.model, args.gpus, args.repeat)
    with tempfile.TemporaryDirectory() as pyc:  # the timed children's bytecode folder
        whole_cli(args.model, args.gpus, args.repeat, as_json=True, pyc=pyc)
        whole_cli(args.model, args.gpus, args.repeat, as_json=False, pyc=pyc)


if __name__ == "__main__":
    main()
