"""LLaMA-Factory training configs (`llamafactory-cli train config.yaml`: a
`model_name_or_path` with `stage` or `finetuning_type`), read as vramcalc options under the
hf profile (LLaMA-Factory trains with transformers' Trainer and PEFT).

Read from hiyouga/LLaMA-Factory ff6d4d12 (0.9.6.dev0; the dtype rules of 0.9.4 and later);
paths are under src/llamafactory/. Supervised fine-tuning (`stage: sft`) only.

| LLaMA-Factory key (default) | option |
|---|---|
| model_name_or_path | model |
| finetuning_type (lora) | finetune lora or full; `quantization_bit: 4` (bnb) makes LoRA QLoRA; `use_dora` DoRA |
| lora_rank (8), lora_dropout (0.0), lora_target (all: every Linear but the head, model_utils/misc.py `find_all_linear_modules`) | lora_rank, lora_dropout, lora_targets |
| double_quantization (True) | nf4_double_quant |
| bf16 / fp16 / pure_bf16 | precision: the weights load in the checkpoint's dtype (model/loader.py `torch_dtype="auto"`) and every trainable parameter is cast to fp32 unless pure_bf16 (model/adapter.py `init_adapter`), under the Trainer's autocast: LoRA and QLoRA bf16-autocast (16-bit base, fp32 adapters), full fine-tuning amp-bf16 (fp32 weights), pure_bf16 bf16-pure; under DeepSpeed (accelerate runs no autocast there) LoRA is bf16, and full fine-tuning with ZeRO-3 casts nothing: bf16 with its fp32 master |
| disable_gradient_checkpointing (False), use_reentrant_gc (True) | recompute full, use_reentrant (model_utils/checkpointing.py `prepare_model_for_training`: on unless disabled, reentrant unless FSDP2) |
| cutoff_len (2048) | seq_len: samples are cut there and a batch is padded to its longest (rounded to 8) |
| per_device_train_batch_size (8, transformers'), gradient_accumulation_steps (1) | micro_batch_size, grad_accum |
| flash_attn (auto: transformers' default; fa2, sdpa; disabled: eager) | attention flash or eager |
| optim (transformers' default) | hf_optim (adamw_torch, adamw_torch_fused, adamw_hf) or optimizer (adamw_bnb_8bit, adamw_8bit, paged_adamw_8bit, paged_adamw_32bit) |
| enable_liger_kernel | liger |
| deepspeed (a JSON path, opened from the cwd) | the DeepSpeed file's keys (vramcalc.check) |

PEFT's `prepare_model_for_kbit_training` is never called (LLaMA-Factory prepares the model
itself), so QLoRA keeps its norms and head in the checkpoint's dtype. What changes memory
but is not modelled is an error: other stages, freeze and OFT tuning, 8-bit quantization,
packing with neat_packing, Unsloth, unsloth-style checkpointing, LLaMA-Factory's own
optimizers (GaLore, APOLLO, BAdam, Adam-mini, Muon), upcast_layernorm and
upcast_lmhead_output.
"""

from __future__ import annotations

from typing import Any

from vramcalc.errors import InputError, shown
from vramcalc.recipe_files import count, flag
from vramcalc.recipe_hf import trainer_values

_LF = "LLaMA-Factory config"
_ATTENTION = {"auto": "flash", "fa2": "flash", "sdpa": "flash", "disabled": "eager"}
# keys that switch on what is not modelled (finetuning_args.py, model_args.py)
_REFUSED = ("use_galore", "use_apollo", "use_badam", "use_adam_mini", "use_muon",
            "use_unsloth", "use_unsloth_gc", "neat_packing", "upcast_layernorm",
            "upcast_lmhead_output", "use_kt")


def is_llamafactory_config(data: dict[str, Any]) -> bool:
    return "model_name_or_path" in data and ("stage" in data or "finetuning_type" in data)


