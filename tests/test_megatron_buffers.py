"""Megatron-LM's local attention keeps its score-matmul input in a global buffer.

Expected bytes by hand from NVIDIA/Megatron-LM d98e8a64:
megatron/core/transformer/dot_product_attention.py `DotProductAttention.forward` takes
`get_global_memory_buffer().get_tensor((b * np, sq, sk), query.dtype, "mpu")` as the
input of `torch.baddbmm(..., beta=0.0)`; megatron/core/utils.py `GlobalMemoryBuffer`
allocates it with torch.empty the first time and keeps it. np = heads / tp.
Case: the functional tests' 12-layer h512 GPT (8 heads), b 4, s 1024, bf16.
"""

from __future__ import annotations

import contextlib
import io

import pytest
from megatron_models import GPT_SMALL

from vramcalc.analytic import estimate
from vramcalc.cli import main
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms.megatron_layer import local_attention_buffer_bytes
from vramcalc.training import TrainingConfig


def _training(impl: str | None) -> TrainingConfig:
    return TrainingConfig(seq_len=1024, micro_batch_size=4, precision="bf16",
                          framework="megatron", attention="eager", transformer_impl=impl)


@pytest.mark.parametrize(("tp", "mib"), [(1, 64), (2, 32)])
def test_the_buffer_is_one_score_matrix_per_rank(tp: int, mib: int) -> None:
    # 4 sequences x 8/tp heads x 1024 x 1024 scores x 2 B
    ctx = RankContext(GPT_SMALL, _training("local"), ParallelConfig(dp=1, tp=tp))
    assert local_attention_buffer_bytes(ctx) == 4 * (8 // tp) * 1024 * 1024 * 2 == mib * 2**20


def test_transformer_engine_layers_keep_none() -> None:
    for impl in (None, "transformer_engine"):
        ctx = RankContext(GPT_SMALL, _training(impl), ParallelConfig(dp=1))
        assert local_attention_buffer_bytes(ctx) == 0


def test_the_report_holds_it_in_every_phase() -> None:
    base = Scenario(model=GPT_SMALL, training=_training(None), parallel=ParallelConfig(dp=1))
    local = Scenario(model=GPT_SMALL, training=_training("local"),
                     parallel=ParallelConfig(dp=1))
    te, loc = estimate(base), estimate(local)
    assert loc.subterms["transients/attention_buffer"] == 64 * 2**20
    for phase in ("forward", "backward", "optimizer"):
        # TE's own 4 MiB workspace (no GPU: sm90's 32 MiB) goes, the buffer comes
        assert loc.phases[phase] - te.phases[phase] == 64 * 2**20 - 32 * 2**20


def test_explain_names_the_buffer() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["explain", "--model", "llama2-7b", "--gpus", "8xH100", "--framework",
                     "megatron", "--transformer-impl", "local", "--attention", "eager",
                     "--seq-len", "2048", "--micro-batch-size", "2", "--tp", "2"])
    assert code in (0, 1)
    # 2 sequences x 32/2 heads x 2048 x 2048 x 2 B = 0.268 GB
    assert "global buffer" in out.getvalue() and "0.268 GB" in out.getvalue()
