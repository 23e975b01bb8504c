"""The hf profile's stack options (HF Trainer + accelerate + PEFT) and what each can express.

| option | what the stack does | source |
|---|---|---|
| `hf_optim` | TrainingArguments.optim for AdamW: torch foreach, fused, or transformers' own loop | transformers training_args.py `default_optim`, optimization.py `AdamW` |
| `use_reentrant` | HF gradient checkpointing's `use_reentrant` | modeling_utils.py `gradient_checkpointing_enable` |
| `kbit_prepare` | PEFT's `prepare_model_for_kbit_training` | peft utils/other.py |
| `modules_to_save` | PEFT's trained module copies | peft utils/other.py `ModulesToSaveWrapper` |
| `lora_embedding` | PEFT's `lora.Embedding` on embed_tokens | peft tuners/lora/layer.py `Embedding` |
| `lora_head` | PEFT's `lora.Linear` on lm_head | peft tuners/lora/layer.py `Linear` |
| `liger` | `TrainingArguments(use_liger_kernel=True)`: Liger's RMSNorm, SwiGLU, RoPE and fused linear cross entropy | transformers integrations/liger.py; vramcalc/terms/liger.py |
| `sync_each_batch` | accelerate's `GradientAccumulationPlugin(sync_each_batch=True)`: no `no_sync()` between micro-batches | transformers trainer.py `_inner_training_loop`, accelerate accelerator.py `no_sync` |
| `transformers_version` | the causal-LM loss of that release (before 4.46 the model's forward upcasts lm_head's output and returns the fp32 logits; before 4.49 the loss keeps its fp32 upcast and makes a contiguous copy of the shifted logits) and its defaults: the Trainer's AdamW (adamw_hf before 4.32, adamw_torch before 4.54) and reentrant gradient checkpointing (before 5.0) | transformers v4.31.0-v4.45.0 modeling_llama.py (and the families in `FORWARD_UPCAST_FROM`), v4.46.0 loss/loss_utils.py `ForCausalLMLoss`, v4.49.0 pads the labels; training_args.py `default_optim`; modeling_utils.py `gradient_checkpointing_enable` |

`hf_stack_problem(training)` says, in one line, why a combination cannot be expressed (None:
it can); vramcalc.training.TrainingConfig raises it as a validation error. docs/methodology.md
§20 gives the memory each option changes.
"""

from __future__ import annotations

from typing import Any

from vramcalc.errors import InputError, suggest
from vramcalc.qlora import parse_version

# HF Trainer's AdamW choices (transformers TrainingArguments.optim, OptimizerNames) and the
# step each runs: torch.optim.AdamW with foreach (adamw_torch) or fused=True
# (adamw_torch_fused), or transformers' own AdamW (adamw_hf, transformers.optimization.AdamW
# until its removal in 5.x): a Python loop over the parameters ("hf-loop"). The Trainer's
# default: adamw_hf before transformers 4.32 (v4.31.0 training_args.py `default_optim`),
# adamw_torch from 4.32 (huggingface/transformers#25109), adamw_torch_fused from 4.54 with
# torch >= 2.8 (#37358; v4.54.0 training_args.py `is_torch_greater_or_equal_than_2_8`).
HF_OPTIMS: dict[str, str] = {"adamw_torch": "foreach", "adamw_torch_fused": "fused",
                             "adamw_hf": "hf-loop"}
# PEFT's modules_to_save names vramcalc models: the token embedding and the output head
MODULES_TO_SAVE: tuple[str, ...] = ("embed_tokens", "lm_head")


def parse_modules_to_save(value: object) -> str:
    """'lm_head', 'embed_tokens,lm_head', a list, '' or 'none' -> canonical
    'embed_tokens,lm_head' order. Unknown names raise InputError with suggestions."""
    if value is None:
        return ""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    names: set[str] = set()
    for raw in items:
        word = str(raw).strip().lower()
        if word in ("", "none"):
            continue
        if word not in MODULES_TO_SAVE:
            raise InputError(f"--modules-to-save: unknown module {raw!r}"
                             f"{suggest(word, list(MODULES_TO_SAVE))} (choices: "
                             f"{', '.join(MODULES_TO_SAVE)})")
        names.add(word)
    return ",".join(m for m in MODULES_TO_SAVE if m in names)


def _reentrant(tr: Any) -> str | None:
    if tr.use_reentrant is not None and (tr.framework != "hf" or tr.recompute != "full"):
        return (f"--{'' if tr.use_reentrant else 'no-'}use-reentrant: HF's gradient "
                "checkpointing (--framework hf with --recompute full)")
    return None


