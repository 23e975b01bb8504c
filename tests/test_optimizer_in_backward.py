"""The optimizer step inside backward (`--optimizer-in-backward`, torchtune's optimizer_in_bwd).

Expected values come from outside the analytic code:
- pytorch/torchtune bd2a0fc `torchtune/modules/optim.py` `OptimizerInBackward` (lines
  44-60): one optimizer per trained parameter, `p.register_post_accumulate_grad_hook`
  running that optimizer's `step()` and `zero_grad()`; `torchtune/training/memory.py`
  `register_optim_in_bwd_hooks` (lines 222-245); `recipes/full_finetune_single_device.py`
  lines 157-160 (gradient accumulation refused) and 621-635 (`optimizer.step()` a no-op):
  so no gradient survives backward and at most one parameter's gradient exists at a time;
- parameter shapes × dtype sizes (vramcalc.model.param_tensors, pinned to published counts
  in test_catalog.py), 512-byte allocator blocks;
- bitsandbytes `Optimizer8bit.__init__` (`self.name2qmap = {}` per optimizer instance) and
  `Optimizer2State.init_state` (the two 256-entry fp32 maps moved to the parameter's device
  per optimizer): one pair per 8-bit parameter with one optimizer per parameter;
- the trace engine, which runs the real mechanism (per-parameter torch optimizers stepped
  by post-accumulate-grad hooks) on fake tensors.
"""

from __future__ import annotations

import random

import pytest

from vramcalc.analytic import estimate
from vramcalc.cli import main
from vramcalc.cli.plan import prepare_plan
from vramcalc.model import ModelSpec
from vramcalc.model_tensors import param_tensors
from vramcalc.planner import MemoryBound, enumerate_candidates, estimate_candidate, search
from vramcalc.scenario import Scenario
from vramcalc.training import TrainingConfig
from vramcalc.units import MiB, alloc
from vramcalc.validate import SHAPES

# cuBLAS workspaces without a GPU: 32 MiB each, one for the calling thread and one for
# autograd's backward thread (terms/transients.py)
WORKSPACE = 2 * 32 * MiB
# tied embeddings, a small vocabulary and eager attention: the top layer's attention core,
# not the loss, is the backward's peak, while the head's share of the tied gradient waits
TIED = ModelSpec(name="tied", hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=1024, vocab_size=4096,
                 tie_word_embeddings=True)
SPECS = {**SHAPES, "tied": TIED}


def scn(shape: str = "llama-gqa", **kw: object) -> Scenario:
    args = {"seq_len": 64, "micro_batch_size": 1, "precision": "bf16-pure",
            "optimizer_in_backward": True, **kw}
    return Scenario(model=SPECS[shape], training=TrainingConfig(**args))  # type: ignore[arg-type]


def grad_blocks(shape: str, dtype: str) -> set[int]:
    return {alloc(t.numel, dtype) for t in param_tensors(SPECS[shape])}


def test_a_tied_heads_gradient_share_waits_through_the_sweep() -> None:
    # the head's d W (V x h) reaches the tied parameter's AccumulateGrad only with the
    # embedding's share, at the end of backward: until then autograd's input buffer holds
    # it (no hook has run for it), and no parameter gradient is alive at the peak instant
    rep = estimate(scn("tied", seq_len=1024, attention="eager", chunked_ce=8))
    assert rep.subterms["transients/tied_grad"] == alloc(4096 * 256, "bf16")
    assert rep.terms.gradients == 0


# ---- hand-derived ---------------------------------------------------------------------------
def test_the_optimizer_phase_holds_weights_and_states_only() -> None:
    # fp32 AdamW: weights 4 B/param, exp_avg and exp_avg_sq 4 B/param each, per tensor
    # blocks; no gradient is left for the step (torchtune: gradients set to None in the hook)
    rep = estimate(scn(precision="fp32"))
    w = sum(t.count * alloc(t.numel, "fp32") for t in param_tensors(SHAPES["llama-gqa"]))
    assert rep.phases["optimizer"] == w + 2 * w + WORKSPACE
    assert estimate(scn(precision="fp32", optimizer_in_backward=False)).phases[
        "optimizer"] > rep.phases["optimizer"] + w  # all gradients + foreach temporaries


