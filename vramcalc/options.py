"""The option table shared by the CLI flags and training-config files.

Each option has one name: `--seq-len` on the command line is `seq_len` in a config file.
`build_scenario` turns a mapping of option values into a validated Scenario; every bad
value raises InputError with a one-line message (unknown names get suggestions). Names,
types and choices are checked here; the numeric bounds are the models' own (TrainingConfig,
ParallelConfig), reported in pydantic's words under the option's flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError

from vramcalc.catalog import resolve_model
from vramcalc.ds_config import DeepSpeedConfig
from vramcalc.errors import InputError, suggest
from vramcalc.hardware import alias_note, parse_gpus
from vramcalc.hf_config import with_task
from vramcalc.hf_stack import HF_OPTIMS, parse_modules_to_save
from vramcalc.lora_targets import parse_targets
from vramcalc.parallel import ParallelConfig
from vramcalc.peft_file import checked_peft_config
from vramcalc.scenario import Scenario, short_default_length
from vramcalc.training import (
    ATTENTIONS,
    FINETUNES,
    FRAMEWORKS,
    LIGHTNING_PRECISIONS,
    MOE_DISPATCHERS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    QATS,
    RECOMPUTE_METHODS,
    RECOMPUTES,
    TrainingConfig,
)

_FSDP = ("none", "full", "grad-op", "hybrid")
_OFFLOAD = ("none", "optimizer", "gradients", "params")
_PP_SCHED = ("1f1b", "interleaved", "gpipe")


@dataclass(frozen=True)
class Opt:
    """One option: config key `name`, CLI flag `--name-with-dashes`."""

    name: str
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    group: str = "training"

    @property
    def flag(self) -> str:
        """The command-line flag, e.g. `--seq-len` for `seq_len`."""
        return "--" + self.name.replace("_", "-")


SCENARIO_OPTIONS: tuple[Opt, ...] = (
    Opt("model", str, None, "Preset name or alias (70b, llama3-8b, gpt2), or a path to a "
        "Hugging Face config.json / its directory / a model YAML.", group="model"),
    Opt("task", str, None, "Encoders (bert, roberta): the head, sequence-classification "
        "(pooler + classifier) or masked-lm (vocabulary logits). Default: the config's "
        "architectures (else sequence-classification).", ("sequence-classification",
                                                          "masked-lm"), group="model"),
    Opt("gpus", str, "1xH100", "Cluster: H100, 8xH100, 2x8xA100-80GB (nodes x per node).", group="cluster"),
    Opt("seq_len", int, None, "Tokens per sequence (encoder-decoders: the source's). Default: "
        "4096, or a learned position table's tokens where fewer (GPT-2: 1024, BERT: 512)."),
    Opt("target_len", int, None, "Encoder-decoders (t5, bart): target (decoder) tokens per "
        "sequence, the labels the LM head scores. Default: --seq-len."),
    Opt("micro_batch_size", int, 1, "Sequences per micro-batch per data-parallel rank."),
    Opt("grad_accum", int, 1, "Gradient-accumulation micro-steps per optimizer step."),
    Opt("precision", str, None, "fp32 | amp-bf16 | amp-fp16 (autocast, fp32 weights) | "
        "bf16 | fp16 (16-bit weights+grads, fp32 master) | bf16-pure | bf16-autocast | "
        "fp16-autocast (HF Trainer's bf16/fp16=True over a model loaded in 16 bits) | fp8 "
        "(TE FP8 block linears, bf16 weights + fp32 master; FP8 GPUs); Lightning's bf16-true, "
        "bf16-mixed, 32-true, 16-mixed are bf16-pure, amp-bf16, fp32, amp-fp16. Default: the "
        "stack's (torchtitan amp-bf16, torchtune bf16-pure), else bf16.", PRECISIONS),
    Opt("optimizer", str, "adamw", "adamw | adam | sgd | sgd-momentum | lion | adafactor | "
        "adamw-8bit | paged-adamw | paged-adamw-8bit (bitsandbytes; paged states in unified "
        "memory, shown as overhead) | muon (torch.optim.Muon + AdamW, reference).", OPTIMIZERS),
    Opt("optimizer_dtype", str, None, "Optimizer state dtype: fp32 (default) or bf16.",
        ("fp32", "bf16")),
    Opt("optimizer_impl", str, None, "How a torch optimizer steps: foreach (one temporary "
        "per state tensor at once) | fused (one kernel, no temporaries) | loop (one "
        "parameter at a time). Default: the stack's (hf: fused AdamW, as HF Trainer; else "
        "foreach, PyTorch's default on CUDA).", OPTIMIZER_IMPLS),
    Opt("hf_optim", str, None, "HF Trainer's TrainingArguments.optim for AdamW (hf "
        "profile): adamw_torch (torch AdamW, foreach) | adamw_torch_fused (fused=True) | "
        "adamw_hf (transformers' own AdamW, a per-parameter loop). Default: the Trainer's "
        "default of transformers >= 4.54 with torch >= 2.8, adamw_torch_fused (adamw_torch "
        "from 4.32, adamw_hf before).", tuple(HF_OPTIMS)),
    Opt("attention", str, "flash", "flash (SDPA/FlashAttention) | eager (s x s scores).",
        ATTENTIONS),
    Opt("recompute", str, "none", "Activation recomputation: none | selective | full.",
        RECOMPUTES),
    Opt("use_reentrant", bool, None, "hf profile with --recompute full: HF gradient "
        "checkpointing's use_reentrant. On: torch's reentrant checkpoint, which holds the "
        "layer's incoming gradient through its backward (transformers 4.35 to 4.57's "
        "default). Default: off, as in transformers 5.x."),
    Opt("kbit_prepare", bool, False, "hf profile, --finetune qlora: PEFT's "
        "prepare_model_for_kbit_training(model): every parameter that is not 4-bit cast to "
        "fp32 (give --precision amp-bf16, HF Trainer's bf16=True), gradient checkpointing "
        "(give --recompute full), reentrant unless --no-use-reentrant."),
    Opt("recompute_method", str, None, "Megatron-LM's --recompute-method with --recompute full "
        "(megatron profile): block = only the first --recompute-num-layers layers of each "
        "pipeline chunk are checkpointed, the rest keep all activations; uniform = "
        "checkpoint groups of --recompute-num-layers layers. Default: every layer, one per "
        "checkpoint.", RECOMPUTE_METHODS),
    Opt("recompute_num_layers", int, None, "Megatron-LM's --recompute-num-layers N (with "
        "--recompute-method): layers checkpointed per pipeline chunk (block) or per "
        "checkpoint (uniform)."),
    Opt("recompute_every", int, None, "torchtitan profile, with --recompute selective: "
        "checkpoint every N-th transformer block whole and keep everything in the others "
        "(torchtitan's selective_ac_option=N). Without it, --recompute selective is "
        "torchtitan's per-op SAC (selective_ac_option='op')."),
    Opt("framework", str, "reference", "Stack profile: reference | hf | megatron | "
        "torchtitan (torchtitan 9dec370's Llama: per-op SAC for --recompute selective) | "
        "torchtune (torchtune 1814feb's recipes: --chunked-ce N is CEWithChunkedOutputLoss, "
        "LinearCrossEntropyLoss with --torchtune-version 0.7; fused AdamW, offload with "
        "checkpointing) | "
        "lightning (LitGPT 8641822 on Lightning Fabric: chunked head with fp32 outputs, fused "
        "qkv, FSDP1) | unsloth (Unsloth 015bdef0 / unsloth-zoo ce232d6c, LoRA and QLoRA with "
        "--precision bf16: --recompute full offloads layer inputs to pinned host memory, "
        "fused cross entropy without logits, fp32 adapters; its notebooks use --optimizer "
        "adamw-8bit).", FRAMEWORKS),
    Opt("finetune", str, "full", "full | lora | qlora (NF4 base) | dora: frozen base weights "
        "plus trained adapters; peft: --peft-config's method.", (*FINETUNES, "peft")),
    Opt("peft_config", str, None, "A PEFT adapter config (adapter_config.json, or its "
        "folder): any PEFT method (IA3, prompt tuning, LoHa, OFT, ...) built by PEFT itself "
        "on the hf profile and measured by `vramcalc trace`; implies --finetune peft."),
    Opt("lora_rank", int, 8, "LoRA rank r (PEFT default 8)."),
    Opt("lora_targets", str, "q,v", "Adapted linears, comma-separated: q,k,v,o,gate,up,down, "
        "or all-linear (default q,v: PEFT's default for Llama)."),
    Opt("lora_dropout", float, 0.0, "LoRA dropout probability (PEFT default 0: no mask kept)."),
    Opt("lora_embedding", bool, False, "hf profile, --finetune lora or qlora: also adapt "
        "the token embedding (embed_tokens in PEFT's target_modules: lora.Embedding, A (r x "
        "V) and B (h x r)); its gradient then reaches the first layer."),
    Opt("lora_head", bool, False, "hf profile, --finetune lora or qlora: also adapt the "
        "output head (lm_head in PEFT's target_modules: A (r x h), B (V x r)); its sum "
        "B(A(x)) is (tokens x vocab) in fp32."),
    Opt("modules_to_save", str, None, "hf profile with a PEFT method: PEFT's "
        "modules_to_save, trained full copies of lm_head and/or embed_tokens (with their "
        "gradients and optimizer states), comma-separated; fp32-weight precisions (amp-bf16, "
        "amp-fp16, fp32)."),
    Opt("dropout", float, None, "Hidden and attention dropout probability, 0 <= P < 1 "
        "(megatron profile only; default: Megatron's 0.1, which keeps 1-byte masks). 0 keeps "
        "no dropout masks. The reference and hf profiles model dropout off (only 0)."),
    Opt("moe_dispatcher", str, None, "Megatron-LM's MoE token dispatcher (megatron "
        "profile, MoE models): allgather (gathers every token of the TP x EP group, the "
        "default) | alltoall (sends each token to its experts' ranks).", MOE_DISPATCHERS),
    Opt("deterministic", bool, False, "Megatron-LM's --deterministic-mode (megatron profile): "
        "MoE layers keep the expert output and router row index; 32 MiB cuBLAS workspaces."),
    Opt("cross_entropy_loss_fusion", bool, False, "Megatron-LM's --cross-entropy-loss-fusion "
        "(megatron profile; the native impl): the torch.compile'd vocab-parallel loss, whose "
        "backward computes the gradient into a new fp32 buffer before writing it back."),
    Opt("transformer_impl", str, None, "Megatron-LM's --transformer-impl (megatron profile): "
        "transformer_engine (default; TE's own cuBLAS workspace) | local.",
        ("transformer_engine", "local")),
    Opt("litgpt_norm", str, None, "LitGPT's RMSNorm (lightning profile): fp32 (the default: "
        "it upcasts x to fp32, as LitGPT has since lit-gpt 6178c7cc, October 2023) | input "
        "(earlier lit-gpt checkouts computed in the input's dtype).", ("fp32", "input")),
    Opt("chunked_ce", int, 1, "Cross entropy over N token chunks (torchtune's Linear"
        "CrossEntropyLoss; its releases' CEWithChunkedOutputLoss under the torchtune profile):"
        " the fp32 logits and their gradients exist one chunk at a time; 1 = off."),
    Opt("set_to_none", bool, True, "zero_grad(set_to_none=...): --no-set-to-none keeps "
        "zeroed gradients allocated through the next forward (torch < 2.0's default, e.g. "
        "HF Trainer on torch 1.x); one GPU or DDP."),
    Opt("sync_each_batch", bool, False, "accelerate's GradientAccumulationPlugin("
        "sync_each_batch=True) (hf profile): HF Trainer then reduces the gradients after every "
        "micro-batch. Without it, every micro-batch but the last runs under no_sync(), and "
        "with --fsdp and --grad-accum > 1 each rank holds all its gradients unsharded until "
        "the last one."),
    Opt("trl_chunked_ce", bool, False, "TRL SFTTrainer's loss_type chunked_nll, its default "
        "from TRL 1.7 (hf profile): no lm_head call, the loss in checkpointed chunks of 256 "
        "tokens with an fp32 copy of a 16-bit head weight per chunk; every label counted."),
    Opt("adapters_16bit", bool, False, "hf profile, LoRA, QLoRA or DoRA on a 16-bit model: "
        "the adapters stay in the model's dtype, as get_peft_model(..., "
        "autocast_adapter_dtype=False) leaves them and TRL's SFTTrainer casts a 4-bit model's "
        "(bf16); without it PEFT upcasts them to fp32."),
    Opt("liger", bool, False, "HF Trainer's use_liger_kernel=True (hf profile; dense Llama, "
        "Mistral and Qwen2 models, data parallelism): Liger's RMSNorm, SwiGLU and RoPE "
        "kernels, and its fused linear cross entropy, which makes no full logits and keeps "
        "dL/dhidden (and a trained head's dL/dW) from the forward."),
    Opt("activation_offload", bool, False, "Move saved activations of the transformer layers "
        "to pinned host memory (torchtune OffloadActivations), one layer in flight."),
    Opt("qat", str, "none", "Quantization-aware training of the block linears: none | int8 "
        "(8da8w: int8 per-token activations, per-channel weights) | int4 (8da4w: int4 weights "
        "per group of 32).", QATS),
    Opt("expandable_segments", bool, None, "The CUDA caching allocator's "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: one growing segment per pool "
        "instead of one cudaMalloc per large request. Changes the reserved estimate only. "
        "Default: the stack's launcher (torchtitan sets it; torch's default, off, else)."),
    Opt("optimizer_in_backward", bool, False, "Step the optimizer inside backward "
        "(torchtune's optimizer_in_bwd): one optimizer per parameter, run by its "
        "post-accumulate-grad hook, which then frees the gradient. One GPU, --grad-accum 1, "
        "no fp32 master copy; reference, hf and torchtune profiles."),
    Opt("compile", bool, False, "torchtune's compile: True (torchtune profile): each layer "
        "and the loss's cross entropy compiled; a compiled layer keeps the min-cut "
        "partition's tensors, a compiled chunked cross entropy each chunk's 16-bit logits "
        "and two fp32 numbers per token instead of fp32 log-probabilities. torchtitan's "
        "--training.compile (torchtitan profile): each block compiled, the loss eager; "
        "with --recompute none or full, no TP or CP."),
    Opt("packed", bool, False, "torchtune's dataset.packed: True (torchtune profile): every "
        "batch is a full pack of --seq-len tokens, with input_pos and a block-causal mask: "
        "flex attention's BlockMask on compute capability >= 7.5, else a dense (b, s, s) "
        "bool mask (SDPA's memory-efficient kernel; each layer keeps an additive copy)."),
    Opt("float8", bool, False, "torchtitan's --float8.enable_float8_linear (with --compile): "
        "torchao's Float8Linear (dynamic tensorwise) on every linear but the output layer."),
    Opt("float8_all_gather", bool, False, "torchtitan's --float8.enable_fsdp_float8_all_gather "
        "(with --float8 and FSDP over dp > 1): FSDP2 all-gathers the Float8Linear weights in "
        "float8 (1 byte per element; norms and the root module stay bf16), and the forward "
        "casts no weight."),
    Opt("async_tp", bool, False, "torchtitan's --experimental.enable_async_tensor_parallel "
        "(torchtitan profile, --tp > 1 with --compile): inductor's micro-pipelined TP; each "
        "rank keeps a symmetric-memory workspace of 2·(b·s/tp)·h activation elements "
        "outside the caching allocator (device total only)."),
    Opt("qlora_impl", str, None, "QLoRA's 4-bit base (--finetune qlora): bnb (bitsandbytes "
        "Linear4bit: HF/PEFT, Lightning) | torchao (NF4Tensor: torchtune). Default: torchao "
        "under --framework torchtune, else bnb.", ("bnb", "torchao")),
    Opt("bnb_version", str, None, "bitsandbytes release, e.g. 0.41.1: before 0.43.2 each "
        "4-bit matmul keeps its input until the autograd graph is freed. Default: 0.50.1 "
        "(keeps none)."),
    Opt("torchao_version", str, None, "torchao release with --qlora-impl torchao, e.g. 0.1: "
        "before 0.2 to_nf4 quantizes a whole weight at once at load; before 0.3 each "
        "weight keeps a 1/64-size scaler-factor storage. Default: 0.5.0."),
    Opt("torchtune_version", str, None, "torchtune release with --framework torchtune, from 0.1.0, e.g. 0.2.1: before 0.3 the recipes slice the fp32 logits for the loss and keep them all step, and shard with FSDP1; before 0.3.1 AdamW steps foreach, not fused (vramcalc/terms/torchtune.py); 0.7 is the main branch after release 0.6.1, whose LinearCrossEntropyLoss projects the logits inside the loss, one chunk at a time (vramcalc/terms/linear_ce.py). Default: the current release, 0.6.1."),
    Opt("unsloth_version", str, None, "Unsloth release with --framework unsloth, from 2024.8 (its first on PyPI), e.g. 2024.12.4: its loss, checkpoint offload, LoRA kernels and rotary caches changed since (vramcalc/terms/unsloth.py). Default: 2026.8.19."),
    Opt("nf4_double_quant", bool, None, "bitsandbytes double quantization of the absmax (Linear4bit compress_statistics, HF bnb_4bit_use_double_quant, Lightning 'nf4-dq'). Default: on."),
    Opt("quantize_head", bool, False, "QLoRA: lm_head in NF4 too (Lightning's "
        "BitsandbytesPrecision replaces every nn.Linear; transformers keeps the head out)."),
    Opt("load", str, "none", "Model the load phase (the peak while the model is loaded "
        "and prepared): none | hf (transformers 5 from_pretrained in the checkpoint dtype; "
        "QLoRA quantized on load, one weight at a time) | hf-fp32 (from_pretrained without "
        "torch_dtype on transformers 4.x: fp32 weights on the GPU before a cast) | "
        "torchtune (model built on the GPU; QLoRA: torchao to_nf4 per weight) | meta "
        "(FSDP shards materialised from the meta device, one full parameter in flight).",
        ("none", "hf", "hf-fp32", "torchtune", "meta")),
    Opt("load_only", bool, False, "Report the memory right after the model is loaded, "
        "before any training step: the --load phase alone (weights, the loader's buffers in "
        "flight) and the CUDA context, e.g. --load hf-fp32 --load-only for "
        "from_pretrained(...).to('cuda'). Needs --load."),
    Opt("torch_version", str, None, "PyTorch release of the run, e.g. 1.10: before 1.11 "
        "softmax and log_softmax keep their input for backward too (encoder models); before "
        "1.13 the CUDA context loads every kernel at start (the GPU profile's context_eager_bytes);"
        " before 2.8 torchtitan's pipeline stages keep every micro-batch's output, before 2.7 "
        "an FSDP reduce-scatter input too (terms/pipelining.py). Default: a current release."),
    Opt("transformers_version", str, None, "transformers release of an HF Trainer run "
        "(--framework hf), e.g. 4.47.1: before 4.46 the model's forward upcasts the logits "
        "and returns them in fp32 (llama from 4.31, mistral, mixtral, qwen2, gemma, "
        "qwen2_moe, phi3); to 4.48 the loss keeps its fp32 upcast and makes a contiguous "
        "fp32 copy of the shifted logits (4.49 pads the labels instead); the Trainer's AdamW "
        "is adamw_hf before 4.32, foreach before 4.54, and gradient checkpointing reentrant "
        "before 5.0. 4.31 or later. Default: 5.x."),
    Opt("dp", int, None, "Data-parallel degree (default: GPUs / (tp x pp x cp)).", group="parallel"),
    Opt("tp", int, 1, "Tensor-parallel degree.", group="parallel"),
    Opt("pp", int, 1, "Pipeline-parallel degree.", group="parallel"),
    Opt("cp", int, 1, "Context-parallel degree.", group="parallel"),
    Opt("ep", int, 1, "Expert-parallel degree (MoE).", group="parallel"),
    Opt("etp", int, None, "Expert tensor-parallel degree (MoE, megatron profile: Megatron-LM "
        "--expert-tensor-parallel-size; default: tp).", group="parallel"),
    Opt("sequence_parallel", bool, False, "Megatron sequence parallelism (needs tp > 1).",
        group="parallel"),
    Opt("zero", int, 0, "ZeRO stage 0-3 (DeepSpeed).", group="parallel"),
    Opt("fsdp", str, "none", "FSDP sharding: none | full | grad-op | hybrid.", _FSDP,
        group="parallel"),
    Opt("fsdp_impl", str, None, "Which PyTorch FSDP shards the --fsdp layouts: fsdp2 "
        "(fully_shard, per-parameter shards) | fsdp1 (FullyShardedDataParallel: one flat "
        "parameter per transformer block and one for the root, use_orig_params=True; a block "
        "mixing frozen and trained weights gets a gradient for all of them). Default: the "
        "stack's (lightning: fsdp1, as Lightning's FSDPStrategy; else fsdp2).",
        ("fsdp2", "fsdp1"), group="parallel"),
    Opt("fsdp_edge_units", bool, False, "FSDP2: shard the embedding and the output "
        "projection as units of their own, resharded after forward like the blocks, "
        "instead of in the root, which keeps them unsharded from forward to the end of "
        "backward (torchtune's custom_sharded_layers: ['tok_embeddings', 'output'], set in "
        "its Llama 3/3.1 8B and 70B full fine-tune configs).", group="parallel"),
    Opt("shard_group", int, None, "Ranks per shard group: --fsdp hybrid's, or one Megatron-LM "
        "distributed-optimizer instance (--zero 1; dp x cp / its "
        "--num-distributed-optimizer-instances).", group="parallel"),
    Opt("offload", str, "none", "Offload, comma-separated: optimizer,gradients,params.",
        _OFFLOAD, group="parallel"),
    Opt("offload_device", str, "cpu", "Offload target: cpu | nvme.", ("cpu", "nvme"),
        group="parallel"),
    Opt("pp_schedule", str, "1f1b", "Pipeline schedule: 1f1b | interleaved | gpipe.", _PP_SCHED,
        group="parallel"),
    Opt("virtual_stages", int, 1, "Virtual stages per rank (interleaved schedule).",
        group="parallel"),
    Opt("pp_group_size", int, None, "Megatron-LM's --microbatch-group-size-per-virtual-"
        "pipeline-stage (interleaved): micro-batches per chunk in turn; default --pp.",
        group="parallel"),
    Opt("first_stage_layers", int, None, "Layers on the first pipeline stage (Megatron-LM "
        "--decoder-first-pipeline-num-layers); the rest split evenly.", group="parallel"),
    Opt("last_stage_layers", int, None, "Layers on the last pipeline stage (Megatron-LM "
        "--decoder-last-pipeline-num-layers); the rest split evenly.", group="parallel"),
    Opt("stage_layers", str, None, "Layers of each pipeline stage in order, comma-separated: "
        "pp x virtual-stages counts, stage s on rank s mod pp (torchtitan's "
        "--experimental.pipeline_parallel_split_points as counts). Default: an even split; "
        "the torchtitan profile splits uneven layers as torchtitan does.", group="parallel"),
    Opt("embedding_in_split", bool, False, "Count the embedding as one layer of the first "
        "pipeline stage (Megatron-LM --account-for-embedding-in-pipeline-split).",
        group="parallel"),
    Opt("loss_in_split", bool, False, "Count the loss as one layer of the last pipeline "
        "stage (Megatron-LM --account-for-loss-in-pipeline-split).", group="parallel"),
    Opt("mtp_layers", int, None, "Multi-token prediction depths (Megatron-LM "
        "--mtp-num-layers; megatron profile): each adds a transformer layer, norms, eh_proj "
        "and a second loss to the last pipeline stage. Default 0.", group="parallel"),
    Opt("defer_embedding_wgrad", int, None, "Megatron-LM's --defer-embedding-wgrad-compute "
        "with --wgrad-deferral-limit N (0: all): the last stage keeps N micro-batches' output-"
        "layer input and logits gradient until the step's flush.", group="parallel"),
    Opt("num_microbatches", int, None, "Micro-batches per step for pipeline parallelism "
        "(default: --grad-accum).", group="parallel"),
    Opt("capacity_factor", float, 1.0, "MoE token capacity factor.", group="parallel"),
    Opt("headroom", float, 0.0, "Fraction of device memory kept free for the fit check "
        "(0.05 = 5%).", group="cluster"),
)
OPTIONS_BY_NAME = {o.name: o for o in SCENARIO_OPTIONS}
# a stack's precision when --precision is not given: torchtitan's FSDP2 mixed precision
# (fp32 parameters, bf16 compute: torchtitan 9dec370 config_manager.py
# mixed_precision_param bfloat16), torchtune's `dtype: bf16` (no fp32 master copy)
STACK_PRECISION = {"torchtitan": "amp-bf16", "torchtune": "bf16-pure"}

# the options each model takes (offload is parsed before ParallelConfig sees it)
_TRAINING_KEYS = tuple(n for n in OPTIONS_BY_NAME if n in TrainingConfig.model_fields)
_PARALLEL_KEYS = tuple(n for n in OPTIONS_BY_NAME
                       if n in ParallelConfig.model_fields and n != "offload")


def check_choice(opt: Opt, value: str) -> str:
    """Validate one choice value (case-insensitive), with suggestions."""
    assert opt.choices is not None
    v = str(value).strip().lower()
    v = LIGHTNING_PRECISIONS.get(v, v) if opt.name == "precision" else v
    if v not in opt.choices:
        raise InputError(
            f"{opt.flag}: unknown value {value!r}{suggest(v, opt.choices)} "
            f"(choices: {', '.join(opt.choices)})"
        )
    return v


def _coerce(opt: Opt, value: Any) -> Any:
    if value is None:
        return None
    if opt.kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "yes", "1", "on"):
            return True
        if str(value).lower() in ("false", "no", "0", "off"):
            return False
        raise InputError(f"{opt.flag}: expected true or false, got {value!r}")
    if opt.kind is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise InputError(f"{opt.flag}: expected a whole number, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise InputError(f"{opt.flag}: expected a whole number, got {value!r}") from None
    if opt.kind is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise InputError(f"{opt.flag}: expected a number, got {value!r}") from None
    if not isinstance(value, (str, int, float)):
        raise InputError(f"{opt.flag}: expected a string, got {type(value).__name__}")
    if opt.name.endswith("_version") and isinstance(value, float):  # YAML reads 4.50 as 4.5
        raise InputError(f"{opt.flag}: put the release in quotes (YAML read it as the number "
                         f"{value!r}, which loses trailing zeros: 1.10 becomes 1.1)")
    return str(value)


def parse_offload(value: Any) -> tuple[str, ...]:
    """'optimizer,params' or a list -> ('optimizer', 'params'); 'none' -> ()."""
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    out: list[str] = []
    opt = OPTIONS_BY_NAME["offload"]
    for item in items:
        v = check_choice(opt, str(item).strip())
        if v != "none" and v not in out:
            out.append(v)
    return tuple(out)


def parse_stage_layers(value: Any) -> tuple[int, ...]:
    """'15,16,16' or a list of integers -> (15, 16, 16): positive layer counts."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    if not 0 < len(items) <= 100_000:
        raise InputError(f"--stage-layers: expected 1 to 100,000 counts, got {len(items):,}")
    out: list[int] = []
    for item in items:
        text = str(item).strip()
        if isinstance(item, bool) or not text.isdigit() or len(text) > 7 or int(text) < 1:
            raise InputError("--stage-layers: expected comma-separated positive layer counts "
                             f"(e.g. 15,16,16,15), got {str(value)[:80]!r}")
        out.append(int(text))
    return tuple(out)