def _kbit_prepare(tr: Any) -> str | None:
    if not tr.kbit_prepare:
        return None
    flag = None
    if tr.framework != "hf" or tr.finetune != "qlora":
        flag = "needs --framework hf and --finetune qlora (a 4-bit model wrapped by PEFT)"
    elif tr.weight_dtype != "fp32":
        flag = (f"casts every parameter that is not 4-bit to fp32, which --precision "
                f"{tr.precision} does not keep: use --precision amp-bf16 (HF Trainer's "
                "bf16=True) or amp-fp16 or fp32")
    elif tr.recompute != "full":
        flag = ("turns on HF gradient checkpointing (use_gradient_checkpointing=True, its "
                "default): give --recompute full")
    return f"--kbit-prepare (PEFT prepare_model_for_kbit_training) {flag}" if flag else None


def _hf_optim(tr: Any) -> str | None:
    if tr.hf_optim is None:
        return ("optimizer_impl hf-loop: give --hf-optim adamw_hf"
                if tr.optimizer_impl == "hf-loop" else None)
    given = f"--hf-optim {tr.hf_optim}"
    if tr.framework != "hf":
        return f"{given}: HF Trainer's optimizer names need --framework hf"
    if tr.optimizer != "adamw":
        return f"{given}: names an AdamW; it cannot go with --optimizer {tr.optimizer}"
    if tr.optimizer_impl not in (None, HF_OPTIMS[tr.hf_optim]):
        return (f"{given} steps {HF_OPTIMS[tr.hf_optim]}; it cannot go with "
                f"--optimizer-impl {tr.optimizer_impl}")
    return None


def _peft_modules(tr: Any) -> str | None:
    if tr.lora_embedding:
        if tr.framework != "hf" or tr.finetune not in ("lora", "qlora"):
            return ("--lora-embedding (PEFT's lora.Embedding on embed_tokens) needs "
                    "--framework hf and --finetune lora or qlora")
        if "embed_tokens" in tr.modules_to_save:
            return ("--lora-embedding with --modules-to-save embed_tokens: PEFT adapts a "
                    "module or copies it, not both")
    if tr.lora_head:
        if tr.framework != "hf" or tr.finetune not in ("lora", "qlora"):
            return ("--lora-head (PEFT's lora.Linear on lm_head) needs --framework hf and "
                    "--finetune lora or qlora")
        if "lm_head" in tr.modules_to_save:
            return ("--lora-head with --modules-to-save lm_head: PEFT adapts a module or "
                    "copies it, not both")
        if tr.chunked_ce > 1:
            return "--lora-head with --chunked-ce: the chunked head is not modelled with it"
    if not tr.modules_to_save:
        return None
    flag = None
    if tr.framework != "hf" or tr.finetune == "full":
        flag = "needs --framework hf and a PEFT method (--finetune lora, qlora or dora)"
    elif tr.weight_dtype != "fp32":
        flag = (f"under --precision {tr.precision} the copy would train in {tr.weight_dtype} "
                "beside fp32 adapters (PEFT does not upcast it), which is not modelled: use "
                "--precision amp-bf16, amp-fp16 or fp32")
    return f"--modules-to-save {tr.modules_to_save} {flag}" if flag else None


def _adapters_16bit(tr: Any) -> str | None:
    """Adapters kept in the model's 16-bit dtype (PEFT autocast_adapter_dtype=False, TRL's
    cast of a 4-bit model's trained parameters)."""
    if not tr.adapters_16bit:
        return None
    flag = "--adapters-16bit (adapters in the model's 16-bit dtype)"
    if tr.framework != "hf" or tr.finetune not in ("lora", "qlora", "dora"):
        return f"{flag} needs --framework hf and --finetune lora, qlora or dora"
    if tr.weight_dtype not in ("bf16", "fp16"):
        return (f"{flag}: under --precision {tr.precision} the model is fp32, and so are the "
                "adapters PEFT makes for it; use a 16-bit precision (bf16-autocast, bf16-pure)")
    if tr.finetune == "qlora" and tr.weight_dtype != "bf16":
        # PEFT makes a 4-bit linear's adapters in fp32 (`_move_adapter_to_device_of_base_layer`
        # moves, but casts only to a float weight's dtype); TRL casts them to bf16
        return (f"{flag} with --finetune qlora: TRL casts a 4-bit model's adapters to bf16, "
                f"beside {tr.weight_dtype} weights here, which is not modelled; use a bf16 "
                "precision")
    if tr.precision == "fp16-autocast":
        # torch/amp/grad_scaler.py `_unscale_grads_`: "Attempting to unscale FP16 gradients."
        return (f"{flag} with --precision fp16-autocast: the Trainer's GradScaler refuses to "
                "unscale fp16 gradients, so this run stops at its first step")
    return None


