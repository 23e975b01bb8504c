"""Calibration table: published measurements of real runs against vramcalc's estimate.

    python benchmarks/calibration.py [--calibration-dir ../shared/calibration] [--markdown]

Reads `megatron.yaml` (Megatron-LM functional-test golden values) and `measured.yaml`
(published figures of HF/PEFT, torchtune, torchtitan, LitGPT, ... runs) from the calibration
folder, expresses each record with vramcalc's own options (the CLI flags, in snake_case) and
compares the figure the record measured:

- megatron.yaml: `allocated_bytes.all.peak` of the last rank (last pipeline stage), steady
  state (`max_allocated_all_iters`) -> the last stage's allocated peak;
- measured.yaml: `max_memory_allocated` -> allocated peak; NVML / nvidia-smi -> device total
  (the reserved pool plus the CUDA context); `max_memory_reserved` -> the reserved peak
  (`peak_reserved_bytes`, the caching allocator's segments; vramcalc/terms/reserved.py).
  Both reserved readings take the trace engine's allocator replay where the trace runs the
  record, else the analytic packing floor; a capacity boundary (the largest run that fits)
  takes the trace's fit, the smallest capacity its requests run in (vramcalc/allocator.py
  `min_capacity`), else the analytic device total.

A record that needs a mechanism vramcalc lacks is printed as "not expressible" with the
missing feature; no flag or constant is ever adjusted to move a number. The mapping is the
two reviewed pieces below: `megatron_mapping` (Megatron arguments -> flags) and
`MEASURED_TABLE` (one entry per measured.yaml record).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vramcalc.analytic import estimate
from vramcalc.errors import InputError
from vramcalc.options import OPTIONS_BY_NAME, build_scenario

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO_ROOT.parent / "shared" / "calibration"
GIB = 2**30

# What the record measured -> what of the estimate it is compared with.
ALLOCATED, RESERVED, DEVICE, ACTIVE, UNKNOWN, CAPACITY = (
    "allocated", "reserved", "device", "active", "unknown", "capacity")
METRIC_MISSING = {
    CAPACITY: "capacity boundary (largest fitting sequence), not a memory reading",
}
# a reading whose metric the source leaves open (active, allocated or reserved: torch's
# counters, which stack loggers print side by side) is compared with whichever of the
# allocated and reserved estimates is further from it, so the doubt counts against us
UNSTATED = ("metric not stated by the source (active, allocated or reserved): compared "
            "with the estimate further from it")


@dataclass
class Mapping:
    """One record expressed with vramcalc's options, or the features that are missing."""

    record_id: str
    family: str  # megatron | torchtitan | others
    metric: str  # ALLOCATED, RESERVED, DEVICE, ...
    measured_bytes: int | None
    flags: dict[str, Any] | None = None  # option values (keys of vramcalc.options)
    model_fields: dict[str, Any] | None = None  # ModelSpec fields for `--model <name>.yaml`
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def expressible(self) -> bool:
        return not self.missing and self.flags is not None


@dataclass
class Row:
    mapping: Mapping
    estimate_bytes: int | None = None
    # the allocated peak of a record vramcalc can express but whose metric it does not
    # model (max_memory_reserved): printed for information, never compared
    allocated_bytes: int | None = None
    engine: str = "analytic"  # which engine gave estimate_bytes

    @property
    def error(self) -> float | None:
        m = self.mapping.measured_bytes
        if self.estimate_bytes is None or not m:
            return None
        return self.estimate_bytes / m - 1


