"""`vramcalc explain`: every formula of one scenario with its numbers substituted.

Returns plain data (sections of lines); rendering happens in vramcalc.render.
"""

from __future__ import annotations

from typing import Any

from vramcalc.analytic import estimate
from vramcalc.explain_loss import logits_lines
from vramcalc.explain_seq2seq import seq2seq_activation_lines, seq2seq_logits_lines
from vramcalc.features import finetunes, low_precision
from vramcalc.finetune import shapes_for
from vramcalc.hardware import GPUProfile
from vramcalc.rank import RankContext
from vramcalc.report import MemoryReport, fit_phrase, paged_resident_bytes
from vramcalc.scenario import Scenario
from vramcalc.terms import activations as act
from vramcalc.terms.comm import copy_in_stream_bytes, edge_units
from vramcalc.terms.gradients import (
    accumulates_unsharded,
    gradients_at_step_bytes,
    gradients_bytes,
    pipelined_fsdp,
    reduce_dtype,
)
from vramcalc.terms.lowprec import (
    QAT_SCHEMES,
    block_linears,
    fp8_meta_bytes,
    fp8_transpose,
    fp8_weight_cache_bytes,
    qat_qparam_bytes,
)
from vramcalc.terms.megatron_layer import megatron_layer_tensors
from vramcalc.terms.optimizer_states import (
    BNB_BLOCK,
    BNB_MIN_8BIT_SIZE,
    BNB_OPTIMIZERS,
    BNB_PAGED_MIN_NUMEL,
    PAGED_OPTIMIZERS,
    optimizer_state_split,
    paged_state_bytes,
)
from vramcalc.terms.overhead import NCCL_BYTES_MULTI_GPU, NCCL_BYTES_TWO_GPU
from vramcalc.terms.saved import dims, mostly_moe
from vramcalc.terms.transients import (
    autocast_cache_layer_bytes,
    gather_buffer_bytes,
    optimizer_step_parts,
    optimizer_step_temp_bytes,
)
from vramcalc.terms.tune_init import init_replay
from vramcalc.terms.weights import finetune_weight_parts, weights_by_group
from vramcalc.units import DTYPE_BITS, GB, fmt_gb


def _gb(n: float) -> str:
    return f"{n / GB:,.3f} GB"


def _etp_text(etp: int | None) -> str:
    return "" if etp is None else f", routed experts split over expert TP etp={etp}"


