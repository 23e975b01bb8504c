"""Install lines name the distribution this repository builds, never the index's `vramcalc`.

The package index's `vramcalc` is another project (a Llama VRAM predictor, 0.1.2 in October
2026); this repository builds `llm-vramcalc` (pyproject.toml), whose command and import name
are `vramcalc`. A user following README.md or docs/ must not get someone else's code.
"""

from __future__ import annotations

import re
from pathlib import Path

from vramcalc.provenance import DISTRIBUTION

ROOT = Path(__file__).resolve().parent.parent
# `pip install vramcalc`, `pip install 'vramcalc[torch]'`, `pip install -U "vramcalc==0.1"` ...
WRONG = re.compile(r"""pip3?\s+install\s+(?:-\S+\s+)*['"]?vramcalc(?![\w-])""")


def _texts() -> list[Path]:
    """README.md, docs/, and the user-facing text in the package, scripts and benchmarks."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("vramcalc", "benchmarks", "scripts", "examples"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".md"))
    return files


def test_no_line_installs_the_wrong_package() -> None:
    bad = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
           for p in _texts()
           for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
           if WRONG.search(line)]
    assert bad == []


def test_the_pattern_catches_the_old_lines() -> None:
    # the lines the docs used to carry (issue 19), and forms of them
    for line in ("- run: pip install vramcalc   # no torch needed",
                 "`pip install 'vramcalc[torch]'` takes any torch",
                 'pip install "vramcalc[plot]"', "pip install -U vramcalc==0.1.0"):
        assert WRONG.search(line), line
    for line in ("pip install .", "pip install '.[torch]'", f"pip install {DISTRIBUTION}",
                 "pip install -e '.[test]'", f"pip install '{DISTRIBUTION}[torch]'"):
        assert not WRONG.search(line), line


def test_pyproject_builds_the_distribution_the_code_reads() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    project = pyproject.split("[project]", 1)[1].split("\n[", 1)[0]
    assert re.search(rf'^name = "{re.escape(DISTRIBUTION)}"$', project, flags=re.M)
    assert re.search(r'^vramcalc = "vramcalc\.cli:main"$', pyproject, flags=re.M)  # command
    # distinct from the index's `vramcalc` even after the index's name folding (PEP 503
    # normalization, and the index's refusal of names differing only by - _ .)
    assert re.sub(r"[-_.]+", "", DISTRIBUTION.lower()) != "vramcalc"


def test_readme_names_the_distribution() -> None:
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"`{DISTRIBUTION}`" in readme and "No release is on the index yet" in readme
