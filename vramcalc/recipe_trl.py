"""TRL SFT configs (`trl sft --config sft.yaml`: a `model_name_or_path` without
LLaMA-Factory's `stage` / `finetuning_type`), read as vramcalc options under the hf profile
(TRL's SFTTrainer is transformers' Trainer with PEFT).

Read from huggingface/trl f2cd5771 (1.10.0.dev0): trl/scripts/sft.py, trl/trainer/
model_config.py (ModelConfig), sft_config.py and base_config.py (SFTConfig over
TrainingArguments), sft_trainer.py. One YAML holds the keys of all three dataclasses.

| TRL key (default) | option |
|---|---|
| model_name_or_path | model |
| dtype ("float32"), bf16 (`not fp16`), fp16 (False) | precision: float32 under bf16/fp16 autocast amp-bf16 / amp-fp16; bfloat16 (float16) under it bf16-autocast (fp16-autocast); without autocast fp32 or bf16-pure; under DeepSpeed (accelerate runs no autocast) bf16 or fp16 with DeepSpeed's fp32 master; `auto` (the checkpoint's dtype) is taken as bfloat16, which a note says |
| use_peft (False), use_dora, lora_r (16), lora_dropout (0.05), lora_target_modules (PEFT's default for the model type), lora_modules_to_save | finetune lora or dora, lora_rank, lora_dropout, lora_targets, modules_to_save |
| load_in_4bit (False), use_bnb_nested_quant (False), bnb_4bit_quant_type ("nf4"; "fp4" stores the same bytes), bnb_4bit_quant_storage | finetune qlora (qlora_impl bnb), nf4_double_quant, adapters_16bit: TRL casts a 4-bit model's trained parameters to bf16 (`sft_trainer.py`, `_is_quantized_model`); bitsandbytes computes in `dtype`, which must be bfloat16 |
| max_length (1024) | seq_len: samples are cut there and a batch is padded to its longest |
| packing (False), packing_strategy ("bfd"), padding_free (False) | padding-free rows (`packing` with bfd or bfd_split, or `padding_free`): the collator concatenates the batch into one row of up to per_device_train_batch_size × max_length tokens (`DataCollatorForLanguageModeling.torch_call`), so micro_batch_size 1 and seq_len that product; `wrapped` packing without padding_free: rows of exactly max_length |
| per_device_train_batch_size (8), gradient_accumulation_steps (1) | micro_batch_size, grad_accum |
| gradient_checkpointing (True; SFTConfig's own default), gradient_checkpointing_kwargs | recompute full, use_reentrant (transformers 5.x: non-reentrant unless the kwargs say) |
| attn_implementation (transformers' default, SDPA) | attention flash, or eager |
| optim (transformers' default) | hf_optim, or a bitsandbytes optimizer |
| use_liger_kernel, loss_type ("chunked_nll", "nll" with Liger) | liger; trl_chunked_ce unless loss_type is "nll" or Liger runs |
| deepspeed (a JSON path, opened from the cwd) | the DeepSpeed file's keys (vramcalc.check) |
| num_processes (`trl sft` hands it to accelerate launch) | must equal the --gpus count |

`max_seq_length` and `torch_dtype` are the keys of TRL releases before 0.20 and 0.27, which
these defaults do not describe: they are refused with a pointer to the new names. What
changes memory but is not modelled is an error: 8-bit loading, 4-bit loading with a compute
dtype other than bfloat16 (TRL's default `dtype` float32 makes bitsandbytes compute in
fp32), activation offloading, the DFT loss, an accelerate config
file, and FSDP.
"""

from __future__ import annotations

from typing import Any

from vramcalc.errors import InputError, shown
from vramcalc.recipe_files import count, flag
from vramcalc.recipe_hf import trainer_values
from vramcalc.recipe_llamafactory import is_llamafactory_config

