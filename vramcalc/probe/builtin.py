"""Built-in probe: the trace engine's training step with real tensors on a real device.

Same model (reference or Hugging Face class), optimizer and loop as vramcalc/trace/engine.py,
run with real storage. Warm-up iteration first (optimizer states appear), then the peak
counters are reset and the measured iterations run: `max_memory_allocated` is then the
steady-state peak that the analytic and trace engines predict. The first iteration's peak
is recorded too. An out-of-memory error is a result ("oom"), not a crash.
"""

from __future__ import annotations

import contextlib
import gc
import re
import time
from typing import Any

from vramcalc.probe.devices import Device, versions
from vramcalc.probe.record import SCHEMA, rel_error
from vramcalc.scenario import Scenario

_TRIED = re.compile(r"Tried to allocate ([0-9.]+) ([KMGT]i?B)")
_UNIT = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6,
         "GB": 10**9, "TB": 10**12}


def _failed_alloc_bytes(message: str) -> int | None:
    m = _TRIED.search(message)
    if not m:
        return None
    return int(float(m.group(1)) * _UNIT.get(m.group(2), 1))


def _one_iteration(model: Any, opt: Any, scn: Scenario, device: Device) -> None:
    import torch

    from vramcalc.trace.engine import _torch_dtype
    from vramcalc.trace.losses import step_loss

    tr = scn.training
    b, s, V = tr.micro_batch_size, tr.seq_len, scn.model.vocab_size
    dev_type = "cuda" if device.type in ("cuda", "rocm") else device.type
    autocast = (lambda: torch.autocast(dev_type, dtype=_torch_dtype(tr.compute_dtype))) if (
        tr.runs_autocast) else contextlib.nullcontext
    for _ in range(tr.grad_accum):
        ids = torch.randint(0, V, (b, s), device=device.torch_device)
        labels = torch.randint(0, V, (b, tr.target_len or s),  # seq2seq: decoder tokens
                               device=device.torch_device)
        with autocast():
            loss = step_loss(model, tr, ids, labels)
        (loss / tr.grad_accum).backward()
        del loss, ids, labels
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(scn: Scenario, device: Device, iterations: int = 2) -> dict[str, Any]:
    """Run warm-up + `iterations` measured iterations on `device`; return the `measured` part."""
    import torch

    from vramcalc.trace.engine import build_model, check_traceable
    from vramcalc.trace.optim import build_optimizer

    scn = check_traceable(scn)
    if scn.training.precision == "fp8":  # FP8Linear is a memory stand-in (trace/lowprec.py)
        from vramcalc.errors import InputError

        raise InputError("the built-in probe cannot run --precision fp8 (vramcalc's FP8 layer "
                         "is a Transformer Engine memory stand-in); measure your TE job with "
                         "`vramcalc probe --run`")
    m = device.module
    gc.collect()
    m.empty_cache()
    m.synchronize(device.index)
    free0, total = device.mem_get_info() or (0, device.total_memory() or 0)
    reserved0 = int(m.memory_reserved(device.index))
    # memory the process (and others) hold outside the allocator: CUDA context, libraries
    context_bytes = total - free0 - reserved0
    device.reset_peak()
    out: dict[str, Any] = {"context_bytes": int(context_bytes), "status": "ok"}
    model = opt = None
    t0 = time.perf_counter()
    try:
        with torch.device(device.torch_device):
            model = build_model(scn)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        tr = scn.training
        if tr.optimizer_in_backward:  # per-parameter optimizers stepped by hooks
            from vramcalc.trace.optim import InBackward, make_optimizer

            opt = InBackward(params, lambda ps: make_optimizer(tr.optimizer, ps, tr.step_impl),
                             lambda _p, _opt: None)
        else:
            opt = build_optimizer(tr.optimizer, params, tr.has_master_weights, tr.step_impl)
        _one_iteration(model, opt, scn, device)
        first = device.counters()
        out["first_step_max_memory_allocated_bytes"] = first["max_memory_allocated_bytes"]
        device.reset_peak()
        for _ in range(iterations):
            _one_iteration(model, opt, scn, device)
        out.update(device.counters())
        free1, _ = device.mem_get_info() or (0, 0)
        out["device_used_at_peak_bytes"] = int(
            context_bytes + out["max_memory_reserved_bytes"])
        out["free_after_bytes"] = int(free1)
    except torch.OutOfMemoryError as err:  # type: ignore[attr-defined]
        msg = " ".join(str(err).split())
        out.update({"status": "oom", "oom": {"message": msg[:500],
                                            "failed_alloc_bytes": _failed_alloc_bytes(msg)}})
        out.update(device.counters())
    finally:
        del model, opt
        gc.collect()
        m.empty_cache()
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def probe_record(scn: Scenario, values: dict[str, Any], device: Device, iterations: int = 2,
                 with_trace: bool = True) -> dict[str, Any]:
    """One probe record: device, versions, scenario, measured, analytic and trace peaks."""
    from vramcalc.analytic import estimate

    # --peft-config: PEFT's own methods are the trace engine's alone (vramcalc/peft_file.py)
    analytic = None if scn.training.finetune == "peft" else estimate(scn)
    trace_peak = None
    if with_trace or device.type == "cpu" or analytic is None:
        from vramcalc.trace.engine import run_trace
        from vramcalc.trace.hf_models import quiet_libraries

        with quiet_libraries():
            trace_peak = run_trace(scn).peak_allocated_bytes
    if device.type == "cpu":
        # dry-run fallback: the trace tracker stands in for the device counters
        measured: dict[str, Any] = {"status": "ok", "max_memory_allocated_bytes": trace_peak,
                                    "max_memory_reserved_bytes": None, "context_bytes": None,
                                    "dry_run": True}
    else:
        measured = measure(scn, device, iterations)
    status = measured.pop("status")
    oom = measured.pop("oom", None)
    peak = measured.get("max_memory_allocated_bytes")
    return {
        "schema": SCHEMA,
        "kind": "builtin",
        "device": {"type": device.type, "name": device.name(), "index": device.index,
                   "total_memory_bytes": device.total_memory()},
        "versions": versions(),
        "scenario": {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items()},
        "rank": 0,
        "world_size": 1,
        "status": status,
        "oom": oom,
        "measured": measured,
        "analytic": {"peak_allocated_bytes": analytic.peak_allocated_bytes,
                     "device_total_bytes": analytic.device_total_bytes,
                     "rel_error": rel_error(analytic.peak_allocated_bytes, peak)
                     if status == "ok" else None} if analytic is not None else None,
        "trace": {"peak_allocated_bytes": trace_peak,
                  "rel_error": rel_error(trace_peak, peak) if status == "ok" else None}
        if trace_peak is not None else None,
    }
