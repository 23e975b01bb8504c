"""torchtitan's async TP (--async-tp): the symmetric-memory workspace (vramcalc/terms/
torchtitan_tp.py `async_tp_workspace_bytes`).

The workspace sizes each fused op asks for are taken from torch's own functions
(torch/distributed/_symmetric_memory/__init__.py `_fused_all_gather_matmul_impl`,
`_fused_matmul_reduce_scatter_impl`), run under FakeTensorMode on a fake process group with
`get_symm_mem_workspace` replaced by a recorder; the signal pad and the 2 MiB rounding are c10d
CUDASymmetricMemory.cu's allocator, derived by hand below.
"""

from __future__ import annotations

import json

import pytest

from vramcalc.cli import main
from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms import torchtitan_tp as ttp
from vramcalc.training import TrainingConfig

MiB = 2**20
LLAMA8B = ModelSpec(name="l8", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, intermediate_size=14336, vocab_size=128256)
BASE = ["estimate", "--model", "llama3.1-8b", "--gpus", "8xH100", "--framework", "torchtitan",
        "--precision", "amp-bf16", "--fsdp", "full", "--seq-len", "8192",
        "--micro-batch-size", "1", "--recompute", "full", "--compile"]


def _ctx(tp: int = 8, b: int = 1, s: int = 8192, **kw: object) -> RankContext:
    args = {"framework": "torchtitan", "precision": "amp-bf16", "seq_len": s,
            "micro_batch_size": b, "recompute": "full", "compile": True, "async_tp": True,
            **kw}
    par = ParallelConfig(dp=8 // tp if tp <= 8 else 1, tp=tp, fsdp="full",
                         sequence_parallel=True)
    return RankContext(LLAMA8B, TrainingConfig(**args), par, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("b", "tp", "expected"), [
    # T = b·s/t tokens; all-gather asks T·h·2 B, reduce-scatter 2·T·h·2 B; + 2048 B pad,
    # rounded up to 2 MiB
    (1, 8, 18 * MiB),   # T=1024: 2·1024·4096·2 = 16 MiB, + 2 KiB -> 18 MiB
    (2, 8, 34 * MiB),   # T=2048: 32 MiB + 2 KiB -> 34 MiB
    (1, 2, 66 * MiB),   # T=4096: 64 MiB + 2 KiB -> 66 MiB
])
def test_workspace_by_hand(b: int, tp: int, expected: int) -> None:
    assert ttp.async_tp_workspace_bytes(_ctx(tp=tp, b=b)) == expected


def test_float8_gathers_do_not_change_the_workspace() -> None:
    # float8 TP gathers 1 B per element (T·h = 4 MiB), the reduce-scatter still returns bf16
    # (2·T·h·2 = 16 MiB): the larger request sizes the workspace
    assert ttp.async_tp_workspace_bytes(_ctx(float8=True)) == 18 * MiB


def test_off_is_zero() -> None:
    assert ttp.async_tp_workspace_bytes(_ctx(async_tp=False)) == 0
    assert ttp.async_tp_overhead(_ctx(async_tp=False)) == {}


def test_requests_equal_torchs_own_fused_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.distributed import fake_process_group

    asked: list[int] = []

    class _Stop(Exception):
        pass

    def record(group_name: str, min_size: int) -> None:
        asked.append(min_size)
        raise _Stop

    monkeypatch.setattr(symm, "get_symm_mem_workspace", record)
    b, s, t, h, f = 1, 8192, 8, 4096, 14336 // 8
    mm = torch.ops.aten.mm.out
    with fake_process_group(t), FakeTensorMode():
        group = dist.group.WORLD.group_name
        bf16 = torch.bfloat16
        # w1/w3 (colwise): the (b, s/t, h) norm output gathered on the sequence dim
        a_shard = torch.empty(b, s // t, h, dtype=bf16)
        w13 = [torch.empty(h, f, dtype=bf16), torch.empty(h, f, dtype=bf16)]
        with pytest.raises(_Stop):
            symm._fused_all_gather_matmul_impl(mm, a_shard, w13, None, [{}, {}],
                                               [None, None], 1, group, True)
        # w2 (rowwise): (b, s, f/t) @ (f/t, h), reduce-scattered on the sequence dim
        with pytest.raises(_Stop):
            symm._fused_matmul_reduce_scatter_impl(
                mm, torch.empty(b, s, f, dtype=bf16), torch.empty(f, h, dtype=bf16), {}, None,
                "sum", 1, group)
    assert asked == [b * s // t * h * 2, 2 * b * s // t * h * 2]
    pad, gran = ttp.SYMM_MEM_SIGNAL_PAD_BYTES, ttp.SYMM_MEM_GRANULARITY_BYTES
    expected = -(-(max(asked) + pad) // gran) * gran
    assert ttp.async_tp_workspace_bytes(_ctx()) == expected


def test_report_counts_it_outside_the_allocator(capsys: pytest.CaptureFixture[str]) -> None:
    # device total grows by the workspace; peak allocated and reserved do not move
    reports = []
    for extra in ([], ["--async-tp"]):
        assert main([*BASE, "--tp", "8", "--sequence-parallel", "--json", *extra]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    off, on = reports
    assert on["peak_allocated_bytes"] == off["peak_allocated_bytes"]
    assert on["peak_reserved_bytes"] == off["peak_reserved_bytes"]
    assert on["device_total_bytes"] - off["device_total_bytes"] == 18 * MiB
    assert on["subterms"]["overhead/symm_mem_workspace"] == 18 * MiB
    assert [n for n in on["notes"] if n.startswith("async TP: a 0.02 GB")]
    assert not [n for n in off["notes"] if n.startswith("async TP")]


@pytest.mark.parametrize(("flags", "words"), [
    ([], "needs --tp > 1"),
    (["--tp", "8", "--sequence-parallel", "--no-compile"], "needs --compile"),
    (["--tp", "8", "--sequence-parallel", "--framework", "reference"], "torchtitan profile only"),
])
def test_refused(flags: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*BASE, "--async-tp", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and words in err
    assert len(err.strip().splitlines()) == 1


def test_plan_keeps_async_tp_and_refuses_tp1_layouts() -> None:
    # the plan's base layout is tp 1: --async-tp is set after it, and the search's layout
    # check (parallel._check_torchtitan) refuses every tp-1 layout
    from vramcalc.errors import InputError
    from vramcalc.parallel import ParallelConfig as Par
    from vramcalc.parallel import resolve_layout
    from vramcalc.planner.prepare import prepare_plan

    base, _, _ = prepare_plan({"model": "llama3.1-8b", "gpus": "8xH100",
                               "framework": "torchtitan", "precision": "amp-bf16",
                               "recompute": "full", "compile": True, "async_tp": True})
    assert base.training.async_tp and base.parallel.tp == 1
    tr = base.training.model_copy(update={"recompute": "full"})  # as the search pins it
    with pytest.raises(InputError, match="needs --tp > 1"):
        resolve_layout(base.model, tr, Par(dp=8, fsdp="full"), 8)
    resolve_layout(base.model, tr, Par(dp=4, tp=2, fsdp="full", sequence_parallel=True), 8)


def test_plan_refuses_async_tp_without_compile() -> None:
    from vramcalc.errors import InputError
    from vramcalc.planner.prepare import prepare_plan

    with pytest.raises((InputError, ValueError), match="needs --compile"):
        prepare_plan({"model": "llama3.1-8b", "gpus": "8xH100", "framework": "torchtitan",
                      "precision": "amp-bf16", "recompute": "full", "async_tp": True})
