"""The logits and loss section of `vramcalc explain` (vramcalc/terms/logits.py and the
stacks' losses, in words with this scenario's numbers)."""

from __future__ import annotations

from vramcalc.features import chunks_loss
from vramcalc.hf_stack import copies_shifted_logits, loss_in_forward
from vramcalc.rank import RankContext
from vramcalc.report import MemoryReport
from vramcalc.terms.liger import chunk_tokens as liger_chunk_tokens
from vramcalc.terms.litgpt_loop import previous_held_bytes, previous_logits_bytes
from vramcalc.terms.logits import (
    lit_logits_lists,
    logits_backward_peak_bytes,
    logits_forward_peak_bytes,
    logits_saved_bytes,
)
from vramcalc.terms.saved import dims
from vramcalc.terms.torchtitan_tp import loss_parallel
from vramcalc.terms.torchtune import recipe_held, shifts_logits
from vramcalc.terms.unsloth import chunk_logits_bytes, loss_path, num_chunks
from vramcalc.units import DTYPE_BITS, fmt_gb


def _gb(n: float) -> str:
    return fmt_gb(round(n), 3)


def logits_lines(ctx: RankContext, report: MemoryReport) -> list[str]:
    """The logits and cross-entropy buffers (vramcalc/terms/logits.py), on the last stage."""
    x = dims(ctx)
    tr = ctx.training
    n_tok = x.b * x.s
    nv = n_tok * x.V
    where = f"stage {ctx.parallel.pp - 1} (the last)" if ctx.parallel.pp > 1 else "this rank"
    out = [f"On {where}: N = b·s = {n_tok:,} tokens x V' = V/tp = {x.V:,} vocabulary entries "
           f"= {nv:,} logits per micro-batch; the loss runs in fp32."]
    saved = logits_saved_bytes(ctx)
    fwd, bwd = logits_forward_peak_bytes(ctx), logits_backward_peak_bytes(ctx)
    if chunks_loss(tr):
        out.append(f"Chunked cross entropy ({tr.chunked_ce} chunks): the fp32 logits and their "
                   "gradients exist one chunk at a time; the " + ("16-bit logits (compiled)" if
                   tr.compile and tr.framework == "torchtune" else "log-probabilities") + " are all kept.")
    elif shifts_logits(tr):  # --torchtune-version before 0.3 (vramcalc/terms/torchtune.py)
        held = sum(recipe_held(ctx).values())
        out.append("torchtune's recipe (before 0.3) copies the fp32 logits of positions 0..s-2 "
                   f"for the loss, its `logits` holding {_gb(held)} all step with the labels "
                   "copy; CUDA's log_softmax copies the transposed logits contiguous beside "
                   "its output.")
    elif tr.framework == "unsloth" and loss_path(ctx) != "fused":  # --unsloth-version
        out.append("Unsloth's cut cross-entropy (Apple's ml-cross-entropy) makes no logits; it "
                   "keeps the normed hidden states, lse and logit_avg, and its backward "
                   "allocates a full gradient of the frozen lm_head beside dL/dhidden."
                   if loss_path(ctx) == "cce" else f"Unsloth's cross entropy keeps the {x.c} "
                   "logits and writes their gradient into them; the Trainer's mixed precision "
                   "returns an fp32 copy of them at the end of forward.")
    elif tr.framework == "unsloth":  # vramcalc/terms/unsloth.py
        n = num_chunks(ctx)
        out.append(f"Unsloth's fused cross entropy computes the loss and dL/dhidden in forward, "
                   f"{n} chunk{'s' * (n > 1)} of ⌈N/{n}⌉ tokens at a time (fp32 logits of "
                   f"{_gb(chunk_logits_bytes(ctx))} per chunk, none kept), and keeps "
                   f"dL/dhidden (N x h in {x.c}) and the shifted labels for backward.")
    elif tr.liger:  # vramcalc/terms/liger.py
        n = liger_chunk_tokens(ctx)
        out.append(f"Liger's fused linear cross entropy (--liger) makes no full logits: chunks "
                   f"of next_pow2(⌈N/⌈V/h⌉⌉) = {n:,} tokens, each chunk's {x.c} logits "
                   f"({_gb(n * x.V * DTYPE_BITS[x.c] // 8)}; two exist from the second chunk "
                   "on) turned into their gradient in place; "
                   + ("dL/dhidden (N x h) and the head's dL/dW (V x h) are" if tr.finetune
                      == "full" else "dL/dhidden (N x h) is")
                   + " made in forward and kept for backward, which scales it in place.")
    elif tr.trl_chunked_ce:  # vramcalc/terms/trl_loss.py
        out.append(f"TRL's chunked_nll makes no full logits: it keeps the N rows (N x h, {x.r}) "
                   "and runs chunks of 256 under checkpointing, again in backward.")
    elif tr.framework == "megatron":
        c = DTYPE_BITS[tr.compute_dtype] // 8
        out.append(f"Megatron-LM's vocab-parallel cross entropy turns one fp32 copy of the "
                   f"logits into the softmax in place and writes the gradient into it: "
                   f"(4 + {c}) B per logit at both peaks = {nv:,} x {4 + c} B "
                   f"= {_gb(nv * (4 + c))}."
                   + (" With --cross-entropy-loss-fusion (torch.compile'd) the backward "
                      "computes the gradient into a new fp32 buffer first: (4 + 4 + 2) B per "
                      "logit there." if tr.cross_entropy_loss_fusion else ""))
    elif loss_parallel(ctx):  # vramcalc/terms/torchtitan_tp.py
        c = DTYPE_BITS[tr.compute_dtype] // 8
        out.append(f"torchtitan's loss parallel (torch's loss_parallel on each rank's vocabulary "
                   f"shard): forward, the {tr.compute_dtype} logits + their fp32 copy + "
                   f"x - max + its exp: {nv:,} x {c + 12} B = {_gb(nv * (c + 12))}; backward, "
                   f"the kept fp32 log-probabilities + zeros_like grad + exp + their sum: "
                   f"{nv:,} x 16 B = {_gb(16 * nv)}.")
    elif tr.framework == "lightning":  # vramcalc/terms/logits.py, terms/litgpt_loop.py
        c_list, fp32_list = lit_logits_lists(ctx)
        before, held = previous_logits_bytes(ctx), previous_held_bytes(ctx)
        out.append(f"LitGPT's head returns a list of 128-token chunks ({_gb(c_list)} in "
                   f"{x.c}), which Fabric copies to fp32 ({_gb(fp32_list)}, kept in the loop's "
                   "`logits` through backward); each chunk's cross entropy keeps its fp32 "
                   "log-probabilities.")
        out.append(f"The loop keeps the previous micro-batch's list ({_gb(before)})"
                   + (f" and, through its graph, every 4-bit linear's input that bitsandbytes "
                      f"{tr.bnb_version or 'before 0.43.2'} holds ({_gb(held)})" if held else "")
                   + " until the next forward returns (vramcalc/terms/litgpt_loop.py).")
    elif loss_in_forward(tr):  # transformers 4.31-4.45
        ns = x.b * (x.s - 1) * x.V
        copy = (f", a contiguous fp32 copy of the shifted logits ({ns:,} x 4 B)" if x.b > 1
                else "")
        out.append(f"transformers {tr.transformers_version}: the model's forward upcasts "
                   f"lm_head's output and returns the fp32 logits ({nv:,} x 4 B; the "
                   f"{x.c} ones are freed at once, their block left cached) and computes the "
                   f"loss on them{copy} and its log-probabilities ({ns:,} x 4 B, kept); "
                   f"backward, 3 x {ns:,} x 4 B = {_gb(12 * ns)}.")
    elif copies_shifted_logits(tr) and x.b > 1:  # transformers 4.46-4.48
        ns = x.b * (x.s - 1) * x.V
        out.append(f"transformers {tr.transformers_version}'s ForCausalLMLoss keeps the fp32 "
                   f"upcast ({nv:,} x 4 B) while a contiguous fp32 copy of the shifted logits "
                   f"and its log-probabilities ({ns:,} x 4 B each) are made: "
                   f"{_gb(4 * nv + 8 * ns)} in forward; backward, 3 x {ns:,} x 4 B = "
                   f"{_gb(12 * ns)}. From 4.49 the labels are padded and no copy is made.")
    else:
        out.append(f"Forward: fp32 upcast of the logits + fp32 log-probabilities (kept for "
                   f"backward): 2 x {nv:,} x 4 B = {_gb(8 * nv)}.")
        out.append(f"Backward: the kept log-probabilities + dL/dlogprobs + dL/dlogits, all "
                   f"fp32: 3 x {nv:,} x 4 B = {_gb(12 * nv)}.")
    out.append(f"This scenario: kept {_gb(saved)}, forward peak {_gb(fwd)}, backward peak "
               f"{_gb(bwd)} (each tensor rounded to 512 B blocks; vramcalc/terms/logits.py).")
    if tr.framework in ("hf", "torchtitan") and tr.compute_dtype != "fp32" and not \
            chunks_loss(tr) and not loss_parallel(ctx) and not tr.liger and \
            not tr.trl_chunked_ce and \
            not loss_in_forward(tr):
        out.append(f"The {tr.framework} profile also keeps the {tr.compute_dtype} logits "
                   f"({nv:,} x {DTYPE_BITS[tr.compute_dtype] // 8} B) until the loss returns.")
    out.append(f"At the peak ({report.peak_phase}) the report counts "
               f"{_gb(report.terms.logits)} of logits.")
    return out
