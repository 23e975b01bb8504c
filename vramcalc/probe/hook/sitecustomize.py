"""vramcalc probe hook, injected through PYTHONPATH by `vramcalc probe --run -- CMD`.

Loaded by Python at start-up in the user's (unmodified) training process. It never imports
torch itself: at exit, and every VRAMCALC_PROBE_INTERVAL seconds, it writes this rank's
allocator peaks (when the process imported torch and initialised CUDA), NVML's per-process
figure when pynvml is available, and the host's peak RSS, to
$VRAMCALC_PROBE_DIR/rank<RANK>-<pid>.json: only in the processes that are the launcher's
ranks (`_claim`), not in their Python children. Any other sitecustomize on the path still
runs.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time


def _device_stats() -> dict:
    torch = sys.modules.get("torch")
    if torch is None:
        return {"type": "none"}
    try:
        cuda = torch.cuda
        if cuda.is_available() and cuda.is_initialized():
            i = cuda.current_device()
            stats = cuda.memory_stats(i)
            free, total = cuda.mem_get_info(i)
            return {
                "type": "rocm" if getattr(torch.version, "hip", None) else "cuda",
                "index": i,
                "name": cuda.get_device_name(i),
                "total_memory_bytes": int(total),
                "free_bytes": int(free),
                "max_memory_allocated_bytes": int(cuda.max_memory_allocated(i)),
                "max_memory_reserved_bytes": int(cuda.max_memory_reserved(i)),
                "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
                "active_peak_bytes": int(stats.get("active_bytes.all.peak", 0)),
            }
        npu = getattr(torch, "npu", None)
        if npu is not None and npu.is_available():
            i = npu.current_device()
            return {
                "type": "npu",
                "index": i,
                "name": npu.get_device_name(i),
                "max_memory_allocated_bytes": int(npu.max_memory_allocated(i)),
                "max_memory_reserved_bytes": int(npu.max_memory_reserved(i)),
            }
    except Exception as err:  # noqa: BLE001 - never break the user's job
        return {"type": "error", "error": repr(err)}
    return {"type": "cpu"}


def _nvml_used() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001
        return None
    return None


def _host_peak_rss() -> int | None:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    except Exception:  # noqa: BLE001
        return None


def _write(final: bool) -> None:
    out_dir = os.environ.get("VRAMCALC_PROBE_DIR")
    if not out_dir:
        return
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)
    launcher = os.path.basename(sys.argv[0] if sys.argv else "") in ("torchrun", "run.py") and (
        "RANK" not in os.environ)
    doc = {
        "rank": rank,
        "role": "launcher" if launcher else "worker",
        "world_size": int(os.environ.get("WORLD_SIZE", "1") or 1),
        "pid": os.getpid(),
        "argv": sys.argv,
        "final": final,
        "time": time.time(),
        "device": _device_stats(),
        "nvml_used_bytes": _nvml_used(),
        "host_peak_rss_bytes": _host_peak_rss(),
    }
    path = os.path.join(out_dir, f"rank{rank}-{os.getpid()}.json")
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
        os.replace(tmp, path)
    except OSError:
        pass


def _periodic(interval: float) -> None:
    while True:
        time.sleep(interval)
        _write(final=False)


def _chain_other_sitecustomize() -> None:
    """Run the sitecustomize this hook shadows, if any."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    paths = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001 - the other hook's errors are not ours to raise
        pass


def _claim() -> bool:
    """Whether this process is one the launcher started as a rank: the first Python
    process of each RANK (torchrun's workers), or the first one without RANK (a plain
    `python train.py`, or torchrun's launcher). Their own Python children (data-loader
    workers, tools they spawn) inherit the environment and find the claim taken."""
    key = f"rank{os.environ['RANK']}" if "RANK" in os.environ else "main"
    try:
        fd = os.open(os.path.join(os.environ["VRAMCALC_PROBE_DIR"], f".claim-{key}"),
                     os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError:
        return False
    os.close(fd)
    return True


if os.environ.get("VRAMCALC_PROBE_DIR") and _claim():
    atexit.register(_write, True)
    _interval = float(os.environ.get("VRAMCALC_PROBE_INTERVAL", "0") or 0)
    if _interval > 0:
        threading.Thread(target=_periodic, args=(_interval,), daemon=True).start()
_chain_other_sitecustomize()
