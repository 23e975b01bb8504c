"""torchtune's LinearCrossEntropyLoss: the loss of its main branch (`--torchtune-version
0.7`, the 0.7.0 nightlies; release 0.6.1 and earlier use CEWithChunkedOutputLoss,
vramcalc/terms/torchtune.py).

Source: pytorch/torchtune 9c06c8bd (#2531, April 2025, after v0.6.1; read at bd2a0fc7),
torchtune/modules/loss/cross_entropy_loss.py `LinearCrossEntropyLoss`. The model skips its
output projection (`set_model_output`: `skip_output_layer`) and returns the final norm's
output; the loss flattens it to (N, h), N = b·s, keeps the rows whose label is not
ignored (`mask_inputs`: `index_select`, a copy, and the int64 row indices its backward
keeps; every row in a batch without padding), splits rows and labels with
`tensor_split(n, dim=0)` (N mod n chunks of ⌈N/n⌉ rows, the rest ⌊N/n⌋) and per chunk runs
`compute_cross_entropy`: the output projection, `.float()`, `F.cross_entropy(...,
reduction="sum")`. Legend as in vramcalc/terms/saved.py; N_i the rows of chunk i.

| | eager | compiled (`compile: True`: `apply_compile_strategy` compiles `compute_cross_entropy`) |
|---|---|---|
| kept for backward | every chunk's fp32 log-probabilities (N_i·V·4) and nll_loss's total weight; the row indices and the labels copy (N int64 each); the loss | every chunk's c logits (the projection's output) and its row max and log-sum-exp, (N_i) fp32 each (inductor's min-cut partition); the indices, labels and loss |
| the projection's input | a trained head keeps the masked copy (the head side's lm_head.input, whose bytes it has); a frozen one keeps none (`mm` keeps its input only for the weight's gradient), so the copy lives through the loss's forward only | the same |
| forward peak | kept + the last chunk's c logits and fp32 upcast | kept |
| backward, last chunk first (its nodes are the newest) | kept + that chunk's dL/dlog-probs and dL/dlogits (2·N_i·V·4) | kept + that chunk's c gradient |
| backward, a trained head | when the second chunk's weight gradient is summed into the first: 3·V·h in the gradient dtype, beside the kept set less the two chunks done and their two dL/dx (N_i·h·c) | the same |

Unlike CEWithChunkedOutputLoss, no list of every chunk's logits exists, and each chunk's
projection backward runs right after its loss backward, so the chunks' gradients never
coexist. tests/test_linear_ce.py replays the eager loss under the trace engine's tracker and
the compiled function through torch's partitioner.
"""

from __future__ import annotations

from vramcalc.features import finetunes
from vramcalc.rank import RankContext
from vramcalc.stack_rules import TORCHTUNE_0_7, torchtune_before
from vramcalc.terms.gradients import grad_dtype
from vramcalc.terms.saved import dims
from vramcalc.training import TrainingConfig
from vramcalc.units import ALLOC_ROUND_BYTES, alloc


def applies(tr: TrainingConfig) -> bool:
    """torchtune's main-branch loss: --torchtune-version 0.7 or later with --chunked-ce."""
    return (tr.framework == "torchtune" and tr.chunked_ce > 1
            and tr.torchtune_version is not None and not torchtune_before(tr, TORCHTUNE_0_7))


def chunk_tokens(ctx: RankContext) -> list[int]:
    """Rows of each chunk: `tensor_split(n, dim=0)` of the N = b·s masked rows."""
    x = dims(ctx)
    rows = x.b * x.s
    n = min(ctx.training.chunked_ce, rows)
    q, r = divmod(rows, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def _per_chunk(ctx: RankContext, n: int) -> int:
    x = dims(ctx)
    if ctx.training.compile:
        return alloc(n * x.V, x.c) + 2 * alloc(n, "fp32")
    return alloc(n * x.V, "fp32") + ALLOC_ROUND_BYTES  # log-probs, nll's total weight


def saved_bytes(ctx: RankContext) -> int:
    """Kept from the end of forward into backward (module table), besides the trained
    head's masked input (the head side's)."""
    x = dims(ctx)
    rows = x.b * x.s
    return (ALLOC_ROUND_BYTES + 2 * alloc(rows, "int64")
            + sum(_per_chunk(ctx, n) for n in chunk_tokens(ctx)))


def _masked_copy(ctx: RankContext) -> int:
    """The masked rows while the loss's forward runs, for a frozen head (a trained head
    keeps them: the head side counts them)."""
    x = dims(ctx)
    return alloc(x.b * x.s * x.h, x.c) if finetunes(ctx.training) else 0


def forward_peak_bytes(ctx: RankContext) -> int:
    x = dims(ctx)
    out = saved_bytes(ctx) + _masked_copy(ctx)
    if ctx.training.compile:
        return out
    last = chunk_tokens(ctx)[-1]
    upcast = 0 if x.c == "fp32" else alloc(last * x.V, "fp32")
    return out + alloc(last * x.V, x.c) + upcast


def backward_peak_bytes(ctx: RankContext) -> int:
    x = dims(ctx)
    chunks = chunk_tokens(ctx)
    saved = saved_bytes(ctx)
    last = chunks[-1]
    work = (alloc(last * x.V, x.c) if ctx.training.compile
            else 2 * alloc(last * x.V, "fp32"))
    first = saved + work
    if finetunes(ctx.training) or len(chunks) < 2:
        return first
    done = sum(_per_chunk(ctx, n) for n in chunks[-2:])
    dx = sum(alloc(n * x.h, x.c) for n in chunks[-2:])
    return max(first, saved - done + dx + 3 * alloc(x.V * x.h, grad_dtype(ctx)))
