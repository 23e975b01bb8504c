"""torchtitan under tensor parallelism (torchtitan profile, --tp with --sequence-parallel):
the vocab-parallel loss, the all-gathered head input and the float8 all-gathers of the block
inputs. Legend: vramcalc/terms/saved.py; N = b·s tokens, T = N ÷ t (the sequence shard a
rank holds between the TP regions), V' = V ÷ t, c = bf16 under FSDP2's MixedPrecisionPolicy.

Source: pytorch/torchtitan 9dec370ad26b5f8e9a7333a0e36165018262644b (Dec 2024):

- parallelize_llama.py `apply_tp`: `output` is ColwiseParallel(input_layouts=Shard(1),
  output_layouts=Shard(-1), use_local_output=False) when loss parallel is on, so its input
  is all-gathered to (N, h) before the local mm (which saves it for the weight's gradient)
  and the logits stay a vocab-sharded DTensor (N, V') per rank; the block linears are
  Colwise/RowwiseParallel with PrepareModuleInput all-gathering the norms' (T, h) outputs,
  or, with --float8.enable_float8_linear, torchao's Float8ColwiseParallel /
  Float8RowwiseParallel / PrepareFloat8ModuleInput (pytorch/ao eab345c2268a7506355d506eb
  fc27b5d28e5e7d0, torchao/float8/float8_tensor_parallel.py: the input is cast to
  float8_e4m3fn on its (T, h) shard and the cast tensor is redistributed, so the all-gather
  moves and returns 1 byte per element; `output` stays a bf16 ColwiseParallel, float8.py's
  module filter skips it);
- parallel_dims.py `loss_parallel_enabled` = tp > 1 and not
  --training.disable_loss_parallel (a store_true flag, off by default); train.py runs the
  loss under `loss_parallel()` (utils.get_train_context), `del pred` before backward.

Loss parallel (pytorch/pytorch torch/distributed/tensor/parallel/loss.py: `_log_softmax`
and `_nll_loss_and_log_softmax_backward` allocate the same in the torch 2.3-era file and in
torch 2.13, so also at the runs' torch 1963fc8) computes on each rank's (N, V') shard:

| moment | live (N, V') tensors | B per logit |
|---|---|---|
| forward, `torch.exp(shifted)` | pred (c), its fp32 `.float()` copy, `shifted = x - x_max`, the exp | c + 12 |
| after forward | the fp32 log-probabilities (kept by log_softmax and nll_loss) | 4 |
| backward, `grad_input + torch.exp(x)` | log-probs, `zeros_like` grad_input, the exp, their sum | 16 |

then `(...) * grad_output` replaces the exp (still 16), the log_softmax backward handler
passes the fp32 gradient through, and ToCopyBackward casts it to c. (N)-sized vectors
beside them: forward, the all-reduced row max, sum of exps and its log (fp32); backward,
the safe target, the masked target and `arange` (int64), the vocab-range mask (bool), the
-1 update and the masked grad_output (fp32). tests/test_titan_tp.py runs torch's own
functions under FakeTensorMode and a fake process group and counts these peaks.

Async TP (--async-tp: --experimental.enable_async_tensor_parallel, with --training.compile):
`apply_tp` sets `torch._inductor.config._micro_pipeline_tp = True` and
`enable_symm_mem_for_group(tp group)`. Inductor's post-grad pass (torch/_inductor/fx_passes/
post_grad.py, micro_pipeline_tp.py `micro_pipeline_tp_pass`) runs after AOTAutograd's
partition, so what a compiled block keeps is unchanged; it swaps each all-gather → mm for
`symm_mem.fused_all_gather_matmul` and each mm → reduce-scatter for
`fused_matmul_reduce_scatter` (torch/distributed/_symmetric_memory/__init__.py). Both
allocate through the caching allocator exactly what the unfused pair did: the gathered
input `A_flat` (N, h) (kept when `return_A`, as the all-gather's output was) and the mm
outputs; the reduce-scatter's `stacked_partials` (N, h) in the output dtype, then the (T, h)
sum. New is one workspace per TP group, `get_symm_mem_workspace(group, min_size)`, grown to
the largest request and kept: the all-gather asks the shard's bytes (T·h of the gathered
dtype, `_pipelined_multi_all_gather_and_consume`), the reduce-scatter two output chunks,
2·⌈N/t⌉·h of the output dtype c (`_pipelined_produce_and_all2all`: two p2p buffers). It is
`_SymmetricMemory.empty_strided_p2p`: CUDASymmetricMemoryAllocator::alloc (c10d
CUDASymmetricMemory.cu) appends a signal pad (2048 B in the Dec 2024 torch) to the size
rounded to 16 B, rounds the block up to the driver's recommended granularity (2 MiB for
device memory on NVIDIA GPUs) and maps it with cuMemCreate, outside the caching allocator:
in nvidia-smi's device total, not in max_memory_allocated / max_memory_reserved.
"""

