"""The analytic engine: per-term bytes combined into phase peaks, per rank.

The step is modelled in steady state (step 2 on, zero_grad(set_to_none=True)):

forward  = W + O + G_acc + k·A_mb + max(logits forward peak, layer forward temporaries)
backward = max over the backward sweep, evaluated where it is extreme (the sweep is linear
           in the layer index): at the loss backward (all activations + CE gradient
           buffers), at the top layer and at the bottom layer (grads grown, activations
           freed)
optimizer = W + O + G + optimizer-step temporaries (inside backward with
            --optimizer-in-backward: vramcalc/terms/optim_in_bwd.py)

W weights, O optimizer states (+ master), G gradients, G_acc gradients kept across
micro-batches (gradient accumulation or pipeline), A_mb activations of one micro-batch,
k micro-batches in flight on this stage. The first step has no optimizer states during
forward and backward (they are created lazily by the first optimizer step).
"""

from __future__ import annotations

from typing import Any

from vramcalc.analytic_seq2seq import seq2seq_stage_phases
from vramcalc.features import low_precision
from vramcalc.hardware import GPUProfile
from vramcalc.hf_stack import loss_in_forward
from vramcalc.notes import scenario_notes
from vramcalc.offload import host_bytes_per_node, nvme_bytes_per_node
from vramcalc.phases import Phase, StageBase
from vramcalc.rank import RankContext
from vramcalc.report import (
    MemoryReport,
    StageReport,
    Terms,
    fit_verdict,
    gpu_info,
    model_info,
    strategy_dict,
)
from vramcalc.scenario import Scenario, check_capabilities
from vramcalc.sharding import moe_layers_on_stage, pipeline_chunks
from vramcalc.terms import activations as act
from vramcalc.terms import comm, fsdp2_moments
from vramcalc.terms import transients as tr
from vramcalc.terms.gradients import (
    accumulates_unsharded,
    embedding_backward_bytes,
    gradients_at_step_bytes,
    gradients_bytes,
    gradients_persistent,
    late_gradient_bytes,
    layer_gradient_bytes,
)
from vramcalc.terms.load import init_reserved_bytes, load_parts
from vramcalc.terms.lowprec import check_lowprec
from vramcalc.terms.megatron_layer import megatron_held_parts
from vramcalc.terms.modifiers import persistent_parts
from vramcalc.terms.optim_in_bwd import in_backward, states_made
from vramcalc.terms.optimizer_states import (
    optimizer_state_split,
    paged_residency,
    paged_state_bytes,
)
from vramcalc.terms.overhead import context_bytes, overhead_split
from vramcalc.terms.pipelining import pipelining_held
from vramcalc.terms.profile import profile
from vramcalc.terms.reserved import reserved_pad_bytes, side_stream_bytes
from vramcalc.terms.saved import Moment
from vramcalc.terms.schedule import in_flight_microbatches
from vramcalc.terms.torchtitan_tp import async_tp_overhead
from vramcalc.terms.torchtune import recipe_held
from vramcalc.terms.weights import weight_parts


def candidate_stages(scn: Scenario) -> list[int]:
    """Pipeline ranks that can be the worst: the first, the last, and each rank whose number
    of layers and mix of dense and MoE layers no earlier rank has. Any other rank r has the
    layers of an earlier rank i < r and is dominated by it term by term: the same weights,
    gradients, optimizer states and buffers per layer, no more micro-batches in flight
    (`in_flight_microbatches` falls with the rank), and neither the embedding (rank 0 only)
    nor the head and loss (the last rank only). For dense models split evenly that leaves
    {0, p − 1}; an uneven split (`sharding.chunk_layers`) adds rank 1, the first middle
    rank. Ranks 1 … p − 2 hold 1/v of their layers in each chunk, so the schedule's
    per-chunk counting in `in_flight_microbatches` does not separate two of them either."""
    par = scn.parallel
    p, out = par.pp, {0, par.pp - 1}
    if (scn.model.is_moe or par.uneven_split) and p > 2:
        chunks = pipeline_chunks(scn.model, par)
        seen: set[tuple[int, int]] = set()
        for st in range(p - 1):
            mix = (sum(row[st] for row in chunks), moe_layers_on_stage(scn.model, chunks, st))
            if mix not in seen:
                out.add(st)
                seen.add(mix)
    return sorted(out)


