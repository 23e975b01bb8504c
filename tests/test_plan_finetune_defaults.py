"""`plan` for fine-tuning: a fine-tuning global batch by default (said in a note), and
suggestions that include every lever which makes a job fit.

Sources: Stanford Alpaca's fine-tuning recipe, "Batch size 128" (tatsu-lab/stanford_alpaca
@000109ff README.md); Llama 2's 4M-token pretraining batch (Llama 2 MODEL_CARD.md), 1,024
sequences of 4,096 tokens; torchtune's CEWithChunkedOutputLoss default of 8 chunks; model
facts from the model cards' config.json (Llama-2-7B 6,738,415,616 parameters; Gemma-2B
vocabulary 256,000; Llama-2-70B 80 layers, hidden 8192, vocabulary 32,000).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from vramcalc.cli import app

runner = CliRunner()


def _plan(*args: str) -> tuple[dict, str]:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


def _global_batch(candidate: dict) -> int:
    s = candidate["strategy"]
    dp = s["world_size"] // (s["tp"] * s["pp"] * s["cp"])
    return s["micro_batch_size"] * s["grad_accum"] * dp


@pytest.mark.parametrize("method", ["lora", "qlora", "full"])
def test_finetuning_plans_a_finetuning_batch_and_says_so(method: str) -> None:
    doc, err = _plan("--model", "8b", "--gpus", "8xH100", "--finetune", method, "--top", "3")
    assert doc["candidates"]
    assert {_global_batch(c) for c in doc["candidates"]} == {128}
    assert "fine-tuning" in err and "128 sequences" in err


def test_pretraining_keeps_the_4m_token_batch_and_a_given_batch_wins() -> None:
    doc, err = _plan("--model", "8b", "--gpus", "8xH100", "--top", "2")
    assert {_global_batch(c) for c in doc["candidates"]} == {4 * 2**20 // 4096}
    assert "fine-tuning" not in err
    doc, err = _plan("--model", "8b", "--gpus", "8xH100", "--finetune", "lora",
                     "--global-batch-size", "64", "--top", "2")
    assert {_global_batch(c) for c in doc["candidates"]} == {64}
    assert "fine-tuning" not in err


def _suggestion(doc: dict, kind: str) -> dict:
    found = [s for s in doc["suggestions"] if s["kind"] == kind]
    assert found, [s["kind"] for s in doc["suggestions"]]
    assert found[0]["candidate"]["fits"]
    return found[0]


def test_a_fused_optimizer_is_suggested_when_the_foreach_copy_is_what_overflows() -> None:
    """Full fine-tune of Llama-2-7B on one H200: the foreach AdamW step copies every fp32
    second moment (4 B x 6.74e9 = 27 GB) on top of 16 B/param of model states (108 GB), past
    the 142.5 GB that 5% headroom leaves; a fused step copies nothing."""
    doc, _ = _plan("--model", "llama2-7b", "--gpus", "1xH200", "--seq-len", "2048",
                   "--finetune", "full")
    sg = _suggestion(doc, "optimizer_impl")
    assert sg["change"] == {"optimizer_impl": "fused"}
    assert sg["candidate"]["strategy"]["optimizer_impl"] == "fused"


def test_chunked_cross_entropy_is_suggested_when_logits_dominate() -> None:
    """Gemma-2B LoRA at 8,192 tokens: fp32 logits, log-probabilities and their gradient are
    8192 x 256,000 x 12 B = 25.2 GB, more than the whole 24 GB card."""
    doc, _ = _plan("--model", "gemma-2b", "--gpus", "1xRTX4090", "--finetune", "lora",
                   "--seq-len", "8192")
    sg = _suggestion(doc, "chunked_ce")
    assert sg["change"] == {"chunked_ce": 8}
    assert "logits are" in sg["title"]


def test_activation_offload_is_suggested_when_layer_inputs_overflow() -> None:
    """Llama-2-70B QLoRA at 32,768 tokens on one H100: even under full recompute the layer
    inputs are 80 x 32768 x 8192 x 2 B = 42.9 GB beside ~35.6 GB of NF4 weights (4.13 bits
    x 69e9) and 12.6 GB of loss buffers; offloaded to host RAM, they leave room."""
    doc, _ = _plan("--model", "llama2-70b", "--gpus", "1xH100", "--finetune", "qlora",
                   "--seq-len", "32768")
    sg = _suggestion(doc, "activation_offload")
    assert sg["change"] == {"activation_offload": True}
    assert sg["candidate"]["strategy"]["activation_offload"] is True


@pytest.mark.parametrize("release", ["0.1.0", "0.2"])  # YAML reads a bare 0.2 as a number
def test_next_steps_carry_every_option_given(tmp_path: object, release: str) -> None:
    # plan's "see one strategy" command and its `check` config describe the run the plan
    # ranked: the stack, its release and the adapters' settings go with the strategy (the
    # device total each gives equals the plan's best, which a run without them would not)
    import shlex
    from pathlib import Path

    given = ["--model", "llama2-7b", "--gpus", "2xRTX4090", "--framework", "torchtune",
             "--torchtune-version", release, "--finetune", "lora", "--lora-rank", "64",
             "--lora-targets", "all-linear", "--lora-dropout", "0.1", "--seq-len", "1024"]
    runner = CliRunner()
    best = json.loads(runner.invoke(app, ["plan", *given, "--json"]).stdout)
    total = best["candidates"][0]["device_total_bytes"]
    text = runner.invoke(app, ["plan", *given], env={"COLUMNS": "80"}).stdout  # one line even so
    # the command is folded with `\` continuations: it pastes as one
    cmd = text.split("see one strategy:", 1)[1].split("guard it in CI:", 1)[0]
    argv = shlex.split(cmd.replace("\\\n", " "))[1:]
    for flag in ("--torchtune-version", "--lora-rank", "--lora-targets", "--lora-dropout",
                 "--framework"):
        assert flag in argv
    shown = json.loads(runner.invoke(app, [*argv, "--json"]).stdout)
    assert shown["device_total_bytes"] == total
    yaml_lines = text.split("(docs/ci.md)", 1)[1].splitlines()
    cfg = Path(str(tmp_path)) / "train.yaml"
    cfg.write_text("\n".join(line.strip() for line in yaml_lines if line.strip()) + "\n")
    checked = json.loads(runner.invoke(app, ["check", str(cfg), "--json"]).stdout)
    assert checked["device_total_bytes"] == total
