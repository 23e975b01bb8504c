"""Fine-tuning under the trace engine: PEFT's own parameter counts, the NF4 stand-in's
storage layout, and the analytic engine against traces of LoRA/QLoRA/DoRA steps (the
agreement over vramcalc/validate/grid.py's grid runs in tests/test_trace.py).

Expected values: PEFT (`get_peft_model`) counts its adapters itself; the NF4 layout is
bitsandbytes' (functional.quantize_4bit with compress_statistics=True, 0.50.1): uint8
codes two per byte, a uint8 absmax per 64 values, an fp32 absmax per 256 of those, a
256-entry fp32 code copy, a 0-dim fp32 offset and a 16-entry fp32 NF4 table per weight.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from typer.testing import CliRunner  # noqa: E402

from vramcalc.catalog import resolve_model  # noqa: E402
from vramcalc.cli import app  # noqa: E402
from vramcalc.finetune import shapes_for  # noqa: E402
from vramcalc.parallel import ParallelConfig  # noqa: E402
from vramcalc.rank import RankContext  # noqa: E402
from vramcalc.scenario import Scenario  # noqa: E402
from vramcalc.training import TrainingConfig  # noqa: E402
from vramcalc.validate import SHAPES, compare  # noqa: E402

runner = CliRunner()


@pytest.mark.parametrize("targets,rank", [("q,v", 8), ("all-linear", 16), ("k,o,down", 4)])
def test_peft_counts_the_same_adapters(targets: str, rank: int) -> None:
    """PEFT's LoRA on transformers' Llama-2-7B (meta device: no memory) has exactly the
    analytic engine's trainable parameters."""
    from vramcalc.trace.hf_models import to_hf_config
    from vramcalc.trace.lora import _PEFT_NAMES

    spec, _ = resolve_model("llama2-7b")
    tr = TrainingConfig(finetune="lora", lora_rank=rank, lora_targets=targets, framework="hf")
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(to_hf_config(spec))
    names = ([_PEFT_NAMES[t] for t in ("q", "k", "v", "o", "gate", "up", "down")]
             if targets == "all-linear" else [_PEFT_NAMES[t] for t in targets.split(",")])
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules=names))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    fs = shapes_for(RankContext(spec, tr, ParallelConfig(dp=1)))
    assert trainable == fs.adapters.numel()
    assert frozen == fs.frozen.numel() == spec.num_params
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(("model", "targets", "peft_targets", "rank"), [
    ("gpt2", "q,v", ["c_attn"], 8),  # PEFT's default for GPT-2
    ("gpt2", "all-linear", "all-linear", 16),  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    ("gpt2", "k,down", ["c_attn", "mlp.c_proj"], 4),
    ("phi3-mini", "q,v", ["qkv_proj"], 8),  # PEFT's default for Phi-3
    ("phi3-mini", "all-linear", "all-linear", 8),
    ("phi3-mini", "up,o", ["gate_up_proj", "o_proj"], 4),
])
def test_peft_counts_fused_adapters(model: str, targets: str, peft_targets: object,
                                    rank: int) -> None:
    """GPT-2 and Phi-3 fuse q, k, v (and Phi-3 gate, up) into one module; PEFT adapts the
    module it is given, one adapter each, and the hf profile maps any of the member targets
    onto it. PEFT's own count (its "all-linear" keyword included) on the meta device."""
    from vramcalc.trace.hf_models import to_hf_config

    spec, _ = resolve_model(model)
    tr = TrainingConfig(finetune="lora", lora_rank=rank, lora_targets=targets, framework="hf")
    import transformers

    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(to_hf_config(spec))
    hf = peft.get_peft_model(hf, peft.LoraConfig(r=rank, target_modules=peft_targets))
    trainable = sum(p.numel() for p in hf.parameters() if p.requires_grad)
    fs = shapes_for(RankContext(spec, tr, ParallelConfig(dp=1)))
    assert trainable == fs.adapters.numel()


def test_nf4_stand_in_has_bitsandbytes_storage() -> None:
    from vramcalc.trace.nf4 import NF4Linear

    out_f, in_f = 11008, 4096
    lin = NF4Linear(in_f, out_f, dtype=torch.bfloat16, device="meta")
    n = out_f * in_f
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in lin.named_parameters()}
    assert shapes == {
        "weight": (((n + 1) // 2, 1), torch.uint8),
        "absmax": ((n // 64,), torch.uint8),
        "state2_absmax": ((n // 64 // 256,), torch.float32),
        "state2_code": ((256,), torch.float32),
        "offset": ((), torch.float32),
        "code": ((16,), torch.float32),
    }
    assert not any(p.requires_grad for p in lin.parameters())


def test_qlora_trace_weights_match_the_analytic_layout() -> None:
    scn = Scenario(model=SHAPES["llama-gqa"],
                   training=TrainingConfig(finetune="qlora", seq_len=256,
                                           lora_targets="all-linear"))
    row = compare("qlora-weights", scn)
    assert row["ok"], row
    assert row["terms"]["weights"]["rel_error"] == 0


def test_trace_cli_runs_lora() -> None:
    result = runner.invoke(app, ["trace", "--model", "gpt2",
                                 "--finetune", "lora", "--lora-targets", "all-linear",
                                 "--seq-len", "128", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["engine"] == "trace" and doc["strategy"]["finetune"] == "lora"
    assert doc["terms"]["gradients"] < doc["terms"]["weights"] / 100
