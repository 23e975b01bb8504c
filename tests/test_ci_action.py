"""The GitHub Action (action.yml) and the pre-commit hook (.pre-commit-hooks.yaml), run here.

The action's check step runs as GitHub runs a `shell: bash` step (`bash --noprofile --norc
-eo pipefail`), with a fake GITHUB_STEP_SUMMARY file and `vramcalc` from this checkout.
Which config fits is derived by hand, not read from vramcalc:
- gpt2 (124,439,808 parameters, OpenAI's GPT-2 small) trained with AdamW in bf16 needs
  16 B/param of model states (ZeRO paper, Rajbhandari et al. 2020, §3.1: 2+2+12) = 2.0 GB
  on one 80 GB H100, plus activations of a 1,024-token sequence: it fits;
- llama3-70b's bf16 weights alone, 70.55e9 parameters x 2 B = 141 GB (Meta-Llama-3-70B
  model card: 70B), exceed one 80 GB H100: it does not fit;
- a file that is not valid YAML is bad input.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
ACTION = yaml.safe_load((ROOT / "action.yml").read_text(encoding="utf-8"))
HOOKS = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text(encoding="utf-8"))

FITS = "model: gpt2\ngpus: 1xH100\nseq_len: 1024\nprecision: bf16\noptimizer: adamw\n"
TOO_BIG = "model: llama3-70b\ngpus: 1xH100\nseq_len: 4096\nprecision: bf16\n"
MALFORMED = "model: gpt2\ngpus: [1xH100\n"


@pytest.fixture()
def configs(tmp_path: Path) -> dict[str, Path]:
    folder = tmp_path / "configs"
    folder.mkdir()
    out = {}
    for name, text in (("fits", FITS), ("too_big", TOO_BIG), ("malformed", MALFORMED)):
        out[name] = folder / f"{name}.yaml"
        out[name].write_text(text, encoding="utf-8")
    return out


@pytest.fixture()
def vramcalc_bin(tmp_path: Path) -> Path:
    """A `vramcalc` on PATH that runs this checkout's package with this interpreter."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "vramcalc"
    exe.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m vramcalc "$@"\n',
                   encoding="utf-8")
    exe.chmod(0o755)
    return exe


