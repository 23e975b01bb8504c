"""`vramcalc --version`, the version and catalog revisions in every `--json` document, and
typer's shell completion.

The expected version is read from pyproject.toml here (the one place it is defined); the
expected revisions are SHA-256 digests of the shipped YAML files, computed here from their
definition (vramcalc/provenance.py docstring).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from vramcalc import provenance
from vramcalc.cli import main

ROOT = Path(__file__).resolve().parent.parent
KEYS = ["vramcalc_version", "gpu_profiles_revision", "model_catalog_revision"]


def _pyproject_version() -> str:
    project = (ROOT / "pyproject.toml").read_text(encoding="utf-8").split("[project]", 1)[1]
    found = re.search(r'^version = "([^"]+)"$', project, flags=re.M)
    assert found
    return found.group(1)


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in sorted(p.name for p in folder.iterdir() if p.name.endswith(".yaml")):
        h.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    return h.hexdigest()[:12]


EXPECTED = {
    "vramcalc_version": _pyproject_version(),
    "gpu_profiles_revision": _digest(ROOT / "hardware_profiles"),
    "model_catalog_revision": _digest(ROOT / "vramcalc" / "presets"),
}


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out == (f"vramcalc {EXPECTED['vramcalc_version']} (GPU profiles "
                   f"{EXPECTED['gpu_profiles_revision']}, model catalog "
                   f"{EXPECTED['model_catalog_revision']})\n")


@pytest.mark.parametrize("argv", [
    ["estimate", "--model", "gpt2", "--gpus", "H100"],
    ["explain", "--model", "gpt2", "--gpus", "H100"],
    ["plan", "--model", "gpt2", "--gpus", "8xH100", "--top", "1"],
    ["size", "--model", "gpt2", "--tokens", "1B", "--gpu", "H100"],
    ["check", str(ROOT / "examples" / "train.yaml")],
    ["gpus"],
    ["models"],
    ["validate", "--records", "RECORDS"],
])
def test_every_json_document_carries_the_version(argv: list[str], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    if "RECORDS" in argv:  # one hand-written probe record (an empty folder is exit 2)
        (tmp_path / "r.json").write_text(json.dumps({
            "schema": "vramcalc.probe/1", "kind": "builtin", "status": "ok",
            "device": {"name": "cpu", "type": "cpu"},
            "scenario": {"model": "gpt2", "gpus": "1xH100", "seq_len": 64},
            "measured": {"max_memory_allocated_bytes": 10**9}}))
        argv = [str(tmp_path) if a == "RECORDS" else a for a in argv]
    # validate exits 1 when a stored record is out of tolerance: still one JSON document
    assert main([*argv, "--json"]) in ((0, 1) if argv[0] == "validate" else (0,))
    doc = json.loads(capsys.readouterr().out)
    assert list(doc)[:3] == KEYS
    assert {k: doc[k] for k in KEYS} == EXPECTED


def test_the_version_is_read_through_importlib_metadata(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    real = metadata.version

    def installed(name: str) -> str:
        return "7.7.7" if name == provenance.DISTRIBUTION else real(name)

    monkeypatch.setattr(metadata, "version", installed)
    assert provenance.version() == "7.7.7"

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    # not installed: a source checkout reads its own pyproject.toml ...
    monkeypatch.setattr(metadata, "version", missing)
    assert provenance.version() == EXPECTED["vramcalc_version"]
    # ... but never another project's
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "vramcalc"\nversion = "0.1.2"\n', encoding="utf-8")
    monkeypatch.setattr(provenance, "_CHECKOUT_PYPROJECT", other)
    assert provenance.version() == provenance.UNKNOWN_VERSION


def test_a_revision_changes_with_any_file(tmp_path: Path) -> None:
    folder = tmp_path / "profiles"
    shutil.copytree(ROOT / "hardware_profiles", folder)
    same = provenance.catalog_revision(folder)
    assert same == EXPECTED["gpu_profiles_revision"]
    h100 = folder / "h100_sxm.yaml"
    h100.write_text(h100.read_text(encoding="utf-8") + "\n", encoding="utf-8")
    edited = provenance.catalog_revision(folder)
    h100.rename(folder / "h100_sxm_renamed.yaml")
    renamed = provenance.catalog_revision(folder)
    assert len({same, edited, renamed}) == 3


# ---- shell completion (typer's) ------------------------------------------------------------
def _vramcalc(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "vramcalc", *args], capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": pythonpath, **env})


def test_completion_completes_commands_and_options() -> None:
    script = _vramcalc(["--show-completion", "bash"])
    assert script.returncode == 0 and "_VRAMCALC_COMPLETE=complete_bash" in script.stdout
    # what bash asks when the user presses tab after `vramcalc pl` / `vramcalc estimate --prec`
    words = _vramcalc([], _VRAMCALC_COMPLETE="complete_bash", COMP_WORDS="vramcalc pl",
                      COMP_CWORD="1")
    assert words.stdout.split() == ["plan"]
    words = _vramcalc([], _VRAMCALC_COMPLETE="complete_bash",
                      COMP_WORDS="vramcalc estimate --prec", COMP_CWORD="2")
    assert words.stdout.split() == ["--precision"]


def test_install_completion_writes_the_shell_setup(tmp_path: Path) -> None:
    proc = _vramcalc(["--install-completion", "bash"], HOME=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / ".bash_completions" / "vramcalc.sh"  # in HOME, as typer installs it
    assert "_VRAMCALC_COMPLETE=complete_bash" in script.read_text(encoding="utf-8")
    assert str(script) in (tmp_path / ".bashrc").read_text(encoding="utf-8")  # sourced
