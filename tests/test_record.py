"""Frozen records (vramcalc/record.py): validated construction through pydantic, trusted
construction, copies, value semantics, and the validated-file cache (vramcalc/yamlio.py)
that lets a warm run skip pydantic."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from pydantic import ValidationError

from vramcalc import yamlio
from vramcalc.catalog import get_preset
from vramcalc.errors import InputError
from vramcalc.hardware import GPUProfile, resolve_gpu
from vramcalc.model import ModelSpec
from vramcalc.options import build_scenario
from vramcalc.parallel import ParallelConfig
from vramcalc.record import bound_violation
from vramcalc.report import Terms
from vramcalc.training import TrainingConfig

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 100}


# ---- validated construction ---------------------------------------------------------
@pytest.mark.parametrize("values", [
    {"seq_len": 0}, {"seq_len": -3}, {"micro_batch_size": 10**9}, {"precision": "bf17"},
    {"lora_dropout": 1.0}, {"recompute": "some"}, {"seq_lenn": 4}, {"seq_len": "many"},
])
def test_training_config_rejects_bad_values(values: dict) -> None:
    with pytest.raises(ValidationError):
        TrainingConfig(**values)


def test_validation_coerces_like_pydantic() -> None:
    tr = TrainingConfig(seq_len="2048", lora_targets="V, q")
    assert tr.seq_len == 2048 and tr.lora_targets == "q,v"
    par = ParallelConfig(offload=["optimizer"])
    assert par.offload == ("optimizer",)


def test_the_validating_pydantic_model_is_derived_from_the_declarations() -> None:
    props = TrainingConfig.pydantic_model().model_json_schema()["properties"]
    assert props["seq_len"]["exclusiveMinimum"] == 0
    assert props["seq_len"]["maximum"] == 100_000_000
    assert set(props["recompute"]["enum"]) == {"none", "selective", "full"}
    assert set(props) == set(TrainingConfig.model_fields)


def test_model_spec_checks_shapes_after_the_fields() -> None:
    with pytest.raises(InputError, match="not divisible"):
        ModelSpec(**{**TINY, "num_key_value_heads": 3})
    with pytest.raises(ValidationError, match="extra"):
        ModelSpec(**TINY, hidden_sise=64)


def test_nested_records_accept_instances_or_mappings() -> None:
    from vramcalc.scenario import Scenario

    spec = ModelSpec(**TINY)
    a = Scenario(model=spec)
    b = Scenario(model=TINY, training={"seq_len": 64})
    assert a.model == b.model and b.training.seq_len == 64
    with pytest.raises(ValueError, match="expected a ModelSpec"):
        Scenario(model="gpt2")


def test_gpu_profile_cross_checks() -> None:
    data = resolve_gpu("H100").model_dump()
    with pytest.raises(ValueError, match="unknown dtype"):
        GPUProfile(**{**data, "dense_tflops": {"bf16": 989.0, "int3": 1.0}})
    with pytest.raises(ValueError, match="context_overhead_bytes"):
        GPUProfile(**{**data, "context_overhead_bytes": data["memory_total_bytes"]})
    assert GPUProfile(**{**data, "dense_tflops": {**data["dense_tflops"], "fp8": None}}
                      ).peak_tflops("fp8") is None


# ---- trusted construction, copies, value semantics ----------------------------------
def test_construct_and_copy_do_not_validate_but_fill_defaults() -> None:
    tr = TrainingConfig.model_construct(seq_len=0)
    assert tr.seq_len == 0 and tr.precision == "bf16"
    assert tr.model_copy(update={"seq_len": 5}).seq_len == 5
    with pytest.raises(TypeError):
        tr.model_copy(update={"seq_lenn": 5})


def test_equal_values_are_equal_and_hash_alike() -> None:
    a = TrainingConfig(seq_len=128)
    b = TrainingConfig.model_construct(seq_len=128)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != a.model_copy(update={"seq_len": 256})
    assert TrainingConfig() != ParallelConfig()


def test_frozen_and_pickled_without_the_cached_hash() -> None:
    spec = get_preset("llama3-8b").spec
    hash(spec)
    with pytest.raises(AttributeError, match="frozen"):
        spec.hidden_size = 1  # type: ignore[misc]
    back = pickle.loads(pickle.dumps(spec))
    assert "_record_hash" not in back.__dict__ and back == spec
    assert back.num_params == spec.num_params == 8_030_261_248


def test_dump_round_trip() -> None:
    scn = build_scenario({"model": "8b", "gpus": "8xH100", "offload": "optimizer", "zero": 2})
    dumped = scn.parallel.model_dump(mode="json")
    assert dumped["offload"] == ["optimizer"]
    assert ParallelConfig.from_dump(dumped) == scn.parallel
    assert scn.model_dump()["model"]["hidden_size"] == 4096
    assert Terms(weights=1).model_dump()["overhead"] == 0


def test_bound_violation_words() -> None:
    info = TrainingConfig.model_fields["seq_len"]
    assert bound_violation(info, 0) == "Input should be greater than 0"
    assert bound_violation(info, 4096) is None and bound_violation(info, None) is None
    assert "less than or equal to 3" in bound_violation(ParallelConfig.model_fields["zero"], 4)
    with pytest.raises(InputError, match="--zero: Input should be less than or equal to 3"):
        build_scenario({"model": "8b", "gpus": "8xH100", "zero": 4})


# ---- the validated-file cache --------------------------------------------------------
@pytest.fixture
def training_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """(a YAML file, its converter that validates a TrainingConfig and records its calls)."""
    monkeypatch.setenv("VRAMCALC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(yamlio, "_CACHES", {})
    calls: list[Path] = []

    def convert(data: dict, path: Path) -> dict:
        calls.append(path)
        return TrainingConfig(**data).model_dump(mode="json")

    convert.calls = calls  # type: ignore[attr-defined]
    return tmp_path / "x.yaml", convert


def test_cache_keeps_converted_data_and_revalidates_when_the_code_changes(
        training_file: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    f, convert = training_file
    f.write_text("seq_len: 128\n")
    first = yamlio.load_file(f, convert, key="v1")
    monkeypatch.setattr(yamlio, "_CACHES", {})  # a new process
    assert yamlio.load_file(f, convert, key="v1") == first and len(convert.calls) == 1
    monkeypatch.setattr(yamlio, "_CACHES", {})
    assert yamlio.load_file(f, convert, key="v2") == first and len(convert.calls) == 2
    assert TrainingConfig.from_dump(first) == TrainingConfig(seq_len=128)


def test_a_file_that_fails_validation_is_never_cached(
        training_file: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    f, convert = training_file
    f.write_text("seq_len: 0\n")
    for _ in range(2):
        monkeypatch.setattr(yamlio, "_CACHES", {})
        with pytest.raises(ValidationError):
            yamlio.load_file(f, convert, key="v1")
    assert len(convert.calls) == 2


def test_code_key_follows_the_module_files() -> None:
    key = yamlio.code_key("vramcalc.record", "vramcalc.model")
    assert key.startswith("vramcalc.record:") and ";vramcalc.model:" in key
    assert yamlio.code_key("no.such.module") == "no.such.module"
