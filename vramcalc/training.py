"""Training options: sequence, batch, precision policy, optimizer, attention kernel, recompute.

Precision policies (what each tensor is stored in):

| policy    | weights | grads | master copy | compute (activations) |
|-----------|---------|-------|-------------|-----------------------|
| fp32      | fp32    | fp32  | none        | fp32                  |
| amp-bf16  | fp32    | fp32  | none        | bf16 (torch.autocast) |
| amp-fp16  | fp32    | fp32  | none        | fp16 (torch.autocast) |
| bf16      | bf16    | bf16  | fp32        | bf16                  |
| fp16      | fp16    | fp16  | fp32        | fp16                  |
| bf16-pure | bf16    | bf16  | none        | bf16 (states bf16)    |
| bf16-autocast | bf16 | bf16 | none       | bf16 (torch.autocast; states bf16) |
| fp16-autocast | fp16 | fp16 | none       | fp16 (torch.autocast) |
| fp8       | bf16    | bf16  | fp32        | bf16; block linears in FP8 (Transformer Engine, vramcalc/terms/lowprec.py) |

`bf16`/`fp16` is the Megatron/DeepSpeed default (ZeRO paper: 2 + 2 + 12 bytes/param with Adam).
`bf16-autocast`/`fp16-autocast` are HF Trainer's `bf16=True`/`fp16=True` over a model loaded in
16 bits (`from_pretrained(..., dtype=torch.bfloat16)`): the hf profile's; autocast casts
nothing but the trained fp32 adapters and the inputs PEFT upcasts for them
(vramcalc/terms/finetune_activations.py).
`qat` (int8 / int4 fake quantization of the block linears) combines with the non-autocast
policies; see vramcalc/terms/lowprec.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vramcalc.hf_stack import HF_OPTIMS, hf_stack_problem, parse_modules_to_save, trainer_defaults
from vramcalc.lora_targets import DEFAULT_TARGETS, parse_targets
from vramcalc.qlora import NF4Layout, nf4_layout, parse_version
from vramcalc.stack_rules import (
    TORCHTUNE_0_3_1,
    lightning_training_problem,
    optimizer_in_backward_problem,
    torchtitan_training_problem,
    torchtune_before,
    torchtune_training_problem,
    unsloth_training_problem,
)

Precision = Literal["fp32", "amp-bf16", "amp-fp16", "bf16", "fp16", "bf16-pure", "fp8",
                    "bf16-autocast", "fp16-autocast"]
OptimizerName = Literal[
    "adamw", "adam", "sgd", "sgd-momentum", "lion", "adafactor", "adamw-8bit",
    "paged-adamw", "paged-adamw-8bit", "muon",
]
PRECISIONS: tuple[str, ...] = ("fp32", "amp-bf16", "amp-fp16", "bf16", "fp16", "bf16-pure",
                                "fp8", "bf16-autocast", "fp16-autocast")
# Lightning Fabric's precision plugins as these policies (methodology § 17)
LIGHTNING_PRECISIONS = {"bf16-true": "bf16-pure", "bf16-mixed": "amp-bf16", "32-true": "fp32",
                        "16-mixed": "amp-fp16"}
# the precision policies of the table above: weights' and activations' dtypes
WEIGHT_DTYPE: dict[str, str] = {"fp32": "fp32", "amp-bf16": "fp32", "amp-fp16": "fp32",
                                "bf16": "bf16", "fp16": "fp16", "bf16-pure": "bf16",
                                "fp8": "bf16", "bf16-autocast": "bf16", "fp16-autocast": "fp16"}
COMPUTE_DTYPE: dict[str, str] = {"fp32": "fp32", "amp-bf16": "bf16", "amp-fp16": "fp16",
                                 "bf16": "bf16", "fp16": "fp16", "bf16-pure": "bf16",
                                 "fp8": "bf16", "bf16-autocast": "bf16", "fp16-autocast": "fp16"}
QATS: tuple[str, ...] = ("none", "int8", "int4")  # vramcalc/terms/lowprec.py
OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd", "sgd-momentum", "lion", "adafactor",
                                "adamw-8bit", "paged-adamw", "paged-adamw-8bit", "muon")
FINETUNES: tuple[str, ...] = ("full", "lora", "qlora", "dora")  # vramcalc/finetune.py
ADAPTER_METHODS: tuple[str, ...] = ("lora", "qlora", "dora")
# How a torch optimizer runs its step (torch/optim/adam.py, sgd.py): `foreach` kernels over
# lists (PyTorch's default on CUDA, torch/optim/optimizer.py `_default_to_fused_or_foreach`
# with use_fused=False), one `fused` kernel (`fused=True`), or a Python `loop` over the
# parameters (`foreach=False`).
OPTIMIZER_IMPLS: tuple[str, ...] = ("foreach", "fused", "loop")
# torch ships fused and per-parameter implementations of these; vramcalc's Lion and
# Adafactor step are foreach only, bitsandbytes' optimizers their own fused kernels
_IMPLS_OF: dict[str, tuple[str, ...]] = dict.fromkeys(("adam", "adamw", "sgd", "sgd-momentum"),
                                                      OPTIMIZER_IMPLS)
TORCH_STEPPED: tuple[str, ...] = tuple(_IMPLS_OF)
ATTENTIONS: tuple[str, ...] = ("flash", "eager")
RECOMPUTES: tuple[str, ...] = ("none", "selective", "full")
# Megatron-LM's --recompute-method (megatron/core/transformer/transformer_config.py
# `recompute_method`; the megatron profile only, with --recompute full)
RECOMPUTE_METHODS: tuple[str, ...] = ("uniform", "block")
# Megatron-LM's --moe-token-dispatcher-type for training (megatron profile, MoE models):
# megatron/core/transformer/moe/token_dispatcher.py MoEAllGatherTokenDispatcher /
# MoEAlltoAllTokenDispatcher (vramcalc/terms/megatron_layer.py `megatron_moe_bytes`)
MOE_DISPATCHERS: tuple[str, ...] = ("allgather", "alltoall")
# Megatron-LM's default: TransformerConfig.moe_token_dispatcher_type = "allgather"
# (NVIDIA/Megatron-LM d98e8a64, megatron/core/transformer/transformer_config.py)
MEGATRON_DEFAULT_DISPATCHER = "allgather"
FRAMEWORKS: tuple[str, ...] = ("reference", "hf", "megatron", "torchtitan", "torchtune",
                                "lightning", "unsloth")


def adapter_dtype(framework: str, weight_dtype: str, keep_16bit: bool = False) -> str:
    """Adapters' dtype: PEFT (hf) upcasts 16-bit adapters to fp32 unless `keep_16bit`
    (TrainingConfig.adapters_16bit), as unsloth does (unsloth_zoo training_utils.py
    `prepare_model_for_training`, `upcast = True`); others keep the weight dtype."""
    upcast = framework in ("hf", "unsloth") and not keep_16bit
    return "fp32" if upcast else weight_dtype


class TrainingConfig(BaseModel):
    """One training job's per-step settings (parallel layout lives in ParallelConfig)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq_len: int = Field(4096, gt=0, le=100_000_000)
    # encoder-decoders: decoder (label) tokens per sequence; None: seq_len
    target_len: int | None = Field(None, gt=0, le=100_000_000, exclude_if=lambda v: v is None)
    micro_batch_size: int = Field(1, gt=0, le=1_000_000)
    grad_accum: int = Field(1, gt=0, le=1_000_000)
    precision: Precision = "bf16"
    optimizer: OptimizerName = "adamw"
    optimizer_dtype: Literal["fp32", "bf16"] | None = None
    # None: the stack's default (see `step_impl`); "hf-loop" only through hf_optim adamw_hf
    optimizer_impl: Literal["foreach", "fused", "loop", "hf-loop"] | None = None
    # HF Trainer's TrainingArguments.optim for AdamW (hf profile; HF_OPTIMS); None: the
    # Trainer's default (transformers >= 4.54, torch >= 2.8: adamw_torch_fused); not dumped
    hf_optim: Literal["adamw_torch", "adamw_torch_fused", "adamw_hf"] | None = Field(
        None, exclude_if=lambda v: v is None)
    attention: Literal["flash", "eager"] = "flash"
    recompute: Literal["none", "selective", "full"] = "none"
    # HF's gradient_checkpointing_kwargs={"use_reentrant": ...} (hf profile, full recompute;
    # vramcalc/terms/moments.py); None: transformers 5.x's default, False; not dumped if None
    use_reentrant: bool | None = Field(None, exclude_if=lambda v: v is None)
    # PEFT's prepare_model_for_kbit_training(model) with its defaults (hf profile, QLoRA):
    # the non-4-bit parameters cast to fp32, gradient checkpointing on through
    # gradient_checkpointing_enable({}) (torch's reentrant default), the embedding's output
    # made to require grad. Left out of dumps when off
    kbit_prepare: bool = Field(False, exclude_if=lambda v: not v)
    # accelerate's sync_each_batch=True (hf): no no_sync() (hf_stack.py `trainer_no_sync`)
    sync_each_batch: bool = Field(False, exclude_if=lambda v: not v)
    liger: bool = Field(False, exclude_if=lambda v: not v)  # use_liger_kernel (terms/liger.py)
    # TRL SFTTrainer's loss_type chunked_nll (terms/trl_loss.py)
    trl_chunked_ce: bool = Field(False, exclude_if=lambda v: not v)
    # the adapters kept in the model's 16-bit dtype (hf): PEFT's get_peft_model(...,
    # autocast_adapter_dtype=False), or TRL's cast of a 4-bit model's trained parameters
    adapters_16bit: bool = Field(False, exclude_if=lambda v: not v)
    # Megatron-LM's --recompute-method / --recompute-num-layers (megatron profile, full
    # recompute): which layers of each pipeline chunk are checkpointed, and how many per
    # checkpoint (vramcalc/terms/megatron_recompute.py). None: every layer, one per checkpoint
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = Field(None, gt=0, le=100_000)
    # torchtitan's selective_ac_option = N (torchtitan profile, --recompute selective): every
    # N-th block checkpointed whole, the others keep everything (vramcalc/terms/torchtitan.py).
    # None: torchtitan's per-op SAC ('op'), left out of dumps
    recompute_every: int | None = Field(None, gt=0, le=100_000, exclude_if=lambda v: v is None)
    framework: Literal["reference", "hf", "megatron", "torchtitan", "torchtune",
                       "lightning", "unsloth"] = "reference"
    # fine-tuning (vramcalc/finetune.py): frozen base + adapters; PEFT's defaults
    # "peft": a PEFT adapter config file (`peft_config`), traced only (vramcalc/peft_file.py)
    finetune: Literal["full", "lora", "qlora", "dora", "peft"] = "full"
    peft_config: str | None = Field(None, exclude_if=lambda v: v is None)
    lora_rank: int = Field(8, gt=0, le=65_536)
    lora_targets: str = DEFAULT_TARGETS  # canonical, see parse_targets
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # PEFT's LoraConfig(modules_to_save=[...]) (hf profile): trained copies of whole modules,
    # "lm_head" and/or "embed_tokens" (comma-separated; vramcalc/finetune.py); dumped if set
    modules_to_save: str = Field("", exclude_if=lambda v: not v)
    # PEFT target_modules beyond the layers' linears (hf): "embed_tokens" (lora.Embedding)
    lora_embedding: bool = Field(False, exclude_if=lambda v: not v)
    # ... and "lm_head" (PEFT's lora.Linear on the output head). Left out of dumps when off
    lora_head: bool = Field(False, exclude_if=lambda v: not v)
    # the megatron profile's hidden and attention dropout probability; None: the stack's
    # default (Megatron's 0.1; the reference and hf profiles model no dropout: 0 only)
    dropout: float | None = Field(None, ge=0.0, lt=1.0)
    # the megatron profile's MoE token dispatcher; None: Megatron's allgather (megatron only)
    moe_dispatcher: Literal["allgather", "alltoall"] | None = None
    # Megatron-LM's --deterministic-mode (megatron profile): torch.use_deterministic_algorithms,
    # which switches MoE routing and unpermute to index_put_/index_add_ (terms/saved_layers.py),
    # and CUBLAS_WORKSPACE_CONFIG :4096:8 (terms/transients.py `cublas_workspace_bytes`)
    deterministic: bool = False
    cross_entropy_loss_fusion: bool = Field(False, exclude_if=lambda v: not v)  # Megatron
    # Megatron-LM's --transformer-impl (megatron); None: transformer_engine (TE's workspace)
    transformer_impl: Literal["transformer_engine", "local"] | None = None
    # LitGPT's RMSNorm (lightning): None = fp32, as since lit-gpt 6178c7cc (terms/saved_layers.py)
    litgpt_norm: Literal["fp32", "input"] | None = None
    chunked_ce: int = Field(1, ge=1, le=65_536)  # cross entropy in N chunks (terms/lowmem.py)
    activation_offload: bool = False  # saved activations to pinned host memory
    # quantization-aware training: fake-quantized block linears (vramcalc/terms/lowprec.py)
    qat: Literal["none", "int8", "int4"] = "none"
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (allocator.py); None: the stack's launcher
    expandable_segments: bool | None = None
    # torchtune's optimizer_in_bwd: per-parameter steps in backward (terms/optim_in_bwd.py)
    optimizer_in_backward: bool = Field(False, exclude_if=lambda v: not v)
    # torchtune's `compile: True`: each layer and the loss compiled (terms/torchtune.py)
    compile: bool = Field(False, exclude_if=lambda v: not v)
    # torchtune's `dataset.packed: True`: full packs of seq_len tokens with input_pos and a
    # document mask (terms/packed.py), "flex" or "dense" by the GPU (Scenario.resolved)
    packed: bool = Field(False, exclude_if=lambda v: not v)
    packed_mask: Literal["flex", "dense"] | None = Field(None, exclude_if=lambda v: v is None)
    # torchtitan, dumped if on: --float8.enable_float8_linear, .enable_fsdp_float8_all_gather
    # (terms/float8_fsdp.py), --experimental.enable_async_tensor_parallel (torchtitan_tp.py)
    float8: bool = Field(False, exclude_if=lambda v: not v)
    float8_all_gather: bool = Field(False, exclude_if=lambda v: not v)
    async_tp: bool = Field(False, exclude_if=lambda v: not v)
    # QLoRA's 4-bit implementation and release (vramcalc/qlora.py; None = bitsandbytes, current,
    # double-quantized, head unquantized), stack releases (terms/unsloth.py, terms/torchtune.py)
    qlora_impl: Literal["bnb", "torchao"] | None = Field(None, exclude_if=lambda v: v is None)
    bnb_version: str | None = Field(None, exclude_if=lambda v: v is None)
    torchao_version: str | None = Field(None, exclude_if=lambda v: v is None)
    unsloth_version: str | None = Field(None, exclude_if=lambda v: v is None)
    torchtune_version: str | None = Field(None, exclude_if=lambda v: v is None)
    nf4_double_quant: bool | None = Field(None, exclude_if=lambda v: v is None)
    quantize_head: bool = Field(False, exclude_if=lambda v: not v)
    # how the model is loaded and prepared before the first step (vramcalc/terms/load.py);
    # "none": the load phase is not modelled
    load: Literal["none", "hf", "hf-fp32", "torchtune", "meta"] = Field(
        "none", exclude_if=lambda v: v == "none")

    @model_validator(mode="after")
    def _qlora_layout_valid(self) -> TrainingConfig:
        for name in ("bnb_version", "torchao_version", "unsloth_version", "torchtune_version",
                     "torch_version", "transformers_version"):
            text = getattr(self, name)
            if text is not None:
                try:
                    parse_version(text)
                except ValueError as err:
                    raise ValueError(f"--{name.replace('_', '-')}: {err}") from None
        if (self.finetune == "peft") != (self.peft_config is not None):
            raise ValueError("--finetune peft and --peft-config FILE go together (the file is "
                             "the PEFT adapter config to trace)")
        if self.finetune == "peft" and self.framework != "hf":
            raise ValueError("--peft-config: PEFT runs on transformers' models: use "
                             "--framework hf")
        if self.qlora_impl == "torchao" and self.nf4_double_quant is False:
            raise ValueError("--no-nf4-double-quant: torchao's NF4Tensor always quantizes its "
                             "scalers (scaler_block_size 256); use --qlora-impl bnb")
        return self

    @property
    def nf4(self) -> NF4Layout:
        """QLoRA's 4-bit layout and release (vramcalc/qlora.py); the torchtune profile's
        default is torchao's NF4Tensor (torchtune's QLoRA builders use torchao's
        `to_nf4`/`linear_nf4`)."""
        impl = self.qlora_impl or ("torchao" if self.framework == "torchtune" else None)
        return nf4_layout(impl, self.bnb_version, self.torchao_version, self.nf4_double_quant,
                          self.quantize_head, "fp16" if self.framework == "lightning" else None)
    # zero_grad(set_to_none=...) between steps. False keeps the zeroed gradients allocated
    # through the next forward: torch < 2.0's default (pytorch/pytorch#92731 made True the
    # default), e.g. HF Trainer's `model.zero_grad()` on torch 1.x. One GPU or DDP
    # (vramcalc/terms/gradients.py `gradients_persistent`); left out of dumps when True
    set_to_none: bool = Field(True, exclude_if=lambda v: v)
    # the PyTorch release of the run (None: a current one): `softmax_keeps_input` (< 1.11),
    # `eager_module_loading` (< 1.13); left out of dumps when None
    torch_version: str | None = Field(None, exclude_if=lambda v: v is None)
    # an hf run's transformers release (None: 5.x): hf_stack.copies_shifted_logits
    transformers_version: str | None = Field(None, exclude_if=lambda v: v is None)
    # report the memory right after the model is loaded (the load phase alone, --load-only)
    load_only: bool = Field(False, exclude_if=lambda v: not v)

    @property
    def softmax_keeps_input(self) -> bool:
        """torch < 1.11: softmax's and log_softmax's autograd nodes keep their input as well
        as their output (the formula `_softmax_backward_data(grad, result, dim, self)`,
        pytorch/pytorch#64000; pytorch/pytorch#66018 passes the input's dtype instead, first
        released in 1.11: transformers v4.20.0 pytorch_utils.py `softmax_backward_data`
        passes the input tensor when `is_torch_less_than_1_11`)."""
        return self.torch_version is not None and parse_version(self.torch_version) < (1, 11, 0)

    @property
    def eager_module_loading(self) -> bool:
        """torch < 1.13: CUDA_MODULE_LOADING is left unset, so the CUDA runtime loads every
        kernel of the libraries at context creation (pytorch/pytorch#86509 sets it to LAZY
        from 1.13; CUDA enables lazy loading by default only from 12.2, NVIDIA CUDA
        Programming Guide §4.7 "Lazy Loading")."""
        return self.torch_version is not None and parse_version(self.torch_version) < (1, 13, 0)

    @property
    def reentrant(self) -> bool:
        """Whether HF gradient checkpointing runs torch's reentrant checkpoint: as
        --use-reentrant says; else under --kbit-prepare yes (PEFT passes
        gradient_checkpointing_kwargs={} and torch.utils.checkpoint falls back to
        use_reentrant=True when none is given), else the release's (`trainer_defaults`)."""
        if self.use_reentrant is not None:
            return self.use_reentrant
        if self.framework == "unsloth":  # UnslothCheckpointFunction re-runs as reentrant
            return self.recompute == "full"
        return (self.kbit_prepare or trainer_defaults(self)[1]) and self.recompute == "full"

    @model_validator(mode="after")
    def _hf_stack_modelled(self) -> TrainingConfig:
        problem = hf_stack_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _impl_exists(self) -> TrainingConfig:
        if self.optimizer_impl == "hf-loop":
            return self
        if self.optimizer_impl not in (None, *_IMPLS_OF.get(self.optimizer, ("foreach",))):
            raise ValueError(f"--optimizer-impl {self.optimizer_impl}: {self.optimizer} has no "
                             f"{self.optimizer_impl} implementation (only "
                             f"{', '.join(_IMPLS_OF.get(self.optimizer, ('foreach',)))})")
        return self

    @model_validator(mode="after")
    def _dropout_modelled(self) -> TrainingConfig:
        if self.dropout and self.framework != "megatron":
            raise ValueError(f"--dropout {self.dropout}: only the megatron profile models "
                             f"dropout masks; the {self.framework} profile models dropout off "
                             "(give --dropout 0 or leave it out, or use --framework megatron)")
        return self

    @model_validator(mode="after")
    def _lightning_head(self) -> TrainingConfig:
        # LitGPT chunks its head and loss itself (lm_head_chunk_size=128, vramcalc/terms/
        # logits.py); torchtune's chunked loss is another mechanism
        if self.framework == "lightning" and self.chunked_ce != 1:
            raise ValueError(f"--chunked-ce {self.chunked_ce}: the lightning profile chunks "
                             "its head by 128 tokens as LitGPT does (leave --chunked-ce out)")
        return self

    @model_validator(mode="after")
    def _dispatcher_modelled(self) -> TrainingConfig:
        if self.moe_dispatcher is not None and self.framework != "megatron":
            raise ValueError(f"--moe-dispatcher {self.moe_dispatcher}: only the megatron "
                             "profile models Megatron-LM's token dispatchers; the "
                             f"{self.framework} profile routes tokens its own way (leave it "
                             "out, or use --framework megatron)")
        return self

    @model_validator(mode="after")
    def _packed_mask_needs_packing(self) -> TrainingConfig:
        if self.packed_mask is not None and not self.packed:
            raise ValueError(f"packed_mask {self.packed_mask}: only with --packed")
        return self

    @model_validator(mode="after")
    def _deterministic_modelled(self) -> TrainingConfig:
        for name in ("transformer_impl", "cross_entropy_loss_fusion"):
            if getattr(self, name) and self.framework != "megatron":
                raise ValueError(f"--{name.replace('_', '-')} (Megatron-LM's option) needs "
                                 "--framework megatron")
        if self.deterministic and self.framework != "megatron":
            raise ValueError("--deterministic: only the megatron profile models what "
                             "deterministic algorithms keep (Megatron-LM's MoE index_add_ "
                             f"path); the {self.framework} profile does not (leave it out, or "
                             "use --framework megatron)")
        return self

    @model_validator(mode="after")
    def _optimizer_in_backward_modelled(self) -> TrainingConfig:
        if self.optimizer_in_backward:
            problem = optimizer_in_backward_problem(self)
            if problem:
                raise ValueError(problem)
        return self

    @property
    def selective_kind(self) -> str | int:
        """What `--recompute selective` recomputes: the attention core ("core"), torchtitan's
        per-op SAC ("op"), or every N-th block whole (torchtitan's selective_ac_option N)."""
        if self.framework != "torchtitan":
            return "core"
        return self.recompute_every if self.recompute_every is not None else "op"

    @property
    def expandable(self) -> bool:
        """Whether the caching allocator runs with expandable segments: as given, else the
        stack's launcher — torchtitan's run_llama_train.sh sets
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True" (pytorch/torchtitan 9dec370);
        the others leave torch's default, off."""
        if self.expandable_segments is not None:
            return self.expandable_segments
        return self.framework == "torchtitan"

    @property
    def dispatcher(self) -> str:
        """The megatron profile's MoE token dispatcher: as given, else Megatron's default."""
        return self.moe_dispatcher or MEGATRON_DEFAULT_DISPATCHER

    @model_validator(mode="after")
    def _recompute_method_modelled(self) -> TrainingConfig:
        method, n = self.recompute_method, self.recompute_num_layers
        if method is None and n is None:
            return self
        given = (f"--recompute-method {method}" if method is not None
                 else f"--recompute-num-layers {n}")
        if self.framework != "megatron":
            raise ValueError(f"{given}: only the megatron profile models Megatron-LM's "
                             f"recompute method; the {self.framework} profile checkpoints every "
                             "layer (use --framework megatron, or leave it out)")
        if self.recompute != "full":
            raise ValueError(f"{given}: needs --recompute full (Megatron-LM allows a recompute "
                             "method only with --recompute-granularity full)")
        if method is None or n is None:
            raise ValueError(f"{given}: give --recompute-method uniform|block and "
                             "--recompute-num-layers N together (Megatron-LM requires both "
                             "with full recompute)")
        return self

    @model_validator(mode="after")
    def _recompute_every_modelled(self) -> TrainingConfig:
        if self.recompute_every is None:
            return self
        given = f"--recompute-every {self.recompute_every}"
        if self.framework != "torchtitan":
            raise ValueError(f"{given}: only the torchtitan profile models torchtitan's "
                             "per-layer selective checkpointing (use --framework torchtitan, "
                             "or leave it out)")
        if self.recompute != "selective":
            raise ValueError(f"{given}: needs --recompute selective (torchtitan's "
                             "activation_checkpoint.mode = 'selective' with "
                             "selective_ac_option = N)")
        return self

    @model_validator(mode="after")
    def _stack_modelled(self) -> TrainingConfig:
        problem = (unsloth_training_problem(self) or torchtune_training_problem(self)
                   or lightning_training_problem(self) or (torchtitan_training_problem(self)
                                                           if self.framework == "torchtitan"
                                                           else None))
        if problem:
            raise ValueError(problem)
        return self

    @field_validator("modules_to_save", mode="before")
    @classmethod
    def _canonical_modules(cls, value: object) -> str:
        return parse_modules_to_save(value)

    @field_validator("lora_targets", mode="before")
    @classmethod
    def _canonical_targets(cls, value: object) -> str:
        return parse_targets(value)

    # ---- precision policy ---------------------------------------------
    @property
    def step_impl(self) -> str:
        """The optimizer step's implementation: as given, else the stack's default. HF
        Trainer steps AdamW as --hf-optim says (HF_OPTIMS), else as the release's
        `TrainingArguments.optim` (hf_stack.trainer_defaults: fused from transformers 4.54
        with torch >= 2.8); else PyTorch's CUDA default, foreach (`_default_to_fused_or_foreach`)."""
        if self.optimizer_impl is not None:
            return self.optimizer_impl
        if self.hf_optim is not None or (self.framework == "hf" and self.optimizer == "adamw"):
            return HF_OPTIMS[self.hf_optim or trainer_defaults(self)[0]]
        # torchtitan 9dec370 `build_optimizers`: --optimizer.fused (default False);
        # torchtune's configs build torch.optim.AdamW with `fused: True` from 0.3.1 (cca50f0)
        tune = self.framework == "torchtune" and not torchtune_before(self, TORCHTUNE_0_3_1)
        fused = (self.framework == "hf" or tune) and self.optimizer == "adamw"
        return "fused" if fused else "foreach"

    @property
    def weight_dtype(self) -> str:
        return WEIGHT_DTYPE[self.precision]

    @property
    def trainable_dtype(self) -> str:
        """Dtype of the trained parameters: the weights, or the adapters when fine-tuning
        (PEFT upcasts 16-bit adapters to fp32 for the hf profile; vramcalc/finetune.py)."""
        if self.finetune == "full":
            return self.weight_dtype
        return self.adapter_dtype

    @property
    def adapter_dtype(self) -> str:
        """The adapters' dtype (vramcalc/finetune.py's module docstring)."""
        return adapter_dtype(self.framework, self.weight_dtype, self.adapters_16bit)

    @property
    def grad_dtype(self) -> str:
        return self.trainable_dtype

    @property
    def compute_dtype(self) -> str:
        return COMPUTE_DTYPE[self.precision]

    @property
    def has_master_weights(self) -> bool:
        """An fp32 master copy kept by the optimizer (16-bit weights + fp32 update)."""
        return self.precision in ("bf16", "fp16", "fp8") and self.trainable_dtype != "fp32"

    @property
    def is_autocast(self) -> bool:
        """fp32 weights under torch.autocast (amp-*): every matmul casts its weights."""
        return self.precision.startswith("amp-")

    @property
    def autocast_16bit(self) -> bool:
        """torch.autocast over 16-bit weights (bf16-autocast, fp16-autocast): only the trained
        fp32 adapters and what PEFT upcasts for them are cast."""
        return self.precision.endswith("-autocast")

    @property
    def runs_autocast(self) -> bool:
        """The forward runs under torch.autocast (either kind above)."""
        return self.is_autocast or self.autocast_16bit

    @property
    def state_dtype(self) -> str:
        """Optimizer state dtype: fp32 unless bf16-pure or asked for."""
        if self.optimizer_dtype:
            return self.optimizer_dtype
        # torch's optimizers keep states in the parameter's dtype
        pure = self.precision in ("bf16-pure", "bf16-autocast")
        return "bf16" if pure and self.trainable_dtype == "bf16" else "fp32"
