"""The hf profile's stack details: HF Trainer's AdamW choices (`--hf-optim
adamw_torch|adamw_torch_fused|adamw_hf`) and HF gradient checkpointing's use_reentrant.

Expected values from transformers' and torch's source, not from vramcalc:
- the Trainer's default `TrainingArguments.optim`: "adamw_hf" in v4.31.0, "adamw_torch" from
  v4.32.0 (huggingface/transformers#25109), "adamw_torch_fused" from v4.54.0 when torch >= 2.8
  (#37358) — src/transformers/training_args.py `default_optim` at those tags;
- transformers' AdamW (v4.31.0 src/transformers/optimization.py `AdamW.step`): per parameter
  `denom = exp_avg_sq.sqrt().add_(group["eps"])` is its only new tensor, allocated while the
  previous parameter's `denom` is still bound; the moments and the parameter are updated in
  place; `state["step"]` is a Python int (no device memory);
- transformers' Llama decoder layer registers self_attn, mlp, input_layernorm,
  post_attention_layernorm in that order (modeling_llama.py `LlamaDecoderLayer.__init__`),
  so model.parameters() runs embed_tokens, q_proj, k_proj, ...
- torch/utils/checkpoint.py `CheckpointFunction.backward` (use_reentrant=True) re-runs the
  layer's forward, binds its output (`outputs`) and calls `torch.autograd.backward` on it:
  that output, one (b, s, h) tensor in the residual dtype, stays alive through the layer's
  backward; the non-reentrant checkpoint keeps only what the re-run saves. The default:
  `{"use_reentrant": True}` in transformers 4.35-4.57 (modeling_utils.py
  `gradient_checkpointing_enable`), `{"use_reentrant": False}` from 5.0.
The trace engine runs `TransformersAdamW` (that step, written from the same source) on fake
tensors: tests/test_trace.py compares it with the analytic model over the grid's adamw_hf rows.
"""

from __future__ import annotations

import pytest

from vramcalc.analytic import estimate
from vramcalc.cli import main
from vramcalc.training import TrainingConfig
from vramcalc.validate import scenario_for

V, H = 32000, 1024  # llama-gqa (vramcalc/validate/shapes.py): untied, 16 heads of 64
TENSORS = 21  # embedding, 2 layers x (q, k, v, o, gate, up, down, 2 norms), norm, head


def _optimizer_phase(**kw: object) -> int:
    _, scn = scenario_for("llama-gqa", framework="hf", precision="fp32", seq_len=256,
                          micro_batch_size=1, **kw)  # type: ignore[arg-type]
    return estimate(scn).phases["optimizer"]


@pytest.mark.parametrize(("optim", "impl"), [
    ("adamw_torch", "foreach"), ("adamw_torch_fused", "fused"), ("adamw_hf", "hf-loop")])
def test_each_name_steps_as_transformers_builds_it(optim: str, impl: str) -> None:
    assert TrainingConfig(framework="hf", hf_optim=optim).step_impl == impl
    # the Trainer's default of transformers >= 4.54 with torch >= 2.8
    assert TrainingConfig(framework="hf").step_impl == "fused"


def test_adamw_hf_holds_one_denom_per_parameter_and_the_previous_one() -> None:
    # fp32: the largest consecutive pair in parameter order is embed_tokens (V·h) then the
    # first layer's q_proj (h·h): embedding's denom still bound while q_proj's is made.
    # Against fused: no temporaries, but 21 0-dim step tensors on the device (512 B each)
    pair = 4 * V * H + 4 * H * H
    assert _optimizer_phase(hf_optim="adamw_hf") - _optimizer_phase(hf_optim="adamw_torch_fused") \
        == pair - TENSORS * 512


def test_adamw_hf_uses_less_than_torchs_loop() -> None:
    # torch's loop: norm's denom + the head's sqrt and quotient (2 head-sized temporaries)
    loop = _optimizer_phase(optimizer_impl="loop")
    assert loop - _optimizer_phase(hf_optim="adamw_hf") == (4 * H + 2 * 4 * V * H) - (
        4 * V * H + 4 * H * H)


