"""The report's notes: one line per fact about a scenario a reader should know beside the
numbers (fine-tuning, activation offload, chunked cross entropy, paged optimizer states,
FP8 / QAT), with this scenario's figures. Text only: the numbers come from the terms."""

from __future__ import annotations

from vramcalc.features import chunks_loss, finetunes, low_precision
from vramcalc.finetune import fused_family, fused_groups, shapes_for
from vramcalc.hardware import GPUProfile
from vramcalc.hf_stack import trainer_no_sync
from vramcalc.model import ModelSpec
from vramcalc.peft_file import peft_type_of
from vramcalc.peft_moe import wrapped_parameters
from vramcalc.qlora import compiled_dequant_kept, nf4_tensor_bytes
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import fsdp1
from vramcalc.terms import linear_ce as lce
from vramcalc.terms.gradients import gradients_bytes
from vramcalc.terms.liger import chunk_tokens as liger_chunk_tokens
from vramcalc.terms.liger import saved_bytes as liger_saved_bytes
from vramcalc.terms.lowprec import (
    FP8_DIM_MULTIPLE,
    QAT_SCHEMES,
    block_linears,
    fp8_transpose,
    persistent_parts,
)
from vramcalc.terms.optimizer_states import paged_state_bytes
from vramcalc.terms.torchtitan_tp import async_tp_workspace_bytes
from vramcalc.terms.torchtune import rope_buffer_bytes, rope_shared_from, tune_rope
from vramcalc.terms.unsloth import unsloth_notes
from vramcalc.training import COMPUTE_DTYPE, TrainingConfig
from vramcalc.units import fmt_gb


def scenario_notes(scn: Scenario) -> list[str]:
    """Every note of a (resolved) scenario's report, in order: the model's and the GPU's
    notes, then the first rank's feature notes."""
    notes = []
    if scn.model_note:
        notes.append(scn.model_note)
    if scn.gpu_note:
        notes.append(scn.gpu_note)
    notes += capability_notes(scn.model, scn.training,
                              scn.cluster.gpu if scn.cluster is not None else None)
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    if fsdp1.flat(ctx):
        notes.append(_fsdp1_note(ctx))
    elif fsdp1.wrapped_adapters(ctx):
        notes.append(_WRAPPED_ADAPTERS.format(
            "torchtune's lora_fsdp_wrap_policy" if scn.training.framework == "torchtune"
            else "HF Trainer's PEFT fsdp_auto_wrap_policy (transformers 4.39 and later)"))
    if trainer_no_sync(scn.training, scn.parallel) and not fsdp1.flat(ctx):
        notes.append(f"HF Trainer runs every micro-batch but the last under accelerate's "
                     f"no_sync(): the sharded gradients are held unsharded, "
                     f"{fmt_gb(gradients_bytes(ctx))}, until the last one reduce-scatters "
                     "them (--sync-each-batch: accelerate's sync_each_batch=True reduces "
                     "every micro-batch and keeps only the shards)")
    positions, modules, _ = tune_rope(ctx)
    if scn.training.framework == "torchtune" and modules > 1:
        shared = ".".join(map(str, rope_shared_from(scn.model)))
        notes.append(f"torchtune {scn.training.torchtune_version}: every layer keeps its own "
                     f"copy of the RoPE cache ({positions:,} positions, fp32): "
                     f"{fmt_gb(rope_buffer_bytes(ctx))} for {modules} layers; releases from "
                     f"{shared} build one cache for all layers")
    notes += finetune_notes(ctx)
    if low_precision(scn.training):
        notes += lowprec_notes(ctx, scn.cluster.gpu if scn.cluster else None)
    return notes


_WRAPPED_ADAPTERS = (
    "FSDP1 with {}: each LoRA A and B is a unit of its own, "
    "each block's flat parameter is frozen (no gradient, resharded after the block's "
    "backward), so the bytes are per-parameter sharding's (vramcalc/terms/fsdp1.py)")