def stage_phases(scn: Scenario, stage: int, gpu: GPUProfile | None
                  ) -> tuple[list[Phase], int, tuple[int, int]]:
    """Phases (steady state) of one stage, the first-step peak, and reserved minus allocated
    at the peak: the packing floor and the cached blocks above it (terms/reserved.py)."""
    if scn.model.is_encoder_decoder:  # T5, BART: two stacks (vramcalc/analytic_seq2seq.py)
        return seq2seq_stage_phases(scn, gpu)
    ctx = RankContext(scn.model, scn.training, scn.parallel, stage)
    train = scn.training
    w_parts = weight_parts(ctx)  # {"weights": W}, or fine-tuning's sub-terms
    opt = optimizer_state_split(ctx)
    G = gradients_bytes(ctx)
    g_layer = layer_gradient_bytes(ctx)
    nL = ctx.num_layers
    G_layers = g_layer * nL
    G_head = max(G - G_layers, 0)  # embedding, head, final norm
    m = scn.parallel.num_microbatches or train.grad_accum
    keep_grads = m > 1 or gradients_persistent(ctx)  # ZeRO-2/3, Megatron: buffers kept
    k = in_flight_microbatches(scn, stage)
    ib = in_backward(ctx) if train.optimizer_in_backward else None  # terms/optim_in_bwd.py

    P = profile(ctx)  # activation, logits and moment bytes (cached)
    gap = P.first_layer_gap  # what the first layer does not save when the embedding is frozen
    A_dev = P.resident_layer  # saved layer tensors in host memory: what stays on the device
    offload = A_dev is not None
    plan = P.recompute_plan  # Megatron's --recompute-method: layers keep different bytes

    def A_bottom(n: int) -> int:
        """Activations of the bottom n layers of this stage, in layer order."""
        if A_dev is not None:
            return n * A_dev
        if plan is not None:
            return plan.bottom(n) - (gap if n else 0)
        return P.bottom(n) - (gap if n else 0)

    A_emb, A_end = P.embedding_side, P.embedding_side_end  # ids, labels, rope, mask; at the end
    A_edges = A_emb + P.head_side
    cache_layer = P.autocast_cache_layer
    cache_head = P.autocast_cache_head
    A_mb = A_bottom(nL) + A_edges
    C_mb = nL * cache_layer + cache_head
    logits_keep = P.logits_keep
    cublas = tr.cublas_workspace_bytes(gpu, train)
    gather = tr.gather_buffer_bytes(ctx)
    # the head's and the embedding's instants differ only with --fsdp-edge-units
    gather_head, gather_emb = ((tr.gather_buffer_bytes(ctx, "head"),
                                tr.gather_buffer_bytes(ctx, "embedding"))
                               if comm.edge_units(ctx) else (gather, gather))
    fwd_work = P.forward_work + comm.layer_forward_comm_bytes(ctx)
    j_other, work_other = P.other_forward
    persistent = tr.persistent_buffer_bytes(ctx)
    prev = k - 1  # other in-flight micro-batches (whole)
    # loss buffers of other micro-batches: only micro-batches whose last model chunk ran
    # forward keep one. The interleaved schedule runs each micro-batch's last chunk right
    # before that chunk's backward (Megatron-LM core/pipeline_parallel/schedules.py:
    # `get_schedule_table` orders forwards chunk by chunk, backwards in reverse chunk
    # order, and the last rank's warm-up, (v − 1)·group, ends just before them), so the
    # last rank holds one loss at a time; 1F1B's last rank holds one micro-batch, GPipe all.
    prev_logits = 0 if scn.parallel.pp_schedule == "interleaved" else int(prev * logits_keep)

    held_parts = persistent_parts(ctx, gpu)  # FP8 weight cache, QAT qparams (modifiers)
    held_parts.update(megatron_held_parts(ctx))  # GlobalMemoryBuffer, deferred wgrad
    held_parts.update(recipe_held(ctx))  # torchtune before 0.3: the recipe's shifted logits
    held_parts.update(pipelining_held(ctx, m))  # torch.distributed.pipelining's buffers
    B = StageBase({**w_parts, **held_parts, "optimizer_states/states": opt["states"],
                   "optimizer_states/master": opt["master"]},
                  {"transients/cublas_workspace": cublas, "transients/comm_buffers": persistent})

    g_acc = G if keep_grads else 0

    def fwd_point(activations: float, logits: int, extra: dict[str, int], gathered: int = gather,
                  side: int = 0, head: bool = False) -> Phase:  # head: its weight's cast exists
        return Phase("forward", B, g_acc, {
            "activations": int(activations),
            "transients/autocast_cache": int(k * C_mb - (0 if head else cache_head)),
            "transients/gather_buffers": gathered,
            "logits": prev_logits + logits,
            **extra,
        }, side=side)

    # the forward peaks at the end of the loss, while the final norm runs, at the top
    # layer's last residual add, or inside the top layer's eager attention (below)
    fwd_logits = P.logits_forward
    head_extra = P.head_forward_extra
    A_head = A_edges - A_emb
    casts = {"transients/autocast_cache": int(k * C_mb) + P.loss_forward_casts}
    loss_fwd = fwd_point(k * A_mb + head_extra, fwd_logits, casts, gather_head, head=True)
    before = P.previous_graph  # LitGPT's loop keeps the previous micro-batch's graph
    start_outs = fsdp2_moments.forward_start_outputs_bytes(ctx)
    top_outs = fsdp2_moments.forward_top_outputs_bytes(ctx)
    forward = max([
        loss_fwd,
        fwd_point(k * A_mb + P.forward_end_extra, 0, {}),
        fwd_point(k * A_mb - A_head, 0, {"transients/layer_forward": fwd_work}),
        # the other kind's work happens in its topmost layer: the layers above it have
        # saved nothing and cast nothing yet
        fwd_point(prev * A_mb + A_emb + A_bottom(nL - j_other), 0, {
            "transients/layer_forward": work_other + fwd_work - P.forward_work,
            "transients/autocast_cache": int(prev * C_mb + (nL - j_other) * cache_layer)}),
        fwd_point(k * A_mb + head_extra, P.lit_returned, {  # (terms/litgpt_loop.py)
            "logits/previous_micro_batch": before[0],
            "activations/previous_graph": before[1]}, gather_head, head=True),
        fwd_point(prev * A_mb + A_emb, 0, {  # FSDP2's first block copy-out (comm.py)
            "transients/all_gather_outputs": start_outs}, side=start_outs),
        fwd_point(prev * A_mb + A_emb + A_bottom(nL - 1), 0, {  # and the top block's
            "transients/all_gather_outputs": top_outs}, side=top_outs),
    ], key=lambda p: p.total)

    eager_held, eager_work = P.eager_forward
    if eager_work and nL:
        # the top layer's softmax: its later saved tensors do not exist yet (a checkpointed
        # layer's are its input, the checkpoint's, which does)
        top_bytes = plan.kept[-1] if plan else 0 if train.recompute == "full" else (
            P.moe_layer if P.is_moe_from_top(0) else P.dense_layer)
        qkv_share = 1 - P.grad_fraction["mlp+o"]  # casts made so far
        eager = Phase("forward", B, g_acc, {
            "activations": int(prev * A_mb + (A_bottom(nL - 1) if offload else A_bottom(nL)
                                              - top_bytes) + eager_held + A_emb),
            "transients/autocast_cache": int(prev * C_mb + (nL - 1 + qkv_share) * cache_layer),
            "transients/gather_buffers": gather,
            "transients/layer_forward": eager_work,
            "logits": prev_logits,
        })
        if eager.total > forward.total:
            forward = eager

    # autocast's casts live in its cache until the forward ends and on in the matmuls that
    # saved them; under full recompute the checkpointed layers saved none (made again later)
    full = train.recompute == "full"
    C_kept = cache_head + (plan.num_plain if plan else 0 if full else nL) * cache_layer
    loss_bwd = Phase("backward", B, g_acc, {
        "activations": int(k * A_mb),
        "transients/autocast_cache": int(prev * C_mb + C_kept) + P.loss_backward_casts,
        "transients/gather_buffers": gather_head,
        "logits": P.logits_backward + prev_logits,
    }, 0)

    G_late = late_gradient_bytes(ctx)  # the (untied) embedding's: after the bottom layer
    G_top, G_end = fsdp2_moments.root_gradients(ctx, max(G_head - G_late, 0), G_head)
    comm_bwd = comm.layer_backward_comm_bytes(ctx)
    root = P.loss_root

    def A_below(j: int) -> int:
        """Activations of the layers below the j-th from the bottom during its backward: a
        recomputed unit's lower layers hold their full sets (vramcalc.terms.megatron_recompute)."""
        return A_bottom(j) if plan is None else plan.below(j) - (gap if j else 0)

    def casts_held(j: int, done: float) -> float:
        """Layers' autocast casts alive during the backward of the j-th from the bottom."""
        if plan is not None:
            return plan.casts_below(j) + 1 - done
        return (1 - done) if full else (j + 1 - done)

    def layer_point(i: int, mom: Moment, hook: tuple[int, int] = (0, 0)) -> Phase:
        """Instant `mom` of the backward of the i-th layer from the top (0-based); `hook`:
        a parameter's (gradient, step temporaries) inside backward (optim_in_bwd.py)."""
        done = P.grad_fraction[mom.grads]
        # layers' worth of gradients made (above, this one's share) and of casts still held
        made, casts = i + done, casts_held(nL - i - 1, done)
        if plan is None and P.kind_grads is not None:  # dense and MoE layers differ
            made, casts = P.kind_share(i, mom.grads, full)
        grads = G if keep_grads else G_top + int(made * g_layer)
        step = {"transients/optimizer_step": hook[1], "transients/tied_grad": ib.waiting
                } if ib else {}
        return Phase("backward", B, hook[0] if ib else min(grads, G), {
            **step,
            "activations": int(prev * A_mb + A_below(nL - i - 1) + mom.held + A_emb)
            - (gap if i == nL - 1 else 0),
            "transients/autocast_cache": int(prev * C_mb + casts * cache_layer),
            "transients/layer_backward": mom.work + comm_bwd,
            "transients/gather_buffers": gather,
            "transients/reduce_buffers": tr.reduce_buffer_bytes(ctx, i, done,
                                                                mom.work + mom.held),
            "logits": prev_logits + root,
        }, states_made(ib, i + done) if ib else None, comm.prefetch_bytes(ctx, i))

    candidates = [loss_bwd]
    if ib:  # the step of each parameter inside backward, at its largest instants
        g, t = ib.layer  # inside the matrix's backward node, its cast (autocast), its hook
        lw, dw = ib.layer_work, ib.layer_dw
        candidates += [layer_point(i, Moment("hook", m.held, work, m.grads), hook)
                       for i, moms in ((0, P.top_moments), (nL - 1, P.bottom_moments)) for m in moms
                       for work, hook in ((lw + ib.layer_in + dw, (0, 0)),
                                          (lw + dw * ib.cast, (g, 0)), (lw, (g, t)))
                       if m.name == "mlp" and g]
        g, t = ib.head  # the same for the untied head: node, cast, hook (and its states)
        for held, dx, step, made in (
                ((0, C_kept, ib.head_dlogits), ib.head_dw, (0, 0), 0),
                ((ib.head_freed, C_kept - cache_head, 0), ib.head_dw * ib.cast, (g, 0), 0),
                ((ib.head_freed, C_kept - cache_head, 0), 0, (g, t), states_made(ib, 0))):
            candidates += [Phase("backward", B, step[0], {
                "activations": int(k * A_mb - held[0]), "logits": prev_logits + root + held[2],
                "transients/autocast_cache": int(prev * C_mb + held[1]),
                "transients/layer_backward": ib.head_dx + dx,
                "transients/gather_buffers": gather_head,
                "transients/optimizer_step": step[1]}, made)] if g and (held[2] or step[0]) else []
    if nL:
        # the top layer holds every other layer's activations; the bottom one every other
        # layer's gradients; interleaved MoE: the topmost layer of the top's other kind and
        # the bottommost of the bottom's other kind too
        candidates += [layer_point(0, mom) for mom in P.top_moments]
        candidates += [layer_point(nL - 1, mom) for mom in P.bottom_moments]
        candidates += [layer_point(i, mom) for i, moms in (P.other_top, P.other_bottom)
                       for mom in moms]
        if plan is not None:
            # the sweep is linear only between a recompute unit's ends (megatron_recompute)
            for i in plan.sweep_points():
                if 0 < i < nL - 1:
                    candidates += [layer_point(i, mom) for mom in (
                        P.top_moments if P.is_moe_from_top(i) else P.bottom_moments)]
        if ctx.engine == "fsdp2" and nL > 2:
            # FSDP2: only layers between the top and the bottom hold both the previous
            # layer's reduce-scatter input and the next one's prefetch (comm.reduce_bytes)
            for i in sorted({1, nL - 2}):
                candidates += [layer_point(i, mom)
                               for mom in act.layer_backward_moments(ctx, P.is_moe_from_top(i))]
    norm_work = P.final_norm_work
    if norm_work:
        lm_in = P.head_freed_at_final_norm
        wait = {"transients/tied_grad": ib.waiting} if ib else {}
        candidates.append(Phase("backward", B, 0 if ib else G if keep_grads else G_top, {
            **wait, "activations": int(k * A_mb - lm_in),
            "transients/autocast_cache": int(prev * C_mb + C_kept - cache_head),
            "transients/layer_backward": norm_work,
            "transients/gather_buffers": gather,
            "logits": prev_logits + root,
        }, states_made(ib, 0) if ib else None))
    if ctx.is_first_stage:
        # the embedding's backward ends the sweep: every gradient exists; with tied
        # embeddings the head's share waits in autograd's input buffer and the embedding's
        # is added to it (terms/gradients.py `embedding_backward_bytes`)
        tied, emb_work = embedding_backward_bytes(ctx, keep_grads)
        end_grads = ib.embed[0] if ib else G + tied + G_end
        for work, hooked in ((ib.summing, {}), (0, {"transients/optimizer_step": ib.embed[1]})
                             ) if ib else ((emb_work, {}),):
            candidates.append(Phase("backward", B, end_grads, {
                "activations": int(prev * A_mb + A_end),
                "transients/autocast_cache": int(prev * C_mb),
                "transients/layer_backward": work, **hooked,
                "transients/gather_buffers": gather_emb,
                "logits": prev_logits + root,
            }, states_made(ib, nL) if ib and not hooked else None))
        if rs := fsdp2_moments.root_reduce_scatter_bytes(ctx):  # FSDP2's last reduce-scatter
            candidates.append(Phase("backward", B, G, {"activations": int(prev * A_mb + A_end),
                                    "transients/reduce_buffers": rs, "logits": root}))
    backward = max(candidates, key=lambda p: p.total)

    optimizer = Phase("optimizer", B.without("logits/deferred_wgrad"), gradients_at_step_bytes(ctx), {
        "transients/optimizer_step": 0 if ib else P.optimizer_step,
        "optimizer_states/main_grads": opt["main_grads"]})  # Megatron fp16
    load = load_parts(ctx)  # the model being loaded and prepared (terms/load.py)
    phases = ([] if load and ctx.training.load_only else [forward, backward, optimizer]) + (
        [Phase("load", StageBase({}, {}), 0, load)] if load else [])
    S = opt["states"]  # first step: no states in forward/backward (made by the step or in it)
    first = phases[0].total if len(phases) == 1 else max(
        forward.total - S, optimizer.total, backward.total - S if not ib else max(
            c.total - S + (S if c.made is None else c.made) for c in candidates))
    peak = max(phases, key=lambda p: p.total)
    pad = reserved_pad_bytes(ctx, peak.name, peak.grads, *((0, 0, 0) if peak.name == "load"
                                                           else (opt["states"], opt["master"], k)))
    # (before transformers 4.46 the forward's upcast frees the logits ahead of the loss)
    freed_at = max(loss_bwd.total, loss_fwd.total if loss_in_forward(train) else 0)
    high = max(0 if len(phases) == 1 else freed_at + P.logits_freed,  # cached: OOM frees
               init_reserved_bytes(ctx))
    # cached beside the peak: the freed logits (logits.py), the init's segments
    # (tune_init.py), FSDP's side streams (terms/reserved.py)
    pipelined = accumulates_unsharded(ctx)  # the backward's gradients: unsharded, compute stream
    streams = 0 if peak.name == "load" else side_stream_bytes(
        ctx, [(p.total, 0 if pipelined and p.name != "optimizer" else p.grads, p.side)
              for p in phases if p.name != "load"])
    return phases, first, (pad, max(high - peak.total - pad, 0) + streams)


