"""vLLM's V0 engine as released in v0.6.4.post1 (November 2024): its profiling run and KV budget.

Read from vllm-project/vllm v0.6.4.post1 (the release's source distribution on PyPI); each
rule names its file and function. Legend as in vramcalc.serve.activations (T tokens in the
profiling forward, R sequences sampled, h hidden size, V vocabulary, B = 2 bytes).

- Budget (vllm/worker/worker.py `Worker.determine_num_available_blocks`): the torch peak
  counter is reset, `profile_run` executes, and `allocated_bytes.all.peak` is read (the
  weights are in it); after `empty_cache` the memory in use outside PyTorch, (total − free)
  − torch allocated, is added. That non-torch part is everything the process holds outside
  the caching allocator: the CUDA context and loaded kernels, and NCCL with TP > 1. So
  KV memory = total × gpu_memory_utilization − (torch peak + non-torch); the CUDA context is
  inside the budget, where the V1 engine leaves it outside.
- Blocks (vllm/worker/cache_engine.py `CacheEngine.get_cache_block_size`): 16 tokens of
  every attention layer of the stage; no hybrid groups, so sliding-window layers take full
  blocks too. The start-up line "Maximum concurrency for N tokens per request" is
  blocks × 16 / max_model_len (vllm/executor/gpu_executor.py).
- Weights ("Loading model weights took", vllm/worker/model_runner.py
  `GPUModelRunnerBase.load_model`): torch memory after loading, so parameters plus buffers:
  the rotary cos/sin cache, max_position_embeddings × rotary dim in the model dtype, one per
  model (vllm/model_executor/layers/rotary_embedding.py `RotaryEmbedding.__init__`; `get_rope`
  reuses one instance for every layer).
- Profiling run (model_runner.py `GPUModelRunnerBase.profile_run`): max_num_seqs dummy
  prompts sharing max_num_batched_tokens tokens, one eager forward (V0 does not compile),
  the logits of each prompt's last token, and the sampler with top-k and top-p on.
- Forward (vllm/model_executor/models/llama.py): `LlamaModel.forward`'s loop variable keeps
  each layer's input alive while the layer runs; inside, the fused add-RMSNorm works in place,
  so `residual`, the attention output (normed in place, the MLP's input) and the MLP's
  gate_up and activation are alive together: T·(3h + 3f/t)·B for every layer after the first
  (the first layer's input is the residual itself), one T·h more than the compiled V1
  forward (vramcalc.serve.activations); the same holds for the attention, MoE and MLA widths.
  The int64 input ids, positions and slot mapping (24 B per token) live through the forward.
- PyTorch's cuBLAS workspace (aten/src/ATen/cuda/CublasHandlePool.cpp, allocated through
  the caching allocator at the first matmul, so in the profile's peak; kept for CUDA ≥ 12.2
  by pytorch/pytorch PR #124250): the GPU profile's `blas_workspace_bytes`.
- Sampler (vllm/model_executor/layers/sampler.py `Sampler.forward`, `_apply_top_k_top_p`),
  R rows of V logits, beside the forward's output T·h·B and the inputs: at the scatter the
  bf16 logits (held by `execute_model`), their fp32 copy, the sort's fp32 values and int64
  indices, the top-k mask (bool), the sorted softmax and its cumsum (fp32), the top-p mask
  (bool) and the scattered-back fp32 logits are alive together, 2 + 4 + 4 + 8 + 1 + 4 + 4 + 1
  + 4 = 32 B per logit. The sort itself (pytorch/pytorch aten/src/ATen/native/cuda/
  SortStable.cu `launch_stable_sort_kernel`; rows of more than 4,096 take the stable sort)
  adds scratch to the 2 + 4 + 4 + 8 B alive then: 128 rows or more
  (`segmented_sort_pairs`) an int64 index per logit and cub's third key and value buffers
  (cub DispatchSegmentedRadixSort, 4 + 8 B: the sort does not overwrite its input), so 38 B;
  2 to 127 rows (`segmented_sort_pairs_by_full_sort`) two (index, segment) int2 arrays, a
  key output (ATen/cuda/cub.cuh `radix_sort_pairs` with no key output) and cub's third key
  and int2 value buffers, so 50 B; one row the index list and cub's buffers, 38 B.
- Defaults (vllm/engine/arg_utils.py `EngineArgs.create_engine_config`, vllm/config.py
  `SchedulerConfig`): max_num_seqs 256; chunked prefill on by default when max_model_len
  exceeds 32,768 tokens (not for sliding-window models), then 512 batched tokens, else
  max(max_model_len, 2048). max_num_batched_tokens below max_num_seqs is refused.
- CUDA graphs (model_runner.py `capture_model`, `_get_max_graph_batch_size`): decode batches
  up to max_num_seqs rounded up to a multiple of 8, captured after the KV cache is allocated
  (worker.py `_warm_up_model`), so outside the budget.
"""

