"""torchtitan under tensor parallelism (vramcalc/terms/torchtitan_tp.py): torch's loss
parallel, the all-gathered head input, compiled checkpointed blocks under TP, and float8's
fp8 all-gathers.

The expected values come from torch itself, run under a fake process group (torch's testing
backend: collectives return at once, every buffer has its true shape): loss parallel's own
functions (torch/distributed/tensor/parallel/loss.py) counted by the trace engine's tracker;
DTensor's ColwiseParallel; torch.compile's AOT partitioner on torchtitan's block
(vramcalc/trace/titan_model.py) parallelized with torchtitan 9dec370's `apply_tp` layer plan
(parallelize_llama.py); and hand counts from the sources cited in the module.
"""

from __future__ import annotations

import contextlib

import pytest

from vramcalc.cli import main
from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms import torchtitan_tp as ttp
from vramcalc.terms.activations import head_saved
from vramcalc.terms.torchtitan import checkpointed_forward_work, layer_saved
from vramcalc.terms.torchtitan_compile import compiled_block_saved
from vramcalc.training import TrainingConfig
from vramcalc.units import alloc

torch = pytest.importorskip("torch")

SMALL = ModelSpec(name="small", hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=768, vocab_size=3000)
TP2 = ParallelConfig(dp=4, tp=2, fsdp="full", sequence_parallel=True)


def _ctx(b: int = 2, s: int = 64, par: ParallelConfig = TP2, **kw: object) -> RankContext:
    args = {"framework": "torchtitan", "precision": "amp-bf16", "seq_len": s,
            "micro_batch_size": b, "recompute": "full", **kw}
    return RankContext(SMALL, TrainingConfig(**args), par, 0)  # type: ignore[arg-type]


# ---- loss parallel --------------------------------------------------------------------
@pytest.mark.parametrize(("n", "vp"), [(1024, 375), (1024, 750), (4096, 512)])
def test_loss_parallel_peaks_equal_torchs_own_functions(n: int, vp: int) -> None:
    # torch's `_log_softmax` and `_nll_loss_and_log_softmax_backward` (what loss_parallel's
    # handlers run on each rank's (N, V') shard), counted by the trace engine's tracker;
    # the backward root's three 0-dim tensors are made outside the count, as the analytic
    # formula adds them (the plain path's convention, vramcalc/terms/logits.py)
    import torch.distributed.tensor.parallel.loss as lp
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from vramcalc.trace.distributed import fake_process_group
    from vramcalc.trace.tracker import MemoryTracker

    tp = 8
    with fake_process_group(tp):
        mesh = init_device_mesh("cpu", (tp,))
        with FakeTensorMode():
            grad_out, total = torch.ones(()), torch.tensor(float(n))
            tracker = MemoryTracker()
            with tracker:
                target = torch.randint(0, vp * tp, (n,))  # the labels: the batch's, not the loss's
                tracker.set_phase("forward")
                pred = torch.randn(n, vp, dtype=torch.bfloat16)
                x = pred.float()
                logp = lp._log_softmax(x, 1, False, mesh, 0)
                del x, pred
                tracker.set_phase("backward")
                lp._nll_loss_and_log_softmax_backward(
                    grad_out, logp, target, None, 1, -100, total, torch.Size((n, vp * tp)),
                    1, mesh, 0)
    labels = alloc(n, "int64")
    forward = tracker.peaks[(0, "forward")].total - labels
    backward = tracker.peaks[(0, "backward")].total - labels
    ctx = _ctx(b=1, s=n, par=ParallelConfig(dp=4, tp=tp, fsdp="full", sequence_parallel=True))
    ctx = RankContext(SMALL.model_copy(update={"vocab_size": vp * tp}), ctx.training,
                      ctx.parallel, 0)
    assert ttp.loss_parallel_forward_peak_bytes(ctx) == forward
    assert ttp.loss_parallel_backward_peak_bytes(ctx) == backward + 3 * 512


