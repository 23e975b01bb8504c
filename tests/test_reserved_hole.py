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


# torchtitan runs with expandable segments (its launcher's PYTORCH_CUDA_ALLOC_CONF). Under
# FSDP2 without them, at this size, the side streams' pools change the default pool's
# layout so that the freed logits merge with a free neighbour and the backward reuses them:
# the analytic engine's cached logits block is then not there (the trace replays it).
@pytest.mark.parametrize("framework,expandable", [
    ("reference", False), ("reference", True), ("hf", False), ("hf", True),
    ("torchtitan", True)])
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


# ---- FSDP2's side streams ---------------------------------------------------------------------
# torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_reduce` allocates the
# reduce-scatter output, of which the sharded gradients are views, on the reduce-scatter
# stream, and `foreach_all_gather` the cast shards and the flat all-gather output on the
# all-gather copy-in stream; the caching allocator reuses a freed block only on its own
# stream (`get_free_block`), so after `zero_grad` the gradients' bytes stay reserved beside
# a compute-stream peak that holds none, and the copy-in stream keeps its high-water mark.
LLAMA3_8B_PARAMS = 8_030_261_248  # model card; every dim 0 divides by 8, no padding
MID = ModelSpec(name="mid-vocab32k", hidden_size=1024, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=8, intermediate_size=4096,
                vocab_size=32000)


