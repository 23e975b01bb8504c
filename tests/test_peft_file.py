"""--peft-config: any PEFT method from its adapter config, traced with PEFT's own modules
(vramcalc/peft_file.py, vramcalc/trace/lora.py `peft_from_file`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramcalc.cli import main
from vramcalc.units import ALLOC_ROUND_BYTES, alloc

# validate's llama-gqa shape: h 1024, 2 layers, 16 heads of 64, 4 KV heads, f 2816
H, L, KV, F = 1024, 2, 4 * 64, 2816


def _write(tmp_path: Path, doc: object, name: str = "adapter_config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc), encoding="utf-8")
    return str(path)


def _trace(config: str, **kw: object):  # noqa: ANN202
    pytest.importorskip("peft")
    from vramcalc.trace.engine import trace
    from vramcalc.validate import scenario_for

    _, scn = scenario_for("llama-gqa", framework="hf", finetune="peft", peft_config=config,
                          seq_len=256, **kw)
    return trace(scn)


def test_ia3_trains_peft_s_scaling_vectors(tmp_path: Path) -> None:
    """IA3 on k_proj, v_proj and down_proj (feedforward): PEFT's ia3/layer.py gives each
    target one vector, (out, 1) on an attention output and (1, in) on a feedforward input,
    upcast to fp32 (`autocast_adapter_dtype=True`). The trace's gradients and AdamW states
    are those vectors and nothing of the frozen base: 2 layers x (256 + 256 + 2816)
    fp32 values, each tensor a block of its own."""
    cfg = _write(tmp_path, {"peft_type": "IA3", "task_type": "CAUSAL_LM",
                            "target_modules": ["k_proj", "v_proj", "down_proj"],
                            "feedforward_modules": ["down_proj"]})
    res = _trace(cfg)
    vectors = L * (2 * alloc(KV, "fp32") + alloc(F, "fp32"))
    step = res.phases["optimizer"].parts
    assert step["gradients"] == vectors
    # AdamW fused (the hf profile's): exp_avg, exp_avg_sq and a 0-dim step tensor on the
    # device per parameter (torch/optim/adam.py `_init_group`, fused or capturable)
    assert step["optimizer_states/states"] == 2 * vectors + 3 * L * ALLOC_ROUND_BYTES


def test_prompt_tuning_trains_the_virtual_token_embeddings(tmp_path: Path) -> None:
    """Prompt tuning: PEFT's PromptEmbedding is an nn.Embedding of (virtual tokens,
    token_dim) in fp32; its gradient is all that trains, and the virtual tokens lengthen
    every sequence, so more of them keep more activations."""
    def prompt(n: int) -> str:
        return _write(tmp_path, {"peft_type": "PROMPT_TUNING", "task_type": "CAUSAL_LM",
                                 "num_virtual_tokens": n, "token_dim": H,
                                 "num_transformer_submodules": 1}, f"p{n}.json")

    short, long = _trace(prompt(20)), _trace(prompt(200))
    assert short.phases["optimizer"].parts["gradients"] == alloc(20 * H, "fp32")
    assert long.phases["optimizer"].parts["gradients"] == alloc(200 * H, "fp32")
    assert (long.phases["forward"].terms()["activations"]
            > short.phases["forward"].terms()["activations"])


def test_a_folder_holding_adapter_config_json_is_read(tmp_path: Path) -> None:
    _write(tmp_path, {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4,
                      "target_modules": ["q_proj"]})
    res = _trace(str(tmp_path))
    # one LoRA A (4 x 1024) and B (1024 x 4) per layer, fp32
    assert res.phases["optimizer"].parts["gradients"] == L * 2 * alloc(4 * H, "fp32")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


BASE = ["--model", "llama3.2-1b", "--framework", "hf", "--seq-len", "64"]


@pytest.mark.parametrize("command", ["estimate", "explain", "plan"])
def test_the_analytic_commands_point_to_the_trace(command: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _write(tmp_path, {"peft_type": "IA3"})
    code, err = _run([command, *BASE, "--peft-config", cfg], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "vramcalc trace" in lines[0]


@pytest.mark.parametrize(("doc", "flags", "says"), [
    (None, [], "not found"),
    ([1], [], "JSON object"),
    ({"r": 8}, [], "peft_type"),
    ({"peft_type": "NOPE"}, [], "no method"),
    ({"peft_type": "LORA", "target_modules": ["nothing_here"]}, [], "cannot apply"),
    ({"peft_type": "IA3"}, ["--framework", "torchtune"], "--framework hf"),
])
def test_bad_peft_configs_get_one_error_line(doc: object, flags: list[str], says: str,
                                             tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("peft")
    cfg = str(tmp_path / "missing.json") if doc is None else _write(tmp_path, doc)
    argv = ["trace", *BASE, *flags, "--peft-config", cfg]
    code, err = _run(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], lines


def test_finetune_peft_needs_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(["trace", *BASE, "--finetune", "peft"], capsys)
    assert code == 2 and "--peft-config" in err


def test_methods_that_need_tensor_values_get_one_error_line(tmp_path: Path) -> None:
    """FROD and SHiRA (`nonzero`), UniLoRA (`bincount`) compute shapes from tensor values,
    VB-LoRA checks them (`isinf(...).any()`): under --peft-config these end as an
    InputError naming the method; for the built-in methods they stay torch's own errors."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    from vramcalc.errors import InputError
    from vramcalc.trace.lora import peft_trace_limits

    cfg = _write(tmp_path, {"peft_type": "SHIRA"})
    peft = SimpleNamespace(finetune="peft", peft_config=cfg)
    with pytest.raises(InputError, match="SHIRA computes shapes from tensor values"):
        with peft_trace_limits(peft):
            raise DynamicOutputShapeException(torch.ops.aten.nonzero.default)
    with pytest.raises(InputError, match="could not run on fake tensors"):
        with peft_trace_limits(peft):
            raise RuntimeError("Found infinity values")
    with pytest.raises(DynamicOutputShapeException):
        with peft_trace_limits(SimpleNamespace(finetune="lora", peft_config=None)):
            raise DynamicOutputShapeException(torch.ops.aten.nonzero.default)