@pytest.mark.parametrize(("args", "words"), [
    (["--hf-optim", "adamw_hf"], "--framework hf"),
    (["--framework", "hf", "--hf-optim", "adamw_hf", "--optimizer", "sgd"], "--optimizer sgd"),
    (["--framework", "hf", "--hf-optim", "adamw_torch", "--optimizer-impl", "fused"],
     "--optimizer-impl fused"),
    (["--framework", "hf", "--hf-optim", "adamw_apex"], "unknown value"),
])
def test_bad_combinations_are_one_error_line(capsys, args: list[str], words: str) -> None:  # noqa: ANN001
    code = main(["estimate", "--model", "8b", *args])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and words in err[0]


def _peak(**kw: object) -> tuple[int, str]:
    _, scn = scenario_for("llama-deep", framework="hf", recompute="full", seq_len=2048, **kw)  # type: ignore[arg-type]
    rep = estimate(scn)
    return rep.peak_allocated_bytes, rep.peak_phase


def test_reentrant_checkpoint_holds_the_rerun_layer_output() -> None:
    # llama-deep (h = 1024, vocab 1024) at b = 2, s = 2048: the peak is inside a layer's
    # backward; the re-run output is b·s·h bf16 = 8 MiB more
    off, phase = _peak()
    on, _ = _peak(use_reentrant=True)
    assert phase == "backward" and on - off == 2 * 2048 * 1024 * 2
    assert _peak(use_reentrant=False)[0] == off  # transformers 5.x's default


@pytest.mark.parametrize("args", [["--use-reentrant"],
                                  ["--framework", "hf", "--no-use-reentrant"]])
def test_reentrant_needs_hf_full_recompute(capsys, args: list[str]) -> None:  # noqa: ANN001
    code = main(["estimate", "--model", "8b", *args])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and "--recompute full" in err[0]


# ---- PEFT's prepare_model_for_kbit_training (--kbit-prepare) -------------------------------
KBIT = {"framework": "hf", "finetune": "qlora", "precision": "amp-bf16", "recompute": "full",
        "kbit_prepare": True}


def test_kbit_prepare_checkpoints_reentrant_unless_told() -> None:
    # PEFT calls gradient_checkpointing_enable(gradient_checkpointing_kwargs={}); with no
    # use_reentrant, torch.utils.checkpoint.checkpoint falls back to use_reentrant=True
    assert TrainingConfig(**KBIT).reentrant
    assert not TrainingConfig(**KBIT, use_reentrant=False).reentrant
    assert not TrainingConfig(framework="hf", recompute="full").reentrant  # transformers 5.x


