"""Published rows outside the calibration set, against vramcalc's estimate.

    python benchmarks/published_rows.py [--markdown]

The calibration folder (benchmarks/calibration.py) holds one or a few rows of each source.
The same sources publish more rows; this prints vramcalc's estimate for each of them next to
the published figure, with the flags that express it. Nothing here is fitted: the flags
follow each run's own config file at the cited commit, and the comparison is the metric the
source prints (allocated peak unless said).

Sources (GB = 1e9 bytes unless said):
- LitGPT `config_hub/finetune/README.md` (Lightning-AI/litgpt 00af8b0d, September 2024):
  "Peak memory" is finetune/lora.py's `torch.cuda.max_memory_allocated() / 1e9`; 1xA10G,
  `precision: bf16-true`, Alpaca2k at `max_seq_length: 512`, the yaml's batch
  (`global_batch_size / micro_batch_size` micro-batches per step: the adapters' gradients
  stay between them) and LoRA settings
  (r 32, alpha 16, dropout 0.05 on query and value); `quantize: bnb.nf4` (Lightning's
  BitsandbytesPrecision, every nn.Linear including lm_head, no double quantization) with
  `bitsandbytes==0.42.0` (pyproject.toml at 00af8b0d).
  Rows marked † are Gemma 2, whose attention LitGPT computes in its own eager code to
  soft-cap the scores (litgpt/model.py `scaled_dot_product_attention`: q·kᵀ, tanh, an fp32
  softmax): those s x s tensors are not modelled, so the estimate runs low.
- PEFT `method_comparison/MetaMathQA/results/*.json` (huggingface/peft 5d602fdb):
  `accelerator_memory_max` (max_memory_reserved less the reading after init, as the
  calibrated rows; bytes), Llama-3.2-3B on an L40S, batch 4, sequences up to 768 tokens.
- torchtune README (pytorch/torchtune 1814feb): the Llama-3.2-3B optimisation table ("Peak
  Memory Active (GiB)") on an A100, batch 2, packed to 4096 where said.
- torchtune's LoRA tutorial (docs/source/tutorials/lora_finetune.rst, ff594c2): the table's
  other three rows (peak memory reserved, GB), with the calibrated q/v r 8 row's flags
  (`--torchtune-version 0.1.0`: the commit, like the Llama 3 tutorial's, is in the 0.1 series).
  "all layers" is q, k, v, output_proj, the MLP and the output projection (rows marked *
  leave out the output projection's adapter, modelled for the hf profile only); lora_llama2
  at ff594c2 gives the MLP adapters no dropout, so `--lora-dropout 0.05` counts one
  recomputed layer's MLP masks the run lacked (under 0.06 GB).
- torchtune's Llama 3 tutorial (docs/source/tutorials/llama3.rst, 20747cd8, April 2024):
  "a peak memory usage of 18.5 GB" for llama3/8B_lora_single_device at that commit (r 8 on
  q and v, dropout 0.05, batch 2, checkpointing, foreach AdamW, alpaca_cleaned at 512
  tokens), compared as the LoRA tutorial's reserved figure; the GPU is not stated (the
  text names a 24 GB consumer card).
- torchtune PR #961 (May 2024, main between v0.1.1 and v0.2.0): "seeing 20.2 peak memory
  allocated" for `full_finetune_single_device --config llama2/7B_full_low_memory.yaml
  batch_size=4` with every batch replaced by zeros of 2048 tokens (bitsandbytes PagedAdamW
  stepped in backward, checkpointing, torch.nn.CrossEntropyLoss); the GPU is not stated.
- torchtune README (pytorch/torchtune fef3ed10, April 2024, "Memory update (#775)"), the
  table "Peak Memory per GPU": the rows outside the calibration set, compared as reserved
  (the table's QLoRA row equals the QLoRA tutorial's "peak memory reserved, training"), with
  the calibrated LoRA rows' settings and `--torchtune-version 0.1.0`: 7B_lora_single_device
  (as the LoRA tutorial's q/v row) and 7B_full (full_finetune_distributed on 4 GPUs: FSDP1
  FULL_SHARD without mixed precision, checkpointing per layer, batch 2 without accumulation,
  foreach AdamW, alpaca_dataset at 512 tokens). The same table's two-GPU LoRA row is a
  calibration record (docs/methodology.md section 16).
- torchtune's end-to-end tutorial (docs/source/tutorials/e2e_flow.rst, 97bd210b): the log's
  "Memory stats after model init", "GPU peak memory allocation: 6.21 GiB", of
  llama3_2/3B_lora_single_device (LoRA r 64 on q, v, output_proj and the MLP, bf16), as
  the load phase (`--load torchtune --load-only`); the GPU is not stated.
- LitGPT `tutorials/resource-tables.md` (Lightning-AI/litgpt 0cc02afa, October 2023; runs at
  8641822): "Max GPU RAM" (`max_memory_allocated`, never reset), Alpaca, LoRA r 8 on query
  and value, one A100 40GB unless said, `bf16-true`; the rows not in the calibration set,
  with the calibrated rows' flags (benchmarks/calibration.py `_LITGPT`): each model at its
  longest Alpaca sample (1,044 phi-1.5 tokens, 1,304 Llama 2 tokens), which the first batch
  holds; `bnb.nf4` / `bnb.nf4-dq` as Lightning's BitsandbytesPrecision with bitsandbytes
  0.41.1 and PagedAdamW; several devices: FSDPStrategy with checkpointing per block and 128
  samples per step. The StableLM Alpha rows are left out: their longest sample under
  StableLM's tokenizer is not established here.
- torchtune README (pytorch/torchtune 30b8519e, September 2024; unchanged at 1814feb), the
  Llama 3.1 table "Memory and training speed" (GiB, the 405B row GB). The README gives
  batch 2 without accumulation, a dataset packed to 2048 and compile for every row; the
  rest follows the linked `recipes/configs/llama3_1` files at 30b8519e: 8B_full_single_device
  (bitsandbytes PagedAdamW8bit stepped in backward, checkpointing, CEWithChunkedOutputLoss),
  8B_lora_single_device (r 8 on q, v, fused AdamW, checkpointing, chunked loss), 70B_full
  (FSDP2 with CPUOffloadPolicy, `custom_sharded_layers: ['tok_embeddings', 'output']`,
  fused AdamW, checkpointing), 70B_lora (r 16 on q, k, v), 405B_qlora (r 16 on every
  linear, torch.nn.CrossEntropyLoss; its `batch_size: 1` kept). Rows marked ‡ (A6000)
  ran settings the README does not give: with the configs' checkpointing they come out at
  half the figures, so they are shown without it (a reading of the figures, not a
  source). The Llama 3.1 8B QLoRA row of this table is a calibration record.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from calibration import _LITGPT, _LITGPT_PHI15, _LLAMA32_3B, _PEFT_MC, _TUNE, model_yaml

from vramcalc.analytic import estimate
from vramcalc.options import build_scenario

GB, GIB = 10**9, 2**30

_LIT = {"gpus": "1xA10G", "precision": "bf16-pure", "optimizer": "adamw",
        "framework": "lightning", "attention": "flash", "recompute": "none", "seq_len": 512,
        "finetune": "lora", "lora_rank": 32, "lora_targets": "q,v", "lora_dropout": 0.05}
# a bnb.* quantization makes finetune/lora.py build bitsandbytes' PagedAdamW instead of the
# configured torch optimizer (litgpt 00af8b0d `instantiate_bnb_optimizer`)
_LIT_Q = {**_LIT, "finetune": "qlora", "optimizer": "paged-adamw", "nf4_double_quant": False,
          "quantize_head": True, "bnb_version": "0.42.0"}
# the Gemma and Phi-3 yamls adapt every linear and the head (`lora_head: true`); the head's
# adapter is left out (rows marked *: --lora-head is modelled for the hf profile only; its
# A and B are r·(h + V) parameters and one (128, V) chunk output at a time)
_ALL8 = {"lora_rank": 8, "lora_targets": "all-linear", "lora_dropout": 0.1}
_ALL16 = {**_ALL8, "lora_rank": 16}
# the calibrated rows' settings of the same runs (benchmarks/calibration.py)
_PEFT = {**_PEFT_MC, "micro_batch_size": 4, "lora_dropout": 0.0}
_PACKED = {**_TUNE, "model": "@llama3.2-3b", "gpus": "1xA100-80GB", "micro_batch_size": 2,
           "packed": True, "seq_len": 4096}
# LitGPT's 2023 resource table: the calibrated rows' settings (benchmarks/calibration.py),
# each model at its longest Alpaca sample (the first batch holds it)
_LIT23_PHI = {**_LITGPT, "model": "@phi-1.5", "seq_len": 1044}
_LIT23_7B = {**_LITGPT, "model": "llama2-7b", "seq_len": 1304}
_LIT23_13B = {**_LITGPT, "model": "llama2-13b", "seq_len": 1304}
_NF4 = {"finetune": "qlora", "optimizer": "paged-adamw", "bnb_version": "0.41.1",
        "nf4_double_quant": False, "quantize_head": True}
_NF4DQ = {**_NF4, "nf4_double_quant": True}
_FSDP2X = {"gpus": "2xA100-40GB", "fsdp": "full", "recompute": "full"}
# the Llama 3.1 table: batch 2, packed to 2048, compile (README); configs at 30b8519e
_TUNE31 = {**_TUNE, "model": "llama3.1-8b", "micro_batch_size": 2, "grad_accum": 1,
           "packed": True, "seq_len": 2048, "compile": True, "chunked_ce": 8}
_TUNE31_LORA = {"finetune": "lora", "lora_rank": 8, "lora_targets": "q,v", "lora_dropout": 0.0}

# torchtune's LoRA tutorial table (ff594c2): the calibrated q/v r 8 row's flags
_TUNE_LORA_TUT = {"model": "llama2-7b", **_TUNE, "seq_len": 512, "optimizer_impl": "foreach",
                  "finetune": "lora", "lora_rank": 8, "lora_targets": "q,v",
                  "lora_dropout": 0.05, "micro_batch_size": 2, "grad_accum": 64,
                  "torchtune_version": "0.1.0"}

# (source, row, published value, unit, metric, flags)
ROWS: list[tuple[str, str, float, str, str, dict[str, Any]]] = [
    ("LitGPT", "llama-2-7b/lora.yaml", 19.77, "GB", "allocated",
     {**_LIT, "model": "llama2-7b", "micro_batch_size": 2, "grad_accum": 4}),
    ("LitGPT", "llama-2-7b/qlora.yaml", 13.68, "GB", "allocated",
     {**_LIT_Q, "model": "llama2-7b", "micro_batch_size": 2, "grad_accum": 4}),
    ("LitGPT", "llama-3-8b/lora.yaml", 19.73, "GB", "allocated",
     {**_LIT, "model": "llama3-8b", "micro_batch_size": 1, "grad_accum": 8}),
    ("LitGPT", "llama-3-8b/qlora.yaml", 17.41, "GB", "allocated",
     {**_LIT_Q, "model": "llama3-8b", "micro_batch_size": 2, "grad_accum": 4}),
    ("LitGPT", "llama-3.1-8b/lora.yaml", 19.73, "GB", "allocated",
     {**_LIT, "model": "llama3.1-8b", "micro_batch_size": 1, "grad_accum": 8}),
    ("LitGPT", "mistral-7b/lora.yaml", 20.66, "GB", "allocated",
     {**_LIT, "model": "mistral-7b", "micro_batch_size": 2, "grad_accum": 4}),
    ("LitGPT", "mistral-7b/qlora.yaml", 14.29, "GB", "allocated",
     {**_LIT_Q, "model": "mistral-7b", "micro_batch_size": 2, "grad_accum": 4}),
    ("LitGPT", "llama-3.2-1B/lora.yaml", 4.49, "GB", "allocated",
     {**_LIT, "model": "llama3.2-1b", "micro_batch_size": 1, "grad_accum": 8}),
    ("LitGPT", "llama-3.2-1B/qlora.yaml", 5.53, "GB", "allocated",
     {**_LIT_Q, "model": "llama3.2-1b", "micro_batch_size": 2, "grad_accum": 4}),
    ("LitGPT", "llama-3.2-3B/lora.yaml", 9.67, "GB", "allocated",
     {**_LIT, "model": "llama3.2-3b", "micro_batch_size": 1, "grad_accum": 8}),
    ("LitGPT", "llama-3.2-3B/qlora.yaml", 10.30, "GB", "allocated",
     {**_LIT_Q, "model": "llama3.2-3b", "micro_batch_size": 2, "grad_accum": 4}),
    ("LitGPT", "gemma-2b/lora.yaml *", 12.62, "GB", "allocated",
     {**_LIT, "model": "gemma-2b", "micro_batch_size": 2, "grad_accum": 3, **_ALL8}),
    ("LitGPT", "gemma-2b/qlora.yaml *", 11.58, "GB", "allocated",
     {**_LIT_Q, "model": "gemma-2b", "micro_batch_size": 2, "grad_accum": 3, **_ALL16}),
    ("LitGPT", "gemma-7b/qlora.yaml *", 17.18, "GB", "allocated",
     {**_LIT_Q, "model": "gemma-7b", "micro_batch_size": 1, "grad_accum": 6, **_ALL16}),
    ("LitGPT", "phi-3/lora.yaml *", 19.75, "GB", "allocated",
     {**_LIT, "model": "phi3-mini", "micro_batch_size": 4, "grad_accum": 2, "lora_rank": 8,
      "lora_targets": "all-linear"}),
    ("LitGPT", "phi-3/qlora.yaml *", 19.13, "GB", "allocated",
     {**_LIT_Q, "model": "phi3-mini", "micro_batch_size": 4, "grad_accum": 2, "lora_rank": 8,
      "lora_targets": "all-linear"}),
    ("LitGPT", "gemma2-2b/lora.yaml * †", 14.31, "GB", "allocated",
     {**_LIT, "model": "gemma2-2b", "micro_batch_size": 2, "grad_accum": 3, **_ALL8}),
    ("LitGPT", "gemma2-9b/qlora.yaml * †", 20.92, "GB", "allocated",
     {**_LIT_Q, "model": "gemma2-9b", "micro_batch_size": 1, "grad_accum": 6, **_ALL16}),
    ("torchtune", "LoRA tutorial, all layers, r 8 *", 15.87, "GB", "reserved",
     {**_TUNE_LORA_TUT, "lora_targets": "q,k,v,o,gate,up,down"}),
    ("torchtune", "LoRA tutorial, q and v, r 64", 15.86, "GB", "reserved",
     {**_TUNE_LORA_TUT, "lora_rank": 64}),
    ("torchtune", "LoRA tutorial, all layers, r 64 *", 17.04, "GB", "reserved",
     {**_TUNE_LORA_TUT, "lora_rank": 64, "lora_targets": "q,k,v,o,gate,up,down"}),
    ("torchtune", "Llama 3 tutorial, 8B LoRA", 18.5, "GB", "reserved",
     {**_TUNE_LORA_TUT, "model": "llama3-8b", "gpus": "1xRTX4090"}),
    ("torchtune", "README Apr 2024, 7B LoRA, 1x 4090", 17.18, "GB", "reserved",
     {**_TUNE_LORA_TUT, "gpus": "1xRTX4090"}),
    ("torchtune", "README Apr 2024, 7B full, 4x 4090, FSDP1", 22.9, "GB", "reserved",
     {**_TUNE, "model": "llama2-7b", "gpus": "4xRTX4090", "fsdp": "full",
      "optimizer_impl": "foreach", "seq_len": 512, "micro_batch_size": 2, "grad_accum": 1,
      "torchtune_version": "0.1.0"}),
    ("torchtune", "PR #961, 7B full, low memory, 4 x 2048 tokens", 20.2, "GB", "allocated",
     {**_TUNE, "model": "llama2-7b", "gpus": "1xRTX4090", "optimizer": "paged-adamw",
      "optimizer_in_backward": True, "seq_len": 2048, "micro_batch_size": 4,
      "grad_accum": 1, "torchtune_version": "0.1.0"}),
    ("torchtune", "e2e tutorial, 3B LoRA, model init", 6.21, "GiB", "allocated",
     {**_TUNE, "model": "llama3.2-3b", "gpus": "1xA100-80GB", "micro_batch_size": 4,
      "finetune": "lora", "lora_rank": 64, "lora_targets": "q,v,o,gate,up,down",
      "lora_dropout": 0.0, "load": "torchtune", "load_only": True}),
    ("PEFT", "lora--llama-3.2-3B-rank64", 22552772608 / GB, "GB", "reserved",
     {**_PEFT, "finetune": "lora", "lora_rank": 64, "lora_targets": "q,v"}),
    ("PEFT", "lora--llama-3.2-3B-rank32-dora", 24532484096 / GB, "GB", "reserved",
     {**_PEFT, "finetune": "dora", "lora_rank": 32, "lora_targets": "q,v"}),
    ("PEFT", "lora--llama-3.2-3B-rank10-target-mlp", 24698159104 / GB, "GB", "reserved",
     {**_PEFT, "finetune": "lora", "lora_rank": 10, "lora_targets": "gate,up,down"}),
    ("torchtune", "3B + packed", 60.0, "GiB", "allocated",
     {**_PACKED, "recompute": "none"}),
    ("torchtune", "3B + compile", 51.0, "GiB", "allocated",
     {**_PACKED, "recompute": "none", "compile": True}),
    ("torchtune", "3B + chunked cross entropy", 42.9, "GiB", "allocated",
     {**_PACKED, "recompute": "none", "compile": True, "chunked_ce": 8}),
    ("torchtune", "3B + activation checkpointing", 24.9, "GiB", "allocated",
     {**_PACKED, "recompute": "full", "compile": True, "chunked_ce": 8}),
    ("torchtune", "3B + activation offloading", 21.8, "GiB", "allocated",
     {**_PACKED, "recompute": "full", "compile": True, "chunked_ce": 8,
      "optimizer_in_backward": True, "activation_offload": True}),
    ("torchtune", "3B + 8-bit AdamW", 17.6, "GiB", "allocated",
     {**_PACKED, "recompute": "full", "compile": True, "chunked_ce": 8,
      "optimizer_in_backward": True, "activation_offload": True,
      "optimizer": "adamw-8bit"}),
    ("torchtune", "3B QLoRA", 4.6, "GiB", "allocated",
     {**_PACKED, "recompute": "full", "compile": True, "chunked_ce": 8,
      "activation_offload": True, "finetune": "qlora", "lora_rank": 64,
      "lora_targets": "q,v,o,gate,up,down", "qlora_impl": "torchao", "load": "torchtune"}),
    ("LitGPT 2023", "phi-1.5 bnb.nf4", 3.78, "GB", "allocated", {**_LIT23_PHI, **_NF4}),
    ("LitGPT 2023", "phi-1.5 bnb.nf4-dq", 3.72, "GB", "allocated", {**_LIT23_PHI, **_NF4DQ}),
    ("LitGPT 2023", "phi-1.5 micro-batch 2", 6.76, "GB", "allocated",
     {**_LIT23_PHI, "micro_batch_size": 2}),
    ("LitGPT 2023", "phi-1.5 micro-batch 4", 10.68, "GB", "allocated",
     {**_LIT23_PHI, "micro_batch_size": 4}),
    ("LitGPT 2023", "Llama 2 7B bnb.nf4-dq", 13.84, "GB", "allocated",
     {**_LIT23_7B, **_NF4DQ}),
    ("LitGPT 2023", "Llama 2 7B micro-batch 2", 29.07, "GB", "allocated",
     {**_LIT23_7B, "micro_batch_size": 2}),
    ("LitGPT 2023", "Llama 2 13B", 38.12, "GB", "allocated", _LIT23_13B),
    ("LitGPT 2023", "Llama 2 13B bnb.nf4", 23.14, "GB", "allocated", {**_LIT23_13B, **_NF4}),
    ("LitGPT 2023", "Llama 2 13B bnb.nf4-dq", 22.55, "GB", "allocated",
     {**_LIT23_13B, **_NF4DQ}),
    ("LitGPT 2023", "phi-1.5, 2 x A100", 4.86, "GB", "allocated",
     {**_LIT23_PHI, **_FSDP2X, "grad_accum": 128}),
    ("LitGPT 2023", "phi-1.5 micro-batch 2, 2 x A100", 5.05, "GB", "allocated",
     {**_LIT23_PHI, **_FSDP2X, "micro_batch_size": 2, "grad_accum": 64}),
    ("LitGPT 2023", "phi-1.5 micro-batch 4, 2 x A100", 5.88, "GB", "allocated",
     {**_LIT23_PHI, **_FSDP2X, "micro_batch_size": 4, "grad_accum": 32}),
    ("LitGPT 2023", "Llama 2 13B, 4 x A100", 35.57, "GB", "allocated",
     {**_LIT23_13B, **_FSDP2X, "gpus": "4xA100-40GB", "grad_accum": 128}),
    ("torchtune", "Llama 3.1 8B full, 1x 4090", 18.9, "GiB", "allocated",
     {**_TUNE31, "gpus": "1xRTX4090", "optimizer": "paged-adamw-8bit",
      "optimizer_in_backward": True}),
    ("torchtune", "Llama 3.1 8B full, 1x A6000 ‡", 37.4, "GiB", "allocated",
     {**_TUNE31, "gpus": "1xA6000", "optimizer": "paged-adamw-8bit",
      "optimizer_in_backward": True, "recompute": "none"}),
    ("torchtune", "Llama 3.1 8B LoRA, 1x 4090", 16.2, "GiB", "allocated",
     {**_TUNE31, "gpus": "1xRTX4090", **_TUNE31_LORA}),
    ("torchtune", "Llama 3.1 8B LoRA, 1x A6000 ‡", 30.3, "GiB", "allocated",
     {**_TUNE31, "gpus": "1xA6000", **_TUNE31_LORA, "recompute": "none"}),
    ("torchtune", "Llama 3.1 70B full, 8x A100", 13.9, "GiB", "allocated",
     {**_TUNE31, "model": "llama3.1-70b", "gpus": "8xA100-80GB", "fsdp": "full",
      "fsdp_edge_units": True, "offload": "params,optimizer"}),
    ("torchtune", "Llama 3.1 70B LoRA, 8x A100", 27.6, "GiB", "allocated",
     {**_TUNE31, "model": "llama3.1-70b", "gpus": "8xA100-80GB", "fsdp": "full",
      **_TUNE31_LORA, "lora_rank": 16, "lora_targets": "q,k,v"}),
    ("torchtune", "Llama 3.1 405B QLoRA, 8x A100", 44.8, "GB", "allocated",
     {**_TUNE31, "model": "llama3.1-405b", "gpus": "8xA100-80GB", "fsdp": "full",
      "micro_batch_size": 1, "chunked_ce": 1, "finetune": "qlora", "lora_rank": 16,
      "lora_targets": "q,k,v,o,gate,up,down", "lora_dropout": 0.0,
      "qlora_impl": "torchao"}),
]



def run() -> list[tuple[str, str, float, float, str, str]]:
    """(source, row, published, estimate, unit, flags) per row."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for fields in (_LLAMA32_3B, _LITGPT_PHI15):
            path = Path(tmp) / f"{fields['name']}.yaml"
            path.write_text(model_yaml(fields), encoding="utf-8")
            files["@" + fields["name"]] = str(path)
        for source, row, value, unit, metric, flags in ROWS:
            values = {k: files.get(v, v) if isinstance(v, str) else v for k, v in flags.items()}
            rep = estimate(build_scenario(values))
            got = rep.peak_reserved_bytes if metric == "reserved" else rep.peak_allocated_bytes
            div = GIB if unit == "GiB" else GB
            shown = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items())
            out.append((source, row, value, got / div, unit, shown))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = run()
    if args.markdown:
        print("| source | row | published | vramcalc | error | flags |")
        print("|---|---|---|---|---|---|")
    for source, row, value, got, unit, flags in rows:
        err = 100 * (got - value) / value
        if args.markdown:
            print(f"| {source} | {row} | {value:.2f} {unit} | {got:.2f} {unit} | "
                  f"{err:+.1f}% | {flags} |")
        else:
            print(f"{source:10} {row:52} {value:7.2f} {got:7.2f} {unit:3} {err:+6.1f}%")


if __name__ == "__main__":
    main()