def test_loss_parallel_bytes_per_logit() -> None:
    # the module's table: c + 12 B per logit in forward, 16 in backward (c = bf16), against
    # 2·4 + c and 3·4 of the single-rank F.cross_entropy(logits.float()) path
    ctx = _ctx(b=4, s=8192, par=ParallelConfig(dp=4, tp=8, fsdp="full",
                                               sequence_parallel=True))
    n = 4 * 8192
    nv = n * (3000 // 8)
    fw, bw = ttp.loss_parallel_forward_peak_bytes(ctx), ttp.loss_parallel_backward_peak_bytes(ctx)
    # + the (N) vectors: 3 fp32 in forward; 3 int64, 1 bool, 2 fp32 (33 B a token) and
    # three 0-dim tensors in backward
    assert fw == 14 * nv + 12 * n
    assert bw == 16 * nv + 33 * n + 3 * 512


def test_loss_parallel_only_under_tp() -> None:
    assert ttp.loss_parallel(_ctx())
    assert not ttp.loss_parallel(_ctx(par=ParallelConfig(dp=8, fsdp="full")))
    ref = RankContext(SMALL, TrainingConfig(precision="amp-bf16", seq_len=64,
                                            micro_batch_size=2), TP2, 0)
    assert not ttp.loss_parallel(ref)


# ---- the head's all-gathered input ------------------------------------------------------
def test_head_saves_the_all_gathered_input_as_dtensor_does() -> None:
    # apply_tp's `output` style: ColwiseParallel(input_layouts=Shard(1),
    # output_layouts=Shard(-1), use_local_output=False); the mm saves the gathered input
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from vramcalc.trace.distributed import fake_process_group

    b, s, h, V, tp = 2, 64, 256, 3000, 2
    shapes: list[tuple[int, ...]] = []

    def pack(t: object) -> object:
        local = t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[attr-defined]
        shapes.append(tuple(local.shape))  # type: ignore[attr-defined]
        return t

    with fake_process_group(tp):
        mesh = init_device_mesh("cpu", (tp,))
        with FakeTensorMode():
            lin = torch.nn.Linear(h, V, bias=False, dtype=torch.bfloat16)
            parallelize_module(lin, mesh, ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False))
            x = torch.randn(b, s // tp, h, dtype=torch.bfloat16, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = lin(x)
            assert tuple(out._local_tensor.shape) == (b, s, V // tp)
    assert (b * s, h) in shapes  # the gathered (N, h) input, not the (T, h) shard
    ctx = _ctx(b=b, s=s)
    head = next(t for t in head_saved(ctx) if t.name == "lm_head.input")
    assert head.nbytes == alloc(b * s * h, "bf16")


# ---- compiled checkpointed blocks under TP -----------------------------------------------
def _tp_block(ac: str) -> list[tuple[str, tuple[int, ...]]]:
    """(op, shape) of what torch.compile's forward graph hands the backward, for
    torchtitan's block parallelized with apply_tp's layer plan (bf16 styles) on a fake
    2-rank TP mesh, b = 2, s = 64."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from tests.test_titan_compile import recording_backend
    from vramcalc.trace.distributed import fake_process_group
    from vramcalc.trace.titan_model import TransformerBlock

    backend, graphs = recording_backend()
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        blk = TransformerBlock(SMALL, ac, dtype=torch.bfloat16)
        parallelize_module(blk, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel()})
        torch._dynamo.reset()
        x = torch.randn(2, 32, 256, dtype=torch.bfloat16, requires_grad=True)
        fc = torch.randn(64, SMALL.head_size // 2, dtype=torch.complex64)
        # the graphs are recorded at compile time; running the recorded forward on the fake
        # group's CPU mesh can fail afterwards (the mesh among the saved values)
        with contextlib.suppress(AssertionError):
            torch.compile(blk, backend=backend, fullgraph=True)(x, fc)
    gm = graphs[-1]
    out = next(n for n in gm.graph.nodes if n.op == "output")  # type: ignore[attr-defined]
    kept = []
    for node in out.args[0][1:]:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            kept.append((node.op if node.op == "placeholder" else str(node.target),
                         tuple(val.shape)))
    torch._dynamo.reset()
    return kept


def test_compiled_checkpointed_tp_block_keeps_its_input_shard_alone() -> None:
    # parallelize_llama.py: apply_tp, then apply_ac (checkpoint_wrapper), then apply_compile:
    # the forward hands the backward its graph inputs (the (b, s/t, h) input, freqs_cis,
    # the TP-local weights) and the RNG state only: no all-gathered or (N, ·) tensor
    kept = _tp_block("full")
    made = [k for k in kept if k[0] != "placeholder"]
    assert made and all(len(shape) == 1 for _, shape in made)  # the RNG state's bytes
    assert ("placeholder", (2, 32, 256)) in kept
    ctx = _ctx(compile=True, float8=False)
    assert [t.name for t in layer_saved(ctx)] == ["layer.input"]
    assert sum(t.nbytes for t in layer_saved(ctx)) == alloc(2 * 32 * 256, "bf16")


def test_compiled_tp_block_without_ac_keeps_collective_outputs() -> None:
    # why --compile --tp needs --recompute full: without AC the partitioner keeps the
    # all-gathered (N, h) inputs and the reduce-scatter's (T, h) output, a set the table
    # does not model
    kept = _tp_block("none")
    shapes = [shape for op, shape in kept if op != "placeholder"]
    assert (128, 256) in shapes and (2, 32, 256) in shapes


@pytest.mark.parametrize(("flags", "words"), [
    (["--compile", "--tp", "2", "--sequence-parallel"], "needs --recompute full"),
    (["--compile", "--tp", "2", "--sequence-parallel", "--recompute", "selective"],
     "needs --recompute full"),
])
def test_compile_under_tp_without_full_ac_is_refused(
        flags: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "llama3-8b", "--gpus", "8xH100", "--framework",
                 "torchtitan", "--precision", "amp-bf16", "--fsdp", "full", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and words in err


def test_compile_under_tp_with_full_ac_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "llama3-8b", "--gpus", "8xH100", "--framework",
                 "torchtitan", "--precision", "amp-bf16", "--fsdp", "full", "--tp", "2",
                 "--sequence-parallel", "--recompute", "full", "--compile", "--float8",
                 "--json"])
    assert code == 0, capsys.readouterr().err


# ---- float8's fp8 all-gathers -------------------------------------------------------------
def test_float8_tp_gathers_block_inputs_in_fp8() -> None:
    # torchao eab345c float8_tensor_parallel.py: PrepareFloat8ModuleInput casts the (T, h)
    # norm output to float8_e4m3fn, then redistributes Shard(1) -> Replicate: the gathered
    # (N, h) input is 1 B per element; the top block's checkpointed forward holds it next
    # to h (T, h) and three (N, f/t) tensors (vramcalc/terms/torchtitan.py)
    b, s, t, h, f = 2, 64, 2, 256, 768 // 2
    n = b * s
    f8 = _ctx(compile=True, float8=True)
    bf = _ctx(compile=True, float8=False)
    assert ttp.gathered_input_dtype(f8) == "fp8" and ttp.gathered_input_dtype(bf) == "bf16"
    assert checkpointed_forward_work(f8) == (alloc(b * s // t * h, "bf16") + alloc(n * h, "fp8")
                                             + 3 * alloc(n * f, "bf16"))
    assert checkpointed_forward_work(bf) - checkpointed_forward_work(f8) == n * h
    names = {t.name: t for t in compiled_block_saved(f8)}
    assert names["attn.input"].nbytes == names["mlp.input"].nbytes == alloc(n * h, "fp8")
    assert names["mlp.gate"].nbytes == alloc(n * f, "bf16")  # ffn ÷ t


def test_float8_without_tp_keeps_no_gathered_input() -> None:
    ctx = _ctx(par=ParallelConfig(dp=8, fsdp="full"), compile=True, float8=True)
    names = {t.name for t in compiled_block_saved(ctx)}
    assert "attn.input" not in names and "mlp.input" not in names
    assert ttp.gathered_input_dtype(ctx) == "bf16"


def test_mlp_backward_gradients_are_gathered_rows_under_tp() -> None:
    # the act · up backward of a TP block: dL/d(act·up), d act, d up are (N, f/t) (w1 and
    # w3 are ColwiseParallel on the all-gathered input), beside dL/d residual (T, h)
    from vramcalc.terms.activations import layer_backward_moments

    b, s, t, h, f = 2, 64, 2, 256, 768 // 2
    mlp = next(m for m in layer_backward_moments(_ctx(compile=True)) if m.name == "mlp")
    assert mlp.work == alloc(b * s // t * h, "bf16") + 3 * alloc(b * s * f, "bf16")


def test_explain_names_loss_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["explain", "--model", "llama3-8b", "--gpus", "8xH100", "--framework",
                 "torchtitan", "--precision", "amp-bf16", "--fsdp", "full", "--tp", "8",
                 "--sequence-parallel", "--seq-len", "1024", "--micro-batch-size", "1"])
    out = capsys.readouterr().out
    nv = 1024 * (128256 // 8)
    assert code == 0 and "loss parallel" in out and f"{nv:,} x 16 B" in out
