"""Rewrite vramcalc/evidence.yaml from the comparisons in docs/validation.md.

    python scripts/gen_evidence.py

docs/validation.md compares vramcalc's figures with published measurements of real runs:
the calibration table, the published rows outside it and torchtitan's benchmark, one error
per run. (Megatron-LM's functional tests outside the calibration set give a range over
each case's golden files, summarised in their own section; they are not counted here.)
Each of those rows names the stack profile it ran
(`--framework X` in its flags; torchtitan's table is torchtitan's; no flag is the reference
profile). This groups the rows' errors by profile and writes how far they fall from the
measurements: the median |error|, the |error| that nine in ten rows stay within, the worst.
`vramcalc estimate` prints that band under its verdict. tests/test_evidence.py fails when
the file is out of date with the tables.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VALIDATION = ROOT / "docs" / "validation.md"
OUT = ROOT / "vramcalc" / "evidence.yaml"

# the sections whose tables compare a run's published figure with vramcalc's, and the
# profile of a row whose flags name none
SECTIONS = {
    "## Calibration against published measurements": "reference",
    "## Published rows outside the calibration set": "reference",
    "## torchtitan's December 2024 benchmark, row by row": "torchtitan",
}
_PCT = re.compile(r"([+\-−]?)\s*(\d+(?:\.\d+)?)\s*%")
_FRAMEWORK = re.compile(r"--framework\s+(\S+)")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def row_errors(text: str) -> list[tuple[str, float]]:
    """(profile, |error| in %) of every compared row in the sections above; a row without
    a percentage (not expressible) counts none."""
    out: list[tuple[str, float]] = []
    default: str | None = None
    header: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("## "):
            default, header = SECTIONS.get(line.strip()), None
            continue
        if default is None or not line.startswith("|"):
            header = None if not line.startswith("|") else header
            continue
        cells = _cells(line)
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set(line) <= set("|-: "):
            continue
        if "error" not in header:
            continue
        err = cells[header.index("error")]
        pct = _PCT.search(err)
        if pct is None:
            continue
        fw = _FRAMEWORK.search(line)
        out.append((fw.group(1).strip("`") if fw else default, float(pct.group(2))))
    return out


def _band(errors: list[float]) -> dict[str, float | int]:
    ranked = sorted(errors)
    return {"runs": len(ranked),
            "median_pct": round(statistics.median(ranked), 1),
            "p90_pct": round(ranked[math.ceil(0.9 * len(ranked)) - 1], 1),
            "worst_pct": round(ranked[-1], 1)}


def evidence(text: str) -> dict[str, dict[str, float | int]]:
    """The band of every profile with compared rows, and of all rows ("all")."""
    rows = row_errors(text)
    by: dict[str, list[float]] = {}
    for fw, err in rows:
        by.setdefault(fw, []).append(err)
    bands = {fw: _band(errs) for fw, errs in sorted(by.items())}
    bands["all"] = _band([e for _, e in rows])
    return bands


def render(bands: dict[str, dict[str, float | int]]) -> str:
    lines = ["# |error| of vramcalc against published measurements of real runs, by stack\n",
             "# profile: the rows of docs/validation.md. scripts/gen_evidence.py writes it;\n",
             "# tests/test_evidence.py checks it against the tables.\n"]
    for fw, band in bands.items():
        fields = ", ".join(f"{k}: {v}" for k, v in band.items())
        lines.append(f"{fw}: {{{fields}}}\n")
    return "".join(lines)


def main() -> None:
    OUT.write_text(render(evidence(VALIDATION.read_text(encoding="utf-8"))), encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
