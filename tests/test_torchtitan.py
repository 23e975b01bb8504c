"""The torchtitan profile (`--framework torchtitan`): torchtitan's Llama and its activation
checkpointing modes, checked against torchtitan's source and the trace engine.

Source: pytorch/torchtitan 9dec370ad26b5f8e9a7333a0e36165018262644b (Dec 2024):
- torchtitan/parallelisms/parallelize_llama.py `_save_list` (aten.mm, SDPA efficient /
  flash, reduce_scatter_tensor, abs, max) and `_apply_ac_to_transformer_block`: per-op SAC
  saves the outputs of those ops "except every second mm" (`meta[mm_count_key] % 2 == 0`
  is recomputed, the count per checkpointed call, forward and recompute apart); an int
  option N wraps a block when `ptd_checkpoint_wrapper._count % ac_freq == 0` after
  `_count += 1`; mode "full" wraps every block;
- torchtitan/models/llama/model.py: the mm call order of a block is wq, wk, wv
  (Attention.forward: `self.wq(x), self.wk(x), self.wv(x)`), wo, then w1, w3, w2
  (FeedForward.forward: `self.w2(F.silu(self.w1(x)) * self.w3(x))`), so SAC keeps wq, wv,
  w1 and w2's outputs; `repeat_kv` copies k and v for GQA; RoPE in fp32 complex numbers
  against the complex64 `freqs_cis` buffer of (max_seq_len, head_dim / 2);
- torchtitan/optimizer.py `build_optimizers`: `"fused": fused, "foreach": not fused` with
  --optimizer.fused False by default (config_manager.py): foreach AdamW.

The trace engine (vramcalc/trace/titan_model.py) runs that model with torch's own
`create_selective_checkpoint_contexts` and the policy written from the source; the analytic
profile (vramcalc/terms/torchtitan.py) must agree with it.
"""

from __future__ import annotations

import pytest

from vramcalc.analytic import estimate
from vramcalc.cli import main
from vramcalc.errors import InputError
from vramcalc.hardware import parse_gpus
from vramcalc.model import ModelSpec
from vramcalc.options import build_scenario
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import torchtitan as tt
from vramcalc.training import TrainingConfig

# b = 2, s = 256, h = 256, a = 8 heads of d = 32 (48 for "hd"), g = 2 kv heads, f = 768
GQA = ModelSpec(name="tt-gqa", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=768, vocab_size=1000)
HD = GQA.model_copy(update={"name": "tt-hd", "head_dim": 48})
MHA = ModelSpec(name="tt-mha", hidden_size=192, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=6, intermediate_size=512, vocab_size=3000)
MODES = {"none": ("none", None), "full": ("full", None), "op": ("selective", None),
         "every2": ("selective", 2), "every3": ("selective", 3)}


def _scenario(spec: ModelSpec, mode: str, fsdp: bool = False, **kw: object) -> Scenario:
    rec, every = MODES[mode]
    tr = TrainingConfig(seq_len=256, micro_batch_size=2, framework="torchtitan",
                        precision="amp-bf16" if fsdp else "fp32", recompute=rec,
                        recompute_every=every, **kw)
    if fsdp:
        return Scenario(model=spec, training=tr, parallel=ParallelConfig(fsdp="full"),
                        cluster=parse_gpus("4xH100"))
    return Scenario(model=spec, training=tr, cluster=parse_gpus("1xH100"))


# ---- from the source, by hand ------------------------------------------------------------
def test_op_sac_keeps_every_odd_mm_of_a_block() -> None:
    """The policy over one block's op sequence: mm 1, 3, 5, 7 (wq, wv, w1, w2) saved, the
    SDPA kernel saved, the rest recomputed; the recompute pass counts on its own."""
    pytest.importorskip("torch")
    import torch

    from vramcalc.trace.titan_model import op_sac_policy

    aten = torch.ops.aten
    must = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE

    class Ctx:
        is_recompute = False

    ops = [aten._to_copy.default, aten.mm.default, aten.mm.default, aten.mm.default,
           aten.mul.Tensor, aten._scaled_dot_product_efficient_attention.default,
           aten.mm.default, aten.add.Tensor, aten.mm.default, aten.silu.default,
           aten.mm.default, aten.mul.Tensor, aten.mm.default]
    names = ["norm", "wq", "wk", "wv", "rope", "sdpa", "wo", "residual", "w1", "silu",
             "w3", "act*up", "w2"]
    for recompute in (False, True):
        policy, ctx = op_sac_policy(), Ctx()
        ctx.is_recompute = recompute
        saved = [n for n, op in zip(names, ops, strict=True) if policy(ctx, op) == must]
        assert saved == ["wq", "wv", "sdpa", "w1", "w2"]


