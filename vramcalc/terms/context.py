"""RankContext: everything a term function needs about one rank of one scenario."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.sharding import RankTensor, rank_tensors, stage_layers
from vramcalc.training import TrainingConfig


@dataclass(frozen=True)
class RankContext:
    """One rank: pipeline stage `stage` of a resolved layout (dp filled in)."""

    spec: ModelSpec
    training: TrainingConfig
    parallel: ParallelConfig
    stage: int = 0

    @cached_property
    def tensors(self) -> list[RankTensor]:
        return rank_tensors(self.spec, self.parallel, self.stage)

    @property
    def num_layers(self) -> int:
        return stage_layers(self.spec, self.parallel)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.parallel.pp - 1

    @property
    def param_shard(self) -> int:
        """Shard degree for weights (ZeRO-3 / FSDP full)."""
        return self.parallel.shard_degree if self.parallel.shard_stage >= 3 else 1

    @property
    def grad_shard(self) -> int:
        return self.parallel.shard_degree if self.parallel.shard_stage >= 2 else 1

    @property
    def state_shard(self) -> int:
        return self.parallel.shard_degree if self.parallel.shard_stage >= 1 else 1

    def __hash__(self) -> int:  # frozen dataclass with cached_property needs an explicit hash
        return id(self)
