"""Distributed trace: FSDP2 (`fully_shard`) training steps of one rank, under fake tensors and
a fake process group, counted like the single-rank trace.

`run_distributed_trace(scn)` traces rank 0 of a data-parallel world of `dp` ranks:

- `torch.distributed.init_process_group("fake", store=FakeStore())` (torch's testing
  backend: collectives return at once and leave their outputs' contents alone, so every
  buffer has its true shape and no rank needs to exist) and a CPU device mesh of the world
  (2-D (replicate, shard) for hybrid sharding);
- the model is built on the meta device (as torchtitan does), each transformer block and
  then the root is wrapped with `fully_shard` (`reshard_after_forward=False` for
  --fsdp grad-op), and `to_empty(device="cpu")` materializes only this rank's shards;
- precision: amp-bf16 / amp-fp16 become FSDP2's MixedPrecisionPolicy (fp32 sharded
  parameters, all-gathers in the compute dtype, fp32 gradient reduction), the others keep the
  parameters in their storage dtype; bf16/fp16 keep an fp32 master copy per shard
  (vramcalc.trace.optim.MixedPrecisionOptimizer);
- the step loop, model, optimizer, CUDA rules and report are the single-rank engine's
  (vramcalc.trace.engine); only the tracker learns about DTensors and FSDP2's buffers.

What the tracker must be told (else its figures are not what a GPU holds):

1. A DTensor is a wrapper subclass whose own storage reports the *global* size; a dispatch
   mode sees the wrapper (modes run before subclass dispatch) and not the local shard it
   wraps. Counting wrappers inflates everything created from a sharded parameter by the
   world size: `torch.zeros_like(p)` for AdamW's exp_avg/exp_avg_sq, the foreach
   temporaries of the step, `.float()` masters. `DistributedTracker` counts the local
   tensor instead, which is what a GPU allocates.
2. FSDP2 frees and re-allocates unsharded parameters with `UntypedStorage.resize_`
   (`_fsdp_param.free_storage` / `alloc_storage`), which no dispatch mode sees; the two
   functions are wrapped so the tracker re-reads the storage size after each call.

torch is imported only when a trace runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from vramcalc.errors import InputError
from vramcalc.hf_stack import trainer_no_sync
from vramcalc.report import MemoryReport
from vramcalc.scenario import Scenario
from vramcalc.terms.fsdp1 import wraps_adapters
from vramcalc.terms.gradients import reduce_dtype
from vramcalc.terms.transients import blas_workspace_parts
from vramcalc.trace.engine import (
    ITERATIONS,
    Progress,
    TraceResult,
    _result,
    _torch_dtype,
    build_model,
    check_eager_titan,
    check_traceable,
    fill_iterations,
    run_steps,
    run_trace,
    tracked_optimizer,
    watch_logits,
    with_lengths_note,
)
from vramcalc.trace.hf_models import quiet_libraries

if TYPE_CHECKING:
    import torch


def check_distributed(scn: Scenario) -> Scenario:
    """Resolve the scenario and refuse what the distributed trace cannot run (InputError)."""
    scn = scn.resolved()
    par, tr = scn.parallel, scn.training
    if par.fsdp == "none":
        raise InputError("the distributed trace runs FSDP2 layouts: give --fsdp full, "
                         "grad-op or hybrid")
    other = [f"{k}={v}" for k, v in (("tp", par.tp), ("pp", par.pp), ("cp", par.cp),
                                      ("ep", par.ep)) if v > 1]
    if other or par.offload:
        raise InputError("the distributed trace runs data-parallel FSDP2 without offload; got "
                         + ", ".join(other + [f"offload={','.join(par.offload)}"] * bool(
                             par.offload)))
    if tr.framework in ("megatron", "lightning", "unsloth"):
        raise InputError(f"trace runs the reference, hf and torchtitan profiles, not "
                         f"{tr.framework}")
    # torchtune's and HF Trainer's FSDP1 LoRA units hold per-parameter sharding's bytes:
    # FSDP2 stands in (terms/fsdp1.py `wraps_adapters`)
    if par.flat_fsdp(tr.framework) and not wraps_adapters(tr, par):
        raise InputError("the distributed trace runs FSDP2 (fully_shard); FSDP1's flat "
                         "parameters are modelled analytically (use --fsdp-impl fsdp2)")
    if par.dp_degree < 2:
        raise InputError("the distributed trace needs dp >= 2")
    check_eager_titan(scn)
    from vramcalc.trace.tune import check_tune  # torch, loaded with the trace

    check_tune(scn)
    return scn


def _tracker_class() -> Any:
    from torch.distributed.tensor import DTensor

    from vramcalc.trace.tracker import MemoryTracker

    def local(t: Any) -> Any:
        return t._local_tensor if isinstance(t, DTensor) else t

    class DistributedTracker(MemoryTracker):
        """MemoryTracker that counts a DTensor's local shard, not its global-size wrapper."""

        def track(self, t: Any, term: str | None = None) -> None:
            super().track(local(t), term)

        def label(self, t: Any, term: str) -> None:
            super().label(local(t), term)

        def set_host(self, t: Any) -> None:
            super().set_host(local(t))

        def term_of(self, t: Any) -> str | None:
            return super().term_of(local(t))

        def register_params(self, params: list[Any]) -> None:
            super().register_params([local(p) for p in params])

    return DistributedTracker