def explain(scn: Scenario) -> dict[str, Any]:
    """Sections {title, lines} explaining where each number of the estimate comes from."""
    scn = scn.resolved()
    report = estimate(scn)
    spec, tr, par = scn.model, scn.training, scn.parallel
    stage = max(report.stages, key=lambda s: s.device_total_bytes).stage if report.stages else 0
    ctx = RankContext(spec, tr, par, stage)
    sections: list[dict[str, Any]] = []

    n_local = sum(t.numel * t.count for t in ctx.tensors)
    sections.append({"title": "Model", "lines": [
        spec.summary(),
        f"This rank (pipeline stage {stage}) holds {n_local:,} parameters after tensor "
        f"parallelism (tp={par.tp}), pipeline stages (pp={par.pp}) and expert parallelism "
        f"(ep={par.ep}{_etp_text(par.etp)}).",
    ] + ([f"An encoder of {spec.num_hidden_layers} layers over --seq-len source tokens and a "
          f"decoder of {spec.num_decoder_layers} layers over --target-len target tokens."]
         if spec.is_encoder_decoder else [])})

    wb = DTYPE_BITS[tr.weight_dtype] // 8
    groups = weights_by_group(ctx)
    shard_w = ctx.param_shard
    sections.append({"title": "Weights", "lines": [
        f"Precision '{tr.precision}' stores weights in {tr.weight_dtype} ({wb} bytes each).",
        f"{n_local:,} params x {wb} B" + (f" / {shard_w} (ZeRO-3/FSDP shards)" if shard_w > 1
                                           else "") + f" = {_gb(sum(groups.values()))} "
        "(each tensor rounded up to the allocator's 512-byte blocks).",
        "By group: " + ", ".join(f"{k} {_gb(v)}" for k, v in groups.items()),
    ]})
    if finetunes(tr):  # frozen base, NF4 and adapters (vramcalc/finetune.py)
        sections[-1]["lines"] = explain_weight_lines(ctx)

    gb_ = DTYPE_BITS[tr.grad_dtype] // 8
    sections.append({"title": "Gradients", "lines": [
        f"One {tr.grad_dtype} gradient ({gb_} B) per "
        + ("trained (adapter) parameter" if finetunes(tr) else "parameter")
        + (f", sharded over {ctx.grad_shard} ranks (ZeRO-2+/FSDP)" if ctx.grad_shard > 1
           and not accumulates_unsharded(ctx) else "")
        + f": {_gb(gradients_bytes(ctx))} once backward has finished"
        + ((" — unsharded, in " + reduce_dtype(ctx.training) + ": " + (
            "under pipelining every micro-batch's backward runs with FSDP's gradient sync off "
            "(torch/distributed/pipelining/stage.py backward_maybe_with_nosync)"
            if pipelined_fsdp(ctx) else "HF Trainer runs every micro-batch but the last "
            "under accelerate's no_sync(), FSDP's gradient sync off (--sync-each-batch "
            "reduces each one instead)")
            + " and they accumulate whole until the last one reduce-scatters them, "
            f"{_gb(gradients_at_step_bytes(ctx))} for the step.")
           if accumulates_unsharded(ctx) else "."),
        "With zero_grad(set_to_none=True) they do not exist during forward unless gradients "
        "are accumulated over micro-batches." if tr.set_to_none else "zero_grad(set_to_none="
        "False) keeps them, zeroed, through every forward (--no-set-to-none).",
    ] if not tr.optimizer_in_backward else [
        f"One {tr.grad_dtype} gradient ({gb_} B) per trained parameter, but with the optimizer "
        "inside backward each parameter's optimizer steps as soon as its gradient exists and "
        "sets it to None (torchtune OptimizerInBackward): one parameter's gradient at a time, "
        f"none left for the optimizer phase ({_gb(gradients_bytes(ctx))} if all were kept).",
    ]})

    split = optimizer_state_split(ctx)
    sb = DTYPE_BITS[tr.state_dtype] // 8
    shard = f", sharded over {ctx.state_shard} ranks (ZeRO-1+)" if ctx.state_shard > 1 else ""
    lines = [f"Optimizer '{tr.optimizer}' keeps its states in {tr.state_dtype} ({sb} B/element)"
             f"{shard}: {_gb(split['states'])}."] if tr.optimizer not in BNB_OPTIMIZERS else [
        f"bitsandbytes '{tr.optimizer}' (Optimizer2State.init_state) keeps per tensor of n "
        "elements " + ("two uint8 states + two fp32 absmax per "
                       f"{BNB_BLOCK} elements when n >= {BNB_MIN_8BIT_SIZE:,}, else two fp32 "
                       "states" if tr.optimizer.endswith("8bit") else "two fp32 states")
        + (f"; paged, the state buffers of tensors with n >= {BNB_PAGED_MIN_NUMEL:,} live in "
           "CUDA unified memory (Overhead below)" if tr.optimizer in PAGED_OPTIMIZERS else "")
        + f"{shard}: {_gb(split['states'])} in the allocator."]
    if tr.optimizer == "muon":
        lines.append("torch.optim.Muon keeps one momentum buffer per layer matrix; the "
                     "embeddings, head, norms and biases step with AdamW (two states each).")
    if tr.has_master_weights:
        lines.append(f"Mixed precision adds an fp32 master copy (4 B/param): "
                     f"{_gb(split['master'])} — the ZeRO paper's K = 12 with Adam (4 + 4 + 4).")
    if split["main_grads"]:
        lines.append(f"Megatron-LM's fp16 optimizer copies the gradients to fp32 for the step "
                     f"(4 B/param, freed by the next zero_grad): {_gb(split['main_grads'])}, "
                     "in the optimizer phase only.")
    sections.append({"title": "Optimizer states", "lines": lines})
    if low_precision(tr):  # vramcalc/terms/lowprec.py
        sections.append({"title": "FP8" if tr.precision == "fp8" else "Quantization-aware "
                         "training", "lines": lowprec_explain_lines(
                             ctx, scn.cluster.gpu if scn.cluster else None)})

    if spec.is_encoder_decoder:  # T5, BART: two stacks (vramcalc/explain_seq2seq.py)
        sections += [{"title": "Activations", "lines": seq2seq_activation_lines(ctx, report)},
                     {"title": "Logits and loss", "lines": seq2seq_logits_lines(ctx, report)}]
    else:
        sections += decoder_sections(ctx, report)
    sections.append({"title": "Transients", "lines": transient_lines(ctx, report)})
    sections.append({"title": "Overhead", "lines": overhead_lines(scn, report)})

    copy_in = copy_in_stream_bytes(ctx)
    sections.append({"title": "Peak", "lines": [
        "Phase peaks (steady state): " + ", ".join(f"{k} {_gb(v)}" for k, v in
                                                    report.phases.items()) + ".",
        f"The peak is the largest phase ({report.peak_phase}): {_gb(report.peak_allocated_bytes)}"
        " — comparable with torch.cuda.max_memory_allocated().",
        "At that moment: " + ", ".join(f"{k} {_gb(v)}" for k, v in
                                       report.terms.as_dict().items() if k != "overhead"),
        "Sub-terms: " + ", ".join(f"{k} {_gb(v)}" for k, v in sorted(report.subterms.items())),
        "Peak reserved = peak + the caching allocator's segment packing of the tensors live "
        "at the peak + blocks cached beside the loss backward (the freed logits)"
        + (" + the blocks FSDP's side streams keep (the reduce-scatter stream's sharded "
           "gradients" + (f", the all-gather copy-in stream's {_gb(copy_in)}" if copy_in else "")
           + ")" if ctx.engine == "fsdp2" else "")
        + f" = {_gb(report.peak_reserved_bytes)} (vramcalc/terms/reserved.py, terms/logits.py) "
        "— comparable with torch.cuda.max_memory_reserved() on a GPU with room to spare.",
        "Device total = peak + packing + CUDA context + NCCL buffers"
        + (" + resident paged optimizer states" if "overhead/paged_optimizer_states"
           in report.subterms else "") + " (overhead "
        f"{_gb(report.terms.overhead)}) = {_gb(report.device_total_bytes)}: cached blocks "
        "are not counted, since the allocator frees its cached whole segments and retries "
        "before it reports an out-of-memory error. A floor: near the card's limit a segment "
        "that still holds a live block keeps its free rest, which `vramcalc trace` replays.",
    ]})
    if report.gpu is not None and report.usable_bytes is not None:
        sections.append({"title": "Fit", "lines": [
            f"{report.gpu.name} reports {_gb(report.gpu.memory_total_bytes)}; headroom kept "
            f"free: {scn.headroom_fraction:.0%}.",
            ("Fits" if report.fits else "Does not fit") + ": " + fit_phrase(
                report.device_total_bytes, report.usable_bytes, report.gpu.memory_total_bytes,
                paged=paged_resident_bytes(report)) + ".",
        ]})
    return {"sections": sections, "report": report.to_json_dict()}



