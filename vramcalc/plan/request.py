"""What the planner is asked: the batch, how many plans, which settings it may change."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Global batch when none is given: the power of two nearest below 4M tokens per step
# (Llama 2 trained every size with a global batch of 4M tokens; Llama 2 MODEL_CARD.md).
DEFAULT_BATCH_TOKENS = 4 * 2**20
MAX_MICRO_BATCH = 64

ProgressFn = Callable[[str, int, int], None]  # (message, done, total)


@dataclass(frozen=True)
class PlanRequest:
    """What to search. Exactly one of the batch fields may be set (else the default)."""

    global_batch_size: int | None = None  # sequences per step
    global_batch_tokens: int | None = None
    top_n: int = 5
    allow: frozenset[str] = frozenset()
    pinned: Mapping[str, Any] = field(default_factory=dict)  # normalized option values
    efficiency: float | None = None  # --mfu override of the profile's mfu_fraction
    max_micro_batch: int = MAX_MICRO_BATCH

    def batch_for(self, seq_len: int) -> int:
        """Global batch in sequences for this sequence length."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        if self.global_batch_tokens is not None:
            return max(1, round(self.global_batch_tokens / seq_len))
        per = max(1, DEFAULT_BATCH_TOKENS // seq_len)
        return 1 << (per.bit_length() - 1)
