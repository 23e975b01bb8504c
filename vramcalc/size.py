"""Cluster sizing: for each GPU type, a short table of cluster sizes with days, GPU-hours and
cost, and the size that answers the purchase question.

Pure: the planner (vramcalc.planner.search) answers each "does it fit, how fast" question;
this module chooses the GPU counts to ask about and does the arithmetic:

    days      = tokens / (tokens/s) / 86,400
    GPU-hours = num_gpus · tokens / (tokens/s) / 3,600
    cost      = GPU-hours · price (USD per GPU-hour; the profile's indicative price or --price)

GPU counts: powers of two below one node, then whole nodes 1, 2, 3, 4, 6, 8, 12, 16, 24, …
(each step x1.5 or x1.33). The table runs from the smallest count on which some strategy
fits up to the knee: it stops before the first count whose MFU is below half the best MFU
seen (past it, each added GPU returns less than half its worth, because the fixed global
batch leaves data parallelism nothing to split). Without a deadline the answer is the
largest size whose GPU-hours are within 10 % of the cheapest size's (the fastest run that
costs about the least); for a fine-tuning job (`fewest`: a LoRA/QLoRA/DoRA method or
--finetune given) the smallest such size, since its token budget is small enough that the
fastest cluster would finish in minutes; with `days`, the smallest size in the table that
meets the deadline, or, when none does, the global batch that would let the cluster grow
far enough.

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
from vramcalc.planner import PlanEntry, PlanRequest, ProgressFn, search
from vramcalc.planner.request import splittable_batch
from vramcalc.planner.search import check_searchable
from vramcalc.scenario import Scenario, capability_problem

SECONDS_PER_DAY = 86_400
DEFAULT_MAX_GPUS = 131_072
KNEE_MFU_FRACTION = 0.5  # the table stops where MFU falls below half its best
COST_SLACK = 0.10  # without a deadline: the fastest size within 10 % of the cheapest


@dataclass(frozen=True)
class SizeOption:
    """One cluster size in the table."""

    num_gpus: int
    entry: PlanEntry
    days: float
    gpu_hours: float
    cost_usd: float | None

    def to_json(self) -> dict[str, Any]:
        return {"num_gpus": self.num_gpus, "days": self.days, "gpu_hours": self.gpu_hours,
                "cost_usd": self.cost_usd, "tokens_per_s": self.entry.speed.tokens_per_s,
                "mfu": self.entry.speed.mfu, "strategy": self.entry.report.strategy}


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
    table: tuple[SizeOption, ...] = ()
    suggested_global_batch: int | None = None  # sequences; when the deadline needs it

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
            "table": [o.to_json() for o in self.table],
            "suggested_global_batch_size": self.suggested_global_batch,
        }


def size_counts(gpus_per_node: int, limit: int) -> list[int]:
    """Powers of two below one node, then whole nodes 1, 2, 3, 4, 6, 8, 12, … (x1.5 / x1.33
    steps), up to `limit` GPUs."""
    out = [n for n in (2**k for k in range(0, 31)) if n < gpus_per_node and n <= limit]
    k = 0
    while True:
        for nodes in sorted({2**k, 3 * 2**k // 2} - {0}) if k else (1,):
            if nodes * gpus_per_node > limit:
                return out
            if not out or nodes * gpus_per_node > out[-1]:
                out.append(nodes * gpus_per_node)
        k += 1


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


def _option(n: int, entry: PlanEntry, tokens: int, price: float | None) -> SizeOption:
    seconds = tokens / entry.speed.tokens_per_s
    hours = n * seconds / 3600
    return SizeOption(n, entry, seconds / SECONDS_PER_DAY, hours,
                      hours * price if price is not None else None)


def size_one(base: Scenario, gpu: GPUProfile, tokens: int, req: PlanRequest,
             days: float | None = None, price: float | None = None,
             max_gpus: int = DEFAULT_MAX_GPUS, deadline: float | None = None,
             fewest: bool = False) -> SizeRow:
    """Size one GPU type: the table from the smallest fitting count to the knee, and the
    answer (the knee, or the smallest count that meets `days`; with `fewest`, the smallest
    count that costs about the least). `deadline` (time.monotonic()) stops the scan over
    counts when reached."""
    counts = size_counts(gpu.gpus_per_node, max_gpus)
    price = price if price is not None else gpu.price_usd_per_hour
    floor = gpu.context_overhead_bytes + gpu.blas_workspace_bytes
    if floor >= gpu.memory_total_bytes * (1 - base.headroom_fraction):
        return SizeRow(gpu, None, None, None, None, None, price, None, (
            f"nothing fits on any count: the CUDA context and cuBLAS workspace alone "
            f"({floor:,} bytes) fill the usable memory with --headroom "
            f"{base.headroom_fraction:g}",))
    problem = capability_problem(base.training, gpu) if "precision" not in req.allow else None
    if problem:  # e.g. bf16 + flash on a GPU without BF16: no count runs it as counted
        return SizeRow(gpu, None, None, None, None, None, price, None, (problem,))
    need = tokens / (days * SECONDS_PER_DAY) if days is not None else None
    table: list[SizeOption] = []
    best_mfu = 0.0
    unsplit: list[int] = []  # sizes after the first fit on which no layout splits the batch
    searched, stopped = 0, False
    for n in counts:
        if _out_of_time(deadline):
            stopped = True
            break
        searched = n
        entry = _best(_on(base, gpu, n), req)
        if entry is None:  # nothing fits yet, or the batch does not split over n GPUs
            if table:
                unsplit.append(n)
            continue
        if table and entry.speed.mfu < KNEE_MFU_FRACTION * best_mfu:
            break
        best_mfu = max(best_mfu, entry.speed.mfu)
        table.append(_option(n, entry, tokens, price))
        if need is not None and entry.speed.tokens_per_s >= need:
            break  # the smallest count that meets the deadline
    if not table:
        found = f"no strategy fits on up to {searched:,} GPUs" if searched else "no count searched"
        return SizeRow(gpu, None, None, None, None, None, price, None, (
            found + ("; the time budget ran out before larger counts were searched (lower "
                     "--max-gpus or try a plan on one count)" if stopped else ""),))
    notes: list[str] = []
    if stopped:
        notes.append(f"the time budget ran out after {searched:,} GPUs; larger sizes were "
                     "not searched")
    suggested = None
    cheapest = min(o.gpu_hours for o in table)
    cheap = [o for o in table if o.gpu_hours <= (1 + COST_SLACK) * cheapest]
    chosen = cheap[0] if fewest else cheap[-1]
    if need is not None:
        chosen = table[-1]
    B = req.batch_for(base.training.seq_len)
    if need is not None and chosen.entry.speed.tokens_per_s >= need and len(table) > 1:
        skipped = [n for n in unsplit if table[-2].num_gpus < n < chosen.num_gpus]
        if skipped:
            odd = skipped[0]
            better = splittable_batch(B * 1.5) if B % 3 else B
            notes.append(
                f"{odd:,} GPUs would sit between {table[-2].num_gpus:,} (too slow) and "
                f"{chosen.num_gpus:,}, but no layout splits a global batch of {B:,} "
                f"sequences over them; a batch with a factor of 3 (e.g. --global-batch-size "
                f"{better}) would")
    if need is not None and chosen.entry.speed.tokens_per_s < need:
        fastest = max(table, key=lambda o: o.entry.speed.tokens_per_s)
        chosen = fastest
        suggested = splittable_batch(B * need / fastest.entry.speed.tokens_per_s)
        notes.append(
            f"cannot finish in {days:g} days at a sane MFU: past {fastest.num_gpus:,} GPUs the "
            f"global batch of {B:,} sequences leaves data parallelism nothing to split "
            f"(MFU falls below half its best). Raising the global batch to about "
            f"{suggested:,} sequences (--global-batch-size {suggested}) would let the "
            "cluster grow enough; showing the fastest size found")
    return SizeRow(gpu=gpu, num_gpus=chosen.num_gpus, min_gpus=table[0].num_gpus,
                   entry=chosen.entry, days=chosen.days, gpu_hours=chosen.gpu_hours,
                   price_usd_per_hour=price, cost_usd=chosen.cost_usd, notes=tuple(notes),
                   table=tuple(table), suggested_global_batch=suggested)


def size_cluster(base: Scenario, gpus: Sequence[GPUProfile], tokens: int, req: PlanRequest,
                 days: float | None = None, prices: Mapping[str, float] | None = None,
                 max_gpus: int = DEFAULT_MAX_GPUS,
                 progress: ProgressFn | None = None,
                 time_budget_s: float | None = None, fewest: bool = False) -> list[SizeRow]:
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
                             max_gpus, deadline, fewest))
    if progress is not None:
        progress("done", len(gpus), len(gpus))
    return rows
