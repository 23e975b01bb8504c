"""Liger kernels under HF Trainer (`--liger`: TrainingArguments(use_liger_kernel=True), the hf
profile): what Liger's Triton kernels keep on the device instead of transformers' modules.

Legend as in vramcalc/terms/saved.py; T = b·s tokens, h hidden, f intermediate, V
vocabulary, r the residual dtype, c the compute dtype, w the weights' dtype.

Sources: linkedin/Liger-Kernel ead96b61 (src/liger_kernel/...), transformers 5.x
integrations/liger.py `apply_liger_kernel` (`_apply_liger_kernel_to_instance` with the
default config: for Llama, Mistral and Qwen2 `apply_liger_kernel_to_*` with rope=True,
rms_norm=True, swiglu=True, fused_linear_cross_entropy=True).

| kernel (module) | keeps for backward | transformers' eager module keeps |
|---|---|---|
| LigerRMSNorm (ops/rms_norm.py `LigerRMSNormFunction`, casting "llama") | X (the input, r) and RSTD (T, fp32) | x.float(), rsqrt (T, fp32), x̂ in r |
| LigerSwiGLUMLP (ops/swiglu.py `LigerSiLUMulFunction`) | a = gate(x), b = up(x) (c); down_proj keeps c = silu(a)·b | gate, up, silu(gate), act·up |
| liger_rotary_pos_emb (ops/rope.py `LigerRopeFunction`) | cos, sin (shared); rotates q and k in place in their projections' storage | q, k rotated in r under autocast, cast to c for SDPA |
| fused linear cross entropy (ops/fused_linear_cross_entropy.py, model/llama.py `lce_forward`) | dL/dhidden (T·h in the hidden states' dtype) and, for a trained head, dL/dW (V·h in w), both made in forward | fp32 logits, log-probabilities, their gradients |

Backward: `swiglu_backward` writes d gate and d up into a and b in place (one T·f buffer,
dc, where autograd's act·up backward holds three); LigerRMSNorm's backward writes dX into
dY (`in_place=True`, LigerRMSNorm's default) plus a (SMs, h) fp32 partial dW (not counted);
the fused loss's backward scales its kept gradients in place (`element_mul_kernel`).

The fused loss's forward (`fused_linear_cross_entropy_forward`): chunks of
next_pow2(⌈T / ⌈V/h⌉⌉) tokens; per chunk the logits (chunk·V in c, the matmul under autocast),
their gradient written in place by the cross-entropy kernel, dL/dhidden of the chunk (chunk·h
in c, copied into grad_input) and, under autocast, head weight casts (V·h in c;
`chunk_work_parts` says when two coexist; backward keeps none). Beside: grad_input (T·h),
grad_weight (V·h, zeros_like the weight,
trained head only; the `torch.addmm(..., out_dtype=float32)` path of torch >= 2.8 on compute
capability >= 8.0 accumulates into it in place), loss_1d (T fp32), target_mask (T bool) and
LigerForCausalLMLoss's padded labels (b·(s+1) int64) with their shifted copy (b·s, a copy
for b > 1).
"""

from __future__ import annotations

from vramcalc.rank import RankContext
from vramcalc.terms.saved import Modifier, Moment, Saved, bsh, dims
from vramcalc.units import ALLOC_ROUND_BYTES, alloc, ceil_div


def liger(ctx: RankContext) -> bool:
    return ctx.training.liger


def chunk_tokens(ctx: RankContext) -> int:
    """Tokens per chunk of the fused loss: next_pow2(⌈T / ⌈V/h⌉⌉), at most T."""
    x = dims(ctx)
    want = ceil_div(x.T, ceil_div(x.V, x.h))
    return min(1 << max(want - 1, 0).bit_length(), x.T)


def _trained_head(ctx: RankContext) -> bool:
    return ctx.training.finetune == "full"


def _hidden_dtype(ctx: RankContext) -> str:
    """The final norm's output dtype, the input of the fused loss (LigerRMSNorm's Y is in X's
    dtype, the residual's)."""
    return dims(ctx).r


def saved_bytes(ctx: RankContext) -> int:
    """Kept from the loss's forward into its backward: dL/dhidden (T·h), a trained head's
    dL/dW (handed to AccumulateGrad when backward reaches the loss) and the loss and its
    division by num_items_in_batch (0-dim)."""
    x = dims(ctx)
    return (alloc(x.T * x.h, _hidden_dtype(ctx)) + grad_weight_bytes(ctx)
            + 2 * ALLOC_ROUND_BYTES)


def grad_weight_bytes(ctx: RankContext) -> int:
    """A trained head's dL/dW, made in forward and handed to AccumulateGrad in backward."""
    x = dims(ctx)
    return alloc(x.V * x.h, ctx.training.weight_dtype) if _trained_head(ctx) else 0