def test_op_sac_saved_set_by_hand() -> None:
    """Per block: the checkpoint input (b, s, h), wq (b, s, a·d), wv (b, s, g·d), the SDPA
    output (b, s, a, d) and fp32 logsumexp (b, a, s), w1 (b, s, f), w2 (b, s, h); bf16
    under FSDP2's mixed precision."""
    scn = _scenario(GQA, "op", fsdp=True).resolved()
    ctx = RankContext(scn.model, scn.training, scn.parallel)
    b, s, h, a, g, d, f = 2, 256, 256, 8, 2, 32, 768
    got = {t.name: t.nbytes for t in tt.layer_saved(ctx)}
    assert got == {"layer.input": b * s * h * 2, "sac.wq": b * s * a * d * 2,
                   "sac.wv": b * s * g * d * 2, "attn.out": b * s * a * d * 2,
                   "attn.lse": b * a * s * 4, "sac.w1": b * s * f * 2, "sac.w2": b * s * h * 2}


def test_op_sac_under_tensor_parallelism_by_hand() -> None:
    """TP 2 with sequence parallelism (torchtitan's apply_tp): the mm outputs are the
    local column shards (wq a/t·d, wv g/t·d, w1 f/t) or, for w2, the (b, s, h) partial sums;
    the block input is sequence-sharded (b, s/t, h); the two RowwiseParallel
    reduce_scatter_tensor outputs (b, s/t, h) are in the save list."""
    scn = build_scenario({"model": "llama3-8b", "gpus": "4xH100", "framework": "torchtitan",
                          "precision": "amp-bf16", "fsdp": "full", "tp": 2,
                          "sequence_parallel": True, "recompute": "selective",
                          "seq_len": 1024, "micro_batch_size": 1})
    ctx = RankContext(scn.model, scn.training, scn.parallel)
    b, s, h, a, g, d, f, t = 1, 1024, 4096, 32, 8, 128, 14336, 2
    got = {t_.name: t_.nbytes for t_ in tt.layer_saved(ctx)}
    assert got == {"layer.input": b * s // t * h * 2, "sac.wq": b * s * a // t * d * 2,
                   "sac.wv": b * s * g // t * d * 2, "attn.out": b * s * a // t * d * 2,
                   "attn.lse": b * a // t * s * 4, "sac.w1": b * s * f // t * 2,
                   "sac.w2": b * s * h * 2, "sac.reduce_scatter": 2 * (b * s // t * h * 2)}


def test_no_ac_block_by_hand() -> None:
    """fp32 (no FSDP: torchtitan computes in fp32): RMSNorm's x.float() is the input itself,
    type_as returns the normalised tensor: x, rstd, x̂ per norm; the projections' input;
    rotated q; repeat_kv copies of k and v (GQA); SDPA output + logsumexp; w1, w3, silu and
    product outputs + the MLP input."""
    scn = _scenario(GQA, "none").resolved()
    ctx = RankContext(scn.model, scn.training, scn.parallel)
    b, s, h, a, d, f = 2, 256, 256, 8, 32, 768
    bsh, bsad, bsf = b * s * h * 4, b * s * a * d * 4, b * s * f * 4
    norm = 2 * bsh + b * s * 4
    expected = 2 * norm + bsh + 3 * bsad + bsad + b * a * s * 4 + bsh + 4 * bsf
    assert sum(t.nbytes for t in tt.layer_saved(ctx)) == expected == 11_554_816


def test_per_layer_sac_wraps_every_nth_block() -> None:
    pytest.importorskip("torch")
    from vramcalc.trace.titan_model import checkpoint_modes

    assert checkpoint_modes(4, "selective", 2) == ["none", "full", "none", "full"]
    assert checkpoint_modes(5, "selective", 3) == ["none", "none", "full", "none", "none"]
    assert checkpoint_modes(3, "selective", 1) == ["full"] * 3
    for n in (1, 2, 3):
        scn = _scenario(GQA, "every2").resolved().model_copy(update={
            "training": TrainingConfig(framework="torchtitan", recompute="selective",
                                       recompute_every=n, seq_len=256, precision="fp32")})
        ctx = RankContext(scn.model, scn.training, scn.parallel)
        assert list(tt.checkpointed(ctx)) == [m == "full" for m in checkpoint_modes(
            4, "selective", n)]


def test_freqs_cis_buffer() -> None:
    """(max_seq_len = seq_len, d/2) complex64 on every rank: 256 · 16 · 8 bytes."""
    rep = estimate(_scenario(GQA, "op"))
    assert rep.subterms["weights/buffers"] == 256 * 16 * 8


def test_foreach_adamw_by_default() -> None:
    tr = TrainingConfig(framework="torchtitan", precision="amp-bf16")
    assert tr.step_impl == "foreach"
    assert tr.model_copy(update={"optimizer_impl": "fused"}).step_impl == "fused"


def test_op_sac_is_between_full_and_none() -> None:
    """Llama 3.1 8B, FSDP 8, seq 8192, batch 2 (the calibration record's setting)."""
    peaks = {}
    for rec in ("none", "selective", "full"):
        scn = build_scenario({"model": "llama3.1-8b", "gpus": "8xH100", "fsdp": "full",
                              "precision": "amp-bf16", "seq_len": 8192,
                              "micro_batch_size": 2, "framework": "torchtitan",
                              "recompute": rec})
        peaks[rec] = estimate(scn).terms.activations
    assert peaks["full"] < peaks["selective"] < peaks["none"]


# ---- analytic against the trace ----------------------------------------------------------
SINGLE = [(spec, mode) for spec in (GQA, HD, MHA) for mode in MODES]


@pytest.mark.parametrize(("spec", "mode"), SINGLE,
                         ids=[f"{s.name}-{m}" for s, m in SINGLE])
def test_single_rank_matches_trace(spec: ModelSpec, mode: str) -> None:
    """Every phase's peak within 1 KiB (int() of fractional gradient shares), and the end of
    the forward exact (what each block keeps)."""
    pytest.importorskip("torch")
    from vramcalc.trace.engine import trace
    from vramcalc.validate import analytic_points, trace_points

    scn = _scenario(spec, mode)
    res, ana = trace(scn), estimate(scn)
    for phase, t in res.report.phases.items():
        assert abs(ana.phases[phase] - t) <= 1024, (phase, ana.phases[phase], t)
    a, t = analytic_points(scn), trace_points(res)
    for term in ("weights", "gradients", "optimizer_states", "activations", "logits"):
        assert a[term] == t[term], term


def test_trace_keeps_the_op_sac_set_per_block() -> None:
    """The trace's end-of-forward activations grow by the hand-derived op-SAC set per block
    (fp32: 3,817,472 bytes = input + wq + wv + SDPA out + logsumexp + w1 + w2)."""
    pytest.importorskip("torch")
    from vramcalc.trace.engine import trace

    def kept(layers: int) -> int:
        spec = GQA.model_copy(update={"num_hidden_layers": layers})
        return trace(_scenario(spec, "op")).marks["end_forward"].parts["activations"]

    b, s, h, a, g, d, f = 2, 256, 256, 8, 2, 32, 768
    per_block = 4 * (b * s * h * 3 + b * s * a * d + b * s * g * d + b * a * s + b * s * f)
    assert (kept(4) - kept(2)) // 2 == per_block == 3_817_472


FSDP = [(GQA, "none"), (GQA, "full"), (GQA, "op"), (GQA, "every2"), (MHA, "op"),
        (HD, "every3")]
# the shared FSDP2 backward model's gap when a block is recomputed (the reference profile's
# FSDP + full recompute shows the same ~0.4%: vramcalc.terms.comm.reduce_bytes)
FSDP_PEAK_REL = 0.005


@pytest.mark.parametrize(("spec", "mode"), FSDP, ids=[f"{s.name}-{m}" for s, m in FSDP])
def test_fsdp_matches_trace(spec: ModelSpec, mode: str) -> None:
    pytest.importorskip("torch")
    from vramcalc.trace.distributed import distributed_trace
    from vramcalc.validate import analytic_points, trace_points

    scn = _scenario(spec, mode, fsdp=True)
    res, ana = distributed_trace(scn), estimate(scn)
    assert ana.phases["forward"] == res.report.phases["forward"]
    err = ana.peak_allocated_bytes / res.report.peak_allocated_bytes - 1
    assert abs(err) <= FSDP_PEAK_REL, err
    a, t = analytic_points(scn), trace_points(res)
    for term in ("weights", "gradients", "optimizer_states", "activations"):
        assert a[term] == t[term], term


# ---- what the profile refuses ------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    {"precision": "bf16"}, {"precision": "amp-bf16"}, {"optimizer": "sgd"},
    {"attention": "eager"}, {"finetune": "lora"}, {"zero": 1}, {"tp": 2},
    {"optimizer_impl": "loop"}, {"model": "gpt2"}, {"fsdp": "full", "pp": 2},
])
def test_refused(bad: dict[str, object]) -> None:
    values = {"model": "llama3-8b", "gpus": "8xH100", "framework": "torchtitan",
              "precision": "fp32", "fsdp": "none", **bad}
    with pytest.raises(InputError, match="torchtitan"):
        build_scenario(values)


