"""Test-wide settings.

- The YAML parse cache (vramcalc/yamlio.py) goes to a temporary folder, so tests never read
  or write the user's ~/.cache.
- Hypothesis draws the same examples on every run (derandomize), so CI cannot fail on an
  example no earlier run saw; `HYPOTHESIS_PROFILE=explore python -m pytest` draws fresh
  random examples to look for new counterexamples.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="session")
def _private_parse_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["VRAMCALC_CACHE_DIR"] = str(tmp_path_factory.mktemp("vramcalc-cache"))