def test_peft_prepare_casts_what_the_profile_assumes() -> None:
    """Run PEFT's own prepare_model_for_kbit_training on a small bf16 transformers Llama whose
    layer linears are the 4-bit stand-ins (real tensors, CPU): every parameter that is not
    4-bit becomes fp32 and frozen, the 4-bit codes stay uint8, gradient checkpointing is on.
    That is the amp policy's fp32 weights with NF4 layer linears, which the analytic
    profile counts (the grid's kbit-prepare rows compare the whole step with the trace)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    import transformers
    from peft import prepare_model_for_kbit_training

    from vramcalc.trace.hf_models import to_hf_config
    from vramcalc.trace.nf4 import NF4Linear
    from vramcalc.validate import SHAPES

    spec = SHAPES["llama-gqa"].model_copy(update={"hidden_size": 64, "num_attention_heads": 4,
                                                  "num_key_value_heads": 2,
                                                  "intermediate_size": 128,
                                                  "vocab_size": 256})
    model = transformers.AutoModelForCausalLM.from_config(to_hf_config(spec),
                                                          dtype=torch.bfloat16)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in list(parent.named_children()):
                if isinstance(mod, torch.nn.Linear):
                    setattr(parent, name, NF4Linear.from_linear(mod, torch.bfloat16))
    model.is_loaded_in_4bit = True
    model = prepare_model_for_kbit_training(model)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(not p.requires_grad for p in model.parameters())
    linears = {n for n in dtypes if ".self_attn." in n or ".mlp." in n}
    codes = {n for n in linears if n.endswith(".weight")}
    assert codes and all(dtypes[n] == torch.uint8 for n in codes)
    # the stand-in's quantization constants (uint8 absmax, fp32 tables) are never 16-bit
    assert all(dtypes[n] in (torch.uint8, torch.float32) for n in linears)
    rest = set(dtypes) - linears  # embed_tokens, the norms, lm_head
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= rest
    assert all(dtypes[n] == torch.float32 for n in rest)
    assert model.is_gradient_checkpointing


@pytest.mark.parametrize(("update", "words"), [
    ({"precision": "bf16"}, "fp32"), ({"recompute": "none"}, "--recompute full"),
    ({"finetune": "lora"}, "--finetune qlora"), ({"framework": "reference"}, "--framework hf")])
def test_kbit_prepare_refuses_what_peft_would_not_do(update: dict, words: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=words.replace("-", r"\-")):
        TrainingConfig(**{**KBIT, **update})


# ---- PEFT's modules_to_save (--modules-to-save) ---------------------------------------------
def _states(**kw: object) -> dict[str, int]:
    from vramcalc.validate.compare import analytic_points

    _, scn = scenario_for("llama-gqa", framework="hf", finetune="lora", precision="amp-bf16",
                          seq_len=256, micro_batch_size=1, **kw)  # type: ignore[arg-type]
    return analytic_points(scn)


@pytest.mark.parametrize("module", ["lm_head", "embed_tokens"])
def test_a_saved_module_is_a_trained_fp32_copy(module: str) -> None:
    # ModulesToSaveWrapper keeps the frozen original and trains copy.deepcopy of it: one more
    # V·h fp32 weight (amp: the model's weights are fp32), its fp32 gradient, AdamW's two
    # fp32 moments, and the fused step's 0-dim step tensor (one 512 B block)
    base, saved = _states(), _states(modules_to_save=module)
    assert saved["weights"] - base["weights"] == 4 * V * H
    assert saved["gradients"] - base["gradients"] == 4 * V * H
    assert saved["optimizer_states"] - base["optimizer_states"] == 8 * V * H + 512


def test_peft_copies_the_module_without_upcasting_it() -> None:
    """PEFT's own wrapper on real CPU tensors: the original frozen, a trainable copy of the
    same shape and dtype (not upcast like the adapters) — why a 16-bit policy is refused."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from peft import LoraConfig, get_peft_model

    from vramcalc.trace.hf_models import to_hf_config
    from vramcalc.validate import SHAPES

    spec = SHAPES["llama-gqa"].model_copy(update={"hidden_size": 64, "num_attention_heads": 4,
                                                  "num_key_value_heads": 2,
                                                  "intermediate_size": 128,
                                                  "vocab_size": 256})
    model = transformers.AutoModelForCausalLM.from_config(to_hf_config(spec),
                                                          dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                             modules_to_save=["lm_head"]))
    heads = {n: p for n, p in model.named_parameters() if "lm_head" in n}
    trained = [p for p in heads.values() if p.requires_grad]
    frozen = [p for p in heads.values() if not p.requires_grad]
    assert len(trained) == 1 and len(frozen) == 1
    assert trained[0].shape == frozen[0].shape == (256, 64)
    assert trained[0].dtype == torch.bfloat16  # the LoRA adapters are upcast to fp32
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)


