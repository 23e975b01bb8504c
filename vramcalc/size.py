"""Cluster sizing: for each GPU type, how many GPUs, how long, how many GPU-hours, what cost.

Pure: the planner (vramcalc.plan.search) answers each "does it fit, how fast" question;
this module chooses the GPU counts to ask about and does the arithmetic:

    days      = tokens / (tokens/s) / 86,400
    GPU-hours = num_gpus · tokens / (tokens/s) / 3,600
    cost      = GPU-hours · price (USD per GPU-hour; the profile's indicative price or --price)

GPU counts searched: powers of two up to one node, then whole nodes doubling
(gpus_per_node · 2^k). The minimum is the smallest of those on which some strategy fits;
with a deadline (`days`), the smallest count whose best strategy finishes in time.

Stopping early: a count is not searched when the GPU's CUDA context and cuBLAS workspace
alone (what every rank holds, whatever the layout) leave no usable memory, and the scan over
counts stops when the time budget (`time_budget_s`, wall clock) is spent; the row says so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vramcalc.errors import InputError
from vramcalc.hardware import Cluster, GPUProfile
from vramcalc.plan import PlanEntry, PlanRequest, ProgressFn, search
from vramcalc.plan.search import check_searchable
from vramcalc.scenario import Scenario

SECONDS_PER_DAY = 86_400
DEFAULT_MAX_GPUS = 131_072


@dataclass(frozen=True)
class SizeRow:
    """One GPU type's answer. `entry` is None when nothing fits within the limit."""

    gpu: GPUProfile
    num_gpus: int | None
    min_gpus: int | None
    entry: PlanEntry | None
    days: float | None
    gpu_hours: float | None
    price_usd_per_hour: float | None
    cost_usd: float | None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        """The `--json` row (keys fixed by issue 5, plus min_gpus, tokens_per_s, mfu, notes)."""
        e = self.entry
        return {
            "gpu": self.gpu.id,
            "num_gpus": self.num_gpus,
            "days": self.days,
            "gpu_hours": self.gpu_hours,
            "cost_usd": self.cost_usd,
            "strategy": e.report.strategy if e else None,
            "min_gpus": self.min_gpus,
            "tokens_per_s": e.speed.tokens_per_s if e else None,
            "mfu": e.speed.mfu if e else None,
            "price_usd_per_hour": self.price_usd_per_hour,
            "device_total_bytes": e.report.device_total_bytes if e else None,
            "notes": list(self.notes),
        }


