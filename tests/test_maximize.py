"""`vramcalc max`: the longest sequence / largest micro-batch that fits.

The boundary property is checked with the estimate itself (the answer fits, the next step
does not); the hand-checked cases pin the search against answers derived outside it: a GPU
whose memory is set to exactly the device total at a chosen length must answer that length,
and activations linear in the micro-batch (DESIGN.md, "activations linear in micro-batch")
give the largest micro-batch as floor((usable - C) / A) from two estimates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramcalc.analytic import estimate
from vramcalc.cli import main
from vramcalc.options import build_scenario
from vramcalc.planner.maximize import most_that_fits, scenario_at, seq_step


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("values,dimension", [
    ({"model": "llama3-8b", "gpus": "8xH100", "zero": 3}, "seq-len"),
    ({"model": "llama3-8b", "gpus": "8xH100", "zero": 3, "recompute": "full"}, "micro-batch"),
    ({"model": "qwen3-0.6b", "gpus": "1xRTX4090", "attention": "eager"}, "seq-len"),
    ({"model": "llama2-7b", "gpus": "8xA100-80GB", "tp": 2, "sequence_parallel": True,
      "fsdp": "full"}, "seq-len"),
])
def test_answer_fits_and_the_next_step_does_not(values: dict, dimension: str) -> None:
    base = build_scenario(values)
    res = most_that_fits(base, dimension, 256)
    assert res.answer is not None and res.next_value is not None
    assert res.next_value == res.answer + res.step
    assert estimate(scenario_at(base, dimension, res.answer)).fits
    assert not estimate(scenario_at(base, dimension, res.next_value)).fits
    # the chart has points on both sides of the capacity line
    assert any(p.fits for p in res.points) and any(not p.fits for p in res.points)
    assert all(p.fits == (p.value <= res.answer) for p in res.points)


def test_gpu_sized_to_the_total_at_a_length_answers_that_length() -> None:
    """Hand-checked: give the GPU exactly the memory the layout needs at seq 6144 (headroom
    0): 6144 fits with 0 bytes free, 6144 + 256 needs more."""
    base = build_scenario({"model": "llama3-8b", "gpus": "8xH100", "zero": 3,
                           "headroom": 0.0})
    need = estimate(scenario_at(base, "seq-len", 6144)).device_total_bytes
    assert base.cluster is not None
    gpu = base.cluster.gpu.model_copy(update={"memory_total_bytes": need})
    sized = base.model_copy(update={"cluster": base.cluster.model_copy(update={"gpu": gpu})})
    res = most_that_fits(sized, "seq-len", 256)
    assert res.answer == 6144
    assert res.report is not None and res.report.free_bytes == 0


def test_largest_micro_batch_matches_the_linear_extrapolation() -> None:
    """Hand-checked: with full recompute and flash attention the device total is C + b*A
    (to the allocator's rounding), so the answer is floor((usable - C) / A) from b = 1, 2."""
    base = build_scenario({"model": "llama3-8b", "gpus": "8xH100", "zero": 3,
                           "recompute": "full"})
    t1 = estimate(scenario_at(base, "micro-batch", 1)).device_total_bytes
    t2 = estimate(scenario_at(base, "micro-batch", 2)).device_total_bytes
    per_sequence = t2 - t1
    assert base.usable_bytes is not None
    expected = 1 + (base.usable_bytes - t1) // per_sequence
    res = most_that_fits(base, "micro-batch")
    assert res.answer is not None and abs(res.answer - expected) <= 1


def test_micro_batch_with_a_global_batch_divides_it() -> None:
    one = build_scenario({"model": "llama3-8b", "gpus": "8xH100", "zero": 3,
                          "recompute": "full"})
    base = one.model_copy(update={"parallel": one.parallel.model_copy(
        update={"global_batch_size": 96})}).resolved()  # as a DeepSpeed file or check sets it
    res = most_that_fits(base, "micro-batch")
    assert res.answer is not None and 12 % res.answer == 0  # 96 / dp 8 = 12 per rank


def test_step_respects_the_layout() -> None:
    base = build_scenario({"model": "llama3-8b", "gpus": "8xH100", "cp": 4, "tp": 2,
                           "sequence_parallel": True})
    assert seq_step(base, 100) % 8 == 0 and seq_step(base, 100) % 100 == 0


def test_cli_json_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "max", "--model", "llama3-8b", "--gpus", "8xH100", "--zero",
                        "3", "--json")
    assert code == 0
    doc = json.loads(out)["maximize"]
    assert doc["answer"] % 256 == 0 and doc["next_value"] == doc["answer"] + 256
    assert doc["report"]["fits"] is True
    code, out, _ = _run(capsys, "max", "--model", "llama3-8b", "--gpus", "8xH100", "--zero",
                        "3")
    assert code == 0
    assert f"{doc['answer']:,} tokens" in out and "┃" in out


