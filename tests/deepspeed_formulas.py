"""DeepSpeed's own model-state estimators, restated for comparison (not used by `estimate`).

Source: DeepSpeed 0.16.5 (commit 38327e07, 2025-02-21), unchanged through the PyPI
release 0.19.8 that ../shared/reference/peers.md ran:
`deepspeed/runtime/zero/stage_1_and_2.py::estimate_zero2_model_states_mem_needs` and
`deepspeed/runtime/zero/stage3.py::estimate_zero3_model_states_mem_needs`. DeepSpeed prints
these numbers divided by 2**30 and labels them "GB"; here they are bytes.

Notation: N = total parameters, G = GPUs in all, n = GPUs per node, L = the largest single
module's own parameters, f = 1 / number of nodes, b = additional_buffer_factor (1.5).

| stage, offload | GPU bytes | CPU bytes (per node) |
|---|---|---|
| ZeRO-2, none | 2N + ⌊18N/G⌋ | 4N·n·b |
| ZeRO-2, optimizer | 2N | N·max(4G, 16)·b |
| ZeRO-3, none | 4L + ⌊18N/G⌋ | zero_init: 4L·n·b, else 4N·n·b |
| ZeRO-3, optimizer | 4L + ⌊2N/G⌋ | zero_init: 16N·f·b, else N·max(4n, 16f)·b |
| ZeRO-3, optimizer + params | 4L | zero_init: 18N·f·b, else N·max(4n, 18f)·b |

DeepSpeed has no ZeRO-1 estimator (DeepSpeed issue #5102). What vramcalc models instead,
and why it differs, is in docs/parallelism.md ("DeepSpeed's estimators").
"""

from __future__ import annotations

from dataclasses import dataclass

from vramcalc.model import ModelSpec
from vramcalc.model_tensors import param_tensors

ADDITIONAL_BUFFER_FACTOR = 1.5  # DeepSpeed's default additional_buffer_factor


@dataclass(frozen=True)
class DSEstimate:
    """One DeepSpeed estimate: bytes per GPU and per node's CPU RAM."""

    gpu_bytes: int
    cpu_bytes: int


def zero2_model_states(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                       cpu_offload: bool = True,
                       additional_buffer_factor: float = ADDITIONAL_BUFFER_FACTOR) -> DSEstimate:
    """`estimate_zero2_model_states_mem_needs` (18 = 2 fp16 grads + 4 fp32 grads + 4 fp32
    params + 8 Adam states, per DeepSpeed's comment)."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return DSEstimate(int(gpu), int(cpu))


def zero3_model_states(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                       num_nodes: int = 1, cpu_offload: bool = True,
                       cpu_offload_params: bool = True, zero_init: bool = True,
                       additional_buffer_factor: float = ADDITIONAL_BUFFER_FACTOR) -> DSEstimate:
    """`estimate_zero3_model_states_mem_needs` (4·largest layer = its fp16 params and grads
    while gathered)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu = largest
            cpu = (total_params * 18 * gpus_factor * additional_buffer_factor if zero_init else
                   total_params * max(4 * num_gpus_per_node, 18 * gpus_factor)
                   * additional_buffer_factor)
        else:
            gpu = largest + int(2 * total_params / total_gpus)
            cpu = (total_params * 16 * gpus_factor * additional_buffer_factor if zero_init else
                   total_params * max(4 * num_gpus_per_node, 16 * gpus_factor)
                   * additional_buffer_factor)
    else:
        gpu = largest + int(18 * total_params / total_gpus)
        cpu = (largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
               if zero_init else total_params * 4 * num_gpus_per_node * additional_buffer_factor)
    return DSEstimate(int(gpu), int(cpu))


def largest_layer_params(spec: ModelSpec) -> int:
    """DeepSpeed's `largest_layer_params`: the most parameters any single module owns
    directly (`max(sum(p.numel() for p in m.parameters(recurse=False)))`): for decoder LMs
    the embedding or the output head."""
    return max(t.numel for t in param_tensors(spec))
