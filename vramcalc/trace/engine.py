"""The trace engine: run real training steps under FakeTensorMode and count live storages.

`run_trace(scn)` builds the model (vramcalc's reference model, or Hugging Face's class for
the `hf` profile) and its optimizer inside `torch._subclasses.fake_tensor.FakeTensorMode`,
so every tensor has its true shape and dtype but no storage, and runs `ITERATIONS`
iterations of

    for each of grad_accum micro-batches: forward (loss inside) -> backward
    optimizer.step() -> optimizer.zero_grad(set_to_none=True, or False with --no-set-to-none)

under `MemoryTracker` (vramcalc/trace/tracker.py), with CUDA's autocast lists and kernel
allocations (vramcalc/trace/cuda_rules.py). The report is the last (steady-state)
iteration; `first_step_peak_bytes` is the first iteration's peak (no optimizer states yet
during its forward and backward). Memory is never allocated: a 70B model traces in seconds.

torch is imported only when a trace runs, never when this module is imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vramcalc.errors import InputError
from vramcalc.notes import scenario_notes
from vramcalc.rank import RankContext
from vramcalc.report import (
    PHASE_NAMES,
    MemoryReport,
    Terms,
    fit_verdict,
    gpu_info,
    model_info,
    strategy_dict,
)
from vramcalc.scenario import Scenario, check_capabilities
from vramcalc.terms.optimizer_states import paged_residency, paged_state_bytes
from vramcalc.terms.overhead import context_bytes, overhead_split
from vramcalc.terms.torchtune import shifts_logits, tune_rope
from vramcalc.terms.transients import blas_workspace_parts, cublas_workspace_bytes
from vramcalc.trace.losses import step_loss

ITERATIONS = 2  # the second iteration is the steady state (optimizer states exist)
Progress = Callable[[str, float], None]


@dataclass
class PhaseSnapshot:
    """Allocated bytes at one moment of the trace: total and per term / sub-term key."""

    total: int
    parts: dict[str, int] = field(default_factory=dict)
    num_live: int = 0

    def terms(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, val in self.parts.items():
            term = key.split("/", 1)[0]
            out[term] = out.get(term, 0) + val
        return out


@dataclass
class TraceResult:
    """A trace's report plus the detail `validate` compares term by term."""

    report: MemoryReport
    phases: dict[str, PhaseSnapshot]  # steady-state peak of each phase
    marks: dict[str, PhaseSnapshot]  # end_forward, end_backward, end_step (steady state)
    first_step_peak_bytes: int
    param_bytes: int  # parameters only (buffers such as rotary tables excluded)
    notes: list[str] = field(default_factory=list)


def check_eager_titan(scn: Scenario) -> None:
    """The trace runs torchtitan's blocks eagerly: refuse --compile and --float8."""
    tr = scn.training
    if tr.framework == "torchtitan" and (tr.compile or tr.float8):
        raise InputError("the trace runs torchtitan's blocks eagerly: --compile and --float8 "
                         "are estimated by the analytic engine (their saved sets are the "
                         "partitioner's, vramcalc/terms/torchtitan_compile.py)")


def check_traceable(scn: Scenario) -> Scenario:
    """Resolve the scenario and refuse what the trace cannot run yet (InputError)."""
    scn = scn.resolved()
    par, tr = scn.parallel, scn.training
    multi = [f"{k}={v}" for k, v in (("dp", par.dp_degree), ("tp", par.tp), ("pp", par.pp),
                                      ("cp", par.cp), ("ep", par.ep)) if v > 1]
    if par.zero:
        multi.append(f"zero={par.zero}")
    if par.fsdp != "none":
        multi.append(f"fsdp={par.fsdp}")
    if par.offload:
        multi.append("offload=" + ",".join(par.offload))
    if multi:
        raise InputError(
            "trace supports single-rank layouts; got " + ", ".join(multi)
            + " (trace one GPU, e.g. --gpus 1xH100, without parallel options)")
    if tr.load_only or tr.load != "none":
        raise InputError(f"--load{'-only' if tr.load_only else ' ' + tr.load}: the trace "
                         "engine runs training steps from a build of its own; the load "
                         "phase is the analytic engine's (vramcalc estimate)")
    if tr.framework in ("megatron", "lightning", "unsloth"):
        raise InputError(f"trace runs the reference, hf, torchtitan and torchtune profiles; "
                         f"{tr.framework} has no traceable model (use --framework reference "
                         "or hf)")
    from vramcalc.trace.tune import check_tune  # torch, loaded with the trace
    check_tune(scn)
    spec = scn.model
    if spec.position_embedding == "learned" and tr.seq_len > spec.max_position_embeddings:
        raise InputError(f"seq_len={tr.seq_len} exceeds {spec.name}'s learned positions "
                         f"(max_position_embeddings={spec.max_position_embeddings})")
    if tr.framework == "hf" and scn.model.is_moe and tr.weight_dtype != "bf16":
        raise InputError("hf MoE experts run torch grouped_mm, which takes bf16 weights only; "
                         "use --precision bf16 or bf16-pure with --framework hf")
    if tr.finetune == "qlora" and tr.quantize_head:
        raise InputError("--quantize-head is not traceable (the traced models keep lm_head "
                         "in the policy dtype); estimate it with the analytic engine")
    check_capabilities(scn)
    check_eager_titan(scn)
    if tr.precision == "fp8" or tr.qat != "none":
        from vramcalc.terms.lowprec import check_lowprec

        check_lowprec(scn)
    natural = tr.trainable_dtype if tr.precision in ("bf16-pure", "bf16-autocast") else "fp32"
    if tr.optimizer in ("adamw-8bit", "sgd"):
        natural = tr.state_dtype
    if tr.state_dtype != natural:
        raise InputError(f"trace keeps optimizer states in the parameters' dtype ({natural}); "
                         f"optimizer_dtype={tr.optimizer_dtype} is not traceable")
    return scn


