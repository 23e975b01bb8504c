"""The unsloth profile (`--framework unsloth`): what Unsloth's own code keeps on the device.

Legend as in vramcalc/terms/saved.py; T = b·s tokens, h hidden, V vocabulary, L layers on
the rank, c the compute dtype (bf16; fp16 where the card has no bf16).

Sources: unslothai/unsloth-zoo ce232d6c (`unsloth_zoo/gradient_checkpointing.py`,
`unsloth_zoo/fused_losses/cross_entropy_loss.py`) and unslothai/unsloth 015bdef0
(`unsloth/models/llama.py`, `unsloth/kernels/utils.py`, `unsloth/kernels/fast_lora.py`).

Offloaded gradient checkpointing, `use_gradient_checkpointing="unsloth"` (the default of
`FastLanguageModel.get_peft_model`, llama.py): torch's reentrant CheckpointFunction is
replaced by `UnslothCheckpointFunction`. Its forward copies each layer's input (the first
tensor argument, when it requires grad and has more than MINIMUM_SIZE = 2 MiB / 2 elements)
into a pinned CPU buffer (`CPU_BUFFERS[CPU_INDEX]`, resized to the input, never shrunk) and
saves nothing of it on the device; after the first step the last checkpointed layer
(`CURRENT_GC_INDEX == LAST_GC_INDEX`) keeps its input on the device ("Don't offload the last
layer"). In backward the input is copied back into one persistent device buffer per GPU
(`GPU_BUFFERS`, INITIAL_GPU_BUFFER_SIZE = 2·256·2048 elements, resized to the largest input,
never shrunk), which the recomputed layer then uses as its input. A second buffer
(`GPU_BUFFERS_B`, double buffering) is kept only while more than DOUBLE_BUFFER_HEADROOM =
512 MiB is free after the first step, and freed on any out-of-memory when it grows: it never
decides whether a run fits and is not counted.

| what                         | device bytes          | host (pinned) bytes |
|------------------------------|-----------------------|---------------------|
| layers 1..L-1's inputs       | 0                     | (L-1)·T·h·c        |
| the last layer's input       | T·h·c (forward to its backward) | —         |
| the reload buffer            | max(T·h, 2^20)·c, the whole step | —       |
| CPU buffers                  | —                     | first step: all L inputs, + (200-L)·128Ki·c initial buffers |

Inputs of at most 2^20 elements stay on the device (torch's reentrant checkpoint).

Fused cross entropy (`unsloth_fused_ce_loss`, called by `CausalLM_fast_forward` whenever
labels are given and UNSLOTH_RETURN_LOGITS is unset: the `bsz * q_len <= 1024` test there no
longer changes the path): `UnslothFusedLoss.forward` computes the loss *and* dL/dhidden in
forward, over n chunks of tokens, each chunk's logits made and dropped inside a compiled
`torch.func.grad_and_value`; no logits outlive a chunk. It keeps `grad_inputs` (T·h in the
hidden states' dtype) and the shifted labels (T int64) for backward. The chunk count is
`get_chunk_size`: with G = T·V·4 / 2^30 the fp32 logits in GiB and target = min(half the
free memory, 4 GiB), n = 1 if G ≤ target else ⌈G / target / 4⌉·4; a chunk holds ⌈T/n⌉
tokens (torch.chunk), whose fp32 logits (⌈T/n⌉·V·4 bytes, the size Unsloth budgets per
chunk) are the loss's working set. vramcalc takes the 4 GiB cap: with less than 8 GiB free
at the first step, Unsloth picks smaller chunks than counted here.

QLoRA kernels (`fast_lora.py`, `utils.py`): forward's `matmul_lora` dequantizes each 4-bit
weight with `fast_dequantize(..., use_global_buffer=True)` into one weight buffer per GPU
(`WEIGHT_BUFFERS`, the largest weight's numel in c, never shrunk) and one fp32 absmax buffer
(`ABSMAX_BUFFERS`, one float per 64 weights): both persist for the whole run. Backward
dequantizes into fresh tensors, one weight at a time, as bitsandbytes does (the QLoRA
transients' term). `LoRA_MLP` saves X, e = gate(X) and g = up(X) and recomputes the
activation in backward, whose buffers it reuses in place (`UnslothLoraKernels`); with
offloaded checkpointing only the recomputed layer holds them.
"""

from __future__ import annotations

