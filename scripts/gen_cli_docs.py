"""Regenerate docs/cli.md from real command output: python scripts/gen_cli_docs.py

Each command below runs through the installed CLI at 100 columns; its output is pasted
verbatim, so the docs show what a user sees.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

COMMANDS: list[tuple[str, str, list[str]]] = [
    ("Plan a job", "The main job: ranked strategies that fit, the best one's breakdown.",
     ["plan", "--model", "70b", "--gpus", "8xH100"]),
    ("Estimate one scenario", "Per-GPU breakdown, bars, phases and the fit verdict.",
     ["estimate", "--model", "llama3-8b", "--gpus", "H100", "--seq-len", "4096",
      "--recompute", "full"]),
    ("Does it fit with ZeRO-3 on 64 GPUs?", "",
     ["estimate", "--model", "70b", "--gpus", "8x8xH100", "--zero", "3", "--recompute", "full"]),
    ("Fine-tune Llama-2-7B on one RTX 4090: LoRA", "Frozen base, adapters with their own "
     "gradients and AdamW states.",
     ["estimate", "--model", "llama2-7b", "--gpus", "4090", "--finetune", "lora",
      "--seq-len", "1024"]),
    ("The same with QLoRA and a paged 8-bit optimizer", "NF4 base weights; paged state "
     "shows as memory outside the allocator.",
     ["estimate", "--model", "llama2-7b", "--gpus", "4090", "--finetune", "qlora",
      "--optimizer", "paged-adamw-8bit", "--seq-len", "1024"]),
    ("A full fine-tune with paged AdamW on one 24 GB card",
     "torchtune's low-memory recipe: 54 GB of paged optimizer states; what has no room on "
     "the GPU lives in host RAM, so it fits (and each step pages it over PCIe).",
     ["estimate", "--model", "llama2-7b", "--gpus", "4090", "--framework", "torchtune",
      "--precision", "bf16-pure", "--optimizer", "paged-adamw", "--optimizer-in-backward",
      "--recompute", "full", "--seq-len", "512", "--micro-batch-size", "2"]),
    ("torchtune's QLoRA recipe with torchao 0.1: the load phase is the peak",
     "torchao before 0.2 quantizes each weight at once while the model loads (`--load`); "
     "the segments the init reserves stay cached through training.",
     ["estimate", "--model", "llama2-7b", "--gpus", "4090", "--finetune", "qlora",
      "--lora-targets", "all-linear", "--precision", "bf16-pure", "--recompute", "full",
      "--seq-len", "512", "--micro-batch-size", "2", "--qlora-impl", "torchao",
      "--torchao-version", "0.1", "--load", "torchtune"]),
    ("Let the planner propose fine-tuning", "",
     ["plan", "--model", "70b", "--gpus", "A100", "--allow", "finetune,optimizer",
      "--seq-len", "2048"]),
    ("FP8 training (Transformer Engine)", "FP8 weight caches and fp8 linear inputs.",
     ["estimate", "--model", "8b", "--gpus", "8xH100", "--precision", "fp8", "--zero", "1"]),
    ("The most that fits", "The longest sequence this layout holds (steps of 256 tokens), "
     "with per-GPU memory against sequence length; `--maximize micro-batch` for the batch, "
     "`--plot max.png` to draw it (plot extra).",
     ["max", "--model", "llama3-8b", "--gpus", "8xH100", "--zero", "3"]),
    ("A plan for a pull-request comment", "`plan --markdown` (and `estimate --markdown`); "
     "`plan --json` opens with a summary: model, cluster, fits, best layout.",
     ["plan", "--model", "llama3-8b", "--gpus", "8xH100", "--top", "3", "--markdown"]),
    ("Explain the numbers", "Every formula with this scenario's numbers.",
     ["explain", "--model", "gpt2", "--gpus", "4090", "--seq-len", "1024"]),
    ("Trace a real PyTorch step (fake tensors, no GPU)", "",
     ["trace", "--model", "gpt2", "--gpus", "4090", "--seq-len", "512"]),
    ("Size a cluster", "",
     ["size", "--model", "70b", "--tokens", "2T", "--gpu", "H100", "--gpu", "A100",
      "--gpu", "910B", "--days", "30"]),
    ("Size a fine-tuning job", "Every training option of `plan` applies; a fine-tuning job "
     "gets the fewest GPUs within 10 % of the least GPU-hours.",
     ["size", "--model", "70b", "--finetune", "qlora", "--tokens", "100M", "--gpu", "RTX4090",
      "--gpu", "H100"]),
    ("Guard a config in CI", "",
     ["check", "examples/train.yaml"]),
    ("Estimate from a DeepSpeed config", "The Hugging Face Trainer's ZeRO-3 template: "
     "\"auto\" buckets filled from the hidden size, notes on stderr.",
     ["estimate", "--model", "8b", "--gpus", "8xH100", "--deepspeed",
      "examples/ds_zero3_hf.json", "--recompute", "full"]),
    ("Measure on a real GPU", "Without a GPU or NPU the probe says so and exits 3.",
     ["probe", "--model", "gpt2", "--gpus", "H100", "--seq-len", "512"]),
    ("Version", "The installed version and the revisions of the shipped GPU-profile and model "
     "catalogs; every `--json` document carries the same three keys.", ["--version"]),
    ("Serve a model with vLLM", "Weights, profiling peak, KV capacity and concurrency "
     "at a context length; exit 1 when it does not fit.",
     ["serve", "--model", "llama3.1-8b", "--gpus", "H100", "--max-model-len", "32768"]),
    ("Serve DeepSeek-V3 in FP8 on eight H200s", "Multi-latent attention: one latent per "
     "token and layer, the same on every TP rank.",
     ["serve", "--model", "deepseek-v3", "--gpus", "8xH200", "--tp", "8", "--quantization",
      "fp8", "--max-model-len", "32768"]),
    ("How many GPUs to serve 100 users at 8K context, and what per month", "Per GPU type, "
     "the fewest GPUs that hold the concurrency (`plan --serve` lists every layout on one "
     "type).",
     ["size", "--serve", "--model", "llama3.1-70b", "--gpu", "H100", "--gpu", "H200",
      "--gpu", "A100-80GB", "--max-model-len", "8192", "--concurrency", "100"]),
    ("GPU catalog", "", ["gpus"]),
    ("Model catalog", "", ["models"]),
    ("Bad input", "One line on stderr, exit code 2.",
     ["estimate", "--model", "llama3-9b", "--gpus", "8xH100"]),
]


EXIT_CODES = [
    "| exit code | meaning |",
    "|---|---|",
    "| 0 | done (`check`, `serve`: it fits; `validate`: within tolerance) |",
    "| 1 | `check` / `serve`: it does not fit; `validate`: a scenario or record out of "
    "tolerance |",
    "| 2 | bad input, one `error:` line on stderr (also `validate` without torch / "
    "transformers, or `--records` with nothing to compare) |",
    "| 3 | `probe`: no GPU or NPU found |",
]


def run(args: list[str]) -> tuple[int, str]:
    env = dict(os.environ, COLUMNS="100", TERM="dumb")
    proc = subprocess.run([sys.executable, "-m", "vramcalc", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    return proc.returncode, (proc.stdout + proc.stderr).rstrip()


def main() -> None:
    parts = ["# vramcalc commands, with real output",
             "", "Generated by `python scripts/gen_cli_docs.py`; every block is real output.", "",
             *EXIT_CODES, ""]
    for title, blurb, args in COMMANDS:
        rc, out = run(args)
        if "No such command" in out:
            continue
        parts += [f"## {title}", ""]
        if blurb:
            parts += [blurb, ""]
        parts += ["```console", f"$ vramcalc {' '.join(args)}", out, "```", f"exit code {rc}", ""]
    (ROOT / "docs" / "cli.md").write_text("\n".join(parts) + "\n", encoding="utf-8")
    print("wrote docs/cli.md")


if __name__ == "__main__":
    main()
