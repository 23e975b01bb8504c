"""The report schema shared by the analytic, trace and probe engines.

Reports are outputs the engines build from numbers they computed (pydantic models, built
with `model_construct` by the analytic engine: its values are ints it computed).

`terms` is the composition of memory at the peak moment: the six allocated terms add up
to `peak_allocated_bytes` (comparable with torch.cuda.max_memory_allocated on the worst
rank). `peak_reserved_bytes` estimates torch.cuda.max_memory_reserved: the caching
allocator's segments (vramcalc/allocator.py). `overhead` (CUDA context, NCCL buffers, and
the allocator's reserved-but-unallocated bytes, reserved − allocated) is added on top to
give `device_total_bytes` = reserved + context + NCCL, which the fit check compares with
the GPU's memory.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from vramcalc.parallel import ParallelConfig
from vramcalc.scenario import Scenario
from vramcalc.units import fmt_gb

TERM_NAMES: tuple[str, ...] = (
    "weights",
    "gradients",
    "optimizer_states",
    "activations",
    "logits",
    "transients",
    "overhead",
)
ALLOCATED_TERMS: tuple[str, ...] = TERM_NAMES[:-1]
PHASE_NAMES: tuple[str, ...] = ("forward", "backward", "optimizer")


class Terms(BaseModel):
    """Bytes per memory term (ints)."""

    weights: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    activations: int = 0
    logits: int = 0
    transients: int = 0
    overhead: int = 0

    @property
    def allocated(self) -> int:
        return sum(getattr(self, t) for t in ALLOCATED_TERMS)

    def as_dict(self) -> dict[str, int]:
        return {t: getattr(self, t) for t in TERM_NAMES}


class StageReport(BaseModel):
    """One pipeline stage's (or rank group's) peak."""

    stage: int
    num_layers: int
    terms: Terms
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int


class GPUInfo(BaseModel):
    id: str
    name: str
    memory_total_bytes: int
    num_gpus: int
    num_nodes: int
    note: str | None = None


class ModelInfo(BaseModel):
    name: str
    num_params: int
    num_active_params: int
    source: str
    note: str | None = None


class MemoryReport(BaseModel):
    """Per-rank memory of one scenario, worst rank first."""

    engine: str
    model: ModelInfo
    strategy: dict[str, Any]
    gpu: GPUInfo | None
    terms: Terms
    subterms: dict[str, int]
    phases: dict[str, int]
    peak_phase: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    first_step_peak_bytes: int
    device_total_bytes: int
    fits: bool | None
    usable_bytes: int | None  # the GPU's memory less the headroom kept free
    free_bytes: int | None  # usable_bytes - device_total_bytes (negative: over by that much)
    host_bytes_per_node: int = 0
    nvme_bytes_per_node: int = 0
    stages: list[StageReport] = []
    notes: list[str] = []

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# ---- the parts every engine's report shares --------------------------------------------
def fit_verdict(scn: Scenario, device_total_bytes: int) -> dict[str, Any]:
    """The report's `fits`, `usable_bytes` and `free_bytes` against the cluster's GPU; all
    None without a GPU.

    The one definition every command and format uses: usable = the GPU's memory less the
    requested headroom (`--headroom`); free = usable - device total; it fits when free >= 0.
    """
    usable = scn.usable_bytes
    if usable is None:
        return {"fits": None, "usable_bytes": None, "free_bytes": None}
    free = usable - device_total_bytes
    return {"fits": free >= 0, "usable_bytes": usable, "free_bytes": free}


def fit_phrase(device_total_bytes: int, usable_bytes: int, capacity_bytes: int,
               digits: int = 2, paged: int = 0) -> str:
    """The fit verdict in words, the same in every command and format: what is needed, what
    it is compared with (the usable memory and how it is derived), and the margin. `paged`:
    the resident part of paged optimizer states, which takes what the run leaves free
    (vramcalc.terms.optimizer_states.paged_residency): when it fills it, the margin says so."""
    free = usable_bytes - device_total_bytes
    kept = capacity_bytes - usable_bytes
    basis = (f"{fmt_gb(usable_bytes, digits)} usable" if kept <= 0 else
             f"{fmt_gb(usable_bytes, digits)} usable ({fmt_gb(capacity_bytes, digits)} less "
             f"{fmt_gb(kept, digits)} headroom)")
    margin = (f"{fmt_gb(free, digits)} free" if free >= 0 else
              f"over by {fmt_gb(-free, digits)}")
    if paged and free == 0:  # the pages filled the free memory: the rest are in host RAM
        margin += (f" ({fmt_gb(paged, digits)} of the total is paged optimizer states, which "
                   "fill what the run leaves free; the rest of them waits in host RAM)")
    return f"needs {fmt_gb(device_total_bytes, digits)} of {basis}: {margin}"


def paged_resident_bytes(report: MemoryReport) -> int:
    """The resident paged optimizer states of a report (0 without a paged optimizer)."""
    return report.subterms.get("overhead/paged_optimizer_states", 0)


def model_info(scn: Scenario) -> ModelInfo:
    m = scn.model
    return ModelInfo(name=m.name, num_params=m.num_params, num_active_params=m.num_active_params,
                     source=m.source, note=scn.model_note)


def gpu_info(scn: Scenario) -> GPUInfo | None:
    if scn.cluster is None:
        return None
    g, c = scn.cluster.gpu, scn.cluster
    return GPUInfo(id=g.id, name=g.name, memory_total_bytes=g.memory_total_bytes,
                   num_gpus=c.num_gpus, num_nodes=c.num_nodes, note=scn.gpu_note)


def strategy_dict(scn: Scenario) -> dict[str, object]:
    """The resolved strategy as plain JSON values."""
    out: dict[str, object] = {}
    out.update(scn.training.model_dump(mode="json"))
    # DeepSpeed's keys (vramcalc.ds_config) only when a DeepSpeed config changed a default
    # and the expert TP degree (--etp) only when given
    ds_default = scn.parallel.deepspeed == ParallelConfig().deepspeed
    exclude = {"deepspeed"} if ds_default else set()
    if scn.parallel.etp is None:
        exclude.add("etp")
    out.update(scn.parallel.model_dump(mode="json", exclude=exclude or None))
    out["world_size"] = scn.world_size
    return out
