"""Term: overhead — device memory outside the allocator's tensors, counted for the fit check.

- CUDA context (and the vendor runtime's idle reservation): from the GPU profile
  (NVIDIA planning default ~500 MiB: 287 MB lazy-loading context measured in
  pytorch/pytorch#86509 plus kernels/libraries; Ascend ~3.3 GB idle, vllm-ascend#1903).
- NCCL communicator buffers when more than one rank talks: ~392 MB per GPU at 4-8 GPUs
  (aiconfigurator systems/h100_sxm.yaml misc.nccl_mem; ../shared/reference/hardware.yaml).
- The caching allocator's reserved-but-unallocated bytes at its high-water mark
  (`fragmentation` = peak reserved − peak allocated): the trace engine replays its
  allocations through vramcalc/allocator.py; the analytic engine estimates it with
  `vramcalc.terms.reserved`.
"""

from __future__ import annotations

NCCL_BYTES_MULTI_GPU = 392 * 10**6  # aiconfigurator misc.nccl_mem for 4-8 GPUs
NCCL_BYTES_TWO_GPU = 342 * 10**6  # aiconfigurator misc.nccl_mem for 2 GPUs


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