def _env(vramcalc_bin: Path, **extra: str) -> dict[str, str]:
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PATH": f"{vramcalc_bin.parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": pythonpath, **extra}


def _step(name_part: str) -> dict:
    steps = [s for s in ACTION["runs"]["steps"] if name_part in s["name"]]
    assert len(steps) == 1
    return steps[0]


def _run_check_step(configs: str, vramcalc_bin: Path, summary: Path, cwd: Path,
                    args: str = "") -> subprocess.CompletedProcess[str]:
    step = _step("Check")
    env = _env(vramcalc_bin, CONFIGS=configs, ARGS=args, VRAMCALC=str(vramcalc_bin),
               GITHUB_STEP_SUMMARY=str(summary))
    script = cwd / "check_step.sh"
    script.write_text(step["run"], encoding="utf-8")
    return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


# ---- structure ---------------------------------------------------------------------------
def test_action_is_a_composite_of_bash_steps() -> None:
    assert ACTION["runs"]["using"] == "composite"
    assert ACTION["inputs"]["configs"]["required"] is True
    for step in ACTION["runs"]["steps"]:
        assert step["shell"] == "bash"
        # inputs reach the scripts through env only (no expression spliced into shell code)
        assert "${{" not in step["run"]


def test_action_installs_this_checkout_without_torch() -> None:
    run = _step("Install")["run"]
    installs = [line for line in run.splitlines() if "pip install" in line]
    assert len(installs) == 1
    assert installs[0].rstrip().endswith('"$GITHUB_ACTION_PATH"')  # the action's own code,
    assert "[" not in installs[0] and "torch" not in run  # no extras: no torch


def test_precommit_hook_structure() -> None:
    assert isinstance(HOOKS, list) and len(HOOKS) == 1
    hook = HOOKS[0]
    assert {"id", "name", "entry", "language"} <= set(hook)
    assert hook["language"] == "python"  # pre-commit pip-installs this repository
    assert "vramcalc check" in hook["entry"]
    files = re.compile(hook["files"])
    assert files.search("configs/train.yaml") and files.search("configs/llama.yml")
    assert not files.search(".github/workflows/ci.yml")


# ---- the action's check step, run locally --------------------------------------------------
@pytest.mark.parametrize(("name", "code", "verdict"), [
    ("fits", 0, "✅ fits"), ("too_big", 1, "❌ does not fit"), ("malformed", 2, "❌ bad input"),
])
def test_action_check_step(configs: dict[str, Path], vramcalc_bin: Path, tmp_path: Path,
                           name: str, code: int, verdict: str) -> None:
    summary = tmp_path / "summary.md"
    summary.write_text("", encoding="utf-8")
    proc = _run_check_step(str(configs[name]), vramcalc_bin, summary, tmp_path)
    assert proc.returncode == code, proc.stderr
    text = summary.read_text(encoding="utf-8")
    assert f"vramcalc check: {verdict}" in text and str(configs[name]) in text
    if code == 0:
        assert "::error" not in proc.stdout
    else:
        assert f"::error file={configs[name]}::" in proc.stdout
    if name == "malformed":
        assert "error:" in text and "Traceback" not in text + proc.stderr
    else:  # the markdown report carries the version that judged it
        assert re.search(r"vramcalc \d+\.\d+\S* analytic estimate \(GPU profiles [0-9a-f]{12}, "
                         r"model catalog [0-9a-f]{12}\)", text)


def test_action_checks_every_config_and_fails_with_the_worst(
        configs: dict[str, Path], vramcalc_bin: Path, tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    # a glob and a plain path, separated by a newline as a YAML block input gives them
    proc = _run_check_step(f"{tmp_path}/configs/[ft]*.yaml\n{configs['malformed']}",
                           vramcalc_bin, summary, tmp_path)
    assert proc.returncode == 2, proc.stderr
    text = summary.read_text(encoding="utf-8")
    assert text.count("### vramcalc check:") == 3
    for name in ("fits", "too_big", "malformed"):
        assert str(configs[name]) in text
    # without the malformed one the worst is "does not fit"
    proc = _run_check_step(f"{configs['fits']} {configs['too_big']}", vramcalc_bin, summary,
                           tmp_path)
    assert proc.returncode == 1


def test_action_args_reach_every_check(configs: dict[str, Path], vramcalc_bin: Path,
                                       tmp_path: Path) -> None:
    # the same gpt2 config on 8 x H100 (args override the file): still fits, and says so
    summary = tmp_path / "summary.md"
    proc = _run_check_step(str(configs["fits"]), vramcalc_bin, summary, tmp_path,
                           args="--gpus 8xH100")
    assert proc.returncode == 0, proc.stderr
    assert "8 × NVIDIA H100" in summary.read_text(encoding="utf-8")


def test_action_without_configs_fails(vramcalc_bin: Path, tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    proc = _run_check_step("", vramcalc_bin, summary, tmp_path)
    assert proc.returncode == 2 and "no training config given" in proc.stdout


# ---- the pre-commit hook's entry, run as pre-commit runs it (entry + file names) -------------
@pytest.mark.parametrize(("names", "code"), [
    (["fits"], 0), (["fits", "too_big"], 1), (["malformed", "fits"], 2),
])
def test_precommit_entry(configs: dict[str, Path], vramcalc_bin: Path, names: list[str],
                         code: int) -> None:
    argv = shlex.split(HOOKS[0]["entry"]) + [str(configs[n]) for n in names]
    proc = subprocess.run(argv, env=_env(vramcalc_bin), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == code, proc.stderr
