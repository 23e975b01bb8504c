"""Eager attention's instants and what the attention's locals hold
(vramcalc/terms/moments.py `eager_forward_moment`, `plain_backward_moments`).

Independent sources: the traced reference model's and transformers' attention code
(vramcalc/trace/reference_model.py `Attention.forward`, `Block.forward`; transformers 5.x
`modeling_gpt2.py`, `modeling_llama.py`), torch's autocast (casts are new tensors; a matmul
keeps the casts it reads) and torch/utils/checkpoint.py (a checkpointed function's inputs
live until its region's backward has run), counted by hand; and the trace engine.
"""

from __future__ import annotations

import pytest

from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import activations as act
from vramcalc.validate.compare import compare
from vramcalc.validate.shapes import scenario_for

MiB = 2**20


def _ctx(recompute: str, **kw: object) -> RankContext:
    _, scn = scenario_for("gpt2-relu", framework="reference", recompute=recompute,
                          attention="eager", micro_batch_size=1, seq_len=1024, **kw)
    scn = scn.resolved()
    return RankContext(scn.model, scn.training, scn.parallel, 0)


@pytest.mark.parametrize(("recompute", "held"), [
    # the layer's input norm (fp32 input, mean, rstd), the q and v adapters' input casts
    # and A outputs, the normed input (fp32, the attention's argument), fp32 q, k, v (the
    # 4-bit projections return x's dtype) and the 16-bit casts of q and kᵀ the scores' matmul
    # keeps; v's cast is made after the softmax
    ("none", 3 * MiB + 8192 + 2 * (3 * MiB // 2 + 16384) + 3 * MiB + 9 * MiB + 3 * MiB),
    # a checkpointed core's first forward keeps no cast
    ("selective", 3 * MiB + 8192 + 2 * (3 * MiB // 2 + 16384) + 3 * MiB + 9 * MiB),
    # a checkpointed layer keeps nothing: the normed input and q, k, v are locals
    ("full", 3 * MiB + 9 * MiB),
])
def test_qlora_autocast_softmax_instant_by_hand(recompute: str, held: int) -> None:
    # GPT-2-shaped (h 768, 12 heads of 64), b 1 × 1,024 tokens: a (T, h) fp32 tensor is 3 MiB
    ctx = _ctx(recompute, finetune="qlora", lora_targets="q,v", precision="amp-bf16")
    scores = 12 * 1024 * 1024
    # the 16-bit scores, their fp32 copy (softmax is on autocast's fp32 list) and the probs
    assert act.eager_forward_moment(ctx) == (held, scores * 2 + scores * 4 + scores * 4)


def test_full_training_autocast_keeps_the_normed_input_as_a_local() -> None:
    # without recompute the linears keep three 16-bit casts of the normed input, which
    # itself (fp32) lives on as the attention's argument
    ctx = _ctx("none", precision="amp-bf16")
    saved = {t.name: t.nbytes for t in act.layer_saved(ctx)}
    held, _ = act.eager_forward_moment(ctx)
    assert saved["attn.input.cast"] == 3 * (3 * MiB // 2)
    assert held == (sum(v for k, v in saved.items() if k.startswith("input_norm."))
                    + saved["attn.input.cast"] + 3 * (3 * MiB // 2) + 3 * MiB)


@pytest.mark.parametrize(("framework", "shape", "kw"), [
    ("reference", "gpt2-relu", {"precision": "amp-bf16", "recompute": "none"}),
    ("reference", "gpt2-relu", {"precision": "bf16", "recompute": "selective"}),
    ("reference", "gpt2-relu", {"precision": "fp32", "recompute": "selective",
                                "finetune": "lora", "lora_targets": "q,v"}),
    ("reference", "llama-deep", {"precision": "amp-bf16", "recompute": "full",
                                 "finetune": "qlora", "lora_targets": "all-linear"}),
    ("reference", "llama-deep", {"precision": "amp-bf16", "recompute": "selective",
                                 "finetune": "qlora", "lora_targets": "q,v",
                                 "micro_batch_size": 2}),
    ("hf", "gpt2-relu", {"precision": "amp-bf16", "recompute": "selective",
                         "finetune": "qlora", "lora_targets": "q,v"}),
    ("hf", "gpt2-relu", {"precision": "amp-bf16", "recompute": "none",
                         "finetune": "qlora", "lora_targets": "q,v", "micro_batch_size": 2}),
    ("hf", "llama-deep", {"precision": "amp-bf16", "recompute": "selective"}),
    ("hf", "llama-deep", {"precision": "amp-bf16", "recompute": "selective",
                          "finetune": "qlora", "lora_targets": "q,v"}),
])
def test_eager_rows_against_the_trace(framework: str, shape: str, kw: dict[str, object]) -> None:
    # before: forward −0.6 … −3.8 %, backward −0.4 … −3.3 % (reference), peak −3.3 %, −1.1 %,
    # −0.4 % (hf); the phases whose eager instants these rows exercise
    options = {"attention": "eager", "micro_batch_size": 1, "seq_len": 1024, **kw}
    name, scn = scenario_for(shape, framework=framework, **options)
    row = compare(name, scn)
    assert abs(row["rel_error"]) < 3e-4, row["rel_error"]
    phases = ("backward",) if framework == "hf" else ("forward", "backward")
    for phase in phases:
        assert abs(row["phases"][phase]["rel_error"]) < 3e-4, (phase, row["phases"][phase])


def test_transformers_rotary_decoder_binds_its_embedding_output() -> None:
    # LlamaModel.forward keeps `inputs_embeds` bound while every layer runs: a 16-bit one is
    # no saved tensor (the first RMSNorm keeps an fp32 copy); a checkpointed first layer
    # keeps it as its input, and an fp32 one is that norm's input itself
    from vramcalc.terms.model_locals import embedding_locals_bytes

    def ctx(precision: str, recompute: str) -> RankContext:
        _, scn = scenario_for("llama-deep", framework="hf", precision=precision,
                              recompute=recompute, micro_batch_size=2, seq_len=512)
        scn = scn.resolved()
        return RankContext(scn.model, scn.training, scn.parallel, 0)

    assert embedding_locals_bytes(ctx("bf16", "none")) == 2 * 512 * 1024 * 2
    assert embedding_locals_bytes(ctx("bf16", "full")) == 0
    assert embedding_locals_bytes(ctx("amp-bf16", "none")) == 0


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_transformers_layer_locals_against_the_trace(recompute: str) -> None:
    # the decoder layer's 16-bit `residual` and the model's `inputs_embeds` at the softmax
    # (forward −0.3 % and −0.4 % before)
    name, scn = scenario_for("llama-deep", framework="hf", precision="bf16",
                             recompute=recompute, attention="eager", micro_batch_size=1,
                             seq_len=1024)
    row = compare(name, scn)
    assert abs(row["phases"]["forward"]["rel_error"]) < 3e-4, row["phases"]["forward"]


def _hf_llama(recompute: str, precision: str, finetune: str | None) -> tuple[str, Scenario]:
    kw: dict[str, object] = {"finetune": finetune, "lora_targets": "q,v"} if finetune else {}
    return scenario_for("llama-deep", framework="hf", precision=precision, recompute=recompute,
                        attention="eager", micro_batch_size=1, seq_len=1024, **kw)


@pytest.mark.parametrize(("precision", "finetune", "held"), [
    # llama-deep (h 1,024, 16 heads and 4 kv heads of 64), 1,024 tokens: a (T, h) tensor is
    # 1 MiB per byte of its dtype, k and v before the repeat a quarter of that. The normed
    # input (r), q and k after RoPE promoted to cos/sin's dtype (r), v in the projection's
    # dtype, k and v repeated to 16 heads
    ("bf16", "lora", 2 * MiB + 2 * MiB + 2 * MiB + 2 * MiB + MiB // 2 + MiB // 2),
    # autocast: the fp32 residual's norm; bf16 projections, but q and k fp32 after RoPE
    ("amp-bf16", None, 4 * MiB + 4 * MiB + 4 * MiB + 2 * MiB + MiB + MiB // 2),
    # 4-bit projections under autocast return x's dtype: all fp32
    ("amp-bf16", "qlora", 4 * MiB + 4 * MiB + 4 * MiB + 4 * MiB + MiB + MiB),
])
def test_transformers_checkpointed_layer_softmax_locals_by_hand(
        precision: str, finetune: str | None, held: int) -> None:
    # modeling_llama.py LlamaDecoderLayer.forward / LlamaAttention.forward /
    # apply_rotary_pos_emb / repeat_kv in a checkpointed layer's first forward (nothing saved)
    scn = _hf_llama("full", precision, finetune)[1].resolved()
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    assert act.eager_forward_moment(ctx)[0] == held


@pytest.mark.parametrize(("recompute", "precision", "finetune"), [
    ("full", "amp-bf16", "qlora"), ("full", "amp-bf16", None), ("full", "bf16", "lora"),
    ("none", "bf16", "lora"), ("selective", "bf16", "qlora"), ("none", "fp32", "lora"),
    ("selective", "amp-bf16", None)])
def test_transformers_peft_forward_locals_against_the_trace(
        recompute: str, precision: str, finetune: str | None) -> None:
    # the checkpointed layer's locals above; under PEFT the frozen projections keep no
    # normed input (a local of the decoder layer) and the first layer keeps nothing of the
    # embedding output the model's forward binds; under autocast q and k leave RoPE in fp32
    # (forward −4.2, −0.3, −0.6, −0.5, −0.5, −0.5, −0.45 % before)
    row = compare(*_hf_llama(recompute, precision, finetune))
    assert abs(row["phases"]["forward"]["rel_error"]) < 3e-4, row["phases"]["forward"]


@pytest.mark.parametrize(("recompute", "held"), [
    # the layer's norm (fp32 input, rstd, x̂) and the three 16-bit casts of the normed input
    # the linears keep, the normed input itself (fp32), k before the repeat in fp32 (RoPE
    # with fp32 cos and sin) and v in bf16; a checkpointed core's first forward keeps no
    # cast: q and k's repeats are fp32, v's bf16
    ("selective", 8 * MiB + 4096 + 6 * MiB + 4 * MiB + MiB + MiB // 2 + 4 * MiB + 4 * MiB
     + 2 * MiB),
    # without recompute the matmul keeps the 16-bit casts of q and kᵀ (and v's repeats, bf16
    # already) beside the fp32 q and k repeats; the model's fp32 additive mask
    ("none", 8 * MiB + 4096 + 6 * MiB + 4 * MiB + MiB + MiB // 2 + 3 * 2 * MiB + 4 * MiB
     + 4 * MiB + 4 * MiB),
])
def test_transformers_autocast_rope_softmax_locals_by_hand(recompute: str, held: int) -> None:
    scn = _hf_llama(recompute, "amp-bf16", None)[1].resolved()
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    assert act.eager_forward_moment(ctx)[0] == held


@pytest.mark.parametrize("shape", ["qwen2-bias", "qwen3-qknorm", "gemma-mqa"])
def test_tied_embedding_backward_finds_no_mask_or_rotary_tables(shape: str) -> None:
    # tied heads: the embedding's backward, where the head's and the embedding's shares of
    # the gradient meet, is the peak. The model's additive mask, position ids and cos/sin
    # are locals of LlamaModel.forward held only by the checkpoints and the layers' saved
    # tensors, freed with the first layer's backward (peak +0.38, +0.38, +0.45 % before)
    name, scn = scenario_for(shape, framework="hf", precision="fp32", recompute="full",
                             attention="eager", micro_batch_size=1, seq_len=1024)
    row = compare(name, scn)
    assert row["trace_peak_phase"] == "backward"
    assert abs(row["rel_error"]) < 3e-4, row["rel_error"]


def test_phi3_fused_output_goes_with_v_in_backward() -> None:
    # Phi3Attention: q, k and v are slices of qkv_proj's output; RoPE (a torch.cat with the
    # pass-through dims) makes q and k new tensors, so only v's view holds the fused output,
    # which probs @ v's backward frees before the softmax's (peak +0.78 % before)
    name, scn = scenario_for("phi3-fused", framework="hf", precision="fp32", recompute="full",
                             attention="eager", micro_batch_size=1, seq_len=1024)
    row = compare(name, scn)
    assert row["trace_peak_phase"] == "backward"
    assert abs(row["rel_error"]) < 3e-4, row["rel_error"]
