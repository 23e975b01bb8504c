"""The optimizer step's implementation (`--optimizer-impl foreach|fused|loop`).

Expected values come from PyTorch's and transformers' source, not from vramcalc:
- torch/optim/adam.py `_multi_tensor_adam` (foreach): `exp_avg_sq_sqrt =
  torch._foreach_sqrt(device_exp_avg_sqs)`, one state-sized temporary per parameter, all at
  once; `_fused_adamw_` (fused) updates in place; `_single_tensor_adam` (loop):
  `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` per parameter, while the
  previous parameter's `denom` is still bound;
- torch/optim/adam.py `_init_group`: a fused optimizer keeps `state["step"]` as a 0-dim
  fp32 tensor on the parameter's device (a 512-byte allocator block each);
- transformers 5.x src/transformers/training_args.py: `TrainingArguments.optim` defaults to
  "adamw_torch_fused" with torch >= 2.8.
The trace engine runs the real torch optimizers on fake tensors: tests/test_trace.py compares
them with these formulas over the validation grid.
"""

from __future__ import annotations

from vramcalc.analytic import estimate
from vramcalc.cli import main
from vramcalc.model_tensors import param_tensors
from vramcalc.training import TrainingConfig
from vramcalc.validate import SHAPES, scenario_for

# llama-gqa (vramcalc/validate/shapes.py): V = 32000, h = 1024, 2 layers of q, k, v, o, gate,
# up, down and two norms, a final norm and an untied head: 1 + 2·9 + 1 + 1 = 21 tensors
SPEC = SHAPES["llama-gqa"]
HEAD_FP32 = 32000 * 1024 * 4
NORM_FP32 = 1024 * 4


def _optimizer_phase(impl: str, precision: str = "fp32") -> int:
    _, scn = scenario_for("llama-gqa", precision=precision, optimizer_impl=impl, seq_len=256,
                          micro_batch_size=1)
    return estimate(scn).phases["optimizer"]


def test_hf_trainer_steps_adamw_fused_by_default() -> None:
    assert TrainingConfig(framework="hf").step_impl == "fused"
    assert TrainingConfig(framework="hf", optimizer="sgd").step_impl == "foreach"
    assert TrainingConfig().step_impl == "foreach"  # PyTorch's default on CUDA
    assert TrainingConfig(framework="hf", optimizer_impl="loop").step_impl == "loop"


def test_foreach_holds_one_sqrt_per_state_tensor() -> None:
    n_params = sum(t.numel * t.count for t in param_tensors(SPEC))
    assert n_params == SPEC.num_params
    # fused adds 21 step tensors and has no temporaries; foreach: every state's sqrt at once
    assert _optimizer_phase("foreach") - _optimizer_phase("fused") == 4 * n_params - 21 * 512


def test_loop_holds_two_temporaries_of_the_largest_parameter() -> None:
    # the head is the largest parameter, after the final norm: norm's denom + sqrt + quotient
    assert _optimizer_phase("loop") - _optimizer_phase("fused") == (
        NORM_FP32 + 2 * HEAD_FP32 - 21 * 512)


def test_an_implementation_the_optimizer_lacks_is_one_error_line(capsys) -> None:  # noqa: ANN001
    code = main(["estimate", "--model", "8b", "--optimizer", "lion", "--optimizer-impl",
                 "fused"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --optimizer-impl fused")
