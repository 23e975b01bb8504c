"""One fit definition for every command and format (issue 15, bug 3).

usable = the GPU's memory less the requested headroom; free = usable - device total; it fits
when free >= 0. Each case below printed two different margins before.
"""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from vramcalc.cli import app

runner = CliRunner()
H100 = 85_045_477_376  # hardware_profiles/h100_sxm.yaml memory_total_bytes (CUDA totalGlobalMem)


def _run(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.stdout


def _gb(text: str, pattern: str) -> float:
    m = re.search(pattern, text)
    assert m, (pattern, text)
    return float(m.group(1).replace(",", ""))


def test_estimate_json_and_text_use_the_requested_headroom() -> None:
    # 8B at seq 7200 with ZeRO-1 lands between 95 % and 100 % of the card
    args = ("estimate", "--model", "8b", "--gpus", "8xH100", "--zero", "1", "--seq-len", "7200",
            "--headroom", "0.05")
    rc, out = _run(*args, "--json")
    doc = json.loads(out)
    assert doc["usable_bytes"] == int(H100 * 0.95)
    assert doc["free_bytes"] == doc["usable_bytes"] - doc["device_total_bytes"]
    assert doc["fits"] is (doc["free_bytes"] >= 0)
    _, text = _run(*args)
    margin = doc["free_bytes"] / 1e9
    word = "free" if margin >= 0 else "over by"
    assert f"{abs(margin):,.2f} GB" in text and word in text


def test_check_text_and_markdown_give_the_same_margin() -> None:
    _, text = _run("check", "examples/train.yaml")
    _, md = _run("check", "examples/train.yaml", "--markdown")
    _, js = _run("check", "examples/train.yaml", "--json")
    doc = json.loads(js)
    free = (doc["usable_bytes"] - doc["device_total_bytes"]) / 1e9
    assert _gb(text, r"([\d,.]+) GB free") == round(free, 2)
    assert _gb(md, r"([\d,.]+) GB free") == round(free, 2)


def test_plan_states_one_overshoot() -> None:
    _, out = _run("plan", "--model", "70b", "--gpus", "8xH100")
    overs = {round(float(x.replace(",", "")), 2) for x in re.findall(r"over by ([\d,.]+) GB", out)}
    assert len(overs) == 1, out


def test_a_tight_analytic_fit_points_to_the_trace() -> None:
    # within a fifth of the card the analytic device total (the packing floor) gets a hint
    # that the allocator can need more near the limit (docs/trace.md, "The fit"); with room
    # to spare, or when it does not fit, none
    base = ("estimate", "--model", "llama3.1-8b", "--gpus", "1xRTX4090", "--framework", "hf",
            "--precision", "amp-bf16", "--finetune", "qlora", "--kbit-prepare",
            "--lora-targets", "all-linear", "--recompute", "full")
    flags = ("--json",)
    for seq, tight in (("6000", True), ("512", False), ("60000", False)):
        doc = json.loads(_run(*base, "--seq-len", seq, *flags)[1])
        assert (doc["fits"] and doc["free_bytes"] < 0.2 * doc["usable_bytes"]) is tight
        text = _run(*base, "--seq-len", seq)[1]
        assert ("vramcalc trace" in text) is tight
