"""The loss backward's reserved-but-free logits block (vramcalc/terms/logits.py
`freed_logits_bytes`), refereed by the trace engine's caching-allocator replay.

The plain loss `F.cross_entropy(logits.float(), labels)` frees the c-typed logits before
backward; backward then asks for two fp32 buffers of the logits' shape, each twice the freed
block, so best fit cannot place them there and the block stays reserved beside the peak.
Expected sizes are b·s·V·(bytes of c) rounded to 512 B; the referee is the trace engine
(real PyTorch under FakeTensorMode, every allocation replayed through the allocator model).
"""

from __future__ import annotations

import pytest

from vramcalc.analytic import estimate
from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms.logits import freed_logits_bytes
from vramcalc.training import TrainingConfig

# a small Llama shape with a vocabulary large enough for its logits to sit in the large pool
SPEC = ModelSpec(name="small-vocab32k", hidden_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                 vocab_size=32000)


def scenario(**kw: object) -> Scenario:
    args = {"seq_len": 512, "micro_batch_size": 2, "precision": "bf16", "optimizer": "adamw",
            **kw}
    return Scenario(model=SPEC, training=TrainingConfig(**args))  # type: ignore[arg-type]


def freed(scn: Scenario) -> int:
    return freed_logits_bytes(RankContext(scn.model, scn.training, scn.parallel, 0))


def test_freed_block_is_the_bf16_logits() -> None:
    # 2 x 512 tokens x 32,000 logits x 2 bytes = 65,536,000 B, a multiple of 512
    assert freed(scenario()) == 2 * 512 * 32000 * 2
    assert freed(scenario(framework="hf")) == 2 * 512 * 32000 * 2
    assert freed(scenario(precision="amp-bf16")) == 2 * 512 * 32000 * 2


@pytest.mark.parametrize("kw", [
    {"precision": "fp32"},  # .float() returns the logits themselves: nothing is freed
    {"framework": "megatron"},  # the c-typed gradient reuses the block (logits.py)
    {"chunked_ce": 8},  # per-chunk buffers
    {"seq_len": 8},  # 2 x 8 x 32,000 x 2 B = 1 MB: small pool
])
def test_no_freed_block(kw: dict) -> None:
    assert freed(scenario(**kw)) == 0


def test_tensor_parallel_head_frees_its_shard() -> None:
    scn = scenario().model_copy(update={"parallel": ParallelConfig(tp=2)})
    assert freed(scn) == 2 * 512 * 16000 * 2


def test_reserved_includes_the_freed_block_at_the_loss_peak() -> None:
    rep = estimate(scenario(seq_len=4096, micro_batch_size=4))
    assert rep.peak_phase == "backward"
    assert rep.peak_reserved_bytes - rep.peak_allocated_bytes >= 4 * 4096 * 32000 * 2


@pytest.mark.parametrize("framework", ["reference", "hf", "torchtitan"])
@pytest.mark.parametrize("expandable", [False, True])
def test_trace_replay_reserves_at_least_the_freed_block(framework: str,
                                                        expandable: bool) -> None:
    pytest.importorskip("torch")
    from vramcalc.trace.distributed import trace_any

    kw: dict[str, object] = {"framework": framework, "expandable_segments": expandable}
    if framework == "torchtitan":
        kw["precision"] = "amp-bf16"
    scn = scenario(**kw)
    if framework == "torchtitan":  # FSDP2 bf16 all-gathers, the stack's mixed precision
        scn = scenario(**kw, attention="flash").model_copy(
            update={"parallel": ParallelConfig(dp=2, fsdp="full")})
    traced = trace_any(scn)
    analytic = estimate(scn)
    assert traced.peak_allocated_bytes == pytest.approx(analytic.peak_allocated_bytes, rel=0.01)
    assert traced.peak_reserved_bytes - traced.peak_allocated_bytes >= freed(scn) > 0
    # the analytic figure stays a floor of the replay
    assert analytic.peak_reserved_bytes <= traced.peak_reserved_bytes * 1.005


