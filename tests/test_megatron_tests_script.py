"""benchmarks/megatron_tests.py on a small Megatron-LM-shaped tree made here.

Structure only: how a test case's MODEL_ARGS and recipe become flags, and which cases are
left out. The expected shapes are Megatron-LM's own rules (d98e8a64), not the script's
output: `_NullTokenizer.vocab_size` is the given size + 1 (its eod id);
`_vocab_size_with_padding` rounds up to make-vocab-size-divisible-by x TP; a SwiGLU MLP
without --ffn-hidden-size is int(4h·2/3 / 64)·64 wide; `validate_args` drops sequence
parallelism without tensor parallelism.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def sweep() -> Any:
    sys.path.insert(0, str(BENCH))  # the script imports its sibling calibration.py
    spec = importlib.util.spec_from_file_location("megatron_tests_script",
                                                  BENCH / "megatron_tests.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


ARGS = {"--num-layers": 4, "--hidden-size": 256, "--num-attention-heads": 4,
        "--micro-batch-size": 2, "--global-batch-size": 16, "--seq-length": 512,
        "--max-position-embeddings": 512, "--train-iters": 10, "--bf16": True,
        "--tensor-model-parallel-size": 2, "--tokenizer-type": "NullTokenizer",
        "--vocab-size": 1000, "--swiglu": True, "--sequence-parallel": True,
        "--use-distributed-optimizer": True, "--log-interval": 1, "--lr": 1e-4}


def _tree(root: Path, name: str, args: dict[str, Any], peak: int = 3 * 2**30,
          gpus: int = 8) -> None:
    case = root / "tests/functional_tests/test_cases/gpt" / name
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text(yaml.safe_dump({"MODEL_ARGS": args}))
    golden = {"mem-max-allocated-bytes": {"values": {"1": peak - 2**20, "2": peak}}}
    (case / "golden_values_dev_dgx_h100.json").write_text(json.dumps(golden))
    recipes = root / "tests/test_utils/recipes/h100"
    recipes.mkdir(parents=True, exist_ok=True)
    (recipes / f"{name}.yaml").write_text(yaml.safe_dump(
        {"spec": {"nodes": 1, "gpus": gpus}, "products": [{"test_case": [name]}]}))


def test_a_case_becomes_flags_by_megatrons_rules(sweep: Any, tmp_path: Path) -> None:
    _tree(tmp_path, "gpt3_fake_tp2", ARGS, gpus=4)
    [(name, where, m)] = sweep.cases(tmp_path)
    assert (name, where) == ("gpt3_fake_tp2", "dev_dgx_h100")
    assert m.flags["gpus"] == "4xH100" and m.flags["tp"] == 2 and m.flags["zero"] == 1
    assert m.flags["grad_accum"] == 16 // (2 * 2)  # global / (micro x dp 2)
    assert m.flags["sequence_parallel"] is True
    assert m.model_fields["vocab_size"] == 1024  # 1001 rounded up to 128 x 2
    assert m.model_fields["intermediate_size"] == int(4 * 256 * 2 / 3 / 64) * 64 == 640
    assert m.measured_bytes == 3 * 2**30
    assert sweep.AUTO in m.notes  # TE picks the attention backend at run time


def test_sequence_parallel_goes_without_tensor_parallel(sweep: Any, tmp_path: Path) -> None:
    _tree(tmp_path, "gpt3_fake_tp1", {**ARGS, "--tensor-model-parallel-size": 1})
    [(_, _, m)] = sweep.cases(tmp_path)
    assert not m.flags.get("sequence_parallel")


def test_unmapped_and_unknown_cases_are_left_out_with_the_reason(sweep: Any,
                                                                 tmp_path: Path) -> None:
    _tree(tmp_path, "gpt3_fake_relu2", {**ARGS, "--squared-relu": True})
    _tree(tmp_path, "gpt3_fake_hf", {**ARGS, "--tokenizer-type": "HuggingFaceTokenizer"})
    found = {name: m for name, _, m in sweep.cases(tmp_path)}
    assert found["gpt3_fake_relu2"] == "not mapped: --squared-relu"
    assert "vocabulary" in found["gpt3_fake_hf"]


def test_optimizer_instances_and_loss_fusion_map_to_flags(sweep: Any, tmp_path: Path) -> None:
    _tree(tmp_path, "gpt3_fake_inst", {**ARGS, "--num-distributed-optimizer-instances": 2,
                                       "--cross-entropy-loss-fusion": True})
    [(_, _, m)] = sweep.cases(tmp_path)
    assert m.flags["shard_group"] == 4 // 2  # dp 4 (8 GPUs / tp 2), two instances
    assert m.flags["cross_entropy_loss_fusion"] is True
    rows, skipped = sweep.run(tmp_path)
    assert not skipped and len(rows["gpt3_fake_inst"]) == 1