def test_recompute_every_needs_torchtitan_and_selective() -> None:
    with pytest.raises(InputError, match="only the torchtitan profile"):
        build_scenario({"model": "8b", "gpus": "1xH100", "recompute": "selective",
                        "recompute_every": 2})
    with pytest.raises(InputError, match="needs --recompute selective"):
        build_scenario({"model": "8b", "gpus": "1xH100", "framework": "torchtitan",
                        "precision": "fp32", "recompute": "full", "recompute_every": 2})


def test_cli_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "8b", "--gpus", "8xH100", "--framework",
                 "torchtitan", "--precision", "bf16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:")


def test_plan_proposes_torchtitan_layouts_only() -> None:
    from vramcalc.cli.plan import prepare_plan
    from vramcalc.planner import search

    base, req, _ = prepare_plan({"model": "llama3.1-8b", "gpus": "8xH100",
                                 "framework": "torchtitan", "precision": "amp-bf16",
                                 "seq_len": 4096}, top=50)
    result = search(base, req)
    assert result.entries
    for e in result.entries:
        par = e.scenario.parallel
        assert par.zero == 0 and par.ep == 1
        assert par.fsdp != "none" or (par.tp == par.pp == par.cp == 1)
        assert par.tp == 1 or par.sequence_parallel
        assert (par.fsdp == "grad-op") == (par.pp > 1)
        assert e.scenario.training.precision == "amp-bf16"