from vramcalc.hardware import GPUProfile
from vramcalc.qlora import parse_version
from vramcalc.rank import RankContext
from vramcalc.terms.saved import SAVED_BITS, Modifier, Moment, Saved, dims
from vramcalc.units import ALLOC_ROUND_BYTES, alloc, ceil_div

GIB = 2**30
# gradient_checkpointing.py `initialize_unsloth_gradient_checkpointing`:
# MINIMUM_SIZE = 2 * 1024 * 1024 // n_bytes with the bf16/fp16 buffer dtype (2 bytes)
MINIMUM_NUMEL = 2 * 1024 * 1024 // 2
INITIAL_GPU_BUFFER_NUMEL = 2 * 256 * 2048  # INITIAL_GPU_BUFFER_SIZE
INITIAL_CPU_BUFFER_NUMEL = 128 * 1024  # torch.empty(128*1024, ..., pin_memory=True)
INITIAL_CPU_BUFFER_COUNT = 200  # `for i in range(200)`
# fused_losses/cross_entropy_loss.py `_get_chunk_multiplier`: target_gb = min(free/2, 4.0)
CHUNK_TARGET_BYTES = 4 * GIB
NF4_BLOCK = 64  # bitsandbytes' 4-bit blocksize: one absmax per 64 weights
LABEL_BITS = 64  # int64 labels

# --unsloth-version: the release modelled by default (unsloth/_version.py at 015bdef0;
# unsloth-zoo 2026.8.13 at ce232d6c). `OLD` below: unsloth d9ed4bef09 (in-tree 2024.12.4),
# unsloth-zoo 9c643b66, whose memory is that of every PyPI release from the first, 2024.8
# (stack_rules.UNSLOTH_OLDEST), to 2025.1.1 but for the loss (`loss_path`)
UNSLOTH_CURRENT = "2026.8.19"
# the first PyPI releases that run what the module docstring describes, each behaviour's
# own (checked against each release's wheel); before them, what `OLD` does:
FUSED_CE_FROM = (2025, 8, 5)  # llama.py calls unsloth_fused_ce_loss (806bee2433)
CUT_CE_FROM = (2024, 11, 8)  # llama.py calls fused_linear_cross_entropy (fa8e59eb1b)
# b·s <= 1024 returns the logits (`RETURN_LOGITS = True`, b9fe2588e5) from 2024.12.5 until
# 2025.10.8, which drops that shortcut
SHORT_LOGITS = ((2024, 12, 5), (2025, 10, 8))
GC_BUFFER_FROM = (2025, 3, 1)  # "unsloth" checkpointing is UnslothCheckpointFunction (3e5f0611)
ADDMM_LORA_FROM = (2025, 3, 1)  # matmul_lora's out.addmm_(XA, B, alpha=s) (4f166026d7)
GLOBAL_DEQUANT_FROM = (2025, 2, 2)  # matmul_lora's use_global_buffer=True (144190bd06)
SHARED_ROPE_FROM = (2025, 1, 1)  # one rotary embedding for the model (63782ea3af)
ROPE_CACHE_POSITIONS = 4 * 8192  # LlamaRotaryEmbedding: current_rope_size = min(4·8192, P)
ROPE_CACHE_STEP = 8192  # extend_rope_embedding grows it in steps of 8192 positions


def version(ctx: RankContext) -> tuple[int, int, int]:
    """The Unsloth release the scenario names (--unsloth-version), else the one modelled."""
    return parse_version(ctx.training.unsloth_version or UNSLOTH_CURRENT)


def loss_path(ctx: RankContext) -> str:
    """Which loss `CausalLM_fast_forward` runs with labels given: "fused" (the chunked
    fused cross entropy of the module docstring), "cce" (Apple's cut cross-entropy:
    unsloth_zoo/loss_utils.py `fused_linear_cross_entropy` -> ml-cross-entropy 24.12.1
    1f3ebdb `linear_cross_entropy`) or "logits" (the bf16 logits into
    `fast_cross_entropy_loss`): logits before CUT_CE_FROM, and for b·s <= 1024 within
    SHORT_LOGITS; then cut cross-entropy until FUSED_CE_FROM."""
    v = version(ctx)
    if v < CUT_CE_FROM or (dims(ctx).T <= 1024 and SHORT_LOGITS[0] <= v < SHORT_LOGITS[1]):
        return "logits"
    return "cce" if v < FUSED_CE_FROM else "fused"