@pytest.mark.parametrize("shape", ["llama-gqa", "gpt2", "llama-deep"])
def test_the_gradients_at_the_peak_are_one_parameters(shape: str) -> None:
    rep = estimate(scn(shape))
    assert rep.peak_phase == "backward"
    assert rep.terms.gradients in grad_blocks(shape, "bf16") | {0}
    everything = sum(t.count * alloc(t.numel, "bf16") for t in param_tensors(SHAPES[shape]))
    assert rep.terms.gradients < everything  # not all of them (the ordinary step: all)


def test_the_head_hook_holds_the_head_gradient_and_its_sqrt() -> None:
    # llama-gqa, bf16-pure, 64 tokens: the untied head (32000 x 1024) is the largest
    # parameter and its hook the peak: its bf16 gradient + foreach Adam's
    # _foreach_sqrt(exp_avg_sq), one state-sized bf16 tensor; fused has no sqrt
    head = alloc(32000 * 1024, "bf16")
    rep = estimate(scn())
    assert rep.terms.gradients == head
    assert rep.subterms["transients/optimizer_step"] == head
    loop = estimate(scn(optimizer_impl="loop"))  # sqrt and the quotient, both state-sized
    assert loop.subterms["transients/optimizer_step"] == 2 * head
    assert loop.peak_allocated_bytes - rep.peak_allocated_bytes == head


def test_8bit_maps_are_per_parameter_optimizer() -> None:
    # llama-gqa: embed, head and 2 x (q, k, v, o, gate, up, down) have >= 4096 elements: 16
    # optimizers with 8-bit states, each with its own two 256-entry fp32 maps (1 KiB blocks)
    on = estimate(scn(optimizer="adamw-8bit")).terms.optimizer_states
    off = estimate(scn(optimizer="adamw-8bit", optimizer_in_backward=False)
                   ).terms.optimizer_states
    assert on - off == 15 * 2 * alloc(256, "fp32")


def test_off_by_default_and_left_out_of_dumps() -> None:
    assert "optimizer_in_backward" not in TrainingConfig().model_dump()
    assert TrainingConfig(precision="fp32", optimizer_in_backward=True).model_dump()[
        "optimizer_in_backward"] is True


# ---- refusals: one error line, exit 2 ------------------------------------------------------
@pytest.mark.parametrize(("extra", "start"), [
    ([], "error: --optimizer-in-backward with --precision bf16"),
    (["--precision", "bf16-pure", "--grad-accum", "4"],
     "error: --optimizer-in-backward with --grad-accum 4"),
    (["--precision", "bf16-pure", "--framework", "megatron"],
     "error: --optimizer-in-backward with --framework megatron"),
    (["--precision", "amp-bf16", "--framework", "torchtitan"],
     "error: --optimizer-in-backward with --framework torchtitan"),
    (["--precision", "bf16-pure", "--gpus", "8xH100"],
     "error: --optimizer-in-backward is modelled on one GPU"),
    (["--precision", "bf16-pure", "--gpus", "1xH100", "--zero", "1"],
     "error: --optimizer-in-backward is modelled on one GPU"),
    (["--precision", "bf16-pure", "--gpus", "8xH100", "--pp", "8"],
     "error: --optimizer-in-backward is modelled on one GPU"),
])
def test_unmodelled_combinations_are_one_error_line(extra: list[str], start: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "8b", "--optimizer-in-backward", *extra])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(start), err


