"""DeepSpeed activation checkpointing (deepspeed.checkpointing, the `activation_checkpointing`
section of a DeepSpeed JSON): what a full-recompute layer keeps when its checkpoint goes
through `deepspeed.checkpointing.checkpoint` (Megatron-DeepSpeed and DeepSpeedExamples
models; Hugging Face models checkpoint with torch.utils.checkpoint instead).

Legend as in vramcalc/terms/saved.py; t = tp (DeepSpeed's mp_size, the tensor-parallel
group: checkpointing.py `configure` reads `get_tensor_model_parallel_world_size`), L_r the
layers on this rank, k the micro-batches in flight.

| setting | a checkpointed layer keeps on the device | host memory | source (DeepSpeed 0.16.5, 38327e07, deepspeed/runtime/activation_checkpointing/checkpointing.py) |
|---|---|---|---|
| neither | its input (b, s, h) | — | `save_args_for_backward(*args)` |
| partition_activations | ⌈T·h/t⌉ of it: a clone of this rank's slice | — | `partition_activations`: `item...narrow(0, start, size).clone()`; `get_partitioned_activations_for_backward` empties the input (`arg.data = torch.empty([])`) |
| cpu_checkpointing | nothing | L_r·k·(b, s, h) | `copy_to_device(args, device=cpu)` (without partitioning), `partition.cpu()` (with) |
| both | nothing | L_r·k·⌈T·h/t⌉ | same |
| contiguous_memory_optimization | as partition_activations: number_checkpoints slices preallocated one per layer | — | `contiguous_data_buffers`: `num_layers` tensors of the slice size |

In backward the layer's input is gathered (partitioned: `gather_partitioned_activations`
all-gathers it into a new full tensor) or moved back (cpu) before the layer is recomputed:
the recomputed layer then holds its full saved set, which starts from that input (the
phase model's backward moments, vramcalc.terms.moments). Not counted: the slice kept next
to the gathered input while that layer's backward runs (T·h/t), the device copy of the
input during each layer's forward (`inputs_cuda`), and unused contiguous buffers when
number_checkpoints exceeds the layers checkpointed.
"""

from __future__ import annotations

from vramcalc.rank import RankContext
from vramcalc.terms.saved import Modifier, Saved
from vramcalc.terms.saved_layers import checkpoint_saved
from vramcalc.units import ceil_div


def ds_checkpointing(ctx: RankContext) -> bool:
    """Whether deepspeed.checkpointing partitions or offloads this rank's checkpoints: a
    DeepSpeed config with partition_activations or cpu_checkpointing, full recompute, on
    the reference profile (the model that calls deepspeed.checkpointing.checkpoint)."""
    tr = ctx.training
    return (ctx.parallel.deepspeed.checkpoints_partitioned_or_offloaded
            and tr.recompute == "full" and tr.framework == "reference")


def partitioned(ctx: RankContext, saved: list[Saved]) -> list[Saved]:
    """The checkpoint's tensors as partition_activations keeps them: each rank's 1/t slice."""
    t = ctx.parallel.tp
    if not ctx.parallel.deepspeed.partition_activations or t == 1:
        return saved
    return [Saved(s.name, ceil_div(s.numel, t), s.dtype, s.shape + "/t",
                  s.why + ", partitioned over tp", s.count) for s in saved]


class DeepSpeedCheckpointing(Modifier):
    """partition_activations and cpu_checkpointing on top of full recompute (table above)."""

    name = "deepspeed_checkpointing"

    def applies(self, ctx: RankContext) -> bool:
        return ds_checkpointing(ctx)

    def checkpoint_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        if ctx.parallel.deepspeed.cpu_checkpointing:
            return []
        return partitioned(ctx, saved)

    def host_bytes(self, ctx: RankContext, saved: list[Saved], in_flight: float) -> int:
        if not ctx.parallel.deepspeed.cpu_checkpointing:
            return 0
        per_layer = sum(s.nbytes for s in partitioned(ctx, checkpoint_saved(ctx)))
        return int(ctx.num_layers * per_layer * in_flight)
