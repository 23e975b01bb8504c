"""Benchmark: trace one training step of a Llama-3-70B shape (80 layers) under FakeTensorMode.

Prints the wall time, the traced peak next to the analytic estimate, and this process's
maximum resident memory, which shows that no tensor memory is allocated (the step would
need about 1.4 TB on a device).

Run: python benchmarks/trace_70b.py [--seq 4096] [--framework reference|hf]
"""

from __future__ import annotations

import argparse
import resource
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--framework", default="reference", choices=("reference", "hf"))
    args = ap.parse_args()

    from vramcalc.analytic import estimate
    from vramcalc.catalog import get_preset
    from vramcalc.scenario import Scenario
    from vramcalc.trace.engine import run_trace
    from vramcalc.training import TrainingConfig
    from vramcalc.units import fmt_gib

    spec = get_preset("llama3-70b").spec
    scn = Scenario(model=spec, training=TrainingConfig(
        seq_len=args.seq, micro_batch_size=1, precision="bf16", optimizer="adamw",
        framework=args.framework))
    t0 = time.perf_counter()
    import torch  # noqa: F401  (counted separately: import time is not trace time)

    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    rep = run_trace(scn)
    wall = time.perf_counter() - t0
    ana = estimate(scn)
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{spec.summary()}")
    print(f"profile {args.framework}, seq {args.seq}, micro-batch 1, bf16 + fp32 master, AdamW")
    print(f"torch import:     {t_import:6.1f} s")
    print(f"trace wall time:  {wall:6.1f} s (2 iterations: forward, backward, optimizer step)")
    print(f"traced peak:      {fmt_gib(rep.peak_allocated_bytes)} ({rep.peak_phase})")
    print(f"analytic peak:    {fmt_gib(ana.peak_allocated_bytes)} ({ana.peak_phase}), "
          f"{(ana.peak_allocated_bytes / rep.peak_allocated_bytes - 1) * 100:+.3f} %")
    print(f"first-step peak:  {fmt_gib(rep.first_step_peak_bytes)}")
    print(f"process max RSS:  {rss_kib / 2**20:.2f} GiB (no tensor memory is allocated)")


if __name__ == "__main__":
    main()