def decoder_sections(ctx: RankContext, report: MemoryReport) -> list[dict[str, Any]]:
    """The activation and loss sections of a decoder or encoder (one layer's table)."""
    spec, tr, par = ctx.spec, ctx.training, ctx.parallel
    sections: list[dict[str, Any]] = []
    saved = act.layer_saved(ctx)
    per_layer = act.layer_activation_bytes(ctx)
    lines = [f"Per layer and micro-batch (b={tr.micro_batch_size}, s={tr.seq_len // par.cp}, "
             f"attention '{tr.attention}', recompute '{tr.recompute}', profile "
             f"'{tr.framework}'), the forward pass keeps for backward:"]
    if tr.framework != "megatron":
        for t in saved:
            lines.append(f"  {t.name:<18} {t.shape:<22} {t.dtype:<5} {_gb(t.nbytes)}")
    else:
        lines += megatron_tensor_lines(ctx)
    lines.append(f"= {_gb(per_layer)} per layer x {ctx.num_layers} layers on this stage.")
    sections.append({"title": "Activations", "lines": lines})
    sections.append({"title": "Logits and loss", "lines": logits_lines(
        RankContext(spec, tr, par, par.pp - 1), report)})
    return sections

def explain_weight_lines(ctx: RankContext) -> list[str]:
    """`vramcalc explain`'s weights section under LoRA/QLoRA/DoRA."""
    fs = shapes_for(ctx)
    tr = ctx.training
    parts = finetune_weight_parts(ctx)
    a_dt = tr.adapter_dtype
    lines = [f"{tr.finetune}: the base is frozen; {fs.frozen.numel():,} parameters stay in "
             f"{tr.weight_dtype}: {fmt_gb(parts['weights/frozen'])}."]
    if fs.quantized.tensors:
        bits = 8 * (parts["weights/nf4"] + parts["weights/nf4_constants"]) / fs.quantized.numel()
        lines.append(f"{fs.quantized.numel():,} layer-linear parameters in NF4: 4 bits each "
                     f"({fmt_gb(parts['weights/nf4'])}) + absmax per 64 and per-tensor "
                     f"constants ({fmt_gb(parts['weights/nf4_constants'])}, {tr.nf4.impl}'s "
                     f"layout, vramcalc/qlora.py): {bits:.3f} bits/param (Dettmers et al. "
                     "2023).")
    lines.append(f"Adapters: {fs.adapters.numel():,} trained parameters (r={tr.lora_rank} on "
                 f"{tr.lora_targets}: r·(in + out) per linear) in {a_dt}: "
                 f"{fmt_gb(parts['weights/adapters'])}.")
    return lines


