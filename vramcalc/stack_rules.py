"""Which training settings each stack profile can run: one function per rule, asked by
TrainingConfig's validators (vramcalc/training.py) and by the planner for every precision,
optimizer and method it tries. Each returns why the settings cannot be expressed, or None;
`torchtitan_split` fills in torchtitan's own pipeline split. `tr` is a TrainingConfig
(typed loosely: this module sits below vramcalc/training.py and vramcalc/parallel.py)."""

from __future__ import annotations

from typing import Any

from vramcalc.errors import InputError
from vramcalc.qlora import parse_version

# the oldest Unsloth release vramcalc models, its first on PyPI (vramcalc/terms/unsloth.py)
UNSLOTH_OLDEST = (2024, 8, 0)
# torchtune releases (pytorch/torchtune tags) where what the profile models changed: its first
# release; PackedDataset, and `del logits` in lora_finetune_distributed (cb3ed29, #1046);
# labels shifted by `torch.hstack` in place of the recipe's logits slice, CEWithChunkedOutputLoss,
# `compile_loss` and FSDP2's `shard_model`; OffloadActivations and the configs' fused AdamW
# (cca50f0, #1575) (vramcalc/terms/torchtune.py)
TORCHTUNE_OLDEST, TORCHTUNE_0_2, TORCHTUNE_0_3, TORCHTUNE_0_3_1 = (
    (0, 1, 0), (0, 2, 0), (0, 3, 0), (0, 3, 1))
# model builders that make one RoPE module for all layers (pytorch/torchtune 23896c30, #2282);
# Llama 3.1's did from v0.3.1 (b0895a79, #1554) (vramcalc/terms/torchtune.py `rope_modules`)
TORCHTUNE_0_6 = (0, 6, 0)
# torchtune's main branch after v0.6.1 (version.txt 0.7.0): LinearCrossEntropyLoss (9c06c8bd)
TORCHTUNE_0_7 = (0, 7, 0)


def torchtune_before(tr: Any, release: tuple[int, ...]) -> bool:
    """Whether --torchtune-version names a release older than `release` (not given: the
    current one, which is not)."""
    return tr.torchtune_version is not None and parse_version(tr.torchtune_version) < release


def torchtitan_training_problem(tr: Any) -> str | None:
    """Why the torchtitan profile cannot express these training settings (None: it can).
    What torchtitan 9dec370 runs: torch.optim Adam / AdamW only (torchtitan/optimizer.py
    OptimizersContainer), foreach or fused (`"foreach": not fused`); fp32 parameters, in
    bf16 only through FSDP2's MixedPrecisionPolicy (config_manager.py
    --training.mixed_precision_param: bfloat16 | float32), no autocast; SDPA attention
    (models/llama/model.py Attention.forward); full training (no adapters, no QAT); float8
    is torchao's Float8Linear (float8.py `Float8Handler`, --float8: modelled compiled, in
    bf16 compute); torch.compile per block (parallelize_llama.py `apply_compile`, after AC
    wrapping: --compile, with full AC, none, or per-op SAC without fp8 all-gather,
    vramcalc/terms/torchtitan_compile.py); no
    chunked loss or activation offload."""
    flag = None
    if tr.float8_all_gather and not tr.float8:
        flag = ("--float8-all-gather needs --float8: torchao's fp8 all-gather casts the "
                "weights of Float8Linear layers (float8.py `Float8Handler`)")
    elif tr.float8 and not (tr.compile and tr.precision == "amp-bf16"):
        flag = ("--float8 needs --compile and --precision amp-bf16: torchtitan runs torchao's "
                "float8 linears under torch.compile in bf16 (float8.py: \"intended to be ran "
                "under torch.compile\"); the eager Float8Linear's saved set is not modelled")
    elif tr.async_tp and not tr.compile:
        flag = ("--async-tp needs --compile: torchtitan's async TP is inductor's micro-pipeline "
                "pass (torch._inductor.config._micro_pipeline_tp), which eager mode never runs")
    elif tr.compile and tr.float8_all_gather and tr.recompute == "selective" and (
            tr.recompute_every is None):
        flag = ("--float8-all-gather with per-op SAC (--recompute selective) under "
                "--compile: what the partitioner keeps of the gathered fp8 weights under "
                "torchtitan's SAC policy is not modelled (use --recompute full or none, or "
                "--recompute-every N)")
    elif tr.precision not in ("fp32", "amp-bf16"):
        flag = (f"--precision {tr.precision}: torchtitan keeps fp32 parameters and computes "
                "in bf16 only through FSDP2's mixed precision (use --precision amp-bf16 with "
                "--fsdp full, or fp32)")
    elif tr.optimizer not in ("adamw", "adam"):
        flag = (f"--optimizer {tr.optimizer}: torchtitan builds torch.optim Adam or AdamW "
                "only")
    elif tr.optimizer_impl == "loop" or tr.optimizer_dtype not in (None, "fp32"):
        flag = ("--optimizer-impl loop / --optimizer-dtype bf16: torchtitan steps with "
                "foreach (default) or fused kernels, fp32 states")
    elif tr.attention != "flash":
        flag = "--attention eager: torchtitan's Llama always calls SDPA (use flash)"
    elif tr.finetune != "full" or tr.qat != "none":
        flag = "torchtitan trains every weight: no LoRA/QLoRA/DoRA or QAT"
    elif tr.chunked_ce > 1 or tr.activation_offload:
        flag = "torchtitan has no chunked cross entropy or activation offload"
    return None if flag is None else flag + " (torchtitan profile)"


