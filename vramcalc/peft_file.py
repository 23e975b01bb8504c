"""`--peft-config FILE`: any PEFT method, as PEFT itself builds it.

The file is a PEFT adapter config: the `adapter_config.json` that `save_pretrained` writes
(a folder holding one may be given), or any JSON object with PEFT's `peft_type` and that
method's fields. Only the trace engine measures it: `vramcalc trace` runs transformers'
model with PEFT's `get_peft_model(model, PeftConfig.from_peft_type(**config))` under
FakeTensorMode (vramcalc/trace/lora.py `peft_from_file`), so IA3, prompt and prefix tuning,
LoHa, LoKr, OFT, VeRA and every other method PEFT has are counted by PEFT's own modules.
The analytic engine models --finetune lora | qlora | dora and refuses this one.

This module reads and checks the file at the input boundary (no torch, no peft).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vramcalc.errors import InputError, shown_path
from vramcalc.safeio import path_kind, read_json, user_path

FLAG = "--peft-config"
CONFIG_NAME = "adapter_config.json"  # PEFT's CONFIG_NAME (peft/utils/constants.py)


def peft_config_path(text: str) -> Path:
    """The config file `text` names (a folder: its adapter_config.json)."""
    path = user_path(text, FLAG)
    return path / CONFIG_NAME if path_kind(path) == "dir" else path


def read_peft_config(text: str) -> dict[str, Any]:
    """The config as a dict; InputError unless it is a JSON object with a `peft_type`."""
    path = peft_config_path(text)
    doc = read_json(path, FLAG)
    if not isinstance(doc, dict):
        raise InputError(f"{FLAG} {shown_path(path)}: expected a JSON object (a PEFT "
                         f"adapter config), got {type(doc).__name__}")
    kind = doc.get("peft_type")
    if not isinstance(kind, str) or not kind.strip():
        raise InputError(f"{FLAG} {shown_path(path)}: no \"peft_type\" (PEFT's method name, "
                         "such as \"LORA\" or \"IA3\"): not a PEFT adapter config")
    return doc


def checked_peft_config(raw: object) -> str:
    """The --peft-config value, once its file is read and checked (the option's parser)."""
    read_peft_config(str(raw))
    return str(raw)


def peft_type_of(text: str | None) -> str:
    """The config's PEFT method name ("?" when it cannot be read again)."""
    try:
        return str(read_peft_config(text or "")["peft_type"])
    except InputError:
        return "?"


def analytic_refusal() -> InputError:
    """The error every analytic command gives for --finetune peft."""
    return InputError(f"{FLAG} (--finetune peft): PEFT's own adapters are measured by the "
                      "trace engine: run `vramcalc trace` with the same flags (the analytic "
                      "engine models --finetune lora, qlora and dora)")
