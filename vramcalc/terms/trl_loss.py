"""TRL SFTTrainer's chunked cross entropy (`--trl-chunked-ce`: `loss_type="chunked_nll"`, the
default of TRL's SFTTrainer from 1.7; the hf profile).

Source: huggingface/trl f2cd5771 (1.10.0.dev0) trl/trainer/sft_trainer.py
`_patch_chunked_ce_lm_head`, `_chunked_cross_entropy_loss`, `_chunk`. The patched forward
runs the decoder to its final norm and never calls lm_head. The loss then:

1. shifts by one position: N = b·(s − 1) rows (`hidden_states[..., :-1, :].reshape`, a copy
   for b > 1, freed once gathered);
2. packs the valid labels first: `valid` (N bool), `order` (argsort, N int64), then gathers
   `hidden[order]` (N·h in r, the final norm's dtype) and `labels[order]` (N int64). Every
   label counts as valid (an upper bound: prompt and padding tokens are dropped in a real
   run);
3. runs chunks of 256 rows through `_chunk` under non-reentrant `torch.utils.checkpoint`, so
   a chunk keeps nothing but its inputs (views of the gathered rows) and is computed again
   in backward: `h.float() @ w.float().t()` (an fp32 copy of the rows unless r is fp32, an
   fp32 copy of the head weight unless it is fp32; under autocast the matmul casts both
   back to c), `log_softmax` (fp32; under autocast an fp32 cast of the c logits first),
   `nll_loss`, the argmax of the accuracy metric, and the entropy sum
   `-(log_p.exp() * log_p).sum(-1)` (two more n·V fp32 tensors).

In backward, each chunk is recomputed (up to its last saved tensor; the entropy's are not
kept, its graph died with the model output), then: the matmul's kept operand (the c cast of
the weight under autocast, else the fp32 copy), log_p, dL/dlog_p, dL/dlogits (fp32, its c
cast under autocast), dL/dh; the chunks' dL/dh land in one N·h buffer (`slice_backward`
makes a zero-filled N·h tensor per chunk that is added into it).

What stays from forward into backward (`saved_bytes`): the gathered rows and labels, `order`
(the gather's backward index) and the valid-token count. The final norm's output (T·h·r)
is a local through the loss's forward. The weight's fp32 copy and, for an fp32 head under
autocast, its c cast are casts of a parameter: reported under transients/autocast_cache.
Modelled for a frozen head (LoRA, QLoRA, DoRA); trace twin: vramcalc/trace/trl.py.
"""

from __future__ import annotations

from vramcalc.rank import RankContext
from vramcalc.terms.saved import Modifier, Saved, dims
from vramcalc.units import ALLOC_ROUND_BYTES, alloc

CHUNK_ROWS = 256  # sft_trainer.py _CHUNKED_LM_HEAD_CHUNK_SIZE


def applies(ctx: RankContext) -> bool:
    return ctx.training.trl_chunked_ce and ctx.is_last_stage


def _rows(ctx: RankContext) -> int:
    x = dims(ctx)
    return x.b * (x.s - 1)


def _sizes(ctx: RankContext) -> dict[str, int]:
    """Bytes of one full chunk's tensors (module docstring)."""
    x, tr = dims(ctx), ctx.training
    n, ac, wd = min(CHUNK_ROWS, _rows(ctx)), tr.runs_autocast, tr.weight_dtype
    return {
        "hf": alloc(n * x.h, "fp32") if x.r != "fp32" else 0,
        "wf": alloc(x.V * x.h, "fp32") if wd != "fp32" else 0,
        "hc": alloc(n * x.h, x.c) if ac else 0,
        "wc": alloc(x.V * x.h, x.c) if ac else 0,
        "L": alloc(n * x.V, x.c if ac else "fp32"),
        "P": alloc(n * x.V, "fp32"),
        "L_cast": alloc(n * x.V, "fp32") if ac else 0,
        "dh": alloc(n * x.h, x.c if ac else "fp32"),
    }


def _split(ctx: RankContext, z: dict[str, int]) -> tuple[int, int]:
    """(the weight's casts that are the loss's own tensors, those that are a parameter's)."""
    if ctx.training.weight_dtype == "fp32":  # autocast casts the parameter itself
        return 0, z["wc"]
    return z["wc"], z["wf"]


