"""Live-storage memory tracker for fake-tensor training steps.

Method (cf. torch/distributed/_tools/mem_tracker.py): a TorchDispatchMode sees every aten
op. Each output tensor's storage is counted once (views share it), at its size rounded up
to 512 bytes as the CUDA caching allocator rounds every block (kMinBlockSize), and is
uncounted when the storage dies (a weakref callback on the storage object). Each counted
storage carries a term label (the memory report's keys), chosen when it appears:

| phase / region          | default term |
|-------------------------|--------------|
| build (model)           | weights      |
| forward                 | activations  |
| forward, after lm_head  | logits       |
| backward, before lm_head's grad | logits |
| backward                | transients   |
| optimizer               | transients   |

and relabelled when its role becomes known: parameter gradients (post-accumulate-grad hook)
become `gradients`, optimizer states and fp32 masters `optimizer_states`, autocast's casts
of fp32 parameters `transients` (sub-term `autocast_cache`). The tracker keeps, per
(iteration, phase), the largest total seen and the composition at that moment, and named
marks (end of forward, end of backward, end of step). CUDA-specific allocation behaviour
is delegated to `cuda_rules.rewrite_op`.

Every allocation and free is also replayed, in order, through the caching-allocator model
(vramcalc/allocator.py): `allocator.peak_reserved` is the trace's estimate of
`torch.cuda.max_memory_reserved`, and the recorded requests (`allocator.events`) give the
smallest capacity the run fits in (`allocator.min_capacity`). A storage resized in place is
a new block then the old one freed (`resize_` copies into a new allocation); the cuBLAS workspace, which torch takes
from the caching allocator at the first matmul (aten/src/ATen/cuda/CublasHandlePool.cpp keeps
it as a DataPtr of CUDACachingAllocator), is requested when the first forward starts, and
the backward thread's own when the first backward starts (terms/transients.py
`blas_workspace_parts`). Each
block is requested on the stream current when it is allocated, as torch's allocator does:
code written for any device (FSDP2's `device_handle.stream(...)`) selects its side streams
through `torch.cpu.stream` on the CPU, and `torch.cpu.current_stream()` names them here, so
the all-gather copy-in and reduce-scatter streams' blocks stay in pools of their own.

One CUDA behaviour a fake tensor cannot show: when two gradients reach one autograd input,
the engine adds the second into the first in place if it holds the first's last reference
(torch/csrc/autograd/input_buffer.cpp `accumulate`, `can_accumulate_inplace`). That test
refuses tensor subclasses, so under FakeTensorMode every such sum is a new tensor. The
tracker therefore counts a sum the engine makes of a plain (non-view) buffered gradient
as taking over that gradient's block, once the next event shows the buffered one freed
(`_settle`); a view's sum stays a new tensor, as on the GPU.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from vramcalc.allocator import CachingAllocator, from_start, min_capacity
from vramcalc.trace import cuda_rules
from vramcalc.units import round_alloc

aten = torch.ops.aten
_HOST_OPS = (aten.lift_fresh.default, aten.lift_fresh_copy.default)
_CAST_OPS = (aten._to_copy.default,)
# the decorators torch puts around a dispatch mode's handler (torch._disable_dynamo)
_WRAPPERS = ("_dynamo/eval_frame.py", "torch/_compile.py")


@dataclass
class Snapshot:
    """Allocated bytes at one moment: total, per term (and sub-term), live storages."""

    total: int = 0
    terms: dict[str, int] = field(default_factory=dict)
    num_live: int = 0
    side_allocated: int = 0  # the allocator's blocks in use on side streams (FSDP's)


@dataclass
class _Block:
    nbytes: int
    term: str
    ref: Any
    handle: int  # the block in the allocator model (0: none, a storage resized to 0)
    origin: str = ""  # op and shape that allocated it (debug mode only)


class MemoryTracker(TorchDispatchMode):
    """Counts live storages by term; see the module docstring."""

    def __init__(self, debug: bool = False, expandable_segments: bool = False,
                 workspace_bytes: tuple[int, int] = (0, 0)) -> None:
        super().__init__()
        self.allocator = CachingAllocator(expandable=expandable_segments, record=True)
        self._workspace = dict(zip(("forward", "backward"), workspace_bytes, strict=True))
        self.debug = debug
        self._origin = ""
        self.timeline: list[tuple[int, str, str, int, dict[str, int]]] | None = (
            [] if debug else None)
        self.peak_blocks: dict[tuple[int, str], tuple[str, list[tuple[int, str, str]]]] = {}
        self.blocks: dict[int, _Block] = {}
        self.host: dict[int, Any] = {}
        self.param_keys: set[int] = set()
        self.terms: dict[str, int] = {}
        self.total = 0
        self.phase = "build"
        # where training starts in allocator.events (the first forward): the capacity the
        # fit needs is replayed from there, the build's blocks requested anew
        self.training_start: int | None = None
        self.region: str | None = None
        self.iteration = 0
        self.peaks: dict[tuple[int, str], Snapshot] = {}
        self.marks: dict[tuple[int, str], Snapshot] = {}
        self._peak_key: tuple[int, str] | None = None
        self._peak: Snapshot | None = None
        self._host_alloc = False
        self._streams: dict[int, int] = {id(torch.cpu.current_stream()): 0}
        self._summing: int | None = None  # the buffered gradient a sum may take over
        self._pending: tuple[int, int, int, Snapshot, list[tuple[int, str, str]]] | None = None

    # ---- phases and marks ------------------------------------------------------------
    def set_phase(self, phase: str, region: str | None = None) -> None:
        """Start (or continue) a phase of the current iteration; its peak starts from now."""
        self._settle()
        if self.training_start is None and phase == "forward":
            self.training_start = len(self.allocator.events or [])
        self.phase, self.region = phase, region
        if self._workspace.get(phase):  # held for the process's lifetime
            self.allocator.malloc(self._workspace.pop(phase))
        key = (self.iteration, phase)
        self._peak_key = key
        self._peak = self.peaks.get(key)
        if self._peak is None or self.total > self._peak.total:
            self._peak = self.snapshot()
            self.peaks[key] = self._peak

    def fit_bytes(self, side_allocated: int, peak_total: int) -> int:
        """The capacity the traced steps need (docs/trace.md, "The fit"): with default
        segments the smallest capacity in which the training steps' requests run, an
        out-of-memory error releasing the cached whole segments first, as torch does
        (allocator.min_capacity), replayed from the first forward with the blocks then live
        requested anew (the fake-device build is no loader's order). With expandable
        segments torch unmaps the free pages of any block instead, which is not replayed:
        the reserved peak (at least `peak_total`, the allocated peak) less the side
        streams' blocks the peak does not use (`side_allocated`: those in use at it)."""
        a = self.allocator
        if a.expandable or not a.events:
            side = a.peak_reserved - a.stream_reserved[0]
            return max(a.peak_reserved, peak_total) - max(side - side_allocated, 0)
        return min_capacity(from_start(a.events, self.training_start or 0))

    def mark(self, name: str) -> None:
        self._settle()
        self.marks[(self.iteration, name)] = self.snapshot()

    def snapshot(self) -> Snapshot:
        a = self.allocator
        return Snapshot(self.total, {k: v for k, v in self.terms.items() if v}, len(self.blocks),
                        a.allocated - a.stream_allocated[0])

    def _update_peak(self, snap: Snapshot | None = None,
                     live: list[tuple[int, str, str]] | None = None) -> None:
        """Keep the current moment (or `snap`, a moment kept for later) if it is the
        phase's largest so far."""
        total = self.total if snap is None else snap.total
        if self._peak is not None and total > self._peak.total:
            self._peak = self.snapshot() if snap is None else snap
            assert self._peak_key is not None
            self.peaks[self._peak_key] = self._peak
            if self.debug:
                self.peak_blocks[self._peak_key] = (self._origin,
                                                    self.live() if live is None else live)

    # ---- counting --------------------------------------------------------------------
    def default_term(self) -> str:
        if self.phase == "build":
            return "weights"
        if self.phase == "build_optimizer":
            return "optimizer_states"
        if self.region == "logits":
            return "logits"
        return "activations" if self.phase == "forward" else "transients"

    def track(self, t: Any, term: str | None = None) -> None:
        """Count t's storage if it is new (under `term`, else the phase's default)."""
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return  # a meta tensor (a model built before it is sharded) has no storage
        st = t.untyped_storage()
        key = st._cdata
        if key in self.host:
            return
        if self._host_alloc:  # allocated outside the caching allocator (host_allocations)
            self.set_host(t)
            return
        nbytes = round_alloc(st.nbytes())
        blk = self.blocks.get(key)
        if blk is not None:
            if blk.nbytes != nbytes:  # resized in place
                self._settle()
                handle = self.allocator.malloc(nbytes, self._stream()) if nbytes else 0
                self._release(blk)
                self._add(blk.term, nbytes - blk.nbytes)
                blk.nbytes, blk.handle = nbytes, handle
            return
        if nbytes == 0:
            return
        term = term or self.default_term()

        def on_free(_r: weakref.ReferenceType[torch.UntypedStorage]) -> None:
            self._free(key)

        ref = weakref.ref(st, on_free)
        origin = f"{self._origin} {tuple(t.shape)} {t.dtype}" if self.debug else ""
        summing = self._summing
        if summing is not None and summing in self.blocks and self.blocks[
                summing].nbytes == nbytes:  # decided at the next event (_settle)
            self.blocks[key] = _Block(nbytes, term, ref, 0, origin)
            self.terms[term] = self.terms.get(term, 0) + nbytes
            self.total += nbytes
            self._pending = (summing, key, self._stream(), self.snapshot(),
                             self.live() if self.debug else [])
            return
        self._settle()
        self.blocks[key] = _Block(nbytes, term, ref,
                                  self.allocator.malloc(nbytes, self._stream()), origin)
        self._add(term, nbytes)

    def _stream(self) -> int:
        """The current stream's pool index (0: the default stream; module docstring)."""
        return self._streams.setdefault(id(torch.cpu.current_stream()), len(self._streams))

    def _add(self, term: str, nbytes: int) -> None:
        self.terms[term] = self.terms.get(term, 0) + nbytes
        self.total += nbytes
        if nbytes > 0:
            self._update_peak()

    def _free(self, key: int) -> None:
        self._settle(key)
        blk = self.blocks.pop(key, None)
        if blk is not None:
            self.terms[blk.term] -= blk.nbytes
            self.total -= blk.nbytes
            self._release(blk)
        self.host.pop(key, None)

    def _release(self, blk: _Block) -> None:
        if blk.handle:
            self.allocator.free(blk.handle)
            blk.handle = 0

    # ---- autograd's input buffer -----------------------------------------------------
    def _settle(self, freed: int | None = None) -> None:
        """Decide a sum of two gradients for one autograd input (`_input_buffer_sum`) at the
        next allocation or free. When that event frees the buffered gradient, the engine
        held its last reference, and on a GPU it adds in place
        (torch/csrc/autograd/input_buffer.cpp `accumulate`: `old_var.add_(var)` when
        `can_accumulate_inplace(old_var)`). A fake tensor is a tensor subclass, which that
        test refuses, so the trace sees `old_var + var`; here the sum takes over the
        buffered gradient's block and adds no peak. Otherwise the sum is a new block, and
        the moment it was made counts toward the peak as it would have."""
        pend, self._pending = self._pending, None
        if pend is None:
            return
        old_key, new_key, stream, snap, live = pend
        new = self.blocks.get(new_key)
        if new is None:
            return
        if freed == old_key:
            old = self.blocks[old_key]
            new.handle, old.handle = old.handle, 0
            return
        new.handle = self.allocator.malloc(new.nbytes, stream)
        self._update_peak(snap, live)

    def _input_buffer_sum(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                          ) -> int | None:
        """The buffered gradient's storage when autograd's engine sums two gradients of one
        input in backward: an out-of-place `add` called by the engine itself (no Python
        frame between, grad mode off), of two dense tensors of one shape and dtype."""
        if (func is not aten.add.Tensor or self.phase != "backward" or kwargs
                or torch.is_grad_enabled() or len(args) != 2):
            return None
        old, var = args
        if not (isinstance(old, torch.Tensor) and isinstance(var, torch.Tensor)
                and old.shape == var.shape and old.dtype == var.dtype
                and old.is_contiguous() and not old._is_view()):
            return None
        frame = sys._getframe(2)  # past __torch_dispatch__ and torch's own wrappers of it
        while frame.f_back is not None and frame.f_code.co_filename.endswith(_WRAPPERS):
            frame = frame.f_back
        if frame.f_code.co_name != "_engine_run_backward":  # a Python backward's own add
            return None
        return old.untyped_storage()._cdata

    def label(self, t: torch.Tensor, term: str) -> None:
        """Move t's storage to `term` (counting it first if it is new)."""
        self.track(t, term)
        blk = self.blocks.get(t.untyped_storage()._cdata)
        if blk is not None and blk.term != term:
            self.terms[blk.term] -= blk.nbytes
            self.terms[term] = self.terms.get(term, 0) + blk.nbytes
            blk.term = term

    @contextlib.contextmanager
    def host_allocations(self) -> Iterator[None]:
        """Storages allocated inside live outside torch's caching allocator (bitsandbytes'
        unified-memory buffers): never counted, never in the allocator replay."""
        self._host_alloc = True
        try:
            yield
        finally:
            self._host_alloc = False

    def set_host(self, t: torch.Tensor) -> None:
        """t lives in host memory on a CUDA machine: never count it."""
        st = t.untyped_storage()
        key = st._cdata
        blk = self.blocks.pop(key, None)
        if blk is not None:
            self.terms[blk.term] -= blk.nbytes
            self.total -= blk.nbytes
            self._release(blk)
        if key not in self.host:
            def forget(_r: weakref.ReferenceType[torch.UntypedStorage]) -> None:
                self.host.pop(key, None)

            self.host[key] = weakref.ref(st, forget)

    def register_params(self, params: list[torch.Tensor]) -> None:
        for p in params:
            self.label(p, "weights")
            self.param_keys.add(p.untyped_storage()._cdata)

    def live(self, term: str | None = None) -> list[tuple[int, str, str]]:
        """Debug: (bytes, term, origin) of every live storage, largest first."""
        out = [(b.nbytes, b.term, b.origin) for b in self.blocks.values()
               if term is None or b.term == term]
        return sorted(out, reverse=True)

    def term_of(self, t: torch.Tensor) -> str | None:
        blk = self.blocks.get(t.untyped_storage()._cdata)
        return blk.term if blk else None

    # ---- dispatch --------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if self.debug:
            self._origin = f"{self.phase}:{self.region or ''}:{func.__name__}"
        handled, out = cuda_rules.rewrite_op(func, args, kwargs, self.track)
        if not handled:
            out = func(*args, **kwargs)
        if func is aten._scaled_dot_product_efficient_attention.default:
            for t in out[2:]:  # philox seed, offset: host tensors on CUDA (attention.cu)
                self.set_host(t)
        if func in _HOST_OPS:
            tree_map(lambda t: self.set_host(t) if isinstance(t, torch.Tensor) else None, out)
            return out
        self._summing = self._input_buffer_sum(func, args, kwargs)
        term = None
        if (func in _CAST_OPS and self.phase in ("forward", "backward")
                and args and isinstance(args[0], torch.Tensor)
                and args[0].untyped_storage()._cdata in self.param_keys):
            term = "transients/autocast_cache"
        tree_map(lambda t: self.track(t, term), out)
        self._summing = None
        if self.timeline is not None:
            self.timeline.append((self.iteration, self.phase, func.__name__, self.total,
                                  dict(self.terms)))
        return out
