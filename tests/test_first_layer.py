"""The first layer under a PEFT method (vramcalc/terms/first_layer.py): its input, the frozen
embedding's output, needs no gradient, so autograd records nothing before the layer's first
adapter, and after it an op keeps only what its grad-requiring inputs' gradients read.

Expected values: torch's own saved-tensor rule, shown on transformers' LlamaMLP under PEFT
with real CPU tensors (`saved_tensors_hooks` lists what autograd keeps), and the sizes of
Llama-3.1-8B's tensors by hand (T = 2,048 tokens, h 4,096, f 14,336, 8 KV heads of 128,
32 heads). The trace engine referees the whole step (the grid's MLP-only rows).
"""

from __future__ import annotations

import pytest
from peft_mlp import peft_llama_mlp

from vramcalc.analytic import estimate
from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms.activations import layer_saved
from vramcalc.terms.first_layer import first_layer_unsaved_bytes
from vramcalc.validate import scenario_for

T, H, F, KV = 2048, 4096, 14336, 1024


def _gap(targets: str) -> int:
    scn = build_scenario({"model": "llama3.1-8b", "gpus": "1xH100", "framework": "hf",
                          "finetune": "lora", "lora_targets": targets,
                          "precision": "bf16-pure", "seq_len": T,
                          "recompute": "none"}).resolved()
    ctx = RankContext(scn.model, scn.training, scn.parallel)
    return first_layer_unsaved_bytes(ctx, layer_saved(ctx))


@pytest.mark.parametrize(("targets", "kept"), [
    (["up_proj"], {"act"}),  # act · up keeps act for dL/dup only
    (["gate_proj"], {"gate", "up"}),  # silu keeps gate; act · up keeps up for dL/dact
    (["down_proj"], set()),  # only down's adapter input (the product)
    (["gate_proj", "up_proj"], {"gate", "up", "act"}),
])
def test_llama_mlp_keeps_only_what_its_adapters_need(targets: list[str], kept: set[str]
                                                      ) -> None:
    torch = pytest.importorskip("torch")
    mlp = peft_llama_mlp(targets)
    saved: list[torch.Tensor] = []
    x = torch.randn(8, 64, dtype=torch.bfloat16)  # no grad: a frozen embedding's output
    outs: dict[str, torch.Tensor] = {}
    mlp.gate_proj.register_forward_hook(lambda m, i, o: outs.__setitem__("gate", o))
    mlp.up_proj.register_forward_hook(lambda m, i, o: outs.__setitem__("up", o))
    mlp.act_fn.register_forward_hook(lambda m, i, o: outs.__setitem__("act", o))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                  lambda t: t):
        mlp(x)
    wide = {name for name, t in outs.items() if any(s is t for s in saved)}
    assert wide == kept
    # each adapter's A keeps its input: x for gate and up, the product for down
    assert sum(1 for s in saved if s is x) == len({"gate_proj", "up_proj"} & set(targets))


def test_the_first_layer_of_llama_8b_with_an_up_adapter() -> None:
    attention = (T * H * 4 + T * 4  # input norm: fp32 x, rstd
                 + T * H * 2 + 2 * T * KV * 2 + T * 32 * 4  # q, k, v, flash's lse
                 + T * H * 2)  # the attention output (o keeps no input)
    post_norm = T * H * 4 + T * 4
    assert _gap("up") == attention + post_norm + 2 * T * F * 2  # gate and up go
    assert _gap("gate") == attention + post_norm + T * F * 2  # act goes
    assert _gap("down") == attention + post_norm + 3 * T * F * 2  # gate, up and act go
    assert _gap("o") == attention  # o's adapter keeps its own fp32 copy


def test_the_trace_agrees() -> None:
    pytest.importorskip("peft")
    from vramcalc.trace.engine import trace

    # the forward peaks at up's adapter in the top layer, after gate and act exist
    _, scn = scenario_for("llama-deep", framework="hf", precision="bf16-pure",
                          finetune="lora", lora_targets="up")
    analytic = estimate(scn).peak_allocated_bytes
    assert abs(analytic / trace(scn).report.peak_allocated_bytes - 1) < 1e-4


def test_a_checkpointed_eager_core_keeps_q_k_and_v_in_the_first_layer() -> None:
    # q @ kᵀ keeps q only for dk: with q, v adapted (k frozen) the first layer's matmul
    # keeps no q — but a checkpointed core keeps its inputs, q, k and v, whatever needs a
    # gradient; the input norm's tensors and the dropout masks (their input needs none) go
    def gap(recompute: str) -> int:
        scn = build_scenario({"model": "llama3.1-8b", "gpus": "1xH100", "framework": "hf",
                              "finetune": "lora", "lora_targets": "q,v", "lora_dropout": 0.1,
                              "precision": "bf16-pure", "seq_len": T, "attention": "eager",
                              "recompute": recompute}).resolved()
        ctx = RankContext(scn.model, scn.training, scn.parallel)
        return first_layer_unsaved_bytes(ctx, layer_saved(ctx))

    norm, masks = T * H * 4 + T * 4, 2 * T * H
    assert gap("selective") == norm + masks
    assert gap("none") == norm + masks + 32 * T * 128 * 2  # q, kept for dk only, goes
    pytest.importorskip("torch")
    from vramcalc.validate.compare import compare

    _, scn = scenario_for("llama-deep", framework="reference", finetune="lora",
                          lora_targets="q,v", lora_dropout=0.1, attention="eager",
                          recompute="selective", precision="bf16-pure", seq_len=1024)
    row = compare("first-layer-eager", scn)  # the first layer's q was left out (-4 MB)
    assert abs(row["terms"]["activations"]["rel_error"]) < 1e-4


def test_the_first_layer_keeps_no_norm_of_an_unadapted_k() -> None:
    # Qwen3's k_norm on k_proj's output: with q, v adapted, k needs no gradient in the first
    # layer, so its RMSNorm records nothing (the fp32 copy and rstd go); q's norm stays
    _, scn = scenario_for("qwen3-qknorm", framework="hf", finetune="lora", lora_targets="q,v",
                          precision="bf16", recompute="selective", attention="eager",
                          micro_batch_size=1, seq_len=1024)
    scn = scn.resolved()
    ctx = RankContext(scn.model, scn.training, scn.parallel)
    saved = {t.name: t.nbytes for t in layer_saved(ctx)}
    k_norm = 1024 * 8 * 128 * 4 + 1024 * 8 * 4  # fp32 copy of (s, g, d) and its rstd
    assert saved["attn.k_norm.x_fp32"] + saved["attn.k_norm.rstd"] == k_norm
    norm = 1024 * 1024 * 4 + 1024 * 4  # the input norm's fp32 copy and rstd
    assert first_layer_unsaved_bytes(ctx, layer_saved(ctx)) == norm + k_norm
    pytest.importorskip("peft")
    from vramcalc.validate.compare import compare

    for framework in ("hf", "reference"):  # were +0.6 % (the first layer's k norm counted)
        _, scn = scenario_for("qwen3-qknorm", framework=framework, finetune="lora",
                              lora_targets="q,v", precision="bf16", recompute="selective",
                              attention="eager", micro_batch_size=1, seq_len=1024)
        row = compare(framework, scn)
        assert abs(row["terms"]["activations"]["rel_error"]) < 1e-4, framework
