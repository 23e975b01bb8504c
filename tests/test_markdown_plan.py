"""`plan --markdown`, `estimate --markdown` and the summary at the top of `plan --json`.

Every number in the markdown is checked against the same command's --json (one fit
definition for every format), and the usable memory against the GPU's memory less the
requested headroom, computed here.
"""

from __future__ import annotations

import json
import re

import pytest

from vramcalc.cli import main
from vramcalc.report import fit_phrase


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


PLAN = ["plan", "--model", "llama3-8b", "--gpus", "8xH100", "--top", "3"]
EST = ["estimate", "--model", "llama3-8b", "--gpus", "8xH100", "--zero", "3",
       "--headroom", "0.1"]


def test_plan_json_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, *PLAN, "--json")
    assert code == 0
    doc = json.loads(out)
    summary, cands = doc["summary"], doc["candidates"]
    assert list(doc)[3] == "summary"  # first after the version keys
    assert summary["model"] == {"name": "llama3-8b", "num_params": 8_030_261_248}
    cl = summary["cluster"]
    assert (cl["num_gpus"], cl["num_nodes"], cl["gpu"]) == (8, 1, "h100_sxm")
    # plan keeps 5 % free by default: usable = memory x 0.95
    assert cl["usable_bytes"] == int(cl["memory_total_bytes"] * 0.95)
    assert summary["fits"] is True and summary["num_fitting"] == len(cands) == 3
    best = summary["best"]
    assert best["device_total_bytes"] == cands[0]["device_total_bytes"]
    assert best["free_bytes"] == cl["usable_bytes"] - best["device_total_bytes"]
    assert best["tokens_per_s"] == cands[0]["tokens_per_s"]
    s = cands[0]["strategy"]
    assert best["layout"].split()[0] == "×".join(
        f"{k}{s[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if s[k] > 1)


def test_plan_json_summary_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", "--model", "llama3-70b", "--gpus", "1xH100", "--json")
    summary = json.loads(out)["summary"]
    assert summary["fits"] is False and summary["num_fitting"] == 0
    assert summary["best"]["fits"] is False and summary["best"]["free_bytes"] < 0


def test_plan_markdown_matches_json(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _run(capsys, *PLAN, "--json")
    cands = json.loads(out)["candidates"]
    code, md, _ = _run(capsys, *PLAN, "--markdown")
    assert code == 0
    assert md.startswith("### vramcalc plan: ✅ 3 strategies fit — llama3-8b on 8 × ")
    rows = [line for line in md.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) == 3
    for row, cand in zip(rows, cands, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == f"{cand['tokens_per_s']:,.0f}"
        assert cells[9] == f"{cand['device_total_bytes'] / 1e9:,.1f}"
    assert "```\nvramcalc estimate --model llama3-8b --gpus 8xH100" in md
    assert f"**{cands[0]['device_total_bytes'] / 1e9:,.2f}**" in md  # best's device total


def test_plan_markdown_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code, md, _ = _run(capsys, "plan", "--model", "llama3-70b", "--gpus", "1xH100",
                       "--markdown")
    assert code == 0 and "❌ nothing fits" in md.splitlines()[0]
    assert "`vramcalc plan --model llama3-70b" in md  # each change with its command


def test_estimate_markdown_matches_json(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _run(capsys, *EST, "--json")
    rep = json.loads(out)
    code, md, _ = _run(capsys, *EST, "--markdown")
    assert code == 0
    assert md.startswith("### vramcalc estimate: ✅ fits — `llama3-8b on 8xH100`")
    cap = rep["gpu"]["memory_total_bytes"]
    assert rep["usable_bytes"] == int(cap * 0.9)
    assert fit_phrase(rep["device_total_bytes"], rep["usable_bytes"], cap) in md
    assert "(10% headroom requested)" in md
    for term, value in rep["terms"].items():
        label = term.replace("_", " ").replace("logits", "logits + loss")
        assert f"| {label} | {value / 1e9:,.2f} |" in md


@pytest.mark.parametrize("args", [PLAN, EST])
def test_json_and_markdown_together_is_bad_input(capsys: pytest.CaptureFixture[str],
                                                 args: list[str]) -> None:
    code, out, err = _run(capsys, *args, "--json", "--markdown")
    assert code == 2 and out == "" and err.startswith("error: choose one of --json")


def test_markdown_with_serve_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "plan", "--serve", "--model", "llama3-8b", "--gpus", "1xH100",
                        "--markdown")
    assert code == 2 and "--markdown is for training plans" in err
