"""The model catalog: built-in presets, aliases, and Hugging Face `config.json` import.

Pure module: reads local files, and for a Hugging Face Hub id that names no preset its
config.json only (vramcalc.hub: local cache first; never `trust_remote_code`); imports
neither torch nor transformers.

- Presets live in `vramcalc/presets/<name>.yaml`, one per model, file stem == name. Each
  holds ModelSpec fields plus catalog metadata (`aliases`, `sources`, `hf_repo`,
  `num_params_published`); both parts are validated with extra="forbid".
- `resolve_model(text)` turns what a user typed into a ModelSpec: a local path
  (directory with config.json, a .json HF config, a .yaml/.yml ModelSpec), else a preset
  name or alias (see `resolve_model` for the matching rules).
- A `config.json` is read here and mapped by vramcalc.hf_config.
- A name is found through `presets/_index.yaml` (aliases, HF repo of each preset), so only
  the preset it names is read and validated.
"""

from __future__ import annotations

import difflib
import re
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

import vramcalc.safeio as safeio
from vramcalc.errors import InputError, shown, shown_path
from vramcalc.hf_config import from_hf_config
from vramcalc.hub import hub_config_path, looks_like_hub_id
from vramcalc.model import ModelSpec, spec_from_fields, validation_message

PRESETS_DIR = Path(__file__).parent / "presets"

# Catalog metadata keys allowed in a preset (or user) YAML next to the ModelSpec fields.
_META_KEYS = frozenset({"aliases", "sources", "hf_repo", "num_params_published"})
# Tried, in order, when a name does not match as typed: chat/instruct variants share the
# base model's shapes; "-hf" marks Meta's transformers-format repos.
_STRIP_SUFFIXES = ("-hf", "-instruct", "-chat", "-it", "-base")
_STRIP_PREFIXES = ("meta-",)


class PresetMeta(BaseModel):
    """Catalog metadata of one preset (not part of the spec)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    aliases: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    hf_repo: str | None = None  # e.g. "meta-llama/Meta-Llama-3-70B"
    num_params_published: int | None = Field(None, gt=0)


class Preset(BaseModel):
    """A built-in model: its spec and catalog metadata."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: ModelSpec
    meta: PresetMeta


# ---- small helpers ------------------------------------------------------------------
def _key(text: str) -> str:
    """Lookup key: lowercase, without `-`, `_`, `.` and spaces ("Llama_3.1-8B" -> "llama318b")."""
    return re.sub(r"[\s_.\-]+", "", text.lower())


def _split_yaml_mapping(data: Any, where: str) -> tuple[dict[str, Any], PresetMeta]:
    """Split a YAML mapping into ModelSpec fields and catalog metadata, both validated."""
    if not isinstance(data, dict):
        raise InputError(
            f"{where}: expected a mapping of ModelSpec fields, got {type(data).__name__}"
        )
    fields = {str(k): v for k, v in data.items() if k not in _META_KEYS}
    try:
        meta = PresetMeta(**{k: v for k, v in data.items() if k in _META_KEYS})
    except ValidationError as err:
        raise InputError(f"{where}: {validation_message(err, sorted(_META_KEYS))}") from None
    return fields, meta


def _load_yaml(path: Path) -> Any:
    """Parse a (user's) YAML file (vramcalc.safeio: bounded, strict)."""
    return safeio.read_yaml(path, "model file")


def _load_json(path: Path) -> Any:
    return safeio.read_json(path, "model config")


# ---- presets --------------------------------------------------------------------------
INDEX_FILE = "_index.yaml"  # the presets' names for lookup: {name: {aliases, hf_repo}}


@cache
def load_preset(name: str) -> Preset:
    """The preset in `presets/<name>.yaml`, validated (its `name` must equal the stem)."""
    path = PRESETS_DIR / f"{name}.yaml"
    where = f"preset {path.name}"
    fields, meta = _split_yaml_mapping(_load_yaml(path), where)
    if fields.get("name") != path.stem:
        raise InputError(f"{where}: name must equal the file stem '{path.stem}'")
    fields.setdefault("source", f"preset {path.stem}")
    return Preset(spec=spec_from_fields(fields, where), meta=meta)


