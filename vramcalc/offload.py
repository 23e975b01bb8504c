"""Offload: what moves off the device, the host RAM / NVMe it needs, and the traffic per step.

Per rank, by engine (Ψ_r = parameters this rank holds after TP/PP/EP, N = shard group,
m = micro-batches per step; all fp32 unless said):

| engine, offload | host RAM (pinned) | NVMe | PCIe per step | source |
|---|---|---|---|---|
| DeepSpeed ZeRO-1/2, optimizer→cpu | master 4 + states + fp32 grads 4, ÷N | – | D2H 16-bit grad partition (ZeRO-2 every micro-step, ZeRO-1 once); H2D fp32 partition 4Ψ_r/N | stage_1_and_2.py (`cpu_offload`: fp32 `.grad` pinned on the host; step copies `fp32_partition.to(device)`) |
| DeepSpeed ZeRO-3, optimizer→cpu | the same + the 16-bit grad partition buffer (2Ψ_r/N) | – | D2H 16-bit grads every micro-step; H2D 16-bit updated partition | stage3.py (`self.device = "cpu"` when offloading: `grad_partitions_flat_buffer` lives there) |
| DeepSpeed ZeRO-3, params→cpu | + 16-bit parameter partitions 2Ψ_r/N | – | H2D partitions for every forward and backward gather | stage3.py, partition_parameters.py |
| DeepSpeed, optimizer→nvme | swap buffers: buffer_count 4 × min(Ψ_r/N, sub_group 1e9) × 4 B | master + states + fp32 grads | NVMe read + write of master and states, write of grads | offload_config.py (buffer_count 4), swap_tensor/ |
| DeepSpeed, params→nvme | swap buffers: buffer_count 5 × buffer_size 1e8 × 2 B | 16-bit partitions | NVMe reads per gather | offload_config.py (buffer_count 5, buffer_size 1e8) |
| FSDP2 CPUOffloadPolicy | sharded params, grads, optimizer states (+ master) | – | H2D params every forward and backward gather; D2H reduce-scattered grads every micro-step | torch/distributed/fsdp/_fully_shard (offload_to_cpu) |
| Megatron-LM --optimizer-cpu-offload | master 4 + states + fp32 grads 4, ÷N | – | D2H fp32 main-grad shard; H2D updated shard (weight dtype) | megatron/core/optimizer/cpu_offloading |

Under LoRA/QLoRA/DoRA, Ψ_r counts the trained parameters for gradients and optimizer
states; offloaded parameters are the frozen base as stored (16-bit or NF4 data) and the
adapters, while bitsandbytes' NF4 constants (QuantState, not a parameter) stay on the device
(terms/weights.py `offloaded_weight_bytes`).

Host RAM per node = per rank × GPUs per node (the node's ranks, worst pipeline stage).
DeepSpeed's own estimators multiply by `additional_buffer_factor` 1.5 on top and, without
`zero_init`, count the whole fp32 model per process at load time; those formulas are in
tests/deepspeed_formulas.py for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramcalc.features import finetunes
from vramcalc.parallel import num_microbatches
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms.activations import activation_host_bytes
from vramcalc.terms.gradients import grad_dtype
from vramcalc.terms.optimizer_states import optimizer_state_split_on_device
from vramcalc.terms.weights import offloaded_weight_bytes
from vramcalc.units import DTYPE_BITS, alloc, ceil_div

DS_OPTIMIZER_SWAP_BUFFERS = 4  # offload_optimizer.buffer_count (DeepSpeed 0.16.5)
DS_PARAM_SWAP_BUFFERS = 5  # offload_param.buffer_count
DS_PARAM_SWAP_BUFFER_NUMEL = 100_000_000  # offload_param.buffer_size


@dataclass(frozen=True)
class OffloadFootprint:
    """One rank's offload: host RAM and NVMe held, and bytes moved per optimizer step."""

    host_bytes: int = 0
    nvme_bytes: int = 0
    pcie_h2d_bytes_per_step: int = 0
    pcie_d2h_bytes_per_step: int = 0
    nvme_read_bytes_per_step: int = 0
    nvme_write_bytes_per_step: int = 0


def _bytes(numel: int, dtype: str) -> int:
    return numel * DTYPE_BITS[dtype] // 8