def reload_buffer(ctx: RankContext) -> bool:
    """Whether the offloaded checkpoints come back into the persistent GPU buffer (and the
    last layer and small inputs stay on the device); OLD reloads each input into a fresh
    tensor (`Unsloth_Offloaded_Gradient_Checkpointer.backward`: `.to("cuda:0")`) and
    offloads every layer whatever its size."""
    return version(ctx) >= GC_BUFFER_FROM


def unsloth(ctx: RankContext) -> bool:
    return ctx.training.framework == "unsloth"


def offloads_checkpoints(ctx: RankContext) -> bool:
    """Whether Unsloth's checkpointing moves the layer inputs to the host: the unsloth
    profile with --recompute full (use_gradient_checkpointing="unsloth") and inputs over
    MINIMUM_SIZE elements."""
    if not unsloth(ctx) or ctx.training.recompute != "full" or ctx.spec.is_encoder:
        return False
    x = dims(ctx)
    return x.T * x.h > MINIMUM_NUMEL or not reload_buffer(ctx)


def reload_buffer_bytes(ctx: RankContext) -> int:
    """The persistent device buffer the offloaded inputs come back into: max(T·h, 2^20)·c."""
    x = dims(ctx)
    return alloc(max(x.T * x.h, INITIAL_GPU_BUFFER_NUMEL), x.r)


def checkpoint_host_bytes(ctx: RankContext) -> int:
    """Pinned host memory of the CPU buffers: one per checkpointed layer, each grown to its
    input (the first step offloads all L), the rest of the 200 initial ones unchanged."""
    x = dims(ctx)
    bits = SAVED_BITS[x.r]
    if not reload_buffer(ctx):  # OLD: a pinned copy of each layer's input, nothing else
        return ctx.num_layers * ceil_div(x.T * x.h * bits, 8)
    per = ceil_div(max(x.T * x.h, INITIAL_CPU_BUFFER_NUMEL) * bits, 8)
    idle = max(INITIAL_CPU_BUFFER_COUNT - ctx.num_layers, 0)
    return ctx.num_layers * per + idle * ceil_div(INITIAL_CPU_BUFFER_NUMEL * bits, 8)


def dequant_buffer_bytes(ctx: RankContext) -> int:
    """QLoRA: the global dequantized-weight buffer (largest 4-bit weight, in c) and its fp32
    absmax buffer, held for the whole run."""
    x, spec, tp = dims(ctx), ctx.spec, ctx.parallel.tp
    q_out = ceil_div(spec.num_attention_heads * spec.head_size, tp)
    kv_out = ceil_div(spec.kv_heads * spec.head_size, tp)
    largest = max(q_out * x.h, kv_out * x.h, x.f * x.h)
    return alloc(largest, x.c) + alloc(ceil_div(largest, NF4_BLOCK), "fp32")


def num_chunks(ctx: RankContext) -> int:
    """`get_chunk_size` at the 4 GiB target: 1 if the fp32 logits fit it, else the exact
    count rounded up to a multiple of 4."""
    x = dims(ctx)
    logits = x.T * x.V * 4
    if logits <= CHUNK_TARGET_BYTES:
        return 1
    return ceil_div(ceil_div(logits, CHUNK_TARGET_BYTES), 4) * 4


def chunk_logits_bytes(ctx: RankContext) -> int:
    """One chunk's fp32 logits, ⌈T/n⌉·V·4 (torch.chunk's first chunk is the largest)."""
    x = dims(ctx)
    return alloc(ceil_div(x.T, num_chunks(ctx)) * x.V, "fp32")


