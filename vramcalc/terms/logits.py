"""Term: logits — the output projection's logits and the cross-entropy buffers (last stage).

With N = b·s tokens on this rank and V' = V/tp (vocab-parallel head), c = compute dtype:

- forward, while log_softmax runs: logits (N·V' in c) + fp32 upcast (N·V'·4, skipped when
  c is fp32) + log-probabilities (N·V'·4, saved for backward);
- after forward: the fp32 log-probabilities stay (saved by log_softmax);
- start of backward: saved log-probabilities + dL/dlogprobs (fp32) + dL/dlogits (fp32),
  then the c-typed gradient of the logits flows into the head.

Source: PyTorch's log_softmax/nll_loss autograd formulas (tools/autograd/derivatives.yaml:
log_softmax saves `result`, its backward returns a new tensor; nll_loss backward allocates
a zero grad of the input's shape).
"""

from __future__ import annotations

from vramcalc.terms.activations import dims
from vramcalc.terms.context import RankContext
from vramcalc.units import alloc


def _nv(ctx: RankContext) -> int:
    x = dims(ctx)
    return x.b * x.s * x.V


def logits_saved_bytes(ctx: RankContext) -> int:
    """Held from the end of forward into backward (fp32 log-probabilities), per micro-batch."""
    if not ctx.is_last_stage:
        return 0
    return alloc(_nv(ctx), "fp32")


def logits_forward_peak_bytes(ctx: RankContext) -> int:
    """Peak of the loss computation in forward (includes the saved log-probabilities)."""
    if not ctx.is_last_stage:
        return 0
    nv, c = _nv(ctx), ctx.training.compute_dtype
    upcast = 0 if c == "fp32" else alloc(nv, "fp32")
    return alloc(nv, c) + upcast + alloc(nv, "fp32")


def logits_backward_peak_bytes(ctx: RankContext) -> int:
    """Peak of the loss backward (saved log-probs + two fp32 gradient buffers)."""
    if not ctx.is_last_stage:
        return 0
    nv, c = _nv(ctx), ctx.training.compute_dtype
    fp32_chain = 3 * alloc(nv, "fp32")
    to_compute = alloc(nv, "fp32") + (0 if c == "fp32" else alloc(nv, c))
    return max(fp32_chain, to_compute)