_TRL = "TRL config"
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "auto": "bf16"}
_RENAMED = {"max_seq_length": "max_length (TRL 0.20)", "torch_dtype": "dtype (TRL 0.27)"}
# keys that switch on what is not modelled (model_config.py, sft_config.py, TrainingArguments)
_REFUSED = ("load_in_8bit", "activation_offloading",
            "accelerate_config", "fsdp", "fsdp_config", "torch_compile")


def is_trl_config(data: dict[str, Any]) -> bool:
    return "model_name_or_path" in data and not is_llamafactory_config(data)


def _precision(data: dict[str, Any]) -> tuple[str, list[str]]:
    """The precision option of the dtype rules in the module table, and its note."""
    dtype = data.get("dtype") or "float32"
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise InputError(f"{_TRL}: dtype {shown(dtype)} is not one of {', '.join(_DTYPES)}")
    weights = _DTYPES[dtype]
    notes = (["dtype auto loads the checkpoint's own dtype, taken as bfloat16 (give "
              "--precision otherwise)"] if dtype == "auto" else [])
    fp16 = flag(data, "fp16", who=_TRL)
    bf16 = flag({"bf16": not fp16, **data}, "bf16", who=_TRL)  # base_config.py __post_init__
    half = "fp16" if fp16 else "bf16" if bf16 else None
    if data.get("deepspeed") is not None:  # DeepSpeed's engine: 16-bit weights, fp32 master
        return half or "fp32", notes
    if half is None:
        return ("fp32" if weights == "fp32" else "bf16-pure" if weights == "bf16" else "fp16"
                ), notes
    if weights == "fp32":
        return "amp-" + half, notes
    if weights != half:
        raise InputError(f"{_TRL}: dtype {dtype} under {half} autocast is not modelled (load "
                         f"the model in {half} or in float32)")
    return half + "-autocast", notes


def _four_bit(data: dict[str, Any], vals: dict[str, Any]) -> list[str]:
    """load_in_4bit: bitsandbytes 4-bit linears (trl/trainer/utils.py
    `get_quantization_config`: compute dtype = `dtype`, double quantization =
    use_bnb_nested_quant) under PEFT, with the adapters TRL casts to bf16."""
    if not flag(data, "use_peft", who=_TRL):
        raise InputError(f"{_TRL}: load_in_4bit without use_peft trains nothing (transformers' "
                         "Trainer refuses a purely quantized model): add use_peft: true")
    if flag(data, "use_dora", who=_TRL):
        raise InputError(f"{_TRL}: load_in_4bit with use_dora (QDoRA) is not modelled")
    dtype = data.get("dtype") or "float32"
    if dtype != "bfloat16":
        raise InputError(f"{_TRL}: load_in_4bit with dtype {shown(dtype)}: bitsandbytes then "
                         "computes in that dtype beside the bf16 adapters TRL makes, which is "
                         "not modelled; set dtype: bfloat16")
    kind = data.get("bnb_4bit_quant_type", "nf4")
    if kind not in ("nf4", "fp4"):
        raise InputError(f"{_TRL}: bnb_4bit_quant_type {shown(kind)} is not one of nf4, fp4")
    vals["qlora_impl"] = "bnb"
    vals["nf4_double_quant"] = flag(data, "use_bnb_nested_quant", who=_TRL)
    vals["adapters_16bit"] = True
    return ([f"bnb_4bit_quant_type {kind} is stored as nf4 is: 4-bit codes and one absmax "
             "per 64 values"] if kind == "fp4" else [])