@cache
def preset_index() -> dict[str, tuple[tuple[str, ...], str | None]]:
    """(aliases, HF repo) of each preset by name, from the catalog's index file: a name is
    found without reading every preset (a test checks the index against the presets)."""
    data = _load_yaml(PRESETS_DIR / INDEX_FILE)
    return {str(name): (tuple(str(a) for a in entry.get("aliases", ())), entry.get("hf_repo"))
            for name, entry in data.items()}


@cache
def _index() -> dict[str, str]:
    """Lookup key -> preset name, for canonical names, aliases and HF repo ids (org
    stripped)."""
    index: dict[str, str] = {}
    for name, (aliases, repo) in preset_index().items():
        for label in (name, *aliases, *([repo.rsplit("/", 1)[-1]] if repo else [])):
            k = _key(label)
            other = index.get(k)
            if other is not None and other != name:
                raise InputError(f"preset {name}: alias '{label}' also names {other}")
            index[k] = name
    return index


def list_preset_entries() -> list[Preset]:
    """Every built-in preset with its metadata (aliases, sources), in file-name order."""
    return [load_preset(name) for name in preset_index()]  # the index is in file order


def list_presets() -> list[ModelSpec]:
    """Every built-in model spec, in file-name order."""
    return [p.spec for p in list_preset_entries()]


def get_preset(name: str) -> Preset:
    """The preset with this canonical name or alias (exact key match, no path handling)."""
    found = _index().get(_key(name))
    if found is None:
        raise InputError(_unknown_message(name))
    return load_preset(found)


def _candidates(text: str) -> list[str]:
    """Spellings to try for `text`: as typed, without org, then without known prefixes/suffixes."""
    base = text.rsplit("/", 1)[-1] if "/" in text else text
    out = [text, base]
    cur = base.lower().replace("_", "-")
    changed = True
    while changed:
        changed = False
        for suffix in _STRIP_SUFFIXES:
            if cur.endswith(suffix) and len(cur) > len(suffix):
                cur = cur[: -len(suffix)]
                out.append(cur)
                changed = True
        for prefix in _STRIP_PREFIXES:
            if cur.startswith(prefix) and len(cur) > len(prefix):
                cur = cur[len(prefix) :]
                out.append(cur)
                changed = True
    return out


def _lookup(text: str) -> Preset | None:
    index = _index()
    for cand in _candidates(text):
        name = index.get(_key(cand))
        if name is not None:
            return load_preset(name)
    return None


def _suggestions(text: str, n: int = 3) -> list[str]:
    labels: dict[str, str] = {}
    for name, (aliases, _) in sorted(preset_index().items()):
        for label in (name, *aliases):
            labels.setdefault(label.lower(), name)
    query = text.rsplit("/", 1)[-1].lower()
    out: list[str] = []
    for label in difflib.get_close_matches(query, list(labels), n=10, cutoff=0.5):
        name = labels[label]
        if name not in out:
            out.append(name)
    return out[:n]


def _unknown_message(text: str) -> str:
    close = _suggestions(text)
    hint = (
        f"did you mean: {', '.join(close)}?"
        if close
        else f"built-in models: {', '.join(preset_index())}"
    )
    return f"unknown model {shown(text)}; {hint} (or pass a path to a Hugging Face config.json)"


# ---- files ----------------------------------------------------------------------------
def load_yaml_spec(path: Path) -> ModelSpec:
    """A ModelSpec from a YAML file of ModelSpec fields (preset metadata keys are allowed)."""
    fields, _ = _split_yaml_mapping(_load_yaml(path), str(path))
    fields.setdefault("name", path.stem)
    fields.setdefault("source", str(path))
    return spec_from_fields(fields, str(path))


def load_hf_config(path: Path) -> ModelSpec:
    """A ModelSpec from a local Hugging Face config.json (file or directory holding it)."""
    if safeio.path_kind(path) == "dir":
        path = path / "config.json"
    cfg = _load_json(path)
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return from_hf_config(cfg, str(path))


