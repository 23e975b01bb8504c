"""Any mix of valid option values ends in a report (exit 0/1) or one clear line (exit 2):
never a traceback. Hypothesis draws command lines from the option table's own choices, so
new options and values are covered as they are added; a second strategy draws `estimate`
lines as users type them, with malformed values, `=` forms, typos and repeats."""

from __future__ import annotations

import contextlib
import io

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramcalc.cli import main
from vramcalc.options import SCENARIO_OPTIONS

MODELS = ["gpt2", "8b", "70b", "mixtral-8x7b", "qwen2.5-7b", "llama2-7b", "bert-large", "roberta-base"]
GPUS = ["4090", "A100", "H100", "8xH100", "2x8xA100-80GB", "910B", "MI300X", "8xB200"]
NUMBERS = {"tp": ["1", "2", "8"], "pp": ["1", "2", "4"], "cp": ["1", "2"], "ep": ["1", "8"],
           "zero": ["0", "1", "3"], "seq_len": ["256", "4096"], "micro_batch_size": ["1", "2"],
           "grad_accum": ["1", "4"], "lora_rank": ["8", "64"], "chunked_ce": ["1", "8"]}
CHOICES = {o.flag: list(o.choices) for o in SCENARIO_OPTIONS if o.choices}
CHOICES.update({o.flag: NUMBERS[o.name] for o in SCENARIO_OPTIONS if o.name in NUMBERS})


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    cmd = draw(st.sampled_from(["estimate", "estimate", "explain"]))
    args = [cmd, "--model", draw(st.sampled_from(MODELS)), "--gpus",
            draw(st.sampled_from(GPUS))]
    for flag in draw(st.lists(st.sampled_from(sorted(CHOICES)), max_size=6, unique=True)):
        args += [flag, draw(st.sampled_from(CHOICES[flag]))]
    if draw(st.booleans()):
        args.append("--json")
    return args


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(command_lines())
def test_no_option_mix_ends_in_a_traceback(args: list[str]) -> None:
    _report_or_one_error_line(args)


def _report_or_one_error_line(args: list[str]) -> None:
    """`vramcalc ARGS` exits 0 or 1 with output, or 2 with one `error:` line; never a
    traceback."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)  # an uncaught exception fails the test with its traceback
    assert code in (0, 1, 2), (args, err.getvalue())
    if code == 2:
        lines = err.getvalue().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, lines)
    else:
        assert out.getvalue().strip(), args


ODD_VALUES = ["0", "-1", "1.5", "abc", "", " 8", "1_000", "+2", "--json", "1e3", "0.05"]
BOOL_FLAGS = [f for o in SCENARIO_OPTIONS if o.kind is bool
              for f in (o.flag, "--no-" + o.flag[2:])]


@st.composite
def estimate_lines(draw: st.DrawFn) -> list[str]:
    """estimate lines as users type them, with typos, odd values, = forms and repeats."""
    args = ["estimate"]
    if draw(st.booleans()):
        args += ["--model", draw(st.sampled_from(MODELS + ["70", "gtp2"]))]
    if draw(st.booleans()):
        args += ["--gpus", draw(st.sampled_from(GPUS))]
    flags = sorted(CHOICES) + ["--headroom", "--lora-dropout", "--capacity-factor", "--dp"]
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.integers(0, 9))
        if kind < 6:
            flag = draw(st.sampled_from(flags))
            value = draw(st.sampled_from(CHOICES.get(flag, ["1"]) + ODD_VALUES))
            args += [f"{flag}={value}"] if kind == 0 else [flag, value]
        elif kind < 8:
            args.append(draw(st.sampled_from(BOOL_FLAGS + ["--json"])))
        elif kind == 8:
            args.append(draw(st.sampled_from(["--seq-len", "--help", "--jsn", "-h", "x"])))
        else:
            args += ["--profiles-dir", draw(st.sampled_from(["/nonexistent", "hardware_profiles"]))]
    return args


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(estimate_lines())
def test_odd_estimate_lines_end_in_a_report_or_one_error_line(args: list[str]) -> None:
    _report_or_one_error_line(args)