def estimate(scn: Scenario, every_stage: bool = True) -> MemoryReport:
    """Estimate per-rank memory of a scenario (validated; dp derived when omitted).

    With pipeline parallelism the report lists every stage (`stages`) and the top-level
    numbers are the worst rank's; `every_stage=False` computes only `candidate_stages`
    (which provably contain the worst rank) and lists those: same answer, less work, for
    callers that estimate thousands of scenarios.
    """
    resolved, fields = _report_fields(scn, every_stage)
    return _assemble(scn, fields, strategy_dict(resolved))


def _assemble(scn: Scenario, fields: dict[str, Any], strategy: dict[str, object]
              ) -> MemoryReport:
    """The report from `_report_fields`' numbers and the fit verdict. Report records trust
    their values (vramcalc/report.py); tests/test_properties.py checks the terms add up."""
    terms = Terms.model_construct(**fields["terms"])
    stages = [StageReport.model_construct(
        stage=st["stage"], num_layers=st["num_layers"],
        # the worst stage's terms are the report's: one (immutable) object for both
        terms=terms if st["terms"] == fields["terms"] else Terms.model_construct(**st["terms"]),
        peak_allocated_bytes=st["peak_allocated_bytes"],
        peak_reserved_bytes=st["peak_reserved_bytes"],
        device_total_bytes=st["device_total_bytes"]) for st in fields["stages"]]
    copied = ("model", "gpu", "subterms", "phases", "peak_phase", "peak_allocated_bytes",
              "peak_reserved_bytes", "first_step_peak_bytes", "device_total_bytes",
              "host_bytes_per_node", "nvme_bytes_per_node")
    return MemoryReport.model_construct(
        engine="analytic", strategy=strategy, terms=terms, stages=stages,
        notes=list(fields["notes"]), **{key: fields[key] for key in copied},
        **fit_verdict(scn, fields["device_total_bytes"]))


