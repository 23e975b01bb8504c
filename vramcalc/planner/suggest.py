"""When nothing fits: the smallest changes that would, each with the best plan under it.

Tried in order — more GPUs of the same type, another GPU type with more memory, offload to
host RAM, 8-bit AdamW, a fused AdamW step, LoRA/QLoRA/DoRA, chunked cross entropy, activation
offload, a shorter sequence — each first screened by `feasible` (a few estimates of the most
memory-frugal candidates), then searched.
Pure: no I/O; progress goes to an optional callback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from vramcalc.errors import InputError
from vramcalc.hardware import Cluster, GPUProfile
from vramcalc.planner.bound import MemoryBound
from vramcalc.planner.candidates import REC_ORDER, Candidate, Enumerator
from vramcalc.planner.request import PlanRequest, ProgressFn
from vramcalc.planner.search import PlanEntry, estimate_candidate, search, usable_and_context
from vramcalc.scenario import Scenario
from vramcalc.training import FINETUNES, TrainingConfig

# torchtune's CEWithChunkedOutputLoss(num_output_chunks: int = 8)
# (pytorch/torchtune torchtune/modules/loss/ce_chunked_output_loss.py)
CHUNKED_CE_DEFAULT = 8


@dataclass(frozen=True)
class Suggestion:
    """A change that makes the job fit, with the best plan under it."""

    # more_gpus | other_gpu | offload | optimizer | optimizer_impl | sync_each_batch |
    # finetune | chunked_ce | liger | activation_offload | seq_len
    kind: str
    title: str
    change: Mapping[str, Any]  # option values to apply (CLI option names, snake_case)
    entry: PlanEntry
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "title": self.title, "change": dict(self.change),
                **dict(self.details), "candidate": self.entry.to_json()}


def feasible(base: Scenario, req: PlanRequest, probes: int = 16) -> bool:
    """Quick check that some layout fits: estimate the most memory-frugal candidates
    (full recompute, smallest micro-batch, smallest memory lower bound) until one fits.
    A less frugal recompute mode is listed only while fewer than `probes` are in hand, and
    not at all when no candidate of a more frugal one is under the memory bound (the bound's
    model states are the same, its activation floor no smaller: bound.py `floor`)."""
    if base.cluster is None:
        return False
    usable, context = usable_and_context(base)
    bound = MemoryBound(base)
    scored: list[tuple[int, float, tuple, Candidate]] = []
    try:
        en = Enumerator(base, req, bound, usable - context)
        for rec in sorted(en.recomputes, key=lambda r: -REC_ORDER[r]):
            if len(scored) >= probes:
                break
            level = [(c.b, lower, c.tail(), c) for g in en.groups
                     for c in en.expand(g, recompute=rec)
                     if (lower := bound.total(c)) + context <= usable]
            if not level:  # a less frugal mode's activation floor is no smaller
                break
            scored += sorted(level, key=lambda t: t[:3])
    except InputError:
        return False
    for *_, c in scored[:probes]:
        e = estimate_candidate(c, base, req)
        if e is not None and e.fits:
            return True
    return False


def _cluster_text(num_gpus: int, gpu: GPUProfile) -> str | None:
    gpn = gpu.gpus_per_node
    name = gpu.aliases[0] if gpu.aliases else gpu.id
    if num_gpus <= gpn:
        return f"{num_gpus}x{name}"
    if num_gpus % gpn:
        return None
    return f"{num_gpus // gpn}x{gpn}x{name}"


def _with_cluster(base: Scenario, num_gpus: int, gpu: GPUProfile) -> Scenario | None:
    gpn = gpu.gpus_per_node
    if num_gpus <= gpn:
        cl = Cluster.model_construct(gpu=gpu, num_nodes=1, gpus_per_node=num_gpus)
    elif num_gpus % gpn == 0:
        cl = Cluster.model_construct(gpu=gpu, num_nodes=num_gpus // gpn, gpus_per_node=gpn)
    else:
        return None
    return base.model_copy(update={"cluster": cl, "gpu_note": None})


def gpu_counts(start: int, gpn: int, limit: int) -> list[int]:
    """Counts tried when adding GPUs: doubling within a node, then doubling whole nodes."""
    out = []
    n = start * 2
    while n <= limit:
        if n <= gpn or n % gpn == 0:
            out.append(n)
        n *= 2
    if start < gpn and gpn not in out and gpn <= limit:
        out.append(gpn)
    return sorted(set(out))


def _best(base: Scenario, req: PlanRequest) -> PlanEntry | None:
    try:
        res = search(base, replace(req, top_n=1), want_closest=False)
    except InputError:
        return None
    return res.entries[0] if res.entries else None


def _retrain(base: Scenario, **update: Any) -> Scenario | None:
    """`base` with these training values; None when one is out of its declared bounds."""
    try:
        training = TrainingConfig(**{**base.training.model_dump(), **update})
    except ValidationError:
        return None
    return base.model_copy(update={"training": training})


def _lever(base: Scenario, req: PlanRequest, kind: str, title: str,
           **update: Any) -> Suggestion | None:
    """The suggestion of one training-setting change, when it makes the job fit."""
    scn = _retrain(base, **update)
    if scn is None or not feasible(scn, req):
        return None
    entry = _best(scn, req)
    return None if entry is None else Suggestion(kind, title, update, entry)


def suggest_changes(base: Scenario, req: PlanRequest, profiles: Sequence[GPUProfile] = (),
                    progress: ProgressFn | None = None, max_gpus: int = 16384,
                    max_other_gpus: int = 3, closest: PlanEntry | None = None,
                    ) -> list[Suggestion]:
    """The smallest changes that make the job fit, each with the best plan under it
    (`closest`, the layout that came nearest, only words a title)."""
    assert base.cluster is not None
    out: list[Suggestion] = []
    cl = base.cluster
    gpu = cl.gpu
    steps = ["gpus", "gpu type", "offload", "optimizer", "fused optimizer", "gradient sync",
             "finetune", "chunked loss", "liger", "activation offload", "sequence"]

    def tick(i: int) -> None:
        if progress is not None:
            progress(f"looking for changes that fit ({steps[i]})", i, len(steps))

    # 1. more GPUs of the same type
    tick(0)
    for n in gpu_counts(cl.num_gpus, gpu.gpus_per_node, max_gpus):
        scn = _with_cluster(base, n, gpu)
        if scn is None or not feasible(scn, req):
            continue
        entry = _best(scn, req)
        if entry is not None:
            text = _cluster_text(n, gpu)
            out.append(Suggestion("more_gpus", f"use {n} {gpu.name} GPUs instead of {cl.num_gpus}",
                                  {"gpus": text}, entry, {"num_gpus": n}))
            break
    # 2. another GPU type, same count
    tick(1)
    others = sorted((p for p in profiles if p.memory_total_bytes > gpu.memory_total_bytes
                     and p.id != gpu.id), key=lambda p: (p.memory_total_bytes, p.id))
    found = 0
    for p in others:
        if found >= max_other_gpus:
            break
        scn = _with_cluster(base, cl.num_gpus, p)
        if scn is None or not feasible(scn, req):
            continue
        entry = _best(scn, req)
        if entry is not None:
            found += 1
            out.append(Suggestion("other_gpu", f"use {cl.num_gpus} x {p.name}",
                                  {"gpus": _cluster_text(cl.num_gpus, p)}, entry,
                                  {"gpu": p.id, "num_gpus": cl.num_gpus}))
    # 3. offload to host RAM
    tick(2)
    if "offload" not in req.allow and "offload" not in req.pinned:
        for off in (("optimizer",), ("optimizer", "params")):
            r2 = replace(req, pinned={**req.pinned, "offload": off})
            if not feasible(base, r2):
                continue
            entry = _best(base, r2)
            if entry is not None:
                host = entry.report.host_bytes_per_node
                out.append(Suggestion(
                    "offload", f"offload {' and '.join(off)} to CPU RAM", {"offload": ",".join(off)},
                    entry, {"host_bytes_per_node": host}))
                break
    # 4. 8-bit optimizer
    tick(3)
    tr = base.training
    if tr.optimizer in ("adam", "adamw") and "optimizer" not in req.allow:
        scn = _retrain(base, optimizer="adamw-8bit")
        if scn is not None and feasible(scn, req):
            entry = _best(scn, req)
            if entry is not None:
                out.append(Suggestion("optimizer", "use 8-bit AdamW (bitsandbytes)",
                                      {"optimizer": "adamw-8bit"}, entry))
    # 5. a fused AdamW step: torch._fused_adamw_ updates in place, no _foreach_sqrt copy of
    # the second moments (vramcalc/terms/transients.py)
    tick(4)
    if tr.optimizer in ("adam", "adamw") and tr.optimizer_impl != "fused":
        sg = _lever(base, req, "optimizer_impl", "step AdamW fused (no foreach temporaries)",
                    optimizer_impl="fused")
        if sg is not None:
            out.append(sg)
    # 6. HF Trainer: reduce-scatter every micro-batch instead of accumulating unsharded
    # gradients under accelerate's no_sync() (hf_stack.py `trainer_no_sync`)
    tick(5)
    if tr.framework == "hf" and not tr.sync_each_batch:
        sg = _lever(base, req, "sync_each_batch", "reduce FSDP gradients after every "
                    "micro-batch (accelerate's sync_each_batch)", sync_each_batch=True)
        if sg is not None:
            out.append(sg)
    # 7. LoRA / QLoRA / DoRA
    tick(6)
    if "finetune" not in req.allow:
        ft_req = replace(req, finetuning=True)  # rerun with --finetune: a fine-tuning batch
        batch = ft_req.batch_for(tr.seq_len)
        what = "" if batch == req.batch_for(tr.seq_len) else (
            f" (a fine-tuning batch of {batch} sequences)")
        for ft in FINETUNES:
            if ft in (tr.finetune, "full"):
                continue
            scn = _retrain(base, finetune=ft)
            if scn is not None and feasible(scn, ft_req):
                entry = _best(scn, ft_req)
                if entry is not None:
                    out.append(Suggestion("finetune", f"fine-tune with {ft}{what}",
                                          {"finetune": ft}, entry))
                    break
    # 8. chunked cross entropy: the fp32 logits and their gradients one chunk at a time;
    # 8 chunks = torchtune's CEWithChunkedOutputLoss default num_output_chunks
    tick(7)
    if tr.chunked_ce == 1:
        share = ""
        if closest is not None and closest.report.device_total_bytes:
            frac = closest.report.terms.logits / closest.report.device_total_bytes
            share = f" (logits are {frac:.0%} of the closest layout's memory)"
        sg = _lever(base, req, "chunked_ce", f"chunk the cross entropy in 8{share}",
                    chunked_ce=CHUNKED_CE_DEFAULT)
        if sg is not None:
            out.append(sg)
    # 9. HF Trainer's use_liger_kernel: no full logits, fused norms and SwiGLU
    tick(8)
    if tr.framework == "hf" and not tr.liger and tr.chunked_ce == 1:
        # TRL's SFTTrainer then runs its nll loss through Liger's fused one
        sg = _lever(base, req, "liger", "use Liger kernels (use_liger_kernel=True)", liger=True,
                    trl_chunked_ce=False)
        if sg is not None:
            out.append(sg)
    # 10. activation offload: saved activations wait in pinned host memory
    tick(9)
    if not tr.activation_offload:
        sg = _lever(base, req, "activation_offload", "offload activations to CPU RAM",
                    activation_offload=True)
        if sg is not None:
            out.append(sg)
    # 11. shorter sequence (largest power-of-two fraction that fits)
    tick(10)
    s = tr.seq_len // 2
    while s >= 128:
        scn = _retrain(base, seq_len=s)
        if scn is not None and feasible(scn, req):
            entry = _best(scn, req)
            if entry is not None:
                out.append(Suggestion("seq_len", f"train on sequences of {s} tokens",
                                      {"seq_len": s}, entry, {"seq_len": s}))
                break
        s //= 2
    if progress is not None:
        progress("done", len(steps), len(steps))
    return out