def lowprec_explain_lines(ctx: RankContext, gpu: GPUProfile | None) -> list[str]:
    """Plain-words formulas with this scenario's numbers (vramcalc explain)."""
    tr = ctx.training
    lins = block_linears(ctx)
    n = sum(r * cols * c for _, r, cols, c in lins)
    k = sum(c for *_, c in lins)
    gb = 1e9
    if tr.precision == "fp8":
        copies = 2 if fp8_transpose(gpu) else 1
        return [
            f"FP8 (Transformer Engine): {k} block linears hold {n:,} weight elements on this "
            "rank; weights, gradients, master and optimizer states are as 'bf16'.",
            f"Cached FP8 weights: {n:,} x {copies} B ({'data + transpose' if copies == 2 else 'data'})"
            f" + a 4 B scale_inv each = {fp8_weight_cache_bytes(ctx, gpu) / gb:,.3f} GB.",
            f"Amax history and scales: {k} linears x (1024 x (3 + 2) + 3 + 2) fp32 = "
            f"{fp8_meta_bytes(ctx) / gb:,.4f} GB.",
            "Each distinct linear input (normed input for q/k/v, o input, MLP input, down "
            "input) is saved as a 1-byte e4m3 transpose instead of the 2-byte bf16 tensor; "
            "grad outputs are cast to e5m2 (2 x 1 byte per element) only while each "
            "linear's backward runs.",
        ]
    T = tr.micro_batch_size * tr.seq_len
    c = 4 if tr.compute_dtype == "fp32" else 2
    return [
        f"QAT {tr.qat}: {QAT_SCHEMES[tr.qat]}.",
        f"Per micro-batch, every block linear keeps its fake-quantized weight ({c} B) and "
        f"its bool mask (1 B): {n:,} x {c + 1} B = {n * (c + 1) / gb:,.3f} GB over the "
        f"{k} linears of this rank, freed layer by layer in backward.",
        f"Every linear also keeps its fake-quantized input ({c} B) and mask (1 B) per element "
        f"of (T = {T:,} tokens, in): q, k and v each keep their own.",
        f"Scales and zero points kept by the fake quantizers: "
        f"{qat_qparam_bytes(ctx) / gb:,.4f} GB.",
    ]