class _StageRun:
    """One pipeline stage's phases (steady state), first-step peak and overhead."""

    __slots__ = ("stage", "num_layers", "phases", "first", "overhead", "cached", "spilled")

    def __init__(self, stage: int, num_layers: int, phases: list[Phase], first: int,
                 overhead: dict[str, int], cached: int, spilled: int) -> None:
        self.stage, self.num_layers, self.phases, self.first = stage, num_layers, phases, first
        self.overhead, self.cached = overhead, cached  # cached: reserved above the fit floor
        self.spilled = spilled  # paged optimizer pages that live in host RAM


def _report_fields(scn: Scenario, every_stage: bool) -> tuple[Scenario, Any]:
    """The resolved scenario, and everything a report holds but the strategy and the fit
    verdict, as plain values."""
    scn = scn.resolved()
    check_capabilities(scn)  # what the GPU cannot run as counted: InputError
    if low_precision(scn.training):
        check_lowprec(scn)  # FP8 / QAT combinations not modelled: InputError
    gpu = scn.cluster.gpu if scn.cluster else None
    stages = list(range(scn.parallel.pp)) if every_stage else candidate_stages(scn)
    runs = []
    for st in stages:
        phases, first, (pad, cached) = stage_phases(scn, st, gpu)
        ovh = overhead_split(context_bytes(gpu, scn.training), scn.world_size, pad)
        ctx = RankContext(scn.model, scn.training, scn.parallel, st)
        symm = async_tp_overhead(ctx)
        spilled = 0
        if scn.training.optimizer.startswith("paged-"):  # pages with no room live on the host
            rest = max(p.total for p in phases) + sum(ovh.values()) + sum(symm.values())
            ovh["paged_optimizer_states"], spilled = paged_residency(
                paged_state_bytes(ctx), scn.usable_bytes, rest)
        ovh.update(symm)
        runs.append(_StageRun(st, ctx.num_layers, phases, first, ovh, cached, spilled))
    common = {"model": model_info(scn), "gpu": gpu_info(scn), "notes": scenario_notes(scn)}
    return scn, _fields(scn, runs, _pick(runs), common)