def _validated(cls: Any, values: dict[str, Any]) -> Any:
    """`cls(**values)` (TrainingConfig, ParallelConfig) from values normalize_values coerced
    and choice-checked, so what the model rejects is a bound: raised as InputError naming
    the option's flag, e.g. `--seq-len: Input should be greater than 0 (got -5)`."""
    try:
        return cls(**values)
    except ValidationError as err:
        first = err.errors()[0]
        loc = first.get("loc") or ()
        name = str(loc[0]) if loc else ""
        cause = (first.get("ctx") or {}).get("error")
        if name not in values:  # a check across fields: its own words
            raise InputError(str(cause) if cause else first["msg"]) from None
        raise InputError(f"--{name.replace('_', '-')}: {first['msg']} "
                         f"(got {values[name]!r})") from None


# values with a parser of their own (offload's also turns None into "none")
_PARSERS = {"offload": parse_offload, "lora_targets": parse_targets,
            "stage_layers": parse_stage_layers, "modules_to_save": parse_modules_to_save,
            "peft_config": checked_peft_config}


def normalize_values(values: dict[str, Any]) -> dict[str, Any]:
    """Check names, coerce types and choices; fill defaults. Unknown keys raise."""
    out: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in OPTIONS_BY_NAME:
            raise InputError(f"unknown option {key!r}{suggest(key, list(OPTIONS_BY_NAME))}")
        opt = OPTIONS_BY_NAME[key]
        if key in _PARSERS and (raw is not None or key == "offload"):
            out[key] = _PARSERS[key](raw)
            continue
        v = _coerce(opt, raw)
        if v is not None and opt.choices:
            v = check_choice(opt, v)
        out[key] = v
    if out.get("precision") is None:  # the stack's own default
        out["precision"] = STACK_PRECISION.get(out.get("framework") or "reference", "bf16")
    if out.get("peft_config") is not None and out.get("finetune") in (None, "full"):
        out["finetune"] = "peft"  # --peft-config implies --finetune peft
    for opt in SCENARIO_OPTIONS:
        out.setdefault(opt.name, parse_offload(opt.default) if opt.name == "offload"
                       else opt.default)
    return out


