"""`vramcalc check` on a LLaMA-Factory config (vramcalc/recipe_llamafactory.py): the keys
its SFT workflow reads (hiyouga/LLaMA-Factory ff6d4d12) become hf-profile options.

The config below is written here with LLaMA-Factory's keys and the values of its
examples/train_lora/llama3_lora_sft.yaml (000526908a; the qwen3 examples of ff6d4d12 set the
same memory keys)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from vramcalc.cli import app
from vramcalc.recipe_llamafactory import llamafactory_values

runner = CliRunner()

LORA_SFT = """\
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
output_dir: saves/llama3-8b/lora/sft
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
bf16: true
"""


def _values(text: str, zero3: bool = False) -> dict[str, object]:
    return llamafactory_values(yaml.safe_load(text), zero3)[0]


def test_lora_example_keys_and_defaults() -> None:
    assert _values(LORA_SFT) == {
        "framework": "hf", "model": "meta-llama/Meta-Llama-3-8B-Instruct", "finetune": "lora",
        # LoRA: the checkpoint's bf16 base, fp32 adapters, the Trainer's bf16 autocast
        "precision": "bf16-autocast", "lora_rank": 8, "lora_dropout": 0.0, "lora_targets": "all-linear",
        # gradient checkpointing on and reentrant unless disabled (checkpointing.py)
        "recompute": "full", "use_reentrant": True, "seq_len": 2048, "micro_batch_size": 1,
        "grad_accum": 8, "attention": "flash"}
    # transformers' per_device_train_batch_size default (8), LLaMA-Factory's cutoff_len (2048)
    bare = _values("model_name_or_path: x/y\nstage: sft\nbf16: true\n")
    assert (bare["micro_batch_size"], bare["seq_len"], bare["lora_rank"]) == (8, 2048, 8)


def test_quantization_precision_and_checkpointing_keys() -> None:
    q = _values(LORA_SFT + "quantization_bit: 4\nquantization_method: bnb\n")
    assert (q["finetune"], q["nf4_double_quant"], q["precision"]) == ("qlora", True, "bf16-autocast")
    q = _values(LORA_SFT + "quantization_bit: 4\ndouble_quantization: false\n")
    assert q["nf4_double_quant"] is False
    full = LORA_SFT.replace("finetuning_type: lora", "finetuning_type: full")
    # full: every trainable parameter cast to fp32 under autocast, unless ZeRO-3 or pure_bf16
    assert _values(full)["precision"] == "amp-bf16"
    assert _values(full, zero3=True)["precision"] == "bf16"
    assert _values(full + "pure_bf16: true\n")["precision"] == "bf16-pure"
    off = _values(LORA_SFT + "disable_gradient_checkpointing: true\n")
    assert off["recompute"] == "none" and "use_reentrant" not in off
    assert _values(LORA_SFT + "use_reentrant_gc: false\n")["use_reentrant"] is False
    named = _values(LORA_SFT.replace("lora_target: all", "lora_target: q_proj,v_proj"))
    assert named["lora_targets"] == "q,v"
    assert _values(LORA_SFT + "optim: paged_adamw_8bit\n")["optimizer"] == "paged-adamw-8bit"
    assert _values(LORA_SFT + "flash_attn: disabled\n")["attention"] == "eager"


def test_check_reads_the_deepspeed_file_from_the_cwd(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("ds_z3.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3}}), encoding="utf-8")
    full = LORA_SFT.replace("finetuning_type: lora", "finetuning_type: full\n"
                            "deepspeed: ds_z3.json")
    Path("full.yaml").write_text(full, encoding="utf-8")
    res = runner.invoke(app, ["check", "full.yaml", "--gpus", "8xH100", "--json"])
    strategy = json.loads(res.stdout)["report"]["strategy"]
    assert (strategy["zero"], strategy["precision"], strategy["dp"]) == (3, "bf16", 8)
    Path("lora.yaml").write_text(LORA_SFT, encoding="utf-8")
    lora = json.loads(runner.invoke(app, ["check", "lora.yaml", "--gpus", "1xH100",
                                          "--json"]).stdout)["report"]["strategy"]
    assert (lora["finetune"], lora["recompute"], lora["use_reentrant"]) == ("lora", "full", True)
    assert lora["precision"] == "bf16-autocast"


@pytest.mark.parametrize("extra, message", [
    ("stage: dpo\n", "stage 'dpo'"),
    ("finetuning_type: freeze\n", "finetuning_type 'freeze'"),
    ("quantization_bit: 8\n", "quantization_bit '8'"),
    ("use_galore: true\n", "use_galore"),
    ("neat_packing: true\n", "neat_packing"),
    ("optim: sgd\n", "optim 'sgd'"),
    ("lora_target: qkv\n", "lora_target 'qkv'"),
    ("deepspeed: [1]\n", "deepspeed must be a path"),
])
def test_refusals_are_one_error_line(tmp_path: Path, extra: str, message: str) -> None:
    key = extra.split(":")[0]
    text = "\n".join(line for line in LORA_SFT.splitlines() if not line.startswith(key))
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n" + extra, encoding="utf-8")
    res = subprocess.run([sys.executable, "-m", "vramcalc", "check", str(path), "--gpus",
                          "1xH100"], capture_output=True, text=True)
    assert res.returncode == 2, res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_no_precision_is_refused() -> None:
    with pytest.raises(Exception, match="set bf16, fp16 or pure_bf16"):
        _values(LORA_SFT.replace("bf16: true\n", ""))


def test_lora_autocasts_unless_deepspeed_runs_it() -> None:
    # accelerate's Accelerator sets native_amp (the autocast it wraps the forward in) for
    # fp16/bf16 unless the distributed type is DeepSpeed or Megatron-LM
    assert _values(LORA_SFT)["precision"] == "bf16-autocast"
    fp16 = LORA_SFT.replace("bf16: true", "fp16: true")
    assert _values(fp16)["precision"] == "fp16-autocast"
    assert _values(LORA_SFT + "deepspeed: ds_z2.json\n")["precision"] == "bf16"
    notes = llamafactory_values(yaml.safe_load(LORA_SFT), False)[1]
    assert len(notes) == 1 and "precision bf16-autocast" in notes[0]