def megatron_tensor_lines(ctx: RankContext) -> list[str]:
    """The megatron profile's saved tensors per layer (Korthikanti et al. 2022 Table 2 as
    vramcalc/terms/megatron_layer.py `megatron_layer_tensors` spells it out)."""
    x = dims(ctx)
    moe = mostly_moe(ctx)
    sp = " with sequence parallelism" if ctx.parallel.sequence_parallel else ""
    mla = " with Megatron-LM's multi-latent attention rows" if ctx.spec.is_mla else ""
    out = [f"  Korthikanti et al. 2022 Table 2{mla} (s={x.s}, b={x.b}, h={x.h}, "
           f"a={ctx.spec.num_attention_heads}, t={ctx.parallel.tp}{sp}; sizes in bytes, 2 sbh "
           "= one 16-bit (s, b, h) tensor; replicated ones ÷t only with sequence "
           "parallelism):"]
    for name, size, nbytes in megatron_layer_tensors(ctx, moe):
        out.append(f"  {name:<44} {size:<22} {nbytes / GB:,.3f} GB")
    return out


def transient_lines(ctx: RankContext, report: MemoryReport) -> list[str]:
    """The short-lived buffers (vramcalc/terms/transients.py) with the optimizer step's
    formula: its temporaries are often the largest surprise of a full fine-tune."""
    tr, sub = ctx.training, report.subterms
    out = []
    step = optimizer_step_temp_bytes(ctx)
    n = ctx.train_shapes.numel()
    shard = ctx.state_shard
    if "optimizer" in ctx.parallel.offload:
        out.append("Optimizer step: on the CPU (optimizer offload): no device temporaries.")
    elif ctx.engine in ("deepspeed", "megatron"):
        out.append(f"Optimizer step ({ctx.engine}'s fused Adam: no _foreach_sqrt copy): "
                   f"{_gb(step)}" + (" — DeepSpeed's fp32 copy of this rank's gradient "
                                     "partition." if step else "."))
    else:
        temp, inner, copy_peak = optimizer_step_parts(ctx)
        sb = DTYPE_BITS[tr.state_dtype] // 8
        per = f"{n:,} trained params" + (f" / {shard} (sharded)" if shard > 1 else "")
        if tr.has_master_weights:
            gb_ = DTYPE_BITS[tr.grad_dtype] // 8
            out.append(f"Mixed precision: each {tr.grad_dtype} gradient is replaced by an fp32 "
                       f"copy on its master, net (4 − {gb_}) B x {per} = {_gb(temp)}; the copy "
                       f"loop's own peak above that: {_gb(copy_peak)}.")
        if tr.optimizer in ("adam", "adamw") and tr.step_impl == "foreach":
            out.append(f"AdamW foreach (PyTorch's default on CUDA): _foreach_sqrt(exp_avg_sq) "
                       f"copies every second moment at once: {sb} B x {per} = {_gb(inner)}.")
        elif tr.optimizer in ("adam", "adamw") and tr.step_impl == "fused":
            out.append("AdamW fused (torch._fused_adamw_): one kernel updates in place: 0 B.")
        else:
            impl = ("bitsandbytes' kernel, in place" if tr.optimizer in BNB_OPTIMIZERS
                    else tr.step_impl)
            out.append(f"Inner step ({tr.optimizer}, {impl}): {_gb(inner)} "
                       "(vramcalc/terms/transients.py).")
        out.append(f"Optimizer-step transient = net fp32 copies + max(inner step, copy loop) "
                   f"= {_gb(temp)} + max({_gb(inner)}, {_gb(copy_peak)}) = {_gb(step)}.")
    out.append(f"cuBLAS workspaces (the GPU profile's size; one for the forward's thread, one "
               f"for autograd's backward thread, and Transformer Engine's own where it runs): "
               f"{_gb(sub.get('transients/cublas_workspace', 0))}; communication buffers "
               f"held all step (DDP buckets, ZeRO-3 reduce bucket): "
               f"{_gb(sub.get('transients/comm_buffers', 0))}; ZeRO-3/FSDP gather buffers "
               f"during forward and backward: {_gb(gather_buffer_bytes(ctx))}.")
    if sub.get("transients/attention_buffer"):
        out.append(f"Megatron-LM's local attention keeps its score matmul's input in a global "
                   f"buffer for the whole run: (b·a/t, s, s) in {tr.compute_dtype} = "
                   f"{_gb(sub['transients/attention_buffer'])} (terms/megatron_layer.py).")
    if edge_units(ctx):
        head, emb = gather_buffer_bytes(ctx, "head"), gather_buffer_bytes(ctx, "embedding")
        out.append(f"The embedding and the output projection are FSDP units of their own "
                   f"(--fsdp-edge-units): at the head and the loss {_gb(head)} is gathered "
                   f"(the head and the top block), at the embedding's backward {_gb(emb)}.")
    if tr.is_autocast:
        out.append(f"Autocast weight casts: one {tr.compute_dtype} copy of each layer's "
                   f"weights, {_gb(autocast_cache_layer_bytes(ctx))} per layer, freed when "
                   "the forward ends.")
    out.append(f"At the peak ({report.peak_phase}): transients {_gb(report.terms.transients)}"
               + "".join(f", {k.split('/', 1)[1]} {_gb(v)}" for k, v in sorted(sub.items())
                         if k.startswith("transients/") and v) + ".")
    return out


