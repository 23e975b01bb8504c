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
