"""torchao's float8 all-gather under FSDP2 (torchtitan profile, --float8 --float8-all-gather;
vramcalc/terms/float8_fsdp.py, vramcalc/terms/comm.py `fsdp_layer_bytes`).

Sources: torchtitan 9dec370 torchtitan/float8.py (`enable_fsdp_float8_all_gather` only when
`parallel_dims.dp_shard_enabled`; `output` not converted); pytorch/ao eab345c
torchao/float8/fsdp_utils.py (`fsdp_pre_all_gather` hands FSDP2 the fp8 data of the local
shard, its fp32 scale as metadata); torch 2.13 `_fsdp_collectives.py` (mixed-dtype inputs are
all-gathered as one uint8 buffer)."""

from __future__ import annotations

import pytest

from vramcalc.analytic import estimate
from vramcalc.api import load_model as resolve_model
from vramcalc.cli import main
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import comm
from vramcalc.terms.float8_fsdp import block_linear_norm_numels
from vramcalc.training import TrainingConfig

H, KV, F = 4096, 1024, 14336  # Llama-3-8B: hidden, k/v columns (8 heads × 128), ffn


def _tr(**kw: object) -> TrainingConfig:
    return TrainingConfig(framework="torchtitan", precision="amp-bf16", seq_len=8192,  # type: ignore[arg-type]
                          micro_batch_size=1, compile=True, float8=True, recompute="full", **kw)


def _ctx(tp: int = 1, **kw: object) -> RankContext:
    par = ParallelConfig(dp=8, tp=tp, fsdp="full", sequence_parallel=tp > 1)
    return RankContext(resolve_model("llama3-8b"), _tr(**kw), par, 0)


def test_gathered_block_is_one_byte_per_linear_weight_by_hand() -> None:
    # wq, wo (h, h); wk, wv (h, 1024); w1, w3, w2 (h, f): 218,103,808 fp8 elements; the two
    # RMSNorm weights (h) stay bf16; one uint8 buffer (512 B rounding: exact here) plus the
    # seven fp32 0-dim scales (512 B each)
    linear = 2 * H * H + 2 * H * KV + 3 * H * F
    assert linear == 218_103_808
    fp8 = linear + 2 * H * 2 + 7 * 512
    assert comm.fsdp_layer_bytes(_ctx(float8_all_gather=True)) == fp8
    assert comm.fsdp_layer_bytes(_ctx()) == (linear + 2 * H) * 2  # bf16 gathers: unchanged


def test_under_tp_the_rank_gathers_its_tp_shard_in_fp8() -> None:
    linear = (2 * H * H + 2 * H * KV + 3 * H * F) // 2
    assert comm.fsdp_layer_bytes(_ctx(tp=2, float8_all_gather=True)) == (
        linear + 2 * H * 2 + 7 * 512)