def _fsdp1_note(ctx: RankContext) -> str:
    """FSDP1's flat gradients, with this scenario's figure (vramcalc/terms/fsdp1.py)."""
    how = ("unsharded, accumulated under no_sync() until the last micro-batch"
           if fsdp1.no_sync(ctx) else "one shard per rank")
    mixed = (", use_orig_params=True: each block's frozen weights share its flat parameter "
             "with the adapters and get gradients too" if fsdp1.mixed_units(ctx) else "")
    return (f"FSDP1 flat parameters (FullyShardedDataParallel{mixed}); "
            f"gradients {fmt_gb(gradients_bytes(ctx))} ({how})")


def capability_notes(spec: ModelSpec, tr: TrainingConfig, gpu: GPUProfile | None) -> list[str]:
    """Warnings about what runs differently from what was asked (the combinations that cannot
    run as counted are refused by vramcalc/scenario.py `capability_problem`): a sequence past
    the model's trained context, bf16 on a GPU without BF16, flash attention where only
    PyTorch SDPA's memory-efficient kernel runs."""
    out: list[str] = []
    if tr.load_only:  # no training step: the sequence and the kernels do not run
        return out
    limit = spec.max_position_embeddings
    if spec.position_embedding == "learned" and tr.seq_len > limit:
        out.append(f"warning: --seq-len {tr.seq_len:,} exceeds {spec.name}'s learned position "
                   f"table ({limit:,} rows): the model cannot run sequences this long without "
                   "a larger table; memory is counted as asked")
    elif "max_position_embeddings" in spec.model_fields_set and tr.seq_len > limit:
        out.append(f"warning: --seq-len {tr.seq_len:,} exceeds {spec.name}'s trained context "
                   f"(max_position_embeddings={limit:,}): memory is counted as asked, but "
                   "the model was not trained on sequences this long")
    if gpu is None:
        return out
    if COMPUTE_DTYPE[tr.precision] == "bf16" and not gpu.bf16_supported:
        out.append(f"warning: {gpu.name} has no BF16 tensor cores (bf16_supported: "
                   "false): bf16 matmuls run without them; --precision amp-fp16 or fp16 is "
                   "the usual choice there")
    if tr.attention == "flash" and not gpu.flash_attention_2:
        out.append(f"warning: FlashAttention-2 does not run on {gpu.name}; --attention flash "
                   "counts PyTorch SDPA's memory-efficient kernel (fp16/fp32 there), which "
                   "keeps the same output and logsumexp")
    return out


_FUSED_MODULES = {("gpt2", "qkv"): "c_attn", ("phi3", "qkv"): "qkv_proj",
                  ("phi3", "gate_up"): "gate_up_proj"}


def _fused_target_note(spec: ModelSpec, tr: TrainingConfig) -> str | None:
    """Which fused module carries the adapters when targets name part of it (hf profile)."""
    fam = fused_family(spec, tr.framework)
    if fam is None:
        return None
    wanted = set(tr.lora_targets.split(","))
    parts = []
    for group, letters in fused_groups(spec, tr.framework).items():
        hit = list(letters) if "all-linear" in wanted else [x for x in letters if x in wanted]
        if hit:
            parts.append(f"{','.join(hit)} -> {_FUSED_MODULES[(fam, group)]} "
                         f"(one adapter for {', '.join(letters)})")
    if not parts:
        return None
    return (f"{spec.name} fuses projections under --framework hf: targets {'; '.join(parts)}, "
            "as PEFT adapts the fused module")


