"""Analytic `peak_reserved_bytes` against the trace engine's caching-allocator replay.

Runs the `vramcalc validate` grid's reference and hf scenarios (the trace engine, real PyTorch
under FakeTensorMode, on the CPU) with the default allocator and with expandable segments,
and prints, per allocator: the replay's reserved over its allocated peak, and the analytic
reserved against the replay's. Usage: `python benchmarks/reserved_agreement.py [--limit N]`.
Needs torch; takes a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import statistics

from vramcalc.analytic import estimate
from vramcalc.trace.engine import trace
from vramcalc.validate import default_grid


def _summary(values: list[float]) -> str:
    return (f"median {statistics.median(values):+.1%}, range {min(values):+.1%} … "
            f"{max(values):+.1%} (n={len(values)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=0, help="first N grid scenarios only")
    args = ap.parse_args()
    grid = [(n, s) for n, s in default_grid()
            if s.training.framework in ("reference", "hf") and s.parallel.fsdp == "none"]
    if args.limit:
        grid = grid[:args.limit]
    for expandable in (False, True):
        over, vs = [], []
        for _, scn in grid:
            scn = scn.model_copy(update={"training": scn.training.model_copy(
                update={"expandable_segments": expandable})})
            try:
                rep = trace(scn).report
            except Exception:  # noqa: BLE001 - a scenario the trace cannot run is skipped
                continue
            ana = estimate(scn)
            over.append(rep.peak_reserved_bytes / rep.peak_allocated_bytes - 1)
            vs.append(ana.peak_reserved_bytes / rep.peak_reserved_bytes - 1)
        label = "expandable segments" if expandable else "default allocator"
        print(f"{label}: replay reserved/allocated - 1: {_summary(over)}")
        print(f"{label}: analytic reserved vs replay: {_summary(vs)}")


if __name__ == "__main__":
    main()