def trl_values(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Option values of a TRL SFT config (module table)."""
    for key, new in _RENAMED.items():
        if key in data:
            raise InputError(f"{_TRL}: {key} is an older TRL's key; current releases read {new}")
    vals = trainer_values(data, _TRL, _REFUSED)
    model = vals["model"]
    vals["precision"], notes = _precision(data)
    four_bit = flag(data, "load_in_4bit", who=_TRL)
    if four_bit:
        notes += _four_bit(data, vals)
    if flag(data, "use_peft", who=_TRL):
        vals["finetune"] = ("qlora" if four_bit else "dora" if flag(data, "use_dora", who=_TRL)
                            else "lora")
        vals["lora_rank"] = count(data.get("lora_r", 16), "lora_r", _TRL)
        vals["lora_dropout"] = data.get("lora_dropout", 0.05)
        targets = data.get("lora_target_modules")
        if targets is not None:
            vals["lora_targets"] = targets
        if data.get("lora_modules_to_save"):
            vals["modules_to_save"] = data["lora_modules_to_save"]
    else:
        vals["finetune"] = "full"
    if data.get("max_length", 1024) is not None:  # null: no truncation (--seq-len then)
        vals["seq_len"] = count(data.get("max_length", 1024), "max_length", _TRL)
    vals["micro_batch_size"] = count(data.get("per_device_train_batch_size", 8),
                                     "per_device_train_batch_size", _TRL)
    rows = _rows(data, vals)
    vals["grad_accum"] = count(data.get("gradient_accumulation_steps", 1),
                               "gradient_accumulation_steps", _TRL)
    if flag({"gradient_checkpointing": True, **data}, "gradient_checkpointing", who=_TRL):
        vals["recompute"] = "full"
        kwargs = data.get("gradient_checkpointing_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise InputError(f"{_TRL}: gradient_checkpointing_kwargs must be a mapping")
        if "use_reentrant" in kwargs:
            vals["use_reentrant"] = flag(kwargs, "use_reentrant", who=_TRL)
    else:
        vals["recompute"] = "none"
    attn = data.get("attn_implementation")
    vals["attention"] = "eager" if attn == "eager" else "flash"
    liger = flag(data, "use_liger_kernel", who=_TRL)
    loss = data.get("loss_type", "nll" if liger else "chunked_nll")
    if loss not in ("nll", "chunked_nll"):
        raise InputError(f"{_TRL}: loss_type {shown(loss)} is not modelled (nll, chunked_nll)")
    if liger:
        vals["liger"] = True
    if loss == "chunked_nll":
        vals["trl_chunked_ce"] = True
    if data.get("num_processes") is not None:
        vals["_devices"] = count(data["num_processes"], "num_processes", _TRL)
    notes.insert(0, f"read as a TRL SFT config: {model}, {vals['finetune']}, precision "
                    f"{vals['precision']}; {rows}")
    return vals, notes


def _rows(data: dict[str, Any], vals: dict[str, Any]) -> str:
    """The rows TRL's collator makes (sft_trainer.py: `self.padding_free = args.padding_free
    or (args.packing and args.packing_strategy in {"bfd", "bfd_split"})`), as micro-batch
    and sequence length, and the note that says so."""
    packing = flag(data, "packing", who=_TRL)
    strategy = data.get("packing_strategy", "bfd")
    if packing and strategy not in ("bfd", "bfd_split", "wrapped"):
        raise InputError(f"{_TRL}: packing_strategy {shown(strategy)} is not one of bfd, "
                         "bfd_split, wrapped")
    free = flag(data, "padding_free", who=_TRL) or (packing and strategy != "wrapped")
    length = vals.get("seq_len")
    if (packing or free) and length is None:
        raise InputError(f"{_TRL}: {'packing' if packing else 'padding_free'} with "
                         "max_length null is not modelled: give max_length")
    if free:
        b = vals["micro_batch_size"]
        vals["micro_batch_size"], vals["seq_len"] = 1, b * length
        return (f"padding-free: the batch of {b} is one row of up to {b} x {length} tokens "
                "(full bins; fewer tokens use less)")
    if packing:
        return f"wrapped packing: every row holds max_length {length} tokens"
    return (f"samples cut at max_length {length} (a batch is padded to its longest: "
            "--seq-len to give that)")
