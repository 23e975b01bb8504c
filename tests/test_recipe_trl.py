"""`vramcalc check` on a TRL SFT config (vramcalc/recipe_trl.py).

Expected values from TRL's source (huggingface/trl f2cd5771, 1.10.0.dev0), not from
vramcalc: ModelConfig `dtype="float32"`, `use_peft=False`, `lora_r=16`, `lora_dropout=0.05`;
SFTConfig `max_length=1024`, `gradient_checkpointing=True`, `bf16 = not fp16` when unset
(base_config.py `__post_init__`), `loss_type` "chunked_nll" unless `use_liger_kernel`
("nll"); TrainingArguments' `per_device_train_batch_size=8`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from vramcalc.cli import app
from vramcalc.recipe_trl import is_trl_config, trl_values

runner = CliRunner()

# TRL's examples/cli_configs/example_config.yaml with a catalog model
EXAMPLE = """model_name_or_path: Qwen/Qwen2.5-7B
dataset_name: stanfordnlp/imdb
report_to: none
learning_rate: 0.0001
lr_scheduler_type: cosine
"""
# the sft.py docstring's LoRA command as a YAML, in bf16
LORA = """model_name_or_path: meta-llama/Llama-3.1-8B
dataset_name: trl-lib/Capybara
dtype: bfloat16
use_peft: true
lora_r: 32
lora_alpha: 16
lora_target_modules: [q_proj, k_proj, v_proj, o_proj]
max_length: 2048
per_device_train_batch_size: 2
gradient_accumulation_steps: 8
"""


def _values(text: str) -> dict[str, object]:
    return trl_values(yaml.safe_load(text))[0]


def test_the_example_config_takes_trls_defaults() -> None:
    assert is_trl_config(yaml.safe_load(EXAMPLE))
    assert _values(EXAMPLE) == {
        "framework": "hf", "model": "Qwen/Qwen2.5-7B", "finetune": "full",
        # the fp32 load under the Trainer's bf16 autocast
        "precision": "amp-bf16", "seq_len": 1024, "micro_batch_size": 8, "grad_accum": 1,
        "recompute": "full", "attention": "flash", "trl_chunked_ce": True}


def test_lora_keys() -> None:
    assert _values(LORA) == {
        "framework": "hf", "model": "meta-llama/Llama-3.1-8B", "finetune": "lora",
        "precision": "bf16-autocast", "lora_rank": 32, "lora_dropout": 0.05,
        "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj"], "seq_len": 2048,
        "micro_batch_size": 2, "grad_accum": 8, "recompute": "full", "attention": "flash",
        "trl_chunked_ce": True}


@pytest.mark.parametrize(("extra", "precision"), [
    ("dtype: float16\nfp16: true\n", "fp16-autocast"),
    ("dtype: bfloat16\nbf16: false\n", "bf16-pure"),
    ("bf16: false\n", "fp32"),
    ("fp16: true\n", "amp-fp16"),
    ("dtype: bfloat16\ndeepspeed: ds.json\n", "bf16"),  # accelerate runs no autocast there
])
def test_precision_rules(extra: str, precision: str) -> None:
    assert _values(EXAMPLE + extra)["precision"] == precision


def test_loss_and_checkpointing_keys() -> None:
    liger = _values(EXAMPLE + "use_liger_kernel: true\n")
    assert liger["liger"] is True and "trl_chunked_ce" not in liger
    assert "trl_chunked_ce" not in _values(EXAMPLE + "loss_type: nll\n")
    off = _values(EXAMPLE + "gradient_checkpointing: false\n")
    assert off["recompute"] == "none"
    on = _values(EXAMPLE + "gradient_checkpointing_kwargs: {use_reentrant: true}\n")
    assert on["use_reentrant"] is True
    assert _values(EXAMPLE + "attn_implementation: eager\n")["attention"] == "eager"
    assert _values(EXAMPLE + "optim: paged_adamw_8bit\n")["optimizer"] == "paged-adamw-8bit"
    auto = trl_values(yaml.safe_load(EXAMPLE + "dtype: auto\n"))
    assert auto[0]["precision"] == "bf16-autocast" and "taken as bfloat16" in auto[1][1]


def test_check_of_the_config_equals_check_of_its_options(tmp_path: Path) -> None:
    path = tmp_path / "sft.yaml"
    path.write_text(LORA, encoding="utf-8")
    got = json.loads(runner.invoke(app, ["check", str(path), "--gpus", "1xH100",
                                         "--json"]).stdout)["report"]
    flags = ["estimate", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "1xH100",
             "--framework", "hf", "--finetune", "lora", "--precision", "bf16-autocast",
             "--lora-rank", "32", "--lora-dropout", "0.05", "--lora-targets", "q,k,v,o",
             "--seq-len", "2048", "--micro-batch-size", "2", "--grad-accum", "8",
             "--recompute", "full", "--trl-chunked-ce", "--json"]
    want = json.loads(runner.invoke(app, flags).stdout)
    assert got["peak_allocated_bytes"] == want["peak_allocated_bytes"]
    assert got["strategy"] == want["strategy"]


def test_4bit_loading_is_qlora_with_trls_bf16_adapters() -> None:
    # trl/trainer/utils.py get_quantization_config: double quantization only with
    # use_bnb_nested_quant (False by default); sft_trainer.py casts the trained parameters
    # of a quantized model to bf16
    vals = _values(LORA + "load_in_4bit: true\n")
    assert vals["finetune"] == "qlora" and vals["qlora_impl"] == "bnb"
    assert vals["nf4_double_quant"] is False and vals["adapters_16bit"] is True
    assert vals["precision"] == "bf16-autocast"
    nested = _values(LORA + "load_in_4bit: true\nuse_bnb_nested_quant: true\n")
    assert nested["nf4_double_quant"] is True


@pytest.mark.parametrize(("extra", "rows"), [
    # sft_trainer.py: padding_free = padding_free or (packing and strategy in bfd, bfd_split);
    # the collator then concatenates the batch of 2 into one row (1, sum of lengths)
    ("packing: true\n", (1, 4096)),
    ("packing: true\npacking_strategy: bfd_split\n", (1, 4096)),
    ("padding_free: true\n", (1, 4096)),
    ("packing: true\npacking_strategy: wrapped\n", (2, 2048)),  # rows of max_length
])
def test_packing_and_padding_free_rows(extra: str, rows: tuple[int, int]) -> None:
    vals = _values(LORA + extra)
    assert (vals["micro_batch_size"], vals["seq_len"]) == rows


@pytest.mark.parametrize(("extra", "message"), [
    ("max_seq_length: 512\n", "current releases read max_length"),
    ("torch_dtype: bfloat16\n", "current releases read dtype"),
    ("load_in_8bit: true\n", "load_in_8bit is not modelled"),
    ("load_in_4bit: true\n", "without use_peft trains nothing"),
    # TRL's default dtype float32 is bitsandbytes' compute dtype
    ("load_in_4bit: true\nuse_peft: true\n", "load_in_4bit with dtype 'float32'"),
    ("load_in_4bit: true\nuse_peft: true\ndtype: bfloat16\nbnb_4bit_quant_type: int4\n",
     "bnb_4bit_quant_type 'int4'"),
    ("packing: true\npacking_strategy: greedy\n", "packing_strategy 'greedy'"),
    ("packing: true\nmax_length: null\n", "packing with max_length null"),
    ("loss_type: dft\n", "loss_type 'dft'"),
    ("dtype: bfloat16\nfp16: true\n", "under fp16 autocast"),
    ("num_processes: 4\n", "num_processes = 4"),
])
def test_refusals_are_one_error_line(tmp_path: Path, extra: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(EXAMPLE + extra, encoding="utf-8")
    res = subprocess.run([sys.executable, "-m", "vramcalc", "check", str(path), "--gpus",
                          "1xH100"], capture_output=True, text=True)
    assert res.returncode == 2, res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_no_max_length_asks_for_the_longest_sample(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(EXAMPLE + "max_length: null\n", encoding="utf-8")

    def check(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vramcalc", "check", str(path), *extra],
                              capture_output=True, text=True)

    res = check("--gpus", "1xH100")
    assert res.returncode == 2 and "sets no max_length" in res.stderr
    res = check("--gpus", "8xH100", "--seq-len", "512", "--finetune", "lora")
    assert res.returncode in (0, 1) and "seq 512" in res.stdout, res.stderr
