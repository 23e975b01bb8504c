"""FSDP2's own moments: the all-gather outputs alive at a block's copy-out in forward, and
the root's reduce-scatter that ends backward (torch/distributed/fsdp/_fully_shard,
docs/methodology.md section 6). Each is a number of bytes the analytic engine adds at a
moment of its own (vramcalc/analytic.py); 0 outside FSDP2."""

from __future__ import annotations

from vramcalc.features import finetunes
from vramcalc.rank import RankContext
from vramcalc.terms import fsdp1
from vramcalc.terms.comm import (
    ROOT_GROUPS,
    edge_units,
    fsdp_layer_bytes,
    fsdp_root_bytes,
    unsharded_bytes,
)
from vramcalc.terms.gradients import accumulates_unsharded, reduce_dtype
from vramcalc.units import alloc, ceil_div


def forward_start_outputs_bytes(ctx: RankContext) -> int:
    """FSDP2 all-gather outputs alive at the first block's copy-out in forward: the previous
    group's output is kept in `all_gather_state` until the next group's copy-out
    (`copy_in_stream_bytes`), so the root's (or, with edge units, the embedding unit's)
    output sits beside the first block's output and its unsharded copy. With a large
    vocabulary and short sequences this is the forward's peak. 0 outside FSDP2."""
    if ctx.engine != "fsdp2" or ctx.parallel.flat_fsdp(ctx.training.framework):
        return 0
    if ctx.parallel.shard_degree <= 1 or not ctx.num_layers:
        return 0
    outs = [fsdp_root_bytes(ctx)] + ([unsharded_bytes(ctx, ("embedding",))]
                                     if edge_units(ctx) else [])
    outs.append(fsdp_layer_bytes(ctx))
    return max(a + b for a, b in zip(outs, outs[1:], strict=False))


def forward_top_outputs_bytes(ctx: RankContext) -> int:
    """The same at the top block's copy-out, above every lower block's activations: the
    block below's all-gather output and the top block's. `wait_for_unshard` drops
    `all_gather_state` before the copy-out, but its local `prev_all_gather_state` holds the
    previous output until it returns. In backward each output is freed at its own copy-out.
    0 outside FSDP2 or with one block, which `forward_start_outputs_bytes` covers."""
    if ctx.num_layers < 2 or not forward_start_outputs_bytes(ctx):
        return 0
    return 2 * fsdp_layer_bytes(ctx)


def root_reduce_scatter_bytes(ctx: RankContext) -> int:
    """Beside every sharded gradient when FSDP2 reduce-scatters the root's (embedding, final
    norm, head) at the end of backward, the root's parameters resharded first
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_reduce`): the
    reduce-scatter input (the root unsharded, in the reduce dtype) and its output (a shard,
    in the reduce dtype) while `_to_dtype_if_needed` casts it to the sharded parameters'
    dtype (the gradients counted), and the unsharded gradient of the group's last parameter,
    the untied head's: for a world above 1 the loop that checks non-dim-0 shardings leaves it
    bound to `unsharded_grad` until the function returns (a real two-rank gloo run shows it
    alive at the cast, freed after). 0 outside full FSDP2 training with sync on, under edge
    units and HSDP."""
    if not _root_reduced_last(ctx):
        return 0
    par, tr = ctx.parallel, ctx.training
    n, rs_dt = ctx.shapes.numel(ROOT_GROUPS), reduce_dtype(tr)
    out = alloc(n, rs_dt)
    if rs_dt != tr.weight_dtype:  # else the output is the gradient itself
        out += alloc(ceil_div(n, par.shard_degree), rs_dt)
    if ctx.is_last_stage and not ctx.spec.tie_word_embeddings:
        out += alloc(ctx.shapes.numel(("head",)), tr.compute_dtype)
    return out


def root_gradients(ctx: RankContext, top: int, root: int) -> tuple[int, int]:
    """FSDP2 computes the root's gradients unsharded, in the all-gather (compute) dtype, and
    reduce-scatters them at the end of backward. Returns (what the sweep holds in place of
    `top`, the head's and final norm's shards: the head's gradient, a tied one's share
    waiting in autograd's buffer, and the norm's; what the embedding's backward adds to the
    gradients: an untied embedding's unsharded gradient beside those, in place of every
    root shard `root`, a tied one's is `gradients.embedding_backward_bytes`'). Outside
    (`top`, 0)."""
    if not _root_reduced_last(ctx) or not ctx.is_last_stage:
        return top, 0
    c = ctx.training.compute_dtype
    head = ctx.shapes.numel(("embedding" if ctx.spec.tie_word_embeddings else "head",))
    during = alloc(head, c) + alloc(ctx.shapes.numel(("final",)), c)
    if ctx.spec.tie_word_embeddings:
        return during, 0
    return during, during + alloc(ctx.shapes.numel(("embedding",)), c) - root


def _root_reduced_last(ctx: RankContext) -> bool:
    """Full FSDP2 training with sync on, one pipeline stage, no edge units or HSDP: the
    root (embedding, final norm, head) is reduce-scattered once, after the embedding."""
    par, tr = ctx.parallel, ctx.training
    return not (ctx.engine != "fsdp2" or fsdp1.flat(ctx) or finetunes(tr) or par.pp > 1
                or accumulates_unsharded(ctx) or edge_units(ctx) or par.fsdp == "hybrid")