def _autocast_16bit(tr: Any) -> str | None:
    """HF Trainer's `bf16=True` / `fp16=True` over a model loaded in 16 bits."""
    if not tr.autocast_16bit:
        return None
    if tr.framework != "hf":
        return (f"--precision {tr.precision} is HF Trainer's autocast over a model loaded in "
                "16 bits: it needs --framework hf (16-bit weights without autocast: "
                "--precision bf16-pure or fp16)")
    if tr.precision == "fp16-autocast" and tr.finetune == "full":
        # torch/amp/grad_scaler.py `_unscale_grads_`: "Attempting to unscale FP16 gradients."
        return ("--precision fp16-autocast with --finetune full: the Trainer's GradScaler "
                "refuses to unscale fp16 gradients, so this run stops at its first step; "
                "full fine-tuning under fp16=True needs fp32 weights (--precision amp-fp16)")
    return None


# TRL 1.x requires transformers >= 4.56.2 (huggingface/trl f2cd5771 pyproject.toml)
TRL_TRANSFORMERS_FROM = (4, 56, 2)


def _trl_chunked(tr: Any) -> str | None:
    """TRL SFTTrainer's chunked_nll (vramcalc/terms/trl_loss.py): what it refuses itself
    (trl/trainer/sft_trainer.py: with use_liger_kernel, with a PEFT adapter on lm_head) and
    what is not modelled with it."""
    if not tr.trl_chunked_ce:
        return None
    flag = "--trl-chunked-ce (TRL SFTTrainer's chunked_nll loss)"
    if tr.framework != "hf":
        return f"{flag} needs --framework hf"
    if tr.liger or tr.lora_head:
        return (f"{flag} with {'--liger' if tr.liger else '--lora-head'}: TRL refuses "
                "chunked_nll with use_liger_kernel and with an adapter on lm_head (its loss_type "
                "'nll' runs instead: leave --trl-chunked-ce out)")
    clash = ("--chunked-ce" if tr.chunked_ce > 1 else "--modules-to-save lm_head"
             if "lm_head" in tr.modules_to_save else "--quantize-head" if tr.quantize_head
             else None)
    if clash:
        return f"{flag} with {clash} is not modelled"
    if tr.transformers_version and parse_version(tr.transformers_version) < TRL_TRANSFORMERS_FROM:
        return (f"{flag} with --transformers-version {tr.transformers_version}: TRL's chunked "
                "loss needs transformers 4.56.2 or later")
    return None


def trl_chunked_problem(spec: Any, tr: Any, engine: str, zero: int) -> str | None:
    """Why TRL's chunked loss cannot be modelled for this model and layout, or None: causal
    LMs without logit scaling or soft-capping (which add chunk-sized tensors), one GPU, DDP
    or ZeRO-1/2 (FSDP2 gathers the head once with `full_tensor`, ZeRO-3 per chunk)."""
    if not tr.trl_chunked_ce:
        return None
    if spec.is_encoder or spec.is_encoder_decoder or spec.task != "causal_lm":
        return f"--trl-chunked-ce: TRL's chunked loss is a causal LM's; {spec.name} is not one"
    if spec.model_type in ("gemma2", "gemma3_text", "cohere", "cohere2"):
        return (f"--trl-chunked-ce with {spec.model_type}: its logit scaling or soft-capping "
                "adds tensors to each chunk, which is not modelled")
    if engine == "fsdp2" or zero >= 3:
        return ("--trl-chunked-ce with ZeRO-3 or FSDP: TRL gathers the sharded head for the "
                "chunks, which is not modelled; use DDP or ZeRO-1/2")
    return None


