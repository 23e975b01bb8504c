"""Property tests (hypothesis) for parallel layouts: the invariants STYLE.md lists.

- A higher ZeRO stage (or FSDP sharding) never increases the per-rank model states
  (weights + gradients + optimizer states). The allocated *peak* can grow: DeepSpeed's
  default reduce bucket (5e8 elements) and ZeRO-3's gathered parameters outweigh the savings
  on small models (DeepSpeed issue #5305, DeepSpeedExamples #284), which vramcalc reproduces.
- Sharding never under-counts: degree x shard >= whole, for every layout and split.
- Terms are non-negative ints that add up, on every pipeline stage.
- The candidate stages contain the worst rank.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vramcalc.analytic import estimate
from vramcalc.errors import InputError
from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.report import ALLOCATED_TERMS
from vramcalc.scenario import Scenario
from vramcalc.sharding import dim0_numel, rank_shapes
from vramcalc.terms.gradients import gradients_bytes
from vramcalc.terms.optimizer_states import optimizer_states_bytes
from vramcalc.terms.weights import weights_bytes
from vramcalc.training import TrainingConfig
from vramcalc.units import DTYPE_BITS


@st.composite
def specs(draw: st.DrawFn) -> ModelSpec:
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([2, 4]))
    moe = draw(st.booleans())
    layers = draw(st.sampled_from([4, 8, 12]))
    return ModelSpec(
        hidden_size=heads * draw(st.sampled_from([16, 32, 64])),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=draw(st.sampled_from([64, 256, 1000])),
        vocab_size=draw(st.integers(100, 5000)),
        tie_word_embeddings=draw(st.booleans()),
        num_local_experts=8 if moe else 0,
        num_experts_per_tok=2 if moe else 0,
        moe_intermediate_size=128 if moe else None,
        first_k_dense_replace=draw(st.sampled_from([0, 1, 3])) if moe else 0,
    )


trainings = st.builds(
    TrainingConfig,
    seq_len=st.sampled_from([64, 256, 1024]),
    micro_batch_size=st.integers(1, 3),
    grad_accum=st.sampled_from([1, 2, 4]),
    precision=st.sampled_from(["bf16", "fp16", "fp32", "amp-bf16", "bf16-pure"]),
    optimizer=st.sampled_from(["adamw", "sgd-momentum", "lion", "adamw-8bit"]),
    recompute=st.sampled_from(["none", "selective", "full"]),
    framework=st.sampled_from(["reference", "hf"]),
)


def _states(spec: ModelSpec, tr: TrainingConfig, par: ParallelConfig) -> int:
    ctx = RankContext(spec, tr, par)
    return weights_bytes(ctx) + gradients_bytes(ctx) + optimizer_states_bytes(ctx)


@settings(max_examples=80, deadline=None)
@given(specs(), trainings, st.sampled_from([2, 4, 8]), st.sampled_from([1, 2]))
def test_sharding_stage_never_increases_model_states(spec: ModelSpec, tr: TrainingConfig,
                                                     dp: int, tp: int) -> None:
    chains = [
        [ParallelConfig(dp=dp, tp=tp, zero=z) for z in range(4)],  # DDP, DeepSpeed 1-3
        [ParallelConfig(dp=dp, tp=tp), ParallelConfig(dp=dp, tp=tp, fsdp="grad-op")],
        [ParallelConfig(dp=dp, tp=tp, fsdp="grad-op"), ParallelConfig(dp=dp, tp=tp, fsdp="full")],
    ]
    for chain in chains:
        values = [_states(spec, tr, p) for p in chain]
        assert values == sorted(values, reverse=True), (chain, values)
    meg = tr.model_copy(update={"framework": "megatron"})
    assert _states(spec, meg, ParallelConfig(dp=dp, tp=tp, zero=1)) <= _states(
        spec, meg, ParallelConfig(dp=dp, tp=tp))


@settings(max_examples=80, deadline=None)
@given(specs(), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]),
       st.sampled_from([1, 2]), st.sampled_from([1, 2, 3, 8, 64]),
       st.sampled_from(["tensor", "dim0", "flat", "persist"]), st.sampled_from(["bf16", "fp32"]))
def test_sharding_never_undercounts(spec: ModelSpec, tp: int, pp: int, v: int, n: int,
                                    layout: str, dtype: str) -> None:
    if spec.num_hidden_layers % (pp * v) or spec.num_attention_heads % tp or (
            spec.kv_heads % tp and tp % spec.kv_heads) or (v > 1 and pp == 1):
        return
    ep = 2 if spec.is_moe else 1
    par = ParallelConfig(tp=tp, pp=pp, ep=ep, pp_schedule="interleaved" if v > 1 else "1f1b",
                         virtual_stages=v)
    held = 0
    for stage in range(pp):
        shapes = rank_shapes(spec, par, stage)
        exact = sum(t.numel * t.count for t in shapes.tensors) * DTYPE_BITS[dtype] // 8
        assert shapes.nbytes(dtype, n, n, layout) * n >= exact  # type: ignore[arg-type]
        for t in shapes.tensors:
            assert dim0_numel(t, n) * n >= t.numel
            held += t.numel * t.count * (ep if t.is_expert else 1)
    copies = spec.vocab_size * spec.hidden_size if (spec.tie_word_embeddings and pp > 1) else 0
    assert held * tp >= spec.num_params + copies


layouts = st.sampled_from([
    {"dp": 4}, {"dp": 4, "zero": 1}, {"dp": 4, "zero": 2}, {"dp": 4, "zero": 3},
    {"dp": 4, "fsdp": "full"}, {"dp": 4, "fsdp": "grad-op"},
    {"dp": 4, "fsdp": "hybrid", "shard_group": 2},
    {"dp": 2, "tp": 2, "sequence_parallel": True},
    {"dp": 1, "pp": 4, "num_microbatches": 8},
    {"dp": 1, "pp": 2, "pp_schedule": "interleaved", "virtual_stages": 2, "num_microbatches": 4},
    {"dp": 1, "pp": 4, "pp_schedule": "gpipe", "num_microbatches": 4},
    {"dp": 2, "pp": 2, "zero": 1, "num_microbatches": 4},
    {"dp": 2, "cp": 2}, {"dp": 4, "ep": 2}, {"dp": 4, "ep": 4, "zero": 1},
    {"dp": 4, "zero": 3, "offload": ("optimizer", "params")},
    {"dp": 4, "fsdp": "full", "offload": ("params",)},
])


@settings(max_examples=120, deadline=None)
@given(specs(), trainings, layouts)
def test_terms_are_non_negative_ints_on_every_stage(spec: ModelSpec, tr: TrainingConfig,
                                                    lay: dict) -> None:
    try:
        scn = Scenario(model=spec, training=tr, parallel=ParallelConfig(**lay)).resolved()
    except InputError:
        return  # a layout this model cannot take (e.g. ep on a dense model)
    rep = estimate(scn)
    terms = rep.terms.as_dict()
    assert all(isinstance(v, int) and v >= 0 for v in terms.values())
    assert sum(terms[t] for t in ALLOCATED_TERMS) == rep.peak_allocated_bytes
    assert rep.peak_allocated_bytes == max(rep.phases.values())
    for stage in rep.stages:
        st_terms = stage.terms.as_dict()
        assert all(isinstance(v, int) and v >= 0 for v in st_terms.values())
        assert stage.device_total_bytes <= rep.device_total_bytes
    if scn.parallel.pp > 1:
        assert len(rep.stages) == scn.parallel.pp
        fast = estimate(scn, every_stage=False)
        assert fast.device_total_bytes == rep.device_total_bytes
