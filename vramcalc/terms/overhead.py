"""Term: overhead — device memory outside the allocator's tensors, counted for the fit check.

- CUDA context (and the vendor runtime's idle reservation): from the GPU profile
  (NVIDIA planning default ~500 MiB: 287 MB lazy-loading context measured in
  pytorch/pytorch#86509 plus kernels/libraries; Ascend ~3.3 GB idle, vllm-ascend#1903).
  With a torch before 1.13 (`--torch-version`) every kernel image is loaded when the context
  is created: the profile's `context_eager_bytes` (1 GB on the CUDA GPUs such a torch ran
  on: "Before CUDA 11.7, *all* kernels were loaded into the context once the library was
  loaded, which took >1000MB", ptrblck in pytorch/pytorch#107667; ~1 GB for PyTorch's own
  kernels, pytorch/pytorch#12873; 666,632,192 B eager vs 287,047,680 B lazy on torch 1.13
  with CUDA 11.7, pytorch/pytorch#86509).
- NCCL communicator buffers when more than one rank talks: ~392 MB per GPU at 4-8 GPUs
  (aiconfigurator systems/h100_sxm.yaml misc.nccl_mem; ../shared/reference/hardware.yaml).
- The caching allocator's reserved-but-unallocated bytes at its high-water mark
  (`fragmentation` = peak reserved − peak allocated): the trace engine replays its
  allocations through vramcalc/allocator.py; the analytic engine estimates it with
  `vramcalc.terms.reserved`.
"""

from __future__ import annotations

from vramcalc.errors import InputError
from vramcalc.hardware import GPUProfile
from vramcalc.training import TrainingConfig

NCCL_BYTES_MULTI_GPU = 392 * 10**6  # aiconfigurator misc.nccl_mem for 4-8 GPUs
NCCL_BYTES_TWO_GPU = 342 * 10**6  # aiconfigurator misc.nccl_mem for 2 GPUs


def context_bytes(gpu: GPUProfile | None, training: TrainingConfig) -> int:
    """The CUDA context of one process: the profile's `context_overhead_bytes` (lazy module
    loading, torch >= 1.13), or its `context_eager_bytes` when the run's torch loads every
    kernel at start (`TrainingConfig.eager_module_loading`); 0 without a GPU."""
    if gpu is None:
        return 0
    if not training.eager_module_loading:
        return gpu.context_overhead_bytes
    if gpu.context_eager_bytes is None:
        raise InputError(f"--torch-version {training.torch_version}: the GPU profile "
                         f"'{gpu.id}' gives no CUDA context for torch before 1.13 (eager "
                         "module loading; context_eager_bytes): no torch of that era is "
                         "recorded on it")
    return gpu.context_eager_bytes


def nccl_bytes(world_size: int) -> int:
    if world_size <= 1:
        return 0
    return NCCL_BYTES_TWO_GPU if world_size == 2 else NCCL_BYTES_MULTI_GPU


def overhead_split(context_bytes: int, world_size: int, fragmentation_bytes: int
                   ) -> dict[str, int]:
    """Overhead parts: {'context', 'nccl', 'fragmentation'} in bytes; the last is the peak
    reserved minus the peak allocated, so device total = reserved + context + NCCL."""
    return {
        "context": context_bytes,
        "nccl": nccl_bytes(world_size),
        "fragmentation": fragmentation_bytes,
    }
