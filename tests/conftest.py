"""Test-wide settings.

- Hypothesis draws the same examples on every run (derandomize), so CI cannot fail on an
  example no earlier run saw; `HYPOTHESIS_PROFILE=explore python -m pytest` draws fresh
  random examples to look for new counterexamples.
- HF_HUB_OFFLINE=1: a Hugging Face Hub id is read from the local cache, never downloaded.
"""

from __future__ import annotations

import os

from hypothesis import settings

# Hugging Face Hub ids resolve from the local cache only: no test reaches the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

