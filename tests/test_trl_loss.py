"""`--trl-chunked-ce`: TRL SFTTrainer's `loss_type="chunked_nll"` (huggingface/trl f2cd5771
trl/trainer/sft_trainer.py `_chunked_cross_entropy_loss`, `_chunk`; the default from TRL 1.7).

Expected values are derived by hand from those lines, not from vramcalc: per chunk of 256
rows `h.float() @ w.float().t()` (an fp32 copy of a 16-bit head weight; under autocast the
matmul casts both operands back to bf16), `log_softmax` (fp32), the entropy's `exp` and
product (two more 256·V fp32 tensors); kept into backward the gathered rows (N·h), the
gathered labels and `order` (N int64 each) and the valid-token count. The trace engine runs
the restated loss (vramcalc/trace/trl.py) as the referee.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from vramcalc.analytic import estimate
from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms import trl_loss
from vramcalc.validate import scenario_for

V, H = 128256, 4096  # Llama-3.1-8B
N = 2047  # b 1 x (2,048 - 1) shifted rows


def _ctx(precision: str, finetune: str = "lora") -> RankContext:
    scn = build_scenario({"model": "llama3.1-8b", "gpus": "1xH100", "framework": "hf",
                          "finetune": finetune, "precision": precision, "seq_len": 2048,
                          "recompute": "full", "trl_chunked_ce": True}).resolved()
    return RankContext(scn.model, scn.training, scn.parallel)


def test_kept_rows_labels_and_order() -> None:
    # N·h bf16 rows + 2 x N int64 (16,376 B -> 16,384 in 512 B blocks) + the count
    assert trl_loss.saved_bytes(_ctx("bf16-autocast")) == N * H * 2 + 2 * 16_384 + 512


def test_forward_peak_is_the_chunk_matmul_with_both_weight_copies() -> None:
    # the fp32 copy of the bf16 head (a parameter's cast) and autocast's bf16 cast of it
    # (the loss's own), the rows' fp32 copy and bf16 cast, the bf16 logits of 256 rows
    own = 256 * H * 4 + 256 * H * 2 + 256 * V * 2 + V * H * 2
    loop = 2048 + 3 * 512  # the valid mask (N bool) and three running sums
    assert trl_loss.forward_parts(_ctx("bf16-autocast")) == (
        N * H * 2 + 2 * 16_384 + 512 + loop + own, V * H * 4)


def test_an_fp32_head_is_not_copied_only_cast() -> None:
    # amp-bf16: the fp32 head needs no .float() copy; autocast casts the parameter to bf16
    rows, cast = trl_loss.forward_parts(_ctx("amp-bf16"))
    assert cast == V * H * 2
    # without autocast (bf16-pure) the matmul runs in fp32 on the copy: no bf16 cast at all
    assert trl_loss.forward_parts(_ctx("bf16-pure"))[1] == V * H * 4


def test_the_head_keeps_no_input() -> None:
    # lm_head is never called: a trained head saves no input for its weight gradient (the
    # loss keeps the gathered rows instead)
    from vramcalc.terms.activations import head_saved

    def names(trl: bool) -> set[str]:
        scn = build_scenario({"model": "llama3.2-1b", "framework": "hf", "finetune": "full",
                              "precision": "amp-bf16", "trl_chunked_ce": trl}).resolved()
        return {t.name for t in head_saved(RankContext(scn.model, scn.training, scn.parallel))}

    assert any(n.startswith("lm_head.input") for n in names(False))
    assert not any(n.startswith("lm_head.input") for n in names(True))


@pytest.mark.parametrize("kw", [
    {"finetune": "lora", "precision": "bf16-autocast", "lora_targets": "all-linear"},
    {"finetune": "full", "precision": "amp-bf16"},
])
def test_the_trace_agrees(kw: dict[str, object]) -> None:
    pytest.importorskip("peft")
    from vramcalc.trace.engine import trace

    _, scn = scenario_for("llama-gqa", framework="hf", trl_chunked_ce=True, seq_len=512,
                          **kw)  # type: ignore[arg-type]
    analytic = estimate(scn).peak_allocated_bytes
    assert abs(analytic / trace(scn).report.peak_allocated_bytes - 1) < 1e-4


@pytest.mark.parametrize(("args", "message"), [
    (["--framework", "torchtune"], "needs --framework hf"),
    (["--liger"], "TRL refuses chunked_nll with use_liger_kernel"),
    (["--lora-head"], "an adapter on lm_head"),
    (["--gpus", "2xH100", "--zero", "3"], "ZeRO-3 or FSDP"),
    (["--model", "google/gemma-2-2b"], "soft-capping"),
])
def test_what_is_not_modelled_is_one_error_line(args: list[str], message: str) -> None:
    base = {"--model": "llama3.2-1b", "--gpus": "1xH100", "--framework": "hf",
            "--finetune": "lora"}
    flags = [a for a in args if a.startswith("--") and a not in ("--liger", "--lora-head")]
    for flag in flags:
        base[flag] = args[args.index(flag) + 1]
    argv = [a for pair in base.items() for a in pair] + [
        a for a in ("--liger", "--lora-head") if a in args] + ["--trl-chunked-ce"]
    res = subprocess.run([sys.executable, "-m", "vramcalc", "estimate", *argv],
                         capture_output=True, text=True)
    assert res.returncode == 2, res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]


def test_a_recomputed_dora_layer_counts_its_forward_again() -> None:
    # with TRL's small loss the backward peaks while a checkpointed DoRA layer re-runs its
    # forward (peft 0.21.2 tuners/lora/dora.py: torch.eye(in), lora_weight, the fp32
    # combination products) beside dL/d its output and the gradients that reached it first;
    # without that instant the analytic engine was 27 % under the trace here, now within
    # 3 % (−2.0 %; +2.6 % while DoRA's eye and lora_weight graph were counted in fp32
    # where autocast keeps bf16 casts and the eye itself is gone, methodology §10)
    pytest.importorskip("peft")
    from vramcalc.trace.engine import trace

    _, scn = scenario_for("qwen2-bias", framework="hf", precision="bf16-autocast",
                          finetune="dora", lora_targets="all-linear", lora_dropout=0.1,
                          recompute="full", micro_batch_size=1, trl_chunked_ce=True)
    ratio = estimate(scn).peak_allocated_bytes / trace(scn).report.peak_allocated_bytes
    assert 0.97 < ratio < 1.03