def test_plan_defaults_to_torchtitans_own_run() -> None:
    """Without --precision the stack's mixed precision (torchtitan 9dec370 config_manager.py:
    mixed_precision_param bfloat16 over fp32 parameters); without pipelining its data
    parallelism is FSDP2 full sharding (data_parallel_shard_degree -1), so `plan` must offer
    dp8 with --fsdp full, also when --fsdp full is pinned."""
    from vramcalc.cli.plan import prepare_plan
    from vramcalc.planner import search

    for pinned in ({}, {"fsdp": "full", "pp": 1}):
        base, req, _ = prepare_plan({"model": "llama3.1-8b", "gpus": "8xH100",
                                     "framework": "torchtitan", "seq_len": 4096, **pinned},
                                    top=50)
        entries = search(base, req).entries
        assert base.training.precision == "amp-bf16"
        assert any(e.scenario.parallel.fsdp == "full" and e.scenario.parallel.pp == 1
                   and e.scenario.parallel.dp_degree == 8 for e in entries)
    assert build_scenario({"model": "8b", "gpus": "1xA100-80GB",
                           "framework": "torchtune"}).training.precision == "bf16-pure"


# ---- FSDP2 under pipelining: gradients accumulate unsharded ----------------------------------
# torch/distributed/pipelining/stage.py `backward_maybe_with_nosync` turns gradient sync off
# for every micro-batch's backward of an FSDPModule stage and calls post_backward with it on
# after the last one; with sync off FSDP2 keeps `unsharded_accumulated_grad` in the reduce
# dtype (fp32 under torchtitan's MixedPrecisionPolicy).
LLAMA31_8B_EMBED = 128_256 * 4096  # model card shapes; every dim 0 divides by 4
LLAMA31_8B_LAYER = 218_112_000


