"""The tables of docs/validation.md and docs/finetuning.md that their benchmark scripts print
are the scripts' current output: a change to the engine that moves a row must regenerate the
page (and then vramcalc/evidence.yaml, scripts/gen_evidence.py), so the evidence a user reads
under each verdict is never stale."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _script(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))  # published_rows imports the calibration script's settings
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def _printed(run: object, monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> list[str]:
    monkeypatch.setattr(sys, "argv", argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run()  # type: ignore[operator]
    return [line for line in out.getvalue().splitlines() if line.startswith("| ")]


@pytest.mark.parametrize("name", ["torchtitan_rows", "published_rows"])
def test_validation_page_shows_the_current_rows(name: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    page = (ROOT / "docs" / "validation.md").read_text(encoding="utf-8")
    rows = _printed(_script(name).main, monkeypatch, [name, "--markdown"])
    stale = [row for row in rows if row not in page]
    assert len(rows) > 10 and not stale, (
        f"docs/validation.md is out of date: run python benchmarks/{name}.py --markdown "
        f"and python scripts/gen_evidence.py; first stale row: {stale[:1]}")


@pytest.mark.slow
def test_finetuning_page_shows_the_current_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    page = (ROOT / "docs" / "finetuning.md").read_text(encoding="utf-8")
    module = _script("finetune_tables")

    def both() -> None:
        module.table_7b()
        module.table_70b()

    rows = _printed(both, monkeypatch, ["finetune_tables"])
    stale = [row for row in rows if row not in page]
    assert len(rows) > 40 and not stale, (
        f"docs/finetuning.md is out of date: run python benchmarks/finetune_tables.py; "
        f"first stale row: {stale[:1]}")
