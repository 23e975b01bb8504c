"""`--adapters-16bit` (hf profile): the adapters stay in the model's 16-bit dtype.

Two stacks do this, and the expected values come from their source, not from vramcalc:
- PEFT 0.21.2 `get_peft_model(..., autocast_adapter_dtype=False)`: a LoRA layer is made and
  then moved to its base weight's dtype (`_move_adapter_to_device_of_base_layer`), and the
  default `True` upcasts 16-bit adapters to fp32 (`tuners_utils.py` `cast_adapter_dtype`);
- TRL's SFTTrainer on a 4-bit model (huggingface/trl f2cd5771 `sft_trainer.py`:
  `if _is_quantized_model: for p in model.parameters(): if p.requires_grad: p.data =
  p.data.to(torch.bfloat16)`), since PEFT leaves a 4-bit linear's adapters in fp32.
With the adapters in the activations' dtype PEFT's `_cast_input_dtype` copies nothing, and
under autocast neither the adapters nor their inputs are cast. Llama-3.1-8B with rank-16
adapters on every linear trains 41,943,040 parameters (16 x (q 4096+4096, k and v
4096+1024, o 4096+4096, gate and up 4096+14336, down 14336+4096) x 32 layers), the count
PEFT's `print_trainable_parameters` reports for it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from vramcalc.analytic import estimate
from vramcalc.options import build_scenario
from vramcalc.validate import scenario_for

N_ADAPTER = 16 * (8192 + 5120 + 5120 + 8192 + 3 * 18432) * 32


def _scn(**kw: object):  # noqa: ANN202
    values = {"model": "llama3.1-8b", "gpus": "1xH100", "framework": "hf",
              "finetune": "qlora", "lora_targets": "all-linear", "lora_rank": 16,
              "precision": "bf16-autocast", "seq_len": 2048, "micro_batch_size": 1,
              "recompute": "full", **kw}
    return build_scenario(values).resolved()


def test_the_adapters_gradients_and_states_take_2_bytes_per_element() -> None:
    fp32, bf16 = estimate(_scn()), estimate(_scn(adapters_16bit=True))
    assert fp32.subterms["weights/adapters"] == N_ADAPTER * 4
    assert bf16.subterms["weights/adapters"] == N_ADAPTER * 2
    # torch's AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype, and a 0-dim
    # fp32 `step` per tensor (448 adapter matrices, one 512-byte block each)
    steps = 7 * 2 * 32 * 512
    assert fp32.terms.optimizer_states == N_ADAPTER * 8 + steps
    assert bf16.terms.optimizer_states == N_ADAPTER * 4 + steps
    # at the step: weights, gradients and states, 2 + 2 + 4 bytes per element fewer
    assert fp32.phases["optimizer"] - bf16.phases["optimizer"] == N_ADAPTER * 8


def test_peft_keeps_the_model_dtype_when_told() -> None:
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")

    def adapter_dtype(upcast: bool) -> torch.dtype:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)).to(torch.bfloat16)
        lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["0"]),
                                   autocast_adapter_dtype=upcast)
        return lora.base_model.model[0].lora_A["default"].weight.dtype

    assert adapter_dtype(True) == torch.float32
    assert adapter_dtype(False) == torch.bfloat16


@pytest.mark.parametrize(("precision", "finetune", "dropout"), [
    ("bf16-autocast", "qlora", 0.05),  # TRL's QLoRA recipe
    ("bf16-pure", "lora", 0.0),
    ("bf16-autocast", "dora", 0.05),
])
def test_the_trace_agrees(precision: str, finetune: str, dropout: float) -> None:
    pytest.importorskip("peft")
    from vramcalc.trace.engine import trace

    _, scn = scenario_for("llama-gqa", framework="hf", precision=precision, finetune=finetune,
                          lora_targets="all-linear", lora_dropout=dropout, seq_len=512,
                          adapters_16bit=True)
    analytic = estimate(scn).peak_allocated_bytes
    # DoRA's (out,)-sized norm and scale vectors are not counted (methodology §10)
    assert abs(analytic / trace(scn).report.peak_allocated_bytes - 1) < 3e-4


@pytest.mark.parametrize(("args", "message"), [
    (["--framework", "torchtune"], "needs --framework hf"),
    (["--precision", "amp-bf16"], "the model is fp32"),
    (["--precision", "fp16"], "casts a 4-bit model's adapters to bf16"),
    (["--precision", "fp16-autocast", "--finetune", "lora"], "refuses to unscale"),
    (["--finetune", "full"], "needs --framework hf and --finetune lora"),
])
def test_what_is_not_modelled_is_one_error_line(args: list[str], message: str) -> None:
    base = {"--model": "llama3.2-1b", "--gpus": "1xH100", "--framework": "hf",
            "--finetune": "qlora", "--precision": "bf16-autocast"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = [a for pair in base.items() for a in pair] + ["--adapters-16bit"]
    res = subprocess.run([sys.executable, "-m", "vramcalc", "estimate", *argv],
                         capture_output=True, text=True)
    assert res.returncode == 2, res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]
