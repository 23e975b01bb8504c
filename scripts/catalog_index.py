"""Rewrite the catalogs' index files from the catalog files themselves.

    python scripts/catalog_index.py

`hardware_profiles/_index.yaml` lists each GPU profile's aliases; `vramcalc/presets/_index.yaml`
each preset's aliases and HF repo. vramcalc finds a name through them without reading every
file; tests/test_hardware.py and tests/test_catalog.py fail when an index is out of date.
"""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
HEADER = ("# {what} of the shipped {kind}, as each file lists them: a name is found without\n"
          "# reading every file. tests/{test} checks it; scripts/catalog_index.py rewrites it.\n")


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.yaml") if p.name != "_index.yaml")


def _line(key: str, value: object) -> str:
    return f"{key}: {yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()}\n"


def main() -> None:
    gpus = ROOT / "hardware_profiles"
    text = HEADER.format(what="Aliases", kind="GPU profiles", test="test_hardware.py")
    for path in _files(gpus):
        text += _line(path.stem, list(yaml.safe_load(path.read_text()).get("aliases") or []))
    (gpus / "_index.yaml").write_text(text)

    presets = ROOT / "vramcalc" / "presets"
    text = HEADER.format(what="Aliases and HF repos", kind="model presets",
                         test="test_catalog.py")
    for path in _files(presets):
        data = yaml.safe_load(path.read_text())
        entry = {k: data[k] for k in ("aliases", "hf_repo") if data.get(k)}
        text += _line(path.stem, entry)
    (presets / "_index.yaml").write_text(text)


if __name__ == "__main__":
    main()
