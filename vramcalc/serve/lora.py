"""The GPU slots vLLM allocates for LoRA adapters (`vllm serve --enable-lora`).

Written from vLLM v0.12.0 (vllm/lora/). At model load every LoRA-capable layer allocates
`max_loras` slots of rank `max_lora_rank` in the model dtype (`create_lora_weights`, zeros
on the layer's device), whatever adapters are later loaded into them:

| layer | A per slot | B per slot | source |
|---|---|---|---|
| a linear of the decoder blocks (every `LinearBase`: q/k/v, o, gate/up, down, routers) | R × its input on the rank | its output on the rank × R | layers/base_linear.py `BaseLinearLayerWithLoRA.create_lora_weights` |
| MoE experts (`FusedMoEWithLoRA`), per local expert | R × its input on the rank | its output on the rank × R | layers/fused_moe.py |
| the token embedding | the whole vocabulary × R (every rank) | h × R | layers/vocab_parallel_embedding.py |
| the LM head (`LogitsProcessorWithLoRA`) | R × h | the whole vocabulary × R (every rank) | layers/logits_processor.py |

A column-parallel linear (q/k/v, gate/up) keeps its whole input and its output shard, a
row-parallel one (o, down) its input shard and its whole output, as the base weight
(vramcalc.serve.weights); the merged QKV and gate/up layers hold one A and one B per slice,
which is one per projection. The embedding and head slots exist only for the model classes
that declare `embedding_modules` (models/llama.py, which vLLM's registry also runs Mistral
with, mixtral.py, granite.py, nemotron.py, commandr.py, phimoe.py, ...); Qwen, Gemma, Phi-3
and DeepSeek declare none.

They are allocated inside the model-load memory measurement (v1/worker/gpu_model_runner.py
`load_model` → `load_lora_model`), so vLLM counts them with the weights: they come out of
the KV-cache budget. The profiling run's dummy adapters are built on the CPU and copied
into these slots (lora/models.py `create_dummy_lora`); the kernels' fp32 shrink buffers
(slices × tokens × R × 4 B) live while a projection runs, below the activation moment the
peak is taken at, and are not counted, nor the Punica index arrays (int64 of
max_num_batched_tokens: under 1 MiB). Releases up to v0.11 also kept 256 extra vocabulary
rows per slot in the embedding and head (`lora_extra_vocab_size`), not counted here.
"""

from __future__ import annotations

from vramcalc.model import ModelSpec
from vramcalc.serve.weights import MODEL_DTYPE_BYTES, block_tensors

# vllm/config/lora.py (v0.12.0): `max_lora_rank` must be one of these; defaults 16 and 1
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORA_RANK = 16
DEFAULT_MAX_LORAS = 1
# model_type of the vLLM classes that declare `embedding_modules` (embed_tokens, lm_head)
EMBEDDING_LORA_MODEL_TYPES = ("llama", "mistral", "mixtral", "granite", "granitemoe",
                              "nemotron", "cohere", "cohere2", "phimoe")
# LogitsProcessorWithLoRA.create_lora_weights refuses a larger vocabulary
MAX_LORA_VOCAB = 257024


def stage_lora_bytes(spec: ModelSpec, tp: int, first: int, count: int, pp: int, stage: int,
                     max_loras: int, rank: int, ep: bool = False) -> int:
    """LoRA slot bytes on one rank of pipeline stage `stage` (layers [first, first+count))."""
    elements = 0
    if spec.model_type in EMBEDDING_LORA_MODEL_TYPES:
        # the embedding's A and the head's B span the whole vocabulary on every rank, the
        # other matrix h; a tied head has a LoRA slot of its own too
        ends = (stage == 0) + (stage == pp - 1)
        elements += ends * rank * (spec.vocab_size + spec.hidden_size)
    for t, rows, cols, reps in block_tensors(spec, tp, first, count, ep):
        if t.rows:  # norms and biases have no LoRA
            elements += reps * rank * (rows + cols)
    return max_loras * elements * MODEL_DTYPE_BYTES
