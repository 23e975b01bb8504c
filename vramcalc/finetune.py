"""Fine-tuning methods: which tensors train, the adapters LoRA/DoRA add, QLoRA's NF4 layout,
the shapes of one rank under a parameter-efficient method (the per-rank shapes layer,
below the memory terms).

`--finetune` (TrainingConfig.finetune):

| method | base weights                         | trainable                         | source |
|--------|--------------------------------------|-----------------------------------|--------|
| full   | policy weight dtype, trainable       | every parameter                   | |
| lora   | policy weight dtype, frozen          | A (r × in), B (out × r) per targeted linear | Hu et al. 2021; PEFT `LoraConfig` |
| qlora  | layer linears NF4 (block 64, double-quantized absmax), the rest frozen in the policy dtype | as lora | Dettmers et al. 2023; bitsandbytes `Params4bit` |
| dora   | as lora                              | as lora + magnitude (out) per targeted linear | Liu et al. 2024; PEFT `use_dora=True` |

Frozen tensors have no gradients and no optimizer states. The adapters' dtype depends on the
profile: `hf` follows PEFT's `get_peft_model(..., autocast_adapter_dtype=True)` default,
which upcasts bf16/fp16 adapters to fp32 (peft/tuners/tuners_utils.py `cast_adapter_dtype`),
so under a 16-bit policy they are fp32 parameters with fp32 gradients and no master copy
(`--adapters-16bit` keeps them in the model's dtype: `autocast_adapter_dtype=False`, or
TRL's SFTTrainer, which casts a quantized model's trained parameters to bf16,
huggingface/trl f2cd5771 `sft_trainer.py` `if _is_quantized_model: ...
p.data.to(torch.bfloat16)`);
`unsloth` does the same (unsloth_zoo/training_utils.py `prepare_model_for_training`, at
ce232d6c: `float32_mixed_precision=True` by default casts every trainable parameter to
fp32 for a bf16 or fp16 model); `reference` keeps them in the policy's weight dtype (torchtune's choice: the whole model,
adapters included, in the training dtype). Under tensor parallelism the adapters are split
with their base, as Megatron-style parallel LoRA does (PEFT tuners/lora/tp_layer.py
`LoraParallelLinear`; NeMo's ParallelLinearAdapter likewise): column-parallel bases (q, k,
v, gate, up) keep A (r × in) whole on every rank and split B (out/t × r); row-parallel bases
(o, down) split A (r × in/t) and keep B (out × r) whole. Per rank and adapted linear:
r·(in + out/t) or r·(in/t + out).

QLoRA storage per quantized tensor of n elements: packed 4-bit codes (⌈n/2⌉ uint8) plus
quantization constants, per implementation and release (bitsandbytes with or without double
quantization, torchao's NF4Tensor): the table in vramcalc/qlora.py.

Which tensors are quantized: every linear weight inside the transformer layers (attention
projections, MLP and expert matrices); the embedding, norms, biases, router and lm_head stay
in the policy's dtype (transformers keeps the output embedding out of bitsandbytes,
`get_keys_to_not_convert`) unless --quantize-head (Lightning's BitsandbytesPrecision,
lightning 71aed751 fabric/plugins/precision/bitsandbytes.py, swaps every `torch.nn.Linear`
while the model is built, with no module ignored unless `ignore_modules` is given).

Paged optimizers (bitsandbytes `is_paged=True`) keep the states of tensors with at least
1e5 elements in CUDA unified memory (`Optimizer8bit.get_state_buffer`):
device memory the PyTorch allocator does not see (nvidia-smi does), which the driver evicts to
host RAM under memory pressure (vramcalc.terms.optimizer_states `paged_state_bytes`).

Everything here is pure and torch-free; the tensor lists are cached per (spec, layout,
method) because the planner estimates thousands of scenarios.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from vramcalc.errors import InputError
from vramcalc.lora_targets import ALL_LINEAR, TARGETS
from vramcalc.model import ModelSpec
from vramcalc.model_tensors import param_tensors
from vramcalc.parallel import ParallelConfig
from vramcalc.peft_file import analytic_refusal
from vramcalc.peft_moe import (
    adapts_shared_expert_gate,
    check_expert_lora,
    converted_letters,
    expert_adapters,
    mlp_names,
    wrapped_parameters,
)
from vramcalc.qlora import (  # noqa: F401  (re-exported: the NF4 layout constants)
    NF4_BLOCK,
    NF4_CODE_ELEMS,
    NF4_SCALER_BLOCK,
    NF4_STATE2_CODE_ELEMS,
    NF4Layout,
    dequant_transient_bytes,
    nf4_constant_bytes,
    nf4_gathered_constant_bytes,
    nf4_tensor_bytes,
)
from vramcalc.sharding import RankShapes, RankTensor, _rank_shapes, pipeline_chunks
from vramcalc.training import TrainingConfig
from vramcalc.units import DTYPE_BITS, ceil_div

DEFAULT_RANK = 8  # peft LoraConfig.r default

NF4_ABSMAX_BLOCK = NF4_SCALER_BLOCK  # double quantization of the absmax (quantize_blockwise)


class Rank(Protocol):
    """What the shape functions read of a rank (vramcalc.rank.RankContext has it)."""

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def training(self) -> TrainingConfig: ...

    @property
    def parallel(self) -> ParallelConfig: ...

    @property
    def stage(self) -> int: ...


# ---- which linears, which tensors --------------------------------------------------------
def _mlp_prefixes() -> tuple[str, ...]:
    return ("mlp.", "shared_expert.")


def target_param_names(spec: ModelSpec, targets: str) -> frozenset[str]:
    """Parameter names (vramcalc.model.param_tensors) of the linears that get adapters.

    Routed experts are never named here (transformers 5 keeps them as fused 3-D parameters;
    where PEFT wraps those, vramcalc/peft_moe.py adds their adapters); shared experts and
    dense MLPs are."""
    gated = spec.mlp_kind == "gated"
    present = {p.name for p in param_tensors(spec)}
    wanted = set(TARGETS) if targets == ALL_LINEAR else set(targets.split(","))
    if not gated and "gate" in wanted and targets != ALL_LINEAR:
        raise InputError(f"--lora-targets: {spec.name} has a 2-matrix MLP (no gate); "
                         "target up (fc) and down (proj) instead")
    names: set[str] = set()
    for t in ("q", "k", "v", "o"):
        if t in wanted:
            names.add(f"attn.{t}_proj.weight")
    mats = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"} if gated else {
        "up": "fc", "down": "proj"}
    for t, mat in mats.items():
        if t in wanted:
            names.update(f"{p}{mat}.weight" for p in _mlp_prefixes())
    return frozenset(names & present)


def peft_adapted_linears(spec: ModelSpec, targets: str, framework: str, method: str,
                         transformers_version: str | None) -> tuple[str, ...]:
    """`adapted_linears` less the MLP letters PEFT moves to a MoE model's expert
    parameters (vramcalc/peft_moe.py `converted_letters`)."""
    gone = converted_letters(spec, framework, method, targets, transformers_version)
    return tuple(t for t in adapted_linears(spec, targets, framework) if t not in gone)


# Fused projections of the hf profile (transformers' modelling code): PEFT adapts the fused
# module named in a target list, one adapter per module (GPT-2: c_attn = q, k, v as one
# Conv1D h → 3h; Phi-3: qkv_proj h → (a + 2g)·d and gate_up_proj h → 2f). PEFT's own defaults
# are ["c_attn"] and ["qkv_proj"] (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
FUSED_QKV = ("q", "k", "v")
FUSED_GATE_UP = ("gate", "up")


def fused_family(spec: ModelSpec, framework: str) -> str | None:
    """'gpt2' or 'phi3' when the hf profile builds this model with fused projections
    (vramcalc.terms.saved.hf_family), else None (encoders: separate q, k, v)."""
    if framework != "hf" or spec.is_encoder or spec.is_encoder_decoder:
        return None
    if spec.norm_kind == "layernorm" or spec.mlp_kind == "standard":
        return "gpt2"
    if (spec.model_type == "phi3" and not spec.is_moe
            and not (spec.attention_bias or spec.qk_norm)):
        return "phi3"
    return None


def fused_groups(spec: ModelSpec, framework: str) -> dict[str, tuple[str, ...]]:
    """Fused module → the target letters it covers, for this model under `framework`."""
    fam = fused_family(spec, framework)
    if fam == "gpt2":
        return {"qkv": FUSED_QKV}
    if fam == "phi3":
        return {"qkv": FUSED_QKV, "gate_up": FUSED_GATE_UP}
    return {}


def module_param_count(spec: ModelSpec, framework: str, shapes: RankShapes) -> int:
    """Parameter tensors of these shapes as the framework's modules register them, i.e.
    what a per-parameter optimizer state (a fused optimizer's step count) is kept for.
    vramcalc lists every projection on its own; under the hf profile GPT-2's `c_attn` and
    Phi-3's `qkv_proj` hold q, k and v in one weight (and one bias), Phi-3's `gate_up_proj`
    gate and up, and transformers 5 keeps each MoE layer's routed experts as two 3-D
    parameters, `gate_up_proj` and `down_proj` (modeling_mixtral.py / modeling_qwen2_moe.py
    `*Experts`)."""
    n = sum(t.count for t in shapes.tensors)
    dense = shapes.num_layers - shapes.num_moe_layers
    for name, letters in fused_groups(spec, framework).items():
        bias = spec.attention_bias if name == "qkv" else spec.mlp_bias
        layers = shapes.num_layers if name == "qkv" else dense
        n -= (len(letters) - 1) * (2 if bias else 1) * layers
    if framework == "hf" and shapes.num_moe_layers:
        experts = sum(t.count for t in shapes.tensors if t.is_expert)
        n -= experts - 2 * shapes.num_moe_layers
    return n


def _is_quantized(t: RankTensor, framework: str, head: bool = False) -> bool:
    """QLoRA quantizes every linear weight inside the layers (not norms, biases, router),
    and with `head` (--quantize-head: Lightning's BitsandbytesPrecision replaces every
    nn.Linear, lm_head included) the output projection. transformers 5 keeps routed experts
    as fused 3-D parameters, which bitsandbytes' Linear4bit replacement does not touch: under
    the hf profile they stay in the policy's dtype."""
    if t.is_expert and framework == "hf":
        return False
    if head and t.group == "head" and t.rows > 0:
        return True
    return (t.group in ("layer", "expert") and t.rows > 0 and t.name.endswith(".weight")
            and "norm" not in t.name and not t.name.startswith(("router", "shared_expert_gate")))


@dataclass(frozen=True, eq=False)
class FinetuneShapes:
    """One rank's tensors under a parameter-efficient method, split by role."""

    all: RankShapes  # base (frozen) + adapters: what the rank holds
    frozen: RankShapes  # base tensors in the policy's weight dtype
    quantized: RankShapes  # NF4 base tensors (QLoRA), numel = logical elements
    adapters: RankShapes  # trainable adapter tensors (A, B, DoRA magnitude)


def finetune_shapes(spec: ModelSpec, training: TrainingConfig, tp: int,
                    chunks: tuple[tuple[int, ...], ...], ep: int, stage: int) -> FinetuneShapes:
    """The rank's tensors for `training.finetune` (cached; see `_finetune_shapes`)."""
    tr = training
    return _finetune_shapes(spec, tp, chunks, ep, stage, tr.finetune, tr.lora_rank,
                            tr.lora_targets, tr.framework,
                            tr.adapter_dtype,
                            method_quantizes_head(spec, tr), tr.modules_to_save,
                            tr.lora_embedding, tr.lora_head,
                            wrapped_parameters(spec, tr.framework, tr.finetune,
                                               tr.lora_targets, tr.transformers_version),
                            converted_letters(spec, tr.framework, tr.finetune,
                                              tr.lora_targets, tr.transformers_version),
                            adapts_shared_expert_gate(spec, tr.framework, tr.finetune,
                                                      tr.lora_targets))


def method_quantizes_head(spec: ModelSpec, training: TrainingConfig) -> bool:
    """QLoRA with --quantize-head; InputError for a tied head (an nn.Embedding's weight,
    which no 4-bit linear replaces)."""
    if training.finetune != "qlora" or not training.quantize_head:
        return False
    if spec.tie_word_embeddings:
        raise InputError(f"--quantize-head: {spec.name} ties lm_head to the embedding, which "
                         "stays unquantized; leave --quantize-head out")
    return True


@lru_cache(maxsize=2048)
def _finetune_shapes(spec: ModelSpec, tp: int, chunks: tuple[tuple[int, ...], ...], ep: int,
                     stage: int, method: str, rank: int, targets: str, framework: str,
                     a_dtype: str, head: bool = False, saved_modules: str = "",
                     lora_embedding: bool = False, lora_head: bool = False,
                     wrapped: tuple[str, ...] = (), converted: frozenset[str] = frozenset(),
                     shared_gate: bool = False) -> FinetuneShapes:
    base = _rank_shapes(spec, tp, chunks, ep, stage)
    # PEFT's ModulesToSaveWrapper (peft 0.21.2 utils/other.py): the original module frozen,
    # plus a trained `copy.deepcopy` of it under the same parameter name here (its gradient
    # appears where the original's would: the head's first, the embedding's last)
    copies = [dataclasses.replace(t, trainable=True, dtype=a_dtype) for t in base.tensors
              if saved_modules and t.name in (
                  ("lm_head.weight",) if "lm_head" in saved_modules else ()) + (
                  ("embed_tokens",) if "embed_tokens" in saved_modules else ())]
    wanted = target_param_names(spec, targets) - mlp_names(converted)
    # fused modules (hf GPT-2 / Phi-3): the member matrices' names → the fused module's stem
    fused_of: dict[str, str] = {}
    for fused, letters in fused_groups(spec, framework).items():
        prefix = "attn." if fused == "qkv" else "mlp."
        mats = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "gate": "gate_proj",
                "up": "up_proj"}
        for letter in letters:
            fused_of[f"{prefix}{mats[letter]}.weight"] = f"{prefix}{fused}_proj"
    fused_rows: dict[str, list[RankTensor]] = {}
    frozen: list[RankTensor] = []
    quant: list[RankTensor] = []
    adapters: list[RankTensor] = []
    fused_quant: dict[str, list[RankTensor]] = {}
    for t in base.tensors:
        if method == "qlora" and _is_quantized(t, framework, head) and t.name in fused_of:
            # bitsandbytes quantizes the fused module's weight: one NF4 tensor (one set of
            # quantization constants) for q, k, v (gate, up) together
            fused_quant.setdefault(fused_of[t.name], []).append(t)
        elif method == "qlora" and _is_quantized(t, framework, head):
            # bitsandbytes stores the packed codes as a (⌈n/2⌉, 1) tensor (quantize_4bit), so
            # ZeRO-3/FSDP shard its dim 0 of n/2 bytes, not the logical (out, in) rows
            packed_rows = t.numel // 2 if t.numel % 2 == 0 else 0
            quant.append(dataclasses.replace(t, trainable=False, dtype="nf4", rows=packed_rows))
        else:
            frozen.append(dataclasses.replace(t, trainable=False))
        if t.name not in fused_of and t.name not in wanted:
            continue
        if t.name in fused_of:  # one adapter for the fused module if any member is targeted
            fused_rows.setdefault(fused_of[t.name], []).append(t)
            continue
        # The adapters follow the base's tensor-parallel split (PEFT tuners/lora/tp_layer.py
        # LoraParallelLinear, Megatron backend): a column-parallel base (q, k, v, gate, up)
        # keeps A (r × in) whole and B (out/t × r) split with it; a row-parallel base (o, down)
        # splits A (r × in/t) and keeps B (out × r) whole. Both are the base's local shape.
        out_f, in_f = t.rows, t.numel // t.rows
        stem = t.name[: -len(".weight")]
        adapters.append(RankTensor(name=f"{stem}.lora_A", numel=rank * in_f, count=t.count,
                                   group=t.group, rows=rank, dtype=a_dtype))
        adapters.append(RankTensor(name=f"{stem}.lora_B", numel=out_f * rank, count=t.count,
                                   group=t.group, rows=out_f, dtype=a_dtype))
        if method == "dora":
            adapters.append(RankTensor(name=f"{stem}.lora_magnitude", numel=out_f,
                                       count=t.count, group=t.group, dtype=a_dtype))

    for stem, members in fused_quant.items():
        n = sum(m.numel for m in members)
        quant.append(RankTensor(name=f"{stem}.weight", numel=n, count=members[0].count,
                                group=members[0].group, rows=n // 2 if n % 2 == 0 else 0,
                                trainable=False, dtype="nf4"))
    for stem, members in fused_rows.items():
        if not any(m.name in wanted for m in members):
            continue
        # A: r × in (the members share their input), B: (Σ member rows) × r — PEFT's
        # lora_A / lora_B of the fused module (out = 3h for c_attn, (a + 2g)·d for qkv_proj)
        first = members[0]
        in_f, out_f = first.numel // first.rows, sum(m.rows for m in members)
        adapters.append(RankTensor(name=f"{stem}.lora_A", numel=rank * in_f,
                                   count=first.count, group=first.group, rows=rank,
                                   dtype=a_dtype))
        adapters.append(RankTensor(name=f"{stem}.lora_B", numel=out_f * rank,
                                   count=first.count, group=first.group, rows=out_f,
                                   dtype=a_dtype))
        if method == "dora":
            adapters.append(RankTensor(name=f"{stem}.lora_magnitude", numel=out_f,
                                       count=first.count, group=first.group, dtype=a_dtype))

    def shapes(ts: list[RankTensor]) -> RankShapes:
        return RankShapes(tensors=tuple(ts), num_layers=base.num_layers,
                          num_moe_layers=base.num_moe_layers)

    adapters += copies + expert_adapters(base, spec, rank, a_dtype, wrapped, method, shared_gate)
    lm = next((t for t in base.tensors if t.name == "lm_head.weight" and t.count), None)
    if lora_head and lm is not None:  # PEFT's lora.Linear: A (r, h), B (V, r)
        adapters += [RankTensor(name="lm_head.lora_A", numel=rank * (lm.numel // lm.rows),
                                count=1, group="head", rows=rank, dtype=a_dtype),
                     RankTensor(name="lm_head.lora_B", numel=lm.rows * rank, count=1,
                                group="head", rows=lm.rows, dtype=a_dtype)]
    emb = next((t for t in base.tensors if t.name == "embed_tokens" and t.count), None)
    if lora_embedding and emb is not None:
        # PEFT's lora.Embedding (peft 0.21.2 tuners/lora/layer.py `Embedding.update_layer`):
        # lora_embedding_A (r, V), lora_embedding_B (h, r), upcast like the other adapters
        vocab, h = emb.rows, emb.numel // emb.rows
        adapters += [RankTensor(name="embed_tokens.lora_embedding_A", numel=rank * vocab,
                                count=1, group="embedding", rows=rank, dtype=a_dtype),
                     RankTensor(name="embed_tokens.lora_embedding_B", numel=h * rank,
                                count=1, group="embedding", rows=h, dtype=a_dtype)]
    return FinetuneShapes(all=shapes(frozen + quant + adapters), frozen=shapes(frozen),
                          quantized=shapes(quant), adapters=shapes(adapters))


def check_finetune(ctx: Rank) -> None:
    """Refuse what the fine-tuning model does not cover (InputError): the megatron profile
    (Korthikanti et al.'s formula has no frozen layers). The hf profile's fused projections
    (GPT-2's c_attn, Phi-3's qkv_proj and gate_up_proj) get one adapter per fused module,
    as PEFT gives them (`fused_groups`)."""
    tr = ctx.training
    if tr.finetune == "peft":
        raise analytic_refusal()
    check_expert_lora(ctx.spec, tr.framework, tr.finetune, tr.lora_targets, tr.lora_dropout,
                      tr.transformers_version)
    if tr.framework == "megatron":
        raise InputError(f"--finetune {tr.finetune}: the megatron profile models full training "
                         "only; use --framework reference or hf")
    if tr.modules_to_save and ctx.spec.tie_word_embeddings:
        raise InputError(f"--modules-to-save {tr.modules_to_save}: {ctx.spec.name} ties its "
                         "embedding and head (one shared weight); copies of tied modules are "
                         "not modelled")
    if (tr.lora_embedding or tr.lora_head) and ctx.spec.tie_word_embeddings:
        raise InputError(f"--lora-embedding / --lora-head: {ctx.spec.name} ties its embedding "
                         "and head; an adapter on the shared weight is not modelled")
    if (tr.modules_to_save or tr.lora_embedding or tr.lora_head) and (
            ctx.parallel.tp > 1 or ctx.parallel.pp > 1):
        raise InputError("--modules-to-save / --lora-embedding / --lora-head: modelled "
                         "without tensor or pipeline parallelism")


def shapes_for(ctx: Rank) -> FinetuneShapes:
    """FinetuneShapes of a rank (vramcalc.rank.RankContext); InputError for what
    `check_finetune` refuses."""
    check_finetune(ctx)
    par = ctx.parallel
    return finetune_shapes(ctx.spec, ctx.training, par.tp, pipeline_chunks(ctx.spec, par),
                           par.ep, ctx.stage)


def adapted_linears(spec: ModelSpec, targets: str, framework: str) -> tuple[str, ...]:
    """The linears of one layer that carry an adapter, as the framework builds them: target
    letters, with the hf profile's fused modules ('qkv', 'gate_up') replacing their members
    (one adapter for the fused module when any member is targeted)."""
    letters = targeted_linears(spec, targets)
    out: list[str] = []
    groups = fused_groups(spec, framework)
    done: set[str] = set()
    for t in letters:
        fused = next((f for f, members in groups.items() if t in members), None)
        if fused is None:
            out.append(t)
        elif fused not in done:
            done.add(fused)
            out.append(fused)
    return tuple(out)


def targeted_linears(spec: ModelSpec, targets: str) -> tuple[str, ...]:
    """Target letters present in one layer of this model (q, k, v, o, gate, up, down)."""
    names = target_param_names(spec, targets)
    out = []
    for t in TARGETS:
        if t in ("q", "k", "v", "o"):
            hit = f"attn.{t}_proj.weight" in names
        else:
            mat = {"gate": ("gate_proj",), "up": ("up_proj", "fc"), "down": ("down_proj", "proj")}[t]
            hit = any(f"{p}{m}.weight" in names for m in mat for p in _mlp_prefixes())
        if hit:
            out.append(t)
    return tuple(out)


# ---- ZeRO-3 / FSDP: what one gathered layer holds ----------------------------------------
def _per_layer_copies(t: RankTensor, n_layers: int, n_moe: int) -> int:
    """Copies of tensor `t` in one layer (its count is over the stage's layers)."""
    if t.name.startswith(("experts.", "router", "shared_expert")):
        return t.count // max(n_moe, 1)
    if t.name.startswith("mlp."):
        return t.count // max(n_layers - n_moe, 1)
    return t.count // max(n_layers, 1)


def _layer_tensors(shapes: RankShapes) -> list[tuple[RankTensor, int]]:
    """(tensor, copies) of one transformer layer of this rank: the MoE layer when the rank
    has any (the larger), else a dense one (as vramcalc.sharding.layer_param_numels)."""
    n_layers, n_moe = shapes.num_layers, shapes.num_moe_layers
    out = []
    for t in shapes.tensors:
        if t.group not in ("layer", "expert") or (n_moe and t.name.startswith("mlp.")):
            continue
        if not n_moe and t.name.startswith(("experts.", "router", "shared_expert")):
            continue
        copies = _per_layer_copies(t, n_layers, n_moe)
        if copies:
            out.append((t, copies))
    return out


def gathered_layer_bytes(ctx: Rank, dtype: str) -> tuple[int, ...]:
    """Bytes of each tensor copy of one layer as ZeRO-3 / FSDP all-gathers it under a PEFT
    method: the other frozen tensors and the adapters in `dtype` (the all-gather dtype) —
    except adapters kept in their own dtype when no mixed-precision cast applies — and a
    QLoRA weight as its packed 4-bit data, ⌈n/2⌉ bytes, whatever `dtype` is.

    FSDP + QLoRA (bitsandbytes docs/source/fsdp_qlora.md, Answer.AI's fsdp_qlora, PEFT's
    "FSDP + QLoRA" guide; bitsandbytes `quantize_4bit(quant_storage=...)` allocates
    ((n + 1) // (2·bytes(quant_storage)), 1) elements): the packed codes live in a container
    of the model's float dtype (`bnb_4bit_quant_storage`) so FSDP1/DeepSpeed can flatten and
    shard them with the other parameters; FSDP2 gathers integer parameters without a cast
    (`FSDPParam.init_dtype_attrs`: no param_dtype for non-float tensors) and mixes dtypes in
    a uint8 all-gather. Either way the gathered bytes are the packed bytes: 4× fewer than a
    bf16 weight. The quantization state (absmax, codes) is module metadata outside the
    sharded parameters, whole on every rank (weights/nf4_constants) — but torchao's
    NF4Tensor is the parameter, and FSDP2 gathers its int8 scalers and factors with the
    packed data (`nf4_gathered_constant_bytes`) — and the compute-dtype weight is made per
    matmul by dequantization (a transient, vramcalc/terms/finetune_activations.py), never
    gathered."""
    fs = shapes_for(ctx)
    tr = ctx.training
    a_dt = dtype if tr.is_autocast else tr.adapter_dtype
    quant = {id(t) for t in fs.quantized.tensors}
    adapters = {id(t) for t in fs.adapters.tensors}
    out: list[int] = []
    split = ctx.parallel.engine(tr.framework) == "fsdp2"
    for t, copies in _layer_tensors(fs.all):
        if id(t) in quant:
            nbytes = ceil_div(t.numel * DTYPE_BITS["nf4"], 8) + (
                nf4_gathered_constant_bytes(t.numel, tr.nf4) if split else 0)
        else:
            dt = a_dt if id(t) in adapters else dtype
            nbytes = ceil_div(t.numel * DTYPE_BITS[dt], 8)
        out += [nbytes] * copies
    return tuple(out)


def trained_layer_numels(ctx: Rank) -> tuple[int, ...]:
    """Element counts of the trained (adapter) tensors of one layer on this rank: what
    ZeRO-2/3 and FSDP reduce per layer under a PEFT method (frozen weights get no grads)."""
    fs = shapes_for(ctx)
    out: list[int] = []
    for t, copies in _layer_tensors(fs.adapters):
        out += [t.numel] * copies
    return tuple(out)
