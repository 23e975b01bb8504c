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
