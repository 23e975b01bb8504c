"""Capacity boundaries: the longest sequence a published run fit, against both fit checks.

    python benchmarks/capacity_rows.py [--markdown]

Unsloth's README (unslothai/unsloth 000252c9, 'Llama 3.1 (8B) max. context length' and
'Llama 3.3 (70B) max. context length', measured for its December 2024 Llama 3.3 post) lists,
per card size, the longest sequence that fit for Llama-3.1-8B-Instruct (and Llama-3.3-70B) QLoRA (4-bit NF4, LoRA r 32 on q, k, v, o, gate, up and down,
batch 1) with Hugging Face transformers + FlashAttention-2. For each row this prints the
device total at that length from the analytic engine (live tensors packed into segments)
and from the trace engine (the smallest capacity its recorded allocations run in, cached
whole segments released before an out-of-memory error: vramcalc/allocator.py
`min_capacity`), against the card's size in GiB (Unsloth prints GiB as GB). A row fits
when its device total is at most the card; the published length is the largest that did,
so the closer to the card the better. The flags are the calibration record's
(benchmarks/calibration.py `unsloth-hf-fa2-llama31-8b-qlora-r32-maxctx-24gb`). The same
table's Unsloth column follows, from the analytic engine (`run_unsloth`).
"""

from __future__ import annotations

import argparse
from typing import Any

from vramcalc.analytic import estimate
from vramcalc.options import build_scenario

GIB = 2**30

FLAGS: dict[str, Any] = {
    "model": "llama3.1-8b", "gpus": "1xA100-80GB", "framework": "hf",
    "precision": "amp-bf16", "finetune": "qlora", "kbit_prepare": True, "lora_rank": 32,
    "lora_targets": "all-linear", "lora_dropout": 0.0, "attention": "flash",
    "recompute": "full", "hf_optim": "adamw_torch", "transformers_version": "4.46.1",
    "micro_batch_size": 1}

# (model, card GiB, longest sequence that fit) of the README's 'Hugging Face + FA2' columns
# (Llama 3.1 8B; Llama 3.3 70B on an 80 GB A100, the same settings)
ROWS: list[tuple[str, int, int]] = [
    ("llama3.1-8b", 12, 932), ("llama3.1-8b", 16, 2551), ("llama3.1-8b", 24, 5789),
    ("llama3.1-8b", 40, 12264), ("llama3.1-8b", 48, 15502), ("llama3.1-8b", 80, 28454),
    ("llama3.3-70b", 80, 6916)]

# the same table's 'Unsloth context length' column: --framework unsloth with Unsloth's
# notebook settings (bf16 base beside the NF4 layers, adamw_8bit, use_gradient_checkpointing
# "unsloth"); Unsloth's kernels do not run on the CPU, so only the analytic engine, at the
# release the table ran (2024.12.4, the Llama 3.3 post of December 2024) and at the current
UNSLOTH_FLAGS: dict[str, Any] = {
    "model": "llama3.1-8b", "gpus": "1xA100-80GB", "framework": "unsloth",
    "precision": "bf16", "finetune": "qlora", "lora_rank": 32, "lora_targets": "all-linear",
    "lora_dropout": 0.0, "attention": "flash", "recompute": "full", "optimizer": "adamw-8bit",
    "micro_batch_size": 1}
UNSLOTH_ROWS: list[tuple[str, int, int]] = [
    ("llama3.1-8b", 8, 2972), ("llama3.1-8b", 12, 21848), ("llama3.1-8b", 16, 40724),
    ("llama3.1-8b", 24, 78475), ("llama3.1-8b", 40, 153977), ("llama3.1-8b", 48, 191728),
    ("llama3.1-8b", 80, 342733), ("llama3.3-70b", 48, 12106), ("llama3.3-70b", 80, 89389)]


def run_unsloth() -> list[tuple[str, int, int, float, float]]:
    """(model, card GiB, tokens, device total GiB at 2024.12.4, at the current release)."""
    out = []
    for model, card, tokens in UNSLOTH_ROWS:
        flags = {**UNSLOTH_FLAGS, "model": model, "seq_len": tokens}
        then = build_scenario({**flags, "unsloth_version": "2024.12.4"})
        out.append((model, card, tokens, estimate(then).device_total_bytes / GIB,
                    estimate(build_scenario(flags)).device_total_bytes / GIB))
    return out


def run() -> list[tuple[str, int, int, float, float]]:
    """(model, card GiB, tokens, analytic device total GiB, trace device total GiB)."""
    from vramcalc.trace.distributed import trace_any

    out = []
    for model, card, tokens in ROWS:
        scn = build_scenario({**FLAGS, "model": model, "seq_len": tokens})
        out.append((model, card, tokens, estimate(scn).device_total_bytes / GIB,
                    trace_any(scn).device_total_bytes / GIB))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = run()
    if args.markdown:
        print("| model | card | longest that fit | analytic GiB | error | trace GiB | error |")
        print("|---|---|---|---|---|---|---|")
    for model, card, tokens, ana, tra in rows:
        cells = [model, f"{card} GB", f"{tokens:,}", f"{ana:.2f}", f"{(ana - card) / card:+.1%}",
                 f"{tra:.2f}", f"{(tra - card) / card:+.1%}"]
        print("| " + " | ".join(cells) + " |" if args.markdown else "  ".join(cells))
    print()
    if args.markdown:
        print("| model | card | longest that fit (Unsloth) | 2024.12.4 GiB | error | current GiB "
              "| error |")
        print("|---|---|---|---|---|---|---|")
    for model, card, tokens, then, now in run_unsloth():
        cells = [model, f"{card} GB", f"{tokens:,}", f"{then:.2f}",
                 f"{(then - card) / card:+.1%}", f"{now:.2f}", f"{(now - card) / card:+.1%}"]
        print("| " + " | ".join(cells) + " |" if args.markdown else "  ".join(cells))


if __name__ == "__main__":
    main()
