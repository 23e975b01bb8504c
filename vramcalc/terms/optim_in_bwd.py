"""The optimizer step inside backward (`--optimizer-in-backward`, torchtune's optimizer_in_bwd).

Written from pytorch/torchtune bd2a0fc: `torchtune/modules/optim.py` `OptimizerInBackward`
(lines 44-60: one `optimizer_cls([p], ...)` per trained parameter and a
`p.register_post_accumulate_grad_hook` that runs `_step_and_clear`: that optimizer's
`step()` then `zero_grad()`, set_to_none by default), `torchtune/training/memory.py`
`register_optim_in_bwd_hooks` (lines 222-245, the same hooks), and
`recipes/full_finetune_single_device.py` (lines 157-160: gradient accumulation refused;
lines 621-635: no scaling or clipping of gradients, `optimizer.step()` a no-op).

Autograd runs a parameter's AccumulateGrad node right after the node that produced its
gradient (the saved tensors of that node are already released), and the hook frees the
gradient once its step is done. So at any instant of backward at most one parameter's
gradient exists, next to the step temporaries of that one parameter's optimizer (a foreach
or fused kernel over a single tensor); no gradients survive backward and the optimizer
phase holds weights and states only. The bytes at a hook, with g(p) = round512(n_p · grad
dtype) and t(p) the one-tensor step temporaries (`param_step_temp_bytes`):

- lm_head (untied, last stage): inside its node, k·A_mb + d logits (T·V in c) + dX (T·h
  in c) + its weight gradient in c; under autocast the cast's backward then holds that and
  g at once (the node's saved input and weight cast released); at its hook, k·A_mb − the
  head's saved input + dX + g + t (under chunked cross entropy no node instant: the head
  runs per chunk);
- the top and bottom layers' MLP output matrix (down_proj / c_proj: the first parameter a
  layer's backward finishes, while everything the layer saved is still held — its saved
  input is freed and dX of the same size takes its place): the layer's MLP instant with
  only g_res + dX (T·h in r + T·f in c) as work + g + t; and, just before, inside that
  matrix's own backward node, the same with its saved input still held and its weight
  gradient in c (the larger one when t is small: fused Adam, SGD, bitsandbytes), and under
  autocast the cast of that gradient to fp32 (both alive);
- the token embedding (first stage, the last hook): its gradient, which with tied
  embeddings is the sum of the head's share (waiting in autograd's input buffer through the
  whole sweep) and the embedding's, + t.

First step: each optimizer creates its states at its first step, inside backward, so the
states alive at an instant are those of the parameters already hooked (in the order the
gradients appear: head, layers top-down, embedding), counted like the gradients of the
ordinary sweep.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramcalc.features import chunks_loss
from vramcalc.rank import RankContext
from vramcalc.sharding import RankTensor
from vramcalc.terms.activations import head_saved
from vramcalc.terms.gradients import grad_dtype, tied_sum_in_place
from vramcalc.terms.optimizer_states import state_bytes_for_tensor
from vramcalc.terms.saved import bsh, dims
from vramcalc.units import ALLOC_ROUND_BYTES, alloc, ceil_div

# the MLP output matrix of each profile's layer (vramcalc/model.py tensor names)
_MLP_OUT = ("mlp.down_proj.weight", "mlp.proj.weight")


def param_step_temp_bytes(ctx: RankContext, t: RankTensor) -> int:
    """Temporaries of one parameter's own optimizer step (bytes), torch/optim as
    `_optimizer_step_temp_bytes` (vramcalc/terms/transients.py) for a list of one tensor:
    Adam/AdamW foreach `_foreach_sqrt(exp_avg_sq)` (n), fused none, the loop
    `exp_avg_sq.sqrt()` and the quotient (2n: no previous parameter's `denom`, each step
    returns first); Lion's update (n); Adafactor's `row_var @ col_var` (n, + a 512 B row
    mean for a matrix); SGD and bitsandbytes' kernels update in place."""
    tr = ctx.training
    sd, n = tr.state_dtype, t.numel
    if tr.optimizer in ("adam", "adamw"):
        return {"foreach": alloc(n, sd), "fused": 0, "loop": 2 * alloc(n, sd),
                "hf-loop": alloc(n, sd)}[tr.step_impl]
    if tr.optimizer == "lion":
        return alloc(n, sd)
    if tr.optimizer == "adafactor":
        return alloc(n, sd) + (ALLOC_ROUND_BYTES if t.rows else 0)
    return 0


