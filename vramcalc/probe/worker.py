"""One rank of `vramcalc probe --nproc N`: launched by torchrun, writes rank<R>.json.

    torchrun --nproc-per-node N -m vramcalc.probe.worker --values JSON --out DIR

Data parallelism only: DDP (zero 0) or FSDP2 `fully_shard` per layer + root (zero 3 /
fsdp full; fsdp grad-op keeps parameters unsharded after forward). The model is built on
the meta device and materialised shard by shard, so a model larger than one device works
under FSDP2. Same loop as the single-device probe: warm-up, reset peaks, measured iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from vramcalc.errors import InputError


def _layers(model: Any, num_layers: int) -> list[Any]:
    import torch.nn as nn

    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == num_layers:
            return list(mod)
    return []


def wrap(model: Any, scn: Any, device: Any) -> Any:
    """DDP or FSDP2 per the scenario's data-parallel sharding."""
    import torch

    par = scn.parallel
    if par.tp > 1 or par.pp > 1 or par.cp > 1 or par.ep > 1 or par.offload:
        raise InputError("probe --nproc runs data parallelism only (DDP or FSDP2); "
                         "tp/pp/cp/ep/offload are estimated, not probed")
    stage = par.shard_stage
    if stage == 0:
        from torch.nn.parallel import DistributedDataParallel

        model.to_empty(device=device)
        _init(model)
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if stage in (1, 2) and par.fsdp == "none":
        raise InputError("probe --nproc supports --zero 0 (DDP), --zero 3 / --fsdp full and "
                         "--fsdp grad-op (FSDP2)")
    from torch.distributed.fsdp import fully_shard

    reshard = par.fsdp != "grad-op"
    for layer in _layers(model, scn.model.num_hidden_layers):
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    model.to_empty(device=device)
    _init(model)
    del torch
    return model


def _init(model: Any) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for b in model.buffers():
            if b.is_floating_point():
                b.zero_()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--values", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--iterations", type=int, default=2)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from vramcalc.options import build_scenario
    from vramcalc.probe.builtin import _one_iteration
    from vramcalc.probe.devices import find_device, versions
    from vramcalc.probe.record import SCHEMA, rel_error, write_record
    from vramcalc.trace.engine import build_model
    from vramcalc.trace.optim import build_optimizer

    values = json.loads(args.values)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ["WORLD_SIZE"])
    dev = find_device(local, allow_cpu=True)
    backend = {"cuda": "nccl", "rocm": "nccl", "npu": "hccl"}.get(dev.type, "gloo")
    if dev.module is not None:
        dev.module.set_device(local)
    dist.init_process_group(backend)
    record: dict[str, Any] = {"schema": SCHEMA, "kind": "builtin", "rank": rank,
                              "world_size": world, "scenario": values,
                              "device": {"type": dev.type, "name": dev.name(), "index": local,
                                         "total_memory_bytes": dev.total_memory()},
                              "versions": versions(), "status": "ok", "oom": None}
    model = opt = None
    try:
        scn = build_scenario(values)
        if scn.cluster is not None and scn.cluster.num_gpus != world:
            raise InputError(f"--gpus gives {scn.cluster.num_gpus} GPUs but --nproc is {world}")
        device = torch.device(dev.torch_device)
        with torch.device("meta"):
            model = build_model(scn)
        model = wrap(model, scn, device)
        model.train()
        opt = build_optimizer(scn.training.optimizer,
                              [p for p in model.parameters() if p.requires_grad],
                              scn.training.has_master_weights, scn.training.step_impl)
        _one_iteration(model, opt, scn, dev)
        first = dev.counters()
        dev.reset_peak()
        for _ in range(args.iterations):
            _one_iteration(model, opt, scn, dev)
        # None where the device has no allocator counters (cpu: counters() is empty)
        measured: dict[str, int | None] = dict(dev.counters())
        measured["first_step_max_memory_allocated_bytes"] = first.get(
            "max_memory_allocated_bytes")
        record["measured"] = measured
        from vramcalc.analytic import estimate

        record["analytic"] = None  # --peft-config: the trace engine's alone
        if scn.training.finetune != "peft":
            rep = estimate(scn)
            record["analytic"] = {
                "peak_allocated_bytes": rep.peak_allocated_bytes,
                "device_total_bytes": rep.device_total_bytes,
                "rel_error": rel_error(rep.peak_allocated_bytes,
                                       measured.get("max_memory_allocated_bytes"))}
    except torch.OutOfMemoryError as err:  # type: ignore[attr-defined]
        record["status"] = "oom"
        record["oom"] = {"message": " ".join(str(err).split())[:500]}
        record["measured"] = dev.counters()
    except InputError as err:
        record["status"] = "error"
        record["error"] = str(err)
    finally:
        del model, opt
        write_record(record, args.out / f"rank{rank}.json")
        # every rank reaches the end before rank 0, which hosts the rendezvous store, leaves
        # (a rank still tearing down would lose the store and exit non-zero)
        dist.barrier()
        dist.destroy_process_group()
    return 0 if record["status"] != "error" else 2


if __name__ == "__main__":
    sys.exit(main())
