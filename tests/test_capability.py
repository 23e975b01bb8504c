"""What a GPU cannot run is refused or warned about, never counted silently.

Sources: the V100 and T4 profiles' `bf16_supported: false` (NVIDIA: BF16 needs compute
capability 8.0; shared/reference/hardware.yaml); PyTorch SDPA takes bf16 in its fused kernels
only from sm80 on (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
`can_use_mem_efficient_attention`: fp16 and fp32 before sm80), so bf16 attention there runs
the math kernel with its s x s scores; FlashAttention-2 runs on Ampere, Ada and Hopper only
(Dao-AILab/flash-attention README). Trained context: Meta-Llama-3-8B's config.json,
max_position_embeddings 8192; GPT-2's learned position table has n_positions 1024 rows
(config.json of openai-community/gpt2).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from vramcalc.cli import app, main

runner = CliRunner()


def _json(*args: str) -> dict:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("gpu", ["8xV100", "8xV100-16GB", "8xT4"])
@pytest.mark.parametrize("precision", ["bf16", "amp-bf16", "bf16-pure"])
def test_bf16_with_flash_is_refused_where_the_gpu_has_no_bf16(gpu: str, precision: str,
                                                              capsys) -> None:
    for command in ("estimate", "explain"):
        assert main([command, "--model", "8b", "--gpus", gpu, "--zero", "3",
                     "--precision", precision]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        assert "BF16" in lines[0] and "amp-fp16" in lines[0]


def test_fp16_flash_on_v100_warns_that_flashattention2_does_not_run() -> None:
    doc = _json("estimate", "--model", "8b", "--gpus", "8xV100", "--zero", "3",
                "--precision", "amp-fp16")
    warn = [n for n in doc["notes"] if n.startswith("warning:")]
    assert any("FlashAttention-2" in n and "memory-efficient" in n for n in warn), doc["notes"]
    # an Ampere GPU runs FlashAttention-2: no such warning
    doc = _json("estimate", "--model", "8b", "--gpus", "8xA100", "--zero", "3")
    assert not [n for n in doc["notes"] if n.startswith("warning:")], doc["notes"]


def test_bf16_eager_on_t4_is_counted_with_a_warning() -> None:
    doc = _json("estimate", "--model", "gpt2", "--gpus", "1xT4", "--precision", "bf16",
                "--attention", "eager", "--seq-len", "512", "--finetune", "qlora")
    assert any(n.startswith("warning:") and "BF16" in n for n in doc["notes"]), doc["notes"]


def test_plan_never_suggests_a_gpu_without_bf16_for_a_bf16_flash_job() -> None:
    # LoRA on one 24 GB card does not fit at 8k tokens; V100 32GB has more memory but no BF16
    doc = _json("plan", "--model", "8b", "--gpus", "1xRTX4090", "--finetune", "lora",
                "--seq-len", "8192")
    others = [s["gpu"] for s in doc["suggestions"] if s["kind"] == "other_gpu"]
    assert others, doc["suggestions"]
    assert not any(g.startswith(("v100", "t4")) for g in others), others


def test_plan_on_v100_refuses_bf16_flash_unless_precision_may_change(capsys) -> None:
    assert main(["plan", "--model", "8b", "--gpus", "8xV100", "--finetune", "lora"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--allow precision" in err
    doc = _json("plan", "--model", "8b", "--gpus", "8xV100", "--finetune", "lora",
                "--allow", "precision")
    precisions = {c["strategy"]["precision"] for c in doc["candidates"]}
    assert precisions and not any("bf16" in p for p in precisions), precisions


def test_size_says_why_a_gpu_without_bf16_has_no_row() -> None:
    doc = _json("size", "--model", "8b", "--tokens", "100B", "--gpu", "V100", "--gpu", "A100")
    rows = {r["gpu"]: r for r in doc["rows"]}
    assert rows["v100_32gb"]["num_gpus"] is None
    assert any("BF16" in n for n in rows["v100_32gb"]["notes"])
    assert rows["a100_80gb"]["num_gpus"]


def test_sequence_past_the_trained_context_warns() -> None:
    doc = _json("estimate", "--model", "llama3-8b", "--gpus", "8xH100", "--zero", "3",
                "--seq-len", "16384")
    assert any(n.startswith("warning:") and "8,192" in n for n in doc["notes"]), doc["notes"]
    doc = _json("estimate", "--model", "llama3-8b", "--gpus", "8xH100", "--zero", "3",
                "--seq-len", "8192")
    assert not any("trained context" in n for n in doc["notes"])


def test_sequence_past_a_learned_position_table_warns() -> None:
    doc = _json("estimate", "--model", "gpt2", "--gpus", "1xH100", "--seq-len", "2048")
    assert any(n.startswith("warning:") and "1,024 rows" in n for n in doc["notes"])
    doc = _json("estimate", "--model", "gpt2", "--gpus", "1xH100", "--seq-len", "1024")
    assert not any(n.startswith("warning:") for n in doc["notes"]), doc["notes"]


@pytest.mark.parametrize(("model", "tokens"), [
    # n_positions 1024 (openai-community/gpt2 config.json); max_position_embeddings 512
    # (google-bert/bert-large-uncased); 514 rows less RoBERTa's two (FacebookAI/roberta-base,
    # positions numbered from padding_idx + 1); 1024 (facebook/bart-large)
    ("gpt2", 1024), ("bert-large", 512), ("roberta-base", 512), ("bart-large", 1024)])
def test_default_sequence_is_the_learned_position_table_where_shorter(model: str,
                                                                     tokens: int) -> None:
    doc = _json("estimate", "--model", model, "--gpus", "1xH100", "--framework", "hf")
    assert doc["strategy"]["seq_len"] == tokens
    assert any(n.startswith(f"seq {tokens:,}: ") and "learned positions" in n
               for n in doc["notes"]), doc["notes"]
    assert not any(n.startswith("warning:") for n in doc["notes"]), doc["notes"]
    # a length the user gives is counted as given; RoPE models keep the 4,096 default
    doc = _json("estimate", "--model", model, "--gpus", "1xH100", "--framework", "hf",
                "--seq-len", "256")
    assert doc["strategy"]["seq_len"] == 256
    assert not any("learned positions cover" in n for n in doc["notes"]), doc["notes"]
    assert _json("estimate", "--model", "llama3-8b", "--gpus", "1xH100")["strategy"][
        "seq_len"] == 4096
