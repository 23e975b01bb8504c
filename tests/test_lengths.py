"""`trace --lengths`: micro-batches padded to their longest sample, replayed through the
allocator model (vramcalc/lengths.py, vramcalc/trace/engine.py `run_steps`)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from vramcalc.cli import main  # noqa: E402
from vramcalc.errors import InputError  # noqa: E402
from vramcalc.lengths import MAX_STEPS, padded_batches, read_lengths  # noqa: E402
from vramcalc.model import ModelSpec  # noqa: E402
from vramcalc.scenario import Scenario  # noqa: E402
from vramcalc.training import TrainingConfig  # noqa: E402

TINY = ModelSpec(name="tiny", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=512, vocab_size=4096)


def scenario(**kw: object) -> Scenario:
    args = {"seq_len": 512, "micro_batch_size": 2, "precision": "bf16", **kw}
    return Scenario(model=TINY, training=TrainingConfig(**args))  # type: ignore[arg-type]


def test_batches_are_padded_to_their_longest_sample_and_cut_at_seq_len() -> None:
    lengths = (10, 20, 700)
    batches = padded_batches(lengths, 3, 512, 50)
    assert len(batches) == 50 and batches[-1] == 512
    assert set(batches[:-1]) <= {10, 20, 512}  # the longest of three draws, 700 cut at 512
    assert batches == padded_batches(lengths, 3, 512, 50)  # seeded
    assert padded_batches((5,), 1, 512, 3) == (5, 5, 512)


@pytest.mark.parametrize("text,message", [
    ("", "no lengths"), ("12 x 40", "'x' is not a token count"),
    ("12 0", "'0' is not a token count"), ("-3", "'-3' is not a token count"),
    ("1" * 12, "is not a token count")])
def test_bad_length_files_are_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        read_lengths(path)


def test_steps_are_bounded() -> None:
    for steps in (0, MAX_STEPS + 1):
        with pytest.raises(InputError, match="--steps must be between 1"):
            padded_batches((10,), 1, 512, steps)


def test_one_length_replays_the_fixed_trace_exactly() -> None:
    from vramcalc.trace.engine import run_trace

    fixed = run_trace(scenario())
    same = run_trace(scenario(), seq_lens=(512,) * 6)
    assert same.peak_allocated_bytes == fixed.peak_allocated_bytes
    assert same.peak_reserved_bytes == fixed.peak_reserved_bytes


def test_varied_shapes_keep_the_longest_peak_and_reserve_more() -> None:
    """The last micro-batch is at --seq-len, so the steady-state allocated peak is the fixed
    one; the segments the shorter shapes left cached stay in the reserved high-water mark."""
    from vramcalc.trace.engine import run_trace

    fixed = run_trace(scenario())
    varied = run_trace(scenario(), seq_lens=padded_batches((100, 230, 310, 400), 2, 512, 12))
    assert varied.peak_allocated_bytes == fixed.peak_allocated_bytes
    assert varied.peak_reserved_bytes > fixed.peak_reserved_bytes
    assert any("replayed over 12 micro-batches" in n for n in varied.notes)


def test_cli_replays_a_lengths_file_and_refuses_bad_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("100 230\n310 400\n")
    args = ["trace", "--model", "gpt2", "--seq-len", "128", "--lengths", str(path),
            "--steps", "3", "--json"]
    assert main(args) == 0
    assert "replayed over 3 micro-batches" in capsys.readouterr().out
    assert main([*args[:-3], "--steps", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --steps must be between 1")
    assert main(["trace", "--model", "gpt2", "--steps", "5"]) == 2
    assert capsys.readouterr().err.startswith("error: --steps counts the micro-batches")
    # FSDP2 data parallelism: rank 0 of the fake process group replays the same lengths
    assert main([*args, "--fsdp", "full", "--gpus", "2xH100"]) == 0
    assert "replayed over 3 micro-batches" in capsys.readouterr().out
