"""`--transformers-version`: the causal-LM loss of transformers 4.31-4.48 (hf profile).

Expected bytes are derived by hand from transformers' source, never from the code's output:
- v4.46.0 (and v4.48.0) src/transformers/loss/loss_utils.py `ForCausalLMLoss`:
  `logits = logits.float()` (a local until the function returns),
  `shift_logits = logits[..., :-1, :].contiguous()`, `shift_labels = labels[..., 1:]
  .contiguous()`, then `nn.functional.cross_entropy` on the flattened shifted tensors;
- v4.49.0 the same function pads the labels by one position (`nn.functional.pad(labels,
  (0, 1), value=ignore_index)`) and passes the upcast logits as they are (5.x alike);
- v4.31.0 to v4.45.0 modeling_llama.py `LlamaForCausalLM.forward` (mistral, mixtral, qwen2,
  gemma, qwen2_moe and phi3 alike from the release that gave them the upcast):
  `logits = self.lm_head(hidden_states)`, `logits = logits.float()` (the model output,
  held by the Trainer's `compute_loss` until it returns; the 16-bit logits are freed),
  then the same shift, contiguous copy and CrossEntropyLoss as 4.46;
- v4.31.0 training_args.py `default_optim = "adamw_hf"` (v4.34.0: "adamw_torch");
- torch: `Tensor.contiguous()` returns the tensor itself when it is contiguous already, as
  a (1, s-1, V) slice of a (1, s, V) tensor is; log_softmax saves its fp32 output; its
  backward and nll_loss's make one fp32 buffer of the input's shape each.
Case: Llama-2-7B (V 32000), bf16-pure, seq 1024.
"""

from __future__ import annotations

import pytest

from vramcalc.cli import main
from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms.logits import (
    logits_backward_peak_bytes,
    logits_forward_peak_bytes,
    logits_saved_bytes,
)

R = 512  # the caching allocator's rounding of every block
S, V = 1024, 32000