from __future__ import annotations

from vramcalc.rank import RankContext
from vramcalc.terms.saved import dims
from vramcalc.units import ALLOC_ROUND_BYTES, MiB, alloc, ceil_div, nbytes

# c10d CUDASymmetricMemory.cu (torch of Dec 2024): `signal_pad_size = 2048` after the
# buffer (rounded to 16 B), the block rounded to CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
SYMM_MEM_SIGNAL_PAD_BYTES = 2048
SYMM_MEM_GRANULARITY_BYTES = 2 * MiB


def loss_parallel(ctx: RankContext) -> bool:
    """torchtitan's loss parallel: on whenever TP is (parallel_dims.py)."""
    return ctx.training.framework == "torchtitan" and ctx.parallel.tp > 1


def _nv(ctx: RankContext) -> int:
    x = dims(ctx)
    return x.b * x.s * x.V


def loss_parallel_forward_peak_bytes(ctx: RankContext) -> int:
    """The loss forward at `torch.exp(shifted)`: the c logits, their fp32 copy, `shifted`
    and the exp, (N, V') each, + 3 fp32 (N) vectors (the loss scalars come later, once
    these temporaries are gone)."""
    x, nv = dims(ctx), _nv(ctx)
    return alloc(nv, x.c) + 3 * alloc(nv, "fp32") + 3 * alloc(x.b * x.s, "fp32")


def loss_parallel_backward_peak_bytes(ctx: RankContext) -> int:
    """The loss backward at `grad_input + torch.exp(x)`: the kept log-probabilities,
    grad_input, the exp and the sum, (N, V') fp32 each, + the (N) vectors (3 int64, 1 bool,
    2 fp32) + the backward root's three 0-dim tensors."""
    x, nv = dims(ctx), _nv(ctx)
    n = x.b * x.s
    return (4 * alloc(nv, "fp32") + 3 * alloc(n, "int64") + alloc(n, "bool")
            + 2 * alloc(n, "fp32") + 3 * ALLOC_ROUND_BYTES)


def head_input_numel(ctx: RankContext) -> int:
    """Elements of the output projection's saved input: (N, h) all-gathered under TP
    (ColwiseParallel(input_layouts=Shard(1))), else the rank's (T, h)."""
    x = dims(ctx)
    return x.b * x.s * x.h if loss_parallel(ctx) else x.T * x.h


def gathered_input_dtype(ctx: RankContext) -> str:
    """dtype of a block's all-gathered linear input under TP: float8_e4m3fn (1 byte) with
    torchao's float8 TP styles (--float8), else c."""
    x = dims(ctx)
    return "fp8" if ctx.training.float8 and ctx.parallel.tp > 1 else x.c


def async_tp_workspace_bytes(ctx: RankContext) -> int:
    """The symmetric-memory workspace async TP keeps per rank (0 when off): the largest
    request of the fused ops, max(T·h of the gathered dtype, 2·⌈N/t⌉·h·c) = the
    reduce-scatter's two output-chunk buffers, + the signal pad, rounded up to 2 MiB."""
    if not (ctx.training.async_tp and ctx.parallel.tp > 1):
        return 0
    x = dims(ctx)
    gather = nbytes(x.T * x.h, gathered_input_dtype(ctx))
    scatter = 2 * nbytes(ceil_div(x.N, ctx.parallel.tp) * x.h, x.c)
    size = ceil_div(max(gather, scatter), 16) * 16 + SYMM_MEM_SIGNAL_PAD_BYTES
    return ceil_div(size, SYMM_MEM_GRANULARITY_BYTES) * SYMM_MEM_GRANULARITY_BYTES


def async_tp_overhead(ctx: RankContext) -> dict[str, int]:
    """Async TP's workspace as an overhead part (device memory outside the allocator)."""
    ws = async_tp_workspace_bytes(ctx)
    return {"symm_mem_workspace": ws} if ws else {}