def _precision(data: dict[str, Any], method: str, zero3: bool) -> str:
    """The precision option of the dtype rules in the module table."""
    pure = flag(data, "pure_bf16", who=_LF)
    if pure:
        return "bf16-pure"
    half = "bf16" if flag(data, "bf16", who=_LF) else "fp16" if flag(data, "fp16", who=_LF) \
        else None
    if half is None:
        raise InputError(f"{_LF}: set bf16, fp16 or pure_bf16 (without them the Trainer runs no "
                         "autocast over the checkpoint's 16-bit weights, which vramcalc does "
                         "not model)")
    if method != "full" and data.get("deepspeed") is None:
        return half + "-autocast"  # the 16-bit base and fp32 adapters under autocast
    if method != "full" or zero3:
        return half  # DeepSpeed's 16-bit engine with its fp32 master, no autocast
    return "amp-" + half  # every trainable parameter cast to fp32, under autocast


def llamafactory_values(data: dict[str, Any], zero3: bool) -> tuple[dict[str, Any], list[str]]:
    """Option values of a LLaMA-Factory SFT config (module table); `zero3`: whether its
    DeepSpeed file runs ZeRO stage 3."""
    stage = data.get("stage", "sft")
    if stage != "sft":
        raise InputError(f"{_LF}: stage {shown(stage)} is not modelled (sft only)")
    vals = trainer_values(data, _LF, _REFUSED)
    model = vals["model"]
    ftype = data.get("finetuning_type", "lora")
    if ftype not in ("lora", "full"):
        raise InputError(f"{_LF}: finetuning_type {shown(ftype)} is not modelled (lora or "
                         "full)")
    bits = data.get("quantization_bit")
    if bits is not None and (bits != 4 or data.get("quantization_method", "bnb") != "bnb"):
        raise InputError(f"{_LF}: quantization_bit {shown(bits)} with "
                         f"{data.get('quantization_method', 'bnb')} is not modelled (4-bit "
                         "bitsandbytes)")
    method = "full" if ftype == "full" else "qlora" if bits else (
        "dora" if flag(data, "use_dora", who=_LF) else "lora")
    vals["finetune"] = method
    vals["precision"] = _precision(data, method, zero3 and not bits)
    if method != "full":
        vals["lora_rank"] = count(data.get("lora_rank", 8), "lora_rank", _LF)
        vals["lora_dropout"] = data.get("lora_dropout", 0.0)
        target = data.get("lora_target", "all")
        vals["lora_targets"] = "all-linear" if target == "all" else _targets(target)
        if data.get("additional_target"):
            vals["modules_to_save"] = data["additional_target"]
    if method == "qlora":
        vals["nf4_double_quant"] = flag({"double_quantization": True, **data},
                                        "double_quantization", who=_LF)
    if flag(data, "disable_gradient_checkpointing", who=_LF):
        vals["recompute"] = "none"
    else:
        vals["recompute"] = "full"
        vals["use_reentrant"] = flag({"use_reentrant_gc": True, **data}, "use_reentrant_gc",
                                     who=_LF)
    vals["seq_len"] = count(data.get("cutoff_len", 2048), "cutoff_len", _LF)
    vals["micro_batch_size"] = count(data.get("per_device_train_batch_size", 8),
                                     "per_device_train_batch_size", _LF)
    vals["grad_accum"] = count(data.get("gradient_accumulation_steps", 1),
                               "gradient_accumulation_steps", _LF)
    attn = data.get("flash_attn", "auto")
    if not isinstance(attn, str) or attn not in _ATTENTION:
        raise InputError(f"{_LF}: flash_attn {shown(attn)} is not modelled "
                         f"({', '.join(_ATTENTION)})")
    vals["attention"] = _ATTENTION[attn]
    if flag(data, "enable_liger_kernel", who=_LF):
        vals["liger"] = True
    notes = [f"read as a LLaMA-Factory config: {model}, {method}, precision "
             f"{vals['precision']}; samples cut at cutoff_len {vals['seq_len']} (a batch is "
             "padded to its longest: --seq-len to give that)"]
    return vals, notes


def _targets(target: Any) -> str:
    """LLaMA-Factory's comma-separated module names as vramcalc's targets."""
    names = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate",
             "up_proj": "up", "down_proj": "down"}
    parts = [p.strip() for p in str(target).split(",") if p.strip()]
    if not parts or any(p not in names for p in parts):
        raise InputError(f"{_LF}: lora_target {shown(target)} is not modelled (all, or "
                         f"{', '.join(names)})")
    return ",".join(names[p] for p in parts)
