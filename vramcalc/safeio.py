"""The one reader of user files and paths: bounded, regular files only, strict JSON and YAML.

Every file vramcalc reads on a user's behalf (training configs, DeepSpeed JSON, Hugging Face
config.json, model YAML, GPU profiles, probe records) goes through `read_text`, and every
JSON or YAML document through `load_json` / `load_yaml`. Each refusal is an InputError with
one line naming the file:

- only regular files (a FIFO, a device such as /dev/zero, a directory or a socket is
  refused without blocking on it: the file is opened non-blocking and checked with fstat);
- at most MAX_FILE_BYTES (a config is a few KiB; a huge file would take minutes to parse),
  a YAML document at most MAX_YAML_CHARS with at most MAX_NODES values (checked on
  libyaml's node graph, before PyYAML's slower construction);
- JSON and YAML: no duplicate keys (the last one would win silently), nesting at most
  MAX_DEPTH levels, integers of at most MAX_INT_DIGITS digits, no NaN or infinity;
- paths: `~user` that does not exist, names over the system's limit, loops and permission
  errors are InputErrors, not OSErrors.

User text inside a message goes through vramcalc.errors.shown / shown_path: escaped like
`repr` (a newline or a terminal escape cannot break the one-line error), cut to 300
characters.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from vramcalc.errors import InputError, shown, shown_path

MAX_FILE_BYTES = 2**20  # 1 MiB: a training config, config.json or profile is a few KiB
MAX_YAML_CHARS = 2**18  # 256 KiB: PyYAML composes ~1 MiB/s, its cost is the node count
MAX_NODES = 20_000  # YAML values: a config has tens to hundreds
MAX_DEPTH = 64  # an HF config.json nests 3-4 levels (text_config.rope_scaling)
MAX_INT_DIGITS = 30  # 10^30 is past any count, size or byte figure vramcalc reads
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux


def _os_reason(err: OSError) -> str:
    return err.strerror or type(err).__name__


def user_path(text: str | os.PathLike[str], what: str = "path") -> Path:
    """`text` as a Path with `~` expanded; InputError for an unknown `~user` or a path
    longer than the system accepts."""
    raw = os.fspath(text)
    if len(raw) > MAX_PATH_CHARS or "\0" in raw:
        raise InputError(f"{what} {shown_path(raw)}: not a valid path")
    try:
        return Path(raw).expanduser()
    except RuntimeError:  # pathlib: "Could not determine home directory"
        raise InputError(f"{what} {shown_path(raw)}: no such user's home directory") from None


def path_kind(path: Path) -> str:
    """'file', 'dir', 'missing' or 'other' (a FIFO, a device, a socket), never raising for
    names too long, loops or permissions (those read as 'missing' when nothing can be
    known, else as what stat says)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return "missing"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    return "other"


def list_dir(path: Path, what: str) -> list[Path]:
    """The entries of a folder, sorted; InputError when it cannot be listed."""
    try:
        return sorted(path.iterdir())
    except OSError as err:
        raise InputError(f"cannot read {what} {shown_path(path)}: {_os_reason(err)}") from None


