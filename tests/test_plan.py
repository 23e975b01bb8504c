"""The planner (vramcalc.planner) and `vramcalc plan`: ranking, determinism, every returned
candidate fits, pruning never hides a better plan, suggestions fix what they claim to fix,
exit codes and output.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.test_moe_layers import SCOUT_TEXT
from vramcalc.analytic import estimate
from vramcalc.cli import app, main
from vramcalc.cli.plan import prepare_plan
from vramcalc.errors import InputError
from vramcalc.hardware import load_profiles
from vramcalc.planner import (
    MemoryBound,
    PlanRequest,
    enumerate_candidates,
    estimate_candidate,
    finetune_supported,
    gpu_counts,
    search,
    suggest_changes,
)
from vramcalc.planner.bound import states_key
from vramcalc.speed import scenario_speed

CANDIDATE_KEYS = {"strategy", "fits", "peak_allocated_bytes", "device_total_bytes",
                  "tokens_per_s", "step_time_s", "mfu"}


def plan(**values):  # noqa: ANN003, ANN201
    extras = {k: values.pop(k) for k in ("global_batch_size", "global_batch_tokens", "allow",
                                         "top", "mfu") if k in values}
    base, req, notes = prepare_plan(values, **extras)
    return base, req, search(base, req), notes


def usable(base) -> int:  # noqa: ANN001
    gpu = base.cluster.gpu
    return int(gpu.memory_total_bytes * (1 - base.headroom_fraction))


CASES = [
    {"model": "70b", "gpus": "8x8xH100"},
    {"model": "8b", "gpus": "8xH100"},
    {"model": "mixtral-8x7b", "gpus": "2x8xH100"},
    {"model": "gpt2", "gpus": "4xRTX4090", "seq_len": 1024},
    {"model": "13b", "gpus": "16x910B"},
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['model']}@{c['gpus']}")
def test_every_returned_candidate_fits_and_ranking(case: dict) -> None:
    base, req, res, _ = plan(**case)
    assert 1 <= len(res.entries) <= req.top_n
    B = req.batch_for(base.training.seq_len)
    for e in res.entries:
        s = e.report.strategy
        assert e.fits
        # re-estimate independently of the search: it fits with the requested headroom
        again = estimate(e.scenario)
        assert again.device_total_bytes == e.report.device_total_bytes
        assert again.device_total_bytes <= usable(base)
        assert s["dp"] * s["tp"] * s["pp"] * s["cp"] == base.cluster.num_gpus
        assert s["dp"] * s["micro_batch_size"] * s["grad_accum"] == B  # global batch kept
        assert s["tp"] <= base.cluster.gpus_per_node  # tensor parallelism within a node
        assert scenario_speed(e.scenario).tokens_per_s == pytest.approx(e.speed.tokens_per_s)
    # ranked by tokens/s, ties by more headroom
    keys = [(-e.speed.tokens_per_s, -(e.report.free_bytes or 0)) for e in res.entries]
    assert keys == sorted(keys)


def test_deterministic() -> None:
    runs = [json.dumps([e.to_json() for e in plan(model="70b", gpus="8x8xH100")[2].entries])
            for _ in range(2)]
    assert runs[0] == runs[1]
    # and the same in a fresh process through the CLI
    out = subprocess.run([sys.executable, "-m", "vramcalc", "plan", "--model", "70b", "--gpus",
                          "8x8xH100", "--json"], capture_output=True, text=True, check=True)
    assert json.dumps(json.loads(out.stdout)["candidates"]) == runs[0]


def _rank(e) -> tuple:  # noqa: ANN001
    return (-e.speed.tokens_per_s, len(e.changes), -(e.report.free_bytes or 0))


@pytest.mark.parametrize("case", [
    {"model": "gpt2", "gpus": "4xRTX4090", "seq_len": 1024},
    {"model": "7b", "gpus": "4xA100-40GB", "seq_len": 2048, "global_batch_size": 64},
    {"model": "gpt2", "gpus": "1xRTX4090", "seq_len": 1024, "precision": "bf16-pure",
     "optimizer_in_backward": True, "global_batch_size": 8},
    {"model": "7b", "gpus": "2xRTX4090", "seq_len": 512, "precision": "bf16-pure",
     "optimizer": "paged-adamw", "framework": "torchtune", "global_batch_size": 16},
], ids=["gpt2", "llama2-7b", "gpt2-optimizer-in-backward", "llama2-7b-paged"])
def test_search_equals_brute_force(case: dict) -> None:
    """Bounds and best-first stopping never hide a better plan, and dominance only drops
    candidates that rank below a valid one that dominates them: estimate every candidate."""
    base, req, res, _ = plan(**case)
    every, total, pruned = enumerate_candidates(base, req)
    assert pruned == 0 and len(every) == total
    est = {c.idx: estimate_candidate(c, base, req) for c in every}
    fitting = sorted((e for e in est.values() if e is not None and e.fits), key=_rank)
    # the best plan is the best of all candidates
    assert _rank(res.entries[0]) == _rank(fitting[0])
    # dominance as documented: a candidate is dropped when a valid candidate at least as
    # fast with no more memory exists (a higher ZeRO stage or a smaller micro-batch)
    by_idx = {c.idx: c for c in every}
    dropped = set()
    for c in sorted(every, key=lambda c: (-c.tps, c.nchg, c.tail())):
        if any(est[d] is not None or d in dropped for d in c.dom):
            dropped.add(c.idx)
    for i in dropped:
        e = est[i]
        if e is not None and e.fits:  # ranks below one of its valid dominators
            doms = [est[d] for d in by_idx[i].dom if est[d] is not None]
            assert any(_rank(d) <= _rank(e) for d in doms), by_idx[i]
    want = sorted((e for i, e in est.items() if i not in dropped and e is not None and e.fits),
                  key=_rank)[: req.top_n]
    assert [_rank(e) for e in res.entries] == [_rank(e) for e in want]


@pytest.mark.parametrize("case", [
    {"model": "70b", "gpus": "8x8xH100"},
    {"model": "8b", "gpus": "8xH100", "seq_len": 8192},
    {"model": "mixtral-8x7b", "gpus": "8xH100"},
    {"model": "gpt2", "gpus": "4xRTX4090", "seq_len": 1024},
], ids=lambda c: c["model"])
def test_memory_lower_bound_is_sound(case: dict) -> None:
    """The bound (including what it learns from estimates) never exceeds the estimate."""
    base, req, _, _ = plan(**case)
    cands, _, _ = enumerate_candidates(base, req)
    sample = random.Random(5).sample(cands, min(150, len(cands)))
    assert bound_checked(base, req, MemoryBound(base), sample) > 20


def bound_checked(base, req, bound, sample) -> int:  # noqa: ANN001
    """Assert bound + CUDA context <= the estimate's device total on every candidate of
    `sample` the engine accepts (the bound learning from each estimate as the search does);
    return how many were checked."""
    context = base.cluster.gpu.context_overhead_bytes
    checked = 0
    for c in sample:
        e = estimate_candidate(c, base, req)
        if e is None:
            continue
        assert bound.total(c) + context <= e.report.device_total_bytes, c
        bound.learn(c, e.report)
        checked += 1
    return checked


# the whole strategy matrix the planner proposes: fine-tuning (frozen and NF4 bases, adapter
# weights), offload, ZeRO 0-3 and FSDP, pipelines, MoE with expert parallelism, FP8
BOUND_CASES = [
    {"model": "8b", "gpus": "8xH100", "allow": "precision,optimizer,offload,finetune"},
    {"model": "70b", "gpus": "2x8xH100", "allow": "offload,finetune"},
    {"model": "mixtral-8x7b", "gpus": "2x8xH100", "allow": "optimizer,offload,finetune"},
    {"model": "8b", "gpus": "1xRTX4090", "finetune": "qlora", "framework": "hf",
     "allow": "offload,optimizer"},
    {"model": "gpt2", "gpus": "4xRTX4090", "seq_len": 1024, "framework": "hf",
     "allow": "finetune,offload,precision"},
    {"model": "13b", "gpus": "16x910B", "allow": "finetune,offload"},
    {"model": "8b", "gpus": "4xH100", "activation_offload": True, "allow": "offload,finetune"},
    {"model": "8b", "gpus": "8xH100", "framework": "torchtitan", "seq_len": 8192,
     "allow": "precision"},
]


@pytest.mark.parametrize("case", BOUND_CASES,
                         ids=lambda c: f"{c['model']}@{c['gpus']}+{c.get('finetune', '')}")
def test_bound_never_exceeds_the_estimate(case: dict) -> None:
    """bound + CUDA context <= analytic.estimate(...).device_total_bytes on a random sample
    of every candidate (before and after the bound learns from estimates), and whatever the
    bound calls refused, the engine refuses."""
    base, req, _ = prepare_plan({k: v for k, v in case.items() if k != "allow"},
                                allow=case.get("allow"))
    cands, _, _ = enumerate_candidates(base, req)
    bound = MemoryBound(base)
    context = base.cluster.gpu.context_overhead_bytes
    seen: set[tuple] = set()
    checked = 0
    for c in random.Random(11).sample(cands, min(140, len(cands))):
        e = estimate_candidate(c, base, req)
        lower = bound.total(c)
        if e is None:
            continue
        assert lower + context <= e.report.device_total_bytes, c
        bound.learn(c, e.report)
        checked += 1
        seen.add((c.ft != "full", bool(c.off), c.stage, c.pp > 1, c.ep > 1, c.prec))
    assert checked > 30
    # refused by the bound's checks => refused by the engine
    for c in cands[:: max(1, len(cands) // 60)]:
        if bound.total(c) == float("inf"):
            assert estimate_candidate(c, base, req) is None, c
    # the sample covers the matrix it was built for
    allow = case.get("allow", "")
    if "finetune" in allow or case.get("finetune"):
        assert any(s[0] for s in seen)
    if "offload" in allow:
        assert any(s[1] for s in seen)
    stages = {0, 3}
    if case.get("framework") == "torchtitan":  # its fp8 (float8) reached; bf16 needs FSDP2
        assert any(s[5] == "fp8" for s in seen)
        stages = {2, 3}
    assert {s[2] for s in seen} >= stages or base.cluster.num_gpus == 1


def test_bound_covers_the_matrix() -> None:
    """BOUND_CASES reach pipelines, expert parallelism, FSDP/ZeRO-3 and fine-tuning."""
    kinds = set()
    for case in BOUND_CASES:
        base, req, _ = prepare_plan({k: v for k, v in case.items() if k != "allow"},
                                    allow=case.get("allow"))
        cands, _, _ = enumerate_candidates(base, req)
        kinds |= {("pp", c.pp > 1) for c in cands} | {("ep", c.ep > 1) for c in cands}
        kinds |= {("fsdp", c.fsdp) for c in cands} | {("ft", c.ft) for c in cands}
    assert {("pp", True), ("ep", True), ("fsdp", "full"), ("fsdp", "hybrid"),
            ("ft", "lora"), ("ft", "qlora"), ("ft", "dora")} <= kinds


# Llama-4-Scout's text model with MoE layers only at 0, 5 and 7 (tests/test_moe_layers.py):
# 1F1B and interleaved schedules put different numbers of MoE layers on a stage
SCOUT_LISTED = {**SCOUT_TEXT, "moe_layers": [0, 5, 7]}


@pytest.mark.parametrize("case", [
    {"model": "70b", "gpus": "2x8xH100", "allow": "precision,offload,finetune,optimizer"},
    {"model": "scout-listed", "gpus": "16xH100", "allow": "finetune,optimizer"},
], ids=lambda c: c["model"])
def test_bound_states_shared_across_schedules_and_optimizers(case: dict, tmp_path: Path) -> None:
    """The bound computes a layout's model states once per split of layers (and MoE layers)
    over the stages, not per pipeline schedule, and all but the optimizer states once for
    every optimizer: what a layout gets after its twins (1F1B, other optimizers) were
    computed equals what the term functions give on its own layout, and the bound stays
    under the estimate on interleaved candidates."""
    values = {k: v for k, v in case.items() if k != "allow"}
    if values["model"] == "scout-listed":
        path = tmp_path / "config.json"
        path.write_text(json.dumps(SCOUT_LISTED))
        values["model"] = str(path)
    base, req, _ = prepare_plan(values, allow=case["allow"])
    cands, _, _ = enumerate_candidates(base, req)
    variants = sorted({(c.prec, c.opt, c.ft) for c in cands})
    assert {v[1] for v in variants} == {"adamw", "adamw-8bit"}
    assert any(c.sched == "interleaved" for c in cands)
    keys = sorted({states_key(c) for c in cands})
    differ, shared = 0, MemoryBound(base)
    for key in random.Random(3).sample(keys, min(60, len(keys))):
        for sched, v in (("1f1b", 1), key[8:10]):  # twins first: `key` may reuse them
            for var in variants:
                shared.states((*key[:8], sched, v, *var))
        alone = MemoryBound(base).states(key)  # the layout's own terms
        assert shared.states(key) == alone, key
        differ += key[8] == "interleaved" and shared.states(
            (*key[:8], "1f1b", 1, *key[10:])) != alone
    # dense: the schedule never changes the states; the listed MoE layers: it can
    assert (differ > 0) == (case["model"] == "scout-listed")
    context = base.cluster.gpu.context_overhead_bytes
    bound, checked = MemoryBound(base), 0
    for c in random.Random(4).sample([c for c in cands if c.sched == "interleaved"], 40):
        key = states_key(c)
        bound.states((*key[:8], "1f1b", 1, *key[10:]))  # the twin first, as in a search
        e = estimate_candidate(c, base, req)
        if e is not None:
            assert bound.total(c) + context <= e.report.device_total_bytes, c
            checked += 1
    assert checked > 10


def test_pinned_options_are_respected() -> None:
    _, _, res, _ = plan(model="70b", gpus="8x8xH100", tp=8, zero=1, recompute="full",
                        micro_batch_size=1)
    assert res.entries
    for e in res.entries:
        s = e.report.strategy
        assert (s["tp"], s["zero"], s["fsdp"], s["recompute"], s["micro_batch_size"]) == (
            8, 1, "none", "full", 1)


def test_training_settings_held_fixed_unless_allowed() -> None:
    _, _, res, _ = plan(model="mistral-7b", gpus="2xH100")
    assert all(e.report.strategy["optimizer"] == "adamw" and not e.report.strategy["offload"]
               and e.report.strategy["precision"] == "bf16" for e in res.entries)
    _, req, res2, _ = plan(model="mistral-7b", gpus="2xH100",
                           allow="precision,optimizer,offload")
    assert req.allow == frozenset({"precision", "optimizer", "offload"})
    for e in res2.entries:
        s = e.report.strategy
        changed = {k for k, default in (("precision", "bf16"), ("optimizer", "adamw"))
                   if s[k] != default}
        assert changed == set(e.changes)
    # allowing more can only make the best plan faster
    assert res2.entries[0].speed.tokens_per_s >= res.entries[0].speed.tokens_per_s


def test_allow_finetune_is_accepted() -> None:
    base, req, notes = prepare_plan({"model": "8b", "gpus": "8xH100"}, allow="finetune")
    if finetune_supported():
        assert "finetune" in req.allow
    else:
        assert "finetune" not in req.allow
        assert any("not supported" in n for n in notes)


def test_global_batch_options() -> None:
    base, req, _ = prepare_plan({"model": "8b", "gpus": "8xH100", "seq_len": 2048},
                                global_batch_tokens="1M")
    # 488.3 sequences: vramcalc.planner.request.splittable_batch rounds to a multiple of 32
    # (16 x 32 <= 488 < 16 x 64): 480 = 15 x 32, which 8 data-parallel ranks split
    assert req.batch_for(2048) == 480
    # default: the power of two nearest below 4M tokens (Llama 2: 4M tokens per step)
    base, req, _ = prepare_plan({"model": "8b", "gpus": "8xH100", "seq_len": 3000})
    assert req.batch_for(3000) == 1024
    assert req.batch_for(4096) == 1024
    with pytest.raises(InputError):
        prepare_plan({"model": "8b", "gpus": "8xH100"}, global_batch_size=8,
                     global_batch_tokens="1M")


def test_progress_callback() -> None:
    calls = []
    base, req, _ = prepare_plan({"model": "70b", "gpus": "8x8xH100"})
    search(base, req, progress=lambda msg, done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1]
    assert all(0 <= d <= t for d, t in calls)


def test_moe_searches_expert_parallelism() -> None:
    base, req, res, _ = plan(model="mixtral-8x7b", gpus="2x8xH100")
    cands, _, _ = enumerate_candidates(base, req)
    assert {c.ep for c in cands} >= {1, 2, 4, 8}
    assert res.entries


# ---- nothing fits -----------------------------------------------------------------------------
def _apply(values: dict, change: dict) -> list:
    base, req, _ = prepare_plan({**values, **change})
    return search(base, req).entries


def test_nothing_fits_closest_and_suggestions_that_work() -> None:
    values = {"model": "70b", "gpus": "8xH100"}
    base, req, res, _ = plan(**values)
    assert res.entries == []
    c = res.closest
    assert c is not None and not c.fits and c.over_bytes > 0
    sugg = suggest_changes(base, req, list(load_profiles().values()))
    kinds = [s.kind for s in sugg]
    assert "more_gpus" in kinds and "offload" in kinds and "other_gpu" in kinds
    for s in sugg:
        assert s.entry.fits
        got = _apply(values, dict(s.change))
        assert got and got[0].fits, s.title
        assert got[0].speed.tokens_per_s == pytest.approx(s.entry.speed.tokens_per_s)
    more = next(s for s in sugg if s.kind == "more_gpus")
    # the smallest count tried that fits: the one before it does not
    counts = gpu_counts(8, 8, 10**6)
    i = counts.index(more.details["num_gpus"])
    if i > 0:
        prev = counts[i - 1]
        assert not _apply(values, {"gpus": f"{prev // 8}x8xH100"})
    off = next(s for s in sugg if s.kind == "offload")
    assert off.details["host_bytes_per_node"] == off.entry.report.host_bytes_per_node > 0


def test_suggest_8bit_optimizer() -> None:
    values = {"model": "mistral-7b", "gpus": "1xH200", "seq_len": 32768}
    base, req, res, _ = plan(**values)
    assert not res.entries
    sugg = suggest_changes(base, req, [])
    opt = next(s for s in sugg if s.kind == "optimizer")
    assert opt.change == {"optimizer": "adamw-8bit"}
    assert _apply(values, dict(opt.change))


def test_suggest_reducing_every_micro_batch_for_hf_fsdp() -> None:
    """HF Trainer's no_sync() holds Llama-3-8B's bf16 gradients whole (16 GB) on every one
    of 8 RTX 4090s; reducing every micro-batch keeps 2 GB of shards, and the job fits."""
    values = {"model": "8b", "gpus": "8xRTX4090", "framework": "hf", "fsdp": "full", "tp": 1,
              "cp": 1, "seq_len": 2048, "recompute": "full", "micro_batch_size": 1}
    base, req, res, _ = plan(**values)
    assert not res.entries
    sugg = suggest_changes(base, req, [])
    sync = next(s for s in sugg if s.kind == "sync_each_batch")
    assert sync.change == {"sync_each_batch": True}
    assert sync.entry.report.terms.gradients < res.closest.report.terms.gradients / 7
    assert _apply(values, dict(sync.change))


def test_suggest_shorter_sequence() -> None:
    values = {"model": "gemma-2b", "gpus": "1xRTX4090", "seq_len": 8192, "offload": "optimizer"}
    base, req, res, _ = plan(**values)
    assert not res.entries
    sugg = suggest_changes(base, req, [])
    seq = next(s for s in sugg if s.kind == "seq_len")
    assert _apply(values, dict(seq.change))
    # it is the longest halving that fits: twice as long does not
    longer = seq.change["seq_len"] * 2
    if longer < 8192:
        assert not _apply(values, {"seq_len": longer})


# ---- CLI ----------------------------------------------------------------------------------------
def test_cli_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "8b", "--gpus", "8xH100", "--json", "--top", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"summary", "candidates", "suggestions", "vramcalc_version",
                        "gpu_profiles_revision", "model_catalog_revision"}
    assert len(doc["candidates"]) == 3 and doc["suggestions"] == []
    for c in doc["candidates"]:
        assert set(c) == CANDIDATE_KEYS
        assert c["fits"] is True
        assert isinstance(c["device_total_bytes"], int)
        assert c["strategy"]["world_size"] == 8


def test_cli_json_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "70b", "--gpus", "8xH100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["candidates"]) == 1 and doc["candidates"][0]["fits"] is False
    assert doc["suggestions"]
    for s in doc["suggestions"]:
        assert {"kind", "title", "change", "candidate"} <= set(s)
        assert s["candidate"]["fits"] is True


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "no-such-model", "--gpus", "8xH100"],
    ["plan", "--model", "8b", "--gpus", "8xNoSuchGPU"],
    ["plan", "--model", "8b", "--gpus", "8xH100", "--allow", "everything"],
    ["plan", "--model", "8b", "--gpus", "8xH100", "--global-batch-size", "8",
     "--global-batch-tokens", "1M"],
    ["plan", "--model", "8b", "--gpus", "8xH100", "--top", "0"],
    ["plan", "--model", "8b", "--gpus", "8xH100", "--mfu", "1.5"],
    ["plan", "--model", "8b", "--gpus", "8xH100", "--tp", "3"],
    ["plan", "--model", "8b", "--gpus", "8xH100", "--global-batch-size", "7", "--dp", "8"],
    ["plan", "--model", "8b", "--gpus", "8xH100", "--recompute", "sometimes"],
    ["plan", "--gpus", "8xH100"],
])
def test_cli_bad_input_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "Traceback" not in err


def test_cli_table_output_tells_what_to_do_next() -> None:
    r = CliRunner().invoke(app, ["plan", "--model", "8b", "--gpus", "8xH100"],
                           env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    out = r.output
    assert "Top 5 strategies that fit" in out and "Best strategy (#1)" in out
    assert "FITS" in out and "vramcalc estimate --model 8b --gpus 8xH100" in out
    assert "vramcalc check train.yaml" in out


def test_cli_nothing_fits_output() -> None:
    r = CliRunner().invoke(app, ["plan", "--model", "70b", "--gpus", "8xH100"],
                           env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    assert "NOTHING FITS" in r.output and "Closest strategy" in r.output
    assert "Smallest changes that fit" in r.output
    assert "vramcalc plan --model 70b --gpus 2x8xH100" in r.output or (
        "--gpus 4x8xH100" in r.output)
    assert "--offload optimizer" in r.output


def test_plan_never_imports_torch() -> None:
    code = ("import sys\nfrom vramcalc.cli import main\n"
            "rc = main(['plan', '--model', '70b', '--gpus', '8xH100', '--json'])\n"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert rc == 0 and not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_gpu_counts() -> None:
    assert gpu_counts(8, 8, 128) == [16, 32, 64, 128]
    assert gpu_counts(2, 8, 64) == [4, 8, 16, 32, 64]
    assert gpu_counts(64, 8, 100) == []


def test_request_defaults() -> None:
    assert PlanRequest().top_n == 5
    base, req, _ = prepare_plan({"model": "8b", "gpus": "8xH100"})
    assert base.headroom_fraction == 0.05  # --headroom default for plan: 5%


def test_every_speed_part_has_a_label() -> None:
    """The table renderer names every part of the step time the speed model reports."""
    from vramcalc.render.plan import SPEED_LABELS
    from vramcalc.speed import PART_NAMES

    assert set(PART_NAMES) == set(SPEED_LABELS)


def test_plan_table_with_a_qlora_best_renders() -> None:
    """A QLoRA winner carries a dequantization part in its step time; the table shows it."""
    r = CliRunner().invoke(app, ["plan", "--model", "70b", "--gpus", "A100", "--allow",
                                 "finetune", "--seq-len", "1024"], env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    assert "qlora" in r.output and "NF4 dequant" in r.output


def test_the_hf_stack_is_never_offered_pipeline_or_expert_parallelism() -> None:
    """HF Trainer lays out ranks with accelerate's ParallelismConfig (dp_replicate, dp_shard,
    tp, cp, sp: accelerate src/accelerate/parallelism_config.py): no pp, no ep. The same
    search under the reference profile does enumerate them."""
    from vramcalc.planner import enumerate_candidates

    def layouts(framework: str) -> set[tuple[int, int]]:
        base, req, _ = prepare_plan({"model": "mixtral-8x7b", "gpus": "32xH100",
                                     "framework": framework})
        cands, _, _ = enumerate_candidates(base, req)
        return {(c.pp, c.ep) for c in cands}

    assert layouts("hf") == {(1, 1)}
    assert any(pp > 1 for pp, _ in layouts("reference"))
    assert any(ep > 1 for _, ep in layouts("reference"))
    code = main(["plan", "--model", "8b", "--gpus", "16xH100", "--framework", "hf", "--json"])
    assert code == 0


def test_paged_pages_in_host_ram_slow_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """A paged optimizer never fails the fit, but the pages with no room on the device cross
    the host link each step: the speed counts them (vramcalc/speed.py), the table says so."""
    base, req, res, _ = plan(model="7b", gpus="1xRTX4090", seq_len=512,
                             precision="bf16-pure", optimizer="paged-adamw",
                             optimizer_in_backward=True, framework="torchtune",
                             global_batch_size=8)
    best = res.entries[0]
    spilled = best.report.host_bytes_per_node  # one GPU, nothing else offloaded
    assert best.fits and spilled > 0
    link = base.cluster.gpu.host_link_bytes_per_s
    assert best.speed.parts_s["offload"] == pytest.approx(2 * spilled / link)
    assert main(["plan", "--model", "7b", "--gpus", "1xRTX4090", "--seq-len", "512",
                 "--precision", "bf16-pure", "--optimizer", "paged-adamw",
                 "--optimizer-in-backward", "--framework", "torchtune",
                 "--global-batch-size", "8"]) == 0
    assert "paged→cpu" in capsys.readouterr().out


def test_torchtune_optimizer_in_backward_plans_one_gpu_only(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "7b", "--seq-len", "512", "--precision", "bf16-pure",
            "--optimizer-in-backward", "--framework", "torchtune", "--global-batch-size", "8"]
    assert main([*args, "--gpus", "1xRTX4090"]) == 0
    assert "1 GPU" in capsys.readouterr().out
    assert main([*args, "--gpus", "2xRTX4090"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --optimizer-in-backward runs on one GPU") and "got 2" in err


def test_torchtitan_fp8_is_its_compiled_float8_linear() -> None:
    """torchtitan trains in FP8 only through torchao's Float8Linear under torch.compile
    (float8.py), so `--allow precision` searches that: the entry's scenario is amp-bf16
    with --float8 --compile, and its numbers are those of estimate with those flags."""
    base, req, res, _ = plan(model="8b", gpus="8xH100", framework="torchtitan",
                             seq_len=8192, allow="precision")
    fp8 = [e for e in res.entries if e.scenario.training.float8]
    assert fp8 and all(e.changes == ("precision",) for e in fp8)
    tr = fp8[0].scenario.training
    assert tr.precision == "amp-bf16" and tr.compile
    again = estimate(fp8[0].scenario)
    assert again.device_total_bytes == fp8[0].report.device_total_bytes
    # the speed counts the block linears at the FP8 peak: faster than the best bf16 entry
    bf16 = [e for e in res.entries if not e.scenario.training.float8]
    assert not bf16 or fp8[0].speed.tokens_per_s > bf16[0].speed.tokens_per_s
