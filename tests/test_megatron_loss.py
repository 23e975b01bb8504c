"""The megatron profile's loss: Megatron-LM's vocab-parallel cross entropy.

Expected bytes are derived by hand from Megatron-LM d98e8a64 (never from the code's output):
- megatron/core/models/gpt/gpt_model.py `GPTModel._postprocess`: the output layer's logits,
  (s, b, V/t) in the compute dtype, alive while `compute_language_model_loss` runs;
- megatron/core/tensor_parallel/cross_entropy.py `VocabParallelCrossEntropy`:
  `calculate_logits_max` makes one fp32 copy (`.float()`); the max subtraction, `exp` and
  the division run in place on it, and `_VocabParallelCrossEntropy.forward` saves it (the
  softmax) with `target_mask` (bool) and `masked_target_1d` (int64); `backward` writes the
  gradient into that same buffer (`grad_input = softmax`, `mul_`), which autograd casts to
  the compute dtype of the logits on the way out;
- pretrain_gpt.py `loss_func`: `losses * loss_mask` keeps the fp32 loss mask.
Case: the calibration's test model (b 4, s 1024, V 50304 padded), bf16.
"""

from __future__ import annotations

import pytest
from megatron_models import GPT_SMALL

from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms.logits import (
    logits_backward_peak_bytes,
    logits_forward_peak_bytes,
    logits_saved_bytes,
)
from vramcalc.training import TrainingConfig

B, S, V = 4, 1024, 50304
N = B * S  # 4096 tokens: every (N) vector below is a multiple of 512 B