def read_text(path: Path, what: str = "file") -> str:
    """A regular file's text (UTF-8), at most MAX_FILE_BYTES; InputError otherwise."""
    name = shown_path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise InputError(f"{what} {name} not found") from None
    except (OSError, ValueError) as err:
        reason = _os_reason(err) if isinstance(err, OSError) else "not a valid path"
        raise InputError(f"cannot read {what} {name}: {reason}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise InputError(f"cannot read {what} {name}: {kind}")
        if info.st_size > MAX_FILE_BYTES:
            raise InputError(f"{what} {name} is {info.st_size:,} bytes; the limit is "
                             f"{MAX_FILE_BYTES:,} ({MAX_FILE_BYTES // 2**20} MiB)")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise InputError(f"cannot read {what} {name}: {_os_reason(err)}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:  # grew while read
        raise InputError(f"{what} {name} is over the limit of {MAX_FILE_BYTES:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"cannot read {what} {name}: not UTF-8 text (byte {err.start})"
                         ) from None


# ---- JSON -----------------------------------------------------------------------------
def _no_duplicates(where: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise InputError(f"{where}: duplicate key {shown(key)}")
            out[key] = value
        return out
    return hook


def _int(where: str) -> Any:
    def parse(text: str) -> int:
        if len(text.lstrip("-")) > MAX_INT_DIGITS:
            raise InputError(f"{where}: a number with {len(text):,} digits (at most "
                             f"{MAX_INT_DIGITS})")
        return int(text)
    return parse


def _float(where: str) -> Any:
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise InputError(f"{where}: number {shown(text)} is out of range")
        return value
    return parse


def _constant(where: str) -> Any:
    def parse(text: str) -> float:
        raise InputError(f"{where}: {text} is not a number JSON allows")
    return parse


def check_depth(doc: Any, where: str) -> None:
    """InputError when lists/mappings nest more than MAX_DEPTH levels (walked without
    recursion, each container once: YAML aliases share them)."""
    stack = [(doc, 1)]
    seen: set[int] = set()
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)) and id(node) not in seen:
            if depth > MAX_DEPTH:
                raise InputError(f"{where}: nested more than {MAX_DEPTH} levels deep")
            seen.add(id(node))
            items = node.values() if isinstance(node, dict) else node
            stack.extend((x, depth + 1) for x in items)


def load_json(text: str, where: str) -> Any:
    """Strict JSON: duplicate keys, NaN/Infinity, over-long integers and deep nesting are
    InputErrors naming `where`."""
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates(where),
                         parse_int=_int(where), parse_float=_float(where),
                         parse_constant=_constant(where))
    except json.JSONDecodeError as err:
        raise InputError(f"{where}: malformed JSON: {err.msg} at line {err.lineno} column "
                         f"{err.colno}") from None
    except RecursionError:
        raise InputError(f"{where}: nested more than {MAX_DEPTH} levels deep") from None
    check_depth(doc, where)
    return doc


def read_json(path: Path, what: str = "file", where: str | None = None) -> Any:
    """`load_json(read_text(path))`, messages naming the file (or `where`)."""
    return load_json(read_text(path, what), where or shown_path(path))


# ---- YAML -----------------------------------------------------------------------------
_BASE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrictLoader(_BASE_LOADER):  # type: ignore[misc, valid-type]
    """PyYAML's safe loader (libyaml's parser when available) with strict mappings,
    integers and floats."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: PyYAML refuses it itself
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {shown(str(key))}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Any) -> Any:
        digits = str(node.value).replace("_", "").lstrip("+-")
        if len(digits) > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(
                None, None, f"a number with {len(digits):,} digits (at most "
                f"{MAX_INT_DIGITS})", node.start_mark)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node: Any) -> Any:
        value = super().construct_yaml_float(node)
        if not math.isfinite(value):
            raise yaml.constructor.ConstructorError(
                None, None, f"number {shown(str(node.value))} is not finite",
                node.start_mark)
        return value


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _StrictLoader.construct_yaml_float)


def _check_nodes(root: Any, where: str) -> None:
    """InputError when the composed YAML has more than MAX_NODES nodes or nests deeper
    than MAX_DEPTH (walked without recursion, each node once: aliases share them)."""
    stack = [(root, 1)] if root is not None else []
    seen: set[int] = set()
    while stack:
        node, depth = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > MAX_NODES:
            raise InputError(f"{where}: more than {MAX_NODES:,} values (not a config file)")
        if isinstance(node, yaml.MappingNode):
            children = [x for pair in node.value for x in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            continue
        if depth > MAX_DEPTH:
            raise InputError(f"{where}: nested more than {MAX_DEPTH} levels deep")
        stack.extend((x, depth + 1) for x in children)


def load_yaml(text: str, where: str) -> Any:
    """Strict YAML through the safe loader: syntax errors, duplicate keys, non-finite
    numbers, over-long integers and deep nesting are InputErrors naming `where`."""
    if len(text) > MAX_YAML_CHARS:
        raise InputError(f"{where}: {len(text):,} characters of YAML; the limit is "
                         f"{MAX_YAML_CHARS:,} (a config is a few KiB)")
    try:
        loader = _StrictLoader(text)
        try:  # libyaml composes the node graph; its size is checked before construction
            node = loader.get_single_node()
            _check_nodes(node, where)
            doc = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        raise InputError(f"{where}: malformed YAML: {' '.join(str(problem).split())}{at}"
                         ) from None
    except RecursionError:
        raise InputError(f"{where}: nested more than {MAX_DEPTH} levels deep") from None
    check_depth(doc, where)
    return doc


def read_yaml(path: Path, what: str = "file", where: str | None = None) -> Any:
    """`load_yaml(read_text(path))`, messages naming the file (or `where`)."""
    return load_yaml(read_text(path, what), where or shown_path(path))
