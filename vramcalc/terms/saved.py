"""The saved-tensor vocabulary of the activation terms: one saved storage (`Saved`), a
rank's tensor dimensions (`Dims`), one instant of a layer's backward (`Moment`), and the
hooks a training feature implements to change them (`Modifier`).

Legend (per rank): b = micro-batch, s = sequence length on this rank (÷cp), h = hidden,
a = attention heads ÷tp, g = kv heads ÷tp (at least 1), d = head dim, f = FFN size ÷tp,
V = vocab ÷tp, T = b·s tokens of a (b, s, h) tensor on this rank (÷tp under sequence
parallelism), E = experts, k = experts per token, fe / fs = expert / shared-expert FFN,
C = ⌈capacity_factor·b·s·k/E⌉ expert capacity. Dtypes: c = compute dtype, r = the
residual stream's dtype (the weights' dtype: fp32 under autocast, else c). Every saved
tensor is one storage, rounded to the allocator's 512 B; a storage saved by several ops
(a norm's output read by q, k and v) is listed once.

Profiles (the per-layer tables are in docs/saved-tensors.md; the trace engine checks them):
- `reference`: vramcalc's own model (vramcalc/trace/reference_model.py): fused RMSNorm
  (input + fp32 rstd), RoPE before the head transpose, FlashAttention-2 keeping q, k, v,
  output and fp32 logsumexp, eager attention keeping the (b, a, s, s) probabilities.
- `hf`: Hugging Face transformers 5.x: RMSNorm upcasts to fp32 in Python (fp32 input copy,
  normalised copy), RoPE tables in the residual dtype, eager softmax in fp32 kept next to
  its 16-bit copy, fused projections for Phi-3 and GPT-2, grouped_mm experts.
- `megatron`: Korthikanti et al. 2022 (arXiv:2205.05198) Table 2, 16-bit activations and
  1-byte dropout masks (none with `--dropout 0`), FFN 4h generalised to f.

Under autocast (r = fp32, c = 16-bit) every linear casts its fp32 input itself, so a norm
output read by n linears is kept as n 16-bit copies (autocast caches casts of parameters
only; aten/src/ATen/autocast_mode.cpp `cached_cast`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from vramcalc.hardware import GPUProfile
from vramcalc.rank import RankContext
from vramcalc.units import DTYPE_BITS, alloc, ceil_div, round_alloc


@dataclass(frozen=True)
class Saved:
    """One storage kept for backward: element count, dtype, shape and reason (for the docs)."""

    name: str
    numel: int
    dtype: str
    shape: str
    why: str = ""
    count: int = 1  # identical storages (one per expert, say)

    @cached_property  # summed many times per profile
    def nbytes(self) -> int:
        bits = SAVED_BITS[self.dtype]
        return self.count * round_alloc(ceil_div(self.numel * bits, 8))


SAVED_BITS = {**DTYPE_BITS, "int32": 32}


@dataclass(frozen=True)
class Dims:
    """Per-rank tensor dimensions (see the legend)."""

    b: int
    s: int
    h: int
    a: int
    g: int
    d: int
    f: int
    V: int
    sp_div: int  # ÷ for (b, s, h) tensors: tp under sequence parallelism, else 1
    c: str  # compute dtype
    r: str = "bf16"  # residual stream / weight dtype

    @property
    def T(self) -> int:
        """Tokens of a (b, s, h) tensor on this rank."""
        return self.b * ceil_div(self.s, self.sp_div)

    @property
    def N(self) -> int:
        """Rows of a tensor-parallel region's tensors ((b·s, f/t), (b·s, V/t)): every token of
        the micro-batch, also under sequence parallelism, whose all-gather feeds the
        column-parallel linears (Korthikanti et al. 2022 §4.2.2: only the norm and dropout
        regions are split over the sequence)."""
        return self.b * self.s

    @property
    def amp(self) -> bool:
        return self.r != self.c


def dims(ctx: RankContext) -> Dims:
    """The rank's tensor dimensions (memoised on the context: a profile asks a dozen times)."""
    cached = ctx.__dict__.get("_dims")
    if cached is None:
        cached = ctx.__dict__["_dims"] = _dims(ctx)
    return cached


