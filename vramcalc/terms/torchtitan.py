"""The torchtitan profile: what torchtitan's Llama keeps for backward under its activation
checkpointing modes (legend: vramcalc/terms/saved.py; c = r = the compute dtype, bf16 under
FSDP2's MixedPrecisionPolicy, else fp32: torchtitan runs no autocast).

Source: pytorch/torchtitan 9dec370ad26b5f8e9a7333a0e36165018262644b (Dec 2024).

A block without AC (torchtitan/models/llama/model.py `TransformerBlock.forward`,
norms.py `RMSNorm`), one micro-batch, N = b·s tokens, T = N ÷ t under TP (SP norms):

| tensor | shape | kept by |
|---|---|---|
| norm x.float() | (T, h) fp32 | pow, mul (the input itself when it is fp32) |
| norm rstd | (T, 1) fp32 | mul, rsqrt |
| norm x̂.type_as(x) | (T, h) r | `* self.weight` |
| wq/wk/wv input | (N, h) c | mm (the all-gathered input under TP) |
| rotated q | (N, a, d) c | SDPA (`type_as` copy of the complex product) |
| k, v | (N, a, d) c | SDPA: `repeat_kv` copies when 1 < g < a, else rotated k and wv's output (N, g, d) (g = 1: SDPA's inputs are stride-0 views of them) |
| SDPA output | (N, a, d) c | SDPA and wo (flash writes (b, s, a, d): `.contiguous()` is free) |
| logsumexp | (b, a, s) fp32 | SDPA |
| ffn_norm (3 tensors) | as above | |
| w1/w3 input | (N, h) c | mm |
| w1 out, w3 out, silu out, product | (N, f) c each | silu, mul, mul, w2 |

RoPE keeps nothing of its own: `xq_ * freqs_cis` needs only the (buffer's) freqs_cis for
xq_'s gradient, and the fp32 / complex copies are temporaries.

AC (parallelize_llama.py `_apply_ac_to_transformer_block`, `_save_list`, `apply_ac`):
- full: every block is checkpointed (non-reentrant); it keeps its input (T, h) r;
- selective, option 'op' (per-op SAC): each block keeps its input and the outputs of the
  ops in `_save_list` the policy saves: mm outputs except every second mm of the block,
  counted in call order wq 1, wk 2, wv 3, wo 4, w1 5, w3 6, w2 7 -> wq (N, a·d), wv (N, g·d),
  w1 (N, f), w2 (N, h); the SDPA (flash / efficient) output and logsumexp; under TP the
  two `reduce_scatter_tensor` outputs of wo and w2 (T, h) each (RowwiseParallel with
  Shard(1) outputs); `aten.abs` / `aten.max` do not occur without float8;
- selective, option N (per-layer): block i (0-based, in build order) is checkpointed whole
  when (i + 1) % N == 0 (the wrapper's `_count` is incremented before the test); the
  other blocks keep everything.

In backward a checkpointed block is re-run whole before its first backward node (the last
tensor it saved is w2's input), so while its backward runs it holds its full set again
(SAC's cached outputs are handed over, not copied) next to its checkpoint input.
"""

from __future__ import annotations

from vramcalc.model import ModelSpec
from vramcalc.rank import RankContext
from vramcalc.sharding import pipeline_chunks
from vramcalc.terms.megatron_recompute import LayerPlan
from vramcalc.terms.saved import Dims, Saved, bsh, dims, repeats_kv_by_copy
from vramcalc.terms.saved_layers import checkpoint_saved, mlp_saved, norm_saved
from vramcalc.terms.torchtitan_compile import compiled_block_saved
from vramcalc.terms.torchtitan_tp import gathered_input_dtype
from vramcalc.units import alloc, ceil_div, round_alloc