def offload_footprint(ctx: RankContext) -> OffloadFootprint:
    """Host RAM, NVMe and PCIe/NVMe traffic per step of one rank (see the module table)."""
    par, tr = ctx.parallel, ctx.training
    off = set(par.offload)
    if not off:
        return OffloadFootprint()
    m = num_microbatches(tr, par)
    shard = ctx.parallel.shard_degree
    part = ceil_div(ctx.train_shapes.numel(), shard)  # this rank's trained partition
    w16 = tr.weight_dtype
    states = optimizer_state_split_on_device(ctx)
    opt_bytes = sum(states.values())
    if ctx.engine == "fsdp2":  # the parameters as stored, the trained ones' gradients
        w = offloaded_weight_bytes(ctx)
        g = ctx.train_shapes.nbytes(grad_dtype(ctx), shard, ctx.expert_shard(shard), "dim0")
        return OffloadFootprint(
            host_bytes=w + g + opt_bytes,
            pcie_h2d_bytes_per_step=2 * m * w,
            pcie_d2h_bytes_per_step=m * g,
        )
    if ctx.engine == "megatron":
        grads32 = alloc(part, "fp32")
        return OffloadFootprint(
            host_bytes=opt_bytes + grads32,
            pcie_h2d_bytes_per_step=_bytes(part, w16),
            pcie_d2h_bytes_per_step=_bytes(part, "fp32"),
        )
    # DeepSpeed
    host = nvme = h2d = d2h = nvme_r = nvme_w = 0
    if "optimizer" in off:
        grads32 = alloc(part, "fp32")
        state_total = opt_bytes + grads32
        if par.zero >= 3:
            state_total += alloc(part, grad_dtype(ctx))  # 16-bit grad partition buffer
        reduces = m if par.zero >= 2 else 1
        d2h += reduces * _bytes(part, grad_dtype(ctx))
        if "params" not in off:
            h2d += _bytes(part, "fp32" if par.zero < 3 else w16)
        if par.offload_device == "nvme":
            nvme += state_total
            sub_group = min(part, par.deepspeed.sub_group_size)
            host += DS_OPTIMIZER_SWAP_BUFFERS * alloc(sub_group, "fp32")
            nvme_r += opt_bytes + grads32
            nvme_w += opt_bytes + grads32
        else:
            host += state_total
    if "params" in off:
        p16 = offloaded_weight_bytes(ctx) if finetunes(tr) else alloc(part, w16)
        moved = p16 if finetunes(tr) else _bytes(part, w16)
        gathers = 2 * m * moved  # forward and backward gather every micro-step
        if par.offload_device == "nvme":
            nvme += p16
            host += DS_PARAM_SWAP_BUFFERS * alloc(DS_PARAM_SWAP_BUFFER_NUMEL, w16)
            nvme_r += gathers
            nvme_w += moved
        else:
            host += p16
        h2d += gathers
    return OffloadFootprint(host, nvme, h2d, d2h, nvme_r, nvme_w)


def host_bytes_per_node(ctx: RankContext, gpus_per_node: int, in_flight: float) -> int:
    """Host RAM one node needs for offloaded state: the rank's footprint (incl. DeepSpeed's
    pinned fp32 gradient and swap buffers) plus the pinned copies of `in_flight`
    micro-batches' saved activations under activation offload, x GPUs per node. Without
    offload 0."""
    act_host = activation_host_bytes(ctx, in_flight)
    if not ctx.parallel.offload:
        return act_host * gpus_per_node
    return (offload_footprint(ctx).host_bytes + act_host) * gpus_per_node


def nvme_bytes_per_node(ctx: RankContext, gpus_per_node: int) -> int:
    """NVMe space one node needs under DeepSpeed ZeRO-Infinity offload (0 otherwise)."""
    if not ctx.parallel.offload or ctx.parallel.offload_device != "nvme":
        return 0
    return offload_footprint(ctx).nvme_bytes * gpus_per_node


def offload_traffic(scn: Scenario) -> OffloadFootprint:
    """Per-rank offload footprint of a scenario's worst pipeline stage, for the speed model:
    PCIe bytes each way and NVMe bytes read/written per optimizer step (0 without offload)."""
    scn = scn.resolved()
    best = OffloadFootprint()
    par = scn.parallel
    uneven = par.uneven_split
    # an uneven split's middle ranks may hold more layers than either end
    for stage in range(par.pp) if uneven else sorted({0, par.pp - 1}):
        fp = offload_footprint(RankContext(scn.model, scn.training, scn.parallel, stage))
        if fp.host_bytes + fp.nvme_bytes > best.host_bytes + best.nvme_bytes:
            best = fp
    return best