def overhead_lines(scn: Scenario, report: MemoryReport) -> list[str]:
    """CUDA context, NCCL and the allocator's fragmentation (vramcalc/terms/overhead.py)."""
    sub = report.subterms
    gpu = scn.cluster.gpu if scn.cluster else None
    world = scn.world_size
    ctx_src = f"{gpu.name}'s profile" if gpu else "the no-GPU default"
    if gpu and scn.training.eager_module_loading:
        ctx_src += (f", context_eager_bytes: torch {scn.training.torch_version} loads every "
                    "kernel at start")
    nccl = ("NCCL buffers (none: one rank)" if world <= 1 else
            f"NCCL communicator buffers for {world} ranks (aiconfigurator misc.nccl_mem: "
            f"{NCCL_BYTES_TWO_GPU / 1e6:.0f} MB at 2 GPUs, {NCCL_BYTES_MULTI_GPU / 1e6:.0f} MB "
            "from 4 on)")
    init = init_replay(RankContext(scn.model, scn.training, scn.parallel))
    init_line = [] if init is None else [
        f"Model init replayed through the allocator model (torchtune's template layer "
        f"deep-copied per layer, torchao {'.'.join(map(str, scn.training.nf4.version))} "
        f"to_nf4 per weight; vramcalc/terms/tune_init.py): {_gb(init.peak_allocated)} "
        f"allocated, {_gb(init.peak_reserved)} reserved at its high-water mark; the reserved "
        "segments stay cached after torchtune resets the peaks, so the peak reserved is at "
        "least that."]
    paged = paged_state_bytes(RankContext(scn.model, scn.training, scn.parallel))
    resident = sub.get("overhead/paged_optimizer_states")
    paged_line = [] if resident is None else [
        f"Paged optimizer states: {_gb(paged)} in CUDA unified memory, outside the allocator; "
        f"resident = min(paged, usable − the rest of the device total) = {_gb(resident)}, the "
        f"other {_gb(paged - resident)} in host RAM, migrated at each step "
        "(terms/optimizer_states.py paged_residency)."]
    return [
        *paged_line,
        f"CUDA context ({ctx_src}): {_gb(sub.get('overhead/context', 0))}; {nccl}: "
        f"{_gb(sub.get('overhead/nccl', 0))}.",
        *init_line,
        f"Allocator fragmentation = the packing of the blocks live at the peak into segments = "
        f"{_gb(sub.get('overhead/fragmentation', 0))} (vramcalc/terms/reserved.py).",
        f"Overhead = {_gb(report.terms.overhead)}: counted for the fit check (device total), "
        "not in the allocated peak.",
    ]
