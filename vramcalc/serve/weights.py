"""Per-rank weight bytes of a serving engine, in the quantized layout it loads.

Which tensors are quantized: the linear layers of the decoder blocks (q/k/v/o or the MLA
projections, the MLP and expert matrices). Embedding, LM head, norms and MoE routers stay in
the model dtype (vLLM builds `ParallelLMHead`/`VocabParallelEmbedding` and the routers'
`ReplicatedLinear` without the quant config, e.g. vllm/model_executor/models/mixtral.py,
deepseek_v2.py). Per matrix of `out` rows and `inp` columns (n = out · inp elements, G =
group size, 128 by default for AWQ and GPTQ checkpoints):

| method  | layout (vLLM `*LinearMethod.create_weights`)                            | bytes |
|---------|-------------------------------------------------------------------------|-------|
| none    | the model dtype (bf16)                                                  | 2n |
| fp8     | fp8 weight + one fp32 per-tensor weight scale (fp8.py `Fp8LinearMethod`) | n + 4 |
| int8    | int8 weight + fp32 scale per output channel (compressed-tensors W8A8)   | n + 4·out |
| awq     | qweight int32 (inp, out/8), qzeros int32 (inp/G, out/8), scales fp16 (inp/G, out) (awq.py) | n/2 + (inp/G)·out·(1/2 + 2) |
| gptq    | qweight int32 (inp/8, out), qzeros int32 (inp/G, out/8), scales fp16 (inp/G, out), g_idx int32 (inp) (gptq.py) | as awq + 4·inp |
| bnb-nf4 | 4-bit data + blockwise absmax (block 64) double-quantized (bitsandbytes `Params4bit`) | n/2 + vramcalc.finetune.nf4_constant_bytes |

Sharding per rank: column-parallel matrices split their rows, row-parallel ones (o_proj,
down_proj) their columns; K/V projections hold max(1, g/t) heads (replicated when t > g);
the vocabulary is padded to a multiple of 64 and split (vLLM `VocabParallelEmbedding`,
DEFAULT_VOCAB_PADDING_SIZE = 64); experts are split by TP, or whole experts spread over the
ranks under expert parallelism (`--enable-expert-parallel`: EP = TP); pipeline stages hold
their own layers, the first the embedding, the last the final norm and LM head (and, with
tied embeddings, a copy of the embedding).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from vramcalc.finetune import nf4_constant_bytes
from vramcalc.hardware import GPUProfile
from vramcalc.model import ModelSpec, ParamTensor
from vramcalc.model_tensors import param_tensors
from vramcalc.serve.kv import kv_heads_per_rank
from vramcalc.units import ceil_div

QUANTIZATIONS = ("none", "fp8", "int8", "awq", "gptq", "bnb-nf4")
QUANT_GROUP_SIZE = 128  # AWQ and GPTQ checkpoints' usual q_group_size / group_size
VOCAB_PADDING = 64  # vllm/model_executor/layers/vocab_parallel_embedding.py
MODEL_DTYPE_BYTES = 2  # bf16 (fp16 where the GPU lacks bf16: the same size)
# the lowest compute capability (major·10 + minor) vLLM's kernels for a layout run on, its
# `QuantizationConfig.get_min_capability` (vllm/model_executor/layers/quantization/): fp8.py
# 80 (weight-only FP8 Marlin on Ampere, W8A8 from 8.9), awq.py 75 ("Turing or newer"),
# bitsandbytes.py 70; the other layouts are not checked
MIN_CAPABILITY = {"fp8": 80, "awq": 75, "bnb-nf4": 70}
_ROW_PARALLEL = ("o_proj", "down_proj", "proj")  # row-parallel modules: the rest are columns
_UNQUANTIZED = ("router.weight", "shared_expert_gate.weight")


def unsupported_layout(method: str, gpu: GPUProfile) -> str | None:
    """Why vLLM refuses `method` on `gpu` (its start-up ValueError), or None when it runs
    or the profile gives no CUDA compute capability."""
    need = MIN_CAPABILITY.get(method)
    if need is None or gpu.cuda_capability is None:
        return None
    major, minor = (int(v) for v in gpu.cuda_capability.split("."))
    have = 10 * major + minor
    if have >= need:
        return None
    return (f"--quantization {method} needs compute capability {need // 10}.{need % 10} or "
            f"newer (vLLM's minimum); {gpu.name} has {gpu.cuda_capability}")


def quantized_matrix_bytes(out: int, inp: int, method: str, group: int = QUANT_GROUP_SIZE
                           ) -> int:
    """Bytes of one `out` × `inp` linear weight in `method`'s layout (module table)."""
    n = out * inp
    if method == "none":
        return MODEL_DTYPE_BYTES * n
    if method == "fp8":
        return n + 4
    if method == "int8":
        return n + 4 * out
    if method == "bnb-nf4":
        return ceil_div(n, 2) + nf4_constant_bytes(n)
    groups = ceil_div(inp, group)
    packed = 4 * ceil_div(inp, 8) * out  # int32 words of eight 4-bit values
    zeros = 4 * groups * ceil_div(out, 8)
    scales = 2 * groups * out
    if method == "awq":
        return packed + zeros + scales
    if method == "gptq":
        return packed + zeros + scales + 4 * inp
    raise ValueError(f"unknown quantization {method!r}")


