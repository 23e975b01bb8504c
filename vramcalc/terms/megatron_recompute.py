"""Megatron-LM's recompute method: which layers of a pipeline rank are checkpointed, and what
each keeps for backward (megatron profile, `--recompute full` with `--recompute-method`).

Legend: L layers on this rank, v virtual chunks (interleaved schedule; 1 otherwise),
c = L / v layers per chunk, N = --recompute-num-layers, "input" = the checkpoint's input
(2·s·b·h bytes, ÷t under sequence parallelism: `megatron_layer_bytes` under full recompute),
"layer" = Korthikanti et al. 2022 Table 2's full set (`megatron_layer_bytes` without
recompute).

What Megatron-LM (NVIDIA/Megatron-LM d98e8a64) does, megatron/core/recompute.py
`checkpointed_forward` (called from megatron/core/transformer/transformer_block.py
`TransformerBlock.forward` when recompute_granularity == 'full'), over the block's layers,
`num_layers_per_pipeline_rank = len(self.layers)` (transformer_block.py `__init__`), which is
one virtual chunk's layers (`get_num_layers_to_build` divides a rank's layers by vp_size):

- uniform: `chunk_runner(layer_idx, min(layer_idx + N, c), True)` for layer_idx = 0, N,
  2N, ...: each group of N layers (the chunk's last one may be shorter) runs inside one
  `tensor_parallel.checkpoint`, which keeps the group's input and runs the layers without
  grad; in backward the whole group is run again with grad, so its N layers' saved sets
  exist at once while the group's backward sweeps down through them.
  Kept per chunk: ceil(c / N) inputs.
- block: `use_checkpoint = layer_idx < N` (plus an FP8/FP4 skip of layers whose input
  needs no grad, not modelled): the chunk's first N layers are checkpointed one layer each,
  the other c − N run plainly and keep the full set. Kept per chunk:
  min(N, c)·input + (c − min(N, c))·layer.

Validation (megatron/core/transformer/transformer_config.py `__post_init__`): full
granularity requires a method ('block' or 'uniform') and recompute_num_layers; selective
forbids recompute_num_layers (megatron/training/arguments.py: and a method). N larger than
a chunk is not refused there: block then checkpoints every layer, uniform makes one group.

The backward sweep: when the j-th layer from the bottom (0-based) runs its backward, the
layers below it in other checkpoint units hold what they kept, and the layers below it in
its own unit (re-run with grad) hold the full set: `below(j)`. Between unit boundaries
and changes of what a layer keeps, that is linear in j (as the gradients are), so the sweep
is extreme at the ends of those pieces: `sweep_points`.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramcalc.rank import RankContext
from vramcalc.sharding import pipeline_chunks


@dataclass(frozen=True)
class LayerPlan:
    """Bytes each layer of the rank keeps after its forward (bottom layer first), the first
    layer of the checkpoint unit each belongs to, and whether it ran without a checkpoint."""

    kept: tuple[int, ...]
    unit_start: tuple[int, ...]
    plain: tuple[bool, ...]
    layer_bytes: int  # Table 2: what a layer holds once it ran with grad

    def bottom(self, n: int) -> int:
        """Bytes the bottom n layers keep at the end of the forward."""
        return sum(self.kept[:n])

    def below(self, j: int) -> int:
        """Bytes held by the layers below layer j (0-based from the bottom) while j's
        backward runs: other units' kept bytes plus the full sets of j's own unit's lower
        layers (re-run with grad)."""
        start = self.unit_start[j]
        return sum(self.kept[:start]) + (j - start) * self.layer_bytes

    def casts_below(self, j: int) -> int:
        """Layers below layer j whose autocast casts exist while j's backward runs: the plain
        ones below its unit and its own unit's lower layers (re-run)."""
        start = self.unit_start[j]
        return sum(self.plain[:start]) + (j - start)

    @property
    def num_plain(self) -> int:
        return sum(self.plain)

    def sweep_points(self) -> tuple[int, ...]:
        """Layers (0-based from the top) at the ends of the sweep's linear pieces: the top,
        the bottom, and each layer where what the layers below hold stops growing by the
        same step."""
        n = len(self.kept)
        held = [(self.below(j), self.casts_below(j)) for j in range(n)]
        step = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(held, held[1:], strict=False)]
        out = {0, n - 1}
        out.update(j for j in range(1, n - 1) if step[j] != step[j - 1])
        return tuple(sorted(n - 1 - j for j in out))


def layer_plan(ctx: RankContext, input_bytes: int, layer_bytes: int) -> LayerPlan | None:
    """The rank's layers under Megatron-LM's --recompute-method (module docstring); None
    without one (every layer its own checkpoint, or no full recompute)."""
    tr = ctx.training
    method, n = tr.recompute_method, tr.recompute_num_layers
    if tr.recompute != "full" or method is None or n is None:
        return None
    kept: list[int] = []
    start: list[int] = []
    plain: list[bool] = []
    base = 0
    # the layers of each of the rank's virtual chunks, as Megatron builds them (even or
    # uneven splits: vramcalc.sharding.pipeline_chunks)
    for c in (row[ctx.stage] for row in pipeline_chunks(ctx.spec, ctx.parallel)):
        for i in range(c):
            if method == "block":
                ckpt = i < n
                kept.append(input_bytes if ckpt else layer_bytes)  # (b, s, h) input or Table 2
                start.append(base + i)
                plain.append(not ckpt)
            else:
                first = base + i - i % n
                kept.append(input_bytes if i % n == 0 else 0)  # the group's (b, s, h) input
                start.append(first)
                plain.append(False)
        base += c
    return LayerPlan(tuple(kept), tuple(start), tuple(plain), layer_bytes)
