"""Term: logits — the output projection's logits and the cross-entropy buffers (last stage).

With N = b·s tokens on this rank, V' = V/tp (vocab-parallel head), c = compute dtype, and
the loss computed in fp32 (`F.cross_entropy(logits.float(), labels)`, as both profiles do):

- forward, at the end of the loss: the fp32 logits (the upcast; the c-typed logits are freed
  by the reference model as soon as they are upcast, while transformers keeps them in its
  output object until the forward returns) + fp32 log-probabilities (saved by log_softmax)
  + the loss and nll_loss's total weight (0-dim, one 512 B block each); transformers also
  pads and shifts the labels (int64);
- after forward: the fp32 log-probabilities, the two scalars and (hf) the shifted labels;
- start of backward (the loss is the root): saved log-probabilities + dL/dlogprobs (fp32,
  from nll_loss_backward) + dL/dlogits (fp32, from log_softmax_backward) + the loss, its
  scaled copy and their gradient (0-dim);
- then the c-typed gradient of the logits flows into the head.

Source: PyTorch's log_softmax/nll_loss autograd formulas (tools/autograd/derivatives.yaml:
log_softmax saves `result`, its backward returns a new tensor; nll_loss backward allocates
a zero grad of the input's shape); transformers loss/loss_utils.py ForCausalLMLoss. Checked
against the trace engine (tests/test_trace.py).
"""

from __future__ import annotations

from vramcalc.features import chunks_loss, finetunes
from vramcalc.rank import RankContext
from vramcalc.terms.lowmem import (
    chunked_backward_peak_bytes,
    chunked_forward_peak_bytes,
    chunked_saved_bytes,
    head_input_split,
)
from vramcalc.terms.saved import dims
from vramcalc.units import ALLOC_ROUND_BYTES, alloc


def _nv(ctx: RankContext) -> int:
    x = dims(ctx)
    return x.b * x.s * x.V


def _hf_labels_kept(ctx: RankContext) -> int:
    """transformers' shifted labels kept by nll_loss: labels[..., 1:].contiguous() of the
    (b, s + 1) padded labels — a view when b = 1, a copy otherwise."""
    x = dims(ctx)
    return alloc(x.b * (x.s + 1), "int64") if x.b == 1 else alloc(x.b * x.s, "int64")


def logits_saved_bytes(ctx: RankContext) -> int:
    """Held from the end of forward into backward, per micro-batch: fp32 log-probabilities,
    the loss and nll_loss's total weight (and the hf profile's shifted labels)."""
    if not ctx.is_last_stage:
        return 0
    if chunks_loss(ctx.training):  # vramcalc/terms/lowmem.py
        return chunked_saved_bytes(ctx)
    out = alloc(_nv(ctx), "fp32") + 2 * ALLOC_ROUND_BYTES
    if ctx.training.framework == "hf":
        out += _hf_labels_kept(ctx)
    return out


def logits_forward_peak_bytes(ctx: RankContext) -> int:
    """Peak of the loss computation in forward (includes what it keeps for backward)."""
    if not ctx.is_last_stage:
        return 0
    if chunks_loss(ctx.training):  # vramcalc/terms/lowmem.py
        return chunked_forward_peak_bytes(ctx)
    nv, c = _nv(ctx), ctx.training.compute_dtype
    out = 2 * alloc(nv, "fp32") + 2 * ALLOC_ROUND_BYTES  # fp32 logits + log-probs + scalars
    if ctx.training.framework == "hf":
        x = dims(ctx)
        if c != "fp32":  # the c-typed logits live on in the model output
            out += alloc(nv, c)
        out += alloc(x.b * (x.s + 1), "int64")  # padded labels
        if x.b > 1:
            out += alloc(x.b * x.s, "int64")  # their shifted copy
    return out


def logits_backward_peak_bytes(ctx: RankContext) -> int:
    """Peak of the loss backward: saved log-probs + two fp32 gradient buffers + 3 scalars."""
    if not ctx.is_last_stage:
        return 0
    if chunks_loss(ctx.training):  # vramcalc/terms/lowmem.py
        return chunked_backward_peak_bytes(ctx)
    return 3 * alloc(_nv(ctx), "fp32") + 3 * ALLOC_ROUND_BYTES


def head_forward_extra_bytes(ctx: RankContext) -> int:
    """Under autocast the final norm's fp32 output is not what lm_head saves (it saves a
    16-bit cast), yet the model keeps it in a local until the forward returns: T·h·4. A
    frozen lm_head (LoRA/QLoRA/DoRA) saves no input: the norm output, T·h·r, is then alive
    only through that local."""
    x = dims(ctx)
    if not ctx.is_last_stage:
        return 0
    if finetunes(ctx.training):  # a frozen lm_head saves no input at all
        return alloc(x.T * x.h, x.r)
    if chunks_loss(ctx.training):  # lm_head saves per-chunk copies, or views of the local
        return alloc(x.T * x.h, x.r) if head_input_split(ctx) else 0
    if x.r == x.c:
        return 0
    return alloc(x.T * x.h, x.r)


def loss_root_bytes(ctx: RankContext) -> int:
    """0-dim tensors alive through the whole backward: the loss, the loss scaled by
    1/grad_accum, and the root gradient (ones_like) that backward() seeds."""
    return 3 * ALLOC_ROUND_BYTES if ctx.is_last_stage else 0
