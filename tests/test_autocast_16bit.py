"""`--precision bf16-autocast | fp16-autocast`: HF Trainer's `bf16=True` / `fp16=True` over a
model loaded in 16 bits (`from_pretrained(..., dtype=torch.bfloat16)`), the common LoRA
recipe of TRL, LLaMA-Factory and PEFT's own examples.

Expected values come from the stacks' source, not from vramcalc:
- PEFT 0.21.2 tuners/lora/layer.py `Linear.forward` binds `x = self._cast_input_dtype(x,
  lora_A.weight.dtype)` (an fp32 copy of the 16-bit input for the fp32 adapters that
  `autocast_adapter_dtype=True` makes) and runs `lora_B(lora_A(dropout(x)))`;
- under autocast `linear` is on the lower-precision list: lora_A casts its fp32 input to
  16 bits and keeps that cast for its weight gradient (2 bytes per element where, without
  autocast, A keeps the fp32 copy: 4 bytes);
- the frozen 16-bit base and transformers' RMSNorm (which upcasts and returns the weight's
  dtype itself) compute exactly as without autocast, so full fine-tuning is bf16-pure's;
- accelerate 1.12.0 accelerator.py sets `native_amp` (the autocast it wraps the forward in)
  for fp16/bf16 unless the distributed type is DeepSpeed or Megatron-LM.
The trace engine runs transformers + PEFT under autocast as the referee (the validate grid's
bf16-autocast rows; `test_the_trace_agrees` below runs one).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from vramcalc.analytic import estimate
from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms.finetune_activations import adapter_saved
from vramcalc.terms.saved import dims
from vramcalc.validate import scenario_for

T, H, F = 2048, 4096, 14336  # Llama-3.1-8B at micro-batch 1 x 2,048 tokens


def _scn(precision: str, **kw: object):  # noqa: ANN202
    values = {"model": "llama3.1-8b", "gpus": "1xH100", "framework": "hf",
              "finetune": "lora", "lora_targets": "all-linear", "precision": precision,
              "seq_len": T, "micro_batch_size": 1, "recompute": "none", **kw}
    return build_scenario(values).resolved()


def _saved(precision: str, target: str, dropout: float = 0.0) -> dict[str, tuple[int, str]]:
    scn = _scn(precision, lora_dropout=dropout)
    ctx = RankContext(scn.model, scn.training, scn.parallel)
    saved, _ = adapter_saved(ctx, dims(ctx), target)
    return {t.name.split(".", 2)[2]: (t.numel, t.dtype) for t in saved}


def test_each_adapter_keeps_a_16bit_cast_of_its_upcast_input() -> None:
    # without autocast A keeps PEFT's fp32 copy; under it, autocast's bf16 cast of that copy
    assert _saved("bf16-pure", "q") == {"input_cast": (T * H, "fp32"), "a_out": (T * 8, "fp32")}
    assert _saved("bf16-autocast", "q") == {"a_input_cast": (T * H, "bf16"),
                                            "a_out": (T * 8, "bf16")}
    assert _saved("bf16-autocast", "down") == {"a_input_cast": (T * F, "bf16"),
                                               "a_out": (T * 8, "bf16")}
    # with dropout: the bool mask, and A keeps its cast of the dropped fp32 copy
    assert _saved("bf16-autocast", "up", 0.05) == {
        "dropout_mask": (T * H, "bool"), "a_input_cast": (T * H, "bf16"),
        "a_out": (T * 8, "bf16")}


def test_without_checkpointing_every_layer_keeps_2_bytes_less_per_adapter_input() -> None:
    # 32 layers x (q, k, v, o, gate, up read (T, h); down reads (T, f)) x 2 B, and A's
    # output (T, r = 8) in 2 bytes instead of 4 for each of the 7 adapters
    per_layer = (6 * T * H + T * F) * 2 + 7 * T * 8 * 2
    pure = estimate(_scn("bf16-pure"))
    auto = estimate(_scn("bf16-autocast"))
    assert pure.terms.activations - auto.terms.activations == 32 * per_layer
    assert auto.terms.weights == pure.terms.weights


def test_full_fine_tuning_casts_nothing() -> None:
    full = {"finetune": "full", "gpus": "8xH100", "zero": 0}
    pure, auto = estimate(_scn("bf16-pure", **full)), estimate(_scn("bf16-autocast", **full))
    assert auto.peak_allocated_bytes == pure.peak_allocated_bytes
    assert auto.terms.optimizer_states == pure.terms.optimizer_states  # bf16 states


def test_peft_under_autocast_keeps_the_16bit_cast() -> None:
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)).to(torch.bfloat16)
    model.requires_grad_(False)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["0"]))
    assert lora.base_model.model[0].lora_A["default"].weight.dtype == torch.float32
    kept: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append((tuple(t.shape), t.dtype))
        return t

    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lora(x)
    inputs = [k for k in kept if k[0] == (8, 64)]
    assert inputs == [((8, 64), torch.bfloat16)]  # A's cast; the base saves no input
    kept.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lora(x)
    assert [k for k in kept if k[0] == (8, 64)] == [((8, 64), torch.float32)]


def test_the_trace_agrees() -> None:
    pytest.importorskip("peft")
    from vramcalc.trace.engine import trace

    _, scn = scenario_for("llama-gqa", framework="hf", precision="bf16-autocast",
                          finetune="lora", lora_targets="all-linear", lora_dropout=0.05)
    analytic = estimate(scn).peak_allocated_bytes
    assert abs(analytic / trace(scn).report.peak_allocated_bytes - 1) < 1e-3


@pytest.mark.parametrize(("args", "message"), [
    (["--framework", "torchtune"], "needs --framework hf"),
    (["--framework", "hf", "--model", "gpt2"], "modelled for RMSNorm decoders"),
    (["--framework", "hf", "--gpus", "2xH100", "--zero", "2"], "does not autocast under"),
    (["--framework", "hf", "--gpus", "2xH100", "--fsdp", "full"], "one GPU and under DDP"),
    (["--framework", "hf", "--finetune", "full", "--precision", "fp16-autocast"],
     "refuses to unscale fp16 gradients"),
])
def test_what_is_not_modelled_is_one_error_line(args: list[str], message: str) -> None:
    base = {"--model": "llama3.2-1b", "--gpus": "1xH100", "--finetune": "lora",
            "--precision": "bf16-autocast"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = [a for pair in base.items() for a in pair]
    res = subprocess.run([sys.executable, "-m", "vramcalc", "estimate", *argv],
                         capture_output=True, text=True)
    assert res.returncode == 2, res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]