def finetune_notes(ctx: RankContext) -> list[str]:
    """Lines for the report's notes about fine-tuning, activation offload, chunked cross
    entropy and paged memory."""
    tr = ctx.training
    out: list[str] = []
    if tr.finetune == "peft":
        out.append(f"peft: {peft_type_of(tr.peft_config)} from --peft-config, built by PEFT's "
                   "get_peft_model on transformers' model (trace engine)")
    elif finetunes(tr):
        fs = shapes_for(ctx)
        n_train = fs.adapters.numel()
        n_all = n_train + fs.frozen.numel() + fs.quantized.numel()
        out.append(f"{tr.finetune}: r={tr.lora_rank}, targets {tr.lora_targets}: "
                   f"{n_train:,} trainable parameters ({100 * n_train / max(n_all, 1):.3f}% "
                   f"of this rank's {n_all:,}); the frozen base has no gradients or "
                   "optimizer states")
        fused = _fused_target_note(ctx.spec, tr)
        if fused:
            out.append(fused)
        wrapped = wrapped_parameters(ctx.spec, tr.framework, tr.finetune, tr.lora_targets,
                                     tr.transformers_version)
        if wrapped:  # vramcalc/peft_moe.py
            names = {"gate_up": "experts.gate_up_proj", "down": "experts.down_proj",
                     "router": "the router"}
            out.append(f"{ctx.spec.name}'s MoE layers: PEFT adapts "
                       f"{', '.join(names[w] for w in wrapped)} (transformers 5's fused "
                       "parameters); each step makes W + BA for them, one copy of the "
                       "layer's experts kept until its backward")
        if tr.finetune == "qlora":
            out.append(_qlora_note(tr))
    if tr.activation_offload:
        if tr.recompute == "full" and tr.framework == "torchtune":
            out.append("activation offload: each checkpointed layer's input waits in pinned "
                       "host memory (host RAM above); the layer is recomputed on the device "
                       "in backward")
        elif tr.recompute == "full":
            out.append("activation offload: nothing to offload beyond the checkpointed layer "
                       "inputs, which this model keeps on the device")
        else:
            out.append("activation offload: the layers' saved tensors wait in pinned host "
                       "memory (host RAM above); each comes back when its backward node runs")
    if tr.framework == "unsloth":
        out.extend(unsloth_notes(ctx))  # vramcalc/terms/unsloth.py
    if tr.liger and ctx.is_last_stage:
        out.append(f"liger: the fused linear cross entropy runs in chunks of "
                   f"{liger_chunk_tokens(ctx):,} tokens and makes no full logits; it keeps "
                   "dL/dhidden" + (" and the head's dL/dW" if tr.finetune == "full" else "")
                   + f" from the forward ({fmt_gb(liger_saved_bytes(ctx))})")
    if tr.trl_chunked_ce and ctx.is_last_stage:
        out.append("trl: chunked_nll calls no lm_head; chunks of 256 tokens, each computed "
                   "again in backward, with an fp32 copy of a 16-bit head weight per chunk; "
                   "every label counted (prompt and padding labels, which TRL drops before "
                   "the head, make a real run's loss smaller)")
    if tr.packed:
        out.append(_packed_note(tr))
    if lce.applies(tr):
        kept = ("each chunk's 16-bit logits and two fp32 numbers per row are kept (compiled)"
                if tr.compile else "the fp32 log-probabilities are all kept")
        out.append(f"LinearCrossEntropyLoss ({tr.chunked_ce} chunks, torchtune's main branch):"
                   " the model returns the final norm's output and the loss projects one "
                   "chunk of rows at a time, so no list of every chunk's logits exists; "
                   + kept)
    elif chunks_loss(tr) and tr.framework == "torchtune":
        kept = ("each chunk's 16-bit logits and two fp32 numbers per token are kept "
                "(compiled)" if tr.compile else "the fp32 log-probabilities are all kept")
        out.append(f"CEWithChunkedOutputLoss ({tr.chunked_ce} chunks): the model returns "
                   "every chunk's 16-bit logits; the fp32 upcast exists one chunk at a time; "
                   + kept)
    elif chunks_loss(tr):
        out.append(f"chunked cross entropy ({tr.chunked_ce} chunks): the fp32 logits and loss "
                   "gradients exist one chunk at a time; the log-probabilities are all kept")
    paged = paged_state_bytes(ctx)
    if paged:
        out.append(f"{tr.optimizer}: {fmt_gb(paged)} of optimizer states live in CUDA unified "
                   "memory: invisible to torch.cuda.max_memory_allocated (not in the peak); "
                   "the part that fits in the free device memory stays resident (in "
                   "nvidia-smi, overhead/paged_optimizer_states), the driver keeps the rest "
                   "in host RAM and migrates it at each step instead of failing (in the host "
                   "RAM per node)")
    symm = async_tp_workspace_bytes(ctx)
    if symm:
        out.append(f"async TP: a {fmt_gb(symm)} symmetric-memory workspace per GPU (the fused "
                   "reduce-scatter's two output chunks), mapped outside the caching allocator: "
                   "in nvidia-smi's total (overhead/symm_mem_workspace), not in "
                   "torch.cuda.max_memory_allocated or max_memory_reserved")
    return out


