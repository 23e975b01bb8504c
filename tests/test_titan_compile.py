"""torchtitan's compiled blocks and torchao's float8 linears (torchtitan profile, --compile,
--float8; vramcalc/terms/torchtitan_compile.py).

The expected sets come from torch itself: AOTAutograd's min-cut partitioner (inductor's
decompositions, vramcalc/trace/compiled.py) run under FakeTensorMode on torchtitan's block
(vramcalc/trace/titan_model.py, written from torchtitan 9dec370) with torchao's
Float8Linear (vramcalc/trace/titan_float8.py, written from pytorch/ao eab345c
torchao/float8/float8_linear.py); and torch.compile's own AOT backend on a checkpointed
block for full AC (parallelize_llama.py `apply_compile` after `apply_ac`).
"""

from __future__ import annotations

import pytest

from vramcalc.cli import main
from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms import torchtitan as tt
from vramcalc.training import TrainingConfig
from vramcalc.units import alloc

torch = pytest.importorskip("torch")

SMALL = ModelSpec(name="small", hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=768, vocab_size=3000)
# FSDP2's MixedPrecisionPolicy: the block computes in bf16 (r = c = bf16)
FSDP = ParallelConfig(dp=8, fsdp="full")


def recording_backend() -> tuple[object, list[object]]:
    """A torch.compile backend that partitions as inductor does (its decompositions, the
    min-cut partitioner) and records each forward graph instead of generating code."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs: list[object] = []

    def fw(gm: object, _inputs: object) -> object:
        graphs.append(gm)
        return gm

    return aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, _i: gm,
                        partition_fn=min_cut_rematerialization_partition,
                        decompositions=select_decomp_table()), graphs

def _block(spec: ModelSpec, ac: str, float8: bool) -> object:
    from vramcalc.trace.titan_float8 import convert_to_float8
    from vramcalc.trace.titan_model import TransformerBlock

    blk = TransformerBlock(spec, ac, dtype=torch.bfloat16)
    return convert_to_float8(blk) if float8 else blk


def _freqs(s: int, d: int) -> object:
    return torch.randn(s, d // 2, dtype=torch.complex64)


def _partitioned(spec: ModelSpec, b: int, s: int, float8: bool) -> list[object]:
    from vramcalc.trace.compiled import dynamo_saved

    blk = _block(spec, "none", float8)
    x = torch.randn(b, s, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    return dynamo_saved(blk, x, _freqs(s, spec.head_size))


@pytest.mark.parametrize("float8", [False, True])
@pytest.mark.parametrize(("kv_heads", "s"), [(2, 64), (8, 64), (2, 256)])
def test_compiled_block_table_equals_what_the_partitioner_keeps(float8: bool, kv_heads: int,
                                                                 s: int) -> None:
    # every saved tensor that is not a parameter, each its own 512-byte block; the block
    # input counts (a graph input the table lists); the freqs_cis slice is a view of the
    # buffer (`_conj` sets the conjugate bit, no copy)
    spec = SMALL.model_copy(update={"num_key_value_heads": kv_heads})
    b = 2
    saved = _partitioned(spec, b, s, float8)
    x_shape = (b, s, spec.hidden_size)
    traced = sum(alloc(t.nbytes, "int8") for t in saved  # type: ignore[attr-defined]
                 if (not t.is_input or t.shape == x_shape)  # type: ignore[attr-defined]
                 and t.dtype != torch.complex64)  # type: ignore[attr-defined]
    ctx = RankContext(spec, TrainingConfig(framework="torchtitan", precision="amp-bf16",
                                           seq_len=s, micro_batch_size=b, compile=True,
                                           float8=float8, recompute="none"),
                      FSDP, 0)
    assert sum(t.nbytes for t in tt.plain_layer_saved(ctx)) == traced


def test_float8_block_keeps_no_fp8_weight_and_no_normed_input() -> None:
    # torch.compile recasts the weights in backward: the only fp8 tensor kept is wo's input
    # (the SDPA output cast, (N, a·d)), nothing e5m2, and nothing (N, h) in bf16 but the
    # block input and wo's output
    saved = _partitioned(SMALL, 2, 64, True)
    fp8 = [t.shape for t in saved  # type: ignore[attr-defined]
           if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]  # type: ignore[attr-defined]
    assert fp8 == [(256, 2 * 64)]  # its storage is column-major: (a·d, N)
    hidden = [t for t in saved if not t.is_input  # type: ignore[attr-defined]
              and t.dtype == torch.bfloat16  # type: ignore[attr-defined]
              and t.nbytes == 2 * 64 * 256 * 2]  # type: ignore[attr-defined]
    # wo's output; q, k, v and the SDPA output have a·d = 256 columns too
    assert len(hidden) == 5


def test_float8_partition_of_torchaos_own_linear_matches_when_installed() -> None:
    # the stand-in's partition against torchao's Float8Linear itself, where torchao is
    # installed (it is not a dependency): the same shapes and dtypes
    ao = pytest.importorskip("torchao.float8")
    from vramcalc.trace.compiled import dynamo_saved
    from vramcalc.trace.titan_model import TransformerBlock

    blk = TransformerBlock(SMALL, "none", dtype=torch.bfloat16)
    ao.convert_to_float8_training(blk)
    x = torch.randn(2, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    real = dynamo_saved(blk, x, _freqs(64, SMALL.head_size))
    ours = _partitioned(SMALL, 2, 64, True)
    key = sorted((t.shape, str(t.dtype)) for t in real)  # type: ignore[attr-defined]
    assert key == sorted((t.shape, str(t.dtype)) for t in ours)  # type: ignore[attr-defined]


@pytest.mark.parametrize("float8", [False, True])
def test_compiled_checkpointed_block_keeps_only_its_inputs(float8: bool) -> None:
    # torch.compile(checkpoint_wrapper(block)): dynamo's checkpoint region, partitioned by
    # the min-cut partitioner, hands the backward graph the graph inputs and nothing of the
    # tokens' size (the recompute runs inside the backward graph)

    backend, graphs = recording_backend()
    torch._dynamo.reset()
    blk = _block(SMALL, "full", float8)
    x = torch.randn(2, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(blk, backend=backend, fullgraph=True)(x, _freqs(64, SMALL.head_size))
    gm = graphs[-1]
    out = next(n for n in gm.graph.nodes if n.op == "output")  # type: ignore[attr-defined]
    kept = [n for n in out.args[0][1:] if n.op != "placeholder"]
    # besides the inputs, only the RNG state the recompute replays (a CPU generator's here,
    # CUDA's philox seed and offset on a GPU)
    assert [n.args[0].name for n in kept] == ["run_and_save_rng_state"]


@pytest.mark.parametrize("kv_heads", [2, 8])
def test_compiled_op_sac_block_keeps_the_policys_outputs_the_backward_reads(
        kv_heads: int) -> None:
    # torch.compile(checkpoint_wrapper(block, context_fn=op SAC)): the partitioner keeps
    # the MUST_SAVE outputs the backward graph reads — wq's and wv's mm outputs, SDPA's
    # output and logsumexp, w1's output — and recomputes the rest; w2's output (MUST_SAVE
    # too) is read by nothing in the backward and is dropped. The table is the same.
    spec = SMALL.model_copy(update={"num_key_value_heads": kv_heads})
    b, s = 2, 64
    backend, graphs = recording_backend()
    torch._dynamo.reset()
    blk = _block(spec, "op", False)
    x = torch.randn(b, s, 256, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(blk, backend=backend, fullgraph=True)(x, _freqs(s, spec.head_size))
    gm = graphs[-1]
    out = next(n for n in gm.graph.nodes if n.op == "output")  # type: ignore[attr-defined]
    kept = [n.meta["val"] for n in out.args[0][1:] if n.op != "placeholder"]
    n, g = b * s, kv_heads * spec.head_size
    assert sorted(tuple(t.shape) for t in kept) == sorted(
        [(n, 256), (n, g), (b, 8, s, 32), (b, 8, s), (n, 768)])
    traced = alloc(b * s * 256 * 2, "int8") + sum(alloc(t.numel() * t.element_size(), "int8")
                                                  for t in kept)
    ctx = RankContext(spec, TrainingConfig(framework="torchtitan", precision="amp-bf16",
                                           seq_len=s, micro_batch_size=b, compile=True,
                                           recompute="selective"), FSDP, 0)
    assert sum(t.nbytes for t in tt.layer_saved(ctx)) == traced


def test_compiled_op_sac_with_float8_adds_only_the_casts_scalars() -> None:
    # torchao's Float8Linear runs its mm as `aten.mm` on Float8Tensors, which the SAC
    # policy sees (its `_scaled_mm` runs below the policy), so compiled per-op SAC keeps
    # the bf16 set plus 11 bf16 amax and 7 fp32 1/scale scalars, 512 B each (torchao 0.8.0
    # under torch.compile: the next test, where torchao is installed)
    base = {"framework": "torchtitan", "precision": "amp-bf16", "seq_len": 512,
            "micro_batch_size": 2, "compile": True, "recompute": "selective"}
    bf16 = RankContext(SMALL, TrainingConfig(**base), FSDP, 0)  # type: ignore[arg-type]
    f8 = RankContext(SMALL, TrainingConfig(**base, float8=True), FSDP, 0)  # type: ignore[arg-type]
    assert sum(t.nbytes for t in tt.layer_saved(f8)) - sum(
        t.nbytes for t in tt.layer_saved(bf16)) == 18 * 512


def test_compiled_op_sac_of_torchaos_own_linear_when_installed() -> None:
    ao = pytest.importorskip("torchao.float8")
    from vramcalc.trace.compiled import dynamo_saved

    b, s = 2, 64
    blk = _block(SMALL, "op", False)
    ao.convert_to_float8_training(blk)
    x = torch.randn(b, s, 256, dtype=torch.bfloat16, requires_grad=True)
    saved = dynamo_saved(blk, x, _freqs(s, SMALL.head_size))
    traced = sum(alloc(t.nbytes, "int8") for t in saved  # type: ignore[attr-defined]
                 if not t.is_input or t.shape == (b, s, 256))  # type: ignore[attr-defined]
    ctx = RankContext(SMALL, TrainingConfig(framework="torchtitan", precision="amp-bf16",
                                            seq_len=s, micro_batch_size=b, compile=True,
                                            float8=True, recompute="selective"), FSDP, 0)
    assert sum(t.nbytes for t in tt.layer_saved(ctx)) == traced


def _ctx(**kw: object) -> RankContext:
    args = {"framework": "torchtitan", "precision": "amp-bf16", "seq_len": 512,
            "micro_batch_size": 2, "compile": True, "recompute": "none", **kw}
    return RankContext(SMALL, TrainingConfig(**args), FSDP, 0)  # type: ignore[arg-type]


def test_float8_drops_the_two_normed_inputs_and_w2s_input() -> None:
    # hand count from the table: bf16 keeps 2 (N, h) normed inputs + the (N, f) product;
    # float8 keeps instead wo's fp8 input (N·a·d bytes), 10 bf16 amax and 11 fp32 1/scale
    # scalars (512 B each)
    n, h, f, ad = 2 * 512, 256, 768, 256
    bf16 = sum(t.nbytes for t in tt.plain_layer_saved(_ctx()))
    f8 = sum(t.nbytes for t in tt.plain_layer_saved(_ctx(float8=True)))
    assert bf16 - f8 == 2 * n * h * 2 + n * f * 2 - n * ad - 21 * 512


def test_full_ac_keeps_the_block_input_alone() -> None:
    saved = tt.layer_saved(_ctx(recompute="full", float8=True))
    assert sum(t.nbytes for t in saved) == 2 * 512 * 256 * 2


@pytest.mark.parametrize(("flags", "words"), [
    (["--float8"], "--float8 needs --compile"),
    (["--float8", "--compile", "--precision", "fp32"], "--float8 needs --compile"),
    (["--compile", "--float8", "--float8-all-gather", "--recompute", "selective"],
     "SAC policy"),
    (["--compile", "--tp", "2", "--sequence-parallel"], "DTensor collectives"),
])
def test_settings_not_modelled_are_refused(flags: list[str], words: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "llama3-8b", "--gpus", "8xH100", "--framework",
                 "torchtitan", "--precision", "amp-bf16", "--fsdp", "full", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and words in err


def test_float8_belongs_to_torchtitan(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "llama3-8b", "--float8"])
    err = capsys.readouterr().err
    assert code == 2 and "torchtitan profile only" in err


def test_compiled_and_float8_blocks_never_raise_the_estimate() -> None:
    # the partition only trades kept tensors for recomputation: with no AC the compiled
    # block keeps less than the eager table, float8 less again; under full AC the forward
    # keeps the same block inputs, so the peak cannot rise
    from vramcalc.analytic import estimate
    from vramcalc.scenario import Scenario

    def peak(recompute: str, **kw: object) -> int:
        tr = TrainingConfig(framework="torchtitan", precision="amp-bf16", seq_len=512,  # type: ignore[arg-type]
                            micro_batch_size=2, recompute=recompute, **kw)
        return estimate(Scenario(model=SMALL, training=tr, parallel=FSDP)).peak_allocated_bytes

    for rec in ("none", "full"):
        eager, comp = peak(rec), peak(rec, compile=True)
        assert peak(rec, compile=True, float8=True) <= comp <= eager
    assert peak("none", compile=True, float8=True) < peak("none")


def test_float8_runs_the_block_linears_at_the_fp8_peak() -> None:
    # torchtitan converts every nn.Linear but `output` (float8.py module_filter_fn): the
    # block linears, the set vramcalc's FP8 speed split puts at the FP8 peak
    from vramcalc.hardware import resolve_gpu
    from vramcalc.speed import SpeedModel, peak_flops

    spec, gpu = SMALL, resolve_gpu("H100")
    bf16 = SpeedModel(spec, gpu, 8, 512, "amp-bf16")
    f8 = SpeedModel(spec, gpu, 8, 512, "amp-bf16", float8=True)
    te = SpeedModel(spec, gpu, 8, 512, "fp8")
    assert bf16.peak == peak_flops(gpu, "bf16")[0] < f8.peak == te.peak


# ---- --compile with context parallelism ------------------------------------------------------
# torchtitan's Table 2 (llama3_h100_202412_torchtitan.md) runs FSDP + CP + torch.compile +
# Float8 with full AC. A checkpointed compiled block hands its backward only its inputs
# whatever the ops inside (test_compiled_checkpointed_block_keeps_only_its_inputs; with
# DTensor collectives inside, test_titan_tp.py), so CP's ring SDPA changes the recompute's
# working set, not the saved set: the same rule as for --tp.
def test_compile_under_cp_keeps_the_block_input_shard_under_full_ac() -> None:
    cp = ParallelConfig(dp=1, cp=2, fsdp="full")
    args = {"framework": "torchtitan", "precision": "amp-bf16", "seq_len": 512,
            "micro_batch_size": 2, "compile": True, "recompute": "full", "float8": True}
    ctx = RankContext(SMALL, TrainingConfig(**args), cp, 0)  # type: ignore[arg-type]
    saved = tt.layer_saved(ctx)
    assert [t.name for t in saved] == ["layer.input"]
    assert sum(t.nbytes for t in saved) == alloc(2 * 512 // 2 * 256, "bf16")  # (b, s/cp, h)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_compile_under_cp_without_full_ac_is_refused(recompute: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "llama3-8b", "--gpus", "8xH100", "--framework",
                 "torchtitan", "--precision", "amp-bf16", "--fsdp", "full", "--cp", "2",
                 "--compile", "--recompute", recompute, "--seq-len", "16384"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "--cp needs --recompute full" in err