def test_pipelined_fsdp_stage_holds_every_gradient_unsharded_until_the_step() -> None:
    from vramcalc.terms.gradients import (
        gradients_at_step_bytes,
        gradients_bytes,
        layer_gradient_bytes,
        pipelined_fsdp,
    )

    scn = build_scenario({"model": "llama3.1-8b", "gpus": "8xH100", "framework": "torchtitan",
                          "precision": "amp-bf16", "fsdp": "grad-op", "pp": 2,
                          "seq_len": 8192, "micro_batch_size": 1, "num_microbatches": 2,
                          "recompute": "full"}).resolved()
    first = RankContext(scn.model, scn.training, scn.parallel, 0)
    assert pipelined_fsdp(first) and scn.parallel.dp == 4
    # stage 0: the embedding and 16 of the 32 blocks, fp32, whole on every rank
    unsharded = (LLAMA31_8B_EMBED + 16 * LLAMA31_8B_LAYER) * 4
    assert gradients_bytes(first) == unsharded == 16_060_514_304
    assert layer_gradient_bytes(first) == LLAMA31_8B_LAYER * 4
    assert gradients_at_step_bytes(first) == unsharded // 4  # reduce-scattered over dp 4
    rep = estimate(scn)
    assert rep.peak_phase == "backward"
    assert rep.stages[0].terms.gradients == unsharded  # the backward peak holds them all
    # one pipeline stage of the same model without pipelining shards them as it goes
    flat = build_scenario({"model": "llama3.1-8b", "gpus": "8xH100", "framework": "reference",
                           "precision": "amp-bf16", "fsdp": "grad-op", "pp": 2,
                           "seq_len": 8192, "recompute": "full"}).resolved()
    assert not pipelined_fsdp(RankContext(flat.model, flat.training, flat.parallel, 0))


# ---- torchtitan's own pipeline split ----------------------------------------------------------
# torchtitan 9dec370 torchtitan/parallelisms/pipelining_utils.py `generate_split_points` (no
# --experimental.pipeline_parallel_split_points): the first stage L // S layers, the middle
# stages one more while L mod S lasts, the last stage the rest; stage s runs on rank s mod pp
# (`stage_ids_this_rank`, style "loop").
def test_torchtitan_default_split_by_hand() -> None:
    from vramcalc.stack_rules import torchtitan_stage_layers

    assert torchtitan_stage_layers(126, 8) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert torchtitan_stage_layers(126, 16) == (7,) + (8,) * 14 + (7,)
    assert torchtitan_stage_layers(28, 8) == (3, 4, 4, 4, 4, 3, 3, 3)  # 28 = 8 x 3 + 4
    assert torchtitan_stage_layers(32, 8) == (4,) * 8