def autocast_model_problem(spec: Any, tr: Any) -> str | None:
    """Why a 16-bit model under the Trainer's autocast cannot be modelled for this model
    (`spec`: a vramcalc.model.ModelSpec), or None. transformers' RMSNorms upcast to fp32
    themselves and return the weight's dtype, so a 16-bit layer computes as it would
    without autocast; nn.LayerNorm and NewGELU's pow are on CUDA autocast's fp32 list, so a
    LayerNorm model keeps fp32 copies (norm inputs, GELU products) in a 16-bit residual
    stream, which is not modelled."""
    if not tr.autocast_16bit:
        return None
    if (spec.is_encoder or spec.is_encoder_decoder or spec.norm_kind != "rmsnorm"
            or spec.hidden_act in ("gelu_new", "relu2")):
        return (f"--precision {tr.precision} is modelled for RMSNorm decoders (Llama, "
                f"Mistral, Qwen, Gemma, ...): {spec.name}'s LayerNorms or GELU run in fp32 "
                "under autocast; use --precision amp-bf16 (an fp32 model) or bf16-pure")
    return None


def autocast_layout_problem(tr: Any, engine: str) -> str | None:
    """Why a 16-bit model under the Trainer's autocast cannot be modelled on this layout
    (`engine`: vramcalc.parallel.Engine), or None."""
    if not tr.autocast_16bit or engine in ("single", "ddp"):
        return None
    if engine == "deepspeed":  # accelerate 1.12.0 accelerator.py: native_amp off under DeepSpeed
        return (f"--precision {tr.precision} with DeepSpeed: the Trainer does not autocast "
                "under DeepSpeed, whose engine holds 16-bit weights and fp32 masters: use "
                "--precision bf16 (or fp16)")
    return (f"--precision {tr.precision} is modelled on one GPU and under DDP; FSDP's mixed "
            "precision casts the fp32 adapters to 16 bits itself (use --precision amp-bf16 "
            "for an fp32 model under FSDP)")


def _sync_each_batch(tr: Any) -> str | None:
    if tr.sync_each_batch and tr.framework != "hf":
        return ("--sync-each-batch (accelerate's GradientAccumulationPlugin option) needs "
                "--framework hf")
    return None


def _liger(tr: Any) -> str | None:
    if not tr.liger:
        return None
    if tr.framework != "hf":
        return "--liger (HF Trainer's use_liger_kernel) needs --framework hf"
    clash = "--chunked-ce" if tr.chunked_ce > 1 else _head_option(tr)
    if clash:
        return (f"--liger with {clash}: Liger's fused linear cross entropy reads lm_head's "
                "weight itself; that combination is not modelled")
    return None


def _head_option(tr: Any) -> str | None:
    """The option that makes lm_head other than a plain linear (None: none does)."""
    return ("--lora-head" if tr.lora_head else "--modules-to-save lm_head"
            if "lm_head" in tr.modules_to_save else "--quantize-head" if tr.quantize_head
            else None)


def hf_stack_problem(tr: Any) -> str | None:
    """Why these training settings (a vramcalc.training.TrainingConfig) use an hf-stack
    option the model cannot express (None: they can)."""
    for check in (_reentrant, _kbit_prepare, _hf_optim, _peft_modules, _sync_each_batch,
                  _liger, _transformers_version, _autocast_16bit, _adapters_16bit,
                  _trl_chunked):
        problem = check(tr)
        if problem:
            return problem
    return None


# the transformers releases whose causal-LM loss vramcalc models: from 4.46 every decoder
# calls the shared `loss_utils.ForCausalLMLoss`; 4.49 stopped copying the shifted logits
# (huggingface/transformers v4.48.0 vs v4.49.0 loss/loss_utils.py). Before 4.46 each
# model's forward computed its own loss; the families below did it as 4.46 does, after an
# fp32 upcast that the forward returns as `outputs.logits`: `logits = self.lm_head(
# hidden_states)`, `logits = logits.float()`, `shift_logits = logits[..., :-1, :]
# .contiguous()`, `shift_labels = labels[..., 1:].contiguous()`, CrossEntropyLoss. The
# release each family first did so (the wheels of 4.28-4.45 read one by one: llama from
# v4.31.0, absent in v4.30.0; gemma from v4.39.0, absent in v4.38.0; phi3 from v4.41.0,
# absent in v4.40.0; the others from the release that added them). Other model types, and
# these before their release, ran cross entropy on the logits' own dtype: not modelled.
SHARED_LOSS_FROM = (4, 46, 0)
PADDED_LABELS_FROM = (4, 49, 0)
FORWARD_UPCAST_FROM: dict[str, tuple[int, int, int]] = {
    "llama": (4, 31, 0), "mistral": (4, 34, 0), "mixtral": (4, 36, 0), "qwen2": (4, 37, 0),
    "gemma": (4, 39, 0), "qwen2_moe": (4, 40, 0), "phi3": (4, 41, 0)}
