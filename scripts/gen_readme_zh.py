"""Regenerate README.zh-CN.md from real command output: python scripts/gen_readme_zh.py

The template (docs/i18n/README.zh-CN.template.md) holds the Chinese text; the set-up
commands are copied from README.md and each example's output comes from running it through
the CLI at 100 columns, pasted verbatim.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "docs" / "i18n" / "README.zh-CN.template.md"

# placeholder -> command line (as a user types it)
EXAMPLES = {
    "example_lora": "vramcalc estimate --model qwen2.5-7b --gpus 4090 --finetune lora "
                    "--seq-len 2048 --recompute full",
    "example_max": "vramcalc max --model qwen2.5-7b --gpus 4090 --finetune lora "
                   "--recompute full",
    "example_910b": "vramcalc plan --model 70b --gpus 64x910B --top 3",
    "example_check": "vramcalc check examples/train.yaml",
    "example_check_fail": "vramcalc check examples/train.yaml --seq-len 32768",
    "example_markdown": "vramcalc check examples/train.yaml --markdown",
}


def setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def run(command: str) -> str:
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1"}
    args = command.split()[1:]
    proc = subprocess.run([sys.executable, "-m", "vramcalc", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=False)
    body = "\n".join(line.rstrip() for line in (proc.stdout + proc.stderr).splitlines())
    return f"```console\n$ {command}\n{body}\n$ echo $?\n{proc.returncode}\n```"


def main() -> None:
    setup = setup_commands()
    fields = {"setup_0": setup[0], "setup_1": setup[1]}
    fields.update({k: run(v) for k, v in EXAMPLES.items()})
    text = TEMPLATE.read_text(encoding="utf-8").format(**fields)
    (ROOT / "README.zh-CN.md").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