from __future__ import annotations

from vramcalc.errors import InputError
from vramcalc.model import ModelSpec
from vramcalc.serve.activations import ACT_BYTES, forward_peak_bytes
from vramcalc.units import ceil_div

MAX_NUM_SEQS = 256
LONG_CONTEXT = 32768  # chunked prefill by default above this max_model_len
CHUNKED_PREFILL_TOKENS = 512
MIN_BATCHED_TOKENS = 2048
INPUT_BYTES_PER_TOKEN = 3 * 8  # input ids, positions, slot mapping (int64)
# bf16 logits, fp32 copy, sorted values, int64 sort indices, top-k mask, sorted probs, their
# cumsum, top-p mask, scattered logits
SAMPLER_SCATTER_BYTES = 2 + 4 + 4 + 8 + 1 + 4 + 4 + 1 + 4
SORT_BYTES = 2 + 4 + 4 + 8  # bf16 logits, fp32 copy, the sort's values and int64 indices
SORT_FULL_MAX_ROWS = 127  # `nsegments < 128`: the full-sort path
GRAPH_BATCH_ALIGN = 8
MAX_GRAPH_BATCH = 8 * 1024  # the last of _BATCH_SIZES_TO_CAPTURE



def check(spec: ModelSpec, max_num_seqs: int, max_num_batched_tokens: int) -> None:
    """What V0 refuses at start-up, or what is not modelled for it."""
    if spec.is_mla:
        raise InputError(f"{spec.name}: --engine vllm-v0 is not modelled for multi-latent "
                         "attention (v0.6.4 cached DeepSeek's keys and values per head)")
    if max_num_batched_tokens < max_num_seqs:
        raise InputError(f"--engine vllm-v0: max_num_batched_tokens ({max_num_batched_tokens})"
                         f" must be at least max_num_seqs ({max_num_seqs}), as V0 requires")


def batch_defaults(spec: ModelSpec, max_model_len: int) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of `vllm serve` in v0.6.4 (docstring)."""
    if max_model_len > LONG_CONTEXT and not spec.sliding_window:
        return MAX_NUM_SEQS, CHUNKED_PREFILL_TOKENS
    return MAX_NUM_SEQS, max(max_model_len, MIN_BATCHED_TOKENS)


def rotary_cache_bytes(spec: ModelSpec) -> int:
    """The rotary cos/sin buffer: max_position_embeddings × head dim in the model dtype."""
    if spec.position_embedding != "rope":
        return 0
    return spec.max_position_embeddings * spec.head_size * ACT_BYTES


def forward_bytes(spec: ModelSpec, num_tokens: int, tp: int) -> int:
    """The eager forward's working set: the compiled width plus the layer input the model's
    loop holds (models of more than one layer), plus the int64 inputs."""
    held = num_tokens * spec.hidden_size * ACT_BYTES if spec.num_hidden_layers > 1 else 0
    return (forward_peak_bytes(spec, num_tokens, tp) + held
            + num_tokens * INPUT_BYTES_PER_TOKEN)


def sampler_bytes_per_logit(num_rows: int) -> int:
    """The larger of the scatter and the sort (with its scratch) per logit (docstring)."""
    if 2 <= num_rows <= SORT_FULL_MAX_ROWS:
        scratch = 8 + 8 + 4 + 4 + 8  # two int2 arrays, key output, cub's key and int2 buffers
    else:
        scratch = 8 + 4 + 8  # int64 indices, cub's key and int64 value buffers
    return max(SAMPLER_SCATTER_BYTES, SORT_BYTES + scratch)


def sampler_bytes(spec: ModelSpec, num_seqs: int, num_tokens: int) -> int:
    """The sampler's buffers over `num_seqs` rows beside the forward's output and inputs."""
    return (num_seqs * spec.vocab_size * sampler_bytes_per_logit(num_seqs)
            + num_tokens * (spec.hidden_size * ACT_BYTES + INPUT_BYTES_PER_TOKEN))


def profile_peak_bytes(spec: ModelSpec, num_tokens: int, num_seqs: int, tp: int,
                       last_stage: bool, blas_workspace: int) -> int:
    """Torch's peak over the weights during `profile_run`: the larger of the forward and
    (last pipeline stage) the sampler, plus the cuBLAS workspace."""
    peak = forward_bytes(spec, num_tokens, tp)
    if last_stage:
        peak = max(peak, sampler_bytes(spec, num_seqs, num_tokens))
    return peak + blas_workspace


def graph_batch(max_num_seqs: int) -> int:
    """The largest captured decode batch (`_get_max_graph_batch_size`)."""
    if max_num_seqs <= 2:
        return max_num_seqs
    if max_num_seqs <= 4:
        return 4
    return min(ceil_div(max_num_seqs, GRAPH_BATCH_ALIGN) * GRAPH_BATCH_ALIGN, MAX_GRAPH_BATCH)