# ---- loading ------------------------------------------------------------------------
def load_records(calib_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """(file stem, record) for every case of megatron.yaml and measured.yaml present."""
    out: list[tuple[str, dict[str, Any]]] = []
    for stem in ("megatron", "measured"):
        path = calib_dir / f"{stem}.yaml"
        if path.is_file():
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            out.extend((stem, case) for case in data.get("cases") or [])
    return out


def map_record(source: str, case: dict[str, Any]) -> Mapping:
    return megatron_mapping(case) if source == "megatron" else measured_mapping(case)


# ---- megatron.yaml --------------------------------------------------------------------
PLATFORM_GPU = {"dgx_a100": "A100-80GB", "dgx_h100": "H100", "dgx_gb200": "GB200",
                # the same GPUs: a second CI cluster, and DGX A100 / H100 in other clouds
                "dgx_a100_2nd": "A100-80GB", "dgx_h100_2nd": "H100", "dgx_gb200_2nd": "GB200",
                "dgxa100_dracooci": "A100-80GB", "dgxa100_dracooci-ord": "A100-80GB",
                "dgxh100_dgxc": "H100"}
# Megatron arguments the mapping below has reviewed: those that change what is allocated
# are turned into flags (or a missing feature), the rest only touch numerics, data loading
# or logging. Any other argument makes the record "not expressible" until it is reviewed.
MEGATRON_REVIEWED_ARGS = frozenset({
    "num-layers", "hidden-size", "num-attention-heads", "micro-batch-size",
    "global-batch-size", "seq-length", "max-position-embeddings", "train-iters",
    "transformer-impl", "tensor-model-parallel-size", "pipeline-model-parallel-size",
    "context-parallel-size", "expert-model-parallel-size", "expert-tensor-parallel-size",
    "sequence-parallel",
    "use-distributed-optimizer", "num-layers-per-virtual-pipeline-stage",
    "recompute-granularity", "recompute-method", "recompute-num-layers", "num-experts",
    "moe-router-topk", "disable-bias-linear", "hidden-dropout", "attention-dropout",
    "attention-backend", "bf16", "deterministic-mode",
    # numerics / kernel choice only
    "no-gradient-accumulation-fusion", "attention-softmax-in-fp32",
    "use-mcore-models", "apply-query-key-layer-scaling", "no-bias-gelu-fusion",
})


def megatron_model_fields(d: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    """ModelSpec fields of a Megatron GPT from its arguments and derived defaults."""
    L, h, heads = a["num-layers"], a["hidden-size"], a["num-attention-heads"]
    V = d["padded_vocab_size"]  # the embedding's real shape (make-vocab-size-divisible-by)
    bias = bool(d.get("add_bias_linear", True))
    fields: dict[str, Any] = {
        "name": f"megatron-gpt-{L}l-h{h}-v{V}" + (f"-e{d['num_experts']}" if
                                                  d.get("num_experts") else ""),
        "model_type": "gpt",
        "hidden_size": h,
        "num_hidden_layers": L,
        "num_attention_heads": heads,
        "num_key_value_heads": d.get("num_query_groups_effective", heads),
        "intermediate_size": d["ffn_hidden_size_effective"],
        "vocab_size": V,
        "max_position_embeddings": a.get("max-position-embeddings", a["seq-length"]),
        "mlp_kind": "gated" if d.get("activation") == "swiglu" else "standard",
        "hidden_act": "silu" if d.get("activation") == "swiglu" else "gelu",
        "norm_kind": "layernorm" if d.get("normalization") == "LayerNorm" else "rmsnorm",
        "norm_bias": d.get("normalization") == "LayerNorm",
        "attention_bias": bias,
        "attention_out_bias": bias,
        "mlp_bias": bias,
        "position_embedding": ("learned" if d.get("position_embedding_type")
                               == "learned_absolute" else "rope"),
        "tie_word_embeddings": bool(d.get("tied_embeddings", True)),
    }
    if d.get("kv_channels_effective", h // heads) != h // heads:
        fields["head_dim"] = d["kv_channels_effective"]
    if d.get("num_experts"):
        fields.update(num_local_experts=d["num_experts"],
                      num_experts_per_tok=d["moe_router_topk"],
                      moe_intermediate_size=d["moe_ffn_hidden_size_effective"])
    return fields


def megatron_recompute(d: dict[str, Any], a: dict[str, Any], missing: list[str]) -> str:
    gran = a.get("recompute-granularity")
    if gran is None:
        return "none"
    if gran == "selective":
        return "selective"
    # full: vramcalc's `full` keeps every layer's input (uniform, one layer per group)
    if a.get("recompute-method") == "uniform" and a.get("recompute-num-layers", 1) == 1:
        return "full"
    missing.append(f"full recompute {a.get('recompute-method')} with "
                   f"recompute-num-layers {a.get('recompute-num-layers')}")
    return "full"


def megatron_attention(d: dict[str, Any], missing: list[str]) -> str:
    if d.get("transformer_impl") == "local":
        return "eager"  # Megatron's local DotProductAttention materialises the scores
    backend = d.get("attention_backend", "auto")
    if backend == "unfused":
        return "eager"
    if backend in ("flash", "fused"):
        return "flash"  # both keep q, k, v, output and the softmax statistics
    missing.append(f"attention backend '{backend}' chosen by Transformer Engine at run time")
    return "flash"


# shown even at their default value: what a reader checks first
ALWAYS_SHOWN = frozenset({"model", "gpus", "framework", "precision", "optimizer", "attention",
                          "recompute", "seq_len", "micro_batch_size"})


def megatron_mapping(case: dict[str, Any]) -> Mapping:
    """Flags for one Megatron-LM functional-test record (see megatron.yaml's header)."""
    a, d, meas = case["args"], case["derived"], case["measured"]
    m = Mapping(record_id=case["id"], family="megatron", metric=ALLOCATED,
                measured_bytes=meas.get("max_allocated_all_iters"))
    missing = m.missing
    for key in sorted(set(a) - MEGATRON_REVIEWED_ARGS):
        missing.append(f"unreviewed Megatron argument --{key}")
    tp = a.get("tensor-model-parallel-size", 1)
    pp = a.get("pipeline-model-parallel-size", 1)
    cp = a.get("context-parallel-size", 1)
    ep = a.get("expert-model-parallel-size", 1)
    # --dropout sets both of Megatron's probabilities; what it changes is whether each is 0
    hidden, attn = d.get("hidden_dropout", 0.1), d.get("attention_dropout", 0.1)
    if (hidden == 0) != (attn == 0):
        missing.append(f"hidden dropout {hidden} with attention dropout {attn} (--dropout "
                       "sets both)")
    if d.get("fp8"):
        missing.append(f"Megatron fp8 recipe {d['fp8']!r}")
    # --expert-tensor-parallel-size (default tp): --etp, shown only when it differs
    etp = d.get("expert_tensor_parallel_size_effective", tp) if d.get("num_experts") else tp
    if d.get("num_experts"):
        dispatcher = d.get("moe_token_dispatcher_type_effective", "allgather")
        if dispatcher not in ("allgather", "alltoall"):
            missing.append(f"MoE {dispatcher} token dispatcher (vramcalc models allgather "
                           "and alltoall)")
        if d.get("moe_grouped_gemm"):
            missing.append("MoE grouped GEMM (vramcalc models SequentialMLP experts)")
    if d.get("params_dtype") not in ("bf16", "fp16", "fp32"):
        missing.append(f"params dtype {d.get('params_dtype')!r}")
    if d.get("optimizer", "adam") not in ("adam", "sgd"):
        missing.append(f"Megatron optimizer {d.get('optimizer')!r}")
    microbatches = d["num_microbatches_per_iter"]
    flags: dict[str, Any] = {
        "model": None,  # the model file, set below
        "gpus": f"{case.get('world_size', 8)}x{PLATFORM_GPU.get(case.get('platform'), '?')}",
        "framework": "megatron",
        "precision": d.get("params_dtype", "fp32"),  # 16-bit weights, fp32 grads and master
        "optimizer": d.get("optimizer", "adam"),
        "attention": megatron_attention(d, missing),
        "recompute": megatron_recompute(d, a, missing),
        "seq_len": a["seq-length"],
        "micro_batch_size": a["micro-batch-size"],
        "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp if etp != tp else None,
        "sequence_parallel": bool(d.get("sequence_parallel")),
        "zero": 1 if d.get("distributed_optimizer") else 0,
        # Megatron's default 0.1 is the profile's default (None): shown only when it differs
        "dropout": None if hidden == attn == 0.1 else (hidden or attn),
        # Megatron's default (allgather) is the profile's default (None): shown when it differs
        # torch.use_deterministic_algorithms: MoE layers take index_add_/index_put_
        "deterministic": bool(a.get("deterministic-mode")),
        "moe_dispatcher": ("alltoall" if d.get("num_experts") and
                           d.get("moe_token_dispatcher_type_effective") == "alltoall" else None),
        # Transformer Engine (Megatron's default) keeps a cuBLAS workspace of its own
        "transformer_impl": "local" if d.get("transformer_impl") == "local" else None,
    }
    if case.get("platform") not in PLATFORM_GPU:
        missing.append(f"GPU of platform {case.get('platform')!r}")
    if pp > 1:
        flags["num_microbatches"] = microbatches
    else:
        flags["grad_accum"] = microbatches
    per_chunk = a.get("num-layers-per-virtual-pipeline-stage")
    if per_chunk:
        flags["pp_schedule"] = "interleaved"
        flags["virtual_stages"] = a["num-layers"] // (pp * per_chunk)
    m.model_fields = megatron_model_fields(d, a)
    flags["model"] = f"{m.model_fields['name']}.yaml"
    m.flags = {k: v for k, v in flags.items()
               if k in ALWAYS_SHOWN or v != OPTIONS_BY_NAME[k].default}
    m.notes.append("Megatron's Transformer Engine and local layers are both estimated with "
                   "the megatron profile (the layer of Korthikanti et al. 2022); TE's own "
                   "cuBLAS workspace is counted unless --transformer-impl local")
    if a.get("deterministic-mode"):
        m.notes.append("--deterministic-mode: the test's ENV_VARS set CUBLAS_WORKSPACE_CONFIG="
                       ":4096:8 (model_config.yaml at adc69dba; Megatron's determinism.py "
                       "default): 32 MiB per cuBLAS workspace, two in a training step")
    return m


# ---- measured.yaml ------------------------------------------------------------------
def metric_kind(text: str) -> str:
    """What a measured.yaml record read, from its `metric` sentence."""
    t = text.lower()
    if "not stated" in t:
        return UNKNOWN
    if "oom boundary" in t or "max context length" in t:
        return CAPACITY
    if "nvml" in t or "nvidia-smi" in t:  # whole device: context + the reserved pool
        return DEVICE
    if "reserved" in t:
        return RESERVED
    if "active_bytes" in t:
        return ACTIVE
    if "max_memory_allocated" in t or "allocated_bytes" in t:
        return ALLOCATED
    return UNKNOWN


_UNIT = {"gb": 1e9, "gib": GIB, "mb": 2**20, "mib": 2**20}  # measured.yaml: 'MB' is MiB


def value_bytes(case: dict[str, Any]) -> int | None:
    for key in ("value_bytes", "value_bytes_approx"):
        if isinstance(case.get(key), int):
            return case[key]
    match = re.fullmatch(r"\s*([\d.]+)\s*(GB|GiB|MB|MiB)\s*", str(case.get("value", "")))
    if not match:
        return None
    return round(float(match.group(1)) * _UNIT[match.group(2).lower()])


# HF Trainer on transformers v4.20 (the doc's commit): BertForSequenceClassification with
# eager attention (BERT had no SDPA path then) and dropout 0.1 (the bert-large preset), the
# Trainer's default optim adamw_hf (transformers' own AdamW: a Python loop over parameters
# -> --optimizer-impl loop); the Trainer's `model.zero_grad()` (trainer.py
# `_inner_training_loop`) on the torch of that time (< 2.0: set_to_none=False by default,
# pytorch/pytorch#92731 switched it for 2.0) keeps zeroed gradients -> --no-set-to-none
# The runs' torch: the page's nvidia-smi output is dated Tue Jan 11 2022 (driver 460.91.03,
# CUDA 11.2), before torch 1.11 (March 2022) -> --torch-version 1.10: softmax and
# log_softmax keep their input (pytorch/pytorch#64000, fixed by #66018 for 1.11), and the
# CUDA context loads every kernel (a CUDA 11.2 driver has no lazy loading, which needs 11.7)
_BERT_LOAD = {"model": "bert-large", "task": "sequence-classification",
              "gpus": "1xV100-16GB", "framework": "hf", "precision": "fp32",
              "torch_version": "1.10"}
_BERT = {**_BERT_LOAD, "optimizer": "adamw", "optimizer_impl": "loop", "attention": "eager",
         "recompute": "none", "set_to_none": False}
_TORCH_NOTE = ("nvidia-smi output dated Jan 11 2022 (driver 460.91.03, CUDA 11.2): torch "
               "1.10 (1.11 came in March 2022) -> --torch-version 1.10: softmax and "
               "log_softmax keep their input (pytorch/pytorch#64000; 1.11 keeps the output "
               "only) and the CUDA context loads every kernel (no lazy loading before CUDA "
               "11.7): the V100 profile's context_eager_bytes, 1 GB (pytorch/pytorch#107667)")
_BERT_NOTES = ["transformers v4.20 BERT: eager attention, dropout 0.1 (masks kept); Trainer "
               "adamw_hf -> --optimizer-impl loop",
               "Trainer's model.zero_grad() on torch < 2.0 (set_to_none=False, the default "
               "until pytorch/pytorch#92731) -> --no-set-to-none", _TORCH_NOTE]
_DYNAMIC = "sequence length not fixed (batches padded to their longest sample)"
# LitGPT 8641822 finetune/lora.py on Lightning 2.1: --precision bf16-true (Fabric's
# HalfPrecision: bf16 weights, no master copy) = bf16-pure; torch.optim.AdamW on the LoRA
# parameters (bnb PagedAdamW under --quantize); lora_r 8, lora_alpha 16, lora_dropout 0.05 on
# query and value; no activation checkpointing on one device; the lightning profile chunks the
# head by 128 tokens as finetune/lora.py does
_LITGPT = {"gpus": "1xA100-40GB", "precision": "bf16-pure", "optimizer": "adamw",
           "framework": "lightning", "attention": "flash", "recompute": "none",
           "finetune": "lora", "lora_rank": 8, "lora_targets": "q,v", "lora_dropout": 0.05,
           "litgpt_norm": "input"}
_LITGPT_NOTES = [
    "LitGPT's 'Memory used' is max_memory_allocated never reset: it includes checkpoint "
    "loading",
    "the previous micro-batch's fp32 logits list (and, with bitsandbytes before 0.43.2, its "
    "graph's 4-bit linear inputs), alive through the loop's `logits` variable until the next "
    "forward returns, is counted at the same length: a bound, since lit-gpt 8641822 trains "
    "first on the longest sample and its later batches are shorter",
    "--litgpt-norm input: lit-gpt 8641822 precedes 6178c7cc (2023-10-24), which made its "
    "RMSNorm upcast x to fp32",
]

# torchtune (vramcalc/terms/torchtune.py): recipes train in `dtype: bf16` with activation
# checkpointing; Llama 3.2 3B has no catalog preset: its config.json's shapes
_TUNE = {"framework": "torchtune", "precision": "bf16-pure", "optimizer": "adamw",
         "attention": "flash", "recompute": "full"}
_LLAMA32_3B = {"name": "llama3.2-3b", "model_type": "llama", "hidden_size": 3072,
               "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
               "intermediate_size": 8192, "vocab_size": 128256,
               "max_position_embeddings": 131072, "mlp_kind": "gated", "hidden_act": "silu",
               "norm_kind": "rmsnorm", "position_embedding": "rope",
               "tie_word_embeddings": True}
_V010 = ("--torchtune-version 0.1.0: the commit lies in the 0.1 series (between v0.1.0-rc1 "
         "and v0.1.1), whose recipes slice the fp32 logits for the loss and keep the copy "
         "all step, and wrap FSDP1")
_PACKED = ("--packed: dataset.packed True, PackedDataset pads every pack to max_seq_len, so "
           "every batch is 2 x 4096 tokens (--seq-len 4096 is the pack size); on the A100 "
           "(compute capability 8.0 >= 7.5) torchtune builds flex attention's BlockMask, "
           "which keeps what SDPA's flash kernel keeps, and each compiled layer keeps its "
           "RoPE cache[input_pos] gather; --chunked-ce 8 is CEWithChunkedOutputLoss's "
           "num_output_chunks")
_ALPACA_512 = (
    "--seq-len 512: batches are padded to their longest sample, truncated at "
    "alpaca_cleaned_dataset's max_seq_len 512; of the first 1000 samples of "
    "alpaca_data_cleaned.json (the copy in makhweeb/text-ngnr 1ff9b7d), 37 reach 512 "
    "Llama-2 tokens in torchtune's Alpaca template (tokenizer.model of karpathy/llama2.c "
    "350e04f, BOS + prompt + response + EOS; longest 763): a shuffled batch of 2 is padded "
    "to 512 with probability 7.3%, so the run's reserved high-water mark is set by a "
    "512-token batch after a few dozen steps (one optimizer step is 64 batches)")

# PEFT's MetaMathQA benchmark (huggingface/peft 5d602fd method_comparison/MetaMathQA):
# run.py trains its own loop (no Trainer) on get_model's bf16 model (dtype bfloat16,
# use_amp false -> bf16 weights, gradients and AdamW states), use_gc false, sdpa
# (attn_implementation null); utils.py get_optimizer_and_scheduler builds
# torch.optim.AdamW(model.parameters(), **optimizer_kwargs) with neither `foreach` nor
# `fused`, which torch 2.13 (the run's, meta_info) resolves to foreach on CUDA
# (torch/optim/adam.py: _default_to_fused_or_foreach(..., use_fused=False))
_PEFT_MC = {"model": "llama3.2-3b", "gpus": "1xL40S", "framework": "hf",
            "precision": "bf16-pure", "optimizer": "adamw", "optimizer_impl": "foreach",
            "attention": "flash", "recompute": "none", "seq_len": 768}
_PEFT_MC_NOTES = [
    "--seq-len 768, the longest batch the run's code allows: utils.py get_tokenizer sets "
    "model_max_length to max_seq_length 768 and data.py tokenize_with_answer cuts every "
    "sample there; data.py's CHAR_LIMIT comment puts the 1300-character query + response "
    "filter where samples reach that 768-token limit; BucketIterator pads each batch of 4 "
    "to its longest sample. The 5000 steps read the first 20000 filtered MetaMathQA samples "
    "in order (no shuffle; mean 210 tokens per sample from the results' 'train total "
    "tokens'); whether one of them reaches 768 tokens is not logged, so the estimate is "
    "the bound",
    "run.py `evaluate` (every 250 steps and at the end) generates at batch_size_eval 50 "
    "to max_length min(prompt + 300, 800) with transformers' default DynamicCache while the "
    "last step's gradients and AdamW states stay allocated (optimizer.zero_grad() runs at "
    "the start of each step); even taking every prompt as 800 tokens, `vramcalc serve --engine hf "
    "--hf-cache dynamic --max-model-len 800 --max-num-seqs 50` adds 4.27 GiB of cache and "
    "a 2.75 GiB prefill peak to them: 30.96 GiB (full) and 13.14 GiB (LoRA), below the "
    "training step, which therefore sets the reserved high-water mark",
    "clip_grad_norm_ (grad_norm_clip 1.0) keeps one scalar norm per parameter; the "
    "before/after wiki loss passes are forwards at batch 4 under inference_mode; a padded "
    "batch's boolean attention mask (4 x 1 x 768 x 768, 2.4 MB) sends sdpa to its "
    "memory-efficient kernel, which keeps the output and log-sum-exp as the flash kernel "
    "does (--attention flash)",
]

# LitGPT 8641822 lit_gpt/config.py "phi-1_5" (Config defaults otherwise: n_head 32,
# intermediate 4·n_embd, bias, parallel_residual, LayerNorm, GptNeoxMLP with tanh GELU)
_LITGPT_PHI15 = {
    "name": "phi-1.5", "model_type": "phi", "hidden_size": 2048, "num_hidden_layers": 24,
    "num_attention_heads": 32, "intermediate_size": 8192, "vocab_size": 51200,
    "max_position_embeddings": 2048, "mlp_kind": "standard",
    "hidden_act": "gelu_pytorch_tanh", "norm_kind": "layernorm", "norm_bias": True,
    "attention_bias": True, "attention_out_bias": True, "mlp_bias": True,
    "num_layer_norms": 1, "parallel_residual": True, "lm_head_bias": True}

# One reviewed entry per measured.yaml record: the flags that express it (seq_len,
# micro_batch_size and grad_accum come from the record itself; "chunked_ce" may be a
# function of seq_len), or the features vramcalc lacks to express it. The metric is read
# from the record (`metric_kind`); an unstated metric is missing on its own.
MEASURED_TABLE: dict[str, dict[str, Any]] = {
    "hf-bertlarge-weights-only-v100": {
        "flags": {**_BERT_LOAD, "load": "hf-fp32", "load_only": True},
        "notes": [_TORCH_NOTE, "from_pretrained(...) without torch_dtype (fp32), then "
                  ".to('cuda'), read before any step -> --load hf-fp32 --load-only"]},
    "hf-bertlarge-bs4-fp32-adamw-v100": {"flags": _BERT, "notes": _BERT_NOTES},
    "hf-bertlarge-bs1-ga4-gc-fp32-adamw-v100": {
        "flags": {**_BERT, "recompute": "full"},
        "notes": [*_BERT_NOTES, "gradient_checkpointing=True -> --recompute full"]},
    "hf-bertlarge-bs4-fp16amp-adamw-v100": {
        "flags": {**_BERT, "precision": "amp-fp16"},
        "notes": [*_BERT_NOTES, "fp16=True: torch autocast, fp32 weights -> amp-fp16"]},
    "torchtune-llama2-7b-lora-r8-qv-1gpu": {
        "flags": {"model": "llama2-7b", **_TUNE, "seq_len": 512, "optimizer_impl": "foreach",
                  "finetune": "lora", "lora_rank": 8, "lora_targets": "q,v",
                  "lora_dropout": 0.05, "torchtune_version": "0.1.0"},
        "notes": [_ALPACA_512, _V010, "torchtune ff594c2 7B_lora_single_device.yaml: "
                  "torch.optim.AdamW without `fused` (foreach), torch.nn.CrossEntropyLoss "
                  "(no chunking), lora_llama2_7b's lora_dropout 0.05"]},
    "torchtune-llama2-7b-qlora-r8-1gpu": {
        "flags": {"model": "llama2-7b", **_TUNE, "seq_len": 512, "optimizer_impl": "foreach",
                  "finetune": "qlora", "lora_rank": 8, "lora_targets": "q,k,v,o,gate,up,down",
                  "lora_dropout": 0.05, "qlora_impl": "torchao", "torchao_version": "0.1",
                  "load": "torchtune", "torchtune_version": "0.1.0"},
        "notes": [_ALPACA_512, _V010, "torchtune 0914d5cf 7B_qlora_single_device.yaml: "
                  "qlora_llama2_7b (lora_llama2_7b with quantize_base) on q, k, v, "
                  "output_proj and the MLP; lora_dropout 0.05 reaches the attention adapters "
                  "only (lora_llama2 does not pass it to lora_llama2_mlp), so --lora-dropout "
                  "0.05 counts MLP masks the run lacked (0.04 GB on the backward peak, none "
                  "on the reserved reading); torch.optim.AdamW without "
                  "`fused` (foreach); torchao==0.1 NF4Tensor (--qlora-impl torchao "
                  "--torchao-version 0.1); the recipe builds the model on the GPU and "
                  "quantizes each weight (--load torchtune): the init (a template layer "
                  "deep-copied per layer, each NF4 clone dequantized and re-quantized, then "
                  "load_state_dict) is replayed through the allocator model, and its "
                  "reserved segments stay in the training reading (memory_stats_log resets "
                  "the peaks to the current values after init); the record's model-init "
                  "reading is 9.13 GB reserved"]},
    "torchtune-readme-apr24-llama2-7b-lora-fsdp-2x4090": {
        "flags": {"model": "llama2-7b", **_TUNE, "gpus": "2xRTX4090", "recompute": "none",
                  "seq_len": 512, "optimizer_impl": "foreach", "finetune": "lora",
                  "lora_rank": 8, "lora_targets": "q,v", "lora_dropout": 0.05,
                  "fsdp": "full", "torchtune_version": "0.1.0"},
        "notes": [_ALPACA_512, _V010, "torchtune fef3ed10 7B_lora.yaml (lora_finetune_distributed): "
                  "enable_activation_checkpointing False, batch 2 per GPU, torch.optim.AdamW "
                  "(foreach); FSDP1 (the 0.1 recipe's, so --fsdp-impl fsdp1 by default) with "
                  "lora_fsdp_wrap_policy: each LoRA A and B a unit of its own, the blocks' "
                  "flat parameters frozen and resharded in backward, so the bytes are "
                  "FSDP2's (the trace runs FSDP2 in its place); "
                  "the remaining gap is not explained by the recipe's FSDP1 (docs/"
                  "methodology.md section 16)"]},
    "torchtune-readme-apr24-llama2-7b-full-lowmem-1x4090": {
        "flags": {"model": "llama2-7b", **_TUNE, "gpus": "1xRTX4090", "seq_len": 512,
                  "optimizer": "paged-adamw", "optimizer_in_backward": True,
                  "torchtune_version": "0.1.0"},
        "notes": [_V010,
            "--seq-len 512: batches are padded to their longest sample, truncated at "
            "alpaca_dataset's max_seq_len 512 (tatsu-lab/alpaca, train_on_input True); of "
            "the 5000 randomly drawn samples in tatsu-lab/stanford_alpaca 5e69c50 "
            "data/alpaca_5000.json, 3 reach 512 Llama-2 tokens in torchtune's Alpaca "
            "template (the tokenizer and count of the LoRA rows; p99 360, longest 795), so "
            "the run's 3 epochs of 26001 batches meet a 512-token batch about 30 times per "
            "epoch; at --seq-len 360 the estimate is 0.16 GiB lower",
            "torchtune fef3ed10 7B_full_low_memory.yaml (full_finetune_single_device): "
            "bitsandbytes.optim.PagedAdamW (32-bit states in CUDA unified memory, outside "
            "torch's counters) with optimizer_in_bwd True (--optimizer paged-adamw "
            "--optimizer-in-backward), activation checkpointing, torch.nn.CrossEntropyLoss, "
            "no compile"]},
    "torchtune-readme-sep24-llama31-8b-qlora-1x4090": {
        "flags": {"model": "llama3.1-8b", **_TUNE, "gpus": "1xRTX4090", "finetune": "qlora",
                  "lora_rank": 8, "lora_targets": "q,k,v,o,gate,up,down",
                  "lora_dropout": 0.0, "qlora_impl": "torchao", "load": "torchtune",
                  "packed": True, "compile": True, "chunked_ce": 8},
        "notes": [
            "README 30b8519e: batch 2 without gradient accumulation, packed to 2048, "
            "torch compile enabled; the rest from llama3_1/8B_qlora_single_device.yaml at "
            "that commit: qlora_llama3_1_8b on q, k, v, output_proj and the MLP, rank 8, "
            "lora_dropout 0.0, torch.optim.AdamW fused=True (the profile's default), "
            "CEWithChunkedOutputLoss (8 chunks, --chunked-ce 8), activation checkpointing, "
            "dtype bf16; on the 4090 (compute capability 8.9 >= 7.5) packed batches take "
            "flex attention, as in the packed rows above",
            "lora_finetune_single_device builds the model on the GPU and quantizes each "
            "weight (--load torchtune); training.get_memory_stats resets the peaks after "
            "init (training/memory.py reset_stats=True), the reserved segments stay",
            "compile: each layer's dequantization is one fused kernel and the recompute "
            "holds the layer's dequantized bf16 weights until their dL/dx (docs/"
            "finetuning.md, compiled torchao QLoRA)"]},
    "torchtune-llama32-3b-full-baseline-a100": {
        "model_fields": _LLAMA32_3B,
        "flags": {"model": "llama3.2-3b.yaml", **_TUNE, "gpus": "1xA100-80GB",
                  "recompute": "none", "seq_len": 795},
        "notes": [
            "--seq-len 795: unpacked alpaca_dataset batches are padded to their longest "
            "sample; the longest of the 5000 random tatsu-lab/alpaca samples above is 795 "
            "Llama-2 tokens, which the larger Llama-3 vocabulary does not exceed; the peak "
            "is the backward's, 0.65 GiB lower at 512 tokens",
            "README (1814feb) baseline: full_finetune_single_device without packing, compile, "
            "chunking, checkpointing or optimizer in backward, torch.nn.CrossEntropyLoss; "
            "torch.optim.AdamW stepped fused, the torchtune profile's default: torchtune "
            "cca50f02e (#1575, Sep 2024) gave every torch.optim.AdamW config `fused: True`. "
            "The README does not print the optimizer's keys; its rows rule out a foreach step "
            "(torch's _multi_tensor_adamw allocates exp_avg_sq_sqrt, one state-sized "
            "temporary, 6 GiB): weights, gradients and AdamW states are 23.9 GiB, and both "
            "this row (25.5) and the checkpointed row built on it (24.9) leave no room for 6 "
            "GiB more. With --optimizer-impl foreach the estimate is 29.93 GiB (+17.4 %)"]},
    "torchtune-llama32-3b-full-optinbwd-a100": {
        "model_fields": _LLAMA32_3B,
        "flags": {"model": "llama3.2-3b.yaml", **_TUNE, "gpus": "1xA100-80GB",
                  "chunked_ce": 8, "compile": True, "optimizer_in_backward": True,
                  "packed": True},
        "notes": [_PACKED, "README (1814feb) optimization flags: torch.optim.AdamW replaces "
                  "the config's PagedAdamW8bit, one optimizer per parameter stepped in "
                  "backward; fused as in the baseline row (with --optimizer-impl foreach the "
                  "peak is the same: the largest parameter's temporary, 0.73 GiB, falls "
                  "outside the backward peak)"]},
    "torchtune-llama32-3b-lora-r64-a100": {
        "model_fields": _LLAMA32_3B,
        "flags": {"model": "llama3.2-3b.yaml", **_TUNE, "gpus": "1xA100-80GB",
                  "chunked_ce": 8, "compile": True, "activation_offload": True,
                  "finetune": "lora", "lora_rank": 64, "lora_targets": "q,v,o,gate,up,down",
                  "packed": True},
        "notes": [_PACKED, "torchtune 1814feb 3B_lora_single_device.yaml: AdamW fused=True "
                  "(the profile's default), lora_dropout 0.0, q/v/output_proj + MLP"]},
    # torchtitan 9dec370 train_configs/llama3_8b.toml (selective_ac_option 'op', rmsnorm,
    # AdamW) with FSDP2 dp_shard=8, MixedPrecisionPolicy(bf16, fp32) and default
    # --optimizer.fused False (foreach) and expandable segments (run_llama_train.sh); the
    # metric is max_memory_reserved: the trace engine's allocator replay is compared
    "torchtitan-llama31-8b-fsdp8-sac-h100": {
        "flags": {"model": "llama3.1-8b", "gpus": "8xH100", "framework": "torchtitan",
                  "precision": "amp-bf16", "fsdp": "full", "recompute": "selective",
                  "optimizer": "adamw", "attention": "flash"},
        "notes": ["torchtitan's per-op SAC (--recompute selective), FSDP2 bf16 all-gathers "
                  "with fp32 reduction (--precision amp-bf16 --fsdp full)"]},
    # benchmarks/llama3_h100_202412_torchtitan.md Table 2: torch.compile + Float8, full AC,
    # local batch 1 at 32768 -> --compile --float8 --recompute full; the run's float8 flags
    # beyond enable_float8_linear are not stated: config_manager.py's defaults (dynamic
    # scaling, enable_fsdp_float8_all_gather off)
    "torchtitan-llama31-8b-fsdp8-cp1-seq32k-fullac-h100": {
        "flags": {"model": "llama3.1-8b", "gpus": "8xH100", "framework": "torchtitan",
                  "precision": "amp-bf16", "fsdp": "full", "recompute": "full",
                  "optimizer": "adamw", "attention": "flash", "compile": True,
                  "float8": True},
        "notes": ["per-block torch.compile and torchao Float8Linear (--compile --float8: "
                  "the min-cut partition's saved set); float8 flags not stated, torchtitan's "
                  "defaults (dynamic scaling, bf16 FSDP all-gathers)",
                  "the trace engine runs eager blocks, so the analytic reserved peak is "
                  "compared: the packing floor + the loss's cached bf16 logits (train.py "
                  "`del pred` before backward; the loss is not compiled at 9dec370); the "
                  "eager bf16 trace of this layout replays 80.18 GiB reserved, the compiled "
                  "blocks' allocation order is not replayed"]},
    # the same table, Table 4 (2D): train_configs/llama3_70b.toml (AdamW, rmsnorm, seq 8192,
    # tensor_parallel_degree 8, data_parallel_shard_degree -1 -> 32 of 256 GPUs, AC 'full')
    # with the row's torch.compile + Float8 and local batch 16; loss parallel and bf16 FSDP2
    # all-gathers by default (--training.disable_loss_parallel and
    # --float8.enable_fsdp_float8_all_gather are store_true flags), async TP off (the record)
    "torchtitan-llama31-70b-fsdp32-tp8-fullac-h100": {
        "flags": {"model": "llama3.1-70b", "gpus": "256xH100", "framework": "torchtitan",
                  "precision": "amp-bf16", "fsdp": "full", "tp": 8,
                  "sequence_parallel": True, "recompute": "full", "optimizer": "adamw",
                  "attention": "flash", "compile": True, "float8": True},
        "notes": ["FSDP 32 x TP 8 with sequence-parallel norms; compiled checkpointed blocks "
                  "keep their (s/8, h) input; torch's loss parallel on the (N, V/8) logits "
                  "shard and the all-gathered head input (vramcalc/terms/torchtitan_tp.py)",
                  "the trace engine runs no TP layout: the analytic reserved peak is "
                  "compared"]},
    "litgpt-phi15-lora-mb1-a100": {
        "flags": {"model": "phi-1.5.yaml", **_LITGPT}, "model_fields": _LITGPT_PHI15,
        "notes": _LITGPT_NOTES},
    "litgpt-llama2-7b-lora-mb1-a100": {
        "flags": {"model": "llama2-7b", **_LITGPT}, "notes": _LITGPT_NOTES},
    # LitGPT 8641822 finetune/lora.py --quantize bnb.nf4: Lightning 71aed751's
    # BitsandbytesPrecision("nf4") -> _NF4Linear (compress_statistics=False), swapped for
    # every torch.nn.Linear under fabric.init_module (lm_head's LoRALinear.linear too);
    # requirements-all.txt leaves bitsandbytes unpinned, the resource table ran 0.41.1
    "litgpt-llama2-7b-qlora-nf4-mb1-a100": {
        "flags": {"model": "llama2-7b", **_LITGPT, "finetune": "qlora",
                  "optimizer": "paged-adamw",
                  "bnb_version": "0.41.1", "nf4_double_quant": False, "quantize_head": True},
        "notes": [*_LITGPT_NOTES, "LitGPT's bnb.nf4 mode: Lightning's _NF4Linear without "
                  "double quantization, on every nn.Linear including lm_head; bitsandbytes "
                  "0.41.1 (the resource table's environment) holds each 4-bit linear's "
                  "input (--bnb-version 0.41.1)"]},
    "litgpt-llama2-7b-lora-fsdp2-mb1-2xa100": {
        # finetune/lora.py 8641822: FSDPStrategy(auto_wrap_policy={Block},
        # activation_checkpointing_policy={Block}, limit_all_gathers=True) when devices > 1;
        # gradient_accumulation_iters = batch_size // micro_batch_size (128 // 1), not
        # divided by the device count
        "flags": {"model": "llama2-7b", **_LITGPT, "gpus": "2xA100-40GB", "fsdp": "full",
                  "recompute": "full", "grad_accum": 128},
        "notes": [*_LITGPT_NOTES, "the record's gradient accumulation (not stated) is "
                  "finetune/lora.py's 128 // micro_batch_size"]},
    "peft-mc-llama32-3b-full-ft-l40s": {"flags": _PEFT_MC, "notes": _PEFT_MC_NOTES},
    "peft-mc-llama32-3b-lora-r32-qv-l40s": {
        "flags": {**_PEFT_MC, "finetune": "lora", "lora_rank": 32, "lora_targets": "q,v",
                  "lora_dropout": 0.0},
        "notes": [*_PEFT_MC_NOTES, "results/lora--llama-3.2-3B-rank32.json peft_config: r 32 "
                  "on q_proj and v_proj, lora_dropout 0.0; get_peft_model(..., "
                  "autocast_adapter_dtype=True) keeps the adapters in fp32 (the hf "
                  "profile's adapter dtype)"]},
    # the report (vertex-ai-samples c9272f1f8^, community-content/vertex_model_garden/
    # benchmarking_reports/pytorch_openllama_7b_finetune_benchmark_report.md, Nov 2023) runs
    # a container whose code is not published (the instruct-lora code in the repository then,
    # e72fffd68 model_oss/peft/instruct_lora.py, is Falcon QLoRA with batch 4); the settings
    # come from the report's own figures and date:
    # - LoRA targets: its table gives 2.00E+07 trainable parameters at rank 8 (4.00E+07 at
    #   16); only all seven projections give that: 8·(4·(4096+4096) + 3·(4096+11008))·32 =
    #   19,988,480 (q and v alone: 4,194,304);
    # - no checkpointing: LoRA goes from 20.5G (256) to 28.2G (512) at batch 2, 15 MB per
    #   added token; checkpointed, a token costs its 32 layer inputs (0.26 MB in 16 bits),
    #   one layer's re-run and the logits, about 1 MB, as the report's QLoRA rows grow
    #   (1.2 MB per token; PEFT's kbit preparation checkpoints);
    # - eager attention: transformers 4.36 (December 2023) made SDPA Llama's default; the
    #   report was written by November 30, 2023 (c72d48526); so the release is taken as
    #   4.35.2, the last before it (its Llama forward upcasts the logits itself);
    # - 16-bit weights ("precision_mode float16": fp32 weights alone would be 27 GB of the
    #   20.5G); the lora_dropout flag default of the container's entry point (main.py
    #   `lora_dropout` 0.05, e72fffd68); the optimizer is not stated: torch AdamW (the
    #   Trainer's default then); the metric is not stated (compared with the estimate
    #   further from it)
    "gcp-openllama7b-lora-r16-seq256-a100": {
        "flags": {"model": "llama2-7b", "gpus": "1xA100-40GB", "framework": "hf",
                  "precision": "fp16", "finetune": "lora", "lora_rank": 16,
                  "lora_targets": "all-linear", "lora_dropout": 0.05, "attention": "eager",
                  "recompute": "none", "optimizer": "adamw", "hf_optim": "adamw_torch",
                  "transformers_version": "4.35.2"},
        "notes": ["OpenLLaMA 7B has Llama-2-7B's shapes (32 layers, 4096 hidden, 11008 "
                  "MLP, 32000 vocabulary: 6.74B parameters)",
                  "settings from the report's own figures: all seven projections (its "
                  "2.00E+07 trainable parameters at rank 8), no checkpointing (LoRA grows "
                  "15 MB per added token, 20.5G at 256 to 28.2G at 512), eager attention "
                  "(before transformers 4.36's SDPA default; report of November 2023), "
                  "16-bit weights (precision_mode float16), the entry point's lora_dropout "
                  "0.05; optimizer not stated (the Trainer's adamw_torch)",
                  "--transformers-version 4.35.2: the last release before the report "
                  "(4.36.0 came in December 2023); Llama's forward then upcast the logits "
                  "and computed the loss itself"]},
    # the Hugging Face + FA2 column of Unsloth's README (000252c9; the figures arrived in
    # e3162dc5, 2025-01-14, from the Llama 3.3 blog of December 2024): the largest sequence
    # that fits, so the estimate at that length is compared with the budget. The column is
    # an exact line in VRAM (404.75 tokens per GB between every pair of its rows from 12 to
    # 80 GB: 932, 2551, 5789, 12264, 15502, 28454), so the 24 GB row is the line read at 24,
    # not the boundary of one card. Unsloth writes GiB as "GB" (unsloth/models/llama.py
    # e3162dc5: `total_memory / 1024 / 1024 / 1024` printed as "GB"), so the budget is
    # 24 GiB.
    # Unstated settings, each chosen from a source rather than from the figure:
    # - gradient checkpointing on: the column's slope, 2.65 MB per token, is below what the
    #   MLP alone keeps per token without it (gate, up and their SiLU-product outputs, 3 x
    #   14336 x 2 B x 32 layers = 2.75 MB), so the baseline checkpointed; PEFT's QLoRA recipe
    #   (`prepare_model_for_kbit_training`, use_gradient_checkpointing=True) does;
    # - the Trainer's default optimizer of the transformers Unsloth required then
    #   (pyproject.toml e3162dc5 "transformers>=4.46.1,!=4.47.0"; adamw_torch from 4.32 to
    #   4.53), and that release's causal-LM loss (--transformers-version 4.46.1, the same in
    #   4.46-4.48; with b = 1 it makes no copy);
    # - bf16 autocast (the blog's A100), PEFT LoraConfig's default lora_dropout 0.0
    "unsloth-hf-fa2-llama31-8b-qlora-r32-maxctx-24gb": {
        "flags": {"model": "llama3.1-8b", "gpus": "1xA100-80GB", "framework": "hf",
                  "precision": "amp-bf16", "finetune": "qlora", "kbit_prepare": True,
                  "lora_rank": 32, "lora_targets": "all-linear", "lora_dropout": 0.0,
                  "attention": "flash", "recompute": "full", "hf_optim": "adamw_torch",
                  "transformers_version": "4.46.1", "seq_len": 5789, "micro_batch_size": 1},
        "capacity_bytes": 24 * GIB,
        "notes": ["the largest fitting sequence of the README's Hugging Face + FA2 column; "
                  "compared: the device total at 5,789 tokens (the fit check's figure: the "
                  "trace's smallest capacity its allocations run in, plus the context) "
                  "with 24 GiB (Unsloth prints GiB as GB); the column is a line in VRAM "
                  "(404.75 tokens per GB), so the row is that line at 24",
                  "settings the source leaves out: gradient checkpointing (the column's "
                  "2.65 MB per token is below the 2.75 MB the MLP alone keeps per token "
                  "without it), the Trainer's default adamw_torch and the loss of the "
                  "transformers Unsloth required then (>=4.46.1), bf16 autocast, PEFT's "
                  "QLoRA preparation and default lora_dropout 0"]},
}


def measured_mapping(case: dict[str, Any]) -> Mapping:
    """Flags for one measured.yaml record, from MEASURED_TABLE."""
    rid = case["id"]
    kind = metric_kind(str(case.get("metric", "")))
    m = Mapping(record_id=rid, family="torchtitan" if rid.startswith("torchtitan") else
                "others", metric=kind, measured_bytes=value_bytes(case))
    entry = MEASURED_TABLE.get(rid)
    if kind in METRIC_MISSING:
        m.missing.append(METRIC_MISSING[kind])
    if kind == ACTIVE:
        m.notes.append("active_bytes peak compared with the allocated peak")
    if kind == UNKNOWN:
        m.notes.append(UNSTATED)
    if entry is None:
        m.missing.append("no reviewed mapping for this record")
        return m
    if kind == CAPACITY and "capacity_bytes" in entry:
        # a largest-fitting-length record: the estimate at that length against the budget
        m.missing.remove(METRIC_MISSING[CAPACITY])
        m.measured_bytes = entry["capacity_bytes"]
    m.missing.extend(entry.get("missing", []))
    m.notes.extend(entry.get("notes", []))
    if "flags" not in entry:
        return m
    flags = dict(entry["flags"])
    m.model_fields = entry.get("model_fields")
    steps = not entry["flags"].get("load_only")  # a reading after loading has no batch
    for key, rec_key in (("seq_len", "seq_len"), ("micro_batch_size", "micro_batch"),
                         ("grad_accum", "grad_accum")) if steps else ():
        value = case.get(rec_key)
        if key in entry["flags"]:  # established by the entry (its notes say how)
            continue
        if isinstance(value, int):
            flags[key] = value
        elif key == "seq_len":
            m.missing.append(_DYNAMIC)
            return m
    for key, value in flags.items():
        if callable(value):
            flags[key] = value(flags["seq_len"])
    m.flags = flags
    m.model_fields = entry.get("model_fields", m.model_fields)
    if m.measured_bytes is None:
        m.missing.append(f"value {case.get('value')!r} has no byte count")
    return m


# ---- estimating ---------------------------------------------------------------------
def model_yaml(fields: dict[str, Any]) -> str:
    """A ModelSpec YAML file's text (`--model <name>.yaml`)."""
    def fmt(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)
    return "".join(f"{k}: {fmt(v)}\n" for k, v in fields.items())


def estimate_row(m: Mapping, model_dir: Path) -> Row:
    """The estimate of the figure the record measured (None when not expressible)."""
    row = Row(m)
    metric_only = m.flags is not None and m.missing == [METRIC_MISSING.get(m.metric)]
    if not m.expressible and not metric_only:
        return row
    assert m.flags is not None
    values = dict(m.flags)
    if m.model_fields is not None:
        path = model_dir / values["model"]
        path.write_text(model_yaml(m.model_fields), encoding="utf-8")
        values["model"] = str(path)
    try:
        report = estimate(build_scenario(values))
    except InputError as err:
        m.missing.append(f"vramcalc rejects the flags: {err}")
        return row
    if metric_only:
        row.allocated_bytes = report.peak_allocated_bytes
    elif m.metric == DEVICE:
        # NVML's used memory is the caching allocator's pool plus the CUDA context (and
        # NCCL): the pool's high-water mark from the trace's allocator replay where it runs,
        # as for max_memory_reserved below; the analytic device total elsewhere
        traced = trace_reserved(build_scenario(values))
        outside = report.device_total_bytes - report.peak_reserved_bytes
        if traced is not None:
            row.estimate_bytes, row.engine = traced + outside, "trace"
        else:
            row.estimate_bytes = report.device_total_bytes
    elif m.metric == CAPACITY:
        # the largest length that fits: what the fit check compares with the card, the
        # device total. Where the trace runs, its fit: the smallest capacity its requests
        # run in, an OOM retry releasing the cached whole segments first (vramcalc/
        # allocator.py `min_capacity`), plus the context; else the analytic device total
        traced_total = trace_device_total(build_scenario(values))
        if traced_total is not None:
            row.estimate_bytes, row.engine = traced_total, "trace"
        else:
            row.estimate_bytes = report.device_total_bytes
    elif m.metric in (RESERVED, UNKNOWN):
        # the reserved high-water mark depends on the order of allocations and frees: the
        # trace engine replays its own through the caching-allocator model; the analytic
        # figure is the floor the live tensors need (vramcalc/terms/reserved.py)
        traced = trace_reserved(build_scenario(values))
        if traced is not None:
            row.estimate_bytes, row.engine = traced, "trace"
        else:
            row.estimate_bytes = (report.stages[-1].peak_reserved_bytes
                                  if values.get("pp", 1) > 1 else report.peak_reserved_bytes)
        allocated = _allocated(report, values)
        if m.metric == UNKNOWN and m.measured_bytes and abs(
                allocated - m.measured_bytes) > abs(row.estimate_bytes - m.measured_bytes):
            row.estimate_bytes, row.engine = allocated, "analytic"
    else:
        row.estimate_bytes = _allocated(report, values)
    return row


def _allocated(report: Any, values: dict[str, Any]) -> int:
    """The allocated peak of the rank a record measured (the last pipeline stage)."""
    if values.get("pp", 1) > 1:
        return int(report.stages[-1].peak_allocated_bytes)
    return int(report.peak_allocated_bytes)


def trace_report(scn: Any) -> Any | None:
    """The trace engine's report (the worst rank's), or None where it cannot run."""
    from vramcalc.trace.distributed import check_any_traceable, trace_any

    try:
        check_any_traceable(scn)
    except InputError:
        return None
    return trace_any(scn)


def trace_reserved(scn: Any) -> int | None:
    """The trace engine's reserved peak, or None where it cannot run."""
    rep = trace_report(scn)
    return None if rep is None else int(rep.peak_reserved_bytes)


def trace_device_total(scn: Any) -> int | None:
    """The trace engine's device total (its fit), or None where it cannot run."""
    rep = trace_report(scn)
    return None if rep is None else int(rep.device_total_bytes)


def run(calib_dir: Path) -> list[Row]:
    mappings = [map_record(src, case) for src, case in load_records(calib_dir)]
    with tempfile.TemporaryDirectory() as tmp:
        return [estimate_row(m, Path(tmp)) for m in mappings]


# ---- printing -----------------------------------------------------------------------
def cli_flags(flags: dict[str, Any]) -> str:
    parts = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else f"--no-{key.replace('_', '-')}")
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def short_id(record_id: str) -> str:
    s = record_id.removeprefix("megatron-gpt3_mcore_")
    s = s.replace("_dist_optimizer_no_mmap_bin_files", "_distopt")
    s = s.replace("_dist_optimizer", "_distopt").replace("_nondeterministic", "")
    return s.replace("__", " ").replace("dgx_", "")


def gib(n: int | None) -> str:
    return "—" if n is None else f"{n / GIB:.2f}"


def _median_abs(rows: Iterable[Row]) -> str:
    errs = [abs(r.error) for r in rows if r.error is not None]
    return f"{statistics.median(errs):.1%} (n={len(errs)})" if errs else "— (n=0)"


def summary(rows: list[Row]) -> str:
    done = [r for r in rows if r.error is not None]
    worst = max(done, key=lambda r: abs(r.error or 0), default=None)
    fams = "; ".join(f"{fam} {_median_abs(r for r in rows if r.mapping.family == fam)}"
                     for fam in ("megatron", "torchtitan", "others"))
    worst_s = (f"{short_id(worst.mapping.record_id)} {worst.error:+.1%}"
               if worst and worst.error is not None else "—")
    return (f"expressed {len(done)}/{len(rows)}; median |error| {_median_abs(rows)}; "
            f"worst {worst_s}; per family median |error|: {fams}")


def table_rows(rows: list[Row]) -> list[list[str]]:
    out = []
    for r in rows:
        m = r.mapping
        if r.error is None:
            what = "not expressible: " + "; ".join(m.missing or ["no estimate"])
            if r.allocated_bytes is not None and m.flags is not None:
                what += f" (flags: {cli_flags(m.flags)}; allocated peak " \
                    f"{gib(r.allocated_bytes)} GiB)"
            out.append([short_id(m.record_id), what, "—", "—", gib(m.measured_bytes), "—"])
        else:
            assert m.flags is not None
            out.append([short_id(m.record_id), cli_flags(m.flags), r.engine,
                        gib(r.estimate_bytes), gib(m.measured_bytes), f"{r.error:+.1%}"])
    return out


HEADER = ["record", "flags", "engine", "estimate GiB", "measured GiB", "error"]


def render_text(rows: list[Row]) -> str:
    lines = []
    for cells in table_rows(rows):
        lines.append(f"{cells[0]}\n    {cells[1]}\n    estimate {cells[3]} ({cells[2]})  "
                     f"measured {cells[4]}  error {cells[5]}")
    return "\n".join(lines) + "\n" + summary(rows) + "\n"


def render_markdown(rows: list[Row]) -> str:
    esc = [[c.replace("|", "\\|") for c in cells] for cells in table_rows(rows)]
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells) + " |" for cells in esc]
    lines += ["", summary(rows), ""]
    models = {r.mapping.flags["model"]: r.mapping.model_fields for r in rows
              if r.mapping.model_fields and r.mapping.flags and r.error is not None}
    if models:
        lines.append("Model files passed as `--model <name>.yaml`:")
        lines.append("")
        for name, fields in models.items():
            lines += [f"`{name}`:", "", "```yaml", model_yaml(fields).rstrip(), "```", ""]
    notes = [(r.mapping.record_id, n) for r in rows if r.error is not None
             for n in r.mapping.notes]
    if notes:
        lines.append("Assumptions of the expressed rows:")
        lines.append("")
        seen: set[str] = set()
        for _rid, note in notes:
            if note not in seen:
                seen.add(note)
                lines.append(f"- {note}")
        lines.append("")
    missing: dict[str, list[str]] = {}
    for r in rows:
        if r.error is None:
            for feature in r.mapping.missing:
                missing.setdefault(feature, []).append(short_id(r.mapping.record_id))
    if missing:
        lines.append("Missing features, by record:")
        lines.append("")
        for feature, ids in sorted(missing.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- {feature}: {', '.join(ids)}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    if not args.calibration_dir.is_dir():
        print(f"no calibration folder at {args.calibration_dir}; nothing to compare")
        return 0
    rows = run(args.calibration_dir)
    sys.stdout.write(render_markdown(rows) if args.markdown else render_text(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
