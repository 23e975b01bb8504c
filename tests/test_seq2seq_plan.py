"""Planning encoder-decoder models (T5, BART): the speed model's FLOPs against PyTorch's own
FLOP counter on transformers' models, `plan` and `size` search the layouts the seq2seq
engine models (one GPU or DDP, no or full recompute) with entries equal to `estimate`, and
the planner's memory lower bound stays below the estimate."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.test_plan import bound_checked
from tests.test_seq2seq import CONFIGS, _run
from vramcalc.analytic import estimate
from vramcalc.cli.plan import prepare_plan
from vramcalc.flops import seq2seq_flops
from vramcalc.hf_config import from_hf_config
from vramcalc.planner import MemoryBound, enumerate_candidates, estimate_candidate, search


@pytest.mark.parametrize(("name", "proj"), [("t5-odd", None), ("t5-odd", "gated-gelu"),
                                            ("bart-odd", None)])
def test_flops_equal_torchs_flop_counter(name: str, proj: str | None) -> None:
    """One training step (forward and backward, eager attention, s != t) of transformers'
    model, counted by torch.utils.flop_counter.FlopCounterMode (every mm, addmm and bmm,
    2 FLOPs per multiply-add), equals b·s·(FLOPs per source token)."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode

    from vramcalc.trace.hf_seq2seq import seq2seq_config

    cfg: dict[str, Any] = {**CONFIGS[name], **({"feed_forward_proj": proj} if proj else {})}
    spec = from_hf_config(cfg, f"{name}/config.json")
    model = tf.AutoModelForSeq2SeqLM.from_config(seq2seq_config(tf, spec),
                                                 attn_implementation="eager")
    b, s, t = 2, 12, 5
    ids, labels = torch.randint(3, 100, (b, s)), torch.randint(3, 100, (b, t))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=labels).loss.backward()
    assert counter.get_total_flops() == seq2seq_flops(spec, s, t)[0] * b * s


def test_flops_reduce_to_the_decoder_formula_at_equal_lengths() -> None:
    """With t = s: 6·N_mm + 12·(Le + 2·Ld)·s·A, N_mm the weight matrices (q, k, v, o and the
    feed-forward of every layer, cross-attention included) plus the tied head V·h; full
    recompute adds the layers' forward, 2·(N_mm − V·h) + 4·(Le + 2·Ld)·s·A."""
    spec = from_hf_config(CONFIGS["t5-odd"], "t5-odd/config.json")
    h, f, V, A = spec.hidden_size, spec.intermediate_size, spec.vocab_size, 3 * 40
    Le, Ld, s = 2, 3, 64
    mats = Le * (4 * h * A + 2 * h * f) + Ld * (8 * h * A + 2 * h * f)
    model, hw = seq2seq_flops(spec, s, s)
    assert model == 6 * (mats + V * h) + 12 * (Le + 2 * Ld) * s * A
    assert hw["full"] - model == 2 * mats + 4 * (Le + 2 * Ld) * s * A
    assert hw["none"] == model


def _plan(values: dict[str, Any], allow: str | None = None) -> tuple[Any, Any, Any]:
    base, req, _ = prepare_plan(values, allow=allow)
    return base, req, search(base, req)


@pytest.mark.parametrize("values", [
    {"model": "t5-base", "gpus": "4xA100-80GB", "seq_len": 512, "attention": "eager"},
    {"model": "bart-large", "gpus": "2xRTX4090", "seq_len": 1024, "target_len": 128,
     "attention": "eager"},
], ids=["t5-base", "bart-large"])
def test_plan_entries_are_the_engines_estimates(values: dict[str, Any]) -> None:
    """Every entry is a layout the seq2seq engine models (data parallel only), its memory is
    `estimate`'s for the same scenario, and its speed counts the encoder-decoder FLOPs."""
    base, _, res = _plan(values)
    assert res.entries
    for e in res.entries:
        par = e.scenario.parallel
        assert (par.tp, par.pp, par.cp, par.ep, par.zero, par.fsdp) == (1, 1, 1, 1, 0, "none")
        assert e.scenario.training.recompute in ("none", "full")
        assert e.report.device_total_bytes == estimate(e.scenario).device_total_bytes
        s, t = values["seq_len"], values.get("target_len") or values["seq_len"]
        assert e.speed.model_flops_per_token == seq2seq_flops(base.model, s, t)[0]


def test_bound_never_exceeds_the_estimate() -> None:
    """bound + CUDA context <= the estimate's device total on every candidate the engine
    accepts, and what the bound refuses the engine refuses."""
    base, req, _ = prepare_plan({"model": "t5-large", "gpus": "8xRTX4090", "seq_len": 512,
                                 "target_len": 256, "attention": "eager"},
                                allow="precision,optimizer")
    cands, _, _ = enumerate_candidates(base, req)
    bound = MemoryBound(base)
    data_parallel = [c for c in cands if (c.tp, c.pp, c.cp, c.ep, c.stage) == (1, 1, 1, 1, 0)
                     and not c.off]
    sample = random.Random(3).sample(data_parallel, min(120, len(data_parallel)))
    assert bound_checked(base, req, bound, sample) > 20
    for c in cands[:: max(1, len(cands) // 60)]:
        if bound.total(c) == float("inf"):
            assert estimate_candidate(c, base, req) is None, c


def test_size_answers_for_an_encoder_decoder() -> None:
    code, err = _run(["size", "--model", "t5-base", "--tokens", "1e9", "--gpu", "H100",
                      "--seq-len", "512", "--attention", "eager"])
    assert code == 0 and not err


def test_a_batch_no_data_parallel_layout_divides_says_so() -> None:
    """Encoders and encoder-decoders run data parallel only: a global batch the GPU count
    does not divide leaves no layout, and the one error line says what to change."""
    code, err = _run(["plan", "--model", "bert-base", "--gpus", "3xA100", "--seq-len", "512"])
    assert code == 2 and err.count("\n") == 1
    assert "not tp=3" in err and "global batch divisible by 3" in err