def build_scenario(values: dict[str, Any], profile_dirs: list[Path] | None = None,
                   deepspeed: DeepSpeedConfig | None = None) -> Scenario:
    """Resolve model and GPUs and build a validated Scenario from option values (and the
    DeepSpeed keys of a DeepSpeed JSON, vramcalc.ds_json)."""
    v = normalize_values(values)
    if not v.get("model"):
        raise InputError("--model is required (e.g. --model 70b or --model path/to/config.json)")
    spec, model_note = resolve_model(str(v["model"]))
    if v["task"] is not None:
        spec = with_task(spec, v["task"])
    if v["seq_len"] is None and (short := short_default_length(spec)) is not None:
        v["seq_len"], model_note = short[0], "; ".join(n for n in (model_note, short[1]) if n)
    cluster = parse_gpus(str(v["gpus"]), profile_dirs)
    gpu_name = str(v["gpus"]).replace("*", "x").replace("X", "x").split("x")[-1]
    gpu_note = alias_note(gpu_name, cluster.gpu)
    headroom = v["headroom"]
    if not 0 <= headroom < 1:
        raise InputError(f"--headroom must be a fraction in [0, 1), got {headroom}")
    training = _validated(TrainingConfig,
                          {k: v[k] for k in _TRAINING_KEYS if v[k] is not None})
    parallel = _validated(ParallelConfig, {
        "offload": v["offload"], **{k: v[k] for k in _PARALLEL_KEYS if v[k] is not None},
        **({"deepspeed": deepspeed} if deepspeed is not None else {})})
    scn = Scenario.model_construct(model=spec, training=training, parallel=parallel,
                                   cluster=cluster, headroom_fraction=headroom,
                                   model_note=model_note, gpu_note=gpu_note)
    return scn.resolved()


def check_bounds(values: dict[str, Any]) -> None:
    """Each value's own bounds, as `build_scenario` checks them (the TrainingConfig /
    ParallelConfig field constraints), without the checks across fields: how `plan`
    validates the layout values it pins before searching the others."""
    for key, value in values.items():
        cls = (TrainingConfig if key in _TRAINING_KEYS
               else ParallelConfig if key in _PARALLEL_KEYS else None)
        if cls is None or value is None:
            continue
        field = cls.model_fields[key]
        try:
            adapter: TypeAdapter[Any] = TypeAdapter(
                Annotated[field.annotation, field])  # type: ignore[arg-type]
            adapter.validate_python(value)
        except ValidationError as err:
            raise InputError(f"--{key.replace('_', '-')}: {err.errors()[0]['msg']} "
                             f"(got {value!r})") from None
