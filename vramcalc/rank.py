"""RankContext: one rank of one scenario, with its per-rank shapes (the layer below the
memory terms): the tensors it holds and trains (vramcalc.sharding, or under LoRA/QLoRA/DoRA
vramcalc.finetune), its layers, its engine and its shard degrees and layouts."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from vramcalc.features import finetunes
from vramcalc.finetune import shapes_for
from vramcalc.model import ModelSpec
from vramcalc.parallel import Engine, ParallelConfig, num_microbatches
from vramcalc.sharding import Layout, RankShapes, RankTensor, rank_shapes, stage_layers
from vramcalc.training import TrainingConfig


@dataclass(frozen=True)
class RankContext:
    """One rank: pipeline stage `stage` of a resolved layout (dp filled in)."""

    spec: ModelSpec
    training: TrainingConfig
    parallel: ParallelConfig
    stage: int = 0

    @cached_property
    def shapes(self) -> RankShapes:
        """Every tensor the rank holds (under LoRA/QLoRA/DoRA: frozen base + adapters)."""
        if finetunes(self.training):
            return shapes_for(self).all
        return rank_shapes(self.spec, self.parallel, self.stage)

    @property
    def tensors(self) -> tuple[RankTensor, ...]:
        return self.shapes.tensors

    @cached_property
    def train_shapes(self) -> RankShapes:
        """The tensors that get gradients and optimizer states (all, unless fine-tuning)."""
        if finetunes(self.training):
            return shapes_for(self).adapters
        return self.shapes

    @property
    def train_tensors(self) -> tuple[RankTensor, ...]:
        return self.train_shapes.tensors

    @property
    def num_layers(self) -> int:
        return stage_layers(self.spec, self.parallel, self.stage)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.parallel.pp - 1

    @cached_property
    def engine(self) -> Engine:
        """Whose sharding semantics apply: single, ddp, deepspeed, fsdp2 or megatron."""
        return self.parallel.engine(self.training.framework)

    @property
    def num_microbatches(self) -> int:
        return num_microbatches(self.training, self.parallel)

    @property
    def param_shard(self) -> int:
        """Shard degree for weights (ZeRO-3 / FSDP)."""
        if self.engine == "fsdp2" or (self.engine == "deepspeed" and self.parallel.zero >= 3):
            return self.parallel.shard_degree
        return 1

    @property
    def grad_shard(self) -> int:
        if self.engine == "fsdp2" or (self.engine == "deepspeed" and self.parallel.zero >= 2):
            return self.parallel.shard_degree
        return 1

    @property
    def state_shard(self) -> int:
        if self.engine == "fsdp2" or (self.engine in ("deepspeed", "megatron")
                                      and self.parallel.zero >= 1):
            return self.parallel.shard_degree
        return 1

    def expert_shard(self, shard: int) -> int:
        """The expert-data-parallel counterpart of a dense shard degree (1 stays 1)."""
        return self.parallel.expert_shard_degree if shard > 1 else 1

    @property
    def weight_layout(self) -> Layout:
        if self.engine == "fsdp2":
            return "dim0"
        if self.engine == "deepspeed" and self.parallel.zero >= 3:
            return "persist"
        # DeepSpeed ZeRO-1/2 flatten the 16-bit weights into one buffer; counting them per
        # tensor differs by < 512 B per tensor and keeps "ZeRO-3 <= ZeRO-2" exact
        return "tensor"

    @property
    def grad_layout(self) -> Layout:
        if self.engine == "fsdp2":
            return "group"
        if self.engine == "megatron" or (self.engine == "deepspeed" and self.parallel.zero >= 2):
            return "flat"
        return "tensor"

    @property
    def state_layout(self) -> Layout:
        if self.engine == "fsdp2":
            return "dim0"
        if self.engine == "deepspeed" or (self.engine == "megatron" and self.parallel.zero):
            return "flat"
        return "tensor"
