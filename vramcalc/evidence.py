"""How far vramcalc's figures fell from published measurements of real runs, by stack
profile: the band `vramcalc estimate` prints under its verdict.

`evidence.yaml` (beside this module) is written by scripts/gen_evidence.py from the
comparisons in docs/validation.md (the calibration table, the published rows outside it,
torchtitan's benchmark: one error per run) and checked against them by
tests/test_evidence.py. Nothing in it is fitted: it only summarises those tables.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from vramcalc import safeio

EVIDENCE_FILE = Path(__file__).resolve().parent / "evidence.yaml"
ALL = "all"


@dataclass(frozen=True)
class Band:
    """|error| over `runs` compared runs, in %: the median, the value nine in ten runs
    stay within, and the worst."""

    runs: int
    median_pct: float
    p90_pct: float
    worst_pct: float


@functools.cache
def bands() -> dict[str, Band]:
    """Every profile's band, and ALL over every compared run."""
    data = safeio.load_yaml(EVIDENCE_FILE.read_text(encoding="utf-8"), EVIDENCE_FILE.name)
    return {str(k): Band(**v) for k, v in data.items()}


def band_for(framework: str) -> tuple[str, Band]:
    """(whose runs, band): the profile's own when published runs of it are compared, else
    every compared run's (ALL)."""
    own = bands().get(framework)
    return (framework, own) if own is not None else (ALL, bands()[ALL])


def within_band(band: Band, device_total_bytes: int, margin_bytes: int) -> bool:
    """Whether a fit margin (negative: the excess) is narrower than the error nine in ten
    compared runs stay within, taken on the device total."""
    return abs(margin_bytes) < band.p90_pct / 100 * device_total_bytes


def evidence_json(framework: str, device_total_bytes: int, margin_bytes: int) -> dict[str, object]:
    """The band as `check --json` reports it: whose runs, the band, and whether the margin
    lies inside it."""
    who, band = band_for(framework)
    return {"runs_of": who, "runs": band.runs, "median_abs_error_pct": band.median_pct,
            "p90_abs_error_pct": band.p90_pct, "worst_abs_error_pct": band.worst_pct,
            "margin_within_p90": within_band(band, device_total_bytes, margin_bytes)}
