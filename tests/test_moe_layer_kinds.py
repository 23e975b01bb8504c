"""Adapters and 4-bit experts on MoE models with layers of two kinds, and the reference
profile's DoRA under autocast.

- A model whose MoE layers sit above dense ones (interleaved, or DeepSeek-style dense first
  layers) runs a dense layer's forward temporaries (DoRA's weight norm on the dense MLP, say)
  while the MoE layers above it have saved nothing yet: the analytic forward point for that
  kind sits at its topmost layer, not on top of every layer's saved tensors.
- bitsandbytes' Linear4bit returns its input's dtype (`out.to(inp_dtype)`), so under
  autocast the reference profile's 4-bit experts and shared experts give fp32 outputs, as
  its dense 4-bit MLP does: their intermediates and the concatenated expert outputs are
  fp32.
- PEFT's `Linear.forward` casts the adapted sum back to the base output's dtype
  (`result.to(torch_result_dtype)`); DoRA's fp32 magnitude would promote it otherwise.

The trace engine is the referee; PEFT itself pins the output dtype.
"""

from __future__ import annotations

import pytest

from vramcalc.rank import RankContext
from vramcalc.terms import activations as act
from vramcalc.terms.profile import profile
from vramcalc.validate import scenario_for
from vramcalc.validate.compare import compare

_AMP = {"precision": "amp-bf16", "micro_batch_size": 2, "seq_len": 512, "attention": "flash"}


def _ctx(shape: str, **kw: object) -> RankContext:
    _, scn = scenario_for(shape, framework="reference", **kw)
    scn = scn.resolved()
    return RankContext(scn.model, scn.training, scn.parallel, 0)


def test_the_reference_dora_layer_returns_the_base_outputs_dtype() -> None:
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from vramcalc.trace.lora import LoRALinear

    base = torch.nn.Linear(32, 16, bias=False)
    ours = LoRALinear(base, 4, 0.0, torch.float32, dora=True)
    wrapped = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False)),
                                  peft.LoraConfig(r=4, target_modules=["0"], use_dora=True))
    x = torch.randn(3, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert base(x).dtype == torch.bfloat16
        assert wrapped(x).dtype == torch.bfloat16  # PEFT's cast back
        assert ours(x).dtype == torch.bfloat16


def test_reference_dora_under_autocast_agrees_with_the_trace() -> None:
    pytest.importorskip("torch")
    # the checkpointed attention core keeps q, k and v as the adapted projections return
    # them (16-bit): before the cast the trace kept fp32 copies, 2.2 % above the analytic
    for shape, kw in (("llama-deep", {"recompute": "selective", "lora_targets": "q,k,v,o"}),
                      ("moe-shared", {"recompute": "none", "lora_targets": "all-linear"})):
        name, scn = scenario_for(shape, framework="reference", finetune="dora",
                                 lora_dropout=0.0, **_AMP, **kw)
        row = compare(name, scn)
        assert abs(row["rel_error"]) < 0.002, (shape, row["rel_error"])


def test_the_other_kinds_forward_work_sits_at_its_topmost_layer() -> None:
    # moe-interleaved: MoE layers 1 and 3 of 4; the top layer is MoE, the topmost dense
    # layer is the second from the top
    kw = {"finetune": "dora", "lora_dropout": 0.1, "lora_targets": "all-linear", **_AMP}
    ctx = _ctx("moe-interleaved", **kw)
    p = profile(ctx)
    assert p.moe_mask == (False, True, False, True)
    assert p.other_forward == (1, act.layer_forward_working_bytes(ctx, False))
    assert p.forward_work == act.layer_forward_working_bytes(ctx, True)
    # DoRA's weight norm on the dense down projection: its (f, f) fp32 eye and 16-bit cast
    f = 2816
    assert p.other_forward[1] >= f * f * (4 + 2)
    # without shared experts a MoE layer's MLP has no adapters: no dense-width eye there
    assert p.forward_work < f * f * 4
    pytest.importorskip("torch")
    name, scn = scenario_for("moe-interleaved", framework="reference", **{
        **kw, "recompute": "selective", "attention": "eager", "micro_batch_size": 1})
    row = compare(name, scn)  # +2.3 % (forward) when the dense work sat on the top layer
    assert abs(row["phases"]["forward"]["rel_error"]) < 0.005
    assert abs(row["rel_error"]) < 0.005


def test_4bit_experts_give_fp32_outputs_under_autocast() -> None:
    kw = {"finetune": "qlora", "lora_dropout": 0.0, "lora_targets": "all-linear",
          "recompute": "none", **_AMP}
    saved = {t.name: t.dtype for t in act.layer_saved(_ctx("moe-shared", **kw), True)}
    for name in ("moe.expert.gate", "moe.expert.up", "moe.expert.act", "moe.expert_output",
                 "shared_expert0.gate", "shared_expert0.up", "shared_expert0.act",
                 "shared_expert0.output"):
        assert saved[name] == "fp32", name
    assert saved["shared_expert0.sigmoid"] == "bf16"  # the h → 1 gate is not 4-bit
    pytest.importorskip("torch")
    for shape in ("moe", "moe-shared", "moe-interleaved"):
        name, scn = scenario_for(shape, framework="reference", **kw)
        row = compare(name, scn)  # activations were 30 % (moe) below the trace
        assert abs(row["terms"]["activations"]["rel_error"]) < 1e-3, shape
        assert abs(row["rel_error"]) < 0.006, (shape, row["rel_error"])


def test_dora_lora_weight_is_made_while_the_eye_is_bound() -> None:
    # PEFT's get_lora_weight (peft 0.21.2 tuners/lora/dora.py) binds torch.eye(in) only
    # while it runs: lora_B's (in, out) product is made beside it, and it is gone at the
    # weight norm when nothing saves it (a checkpointed first forward). The dense down
    # projection's (2816, 2816) bf16 eye beside its (2816, 1024) product: forward was
    # -5.8 % while the trace kept the eye to the end of the layer and -1.1 % without the
    # product
    pytest.importorskip("torch")
    name, scn = scenario_for("moe-interleaved", framework="reference", finetune="dora",
                             lora_targets="all-linear", precision="bf16-pure", recompute="full",
                             micro_batch_size=2, seq_len=256, attention="flash")
    row = compare(name, scn)
    assert abs(row["phases"]["forward"]["rel_error"]) < 0.001, row["phases"]["forward"]
