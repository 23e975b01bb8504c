"""Scenario: model + training + parallel layout + cluster — one question to answer."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from vramcalc.errors import InputError
from vramcalc.hardware import Cluster, GPUProfile
from vramcalc.hf_config import ROBERTA_TYPES
from vramcalc.hf_stack import (
    autocast_layout_problem,
    autocast_model_problem,
    layernorm_model_problem,
    release_model_problem,
    trl_chunked_problem,
)
from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig, resolve_layout
from vramcalc.stack_rules import (
    TORCHTUNE_0_3,
    activation_problem,
    muon_problem,
    optimizer_in_backward_problem,
    torchtune_before,
    torchtune_packed_mask,
    torchtune_training_problem,
)
from vramcalc.training import COMPUTE_DTYPE, TORCH_STEPPED, TrainingConfig


def mla_unsupported(scn: Scenario) -> str | None:
    """What of this scenario multi-latent attention's saved-tensor table
    (vramcalc/terms/saved_layers.py `mla_saved`) does not cover yet, or None."""
    tr, par = scn.training, scn.parallel
    if tr.framework == "megatron":  # vramcalc/terms/megatron_mla.py: TE flash, any TP / SP
        return next((piece for piece, on in (
            (f"cp={par.cp}", par.cp > 1), ("fine-tuning", tr.finetune != "full"),
            ("FP8 / quantization-aware training", tr.precision == "fp8" or tr.qat != "none"))
            if on), None)
    why = {"hf": "transformers' DeepseekV3 attention is not traced yet",
           "torchtitan": "the torchtitan model has no MLA"}
    if tr.framework in why:
        return f"the {tr.framework} profile ({why[tr.framework]})"
    for piece, on in ((f"tp={par.tp}", par.tp > 1), (f"cp={par.cp}", par.cp > 1),
                      ("fine-tuning", tr.finetune != "full"),
                      ("FP8 / quantization-aware training",
                       tr.precision == "fp8" or tr.qat != "none")):
        if on:
            return piece
    return None


def mla_problem(scn: Scenario) -> str | None:
    """The one-line refusal of a multi-latent attention scenario `mla_unsupported` does not
    cover (None when covered or the model has no MLA)."""
    missing = mla_unsupported(scn) if scn.model.is_mla else None
    if missing is None:
        return None
    if scn.training.framework == "megatron":
        return (f"{scn.model.name}: multi-latent attention's activations are modelled for "
                "--framework megatron with tensor and sequence "
                f"parallelism, 16/32-bit full training, so far; not {missing}")
    return (f"{scn.model.name}: multi-latent attention's activations are modelled for "
            "--framework megatron (tensor and sequence parallelism) and --framework reference "
            f"(one tensor/context-parallel rank), full training, so far; not {missing}")


def learned_positions(spec: ModelSpec) -> int | None:
    """The tokens a learned position table covers (None for other position embeddings):
    its rows, less RoBERTa's two, which numbers positions from padding_idx + 1 = 2
    (transformers `create_position_ids_from_input_ids`)."""
    if spec.position_embedding != "learned":
        return None
    return spec.max_position_embeddings - (2 if spec.model_type in ROBERTA_TYPES else 0)


def short_default_length(spec: ModelSpec) -> tuple[int, str] | None:
    """The default --seq-len where a learned position table is shorter than TrainingConfig's
    default (the longest sequence the model runs), with its note; None elsewhere."""
    positions = learned_positions(spec)
    if positions is None or positions >= TrainingConfig.model_fields["seq_len"].default:
        return None
    return positions, (f"seq {positions:,}: {spec.name}'s learned positions cover "
                       f"{positions:,} tokens (--seq-len picks a shorter length)")


def encoder_unsupported(scn: Scenario) -> str | None:
    """What of this scenario the encoder tables (vramcalc/terms/encoder.py) do not model,
    or None: they follow transformers' BERT / RoBERTa on one GPU or plain data parallelism,
    full training, 16/32-bit precision, no or full recompute."""
    tr, par, spec = scn.training, scn.parallel, scn.model
    if tr.framework in ("megatron", "torchtitan"):
        return f"--framework {tr.framework} (its models are decoders; use --framework hf)"
    if tr.framework not in ("hf", "reference"):
        # torchtune's, LitGPT's and Unsloth's tables are their decoders' (their recipes
        # train no BERT, T5 or BART); these models run transformers' own modeling code
        return f"--framework {tr.framework} (use --framework hf, transformers' models)"
    positions = learned_positions(spec)
    if positions is not None and not tr.load_only:
        for flag, n in (("--seq-len", tr.seq_len), ("--target-len", tr.target_len or 0)):
            if n > positions:
                return (f"{flag} {n} (its learned positions cover {positions} tokens: "
                        f"give {flag} {positions} or less)")
    pieces = ((f"tp={par.tp}", par.tp > 1), (f"pp={par.pp}", par.pp > 1),
              (f"cp={par.cp}", par.cp > 1), (f"ep={par.ep}", par.ep > 1),
              (f"zero={par.zero}", bool(par.zero)), (f"fsdp={par.fsdp}", par.fsdp != "none"),
              ("offload", bool(par.offload)), (f"--finetune {tr.finetune}", tr.finetune != "full"),
              ("FP8 / QAT", tr.precision == "fp8" or tr.qat != "none"),
              ("--recompute selective", tr.recompute == "selective"),
              ("--chunked-ce", tr.chunked_ce > 1), ("--activation-offload", tr.activation_offload),
              ("--optimizer-in-backward", tr.optimizer_in_backward))
    return next((piece for piece, on in pieces if on), None)


def capability_problem(tr: TrainingConfig, gpu: GPUProfile) -> str | None:
    """What of this training setup `gpu` cannot run as counted, as one error line, or None.

    - bf16 compute (bf16, amp-bf16, bf16-pure) with fused attention on a GPU whose profile
      has no BF16 (`bf16_supported: false`: V100, T4). PyTorch's SDPA takes bf16 in its
      memory-efficient kernel only from sm80 on (aten/src/ATen/native/transformers/cuda/
      sdp_utils.cpp `can_use_mem_efficient_attention`: fp16 and fp32 before sm80) and its
      flash kernel needs sm80, so SDPA falls back to the math kernel, which keeps the s x s
      scores that `--attention flash` does not count; FlashAttention-2 itself refuses GPUs
      before Ampere (Dao-AILab/flash-attention README). fp8 is refused by
      vramcalc/terms/lowprec.py `check_lowprec`.
    - `--attention flash` on a GPU whose profile lists no fused attention kernel.
    """
    flash = tr.attention == "flash"
    if flash and not gpu.fused_attention:
        return (f"--attention flash needs a fused attention kernel; {gpu.name} has none in "
                "its profile (fused_attention: false): use --attention eager")
    if (flash and tr.precision != "fp8" and COMPUTE_DTYPE[tr.precision] == "bf16"
            and not gpu.bf16_supported):
        return (f"--precision {tr.precision} with --attention flash: {gpu.name} has no BF16 "
                "support (Ampere or newer), so FlashAttention-2 does not run and PyTorch SDPA "
                "falls back to its math kernel, which keeps the s x s attention scores; use "
                "--precision amp-fp16 or fp16 (or --attention eager to count the scores)")
    return None


def check_capabilities(scn: Scenario) -> None:
    """Refuse (InputError) what the scenario's GPU cannot run as counted
    (`capability_problem`). The engines call it; `resolved` does not, so that the planner can
    search other precisions for a request the GPU refuses (--allow precision)."""
    if scn.cluster is not None:
        problem = capability_problem(scn.training, scn.cluster.gpu)
        if problem:
            raise InputError(problem)


# LitGPT's GPT has no weight tying: its checkpoint converter gives a tied checkpoint an
# lm_head of its own (litgpt/scripts/convert_hf_checkpoint.py: `if "lm_head.weight" not in
# state_dict: state_dict["lm_head.weight"] = state_dict["transformer.wte.weight"]`, at
# 00af8b0d and 26857050), so fine-tuning holds two V x h matrices
LITGPT_UNTIED = ("LitGPT keeps lm_head apart from the embedding (its checkpoint converter "
                 "copies transformer.wte.weight into lm_head.weight): two V x h matrices")


class Scenario(BaseModel):
    """Everything one estimate needs. `cluster=None` estimates one rank with no fit check."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelSpec
    training: TrainingConfig = TrainingConfig()
    parallel: ParallelConfig = ParallelConfig()
    cluster: Cluster | None = None
    headroom_fraction: float = 0.0
    model_note: str | None = None
    gpu_note: str | None = None

    @property
    def world_size(self) -> int:
        if self.cluster is not None:
            return self.cluster.num_gpus
        p = self.parallel
        return (p.dp or 1) * p.tp * p.pp * p.cp

    @property
    def usable_bytes(self) -> int | None:
        """GPU memory the fit check allows: the device's total less the headroom kept free
        (None without a cluster)."""
        if self.cluster is None:
            return None
        return int(self.cluster.gpu.memory_total_bytes * (1 - self.headroom_fraction))

    def resolved(self) -> Scenario:
        """Validate the layout against model and world size; fill in dp, the optimizer
        step's implementation where a torch optimizer steps (DeepSpeed and Megatron-LM step
        their own fused optimizers) and the allocator's expandable segments (the stack's)."""
        problem = (mla_problem(self) or release_model_problem(self.model, self.training)
                   or layernorm_model_problem(self.model, self.training)
                   or activation_problem(self.model, self.training)
                   or autocast_model_problem(self.model, self.training)
                   or autocast_layout_problem(self.training,
                                              self.parallel.engine(self.training.framework))
                   or trl_chunked_problem(self.model, self.training,
                                          self.parallel.engine(self.training.framework),
                                          self.parallel.zero))
        if problem:
            raise InputError(problem)
        mtp = self.parallel.mtp_layers
        if mtp and (self.training.framework != "megatron" or self.model.is_encoder
                    or self.model.is_encoder_decoder):
            raise InputError(f"--mtp-layers {mtp}: multi-token prediction is modelled for "
                             "Megatron-LM (--framework megatron) decoders only")
        tr = self.training
        if mtp and tr.recompute == "full" and (tr.recompute_method == "block" or (
                tr.recompute_num_layers or 1) != 1):
            # multi_token_prediction.py `_checkpointed_forward`: uniform asserts
            # recompute_num_layers == 1; block skips the MTP layers' recompute
            raise InputError(f"--mtp-layers {mtp}: Megatron-LM checkpoints each MTP depth "
                             "alone (--recompute-method uniform, --recompute-num-layers 1); "
                             "other full-recompute plans are not modelled with MTP")
        if self.model.parallel_residual and self.training.framework not in (
                "reference", "lightning"):
            raise InputError(f"{self.model.name}: parallel attention + MLP blocks are "
                             "modelled for --framework reference and lightning, not "
                             f"{self.training.framework}")
        if self.model.model_type == "llama4_text" and self.training.framework == "hf":
            # modeling_llama4.py Llama4TextMoe.forward: every token through every expert
            raise InputError(f"{self.model.name}: transformers' Llama-4 MoE runs every expert "
                             "on every token, which the hf profile does not model; use "
                             "--framework reference (routed tokens)")
        tr = self.training
        if tr.target_len is not None and not self.model.is_encoder_decoder:
            raise InputError(f"--target-len: {self.model.name} is not an encoder-decoder "
                             "(t5, bart); its sequences are --seq-len long")
        if tr.softmax_keeps_input and not self.model.is_encoder:
            raise InputError(f"--torch-version {tr.torch_version}: what torch before 1.11 "
                             "keeps for softmax and log_softmax is modelled for encoder "
                             "models (bert, roberta) so far; give 1.11 or later")
        if self.model.is_encoder or self.model.is_encoder_decoder:
            missing = encoder_unsupported(self)
            if missing:
                raise InputError(f"{self.model.name}: encoder and encoder-decoder models are "
                                 "modelled with "
                                 "transformers' modeling code on one GPU or DDP, full "
                                 f"training, no or full recompute; not {missing}")
            if tr.framework == "reference":  # one profile for encoders: transformers' code
                tr = tr.model_copy(update={"framework": "hf"})
        par = self.parallel
        if (tr.framework == "torchtune" and torchtune_before(tr, TORCHTUNE_0_3)
                and par.fsdp != "none" and par.fsdp_impl is None):
            # the recipes wrapped FullyShardedDataParallel until 0.3's `shard_model` (FSDP2)
            par = par.model_copy(update={"fsdp_impl": "fsdp1"})
        par = resolve_layout(self.model, tr, par, self.world_size)
        problem = muon_problem(tr, par.engine(tr.framework), par.tp)
        if problem:
            raise InputError(problem)
        if not tr.set_to_none and (par.engine(tr.framework) not in ("single", "ddp")
                                   or tr.has_master_weights or tr.optimizer_in_backward):
            raise InputError("--no-set-to-none is modelled on one GPU or DDP with the "
                             "optimizer stepping the weights themselves (fp32, amp-*, "
                             "bf16-pure); ZeRO, FSDP, Megatron-LM and fp32 master copies keep "
                             "gradient buffers their own way")
        if tr.optimizer_in_backward:
            _check_optimizer_in_backward(tr, par)
        if (tr.optimizer_impl is None and tr.optimizer in TORCH_STEPPED
                and par.engine(tr.framework) in ("single", "ddp", "fsdp2")):
            tr = tr.model_copy(update={"optimizer_impl": tr.step_impl})
        if tr.expandable_segments is None:
            tr = tr.model_copy(update={"expandable_segments": tr.expandable})
        if tr.packed and tr.packed_mask is None:
            tr = _with_packed_mask(tr, self.cluster.gpu if self.cluster else None)
        model, note = self.model, self.model_note
        if tr.framework == "lightning" and model.tie_word_embeddings:
            model, note = model.model_copy(update={"tie_word_embeddings": False}), "; ".join(
                n for n in (note, LITGPT_UNTIED) if n)
        return self.model_copy(update={"parallel": par, "training": tr, "model": model,
                                       "model_note": note})


