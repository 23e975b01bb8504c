"""`vramcalc check` on a torchtune recipe config: the keys torchtune's recipes read
(pytorch/torchtune bd2a0fc7 recipes/*.py and recipes/configs/*) become vramcalc options.

The configs below are written here with torchtune's key names and the values of its
recipes/configs/llama3_1/8B_lora_single_device.yaml and 8B_full.yaml at bd2a0fc7."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vramcalc.cli import app
from vramcalc.recipe_files import torchtune_values

runner = CliRunner()

LORA_8B = """\
output_dir: /tmp/torchtune/llama3_1_8B/lora_single_device
model:
  _component_: torchtune.models.llama3_1.lora_llama3_1_8b
  lora_attn_modules: ['q_proj', 'v_proj', 'output_proj']
  apply_lora_to_mlp: True
  apply_lora_to_output: False
  lora_rank: 8
  lora_alpha: 16
  lora_dropout: 0.0
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: /tmp/Meta-Llama-3.1-8B-Instruct/original/tokenizer.model
  max_seq_len: null
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: /tmp/Meta-Llama-3.1-8B-Instruct/
dataset:
  _component_: torchtune.datasets.alpaca_cleaned_dataset
  packed: False
seed: null
shuffle: True
batch_size: 2
optimizer:
  _component_: torch.optim.AdamW
  fused: True
  weight_decay: 0.01
  lr: 3e-4
loss:
  _component_: torchtune.modules.loss.LinearCrossEntropyLoss
epochs: 1
gradient_accumulation_steps: 8
clip_grad_norm: null
compile: False
device: cuda
dtype: bf16
enable_activation_checkpointing: True
enable_activation_offloading: False
"""

FULL_8B_DISTRIBUTED = """\
model:
  _component_: torchtune.models.llama3_1.llama3_1_8b
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  max_seq_len: 4096
dataset:
  _component_: torchtune.datasets.alpaca_dataset
  packed: True
batch_size: 2
optimizer:
  _component_: torch.optim.AdamW
  lr: 2e-5
  fused: True
loss:
  _component_: torchtune.modules.loss.LinearCrossEntropyLoss
