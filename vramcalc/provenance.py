"""Which vramcalc judged a job: its version and the revisions of the catalogs it ships.

- The version is defined once, in pyproject.toml (`[project] version`), and read at run time
  through `importlib.metadata` from the installed distribution `DISTRIBUTION`. A source
  checkout run without installing (`PYTHONPATH=.`) reads the same field from the checkout's
  pyproject.toml; anything else reports `0+unknown`.
- A catalog revision is the first 12 hex digits of the SHA-256 of the catalog's shipped
  YAML files (each file's name and bytes, in name order): the GPU profiles
  (`hardware_profiles/`) and the model presets (`vramcalc/presets/`). Two runs that print
  the same revision read byte-identical catalogs; any edit, added or removed file changes
  it. Profiles a user adds with `--profiles-dir` or `VRAMCALC_PROFILES` are not part of it.
  Hashing the ~50 small files takes about a millisecond, and only when a document is written.

`provenance()` is the one function every `--json` writer calls (vramcalc.cli.app.emit_json).
"""

from __future__ import annotations

import hashlib
import re
from importlib import metadata
from pathlib import Path

from vramcalc.catalog import PRESETS_DIR
from vramcalc.hardware import builtin_profiles_dir

DISTRIBUTION = "llm-vramcalc"  # the name on the package index; the import name is vramcalc
UNKNOWN_VERSION = "0+unknown"
_CHECKOUT_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _checkout_version(pyproject: Path) -> str | None:
    """`[project] version` of a source checkout's pyproject.toml, when it builds DISTRIBUTION."""
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return None
    project = text.split("[project]", 1)[-1].split("\n[", 1)[0]
    name = re.search(r'^name\s*=\s*"([^"]+)"', project, flags=re.M)
    found = re.search(r'^version\s*=\s*"([^"]+)"', project, flags=re.M)
    if name is None or found is None or name.group(1) != DISTRIBUTION:
        return None
    return found.group(1)


def version() -> str:
    """The installed version of DISTRIBUTION (PEP 440 text, e.g. "0.1.0")."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return _checkout_version(_CHECKOUT_PYPROJECT) or UNKNOWN_VERSION


def catalog_revision(folder: Path) -> str:
    """12 hex digits of SHA-256 over the `*.yaml` files in `folder` (name, bytes; name order)."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.yaml"), key=lambda p: p.name):
        digest.update(path.name.encode("utf-8") + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def provenance() -> dict[str, str]:
    """The keys every JSON document carries: the version and both catalog revisions."""
    return {
        "vramcalc_version": version(),
        "gpu_profiles_revision": catalog_revision(builtin_profiles_dir()),
        "model_catalog_revision": catalog_revision(PRESETS_DIR),
    }
