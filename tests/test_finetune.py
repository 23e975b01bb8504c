"""Fine-tuning (LoRA, QLoRA, DoRA) and bitsandbytes optimizers: analytic engine, options, CLI.

Independent sources for the expected values:
- LoRA (Hu et al. 2021, arXiv:2106.09685 Sec. 4.1): each adapted W (out × in) gains
  B (out × r) and A (r × in), r·(in + out) trainable parameters; the base is frozen.
  PEFT's `print_trainable_parameters()` for Llama-2-7B, r = 8, q_proj + v_proj prints
  "trainable params: 4,194,304 || all params: 6,742,609,920" (reproduced in countless PEFT
  tutorials; `tests/test_finetune_trace.py` also counts PEFT's own parameters).
- QLoRA (Dettmers et al. 2023, arXiv:2305.14314 Sec. 3): NF4 stores 4 bits per parameter
  and one absmax per 64-element block; double quantization stores those absmax values in 8
  bits with one fp32 constant per 256 of them: 4 + 8/64 + 32/(64·256) = 4.127 bits/param.
- bitsandbytes 0.50.1 (@ 95f9af30) storage: a per-tensor copy of the 256-entry fp32 dynamic
  map (state2.code), a 0-dim fp32 offset and a 16-entry fp32 NF4 code table per weight;
  8-bit optimizer states in blocks of 256 (since 0.44.0), 32-bit states below 4096 elements;
  paged states only for tensors of at least 1e5 elements (optim/optimizer.py).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from vramcalc.analytic import estimate
from vramcalc.catalog import resolve_model
from vramcalc.cli import app, main
from vramcalc.errors import InputError
from vramcalc.finetune import (
    nf4_constant_bytes,
    nf4_tensor_bytes,
    shapes_for,
    target_param_names,
)
from vramcalc.lora_targets import parse_targets
from vramcalc.model import ModelSpec
from vramcalc.options import build_scenario
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import activations as act
from vramcalc.terms.gradients import gradients_bytes
from vramcalc.terms.optimizer_states import bnb_state_split, optimizer_state_split
from vramcalc.terms.weights import weights_by_group
from vramcalc.training import TrainingConfig
from vramcalc.units import GB, alloc

runner = CliRunner()
LLAMA2_7B, _ = resolve_model("llama2-7b")
LLAMA2_70B, _ = resolve_model("llama2-70b")


def ctx_for(spec: ModelSpec, **kw: object) -> RankContext:
    tr = TrainingConfig(**kw)  # type: ignore[arg-type]
    return RankContext(spec, tr, ParallelConfig(dp=1))


def report(model: str = "llama2-7b", gpus: str = "A100-80GB", **kw: object):  # noqa: ANN201
    return estimate(build_scenario({"model": model, "gpus": gpus, **kw}))


# ---- trainable parameters --------------------------------------------------------------
def test_peft_default_llama2_7b_trainable_parameters() -> None:
    fs = shapes_for(ctx_for(LLAMA2_7B, finetune="lora"))
    assert fs.adapters.numel() == 4_194_304  # PEFT print_trainable_parameters
    assert fs.adapters.numel() + fs.frozen.numel() == 6_742_609_920


def test_lora_adds_r_in_plus_out_per_adapted_matrix() -> None:
    spec = LLAMA2_7B
    h, f, L, r = spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers, 16
    fs = shapes_for(ctx_for(spec, finetune="lora", lora_rank=r, lora_targets="all-linear"))
    per_layer = 4 * r * (h + h) + 2 * r * (h + f) + r * (f + h)  # q k v o, gate up, down
    assert fs.adapters.numel() == L * per_layer


def test_dora_adds_one_magnitude_per_output_row() -> None:
    lora = shapes_for(ctx_for(LLAMA2_7B, finetune="lora")).adapters.numel()
    dora = shapes_for(ctx_for(LLAMA2_7B, finetune="dora")).adapters.numel()
    assert dora - lora == LLAMA2_7B.num_hidden_layers * 2 * LLAMA2_7B.hidden_size  # q, v


def test_frozen_base_has_no_gradients_or_states() -> None:
    ctx = ctx_for(LLAMA2_7B, finetune="lora", precision="bf16-pure")
    n = 4_194_304
    assert gradients_bytes(ctx) == sum(t.count * alloc(t.numel, "bf16")
                                       for t in ctx.train_tensors)
    assert gradients_bytes(ctx) == pytest.approx(2 * n, rel=1e-9)  # 512-aligned adapters
    opt = optimizer_state_split(ctx)
    assert opt["states"] == 2 * 2 * n and opt["master"] == 0  # AdamW, bf16 states


def test_peft_adapters_are_fp32_without_a_master_copy() -> None:
    # PEFT get_peft_model(autocast_adapter_dtype=True) upcasts bf16 adapters to fp32; HF
    # Trainer's fused AdamW keeps a 512 B step tensor per adapter tensor (32 · 2 · 2)
    ctx = ctx_for(LLAMA2_7B, finetune="lora", precision="bf16", framework="hf")
    assert ctx.training.grad_dtype == "fp32" and not ctx.training.has_master_weights
    opt = optimizer_state_split(ctx)
    assert (gradients_bytes(ctx), opt["states"], opt["master"]) == (
        4 * 4_194_304, 8 * 4_194_304 + 128 * 512, 0)
    ref = ctx_for(LLAMA2_7B, finetune="lora", precision="bf16")  # reference: bf16 + master
    assert optimizer_state_split(ref)["master"] == 4 * 4_194_304


# ---- NF4 ---------------------------------------------------------------------------------
def test_nf4_is_4_127_bits_per_parameter() -> None:
    n = 4096 * 4096 * 256  # blocks and absmax blocks divide evenly, 512-byte aligned
    fixed = alloc(256, "fp32") + alloc(1, "fp32") + alloc(16, "fp32")  # codes, offset
    assert nf4_tensor_bytes(n) == n * 4 // 8 + n // 64 + 4 * n // (64 * 256) + fixed
    assert (nf4_tensor_bytes(n) - fixed) * 8 / n == pytest.approx(4.127, abs=5e-4)
    assert nf4_constant_bytes(n) == nf4_tensor_bytes(n) - n // 2


def test_qlora_quantizes_layer_linears_only() -> None:
    spec = LLAMA2_7B
    ctx = ctx_for(spec, finetune="qlora")
    fs = shapes_for(ctx)
    quantized = {t.name for t in fs.quantized.tensors}
    assert quantized == {"attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight",
                         "attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                         "mlp.down_proj.weight"}
    parts = weights_by_group(ctx)
    L, h, f, V = spec.num_hidden_layers, spec.hidden_size, spec.intermediate_size, spec.vocab_size
    assert parts["nf4"] == L * (4 * h * h + 3 * h * f) // 2  # two 4-bit codes per byte
    # embedding, lm_head and the norms stay bf16
    assert parts["frozen"] == 2 * (2 * V * h) + 2 * (2 * L + 1) * h
    assert parts["nf4_constants"] == L * (4 * nf4_constant_bytes(h * h)
                                          + 3 * nf4_constant_bytes(h * f))


# ---- optimizers ---------------------------------------------------------------------------
def test_bnb_8bit_blocks_min_size_and_paging() -> None:
    assert bnb_state_split(1 << 20, "adamw-8bit") == (2 * (1 << 20) + 2 * 4 * (1 << 12), 0)
    assert bnb_state_split(4095, "adamw-8bit") == (2 * alloc(4095, "fp32"), 0)  # < 4096: fp32
    # paged: state buffers of >= 1e5-element tensors move out; absmax stays
    assert bnb_state_split(1 << 20, "paged-adamw-8bit") == (2 * 4 * (1 << 12), 2 * (1 << 20))
    assert bnb_state_split(99_999, "paged-adamw") == (2 * alloc(99_999, "fp32"), 0)
    assert bnb_state_split(100_000, "paged-adamw") == (0, 2 * 4 * 100_000)


def test_paged_states_are_overhead_not_allocated() -> None:
    plain = report(finetune="qlora", lora_targets="all-linear", lora_rank=64,
                   optimizer="adamw")
    paged = report(finetune="qlora", lora_targets="all-linear", lora_rank=64,
                   optimizer="paged-adamw")
    moved = paged.subterms["overhead/paged_optimizer_states"]
    assert moved > 0
    assert plain.terms.optimizer_states - paged.terms.optimizer_states == moved
    assert any("unified memory" in n for n in paged.notes)


def test_paged_states_beyond_the_free_memory_live_in_host_ram() -> None:
    # torchtune fef3ed10 README: 7B_full_low_memory (PagedAdamW, 32-bit states of 6.74B
    # parameters, 54 GB) runs on one 24 GB RTX 4090; unified memory keeps what fits
    kw = {"model": "llama2-7b", "framework": "torchtune", "precision": "bf16-pure",
          "optimizer": "paged-adamw", "optimizer_in_backward": True, "recompute": "full",
          "seq_len": 512, "micro_batch_size": 2}
    small = estimate(build_scenario({**kw, "gpus": "1xRTX4090"}))
    large = estimate(build_scenario({**kw, "gpus": "1xH200"}))
    paged = large.subterms["overhead/paged_optimizer_states"]
    assert paged == 2 * 4 * 6_738_415_616 - large.terms.optimizer_states  # >= 1e5 elements
    assert large.host_bytes_per_node == 0 and large.fits
    resident = small.subterms["overhead/paged_optimizer_states"]
    assert small.fits and small.device_total_bytes == small.usable_bytes
    assert 0 < resident < paged and small.host_bytes_per_node == paged - resident
    # what stays resident is the room left beside the allocator's peak and the context
    assert resident == small.usable_bytes - (small.peak_reserved_bytes + (
        small.terms.overhead - resident - (small.peak_reserved_bytes
                                           - small.peak_allocated_bytes)))



def test_the_verdict_says_when_paged_states_fill_the_free_memory() -> None:
    from vramcalc.report import fit_phrase, paged_resident_bytes
    kw = {"model": "llama2-7b", "framework": "torchtune", "precision": "bf16-pure",
          "optimizer": "paged-adamw", "optimizer_in_backward": True, "recompute": "full",
          "seq_len": 512, "micro_batch_size": 2}
    for gpus, spills in (("1xRTX4090", True), ("1xH200", False)):
        rep = estimate(build_scenario({**kw, "gpus": gpus}))
        assert rep.gpu is not None and rep.usable_bytes is not None
        words = fit_phrase(rep.device_total_bytes, rep.usable_bytes,
                           rep.gpu.memory_total_bytes, paged=paged_resident_bytes(rep))
        assert ("waits in host RAM" in words) is spills, words

# ---- activations of frozen layers --------------------------------------------------------
def test_frozen_layers_drop_weight_gradient_inputs() -> None:
    full = {t.name for t in act.layer_saved(ctx_for(LLAMA2_7B))}
    lora = {t.name for t in act.layer_saved(ctx_for(LLAMA2_7B, finetune="lora"))}
    # q/v adapters read the normed input (kept); the MLP's inputs only served weight grads
    assert "attn.input" in lora and "mlp.input" in full and "mlp.input" not in lora
    assert "mlp.down_input" not in lora and {"lora.q.a_out", "lora.v.a_out"} <= lora


def test_dropout_keeps_a_mask_and_its_output_per_adapter() -> None:
    saved = {t.name: t for t in act.layer_saved(ctx_for(LLAMA2_7B, finetune="lora",
                                                         lora_dropout=0.1))}
    T, h = 4096, LLAMA2_7B.hidden_size  # default seq 4096, micro-batch 1
    assert saved["lora.q.dropout_mask"].nbytes == T * h  # bool, 1 byte each
    assert saved["lora.q.dropout_out"].nbytes == 2 * T * h
    assert "attn.input" not in saved  # nothing reads the undropped input any more


def test_activations_never_grow_under_lora() -> None:
    for kw in ({}, {"attention": "eager"}, {"recompute": "selective"},
               {"precision": "amp-bf16"}, {"framework": "hf"}):
        full = act.layer_activation_bytes(ctx_for(LLAMA2_7B, **kw))
        lora = act.layer_activation_bytes(ctx_for(LLAMA2_7B, finetune="lora", **kw))
        assert lora < full, kw


# ---- the acceptance case: Llama-2-7B on one RTX 4090 / A100 ------------------------------
@pytest.mark.parametrize("seq", [512, 1024, 2048])
@pytest.mark.parametrize("framework", ["reference", "hf"])
def test_qlora_below_lora_below_full_for_the_right_reasons(seq: int, framework: str) -> None:
    kw = {"seq_len": seq, "framework": framework}
    full, lora, qlora = (report(finetune=ft, **kw) for ft in ("full", "lora", "qlora"))
    assert qlora.peak_allocated_bytes < lora.peak_allocated_bytes < full.peak_allocated_bytes
    # LoRA saves the gradients and optimizer states of the frozen base ...
    assert lora.terms.gradients < 0.01 * full.terms.gradients
    assert lora.terms.optimizer_states < 0.01 * full.terms.optimizer_states
    # ... QLoRA also stores the base in 4 bits (+ bf16 embedding, head, norms)
    assert qlora.terms.weights < 0.3 * lora.terms.weights
    assert lora.terms.weights == pytest.approx(2 * 6.74e9, rel=0.01)


def test_llama2_7b_qlora_fits_a_4090_and_full_does_not() -> None:
    assert report(gpus="RTX4090", finetune="qlora", seq_len=2048).fits
    assert report(gpus="RTX4090", finetune="lora", seq_len=512).fits
    assert not report(gpus="RTX4090", finetune="full", seq_len=512).fits


def test_70b_qlora_on_one_80gb_gpu() -> None:
    r = report(model="llama2-70b", gpus="A100-80GB", finetune="qlora", recompute="full",
               seq_len=2048)
    assert r.fits
    # 69B params: ~4.13 bits each for the layer linears, bf16 embedding and head
    assert 34 * GB < r.terms.weights < 40 * GB


# ---- options, config files, CLI ------------------------------------------------------------
def test_parse_targets() -> None:
    assert parse_targets("v_proj, Q") == "q,v"
    assert parse_targets(["gate_proj", "down_proj", "up_proj"]) == "gate,up,down"
    assert parse_targets("all-linear") == "all-linear"
    with pytest.raises(InputError, match="did you mean: v"):
        parse_targets("q,vv")
    with pytest.raises(InputError):
        parse_targets(" , ")


def test_targets_follow_the_model() -> None:
    gpt2, _ = resolve_model("gpt2")
    assert target_param_names(gpt2, "up,down") == {"mlp.fc.weight", "mlp.proj.weight"}
    with pytest.raises(InputError, match="no gate"):
        target_param_names(gpt2, "gate")


@pytest.mark.parametrize("args,needle", [
    (["--lora-rank", "0"], "--lora-rank"),
    (["--lora-targets", "qq"], "did you mean"),
    (["--lora-dropout", "1.5"], "--lora-dropout"),
    (["--finetune", "lorra"], "did you mean"),
    (["--framework", "megatron"], "megatron"),
])
def test_bad_finetune_input_is_one_line_exit_2(args: list[str], needle: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "7b", "--finetune", "lora", *args])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1


def test_hf_fused_gpt2_gets_one_adapter_on_c_attn() -> None:
    """PEFT's LoRA on GPT-2 small (default target c_attn, r = 8) prints "trainable params:
    294,912 || all params: 124,734,720" (PEFT quicktour / countless tutorials): one adapter on
    the fused h → 3h projection per layer, 12 · 8 · (768 + 2304)."""
    spec, _ = resolve_model("gpt2")
    for targets in ("q,v", "q", "q,k,v"):  # any of q, k, v adapts the fused c_attn
        fs = shapes_for(ctx_for(spec, finetune="lora", framework="hf", lora_targets=targets))
        assert fs.adapters.numel() == 294_912
        assert fs.adapters.numel() + fs.frozen.numel() == 124_734_720


def test_cli_json_carries_the_breakdown() -> None:
    result = runner.invoke(app, ["estimate", "--model", "7b", "--gpus", "RTX4090",
                                 "--finetune", "qlora", "--seq-len", "1024", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["strategy"]["finetune"] == "qlora" and doc["strategy"]["lora_targets"] == "q,v"
    sub = doc["subterms"]
    assert {"weights/frozen", "weights/nf4", "weights/nf4_constants",
            "weights/adapters"} <= set(sub)
    assert sum(v for k, v in sub.items() if k.startswith("weights/")) == doc["terms"]["weights"]


def test_cli_table_shows_weight_parts() -> None:
    result = runner.invoke(app, ["estimate", "--model", "7b", "--gpus", "A100-80GB",
                                 "--finetune", "qlora", "--optimizer", "paged-adamw-8bit",
                                 "--lora-targets", "all-linear", "--lora-rank", "64"])
    assert result.exit_code == 0, result.output
    for label in ("NF4 4-bit data", "adapters", "paged optimizer states", "qlora r64"):
        assert label in result.output


def test_config_file_keys(tmp_path) -> None:  # noqa: ANN001
    cfg = tmp_path / "train.yaml"
    cfg.write_text("model: 7b\ngpus: RTX4090\nseq_len: 1024\nfinetune: qlora\n"
                   "lora_rank: 16\nlora_targets: [q_proj, k_proj, v_proj, o_proj]\n"
                   "lora_dropout: 0.05\noptimizer: paged-adamw-8bit\n")
    result = runner.invoke(app, ["check", str(cfg), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    text = json.dumps(doc)
    assert '"lora_targets": "q,k,v,o"' in text and '"lora_rank": 16' in text


def test_explain_lists_adapter_tensors() -> None:
    result = runner.invoke(app, ["explain", "--model", "7b", "--finetune", "lora",
                                 "--lora-dropout", "0.1"])
    assert result.exit_code == 0, result.output
    assert "lora.q.dropout_mask" in result.output


# ---- planner ---------------------------------------------------------------------------------
def test_planner_proposes_qlora_for_70b_on_one_gpu() -> None:
    from vramcalc.cli.plan import prepare_plan
    from vramcalc.planner import search

    base, req, _ = prepare_plan({"model": "70b", "gpus": "1xH100", "seq_len": 2048},
                                allow="finetune")
    result = search(base, req)
    assert result.entries, "a fine-tuning method should fit"
    best = result.entries[0]
    assert best.scenario.training.finetune in ("lora", "qlora", "dora")
    assert best.report.fits


def test_estimate_is_fast_enough_for_the_planner() -> None:
    # the adapter/NF4 tensor lists are cached per (spec, layout, method)
    scn = build_scenario({"model": "70b", "gpus": "8xH100", "finetune": "qlora"})
    a = estimate(scn)
    b = estimate(Scenario(**{**scn.__dict__}))
    assert a.peak_allocated_bytes == b.peak_allocated_bytes


# ---- invariants (hypothesis) -------------------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vramcalc.terms.weights import weights_bytes  # noqa: E402


@st.composite
def small_specs(draw: st.DrawFn) -> ModelSpec:
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2]))
    return ModelSpec(hidden_size=heads * draw(st.sampled_from([64, 128])),
                     num_hidden_layers=draw(st.integers(1, 4)), num_attention_heads=heads,
                     num_key_value_heads=kv, intermediate_size=draw(st.sampled_from([128, 512])),
                     vocab_size=draw(st.integers(100, 3000)))


finetune_trainings = st.fixed_dictionaries({
    "seq_len": st.sampled_from([64, 256]),
    "micro_batch_size": st.integers(1, 3),
    "precision": st.sampled_from(["bf16", "bf16-pure", "amp-bf16", "fp32"]),
    "optimizer": st.sampled_from(["adamw", "adamw-8bit", "paged-adamw-8bit", "sgd-momentum"]),
    "attention": st.sampled_from(["flash", "eager"]),
    "recompute": st.sampled_from(["none", "selective", "full"]),
    "framework": st.sampled_from(["reference", "hf"]),
    "lora_targets": st.sampled_from(["q,v", "all-linear", "o,down", "k"]),
    "lora_dropout": st.sampled_from([0.0, 0.1]),
    "lora_rank": st.sampled_from([1, 8, 16]),  # r < in·out/(in + out): fewer than the base
})


@settings(max_examples=60, deadline=None)
@given(small_specs(), finetune_trainings)
def test_finetuning_never_needs_more_model_state_or_activations(spec: ModelSpec,
                                                               kw: dict) -> None:
    full = RankContext(spec, TrainingConfig(**{**kw, "finetune": "full"}), ParallelConfig(dp=1))
    lora = RankContext(spec, TrainingConfig(**{**kw, "finetune": "lora"}), ParallelConfig(dp=1))
    qlora = RankContext(spec, TrainingConfig(**{**kw, "finetune": "qlora"}),
                        ParallelConfig(dp=1))
    assert gradients_bytes(lora) <= gradients_bytes(full)
    if "8bit" not in kw["optimizer"]:
        # (bitsandbytes keeps 32-bit states for tensors under min_8bit_size = 4096 elements,
        # so a tiny model's small adapters can need more state bytes than its 8-bit base)
        assert sum(optimizer_state_split(lora).values()) <= sum(
            optimizer_state_split(full).values())
    assert weights_bytes(qlora) <= weights_bytes(lora)
    if kw["recompute"] != "full":  # a checkpointed layer keeps its input either way
        assert act.layer_activation_bytes(lora) <= act.layer_activation_bytes(full) + (
            # adapters on a target whose input full training did not keep (o, down under
            # dropout or PEFT's fp32 cast) add a little
            sum(t.nbytes for t in act.layer_saved(lora) if t.name.startswith("lora.")))


@settings(max_examples=40, deadline=None)
@given(small_specs(), finetune_trainings, st.sampled_from(["lora", "qlora", "dora"]))
def test_finetune_terms_add_up(spec: ModelSpec, kw: dict, ft: str) -> None:
    scn = Scenario(model=spec, training=TrainingConfig(**{**kw, "finetune": ft}))
    rep = estimate(scn)
    terms = rep.terms.as_dict()
    assert all(v >= 0 for v in terms.values())
    assert sum(v for k, v in terms.items() if k != "overhead") == rep.peak_allocated_bytes
    assert sum(v for k, v in rep.subterms.items() if k.startswith("weights/")) == terms[
        "weights"]


def test_small_adapters_keep_32bit_states_under_8bit_adamw() -> None:
    """bitsandbytes' min_8bit_size (4096 elements): a 16 x 64 LoRA matrix keeps two fp32
    states (8 B/param) while a 64 x 128 base matrix gets 8-bit ones (2 B/param + absmax), so
    on a tiny model LoRA can need more state bytes than full training."""
    spec = ModelSpec(hidden_size=64, num_hidden_layers=1, num_attention_heads=1,
                     num_key_value_heads=1, intermediate_size=128, vocab_size=100)
    kw = {"seq_len": 64, "precision": "bf16-pure", "optimizer": "adamw-8bit",
          "lora_targets": "all-linear", "lora_rank": 16}
    lora = RankContext(spec, TrainingConfig(**kw, finetune="lora"), ParallelConfig(dp=1))
    n_adapter = sum(t.numel * t.count for t in lora.train_tensors)
    assert all(t.numel < 4096 for t in lora.train_tensors)
    assert sum(optimizer_state_split(lora).values()) == n_adapter * 8


def test_fused_projection_note_names_the_module_peft_adapts() -> None:
    """GPT-2 under the hf profile has q, k, v fused in c_attn (PEFT's default target for
    gpt2 is ["c_attn"]); Phi-3 fuses qkv_proj and gate_up_proj. The report says which."""
    gpt2 = estimate(build_scenario({"model": "gpt2", "gpus": "4090", "framework": "hf",
                                    "finetune": "lora", "lora_targets": "q,v"}))
    assert any("q,v -> c_attn" in n for n in gpt2.notes)
    phi = estimate(build_scenario({"model": "phi3-mini", "gpus": "4090", "framework": "hf",
                                   "finetune": "lora", "lora_targets": "q,up"}))
    assert any("q -> qkv_proj" in n and "up -> gate_up_proj" in n for n in phi.notes)
    llama = estimate(build_scenario({"model": "8b", "gpus": "4090", "framework": "hf",
                                     "finetune": "lora"}))
    assert not any("fuses" in n for n in llama.notes)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**11), st.one_of(st.none(), st.integers(0, 10**11)),
       st.integers(0, 10**11))
def test_paged_residency_splits_the_pages_without_overfilling(paged: int, usable: int | None,
                                                              rest: int) -> None:
    from vramcalc.terms.optimizer_states import paged_residency

    resident, spilled = paged_residency(paged, usable, rest)
    assert resident >= 0 and spilled >= 0 and resident + spilled == paged
    if usable is None:  # no GPU: nothing to page against
        assert spilled == 0
    else:  # what is resident fits beside the rest, and nothing spills while there is room
        assert rest + resident <= max(usable, rest)
        assert spilled == 0 or rest + resident >= usable


def test_a_tied_embedding_under_lora_gets_no_gradient() -> None:
    """Gemma ties lm_head to embed_tokens; under LoRA both are the frozen base, so the end of
    backward holds no V x h gradient (full training sums the head's and the embedding's
    shares into one). The trace of transformers' model agrees (validate grid: gemma-mqa,
    hf LoRA at 128 tokens, where such a gradient would have been the peak)."""
    from vramcalc.terms.gradients import tied_embedding_grad_bytes

    def ctx(finetune: str) -> RankContext:
        scn = build_scenario({"model": "gemma-2b", "gpus": "1xH100", "framework": "hf",
                              "seq_len": 256, "finetune": finetune}).resolved()
        return RankContext(scn.model, scn.training, scn.parallel, 0)

    assert tied_embedding_grad_bytes(ctx("lora")) == 0
    assert tied_embedding_grad_bytes(ctx("full")) == alloc(256000 * 2048, "bf16")