def stack_training_problem(tr: Any) -> str | None:
    """Why the stack profile cannot run these training settings (None: it can); the
    planner asks it of every precision / optimizer / method it tries."""
    if tr.framework == "torchtitan":
        return torchtitan_training_problem(tr)
    return unsloth_training_problem(tr) or torchtune_training_problem(tr)


def lightning_training_problem(tr: Any) -> str | None:
    """Why these settings use a LitGPT option outside the lightning profile (None: they
    don't): `--litgpt-norm` names the RMSNorm of a LitGPT checkout (vramcalc/terms/
    saved_layers.py `norm_saved`)."""
    if tr.litgpt_norm is not None and tr.framework != "lightning":
        return f"--litgpt-norm {tr.litgpt_norm}: LitGPT's RMSNorm needs --framework lightning"
    return None


def unsloth_training_problem(tr: Any) -> str | None:
    """Why the unsloth profile cannot express these training settings (None: it can). What
    it models (unslothai/unsloth 015bdef0, unsloth-zoo ce232d6c; vramcalc/terms/unsloth.py):
    LoRA / QLoRA through `FastLanguageModel.get_peft_model` (adapters upcast to fp32, the
    base in its 16-bit dtype: --precision bf16 or fp16); `use_gradient_checkpointing`
    "unsloth" (--recompute full) or False (none), no selective mode; its own attention
    kernels (flash); its fused cross entropy, no --chunked-ce."""
    if tr.framework != "unsloth":
        return None if tr.unsloth_version is None else (
            "--unsloth-version names the release --framework unsloth models")
    flag = None
    if tr.unsloth_version is not None and parse_version(tr.unsloth_version) < UNSLOTH_OLDEST:
        flag = (f"--unsloth-version {tr.unsloth_version}: vramcalc models Unsloth's PyPI "
                f"releases, the first {'.'.join(map(str, UNSLOTH_OLDEST[:2]))}")
    elif tr.finetune not in ("lora", "qlora"):
        flag = (f"--finetune {tr.finetune}: the unsloth profile models get_peft_model's "
                "LoRA and QLoRA (use --finetune lora or qlora)")
    elif tr.precision not in ("bf16", "fp16"):
        flag = (f"--precision {tr.precision}: Unsloth keeps the base model in its 16-bit "
                "dtype and the adapters in fp32 (use --precision bf16, or fp16 on cards "
                "without bf16)")
    elif tr.recompute == "selective":
        flag = ("--recompute selective: Unsloth checkpoints whole layers "
                "(use_gradient_checkpointing='unsloth': --recompute full) or none")
    elif tr.attention != "flash":
        flag = "--attention eager: Unsloth runs its own attention kernels (use flash)"
    elif tr.chunked_ce > 1 or tr.activation_offload:
        flag = ("--chunked-ce / --activation-offload: Unsloth has its own fused cross "
                "entropy and checkpoint offload (leave them out)")
    return None if flag is None else flag + " (unsloth profile)"


