"""Probe suite for one GPU machine: >= 20 scenarios, one JSON record each.

    python benchmarks/device_probe.py OUT_DIR            # on a GPU/NPU machine
    python benchmarks/device_probe.py OUT_DIR --device cpu --quick   # CPU dry run (CI)

Scenarios span the reference and hf profiles, precisions, optimizers, recompute modes,
attention kernels and sizes from GPT-2 small (0.12B) to Llama-3-8B; the largest are sized to
fit a 141 GB H200 and to OOM cleanly on smaller cards (an OOM is recorded, not fatal).
Prints one line per scenario and the error summary; stays well under 8 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

SCENARIOS: list[dict] = [
    # name, then option values (vramcalc.options names)
    {"model": "gpt2", "seq_len": 1024, "micro_batch_size": 8, "precision": "bf16"},
    {"model": "gpt2", "seq_len": 1024, "micro_batch_size": 8, "precision": "fp32"},
    {"model": "gpt2", "seq_len": 1024, "micro_batch_size": 4, "precision": "amp-bf16",
     "attention": "eager"},
    {"model": "gpt2", "seq_len": 1024, "micro_batch_size": 8, "precision": "amp-fp16",
     "optimizer": "sgd-momentum"},
    {"model": "gpt2", "seq_len": 512, "micro_batch_size": 8, "precision": "bf16",
     "grad_accum": 4},
    {"model": "gpt2-medium", "seq_len": 1024, "micro_batch_size": 8, "precision": "bf16",
     "recompute": "full"},
    {"model": "gpt2-medium", "seq_len": 1024, "micro_batch_size": 4, "precision": "bf16-pure",
     "optimizer": "lion"},
    {"model": "gpt2-large", "seq_len": 1024, "micro_batch_size": 4, "precision": "bf16",
     "recompute": "selective", "attention": "eager"},
    {"model": "gpt2-xl", "seq_len": 1024, "micro_batch_size": 4, "precision": "bf16",
     "optimizer": "adafactor"},
    {"model": "gpt2", "seq_len": 1024, "micro_batch_size": 8, "precision": "bf16",
     "framework": "hf"},
    {"model": "gpt2-medium", "seq_len": 1024, "micro_batch_size": 4, "precision": "amp-bf16",
     "framework": "hf"},
    {"model": "gemma-2b", "seq_len": 2048, "micro_batch_size": 2, "precision": "bf16",
     "recompute": "full"},
    {"model": "gemma-2b", "seq_len": 1024, "micro_batch_size": 2, "precision": "bf16",
     "framework": "hf"},
    {"model": "phi3-mini", "seq_len": 2048, "micro_batch_size": 1, "precision": "bf16",
     "recompute": "full"},
    {"model": "phi3-mini", "seq_len": 2048, "micro_batch_size": 1, "precision": "bf16-pure",
     "optimizer": "adamw", "framework": "hf"},
    {"model": "llama2-7b", "seq_len": 2048, "micro_batch_size": 1, "precision": "bf16-pure",
     "optimizer": "sgd", "recompute": "full"},
    {"model": "llama2-7b", "seq_len": 2048, "micro_batch_size": 1, "precision": "bf16",
     "optimizer": "adamw-8bit", "recompute": "full"},
    {"model": "llama3-8b", "seq_len": 4096, "micro_batch_size": 1, "precision": "bf16-pure",
     "optimizer": "adamw", "recompute": "full"},
    {"model": "llama3-8b", "seq_len": 2048, "micro_batch_size": 2, "precision": "bf16-pure",
     "optimizer": "sgd-momentum", "recompute": "selective"},
    {"model": "mistral-7b", "seq_len": 4096, "micro_batch_size": 1, "precision": "bf16-pure",
     "optimizer": "adafactor", "recompute": "full", "framework": "hf"},
    {"model": "qwen2.5-7b", "seq_len": 2048, "micro_batch_size": 1, "precision": "bf16",
     "optimizer": "adamw", "recompute": "full"},  # 7.6B x 22 B/param: an OOM on 141 GB
    {"model": "llama3-8b", "seq_len": 8192, "micro_batch_size": 1, "precision": "bf16-pure",
     "optimizer": "sgd", "attention": "flash", "recompute": "none"},
]
QUICK = [0, 2, 5, 9]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu"))
    ap.add_argument("--quick", action="store_true", help="4 small scenarios (CPU dry run)")
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--gpu", default=None, help="GPU profile id for the fit check (default: "
                    "matched from the device name, else h200)")
    args = ap.parse_args()

    from vramcalc.options import build_scenario
    from vramcalc.probe.builtin import probe_record
    from vramcalc.probe.devices import find_device
    from vramcalc.probe.record import write_record

    device = find_device(allow_cpu=args.device == "cpu")
    gpu = args.gpu or _profile_for(device.name())
    chosen = [SCENARIOS[i] for i in QUICK] if args.quick else SCENARIOS
    args.out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    errors = []
    for i, values in enumerate(chosen):
        values = {**values, "gpus": gpu}
        if args.quick:
            values["seq_len"] = min(values["seq_len"], 128)
            values["micro_batch_size"] = min(values["micro_batch_size"], 2)
        t0 = time.perf_counter()
        name = f"{i:02d}-{values['model']}-{values.get('framework', 'reference')}"
        try:
            scn = build_scenario(values)
            rec = probe_record(scn, values, device, iterations=2,
                               with_trace=not args.no_trace)
        except Exception as err:  # noqa: BLE001 - keep going; record the failure
            print(f"{name}: FAILED {err!r}", flush=True)
            traceback.print_exc()
            continue
        write_record(rec, args.out / f"{name}.json")
        a = rec["analytic"]["rel_error"]
        tr = (rec.get("trace") or {}).get("rel_error")
        peak = rec["measured"].get("max_memory_allocated_bytes")
        print(f"{name}: {rec['status']} measured {peak / 1e9 if peak else float('nan'):.3f} GB "
              f"analytic {'' if a is None else f'{100 * a:+.2f}%'} trace "
              f"{'' if tr is None else f'{100 * tr:+.2f}%'} ({time.perf_counter() - t0:.1f} s)",
              flush=True)
        if a is not None:
            errors.append(abs(a))
    print(json.dumps({"scenarios": len(chosen), "with_error": len(errors),
                      "max_abs_rel_error": max(errors, default=None),
                      "seconds": round(time.perf_counter() - t_all, 1)}))
    return 0


def _profile_for(device_name: str) -> str:
    n = device_name.lower()
    for key, pid in (("h200", "h200"), ("h100", "h100_sxm"), ("a100", "a100_80gb"),
                     ("4090", "rtx_4090"), ("910b", "ascend_910b2"), ("mi300", "mi300x")):
        if key in n:
            return pid
    return "h200"


if __name__ == "__main__":
    sys.exit(main())
