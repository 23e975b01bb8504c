"""The planner on multi-latent attention models (DeepSeek-V2/V3): only layouts the profile's
MLA activations cover (the estimate's own `mla_unsupported`), a memory lower bound that stays
below the estimate, plan entries equal to `estimate`, and the speed model's MLA and
multi-token-prediction FLOPs derived by hand.

Sources: DeepSeek-V2 (arXiv:2405.04434) §2.1.2-2.1.3: per head, q·kᵀ over the
qk_nope_head_dim + qk_rope_head_dim wide q/k heads (eq. 17-18: [q^C; q^R], [k^C; k^R]) and
the attention weights times v over v_head_dim (eq. 19); NVIDIA/Megatron-LM d98e8a64
megatron/core/transformer/multi_latent_attention.py builds the core with k_channels =
q_head_dim and v_channels = v_head_dim. DeepSeek-V3 (arXiv:2412.19437) §2.2: each MTP
module is a shared embedding, a projection M (2h -> h), one transformer block and the
shared output head. DeepSeek-V3 config.json (tests/test_catalog.py DEEPSEEK_V3).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from test_catalog import DEEPSEEK_V2_LITE, DEEPSEEK_V3
from test_mla import SMALL_V3

from vramcalc.catalog import resolve_model
from vramcalc.cli import main
from vramcalc.cli.plan import prepare_plan
from vramcalc.errors import InputError
from vramcalc.flops import attention_width, model_flops_per_token, recompute_flops_per_token
from vramcalc.hardware import resolve_gpu
from vramcalc.hf_config import from_hf_config
from vramcalc.planner import (
    LOWER_BOUND_MARGIN,
    MemoryBound,
    enumerate_candidates,
    estimate_candidate,
    search,
)
from vramcalc.planner.candidates import scenario_for
from vramcalc.render.plan import strategy_flags
from vramcalc.scenario import mla_unsupported
from vramcalc.speed import SpeedModel, scenario_speed

V3 = from_hf_config(DEEPSEEK_V3, "DeepSeek-V3 config.json")


@pytest.fixture(scope="module")
def small_v3(tmp_path_factory: pytest.TempPathFactory) -> str:
    """SMALL_V3 (tests/test_mla.py: 4 layers, 8 heads, 8 routed experts) as a config.json."""
    path = tmp_path_factory.mktemp("mla") / "config.json"
    path.write_text(json.dumps(SMALL_V3))
    return str(path)


@pytest.fixture(scope="module")
def v2_lite(tmp_path_factory: pytest.TempPathFactory) -> str:
    """DeepSeek-V2-Lite's config.json (tests/test_catalog.py): 27 layers, 16 heads, no q
    compression, 64 routed experts."""
    path = tmp_path_factory.mktemp("v2lite") / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V2_LITE))
    return str(path)


def _prepare(case: dict[str, Any], model: str, lite: str = "") -> tuple[Any, Any]:
    values = {k: v for k, v in case.items() if k not in ("allow", "global_batch_size")}
    if values["model"] == "small":
        values["model"] = model
    elif values["model"] == "v2-lite":
        values["model"] = lite
    base, req, _ = prepare_plan(values, case.get("global_batch_size"), allow=case.get("allow"))
    return base, req


# ---- candidates: the estimate's predicate, nothing else ----------------------------------
@pytest.mark.parametrize(("framework", "tps", "allow"), [
    ("megatron", {1, 2, 4, 8}, "precision,optimizer"),
    ("reference", {1}, "precision,optimizer,finetune"),
])
def test_candidates_are_the_layouts_the_estimate_accepts(small_v3: str, framework: str,
                                                         tps: set[int], allow: str) -> None:
    """Every candidate of an MLA model estimates (none rejected for MLA); tp spans what the
    profile covers (megatron: every divisor of the 8 heads; reference: 1) and cp stays 1;
    FP8 and fine-tuning, which the MLA tables do not cover, are not proposed; a layout
    left out is one the estimate refuses with its MLA message."""
    base, req = _prepare({"framework": framework, "gpus": "8xH100", "seq_len": 1024,
                          "allow": allow, "model": "small"}, small_v3)
    cands, total, _ = enumerate_candidates(base, req)
    assert len(cands) == total > 50
    assert {c.tp for c in cands} == tps
    assert {c.cp for c in cands} == {1}
    assert "fp8" not in {c.prec for c in cands} and {c.ft for c in cands} <= {"full"}
    assert {c.prec for c in cands} > {"bf16"}  # --allow precision did search others
    for c in random.Random(2).sample(cands, 40):
        assert mla_unsupported(scenario_for(c, base)) is None
        assert estimate_candidate(c, base, req) is not None, c
    # what was left out, the estimate refuses, naming the MLA reason
    c0 = next(c for c in cands if c.tp == 1 and c.pp == 1 and c.ep == 1 and c.dp == 8)
    c = c0._replace(tp=2, dp=4, sp=True) if framework == "reference" else (
        c0._replace(cp=2, dp=4))
    with pytest.raises(InputError, match="multi-latent attention"):
        scenario_for(c, base)


def test_dense_models_keep_fp8_and_cp() -> None:
    """The MLA filter leaves other models alone: a dense model's search still offers FP8 and
    context parallelism on the same cluster."""
    base, req = _prepare({"model": "llama3.2-1b", "gpus": "8xH100", "seq_len": 8192,
                          "framework": "megatron", "allow": "precision"}, "")
    cands, _, _ = enumerate_candidates(base, req)
    assert "fp8" in {c.prec for c in cands} and max(c.cp for c in cands) > 1


@pytest.mark.parametrize(("framework", "held"), [("megatron", "cp"), ("reference", "tp and cp")])
def test_plan_notes_name_the_held_axes(framework: str, held: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "deepseek-v3", "--gpus", "32x8xH100", "--framework",
                 framework, "--json"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"without {held} > 1" in err and "mla_unsupported" in err


@pytest.mark.parametrize("argv", [
    ["--precision", "fp8"], ["--finetune", "lora"],
])
def test_settings_no_layout_covers_are_refused_with_the_estimates_message(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "deepseek-v3", "--gpus", "32x8xH100", "--framework",
                 "megatron", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: deepseek-v3: multi-latent attention's activations are "
                          "modelled for --framework megatron") and len(err.splitlines()) == 1


# ---- the memory lower bound --------------------------------------------------------------
MLA_BOUND_CASES = [
    {"model": "small", "gpus": "8xH100", "seq_len": 2048, "framework": "megatron",
     "allow": "optimizer,offload"},
    {"model": "small", "gpus": "8xH100", "seq_len": 2048, "framework": "megatron",
     "mtp_layers": 1, "allow": "optimizer"},
    {"model": "small", "gpus": "4xH100", "seq_len": 2048, "framework": "reference",
     "allow": "optimizer,offload"},
    # 27 layers: pp 3 on 24 GPUs
    {"model": "v2-lite", "gpus": "3x8xH100", "seq_len": 4096, "framework": "megatron",
     "global_batch_size": 48},
    {"model": "deepseek-v3", "gpus": "32x8xH100", "framework": "megatron", "mtp_layers": 1},
    {"model": "deepseek-v3", "gpus": "32x8xH100", "framework": "reference"},
]


@pytest.mark.parametrize("case", MLA_BOUND_CASES,
                         ids=lambda c: f"{c['model']}@{c['gpus']}-{c['framework']}"
                                       f"{'-mtp' if c.get('mtp_layers') else ''}")
def test_bound_never_exceeds_the_estimate_for_mla(small_v3: str, v2_lite: str,
                                                   case: dict) -> None:
    """bound + CUDA context <= estimate's device total on a random sample of MLA candidates
    (pipelines, expert parallelism, every recompute mode, ZeRO/FSDP, offload), before and
    after the bound learns from estimates: the bound stays a lower bound with MLA's
    (d_qk, d_v) heads and MTP depths."""
    base, req = _prepare(case, small_v3, v2_lite)
    cands, _, _ = enumerate_candidates(base, req)
    bound = MemoryBound(base)
    context = base.cluster.gpu.context_overhead_bytes
    seen, checked = set(), 0
    for c in random.Random(7).sample(cands, min(150, len(cands))):
        e = estimate_candidate(c, base, req)
        assert e is not None, c  # no MLA layout the estimate refuses is proposed
        assert bound.total(c) + context <= e.report.device_total_bytes, c
        bound.learn(c, e.report)
        checked += 1
        seen.add((c.rec, c.pp > 1, c.ep > 1, c.tp > 1))
    assert checked >= min(150, len(cands)) and checked > 30
    assert {s[0] for s in seen} == {"none", "selective", "full"}
    if case["model"] in ("small", "v2-lite") and case["framework"] == "megatron":
        assert {s[1] for s in seen} == {True, False} and {s[2] for s in seen} == {True, False}
        assert {s[3] for s in seen} == {True, False}


# A dense MLA model whose q/k heads are three times its v heads (dn + dr = 96, dv = 32) and
# whose attention is wide against h: a floor counting v and the output a·(dn + dr) wide
# would exceed the activations the engine counts.
WIDE_MLA: dict[str, Any] = {
    "model_type": "deepseek_v3", "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 64,
    "moe_intermediate_size": 64, "vocab_size": 256, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "first_k_dense_replace": 4, "q_lora_rank": None,
    "kv_lora_rank": 32, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 32,
}  # fmt: skip


@pytest.mark.parametrize("cfg", [WIDE_MLA, SMALL_V3], ids=["wide", "small_v3"])
@pytest.mark.parametrize(("framework", "gpus"), [("megatron", "2xH100"),
                                                 ("reference", "1xH100")])
def test_activation_floor_stays_under_mla_activations(tmp_path: Path, cfg: dict, framework: str,
                                                      gpus: str) -> None:
    """Without pipelining, the bound's activation floor (with its margin) never exceeds the
    activations the estimate counts at a forward/backward peak, for every candidate."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    base, req, _ = prepare_plan({"model": str(path), "gpus": gpus, "framework": framework,
                                 "seq_len": 8192}, global_batch_size=8)
    cands, _, _ = enumerate_candidates(base, req)
    bound, checked = MemoryBound(base), 0
    for c in cands:
        e = estimate_candidate(c, base, req)
        assert e is not None, c
        if c.pp > 1 or e.report.peak_phase not in ("forward", "backward"):
            continue
        floor = LOWER_BOUND_MARGIN * bound.floor(c.tp, c.pp, c.cp, c.sp, c.b, c.m, c.rec,
                                                 c.prec, c.ft)
        assert floor <= e.report.terms.activations, c
        checked += 1
    assert checked >= 6


