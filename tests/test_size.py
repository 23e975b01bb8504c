"""`vramcalc size`: GPU counts, arithmetic, deadlines, prices, and published training runs."""

from __future__ import annotations

import json

import pytest

from vramcalc.cli import main
from vramcalc.cli.plan import prepare_plan
from vramcalc.errors import InputError
from vramcalc.hardware import resolve_gpu
from vramcalc.planner import search
from vramcalc.size import size_counts, size_one


def sized(model: str, gpu: str, tokens: float, days: float | None = None, **values):  # noqa: ANN003, ANN201
    extras = {k: values.pop(k) for k in ("global_batch_size", "global_batch_tokens")
              if k in values}
    base, req, _ = prepare_plan({"model": model, "gpus": f"1x{gpu}", **values}, top=1,
                                **extras)
    return base, req, size_one(base, resolve_gpu(gpu), int(tokens), req, days)


def test_size_counts_are_whole_nodes_past_one_node() -> None:
    assert size_counts(8, 64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert size_counts(4, 32) == [1, 2, 4, 8, 12, 16, 24, 32]
    assert size_counts(16, 16) == [1, 2, 4, 8, 16]
    assert size_counts(8, 4) == [1, 2, 4]
    assert all(n % 8 == 0 for n in size_counts(8, 10**6) if n >= 8)


def _on_count(base, n: int):  # noqa: ANN001, ANN202
    return base.model_copy(update={"cluster": base.cluster.model_copy(update={
        "num_nodes": max(n // 8, 1), "gpus_per_node": min(n, 8)})})


def test_row_arithmetic_and_deadline() -> None:
    tokens = 2e12
    base, req, row = sized("llama2-7b", "A100-80GB", tokens, days=30)
    e = row.entry
    assert e is not None and e.fits and row.num_gpus == e.report.gpu.num_gpus
    seconds = tokens / e.speed.tokens_per_s
    assert row.days == pytest.approx(seconds / 86_400)
    assert row.gpu_hours == pytest.approx(row.num_gpus * seconds / 3600)
    assert row.cost_usd == pytest.approx(row.gpu_hours * 1.9)  # profile price $1.90/h
    # meets the deadline, and every smaller size in the ladder does not (or cannot run)
    assert row.days <= 30
    for n in size_counts(8, row.num_gpus - 1):
        try:
            res = search(_on_count(base, n), req)
        except InputError:  # no layout of n GPUs splits the batch
            continue
        assert not res.entries or tokens / res.entries[0].speed.tokens_per_s > 30 * 86_400
    # the table starts at the minimum: nothing fits on the count before it
    counts = size_counts(8, 10**6)
    j = counts.index(row.min_gpus)
    assert row.table[0].num_gpus == row.min_gpus
    if j > 0:
        assert not search(_on_count(base, counts[j - 1]), req).entries


def test_70b_on_a100_in_35_days_is_not_a_power_of_two_jump() -> None:
    # issue 15: this answered 4,096 A100s finishing in 19.9 days. With a batch that splits
    # over 3-node multiples, the smallest size that meets 35 days is found between powers of two.
    _, _, row = sized("70b", "A100-80GB", 2e12, days=35, global_batch_size=1536)
    assert row.days <= 35
    assert row.num_gpus & (row.num_gpus - 1) != 0  # 3 x 2^k GPUs
    # with a power-of-two batch, the note says which batch would allow the size in between
    _, _, row = sized("70b", "A100-80GB", 2e12, days=35)
    assert row.days <= 35 and any("factor of 3" in n for n in row.notes)


def test_without_deadline_the_answer_is_not_the_fewest_gpus() -> None:
    # issue 15: 405B on 15T tokens answered 128 H100s, 13,263 days at 27 % MFU
    _, _, row = sized("405b", "H100", 15e12)
    best = max(o.entry.speed.mfu for o in row.table)
    cheapest = min(o.gpu_hours for o in row.table)
    assert row.num_gpus > row.min_gpus and row.days < 1000
    assert row.gpu_hours <= 1.1 * cheapest  # within 10 % of the cheapest size
    bigger = [o for o in row.table if o.num_gpus > row.num_gpus]
    assert all(o.gpu_hours > 1.1 * cheapest for o in bigger)
    # the table stops before MFU collapses below half its best
    assert all(o.entry.speed.mfu >= 0.5 * best for o in row.table)


def test_an_unreachable_deadline_recommends_a_bigger_batch() -> None:
    # issue 15: proposed 131,072 H100s at 3.6 % MFU ($864M)
    base, req, row = sized("405b", "H100", 15e12, days=90)
    best = max(o.entry.speed.mfu for o in row.table)
    assert row.entry.speed.mfu >= 0.5 * best and row.num_gpus < 131_072
    B = req.batch_for(base.training.seq_len)
    assert row.suggested_global_batch is not None and row.suggested_global_batch > B
    assert any(f"--global-batch-size {row.suggested_global_batch}" in n for n in row.notes)


def test_405b_published_layout_needs_more_than_80gb_in_both_profiles() -> None:
    """Meta's 405B layout (Llama 3 paper Table 4: tp 8, pp 16, 8k sequences, micro-batch 1;
    126 layers, the first and last stage one layer short) on 1F1B without recompute: the
    reference profile's per-layer tables and the megatron profile's Korthikanti Table 2
    formula agree on the activations (within 5 %) and both exceed an 80 GB H100."""
    from vramcalc.analytic import estimate
    from vramcalc.options import build_scenario

    acts = {}
    for fw in ("reference", "megatron"):
        scn = build_scenario({
            "model": "405b", "gpus": "2048x8xH100", "tp": 8, "pp": 16, "first_stage_layers": 7,
            "last_stage_layers": 7, "sequence_parallel": True, "zero": 1, "framework": fw,
            "seq_len": 8192, "micro_batch_size": 1, "num_microbatches": 16,
            "attention": "flash", "recompute": "none"})
        rep = estimate(scn)
        assert rep.fits is False
        acts[fw] = rep.terms.activations
    assert acts["reference"] == pytest.approx(acts["megatron"], rel=0.05)


def test_nothing_fits_within_the_limit() -> None:
    base, req, _ = prepare_plan({"model": "405b", "gpus": "1xRTX4090"}, top=1)
    row = size_one(base, resolve_gpu("RTX4090"), 10**12, req, max_gpus=8)
    assert row.entry is None and row.num_gpus is None and "no strategy fits" in row.notes[0]


# Published training runs (model cards): GPU-hours for the pre-training token budget.
# Llama 2 (meta-llama/llama MODEL_CARD.md): A100-80GB, 2.0T tokens, 4k context, global
# batch 4M tokens: 7B 184,320 h; 70B 1,720,320 h. Llama 3.1 (meta-llama/llama-models
# models/llama3_1/MODEL_CARD.md): H100-80GB, 15T+ tokens: 70B 7.0M h.
# The model cards' hours include everything the runs spent (restarts, evaluation,
# context-length stages), so a speed model for the steady state should land at or
# somewhat below them; the tolerance is ±25%. docs/planning.md discusses each row.
@pytest.mark.parametrize(("model", "gpu", "tokens", "seq", "published"), [
    ("llama2-7b", "A100-80GB", 2.0e12, 4096, 184_320),
    ("llama2-70b", "A100-80GB", 2.0e12, 4096, 1_720_320),
    ("llama3.1-70b", "H100", 15e12, 8192, 7.0e6),
])
def test_published_gpu_hours(model: str, gpu: str, tokens: float, seq: int,
                             published: float) -> None:
    _, _, row = sized(model, gpu, tokens, days=30, seq_len=seq,
                      global_batch_tokens=str(4 * 2**20))
    assert row.gpu_hours == pytest.approx(published, rel=0.25)


@pytest.mark.xfail(strict=True, reason=(
    "with sequence parallelism counted as Korthikanti et al. Table 2 (the MLP's (b·s, f/t) "
    "intermediates are not split over the sequence), no 80 GB layout of 405B at 8k trains "
    "without recompute: the best plan is dp2048·tp8 ZeRO-3 with full recompute, 42.5M hours "
    "(+38 %). Meta's run fits through pipeline-schedule tuning vramcalc does not model "
    "(docs/planning.md); strict, so a change that brings it back within 25 % must remove this"))
def test_llama31_405b_on_its_own_cluster() -> None:
    """Llama 3.1 405B: 30.84M H100-80GB hours for 15T+ tokens (meta-llama/llama-models
    models/llama3_1/MODEL_CARD.md), trained on up to 16,384 H100s with a 16M-token batch
    of 8,192-token sequences (Dubey et al. 2024, "The Llama 3 Herd of Models", sections
    3.3 and 3.4.1). Same ±25 % as the runs above."""
    base, req, _ = prepare_plan({"model": "405b", "gpus": "2048x8xH100", "seq_len": 8192},
                                global_batch_tokens=str(2048 * 8192), top=1)
    e = search(base, req).entries[0]
    hours = 16_384 * 15e12 / e.speed.tokens_per_s / 3600
    assert hours == pytest.approx(30.84e6, rel=0.25)


# ---- CLI --------------------------------------------------------------------------------------------
def test_cli_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["size", "--model", "7b", "--tokens", "100B", "--gpu", "H100", "--gpu",
               "A100-80GB", "--price", "A100-80GB=1.25", "--days", "10", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["gpu"] for r in rows] == ["h100_sxm", "a100_80gb"]
    for r in rows:
        assert {"gpu", "num_gpus", "days", "gpu_hours", "cost_usd", "strategy"} <= set(r)
        assert r["days"] <= 10
        assert r["gpu_hours"] == pytest.approx(r["num_gpus"] * r["days"] * 24)
    assert rows[1]["cost_usd"] == pytest.approx(rows[1]["gpu_hours"] * 1.25)  # --price wins
    assert rows[0]["cost_usd"] == pytest.approx(rows[0]["gpu_hours"] * 2.95)  # profile price


def test_cli_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["size", "--model", "7b", "--tokens", "1T", "--gpu", "910B", "--gpu",
                 "RTX4090"]) == 0
    out = capsys.readouterr().out
    assert "ascend_910b2" in out and "rtx_4090" in out and "GPU-hours" in out
    assert "◀" in out  # the answer is marked


@pytest.mark.parametrize("argv", [
    ["size", "--model", "7b", "--gpu", "H100"],
    ["size", "--model", "7b", "--tokens", "1T"],
    ["size", "--tokens", "1T", "--gpu", "H100"],
    ["size", "--model", "7b", "--tokens", "lots", "--gpu", "H100"],
    ["size", "--model", "7b", "--tokens", "1T", "--gpu", "H1000"],
    ["size", "--model", "7b", "--tokens", "1T", "--gpu", "H100", "--days", "-3"],
    ["size", "--model", "7b", "--tokens", "1T", "--gpu", "H100", "--price", "H100"],
    ["size", "--model", "7b", "--tokens", "1T", "--gpu", "H100", "--price", "H200=2"],
    ["size", "--model", "7b", "--tokens", "1T", "--gpu", "H100", "--price", "H100=free"],
])
def test_cli_bad_input_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


# ---- fine-tuning jobs: every plan option, the fewest GPUs at about the least cost ----------
def test_fine_tuning_takes_the_fewest_gpus_within_the_cost_slack() -> None:
    from vramcalc.size import COST_SLACK
    base, req, _ = prepare_plan({"model": "8b", "gpus": "1xA10G", "framework": "hf",
                                 "finetune": "lora"}, top=1, finetune_given=True)
    gpu = resolve_gpu("A10G")
    fewest = size_one(base, gpu, 50 * 10**6, req, max_gpus=16, fewest=True)
    fastest = size_one(base, gpu, 50 * 10**6, req, max_gpus=16)
    cheap = [o.num_gpus for o in fewest.table
             if o.gpu_hours <= (1 + COST_SLACK) * min(t.gpu_hours for t in fewest.table)]
    assert len(cheap) > 1  # the case this test is about: several sizes cost about the least
    assert (fewest.num_gpus, fastest.num_gpus) == (cheap[0], cheap[-1])


def test_torchtune_scales_past_one_gpu_with_fsdp() -> None:
    # torchtune's distributed recipes shard with FSDP only: the search offers it at every
    # count (a 70B LoRA does not fit one 24 GB card; before, no count past one was searched)
    base, req, _ = prepare_plan({"model": "70b", "gpus": "1xRTX4090", "framework": "torchtune",
                                 "finetune": "lora", "torchtune_version": "0.2"},
                                top=1, finetune_given=True)
    row = size_one(base, resolve_gpu("RTX4090"), 10**7, req, max_gpus=32, fewest=True)
    assert row.num_gpus is not None and row.num_gpus > 1, row.notes
    assert row.entry is not None
    s = row.entry.report.strategy
    assert (s["fsdp"], s["fsdp_impl"], s["tp"], s["pp"]) == ("full", "fsdp1", 1, 1)


def test_size_command_takes_training_options(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["size", "--model", "8b", "--framework", "torchtune", "--finetune", "qlora",
                 "--lora-rank", "16", "--tokens", "20M", "--gpu", "RTX4090", "--max-gpus", "8",
                 "--json"])
    assert code == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert (row["strategy"]["finetune"], row["strategy"]["lora_rank"]) == ("qlora", 16)
    assert main(["size", "--model", "8b", "--gpus", "8xH100", "--tokens", "1B",
                 "--gpu", "H100"]) == 2
    assert "No such option: --gpus" in capsys.readouterr().err


def test_durations_read_in_days_hours_or_minutes() -> None:
    from vramcalc.render.plan import _duration
    assert [_duration(d) for d in (2.54, 1.0, 0.5, 1 / 24, 0.01)] == [
        "2.5 days", "1.0 days", "12.0 hours", "1.0 hours", "14 minutes"]


@pytest.mark.parametrize("framework", ["torchtune", "unsloth"])
def test_fine_tuning_stacks_plan_fine_tuning_jobs(framework: str) -> None:
    # torchtune's recipes and Unsloth fine-tune: a full fine-tune there is still a
    # fine-tuning job (Alpaca's 128-sequence batch, the fewest GPUs in size)
    values = {"model": "8b", "gpus": "1xH100", "framework": framework}
    if framework == "unsloth":
        values.update(finetune="lora", precision="bf16")
    base, req, notes = prepare_plan(values, top=1, finetune_given=False)
    assert req.finetuning and req.batch_for(base.training.seq_len) == 128
    assert any(n.startswith("fine-tuning: a global batch of 128") for n in notes)
    base, req, _ = prepare_plan({"model": "8b", "gpus": "1xH100"}, top=1)
    assert not req.finetuning  # the reference profile without --finetune: pretraining