@dataclass(frozen=True)
class InBackward:
    """The rank's hook instants (module docstring), bytes: (gradient, step temporaries) of
    the hooked parameter, and what else the instant holds."""

    head: tuple[int, int]  # untied lm_head; (0, 0) when tied, frozen or not on this rank
    head_freed: int  # the head's saved input (released before its hook)
    head_dx: int  # d(head input), T·h in c
    head_dlogits: int  # d logits (T·V in c), the head node's incoming gradient
    head_dw: int  # the head node's weight gradient (in c: under autocast cast to fp32 next)
    layer: tuple[int, int]  # the MLP output matrix; (0, 0) when not trained (adapters)
    layer_work: int  # g_res + its dX
    layer_in: int  # its saved input, held until its node returns
    layer_dw: int  # its node's weight gradient, in c
    cast: bool  # autocast: a node's c weight gradient is cast to the fp32 parameter's dtype
    embed: tuple[int, int]  # the token embedding (first stage)
    waiting: int  # the tied head's gradient share held by autograd through the sweep
    summing: int  # beside the tied gradient when the embedding's share is added to it
    states_head: int  # states of the embedding, final norm and head (first step)
    states_late: int  # states of the embeddings: created at the very end
    states_layer: int  # states of one layer


def _one(ctx: RankContext, t: RankTensor | None) -> tuple[int, int]:
    if t is None:
        return 0, 0
    return alloc(t.numel, grad_dtype(ctx)), param_step_temp_bytes(ctx, t)


def in_backward(ctx: RankContext) -> InBackward:
    """The hook instants of this rank (single GPU: no sharding; see the module doc)."""
    tr = ctx.training
    by_name = {t.name: t for t in ctx.train_tensors}
    tied = ctx.spec.tie_word_embeddings
    x = dims(ctx)
    f = ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp)
    mlp_out = next((by_name[n] for n in _MLP_OUT if n in by_name), None)
    emb = by_name.get("embed_tokens")
    head = None if tied else by_name.get("lm_head.weight")
    states = [(t, state_bytes_for_tensor(t, tr.optimizer, tr.state_dtype, 1) * t.count)
              for t in ctx.train_tensors]
    layer_states = sum(s for t, s in states if t.group in ("layer", "expert"))
    # the embeddings are hooked last, tied or not (a tied one's AccumulateGrad waits for
    # the embedding's share)
    late = sum(s for t, s in states if t.name in ("embed_tokens", "embed_positions"))
    waiting = alloc(emb.numel, grad_dtype(ctx)) if tied and emb and ctx.is_last_stage else 0
    nL = max(ctx.num_layers, 1)
    return InBackward(
        head=_one(ctx, head) if ctx.is_last_stage else (0, 0),
        head_freed=sum(s.nbytes for s in head_saved(ctx) if s.name.startswith("lm_head.")),
        head_dx=alloc(bsh(x), x.c),
        head_dlogits=0 if chunks_loss(tr) else alloc(x.N * x.V, x.c),
        head_dw=alloc(head.numel, x.c) if head else 0,
        layer=_one(ctx, mlp_out) if ctx.num_layers and not ctx.spec.is_moe else (0, 0),
        layer_work=alloc(bsh(x), x.r) + alloc(x.N * f, x.c),
        layer_in=alloc(x.N * f, x.c),
        layer_dw=alloc(mlp_out.numel, x.c) if mlp_out else 0,
        cast=tr.is_autocast,
        embed=_one(ctx, emb) if ctx.is_first_stage else (0, 0),
        waiting=waiting,
        summing=(1 if tied_sum_in_place(ctx) else 2) * waiting,  # the share (and the sum)
        states_head=sum(s for _, s in states) - layer_states,
        states_late=late,
        states_layer=layer_states // nL,
    )


def states_made(ib: InBackward, layers_done: float) -> int:
    """First step: optimizer-state bytes created once the gradients of the head side and
    `layers_done` layers (from the top) have been hooked."""
    return ib.states_head - ib.states_late + int(layers_done * ib.states_layer)
