"""torchao's NF4 linear inside a compiled torchtune layer (`--compile` with QLoRA, torchao).

Independent source: torch's own partitioner (vramcalc/trace/compiled.py `compiled_saved`,
inductor's `min_cut_rematerialization_partition` under FakeTensorMode) on torchao's
`LinearNF4` written from its source (nf4tensor.py v0.5.0). The bytes are derived by hand
from Llama-3.1-8B's shapes (h 4096, 8 kv heads of 128, f 14336).
"""

from __future__ import annotations

import pytest

from vramcalc.catalog import resolve_model
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms import activations as act
from vramcalc.training import TrainingConfig

LLAMA31_8B, _ = resolve_model("llama3.1-8b")


def _nf4_args(out_f: int, in_f: int):  # noqa: ANN202
    import torch

    n = out_f * in_f
    return (torch.empty(n // 2, dtype=torch.uint8), torch.empty(n // 64, dtype=torch.int8),
            torch.empty(n // 64 // 256, dtype=torch.bfloat16),
            torch.empty((), dtype=torch.bfloat16), torch.empty(16, dtype=torch.bfloat16))


def test_compiled_nf4_linear_keeps_its_dequantized_weight() -> None:
    """Under torch.compile the forward hands the backward the dequantized bf16 weight
    (out·in elements, 2 B each) instead of the packed codes it was made from; eager
    autograd keeps only the NF4 tensors (LinearNF4.forward's save_for_backward)."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.compiled import compiled_saved, dynamo_saved, torchao_nf4_linear

    out_f, in_f = 2048, 512
    fn = torchao_nf4_linear(out_f, in_f)
    x = torch.randn(2, 64, in_f, dtype=torch.bfloat16, requires_grad=True)
    nf4 = [t.random_(0, 7) if t.dtype in (torch.uint8, torch.int8) else t.fill_(1.0)
           for t in _nf4_args(out_f, in_f)]
    compiled = dynamo_saved(fn, x, *nf4)
    assert [(t.nbytes, t.dtype) for t in compiled if not t.is_input] == [
        (out_f * in_f * 2, torch.bfloat16)]
    with FakeTensorMode():
        fx = torch.randn(2, 64, in_f, dtype=torch.bfloat16, requires_grad=True)
        eager = compiled_saved(fn, fx, *_nf4_args(out_f, in_f), inductor=False)
    assert all(t.is_input for t in eager)
    assert sum(t.nbytes for t in eager) < out_f * in_f  # codes and scalers: ~0.52 B each


def _ctx(recompute: str, compile_: bool = True, impl: str = "torchao") -> RankContext:
    tr = TrainingConfig(framework="torchtune", precision="bf16-pure", finetune="qlora",
                        lora_targets="all-linear", qlora_impl=impl, recompute=recompute,
                        compile=compile_, seq_len=2048, micro_batch_size=2)
    return RankContext(LLAMA31_8B, tr, ParallelConfig(dp=1))


# q, o: 4096²; k, v: 1024·4096; gate, up, down: 14336·4096; bf16
DEQUANTIZED = (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096) * 2  # 436,207,616 B


def test_uncheckpointed_compiled_layer_saves_every_dequantized_weight() -> None:
    """Without checkpointing every compiled layer keeps its seven dequantized weights until
    its backward: 436,207,616 B a layer on top of what it keeps under LoRA-style eager
    dequantization (bitsandbytes, which has no compiled profile, keeps none)."""
    from vramcalc.terms.finetune_modifier import dequantized_saved

    ctx = _ctx("none")
    assert sum(t.nbytes for t in dequantized_saved(ctx)) == DEQUANTIZED
    assert dequantized_saved(_ctx("none", compile_=False)) == []
    assert dequantized_saved(_ctx("none", impl="bnb")) == []
    assert act.layer_activation_bytes(ctx) >= DEQUANTIZED


def test_checkpointed_compiled_layer_holds_them_through_its_backward() -> None:
    """Under checkpointing the forward keeps the layer input only; the recompute keeps the
    dequantized weights until each one's dL/dx, so down's backward sees all seven (torch
    2.5.1 on a real CPU run of torchao 0.5.0: the layer's backward peak was 424 MiB for
    416 MiB of dequantized weights) — in place of the eager dequantization's 14 B per
    element of one weight (int64 codes, looked-up and scaled halves, the stacked weight)."""
    moments = {m.name: m for m in act.layer_backward_moments(_ctx("full"))}
    assert moments["dequant_down"].held >= DEQUANTIZED
    eager = {m.name: m for m in act.layer_backward_moments(_ctx("full", compile_=False))}
    assert eager["dequant_down"].work >= 14 * 14336 * 4096
    tokens = 2 * 2048  # dL/d residual (T, h) and down's dL/dx (T, f), bf16: nothing else
    assert moments["dequant_down"].work == (tokens * 4096 + tokens * 14336) * 2
