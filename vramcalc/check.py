"""`vramcalc check`: a training config file (and optionally a DeepSpeed JSON) → one estimate.

Config file: a YAML mapping whose keys are the CLI option names in snake_case (the table
in vramcalc.options: `model`, `gpus`, `seq_len`, `micro_batch_size`, `precision`,
`optimizer`, `zero`, `tp`, …, `headroom`) plus `deepspeed` (a DeepSpeed JSON path,
relative to the config file). Unknown keys are errors, with a suggestion.

DeepSpeed JSON: the ZeRO, offload, batch and precision settings are read as options
(`deepspeed_values`), and the keys that change memory (buckets, ZeRO-3 fetching,
activation checkpointing) as the scenario's DeepSpeedConfig (vramcalc.ds_json):

| DeepSpeed key | option |
|---|---|
| zero_optimization.stage | zero |
| zero_optimization.offload_optimizer.device (cpu / nvme) | offload optimizer, offload_device |
| zero_optimization.offload_param.device (cpu / nvme) | offload params, offload_device |
| zero_optimization.cpu_offload (old form) | offload optimizer |
| train_micro_batch_size_per_gpu | micro_batch_size |
| gradient_accumulation_steps | grad_accum |
| train_batch_size | checked against micro × accumulation × dp (or used to derive one) |
| bf16.enabled / fp16.enabled | precision bf16 / fp16 |
| optimizer.type (Adam, AdamW, Lion, SGD) | optimizer |

Values "auto" (the Hugging Face Trainer integration fills them in) are skipped with a note
(the hidden-size ones of vramcalc.ds_json are filled as transformers does).
Precedence: command-line flags, then the YAML config, then the DeepSpeed file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import vramcalc.safeio as safeio
from vramcalc.analytic import estimate
from vramcalc.catalog import resolve_model
from vramcalc.ds_config import DeepSpeedConfig
from vramcalc.ds_json import deepspeed_settings, scenario_notes
from vramcalc.errors import InputError, shown, suggest
from vramcalc.evidence import evidence_json
from vramcalc.options import OPTIONS_BY_NAME, build_scenario, normalize_values
from vramcalc.recipe_files import (
    is_litgpt_config,
    is_torchtune_config,
    litgpt_values,
    recipe_defaults,
    torchtune_values,
)
from vramcalc.recipe_llamafactory import is_llamafactory_config, llamafactory_values
from vramcalc.recipe_trl import is_trl_config, trl_values
from vramcalc.report import MemoryReport
from vramcalc.scenario import Scenario

DEFAULT_CHECK_HEADROOM = 0.05  # same default as `vramcalc plan`
CONFIG_EXTRA_KEYS = ("deepspeed",)
_DS_OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "fusedadam": "adamw", "cpuadam": "adamw",
                  "lion": "lion", "sgd": "sgd"}


@dataclass
class CheckResult:
    """The estimate of one config and its verdict."""

    report: MemoryReport
    usable_bytes: int
    headroom_fraction: float
    notes: list[str] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)  # the option values checked

    @property
    def fits(self) -> bool:
        return bool(self.report.fits)

    def to_json(self) -> dict[str, Any]:
        return {"fits": self.fits, "device_total_bytes": self.report.device_total_bytes,
                "usable_bytes": self.usable_bytes, "headroom_fraction": self.headroom_fraction,
                "over_bytes": max(self.report.device_total_bytes - self.usable_bytes, 0),
                "notes": self.notes,
                "evidence": evidence_json(str(self.report.strategy.get("framework", "reference")),
                                          self.report.device_total_bytes,
                                          self.usable_bytes - self.report.device_total_bytes),
                "report": self.report.to_json_dict()}


def read_config_file(path: Path) -> tuple[dict[str, Any], list[str], str | None]:
    """A YAML training config as option values, notes, and the stack whose config it is
    ("torchtune", "litgpt": vramcalc.recipe_files; "llamafactory":
    vramcalc.recipe_llamafactory; "trl": vramcalc.recipe_trl), or None for vramcalc's own
    keys."""
    data = safeio.read_yaml(path, "config file")
    if isinstance(data, dict) and is_torchtune_config(data):
        values, notes = torchtune_values(data)
        return values, notes, "torchtune"
    if isinstance(data, dict) and is_litgpt_config(data):
        values, notes = litgpt_values(data)
        return values, notes, "litgpt"
    if isinstance(data, dict) and is_llamafactory_config(data):
        ds = data.get("deepspeed")  # a path the Trainer opens from the cwd
        if ds is not None and not isinstance(ds, str):
            raise InputError(f"{path}: deepspeed must be a path, got {shown(ds)}")
        zo = load_deepspeed_file(Path(ds)).get("zero_optimization") if ds else None
        values, notes = llamafactory_values(
            data, zero3=isinstance(zo, dict) and zo.get("stage") == 3)
        return values, notes, "llamafactory"
    if isinstance(data, dict) and is_trl_config(data):
        values, notes = trl_values(data)
        return values, notes, "trl"
    return load_config_file(path, data), [], None


def load_config_file(path: Path, data: Any = None) -> dict[str, Any]:
    """Read a YAML training config: a mapping of option names (validated later)."""
    if data is None:
        data = safeio.read_yaml(path, "config file")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of option names to values")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in OPTIONS_BY_NAME and name not in CONFIG_EXTRA_KEYS:
            raise InputError(f"{path}: unknown key {shown(key)}"
                             f"{suggest(name, list(OPTIONS_BY_NAME) + list(CONFIG_EXTRA_KEYS))}")
        if isinstance(value, (dict, list)) and name not in ("offload", "lora_targets",
                                                            "stage_layers"):
            raise InputError(f"{path}: {shown(key)} must be a single value, got a "
                             f"{type(value).__name__}")
        out[name] = value
    if "deepspeed" in out and out["deepspeed"] is not None:
        ds = safeio.user_path(str(out["deepspeed"]), f"{path}: deepspeed")
        out["deepspeed"] = ds if ds.is_absolute() else path.parent / ds
    return out


def load_deepspeed_file(path: Path) -> dict[str, Any]:
    """Read a DeepSpeed JSON config: a JSON object (the keys read: deepspeed_values)."""
    data = safeio.read_json(path, "DeepSpeed config")
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object")
    return data


def _auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _device(value: Any, where: str) -> str | None:
    if value is None or _auto(value):
        return None
    if not isinstance(value, str) or value.lower() not in ("cpu", "nvme", "none"):
        raise InputError(f"DeepSpeed {where}: expected cpu, nvme or none, got {value!r}")
    return None if value.lower() == "none" else value.lower()


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()) or value < 1:
        raise InputError(f"DeepSpeed {where}: expected a positive whole number, got {value!r}")
    return int(value)


def deepspeed_values(ds: dict[str, Any]) -> tuple[dict[str, Any], int | None, list[str]]:
    """Option values from a DeepSpeed config, the train_batch_size (or None), and notes."""
    vals: dict[str, Any] = {}
    notes: list[str] = []
    skipped: list[str] = []
    zo = ds.get("zero_optimization")
    zo = {} if zo is None else zo
    if not isinstance(zo, dict):
        raise InputError("DeepSpeed zero_optimization: expected an object")
    if "stage" in zo:
        st = zo["stage"]
        if _auto(st):
            skipped.append("zero_optimization.stage")
        elif isinstance(st, bool) or not isinstance(st, int) or not 0 <= st <= 3:
            raise InputError(f"DeepSpeed zero_optimization.stage: expected 0-3, got {st!r}")
        else:
            vals["zero"] = st
    offload: list[str] = []
    devices: set[str] = set()
    for key, target in (("offload_optimizer", "optimizer"), ("offload_param", "params")):
        sub = zo.get(key)
        if sub is None:
            continue
        if not isinstance(sub, dict):
            raise InputError(f"DeepSpeed zero_optimization.{key}: expected an object")
        dev = _device(sub.get("device"), f"zero_optimization.{key}.device")
        if dev:
            offload.append(target)
            devices.add(dev)
    if zo.get("cpu_offload") is True and "optimizer" not in offload:
        offload.append("optimizer")
        devices.add("cpu")
    if offload:
        vals["offload"] = ",".join(offload)
        vals["offload_device"] = "nvme" if "nvme" in devices else "cpu"
        if len(devices) > 1:
            notes.append("DeepSpeed offloads to both cpu and nvme; estimated as nvme")
    for key, opt in (("train_micro_batch_size_per_gpu", "micro_batch_size"),
                     ("gradient_accumulation_steps", "grad_accum")):
        if key in ds:
            if _auto(ds[key]):
                skipped.append(key)
            else:
                vals[opt] = _int(ds[key], key)
    tbs = None
    if "train_batch_size" in ds:
        if _auto(ds["train_batch_size"]):
            skipped.append("train_batch_size")
        else:
            tbs = _int(ds["train_batch_size"], "train_batch_size")
    bf16 = (ds.get("bf16") or ds.get("bfloat16") or {})
    fp16 = ds.get("fp16") or {}
    bf_on = isinstance(bf16, dict) and bf16.get("enabled") is True
    fp_on = isinstance(fp16, dict) and fp16.get("enabled") is True
    if bf_on and fp_on:
        raise InputError("DeepSpeed config enables both bf16 and fp16")
    if bf_on:
        vals["precision"] = "bf16"
    elif fp_on:
        vals["precision"] = "fp16"
    for name, sect in (("bf16", bf16), ("fp16", fp16)):
        if isinstance(sect, dict) and _auto(sect.get("enabled")):
            skipped.append(f"{name}.enabled")
    ds_opt = ds.get("optimizer")
    if isinstance(ds_opt, dict) and ds_opt.get("type") is not None:
        kind = str(ds_opt["type"]).lower().replace("_", "")
        if kind in _DS_OPTIMIZERS:
            vals["optimizer"] = _DS_OPTIMIZERS[kind]
        else:
            notes.append(f"DeepSpeed optimizer type {ds_opt['type']!r} is not modelled; "
                         "using the optimizer option")
    if skipped:
        notes.append("DeepSpeed values set to \"auto\" were skipped: " + ", ".join(skipped))
    return vals, tbs, notes


def merge_values(config: dict[str, Any] | None, deepspeed: dict[str, Any] | None,
                 cli: dict[str, Any]) -> dict[str, Any]:
    """Command-line flags over the YAML config over the DeepSpeed values."""
    out: dict[str, Any] = {}
    for layer in (deepspeed or {}, config or {}, cli):
        out.update({k: v for k, v in layer.items() if v is not None})
    out.pop("deepspeed", None)
    return out


# the report function for a scenario (None: the analytic estimate), chosen once the scenario
# is known (the CLI's --engine trace checks that the trace runs the layout first)
EngineChoice = Callable[[Scenario], Callable[[Scenario], MemoryReport] | None]


def run_check(values: dict[str, Any], train_batch_size: int | None = None,
              profile_dirs: list[Path] | None = None,
              explicit: frozenset[str] = frozenset(),
              deepspeed: DeepSpeedConfig | None = None,
              engine: EngineChoice | None = None) -> CheckResult:
    """Build the scenario, reconcile DeepSpeed's train_batch_size, estimate (or report
    with the engine `engine` picks)."""
    values = dict(values)
    values.setdefault("headroom", DEFAULT_CHECK_HEADROOM)
    scn, notes = checked_scenario(values, train_batch_size, profile_dirs, explicit, deepspeed)
    chosen = engine(scn) if engine is not None else None
    report = chosen(scn) if chosen is not None else estimate(scn)
    usable = scn.usable_bytes
    if usable is None:
        raise InputError("check needs gpus (e.g. gpus: 8xH100)")
    return CheckResult(report=report, usable_bytes=usable,
                       headroom_fraction=scn.headroom_fraction, notes=notes, values=values)


def checked_scenario(values: dict[str, Any], train_batch_size: int | None = None,
                     profile_dirs: list[Path] | None = None,
                     explicit: frozenset[str] = frozenset(),
                     deepspeed: DeepSpeedConfig | None = None) -> tuple[Scenario, list[str]]:
    """The scenario of option values and DeepSpeed keys, with DeepSpeed's train_batch_size
    reconciled (deriving the accumulation or micro-batch not given); and notes."""
    values = dict(values)
    notes: list[str] = []
    scn = build_scenario(values, profile_dirs, deepspeed)
    if train_batch_size is not None:
        dp = scn.parallel.dp_degree
        mbs_given = "micro_batch_size" in explicit
        acc_given = "grad_accum" in explicit
        mbs, acc = scn.training.micro_batch_size, scn.training.grad_accum
        if mbs_given and acc_given:
            if mbs * acc * dp != train_batch_size:
                raise InputError(
                    f"DeepSpeed train_batch_size {train_batch_size} != micro-batch {mbs} x "
                    f"gradient accumulation {acc} x dp {dp} = {mbs * acc * dp}")
        elif mbs_given or not acc_given:
            if train_batch_size % (mbs * dp):
                raise InputError(
                    f"DeepSpeed train_batch_size {train_batch_size} is not divisible by "
                    f"micro-batch {mbs} x dp {dp}")
            values["grad_accum"] = train_batch_size // (mbs * dp)
            notes.append(f"gradient accumulation {values['grad_accum']} derived from "
                         f"train_batch_size {train_batch_size}")
            scn = build_scenario(values, profile_dirs, deepspeed)
        else:
            if train_batch_size % (acc * dp):
                raise InputError(
                    f"DeepSpeed train_batch_size {train_batch_size} is not divisible by "
                    f"gradient accumulation {acc} x dp {dp}")
            values["micro_batch_size"] = train_batch_size // (acc * dp)
            notes.append(f"micro-batch {values['micro_batch_size']} derived from "
                         f"train_batch_size {train_batch_size}")
            scn = build_scenario(values, profile_dirs, deepspeed)
    return scn, notes + scenario_notes(scn)


def normalize_cli(values: dict[str, Any]) -> dict[str, Any]:
    """Validate option names and values given on the command line (no defaults filled)."""
    norm = normalize_values(values)
    return {k: norm[k] for k in values}


@dataclass
class FileInputs:
    """Option values merged from a config file, a DeepSpeed JSON and the command line."""

    values: dict[str, Any]
    train_batch_size: int | None
    deepspeed: DeepSpeedConfig | None
    notes: list[str]
    source: str
    recipe: str | None = None  # the stack whose config file it is (recipe_files)


def read_inputs(config: Path | None, deepspeed: Path | None, cli_values: dict[str, Any],
                command: str = "check") -> FileInputs:
    """Read a config file and/or a DeepSpeed JSON (`deepspeed`, or the config's own
    `deepspeed:` key) under the option values given on the command line (flags over the
    YAML over the DeepSpeed file); DeepSpeed's memory keys resolved for the model."""
    cfg, notes, recipe = read_config_file(config) if config is not None else ({}, [], None)
    ds_file = deepspeed or cfg.get("deepspeed")
    ds_vals: dict[str, Any] = {}
    tbs: int | None = None
    ds_doc: dict[str, Any] | None = None
    if ds_file:
        ds_doc = load_deepspeed_file(Path(ds_file))
        ds_vals, tbs, notes = deepspeed_values(ds_doc)
    merged = merge_values(cfg, ds_vals, normalize_cli(cli_values))
    if "model" not in merged:
        raise InputError(f"{command} needs a model: a CONFIG.yaml with `model:` or --model "
                         "(with --deepspeed ds_config.json)")
    ds_cfg = None
    if ds_doc is not None:  # "auto" values follow the model's hidden size
        spec, _ = resolve_model(str(merged["model"]))
        ds_cfg, ds_notes = deepspeed_settings(ds_doc, spec.hidden_size)
        notes += ds_notes
        no_zero = str(merged.get("zero", 0)).strip() in ("0", "None")
        if no_zero and str(merged.get("fsdp") or "none").lower() == "none":
            notes.append("DeepSpeed ZeRO stage 0 is estimated as PyTorch DDP (DeepSpeed's own "
                         "gradient all-reduce buffers are not modelled)")
    source = str(config) if config is not None else str(ds_file or "command line")
    return FileInputs(merged, tbs, ds_cfg, notes, source, recipe)


def check_files(config: Path | None, deepspeed: Path | None, cli_values: dict[str, Any],
                profile_dirs: list[Path] | None = None,
                engine: EngineChoice | None = None) -> tuple[CheckResult, str]:
    """`vramcalc check`: the estimate of a config file and/or a DeepSpeed JSON, under the
    option values given on the command line (`read_inputs`); and the name of the source
    checked, for the output."""
    inp = read_inputs(config, deepspeed, cli_values)
    if inp.recipe is not None:
        inp.values = recipe_defaults(inp.values, inp.recipe, profile_dirs)
    result = run_check(inp.values, inp.train_batch_size, profile_dirs, frozenset(inp.values),
                       inp.deepspeed, engine)
    result.notes[:0] = inp.notes
    return result, inp.source