def _torch_dtype(name: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def build_model(scn: Scenario) -> Any:
    """The nn.Module to trace (call inside FakeTensorMode), in the policy's weight dtype."""
    tr = scn.training
    dtype = _torch_dtype(tr.weight_dtype)
    if tr.framework == "hf":
        from vramcalc.trace.hf_models import build_hf_model

        model = build_hf_model(scn.model, tr, dtype)
    elif tr.framework == "torchtitan":  # torchtitan's Llama and AC (trace/titan_model.py)
        from vramcalc.trace.titan_model import TitanLlama

        model = TitanLlama(scn.model, tr.seq_len, recompute=tr.recompute,
                           every=tr.recompute_every, dtype=dtype)
    else:
        from vramcalc.trace.reference_model import ReferenceModel

        model = ReferenceModel(scn.model, attention=tr.attention, recompute=tr.recompute,
                               capacity_factor=scn.parallel.capacity_factor, dtype=dtype,
                               tune_rope=tune_rope(RankContext(scn.model, tr, scn.parallel, 0))
                               if tr.framework == "torchtune" else None)
    if tr.finetune != "full":  # LoRA / QLoRA / DoRA (vramcalc/trace/lora.py)
        from vramcalc.trace.lora import apply_finetune

        model = apply_finetune(model, scn)
        if tr.framework == "hf" and tr.recompute == "full" and not tr.kbit_prepare:
            from vramcalc.trace.hf_models import enable_checkpointing

            peft_model: Any = model
            enable_checkpointing(peft_model.get_base_model(), tr)
    if tr.precision == "fp8" or tr.qat != "none":  # FP8 / QAT linears (trace/lowprec.py)
        from vramcalc.trace.lowprec import apply_lowprec

        model = apply_lowprec(model, scn)
    if tr.liger:  # Liger's kernels' stand-ins (vramcalc/trace/liger.py)
        from vramcalc.trace.liger import apply_liger

        model = apply_liger(model)
    if tr.chunked_ce > 1 or tr.activation_offload or shifts_logits(tr):  # trace/lowmem.py
        from vramcalc.trace.lowmem import apply_memory_options

        model = apply_memory_options(model, scn)
    return model


def trace(scn: Scenario, progress: Progress | None = None, iterations: int = ITERATIONS,
          debug: Callable[[str, Any], None] | None = None,
          seq_lens: Sequence[int] | None = None) -> TraceResult:
    """Trace `iterations` training iterations of a single-rank scenario; see the module doc.

    `debug(event, tracker)`, when given, is called at marks with the live tracker (whose
    blocks then record the op that allocated them), for calibration work. `seq_lens` gives
    every micro-batch its own length (vramcalc/lengths.py `padded_batches`, the last one
    the scenario's seq_len): as many iterations run as they fill, at least `iterations`.
    """
    scn = check_traceable(scn)
    iterations, seq_lens = fill_iterations(iterations, scn.training.grad_accum, seq_lens)
    try:
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:  # pragma: no cover - torch is an optional extra
        raise InputError("the trace engine needs torch: pip install torch") from None
    from vramcalc.trace.cuda_rules import cuda_autocast_rules
    from vramcalc.trace.tracker import MemoryTracker

    tr = scn.training
    report_progress = progress or (lambda _label, _frac: None)
    steps = iterations * (tr.grad_accum * 2 + 1)
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        report_progress(label, done / steps)
        done += 1

    gpu = scn.cluster.gpu if scn.cluster else None
    tracker = MemoryTracker(debug=debug is not None,
                            expandable_segments=tr.expandable,
                            workspace_bytes=blas_workspace_parts(gpu, tr))
    report_progress("building model", 0.0)
    autocast = (lambda: torch.autocast("cpu", dtype=_torch_dtype(tr.compute_dtype))) if (
        tr.runs_autocast) else contextlib.nullcontext
    framework_ctx: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if tr.framework == "hf":
        from vramcalc.trace.hf_models import real_device_behaviour

        framework_ctx = real_device_behaviour(
            dropout=scn.model.is_encoder or scn.model.is_encoder_decoder,
            biased_sdpa=tr.attention == "flash" and scn.model.model_type in ("t5", "mt5"))
    fake = FakeTensorMode()
    old_torch: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if tr.softmax_keeps_input:  # torch < 1.11 (vramcalc/trace/old_torch.py)
        from vramcalc.trace.old_torch import keep_softmax_input

        old_torch = keep_softmax_input()
    with framework_ctx, old_torch, cuda_autocast_rules(), fake, tracker:
        model = build_model(scn)
        model.train()
        all_params = list(model.parameters())
        params = [p for p in all_params if p.requires_grad]
        if tr.optimizer == "muon":  # the layers' matrices (trace/optim.py MuonWithAdamW)
            for name, p in model.named_parameters():
                p.vramcalc_muon = name.startswith("layers.") and p.ndim == 2
        tracker.register_params(all_params)
        for buf in model.buffers():
            tracker.label(buf, "weights/buffers")
        for mod in model.modules():  # FP8 weight caches, QAT qparams (trace/lowprec.py)
            for t, term in getattr(mod, "vramcalc_state", list)():
                tracker.label(t, term)
        param_bytes = sum(tracker.blocks[k].nbytes for k in tracker.param_keys)

        def on_grad(p: Any) -> None:
            tracker.label(p.grad, "gradients")

        for p in params:
            p.register_post_accumulate_grad_hook(on_grad)
        watch_logits(tracker, model, tr.framework)
        opt = (in_backward_optimizer(tracker, tr, params) if tr.optimizer_in_backward
               else tracked_optimizer(tracker, tr, params))
        from vramcalc.trace.liger import liger_rope  # Liger's RoPE while the steps run
        from vramcalc.trace.lora import peft_trace_limits

        with liger_rope(model, tr.liger), peft_trace_limits(tr):
            run_steps(scn, tracker, model, params, opt, iterations, tick, autocast=autocast,
                      debug=debug, seq_lens=seq_lens)
        report_progress("done", 1.0)

    return with_lengths_note(_result(scn, tracker, param_bytes, iterations), seq_lens)


def fill_iterations(iterations: int, grad_accum: int, seq_lens: Sequence[int] | None
                    ) -> tuple[int, Sequence[int] | None]:
    """The iterations that `seq_lens` (one length per micro-batch) fill, at least
    `iterations`, and the lengths padded at the front with the first one to whole
    iterations (the longest batch stays the last)."""
    if seq_lens is None:
        return iterations, None
    iterations = max(iterations, -(-len(seq_lens) // grad_accum))
    pad = iterations * grad_accum - len(seq_lens)
    return iterations, (*[seq_lens[0]] * pad, *seq_lens)


def with_lengths_note(res: TraceResult, seq_lens: Sequence[int] | None) -> TraceResult:
    """`res` with a note on the replayed lengths (trace --lengths)."""
    if seq_lens is not None:
        res.report.notes.append(
            f"peak reserved replayed over {len(seq_lens):,} micro-batches padded to their "
            f"longest sample ({min(seq_lens):,} to {max(seq_lens):,} tokens, the last at "
            f"--seq-len {seq_lens[-1]:,}): the caching allocator's segments of the earlier "
            "shapes stay reserved")
    return res


def watch_logits(tracker: Any, model: Any, framework: str) -> None:
    """Label the head's output as logits: from there on, forward tensors are the loss's; in
    backward the "logits" region ends when d loss / d logits is ready (the head's and the
    layers' backward follow)."""
    head = model.get_output_embeddings() if framework == "hf" else model.lm_head
    if head is None:  # an encoder's classification head (BERT's classifier, RoBERTa's head)
        head = model.classifier

    def head_post(_mod: Any, _inp: Any, out: Any) -> None:
        tracker.label(out, "logits")
        tracker.region = "logits"

        def leave(grad: Any) -> None:
            tracker.region = None
        if out.requires_grad:
            out.register_hook(leave)

    head.register_forward_hook(head_post)
    if getattr(model, "vramcalc_liger", False):  # Liger's fused loss makes no logits
        from vramcalc.trace.liger import watch_fused_loss

        watch_fused_loss(tracker, model)


def tracked_optimizer(tracker: Any, tr: Any, params: list[Any]) -> Any:
    """The optimizer (vramcalc/trace/optim.py), its fp32 master copies labelled."""
    from vramcalc.trace.optim import MixedPrecisionOptimizer, build_optimizer

    tracker.phase = "build_optimizer"
    opt = build_optimizer(tr.optimizer, params, tr.has_master_weights, tr.step_impl)
    if isinstance(opt, MixedPrecisionOptimizer):
        for m in opt.masters:
            tracker.label(m, "optimizer_states/master")
    return opt


def in_backward_optimizer(tracker: Any, tr: Any, params: list[Any]) -> Any:
    """Per-parameter optimizers stepped by post-accumulate-grad hooks (registered after the
    hook that labels gradients, so the gradient is labelled before its step); each step's
    new states are labelled at once, its temporaries stay `transients` (the phase's)."""
    from vramcalc.trace.optim import InBackward, make_optimizer, optimizer_state_tensors

    def label_states(_p: Any, one: Any) -> None:
        states, host = optimizer_state_tensors(one)
        for t in host:
            tracker.set_host(t)
        for t in states:
            tracker.label(t, "optimizer_states/states")

    return InBackward(params, lambda ps: make_optimizer(tr.optimizer, ps, tr.step_impl),
                      label_states)


def run_steps(scn: Scenario, tracker: Any, model: Any, params: list[Any], opt: Any,
              iterations: int, tick: Callable[[str], None], *,
              autocast: Callable[[], Any] = contextlib.nullcontext,
              after_backward: Callable[[], None] | None = None,
              before_micro: Callable[[int], None] | None = None,
              debug: Callable[[str, Any], None] | None = None,
              state_label: str = "optimizer_states/states",
              seq_lens: Sequence[int] | None = None) -> None:
    """`iterations` training steps of `grad_accum` micro-batches each, with the tracker's
    phases and marks set (end_forward, end_backward, end_step); `after_backward` runs after
    each micro-batch's backward, `before_micro(i)` before the i-th micro-batch of a step,
    `debug(event, tracker)` at end_forward and end_step;
    `seq_lens`, when given, the length of every micro-batch in order (else seq_len)."""
    import torch

    from vramcalc.trace.optim import optimizer_state_tensors

    tr = scn.training
    b, s, V = tr.micro_batch_size, tr.seq_len, scn.model.vocab_size
    for it in range(iterations):
        tracker.iteration = it
        for micro in range(tr.grad_accum):
            if seq_lens is not None:
                s = seq_lens[it * tr.grad_accum + micro]
            tag = f"iteration {it + 1}/{iterations}, micro-batch {micro + 1}/{tr.grad_accum}"
            if before_micro:
                before_micro(micro)
            tick(f"{tag}: forward")
            tracker.set_phase("forward")
            ids = torch.randint(0, V, (b, s))
            labels = (torch.randint(0, scn.model.num_labels, (b,)) if scn.model.task
                      == "sequence_classification" else torch.randint(0, V, (
                          b, tr.target_len or s)))  # seq2seq: the decoder's tokens
            with autocast():
                loss = step_loss(model, tr, ids, labels, tracker)
            tracker.mark("end_forward")
            if debug:
                debug("end_forward", tracker)
            tick(f"{tag}: backward")
            tracker.set_phase("backward", region="logits")
            (loss / tr.grad_accum).backward()
            del loss, ids, labels
            tracker.region = None
            if after_backward:
                after_backward()
        tracker.mark("end_backward")
        tick(f"iteration {it + 1}/{iterations}: optimizer step")
        tracker.set_phase("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=tr.set_to_none)
        states, host = optimizer_state_tensors(opt)
        for t in host:
            tracker.set_host(t)
        for t in states:
            if tracker.term_of(t) != "optimizer_states/master":
                tracker.label(t, state_label)
        tracker.mark("end_step")
        if debug:
            debug("end_step", tracker)
        tracker.phase = "idle"


def _snap(s: Any, extra: dict[str, int]) -> PhaseSnapshot:
    parts = dict(s.terms)
    for k, v in extra.items():
        parts[k] = parts.get(k, 0) + v
    return PhaseSnapshot(s.total + sum(extra.values()), parts, s.num_live)


def _result(scn: Scenario, tracker: Any, param_bytes: int, iterations: int) -> TraceResult:
    gpu = scn.cluster.gpu if scn.cluster else None
    extra = {"transients/cublas_workspace": cublas_workspace_bytes(gpu, scn.training)}
    last = iterations - 1
    phases = {ph: _snap(tracker.peaks[(last, ph)], extra) for ph in PHASE_NAMES}
    marks = {name: _snap(snap, extra) for (it, name), snap in tracker.marks.items() if it == last}
    first = max(_snap(tracker.peaks[(0, ph)], extra).total for ph in PHASE_NAMES)
    peak_name = max(PHASE_NAMES, key=lambda ph: phases[ph].total)
    peak = phases[peak_name]
    # the allocator replay's high-water mark (the workspace included, every stream's pools)
    # reads as max_memory_reserved on a GPU with room to spare; the fit is the capacity the
    # steps need under memory pressure (MemoryTracker.fit_bytes)
    reserved = max(tracker.allocator.peak_reserved, peak.total)
    needed = tracker.fit_bytes(tracker.peaks[(last, peak_name)].side_allocated, peak.total)
    ovh = overhead_split(context_bytes(gpu, scn.training), scn.world_size,
                         max(needed - peak.total, 0))
    if scn.training.optimizer.startswith("paged-"):  # outside the allocator, as analytic
        paged = paged_state_bytes(RankContext(scn.model, scn.training, scn.parallel, 0))
        ovh["paged_optimizer_states"] = paged_residency(
            paged, scn.usable_bytes, max(p.total for p in phases.values()) + sum(ovh.values()))[0]
    terms = peak.terms()
    terms["overhead"] = sum(ovh.values())
    subterms = {k: v for k, v in peak.parts.items() if "/" in k}
    subterms.update({f"overhead/{k}": v for k, v in ovh.items()})
    total = peak.total + terms["overhead"]
    notes = scenario_notes(scn)  # the analytic report's: the scenario's facts
    report = MemoryReport(
        engine="trace",
        model=model_info(scn),
        strategy=strategy_dict(scn),
        gpu=gpu_info(scn),
        terms=Terms(**{k: max(v, 0) for k, v in terms.items()}),
        subterms=subterms,
        phases={ph: phases[ph].total for ph in PHASE_NAMES},
        peak_phase=peak_name,
        peak_allocated_bytes=peak.total,
        peak_reserved_bytes=reserved,
        first_step_peak_bytes=first,
        device_total_bytes=total,
        **fit_verdict(scn, total),
        notes=notes,
    )
    return TraceResult(report, phases, marks, first, param_bytes)


def run_trace(scn: Scenario, progress: Progress | None = None,
              seq_lens: Sequence[int] | None = None) -> MemoryReport:
    """Per-rank memory of one scenario from a fake-tensor training step (engine "trace").

    Same schema as `vramcalc.analytic.estimate`: `terms` is the composition at the
    steady-state peak, `phases` the peak of each phase (forward, backward, optimizer),
    `first_step_peak_bytes` the first iteration's peak; the cuBLAS workspace constant of
    vramcalc/terms/transients.py is added as CUDA would hold it. Raises InputError for
    multi-rank layouts, the megatron profile, or `hf` without transformers installed.
    """
    return trace(scn, progress, seq_lens=seq_lens).report


def _demo() -> None:  # pragma: no cover - `python -m vramcalc.trace.engine`
    import time

    from vramcalc.model import ModelSpec
    from vramcalc.training import TrainingConfig
    from vramcalc.units import fmt_gib

    spec = ModelSpec(name="llama-mini", hidden_size=1024, num_hidden_layers=4,
                     num_attention_heads=16, num_key_value_heads=4, intermediate_size=2816,
                     vocab_size=32000)
    scn = Scenario(model=spec, training=TrainingConfig(seq_len=2048, micro_batch_size=2))
    t0 = time.perf_counter()
    rep = run_trace(scn)
    print(f"{spec.summary()}\ntraced in {time.perf_counter() - t0:.2f} s")
    for term, val in rep.terms.as_dict().items():
        print(f"  {term:<17} {fmt_gib(val)}")
    print(f"  peak ({rep.peak_phase}) {fmt_gib(rep.peak_allocated_bytes)}, first step "
          f"{fmt_gib(rep.first_step_peak_bytes)}")


if __name__ == "__main__":  # pragma: no cover
    _demo()