def test_fit_check_leaves_the_cached_block_out() -> None:
    """An out-of-memory retry frees cached blocks (DeviceCachingAllocator::malloc calls
    release_cached_blocks before it raises), so the device total — the fit check — counts
    allocated + packing + context, and only the reported reserved peak holds the block."""
    scn = scenario(seq_len=4096, micro_batch_size=4)
    rep = estimate(scn)
    ovh = {k.split("/", 1)[1]: v for k, v in rep.subterms.items() if k.startswith("overhead/")}
    cached = rep.peak_reserved_bytes - rep.peak_allocated_bytes - ovh["fragmentation"]
    assert 0 < cached <= freed(scn)
    assert rep.device_total_bytes == rep.peak_allocated_bytes + sum(ovh.values())


# ---- FSDP2's reduce-scatter stream ----------------------------------------------------------
# torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_reduce` allocates the
# reduce-scatter output, of which the sharded gradients are views, on the reduce-scatter
# stream; the caching allocator reuses a freed block only on its own stream
# (`get_free_block`), so after `zero_grad` those bytes stay reserved beside a
# compute-stream peak that holds no gradients.
LLAMA3_8B_PARAMS = 8_030_261_248  # model card; every dim 0 divides by 8, no padding


def test_reduce_scatter_stream_keeps_the_sharded_gradients_reserved() -> None:
    from vramcalc.catalog import resolve_model
    from vramcalc.parallel import resolve_layout
    from vramcalc.terms.reserved import reduce_stream_bytes

    spec, _ = resolve_model("llama3-8b")
    tr = TrainingConfig(framework="torchtitan", precision="amp-bf16", seq_len=8192,
                        micro_batch_size=2, recompute="selective")
    ctx = RankContext(spec, tr, resolve_layout(spec, tr, ParallelConfig(dp=8, fsdp="full"), 8))
    grads = LLAMA3_8B_PARAMS * 4 // 8  # fp32 gradients (fp32 parameters), 1/8 each
    big = 60 << 30
    assert reduce_stream_bytes(ctx, [(big, 0)]) == grads  # the loss's peak: no gradients
    # a peak that holds them adds nothing unless a gradient-free phase comes within them
    assert reduce_stream_bytes(ctx, [(big, grads), (big - grads - 1, 0)]) == 0
    assert reduce_stream_bytes(ctx, [(big, grads), (big - 100, 0)]) == grads - 100
    ddp = RankContext(spec, tr.model_copy(update={"framework": "reference"}),
                      ParallelConfig(dp=8))
    assert reduce_stream_bytes(ddp, [(big, 0)]) == 0


def test_both_engines_add_the_reduce_stream_beside_a_gradient_free_peak(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the loss's peak holds no gradients in either engine; each adds exactly the sharded
    # fp32 gradients (the hand-derived bytes above) to its one-stream reserved peak
    from vramcalc import analytic
    from vramcalc.parallel import resolve_layout
    from vramcalc.terms.reserved import reduce_stream_bytes
    from vramcalc.trace import engine
    from vramcalc.trace.distributed import distributed_trace

    tr = TrainingConfig(seq_len=512, micro_batch_size=2, precision="amp-bf16",
                        optimizer="adamw", framework="reference")
    scn = Scenario(model=SPEC, training=tr, parallel=ParallelConfig(dp=4, fsdp="full"))
    extra = reduce_stream_bytes(RankContext(SPEC, tr, resolve_layout(SPEC, tr, scn.parallel,
                                                                     4)), [(1 << 40, 0)])
    assert extra > 0
    with_stream = [estimate(scn), distributed_trace(scn).report]
    monkeypatch.setattr(analytic, "reduce_stream_bytes", lambda ctx, phases: 0)
    monkeypatch.setattr(engine, "reduce_stream_bytes", lambda ctx, phases: 0)
    one_stream = [estimate(scn), distributed_trace(scn).report]
    for a, b in zip(with_stream, one_stream, strict=True):
        assert a.terms.gradients == 0
        assert a.peak_reserved_bytes - b.peak_reserved_bytes == extra
        assert a.peak_allocated_bytes == b.peak_allocated_bytes
        assert a.device_total_bytes == b.device_total_bytes  # cached: not in the fit