def optimizer_in_backward_problem(tr: Any) -> str | None:
    """Why --optimizer-in-backward cannot be modelled with these training settings (None: it
    can). torchtune (pytorch/torchtune bd2a0fc) refuses gradient accumulation with it
    (recipes/full_finetune_single_device.py: "Gradient accumulation is not supported with
    optimizer_in_bwd: True"); its recipes train in bf16 or fp32 parameters with no fp32
    master copy (`training.get_dtype`), so the mixed-precision wrapper's master step is not
    modelled; the megatron and torchtitan profiles step their own optimizers after
    backward."""
    flag = None
    if tr.grad_accum > 1:
        flag = (f"--grad-accum {tr.grad_accum}: gradients are stepped and freed inside each "
                "backward, so they cannot accumulate (torchtune refuses gradient "
                "accumulation with optimizer_in_bwd); use --grad-accum 1")
    elif tr.framework not in ("reference", "hf", "torchtune"):
        flag = (f"--framework {tr.framework}: only the reference, hf and torchtune profiles "
                "model it "
                "(torchtune's per-parameter optimizers)")
    elif tr.has_master_weights:
        flag = (f"--precision {tr.precision}: the fp32 master copy's step is not modelled "
                "inside backward (torchtune trains bf16 or fp32 parameters: use --precision "
                "bf16-pure, fp32 or amp-bf16)")
    return None if flag is None else "--optimizer-in-backward with " + flag


def torchtune_training_problem(tr: Any) -> str | None:
    """Why these training settings cannot be expressed (None: they can) — for the torchtune
    profile, what torchtune's single-device recipes run (pytorch/torchtune 1814feb):
    parameters in `dtype: bf16` or fp32 (`training.get_dtype`; no autocast, no fp32 master
    copy: --precision bf16-pure or fp32); SDPA or flex attention (torchtune/modules/
    attention.py `_attention_call`: --attention flash); activation offloading only with
    activation checkpointing (recipes/full_finetune_single_device.py raises "enable_
    activation_offloading should only be True when enable_activation_checkpointing is
    True"). --compile belongs to the torchtune and torchtitan profiles only, --float8 to
    torchtitan's."""
    flag = None
    if tr.framework != "torchtune":
        if tr.torchtune_version is not None:
            flag = "--torchtune-version names the release --framework torchtune models"
        elif (tr.float8 or tr.float8_all_gather) and tr.framework != "torchtitan":
            name = "--float8" if tr.float8 else "--float8-all-gather"
            flag = (f"{name}: torchao's Float8Linear is modelled for the torchtitan profile "
                    f"only, not {tr.framework} (use --framework torchtitan)")
        elif tr.async_tp and tr.framework != "torchtitan":
            flag = (f"--async-tp: async tensor parallelism is modelled for the torchtitan "
                    f"profile only, not {tr.framework} (use --framework torchtitan)")
        elif tr.activation_offload and tr.recompute == "full":
            # features.offloads_activations: outside torchtune the inputs would stay, which
            # no stack's offloading does (TRL's and torchtune's hooks wrap the checkpoints)
            flag = ("--activation-offload with --recompute full is modelled for --framework "
                    "torchtune, whose recipes' hooks around the model's forward move each "
                    "layer's checkpoint input to the host; TRL's activation_offloading and "
                    "transformers' checkpoint offload are not modelled")
        elif tr.packed:
            flag = (f"--packed: packed sequences are modelled for the torchtune profile only "
                    f"(PackedDataset's input_pos and document mask), not {tr.framework} (use "
                    "--framework torchtune, or leave it out)")
        elif tr.compile and tr.framework != "torchtitan":
            flag = (f"--compile: only the torchtune and torchtitan profiles model "
                    f"torch.compile; not the {tr.framework} profile (use --framework "
                    "torchtune or torchtitan, or leave it out)")
        return flag
    if torchtune_before(tr, TORCHTUNE_OLDEST):
        flag = f"--torchtune-version {tr.torchtune_version}: vramcalc models 0.1.0 and later"
    elif torchtune_before(tr, TORCHTUNE_0_3) and (tr.chunked_ce > 1 or tr.compile):
        flag = (f"--torchtune-version {tr.torchtune_version}: chunked cross entropy and the "
                "compiled layers and loss came in 0.3.0 (before it `compile: True` compiled "
                "the whole model, which is not modelled)")
    elif torchtune_before(tr, TORCHTUNE_0_3_1) and tr.activation_offload:
        flag = (f"--torchtune-version {tr.torchtune_version}: activation offloading came in "
                "0.3.1")
    elif torchtune_before(tr, TORCHTUNE_0_2) and tr.packed:
        flag = f"--torchtune-version {tr.torchtune_version}: PackedDataset came in 0.2.0"
    elif tr.precision not in ("bf16-pure", "fp32"):
        flag = (f"--precision {tr.precision}: torchtune trains in its `dtype` (bf16 or fp32 "
                "parameters, gradients and optimizer states, no autocast and no fp32 master "
                "copy): use --precision bf16-pure or fp32")
    elif tr.attention != "flash":
        flag = ("--attention eager: torchtune's attention calls SDPA or flex attention "
                "(use flash)")
    elif tr.activation_offload and tr.recompute != "full":
        flag = ("--activation-offload: torchtune offloads activations only with activation "
                "checkpointing on (add --recompute full)")
    elif tr.float8 or tr.float8_all_gather:
        flag = "--float8: torchao's Float8Linear is modelled for the torchtitan profile only"
    elif tr.recompute == "selective":
        flag = ("--recompute selective: torchtune's recipes checkpoint whole layers "
                "(enable_activation_checkpointing: use --recompute full or none)")
    elif tr.packed and tr.packed_mask == "dense" and tr.compile:
        flag = ("--packed --compile on a GPU without flex attention: what a compiled layer "
                "keeps around SDPA with a dense block-causal mask is not modelled (leave "
                "--compile out)")
    return None if flag is None else flag + " (torchtune profile)"


