"""The evidence band under estimate's verdict: vramcalc/evidence.yaml summarises the
comparisons of docs/validation.md (scripts/gen_evidence.py), and the verdict says when the
fit margin lies inside it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from typer.testing import CliRunner

from vramcalc.cli.app import app
from vramcalc.evidence import ALL, EVIDENCE_FILE, band_for, bands

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gen_evidence", ROOT / "scripts" / "gen_evidence.py")
assert _spec is not None and _spec.loader is not None
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

runner = CliRunner()

SAMPLE = """\
## Calibration against published measurements

| record | flags | engine | estimate GiB | measured GiB | error |
|---|---|---|---|---|---|
| a | --model x --framework torchtune --seq-len 512 | analytic | 1.0 | 1.0 | −30.5 % |
| b | --model x --framework torchtune | trace | 1.0 | 1.0 | +1.5% |
| c | --model x | analytic | 1.0 | 1.0 | -2.0% |
| d | --model x --framework hf | analytic | — | 1.0 | not expressible: a mechanism |

## Published rows outside the calibration set

| source | row | published | vramcalc | error | flags |
|---|---|---|---|---|---|
| LitGPT | r | 1.0 GB | 1.0 GB | +4.0% | --framework lightning --seq-len 512 |

## Megatron-LM's functional tests outside the calibration set

| case | golden files | error | with --attention eager (auto backend) | flags |
|---|---|---|---|---|
| m | 3 | +4.6% … +5.0% | +517.8% … +520.1% | --framework megatron |

## torchtitan's December 2024 benchmark, row by row

| table | row | layout flags | estimate GiB | measured GiB | error |
|---|---|---|---|---|---|
| 1 | FSDP | `--model llama3.1-8b --fsdp full` | 74.93 | 77.0 | −2.7 % |
"""


def test_rows_by_profile_from_flags_or_section() -> None:
    # one error per run: the flags' --framework, else the section's profile; a row with no
    # percentage and Megatron's ranges over golden files count none
    assert gen.row_errors(SAMPLE) == [("torchtune", 30.5), ("torchtune", 1.5),
                                      ("reference", 2.0), ("lightning", 4.0),
                                      ("torchtitan", 2.7)]


def test_band_is_median_nearest_rank_p90_and_worst() -> None:
    assert gen._band([float(e) for e in range(1, 11)]) == {
        "runs": 10, "median_pct": 5.5, "p90_pct": 9.0, "worst_pct": 10.0}
    assert gen.evidence(SAMPLE)["torchtune"] == {"runs": 2, "median_pct": 16.0,
                                                 "p90_pct": 30.5, "worst_pct": 30.5}
    assert gen.evidence(SAMPLE)["all"]["runs"] == 5


def test_shipped_evidence_matches_the_validation_tables() -> None:
    text = (ROOT / "docs" / "validation.md").read_text(encoding="utf-8")
    assert EVIDENCE_FILE.read_text(encoding="utf-8") == gen.render(gen.evidence(text)), (
        "vramcalc/evidence.yaml is out of date: run python scripts/gen_evidence.py")
    assert bands()[ALL].runs == len(gen.row_errors(text)) > 100


def test_a_profile_without_published_runs_takes_every_run() -> None:
    assert band_for("torchtune")[0] == "torchtune"
    assert band_for("unsloth") == (ALL, bands()[ALL])


def _verdict(args: list[str]) -> str:
    result = runner.invoke(app, ["estimate", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_margin_inside_the_band_says_confirm_on_the_gpu() -> None:
    args = ["--model", "8b", "--gpus", "1xRTX4090", "--framework", "torchtune",
            "--finetune", "lora", "--recompute", "full"]
    out = _verdict(args)
    free = float(re.search(r"([\d.]+) GB free", out).group(1))  # type: ignore[union-attr]
    total = float(re.search(r"needs ([\d.]+) GB", out).group(1))  # type: ignore[union-attr]
    p90 = bands()["torchtune"].p90_pct
    assert free < p90 / 100 * total  # the case this test is about
    assert (f"evidence: the {free:.2f} GB margin is less than the error of 1 in 10 of "
            f"{bands()['torchtune'].runs} published torchtune runs") in out
    assert "vramcalc probe" in out


def test_margin_outside_the_band_gives_the_band() -> None:
    out = _verdict(["--model", "7b", "--gpus", "1xH100", "--recompute", "full"])
    band = bands()[ALL]
    assert (f"evidence: {band.runs} published runs of all stacks (none with the reference "
            f"profile): half within ±{band.median_pct:.1f}%") in out
    assert "confirm on the GPU" not in out


def test_check_json_says_whether_the_margin_is_inside_the_band(tmp_path: Path) -> None:
    import json
    cfg = tmp_path / "train.yaml"
    cfg.write_text("model: 8b\ngpus: 1xRTX4090\nframework: torchtune\nfinetune: lora\n"
                   "recompute: full\nheadroom: 0\n", encoding="utf-8")
    result = runner.invoke(app, ["check", str(cfg), "--json"])
    doc = json.loads(result.stdout)
    ev, total = doc["evidence"], doc["device_total_bytes"]
    band = bands()["torchtune"]
    assert (ev["runs_of"], ev["runs"], ev["p90_abs_error_pct"]) == ("torchtune", band.runs,
                                                                   band.p90_pct)
    margin = doc["usable_bytes"] - total
    assert 0 < margin < band.p90_pct / 100 * total  # the case this test is about
    assert ev["margin_within_p90"] is True
    cfg.write_text("model: gpt2\ngpus: 1xH100\n", encoding="utf-8")
    roomy = json.loads(runner.invoke(app, ["check", str(cfg), "--json"]).stdout)["evidence"]
    assert (roomy["runs_of"], roomy["margin_within_p90"]) == (ALL, False)


def test_estimate_json_carries_the_band_check_json_does(tmp_path: Path) -> None:
    import json
    flags = ["--model", "8b", "--gpus", "1xRTX4090", "--framework", "torchtune", "--finetune",
             "lora", "--recompute", "full", "--headroom", "0"]
    est = json.loads(runner.invoke(app, ["estimate", *flags, "--json"]).stdout)
    cfg = tmp_path / "train.yaml"
    cfg.write_text("model: 8b\ngpus: 1xRTX4090\nframework: torchtune\nfinetune: lora\n"
                   "recompute: full\nheadroom: 0\n", encoding="utf-8")
    chk = json.loads(runner.invoke(app, ["check", str(cfg), "--json"]).stdout)
    assert est["evidence"] == chk["evidence"] and est["evidence"]["margin_within_p90"] is True