def test_a_lora_config_file_traces_as_finetune_lora(tmp_path: Path) -> None:
    """A LoRA adapter config gives the trace that --finetune lora gives (both build PEFT's
    LoraConfig), which the analytic engine's LoRA model matches: the file path adds no
    memory of its own."""
    pytest.importorskip("peft")
    from vramcalc.analytic import estimate
    from vramcalc.trace.engine import trace
    from vramcalc.validate import scenario_for

    cfg = _write(tmp_path, {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8,
                            "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                            "lora_dropout": 0.0})
    from_file = _trace(cfg)
    _, scn = scenario_for("llama-gqa", framework="hf", finetune="lora", lora_rank=8,
                          lora_targets="q,v", seq_len=256)
    flags = trace(scn)
    assert {p: s.total for p, s in from_file.phases.items()} == {
        p: s.total for p, s in flags.phases.items()}
    ana = estimate(scn).peak_allocated_bytes
    assert abs(ana / from_file.report.peak_allocated_bytes - 1) < 0.01


def test_probe_compares_a_peft_config_run_with_the_trace(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """`probe --device cpu` (the dry run) of a --peft-config scenario: the record holds the
    trace's comparison and no analytic one; validate --records leaves it out and says why."""
    pytest.importorskip("peft")
    cfg = _write(tmp_path, {"peft_type": "IA3", "task_type": "CAUSAL_LM",
                            "target_modules": ["k_proj", "v_proj", "down_proj"],
                            "feedforward_modules": ["down_proj"]})
    out, model = tmp_path / "records", tmp_path / "model"
    model.mkdir()  # a small Llama (transformers' config.json keys)
    _write(model, {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100},
           "config.json")
    code = main(["probe", "--model", str(model), "--framework", "hf", "--seq-len", "32",
                 "--peft-config", cfg, "--device", "cpu", "--out", str(out), "--json"])
    rec = json.loads(capsys.readouterr().out)
    assert code == 0 and rec["status"] == "ok" and rec["analytic"] is None
    assert rec["trace"]["peak_allocated_bytes"] == rec["measured"]["max_memory_allocated_bytes"]
    code, err = _run(["validate", "--records", str(out)], capsys)
    assert code == 2 and "--peft-config" in err and err.count("\n") == 1
