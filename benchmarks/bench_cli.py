"""Benchmark: the commands a user runs, timed from process start to exit in a fresh venv.

    python benchmarks/bench_cli.py [--runs 7] [--venv PATH]

Builds a new virtual environment with `pip install .` of this checkout (no torch; pass
--venv to reuse one built earlier), then times each command below: one untimed warm-up run
(pip has compiled the bytecode; the warm-up fills the OS file cache), then --runs timed
runs. Prints the minimum and median wall time and the child's CPU time next to the target.
Wall times on a shared machine are noisy: the minimum is the figure to quote.

Also prints in-process estimates per second for scenarios never estimated before (each
with a sequence length no earlier one had), the cost the planner pays per candidate.
Prints figures; asserts nothing.
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
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMANDS: tuple[tuple[str, list[str], float], ...] = (
    ("estimate --model 70b --gpus 8xH100 --zero 3 --json",
     ["estimate", "--model", "70b", "--gpus", "8xH100", "--zero", "3", "--json"], 0.5),
    ("plan --model 70b --gpus 64xH100", ["plan", "--model", "70b", "--gpus", "64xH100"], 1.0),
    ("plan --model 70b --gpus 64xH100 --allow precision,optimizer,offload,finetune",
     ["plan", "--model", "70b", "--gpus", "64xH100", "--allow",
      "precision,optimizer,offload,finetune"], 1.5),
    ("serve --model deepseek-v3 --gpus 16xH100 --tp 8 --pp 2 --json",
     ["serve", "--model", "deepseek-v3", "--gpus", "16xH100", "--tp", "8", "--pp", "2",
      "--json"], 0.5),
    ("serve --model llama3.1-8b --gpus RTX3090 --engine vllm-v0 --max-model-len 20000",
     ["serve", "--model", "llama3.1-8b", "--gpus", "RTX3090", "--engine", "vllm-v0",
      "--max-model-len", "20000"], 0.5),
    ("plan --model 70b --gpus 8xH100 (README main command)",
     ["plan", "--model", "70b", "--gpus", "8xH100"], 1.5),
    ("plan --model deepseek-v3 --gpus 32x8xH100 --framework megatron (MLA)",
     ["plan", "--model", "deepseek-v3", "--gpus", "32x8xH100", "--framework", "megatron"], 1.0),
    ("plan --model deepseek-v3 --gpus 32x8xH100 --framework megatron --first-stage-layers 3 "
     "--last-stage-layers 2 --mtp-layers 1",
     ["plan", "--model", "deepseek-v3", "--gpus", "32x8xH100", "--framework", "megatron",
      "--first-stage-layers", "3", "--last-stage-layers", "2", "--mtp-layers", "1"], 1.5),
)


def build_venv(where: Path) -> Path:
    """A venv at `where` with this checkout installed (`pip install .`); its vramcalc."""
    venv.create(where, with_pip=True)
    pip = where / "bin" / "pip"
    subprocess.run([str(pip), "install", "-q", str(ROOT)], check=True)
    return where / "bin" / "vramcalc"


def timed(cmd: list[str], runs: int) -> tuple[list[float], list[float]]:
    """Wall and child-CPU seconds of `cmd`, after one untimed warm-up run. Runs in an empty
    folder, so a run that wrote a file would show up (`check_clean`)."""
    with tempfile.TemporaryDirectory() as cwd:
        subprocess.run(cmd, check=False, capture_output=True, cwd=cwd)
        walls, cpus = [], []
        for _ in range(runs):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=False, capture_output=True, cwd=cwd)
            walls.append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        left = sorted(os.listdir(cwd))
    if left:
        print(f"  note: the command left files in its folder: {left}")
    return walls, cpus


def estimates_per_second(seconds: float = 1.0) -> float:
    """In-process `analytic.estimate` calls per second on scenarios never seen before."""
    sys.path.insert(0, str(ROOT))
    from vramcalc.analytic import estimate
    from vramcalc.errors import InputError
    from vramcalc.options import build_scenario

    combos = itertools.product(range(1, 10**6), (1, 2), (0, 1, 3), ("bf16", "amp-bf16"),
                               ("none", "selective", "full"))
    todo = []
    for i, tp, zero, precision, recompute in itertools.islice(combos, 3000):
        try:
            todo.append(build_scenario({
                "model": ("70b", "8b")[i % 2], "gpus": "64xH100", "seq_len": 128 * (i + 7),
                "micro_batch_size": 1 + i % 4, "tp": tp, "zero": zero, "precision": precision,
                "recompute": recompute}))
        except InputError:
            continue
    n, t0 = 0, time.perf_counter()
    for scn in todo:
        estimate(scn, every_stage=False)
        n += 1
        if time.perf_counter() - t0 > seconds:
            break
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--venv", type=Path, help="reuse this venv (built by an earlier run)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.venv and (args.venv / "bin" / "vramcalc").exists():
            exe = args.venv / "bin" / "vramcalc"
        else:
            where = args.venv or Path(tmp) / "venv"
            print(f"building a venv with `pip install .` at {where} ...")
            exe = build_venv(where)
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
              f"{args.runs} timed runs each")
        for label, argv, target in COMMANDS:
            walls, cpus = timed([str(exe), *argv], args.runs)
            verdict = "met" if min(walls) < target else "MISSED"
            print(f"{label}\n  min {min(walls):.3f} s  median {statistics.median(walls):.3f} s"
                  f"  CPU min {min(cpus):.3f} s  (target < {target} s: {verdict})")
    rate = estimates_per_second()
    print(f"in-process estimates/s, never-seen scenarios (every_stage=False): {rate:,.0f}")


if __name__ == "__main__":
    main()
