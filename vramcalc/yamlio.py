"""YAML reading with libyaml's C loader when PyYAML has it (10x faster start-up)."""

from __future__ import annotations

from typing import Any

import yaml

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
YAMLError = yaml.YAMLError


def safe_load(text: str) -> Any:
    """yaml.safe_load, through the C loader when available (same safe constructors)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
