"""Adapted layers under full recompute (vramcalc/terms/adapter_instants.py): the checkpointed
forward saves nothing, and backward re-runs it beside the gradients that reached it.

Expected values: torch's own non-reentrant checkpoint, shown on transformers' LlamaMLP under
PEFT with real CPU tensors (a dispatch mode logs the ops backward runs), and tensor sizes by
hand. The trace engine referees whole steps (the grid's full-recompute adapter rows).
"""

from __future__ import annotations

from typing import Any

import pytest
from peft_mlp import peft_llama_mlp

from vramcalc.rank import RankContext
from vramcalc.terms.adapter_instants import rerun_pending_bytes
from vramcalc.validate import compare, scenario_for


def _mlp_backward_ops(fp32_adapters: bool) -> list[tuple[str, Any]]:
    """(op, output dtype) of every aten op backward runs through a checkpointed LlamaMLP
    whose down projection has a LoRA adapter (fp32, PEFT's default, or bf16)."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    mlp = peft_llama_mlp(["down_proj"], fp32_adapters)
    ops: list[tuple[str, Any]] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            ops.append((func.__name__, getattr(out, "dtype", None)))
            return out

    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False)
    with Log():
        y.sum().backward()
    return ops


def test_the_rerun_starts_after_the_adapters_sum_and_stops_before_b() -> None:
    """Backward first runs the nodes of the down adapter's sum and scaling, which save no
    tensor: the fp32 gradient of PEFT's promoted sum, its bf16 cast for the base output and
    the α/r multiplication come before the first re-run op. The re-run then ends when A's
    output, the last tensor the first forward saved, is saved again: it runs gate, silu, up,
    act·up, down's base matmul, PEFT's fp32 cast and A, and never B, the scaling or the fp32
    sum."""
    torch = pytest.importorskip("torch")
    skip = ("detach.default", "t.default", "view.default", "_unsafe_view.default",
            "expand.default", "sum.default", "ones_like.default")
    ops = [(n.removesuffix(".default"), d) for n, d in _mlp_backward_ops(fp32_adapters=True)
           if n not in skip]
    bf16, fp32 = torch.bfloat16, torch.float32
    first_mm = ops.index(("mm", bf16))
    assert ops[:first_mm] == [("_to_copy", fp32), ("_to_copy", bf16), ("mul.Tensor", fp32)]
    a_mm = ops.index(("mm", fp32))
    assert ops[first_mm:a_mm + 1] == [("mm", bf16), ("silu", bf16), ("mm", bf16),
                                      ("mul.Tensor", bf16), ("mm", bf16), ("_to_copy", fp32),
                                      ("mm", fp32)]
    # B's forward would be followed by the fp32 scaling and sum: neither runs again
    assert ops.count(("mul.Tensor", fp32)) == 1
    assert ("add.Tensor", fp32) not in ops


def test_pending_gradients_by_hand() -> None:
    """`rerun_pending_bytes`: beside dL/d the layer's output, the scaled gradient in B's
    output dtype and, when PEFT's sum was promoted to fp32, the base output's cast back.
    Llama-3.1-8B shapes at T = 2,048 tokens, h = 4,096."""
    th = 2048 * 4096

    def pending(**kw: Any) -> int:
        _, scn = scenario_for("llama-deep", framework="hf", finetune="lora", recompute="full",
                              seq_len=2048, micro_batch_size=1, **kw)
        spec = scn.model.model_copy(update={"hidden_size": 4096})
        return rerun_pending_bytes(RankContext(spec, scn.training, scn.parallel, 0))

    assert pending(precision="bf16-pure", lora_targets="all-linear") == th * 4 + th * 2
    assert pending(precision="bf16-pure", lora_targets="all-linear",
                   adapters_16bit=True) == th * 2
    assert pending(precision="bf16-autocast", lora_targets="all-linear") == th * 2
    # an fp32 residual under autocast: the MLP output's gradient is cast to bf16 as well
    assert pending(precision="amp-bf16", lora_targets="all-linear") == 2 * th * 2
    assert pending(precision="bf16-pure", lora_targets="q,v") == 0  # down's matmul first
    assert pending(precision="bf16-pure", lora_targets="all-linear",
                   use_reentrant=True) == 0  # reentrant: the re-run is the backward's first


@pytest.mark.parametrize("kw", [
    {"precision": "bf16-pure"},
    {"precision": "bf16-autocast", "lora_dropout": 0.1},
    {"precision": "amp-bf16"},
])
def test_recomputed_lora_agrees_with_the_trace(kw: dict[str, Any]) -> None:
    pytest.importorskip("torch")
    name, scn = scenario_for("llama-deep", framework="hf", finetune="lora", recompute="full",
                             lora_targets="all-linear", seq_len=2048, **kw)
    row = compare(name, scn)
    for phase in ("forward", "backward"):  # −6 … −23 % before
        assert abs(row["phases"][phase]["rel_error"]) < 0.001, (phase, row["phases"])
