"""Find the accelerator and read its memory counters (CUDA, ROCm, Ascend NPU).

API map (../shared/reference/hardware.yaml `memory_probe_apis`): CUDA and ROCm share
`torch.cuda.*` (ROCm is told apart by `torch.version.hip`); Ascend uses `torch_npu`
(`torch.npu.*`). `mem_get_info` is CUDA/ROCm only.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any

from vramcalc.provenance import version


class NoDeviceError(RuntimeError):
    """No GPU/NPU is visible; the CLI exits 3."""


@dataclass
class Device:
    type: str  # cuda | rocm | npu | cpu
    index: int
    module: Any  # torch.cuda or torch.npu (None for cpu)
    torch_device: str  # "cuda:0", "npu:0", "cpu"

    def name(self) -> str:
        if self.module is None:
            return platform.processor() or "cpu"
        return str(self.module.get_device_name(self.index))

    def total_memory(self) -> int | None:
        if self.module is None:
            return None
        try:
            return int(self.module.get_device_properties(self.index).total_memory)
        except Exception:  # noqa: BLE001 - not all backends expose it
            return None

    def mem_get_info(self) -> tuple[int, int] | None:
        if self.module is None or not hasattr(self.module, "mem_get_info"):
            return None
        free, total = self.module.mem_get_info(self.index)
        return int(free), int(total)

    def reset_peak(self) -> None:
        if self.module is not None:
            self.module.synchronize(self.index)
            self.module.reset_peak_memory_stats(self.index)

    def counters(self) -> dict[str, int]:
        """Allocator counters in bytes (zeros on cpu)."""
        if self.module is None:
            return {}
        m = self.module
        m.synchronize(self.index)
        stats = m.memory_stats(self.index)
        return {
            "max_memory_allocated_bytes": int(m.max_memory_allocated(self.index)),
            "max_memory_reserved_bytes": int(m.max_memory_reserved(self.index)),
            "memory_allocated_bytes": int(m.memory_allocated(self.index)),
            "memory_reserved_bytes": int(m.memory_reserved(self.index)),
            "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "active_peak_bytes": int(stats.get("active_bytes.all.peak", 0)),
        }


def find_device(index: int = 0, allow_cpu: bool = False) -> Device:
    """The first usable accelerator, or cpu when allowed; NoDeviceError otherwise."""
    try:
        import torch
    except ImportError:
        if allow_cpu:
            return Device("cpu", 0, None, "cpu")
        raise NoDeviceError("PyTorch is not installed: pip install torch") from None
    if torch.cuda.is_available():
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        return Device(kind, index, torch.cuda, f"cuda:{index}")
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():  # type: ignore[attr-defined]
            return Device("npu", index, torch.npu, f"npu:{index}")  # type: ignore[attr-defined]
    except ImportError:
        pass
    if allow_cpu:
        return Device("cpu", 0, None, "cpu")
    raise NoDeviceError(
        "no GPU or NPU found (torch.cuda.is_available() is False and torch_npu is absent); "
        "use --device cpu for a dry run with the trace tracker"
    )


def versions() -> dict[str, str | None]:
    """torch / CUDA / HIP / driver / Python versions for the record."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = getattr(torch.version, "cuda", None)
        out["hip"] = getattr(torch.version, "hip", None)
    except ImportError:
        out["torch"] = None
    out["driver"] = nvml_driver_version()
    out["vramcalc"] = version()
    return out


def nvml_driver_version() -> str | None:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # noqa: BLE001 - NVML absent or no driver
        return None

