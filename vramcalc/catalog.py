"""The model catalog: built-in presets, aliases, and Hugging Face `config.json` import.

Pure module: reads local files only (never the hub, never `trust_remote_code`), imports
neither torch nor transformers.

- Presets live in `vramcalc/presets/<name>.yaml`, one per model, file stem == name. Each
  holds ModelSpec fields plus catalog metadata (`aliases`, `sources`, `hf_repo`,
  `num_params_published`); both parts are validated with extra="forbid".
- `resolve_model(text)` turns what a user typed into a ModelSpec: a local path
  (directory with config.json, a .json HF config, a .yaml/.yml ModelSpec), else a preset
  name or alias (see `resolve_model` for the matching rules).
- `from_hf_config(cfg, source)` maps a `config.json` dict to a ModelSpec, with the
  defaults transformers (5.x `configuration_*.py`) uses for keys the file leaves out.
"""

from __future__ import annotations

import difflib
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vramcalc import yamlio
from vramcalc.errors import InputError
from vramcalc.model import ModelSpec

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
def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _key(text: str) -> str:
    """Lookup key: lowercase, without `-`, `_`, `.` and spaces ("Llama_3.1-8B" -> "llama318b")."""
    return re.sub(r"[\s_.\-]+", "", text.lower())


def _validation_message(err: Any, allowed: list[str]) -> str:
    """First pydantic error as one line: `field: message` (+ a suggestion for typos)."""
    # Unknown fields first: a missing field is often a typo of one.
    errors = sorted(err.errors(), key=lambda e: e.get("type") != "extra_forbidden")
    first = errors[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        close = difflib.get_close_matches(loc, allowed, n=1)
        msg = f"unknown field '{loc}'" + (f" (did you mean '{close[0]}'?)" if close else "")
    else:
        cause = (first.get("ctx") or {}).get("error")
        text = str(cause) if isinstance(cause, Exception) else first.get("msg", "invalid")
        msg = f"{loc}: {text}" if loc else text
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return _one_line(msg)


def _build_spec(fields: dict[str, Any], where: str) -> ModelSpec:
    """ModelSpec(**fields), with every validation failure turned into a one-line InputError."""
    try:
        return ModelSpec(**fields)
    except ValidationError as err:
        raise InputError(
            f"{where}: {_validation_message(err, list(ModelSpec.model_fields))}"
        ) from None


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
        raise InputError(f"{where}: {_validation_message(err, sorted(_META_KEYS))}") from None
    return fields, meta


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read: {_one_line(str(err))}") from None


def _yaml_error(path: Path, err: yamlio.YAMLError) -> InputError:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    at = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    return InputError(f"{path}: malformed YAML: {_one_line(problem)}{at}")


def _load_yaml(path: Path) -> Any:
    """Parse a (user's) YAML file."""
    try:
        return yamlio.safe_load(_read_text(path))
    except yamlio.YAMLError as err:
        raise _yaml_error(path, err) from None


def _load_json(path: Path) -> Any:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as err:
        raise InputError(
            f"{path}: malformed JSON: {err.msg} at line {err.lineno} column {err.colno}"
        ) from None


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
    return Preset(spec=_build_spec(fields, where), meta=meta)


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
    return f"unknown model '{text}'; {hint} (or pass a path to a Hugging Face config.json)"


# ---- files ----------------------------------------------------------------------------
def load_yaml_spec(path: Path) -> ModelSpec:
    """A ModelSpec from a YAML file of ModelSpec fields (preset metadata keys are allowed)."""
    fields, _ = _split_yaml_mapping(_load_yaml(path), str(path))
    fields.setdefault("name", path.stem)
    fields.setdefault("source", str(path))
    return _build_spec(fields, str(path))


def load_hf_config(path: Path) -> ModelSpec:
    """A ModelSpec from a local Hugging Face config.json (file or directory holding it)."""
    if path.is_dir():
        path = path / "config.json"
    cfg = _load_json(path)
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return from_hf_config(cfg, str(path))


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
    3. Otherwise InputError: "no such file" when the text looks like a path (ends in
       .json/.yaml/.yml, starts with / . ~, or has two or more `/`), else "unknown model"
       with the closest names.

    The note says which preset an alias chose ("70b resolved to llama3-70b
    (Meta-Llama-3-70B)"); it is None when the text is the preset's own name or HF repo id.
    """
    text = text.strip()
    if not text:
        raise InputError("empty model name")
    path = Path(text).expanduser()
    dir_error: str | None = None
    if path.is_dir():
        if (path / "config.json").is_file():
            return load_hf_config(path), None
        dir_error = f"no config.json in directory {text}"
    elif path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".json":
            return load_hf_config(path), None
        if suffix in (".yaml", ".yml"):
            return load_yaml_spec(path), None
        raise InputError(f"{text}: unsupported file type (expected a .json or .yaml/.yml file)")

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
    if _looks_like_path(text):
        raise InputError(f"no such file: {text}")
    raise InputError(_unknown_message(text))


# ---- Hugging Face config.json ---------------------------------------------------------
_MISSING = object()
_GENERIC_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)
_GPT2_KEYS = ("n_embd", "n_layer", "n_head", "vocab_size")

# Defaults transformers 5.x gives keys a config.json leaves out (configuration_<type>.py).
# kv: num_key_value_heads (None = as many as attention heads); head_dim None = h / a.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"kv": None, "head_dim": None, "tie": False, "act": "silu", "pos": 2048},
    "mistral": {"kv": 8, "head_dim": None, "tie": False, "act": "silu", "pos": 131072},
    "mixtral": {"kv": 8, "head_dim": None, "tie": False, "act": "silu", "pos": 131072},
    "qwen2": {"kv": 32, "head_dim": None, "tie": False, "act": "silu", "pos": 32768},
    "qwen2_moe": {"kv": 16, "head_dim": None, "tie": False, "act": "silu", "pos": 32768},
    "qwen3": {"kv": 32, "head_dim": 128, "tie": False, "act": "silu", "pos": 32768},
    "qwen3_moe": {"kv": 4, "head_dim": None, "tie": False, "act": "silu", "pos": 32768},
    "phi3": {"kv": None, "head_dim": None, "tie": False, "act": "silu", "pos": 4096},
    "gemma": {"kv": 16, "head_dim": 256, "tie": True, "act": "gelu_pytorch_tanh", "pos": 8192},
    "gemma2": {"kv": 4, "head_dim": 256, "tie": True, "act": "gelu_pytorch_tanh", "pos": 8192},
    "gemma3_text": {
        "kv": 4,
        "head_dim": 256,
        "tie": True,
        "act": "gelu_pytorch_tanh",
        "pos": 131072,
    },
    "gpt_neox": {"kv": None, "head_dim": None, "tie": False, "act": "gelu", "pos": 2048},
}
# Unknown model types: llama-like (gated MLP, RMSNorm, no biases unless the keys say so).
_GENERIC_DEFAULTS: dict[str, Any] = {
    "kv": None,
    "head_dim": None,
    "tie": False,
    "act": "silu",
    "pos": 4096,
}
SUPPORTED_MODEL_TYPES = ("gpt2", *_DEFAULTS)


class _Cfg:
    """Typed reads from a config dict; every bad value is a one-line InputError."""

    def __init__(self, cfg: dict[str, Any], source: str) -> None:
        self.cfg, self.source = cfg, source

    def _raw(self, key: str, default: Any) -> Any:
        value = self.cfg.get(key, _MISSING)
        return default if value is _MISSING or value is None else value

    def get_int(self, key: str, default: Any = None) -> Any:
        value = self._raw(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InputError(f"{self.source}: {key} must be an integer, got {value!r}")
        return value

    def get_bool(self, key: str, default: bool) -> bool:
        value = self._raw(key, default)
        if not isinstance(value, bool):
            raise InputError(f"{self.source}: {key} must be true or false, got {value!r}")
        return value

    def get_str(self, key: str, default: str) -> str:
        value = self._raw(key, default)
        if not isinstance(value, str):
            raise InputError(f"{self.source}: {key} must be a string, got {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self._raw(key, [])
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise InputError(f"{self.source}: {key} must be a list of integers, got {value!r}")
        return value

    def require(self, keys: tuple[str, ...], model_type: str) -> None:
        missing = [k for k in keys if self.cfg.get(k) is None]
        if missing:
            raise InputError(
                f"{self.source}: model_type '{model_type}' config lacks {', '.join(missing)}"
            )


def _name_from_source(source: str) -> str:
    path = Path(source)
    if path.name == "config.json" and path.parent.name:
        return path.parent.name
    return path.stem or "custom"


def _decoder_fields(c: _Cfg, model_type: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """Fields shared by the rotary decoders (llama family, gemma, phi3, qwen, gpt_neox)."""
    c.require(_GENERIC_KEYS, model_type)
    return {
        "hidden_size": c.get_int("hidden_size"),
        "num_hidden_layers": c.get_int("num_hidden_layers"),
        "num_attention_heads": c.get_int("num_attention_heads"),
        "num_key_value_heads": c.get_int("num_key_value_heads", defaults["kv"]),
        "head_dim": c.get_int("head_dim", defaults["head_dim"]),
        "intermediate_size": c.get_int("intermediate_size"),
        "vocab_size": c.get_int("vocab_size"),
        "max_position_embeddings": c.get_int("max_position_embeddings", defaults["pos"]),
        # Gemma configs carry both; transformers prefers hidden_activation.
        "hidden_act": c.get_str("hidden_activation", c.get_str("hidden_act", defaults["act"])),
        "tie_word_embeddings": c.get_bool("tie_word_embeddings", defaults["tie"]),
        "mlp_kind": "gated",
        "norm_kind": "rmsnorm",
        "position_embedding": "rope",
    }


def _gpt2_fields(c: _Cfg) -> dict[str, Any]:
    """GPT-2: Conv1D projections with biases, LayerNorm with bias, learned positions, tied."""
    c.require(_GPT2_KEYS, "gpt2")
    h = c.get_int("n_embd")
    return {
        "hidden_size": h,
        "num_hidden_layers": c.get_int("n_layer"),
        "num_attention_heads": c.get_int("n_head"),
        "intermediate_size": c.get_int("n_inner", 4 * h),
        "vocab_size": c.get_int("vocab_size"),
        "max_position_embeddings": c.get_int("n_positions", 1024),
        "hidden_act": c.get_str("activation_function", "gelu_new"),
        "tie_word_embeddings": c.get_bool("tie_word_embeddings", True),
        "mlp_kind": "standard",
        "norm_kind": "layernorm",
        "norm_bias": True,
        "attention_bias": True,
        "attention_out_bias": True,
        "mlp_bias": True,
        "position_embedding": "learned",
    }


def _qwen_moe_fields(c: _Cfg, model_type: str, num_layers: int, shared: bool) -> dict[str, Any]:
    """Qwen2-MoE / Qwen3-MoE experts. Layer i is sparse when i is not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0 (transformers modeling_qwen2_moe.py); only "all
    sparse" or "the first k dense" can be represented."""
    d = {"qwen2_moe": (60, 4, 1408), "qwen3_moe": (128, 8, 768)}[model_type]
    num_experts = c.get_int("num_experts", d[0])
    if num_experts == 0:
        return {}
    step = c.get_int("decoder_sparse_step", 1)
    if step < 1:
        raise InputError(f"{c.source}: decoder_sparse_step must be >= 1, got {step}")
    dense_only = set(c.int_list("mlp_only_layers"))
    sparse = [i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0]
    first_k = num_layers - len(sparse)
    if sparse != list(range(first_k, num_layers)):
        raise InputError(
            f"{c.source}: only MoE configs whose dense layers come first are supported "
            f"(decoder_sparse_step={step}, mlp_only_layers={sorted(dense_only)})"
        )
    fields: dict[str, Any] = {
        "num_local_experts": num_experts,
        "num_experts_per_tok": c.get_int("num_experts_per_tok", d[1]),
        "moe_intermediate_size": c.get_int("moe_intermediate_size", d[2]),
        "first_k_dense_replace": first_k,
    }
    if shared:
        # Qwen2-MoE: one always-on shared expert plus a h->1 sigmoid gate on it.
        shared_ffn = c.get_int("shared_expert_intermediate_size", 5632)
        if shared_ffn:
            fields.update(
                num_shared_experts=1,
                shared_expert_intermediate_size=shared_ffn,
                shared_expert_gate=True,
            )
    return fields


def _four_norms(c: _Cfg, model_type: str) -> dict[str, Any]:
    """Gemma 2/3 have pre- and post-norms around attention and the MLP: 4 norms per layer."""
    if "num_layer_norms" not in ModelSpec.model_fields:
        raise InputError(
            f"{c.source}: model_type '{model_type}' has 4 norms per layer, which vramcalc "
            "cannot count exactly yet"
        )
    return {"num_layer_norms": 4}


def from_hf_config(cfg: dict[str, Any], source: str) -> ModelSpec:
    """Map a Hugging Face `config.json` dict to a ModelSpec.

    Supported model_type: gpt2, gpt_neox, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3,
    qwen3_moe, phi3, gemma (gemma2 / gemma3_text need 4 norms per layer, see `_four_norms`);
    any other model_type is read as a llama-like decoder from the generic keys
    (hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size),
    honouring attention_bias / mlp_bias / tie_word_embeddings when present. Keys a file
    leaves out take transformers' defaults for that type. `auto_map` (remote code),
    rope_scaling, dropout and dtype keys are ignored. Bad input raises InputError.
    """
    if not isinstance(cfg, dict):
        raise InputError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    c = _Cfg(cfg, source)
    model_type = c.get_str("model_type", "")
    name = _name_from_source(source)

    fields: dict[str, Any]
    if model_type == "gpt2":
        fields = _gpt2_fields(c)
    else:
        defaults = _DEFAULTS.get(model_type, _GENERIC_DEFAULTS)
        fields = _decoder_fields(c, model_type or "(none)", defaults)
        if model_type in ("llama", "gemma", "qwen3", "qwen3_moe", "gemma2", "gemma3_text"):
            # q, k, v and o all take `bias=config.attention_bias`
            bias = c.get_bool("attention_bias", False)
            fields.update(attention_bias=bias, attention_out_bias=bias)
        if model_type == "llama":
            fields["mlp_bias"] = c.get_bool("mlp_bias", False)
        elif model_type == "qwen2":
            fields["attention_bias"] = True  # q, k, v biases, none on o (modeling_qwen2.py)
        elif model_type == "qwen2_moe":
            fields["attention_bias"] = c.get_bool("qkv_bias", True)
            fields.update(_qwen_moe_fields(c, model_type, fields["num_hidden_layers"], True))
        elif model_type == "qwen3":
            fields["qk_norm"] = True
        elif model_type == "qwen3_moe":
            fields["qk_norm"] = True
            fields.update(_qwen_moe_fields(c, model_type, fields["num_hidden_layers"], False))
        elif model_type == "mixtral":
            fields.update(
                num_local_experts=c.get_int("num_local_experts", 8),
                num_experts_per_tok=c.get_int("num_experts_per_tok", 2),
            )
        elif model_type == "gpt_neox":
            bias = c.get_bool("attention_bias", True)  # query_key_value and dense
            fields.update(
                mlp_kind="standard",
                mlp_bias=True,
                norm_kind="layernorm",
                norm_bias=True,
                attention_bias=bias,
                attention_out_bias=bias,
            )
        elif model_type == "gemma" and fields["hidden_act"] == "gelu":
            # configuration_gemma.py: legacy "gelu" means the tanh approximation
            fields["hidden_act"] = "gelu_pytorch_tanh"
        elif model_type in ("gemma2", "gemma3_text"):
            fields.update(_four_norms(c, model_type))
            if model_type == "gemma3_text":
                fields["qk_norm"] = True
        elif model_type not in _DEFAULTS:
            experts = [
                k
                for k in ("num_local_experts", "num_experts", "n_routed_experts")
                if c.get_int(k, 0)
            ]
            if experts:
                raise InputError(
                    f"{source}: mixture-of-experts config of unsupported model_type "
                    f"'{model_type}' (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
                )
            bias = c.get_bool("attention_bias", False)
            fields.update(
                attention_bias=bias,
                attention_out_bias=bias,
                mlp_bias=c.get_bool("mlp_bias", False),
            )
    fields.update(name=name, model_type=model_type or "unknown", source=source)
    return _build_spec(fields, source)