def _ctx(precision: str = "bf16", tp: int = 1, framework: str = "megatron",
         fusion: bool = False) -> RankContext:
    tr = TrainingConfig(seq_len=S, micro_batch_size=B, precision=precision, framework=framework,
                        cross_entropy_loss_fusion=fusion)
    return RankContext(GPT_SMALL, tr, ParallelConfig(dp=1, tp=tp))


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_saved_softmax_is_one_fp32_buffer_of_the_rank_vocab(tp: int) -> None:
    softmax = N * (V // tp) * 4  # exp_logits, fp32, saved by save_for_backward
    small = N * 1 + N * 8 + N * 4  # target_mask bool, masked_target_1d int64, loss_mask fp32
    scalars = 2 * 512  # the micro-batch loss and token count, 0-dim
    assert logits_saved_bytes(_ctx(tp=tp)) == softmax + small + scalars
    assert softmax == {1: 824_180_736, 2: 412_090_368, 8: 103_022_592}[tp]


@pytest.mark.parametrize(("precision", "c_bytes"), [("bf16", 2), ("fp16", 2), ("fp32", 0)])
def test_forward_peak_holds_the_c_logits_and_their_fp32_copy(precision: str,
                                                             c_bytes: int) -> None:
    # the c logits + the fp32 copy (when c is fp32 `.float()` returns the logits themselves)
    big = N * V * (c_bytes + 4)
    saved_small = N * 1 + N * 8 + N * 4 + 2 * 512
    vectors = 5 * N * 4  # logits_max, predicted_logits, sum_exp_logits, its log, the loss
    assert logits_forward_peak_bytes(_ctx(precision)) == big + saved_small + vectors


@pytest.mark.parametrize(("precision", "c_bytes"), [("bf16", 2), ("fp32", 0)])
def test_backward_peak_is_the_in_place_gradient_and_its_cast(precision: str,
                                                             c_bytes: int) -> None:
    big = N * V * (4 + c_bytes)  # fp32 softmax turned gradient in place + its c-typed cast
    saved_small = N * 1 + N * 8 + N * 4  # target_mask, masked_target_1d, loss_mask
    operands = N * 4 + N * 8 + N * 4  # grad_output, arange_1d, softmax_update
    scalars = 3 * 512  # loss, its scaled copy, the root gradient
    assert logits_backward_peak_bytes(_ctx(precision)) == big + saved_small + operands + scalars


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_loss_backward_writes_a_new_fp32_gradient_back(tp: int) -> None:
    """--cross-entropy-loss-fusion: fusions/fused_cross_entropy.py runs the same steps under
    torch.compile (core/jit.py: `jit_fuser = torch.compile` from torch 2.2). Compiling its
    four functions with torch 2.13 (TORCH_LOGS=output_code): the forward ones write into
    their inputs (the fp32 copy `calculate_logits_max` returns), but `calculate_gradients`,
    which mutates the saved softmax through an index_put on a view and then `mul_`, computes
    the gradient into a new (N, V') fp32 buffer, writes it back into the softmax and returns
    the bf16 cast: 4 + 4 + 2 bytes per logit, its (N) operands inside the one kernel."""
    v = V // tp
    big = N * v * (4 + 4 + 2)
    saved_small = N * 1 + N * 8 + N * 4  # target_mask, masked_target_1d, loss_mask
    scalars = 3 * 512
    assert logits_backward_peak_bytes(_ctx(tp=tp, fusion=True)) == big + saved_small + scalars
    # the forward keeps what the unfused loss keeps
    assert logits_forward_peak_bytes(_ctx(tp=tp, fusion=True)) == logits_forward_peak_bytes(
        _ctx(tp=tp))


def test_loss_fusion_is_megatron_only() -> None:
    with pytest.raises(ValueError, match="needs --framework megatron"):
        _ctx(framework="hf", fusion=True)


def test_megatron_loss_holds_half_the_reference_backward_per_logit() -> None:
    """Reference profile (F.cross_entropy on fp32 logits): 12 B per logit at the backward
    peak (log-probs + two gradient buffers); Megatron's in-place gradient: 4 + 2."""
    ref = logits_backward_peak_bytes(_ctx(framework="reference"))
    meg = logits_backward_peak_bytes(_ctx())
    assert ref // (N * V) == 12
    assert meg // (N * V) == 6


def test_interleaved_last_rank_holds_one_loss_at_a_time() -> None:
    """Megatron-LM core/pipeline_parallel/schedules.py: the interleaved schedule forwards a
    micro-batch's last model chunk right before that chunk's backward (`get_schedule_table`,
    backward chunk order reversed; the last rank's warm-up is (v − 1)·group forwards of the
    earlier chunks), so the last rank keeps one micro-batch's loss buffers, as under 1F1B,
    while it holds more micro-batches' activations."""
    from vramcalc.analytic import estimate
    from vramcalc.options import build_scenario

    def last_stage(schedule: str, v: int) -> tuple[int, int]:
        scn = build_scenario({"model": "gpt2", "gpus": "4xH100", "pp": 4, "pp_schedule": schedule,
                              "virtual_stages": v, "num_microbatches": 8, "seq_len": 1024,
                              "micro_batch_size": 4, "framework": "megatron", "zero": 1})
        terms = estimate(scn).stages[-1].terms
        return terms.logits, terms.activations

    one_f_one_b, interleaved = last_stage("1f1b", 1), last_stage("interleaved", 3)
    assert interleaved[0] == one_f_one_b[0]
    assert interleaved[1] > one_f_one_b[1]


@pytest.mark.parametrize(("limit", "held"), [(2, 2), (0, 3), (9, 3)])
def test_deferred_embedding_wgrad_waits_until_the_flush(limit: int, held: int) -> None:
    """--defer-embedding-wgrad N (Megatron-LM d98e8a64 --defer-embedding-wgrad-compute,
    --wgrad-deferral-limit N; 0 = no limit): the last stage's output layer keeps its input
    (ColumnParallelLinear.forward appends it to embedding_activation_buffer) and its bf16
    logits gradient (the backward appends grad_output) for the step's first N micro-batches
    and computes their weight gradients in the flush. With 4 micro-batches, from the second
    one on min(N, 3) of them wait beside everything else; the optimizer step has none."""
    from vramcalc.analytic import stage_phases
    from vramcalc.options import build_scenario

    def phases(defer: int | None) -> dict[str, dict[str, int]]:
        scn = build_scenario({"model": "gpt2", "gpus": "4xH100", "framework": "megatron",
                              "pp": 2, "tp": 2, "num_microbatches": 4, "seq_len": S,
                              "micro_batch_size": B, "defer_embedding_wgrad": defer})
        return {p.name: p.parts for p in stage_phases(scn, 1, None)[0]}

    got = phases(limit)
    v = -(-50257 // 2)  # GPT-2's vocabulary on each of 2 tensor-parallel ranks
    one = B * S * 768 * 2 + B * S * v * 2  # the output layer's input + logits gradient, bf16
    per = [-(-n // 512) * 512 for n in (B * S * 768 * 2, B * S * v * 2)]
    assert got["forward"]["logits/deferred_wgrad"] == held * sum(per) >= held * one
    assert got["backward"]["logits/deferred_wgrad"] == held * sum(per)
    assert "logits/deferred_wgrad" not in got["optimizer"]
    assert "logits/deferred_wgrad" not in phases(None)["forward"]
    assert "logits/deferred_wgrad" not in stage_phases(build_scenario(
        {"model": "gpt2", "gpus": "4xH100", "framework": "megatron", "pp": 2, "tp": 2,
         "num_microbatches": 4, "defer_embedding_wgrad": limit}), 0, None)[0][0].parts


def test_deferred_embedding_wgrad_needs_megatron_pipelines() -> None:
    from vramcalc.errors import InputError
    from vramcalc.options import build_scenario

    for values in ({"framework": "megatron"}, {"pp": 2}):
        with pytest.raises(InputError, match="defer-embedding-wgrad"):
            build_scenario({"model": "gpt2", "gpus": "2xH100", "defer_embedding_wgrad": 0,
                            **values}).resolved()
