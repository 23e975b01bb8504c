"""A DeepSpeed JSON's memory-changing keys → `DeepSpeedConfig` (read by `check --deepspeed`
and `estimate --deepspeed`; the ZeRO stage, offload, batch and precision keys are
vramcalc.check `deepspeed_values`).

| DeepSpeed key | field | memory it changes (docs/methodology.md, "DeepSpeed configuration keys") |
|---|---|---|
| zero_optimization.reduce_bucket_size | reduce_bucket_size | ZeRO-1/2 backward bucket(s), ZeRO-3 persistent bucket |
| zero_optimization.overlap_comm | overlap_comm | ZeRO-1/2: a second bucket |
| zero_optimization.contiguous_gradients | contiguous_gradients | the bucket buffers vs waiting gradients + flat copy |
| zero_optimization.stage3_prefetch_bucket_size | prefetch_bucket_size | ZeRO-3 gathered parameters |
| zero_optimization.stage3_max_live_parameters | max_live_parameters | ZeRO-3 gathered parameters (caps the prefetch) |
| zero_optimization.stage3_max_reuse_distance | max_reuse_distance | ZeRO-3 parameters kept gathered across the turn |
| zero_optimization.stage3_param_persistence_threshold | param_persistence_threshold | ZeRO-3 weights kept whole, gathered parameters |
| zero_optimization.sub_group_size | sub_group_size | ZeRO-3 fp32 gradient of one sub-group at the step; NVMe swap buffers |
| zero_optimization.allgather_bucket_size | allgather_bucket_size | none: ZeRO-1/2 all-gather into the flat buffer (runtime/utils.py `all_gather_dp_groups` → `all_gather_into_tensor_dp_groups`) |
| zero_optimization.round_robin_gradients | — | none: it reorders parameters over the partitions |
| activation_checkpointing.partition_activations / cpu_checkpointing / contiguous_memory_optimization / number_checkpoints | same | checkpointed layer inputs (vramcalc/terms/ds_checkpointing.py) |

The `stage3_` keys are also read without the prefix (DeepSpeed's field names). `"auto"` is
what the Hugging Face Trainer fills in: reduce_bucket_size, stage3_prefetch_bucket_size and
stage3_param_persistence_threshold from the model's hidden size
(vramcalc.ds_config.hf_auto_value); any other `"auto"` keeps DeepSpeed's default, with a note.
Keys that change memory but are not modelled give a note; other keys are ignored.
DeepSpeed 0.16.5 (commit 38327e07) throughout.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from vramcalc.ds_config import DeepSpeedConfig, hf_auto_value
from vramcalc.errors import InputError
from vramcalc.scenario import Scenario

# (DeepSpeed key, its name without the stage3_ prefix or None, DeepSpeedConfig field)
_ZERO_INTS: tuple[tuple[str, str | None, str], ...] = (
    ("reduce_bucket_size", None, "reduce_bucket_size"),
    ("allgather_bucket_size", None, "allgather_bucket_size"),
    ("stage3_prefetch_bucket_size", "prefetch_bucket_size", "prefetch_bucket_size"),
    ("stage3_max_live_parameters", "max_live_parameters", "max_live_parameters"),
    ("stage3_max_reuse_distance", "max_reuse_distance", "max_reuse_distance"),
    ("stage3_param_persistence_threshold", "param_persistence_threshold",
     "param_persistence_threshold"),
    ("sub_group_size", None, "sub_group_size"),
)
_ZERO_BOOLS = ("overlap_comm", "contiguous_gradients", "round_robin_gradients")
_HF_AUTO = ("reduce_bucket_size", "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold")
_AC_BOOLS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
             "synchronize_checkpoint_boundary", "profile")
# keys that change memory and are not modelled: (section, key, the value that changes nothing)
_UNMODELLED: tuple[tuple[str, str, Any], ...] = (
    ("zero_optimization", "stage3_model_persistence_threshold", None),
    ("zero_optimization", "model_persistence_threshold", None),
    ("zero_optimization", "zero_hpz_partition_size", 1),
    ("zero_optimization", "zero_quantized_weights", False),
    ("zero_optimization", "zero_quantized_nontrainable_weights", False),
    ("zero_optimization", "zero_quantized_gradients", False),
    ("zero_optimization", "mics_shard_size", -1),
    ("", "communication_data_type", None),
    ("", "data_types", None),
)
_OFFLOAD_UNMODELLED = ("buffer_count", "buffer_size", "ratio")


def _auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()) or value < 0:
        raise InputError(f"DeepSpeed {where}: expected a whole number >= 0, got {value!r}")
    return int(value)


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"DeepSpeed {where}: expected true or false, got {value!r}")
    return value


def _section(ds: dict[str, Any], name: str) -> dict[str, Any]:
    sub = ds.get(name)
    if sub is None:
        return {}
    if not isinstance(sub, dict):
        raise InputError(f"DeepSpeed {name}: expected an object")
    return sub


def deepspeed_settings(ds: dict[str, Any], hidden_size: int
                       ) -> tuple[DeepSpeedConfig, list[str]]:
    """The DeepSpeedConfig of a DeepSpeed JSON object (`"auto"` resolved the Hugging Face
    way for a model of `hidden_size`), and notes. Bad values raise InputError."""
    zo = _section(ds, "zero_optimization")
    ac = _section(ds, "activation_checkpointing")
    fields: dict[str, Any] = {}
    notes: list[str] = []
    filled: list[str] = []
    kept_default: list[str] = []
    for key, bare, field in _ZERO_INTS:
        name = key if key in zo else bare if bare is not None and bare in zo else None
        if name is None:
            continue
        where = f"zero_optimization.{name}"
        if _auto(zo[name]):
            if key in _HF_AUTO:
                fields[field] = hf_auto_value(key, hidden_size)
                filled.append(f"{name} = {fields[field]:,}")
            else:
                kept_default.append(where)
            continue
        fields[field] = _count(zo[name], where)
    for key in _ZERO_BOOLS:
        if key not in zo or zo[key] is None:
            continue
        if _auto(zo[key]):
            kept_default.append(f"zero_optimization.{key}")
            continue
        value = _flag(zo[key], f"zero_optimization.{key}")
        if key != "round_robin_gradients":  # reorders parameters only: no memory
            fields[key] = value
    for key in _AC_BOOLS:
        if key in ac and ac[key] is not None:
            value = _flag(ac[key], f"activation_checkpointing.{key}")
            if key in ("partition_activations", "cpu_checkpointing",
                       "contiguous_memory_optimization"):
                fields[key] = value
    if ac.get("number_checkpoints") is not None:
        n = _count(ac["number_checkpoints"], "activation_checkpointing.number_checkpoints")
        if n == 0:
            raise InputError("DeepSpeed activation_checkpointing.number_checkpoints: expected "
                             "a positive whole number, got 0")
        fields["number_checkpoints"] = n
    try:
        cfg = DeepSpeedConfig(**fields)
    except ValidationError as err:
        first = err.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        raise InputError(str(cause) if cause else f"DeepSpeed config: {first['msg']}") from None
    if filled:
        notes.append(f"DeepSpeed \"auto\" filled as the Hugging Face Trainer does (hidden size "
                     f"{hidden_size:,}): " + ", ".join(filled))
    if kept_default:
        notes.append("DeepSpeed \"auto\" that transformers does not fill, DeepSpeed's default "
                     "assumed: " + ", ".join(kept_default))
    notes += _unmodelled(ds, zo)
    return cfg, notes


def _unmodelled(ds: dict[str, Any], zo: dict[str, Any]) -> list[str]:
    found: list[str] = []
    for section, key, neutral in _UNMODELLED:
        where = zo if section else ds
        if key in where and where[key] is not None and where[key] != neutral:
            found.append(f"{section + '.' if section else ''}{key}")
    for sub in ("offload_optimizer", "offload_param"):
        part = zo.get(sub)
        if isinstance(part, dict):
            found += [f"zero_optimization.{sub}.{k}" for k in _OFFLOAD_UNMODELLED if k in part]
    if not found:
        return []
    return ["DeepSpeed keys that change memory but are not modelled (DeepSpeed's defaults "
            "assumed): " + ", ".join(found)]


def scenario_notes(scn: Scenario) -> list[str]:
    """Notes on DeepSpeed keys a scenario does not use (activation checkpointing needs a
    model that checkpoints through deepspeed.checkpointing; ZeRO-3 keys need ZeRO-3)."""
    ds, tr, par = scn.parallel.deepspeed, scn.training, scn.parallel
    notes: list[str] = []
    if ds.checkpoints_partitioned_or_offloaded:
        if tr.recompute != "full":
            notes.append("DeepSpeed activation_checkpointing (partition_activations / "
                         "cpu_checkpointing) applies to layers checkpointed through "
                         "deepspeed.checkpointing.checkpoint: give --recompute full to model it")
        elif tr.framework != "reference":
            notes.append(f"DeepSpeed activation_checkpointing is not applied to the "
                         f"{tr.framework} profile: its layers checkpoint with "
                         "torch.utils.checkpoint, not deepspeed.checkpointing (the reference "
                         "profile models a model that calls deepspeed.checkpointing)")
        elif ds.partition_activations and par.tp == 1:
            notes.append("DeepSpeed partition_activations splits checkpoints over the "
                         "tensor-parallel group: with tp = 1 nothing is split")
    return notes