def _pick(runs: list[_StageRun]) -> tuple[tuple[int, ...], int]:
    """Each stage's (first largest) peak phase; the (first) worst stage by device total."""
    peaks: list[int] = []
    worst, worst_total = 0, None
    for i, run in enumerate(runs):
        totals = [p.total for p in run.phases]
        peak = max(range(len(totals)), key=totals.__getitem__)
        peaks.append(peak)
        total = totals[peak] + sum(run.overhead.values())
        if worst_total is None or total > worst_total:
            worst, worst_total = i, total
    return tuple(peaks), worst


def _fields(scn: Scenario, runs: list[_StageRun], pick: tuple[tuple[int, ...], int],
            common: dict[str, Any]) -> dict[str, Any]:
    """The report's values for the peak phases and worst stage `pick`."""
    peaks, worst = pick
    stage_rows: list[dict[str, Any]] = []
    for run, peak in zip(runs, peaks, strict=True):
        phase = run.phases[peak]
        t = phase.terms()
        t["overhead"] = sum(run.overhead.values())
        stage_rows.append({"stage": run.stage, "num_layers": run.num_layers, "terms": t,
                           "peak_allocated_bytes": phase.total, "peak_reserved_bytes":
                           phase.total + run.overhead["fragmentation"] + run.cached,
                           "device_total_bytes": phase.total + sum(run.overhead.values())})
    run = runs[worst]
    peak_phase = run.phases[peaks[worst]]
    terms = peak_phase.terms()
    terms["overhead"] = sum(run.overhead.values())
    subterms = {key: val for key, val in peak_phase.parts.items() if "/" in key}
    subterms.update({f"overhead/{key}": val for key, val in run.overhead.items()})
    host_nvme = _outside(scn, run.stage)
    gpus_per_node = scn.cluster.gpus_per_node if scn.cluster else 1
    return {
        "model": common["model"],
        "gpu": common["gpu"],
        "terms": terms,
        "subterms": subterms,
        "phases": {p.name: p.total for p in run.phases},
        "peak_phase": peak_phase.name,
        "peak_allocated_bytes": peak_phase.total,
        "peak_reserved_bytes": peak_phase.total + run.overhead["fragmentation"] + run.cached,
        "first_step_peak_bytes": run.first,
        "device_total_bytes": peak_phase.total + sum(run.overhead.values()),
        "host_bytes_per_node": host_nvme[0] + run.spilled * gpus_per_node,
        "nvme_bytes_per_node": host_nvme[1],
        "stages": stage_rows if scn.parallel.pp > 1 else [],
        "notes": common["notes"],
    }


def _outside(scn: Scenario, stage: int) -> tuple[int, int]:
    """Host RAM and NVMe bytes per node when `stage` is the worst rank (vramcalc.offload)."""
    ctx = RankContext(scn.model, scn.training, scn.parallel, stage)
    gpus_per_node = scn.cluster.gpus_per_node if scn.cluster else 1
    return (host_bytes_per_node(ctx, gpus_per_node, in_flight_microbatches(scn, stage)),
            nvme_bytes_per_node(ctx, gpus_per_node))

