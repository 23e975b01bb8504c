"""Term: overhead — device memory outside the allocator's tensors, counted for the fit check.

- CUDA context (and the vendor runtime's idle reservation): from the GPU profile
  (NVIDIA planning default ~500 MiB: 287 MB lazy-loading context measured in
  pytorch/pytorch#86509 plus kernels/libraries; Ascend ~3.3 GB idle, vllm-ascend#1903).
- NCCL communicator buffers when more than one rank talks: ~392 MB per GPU at 4-8 GPUs
  (aiconfigurator systems/h100_sxm.yaml misc.nccl_mem; ../shared/reference/hardware.yaml).
- Allocator segment rounding: the CUDA caching allocator requests large segments rounded
  up to 2 MiB (CUDACachingAllocator.cpp kRoundLarge), so reserved exceeds allocated by on
  average half a rounding unit per live large tensor.
"""

from __future__ import annotations

from vramcalc.units import MiB

NCCL_BYTES_MULTI_GPU = 392 * 10**6  # aiconfigurator misc.nccl_mem for 4-8 GPUs
NCCL_BYTES_TWO_GPU = 342 * 10**6  # aiconfigurator misc.nccl_mem for 2 GPUs
LARGE_SEGMENT_ROUND_BYTES = 2 * MiB


def nccl_bytes(world_size: int) -> int:
    if world_size <= 1:
        return 0
    return NCCL_BYTES_TWO_GPU if world_size == 2 else NCCL_BYTES_MULTI_GPU


def fragmentation_bytes(num_live_tensors: int) -> int:
    """Expected reserved-minus-allocated from 2 MiB segment rounding (half a unit per tensor)."""
    return num_live_tensors * LARGE_SEGMENT_ROUND_BYTES // 2


def overhead_split(context_bytes: int, world_size: int, num_live_tensors: int) -> dict[str, int]:
    """Overhead parts: {'context', 'nccl', 'fragmentation'} in bytes."""
    return {
        "context": context_bytes,
        "nccl": nccl_bytes(world_size),
        "fragmentation": fragmentation_bytes(num_live_tensors),
    }
