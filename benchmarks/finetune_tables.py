"""Print the fine-tuning tables of docs/finetuning.md from real `vramcalc estimate --json` runs.

    python benchmarks/finetune_tables.py

Table 1: Llama-2-7B full / LoRA r8 / QLoRA r8 (PEFT defaults: q,v, dropout 0) at sequence
512-2048, micro-batch 1, bf16, AdamW, flash attention, no recompute, on one RTX 4090 and one
A100 80GB, for the hf (transformers + PEFT + bitsandbytes) and reference profiles.
Table 2: Llama-2-70B QLoRA r8 on one 80 GB GPU (A100 80GB; the H100 has the same 80 GB
class): the device total per sequence length with and without activation checkpointing.
"""

from __future__ import annotations

import json
import subprocess
import sys

GB = 1e9


def estimate(*args: str) -> dict:
    cmd = [sys.executable, "-c", "import sys; from vramcalc.cli import main; "
           "sys.exit(main(sys.argv[1:]))", "estimate", *args, "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def gb(n: int) -> str:
    return f"{n / GB:.2f}"


def table_7b() -> None:
    print("| profile | GPU | seq | method | weights | grads | optim | activ. | logits | peak alloc | device total | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fw in ("hf", "reference"):
        for gpu in ("RTX4090", "A100-80GB"):
            for seq in (512, 1024, 2048):
                for ft in ("full", "lora", "qlora"):
                    d = estimate("--model", "llama2-7b", "--gpus", gpu, "--seq-len", str(seq),
                                 "--finetune", ft, "--framework", fw)
                    t = d["terms"]
                    print(f"| {fw} | {gpu} | {seq} | {ft} | {gb(t['weights'])} | "
                          f"{gb(t['gradients'])} | {gb(t['optimizer_states'])} | "
                          f"{gb(t['activations'])} | {gb(t['logits'])} | "
                          f"{gb(d['peak_allocated_bytes'])} | {gb(d['device_total_bytes'])} | "
                          f"{'yes' if d['fits'] else 'no'} |")


def table_70b() -> None:
    print("| seq | recompute | weights | activations | logits | peak alloc | device total | fits 80 GB |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in (512, 1024, 2048, 4096, 8192, 16384, 32768):
        for rec in ("none", "full"):
            d = estimate("--model", "llama2-70b", "--gpus", "A100-80GB", "--seq-len", str(seq),
                         "--finetune", "qlora", "--framework", "hf", "--recompute", rec)
            t = d["terms"]
            print(f"| {seq} | {rec} | {gb(t['weights'])} | {gb(t['activations'])} | "
                  f"{gb(t['logits'])} | {gb(d['peak_allocated_bytes'])} | "
                  f"{gb(d['device_total_bytes'])} | {'yes' if d['fits'] else 'no'} |")


if __name__ == "__main__":
    table_7b()
    print()
    table_70b()
