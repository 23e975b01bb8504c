"""`vramcalc validate` refuses to report what it did not measure: missing packages are named
(exit 2) instead of showing up as failed "+inf%" rows, and a records folder with nothing to
compare is an error instead of a pass with 0 records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from vramcalc.cli import main


@pytest.mark.parametrize("package", ["torch", "transformers"])
def test_validate_names_a_missing_package(package: str, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # None in sys.modules: `import package` raises ImportError and find_spec finds nothing,
    # as on a machine without it (the quick grid has hf scenarios, which need transformers)
    monkeypatch.setitem(sys.modules, package, None)
    assert main(["validate", "--quick", "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("error: ") and out.err.count("\n") == 1, out.err
    assert f"pip install {package}" in out.err or f"pip install torch {package}" in out.err


def test_records_folder_without_records_fails(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--records", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: no probe records")
    # records, but none a completed built-in measurement: nothing compared is no pass either
    (tmp_path / "oom.json").write_text(json.dumps({
        "schema": "vramcalc.probe/1", "kind": "builtin", "status": "oom",
        "scenario": {"model": "gpt2"}, "device": {"name": "NVIDIA H100 80GB HBM3"},
        "measured": {}}))
    assert main(["validate", "--records", str(tmp_path), "--json"]) == 2
    assert "none of the 1 probe records" in capsys.readouterr().err