def load_hub_config(repo_id: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face Hub repository's config.json (vramcalc.hub: local
    cache first, never remote code), named by the repository id."""
    path = hub_config_path(repo_id)
    spec = load_hf_config(path)
    return spec.model_copy(update={"name": repo_id, "source": f"{repo_id} ({path})"})


def _looks_like_path(text: str) -> bool:
    lower = text.lower()
    return (
        lower.endswith((".json", ".yaml", ".yml"))
        or text.startswith(("/", "./", "../", "~", ".\\"))
        or "\\" in text
        or text.count("/") >= 2
    )


def resolve_model(text: str) -> tuple[ModelSpec, str | None]:
    """What the user typed -> (ModelSpec, note or None).

    Order:
    1. An existing path: a directory holding config.json, a `.json` file (Hugging Face
       config), a `.yaml`/`.yml` file (ModelSpec fields).
    2. A preset name or alias, case-insensitive, ignoring `-`, `_`, `.` and spaces. An HF
       repo id is matched by its name without the org (`meta-llama/Llama-2-7b-hf` ->
       `Llama-2-7b-hf`), then with `-hf`, `-instruct`, `-chat`, `-it`, `-base` suffixes and a
       `meta-` prefix removed: chat/instruct variants have their base model's shapes.
    3. A Hugging Face Hub id (`org/name`) that names no preset: its config.json, from the
       local HF cache first, else the Hub (vramcalc.hub; HF_HUB_OFFLINE, HF_TOKEN).
    4. Otherwise InputError: "no such file" when the text looks like a path (ends in
       .json/.yaml/.yml, starts with / . ~, or has two or more `/`), else "unknown model"
       with the closest names.

    The note says which preset an alias chose ("70b resolved to llama3-70b
    (Meta-Llama-3-70B)"); it is None when the text is the preset's own name or HF repo id.
    """
    text = text.strip()
    if not text:
        raise InputError("empty model name")
    if len(text) > safeio.MAX_PATH_CHARS:
        raise InputError(f"unknown model {shown(text)}: longer than any name or path")
    path = safeio.user_path(text, "model")
    dir_error: str | None = None
    kind = safeio.path_kind(path)
    if kind == "dir":
        if safeio.path_kind(path / "config.json") == "file":
            return load_hf_config(path), None
        dir_error = f"no config.json in directory {shown_path(text)}"
    elif kind == "other":
        raise InputError(f"model {shown_path(text)}: not a regular file")
    elif kind == "file":
        suffix = path.suffix.lower()
        if suffix == ".json":
            return load_hf_config(path), None
        if suffix in (".yaml", ".yml"):
            return load_yaml_spec(path), None
        raise InputError(f"{shown_path(text)}: unsupported file type (expected a .json or "
                         ".yaml/.yml file)")

    preset = _lookup(text)
    if preset is not None:
        spec, repo = preset.spec, preset.meta.hf_repo
        own = {_key(spec.name)} | ({_key(repo), _key(repo.rsplit("/", 1)[-1])} if repo else set())
        if _key(text) in own:
            return spec, None
        repo_name = repo.rsplit("/", 1)[-1] if repo else ""
        detail = f" ({repo_name})" if repo_name and repo_name.lower() != spec.name else ""
        return spec, f"{text} resolved to {spec.name}{detail}"
    if dir_error:
        raise InputError(dir_error)
    if looks_like_hub_id(text) and not _looks_like_path(text):
        try:
            return load_hub_config(text), f"{text}: shapes from its Hugging Face config.json"
        except InputError as err:  # neither a preset nor a readable Hub config
            raise InputError(f"{_unknown_message(text)}; as a Hugging Face Hub id: "
                             f"{str(err).removeprefix(text + ': ')}") from None
    if _looks_like_path(text):
        raise InputError(f"no such file: {shown_path(text)}")
    raise InputError(_unknown_message(text))
