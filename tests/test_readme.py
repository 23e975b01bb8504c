"""README gives exactly two set-up commands, and CI runs the second one verbatim; the Chinese
quick start (README.zh-CN.md) gives the same two, and its examples run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _setup_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_exactly_two_setup_commands() -> None:
    blocks = _setup_blocks()
    assert len(blocks) == 2 and all("\n" not in b for b in blocks)
    assert blocks[0].endswith("vramcalc plan --model 70b --gpus 8xH100")
    assert "pytest" in blocks[1] and "[test]" in blocks[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert _setup_blocks()[1] in ci


def test_test_extra_pins_the_cpu_torch_wheel() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    test_extra = pyproject.split("test = [", 1)[1].split("]", 1)[0]
    assert '"torch==2.13.0"' in test_extra
    user_extra = pyproject.split("torch = [", 1)[1].split("]", 1)[0]
    assert "torch>=2.4" in user_extra


# ---- README.zh-CN.md: the same two commands, examples that run ------------------------------
ZH = ROOT / "README.zh-CN.md"


def _zh_setup_blocks() -> list[str]:
    text = ZH.read_text(encoding="utf-8")
    section = text.split("## 安装", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_chinese_quick_start_has_the_same_setup_commands() -> None:
    assert _zh_setup_blocks() == _setup_blocks()
    assert "(README.zh-CN.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_chinese_examples_run_with_the_exit_codes_shown(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Each `$ vramcalc ...` example ends with the exit code the quick start prints; the
    verdict line shown is the one the command prints now (scripts/gen_readme_zh.py)."""
    from vramcalc.cli import main

    text = ZH.read_text(encoding="utf-8")
    blocks = re.findall(r"```console\n\$ (vramcalc [^\n]*)\n(.*?)\$ echo \$\?\n(\d+)\n```",
                        text, flags=re.S)
    assert len(blocks) == 6
    for command, shown, code in blocks:
        assert main(shlex.split(command)[1:]) == int(code), command
        out = capsys.readouterr().out
        verdicts = [ln for ln in shown.splitlines() if ln.startswith(("FITS", "DOES NOT"))]
        for line in verdicts:
            assert line.split(":")[0] in out, command