def _with_packed_mask(tr: TrainingConfig, gpu: GPUProfile | None) -> TrainingConfig:
    """--packed with the mask kind torchtune builds on `gpu` (stack_rules
    `torchtune_packed_mask`), refused where it is not modelled."""
    mask, problem = torchtune_packed_mask(gpu)
    if problem is None:
        tr = tr.model_copy(update={"packed_mask": mask})
        problem = torchtune_training_problem(tr)
    if problem is not None:
        raise InputError(problem)
    return tr


def _check_optimizer_in_backward(tr: TrainingConfig, par: ParallelConfig) -> None:
    """--optimizer-in-backward is modelled on one GPU (torchtune's
    full_finetune_single_device), with the training settings `optimizer_in_backward_problem`
    allows (checked again here: the planner varies settings with `model_copy`)."""
    problem = optimizer_in_backward_problem(tr)
    if problem:
        raise InputError(problem)
    if par.engine(tr.framework) != "single" or par.tp * par.pp * par.cp > 1:
        raise InputError("--optimizer-in-backward is modelled on one GPU without "
                         "parallelism (torchtune's full_finetune_single_device); got "
                         f"dp={par.dp_degree}, tp={par.tp}, pp={par.pp}, cp={par.cp}, "
                         f"zero={par.zero}, fsdp={par.fsdp} (use --gpus 1x...)")