# torchtune 1814feb torchtune/utils/_import_guard.py: `_SUPPORTS_FLEX_ATTENTION =
# torch.cuda.is_available() and torch.cuda.get_device_capability() >= (7, 5)` (the torch >= 2.5
# check was removed in 65d07c9, "remove PyTorch 2.5.0 checks": 1814feb needs torch >= 2.5)
FLEX_MIN_CAPABILITY = (7, 5)


def torchtune_packed_mask(gpu: Any) -> tuple[str | None, str | None]:
    """(mask kind, problem) for torchtune's packed batches on `gpu` (a GPUProfile, or None
    for no GPU: flex, the usual case). torchtune/modules/attention_utils.py
    `packed_block_causal_mask` returns a flex-attention BlockMask when
    `_SUPPORTS_FLEX_ATTENTION` (a CUDA device of compute capability >= 7.5), else a dense
    (b, s, s) bool block-causal mask for SDPA. torch.cuda is not available on NPU / HPU
    runtimes (dense mask into the vendor's SDPA: not modelled); a CUDA or ROCm profile
    without `cuda_capability` cannot be placed."""
    if gpu is None:
        return "flex", None
    if gpu.memory_api not in ("cuda", "rocm"):
        return None, (f"--packed on {gpu.name}: torch.cuda is not available there, so "
                      "torchtune passes a dense block-causal mask to the device's own SDPA, "
                      "which is not modelled")
    if gpu.cuda_capability is None:
        return None, (f"--packed on {gpu.name}: its GPU profile gives no cuda_capability, "
                      "which decides between torchtune's flex-attention BlockMask (>= 7.5) "
                      "and a dense mask (add cuda_capability to the profile)")
    major, minor = (int(v) for v in gpu.cuda_capability.split("."))
    return ("flex" if (major, minor) >= FLEX_MIN_CAPABILITY else "dense"), None


def torchtune_layout_problem(par: Any) -> str | None:
    """What torchtune 1814feb's recipes run: one GPU, or data parallelism with FSDP2
    (`training.shard_model` applies `fully_shard` in the *_distributed recipes, resharding
    after forward unless `fsdp_reshard_after_forward: False`: --fsdp full or grad-op); no
    tensor, pipeline, context or expert parallelism, no DeepSpeed ZeRO. `fsdp_cpu_offload:
    True` passes FSDP2's CPUOffloadPolicy to every `fully_shard` (`shard_model`: parameters,
    gradients and the optimizer step on the host), --offload params as for any FSDP2 run.
    `par` is a resolved ParallelConfig."""
    problem = None
    if max(par.tp, par.pp, par.cp, par.ep) > 1:
        problem = "torchtune (1814feb) has no tensor, pipeline, context or expert parallelism"
    elif par.zero:
        problem = "--zero is DeepSpeed's: torchtune shards with FSDP2 (use --fsdp full)"
    elif par.dp_degree > 1 and par.fsdp not in ("full", "grad-op"):
        problem = "torchtune's distributed recipes shard with FSDP2 (add --fsdp full)"
    return problem + " (torchtune profile)" if problem else None


