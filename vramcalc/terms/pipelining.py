"""torch.distributed.pipelining's own buffers, under the torchtitan profile's pipeline
(`--framework torchtitan --pp N`: torchtitan 9dec370 `parallelisms/pipeline_llama.py` builds
one `PipelineStage` per model chunk and steps torch's Schedule1F1B or
ScheduleInterleaved1F1B).

Sources: torch v2.6.0 (2236df1, the release line of torch 1963fc8, which torchtitan's
December 2024 benchmark ran) torch/distributed/pipelining/stage.py; pytorch/pytorch#144535
(January 2025, first released in 2.7) and #153383 (May 2025, first released in 2.8).

Per model chunk on this rank, with m micro-batches per step and U one micro-batch's stage
boundary (b · s/cp, over tp under sequence parallelism, · h in the residual dtype):

| buffer | held | releases |
|---|---|---|
| gradient receive buffers | every stage but the last: one per micro-batch, made when the stage first runs backward and kept (`_prepare_backward_infra` → `_create_grad_recv_info`): m·U | all |
| stage outputs | every stage but the last: each micro-batch's output appended to `output_chunks` by `forward_one_chunk`, cleared when the next step starts (`clear_runtime_states`): m·U | before 2.8 (#153383 keeps them on the last stage only) |
| the last FSDP group's reduce-scatter input | the stage's last backward calls each FSDP group's `post_backward` (`backward_maybe_with_nosync`, `run_post_backward`) but not FSDP's final callback, so the last group's reduce-scatter input, its unsharded gradient in the reduce dtype, stays in `reduce_scatter_state` until the next step's last backward: one layer's per chunk | before 2.7 (#144535 runs the final callback) |

A release is the one `--torch-version` names; without it, a current one (only the receive
buffers). Not counted: the activation receive buffers of micro-batches not in flight (the
in-flight ones are the first layer's checkpointed input, counted), the gradients those
buffers collect in backward (up to m·U by the last backward on every stage but the first),
and the last stage's logits kept in `output_chunks` for every micro-batch until the step
ends — what each holds at a stage's peak depends on where in the schedule the peak falls.
"""

from __future__ import annotations

from vramcalc.qlora import parse_version
from vramcalc.rank import RankContext
from vramcalc.terms.gradients import accumulates_unsharded, layer_gradient_bytes
from vramcalc.terms.saved import dims
from vramcalc.units import alloc

OUTPUTS_LAST_STAGE_ONLY = (2, 8)  # pytorch/pytorch#153383
FINAL_CALLBACK = (2, 7)  # pytorch/pytorch#144535


def _before(ctx: RankContext, release: tuple[int, int]) -> bool:
    version = ctx.training.torch_version
    return version is not None and parse_version(version) < release


def pipelining_held(ctx: RankContext, microbatches: int) -> dict[str, int]:
    """The held parts of pipeline rank `ctx.stage` (module docstring); {} outside the
    torchtitan profile's pipeline."""
    par = ctx.parallel
    if ctx.training.framework != "torchtitan" or par.pp == 1:
        return {}
    v = par.virtual_stages if par.pp_schedule == "interleaved" else 1
    last = par.pp * v - 1
    sending = sum(1 for j in range(v) if ctx.stage + j * par.pp != last)  # chunks not last
    x = dims(ctx)
    boundary = alloc(x.T * x.h, x.r)  # U
    parts = {"transients/pipeline_grad_recv": sending * microbatches * boundary}
    if _before(ctx, OUTPUTS_LAST_STAGE_ONLY):
        parts["activations/pipeline_outputs"] = sending * microbatches * boundary
    if _before(ctx, FINAL_CALLBACK) and accumulates_unsharded(ctx):
        parts["transients/pipeline_reduce_scatter"] = v * layer_gradient_bytes(ctx)
    return parts
