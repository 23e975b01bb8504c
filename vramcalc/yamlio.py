"""YAML reading: PyYAML's safe loader (libyaml's C loader when PyYAML has it)."""

from __future__ import annotations

from typing import Any

import yaml


class YAMLError(Exception):
    """A YAML syntax error (wraps PyYAML's, keeping its `problem` and `problem_mark`)."""

    def __init__(self, original: Exception) -> None:
        super().__init__(str(original))
        self.problem = getattr(original, "problem", None)
        self.problem_mark = getattr(original, "problem_mark", None)


def safe_load(text: str) -> Any:
    """yaml.safe_load, through the C loader when available (same safe constructors)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise YAMLError(err) from None