gradient_accumulation_steps: 1
optimizer_in_bwd: False
compile: False
custom_sharded_layers: ['tok_embeddings', 'output']
fsdp_cpu_offload: False
dtype: bf16
enable_activation_checkpointing: True
"""


def _write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_lora_recipe_keys_become_options(tmp_path: Path) -> None:
    import yaml
    values, notes = torchtune_values(yaml.safe_load(LORA_8B))
    assert values == {
        "framework": "torchtune", "model": "llama3.1-8b", "finetune": "lora",
        "lora_targets": "q,v,o,gate,up,down", "lora_rank": 8, "lora_dropout": 0.0,
        "micro_batch_size": 2, "grad_accum": 8, "precision": "bf16-pure",
        "optimizer": "adamw", "optimizer_impl": "fused", "chunked_ce": 8,
        "torchtune_version": "0.7.0", "compile": False, "activation_offload": False,
        "recompute": "full"}
    assert "lora_llama3_1_8b is llama3.1-8b" in notes[0]


def test_check_of_the_recipe_equals_check_of_its_options(tmp_path: Path) -> None:
    recipe = _write(tmp_path, LORA_8B)
    from_recipe = json.loads(runner.invoke(app, [
        "check", str(recipe), "--gpus", "1xRTX4090", "--seq-len", "2048", "--json"]).stdout)
    own = _write(tmp_path, "model: llama3.1-8b\ngpus: 1xRTX4090\nseq_len: 2048\n"
                 "framework: torchtune\nfinetune: lora\nlora_targets: q,v,o,gate,up,down\n"
                 "micro_batch_size: 2\ngrad_accum: 8\nprecision: bf16-pure\n"
                 "optimizer_impl: fused\nchunked_ce: 8\nrecompute: full\n"
                 "torchtune_version: '0.7.0'\n", "own.yaml")
    from_own = json.loads(runner.invoke(app, ["check", str(own), "--json"]).stdout)
    assert from_recipe["device_total_bytes"] == from_own["device_total_bytes"] > 0
    # command-line flags still win over the recipe
    smaller = json.loads(runner.invoke(app, [
        "check", str(recipe), "--gpus", "1xRTX4090", "--seq-len", "2048",
        "--micro-batch-size", "1", "--json"]).stdout)
    assert smaller["device_total_bytes"] < from_recipe["device_total_bytes"]


def test_distributed_recipe_shards_with_fsdp(tmp_path: Path) -> None:
    recipe = _write(tmp_path, FULL_8B_DISTRIBUTED)
    res = runner.invoke(app, ["check", str(recipe), "--gpus", "8xH100", "--json"])
    strategy = json.loads(res.stdout)["report"]["strategy"]
    assert (strategy["fsdp"], strategy["dp"], strategy["seq_len"], strategy["packed"]) == (
        "full", 8, 4096, True)
    assert strategy["fsdp_edge_units"] is True and strategy["finetune"] == "full"
    one = json.loads(runner.invoke(app, ["check", str(recipe), "--gpus", "1xH100",
                                         "--json"]).stdout)["report"]["strategy"]
    assert one["fsdp"] == "none"


def test_qlora_builder_and_a_local_checkpoint_config(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # torchtune opens checkpoint_dir relative to the cwd
    ckpt = Path("ckpt")
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 512, "intermediate_size": 1024,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
        "vocab_size": 1000, "max_position_embeddings": 2048}), encoding="utf-8")
    text = (LORA_8B.replace("lora_llama3_1_8b", "qlora_llama3_1_8b")
            .replace("/tmp/Meta-Llama-3.1-8B-Instruct/", "ckpt"))
    import yaml
    values, _ = torchtune_values(yaml.safe_load(text))
    assert values["finetune"] == "qlora" and values["model"] == str(ckpt / "config.json")
    res = runner.invoke(app, ["check", str(_write(tmp_path, text)), "--gpus", "1xRTX4090",
                              "--seq-len", "512", "--json"])
    assert json.loads(res.stdout)["report"]["model"]["num_params"] > 0


@pytest.mark.parametrize("change, message", [
    (("max_seq_len: null", "max_seq_len: null"), "give that length with --seq-len"),
    (("apply_lora_to_output: False", "apply_lora_to_output: True"), "apply_lora_to_output"),
    (("torchtune.modules.loss.LinearCrossEntropyLoss", "torchtune.rlhf.loss.DPOLoss"),
     "loss torchtune.rlhf.loss.DPOLoss is not modelled"),
    (("torch.optim.AdamW", "torch.optim.Adagrad"), "optimizer torch.optim.Adagrad"),
    (("lora_llama3_1_8b", "lora_llama3_2_vision_11b"), "no built-in model"),
    (("batch_size: 2", "batch_size: two"), "batch_size must be a positive whole number"),
    (("fused: True", "fused: True\n  momentum: fast"), "optimizer.momentum must be a number"),
    (("compile: False", "compile: {model: True}"), "compile must be True or False"),
    (("dtype: bf16", "dtype: fp16"), "dtype must be bf16 or fp32"),
])
def test_what_cannot_be_read_is_one_error_line(tmp_path: Path, change: tuple[str, str],
                                                message: str) -> None:
    recipe = _write(tmp_path, LORA_8B.replace(*change))
    args = ["check", str(recipe), "--gpus", "1xRTX4090"]
    if "seq-len" not in message:
        args += ["--seq-len", "2048"]
    res = subprocess.run([sys.executable, "-m", "vramcalc", *args], capture_output=True,
                         text=True)
    assert res.returncode == 2, res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_a_plain_vramcalc_config_is_unchanged(tmp_path: Path) -> None:
    own = _write(tmp_path, "model: gpt2\ngpus: 1xH100\nmodel_component: x\n")
    res = subprocess.run([sys.executable, "-m", "vramcalc", "check", str(own)],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "unknown key 'model_component'" in res.stderr


def test_the_release_loss_keeps_the_release(tmp_path: Path) -> None:
    # CEWithChunkedOutputLoss is the loss of torchtune's releases (0.6.1 and before): no
    # version is implied; LinearCrossEntropyLoss exists on its main branch only (0.7.0)
    import yaml
    text = LORA_8B.replace("LinearCrossEntropyLoss", "CEWithChunkedOutputLoss")
    values, _ = torchtune_values(yaml.safe_load(text))
    assert "torchtune_version" not in values and values["chunked_ce"] == 8
    main = json.loads(runner.invoke(app, ["check", str(_write(tmp_path, LORA_8B)), "--gpus",
                                          "1xRTX4090", "--seq-len", "2048", "--json"]).stdout)
    release = json.loads(runner.invoke(app, ["check", str(_write(tmp_path, text, "rel.yaml")),
                                             "--gpus", "1xRTX4090", "--seq-len", "2048",
                                             "--json"]).stdout)
    assert main["report"]["strategy"]["torchtune_version"] == "0.7.0"
    assert main["device_total_bytes"] != release["device_total_bytes"]


# ---- LitGPT ------------------------------------------------------------------------------
# the keys and values of Lightning-AI/litgpt config_hub/finetune/llama-2-7b/qlora.yaml
# (00af8b0d, the commit of its README's memory table, and 0077627d alike)
LIT_QLORA = """\
checkpoint_dir: checkpoints/meta-llama/Llama-2-7b-hf
out_dir: out/finetune/qlora-llama2-7b
precision: bf16-true
quantize: bnb.nf4
devices: 1
num_nodes: 1
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_query: true
lora_key: false
lora_value: true
lora_projection: false
lora_mlp: false
lora_head: false
data:
  class_path: litgpt.data.Alpaca2k
train:
  save_interval: 200
  global_batch_size: 8
  micro_batch_size: 2
  lr_warmup_steps: 10
  epochs: 4
  max_seq_length: 512
optimizer:
  class_path: torch.optim.AdamW
  init_args:
    lr: 0.0002
    weight_decay: 0.0