def loss_parts(ctx: RankContext) -> tuple[int, int, int]:
    """The loss `loss_path` names: (kept for backward, forward peak, backward peak).

    - "fused" (module docstring): dL/dhidden (T·h, c), the shifted labels and the loss and
      divisor scalars kept; forward adds one chunk's fp32 logits, backward the out-of-place
      `grad_inputs * scale_factor` it returns (T·h, c).
    - "cce", cut cross-entropy (ml-cross-entropy 1f3ebdb cce.py
      `LinearCrossEntropyFunction`): no logits; it keeps e (the normed hidden states, T·h
      in c), lse (T fp32), the valid-token index (T int64) and logit_avg (V fp32), and its
      backward (cce_backward.py) allocates de = zeros_like(e), dc = zeros_like(c) — a full
      V·h gradient of the frozen lm_head, made whether c needs it or not — their int32 lock
      tables (about T and V entries) and the argsort of logit_avg (V int32).
    - "logits": the bf16 logits (T·V·c), which `Fast_CrossEntropyLoss` keeps with its
      logsumexp (T fp32) and overwrites with their gradient in backward (kernels/
      cross_entropy_loss.py), then lm_head's dL/dhidden (T·h, c). The model returns them,
      and the Trainer's mixed precision (Unsloth's notebooks set bf16 or fp16) wraps the
      forward in accelerate's `convert_outputs_to_fp32` (accelerator.py `prepare_model`,
      utils/operations.py `convert_to_fp32`): a T·V fp32 copy at the end of forward, beside
      the kept bf16 ones, dropped when the Trainer's compute_loss returns.
    The shifted labels (T int64) in all three."""
    x = dims(ctx)
    labels = alloc(ceil_div(x.T * LABEL_BITS, 8), "int8")
    path = loss_path(ctx)
    if path == "fused":
        kept = alloc(x.T * x.h, x.c) + labels + 2 * ALLOC_ROUND_BYTES
        return kept, kept + chunk_logits_bytes(ctx), kept + alloc(x.T * x.h, x.c)
    if path == "logits":
        kept = alloc(x.T * x.V, x.c) + alloc(x.T, "fp32") + labels
        return kept, kept + alloc(x.T * x.V, "fp32"), kept + alloc(x.T * x.h, x.c)
    kept = (alloc(x.T * x.h, x.c) + alloc(x.T, "fp32") + labels + alloc(x.T, "int64")
            + alloc(x.V, "fp32"))
    back = (alloc(x.T * x.h, x.c) + alloc(x.V * x.h, x.c) + alloc(x.T, "int32")
            + 2 * alloc(x.V, "int32"))
    return kept, kept, kept + back


def rope_cache_bytes(ctx: RankContext) -> int:
    """OLD (before SHARED_ROPE_FROM): each attention module owns a rotary embedding whose
    cos and sin caches (positions × head width, cast to c) cover min(4·8192, max positions)
    positions, the model one more (llama.py `LlamaRotaryEmbedding`, `current_rope_size`;
    `patch_llama_rope_scaling`); a longer sequence regrows every layer's to whole steps of
    8192 positions (`extend_rope_embedding`), not the model's. Read at their first rows, so
    no per-token table exists."""
    x, spec = dims(ctx), ctx.spec
    base = min(ROPE_CACHE_POSITIONS, spec.max_position_embeddings)
    grown = max(base, ceil_div(x.s, ROPE_CACHE_STEP) * ROPE_CACHE_STEP)
    return 2 * (ctx.num_layers * alloc(grown * x.d, x.c) + alloc(base * x.d, x.c))


def layer_rope_caches(ctx: RankContext) -> bool:
    return (unsloth(ctx) and version(ctx) < SHARED_ROPE_FROM
            and ctx.spec.position_embedding == "rope")


def unsloth_notes(ctx: RankContext) -> list[str]:
    """What the report says of Unsloth's offload and fused loss."""
    out = []
    path = loss_path(ctx)
    if offloads_checkpoints(ctx) and reload_buffer(ctx):
        out.append("unsloth checkpointing: every layer input but the last waits in pinned "
                   "host memory (host RAM above) and comes back into one reusable device "
                   "buffer in backward")
    elif offloads_checkpoints(ctx):
        out.append("unsloth checkpointing (--unsloth-version): every layer input waits in "
                   "pinned host memory (host RAM above) and comes back as a new device "
                   "tensor in its layer's backward")
    if path == "cce":
        out.append("unsloth cut cross-entropy (--unsloth-version): no logits; its backward "
                   "allocates a full gradient of the frozen lm_head")
    elif path == "logits":
        out.append("unsloth cross entropy (--unsloth-version): the bf16 logits are kept and "
                   "overwritten by their gradient; the Trainer's mixed precision returns an "
                   "fp32 copy at the end of forward")
    else:
        n = num_chunks(ctx)
        out.append(f"unsloth fused cross entropy: {n} chunk{'s' * (n > 1)} of fp32 logits at "
                   "Unsloth's 4 GiB cap, none kept; with under 8 GiB free at the first step "
                   "Unsloth picks smaller chunks (this estimate is then an upper bound)")
    return out


