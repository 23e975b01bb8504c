"""Any mix of valid option values ends in a report (exit 0/1) or one clear line (exit 2):
never a traceback. Hypothesis draws command lines from the option table's own choices, so
new options and values are covered as they are added."""

from __future__ import annotations

import contextlib
import io

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramcalc.cli import main
from vramcalc.options import SCENARIO_OPTIONS

MODELS = ["gpt2", "8b", "70b", "mixtral-8x7b", "qwen2.5-7b", "llama2-7b"]
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
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)  # an uncaught exception fails the test with its traceback
    assert code in (0, 1, 2), (args, err.getvalue())
    if code == 2:
        lines = err.getvalue().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, lines)
    else:
        assert out.getvalue().strip(), args