OLDEST_RELEASE = min(FORWARD_UPCAST_FROM.values())
# v4.34.0 modeling_llama.py has `flash_attn_func` (use_flash_attention_2), v4.31.0 neither it
# nor `scaled_dot_product_attention` (SDPA from v4.36.0)
FUSED_ATTENTION_FROM = (4, 34, 0)


def _transformers_version(tr: Any) -> str | None:
    if tr.transformers_version is None:
        return None
    given = f"--transformers-version {tr.transformers_version}"
    if tr.framework != "hf":
        return f"{given}: the transformers release of an HF Trainer run needs --framework hf"
    if parse_version(tr.transformers_version) >= SHARED_LOSS_FROM:
        return None
    if parse_version(tr.transformers_version) < OLDEST_RELEASE:
        return (f"{given}: before 4.31 each model's forward ran its loss on logits in their "
                "own dtype, which is not modelled; give 4.31 or later")
    if tr.attention == "flash" and parse_version(tr.transformers_version) < FUSED_ATTENTION_FROM:
        return (f"{given} with --attention flash: transformers' models gained FlashAttention-2 "
                "in 4.34 (and SDPA in 4.36); before, they ran eager attention: give "
                "--attention eager")
    clash = "--liger" if tr.liger else _head_option(tr)
    if clash:
        return (f"{given} with {clash}: the forward's own fp32 upcast of lm_head's output is "
                "modelled for a plain lm_head only; give 4.46 or later")
    return None


def release_model_problem(spec: Any, tr: Any) -> str | None:
    """Why an hf run's transformers release before 4.46 cannot be modelled for this model
    (`spec`: a vramcalc.model.ModelSpec), or None: its forward must compute the loss after
    an fp32 upcast (FORWARD_UPCAST_FROM)."""
    if tr.framework != "hf" or not loss_in_forward(tr):
        return None
    since = FORWARD_UPCAST_FROM.get(spec.model_type)
    if since is not None and parse_version(tr.transformers_version) >= since:
        return None
    given = f"--transformers-version {tr.transformers_version}"
    if since is None:
        known = ", ".join(FORWARD_UPCAST_FROM)
        return (f"{given}: before 4.46 each model's forward computed its own loss; that of "
                f"model_type '{spec.model_type}' is not modelled (modelled: {known}); give "
                "4.46 or later")
    first = ".".join(map(str, since[:2]))
    return (f"{given}: model_type '{spec.model_type}' is modelled from transformers {first}, "
            "the first release whose forward upcasts its logits before the loss (or that has "
            f"the model); give {first} or later")


def gpt2_shaped(spec: Any) -> bool:
    """Whether a LayerNorm / learned-position / 2-matrix-MLP decoder has GPT-2's shape, the
    only such architecture the hf profile builds (GPT2Config, vramcalc/trace/hf_models.py)."""
    return (spec.norm_kind == "layernorm" and spec.norm_bias and spec.position_embedding
            == "learned" and spec.mlp_kind == "standard" and spec.attention_bias
            and spec.attention_out_bias and spec.mlp_bias and spec.tie_word_embeddings
            and spec.kv_heads == spec.num_attention_heads and spec.final_norm
            and spec.head_size * spec.num_attention_heads == spec.hidden_size
            and not spec.is_moe and not spec.qk_norm)


def layernorm_model_problem(spec: Any, tr: Any) -> str | None:
    """Why the hf profile cannot model this decoder (None: it can): its LayerNorm decoders
    are GPT-2's shape; any other (Nemotron's, GPT-NeoX's) would be counted as GPT-2."""
    if tr.framework != "hf" or spec.is_encoder or spec.is_encoder_decoder or (
            spec.parallel_residual):  # refused with its own reason (vramcalc/scenario.py)
        return None
    if (spec.norm_kind == "layernorm" or spec.position_embedding == "learned"
            or spec.mlp_kind == "standard") and not gpt2_shaped(spec):
        return (f"{spec.name}: the hf profile models LayerNorm and 2-matrix-MLP decoders "
                "with GPT-2's shape only; use --framework reference")
    return None