def test_cli_nothing_fits_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "max", "--model", "llama3-70b", "--gpus", "1xRTX4090")
    assert code == 1 and "Nothing fits" in out
    assert "try: vramcalc plan --model llama3-70b --gpus 1xRTX4090\n" in out  # where next
    code, plan_out, _ = _run(capsys, "plan", "--model", "llama3-70b", "--gpus", "1xRTX4090")
    assert "Smallest changes that fit" in plan_out  # and that command answers it


@pytest.mark.parametrize("args,text", [
    (["--maximize", "heads"], "--maximize"),
    (["--plot", "chart.pdf"], ".png or .svg"),
    (["--step", "0"], "--step"),
])
def test_cli_bad_input(capsys: pytest.CaptureFixture[str], args: list[str], text: str) -> None:
    code, _, err = _run(capsys, "max", "--model", "gpt2", "--gpus", "1xH100", *args)
    assert code == 2 and err.startswith("error:") and text in err
    assert len(err.strip().splitlines()) == 1


def test_plot_without_matplotlib_is_a_clear_error(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, _, err = _run(capsys, "max", "--model", "gpt2", "--gpus", "1xH100", "--plot",
                        str(tmp_path / "m.png"))
    assert code == 2 and "pip install 'llm-vramcalc[plot]'" in err
    assert not (tmp_path / "m.png").exists()


@pytest.mark.parametrize("suffix,magic", [(".png", b"\x89PNG"), (".svg", b"<?xml")])
def test_plot_writes_the_file(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                              suffix: str, magic: bytes) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / f"m{suffix}"
    code, _, _ = _run(capsys, "max", "--model", "gpt2", "--gpus", "1xRTX4090", "--plot",
                      str(path))
    assert code == 0 and path.read_bytes().startswith(magic)


def test_chart_draws_the_usable_line_between_fitting_and_over() -> None:
    from vramcalc.render.maxchart import chart_lines

    base = build_scenario({"model": "qwen2.5-7b", "gpus": "1xRTX4090", "finetune": "lora",
                           "recompute": "full"})
    res = most_that_fits(base, "seq-len", 256)
    lines = chart_lines(res.points, res.usable_bytes, res.capacity_bytes, "seq-len", 100)
    rows = [ln.plain for ln in lines[1:]]
    assert len(rows) == len(res.points)
    for row, p in zip(rows, res.points, strict=True):
        assert row.split()[0] == f"{p.value:,}" and row.endswith(
            f"{p.device_total_bytes / 1e9:,.1f} GB")
        mark = row.index("┃")
        assert (row[mark + 1] == "█") == (not p.fits)
        assert len(row) <= 100


def test_learned_positions_cap_the_sequence() -> None:
    """GPT-2 has 1,024 learned positions (n_positions, huggingface.co/openai-community/gpt2
    config.json): on an H100 the answer is the whole table, not a longer sequence."""
    res = most_that_fits(build_scenario({"model": "gpt2", "gpus": "1xH100"}), "seq-len", 256)
    assert res.answer == 1024 and res.next_value is None


def test_rotary_answer_past_the_trained_context_says_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "max", "--model", "llama2-7b", "--gpus", "8xH100", "--zero",
                        "3", "--recompute", "full")
    assert code == 0 and "longer than the model's trained context of 4,096 tokens" in out


def test_step_beyond_the_sequence_limit_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "max", "--model", "llama3-8b", "--gpus", "1xH100", "--step",
                        "1000000000000")
    assert code == 2 and err.startswith("error: --step must be between")


def test_trace_engine_bisects_the_trace_fit() -> None:
    # --engine trace: the trace's fit (the allocator's smallest capacity, at least the
    # analytic floor) bisected up to the analytic answer: its answer fits by the trace's own
    # report, is no larger than the analytic one, and every value traced is a chart point
    from vramcalc.trace.distributed import trace_any

    base = build_scenario({"model": "gpt2", "gpus": "1xRTX4090", "framework": "hf",
                           "precision": "fp32", "attention": "eager", "seq_len": 1024})
    analytic = most_that_fits(base, "micro-batch")
    traced = most_that_fits(base, "micro-batch", engine=trace_any)
    assert analytic.answer is not None and traced.answer is not None
    assert traced.answer <= analytic.answer
    assert traced.report is not None and traced.report.engine == "trace"
    assert traced.report.fits
    seen = {p.value: p for p in traced.points}
    assert seen[traced.answer].fits
    if traced.next_value is not None and traced.next_value in seen:
        assert not seen[traced.next_value].fits
    assert all(p.value <= (analytic.next_value or analytic.answer) for p in traced.points)


def test_cli_engine_choice(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "max", "--model", "gpt2", "--gpus", "1xH100", "--engine", "x")
    assert code == 2 and err.startswith("error:") and "--engine" in err
    code, _, err = _run(capsys, "max", "--model", "llama3-8b", "--gpus", "1xH100",
                        "--framework", "megatron", "--engine", "trace")
    assert code == 2 and err.startswith("error:")