"""


def test_litgpt_qlora_config_is_the_published_rows_flags() -> None:
    # docs/validation.md's LitGPT rows were expressed by hand from these configs
    # (benchmarks/published_rows.py `_LIT_Q`): the importer must give the same options
    import yaml

    from vramcalc.recipe_files import litgpt_values
    values, notes = litgpt_values(yaml.safe_load(LIT_QLORA))
    assert values == {
        "framework": "lightning", "model": "meta-llama/Llama-2-7b-hf",
        "precision": "bf16-pure", "nf4_double_quant": False, "quantize_head": True,
        "finetune": "qlora", "lora_targets": "q,v", "lora_rank": 32, "lora_dropout": 0.05,
        "micro_batch_size": 2, "seq_len": 512, "optimizer": "paged-adamw",
        "_devices": 1, "_global_batch": 8}  # accumulation 8 // 1 // 2 = 4 once --gpus is known
    assert "Llama-2-7b-hf is meta-llama/Llama-2-7b-hf" in notes[0]


def test_litgpt_config_checks_as_its_flags(tmp_path: Path) -> None:
    recipe = _write(tmp_path, LIT_QLORA)
    doc = json.loads(runner.invoke(app, ["check", str(recipe), "--gpus", "1xA10G",
                                         "--bnb-version", "0.42.0", "--json"]).stdout)
    own = _write(tmp_path, "model: llama2-7b\ngpus: 1xA10G\nframework: lightning\n"
                 "precision: bf16-pure\nfinetune: qlora\nlora_rank: 32\nlora_targets: q,v\n"
                 "lora_dropout: 0.05\nmicro_batch_size: 2\ngrad_accum: 4\nseq_len: 512\n"
                 "optimizer: paged-adamw\nnf4_double_quant: false\nquantize_head: true\n"
                 "bnb_version: '0.42.0'\n", "own.yaml")
    expected = json.loads(runner.invoke(app, ["check", str(own), "--json"]).stdout)
    assert doc["device_total_bytes"] == expected["device_total_bytes"] > 0


def test_litgpt_devices_fsdp_and_default_precision(tmp_path: Path) -> None:
    lora = LIT_QLORA.replace("quantize: bnb.nf4\n", "")
    two = _write(tmp_path, lora.replace("devices: 1", "devices: 2"), "two.yaml")
    strategy = json.loads(runner.invoke(app, ["check", str(two), "--gpus", "2xA100",
                                              "--json"]).stdout)["report"]["strategy"]
    # Fabric's FSDPStrategy with activation_checkpointing_policy={Block} (finetune/lora.py)
    assert (strategy["fsdp"], strategy["recompute"], strategy["dp"]) == ("full", "full", 2)
    assert strategy["grad_accum"] == 2  # global 8 // 2 devices // micro 2
    res = subprocess.run([sys.executable, "-m", "vramcalc", "check", str(two), "--gpus",
                          "4xA100"], capture_output=True, text=True)
    assert res.returncode == 2 and "devices × num_nodes = 2" in res.stderr
    # devices: -1 (every GPU): the accumulation follows the --gpus count
    every = _write(tmp_path, lora.replace("devices: 1", "devices: -1"), "every.yaml")
    got = json.loads(runner.invoke(app, ["check", str(every), "--gpus", "4xA100", "--json"]
                                   ).stdout)["report"]["strategy"]
    assert (got["dp"], got["grad_accum"]) == (4, 1)  # 8 // 4 // 2
    # no precision: get_default_supported_precision(training=True), by the GPU's bf16
    bare = _write(tmp_path, lora.replace("precision: bf16-true\n", ""), "bare.yaml")
    for gpu, precision in (("1xA10G", "amp-bf16"), ("1xT4", "amp-fp16")):
        got = json.loads(runner.invoke(app, ["check", str(bare), "--gpus", gpu, "--json"]
                                       ).stdout)["report"]["strategy"]["precision"]
        assert got == precision


@pytest.mark.parametrize("change, message", [
    (("lora_head: false", "lora_head: true"), "lora_head"),
    (("quantize: bnb.nf4", "quantize: bnb.int8-training"), "quantize 'bnb.int8-training'"),
    (("max_seq_length: 512", "max_seq_length: null"), "train.max_seq_length"),
    (("precision: bf16-true", "precision: bf16-mixed"), "mixed precision"),
    (("precision: bf16-true\n", ""), "default mixed precision"),
    (("devices: 1", "devices: 2"), "devices × num_nodes = 2"),
])
def test_litgpt_refusals(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    recipe = _write(tmp_path, LIT_QLORA.replace(*change))
    res = subprocess.run([sys.executable, "-m", "vramcalc", "check", str(recipe), "--gpus",
                          "1xA10G"], capture_output=True, text=True)
    assert res.returncode == 2, res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_litgpt_lora_defaults_to_query_and_value(tmp_path: Path) -> None:
    # finetune/lora.py setup(lora_query=True, lora_value=True, the others False)
    import yaml

    from vramcalc.recipe_files import litgpt_values
    text = "\n".join(line for line in LIT_QLORA.splitlines()
                     if not line.startswith(("lora_query", "lora_value", "lora_key")))
    values, _ = litgpt_values(yaml.safe_load(text))
    assert values["lora_targets"] == "q,v"