def test_copy_in_stream_of_llama3_8b_under_torchtitan() -> None:
    from vramcalc.catalog import resolve_model
    from vramcalc.parallel import resolve_layout
    from vramcalc.terms.comm import copy_in_stream_bytes

    spec, _ = resolve_model("llama3-8b")
    tr = TrainingConfig(framework="torchtitan", precision="amp-bf16", seq_len=8192,
                        micro_batch_size=2, recompute="selective")
    ctx = RankContext(spec, tr, resolve_layout(spec, tr, ParallelConfig(dp=8, fsdp="full"), 8))
    # bf16 all-gather outputs: the root (embedding + head 2 x 128,256 x 4,096, final norm
    # 4,096) and a block (4,096^2 x 2 + 1,024 x 4,096 x 2 + 3 x 4,096 x 14,336 + 2 x 4,096)
    root, block = (2 * 128_256 * 4096 + 4096) * 2, 218_112_000 * 2
    assert (root, block) == (2_101_354_496, 436_224_000)
    page = 20 * 2**20  # torchtitan runs with expandable segments: 20 MiB pages
    # the root's cast shards (root / 8) map 13 pages; its output grows the end by the
    # missing bytes in 100 pages; block 0's cast shards fit the freed root shards' hole,
    # its output does not (208,141,312 B left) and grows the end, whose 5,757,952 free
    # bytes it takes, by 21 pages; from block 1 on the freed root output holds them all
    assert -(-(root // 8) // page) == 13
    tail = 13 * page - root // 8
    assert -(-(root - tail) // page) == 100
    tail += 100 * page - root
    assert root // 8 - block // 8 < block and -(-(block - tail) // page) == 21
    assert copy_in_stream_bytes(ctx) == (13 + 100 + 21) * page == 2_810_183_680


def test_side_streams_add_the_gradients_and_the_copy_in_pool() -> None:
    from vramcalc.catalog import resolve_model
    from vramcalc.parallel import resolve_layout
    from vramcalc.terms.comm import copy_in_stream_bytes
    from vramcalc.terms.reserved import side_stream_bytes

    spec, _ = resolve_model("llama3-8b")
    tr = TrainingConfig(framework="torchtitan", precision="amp-bf16", seq_len=8192,
                        micro_batch_size=2, recompute="selective")
    ctx = RankContext(spec, tr, resolve_layout(spec, tr, ParallelConfig(dp=8, fsdp="full"), 8))
    grads = LLAMA3_8B_PARAMS * 4 // 8  # fp32 gradients (fp32 parameters), 1/8 each
    side = grads + copy_in_stream_bytes(ctx)
    big = 60 << 30
    assert side_stream_bytes(ctx, [(big, 0, 0)]) == side  # the loss's peak: neither held
    # a peak that holds the gradients adds the pool beside them
    assert side_stream_bytes(ctx, [(big, grads, 0), (big - side - 1, 0, 0)]) == side - grads
    # a backward peak holding a prefetched block's all-gather output holds part of the pool
    assert side_stream_bytes(ctx, [(big, 0, 1000)]) == side - 1000
    ddp = RankContext(spec, tr.model_copy(update={"framework": "reference"}),
                      ParallelConfig(dp=8))
    assert side_stream_bytes(ddp, [(big, 0, 0)]) == 0


def _traced_allocator(scn: Scenario) -> tuple[object, object]:
    from vramcalc.trace import distributed

    seen = []
    make = distributed._tracker_class

    def capture() -> type:
        cls = make()

        class Capture(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *a: object, **k: object) -> None:
                super().__init__(*a, **k)
                seen.append(self)
        return Capture

    distributed._tracker_class = capture  # type: ignore[assignment]
    try:
        result = distributed.distributed_trace(scn)
    finally:
        distributed._tracker_class = make  # type: ignore[assignment]
    return seen[0].allocator, result.report  # type: ignore[attr-defined]


@pytest.mark.parametrize("framework,precision", [("reference", "amp-bf16"),
                                                 ("torchtitan", "amp-bf16"),
                                                 ("reference", "bf16-pure")])
def test_trace_replays_each_fsdp_stream_in_its_own_pools(framework: str,
                                                         precision: str) -> None:
    # the referee: real FSDP2 under FakeTensorMode selects its streams with
    # torch.cpu.stream, and the tracker replays each stream's requests in pools of their own
    from vramcalc.parallel import resolve_layout
    from vramcalc.terms.comm import copy_in_stream_bytes
    from vramcalc.terms.gradients import gradients_at_step_bytes

    tr = TrainingConfig(seq_len=512, micro_batch_size=2, precision=precision,
                        optimizer="adamw", framework=framework)
    scn = Scenario(model=MID, training=tr, parallel=ParallelConfig(dp=4, fsdp="full"))
    ctx = RankContext(MID, tr, resolve_layout(MID, tr, scn.parallel, 4))
    pools, rep = _traced_allocator(scn)
    copy_in, reduce = pools.stream_reserved[1], pools.stream_reserved[2]  # type: ignore[attr-defined]
    assert copy_in == copy_in_stream_bytes(ctx) > 0  # forward's all-gathers come first
    # the reduce-scatter outputs: every sharded gradient, each group's in its own block
    grads = gradients_at_step_bytes(ctx)
    assert grads <= reduce <= grads + (MID.num_hidden_layers + 1) * 20 * 2**20
    assert rep.peak_reserved_bytes == pools.peak_reserved  # type: ignore[attr-defined]
    # the side pools' blocks not in use at the peak are cached, outside the fit
    cached = (rep.peak_reserved_bytes - rep.peak_allocated_bytes
              - rep.subterms["overhead/fragmentation"])
    assert 0 < cached <= copy_in + reduce
    if framework == "torchtitan":  # the peak is the loss's backward: no gradient, no gather
        assert rep.peak_phase == "backward" and rep.terms.gradients == 0
        assert cached == copy_in + reduce


def test_fsdp1_stand_in_gathers_on_the_compute_stream() -> None:
    # FSDP1 gathers into its flat parameters' own storage: the FSDP2 stand-in runs its
    # all-gathers on the current stream, so only the reduce-scatter stream is a side pool
    tr = TrainingConfig(seq_len=512, micro_batch_size=2, precision="bf16-pure",
                        optimizer="adamw", framework="torchtune")
    scn = Scenario(model=MID, training=tr.model_copy(update={
        "finetune": "lora", "lora_targets": "q,v"}), parallel=ParallelConfig(
            dp=4, fsdp="full", fsdp_impl="fsdp1"))
    pools, _ = _traced_allocator(scn)
    assert len(pools.stream_reserved) == 2  # type: ignore[attr-defined]
