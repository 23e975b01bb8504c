"""Regenerate docs/validation/predicted_vs_measured.png from the stored probe records.

    pip install matplotlib && python benchmarks/plot_validation.py [RECORDS_DIR]

Also prints the comparison table (same numbers as `vramcalc validate --records`).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    from vramcalc.errors import InputError
    from vramcalc.probe.compare import compare_records

    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "validation" / "records"
    try:
        result = compare_records(folder)
    except InputError as err:  # no record to compare yet
        print(f"{err}: nothing to plot")
        return 0
    rows = [r for r in result["scenarios"] if not r["dry_run"]]
    for r in rows:
        print(f"{r['name']:<40} measured {r['measured_bytes'] / 1e9:8.3f} GB  analytic "
              f"{r['analytic_bytes'] / 1e9:8.3f} GB  {100 * r['rel_error']:+6.2f}%")
    s = result["summary"]
    print(f"{len(rows)} device records; median |error| {100 * s['median_abs_rel_error']:.2f}%, "
          f"max {100 * s['max_abs_rel_error']:.2f}%")
    if not rows:
        print("no device records yet: nothing to plot")
        return 0
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install matplotlib")
        return 0
    x = [r["measured_bytes"] / 1e9 for r in rows]
    y = [r["analytic_bytes"] / 1e9 for r in rows]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(x, y, s=18)
    lim = max(x + y) * 1.05
    ax.plot([0, lim], [0, lim], color="grey", lw=0.8)
    ax.plot([0, lim], [0, lim * 1.05], color="grey", lw=0.5, ls="--")
    ax.plot([0, lim], [0, lim * 0.95], color="grey", lw=0.5, ls="--")
    ax.set_xlabel("measured max_memory_allocated (GB)")
    ax.set_ylabel("vramcalc analytic peak (GB)")
    ax.set_title("Predicted vs measured (±5% dashed)")
    out = ROOT / "docs" / "validation" / "predicted_vs_measured.png"
    fig.savefig(out, dpi=120, bbox_inches="tight")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
