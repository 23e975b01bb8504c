"""Property tests (hypothesis) for the invariants in STYLE.md."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vramcalc.analytic import estimate
from vramcalc.hardware import parse_gpus
from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.report import ALLOCATED_TERMS
from vramcalc.scenario import Scenario
from vramcalc.sharding import sharded_numel
from vramcalc.terms import activations as act
from vramcalc.terms.gradients import gradients_bytes
from vramcalc.terms.logits import freed_logits_bytes
from vramcalc.terms.optimizer_states import optimizer_states_bytes
from vramcalc.terms.weights import weights_bytes
from vramcalc.training import OPTIMIZERS, PRECISIONS, TrainingConfig


@st.composite
def specs(draw: st.DrawFn) -> ModelSpec:
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([16, 32, 64]))
    gpt2 = draw(st.booleans())
    return ModelSpec(
        hidden_size=heads * head_dim,
        num_hidden_layers=draw(st.integers(1, 6)),
        num_attention_heads=heads,
        num_key_value_heads=heads if gpt2 else kv,
        intermediate_size=draw(st.sampled_from([64, 256, 1000])),
        vocab_size=draw(st.integers(100, 5000)),
        max_position_embeddings=2048,
        mlp_kind="standard" if gpt2 else "gated",
        norm_kind="layernorm" if gpt2 else "rmsnorm",
        norm_bias=gpt2, attention_bias=gpt2, attention_out_bias=gpt2, mlp_bias=gpt2,
        position_embedding="learned" if gpt2 else "rope",
        tie_word_embeddings=gpt2,
    )


trainings = st.builds(
    TrainingConfig,
    seq_len=st.sampled_from([16, 64, 256, 1024]),
    micro_batch_size=st.integers(1, 4),
    grad_accum=st.integers(1, 3),
    # the reference profile's policies (the -autocast ones are HF Trainer's: test_autocast_16bit)
    precision=st.sampled_from([p for p in PRECISIONS if not p.endswith("-autocast")]),
    optimizer=st.sampled_from(OPTIMIZERS),
    attention=st.sampled_from(["flash", "eager"]),
    recompute=st.sampled_from(["none", "selective", "full"]),
)


@settings(max_examples=60, deadline=None)
@given(specs(), trainings, st.sampled_from([2, 4, 8]))
def test_zero_stage_never_increases_model_states(spec: ModelSpec, tr: TrainingConfig,
                                                 dp: int) -> None:
    if tr.optimizer == "adafactor":
        # a real exception: DeepSpeed hands the optimizer one flat 1-D partition, which
        # Adafactor cannot factor, so ZeRO-1 keeps n/N second moments instead of rows + cols
        tr = tr.model_copy(update={"optimizer": "adamw"})
    if tr.optimizer == "muon":  # refused with ZeRO (stack_rules.py `muon_problem`)
        tr = tr.model_copy(update={"optimizer": "adamw"})
    if tr.optimizer.startswith("paged-"):
        # another: paged bitsandbytes states leave the allocator only for tensors of >= 1e5
        # elements, so a small flat ZeRO partition comes back to device memory
        tr = tr.model_copy(update={"optimizer": tr.optimizer.removeprefix("paged-")})
    prev = None
    for stage in range(4):
        ctx = RankContext(spec, tr, ParallelConfig(dp=dp, zero=stage))
        states = weights_bytes(ctx) + gradients_bytes(ctx) + optimizer_states_bytes(ctx)
        if prev is not None:
            assert states <= prev
        prev = states


@settings(max_examples=60, deadline=None)
@given(specs(), trainings)
def test_recompute_never_increases_activations(spec: ModelSpec, tr: TrainingConfig) -> None:
    per = {}
    for rec in ("none", "selective", "full"):
        ctx = RankContext(spec, tr.model_copy(update={"recompute": rec}), ParallelConfig(dp=1))
        per[rec] = act.layer_activation_bytes(ctx)
    assert per["full"] <= per["selective"] <= per["none"]


@settings(max_examples=60, deadline=None)
@given(specs(), trainings, st.integers(2, 4))
def test_activations_linear_in_micro_batch(spec: ModelSpec, tr: TrainingConfig, k: int) -> None:
    one = RankContext(spec, tr.model_copy(update={"micro_batch_size": 1}), ParallelConfig(dp=1))
    many = RankContext(spec, tr.model_copy(update={"micro_batch_size": k}), ParallelConfig(dp=1))
    a1, ak = act.layer_activation_bytes(one), act.layer_activation_bytes(many)
    n_tensors = len(act.layer_saved(one))
    # each saved tensor is rounded up to 512 B once, so linearity holds within that slack
    assert abs(ak - k * a1) <= k * n_tensors * 512


@settings(max_examples=60, deadline=None)
@given(specs(), trainings)
def test_terms_are_non_negative_ints_and_add_up(spec: ModelSpec, tr: TrainingConfig) -> None:
    rep = estimate(Scenario(model=spec, training=tr))
    terms = rep.terms.as_dict()
    assert all(isinstance(v, int) and v >= 0 for v in terms.values())
    assert sum(terms[t] for t in ALLOCATED_TERMS) == rep.peak_allocated_bytes
    assert rep.peak_allocated_bytes + terms["overhead"] == rep.device_total_bytes
    assert rep.peak_allocated_bytes == max(rep.phases.values())
    assert rep.first_step_peak_bytes <= rep.peak_allocated_bytes


@settings(max_examples=40, deadline=None)
@given(specs(), trainings, st.sampled_from([1, 2, 8]), st.sampled_from([1, 2]))
def test_reserved_covers_allocated_and_makes_the_device_total(
        spec: ModelSpec, tr: TrainingConfig, gpus: int, pp: int) -> None:
    """reserved >= allocated + packing (per stage too); device total = allocated + packing
    + context + NCCL; the rest of reserved is the loss's cached block (terms/logits.py)."""
    if spec.num_hidden_layers % pp:
        pp = 1
    scn = Scenario(model=spec, training=tr, parallel=ParallelConfig(pp=pp),
                   cluster=parse_gpus(f"{gpus * pp}xH100"))
    rep = estimate(scn)
    ovh = {k.split("/", 1)[1]: v for k, v in rep.subterms.items() if k.startswith("overhead/")}
    cached = rep.peak_reserved_bytes - rep.peak_allocated_bytes - ovh["fragmentation"]
    assert ovh["fragmentation"] >= 0 and cached >= 0
    ctx = RankContext(spec, tr, scn.resolved().parallel, pp - 1)
    assert cached <= freed_logits_bytes(ctx)  # only the loss's freed block is cached
    assert rep.device_total_bytes == (rep.peak_allocated_bytes + ovh["fragmentation"]
                                      + ovh["context"] + ovh["nccl"]
                                      + ovh.get("paged_optimizer_states", 0))
    for st_ in rep.stages:
        assert st_.peak_reserved_bytes >= st_.peak_allocated_bytes


@given(st.integers(1, 10**12), st.integers(1, 4096))
def test_sharding_never_undercounts(numel: int, degree: int) -> None:
    assert sharded_numel(numel, degree) * degree >= numel
    assert (sharded_numel(numel, degree) - 1) * degree < numel
