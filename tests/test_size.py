"""`vramcalc size`: GPU counts, arithmetic, deadlines, prices, and published training runs."""

from __future__ import annotations

import json

import pytest

from vramcalc.cli import main
from vramcalc.cli.plan import prepare_plan
from vramcalc.hardware import resolve_gpu
from vramcalc.planner import search
from vramcalc.size import SECONDS_PER_DAY, size_counts, size_one


def sized(model: str, gpu: str, tokens: float, days: float | None = None, **values):  # noqa: ANN003, ANN201
    extras = {k: values.pop(k) for k in ("global_batch_size", "global_batch_tokens")
              if k in values}
    base, req, _ = prepare_plan({"model": model, "gpus": f"1x{gpu}", **values}, top=1,
                                **extras)
    return base, req, size_one(base, resolve_gpu(gpu), int(tokens), req, days)


def test_size_counts() -> None:
    assert size_counts(8, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert size_counts(4, 32) == [1, 2, 4, 8, 16, 32]
    assert size_counts(16, 16) == [1, 2, 4, 8, 16]
    assert size_counts(8, 4) == [1, 2, 4]


def test_row_arithmetic_and_deadline() -> None:
    tokens = 2e12
    base, req, row = sized("llama2-7b", "A100-80GB", tokens, days=30)
    e = row.entry
    assert e is not None and e.fits and row.num_gpus == e.report.gpu.num_gpus
    seconds = tokens / e.speed.tokens_per_s
    assert row.days == pytest.approx(seconds / 86_400)
    assert row.gpu_hours == pytest.approx(row.num_gpus * seconds / 3600)
    assert row.cost_usd == pytest.approx(row.gpu_hours * 1.9)  # profile price $1.90/h
    # meets the deadline, and the next smaller count tried does not
    assert row.days <= 30
    counts = size_counts(8, 10**6)
    i = counts.index(row.num_gpus)
    if counts[i - 1] >= row.min_gpus:
        smaller = base.model_copy(update={"cluster": base.cluster.model_copy(update={
            "num_nodes": max(counts[i - 1] // 8, 1), "gpus_per_node": min(counts[i - 1], 8)})})
        res = search(smaller, req)
        assert not res.entries or tokens / res.entries[0].speed.tokens_per_s > 30 * 86_400
    # the minimum: nothing fits on the count before it
    j = counts.index(row.min_gpus)
    if j > 0:
        n = counts[j - 1]
        tiny = base.model_copy(update={"cluster": base.cluster.model_copy(update={
            "num_nodes": max(n // 8, 1), "gpus_per_node": min(n, 8)})})
        assert not search(tiny, req).entries


def test_without_deadline_uses_the_minimum() -> None:
    _, _, row = sized("llama2-7b", "H100", 1e11)
    assert row.num_gpus == row.min_gpus
    assert row.days == pytest.approx(1e11 / row.entry.speed.tokens_per_s / SECONDS_PER_DAY)


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
