"""Activation offloading around checkpointed layers, as torchtune's recipes run it
(`with self.activations_handling_ctx: logits = self._model(**batch)`, the hooks turned off
inside the output projection by `get_act_offloading_ctx_manager`): the hooks wrap every
checkpoint from outside, so each layer's saved input goes to the host and the layer's own
tensors to the checkpoint, recomputed in backward outside the hooks; the final norm runs
inside the hooks, so its saved tensors go to the host too.

Expected values: torch's own hook nesting, shown on real CPU tensors (the innermost
saved-tensor hooks take a save; torch.utils.checkpoint's non-reentrant mode saves its
inputs with `ctx.save_for_backward` before it installs its own), and the bytes of the
validation shape by hand (2 layers, T = 2 x 1,024 tokens, h = 1,024; bf16 layer inputs, the
final norm's fp32 copy and its fp32 rstd per token, all above torchtune's 1 KiB
min_offload_size).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from vramcalc.analytic import estimate
from vramcalc.validate import scenario_for

T, H = 2 * 1024, 1024


def test_outer_hooks_get_only_the_checkpoint_inputs() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint

    layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    packed: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = checkpoint(layer, x, use_reentrant=False)
    assert packed == [(4, 8)]  # the input; the GELU's (4, 16) input went to the checkpoint
    packed.clear()
    y.sum().backward()  # the recompute runs outside the hooks
    assert packed == []


def test_the_layers_inputs_and_the_final_norm_leave_the_device() -> None:
    def peak(offload: bool) -> int:
        _, scn = scenario_for("llama-gqa", framework="torchtune", precision="bf16-pure",
                              recompute="full", finetune="lora", lora_targets="all-linear",
                              activation_offload=offload)
        return estimate(scn).peak_allocated_bytes

    # at the loss's backward: two layer inputs (bf16), the final norm's x (fp32) and rstd
    assert peak(False) - peak(True) == 2 * T * H * 2 + T * H * 4 + T * 4


def test_the_trace_agrees() -> None:
    pytest.importorskip("torch")
    from vramcalc.trace.engine import trace

    _, scn = scenario_for("llama-gqa", framework="torchtune", precision="bf16-pure",
                          recompute="full", finetune="lora", lora_targets="all-linear",
                          activation_offload=True)
    assert estimate(scn).peak_allocated_bytes == trace(scn).report.peak_allocated_bytes


def test_other_profiles_refuse_it_with_one_line() -> None:
    res = subprocess.run([sys.executable, "-m", "vramcalc", "estimate", "--model",
                          "llama3.2-1b", "--framework", "hf", "--recompute", "full",
                          "--activation-offload"], capture_output=True, text=True)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "modelled for --framework torchtune" in lines[0]
