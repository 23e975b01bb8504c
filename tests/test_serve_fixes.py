"""What `plan --serve` offers when nothing fits the GPUs a user has, and the GPUs vLLM's
quantized kernels run on.

Every suggested change is a `vramcalc serve` command; the tests run each and require it to
fit, and require the context fix to be the longest: one token more no longer fits.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

from typer.testing import CliRunner

from vramcalc.catalog import resolve_model
from vramcalc.cli import app
from vramcalc.hardware import parse_gpus
from vramcalc.serve import ServeConfig
from vramcalc.serve.plan import fixes_within

runner = CliRunner()


def _serve(command: str) -> dict:
    words = shlex.split(command)
    assert words[:2] == ["vramcalc", "serve"]
    res = runner.invoke(app, [*words[1:], "--json"])
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.stdout)


def _plan(*args: str) -> dict:
    res = runner.invoke(app, ["plan", "--serve", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_every_suggested_command_fits_and_the_context_is_the_longest() -> None:
    # Llama-3.1-70B in bf16 is 141 GB of weights: one copy needs four H100s at 131,072
    # tokens, so on two nothing in the table fits
    doc = _plan("--model", "llama3.1-70b", "--gpus", "2xH100")
    assert doc["num_within"] == 0 and doc["options"][0]["num_gpus"] > 2
    fixes = doc["fixes_within"]
    changes = [f["change"] for f in fixes]
    assert changes[0].keys() == {"max_model_len"} and {"quantization": "fp8"} in changes
    for fix in fixes:
        assert fix["option"]["num_gpus"] <= 2
        report = _serve(fix["command"])
        assert report["fits"] and report["max_concurrent_seqs"] >= 1
    longest = changes[0]["max_model_len"]
    over = _serve(fixes[0]["command"].replace(f"--max-model-len {longest}",
                                              f"--max-model-len {longest + 1}"))
    assert not over["fits"]


def test_the_context_fix_is_the_length_vllm_names() -> None:
    # vLLM's start-up check names the longest length the cache holds; the fix found by
    # bisection over whole layouts is the same figure
    serve = runner.invoke(app, ["serve", "--model", "llama3.1-8b", "--gpus", "RTX4090",
                                "--json"])
    longest = json.loads(serve.stdout)["kv_capacity_tokens"]
    spec = resolve_model("llama3.1-8b")[0]
    fixes = fixes_within(spec, parse_gpus("RTX4090").gpu, ServeConfig(), 1, 1)
    assert fixes[0].change == {"max_model_len": longest}
    assert fixes[0].option.tp == 1 and fixes[0].option.report.fits


def test_no_fix_when_the_base_fits() -> None:
    spec = resolve_model("llama3.1-8b")[0]
    assert fixes_within(spec, parse_gpus("H100").gpu, ServeConfig(max_model_len=8192), 1,
                        1) == []


def test_fp8_is_not_offered_or_accepted_below_ampere() -> None:
    # vllm/model_executor/layers/quantization/fp8.py: get_min_capability() = 80; the T4 is
    # 7.5, where AWQ (75) still runs
    doc = _plan("--model", "llama3.1-8b", "--gpus", "T4")
    quants = [f["change"].get("quantization") for f in doc["fixes_within"]]
    assert "fp8" not in quants and "awq" in quants
    res = subprocess.run([sys.executable, "-m", "vramcalc", "serve", "--model", "llama3.1-8b",
                          "--gpus", "T4", "--quantization", "fp8"], capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.startswith("error: --quantization fp8 needs "
                                                         "compute capability 8.0 or newer")
    assert runner.invoke(app, ["serve", "--model", "llama3.1-8b", "--gpus", "A100",
                               "--quantization", "fp8", "--max-model-len", "8192"]
                         ).exit_code == 0


def test_a_serve_run_that_does_not_fit_names_the_plan() -> None:
    res = runner.invoke(app, ["serve", "--model", "llama3.1-70b", "--gpus", "2xH100",
                              "--engine", "sglang"])
    assert res.exit_code == 1
    assert "try: vramcalc plan --serve --model llama3.1-70b --gpus 2xH100 --engine sglang" \
        in " ".join(res.output.split())


def test_nothing_within_reach_says_more_gpus() -> None:
    res = runner.invoke(app, ["plan", "--serve", "--model", "llama3.1-405b", "--gpus",
                              "1xRTX4090"])
    assert res.exit_code == 0
    assert "more GPUs are needed" in res.output


def test_a_serving_option_without_serve_is_refused() -> None:
    for args in (["--concurrency", "4"], ["--max-model-len", "4096"], ["--enable-lora"]):
        res = subprocess.run([sys.executable, "-m", "vramcalc", "plan", "--model", "8b",
                              "--gpus", "1xH100", *args], capture_output=True, text=True)
        assert res.returncode == 2 and "add --serve" in res.stderr


def test_fixes_keep_the_lora_slots() -> None:
    doc = _plan("--model", "llama3.1-70b", "--gpus", "2xH100", "--enable-lora", "--max-loras",
                "4", "--max-lora-rank", "64")
    assert doc["fixes_within"]
    for fix in doc["fixes_within"]:
        assert "--enable-lora --max-loras 4 --max-lora-rank 64" in fix["command"]
        report = _serve(fix["command"])
        assert report["fits"] and report["terms"]["lora_slots"] > 0