def test_plan_needs_a_global_batch(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "gpt2", "--gpus", "1xRTX4090", "--precision", "bf16-pure",
                 "--optimizer-in-backward"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and "--global-batch-size" in err[0]


# ---- the planner stays sound -----------------------------------------------------------------
PLAN = {"model": "gpt2", "gpus": "1xRTX4090", "seq_len": 1024, "precision": "bf16-pure",
        "optimizer_in_backward": True}


def test_plan_bound_never_exceeds_the_estimate_and_search_is_exhaustive() -> None:
    base, req, _ = prepare_plan(dict(PLAN), global_batch_size=8,
                                allow="precision,optimizer,finetune")
    cands, total, _ = enumerate_candidates(base, req)
    bound = MemoryBound(base)
    context = base.cluster.gpu.context_overhead_bytes
    fitting, checked = [], 0
    for c in random.Random(3).sample(cands, len(cands)):
        e = estimate_candidate(c, base, req)
        if e is None:
            continue
        assert e.report.strategy["optimizer_in_backward"] is True
        assert bound.total(c) + context <= e.report.device_total_bytes, c
        bound.learn(c, e.report)
        checked += 1
        if e.fits:
            fitting.append(e)
    assert checked >= 5
    res = search(base, req)
    assert res.entries[0].speed.tokens_per_s == max(e.speed.tokens_per_s for e in fitting)


# ---- the trace engine referees the analytic model -------------------------------------------
pytest.importorskip("torch")

AGREE = [
    ("llama-gqa", {"precision": "fp32"}),
    ("llama-gqa", {}),
    ("llama-gqa", {"precision": "amp-bf16"}),
    ("llama-gqa", {"recompute": "full"}),
    ("llama-gqa", {"recompute": "selective", "seq_len": 256, "micro_batch_size": 2}),
    ("llama-gqa", {"precision": "fp32", "optimizer_impl": "fused"}),
    ("llama-gqa", {"precision": "fp32", "optimizer_impl": "loop"}),
    ("llama-gqa", {"finetune": "lora"}),
    ("llama-gqa", {"framework": "hf"}),
    ("llama-gqa", {"framework": "hf", "precision": "amp-bf16"}),
    ("llama-gqa", {"chunked_ce": 4}),
    ("llama-gqa", {"optimizer": "adamw-8bit", "precision": "fp32"}),
    ("llama-gqa", {"optimizer": "lion"}),
    ("gpt2", {}),
    ("gpt2", {"finetune": "lora", "recompute": "full"}),
    ("llama-deep", {"precision": "fp32", "optimizer": "sgd-momentum"}),
    ("moe", {}),
    ("tied", {"seq_len": 1024, "attention": "eager", "chunked_ce": 8}),
]


@pytest.mark.parametrize(("shape", "kw"), AGREE, ids=lambda v: str(v))
def test_analytic_agrees_with_the_trace(shape: str, kw: dict) -> None:
    """Every phase within 0.05 % (hf: its 1 KiB rotary buffer difference), the first step
    within 0.1 %; weights and optimizer states at the peak exact, the gradients at the peak
    one parameter's in both engines."""
    from vramcalc.trace.engine import trace

    s = scn(shape, **kw)
    t = trace(s).report
    a = estimate(s)
    for phase in ("forward", "backward", "optimizer"):
        assert abs(a.phases[phase] - t.phases[phase]) <= 0.0005 * t.phases[phase], phase
    assert abs(a.first_step_peak_bytes - t.first_step_peak_bytes) <= (
        0.001 * t.first_step_peak_bytes)
    assert t.phases["optimizer"] < t.phases["backward"]  # no separate step phase to speak of
    for term in ("weights", "optimizer_states"):
        assert abs(getattr(a.terms, term) - getattr(t.terms, term)) <= 1024, term
    assert t.terms.gradients in grad_blocks(shape, TrainingConfig(**{
        "precision": "bf16-pure", **kw}).grad_dtype) | {0}


def test_in_backward_steps_each_parameter_and_leaves_no_gradient() -> None:
    """The trace's InBackward on real tensors: after backward every parameter has moved, has
    its own optimizer's states and no gradient (torchtune's `_step_and_clear`), and the
    hooks ran while backward was still running (the first layer's gradient did not exist
    when the second layer's step ran)."""
    import torch

    from vramcalc.trace.optim import InBackward, make_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    before = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    seen: list[int] = []

    def on_step(p: torch.Tensor, _opt: object) -> None:
        assert p.grad is None
        seen.append(sum(q.grad is not None for q in params))

    opt = InBackward(params, lambda ps: make_optimizer("adamw", ps, "foreach"), on_step)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # a no-op, as in torchtune's recipe
    assert all(p.grad is None for p in params)
    assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert all(set(o.state[p]) >= {"exp_avg", "exp_avg_sq"}
               for o, p in zip(opt.optimizers, params, strict=True))
    assert len(seen) == len(params) and max(seen) == 0  # never two gradients at once
