"""`serve_estimate`: one serving configuration's per-GPU memory, KV capacity and concurrency.

The budget rules are the engines' own (vramcalc.serve.engines); the pieces come from
vramcalc.serve.weights (quantized weights per rank), .kv (KV bytes per token, blocks) and
.activations (profiling forward, sampler). Every pipeline stage is computed; as in vLLM all
ranks use the smallest block count among them, and the report shows that stage.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

import vramcalc.serve.vllm_v0 as vllm_v0
from vramcalc.errors import InputError
from vramcalc.hardware import Cluster
from vramcalc.model import ModelSpec
from vramcalc.serve.activations import (
    forward_peak_bytes,
    hf_prefill_peak_bytes,
    prefill_logits_bytes,
    sampler_peak_bytes,
)
from vramcalc.serve.engines import (
    PROFILES,
    VLLM_MAX_GRAPH_TOKENS,
    VLLM_NON_TORCH_BYTES_TP,
    VLLM_NON_TORCH_BYTES_TP1,
    batch_defaults,
    sglang_graph_max_bs,
    sglang_mem_fraction_static,
)
from vramcalc.serve.kv import (
    KV_DTYPE_BYTES,
    KVLayout,
    block_groups,
    blocks_per_request,
    kv_layout,
    stage_layers,
)
from vramcalc.serve.lora import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    EMBEDDING_LORA_MODEL_TYPES,
    LORA_RANKS,
    MAX_LORA_VOCAB,
    stage_lora_bytes,
)
from vramcalc.serve.weights import QUANTIZATIONS, stage_weight_bytes, unsupported_layout
from vramcalc.terms.overhead import nccl_bytes

MAX_TOKENS = 100_000_000


class ServeConfig(BaseModel):
    """What a serving engine is started with (vLLM's flag names)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: Literal["vllm", "vllm-v0", "sglang", "hf"] = "vllm"
    tp: int = Field(1, ge=1, le=4096)
    pp: int = Field(1, ge=1, le=4096)
    max_model_len: int | None = Field(None, gt=0, le=MAX_TOKENS)
    max_num_seqs: int | None = Field(None, gt=0, le=1_000_000)
    max_num_batched_tokens: int | None = Field(None, gt=0, le=MAX_TOKENS)
    kv_cache_dtype: Literal["auto", "fp8", "fp16"] = "auto"
    quantization: str = "none"
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    expert_parallel: bool = False
    enforce_eager: bool = False
    hf_cache: Literal["static", "dynamic"] = "static"
    enable_lora: bool = False
    max_loras: int | None = Field(None, ge=1, le=4096)
    max_lora_rank: int | None = None

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        if self.quantization not in QUANTIZATIONS:
            raise InputError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if not self.enable_lora and (self.max_loras or self.max_lora_rank):
            raise InputError("--max-loras and --max-lora-rank size vLLM's LoRA slots: add "
                             "--enable-lora")
        if self.enable_lora and self.engine != "vllm":
            raise InputError("--enable-lora is modelled for --engine vllm (the V1 engine)")
        if self.max_lora_rank is not None and self.max_lora_rank not in LORA_RANKS:
            raise InputError(f"--max-lora-rank must be one of "
                             f"{', '.join(map(str, LORA_RANKS))} (vLLM's), got "
                             f"{self.max_lora_rank}")
        if self.engine == "hf" and (self.tp > 1 or self.pp > 1):
            raise InputError("--engine hf runs one GPU per model copy: --tp and --pp must be 1")
        return self


class ServeTerms(BaseModel):
    """Bytes per GPU, each part of the device total once."""

    weights: int
    lora_slots: int  # vLLM --enable-lora: max_loras adapters of max_lora_rank per layer
    activation_peak: int
    non_torch: int
    kv_cache: int
    cuda_graphs: int
    context_nccl: int
    unused: int  # inside the engine's budget but not handed out (rounding, reserve)

    def as_dict(self) -> dict[str, int]:
        return self.model_dump()


class KVInfo(BaseModel):
    num_layers: int
    num_sliding_layers: int
    sliding_window: int | None
    kv_heads_per_gpu: int
    head_dim: int
    dtype_bytes: int
    mla: bool
    bytes_per_token: int  # every layer, full context (per GPU)
    bytes_per_sequence: int  # one max-model-len sequence, sliding layers at their window


class ServeReport(BaseModel):
    """One serving configuration on one GPU type (the worst rank)."""

    engine: str
    engine_source: str
    model: str
    num_params: int
    gpu: str
    memory_total_bytes: int
    num_gpus: int
    tp: int
    pp: int
    replicas: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    quantization: str
    kv_cache_dtype: str
    budget_fraction: float  # gpu_memory_utilization or mem_fraction_static (hf: 1)
    terms: ServeTerms
    device_total_bytes: int
    kv: KVInfo
    kv_capacity_tokens: int
    kv_capacity_blocks: int
    block_tokens: int
    max_concurrency: float  # max-model-len sequences the KV cache holds
    max_concurrent_seqs: int  # also bounded by max_num_seqs
    fits: bool
    reasons: list[str]
    notes: list[str]

    def to_json_dict(self) -> dict[str, object]:
        return self.model_dump(mode="json")


def _kv_dtype_bytes(cfg: ServeConfig) -> int:
    return {"auto": KV_DTYPE_BYTES["bf16"], "fp16": 2, "fp8": 1}[cfg.kv_cache_dtype]


def _validate(spec: ModelSpec, cfg: ServeConfig, cluster: Cluster, max_len: int) -> int:
    """Checks the engines make at start-up; the number of model replicas."""
    if spec.is_encoder_decoder:
        raise InputError(f"{spec.name}: serving encoder-decoder models (T5, BART: a "
                         "cross-attention cache per request) is not modelled")
    if spec.is_encoder:
        raise InputError(f"{spec.name}: serving encoder-only models (BERT, RoBERTa) is not "
                         "modelled: engines run them as pooling models, with no KV cache")
    per_copy = cfg.tp * cfg.pp
    if cluster.num_gpus % per_copy:
        raise InputError(f"--tp {cfg.tp} × --pp {cfg.pp} = {per_copy} GPUs per model copy "
                         f"does not divide the {cluster.num_gpus} GPUs")
    if spec.num_attention_heads % cfg.tp:
        raise InputError(f"--tp {cfg.tp} does not divide the {spec.num_attention_heads} "
                         "attention heads")
    if cfg.enable_lora and spec.is_mla:
        raise InputError(f"{spec.name}: LoRA slots of multi-latent attention are not modelled")
    if cfg.enable_lora and spec.model_type in EMBEDDING_LORA_MODEL_TYPES \
            and spec.vocab_size > MAX_LORA_VOCAB:
        raise InputError(f"{spec.name}: vLLM's LoRA head takes a vocabulary of at most "
                         f"{MAX_LORA_VOCAB} (this one has {spec.vocab_size})")
    refused = unsupported_layout(cfg.quantization, cluster.gpu)
    if refused and cfg.engine in ("vllm", "vllm-v0"):
        raise InputError(refused)
    if max_len > spec.max_position_embeddings:
        raise InputError(f"--max-model-len {max_len} exceeds the model's "
                         f"max_position_embeddings ({spec.max_position_embeddings})")
    return cluster.num_gpus // per_copy


def serve_estimate(spec: ModelSpec, cluster: Cluster, cfg: ServeConfig) -> ServeReport:
    """Per-GPU memory and KV capacity of `spec` served by `cfg.engine` on `cluster`."""
    prof = PROFILES[cfg.engine]
    gpu = cluster.gpu
    total = gpu.memory_total_bytes
    max_len = cfg.max_model_len or spec.max_position_embeddings
    replicas = _validate(spec, cfg, cluster, max_len)
    v0 = cfg.engine == "vllm-v0"
    default_seqs, default_tokens = (vllm_v0.batch_defaults(spec, max_len) if v0 else
                                    batch_defaults(cfg.engine, gpu.name, total, cfg.tp, max_len))
    seqs = cfg.max_num_seqs or default_seqs
    batched = cfg.max_num_batched_tokens or default_tokens
    if v0:
        vllm_v0.check(spec, seqs, batched)
    kv_b = _kv_dtype_bytes(cfg)
    context = gpu.context_overhead_bytes + nccl_bytes(cfg.tp * cfg.pp)
    notes: list[str] = []
    stages = stage_layers(spec.num_hidden_layers, cfg.pp)
    if cfg.engine == "hf":
        return _hf(spec, cluster, cfg, prof.source, max_len, seqs, kv_b, context, replicas)

    best: tuple[int, ...] | None = None
    rows = []
    for s, (first, count) in enumerate(stages):
        w = stage_weight_bytes(spec, cfg.tp, first, count, cfg.pp, s, cfg.quantization,
                               cfg.expert_parallel).total
        lora = 0 if not cfg.enable_lora else stage_lora_bytes(
            spec, cfg.tp, first, count, cfg.pp, s, cfg.max_loras or DEFAULT_MAX_LORAS,
            cfg.max_lora_rank or DEFAULT_MAX_LORA_RANK, cfg.expert_parallel)
        layout = kv_layout(spec, cfg.tp, first, count, kv_b)
        if v0:
            w += vllm_v0.rotary_cache_bytes(spec)
            act = vllm_v0.profile_peak_bytes(spec, batched, seqs, cfg.tp, s == cfg.pp - 1,
                                             gpu.blas_workspace_bytes)
        else:
            act = forward_peak_bytes(spec, batched, cfg.tp)
            if s == cfg.pp - 1:
                act = max(act, sampler_peak_bytes(spec, min(seqs, batched), batched))
        rows.append((w, lora, act, layout))
    if v0:  # the context and NCCL are V0's non-torch memory, inside the budget
        fraction = cfg.gpu_memory_utilization or 0.9
        budget = int(total * fraction)
        non_torch, context = context, 0
        graph_tokens = vllm_v0.graph_batch(seqs)
    elif cfg.engine == "vllm":
        fraction = cfg.gpu_memory_utilization or 0.9
        budget = int(total * fraction)
        non_torch = VLLM_NON_TORCH_BYTES_TP1 if cfg.tp * cfg.pp == 1 else VLLM_NON_TORCH_BYTES_TP
        graph_tokens = min(2 * seqs, VLLM_MAX_GRAPH_TOKENS)
    else:
        fraction = cfg.gpu_memory_utilization or sglang_mem_fraction_static(cfg.tp)
        budget = int((total - context) * fraction)
        non_torch = 0
        graph_tokens = min(seqs, sglang_graph_max_bs(cfg.tp, total))
    graph_bytes = vllm_v0.forward_bytes if v0 else forward_peak_bytes
    graphs = 0 if cfg.enforce_eager else graph_bytes(spec, graph_tokens, cfg.tp)
    for s, (w, lora, act, layout) in enumerate(rows):
        groups = block_groups(layout)
        if v0:  # every layer of the stage in one block, sliding layers at full length
            kv_mem = budget - w - act - non_torch
            slot = layout.layer_token_bytes * prof.block_tokens * layout.num_layers
        elif cfg.engine == "vllm":  # the LoRA slots are measured with the weights
            kv_mem = budget - w - lora - act - non_torch
            slot = layout.layer_token_bytes * prof.block_tokens * groups.group_size
        else:  # SGLang: one cell per token holds every layer (v0.3/v0.4 pools, no SWA pool)
            kv_mem = budget - w
            slot = layout.layer_token_bytes * layout.num_layers
        blocks = max(kv_mem, 0) // max(slot, 1)
        if best is None or blocks < best[0]:
            best = (blocks, s, kv_mem, slot)
    assert best is not None
    blocks, s, kv_mem, slot = best
    w, lora, act, layout = rows[s]
    groups = block_groups(layout)
    if v0:  # gpu_executor.py: blocks × block size / max_model_len
        tokens = blocks * prof.block_tokens
        concurrency = tokens / max_len
    elif cfg.engine == "vllm":
        per_req = blocks_per_request(layout, groups, max_len, batched, prof.block_tokens)
        concurrency = blocks / per_req
        tokens = blocks * prof.block_tokens if groups.num_groups == 1 else int(
            concurrency * max_len)
    else:
        per_req = max_len
        concurrency = blocks / max_len
        tokens = blocks
    kv_bytes = blocks * slot
    used = w + lora + act + non_torch + kv_bytes
    if cfg.engine in ("vllm", "vllm-v0"):
        unused = max(budget - used, 0)
    else:
        unused = max(int(total - context) - used - graphs, 0)
    terms = ServeTerms(weights=w, activation_peak=act, non_torch=non_torch, kv_cache=kv_bytes,
                       lora_slots=lora, cuda_graphs=graphs, context_nccl=context,
                       unused=unused)
    device_total = sum(terms.as_dict().values())
    # the longest sequence the cache holds, as the engines' start-up check computes it
    # (blocks x block size; one cell per token in SGLang); with several KV groups (sliding
    # windows) it is not a single block count, and is left out
    longest = tokens if v0 or cfg.engine != "vllm" or groups.num_groups == 1 else None
    reasons = _reasons(cfg, total, context, budget, kv_mem, concurrency, device_total, max_len,
                       act + graphs, fraction, longest)
    if layout.num_sliding_layers and cfg.engine == "sglang":
        notes.append("SGLang's v0.3/v0.4 pool keeps every layer at full length; newer "
                     "releases add a separate sliding-window pool")
    if v0:
        notes.append("V0 counts the CUDA context (and NCCL) as non-torch memory, inside "
                     "gpu_memory_utilization")
    if cfg.enable_lora:
        notes.append(f"LoRA: {cfg.max_loras or DEFAULT_MAX_LORAS} slot(s) of rank "
                     f"{cfg.max_lora_rank or DEFAULT_MAX_LORA_RANK} in every linear"
                     + (", the embedding and the head" if spec.model_type in
                        EMBEDDING_LORA_MODEL_TYPES else "")
                     + ", allocated at model load: vLLM counts them with the weights, so "
                     "they come out of the KV cache")
    if cfg.engine in ("vllm", "vllm-v0") and not cfg.enforce_eager:
        notes.append("CUDA graphs are captured after the KV cache is allocated: outside "
                     "gpu_memory_utilization, on top of it")
    return ServeReport(
        engine=cfg.engine, engine_source=prof.source, model=spec.name,
        num_params=spec.num_params, gpu=gpu.name, memory_total_bytes=total,
        num_gpus=cluster.num_gpus, tp=cfg.tp, pp=cfg.pp, replicas=replicas,
        max_model_len=max_len, max_num_seqs=seqs, max_num_batched_tokens=batched,
        quantization=cfg.quantization, kv_cache_dtype=cfg.kv_cache_dtype,
        budget_fraction=fraction, terms=terms, device_total_bytes=device_total,
        kv=_kv_info(spec, layout, max_len), kv_capacity_tokens=tokens,
        kv_capacity_blocks=blocks, block_tokens=prof.block_tokens,
        max_concurrency=concurrency, max_concurrent_seqs=min(int(concurrency), seqs),
        fits=not reasons, reasons=reasons, notes=notes)


def _kv_info(spec: ModelSpec, layout: KVLayout, max_len: int) -> KVInfo:
    return KVInfo(num_layers=layout.num_layers, num_sliding_layers=layout.num_sliding_layers,
                  sliding_window=layout.window, kv_heads_per_gpu=layout.kv_heads,
                  head_dim=layout.head_dim, dtype_bytes=layout.dtype_bytes, mla=spec.is_mla,
                  bytes_per_token=layout.bytes_per_token,
                  bytes_per_sequence=layout.sequence_bytes(max_len))


def _reasons(cfg: ServeConfig, total: int, context: int, budget: int, kv_mem: int,
             concurrency: float, device_total: int, max_len: int, outside: int,
             fraction: float, longest: int | None = None) -> list[str]:
    """Why the engine would fail to start (empty: it starts). `longest`: the longest
    --max-model-len the KV cache holds (vLLM names it "the estimated maximum model length",
    vllm/v1/core/kv_cache_utils.py `check_enough_kv_cache_memory`)."""
    out = []
    if cfg.engine == "vllm" and total - context < budget:
        out.append(f"free memory at start-up ({(total - context) / 2**30:.2f} GiB) is below "
                   f"gpu_memory_utilization × total ({budget / 2**30:.2f} GiB)")
    if kv_mem <= 0:
        out.append("no memory left for the KV cache after weights"
                   + (" and the profiling peak" if cfg.engine in ("vllm", "vllm-v0") else ""))
    elif concurrency < 1:
        lower = (f"lower --max-model-len to at most {longest}" if longest else
                 "lower --max-model-len")
        out.append(f"the KV cache holds {concurrency:.2f} sequences of max-model-len "
                   f"{max_len}: {lower} or add GPUs")
    if cfg.engine == "sglang" and outside > (total - context) * (1 - fraction):
        out.append("activations and CUDA graphs exceed the (1 − mem_fraction_static) share")
    if device_total > total:
        out.append(f"device total {device_total / 1e9:.2f} GB exceeds {total / 1e9:.2f} GB")
    return out


def _hf(spec: ModelSpec, cluster: Cluster, cfg: ServeConfig, source: str, max_len: int,
        batch: int, kv_b: int, context: int, replicas: int) -> ServeReport:
    """HF generate on one GPU: weights, the cache of `batch` sequences of max_len tokens
    (static: allocated up front, sliding layers at min(window, max_len); dynamic: the same
    at the end of generation) and the prefill forward over the prompt. The prompt is
    `max_num_batched_tokens` tokens (default: max_len) per sequence."""
    gpu = cluster.gpu
    w = stage_weight_bytes(spec, 1, 0, spec.num_hidden_layers, 1, 0, cfg.quantization).total
    layout = kv_layout(spec, 1, 0, spec.num_hidden_layers, kv_b)
    prompt = min(cfg.max_num_batched_tokens or max_len, max_len)
    cache = batch * layout.sequence_bytes(max_len)
    act = max(hf_prefill_peak_bytes(spec, batch, prompt), prefill_logits_bytes(spec, batch))
    total = gpu.memory_total_bytes
    terms = ServeTerms(weights=w, activation_peak=act, non_torch=0, kv_cache=cache, lora_slots=0,
                       cuda_graphs=0, context_nccl=context, unused=0)
    device_total = sum(terms.as_dict().values())
    room = total - context - w - act
    per_seq = layout.sequence_bytes(max_len)
    concurrency = max(room, 0) / per_seq
    reasons = [] if device_total <= total else [
        f"device total {device_total / 1e9:.2f} GB exceeds {total / 1e9:.2f} GB"]
    return ServeReport(
        engine="hf", engine_source=source, model=spec.name, num_params=spec.num_params,
        gpu=gpu.name, memory_total_bytes=total, num_gpus=cluster.num_gpus, tp=1, pp=1,
        replicas=replicas, max_model_len=max_len, max_num_seqs=batch,
        max_num_batched_tokens=prompt, quantization=cfg.quantization,
        kv_cache_dtype=cfg.kv_cache_dtype, budget_fraction=1.0, terms=terms,
        device_total_bytes=device_total, kv=_kv_info(spec, layout, max_len),
        kv_capacity_tokens=max(room, 0) // max(layout.bytes_per_token, 1),
        kv_capacity_blocks=batch, block_tokens=max_len,
        max_concurrency=concurrency, max_concurrent_seqs=min(int(concurrency), batch),
        fits=not reasons, reasons=reasons,
        notes=[f"{cfg.hf_cache} cache: {batch} sequence(s) of {max_len} tokens"])
