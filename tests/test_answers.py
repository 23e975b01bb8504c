"""Answers a user can act on (issue 15): batch suffixes, narrow terminals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vramcalc.cli.plan import prepare_plan
from vramcalc.planner.request import splittable_batch
from vramcalc.units import parse_count


def test_binary_and_decimal_suffixes() -> None:
    assert parse_count("4M") == 4_000_000
    assert parse_count("4Mi") == 4 * 2**20
    assert parse_count("16Ki") == 16 * 1024
    assert parse_count("1.5T") == 1_500_000_000_000
    assert parse_count("2Ti") == 2 * 2**40


def test_a_decimal_token_batch_becomes_a_batch_that_splits() -> None:
    # 4M tokens of 4096 are 976.6 sequences; 977 is prime, so no data-parallel degree
    # divides it and the planner fell back to pp4 x cp2 without data parallelism
    base, req, notes = prepare_plan({"model": "8b", "gpus": "8xH100"}, global_batch_tokens="4M")
    batch = req.batch_for(base.training.seq_len)
    assert batch % 8 == 0 and abs(batch - 4e6 / 4096) / (4e6 / 4096) <= 1 / 16
    assert any("976.6 sequences" in n and f"using {batch:,}" in n for n in notes)
    # a binary suffix is exact: no rounding, no note
    base, req, notes = prepare_plan({"model": "8b", "gpus": "8xH100"},
                                    global_batch_tokens="4Mi")
    assert req.batch_for(4096) == 1024 and not any("sequences of" in n for n in notes)


@pytest.mark.parametrize("n", [977, 1953, 1000, 7, 100_003])
def test_splittable_batch_is_close_and_has_a_large_power_of_two(n: int) -> None:
    b = splittable_batch(n)
    assert abs(b - n) <= n / 16 + 0.5
    if n >= 16:
        assert b % 2 ** ((n // 16).bit_length() - 1) == 0  # >= n/32 divides it


def test_plan_with_4m_tokens_uses_data_parallelism() -> None:
    out = subprocess.run([sys.executable, "-m", "vramcalc", "plan", "--model", "8b", "--gpus",
                          "8xH100", "--global-batch-tokens", "4M", "--json"],
                         capture_output=True, text=True, check=True).stdout
    best = json.loads(out)["candidates"][0]["strategy"]
    assert best["dp"] > 1


def _cli(args: list[str], columns: int) -> str:
    env = {"COLUMNS": str(columns), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "vramcalc", *args], capture_output=True, text=True,
                       env=env)
    assert r.returncode in (0, 1), r.stderr
    return r.stdout


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("args", [
    ["plan", "--model", "8b", "--gpus", "8xH100"],
    ["size", "--model", "70b", "--tokens", "2T", "--gpu", "A100", "--gpu", "H100"],
    ["models"],
    ["gpus"],
])
def test_tables_fit_the_terminal_and_never_cut_numbers(args: list[str], columns: int) -> None:
    out = _cli(args, columns)
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= columns


def test_text_columns_fold_at_words_not_inside_them() -> None:
    """Two text columns (layout, sharding) whose words all fit: folding them must split at
    spaces, never inside 'dp2×tp2×pp8×cp2' or a number of the last column."""
    from rich.console import Console

    from vramcalc.render.tables import Column, fitted_table

    cols = [Column("#"), Column("layout", wrap=True), Column("ZeRO/FSDP", wrap=True),
            Column("recompute"), Column("free", "right")]
    rows = [["1", "dp2×tp2×pp8×cp2 sp", "fsdp grad-op", "none", "2.2"],
            ["2", "dp2×tp4×pp4×cp2 sp", "zero-1", "none", "9.1"]]
    for width in range(50, 66):  # 50: the longest words and numbers side by side
        table, dropped = fitted_table("t", cols, rows, width)
        console = Console(width=width, record=True, color_system=None)
        console.print(table)
        out = console.export_text()
        assert not dropped
        assert "dp2×tp2×pp8×cp2" in out and "dp2×tp4×pp4×cp2" in out, (width, out)
        assert " 2.2" in out and " 9.1" in out, (width, out)
