"""README gives exactly two set-up commands, and CI runs the second one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

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