def test_activation_floor_counts_mla_heads_by_hand() -> None:
    """The floor's per-token attention inputs on one rank: q and k a·(dn + dr) each, v and
    the core output a·dv each (megatron's MLA rows, tests/test_megatron_mla.py) — not
    4·a·(dn + dr), which would exceed what Megatron-LM keeps."""
    base, _ = _prepare({"model": "deepseek-v3", "gpus": "8xH100", "framework": "megatron"}, "")
    bound = MemoryBound(base)
    a, h = 128, 7168
    per_token = 2 * a * (128 + 64) + 2 * a * 128  # q, k; v, core output
    s, L = 4096, 61
    want = L * s * (2 * h + per_token) * 2  # + attention and MLP inputs; bf16, tp 1, b 1
    assert bound.floor(1, 1, 1, False, 1, 1, "none", "bf16") == want


# ---- plan entries are estimates ----------------------------------------------------------
@pytest.mark.parametrize("case", [
    {"model": "small", "gpus": "8xH100", "seq_len": 2048, "framework": "megatron"},
    {"model": "deepseek-v3", "gpus": "32x8xH100", "framework": "megatron"},
    {"model": "deepseek-v3", "gpus": "64x8xH100", "framework": "megatron", "mtp_layers": 1},
], ids=["small", "v3-256", "v3-512-mtp"])
def test_plan_entries_equal_the_cli_estimate(small_v3: str, case: dict,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Each top entry's memory is what `vramcalc estimate` gives for the same flags (the
    plan's own "see one strategy" flags), and its speed what the speed model gives the
    estimated scenario; the DeepSeek-V3 plans keep tensor parallelism within a node and
    spread the routed experts (ep > 1)."""
    base, req = _prepare(case, small_v3)
    res = search(base, req)
    assert res.entries
    model = small_v3 if case["model"] == "small" else case["model"]
    for e in res.entries[:2]:
        s = e.report.strategy
        argv = ["estimate", "--model", model, "--gpus", case["gpus"], "--framework",
                case["framework"], "--headroom", "0.05", *strategy_flags(s), "--json"]
        assert main(argv) in (0, 1)
        doc = json.loads(capsys.readouterr().out)
        assert doc["device_total_bytes"] == e.report.device_total_bytes
        assert doc["peak_allocated_bytes"] == e.report.peak_allocated_bytes
        assert scenario_speed(e.scenario).tokens_per_s == pytest.approx(e.speed.tokens_per_s)
        if case["model"] != "small":
            assert s["tp"] <= 8 and s["ep"] > 1 and s["cp"] == 1
    if case.get("mtp_layers"):  # the MTP depth is in the estimate the plan ranked, and in
        # the flags that reproduce it
        assert all(e.scenario.parallel.mtp_layers == 1 for e in res.entries)
        assert "--mtp-layers" in strategy_flags(res.entries[0].report.strategy)


# ---- the speed model: MLA attention and MTP FLOPs by hand --------------------------------
H, A, QR, KR, DN, DR, DV = 7168, 128, 1536, 512, 128, 64, 128  # DeepSeek-V3 config.json
V, L, FE, F, E, K = 129280, 61, 2048, 18432, 256, 8
ATTN = (H * QR + QR + QR * A * (DN + DR)  # q_a_proj, q_a_layernorm, q_b_proj
        + H * (KR + DR) + KR + KR * A * (DN + DV)  # kv_a_proj_with_mqa, kv_a_layernorm, kv_b
        + A * DV * H)  # o_proj
MOE_ACTIVE = ATTN + (K + 1) * 3 * H * FE + H * E + 2 * H  # top-8 + 1 shared, router, norms
DENSE = ATTN + 3 * H * F + 2 * H
N_MM = 3 * DENSE + 58 * MOE_ACTIVE + H + V * H  # + final norm, output head (untied)


def test_deepseek_v3_model_flops_by_hand() -> None:
    """6·N_mm + 6·L·s·a·((dn + dr) + dv): q·kᵀ over the 192-wide q/k heads, p·v over the
    128-wide v heads (forward 2·s·a·d each, backward twice that)."""
    s = 4096
    assert N_MM == V3.num_active_params - V * H  # the hand count is the spec's
    core = 6 * L * s * A * ((DN + DR) + DV)
    assert model_flops_per_token(V3, s) == 6 * N_MM + core
    assert attention_width(V3) == A * 160  # A = a·(192 + 128)/2
    assert recompute_flops_per_token(V3, s, "selective") == 2 * L * s * A * (DN + DR + DV)
    assert recompute_flops_per_token(V3, s, "full") == (
        2 * (N_MM - V * H) + 2 * L * s * A * (DN + DR + DV))


def test_mtp_flops_by_hand() -> None:
    """One MTP depth: its MoE layer (DeepSeek-V3's last layer kind), eh_proj 2h·h, three
    norms, and the shared head V·h, 6 FLOPs per parameter, plus one more attention core;
    recompute full runs the depth's forward again but the head; selective its core."""
    s = 4096
    depth = MOE_ACTIVE + 2 * H * H + 3 * H + V * H
    core = 6 * s * A * (DN + DR + DV)
    assert model_flops_per_token(V3, s, mtp_layers=1) - model_flops_per_token(V3, s) == (
        6 * depth + core)
    assert model_flops_per_token(V3, s, mtp_layers=2) == (
        model_flops_per_token(V3, s) + 2 * (6 * depth + core))
    assert (recompute_flops_per_token(V3, s, "full", mtp_layers=1)
            - recompute_flops_per_token(V3, s, "full")) == 2 * (depth - V * H) + core / 3
    assert recompute_flops_per_token(V3, s, "selective", mtp_layers=1) == (
        2 * (L + 1) * s * A * (DN + DR + DV))


def test_scenario_speed_counts_mtp() -> None:
    """`estimate`'s speed and the planner's carry --mtp-layers into the FLOPs."""
    base, req = _prepare({"model": "deepseek-v3", "gpus": "32x8xH100", "framework": "megatron",
                          "mtp_layers": 1}, "")
    e = search(base, req).entries[0]
    assert e.speed.model_flops_per_token == model_flops_per_token(V3, 4096, mtp_layers=1)
    assert scenario_speed(e.scenario).model_flops_per_token == e.speed.model_flops_per_token


# ---- uneven pipeline splits (DeepSeek-V3's 61 layers) ------------------------------------
@pytest.mark.parametrize(("case", "pps", "interleaved"), [
    # 61 − 3 − 2 = 56 layers over pp − 2 middle stages: pp − 2 | 56, pp | 256 -> pp 4, 16
    ({"model": "deepseek-v3", "gpus": "32x8xH100", "framework": "megatron",
      "first_stage_layers": 3, "last_stage_layers": 2, "mtp_layers": 1}, {4, 16}, set()),
    # 10 layers + embedding + loss = 12 slots over pp: pp | 12, pp | 8 -> 2, 4; v = 2 needs
    # an even count per rank: pp 2 only
    ({"model": "small10", "gpus": "8xH100", "seq_len": 2048, "framework": "megatron",
      "embedding_in_split": True, "loss_in_split": True, "allow": "optimizer"}, {2, 4}, {2}),
], ids=["v3-first3-last2", "small-edges-in-split"])
def test_plan_searches_pp_for_an_uneven_split(tmp_path: Path, case: dict, pps: set[int],
                                              interleaved: set[int],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """An uneven split given to plan (Megatron-LM's --decoder-first/last-pipeline-num-layers,
    --account-for-embedding/loss-in-pipeline-split) stays on every candidate, pp is searched
    among the sizes Megatron-LM's rule accepts (derived by hand above), the bound stays
    under the estimate (its floor counts the first stage's own layers), and the best entry
    is what `vramcalc estimate` gives for the flags the plan prints."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL_V3, "num_hidden_layers": 10}))
    model = str(path) if case["model"] == "small10" else case["model"]
    base, req = _prepare({**case, "model": model}, "")
    cands, _, _ = enumerate_candidates(base, req)
    assert {c.pp for c in cands} == pps
    assert {c.pp for c in cands if c.sched == "interleaved"} == interleaved
    keys = ("first_stage_layers", "last_stage_layers", "embedding_in_split", "loss_in_split")
    bound, context, checked = MemoryBound(base), base.cluster.gpu.context_overhead_bytes, 0
    for c in random.Random(9).sample(cands, min(150, len(cands))):
        e = estimate_candidate(c, base, req)
        assert e is not None, c
        par = e.scenario.parallel
        assert all(getattr(par, k) == case[k] for k in keys if k in case)
        assert bound.total(c) + context <= e.report.device_total_bytes, c
        bound.learn(c, e.report)
        checked += 1
    assert checked > 30
    best = search(base, req).entries[0]
    assert main(["estimate", "--model", model, "--gpus", case["gpus"], "--framework",
                 "megatron", "--headroom", "0.05", *strategy_flags(best.report.strategy),
                 "--json"]) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    assert doc["device_total_bytes"] == best.report.device_total_bytes


def test_a_split_no_pipeline_size_accepts_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """61 − 30 − 30 = 1 layer for pp − 2 middle stages: only pp 3, which 8 GPUs cannot
    hold: one error line."""
    assert main(["plan", "--model", "deepseek-v3", "--gpus", "8xH100", "--framework",
                 "megatron", "--first-stage-layers", "30", "--last-stage-layers", "30"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err


def test_fp8_speed_puts_the_mtp_depth_linears_at_the_fp8_peak() -> None:
    """--precision fp8 with an MTP depth (a dense Llama-3.1-8B under megatron): the depth's
    layer, eh_proj and norms join the FP8 share (Transformer Engine linears), its shared-head
    matmul the BF16 share: peak = F / (F8/P8 + (F − F8)/P16), counted by hand."""
    spec = resolve_model("llama3.1-8b")[0]
    gpu = resolve_gpu("H100")
    h, f, V, Lm, kv = 4096, 14336, 128256, 32, 1024
    layer = h * (h + kv + kv) + h * h + 3 * h * f + 2 * h  # q, k, v, o; SwiGLU; 2 norms
    n_lin = Lm * layer  # the decoder's block linears (and norms)
    depth = layer + 2 * h * h + 3 * h  # the MTP layer, eh_proj, 3 norms (head: bf16 share)
    s = 4096
    F = model_flops_per_token(spec, s, mtp_layers=1)
    F8 = 6 * (n_lin + depth)
    p8, p16 = gpu.peak_tflops("fp8") * 1e12, gpu.peak_tflops("bf16") * 1e12
    want = F / (F8 / p8 + (F - F8) / p16)
    assert SpeedModel(spec, gpu, 8, s, "fp8", mtp_layers=1).peak == pytest.approx(want, rel=1e-12)
    assert F - model_flops_per_token(spec, s) == 6 * (depth + V * h) + 12 * s * 32 * 128
