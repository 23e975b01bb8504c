"""DeepSpeed's memory-changing settings for one scenario (`ParallelConfig.deepspeed`).

Defaults are DeepSpeed's own (DeepSpeed 0.16.5, commit 38327e07):
deepspeed/runtime/zero/config.py `DeepSpeedZeroConfig` for the ZeRO keys and
deepspeed/runtime/activation_checkpointing/config.py for the `activation_checkpointing`
section. What each one changes, in bytes, is in docs/methodology.md ("DeepSpeed
configuration keys"); the terms read them from the rank's ParallelConfig
(vramcalc/terms/comm.py, transients.py, ds_checkpointing.py, vramcalc/sharding.py,
vramcalc/offload.py), and `vramcalc.ds_json` reads them from a DeepSpeed JSON.

| field | DeepSpeed key | default |
|---|---|---|
| reduce_bucket_size | zero_optimization.reduce_bucket_size | 5e8 elements |
| allgather_bucket_size | zero_optimization.allgather_bucket_size | 5e8 (no memory: see ds_json) |
| overlap_comm | zero_optimization.overlap_comm | None = DeepSpeed's: True for stage 3 only (`overlap_comm_valid`) |
| contiguous_gradients | zero_optimization.contiguous_gradients | True |
| prefetch_bucket_size | zero_optimization.stage3_prefetch_bucket_size | 5e7 |
| max_live_parameters | zero_optimization.stage3_max_live_parameters | 1e9 |
| max_reuse_distance | zero_optimization.stage3_max_reuse_distance | 1e9 |
| param_persistence_threshold | zero_optimization.stage3_param_persistence_threshold | 1e5 |
| sub_group_size | zero_optimization.sub_group_size | 1e9 |
| partition_activations | activation_checkpointing.partition_activations | False |
| cpu_checkpointing | activation_checkpointing.cpu_checkpointing | False |
| contiguous_memory_optimization | activation_checkpointing.contiguous_memory_optimization | False |
| number_checkpoints | activation_checkpointing.number_checkpoints | None |
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

_BIG = 10**15  # a bound for absurd sizes (elements)


class DeepSpeedConfig(BaseModel):
    """The DeepSpeed config keys that change per-GPU memory, at DeepSpeed's defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reduce_bucket_size: int = Field(500_000_000, ge=0, le=_BIG)
    allgather_bucket_size: int = Field(500_000_000, ge=0, le=_BIG)
    overlap_comm: bool | None = None
    contiguous_gradients: bool = True
    prefetch_bucket_size: int = Field(50_000_000, ge=0, le=_BIG)
    max_live_parameters: int = Field(1_000_000_000, ge=0, le=_BIG)
    max_reuse_distance: int = Field(1_000_000_000, ge=0, le=_BIG)
    param_persistence_threshold: int = Field(100_000, ge=0, le=_BIG)
    sub_group_size: int = Field(1_000_000_000, ge=0, le=_BIG)
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = Field(None, gt=0, le=1_000_000)

    @model_validator(mode="after")
    def _contiguous_needs_partitioning(self) -> DeepSpeedConfig:
        # checkpointing.py `configure`: "Contiguous Checkpointing is only available with
        # partitioned activations" and "Must specify the number of layers with contiguous
        # memory checkpointing" (asserts)
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ValueError("DeepSpeed activation_checkpointing.contiguous_memory_optimization "
                             "needs partition_activations (DeepSpeed asserts it)")
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ValueError("DeepSpeed activation_checkpointing.contiguous_memory_optimization "
                             "needs number_checkpoints (DeepSpeed asserts it)")
        return self

    def overlap(self, stage: int) -> bool:
        """overlap_comm as DeepSpeed resolves it: as given, else True for ZeRO-3 only
        (zero/config.py `overlap_comm_valid`)."""
        return self.overlap_comm if self.overlap_comm is not None else stage == 3

    @property
    def checkpoints_partitioned_or_offloaded(self) -> bool:
        """Whether deepspeed.checkpointing keeps checkpoints other than whole on the device."""
        return self.partition_activations or self.cpu_checkpointing


DEFAULT_DEEPSPEED = DeepSpeedConfig()

# transformers' rules for "auto" values that depend on the model (huggingface/transformers
# 02348331, src/transformers/integrations/deepspeed.py `trainer_config_finalize`): with
# hidden = model.config.hidden_size, reduce_bucket_size = hidden·hidden; under ZeRO-3 also
# stage3_prefetch_bucket_size = 0.9·hidden·hidden and stage3_param_persistence_threshold =
# 10·hidden (0.9·h·h is a float there; DeepSpeed takes int() of it: stage3.py
# `prefetch_elements`).


def hf_auto_value(key: str, hidden_size: int) -> int:
    """The value the Hugging Face Trainer fills in for `"auto"` (`key`: the DeepSpeed name
    without `zero_optimization.`)."""
    h = hidden_size
    if key == "reduce_bucket_size":
        return h * h
    if key == "stage3_prefetch_bucket_size":
        return int(0.9 * h * h)
    if key == "stage3_param_persistence_threshold":
        return 10 * h
    raise KeyError(key)