def _r(n: int) -> int:
    return -(-n // R) * R


def _ctx(b: int, version: str | None = "4.47.1", **kw: object) -> RankContext:
    values = {"model": "llama2-7b", "gpus": "1xH100", "framework": "hf",
              "precision": "bf16-pure", "seq_len": S, "micro_batch_size": b, **kw}
    if version:
        values["transformers_version"] = version
    scn = build_scenario(values).resolved()
    return RankContext(scn.model, scn.training, scn.parallel, 0)


@pytest.mark.parametrize("b", [2, 4])
def test_the_loss_keeps_a_shifted_copy_of_the_fp32_logits(b: int) -> None:
    n, shifted = b * S * V, b * (S - 1) * V
    scalars = 2 * R  # the loss and nll_loss's total weight
    labels = _r(b * (S - 1) * 8)  # labels[..., 1:].contiguous(), int64, kept by nll_loss
    assert logits_saved_bytes(_ctx(b)) == _r(shifted * 4) + scalars + labels
    # the model's bf16 logits + their upcast + the shifted copy + its log-probabilities
    forward = _r(n * 2) + _r(n * 4) + _r(shifted * 4) + _r(shifted * 4) + scalars + labels
    assert logits_forward_peak_bytes(_ctx(b)) == forward
    # the loss backward works on the shifted positions only (the saved log-probabilities
    # and two fp32 gradients), plus the three 0-dim tensors of the backward root
    assert logits_backward_peak_bytes(_ctx(b)) == 3 * _r(shifted * 4) + 3 * R


def test_a_single_sequence_has_no_copy() -> None:
    """b = 1: the slices are contiguous, so `.contiguous()` copies neither."""
    n, shifted = S * V, (S - 1) * V
    assert logits_forward_peak_bytes(_ctx(1)) == _r(n * 2) + _r(n * 4) + _r(shifted * 4) + 2 * R


def test_the_old_loss_costs_one_more_fp32_logits_buffer_in_forward() -> None:
    b = 4
    old, new = logits_forward_peak_bytes(_ctx(b)), logits_forward_peak_bytes(_ctx(b, None))
    # 5.x: bf16 logits + upcast + log-probs of all b·s positions + padded (b, s+1) labels
    # and their shifted (b, s) copy
    new_hand = (_r(b * S * V * 2) + 2 * _r(b * S * V * 4) + 2 * R
                + _r(b * (S + 1) * 8) + _r(b * S * 8))
    assert new == new_hand
    # + the shifted fp32 copy, the log-probabilities of s-1 positions instead of s, and one
    # (b, s-1) labels copy instead of the padded labels and their copy
    copy = _r(b * (S - 1) * V * 4)
    fewer = _r(b * S * V * 4) - _r(b * (S - 1) * V * 4)
    labels = _r(b * (S - 1) * 8) - _r(b * (S + 1) * 8) - _r(b * S * 8)
    assert old - new == copy - fewer + labels


@pytest.mark.parametrize("version", ["4.49.0", "5.2.0"])
def test_later_releases_pad_the_labels(version: str) -> None:
    assert logits_forward_peak_bytes(_ctx(4, version)) == logits_forward_peak_bytes(_ctx(4, None))


@pytest.mark.parametrize(("args", "words"), [
    (["--transformers-version", "4.30.0", "--attention", "eager"], "4.31 or later"),
    (["--transformers-version", "4.33.3"], "--attention eager"),
    (["--transformers-version", "4.38.2", "--model", "gemma-2b"], "give 4.39 or later"),
    (["--transformers-version", "4.45.2", "--model", "gpt2"], "model_type 'gpt2'"),
    (["--transformers-version", "4.40.0", "--finetune", "lora", "--lora-head"], "plain lm_head"),
    (["--transformers-version", "4.47.1", "--framework", "torchtune"], "--framework hf"),
    (["--transformers-version", "four"], "--transformers-version"),
])
def test_refusals_are_one_line(capsys, args: list[str], words: str) -> None:  # noqa: ANN001
    argv = ["estimate", "--model", "llama2-7b", "--gpus", "1xH100", "--framework", "hf", *args]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error:") and words in err
    assert len(err.strip().splitlines()) == 1


def test_the_stand_in_loss_equals_transformers_loss() -> None:
    """trace/hf_models.py `shifted_logits_loss` on real CPU tensors gives the number
    transformers' own (5.x) ForCausalLMLoss gives, and keeps what 4.46 kept."""
    torch = pytest.importorskip("torch")
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    from vramcalc.trace.hf_models import shifted_logits_loss

    logits = torch.randn(3, 7, 11, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 11, (3, 7))
    labels[0, 5:] = -100
    ours = shifted_logits_loss(logits, labels, 11)
    theirs = loss_utils.ForCausalLMLoss(logits, labels, 11)
    assert torch.allclose(ours, theirs)
    assert torch.allclose(shifted_logits_loss(logits, labels, 11, num_items_in_batch=9),
                          loss_utils.ForCausalLMLoss(logits, labels, 11, num_items_in_batch=9))


def test_the_trace_and_the_analytic_model_agree() -> None:
    pytest.importorskip("torch")
    from vramcalc.analytic import estimate
    from vramcalc.trace.engine import trace
    from vramcalc.validate import scenario_for

    for kw in ({"precision": "amp-bf16", "micro_batch_size": 2},
               {"precision": "bf16-pure", "finetune": "lora", "recompute": "full",
                "micro_batch_size": 4}):
        _, scn = scenario_for("llama-gqa", framework="hf", transformers_version="4.46.0", **kw)
        ana, tra = estimate(scn), trace(scn).report
        assert ana.peak_phase == tra.peak_phase == "forward"
        assert abs(ana.peak_allocated_bytes - tra.peak_allocated_bytes) <= 4 * R


def test_a_yaml_number_is_refused(tmp_path, capsys) -> None:  # noqa: ANN001
    """YAML reads an unquoted 4.50 as the float 4.5: refused, not read as release 4.5."""
    cfg = tmp_path / "run.yaml"
    base = "model: llama2-7b\ngpus: 1xH100\nframework: hf\n"
    cfg.write_text(base + "transformers_version: 4.50\n", encoding="utf-8")
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --transformers-version") and "quotes" in err
    cfg.write_text(base + 'transformers_version: "4.50"\n', encoding="utf-8")
    assert main(["check", str(cfg)]) in (0, 1)  # a verdict, not an error
    assert "transformers 4.50" in capsys.readouterr().out


@pytest.mark.parametrize(("version", "impl", "reentrant"), [
    # training_args.py `default_optim`: "adamw_torch" in v4.46.0 and v4.50.0 (foreach),
    # adamw_torch_fused from 4.54; modeling_utils.py gradient_checkpointing_enable:
    # {"use_reentrant": True} in v4.46.0 and v4.50.0, False from 5.0
    ("4.46.1", "foreach", True), ("4.53.3", "foreach", True), ("4.54.0", "fused", True),
    ("5.0.0", "fused", False), (None, "fused", False)])
def test_the_release_sets_the_trainers_defaults(version: str | None, impl: str,
                                                reentrant: bool) -> None:
    tr = _ctx(2, version, recompute="full").training
    assert (tr.step_impl, tr.reentrant) == (impl, reentrant)
    assert not _ctx(2, version, recompute="none").training.reentrant
    given = _ctx(2, version, recompute="full", hf_optim="adamw_torch_fused",
                 use_reentrant=False).training
    assert (given.step_impl, given.reentrant) == ("fused", False)  # flags win


@pytest.mark.parametrize("b", [1, 4])
def test_before_4_46_the_forward_upcasts_and_frees_the_16_bit_logits(b: int) -> None:
    """4.31-4.45: the loss of 4.46-4.48 without the bf16 logits, freed at the upcast."""
    n, shifted = b * S * V, b * (S - 1) * V
    scalars = 2 * R
    labels = _r(b * (S - 1) * 8) if b > 1 else 0  # a view when b = 1
    copy = _r(shifted * 4) if b > 1 else 0
    old = _ctx(b, "4.36.0")
    assert logits_forward_peak_bytes(old) == _r(n * 4) + copy + _r(shifted * 4) + scalars + labels
    assert logits_forward_peak_bytes(_ctx(b, "4.46.0")) - logits_forward_peak_bytes(old) == _r(
        n * 2)
    assert logits_saved_bytes(old) == logits_saved_bytes(_ctx(b, "4.46.0"))
    assert logits_backward_peak_bytes(old) == 3 * _r(shifted * 4) + 3 * R


@pytest.mark.parametrize(("version", "impl"), [("4.31.0", "hf-loop"), ("4.34.0", "foreach")])
def test_the_oldest_releases_step_transformers_own_adamw(version: str, impl: str) -> None:
    assert _ctx(2, version, attention="eager").training.step_impl == impl


def test_the_upcast_hook_returns_what_the_old_forward_returned() -> None:
    """trace/hf_models.py `upcast_output` on lm_head, then the stand-in loss, give the fp32
    logits and the loss of transformers' own ForCausalLMLoss on them."""
    torch = pytest.importorskip("torch")
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    from vramcalc.trace.hf_models import shifted_logits_loss, upcast_output

    head = torch.nn.Linear(8, 11, bias=False, dtype=torch.bfloat16)
    head.register_forward_hook(upcast_output)
    logits = head(torch.randn(2, 5, 8, dtype=torch.bfloat16))
    labels = torch.randint(0, 11, (2, 5))
    assert logits.dtype == torch.float32
    assert torch.allclose(shifted_logits_loss(logits, labels, 11),
                          loss_utils.ForCausalLMLoss(logits, labels, 11))


def test_before_4_46_the_trace_agrees_and_sees_the_freed_logits_cached() -> None:
    """The trace runs the upcast hook; its allocated peak matches the analytic one, and the
    bf16 logits' freed block stays cached at the forward's peak in both engines (the fp32
    buffers that follow are all larger)."""
    pytest.importorskip("torch")
    from vramcalc.analytic import estimate
    from vramcalc.trace.engine import trace
    from vramcalc.validate import scenario_for

    _, scn = scenario_for("llama-gqa", framework="hf", transformers_version="4.36.0",
                          precision="amp-bf16", micro_batch_size=2)
    ana, tra = estimate(scn), trace(scn).report
    assert ana.peak_phase == tra.peak_phase == "forward"
    assert abs(ana.peak_allocated_bytes - tra.peak_allocated_bytes) <= 4 * R
    hole = _r(2 * S * scn.model.vocab_size * 2)
    assert S == scn.training.seq_len
    for report in (ana, tra):
        assert report.peak_reserved_bytes - report.peak_allocated_bytes >= hole