def size_counts(gpus_per_node: int, limit: int) -> list[int]:
    """1, 2, 4, … up to one node, then gpus_per_node · 2^k nodes, up to `limit` GPUs."""
    out = [n for n in (2**k for k in range(0, 31)) if n < gpus_per_node and n <= limit]
    n = gpus_per_node
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def _on(base: Scenario, gpu: GPUProfile, num_gpus: int) -> Scenario:
    gpn = gpu.gpus_per_node
    if num_gpus <= gpn:
        cl = Cluster.model_construct(gpu=gpu, num_nodes=1, gpus_per_node=num_gpus)
    else:
        cl = Cluster.model_construct(gpu=gpu, num_nodes=num_gpus // gpn, gpus_per_node=gpn)
    return base.model_copy(update={"cluster": cl, "gpu_note": None})


def _best(base: Scenario, req: PlanRequest) -> PlanEntry | None:
    try:
        res = search(base, replace(req, top_n=1), want_closest=False)
    except InputError:  # no valid layout at this count (e.g. the batch does not divide)
        return None
    return res.entries[0] if res.entries else None


def _out_of_time(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def size_one(base: Scenario, gpu: GPUProfile, tokens: int, req: PlanRequest,
             days: float | None = None, price: float | None = None,
             max_gpus: int = DEFAULT_MAX_GPUS, deadline: float | None = None) -> SizeRow:
    """Size one GPU type: minimum GPUs, GPUs for the deadline, time and cost. `deadline`
    (time.monotonic()) stops the scan over counts when reached."""
    counts = size_counts(gpu.gpus_per_node, max_gpus)
    notes: list[str] = []
    min_i, min_entry = None, None
    price = price if price is not None else gpu.price_usd_per_hour
    floor = gpu.context_overhead_bytes + gpu.blas_workspace_bytes
    if floor >= gpu.memory_total_bytes * (1 - base.headroom_fraction):
        return SizeRow(gpu, None, None, None, None, None, price, None, (
            f"nothing fits on any count: the CUDA context and cuBLAS workspace alone "
            f"({floor:,} bytes) fill the usable memory with --headroom "
            f"{base.headroom_fraction:g}",))
    searched = 0
    for i, n in enumerate(counts):
        if _out_of_time(deadline):
            break
        searched = n
        entry = _best(_on(base, gpu, n), req)
        if entry is not None:
            min_i, min_entry = i, entry
            break
    if min_entry is None or min_i is None:
        stopped = searched < (counts[-1] if counts else 0)
        found = f"no strategy fits on up to {searched:,} GPUs" if searched else "no count searched"
        return SizeRow(gpu, None, None, None, None, None, price, None, (
            found + ("; the time budget ran out before larger counts were searched (lower "
                     "--max-gpus or try a plan on one count)" if stopped else ""),))
    chosen_i, chosen = min_i, min_entry
    if days is not None:
        need = tokens / (days * SECONDS_PER_DAY)
        i, entry = min_i, min_entry
        tried: dict[int, PlanEntry | None] = {min_i: min_entry}
        while entry is None or entry.speed.tokens_per_s < need:
            have = entry.speed.tokens_per_s if entry else 0.0
            n_now = counts[i]
            # jump to the count that linear scaling says is enough, at least one step
            target = n_now * need / have if have else n_now * 2
            j = i + 1
            while j < len(counts) - 1 and counts[j] < target:
                j += 1
            if j >= len(counts):
                break
            if _out_of_time(deadline):
                notes.append("the time budget ran out before the deadline's count was found")
                break
            if j not in tried:
                tried[j] = _best(_on(base, gpu, counts[j]), req)
            i, entry = j, tried[j]
            if i == len(counts) - 1:
                break
        if entry is not None and entry.speed.tokens_per_s >= need:
            # step back while a smaller count also meets the deadline
            while i - 1 > min_i:
                if i - 1 not in tried:
                    tried[i - 1] = _best(_on(base, gpu, counts[i - 1]), req)
                prev = tried[i - 1]
                if prev is None or prev.speed.tokens_per_s < need:
                    break
                i, entry = i - 1, prev
            chosen_i, chosen = i, entry
        else:
            best = max((e for e in tried.values() if e is not None),
                       key=lambda e: e.speed.tokens_per_s)
            chosen_i = counts.index(best.report.gpu.num_gpus) if best.report.gpu else min_i
            chosen = best
            notes.append(f"cannot finish in {days:g} days on up to {counts[-1]:,} GPUs "
                         f"with a global batch of {req.batch_for(base.training.seq_len):,} "
                         "sequences; showing the fastest count found")
    n = counts[chosen_i]
    seconds = tokens / chosen.speed.tokens_per_s
    gpu_hours = n * seconds / 3600
    return SizeRow(gpu=gpu, num_gpus=n, min_gpus=counts[min_i], entry=chosen,
                   days=seconds / SECONDS_PER_DAY, gpu_hours=gpu_hours,
                   price_usd_per_hour=price,
                   cost_usd=gpu_hours * price if price is not None else None,
                   notes=tuple(notes))


def size_cluster(base: Scenario, gpus: Sequence[GPUProfile], tokens: int, req: PlanRequest,
                 days: float | None = None, prices: Mapping[str, float] | None = None,
                 max_gpus: int = DEFAULT_MAX_GPUS,
                 progress: ProgressFn | None = None,
                 time_budget_s: float | None = None) -> list[SizeRow]:
    """One row per GPU type, in the order given; the scan over GPU counts stops once
    `time_budget_s` seconds (all types together) have passed, saying so in the row."""
    deadline = time.monotonic() + time_budget_s if time_budget_s is not None else None
    check_searchable(base)
    if tokens <= 0:
        raise InputError("--tokens must be positive")
    if days is not None and not (days > 0 and math.isfinite(days)):
        raise InputError(f"--days must be a positive number, got {days}")
    rows = []
    for k, gpu in enumerate(gpus):
        if progress is not None:
            progress(f"sizing {gpu.name}", k, len(gpus))
        rows.append(size_one(base, gpu, tokens, req, days, (prices or {}).get(gpu.id),
                             max_gpus, deadline))
    if progress is not None:
        progress("done", len(gpus), len(gpus))
    return rows