# transformers' defaults that changed with the release (`--transformers-version`): the
# Trainer's optimizer, adamw_torch from 4.32 to 4.53 and adamw_torch_fused from 4.54
# (training_args.py `default_optim`; v4.46.0 and v4.50.0 set "adamw_torch"), and
# gradient_checkpointing_enable's kwargs, {"use_reentrant": True} before 5.0 (v4.46.0 and
# v4.50.0 modeling_utils.py), {"use_reentrant": False} from 5.0
FUSED_OPTIM_FROM = (4, 54, 0)
TORCH_OPTIM_FROM = (4, 32, 0)  # v4.31.0 training_args.py: default_optim = "adamw_hf"
NON_REENTRANT_FROM = (5, 0, 0)


def trainer_defaults(tr: Any) -> tuple[str, bool]:
    """HF Trainer's defaults for the run's transformers release (5.x when unset): its AdamW
    (an HF_OPTIMS key) and whether gradient checkpointing is reentrant."""
    v = parse_version(tr.transformers_version) if tr.transformers_version else (5, 0, 0)
    optim = ("adamw_hf" if v < TORCH_OPTIM_FROM else "adamw_torch" if v < FUSED_OPTIM_FROM
             else "adamw_torch_fused")
    return optim, v < NON_REENTRANT_FROM


def copies_shifted_logits(tr: Any) -> bool:
    """transformers 4.46-4.48 `ForCausalLMLoss` (v4.46.0 loss/loss_utils.py): `logits =
    logits.float()` stays bound while `shift_logits = logits[..., :-1, :].contiguous()`
    makes an fp32 copy of b·(s-1) positions, which cross_entropy reads; the labels are
    sliced the same way (`labels[..., 1:].contiguous()`). From 4.49 the labels are padded
    by one position and the upcast logits go to cross_entropy as they are. Liger's fused
    loss replaces the function (`tr`: a vramcalc.training.TrainingConfig)."""
    return (tr.framework == "hf" and tr.transformers_version is not None and not tr.liger
            and parse_version(tr.transformers_version) < PADDED_LABELS_FROM)


def loss_in_forward(tr: Any) -> bool:
    """transformers before 4.46: the model's forward upcasts lm_head's output
    (`logits = logits.float()`), so the compute-dtype logits are freed at once and the fp32
    logits are the model output, held until the Trainer's `compute_loss` returns; the loss
    then runs as 4.46-4.48's does (`copies_shifted_logits`). FORWARD_UPCAST_FROM names the
    families and releases (`tr`: a vramcalc.training.TrainingConfig)."""
    return (tr.framework == "hf" and tr.transformers_version is not None and not tr.liger
            and parse_version(tr.transformers_version) < SHARED_LOSS_FROM)


# transformers v4.39.0 trainer.py `_fsdp_qlora_plugin_updates` (5.x distributed/fsdp.py
# `update_fsdp_plugin_peft`): under FSDP a PEFT model with a LoraConfig gets PEFT's
# `fsdp_auto_wrap_policy` (peft utils/other.py: every leaf module whose weight requires grad,
# each LoRA A and B, is a unit of its own beside the transformer blocks); before, accelerate's
# transformer-based policy put the adapters in their blocks' units (absent from v4.38.0)
PEFT_WRAP_FROM = (4, 39, 0)


def trainer_wraps_adapters(tr: Any) -> bool:
    """Whether HF Trainer wraps LoRA/QLoRA/DoRA adapters in FSDP units of their own."""
    return (tr.framework == "hf" and tr.finetune in ("lora", "qlora", "dora")
            and (tr.transformers_version is None
                 or parse_version(tr.transformers_version) >= PEFT_WRAP_FROM))


def trainer_no_sync(tr: Any, parallel: Any) -> bool:
    """Whether HF Trainer accumulates FSDP gradients unsharded across micro-batches.

    transformers trainer.py `_inner_training_loop` (5.x; 4.46+ alike) runs every micro-batch
    of an accumulation window but the last inside `accelerator.no_sync(model)` unless
    `sync_each_batch` is set (DeepSpeed excepted); accelerate accelerator.py `no_sync` turns
    FSDP2's `set_requires_gradient_sync(False)` on, or enters FSDP1's
    `FullyShardedDataParallel.no_sync()`. Either keeps each unsharded gradient until the
    last micro-batch's backward reduce-scatters it (`tr`, `parallel`: the training and
    parallel configs)."""
    return reduces_once(tr, parallel.fsdp, tr.grad_accum)


def reduces_once(tr: Any, fsdp: str, grad_accum: int) -> bool:
    """`trainer_no_sync` for an --fsdp value and a number of micro-batches per step (the
    planner's candidates)."""
    return (tr.framework == "hf" and fsdp != "none" and grad_accum > 1
            and not tr.sync_each_batch)

