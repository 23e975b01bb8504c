"""Term: activations — tensors the forward pass saves for backward, per layer, per micro-batch.

Legend (per rank): b = micro-batch, s = sequence length on this rank (÷cp), h = hidden,
a = attention heads ÷tp, g = kv heads ÷tp (at least 1), d = head dim, f = FFN size ÷tp,
c = compute dtype (bf16 = 2 bytes), sh = the tokens of a (b, s, h) tensor on this rank
(÷tp under sequence parallelism). Every saved tensor is rounded to the allocator's 512 B.

Profiles:
- `reference`: exactly what vramcalc's own PyTorch model (vramcalc/trace/reference_model.py)
  saves; the table is in docs/methodology.md and pinned by the trace agreement tests.
- `hf`: Hugging Face transformers (fp32 RMSNorm internals, repeat_kv under eager attention).
- `megatron`: Korthikanti et al. 2022 (arXiv:2205.05198) Table 2, 16-bit activations and
  1-byte dropout masks, FFN 4h generalised to f.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramcalc.terms.context import RankContext
from vramcalc.units import DTYPE_BITS, alloc, ceil_div


@dataclass(frozen=True)
class Saved:
    """One tensor saved for backward: element count, dtype, shape for the docs."""

    name: str
    numel: int
    dtype: str
    shape: str

    @property
    def nbytes(self) -> int:
        return alloc(self.numel, self.dtype)


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


def dims(ctx: RankContext) -> Dims:
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
    )


def _bsh(x: Dims) -> int:
    return x.b * ceil_div(x.s, x.sp_div) * x.h


def _norm_saved(ctx: RankContext, x: Dims, name: str, inp_dtype: str) -> list[Saved]:
    """A norm saves its input plus per-token fp32 statistics (rstd; LayerNorm adds mean)."""
    tokens = x.b * ceil_div(x.s, x.sp_div)
    out = [Saved(f"{name}.input", _bsh(x), inp_dtype, "(b, s, h)"),
           Saved(f"{name}.rstd", tokens, "fp32", "(b, s)")]
    if ctx.spec.norm_kind == "layernorm":
        out.append(Saved(f"{name}.mean", tokens, "fp32", "(b, s)"))
    return out


def attention_core_saved(ctx: RankContext, x: Dims) -> list[Saved]:
    """What the attention core (softmax(QKᵀ)V) saves beyond q, k, v."""
    c = x.c
    if ctx.training.attention == "flash":
        # FlashAttention / SDPA: output (b, a, s, d) and logsumexp (b, a, s) fp32
        return [Saved("attn.out", x.b * x.a * x.s * x.d, c, "(b, a, s, d)"),
                Saved("attn.lse", x.b * x.a * x.s, "fp32", "(b, a, s)")]
    # eager: probabilities (b, a, s, s) saved by softmax and by probs @ v
    return [Saved("attn.probs", x.b * x.a * x.s * x.s, c, "(b, a, s, s)"),
            Saved("attn.out", x.b * x.a * x.s * x.d, c, "(b, a, s, d)")]


def _qkv_saved(ctx: RankContext, x: Dims) -> list[Saved]:
    c = x.c
    g = x.g
    if ctx.training.attention == "eager" and x.g < x.a:
        g = x.a  # k, v expanded to all heads before QKᵀ
    return [Saved("attn.q", x.b * x.a * x.s * x.d, c, "(b, a, s, d)"),
            Saved("attn.k", x.b * g * x.s * x.d, c, "(b, g, s, d)"),
            Saved("attn.v", x.b * g * x.s * x.d, c, "(b, g, s, d)")]


def _mlp_saved(ctx: RankContext, x: Dims) -> list[Saved]:
    c, bsf = x.c, x.b * x.s * x.f
    if ctx.spec.mlp_kind == "gated":
        return [Saved("mlp.input", _bsh(x), c, "(b, s, h) normed"),
                Saved("mlp.gate", bsf, c, "(b, s, f) act input"),
                Saved("mlp.act", bsf, c, "(b, s, f) act output"),
                Saved("mlp.up", bsf, c, "(b, s, f)"),
                Saved("mlp.down_input", bsf, c, "(b, s, f) act·up")]
    return [Saved("mlp.input", _bsh(x), c, "(b, s, h) normed"),
            Saved("mlp.fc_out", bsf, c, "(b, s, f) act input"),
            Saved("mlp.act", bsf, c, "(b, s, f) proj input")]


def layer_saved(ctx: RankContext) -> list[Saved]:
    """Saved tensors of one transformer layer for one micro-batch (reference/hf profiles)."""
    x = dims(ctx)
    rec = ctx.training.recompute
    if rec == "full":
        # torch.utils.checkpoint keeps only the layer input
        return [Saved("layer.input", _bsh(x), x.c, "(b, s, h)")]
    out = _norm_saved(ctx, x, "input_norm", x.c)
    out.append(Saved("attn.input", _bsh(x), x.c, "(b, s, h) normed"))
    out += _qkv_saved(ctx, x)
    if rec != "selective":
        out += attention_core_saved(ctx, x)
    else:
        # the checkpointed core is recomputed; o_proj still keeps its input
        out.append(Saved("attn.out", x.b * x.a * x.s * x.d, x.c, "(b, a, s, d)"))
    out += _norm_saved(ctx, x, "post_norm", x.c)
    out += _mlp_saved(ctx, x)
    return out


def megatron_layer_bytes(ctx: RankContext) -> int:
    """Korthikanti et al. 2022 Table 2 bytes per layer (t = tp, SP and selective recompute)."""
    x = dims(ctx)
    s, b, h, t = x.s, x.b, x.h, ctx.parallel.tp
    a = ctx.spec.num_attention_heads
    ffn_ratio = ctx.spec.intermediate_size / h
    mlp = 19 if ffn_ratio == 4 else 3 + 4 * ffn_ratio  # 19 sbh for f = 4h (2 + 8 + 8 + 1)
    base = 34 - 19 + mlp  # 10 replicated + 24/t sharded in the paper's split
    rec = ctx.training.recompute
    if rec == "full":
        return 2 * s * b * h // (t if ctx.parallel.sequence_parallel else 1)
    core = 0 if rec == "selective" else 5 * a * s / h
    if ctx.parallel.sequence_parallel:
        return int(s * b * h / t * (base + core))
    return int(s * b * h * (10 + (base - 10) / t + core / t))


def layer_activation_bytes(ctx: RankContext) -> int:
    """Bytes one layer keeps for backward, one micro-batch, on this rank."""
    if ctx.training.framework == "megatron":
        return megatron_layer_bytes(ctx)
    return sum(t.nbytes for t in layer_saved(ctx))


def layer_forward_working_bytes(ctx: RankContext) -> int:
    """Largest set of temporaries alive inside one layer's forward beyond what it saves.

    Under full recompute the backward re-runs one layer, so its whole saved set is needed.
    """
    x = dims(ctx)
    if ctx.training.recompute == "full":
        full = ctx.training.model_copy(update={"recompute": "none"})
        return sum(t.nbytes for t in layer_saved(RankContext(ctx.spec, full, ctx.parallel,
                                                               ctx.stage)))
    eager_scores = 0
    if ctx.training.attention == "eager":
        eager_scores = alloc(x.b * x.a * x.s * x.s, x.c)  # scores before softmax
    return max(eager_scores, alloc(_bsh(x), x.c))


def layer_backward_working_bytes(ctx: RankContext) -> int:
    """Gradient temporaries alive while one layer runs backward (excluding param grads)."""
    x = dims(ctx)
    c = x.c
    grad_io = 2 * alloc(_bsh(x), c)  # incoming and outgoing dL/dx of the residual stream
    if ctx.spec.mlp_kind == "gated":
        inner = 3 * alloc(x.b * x.s * x.f, c)  # d(act·up), d act, d up
    else:
        inner = 2 * alloc(x.b * x.s * x.f, c)
    if ctx.training.attention == "eager":
        inner = max(inner, 2 * alloc(x.b * x.a * x.s * x.s, c))
    rec = 0
    if ctx.training.recompute != "none":
        rec = layer_forward_working_bytes(ctx) if ctx.training.recompute == "full" else sum(
            t.nbytes for t in attention_core_saved(ctx, x))
    return grad_io + inner + rec


def embedding_saved(ctx: RankContext) -> list[Saved]:
    """Per micro-batch, first stage: token ids and labels (int64) kept by embedding/loss."""
    if not (ctx.is_first_stage or ctx.is_last_stage):
        return []
    x = dims(ctx)
    return [Saved("input_ids", x.b * x.s, "int64", "(b, s)"),
            Saved("labels", x.b * x.s, "int64", "(b, s)")]


def head_saved(ctx: RankContext) -> list[Saved]:
    """Last stage: final norm input/statistics and the lm_head input."""
    if not ctx.is_last_stage:
        return []
    x = dims(ctx)
    out: list[Saved] = []
    if ctx.spec.final_norm:
        out += _norm_saved(ctx, x, "final_norm", x.c)
    out.append(Saved("lm_head.input", _bsh(x), x.c, "(b, s, h) normed"))
    return out


def activation_dtype_bytes(ctx: RankContext) -> int:
    return DTYPE_BITS[ctx.training.compute_dtype] // 8
