"""Test-wide settings: the YAML parse cache (vramcalc/yamlio.py) goes to a temporary
folder, so tests never read or write the user's ~/.cache."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_parse_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["VRAMCALC_CACHE_DIR"] = str(tmp_path_factory.mktemp("vramcalc-cache"))
