"""What the configs of HF-Trainer-based stacks share (LLaMA-Factory: vramcalc/recipe_
llamafactory.py; TRL: vramcalc/recipe_trl.py): the model, TrainingArguments' `optim` and
`deepspeed`, and the refusal of keys that switch on what is not modelled."""

from __future__ import annotations

from typing import Any

from vramcalc.errors import InputError, shown

# transformers' AdamW choices (vramcalc.hf_stack.HF_OPTIMS) and bitsandbytes' optimizers
HF_OPTIM = ("adamw_torch", "adamw_torch_fused", "adamw_hf")
BNB_OPTIM = {"adamw_bnb_8bit": "adamw-8bit", "adamw_8bit": "adamw-8bit",
             "paged_adamw_8bit": "paged-adamw-8bit", "paged_adamw_32bit": "paged-adamw"}


def trainer_values(data: dict[str, Any], who: str, refused: tuple[str, ...]
                   ) -> dict[str, Any]:
    """The hf profile, `model_name_or_path`, `optim` and `deepspeed` as option values;
    InputError for a true value of a `refused` key."""
    for key in refused:
        if data.get(key):
            raise InputError(f"{who}: {key} is not modelled")
    model = data.get("model_name_or_path")
    if not isinstance(model, str) or not model:
        raise InputError(f"{who}: model_name_or_path must be a name or path, got "
                         f"{shown(model)}")
    vals: dict[str, Any] = {"framework": "hf", "model": model}
    optim = data.get("optim")
    if optim in HF_OPTIM:
        vals["hf_optim"] = optim
    elif isinstance(optim, str) and optim in BNB_OPTIM:
        vals["optimizer"] = BNB_OPTIM[optim]
    elif optim is not None:
        raise InputError(f"{who}: optim {shown(optim)} is not modelled")
    if data.get("deepspeed") is not None:
        vals["deepspeed"] = data["deepspeed"]
    return vals