def chunk_work_parts(ctx: RankContext) -> tuple[int, int]:
    """The chunk loop's worst instant: (its tensors, its head weight casts). Liger's locals
    keep a chunk's logits (and, for a trained head under autocast, its addmm operand cast)
    until the next chunk's replace them, so from the second chunk on two chunks' logits
    coexist at the logits matmul. Under autocast that matmul casts the hidden chunk and
    `weight.t()`, a view, which the autocast cache does not keep: a V·h cast per chunk;
    `grad_logits @ weight` casts the weight itself, cached for the rest of the forward
    when it is a trained leaf."""
    x = dims(ctx)
    n = chunk_tokens(ctx)
    logits, part = alloc(n * x.V, x.c), alloc(n * x.h, x.c)
    amp, trained = ctx.training.is_autocast, _trained_head(ctx)
    cast = alloc(x.V * x.h, x.c) if amp else 0
    cached = cast if trained else 0
    operand = part if amp and trained else 0  # input_chunk.to(c) for the addmm
    hidden_cast = part if amp else 0
    product = (logits + part, cached or cast)  # grad_logits_chunk @ weight
    if n >= x.T:  # one chunk: its logits matmul, then the product
        first = (logits + hidden_cast, cast)
        return max(first, product, key=sum)
    # from the second chunk on, the previous chunk's logits and addmm operand are still bound
    later = (2 * logits + operand + hidden_cast, cast + cached)
    return max(later, (product[0] + operand, product[1]), key=sum)


def forward_peak_bytes(ctx: RankContext) -> int:
    """The fused loss in forward, at the chunk loop's worst instant (module docstring),
    without the head weight casts (`forward_cast_bytes`: the autocast-cache term)."""
    x = dims(ctx)
    labels = alloc(x.b * (x.s + 1), "int64") + (alloc(x.T, "int64") if x.b > 1 else 0)
    vectors = alloc(x.T, "fp32") + alloc(x.T, "bool")
    return saved_bytes(ctx) + labels + vectors + chunk_work_parts(ctx)[0]


def forward_cast_bytes(ctx: RankContext) -> int:
    """The head weight casts alive at the fused loss's worst forward instant (last stage)."""
    return chunk_work_parts(ctx)[1] if liger(ctx) and ctx.is_last_stage else 0


def backward_peak_bytes(ctx: RankContext) -> int:
    """The fused loss in backward: what it kept, scaled in place, plus the backward root's
    0-dim tensors."""
    return saved_bytes(ctx) + ALLOC_ROUND_BYTES


_EAGER_NORM = (".x_fp32", ".rstd", ".xhat")


def _fused_norms(ctx: RankContext, saved: list[Saved]) -> list[Saved]:
    """Each transformers RMSNorm's saved set replaced by LigerRMSNorm's: X (in r) and RSTD."""
    r = dims(ctx).r
    out: list[Saved] = []
    for t in saved:
        if t.name.endswith(".x_fp32"):
            base = t.name[: -len(".x_fp32")]
            rows = next(u.numel for u in saved if u.name == f"{base}.rstd")
            out += [Saved(f"{base}.input", t.numel, r, t.shape, "LigerRMSNorm input X"),
                    Saved(f"{base}.rstd", rows, "fp32", "(rows)", "LigerRMSNorm RSTD")]
        elif not t.name.endswith(_EAGER_NORM):
            out.append(t)
    return out


class LigerKernels(Modifier):
    """Liger's RMSNorm, SwiGLU and fused linear cross entropy (module docstring); the loss
    itself is vramcalc/terms/logits.py's."""

    name = "liger"

    def applies(self, ctx: RankContext) -> bool:
        return liger(ctx)

    def layer_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        return [t for t in _fused_norms(ctx, saved) if t.name != "mlp.act"]

    def head_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        # the fused loss keeps dL/dhidden instead of lm_head's input
        return [t for t in _fused_norms(ctx, saved) if not t.name.startswith("lm_head.input")]

    def backward_moments(self, ctx: RankContext, moments: list[Moment],
                         saved: list[Saved]) -> list[Moment]:
        # down_proj's backward makes dc while its input is still saved; then d gate and
        # d up are written into a and b: the MLP's worst instant holds every saved tensor
        # and dc, where autograd's act·up backward holds three (T, f) gradients
        x = dims(ctx)
        fewer = 2 * alloc(x.N * x.f, x.c)
        down = sum(t.nbytes for t in saved if t.name == "mlp.down_input")
        return [Moment(m.name, m.held + down, m.work - fewer, m.grads) if m.name == "mlp"
                else m for m in moments]


def head_output_bytes(ctx: RankContext) -> int:
    """The final norm's output, a local of the model's forward that nothing saves (the fused
    loss keeps its gradient instead): T·h in r."""
    x = dims(ctx)
    return alloc(bsh(x), x.r)
