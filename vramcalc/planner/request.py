"""What the planner is asked: the batch, how many plans, which settings it may change."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Global batch when none is given: the power of two nearest below 4M tokens per step
# (Llama 2 trained every size with a global batch of 4M tokens; Llama 2 MODEL_CARD.md).
DEFAULT_BATCH_TOKENS = 4 * 2**20
# Global batch of a fine-tuning job when none is given, in sequences: Stanford Alpaca's
# fine-tuning recipe, "Batch size 128" (tatsu-lab/stanford_alpaca @000109ff README.md,
# "Fine-tuning" table), the batch of the HF-Trainer recipes that followed it.
DEFAULT_FINETUNE_BATCH = 128
MAX_MICRO_BATCH = 64



def splittable_batch(sequences: float) -> int:
    """The global batch nearest `sequences` that data parallelism can split evenly: a
    multiple of the largest power of two at most one-eighth of it, so at most 1/16 (6.25 %)
    away. 4M tokens of 4096 are 976.6 sequences: 960 = 15 x 64, not 977, a prime that no
    data-parallel degree divides."""
    n = max(1, round(sequences))
    step = 1
    while step * 16 <= n:
        step *= 2
    return max(step, round(sequences / step) * step)


ProgressFn = Callable[[str, int, int], None]  # (message, done, total)


@dataclass(frozen=True)
class PlanRequest:
    """What to search. Exactly one of the batch fields may be set (else the default)."""

    global_batch_size: int | None = None  # sequences per step
    global_batch_tokens: int | None = None
    top_n: int = 5
    allow: frozenset[str] = frozenset()
    pinned: Mapping[str, Any] = field(default_factory=dict)  # normalized option values
    efficiency: float | None = None  # --mfu override of the profile's mfu_fraction
    max_micro_batch: int = MAX_MICRO_BATCH
    finetuning: bool = False  # a fine-tuning job: DEFAULT_FINETUNE_BATCH when none is given

    def batch_for(self, seq_len: int) -> int:
        """Global batch in sequences for this sequence length: the one given, else a
        fine-tuning batch (DEFAULT_FINETUNE_BATCH) or the pretraining one (the power of two
        nearest below DEFAULT_BATCH_TOKENS tokens)."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        if self.global_batch_tokens is not None:
            return splittable_batch(self.global_batch_tokens / seq_len)
        if self.finetuning:
            return DEFAULT_FINETUNE_BATCH
        per = max(1, DEFAULT_BATCH_TOKENS // seq_len)
        return 1 << (per.bit_length() - 1)


# The parallelisms a stack cannot run, which the planner never proposes, and why. HF
# Trainer lays out its ranks with accelerate's ParallelismConfig (dp_replicate, dp_shard,
# tp, cp, sp; accelerate src/accelerate/parallelism_config.py, 1.15): no pipeline or
# expert parallelism.
UNSUPPORTED: dict[str, tuple[frozenset[str], str]] = {
    "hf": (frozenset({"pp", "ep"}), "HF Trainer (accelerate's ParallelismConfig) runs no "
           "pipeline or expert parallelism: layouts with pp or ep > 1 are not proposed"),
    # torchtitan 9dec370 (torchtitan/parallelisms/parallelize_llama.py, parallel_dims.py):
    # FSDP2 / HSDP, TP with sequence parallelism, PP, CP; no MoE, so no expert parallelism;
    # vramcalc.stack_rules.torchtitan_layout_problem refuses the rest for every layout
    "torchtitan": (frozenset({"ep"}), "torchtitan (9dec370) shards with FSDP2 only (no "
                   "DeepSpeed ZeRO stages), runs DDP only without TP/PP/CP, TP only with "
                   "sequence parallelism, keeps blocks unsharded after forward only under PP "
                   "and has no expert parallelism: other layouts are not proposed"),
    # torchtune 1814feb: single-device recipes or FSDP2 data parallelism (FSDP1 before
    # 0.3, --torchtune-version)
    # (vramcalc.parallel._check_torchtune refuses the rest for every layout)
    "torchtune": (frozenset({"pp", "ep"}), "torchtune (1814feb) runs one GPU or data "
                  "parallelism with FSDP (FSDP1 before 0.3) only: other layouts are not "
                  "proposed"),
    # LitGPT 8641822 on Lightning Fabric 2.1: data parallelism (DDP, FSDPStrategy's FSDP1,
    # DeepSpeed); FSDP1 with tp/cp is refused per layout (vramcalc.parallel._check_fsdp_impl)
    "lightning": (frozenset({"pp", "ep"}), "LitGPT on Lightning Fabric runs no pipeline or "
                  "expert parallelism, and its FSDP (FSDP1) shards over data-parallel ranks "
                  "only: other layouts are not proposed"),
    # Unsloth (015bdef0) trains one model replica per GPU (one GPU, or DDP through
    # accelerate); its checkpoint buffers are one per device (unsloth-zoo ce232d6c
    # gradient_checkpointing.py GPU_BUFFERS)
    "unsloth": (frozenset({"tp", "pp", "cp", "ep"}), "Unsloth trains one replica per GPU: "
                "layouts with tp, pp, cp or ep > 1 are not proposed"),
}


def recomputes_of(framework: str) -> tuple[str, ...]:
    """The recompute modes a stack runs: torchtune checkpoints whole layers or none
    (`enable_activation_checkpointing`), Unsloth too (use_gradient_checkpointing)."""
    return (("none", "full") if framework in ("torchtune", "unsloth")
            else ("none", "selective", "full"))


def stack_note(framework: str) -> str | None:
    """Why the planner leaves some layouts out for this stack (None: it proposes all)."""
    entry = UNSUPPORTED.get(framework)
    return entry[1] if entry else None
