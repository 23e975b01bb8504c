"""Serving-engine profiles: how each engine budgets GPU memory, with its sources.

Each profile is data; vramcalc.serve.estimate applies the budget rule of `kind`:

- vllm (V1 engine; vllm/v1/worker/gpu_worker.py `determine_available_memory` and
  vllm/utils/mem_utils.py `memory_profiling`, vllm-project/vllm @ 35d5cda1): a memory
  snapshot after NCCL is initialised; a profiling forward of `max_num_batched_tokens` tokens
  plus a sampler run over `max_num_seqs` sequences; KV memory = total × gpu_memory_utilization
  − (weights + torch activation peak + non-torch increase). The CUDA context and NCCL buffers
  predate the snapshot and sit outside that budget; CUDA graphs are captured afterwards
  (`compile_or_warm_up_model`) and are outside it too. KV blocks of 16 tokens.
- vllm-v0 (the V0 engine of v0.6.4.post1, vramcalc.serve.vllm_v0): the same budget with the
  CUDA context and NCCL counted as non-torch memory inside it, an eager profiling forward and
  the top-k/top-p sampler over max_num_seqs sequences; one block spans every layer.
- sglang (python/sglang/srt/model_executor/model_runner.py `profile_max_num_token`,
  server_args.py `__post_init__`, sgl-project/sglang, the v0.3/v0.4 line): the KV pool gets
  free-at-start × mem_fraction_static − weights; activations, CUDA graphs and workspaces
  must fit in the other (1 − mem_fraction_static) share, unprofiled. Token-granular pool.
- hf (transformers `generate`): weights, the cache (static: `max_cache_len` allocated up
  front; dynamic: grows to the generated length) and one prefill forward's working set.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramcalc.units import GiB

ENGINES = ("vllm", "vllm-v0", "sglang", "hf")

# vLLM: `non_torch_memory takes 0.16GiB` on one H100 (vllm-project/vllm#12126, TP 1) and on one
# H100 serving Llama-2-7B (kubernetes-sigs/gateway-api-inference-extension#550); 0.20 GiB per
# rank at TP 4 (vllm-project/vllm#14447, four RTX 3090). Measured figures, used as published.
VLLM_NON_TORCH_BYTES_TP1 = int(0.16 * GiB)
VLLM_NON_TORCH_BYTES_TP = int(0.20 * GiB)
# vLLM's default largest CUDA-graph batch: min(2 × max_num_seqs, 512) tokens
# (vllm/config/compilation.py `max_cudagraph_capture_size`).
VLLM_MAX_GRAPH_TOKENS = 512


@dataclass(frozen=True)
class EngineProfile:
    """One serving engine's defaults."""

    id: str
    name: str
    block_tokens: int  # tokens per KV block (vLLM pages of 16; SGLang and HF per token)
    source: str


PROFILES: dict[str, EngineProfile] = {
    # CacheConfig.block_size 16
    "vllm": EngineProfile("vllm", "vLLM (V1 engine)", 16,
                          "vllm-project/vllm @ 35d5cda1: vllm/v1/worker/gpu_worker.py, "
                          "vllm/v1/core/kv_cache_utils.py, vllm/v1/kv_cache_interface.py"),
    # vLLM V0 as released in v0.6.4.post1 (vramcalc.serve.vllm_v0); blocks of 16 tokens
    "vllm-v0": EngineProfile("vllm-v0", "vLLM (V0 engine, v0.6.4)", 16,
                             "vllm-project/vllm v0.6.4.post1: vllm/worker/worker.py, "
                             "vllm/worker/model_runner.py, vllm/worker/cache_engine.py, "
                             "vllm/model_executor/layers/sampler.py"),
    "sglang": EngineProfile("sglang", "SGLang", 1,
                            "sgl-project/sglang: python/sglang/srt/server_args.py, "
                            "python/sglang/srt/model_executor/model_runner.py"),
    "hf": EngineProfile("hf", "Hugging Face generate", 1,
                        "huggingface/transformers: generation/utils.py, cache_utils.py"),
}


def batch_defaults(engine: str, gpu_name: str, memory_total_bytes: int, tp: int,
                   max_model_len: int) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) an engine picks when not given.

    - vLLM `vllm serve` (vllm/engine/arg_utils.py `get_batch_defaults`): 1024 sequences and
      8192 tokens on GPUs of at least 70 GiB whose name does not contain "a100" (vLLM's own
      test, PR #17885), else 256 and 2048.
    - SGLang (server_args.py `__post_init__`): chunked_prefill_size 8192, or 2048 under
      25,000 MB; the CUDA-graph batch (cuda_graph_max_bs) 160, or 8 (TP < 4) / 80 under
      25,000 MB, stands for the decode batch.
    - HF generate: one sequence, the whole prompt of max_model_len tokens in one forward.
    """
    if engine == "vllm":
        if memory_total_bytes >= 70 * 2**30 and "a100" not in gpu_name.lower():
            return 1024, 8192
        return 256, 2048
    if engine == "sglang":
        small = sglang_small_gpu(memory_total_bytes)
        return sglang_graph_max_bs(tp, memory_total_bytes), 2048 if small else 8192
    return 1, max_model_len


def sglang_mem_fraction_static(tp: int) -> float:
    """SGLang's default share of the free memory for weights + KV pool, by TP size
    (server_args.py `__post_init__`)."""
    for size, fraction in ((16, 0.79), (8, 0.81), (4, 0.85), (2, 0.87)):
        if tp >= size:
            return fraction
    return 0.88


def sglang_small_gpu(memory_total_bytes: int) -> bool:
    """SGLang's `gpu_mem < 25_000` (MB, from nvidia-smi) test for its smaller defaults."""
    return memory_total_bytes < 25_000 * 2**20


def sglang_graph_max_bs(tp: int, memory_total_bytes: int) -> int:
    if sglang_small_gpu(memory_total_bytes):
        return 8 if tp < 4 else 80
    return 160