@dataclass(frozen=True)
class WeightBytes:
    """Weights of one rank of one pipeline stage."""

    quantized: int  # the decoder-block linears in the quantized layout
    unquantized: int  # embedding, head, norms, routers, biases in the model dtype

    @property
    def total(self) -> int:
        return self.quantized + self.unquantized


def rank_rows_cols(t: ParamTensor, spec: ModelSpec, tp: int, ep: bool) -> tuple[int, int, int]:
    """(rows, cols, copies) of one tensor on one rank (copies: experts on the rank)."""
    rows = t.rows or t.numel
    cols = t.numel // rows if t.rows else 1
    copies = 1
    if t.group == "expert":
        if ep:
            return rows, cols, ceil_div(spec.num_local_experts, tp)
        copies = spec.num_local_experts
    if t.group in ("embedding", "head") and t.name != "embed_positions":
        return ceil_div(ceil_div(spec.vocab_size, VOCAB_PADDING) * VOCAB_PADDING, tp), cols, 1
    if not t.tp_split or tp == 1:
        return rows, cols, copies
    if t.name.split(".")[-2] in ("k_proj", "v_proj") and not spec.is_mla:
        heads = kv_heads_per_rank(spec, tp)
        if t.rows:
            return heads * spec.head_size, cols, copies
        return heads * spec.head_size, 1, copies  # bias
    if t.rows and t.name.split(".")[-2] in _ROW_PARALLEL:
        return rows, ceil_div(cols, tp), copies
    return ceil_div(rows, tp), cols, copies


def block_tensors(spec: ModelSpec, tp: int, first: int, count: int, ep: bool = False
                  ) -> Iterator[tuple[ParamTensor, int, int, int]]:
    """The decoder blocks' tensors on one rank of the stage holding layers [first,
    first + count): (tensor, rows, cols on the rank, copies held)."""
    for t in param_tensors(spec):
        if t.group not in ("layer", "expert"):
            continue
        rows, cols, copies = rank_rows_cols(t, spec, tp, ep)
        if t.group == "expert":
            # experts are counted once per MoE layer and expert: count = n_moe · E
            reps = copies * sum(1 for i in range(first, first + count)
                                if i >= spec.first_k_dense_replace)
        else:
            reps = layer_reps(t, spec, first, count)
        if reps:
            yield t, rows, cols, reps


def stage_weight_bytes(spec: ModelSpec, tp: int, first: int, count: int, pp: int, stage: int,
                       method: str, ep: bool = False) -> WeightBytes:
    """Weights on one rank of pipeline stage `stage` holding layers [first, first + count)."""
    quant = plain = 0
    last = stage == pp - 1
    for t in param_tensors(spec):
        if t.group == "embedding":
            reps = 1 if stage == 0 or (last and spec.tie_word_embeddings) else 0
        elif t.group in ("head", "final"):
            reps = 1 if last else 0
        else:
            continue
        rows, cols, _ = rank_rows_cols(t, spec, tp, ep)
        plain += reps * MODEL_DTYPE_BYTES * rows * cols
    for t, rows, cols, reps in block_tensors(spec, tp, first, count, ep):
        if t.rows > 0 and not t.name.endswith(_UNQUANTIZED):
            quant += reps * quantized_matrix_bytes(rows, cols, method)
        else:
            plain += reps * MODEL_DTYPE_BYTES * rows * cols
    return WeightBytes(quantized=quant, unquantized=plain)


def layer_reps(t: ParamTensor, spec: ModelSpec, first: int, count: int) -> int:
    """How many of a per-layer tensor's `t.count` copies live in layers [first, first+count):
    dense-MLP tensors sit in the leading dense layers, MoE-only tensors (router, shared
    expert) in the rest, the others in every layer."""
    layers = range(first, first + count)
    k = spec.first_k_dense_replace if spec.is_moe else spec.num_hidden_layers
    if t.count == spec.num_hidden_layers:
        return count
    if spec.is_moe and t.count == spec.num_dense_layers and t.name.startswith("mlp."):
        return sum(1 for i in layers if i < k)
    if spec.is_moe and t.count % max(spec.num_moe_layers, 1) == 0:
        per_layer = t.count // max(spec.num_moe_layers, 1)
        return per_layer * sum(1 for i in layers if i >= k)
    return sum(1 for i in layers if i < k)