def _attention_saved(ctx: RankContext, x: Dims) -> list[Saved]:
    """Attention without AC: the projections' input, SDPA's q, k, v, output, logsumexp;
    torchtune's q/k norms (Qwen3) after RoPE: its RMSNorm's fp32 copy, rstd and x̂ of the
    rotated q (b, a, s, d) and k (b, g, s, d) (torchtune/modules/attention.py; the normed q
    is SDPA's input)."""
    c, n = x.c, x.b * x.s
    nad, ngd = n * x.a * x.d, n * x.g * x.d
    out = [Saved("attn.input", n * x.h, c, "(b, s, h) normed", "input of wq, wk, wv"),
           Saved("attn.q", nad, c, "(b, s, a, d)", "rotated q (type_as copy), SDPA input")]
    if ctx.spec.qk_norm and ctx.training.framework == "torchtune":
        out += norm_saved(ctx, x, "attn.q_norm", n * x.a, x.d, "(b, a, s, d)")
        out += norm_saved(ctx, x, "attn.k_norm", n * x.g, x.d, "(b, g, s, d)")
    if repeats_kv_by_copy(x):
        out += [Saved("attn.k", nad, c, "(b, s, a, d)", "repeat_kv copy of rotated k"),
                Saved("attn.v", nad, c, "(b, s, a, d)", "repeat_kv copy of v")]
    else:
        out += [Saved("attn.k", ngd, c, "(b, s, g, d)", "rotated k, SDPA input"),
                Saved("attn.v", ngd, c, "(b, s, g, d)", "wv output, SDPA input")]
    out += [Saved("attn.out", nad, c, "(b, s, a, d)", "SDPA output, kept by SDPA and wo"),
            Saved("attn.lse", x.b * x.a * x.s, "fp32", "(b, a, s)", "logsumexp, fp32")]
    return out


def plain_layer_saved(ctx: RankContext) -> list[Saved]:
    """One torchtitan block without AC (table in the module docstring; compiled:
    vramcalc/terms/torchtitan_compile.py)."""
    if ctx.training.compile:
        return compiled_block_saved(ctx)
    x = dims(ctx)
    f = ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp)
    return attention_part_saved(ctx) + mlp_saved(ctx, x, x.b * x.s, f)


def attention_part_saved(ctx: RankContext) -> list[Saved]:
    """A block's two norms and its attention, without AC (the MLP's or experts' table
    follows)."""
    x = dims(ctx)
    out = norm_saved(ctx, x, "input_norm", x.T, x.h, "(b, s, h)")
    out += _attention_saved(ctx, x)
    return out + norm_saved(ctx, x, "post_norm", x.T, x.h, "(b, s, h)")


SAC_FLOAT8_AMAX, SAC_FLOAT8_INV_SCALES = 11, 7  # compiled per-op SAC with torchao float8


def op_sac_saved(ctx: RankContext) -> list[Saved]:
    """One block under per-op SAC: its checkpoint input and the outputs the policy saves.
    Compiled, the partitioner keeps the policy's MUST_SAVE outputs the backward reads and
    recomputes the rest: w2's output, which nothing in the backward reads, is not kept; with
    torchao's float8 linears the policy still sees `aten.mm` (on the Float8Tensor, above
    its `_scaled_mm`), so the same outputs are kept, plus 11 amax (bf16) and 7 1/scale
    (fp32) scalars (vramcalc/terms/torchtitan_compile.py)."""
    x = dims(ctx)
    c, n = x.c, x.b * x.s
    f = ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp)
    out = [Saved("layer.input", bsh(x), x.r, "(b, s, h)", "checkpoint input"),
           Saved("sac.wq", n * x.a * x.d, c, "(b, s, a·d)", "mm 1 output (saved)"),
           Saved("sac.wv", n * x.g * x.d, c, "(b, s, g·d)", "mm 3 output (saved)"),
           Saved("attn.out", n * x.a * x.d, c, "(b, s, a, d)", "SDPA output (saved)"),
           Saved("attn.lse", x.b * x.a * x.s, "fp32", "(b, a, s)", "SDPA logsumexp (saved)"),
           Saved("sac.w1", n * f, c, "(b, s, f)", "mm 5 output (saved)")]
    if ctx.training.compile:  # w2's output is not kept
        if ctx.training.float8:  # the casts' scalars the backward reads
            out += [Saved("float8.amax", 1, "bf16", "()", "max(|x|) of a cast",
                          SAC_FLOAT8_AMAX),
                    Saved("float8.inv_scale", 1, "fp32", "()", "1/scale of a cast",
                          SAC_FLOAT8_INV_SCALES)]
        return out
    out.append(Saved("sac.w2", n * x.h, c, "(b, s, h)", "mm 7 output (saved; partial sums "
                     "under TP)"))
    if ctx.parallel.tp > 1:
        out.append(Saved("sac.reduce_scatter", bsh(x), c, "(b, s/t, h)",
                         "wo and w2 reduce-scatter outputs (saved)", 2))
    return out


def layer_saved(ctx: RankContext) -> list[Saved]:
    """One block's saved tensors under the rank's AC mode (per-layer SAC: a block that is
    not checkpointed, the common kind; `layer_plan` has each block's bytes)."""
    rec = ctx.training.recompute
    if rec == "full":
        return checkpoint_saved(ctx)
    if rec == "selective" and ctx.training.recompute_every is None:
        return op_sac_saved(ctx)
    return plain_layer_saved(ctx)