def _moments(ctx: RankContext, recompute: bool) -> list[tuple[int, int]]:
    """(loss tensors, parameter casts) at each instant of a chunk, above what the loss keeps;
    `recompute`: the chunk's second run in backward and its gradients. A trained head's
    dL/dW is cast back along the forward's casts to the weight's dtype and summed over the
    chunks in autograd's input buffer, which from the second chunk on holds the sum beside
    everything (its first addition makes a new tensor, later ones add in place)."""
    x, tr, z = dims(ctx), ctx.training, _sizes(ctx)
    ac, trained = tr.runs_autocast, _trained_head(ctx)
    own, cast = _split(ctx, z)
    vh, wd = x.V * x.h, tr.weight_dtype
    fin = alloc(vh, wd)
    buf = fin if recompute and trained and _rows(ctx) > CHUNK_ROWS else 0
    mm = (z["hf"] + z["hc"] + z["L"] + own + buf, cast)
    # the matmul keeps its weight operand: the c cast (autocast; the parameter's own when the
    # head is fp32) or the fp32 copy, and for a trained head its row operand
    stored = (own, z["wc"] - own) if ac else (0, z["wf"])
    s_own, s_cast = stored if recompute else (0, 0)
    if recompute and trained:
        s_own += z["hc"] if ac else z["hf"]
    s_own += buf
    out = [mm,
           (s_own + z["L"] + z["L_cast"] + z["P"], s_cast),  # log_softmax
           (s_own + z["L"] + 3 * z["P"], s_cast)]  # the entropy: log_p, exp, their product
    if not recompute:
        return out
    g_c = z["L"] if ac else 0  # dL/dlogits cast to c (the logits' own size)
    out += [(s_own + 3 * z["P"], s_cast),  # log_p, dL/dlog_p, dL/dlogits
            (s_own + z["P"] + g_c, s_cast)]  # dL/dlogits and its c cast
    grad_l = (g_c or z["P"]) + z["dh"]  # the matmul's dL/dlogits and dL/dh
    if not trained:
        return out + [(s_own + grad_l, s_cast)]
    gw = alloc(vh, x.c if ac else "fp32")
    out.append((s_own + grad_l + gw, s_cast))
    chain = [gw] + ([alloc(vh, "fp32")] if ac else []) + ([fin] if wd != "fp32" else [])
    out += [(a + b + buf, 0) for a, b in zip(chain, chain[1:], strict=False)]
    if buf:  # the first addition, beside dL/dh on its way to the rows' buffer
        out.append((2 * fin + buf + (alloc(min(CHUNK_ROWS, _rows(ctx)) * x.h, "fp32")
                                     if ac else 0), 0))
    return out


def _trained_head(ctx: RankContext) -> bool:
    return ctx.training.finetune == "full"


def saved_bytes(ctx: RankContext) -> int:
    """Kept from the loss's forward into its backward: the gathered rows (r) and labels,
    `order` and the valid-token count."""
    x, n = dims(ctx), _rows(ctx)
    return alloc(n * x.h, x.r) + 2 * alloc(n, "int64") + ALLOC_ROUND_BYTES


def _loop_bytes(ctx: RankContext) -> int:
    """Beside the kept tensors during the chunk loop: the valid mask and three running
    sums."""
    return alloc(_rows(ctx), "bool") + 3 * ALLOC_ROUND_BYTES


def forward_parts(ctx: RankContext) -> tuple[int, int]:
    """(the loss's bytes at its forward peak, parameter casts then)."""
    own, cast = max(_moments(ctx, False), key=sum)
    return saved_bytes(ctx) + _loop_bytes(ctx) + own, cast


def backward_parts(ctx: RankContext) -> tuple[int, int]:
    """(the loss's bytes at its backward peak, parameter casts then): from the second chunk
    on, the N·h buffer of dL/dh beside the chunk's instants."""
    x = dims(ctx)
    grad_rows = alloc(_rows(ctx) * x.h, x.r) if _rows(ctx) > CHUNK_ROWS else 0
    own, cast = max(_moments(ctx, True), key=sum)
    return saved_bytes(ctx) + grad_rows + own, cast


def head_output_bytes(ctx: RankContext) -> int:
    """The final norm's output, a local of the patched forward through the loss: T·h in r."""
    x = dims(ctx)
    return alloc(x.T * x.h, x.r)


class TrlChunkedLoss(Modifier):
    """lm_head is never called: it keeps no input (the loss keeps the gathered rows)."""

    name = "trl_chunked_ce"

    def applies(self, ctx: RankContext) -> bool:
        return ctx.training.trl_chunked_ce

    def head_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        return [t for t in saved if not t.name.startswith("lm_head.input")]
