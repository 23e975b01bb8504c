"""Parallel layout and sharding: degrees, ZeRO/FSDP stage, offload, pipeline schedule.

All degrees are validated in one place, `resolve_layout`, which raises InputError
with a message a user can act on (cf. torchtitan's ParallelDims._validate).

Which implementation's semantics apply (docs/parallelism.md, "Sharding engines"):

| flags                         | engine     | what is modelled |
|-------------------------------|------------|------------------|
| --fsdp full/grad-op/hybrid    | fsdp2      | PyTorch FSDP2 `fully_shard` per transformer block + root |
| --framework megatron          | megatron   | Megatron-LM: fp32 main-grad buffer; --zero 1 = distributed optimizer |
| --zero 1/2/3                  | deepspeed  | DeepSpeed ZeRO stage 1/2/3; its memory-changing keys in `deepspeed` (vramcalc.ds_config) |
| dp > 1, none of the above     | ddp        | torch DistributedDataParallel (bucketed all-reduce) |
| one rank                      | single     | nothing to shard |
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from vramcalc.ds_config import DEFAULT_DEEPSPEED, DeepSpeedConfig
from vramcalc.errors import InputError
from vramcalc.hf_stack import trainer_wraps_adapters
from vramcalc.model import ModelSpec
from vramcalc.stack_rules import (
    edge_units_problem,
    liger_problem,
    torchtitan_layout_problem,
    torchtitan_split,
    torchtune_layout_problem,
)
from vramcalc.training import TrainingConfig

OffloadTarget = Literal["optimizer", "gradients", "params"]
Engine = Literal["single", "ddp", "deepspeed", "fsdp2", "megatron"]


class ParallelConfig(BaseModel):
    """Parallel degrees and sharding. `dp=None` means derived: world / (tp·pp·cp)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: int | None = Field(None, gt=0, le=10_000_000)
    tp: int = Field(1, gt=0, le=100_000)
    pp: int = Field(1, gt=0, le=100_000)
    cp: int = Field(1, gt=0, le=100_000)
    ep: int = Field(1, gt=0, le=100_000)
    # Megatron-LM's --expert-tensor-parallel-size; None: tp (Megatron's arguments.py default)
    etp: int | None = Field(None, gt=0, le=100_000)
    sequence_parallel: bool = False
    zero: int = Field(0, ge=0, le=3)
    fsdp: Literal["none", "full", "grad-op", "hybrid"] = "none"
    shard_group: int | None = Field(None, gt=0, le=10_000_000)
    # --fsdp-impl: fsdp2 (`fully_shard`) or fsdp1 (one FlatParameter per wrapped module,
    # vramcalc/terms/fsdp1.py); None: the stack's (lightning: fsdp1, else fsdp2)
    fsdp_impl: Literal["fsdp2", "fsdp1"] | None = Field(None, exclude_if=lambda v: v is None)
    # --fsdp-edge-units: the embedding and the head as FSDP2 units of their own
    fsdp_edge_units: bool = Field(False, exclude_if=lambda v: not v)
    offload: tuple[OffloadTarget, ...] = ()
    offload_device: Literal["cpu", "nvme"] = "cpu"
    pp_schedule: Literal["1f1b", "interleaved", "gpipe"] = "1f1b"
    virtual_stages: int = Field(1, gt=0, le=1000)
    pp_group_size: int | None = Field(None, gt=0, le=100_000, exclude_if=lambda v: v is None)
    # uneven pipeline splits (Megatron-LM --decoder-first/last-pipeline-num-layers,
    # --account-for-embedding/loss-in-pipeline-split); vramcalc.sharding.chunk_layers
    first_stage_layers: int | None = Field(None, gt=0, le=1_000_000)
    last_stage_layers: int | None = Field(None, gt=0, le=1_000_000)
    embedding_in_split: bool = False
    loss_in_split: bool = False
    # --stage-layers: layers of each pipeline stage in order (pp x virtual stages; stage s
    # on rank s mod pp); the torchtitan profile fills in its own split for uneven layers
    stage_layers: tuple[int, ...] | None = Field(None, exclude_if=lambda v: v is None)
    mtp_layers: int = Field(0, ge=0, le=64, exclude_if=lambda v: v == 0)  # --mtp-num-layers
    # --defer-embedding-wgrad-compute's --wgrad-deferral-limit (0: all; megatron_layer.py)
    defer_embedding_wgrad: int | None = Field(None, ge=0, le=10_000_000,
                                              exclude_if=lambda v: v is None)
    num_microbatches: int | None = Field(None, gt=0, le=10_000_000)
    global_batch_size: int | None = Field(None, gt=0, le=1_000_000_000)
    capacity_factor: float = Field(1.0, gt=0, le=100)
    # DeepSpeed's buckets, ZeRO-3 fetching and activation-checkpointing keys (a --deepspeed
    # JSON); DeepSpeed's defaults otherwise
    deepspeed: DeepSpeedConfig = DEFAULT_DEEPSPEED

    @property
    def dp_degree(self) -> int:
        return self.dp or 1

    @property
    def shard_stage(self) -> int:
        """ZeRO-equivalent sharding stage: FSDP full/hybrid = 3, grad-op = 2."""
        if self.fsdp in ("full", "hybrid"):
            return 3
        if self.fsdp == "grad-op":
            return 2
        return self.zero

    @property
    def shard_degree(self) -> int:
        """Ranks one dense parameter/gradient/optimizer shard is spread over: DP x CP, which
        hold the same weights (Megatron's distributed optimizer, torchtitan's dp_shard x cp
        FSDP mesh); a hybrid-sharding group or a Megatron optimizer instance only."""
        if self.shard_group and (self.fsdp == "hybrid" or self.zero):
            return self.shard_group  # an HSDP group, or a Megatron optimizer instance
        return self.dp_degree * self.cp

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel degree: --etp, else tp."""
        return self.etp or self.tp

    @property
    def expert_shard_degree(self) -> int:
        """Ranks one expert shard is spread over: the expert-data-parallel group,
        world/(etp·ep·pp) = dp·cp·tp/(etp·ep) (Megatron-LM d98e8a64 parallel_state.py
        `initialize_model_parallel`: expert_data_parallel_size = world_size //
        expert_tensor_model_pipeline_parallel_size); dp·cp/ep when etp = tp."""
        if self.fsdp == "hybrid" and self.shard_group:
            return max(self.shard_group // self.ep, 1) if self.shard_group % self.ep == 0 else 1
        edp = max(self.dp_degree * self.cp * self.tp // (self.expert_tp * self.ep), 1)
        if self.zero and self.shard_group:  # each optimizer instance takes its share of it
            return max(edp * self.shard_group // (self.dp_degree * self.cp), 1)
        return edp

    @property
    def uneven_split(self) -> bool:
        """Whether pipeline ranks may hold different layer counts (`sharding.chunk_layers`)."""
        return (self.first_stage_layers is not None or self.last_stage_layers is not None
                or self.embedding_in_split or self.loss_in_split
                or self.stage_layers is not None)

    @property
    def pp_chunks(self) -> int:
        """Model chunks per pipeline rank: v under the interleaved schedule, else 1."""
        return self.virtual_stages if self.pp_schedule == "interleaved" else 1

    def flat_fsdp(self, framework: str) -> bool:
        """Whether FSDP1's flat parameters apply: --fsdp with --fsdp-impl fsdp1, or the
        lightning profile's default (Lightning's FSDPStrategy wraps FullyShardedDataParallel,
        vramcalc/terms/fsdp1.py)."""
        if self.fsdp == "none":
            return False
        return (self.fsdp_impl or ("fsdp1" if framework == "lightning" else "fsdp2")) == "fsdp1"

    def engine(self, framework: str) -> Engine:
        """Whose sharding and buffer semantics apply (see the module docstring)."""
        if self.fsdp != "none":
            return "fsdp2"
        if framework == "megatron":
            return "megatron"
        if self.zero:
            return "deepspeed"
        if self.dp_degree * self.cp > 1:
            return "ddp"
        return "single"


def resolve_layout(
    spec: ModelSpec, training: TrainingConfig, parallel: ParallelConfig, world_size: int
) -> ParallelConfig:
    """Check a layout against the model and cluster; return it with dp (and the number of
    micro-batches, when a global batch is given) filled in. Raises InputError."""
    tp, pp, cp, ep = parallel.tp, parallel.pp, parallel.cp, parallel.ep
    model_par = tp * pp * cp
    if parallel.dp is None:
        if world_size % model_par:
            raise InputError(
                f"{world_size} GPUs cannot be split into tp={tp} x pp={pp} x cp={cp} "
                f"(= {model_par}); choose degrees whose product divides {world_size}"
            )
        dp = world_size // model_par
    else:
        dp = parallel.dp
        if dp * model_par != world_size:
            raise InputError(
                f"dp={dp} x tp={tp} x pp={pp} x cp={cp} = {dp * model_par} does not match "
                f"{world_size} GPUs"
            )
    if spec.num_attention_heads % tp:
        raise InputError(f"tp={tp} does not divide num_attention_heads={spec.num_attention_heads}")
    if spec.kv_heads % tp and tp % spec.kv_heads:
        raise InputError(
            f"tp={tp} does not divide num_key_value_heads={spec.kv_heads} (nor is it a multiple)"
        )
    parallel = torchtitan_split(spec, training, parallel)
    _check_pipeline(spec, training, parallel)
    if ep > 1:
        if not spec.is_moe:
            raise InputError(f"ep={ep} needs a mixture-of-experts model; {spec.name} is dense")
        if spec.num_local_experts % ep:
            raise InputError(
                f"ep={ep} does not divide num_local_experts={spec.num_local_experts}"
            )
        if parallel.etp is None and (dp * cp) % ep:
            raise InputError(f"ep={ep} must divide dp x cp = {dp * cp} (experts are sharded over DP)")
    if parallel.etp is not None:
        _check_expert_tp(spec, training, parallel, dp * cp * tp)
    if training.seq_len % cp:
        raise InputError(f"cp={cp} does not divide seq_len={training.seq_len}")
    if cp > 1 and (training.seq_len // cp) % 2:
        raise InputError(
            f"seq_len/cp = {training.seq_len // cp} must be even (ring attention splits each "
            "rank's sequence into two chunks for load balance)"
        )
    if parallel.sequence_parallel and tp == 1:
        raise InputError("--sequence-parallel needs --tp > 1")
    if parallel.sequence_parallel and training.seq_len % (tp * cp):
        raise InputError(f"tp x cp = {tp * cp} does not divide seq_len={training.seq_len}")
    if parallel.zero and parallel.fsdp != "none":
        raise InputError("use either --zero or --fsdp, not both")
    if parallel.fsdp == "hybrid":
        if not parallel.shard_group:
            raise InputError("--fsdp hybrid needs --shard-group N (ranks per shard group)")
        if (dp * cp) % parallel.shard_group:
            raise InputError(
                f"--shard-group {parallel.shard_group} does not divide dp x cp = {dp * cp}"
            )
        if parallel.shard_group % ep:
            raise InputError(f"ep={ep} does not divide --shard-group {parallel.shard_group}")
    elif parallel.shard_group and not (training.framework == "megatron" and parallel.zero):
        raise InputError("--shard-group applies to --fsdp hybrid, and to the megatron "
                         "profile's distributed optimizer (--zero 1)")
    elif parallel.shard_group and (dp * cp) % parallel.shard_group:
        raise InputError(f"--shard-group {parallel.shard_group} does not divide dp x cp = "
                         f"{dp * cp}")
    _check_fsdp_impl(training, parallel)
    resolved = parallel.model_copy(update={"dp": dp})
    _check_engine(training, resolved)
    problem = (torchtitan_layout_problem(spec, training, resolved)
               if training.framework == "torchtitan" else torchtune_layout_problem(resolved)
               if training.framework == "torchtune" else None) or edge_units_problem(
                   spec, resolved, training.framework) or liger_problem(spec, training, resolved)
    if problem:
        raise InputError(problem)
    m = _microbatches(training, resolved)
    if m is not None:
        resolved = resolved.model_copy(update={"num_microbatches": m})
    return resolved


def _check_fsdp_impl(training: TrainingConfig, parallel: ParallelConfig) -> None:
    """FSDP1's flat parameters are modelled for data-parallel sharding of 16/32-bit weights
    without offload (vramcalc/terms/fsdp1.py). --fsdp-impl applies to layouts that shard
    with --fsdp (the planner's among others)."""
    if not parallel.flat_fsdp(training.framework):
        return
    other = [f"--{k} {v}" for k, v in (("tp", parallel.tp), ("pp", parallel.pp),
                                        ("cp", parallel.cp), ("ep", parallel.ep)) if v > 1]
    if other:
        raise InputError("FSDP1 (--fsdp-impl fsdp1) is modelled for data parallelism alone; "
                         f"got {', '.join(other)} (use --fsdp-impl fsdp2)")
    if parallel.offload and not trainer_wraps_adapters(training):
        raise InputError("FSDP1's CPUOffload is modelled for HF Trainer's PEFT runs (--framework "
                         "hf, LoRA/QLoRA/DoRA, adapters in units of their own): leave out "
                         "--offload, or use --fsdp-impl fsdp2")
    if training.finetune == "qlora" and not trainer_wraps_adapters(training):
        raise InputError("--finetune qlora with FSDP1 is modelled for HF Trainer (--framework "
                         "hf: bitsandbytes' float quant_storage, PEFT's adapters in units of "
                         "their own, transformers 4.39 or later): use --fsdp-impl fsdp2")


def _check_expert_tp(spec: ModelSpec, training: TrainingConfig, parallel: ParallelConfig,
                     ranks_per_stage: int) -> None:
    """--etp, Megatron-LM d98e8a64's --expert-tensor-parallel-size: the expert grid is
    etp x ep x expert-dp x pp over the same world (parallel_state.py
    `initialize_model_parallel`: "world_size ... is not divisible by
    expert_tensor_model_pipeline_parallel size"), so etp·ep divides tp·cp·dp; the expert
    FFN splits evenly over etp (core/utils.py `divide`); MoELayer.forward refuses tensor
    parallelism without sequence parallelism in training (moe/moe_layer.py). Modelled for
    the megatron profile's own sharding (DDP / distributed optimizer) only."""
    etp, ep, tp = parallel.expert_tp, parallel.ep, parallel.tp
    if not spec.is_moe:
        raise InputError(f"--etp needs a mixture-of-experts model; {spec.name} is dense")
    if training.framework != "megatron":
        raise InputError("--etp is Megatron-LM's --expert-tensor-parallel-size: use it with "
                         "--framework megatron")
    if parallel.fsdp != "none":
        raise InputError("--etp is modelled with Megatron-LM's DDP and distributed optimizer, "
                         "not with --fsdp")
    if ranks_per_stage % (etp * ep):
        raise InputError(
            f"etp={etp} x ep={ep} must divide tp x cp x dp = {ranks_per_stage} (the expert "
            f"grid etp x ep x expert-dp x pp covers the same {ranks_per_stage * parallel.pp} "
            "GPUs)")
    if spec.expert_ffn % etp:
        raise InputError(f"etp={etp} does not divide the expert FFN width {spec.expert_ffn}")
    if etp != tp and tp > 1 and not parallel.sequence_parallel:
        raise InputError("Megatron-LM's MoE layer needs --sequence-parallel with --tp > 1 "
                         "in training")


def pipeline_split_problem(spec: ModelSpec, training: TrainingConfig,
                           parallel: ParallelConfig) -> str | None:
    """`resolve_layout`'s refusal of this layout's pipeline split, or None (the planner
    asks it which pp an uneven split allows)."""
    try:
        _check_pipeline(spec, training, torchtitan_split(spec, training, parallel))
    except InputError as err:
        return str(err)
    return None


def _check_pipeline(spec: ModelSpec, training: TrainingConfig, parallel: ParallelConfig) -> None:
    pp = parallel.pp
    if parallel.pp_schedule != "interleaved" and (parallel.virtual_stages != 1
                                                   or parallel.pp_group_size):
        raise InputError("--virtual-stages and --pp-group-size need --pp-schedule interleaved")
    m = parallel.num_microbatches or training.grad_accum
    if parallel.defer_embedding_wgrad is not None and (pp == 1
                                                      or training.framework != "megatron"):
        raise InputError("--defer-embedding-wgrad: Megatron-LM's, with --pp > 1")
    if parallel.pp_group_size and not pp <= parallel.pp_group_size <= m:
        raise InputError(f"--pp-group-size {parallel.pp_group_size}: between --pp {pp} and "
                         f"the micro-batches per step, {m} (Megatron-LM's check)")
    if parallel.pp_schedule == "interleaved" and pp == 1:
        raise InputError("--pp-schedule interleaved needs --pp > 1")
    v = parallel.pp_chunks
    first, last = parallel.first_stage_layers, parallel.last_stage_layers
    if parallel.stage_layers is not None:
        stages = parallel.stage_layers
        if (len(stages) != pp * v or min(stages) < 1 or sum(stages) != spec.num_hidden_layers
                or first is not None or last is not None or parallel.embedding_in_split
                or parallel.loss_in_split):
            raise InputError(f"--stage-layers {','.join(map(str, stages))}: give pp x virtual "
                             f"stages = {pp * v} counts of at least one layer summing to "
                             f"num_hidden_layers={spec.num_hidden_layers}, and no other split "
                             "(--first/last-stage-layers, --embedding/loss-in-split)")
        return
    if first is not None or last is not None:
        _check_uneven(spec.num_hidden_layers, parallel)
        return
    if parallel.embedding_in_split or parallel.loss_in_split:
        _check_edges_in_split(spec.num_hidden_layers, parallel)
        return
    if spec.num_hidden_layers % (pp * v):
        raise InputError(
            f"num_hidden_layers={spec.num_hidden_layers} is not divisible by pp x virtual "
            f"stages = {pp * v}"
        )


def _check_uneven(num_layers: int, parallel: ParallelConfig) -> None:
    """Megatron-LM's rules for --decoder-first/last-pipeline-num-layers (d98e8a64,
    megatron/core/transformer/transformer_config.py: `TransformerConfig.__post_init__`,
    "Uneven PP"): not with the embedding/loss in the split; each given count > 0 (Field)
    and divisible by v; the layers left over split evenly over the ranks left, v | that
    count; middle ranks exist exactly when layers are left for them."""
    pp, v = parallel.pp, parallel.pp_chunks
    if parallel.embedding_in_split or parallel.loss_in_split:
        raise InputError("--first-stage-layers/--last-stage-layers cannot be combined with "
                         "--embedding-in-split/--loss-in-split (Megatron-LM refuses it)")
    if pp == 1:
        raise InputError("--first-stage-layers/--last-stage-layers need --pp > 1")
    rest, left = num_layers, pp
    for flag, n in (("--first-stage-layers", parallel.first_stage_layers),
                    ("--last-stage-layers", parallel.last_stage_layers)):
        if n is None:
            continue
        if n % v:
            raise InputError(f"{flag} {n} is not divisible by --virtual-stages {v}")
        rest, left = rest - n, left - 1
    if rest < 0 or bool(rest) != bool(left):
        raise InputError(
            f"num_hidden_layers={num_layers} leaves {rest} layers for the {left} middle "
            f"pipeline stages; choose first/last stage layers that leave "
            f"{'none' if not left else 'at least one per middle stage'}")
    if left and rest % left:
        raise InputError(
            f"the {rest} layers left for the {left} middle pipeline stages do not split "
            f"evenly; change --first-stage-layers/--last-stage-layers")
    if left and (rest // left) % v:
        raise InputError(
            f"the middle pipeline stages hold {rest // left} layers each, not divisible by "
            f"--virtual-stages {v}")


def _check_edges_in_split(num_layers: int, parallel: ParallelConfig) -> None:
    """Megatron-LM's rule for --account-for-embedding/loss-in-pipeline-split (d98e8a64,
    transformer_config.py `__post_init__`): L plus the embedding and/or the loss, counted as
    one layer each, divisible by p, and the per-rank count by v."""
    pp, v = parallel.pp, parallel.pp_chunks
    n = num_layers + parallel.embedding_in_split + parallel.loss_in_split
    if n % pp:
        raise InputError(
            f"num_hidden_layers={num_layers} plus the embedding/loss counted as layers "
            f"(= {n}) is not divisible by pp={pp}")
    if (n // pp) % v:
        raise InputError(
            f"{n // pp} layers per pipeline stage (embedding/loss counted) is not divisible "
            f"by --virtual-stages {v}")


def _check_engine(training: TrainingConfig, par: ParallelConfig) -> None:
    """Combinations the modelled implementation does not run, and offload rules per engine."""
    engine = par.engine(training.framework)
    off = set(par.offload)
    if engine == "deepspeed" and par.zero >= 2 and par.pp > 1:
        # deepspeed/runtime/pipe/engine.py: "ZeRO-2 and ZeRO-3 are incompatible with
        # pipeline parallelism"
        raise InputError(
            f"DeepSpeed ZeRO-{par.zero} does not run with pipeline parallelism (pp={par.pp}); "
            "use --zero 1, or --fsdp full"
        )
    if engine == "megatron" and par.zero >= 2:
        raise InputError(
            "Megatron-LM shards optimizer states only (--zero 1 = distributed optimizer); "
            "use --fsdp full for sharded gradients and parameters"
        )
    if par.offload_device == "nvme" and engine != "deepspeed":
        raise InputError("nvme offload is DeepSpeed ZeRO-Infinity: use it with --zero")
    if not off:
        return
    if engine in ("single", "ddp"):
        raise InputError("offload needs ZeRO-1 or higher (or FSDP)")
    if engine == "deepspeed":
        if "params" in off and par.zero != 3:
            raise InputError("parameter offload needs ZeRO-3")
        if "gradients" in off and "optimizer" not in off:
            raise InputError(
                "DeepSpeed offloads gradients together with the optimizer (ZeRO-Offload): "
                "use --offload optimizer"
            )
    elif engine == "fsdp2":
        if "params" not in off:
            raise InputError(
                "FSDP2 offloads parameters, gradients and the optimizer step together "
                "(CPUOffloadPolicy): use --offload params"
            )
        if par.fsdp == "grad-op":
            raise InputError("FSDP2 CPU offload needs --fsdp full or hybrid")
    elif engine == "megatron":
        if off != {"optimizer"} or par.zero != 1:
            raise InputError(
                "Megatron-LM offloads the optimizer only, with the distributed optimizer: "
                "use --zero 1 --offload optimizer"
            )


def _microbatches(training: TrainingConfig, par: ParallelConfig) -> int | None:
    """Micro-batches per optimizer step: given, derived from a global batch, or None."""
    m = par.num_microbatches
    gb = par.global_batch_size
    dp, mbs = par.dp_degree, training.micro_batch_size
    if gb is not None:
        if gb % (dp * mbs):
            raise InputError(
                f"global batch {gb} is not divisible by dp x micro-batch = {dp} x {mbs}"
            )
        derived = gb // (dp * mbs)
        if m is not None and m != derived:
            raise InputError(
                f"--num-microbatches {m} contradicts global batch {gb} / (dp {dp} x "
                f"micro-batch {mbs}) = {derived}"
            )
        if training.grad_accum not in (1, derived):
            raise InputError(
                f"--grad-accum {training.grad_accum} contradicts global batch {gb} / "
                f"(dp {dp} x micro-batch {mbs}) = {derived}"
            )
        m = derived
    elif m is not None and par.pp == 1 and m != training.grad_accum:
        raise InputError("--num-microbatches applies to pipeline parallelism; use --grad-accum")
    eff = m if m is not None else training.grad_accum
    if par.pp_schedule == "interleaved" and 0 < eff % (par.pp_group_size or par.pp) < par.pp:
        # Megatron-LM d98e8a64 schedules.py: the last group of g (default pp) micro-batches
        # holds all g or at least pp of them
        raise InputError(
            f"the interleaved schedule needs the number of micro-batches ({eff}) to be a "
            f"multiple of {par.pp_group_size or par.pp} or to leave at least pp={par.pp} "
            "over; set --num-microbatches")
    return m


def num_microbatches(training: TrainingConfig, parallel: ParallelConfig) -> int:
    """Micro-batches per optimizer step on one pipeline (gradient-accumulation steps)."""
    return parallel.num_microbatches or training.grad_accum