def edge_units_problem(spec: Any, par: Any, framework: str) -> str | None:
    """--fsdp-edge-units (torchtune's `custom_sharded_layers: ['tok_embeddings', 'output']`,
    recipes/full_finetune_distributed.py): a `fully_shard` on the embedding and one on the
    output projection, so FSDP2 sharding, a head of its own (untied) and one pipeline
    stage (the root's place is modelled for the whole model)."""
    if not par.fsdp_edge_units:
        return None
    if par.fsdp == "none" or par.flat_fsdp(framework):
        return "--fsdp-edge-units shards with FSDP2: add --fsdp full (and no --fsdp-impl fsdp1)"
    if spec.tie_word_embeddings:
        return (f"--fsdp-edge-units needs an output projection of its own: {spec.name} ties "
                "it to the embedding")
    if par.pp > 1:
        return "--fsdp-edge-units is modelled without pipeline parallelism"
    return None


def torchtitan_layout_problem(spec: Any, training: Any, par: Any) -> str | None:
    """What torchtitan 9dec370 cannot run (torchtitan/parallelisms/parallelize_llama.py
    `parallelize_llama`, models/llama/model.py): its Llama only; FSDP2 whenever dp_shard or
    cp > 1 (`apply_fsdp`), DDP only as the sole parallelism ("DDP has not supported > 1D
    parallelism"), no DeepSpeed ZeRO; TP always with sequence-parallel norms (`apply_tp`);
    FSDP2 blocks keep their parameters unsharded after forward only under PP
    (`reshard_after_forward = False` when pp_enabled, grad-op); bf16 compute only through
    FSDP2's MixedPrecisionPolicy; no expert parallelism (no MoE model). torch.compile
    under TP or CP is modelled with full AC only (`apply_ac` wraps each block before
    `apply_compile`: the compiled region keeps the block's input shard). `spec`, `training`
    and `par` are a ModelSpec, TrainingConfig and resolved ParallelConfig."""
    llama = (not spec.is_moe and spec.norm_kind == "rmsnorm" and spec.mlp_kind == "gated"
             and spec.position_embedding == "rope" and spec.hidden_act in ("silu", "swish")
             and not (spec.attention_bias or spec.attention_out_bias or spec.mlp_bias
                      or spec.qk_norm or spec.tie_word_embeddings) and spec.final_norm)
    problem = None
    if not llama:
        problem = (f"{spec.name} is not a Llama-architecture model (torchtitan's "
                   "models/llama: RMSNorm, RoPE, SwiGLU, no biases, untied embeddings, dense)")
    elif par.zero:
        problem = "--zero is DeepSpeed's: torchtitan shards with FSDP2 (use --fsdp full)"
    elif par.fsdp == "none" and par.cp > 1:
        problem = "torchtitan runs context parallelism inside FSDP2 (add --fsdp full)"
    elif par.fsdp == "none" and par.dp_degree > 1 and (par.tp > 1 or par.pp > 1):
        problem = ("torchtitan's DDP runs alone (\"DDP has not supported > 1D parallelism\"): "
                   "add --fsdp full")
    elif par.fsdp == "none" and training.precision != "fp32":
        problem = (f"--precision {training.precision}: torchtitan computes in bf16 only "
                   "through FSDP2's MixedPrecisionPolicy (add --fsdp full, or use fp32)")
    elif training.float8_all_gather and (par.fsdp == "none" or par.shard_degree // par.cp < 2):
        problem = ("--float8-all-gather needs FSDP sharding over dp > 1: torchtitan enables "
                   "it only when dp_shard > 1 (float8.py: parallel_dims.dp_shard_enabled)")
    elif training.compile and (par.tp > 1 or par.cp > 1) and training.recompute != "full":
        problem = (f"--compile with --{'tp' if par.tp > 1 else 'cp'} needs --recompute full: a "
                   "checkpointed compiled block keeps only its input, but what the partitioner "
                   "keeps around DTensor collectives and context-parallel SDPA without full AC "
                   "is not modelled")
    elif training.async_tp and par.tp == 1:
        problem = "--async-tp overlaps tensor-parallel collectives: it needs --tp > 1"
    elif par.tp > 1 and not par.sequence_parallel:
        problem = "torchtitan's tensor parallelism always shards the norms over the sequence "\
            "(add --sequence-parallel)"
    elif par.fsdp == "grad-op" and par.pp == 1:
        problem = "torchtitan keeps blocks unsharded after forward only under PP: use --fsdp full"
    elif par.fsdp in ("full", "hybrid") and par.pp > 1:
        problem = ("torchtitan's FSDP2 does not reshard after forward under PP: use --fsdp "
                   "grad-op with --pp")
    return problem + " (torchtitan profile)" if problem else None


# the transformers architectures `_apply_liger_kernel_to_instance` patches with Liger's
# RMSNorm, SwiGLU, RoPE and fused linear cross entropy (Liger-Kernel ead96b61
# transformers/monkey_patch.py MODEL_TYPE_TO_APPLY_LIGER_FN)
LIGER_MODEL_TYPES = ("llama", "mistral", "qwen2")


def liger_problem(spec: Any, training: Any, par: Any) -> str | None:
    """What `--liger` cannot express (vramcalc/terms/liger.py); None: it can. `spec`,
    `training` and `par` are a ModelSpec, TrainingConfig and ParallelConfig."""
    if not training.liger:
        return None
    if (spec.model_type not in LIGER_MODEL_TYPES or spec.is_moe or spec.qk_norm
            or spec.mlp_kind != "gated" or spec.is_encoder or spec.is_encoder_decoder):
        return (f"--liger is modelled for dense Llama, Mistral and Qwen2 decoders (Liger's "
                f"apply_liger_kernel_to_llama, _mistral, _qwen2); {spec.name} is not one")
    if par.tp > 1 or par.pp > 1 or par.cp > 1:
        return "--liger is modelled with data parallelism only (no --tp, --pp or --cp)"
    return None


def activation_problem(spec: Any, tr: Any) -> str | None:
    """Why this MLP activation cannot be modelled for the stack, or None. A gated relu2 runs
    its gate product on the square's fp32 output under autocast (not modelled); Megatron-LM's
    MLP activations are GeLU, SwiGLU and --squared-relu (relu2, 2-matrix)."""
    act, gated = spec.hidden_act, spec.mlp_kind == "gated"
    if gated and act == "relu2":
        return f"{spec.name}: a gated MLP with relu2 is not modelled (2-matrix relu2 is)"
    if tr.framework == "megatron" and act == "relu":
        return (f"{spec.name}: Megatron-LM's MLP runs GeLU, SwiGLU or --squared-relu "
                f"(relu2), not hidden_act '{act}'")
    return None


def muon_problem(tr: Any, engine: str, tp: int = 1) -> str | None:
    """Why `--optimizer muon` cannot be modelled here, or None: torch.optim.Muon (torch 2.9+)
    on the layers' matrices beside AdamW, stepped by a training loop of one's own (the
    reference profile) on ranks that hold whole matrices (one GPU, DDP, and PP, CP or EP
    beside them); it orthogonalizes whole matrices, so sharded states (FSDP, ZeRO), tensor
    parallelism and the stacks' own Muon variants are not modelled."""
    if tr.optimizer != "muon":
        return None
    if tr.framework != "reference" or engine not in ("single", "ddp") or tp > 1:
        return ("--optimizer muon: torch.optim.Muon is modelled with --framework reference on "
                "one GPU or DDP (whole matrices; not FSDP, ZeRO, TP or a stack's own Muon)")
    if tr.finetune != "full" or tr.optimizer_in_backward or tr.optimizer_dtype:
        return ("--optimizer muon: modelled for full training, stepped after backward, its "
                "momentum in the gradients' dtype")
    return None


def torchtitan_stage_layers(num_layers: int, stages: int) -> tuple[int, ...]:
    """torchtitan's default pipeline split (9dec370, torchtitan/parallelisms/
    pipelining_utils.py `generate_split_points`, used when no
    --experimental.pipeline_parallel_split_points is given): the first stage holds
    L // stages layers, the middle stages one more while the remainder lasts, then
    L // stages, and the last stage the rest."""
    base, extra = divmod(num_layers, stages)
    counts = [base]
    for _ in range(stages - 2):
        counts.append(base + (extra > 0))
        extra -= extra > 0
    return (*counts, num_layers - sum(counts))


def torchtitan_split(spec: Any, training: Any, parallel: Any) -> Any:
    """The torchtitan profile's layout with its own default split where the layers do not
    divide evenly over the pipeline stages and no split is given."""
    stages = parallel.pp * parallel.pp_chunks
    if (training.framework != "torchtitan" or parallel.pp == 1 or parallel.uneven_split
            or not spec.num_hidden_layers % stages):
        return parallel
    if stages > spec.num_hidden_layers:
        raise InputError(f"{stages} pipeline stages for {spec.num_hidden_layers} layers: "
                         "torchtitan needs a layer per stage at least")
    return parallel.model_copy(update={
        "stage_layers": torchtitan_stage_layers(spec.num_hidden_layers, stages)})