def lowprec_notes(ctx: RankContext, gpu: GPUProfile | None) -> list[str]:
    """One note per low-precision mode (FP8, QAT) for the report."""
    tr = ctx.training
    parts = persistent_parts(ctx, gpu)
    gb = sum(parts.values()) / 1e9
    if tr.precision == "fp8":
        layout = "data + transpose" if fp8_transpose(gpu) else "data only (non-TN GPU)"
        out = [f"fp8: Transformer Engine delayed scaling on the block linears: cached FP8 "
               f"weights ({layout}) and amax histories {gb:.2f} GB; linear inputs saved in "
               "FP8 e4m3; attention, norms, embedding and lm_head in bf16"]
        odd = [f"{n} ({r} x {c})" for n, r, c, _ in block_linears(ctx)
               if r % FP8_DIM_MULTIPLE or c % FP8_DIM_MULTIPLE]
        if odd:  # TE assert_dim_for_fp8_exec
            out.append(f"fp8: TE's FP8 GEMMs need dimensions divisible by {FP8_DIM_MULTIPLE}; "
                       f"{', '.join(odd)} would have to be padded (memory shown unpadded)")
        return out
    return [f"qat {tr.qat}: {QAT_SCHEMES[tr.qat]}; fake-quantized weight copies and STE masks "
            f"are saved per linear; qparams {gb:.3f} GB"]


def _qlora_note(tr: TrainingConfig) -> str:
    """What the 4-bit layout stores and keeps (vramcalc/qlora.py)."""
    lay = tr.nf4
    n = 4096 * 4096  # bits per parameter of a large weight
    bits = 8 * nf4_tensor_bytes(n, lay) / n
    how = ("torchao NF4Tensor, int8 scalers" if lay.impl == "torchao" else
           "double-quantized absmax" if lay.double_quant else "fp32 absmax")
    what = "layer linears and lm_head" if tr.quantize_head else "layer linears"
    tail = ("compiled, each layer keeps its dequantized bf16 weights for its backward (saved "
            "without checkpointing, held by the recompute with it)"
            if compiled_dequant_kept(tr.compile, tr.finetune, lay) else
            "each matmul dequantizes its weight into a transient copy")
    text = f"qlora: {what} stored in NF4 ({bits:.2f} bits/param with {how}); {tail}"
    if lay.keeps_input:
        text += ("; bitsandbytes before 0.43.2 also holds each 4-bit linear's input until "
                 "the graph is freed")
    return text


def _packed_note(tr: TrainingConfig) -> str:
    """What --packed counts (vramcalc/terms/packed.py)."""
    mask = ("flex attention's BlockMask (a CUDA GPU of compute capability >= 7.5): "
            "attention keeps what the flash kernel keeps" if tr.packed_mask != "dense" else
            "a dense (b, s, s) bool mask (no flex attention on this GPU): SDPA runs its "
            "memory-efficient kernel and every layer keeps a (b, 1, s, s) additive copy")
    return (f"packed: every batch is a full pack of {tr.seq_len:,} tokens (--seq-len is the "
            f"pack size) with input_pos and {mask}; RoPE keeps its cache[input_pos] gather "
            "per call")