@pytest.mark.parametrize(("schedule", "per_rank"), [
    ({}, [15, 16, 16, 16, 16, 16, 16, 15]),
    # rank r holds stages r and r + 8 of 7 + 14 x 8 + 7
    ({"pp_schedule": "interleaved", "virtual_stages": 2}, [15, 16, 16, 16, 16, 16, 16, 15]),
])
def test_llama31_405b_splits_over_8_pipeline_ranks_as_torchtitan_does(
        schedule: dict[str, object], per_rank: list[int]) -> None:
    from vramcalc.sharding import pipeline_chunks, stage_layers

    scn = build_scenario({"model": "llama3.1-405b", "gpus": "512xH100", "framework": "torchtitan",
                          "precision": "amp-bf16", "fsdp": "grad-op", "tp": 8, "pp": 8,
                          "sequence_parallel": True, "recompute": "full", "seq_len": 8192,
                          "micro_batch_size": 4, "num_microbatches": 8, **schedule}).resolved()
    par = scn.parallel
    assert par.stage_layers is not None and sum(par.stage_layers) == 126
    assert [stage_layers(scn.model, par, r) for r in range(8)] == per_rank
    if schedule:
        assert pipeline_chunks(scn.model, par)[0][0] == 7  # stage 0
        assert pipeline_chunks(scn.model, par)[1][0] == 8  # stage 8, rank 0's second chunk
    rep = estimate(scn)
    assert [s.num_layers for s in rep.stages] == per_rank


def test_other_profiles_keep_the_even_split_rule() -> None:
    with pytest.raises(InputError, match="not divisible by pp x virtual stages"):
        build_scenario({"model": "llama3.1-405b", "gpus": "512xH100", "framework": "reference",
                        "tp": 8, "pp": 8, "seq_len": 4096}).resolved()
    scn = build_scenario({"model": "llama3.1-405b", "gpus": "512xH100", "framework": "torchtitan",
                          "precision": "amp-bf16", "fsdp": "grad-op", "tp": 8, "pp": 8,
                          "sequence_parallel": True, "seq_len": 4096}).resolved()
    bad = scn.parallel.model_copy(update={"stage_layers": (16,) * 8})  # 128 layers, not 126
    with pytest.raises(InputError, match="summing to num_hidden_layers=126"):
        Scenario(model=scn.model, training=scn.training, parallel=bad,
                 cluster=scn.cluster).resolved()


SPLIT_405B = "15,16,16,16,16,16,16,15"


def test_stage_layers_flag_gives_any_profile_a_split(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    base = ["estimate", "--model", "llama3.1-405b", "--gpus", "512xH100", "--tp", "8",
            "--pp", "8", "--seq-len", "4096", "--json"]
    titan = ["--framework", "torchtitan", "--fsdp", "grad-op", "--sequence-parallel",
             "--recompute", "full"]
    reports = []
    for extra in (titan, [*titan, "--stage-layers", SPLIT_405B], ["--stage-layers", SPLIT_405B]):
        assert main([*base, *extra]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    # the flag states torchtitan's own split: the same bytes
    assert reports[0]["strategy"]["stage_layers"] == [15, 16, 16, 16, 16, 16, 16, 15]
    assert reports[0]["peak_reserved_bytes"] == reports[1]["peak_reserved_bytes"]
    assert reports[2]["strategy"]["stage_layers"] == [15, 16, 16, 16, 16, 16, 16, 15]


@pytest.mark.parametrize(("value", "words"), [
    ("15,16", "give pp x virtual stages = 8 counts"),
    ("16,16,16,16,16,16,16,16", "summing to num_hidden_layers=126"),
    ("0,126", "positive layer counts"), ("a,b", "positive layer counts"),
    ("1.5,2", "positive layer counts"), ("", "positive layer counts"),
    ("9" * 5000, "positive layer counts"),
])
def test_bad_stage_layers_get_one_error_line(value: str, words: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "llama3.1-405b", "--gpus", "512xH100", "--tp", "8",
                 "--pp", "8", "--stage-layers", value])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and words in err


def test_plan_keeps_a_given_stage_split_on_every_layout(
        capsys: pytest.CaptureFixture[str]) -> None:
    import json

    code = main(["plan", "--model", "llama3.1-405b", "--gpus", "64x8xH100", "--stage-layers",
                 SPLIT_405B, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["candidates"]
    for entry in out["candidates"]:
        assert entry["strategy"]["pp"] == 8
        assert entry["strategy"]["stage_layers"] == [15, 16, 16, 16, 16, 16, 16, 15]
