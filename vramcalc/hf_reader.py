"""Typed reads from a Hugging Face config.json dict, each bad value a one-line InputError,
and the model name a config's path gives (vramcalc/hf_config.py maps the values)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vramcalc.errors import InputError

_MISSING = object()


class Cfg:
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

    def rope_type(self) -> str | None:
        """The rotary scaling's kind: `rope_scaling` (its "rope_type", older files "type"), or
        transformers 5's `rope_parameters`; None without one (a malformed value names none)."""
        for key in ("rope_parameters", "rope_scaling"):
            value = self.cfg.get(key)
            if isinstance(value, dict):
                kind = value.get("rope_type", value.get("type"))
                if isinstance(kind, str) and kind != "default":
                    return kind
        return None

    def require(self, keys: tuple[str, ...], model_type: str) -> None:
        missing = [k for k in keys if self.cfg.get(k) is None]
        if missing:
            raise InputError(
                f"{self.source}: model_type '{model_type}' config lacks {', '.join(missing)}"
            )


def name_from_source(source: str) -> str:
    path = Path(source)
    if path.name == "config.json" and path.parent.name:
        return path.parent.name
    return path.stem or "custom"