def checkpointed(ctx: RankContext) -> tuple[bool, ...]:
    """Per-layer SAC: whether each of the rank's blocks (bottom first) is checkpointed,
    counting them as torchtitan builds this rank's model chunks, one after another
    (train.py applies `parallelize_llama`, hence `apply_ac`, to each of the rank's model
    parts in turn, and `ptd_checkpoint_wrapper._count` is one counter per process)."""
    n = ctx.training.recompute_every or 1
    layers = sum(row[ctx.stage] for row in pipeline_chunks(ctx.spec, ctx.parallel))
    return tuple((i + 1) % n == 0 for i in range(layers))


def layer_plan(ctx: RankContext, input_bytes: int, layer_bytes: int) -> LayerPlan | None:
    """Per-layer SAC (--recompute-every N): checkpointed blocks keep their input, the others
    their full set; each block is its own unit (vramcalc.terms.megatron_recompute.LayerPlan).
    None for the other modes (all blocks alike)."""
    tr = ctx.training
    if tr.framework != "torchtitan" or tr.recompute != "selective" or (
            tr.recompute_every is None):
        return None
    marks = checkpointed(ctx)
    kept = tuple(input_bytes if m else layer_bytes for m in marks)
    return LayerPlan(kept, tuple(range(len(marks))), tuple(not m for m in marks), layer_bytes)


def recompute_extra(ctx: RankContext) -> int:
    """Bytes a checkpointed block holds beside its recomputed full set while its backward
    runs: its checkpoint input (T, h) when RMSNorm's x.float() is a copy (r = bf16; an fp32
    input is x.float() itself, already in the set); under per-op SAC also w2's saved
    output (N, h): non-reentrant checkpoint stops the recompute once the last saved tensor
    is repacked (torch/utils/checkpoint.py, early stop), and w2's mm saves its input
    before it runs, so w2's cached output is never handed back and stays in the SAC
    cache until the block's backward is over."""
    x = dims(ctx)
    out = 0 if x.r == "fp32" else alloc(bsh(x), x.r)
    if ctx.training.recompute == "selective" and ctx.training.recompute_every is None:
        out += alloc(x.b * x.s * x.h, x.c)
    return out


def checkpointed_forward_work(ctx: RankContext) -> int:
    """The top block's forward, when it is checkpointed (full AC, or per-layer SAC wrapping
    it): nothing is saved, so at `silu(w1 x) * w3 x` the block holds h (T, h) r, the MLP
    input (N, h) c, silu's and w3's outputs and the product (N, f) c each (w1's output is
    gone once silu ran; under TP the MLP input is the all-gathered (N, h), fp8 with
    --float8); 0 when the top block is not checkpointed whole."""
    tr = ctx.training
    marks = checkpointed(ctx) if tr.recompute == "selective" and tr.recompute_every else ()
    if not (tr.recompute == "full" or (marks and marks[-1])):
        return 0
    x = dims(ctx)
    n = x.b * x.s
    f = ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp)
    # the MLP input: all-gathered under TP, in fp8 with torchao's float8 TP styles
    return alloc(bsh(x), x.r) + alloc(n * x.h, gathered_input_dtype(ctx)) + 3 * alloc(
        n * f, x.c)


def freqs_cis_bytes(ctx: RankContext) -> int:
    """The `freqs_cis` buffer every rank keeps: precompute_freqs_cis(head_dim, max_seq_len)
    complex64 (max_seq_len, d/2), 8 B each, max_seq_len = --training.seq_len (train.py)."""
    return round_alloc(ctx.training.seq_len * (ctx.spec.head_size // 2) * 8)


def op_sac_recompute_flops_per_token(spec: ModelSpec) -> float:
    """Forward FLOPs per token that per-op SAC runs again in backward: the mms it does not
    save, every second one of a block in call order (wq, wk, wv, wo, w1, w3, w2 -> wk, wo,
    w3; `_apply_ac_to_transformer_block`'s mm counter), 2·(h·g·d + a·d·h + h·f) per layer;
    norms, RoPE and the SwiGLU's elementwise ops are not counted (no matmul)."""
    h, a, g, d = spec.hidden_size, spec.num_attention_heads, spec.kv_heads, spec.head_size
    return 2.0 * spec.num_hidden_layers * (h * g * d + a * d * h + h * spec.intermediate_size)