def test_buffer_matches_torchs_own_all_gather_metadata() -> None:
    # torch's FSDP2 sizes the all-gather buffer from the pre-all-gather outputs: fp8 shards
    # of the Float8Linear weights and bf16 shards of the norms -> one uint8 buffer
    torch = pytest.importorskip("torch")
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_all_gather_input_metadatas,
    )

    ws = 8
    ctx = _ctx(float8_all_gather=True)
    shapes = [(H, H), (KV, H), (KV, H), (H, H), (F, H), (F, H), (H, F)]
    inputs = [[torch.empty(r * c // ws, dtype=torch.float8_e4m3fn, device="meta")]
              for r, c in shapes]
    inputs += [[torch.empty(H // ws, dtype=torch.bfloat16, device="meta")]] * 2
    _, numels, dtype = _get_all_gather_input_metadatas(inputs)
    assert dtype == torch.uint8
    gathered = sum(n * (1 if i < 7 else 2) for i, (n,) in enumerate(numels)) * ws
    lin, norm, count = block_linear_norm_numels(ctx)
    assert (lin + 2 * norm, count) == (gathered, 7)
    assert comm.fsdp_layer_bytes(ctx) == gathered + count * 512


def test_forward_peak_drops_by_one_block_and_root_stays_bf16() -> None:
    # forward: the root (embedding, final norm, output: not Float8Linear) stays bf16 and
    # one block is gathered at a time; the forward peak falls by exactly one block's saving
    def run(**kw: object) -> object:
        return estimate(Scenario(model=resolve_model("llama3-8b"), training=_tr(**kw),
                                 parallel=ParallelConfig(dp=8, fsdp="full")))

    base, f8 = run(), run(float8_all_gather=True)
    saving = comm.fsdp_layer_bytes(_ctx()) - comm.fsdp_layer_bytes(_ctx(float8_all_gather=True))
    assert base.phases["forward"] - f8.phases["forward"] == saving  # type: ignore[attr-defined]
    assert f8.phases["optimizer"] == base.phases["optimizer"]  # type: ignore[attr-defined]
    assert f8.phases["backward"] < base.phases["backward"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("flags", "words"), [
    (["--framework", "torchtitan", "--precision", "amp-bf16", "--fsdp", "full", "--compile",
      "--float8-all-gather"], "--float8-all-gather needs --float8"),
    (["--framework", "torchtitan", "--precision", "amp-bf16", "--fsdp", "full", "--compile",
      "--float8", "--float8-all-gather", "--gpus", "1xH100"], "dp_shard > 1"),
    (["--framework", "torchtitan", "--precision", "fp32", "--compile",
      "--float8-all-gather"], "--float8-all-gather needs --float8"),
    (["--float8-all-gather"], "--float8-all-gather: torchao's Float8Linear is modelled for "
     "the torchtitan profile only"),
])
def test_refused_without_float8_fsdp_or_torchtitan(flags: list[str], words: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model", "llama3-8b", *flags]
    if "--gpus" not in flags:
        args += ["--gpus", "8xH100"]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and words in err and err.count("\n") == 1


def _partitioned_gathered(kv_heads: int, s: int, b: int = 2) -> list[object]:
    torch = pytest.importorskip("torch")

    from tests.test_titan_compile import SMALL
    from vramcalc.trace.compiled import dynamo_saved
    from vramcalc.trace.titan_float8 import convert_to_float8
    from vramcalc.trace.titan_model import TransformerBlock

    spec = SMALL.model_copy(update={"num_key_value_heads": kv_heads})
    blk = convert_to_float8(TransformerBlock(spec, "none", dtype=torch.bfloat16), True)
    x = torch.randn(b, s, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    fc = torch.randn(s, spec.head_size // 2, dtype=torch.complex64)
    return dynamo_saved(blk, x, fc)


@pytest.mark.parametrize(("kv_heads", "s"), [(2, 64), (8, 64), (2, 256)])
def test_compiled_block_with_gathered_fp8_weights_equals_the_partition(kv_heads: int,
                                                                       s: int) -> None:
    # the Float8Linear of vramcalc/trace/titan_float8.py fed the gathered fp8 data and scale
    # (fsdp_post_all_gather's Float8Tensor: no weight cast): what torch's min-cut partition
    # keeps, each its own 512 B block, the block input counted, freqs_cis a view
    torch = pytest.importorskip("torch")
    from tests.test_titan_compile import SMALL
    from vramcalc.terms import torchtitan as tt
    from vramcalc.units import alloc

    b = 2
    spec = SMALL.model_copy(update={"num_key_value_heads": kv_heads})
    saved = _partitioned_gathered(kv_heads, s, b)
    x_shape = (b, s, spec.hidden_size)
    traced = sum(alloc(t.nbytes, "int8") for t in saved  # type: ignore[attr-defined]
                 if (not t.is_input or t.shape == x_shape)  # type: ignore[attr-defined]
                 and t.dtype != torch.complex64)  # type: ignore[attr-defined]
    fp8 = [t for t in saved if t.dtype == torch.float8_e4m3fn  # type: ignore[attr-defined]
           and not t.is_input]  # type: ignore[attr-defined]
    assert len(fp8) == 1  # wo's input: the gathered fp8 weights are kept, not copied
    tr = TrainingConfig(framework="torchtitan", precision="amp-bf16", seq_len=s,
                        micro_batch_size=b, compile=True, float8=True, recompute="none",
                        float8_all_gather=True)
    ctx = RankContext(spec, tr, ParallelConfig(dp=8, fsdp="full"), 0)
    assert sum(t.nbytes for t in tt.plain_layer_saved(ctx)) == traced


def test_compiled_checkpointed_block_with_gathered_fp8_weights_keeps_only_inputs() -> None:
    # full AC (as torchtitan's float8 runs): torch.compile(checkpointed block) with the
    # gathered fp8 weights keeps the graph inputs and the RNG state only: the column-major
    # copies are made again inside the backward graph's recompute
    torch = pytest.importorskip("torch")

    from tests.test_titan_compile import SMALL, recording_backend
    from vramcalc.trace.titan_float8 import convert_to_float8
    from vramcalc.trace.titan_model import TransformerBlock

    backend, graphs = recording_backend()
    torch._dynamo.reset()
    blk = convert_to_float8(TransformerBlock(SMALL, "full", dtype=torch.bfloat16), True)
    x = torch.randn(2, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    fc = torch.randn(64, SMALL.head_size // 2, dtype=torch.complex64)
    torch.compile(blk, backend=backend, fullgraph=True)(x, fc)
    out = next(n for n in graphs[-1].graph.nodes if n.op == "output")  # type: ignore[attr-defined]
    kept = [n for n in out.args[0][1:] if n.op != "placeholder"]
    assert [n.args[0].name for n in kept] == ["run_and_save_rng_state"]
