"""Sample lengths for a trace over batches padded to their longest sample (`trace --lengths`).

A collator that pads each batch to its longest sample (Hugging Face's
DataCollatorWithPadding, torchtune's padded_collate_sft) gives every step another shape.
PyTorch's caching allocator keeps the segments each shape made and splits them for the next
ones, so `max_memory_reserved` (and nvidia-smi) creeps above what one step at the longest
length reserves, while memory is ample: before it reports an out-of-memory error the
allocator frees its cached whole segments and retries, so the fit check (the device total)
does not count those (docs/trace.md, "The fit"). The analytic engine counts one step at --seq-len; `trace --lengths
FILE` replays many steps whose lengths are drawn from the user's own dataset through the
allocator model (vramcalc/allocator.py), for the reserved reading such a run reports.

The file holds one token count per training sample (whitespace-separated integers, as
`len(tokenizer(text).input_ids)` gives them). Each micro-batch is padded to the longest of
`micro_batch_size` samples drawn with a fixed seed, cut at --seq-len (the truncation);
the last micro-batch is at --seq-len, so the replay also holds the longest step's peak.
"""

from __future__ import annotations

import random
from pathlib import Path

from vramcalc.errors import InputError, shown, shown_path
from vramcalc.safeio import read_text

MAX_STEPS = 10_000  # a replay costs about a forward and backward per micro-batch on the CPU


def read_lengths(path: Path) -> tuple[int, ...]:
    """The token counts in `path` (whitespace-separated positive integers)."""
    words = read_text(path).split()
    if not words:
        raise InputError(f"--lengths {shown_path(path)}: no lengths in the file (one token "
                         "count per sample, separated by spaces or newlines)")
    out = []
    for word in words:
        if not word.isdigit() or len(word) > 9 or int(word) == 0:
            raise InputError(f"--lengths {shown_path(path)}: {shown(word)} is not a token "
                             "count (a whole number from 1 to 999,999,999)")
        out.append(int(word))
    return tuple(out)


def padded_batches(lengths: tuple[int, ...], micro_batch_size: int, seq_len: int,
                   steps: int, seed: int = 0) -> tuple[int, ...]:
    """`steps` micro-batch lengths: each the longest of `micro_batch_size` samples drawn
    from `lengths` (seeded), cut at `seq_len`; the last one is `seq_len`."""
    if not 1 <= steps <= MAX_STEPS:
        raise InputError(f"--steps must be between 1 and {MAX_STEPS:,}, got {steps}")
    rng = random.Random(seed)
    drawn = [min(seq_len, max(rng.choice(lengths) for _ in range(micro_batch_size)))
             for _ in range(steps - 1)]
    return (*drawn, seq_len)