class UnslothCheckpointing(Modifier):
    """Unsloth's offloaded gradient checkpointing (table above)."""

    name = "unsloth_checkpointing"

    def applies(self, ctx: RankContext) -> bool:
        return offloads_checkpoints(ctx)

    def checkpoint_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        return []

    def head_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        # the last checkpointed layer's input stays on the device (kept, like the head's
        # tensors, from the end of forward into the first layer backward reaches); OLD
        # offloads it too
        if not reload_buffer(ctx):
            return saved
        x = dims(ctx)
        return saved + [Saved("unsloth.last_layer_input", x.T * x.h, x.r, "(b, s, h)",
                              "last checkpointed layer, not offloaded")]

    def host_bytes(self, ctx: RankContext, saved: list[Saved], in_flight: float) -> int:
        return checkpoint_host_bytes(ctx)

    def backward_moments(self, ctx: RankContext, moments: list[Moment],
                         saved: list[Saved]) -> list[Moment]:
        # the re-run's input is the reload buffer (`x = buffer.detach()`), or the last
        # layer's kept input: both counted already, so the input the recomputed layer's
        # first norm saves is no tensor of its own
        # (OLD reloads it into a new tensor: the saved input is that tensor)
        if not reload_buffer(ctx):
            return moments
        alias = sum(t.nbytes for t in saved if t.name == "input_norm.input")
        return [Moment(m.name, m.held - alias, m.work, m.grads) for m in moments]

    def persistent_parts(self, ctx: RankContext, gpu: GPUProfile | None) -> dict[str, int]:
        return {"transients/unsloth_gc_buffer": reload_buffer_bytes(ctx)} if reload_buffer(
            ctx) else {}


def lora_kernels(ctx: RankContext) -> bool:
    """Whether the layers run Unsloth's fused LoRA kernels: the unsloth profile on a dense
    gated-MLP model (LoRA_MLP fuses gate, up and down; LoRA_QKV and LoRA_W the attention)."""
    spec = ctx.spec
    return (unsloth(ctx) and spec.mlp_kind == "gated" and not spec.is_moe
            and not spec.is_encoder)


# what the fused kernels do not save: LoRA_MLP recomputes h = act(e)·g in backward
# (`_backward_function(DW, e, g)`), matmul_lora's X·A lives inside the Function's forward
_NOT_SAVED = ("mlp.act", "mlp.down_input")


class UnslothLoraKernels(Modifier):
    """Unsloth's LoRA_MLP / LoRA_QKV / LoRA_W autograd Functions: what a layer saves and its
    MLP backward's buffers."""

    name = "unsloth_lora_kernels"

    def applies(self, ctx: RankContext) -> bool:
        return lora_kernels(ctx)

    def layer_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        # LoRA_MLP saves X, e, g; the Functions keep no adapter A outputs
        return [t for t in saved if t.name not in _NOT_SAVED
                and not (t.name.startswith("lora.") and t.name.endswith(".a_out"))]

    def backward_moments(self, ctx: RankContext, moments: list[Moment],
                         saved: list[Saved]) -> list[Moment]:
        # LoRA_MLP.backward: DW = dY·downᵀ (T·f, new), then `_backward_function(DW, e, g)`
        # writes h, df, de into DW, e and g in place: one T·f buffer where autograd's
        # act·up backward has three
        # OLD's matmul_lora adds the LoRA term out of place, `out += (X @ A) @ (s * B)`
        # (kernels/utils.py): DW's own (T, f) product exists beside DW for that add
        x = dims(ctx)
        fewer = (2 if version(ctx) >= ADDMM_LORA_FROM else 1) * alloc(x.T * x.f, x.c)
        return [Moment(m.name, m.held, m.work - fewer, m.grads) if m.name == "mlp" else m
                for m in moments]


class UnslothDequantBuffer(Modifier):
    """Unsloth's persistent buffers: QLoRA's global dequantized-weight buffer; OLD's rotary
    caches, one per layer."""

    name = "unsloth_dequant_buffer"

    def applies(self, ctx: RankContext) -> bool:
        return unsloth(ctx) and (ctx.training.finetune == "qlora" or layer_rope_caches(ctx))

    def persistent_parts(self, ctx: RankContext, gpu: GPUProfile | None) -> dict[str, int]:
        # OLD dequantizes into fresh tensors (`fast_dequantize` without a global buffer) and
        # keeps a rotary cache per layer (rope_cache_bytes)
        out = {}
        if ctx.training.finetune == "qlora" and version(ctx) >= GLOBAL_DEQUANT_FROM:
            out["transients/unsloth_dequant_buffer"] = dequant_buffer_bytes(ctx)
        if layer_rope_caches(ctx):
            out["transients/unsloth_rope_caches"] = rope_cache_bytes(ctx)
        return out
