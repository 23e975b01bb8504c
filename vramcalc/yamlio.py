"""YAML reading: libyaml's C loader when PyYAML has it, and a cache for catalog files.

Every run resolves names against the built-in catalogs (21 model presets, 37 GPU profiles,
one YAML file each). Importing PyYAML and parsing those files took ~65 ms of a ~0.6 s
start-up on the 2-core reference machine (benchmarks/bench_estimate.py), and validating
them with pydantic needs pydantic itself (~0.16 s to import). So `load_file` keeps, per
file, a JSON cache entry keyed by the file's size and mtime (nanoseconds):

- without `convert`, the parse result;
- with `convert(data, path)`, what that function returned for the parsed data: the
  catalogs pass their validation there (vramcalc/record.py) and store the validated
  fields, so a hit skips both PyYAML and pydantic. Such entries also carry `key`, which
  the caller derives from the code that validates (`code_key`): when that code changes,
  the entry is stale and the file is validated again.

A changed file is parsed again. Only data that survives a JSON round trip unchanged is
cached (YAML dates or integer keys are parsed every time). `convert` raising (a bad file)
caches nothing. The cache lives in $VRAMCALC_CACHE_DIR, else $XDG_CACHE_HOME/vramcalc,
else ~/.cache/vramcalc; VRAMCALC_CACHE_DIR=off disables it; a cache that cannot be read
or written is ignored.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CACHE_VERSION = 2


class YAMLError(Exception):
    """A YAML syntax error (wraps PyYAML's, keeping its `problem` and `problem_mark`)."""

    def __init__(self, original: Exception) -> None:
        super().__init__(str(original))
        self.problem = getattr(original, "problem", None)
        self.problem_mark = getattr(original, "problem_mark", None)


def safe_load(text: str) -> Any:
    """yaml.safe_load, through the C loader when available (same safe constructors)."""
    import yaml  # ~30 ms: only when a file is not in the parse cache

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise YAMLError(err) from None


def cache_dir() -> Path | None:
    """Where parse caches live; None when disabled."""
    env = os.environ.get("VRAMCALC_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vramcalc"


def code_key(*modules: str) -> str:
    """A key that changes whenever one of these (imported) modules' source files does."""
    parts = []
    for name in modules:
        path = getattr(sys.modules.get(name), "__file__", None)
        try:
            parts.append(f"{name}:{os.stat(path).st_mtime_ns}" if path else name)
        except OSError:
            parts.append(name)
    return ";".join(parts)


class _DirCache:
    """Entries for the YAML files of one directory: {file name: [size, mtime_ns, key, json]}
    (key "" for plain parse results)."""

    def __init__(self, directory: Path) -> None:
        root = cache_dir()
        key = re.sub(r"[^A-Za-z0-9]+", "_", str(directory.resolve())).strip("_")[-120:]
        self.path = root / f"yaml-{key}.json" if root else None
        self.entries: dict[str, list[Any]] = {}
        self.dirty = False
        if self.path is None:
            return
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
            if isinstance(doc, dict) and doc.get("version") == _CACHE_VERSION and isinstance(
                    doc.get("files"), dict):
                self.entries = doc["files"]
        except (OSError, ValueError):
            self.entries = {}

    def get(self, name: str, size: int, mtime_ns: int, key: str) -> tuple[bool, Any]:
        entry = self.entries.get(name)
        if (isinstance(entry, list) and len(entry) == 4 and entry[:3] == [size, mtime_ns, key]
                and isinstance(entry[3], str)):
            try:
                return True, json.loads(entry[3])  # fresh objects: callers may mutate them
            except ValueError:
                pass
        return False, None

    def put(self, name: str, size: int, mtime_ns: int, key: str, data: Any) -> None:
        if self.path is None:
            return
        try:
            text = json.dumps(data, sort_keys=True)
        except (TypeError, ValueError):
            return
        if json.loads(text) != data:  # e.g. integer keys become strings: not cacheable
            return
        self.entries[name] = [size, mtime_ns, key, text]
        self.dirty = True

    def save(self) -> None:
        if not self.dirty or self.path is None:
            return
        self.dirty = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": _CACHE_VERSION, "files": self.entries}),
                           encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            pass


_CACHES: dict[Path, _DirCache] = {}


def load_file(path: Path, convert: Callable[[Any, Path], Any] | None = None,
              key: str = "") -> Any:
    """Parse a YAML file, then `convert(data, path)` it when given, through the cache (see
    the module docstring). Raises OSError/UnicodeDecodeError when the file cannot be read,
    YAMLError when it is malformed, and whatever `convert` raises; none of them cached."""
    st = path.stat()
    cache = _CACHES.get(path.parent)
    if cache is None:
        cache = _CACHES[path.parent] = _DirCache(path.parent)
    key = f"converted:{key}" if convert is not None else ""
    hit, data = cache.get(path.name, st.st_size, st.st_mtime_ns, key)
    if hit:
        return data
    data = safe_load(path.read_text(encoding="utf-8"))
    if convert is not None:
        data = convert(data, path)
    cache.put(path.name, st.st_size, st.st_mtime_ns, key, data)
    cache.save()
    return data
