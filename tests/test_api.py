"""The public Python API (docs/api.md): the names in `vramcalc.__all__`, the examples of
docs/api.md run as written, and the API agreeing with the CLI it mirrors.

This module imports nothing from vramcalc but the package's public names (the CLI it is
compared with runs in a subprocess).
Independent figures: Meta-Llama-3-8B has 8,030,261,248 parameters and Meta-Llama-3-70B
70,553,706,496 (the sums of the tensor shapes in the models' safetensors index, as
transformers' numel counts them; model cards: 8B and 70B).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import vramcalc

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_8B_PARAMS = 8_030_261_248
LLAMA3_70B_PARAMS = 70_553_706_496


def _examples() -> list[str]:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _run_example(code: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "docs_api_example"}
    exec(compile(code, "docs/api.md", "exec"), namespace)  # noqa: S102 - our own docs
    for name, value in list(namespace.items()):  # the pytest example defines tests: run them
        if name.startswith("test_") and callable(value):
            value()
    return namespace


# ---- docs/api.md -----------------------------------------------------------------------------
def test_docs_have_the_three_examples() -> None:
    codes = _examples()
    assert len(codes) >= 3
    assert any("def test_" in c for c in codes)  # the pytest assertion in a user's repository
    assert any("for seq_len in" in c for c in codes)  # the sweep


@pytest.mark.parametrize("index", range(len(_examples())))
def test_docs_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    namespace = _run_example(_examples()[index])
    out = capsys.readouterr().out
    assert out or any(k.startswith("test_") for k in namespace)
    if "longest" in namespace:  # the sweep: 4k on 8 x H100 with ZeRO-3 fits (test below)
        assert namespace["longest"] is not None and namespace["longest"] >= 4096


def test_docs_list_every_public_name() -> None:
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    for name in vramcalc.__all__:
        assert f"`{name}" in text or f"`vramcalc.{name}(" in text, name


# ---- the public names ------------------------------------------------------------------------
def test_all_names_resolve() -> None:
    for name in vramcalc.__all__:
        assert getattr(vramcalc, name) is not None
        assert name in dir(vramcalc)
    with pytest.raises(AttributeError):
        vramcalc.no_such_name  # noqa: B018


def test_import_is_lazy_and_never_imports_torch() -> None:
    code = ("import sys, vramcalc\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('vramcalc'))\n"
            "r = vramcalc.estimate('llama3-8b', '8xH100')\n"
            "p = vramcalc.plan('llama3-8b', '8xH100', top=1)\n"
            "print(loaded, 'torch' in sys.modules, 'typer' in sys.modules, 'rich' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=120).stdout.strip()
    assert out == "['vramcalc'] False False False"


def test_load_model_counts_published_parameters(tmp_path: Path) -> None:
    assert vramcalc.load_model("llama3-8b").num_params == LLAMA3_8B_PARAMS
    assert vramcalc.load_model("70b").num_params == LLAMA3_70B_PARAMS
    assert vramcalc.load_model("meta-llama/Meta-Llama-3-8B").num_params == LLAMA3_8B_PARAMS
    # a local config.json: Meta-Llama-3-8B's shapes (its config.json on the hub)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    assert isinstance(vramcalc.load_model(tmp_path), vramcalc.ModelSpec)
    assert vramcalc.load_model(tmp_path).num_params == LLAMA3_8B_PARAMS
    with pytest.raises(vramcalc.InputError, match="unknown model"):
        vramcalc.load_model("llama3-9b")


def test_estimate_weights_by_hand() -> None:
    # bf16 weights: 2 bytes per parameter, unsharded under ZeRO-1; ZeRO-3 on 8 GPUs shards
    # them ÷8 (DeepSpeed keeps parameters under stage3_param_persistence_threshold, the norm
    # weights, whole: at most 0.1% more here)
    r1 = vramcalc.estimate("llama3-8b", "8xH100", zero=1)
    r3 = vramcalc.estimate("llama3-8b", "8xH100", zero=3)
    assert isinstance(r1, vramcalc.MemoryReport)
    assert r1.terms.weights == 2 * LLAMA3_8B_PARAMS
    assert 2 * LLAMA3_8B_PARAMS / 8 <= r3.terms.weights < 2 * LLAMA3_8B_PARAMS / 8 * 1.001
    # 70B in bf16 is 141 GB of weights: no 80 GB H100 holds it alone
    assert vramcalc.estimate("70b", "1xH100").fits is False


def test_estimate_equals_the_cli_json() -> None:
    options = {"seq_len": 8192, "zero": 3, "recompute": "selective", "offload": "optimizer",
               "micro_batch_size": 2, "sequence_parallel": True, "tp": 2}
    flags = ["--seq-len", "8192", "--zero", "3", "--recompute", "selective", "--offload",
             "optimizer", "--micro-batch-size", "2", "--sequence-parallel", "--tp", "2"]
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "vramcalc", "estimate", "--model", "70b",
                           "--gpus", "2x8xH100", *flags, "--json"], capture_output=True,
                          text=True, check=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": pythonpath})
    doc = json.loads(proc.stdout)
    api = vramcalc.estimate("70b", "2x8xH100", **options).to_json_dict()
    assert {k: v for k, v in doc.items() if k in api} == api


def test_plan_entries_fit_and_are_ranked() -> None:
    result = vramcalc.plan("70b", "64xH100", top=4, allow=["precision"])
    assert isinstance(result, vramcalc.PlanResult) and result.fits
    assert 1 <= len(result.entries) <= 4
    speeds = [e.speed.tokens_per_s for e in result.entries]
    assert speeds == sorted(speeds, reverse=True)
    for entry in result.entries:
        assert isinstance(entry, vramcalc.PlanEntry)
        assert entry.report.fits and entry.report.device_total_bytes <= entry.usable_bytes
        s = entry.report.strategy  # every layout uses the 64 GPUs (dense model: ep = 1)
        assert s["dp"] * s["tp"] * s["pp"] * s["cp"] == 64
    # nothing fits 70B on one 80 GB GPU without the settings held fixed: the closest is given
    none = vramcalc.plan("70b", "1xH100")
    assert not none.fits and none.entries == [] and none.closest is not None


def test_plan_pins_what_is_given() -> None:
    result = vramcalc.plan("llama3-8b", "8xH100", tp=2, zero=3, top=3)
    assert result.entries
    assert all(e.report.strategy["tp"] == 2 and e.report.strategy["zero"] == 3
               for e in result.entries)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: vramcalc.estimate("llama3-8b", "8xH100", zero=7), "--zero"),
    (lambda: vramcalc.estimate("llama3-8b", "8xH100", precision="bf17"), "did you mean"),
    (lambda: vramcalc.estimate("llama3-8b", "8xH100", tp=3), "tp"),
    (lambda: vramcalc.plan("llama3-8b", "8xH100", allow="colour"), "--allow"),
    (lambda: vramcalc.plan("llama3-8b", "8xH100x"), "unknown GPU"),
])
def test_bad_input_raises_input_error(call: Any, message: str) -> None:
    with pytest.raises(vramcalc.InputError, match=re.escape(message)):
        call()
    with pytest.raises(ValueError):  # InputError is a ValueError
        call()