@pytest.mark.parametrize(("args", "words"), [
    (["--precision", "bf16"], "amp-bf16"),
    (["--model", "gemma-2b"], "ties"),
    (["--modules-to-save", "score"], "unknown module"),
    (["--finetune", "full"], "PEFT method"),
])
def test_modules_to_save_refusals(capsys, args: list[str], words: str) -> None:  # noqa: ANN001
    base = {"--model": "8b", "--framework": "hf", "--finetune": "lora",
            "--precision": "amp-bf16", "--modules-to-save": "lm_head"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    code = main(["estimate", *[x for kv in base.items() for x in kv]])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and words in err[0]


# ---- LoRA on the token embedding (--lora-embedding) -----------------------------------------
def test_embedding_adapter_shapes_and_states() -> None:
    # peft tuners/lora/layer.py Embedding.update_layer: lora_embedding_A (r, V) and
    # lora_embedding_B (h, r), upcast to fp32 like every adapter: r·(V + h) more fp32 weight
    # and gradient, AdamW's two moments, and two fused step tensors (512 B each)
    r = 8
    base, emb = _states(), _states(lora_embedding=True)
    n = r * (V + H)
    assert emb["weights"] - base["weights"] == 4 * n
    assert emb["gradients"] - base["gradients"] == 4 * n
    assert emb["optimizer_states"] - base["optimizer_states"] == 8 * n + 2 * 512


def test_embedding_adapter_makes_the_first_layer_keep_its_tensors() -> None:
    # a frozen embedding's output needs no gradient, so the first layer keeps less; with an
    # adapter on the embedding it keeps what every layer keeps, plus A's output (T, r)
    from vramcalc.rank import RankContext
    from vramcalc.terms import activations as act

    def ctx(**kw: object) -> RankContext:
        _, scn = scenario_for("llama-gqa", framework="hf", finetune="lora", **kw)  # type: ignore[arg-type]
        scn = scn.resolved()
        return RankContext(scn.model, scn.training, scn.parallel, 0)

    assert act.first_layer_gap(ctx()) > 0
    assert act.first_layer_gap(ctx(lora_embedding=True)) == 0
    extra = {t.name: t.nbytes for t in act.embedding_saved(ctx(lora_embedding=True))}
    assert extra["lora.embed.a_out"] == 2 * 1024 * 8 * 4  # T = b·s = 2·1024, r = 8, fp32
    kept16 = {t.name: t for t in act.embedding_saved(ctx(lora_embedding=True,
                                                         adapters_16bit=True))}
    assert kept16["lora.embed.a_out"].dtype == "bf16"  # in the adapters' dtype


def test_embedding_adapter_with_checkpointing_agrees_with_the_trace() -> None:
    # HF Trainer enables checkpointing after get_peft_model: transformers'
    # enable_input_require_grads then hooks the adapted embedding, whose output already
    # requires grad, so the base embedding's output is not made a leaf the graph holds
    pytest.importorskip("peft")
    from vramcalc.trace.engine import trace

    _, scn = scenario_for("llama-deep", framework="hf", finetune="lora", recompute="full",
                          precision="bf16-pure", lora_embedding=True, seq_len=256)
    analytic = estimate(scn).peak_allocated_bytes
    assert abs(analytic / trace(scn).report.peak_allocated_bytes - 1) < 5e-4


@pytest.mark.parametrize(("args", "words"), [
    (["--finetune", "full"], "--finetune lora or qlora"),
    (["--modules-to-save", "embed_tokens", "--precision", "amp-bf16"], "not both"),
    (["--model", "gemma-2b"], "ties"),
])
def test_embedding_adapter_refusals(capsys, args: list[str], words: str) -> None:  # noqa: ANN001
    base = {"--model": "8b", "--framework": "hf", "--finetune": "lora"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    code = main(["estimate", *[x for kv in base.items() for x in kv], "--lora-embedding"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and words in err[0]


# ---- LoRA on the output head (--lora-head) --------------------------------------------------
def test_head_adapter_shapes_and_states() -> None:
    # PEFT's lora.Linear on lm_head: A (r, h), B (V, r), fp32
    n = 8 * (H + V)
    base, head = _states(), _states(lora_head=True)
    assert head["weights"] - base["weights"] == 4 * n
    assert head["gradients"] - base["gradients"] == 4 * n
    assert head["optimizer_states"] - base["optimizer_states"] == 8 * n + 2 * 512


def test_head_adapter_sum_is_the_forward_peak_in_fp32() -> None:
    # peft tuners/lora/layer.py Linear.forward: `result = result + lora_B(lora_A(x)) *
    # scaling` holds the base logits, the scaled B output and the sum, each (T, V): in fp32
    # 3·T·V·4 bytes, above the loss's fp32 logits + log-probs (2·T·V·4 + labels)
    from vramcalc.rank import RankContext
    from vramcalc.terms import logits as lg

    _, scn = scenario_for("llama-gqa", framework="hf", finetune="lora", precision="fp32",
                          lora_head=True)
    scn = scn.resolved()
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    T = 2 * 1024
    assert lg.logits_forward_peak_bytes(ctx) == 3 * T * V * 4


@pytest.mark.parametrize(("args", "words"), [
    (["--finetune", "dora"], "--finetune lora or qlora"),
    (["--modules-to-save", "lm_head", "--precision", "amp-bf16"], "not both"),
    (["--chunked-ce", "4"], "chunked"),
])
def test_head_adapter_refusals(capsys, args: list[str], words: str) -> None:  # noqa: ANN001
    base = {"--model": "8b", "--framework": "hf", "--finetune": "lora"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    code = main(["estimate", *[x for kv in base.items() for x in kv], "--lora-head"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and words in err[0]


def test_speed_model_counts_the_trained_copies_and_adapters() -> None:
    # the speed model's trained-parameter count (gradient traffic, weight-gradient FLOPs)
    # includes a saved module's full copy and the embedding / head adapters
    from vramcalc.speed import training_peft
    from vramcalc.validate import SHAPES

    spec = SHAPES["llama-gqa"]

    def n(**kw: object) -> int:
        tr = TrainingConfig(framework="hf", finetune="lora", precision="amp-bf16", **kw)  # type: ignore[arg-type]
        counts = training_peft(spec, tr)
        assert counts is not None
        return counts.adapter_params

    assert n(modules_to_save="lm_head") - n() == V * H
    assert n(lora_embedding=True, lora_head=True) - n() == 2 * 8 * (V + H)


# ---- HF Trainer's gradient accumulation under FSDP ---------------------------------------------
# transformers trainer.py `_inner_training_loop` runs every micro-batch but the last inside
# `accelerator.no_sync(model)` unless accelerate's GradientAccumulationPlugin has
# sync_each_batch=True; accelerate accelerator.py `no_sync` calls FSDP2's
# `set_requires_gradient_sync(False)` (FSDP1: `FullyShardedDataParallel.no_sync()`), and
# FSDP2 keeps each unsharded gradient, cast to the policy's reduce dtype, until the last
# micro-batch. accelerate's policy (utils/dataclasses.py `set_mixed_precision`) reduces in
# its param dtype: bf16 under bf16 autocast. Llama-3.1-8B's shapes from its model card.
LLAMA31_8B_PARAMS = 8_030_261_248


def _hf_fsdp(**kw: object) -> object:
    from vramcalc.options import build_scenario

    values = {"model": "llama3.1-8b", "gpus": "8xH100", "framework": "hf", "fsdp": "full",
              "precision": "amp-bf16", "seq_len": 2048, "micro_batch_size": 1,
              "recompute": "full", **kw}
    return build_scenario(values).resolved()


def test_trainer_accumulates_fsdp_gradients_unsharded_in_the_reduce_dtype() -> None:
    from vramcalc.rank import RankContext
    from vramcalc.terms.gradients import gradients_at_step_bytes, gradients_bytes

    scn = _hf_fsdp(grad_accum=4)
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    held = gradients_bytes(ctx)
    # every parameter's bf16 gradient, whole (a few 512-byte allocation roundings over)
    assert LLAMA31_8B_PARAMS * 2 <= held < LLAMA31_8B_PARAMS * 2 + 2**20
    # the last micro-batch reduce-scatters them: fp32 shards for the step
    assert LLAMA31_8B_PARAMS * 4 // 8 <= gradients_at_step_bytes(ctx) < (
        LLAMA31_8B_PARAMS * 4 // 8 + 2**20)
    assert estimate(scn).terms.gradients == held


def test_sync_each_batch_and_no_accumulation_keep_the_shards() -> None:
    from vramcalc.rank import RankContext
    from vramcalc.terms.gradients import gradients_bytes

    sharded = []
    for kw in ({"grad_accum": 4, "sync_each_batch": True}, {"grad_accum": 1}):
        scn = _hf_fsdp(**kw)
        sharded.append(gradients_bytes(RankContext(scn.model, scn.training, scn.parallel, 0)))
    assert sharded[0] == sharded[1] < LLAMA31_8B_PARAMS * 4 // 8 + 2**20
    accumulating = estimate(_hf_fsdp(grad_accum=4)).peak_allocated_bytes
    # 16 GB of bf16 gradients replace 4 GB of fp32 shards
    assert accumulating - estimate(_hf_fsdp(grad_accum=4, sync_each_batch=True)
                                   ).peak_allocated_bytes > 10 * 10**9


def test_trainer_no_sync_under_fsdp1_holds_the_flat_gradients() -> None:
    from vramcalc.rank import RankContext
    from vramcalc.terms import fsdp1

    for kw, held in (({"grad_accum": 4}, True), ({"grad_accum": 4, "sync_each_batch": True},
                                                 False), ({"grad_accum": 1}, False)):
        scn = _hf_fsdp(fsdp_impl="fsdp1", **kw)
        assert fsdp1.no_sync(RankContext(scn.model, scn.training, scn.parallel, 0)) is held


def test_sync_each_batch_is_an_hf_option(capsys) -> None:  # noqa: ANN001
    code = main(["estimate", "--model", "8b", "--framework", "torchtune", "--sync-each-batch"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error:") and "--framework hf" in err
    assert len(err.strip().splitlines()) == 1


def test_trainer_wraps_peft_adapters_in_fsdp1_units_of_their_own() -> None:
    """transformers v4.39.0 trainer.py `_fsdp_qlora_plugin_updates` (5.x distributed/fsdp.py
    `update_fsdp_plugin_peft`) gives a PEFT LoraConfig model PEFT's `fsdp_auto_wrap_policy`
    (each LoRA A and B a unit of its own); v4.38.0's Trainer does not, and accelerate's
    transformer-based policy mixes the adapters into their blocks' flat parameters."""
    from vramcalc.rank import RankContext
    from vramcalc.terms import fsdp1

    def ctx(**kw: object) -> RankContext:
        scn = _hf_fsdp(fsdp_impl="fsdp1", finetune="lora", **kw)
        return RankContext(scn.model, scn.training, scn.parallel, 0)

    assert fsdp1.wrapped_adapters(ctx()) and not fsdp1.mixed_units(ctx())
    assert fsdp1.wrapped_adapters(ctx(transformers_version="4.39.0"))
    assert fsdp1.mixed_units(ctx(transformers_version="4.38.2", attention="eager"))


def test_fsdp1_qlora_under_hf_trainer_counts_as_per_parameter_sharding(capsys) -> None:  # noqa: ANN001
    """A float quant_storage lets FSDP1 flatten the 4-bit blocks; with the adapters in units
    of their own the frozen blocks are resharded after their backward and every trained
    tensor is a flat parameter of its own: FSDP2's bytes."""
    kw = {"finetune": "qlora", "grad_accum": 1}
    one = estimate(_hf_fsdp(fsdp_impl="fsdp1", **kw))
    two = estimate(_hf_fsdp(fsdp_impl="fsdp2", **kw))
    assert one.peak_allocated_bytes == two.peak_allocated_bytes
    for argv, words in ((["--transformers-version", "4.38.2", "--attention", "eager"],
                         "transformers 4.39"), (["--framework", "reference"], "HF Trainer")):
        code = main(["estimate", "--model", "8b", "--gpus", "2xH100", "--framework", "hf",
                     "--fsdp", "full", "--fsdp-impl", "fsdp1", "--finetune", "qlora", *argv])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error:") and words in err


def test_parameter_offload_of_a_peft_run_moves_what_the_device_would_hold() -> None:
    """FSDP offload (FSDP2's policy; FSDP1's CPUOffload under HF Trainer's PEFT wrap) moves
    the sharded parameters as stored and the trained parameters' gradients and optimizer
    states to the host; bitsandbytes' QuantState, module metadata rather than a parameter,
    stays on the device (a frozen base is not 16-bit copies of every parameter)."""
    from vramcalc.offload import host_bytes_per_node
    from vramcalc.rank import RankContext
    from vramcalc.terms.gradients import gradients_at_step_bytes

    kw = {"finetune": "qlora", "grad_accum": 1, "gpus": "2xH100"}
    base = _hf_fsdp(**kw)
    on_gpu = estimate(base)
    shards = gradients_at_step_bytes(RankContext(base.model, base.training, base.parallel, 0))
    for impl in ("fsdp2", "fsdp1"):
        scn = _hf_fsdp(fsdp_impl=impl, offload="params", **kw)
        off = estimate(scn)
        kept = off.subterms.get("weights/nf4_constants", 0)
        assert kept == on_gpu.subterms["weights/nf4_constants"] > 0
        assert off.terms.weights == kept and off.terms.optimizer_states == 0
        host = host_bytes_per_node(RankContext(scn.model, scn.training, scn.parallel, 0), 1, 0)
        moved = on_gpu.terms.weights - kept + on_gpu.terms.optimizer_states + shards
        assert host == moved


def test_fsdp2_forward_holds_the_roots_all_gather_output_at_the_first_block() -> None:
    """torch FSDP2 `FSDPParamGroup.wait_for_unshard` keeps a group's all-gather output until
    the next group's copy-out: at the first block's copy-out the root's output (embedding,
    final norm, head), the block's output and both unsharded copies are alive. The FSDP2
    trace of transformers' Llama-3.2-1B on two ranks peaks there in forward; the analytic
    forward peak equals it."""
    pytest.importorskip("torch")
    from vramcalc.options import build_scenario
    from vramcalc.rank import RankContext
    from vramcalc.terms import comm, fsdp2_moments
    from vramcalc.trace.distributed import run_distributed_trace

    scn = build_scenario({"model": "llama3.2-1b", "gpus": "2xH100", "framework": "hf",
                          "fsdp": "full", "finetune": "lora", "seq_len": 128}).resolved()
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    assert fsdp2_moments.forward_start_outputs_bytes(ctx) == (comm.fsdp_root_bytes(ctx)
                                                     + comm.fsdp_layer_bytes(ctx))
    ana, tra = estimate(scn), run_distributed_trace(scn)
    assert ana.peak_phase == tra.peak_phase == "forward"
    # the analytic moment leaves out the embedding output entering the first block (frozen
    # under LoRA, so nothing saves it): T·h·2 = 524,288 B here, 0.02 % of the peak
    assert 0 <= tra.phases["forward"] - ana.phases["forward"] <= 128 * 2048 * 2 + 4 * 512


@pytest.mark.parametrize("precision", ["bf16", "amp-bf16", "fp32", "bf16-pure"])
@pytest.mark.parametrize("fsdp", ["none", "full"])
def test_a_tied_embedding_gradient_is_summed_as_autograd_sums_it(precision: str,
                                                                 fsdp: str) -> None:
    """The end of backward with a tied embedding: the head's gradient share waits in
    autograd's input buffer and the embedding's is added to it. A new tensor holds the sum
    when the head's share is a view (the transpose of its matmul's output); under autocast
    the cast's backward returns a plain tensor, which torch adds into in place
    (input_buffer.cpp `accumulate`; tests/test_trace.py shows it on real tensors). FSDP2
    sums the unsharded gradients before its reduce-scatter. One V·h copy is 65.5 MB here
    (131 MB fp32); both engines agree within 1 MB, on one GPU and on two FSDP2 ranks."""
    pytest.importorskip("torch")
    from vramcalc.parallel import ParallelConfig
    from vramcalc.scenario import Scenario
    from vramcalc.trace.distributed import trace_any
    from vramcalc.validate import SHAPES

    spec = SHAPES["llama-gqa"].model_copy(update={"tie_word_embeddings": True})
    par = ParallelConfig(dp=2, fsdp="full") if fsdp == "full" else ParallelConfig()
    scn = Scenario(model=spec, training=TrainingConfig(framework="hf", seq_len=128,
                                                       precision=precision), parallel=par)
    ana, tra = estimate(scn), trace_any(scn)
    assert ana.peak_phase == tra.peak_phase == "backward"
    assert abs(ana.phases["backward"] - tra.phases["backward"]) < 10**6
