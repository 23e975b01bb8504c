"""torchtitan's December 2024 benchmark, row by row, against the analytic engine.

    python benchmarks/torchtitan_rows.py [--markdown]

pytorch/torchtitan `benchmarks/llama3_h100_202412_torchtitan.md` (torchtitan 9dec370, torch
1963fc8, 96 GB H100s) reports `max_memory_reserved` for 18 runs; three are calibration
records (benchmarks/calibration.py), and this prints the other 15 with the analytic
engine's peak reserved (GiB). Every row runs `--framework torchtitan --precision amp-bf16
--optimizer adamw --attention flash`; the rest follows the benchmark's tables and the tomls
they name: Table 1 and 3 (Llama 3.1 8B, FSDP, per-op SAC, batch 2 at 8,192 tokens), Table 2
(8B, full AC, CP over the 8 GPUs of one node), Table 4 (the 70B 2D calibration record with
async TP), Tables 5 and 6 (405B: FSDP 8 kept unsharded after forward under PP, TP 8 with
sequence parallelism and async TP, PP 8 with 8 micro-batches, the 405B toml's float8 with
float8 all-gather, which torchtitan turns off at dp_shard 1; `--torch-version 2.6`: torch
1963fc8 is a December 2024 nightly of the 2.6 line, whose pipeline stages keep what
vramcalc/terms/pipelining.py lists). docs/validation.md shows the table; nothing here is
fitted.
"""

from __future__ import annotations

import argparse
from typing import Any

from vramcalc.analytic import estimate
from vramcalc.options import build_scenario

GIB = 2**30
COMMON: dict[str, Any] = {"framework": "torchtitan", "precision": "amp-bf16",
                          "optimizer": "adamw", "attention": "flash"}
T1 = {"model": "llama3.1-8b", "gpus": "8xH100", "fsdp": "full", "recompute": "selective",
      "seq_len": 8192, "micro_batch_size": 2}
T3 = {**T1, "gpus": "128xH100"}
T2 = {"model": "llama3.1-8b", "gpus": "8xH100", "fsdp": "full", "recompute": "full",
      "compile": True, "float8": True, "micro_batch_size": 1}
T4 = {"model": "llama3.1-70b", "gpus": "256xH100", "fsdp": "full", "tp": 8,
      "sequence_parallel": True, "recompute": "full", "compile": True, "float8": True,
      "seq_len": 8192, "micro_batch_size": 16, "grad_accum": 1, "async_tp": True}
T5 = {"model": "llama3.1-405b", "gpus": "512xH100", "fsdp": "grad-op", "tp": 8, "pp": 8,
      "sequence_parallel": True, "recompute": "full", "compile": True, "float8": True,
      "float8_all_gather": True, "async_tp": True, "seq_len": 8192, "micro_batch_size": 4,
      "num_microbatches": 8, "torch_version": "2.6"}
T6 = {**T5, "micro_batch_size": 1}

# (table, row, the flags as the docs show them, flags, measured GiB)
ROWS: list[tuple[str, str, str, dict[str, Any], float]] = [
    ("1", "FSDP + compile", "`--model llama3.1-8b --gpus 8xH100 --fsdp full --recompute "
     "selective --seq-len 8192 --micro-batch-size 2 --compile`", {**T1, "compile": True}, 77.0),
    ("1", "+ Float8", "same `--float8`", {**T1, "compile": True, "float8": True}, 76.8),
    ("3", "FSDP, 128 GPUs", "`--gpus 128xH100`, as Table 1 eager", T3, 67.0),
    ("3", "+ compile", "`--compile`", {**T3, "compile": True}, 62.0),
    ("3", "+ Float8", "`--compile --float8`", {**T3, "compile": True, "float8": True}, 61.8),
    ("2", "FSDP 4, CP 2", "`--gpus 8xH100 --fsdp full --cp 2 --recompute full --compile "
     "--float8 --seq-len 65536 --micro-batch-size 1`", {**T2, "cp": 2, "seq_len": 65536}, 84.2),
    ("2", "FSDP 2, CP 4", "`--cp 4 --seq-len 131072`", {**T2, "cp": 4, "seq_len": 131072}, 84.0),
    ("2", "FSDP 1, CP 8", "`--cp 8 --seq-len 262144`", {**T2, "cp": 8, "seq_len": 262144}, 84.5),
    ("4", "2D + AsyncTP", "the 70B 2D record's flags `--async-tp`", T4, 67.6),
    ("5", "1F1B", "`--model llama3.1-405b --gpus 512xH100 --fsdp grad-op --tp 8 --pp 8 "
     "--sequence-parallel --recompute full --compile --float8 --float8-all-gather --async-tp "
     "--seq-len 8192 --micro-batch-size 4 --num-microbatches 8 --torch-version 2.6`", T5, 82.5),
    ("5", "interleaved 1F1B", "`--pp-schedule interleaved --virtual-stages 2`",
     {**T5, "pp_schedule": "interleaved", "virtual_stages": 2}, 72.7),
    ("6", "FSDP 8, CP 1", "Table 5's flags, `--micro-batch-size 1 --seq-len 32768`",
     {**T6, "seq_len": 32768}, 75.3),
    ("6", "FSDP 4, CP 2", "`--cp 2 --seq-len 65536`", {**T6, "cp": 2, "seq_len": 65536}, 75.9),
    ("6", "FSDP 2, CP 4", "`--cp 4 --seq-len 131072`", {**T6, "cp": 4, "seq_len": 131072}, 77.1),
    ("6", "FSDP 1, CP 8", "`--cp 8 --seq-len 262144 --no-float8-all-gather`",
     {**T6, "cp": 8, "seq_len": 262144, "float8_all_gather": False}, 84.9),
]


def run() -> list[tuple[str, str, str, float, float]]:
    """(table, row, shown flags, estimate GiB, measured GiB) of every row."""
    out = []
    for table, row, shown, flags, measured in ROWS:
        report = estimate(build_scenario({**COMMON, **flags}))
        out.append((table, row, shown, report.peak_reserved_bytes / GIB, measured))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="a markdown table")
    args = parser.parse_args()
    if args.markdown:
        print("| table | row | layout flags | estimate GiB | measured GiB | error |")
        print("|---|---|---|---|---|---|")
    for table, row, shown, est, measured in run():
        err = f"{100 * (est / measured - 1):+.1f} %".replace("-", "−")
        cells = [table, row, shown, f"{est:.2f}", f"{measured:.1f}", err]
        print("| " + " | ".join(cells) + " |" if args.markdown else "  ".join(cells))


if __name__ == "__main__":
    main()