def expert_capacity(ctx: RankContext, tokens: int) -> int:
    """Rows each expert of the reference MoE runs on `tokens` tokens: its capacity slots
    ⌈cf·T·k/E⌉, at least one (vramcalc/trace/reference_model.py `MoE.forward`)."""
    E, k = ctx.spec.num_local_experts, ctx.spec.num_experts_per_tok
    return max(1, -(-int(ctx.parallel.capacity_factor * tokens * k * 1_000_000)
                    // (E * 1_000_000)))


def qlora_fp32_outputs(ctx: RankContext, x: Dims) -> bool:
    """QLoRA under autocast: bitsandbytes' Linear4bit returns its input's dtype
    (`out.to(inp_dtype)`), so 4-bit projections fed by the fp32 residual's norms give fp32
    outputs: the MLP's intermediates and their gradients, a fused qkv, the attention inputs
    a checkpointed core keeps."""
    return ctx.training.finetune == "qlora" and x.amp


def returned_attn_weights(ctx: RankContext, x: Dims) -> int:
    """transformers' eager attention returns its probabilities (`attn_output, attn_weights`)
    and the decoder layer binds them (`hidden_states, _ = self.self_attn(...)`) until it
    returns: a (b, a, s, s) tensor in the query's dtype alive from o_proj through the MLP.
    Without recompute the attention saves that tensor anyway; a checkpointed core or layer
    does not, so it is one more local there."""
    tr = ctx.training
    if (tr.framework != "hf" or tr.attention != "eager" or tr.recompute == "none"
            or ctx.spec.is_encoder):
        return 0
    return alloc(x.b * x.a * x.s * x.s, x.c)


def gpt2_block_attn_output(ctx: RankContext, x: Dims) -> int:
    """transformers' GPT2Block binds the attention's output (`attn_output, _ =
    self.attn(...)`, then `hidden_states = attn_output + residual`) until it returns, and
    nothing saves it: one (T, h) tensor in the compute dtype alive through the MLP, in
    every forward of the layer (a re-run's too)."""
    if ctx.training.framework != "hf" or ctx.spec.is_encoder or hf_family(ctx) != "gpt2":
        return 0
    return alloc(x.T * x.h, x.c)


def autocasts_adapters(ctx: RankContext, x: Dims) -> bool:
    """Whether autocast runs the adapters' matmuls: fp32 weights under autocast (amp, the
    residual in fp32) or 16-bit weights under it (bf16-autocast), where the frozen layer
    computes as without autocast and only the adapters' matmuls cast their fp32 operands."""
    return x.amp or ctx.training.autocast_16bit


def relu_output_is_down_input(ctx: RankContext) -> bool:
    """A 2-matrix relu MLP: relu keeps its output for its own backward
    (`threshold_backward(grad, result)`), the tensor the down projection reads, so that
    tensor stays when the down projection no longer needs it."""
    return ctx.spec.mlp_kind != "gated" and ctx.spec.hidden_act == "relu"


def _dims(ctx: RankContext) -> Dims:
    spec, tr, par = ctx.spec, ctx.training, ctx.parallel
    tp = par.tp
    ffn = spec.expert_ffn if spec.is_moe and spec.num_dense_layers == 0 else spec.intermediate_size
    return Dims(
        b=tr.micro_batch_size,
        s=ceil_div(tr.seq_len, par.cp),
        h=spec.hidden_size,
        a=ceil_div(spec.num_attention_heads, tp),
        g=max(spec.kv_heads // tp, 1),
        d=spec.head_size,
        f=ceil_div(ffn, tp),
        V=ceil_div(spec.vocab_size, tp),
        sp_div=tp if par.sequence_parallel else 1,
        c=tr.compute_dtype,
        # FSDP2's MixedPrecisionPolicy all-gathers parameters in c: no autocast, r = c
        r=tr.compute_dtype if ctx.engine == "fsdp2" else tr.weight_dtype,
    )


def flash_scratch_bytes(b: int, a: int, q: int, d: int) -> int:
    """FlashAttention-2's backward scratch for b·a heads of q queries of width d, both fp32
    (flash_api.cpp mha_bwd; the trace's twin: vramcalc/trace/cuda_rules.py
    `flash_backward_workspace`): softmax_d (b, a, q₁₂₈) and dq_accum (b, q₁₂₈, a, d₃₂), with
    q₁₂₈ = q rounded up to 128 and d₃₂ = d rounded up to 32 (64 above 128)."""
    q128 = ceil_div(q, 128) * 128
    step = 32 if d <= 128 else 64
    d32 = ceil_div(d, step) * step
    return round_alloc(4 * b * a * q128) + round_alloc(4 * b * q128 * a * d32)


def efficient_scratch_bytes(b: int, a: int, q: int, d: int, fp32: bool = False) -> int:
    """The memory-efficient kernel's backward scratch for b·a heads of q queries of width d
    (attention_backward.cu `_efficient_attention_backward`; the trace's twin:
    vramcalc/trace/cuda_rules.py `efficient_backward_workspace`): delta (b, a, q) fp32 and
    the fp32 grad-Q accumulator (b, a, q₆₄, d₆₄) (kernel_backward.h `workspace_size`); fp32
    inputs also the (b, q, a, d) product of d out and out that forms delta."""
    q64, d64 = ceil_div(q, 64) * 64, ceil_div(d, 64) * 64
    return round_alloc(4 * b * a * q) + round_alloc(4 * b * a * q64 * d64) + (
        round_alloc(4 * b * q * a * d) if fp32 else 0)


def repeats_kv_by_copy(x: Dims) -> bool:
    """Whether expanding k and v from g to a heads and merging the head dims makes a copy
    (torchtitan's `repeat_kv`: `expand(...).reshape(...)`; torchtune's attention:
    `expand(...).flatten(1, 2)`): only when 1 < g < a. With one kv head (multi-query) the
    size-1 head dim merges with the stride-0 repeat dim, so the result is a view of the
    (b, s, 1, d) tensor (torch's `reshape`/`flatten` return a view whenever the strides allow
    it) and SDPA keeps that; its backward still makes dk, dv for every head."""
    return 1 < x.g < x.a


def bsh(x: Dims) -> int:
    """Elements of a (b, s, h) tensor on this rank: T·h."""
    return x.T * x.h


def hf_family(ctx: RankContext) -> str:
    """The transformers architecture the hf profile follows (vramcalc/trace/hf_models.py)."""
    spec = ctx.spec
    if spec.norm_kind == "layernorm" or spec.mlp_kind == "standard":
        return "gpt2"
    if spec.is_moe:
        return "mixtral" if not (spec.num_shared_experts or spec.qk_norm) else (
            "qwen2_moe" if spec.num_shared_experts else "qwen3_moe")
    if spec.model_type in ("phi3", "gemma") and not (spec.attention_bias or spec.qk_norm):
        return spec.model_type
    return "llama"


@dataclass(frozen=True)
class Moment:
    """One instant inside a layer's backward: what of the layer is still saved (`held`),
    which of its parameter groups already have gradients (`grads`: "mlp" or "mlp+o") and
    the gradient temporaries alive (`work`)."""

    name: str
    held: int
    work: int
    grads: str


def mostly_moe(ctx: RankContext) -> bool:
    """Whether most of this rank's layers are mixture-of-experts layers (the layer kind the
    per-layer functions describe by default)."""
    return ctx.spec.is_moe and ctx.shapes.num_moe_layers * 2 >= max(ctx.num_layers, 1)


def first_layer_moe(ctx: RankContext) -> bool:
    """Whether the first layer of the model is a mixture-of-experts layer."""
    return ctx.spec.is_moe_layer(0)


class Modifier:
    """A training feature that changes what a rank's layers save and hold (fine-tuning, low
    precision, activation offload, chunked cross entropy: one subclass each, in the module
    named after the feature). vramcalc.terms.modifiers picks the ones that apply to a rank;
    the activation and transient terms call every hook of those, in order. Each hook gets
    the value composed so far (and what it needs of the layer) and returns it; the defaults
    change nothing."""

    name = ""
    # False when the layers' saved tensors leave the device between forward and backward
    keeps_layers_on_device = True

    def applies(self, ctx: RankContext) -> bool:
        """Whether the feature is on for this rank."""
        raise NotImplementedError

    def layer_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        """One layer's saved tensors (not called under full recompute, whose checkpoint
        keeps the layer input only)."""
        return saved

    def checkpoint_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        """One layer's saved tensors under full recompute (the checkpoint's layer input)."""
        return saved

    def head_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        """The last stage's final-norm and lm_head saved tensors."""
        return saved

    def backward_moments(self, ctx: RankContext, moments: list[Moment],
                         saved: list[Saved]) -> list[Moment]:
        """The instants of one layer's backward; `saved` is the layer's saved list without
        recompute (what a recomputed layer holds again while its backward runs)."""
        return moments

    def forward_working_bytes(self, ctx: RankContext, saved: list[Saved],
                              layers_on_device: bool, moe: bool) -> int:
        """A candidate for the worst temporaries of one layer's forward, bytes above the
        micro-batch's saved tensors (the largest candidate counts); `saved` is the saved list
        of a layer of that kind (`moe`: a MoE layer), `layers_on_device` False under
        activation offload."""
        return 0

    def first_layer_gap(self, ctx: RankContext, saved: list[Saved]) -> int:
        """Bytes of `saved` (the first layer's saved list) the first layer of the model does
        not keep."""
        return 0

    def resident_layer_bytes(self, ctx: RankContext, saved: list[Saved]) -> int | None:
        """Bytes of one layer's saved tensors left on the device, when they move off it."""
        return None

    def offloaded_edge_bytes(self, ctx: RankContext) -> int:
        """Embedding-side saved bytes that leave the device with the layers."""
        return 0

    def offloaded_head_bytes(self, ctx: RankContext, head: list[Saved]) -> int:
        """Of the head's saved tensors (`head`), the bytes in host memory."""
        return 0

    def host_bytes(self, ctx: RankContext, saved: list[Saved], in_flight: float) -> int:
        """Host memory for `in_flight` micro-batches of layers saving `saved` each."""
        return 0

    def autocast_cache_layer_bytes(self, ctx: RankContext, cache: int) -> int:
        """Per-layer bytes of the autocast weight casts alive in forward (given the full
        training's)."""
        return cache

    def persistent_parts(self, ctx: RankContext, gpu: GPUProfile | None) -> dict[str, int]:
        """Report sub-terms held for the whole step."""
        return {}
