"""Capacity boundaries: the longest sequence a published run fit, against both fit checks.

    python benchmarks/capacity_rows.py [--markdown]

Unsloth's README (unslothai/unsloth 000252c9, 'Llama 3.1 (8B) max. context length', measured
for its December 2024 Llama 3.3 post) lists, per card size, the longest sequence that fit
for Llama-3.1-8B-Instruct QLoRA (4-bit NF4, LoRA r 32 on q, k, v, o, gate, up and down,
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

# (card GiB, longest sequence that fit) of the README's 'Hugging Face + FA2' column
ROWS: list[tuple[int, int]] = [(12, 932), (16, 2551), (24, 5789), (40, 12264), (48, 15502),
                               (80, 28454)]

# the same table's 'Unsloth context length' column: --framework unsloth with Unsloth's
# notebook settings (bf16 base beside the NF4 layers, adamw_8bit, use_gradient_checkpointing
# "unsloth"); Unsloth's kernels do not run on the CPU, so only the analytic engine, at the
# release the table ran (2024.12.4, the Llama 3.3 post of December 2024) and at the current
UNSLOTH_FLAGS: dict[str, Any] = {
    "model": "llama3.1-8b", "gpus": "1xA100-80GB", "framework": "unsloth",
    "precision": "bf16", "finetune": "qlora", "lora_rank": 32, "lora_targets": "all-linear",
    "lora_dropout": 0.0, "attention": "flash", "recompute": "full", "optimizer": "adamw-8bit",
    "micro_batch_size": 1}
UNSLOTH_ROWS: list[tuple[int, int]] = [(8, 2972), (12, 21848), (16, 40724), (24, 78475),
                                       (40, 153977), (48, 191728), (80, 342733)]


def run_unsloth() -> list[tuple[int, int, float, float]]:
    """(card GiB, tokens, device total GiB at 2024.12.4, at the current release) per row."""
    out = []
    for card, tokens in UNSLOTH_ROWS:
        then = build_scenario({**UNSLOTH_FLAGS, "seq_len": tokens,
                               "unsloth_version": "2024.12.4"})
        now = build_scenario({**UNSLOTH_FLAGS, "seq_len": tokens})
        out.append((card, tokens, estimate(then).device_total_bytes / GIB,
                    estimate(now).device_total_bytes / GIB))
    return out


def run() -> list[tuple[int, int, float, float]]:
    """(card GiB, tokens, analytic device total GiB, trace device total GiB) per row."""
    from vramcalc.trace.distributed import trace_any

    out = []
    for card, tokens in ROWS:
        scn = build_scenario({**FLAGS, "seq_len": tokens})
        out.append((card, tokens, estimate(scn).device_total_bytes / GIB,
                    trace_any(scn).device_total_bytes / GIB))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = run()
    if args.markdown:
        print("| card | longest that fit | analytic GiB | error | trace GiB | error |")
        print("|---|---|---|---|---|---|")
    for card, tokens, ana, tra in rows:
        cells = [f"{card} GB", f"{tokens:,}", f"{ana:.2f}", f"{(ana - card) / card:+.1%}",
                 f"{tra:.2f}", f"{(tra - card) / card:+.1%}"]
        print("| " + " | ".join(cells) + " |" if args.markdown else "  ".join(cells))
    print()
    if args.markdown:
        print("| card | longest that fit (Unsloth) | 2024.12.4 GiB | error | current GiB | error |")
        print("|---|---|---|---|---|---|")
    for card, tokens, then, now in run_unsloth():
        cells = [f"{card} GB", f"{tokens:,}", f"{then:.2f}", f"{(then - card) / card:+.1%}",
                 f"{now:.2f}", f"{(now - card) / card:+.1%}"]
        print("| " + " | ".join(cells) + " |" if args.markdown else "  ".join(cells))


if __name__ == "__main__":
    main()