@contextlib.contextmanager
def _fsdp_storage_hooks(tracker: Any, fsdp1: bool = False) -> Iterator[None]:
    """Let the tracker see FSDP2's storage resizes and name its all-gathered parameters.
    `fsdp1`: FSDP2 stands in for FSDP1, which gathers into each flat parameter's own
    storage (terms/comm.py `copy_in_stream_bytes`): all-gathers run on the current stream,
    with no copy-in stream of their own."""
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group

    orig_alloc, orig_free = fsdp_param.alloc_storage, fsdp_param.free_storage
    orig_wait = fsdp_group.FSDPParamGroup.wait_for_unshard
    orig_streams = fsdp_group.FSDPCommContext.get_all_gather_streams

    def alloc_storage(tensor: torch.Tensor) -> None:
        orig_alloc(tensor)
        tracker.track(tensor)

    def free_storage(tensor: torch.Tensor) -> None:
        orig_free(tensor)
        tracker.track(tensor)

    def wait_for_unshard(self: Any) -> None:
        orig_wait(self)
        for p in self.fsdp_params:
            for t in getattr(p, "all_gather_outputs", ()):
                tracker.label(t, "transients/gather_buffers")

    fsdp_param.alloc_storage = alloc_storage
    fsdp_param.free_storage = free_storage
    fsdp_group.alloc_storage = alloc_storage
    fsdp_group.FSDPParamGroup.wait_for_unshard = wait_for_unshard  # type: ignore[method-assign]  # patch
    if fsdp1:
        def current_streams(self: Any, *_: Any) -> tuple[Any, Any]:
            stream = self.device_handle.current_stream()
            return stream, stream

        fsdp_group.FSDPCommContext.get_all_gather_streams = current_streams  # type: ignore[method-assign, assignment]  # patch
    try:
        yield
    finally:
        fsdp_param.alloc_storage, fsdp_param.free_storage = orig_alloc, orig_free
        fsdp_group.alloc_storage = orig_alloc
        fsdp_group.FSDPParamGroup.wait_for_unshard = orig_wait  # type: ignore[method-assign]  # unpatch
        fsdp_group.FSDPCommContext.get_all_gather_streams = orig_streams  # type: ignore[method-assign]  # unpatch


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A fake-backend default process group of `world_size` ranks (this process is rank 0)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise InputError("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _blocks(model: Any, num_layers: int) -> list[Any]:
    """The transformer blocks: the first ModuleList with one entry per layer."""
    import torch.nn as nn

    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == num_layers:
            return list(mod)
    raise InputError("could not find the model's transformer blocks to shard")


def _shard(model: Any, scn: Scenario, mesh: Any) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    tr, par = scn.training, scn.parallel
    mp = MixedPrecisionPolicy()
    if tr.is_autocast:  # fp32 sharded parameters, compute-dtype all-gathers, reduction in
        # the profile's reduce dtype (fp32; accelerate's: the compute dtype)
        mp = MixedPrecisionPolicy(param_dtype=_torch_dtype(tr.compute_dtype),
                                  reduce_dtype=_torch_dtype(reduce_dtype(tr)))
    reshard = par.fsdp != "grad-op"
    blocks = _blocks(model, scn.model.num_hidden_layers)
    for i, block in enumerate(blocks):
        # torchtitan (parallelize_llama.py `apply_fsdp`): the last block is not resharded
        # after forward ("FSDP would prefetch it immediately")
        last = tr.framework == "torchtitan" and i == len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard and not last)
    if par.fsdp_edge_units:  # torchtune's custom_sharded_layers: ['tok_embeddings', 'output']
        hf = hasattr(model, "get_input_embeddings")  # else vramcalc's reference model
        for edge in ((model.get_input_embeddings(), model.get_output_embeddings()) if hf
                     else (model.embed_tokens, model.lm_head)):
            fully_shard(edge, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def distributed_trace(scn: Scenario, progress: Progress | None = None,
                      iterations: int = ITERATIONS,
                      seq_lens: Sequence[int] | None = None) -> TraceResult:
    """Trace rank 0 of an FSDP2 data-parallel world (see the module docstring); `seq_lens`
    as in engine.trace."""
    scn = check_distributed(scn)
    iterations, seq_lens = fill_iterations(iterations, scn.training.grad_accum, seq_lens)
    try:
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError:  # pragma: no cover - torch is an optional extra
        raise InputError("the trace engine needs torch: pip install torch") from None
    from vramcalc.trace.cuda_rules import cuda_autocast_rules

    tr, par = scn.training, scn.parallel
    world = par.dp_degree
    report_progress = progress or (lambda _label, _frac: None)
    steps = iterations * (tr.grad_accum * 2 + 1)
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        report_progress(label, done / steps)
        done += 1

    gpu = scn.cluster.gpu if scn.cluster else None
    tracker = _tracker_class()(expandable_segments=tr.expandable,
                               workspace_bytes=blas_workspace_parts(gpu, tr))
    report_progress("building and sharding the model", 0.0)
    framework_ctx: Any = contextlib.nullcontext()
    if tr.framework == "hf":
        from vramcalc.trace.hf_models import real_device_behaviour

        framework_ctx = real_device_behaviour()
    fsdp1 = par.flat_fsdp(tr.framework)
    with fake_process_group(world), _fsdp_storage_hooks(tracker, fsdp1), framework_ctx:
        # the mesh is built outside fake mode (its coordinates use data-dependent ops)
        if par.fsdp == "hybrid":
            assert par.shard_group is not None
            mesh = init_device_mesh("cpu", (world // par.shard_group, par.shard_group),
                                    mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        fake = FakeTensorMode()
        with cuda_autocast_rules(), fake, tracker:
            # built on the meta device; a constant made in __init__ (Gemma's
            # `torch.tensor(embed_scale)` buffer) is a plain meta tensor, made fake here
            fake.allow_non_fake_inputs = True
            with torch.device("meta"):
                model = build_model(scn)
            fake.allow_non_fake_inputs = False
            return with_lengths_note(
                _run(scn, model, tracker, mesh, tick, report_progress, iterations, seq_lens),
                seq_lens)


def _run(scn: Scenario, model: Any, tracker: Any, mesh: Any, tick: Any, report_progress: Any,
         iterations: int, seq_lens: Sequence[int] | None) -> TraceResult:
    tr = scn.training
    # QLoRA: the quantization state FSDP does not shard (bitsandbytes' module metadata,
    # torchao's mean and table) becomes buffers, whole on every rank, counted as weights
    from vramcalc.trace.nf4 import NF4Linear

    nf4 = [(m, m.quant_state_to_buffers()) for m in model.modules()
           if isinstance(m, NF4Linear)]
    _shard(model, scn, mesh)
    model.to_empty(device="cpu")
    model.train()
    quant_state = [getattr(m, n) for m, names in nf4 for n in names]
    all_params = list(model.parameters()) + quant_state
    params = [p for p in all_params if p.requires_grad]
    tracker.register_params(all_params)
    qs = {id(t) for t in quant_state}
    for buf in model.buffers():
        if id(buf) not in qs:
            tracker.label(buf, "weights/buffers")
    param_bytes = sum(tracker.blocks[k].nbytes for k in tracker.param_keys)
    watch_logits(tracker, model, tr.framework)
    opt = tracked_optimizer(tracker, tr, params)

    fsdp_params = [fp for m in model.modules() if hasattr(m, "_get_fsdp_state")
                   and (g := m._get_fsdp_state()._fsdp_param_group) is not None
                   for fp in g.fsdp_params]

    def label_grads() -> None:  # FSDP2 writes the reduce-scattered shard into .grad; with
        # gradient sync off it keeps the unsharded ones (_fsdp_param.py
        # `to_accumulated_grad_if_needed`, `accumulate_unsharded_grad_if_needed`)
        for p in params:
            if p.grad is not None:
                tracker.label(p.grad, "gradients")
        for fp in fsdp_params:
            for g in (fp._unsharded_param.grad if hasattr(fp, "_unsharded_param") else None,
                      fp.unsharded_accumulated_grad):
                if g is not None:
                    tracker.label(g, "gradients")

    def sync(micro: int) -> None:  # HF Trainer: accelerate's no_sync() but for the last
        model.set_requires_gradient_sync(micro == tr.grad_accum - 1)

    no_sync = trainer_no_sync(tr, scn.parallel)
    from vramcalc.trace.liger import liger_rope
    from vramcalc.trace.lora import peft_trace_limits

    with liger_rope(model, tr.liger), peft_trace_limits(tr):
        run_steps(scn, tracker, model, params, opt, iterations, tick, seq_lens=seq_lens,
                  after_backward=label_grads, before_micro=sync if no_sync else None,
                  state_label="optimizer_states")
    report_progress("done", 1.0)
    return _result(scn, tracker, param_bytes, iterations)


def run_distributed_trace(scn: Scenario, progress: Progress | None = None) -> MemoryReport:
    """Per-rank memory of an FSDP2 scenario from a fake-tensor, fake-process-group training
    step (engine "trace"; same schema as `vramcalc.analytic.estimate`). Raises InputError for
    layouts it cannot run (TP/PP/CP/EP, offload, megatron profile, dp < 2)."""
    return distributed_trace(scn, progress).report


def check_any_traceable(scn: Scenario) -> Scenario:
    """What `trace_any` would run, resolved (InputError where neither trace can run it)."""
    return check_traceable(scn) if scn.parallel.fsdp == "none" else check_distributed(scn)


def trace_any(scn: Scenario, progress: Progress | None = None,
              seq_lens: Sequence[int] | None = None) -> MemoryReport:
    """The trace engine's report: one rank, or FSDP2 data parallelism on a fake process
    group (rank 0); `seq_lens` as in engine.trace."""
    with quiet_libraries():
        if scn.parallel.fsdp == "none":
            return run_trace(scn, progress, seq_lens)
        return distributed_trace(scn, progress, seq_lens=seq_lens).report
