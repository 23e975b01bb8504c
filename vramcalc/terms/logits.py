"""Term: logits — the output projection's logits and the cross-entropy buffers (last stage).

With N = b·s tokens on this rank, V' = V/tp (vocab-parallel head), c = compute dtype, and
the loss computed in fp32 (`F.cross_entropy(logits.float(), labels)`, as both profiles do):

- forward, at the end of the loss: the fp32 logits (the upcast; the c-typed logits are freed
  by the reference model as soon as they are upcast, while transformers keeps them in its
  output object until the forward returns) + fp32 log-probabilities (saved by log_softmax)
  + the loss and nll_loss's total weight (0-dim, one 512 B block each); transformers also
  pads and shifts the labels (int64);
- after forward: the fp32 log-probabilities, the two scalars and (hf) the shifted labels;
- start of backward (the loss is the root): saved log-probabilities + dL/dlogprobs (fp32,
  from nll_loss_backward) + dL/dlogits (fp32, from log_softmax_backward) + the loss, its
  scaled copy and their gradient (0-dim);
- then the c-typed gradient of the logits flows into the head.

Source: PyTorch's log_softmax/nll_loss autograd formulas (tools/autograd/derivatives.yaml:
log_softmax saves `result`, its backward returns a new tensor; nll_loss backward allocates
a zero grad of the input's shape); transformers loss/loss_utils.py ForCausalLMLoss. Checked
against the trace engine (tests/test_trace.py).

torchtitan under TP runs torch's loss parallel (vramcalc/terms/torchtitan_tp.py): c + 12
bytes per logit in forward, 16 in backward.

The `megatron` profile runs Megatron-LM's vocab-parallel cross entropy instead (NVIDIA/
Megatron-LM d98e8a64, megatron/core/tensor_parallel/cross_entropy.py
`_VocabParallelCrossEntropy`, the default: `cross_entropy_loss_fusion = False` in
megatron/core/model_parallel_config.py): see `_megatron_*` below. 4 + c bytes per logit at
both peaks instead of 8 (forward) and 12 (backward).
"""

from __future__ import annotations

from vramcalc.features import chunks_loss, finetunes
from vramcalc.hf_stack import copies_shifted_logits, loss_in_forward
from vramcalc.qlora import dequant_backward_bytes, dequant_matmul_bytes
from vramcalc.rank import RankContext
from vramcalc.terms import encoder as enc
from vramcalc.terms import liger as lig
from vramcalc.terms import linear_ce as lce
from vramcalc.terms import torchtitan_tp as ttp
from vramcalc.terms import torchtune as ttn
from vramcalc.terms import trl_loss as trl
from vramcalc.terms import unsloth as uns
from vramcalc.terms.lowmem import (
    chunk_tokens,
    chunked_backward_peak_bytes,
    chunked_forward_peak_bytes,
    chunked_saved_bytes,
    head_input_split,
)
from vramcalc.terms.megatron_mtp import mtp_depths
from vramcalc.terms.saved import autocasts_adapters, dims
from vramcalc.units import ALLOC_ROUND_BYTES, alloc


def _nv(ctx: RankContext) -> int:
    x = dims(ctx)
    return x.b * x.s * x.V


def _hf_labels_kept(ctx: RankContext) -> int:
    """transformers' shifted labels kept by nll_loss: labels[..., 1:].contiguous() of the
    (b, s + 1) padded labels — a view when b = 1, a copy otherwise."""
    x = dims(ctx)
    return alloc(x.b * (x.s + 1), "int64") if x.b == 1 else alloc(x.b * x.s, "int64")


# transformers 4.46-4.48 (`--transformers-version`, hf_stack.copies_shifted_logits), v4.46.0
# loss/loss_utils.py ForCausalLMLoss: `logits = logits.float()` stays bound until the
# function returns, `shift_logits = logits[..., :-1, :].contiguous()` is a second fp32
# buffer of N' = b·(s-1) positions, and cross_entropy works on those N' positions (its
# log-probabilities and gradients). With b = 1 the slices are contiguous already, so
# `.contiguous()` returns them as they are: no copy of the logits or of the labels. The
# logits' backward then runs SliceBackward (zeros of all N positions) and the cast back to
# c, both below the loss's.
def _shifted_nv(ctx: RankContext) -> int:
    x = dims(ctx)
    return x.b * (x.s - 1) * x.V


def _shifted_copy(ctx: RankContext) -> int:
    """The contiguous fp32 copy of the shifted logits (none when b = 1)."""
    return alloc(_shifted_nv(ctx), "fp32") if dims(ctx).b > 1 else 0


def _shifted_labels(ctx: RankContext) -> int:
    x = dims(ctx)
    return alloc(x.b * (x.s - 1), "int64") if x.b > 1 else 0


# ---- Megatron-LM's vocab-parallel cross entropy -----------------------------------------
# What exists, per micro-batch on the last stage (N = b·s tokens, V' = V/t, c = compute dtype):
# - gpt_model.py GPTModel._postprocess: `logits, _ = self.output_layer(...)` in c (output_dtype
#   = logit_dtype, None by default: the input's dtype); the local `logits` lives until
#   `compute_language_model_loss(labels, logits)` returns, and nothing saves it.
# - cross_entropy.py VocabParallelCrossEntropy.calculate_logits_max: `logits.float()`, one
#   fp32 copy (N·V'·4; the same tensor when c is fp32); calculate_predicted_logits subtracts
#   the max in place and `torch.exp(..., out=exp_logits)` in place; calculate_cross_entropy_
#   loss divides in place: that fp32 buffer becomes the softmax, and
#   `ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)` keeps it with a bool
#   and an int64 (N) vector.
# - backward: prepare_gradient_calculation_operands takes `grad_input = softmax`,
#   calculate_gradients subtracts 1 at the targets and `grad_input.mul_(grad_output)`: the
#   gradient is written into the saved buffer. The Function returns it in fp32 for a c-typed
#   input, so autograd's validate_outputs (torch/csrc/autograd/engine.cpp) casts it to c
#   while the fp32 buffer is still held: 4 + c bytes per logit. The fused native variant
#   (megatron/core/fusions/fused_cross_entropy.py, --cross-entropy-loss-fusion) does the same
#   work and casts `grad_input.to(torch.bfloat16)` inside its backward: the same pair.
# - pretrain_gpt.py loss_func: `torch.sum(losses * loss_mask)` keeps the fp32 loss_mask (N)
#   for backward; the loss and the token count are 0-dim.
def _megatron_small_bytes(ctx: RankContext) -> int:
    """The (N) vectors the vocab-parallel cross entropy keeps for backward: target_mask
    (bool), masked_target_1d (int64), and loss_func's fp32 loss_mask."""
    x = dims(ctx)
    n = x.b * x.s
    return alloc(n, "bool") + alloc(n, "int64") + alloc(n, "fp32")


def _megatron_c_logits_bytes(ctx: RankContext) -> int:
    """The c-typed logits (forward) or their c-typed gradient (backward) next to the fp32
    buffer; none when c is fp32 (`.float()` returns the logits themselves)."""
    c = ctx.training.compute_dtype
    return 0 if c == "fp32" else alloc(_nv(ctx), c)


def _megatron_one_loss_bytes(ctx: RankContext) -> int:
    """fp32 softmax (N·V'·4) + the small (N) vectors + loss and token count (0-dim)."""
    return alloc(_nv(ctx), "fp32") + _megatron_small_bytes(ctx) + 2 * ALLOC_ROUND_BYTES


def _megatron_mtp_losses_bytes(ctx: RankContext) -> int:
    """What the multi-token-prediction losses keep (`--mtp-layers`): Megatron-LM d98e8a64
    multi_token_prediction.py `process_mtp_loss` runs the shared output layer and
    `compute_language_model_loss` (the same vocab-parallel cross entropy) once per depth
    before the main loss and attaches each loss to the hidden states (MTPLossAutoScaler),
    so every depth's saved set is held through the main loss's forward and backward."""
    return mtp_depths(ctx) * _megatron_one_loss_bytes(ctx)


def _megatron_saved_bytes(ctx: RankContext) -> int:
    """The main loss's saved set and the MTP depths' (`_megatron_mtp_losses_bytes`)."""
    return _megatron_one_loss_bytes(ctx) + _megatron_mtp_losses_bytes(ctx)


def _megatron_forward_peak_bytes(ctx: RankContext) -> int:
    """End of the loss forward: the c logits still alive in `_postprocess` + what is saved +
    the forward's fp32 (N) vectors (logits_max, predicted_logits, sum_exp_logits, its log,
    the per-token loss)."""
    x = dims(ctx)
    return (_megatron_c_logits_bytes(ctx) + _megatron_saved_bytes(ctx)
            + 5 * alloc(x.b * x.s, "fp32"))


def _megatron_backward_peak_bytes(ctx: RankContext) -> int:
    """Loss backward: the saved fp32 buffer holding the gradient in place + its c-typed cast
    + the saved (N) vectors + the gradient step's (N) operands (grad_output, arange_1d,
    softmax_update) + the three 0-dim tensors of the backward root."""
    x = dims(ctx)
    n = x.b * x.s
    if ctx.training.cross_entropy_loss_fusion:
        # --cross-entropy-loss-fusion (fusions/fused_cross_entropy.py): `calculate_gradients`
        # under torch.compile (core/jit.py `jit_fuser`) mutates its input, the saved
        # softmax, so inductor computes the gradient into a new fp32 buffer and writes it
        # back, beside the bf16 result (`grad_input.to(torch.bfloat16)`); the (N) operands
        # stay inside the one kernel (torch 2.13's generated code)
        return (2 * alloc(_nv(ctx), "fp32") + alloc(_nv(ctx), "bf16")
                + _megatron_mtp_losses_bytes(ctx) + _megatron_small_bytes(ctx)
                + 3 * ALLOC_ROUND_BYTES)
    return (alloc(_nv(ctx), "fp32") + _megatron_c_logits_bytes(ctx)
            + _megatron_mtp_losses_bytes(ctx)
            + _megatron_small_bytes(ctx) + 2 * alloc(n, "fp32") + alloc(n, "int64")
            + 3 * ALLOC_ROUND_BYTES)


# ---- LitGPT (lightning profile) ------------------------------------------------------------
# LitGPT 8641822 finetune/lora.py: `logits = model(input_ids, lm_head_chunk_size=128)` returns
# a list of per-128-token head outputs (lit_gpt/lora.py GPT.forward); Fabric's precision
# plugin converts the module's outputs to the default dtype, fp32 (lightning 2.1 fabric/
# plugins/precision/half.py and amp.py `convert_output`), so the list holds N·V fp32 logits,
# alive in the loop's `logits` variable through backward. `chunked_cross_entropy`
# (lit_gpt/utils.py) runs F.cross_entropy(reduction="none") per chunk: each log_softmax saves
# its fp32 output, all kept until backward; the per-token losses are cat'ed and averaged.
def _lit_chunks(ctx: RankContext) -> list[int]:
    """Logits per head chunk: b·min(128, rest)·V' (lm_head_chunk_size=128)."""
    x = dims(ctx)
    return [x.b * min(128, x.s - i) * x.V for i in range(0, x.s, 128)]


def lit_logits_lists(ctx: RankContext) -> tuple[int, int]:
    """LitGPT's head output as Fabric returns it: the chunks in the compute dtype and their
    fp32 copies (`convert_output` to the default dtype; no copy when they are fp32)."""
    fp32 = sum(alloc(n, "fp32") for n in _lit_chunks(ctx))
    c = ctx.training.compute_dtype
    return (0 if c == "fp32" else sum(alloc(n, c) for n in _lit_chunks(ctx))), fp32


def _lit_saved_bytes(ctx: RankContext) -> int:
    """fp32 logits list + fp32 log-probabilities per chunk + the per-token losses (N fp32,
    the cat) + the mean."""
    x = dims(ctx)
    return (2 * sum(alloc(n, "fp32") for n in _lit_chunks(ctx))
            + alloc(x.b * x.s, "fp32") + ALLOC_ROUND_BYTES)


def _lit_backward_peak_bytes(ctx: RankContext) -> int:
    """Loss backward, at the last chunk: the saved set + that chunk's dL/dlogprobs and
    dL/dlogits (fp32) + the loss, its scaled copy and their gradient."""
    largest = max(_lit_chunks(ctx), default=0)
    return _lit_saved_bytes(ctx) + 2 * alloc(largest, "fp32") + 3 * ALLOC_ROUND_BYTES


def logits_saved_bytes(ctx: RankContext) -> int:
    """Held from the end of forward into backward, per micro-batch: fp32 log-probabilities,
    the loss and nll_loss's total weight (and the hf profile's shifted labels)."""
    if not ctx.is_last_stage:
        return 0
    if ctx.spec.is_encoder:  # vramcalc/terms/encoder.py
        return enc.logits_saved_bytes(ctx)
    if ttn.shifts_logits(ctx.training):  # torchtune before 0.3 (vramcalc/terms/torchtune.py)
        return ttn.shifted_saved_bytes(ctx)
    if lce.applies(ctx.training):  # torchtune's main branch (vramcalc/terms/linear_ce.py)
        return lce.saved_bytes(ctx)
    if ctx.training.framework == "torchtune" and (chunks_loss(ctx.training)
                                                   or ctx.training.compile):
        return (ttn.saved_bytes(ctx) if chunks_loss(ctx.training)
                else ttn.unchunked_compiled_saved_bytes(ctx))  # vramcalc/terms/torchtune.py
    if ctx.training.framework == "lightning":
        return _lit_saved_bytes(ctx)
    if ctx.training.framework == "unsloth":  # fused CE, no logits kept (terms/unsloth.py)
        return uns.loss_parts(ctx)[0]
    if lig.liger(ctx):  # Liger's fused linear cross entropy (terms/liger.py)
        return lig.saved_bytes(ctx)
    if trl.applies(ctx):  # TRL's chunked_nll (terms/trl_loss.py)
        return trl.saved_bytes(ctx)
    if chunks_loss(ctx.training):  # vramcalc/terms/lowmem.py
        return chunked_saved_bytes(ctx)
    if ctx.training.framework == "megatron":
        return _megatron_saved_bytes(ctx)
    if copies_shifted_logits(ctx.training):
        return alloc(_shifted_nv(ctx), "fp32") + 2 * ALLOC_ROUND_BYTES + _shifted_labels(ctx)
    out = alloc(_nv(ctx), "fp32") + 2 * ALLOC_ROUND_BYTES
    if ctx.training.framework == "hf":
        out += _hf_labels_kept(ctx)
    return out


def logits_forward_peak_bytes(ctx: RankContext) -> int:
    """Peak of the loss computation in forward (includes what it keeps for backward); with
    a 4-bit lm_head, at least its dequantized matmul (`_nf4_head_bytes`)."""
    if not ctx.is_last_stage:
        return 0
    if ctx.spec.is_encoder:
        return enc.logits_forward_peak_bytes(ctx)
    return max(_loss_forward_peak_bytes(ctx), _nf4_head_bytes(ctx, backward=False))


def _loss_forward_peak_bytes(ctx: RankContext) -> int:
    """The loss in forward: logits, their upcast and what the loss keeps (last stage)."""
    if ttn.shifts_logits(ctx.training):
        return ttn.shifted_forward_peak_bytes(ctx)
    if lce.applies(ctx.training):
        return lce.forward_peak_bytes(ctx)
    if ctx.training.framework == "torchtune" and (chunks_loss(ctx.training)
                                                   or ctx.training.compile):
        return (ttn.forward_peak_bytes(ctx) if chunks_loss(ctx.training)
                else ttn.unchunked_compiled_forward_peak_bytes(ctx))
    if ctx.training.framework == "lightning":  # the saved set is the loss's peak
        return _lit_saved_bytes(ctx)
    if ctx.training.framework == "unsloth":
        return uns.loss_parts(ctx)[1]
    if lig.liger(ctx):
        return lig.forward_peak_bytes(ctx)
    if trl.applies(ctx):
        return trl.forward_parts(ctx)[0]
    if chunks_loss(ctx.training):  # vramcalc/terms/lowmem.py
        return chunked_forward_peak_bytes(ctx)
    if ctx.training.framework == "megatron":
        return _megatron_forward_peak_bytes(ctx)
    if ttp.loss_parallel(ctx):  # torchtitan's loss parallel (terms/torchtitan_tp.py)
        return ttp.loss_parallel_forward_peak_bytes(ctx)
    nv, c = _nv(ctx), ctx.training.compute_dtype
    out = 2 * alloc(nv, "fp32") + 2 * ALLOC_ROUND_BYTES  # fp32 logits + log-probs + scalars
    if ctx.training.framework == "torchtitan" and c != "fp32":
        out += alloc(nv, c)  # train.py keeps `pred` until `del pred`, after the loss
    if copies_shifted_logits(ctx.training):  # the upcast + the shifted copy + its log-probs
        out = (alloc(nv, "fp32") + _shifted_copy(ctx) + alloc(_shifted_nv(ctx), "fp32")
               + 2 * ALLOC_ROUND_BYTES + _shifted_labels(ctx))
        if c != "fp32" and not loss_in_forward(ctx.training):  # the model output's (4.46+;
            out += alloc(nv, c)  # before 4.46 the forward's upcast freed them, its own fp32)
    elif ctx.training.framework == "hf":
        x = dims(ctx)
        if c != "fp32":  # the c-typed logits live on in the model output
            out += alloc(nv, c)
        out += alloc(x.b * (x.s + 1), "int64")  # padded labels
        if x.b > 1:
            out += alloc(x.b * x.s, "int64")  # their shifted copy
    if ctx.training.framework == "hf":
        x = dims(ctx)
        tr = ctx.training
        if tr.lora_head:
            # PEFT lora.Linear on lm_head: `result + lora_B(lora_A(x)) * scaling` holds the
            # base logits (c), the scaled B output and their sum (fp32 adapters; c under
            # autocast) at once, before the loss; with dropout, PEFT's fp32 cast of the
            # input is a local beside what A keeps
            b_dt = c if autocasts_adapters(ctx, x) else "fp32"
            cast = tr.lora_dropout > 0 and not x.amp and x.r != "fp32"
            out = max(out, alloc(nv, c) + 2 * alloc(nv, b_dt)
                      + (alloc(x.T * x.h, "fp32") if cast else 0))
    return out


def logits_backward_peak_bytes(ctx: RankContext) -> int:
    """Peak of the loss backward: saved log-probs + two fp32 gradient buffers + 3 scalars;
    with a 4-bit lm_head, at least its dequantized dL/dx (`_nf4_head_bytes`)."""
    if not ctx.is_last_stage:
        return 0
    if ctx.spec.is_encoder:
        return enc.logits_backward_peak_bytes(ctx)
    return max(_loss_backward_peak_bytes(ctx), _nf4_head_bytes(ctx, backward=True))


def nf4_head_forward_bytes(ctx: RankContext) -> int:
    """The 4-bit lm_head's forward matmul of the last chunk (0 without one)."""
    return _nf4_head_bytes(ctx, backward=False)


def _nf4_head_bytes(ctx: RankContext, backward: bool) -> int:
    """QLoRA with --quantize-head: the output layer's 4-bit matmul of the last (or only)
    chunk of n tokens dequantizes its V·h weight (vramcalc/qlora.py). Forward: the earlier
    chunks' kept log-probabilities + the weight, its decoding buffers and the (n, V) logits;
    backward (the last chunk's head node runs first): the other chunks' log-probabilities +
    its (n, V) gradient in c + the weight again and dL/dx (n, h)."""
    tr = ctx.training
    if tr.finetune != "qlora" or not tr.quantize_head:
        return 0
    x = dims(ctx)
    w = x.V * x.h
    if tr.framework == "lightning":
        # LitGPT's 128-token head chunks: forward, the earlier chunks' outputs beside the
        # last chunk's matmul; backward, every chunk's gradient in c (autograd runs all the
        # losses' and Fabric's fp32 casts' nodes, created after the head's, first) beside
        # the fp32 list the loop's `logits` holds
        logits = _lit_chunks(ctx)
        chunks = [alloc(n, x.c) for n in logits]
        n = logits[-1] // x.V
        if backward:
            return (lit_logits_lists(ctx)[1] + sum(chunks)
                    + dequant_backward_bytes(w, x.c, tr.nf4, alloc(n * x.h, x.c)))
        return sum(chunks[:-1]) + dequant_matmul_bytes(w, x.c, tr.nf4, chunks[-1])
    n = chunk_tokens(ctx)[-1] if chunks_loss(tr) else x.b * x.s
    saved = chunked_saved_bytes(ctx) if chunks_loss(tr) else 0
    others = saved - (alloc(n * x.V, "fp32") + ALLOC_ROUND_BYTES if chunks_loss(tr) else 0)
    if backward:
        return (others + alloc(n * x.V, x.c)
                + dequant_backward_bytes(w, x.c, tr.nf4, alloc(n * x.h, x.c)))
    return others + dequant_matmul_bytes(w, x.c, tr.nf4, alloc(n * x.V, x.c))


def _loss_backward_peak_bytes(ctx: RankContext) -> int:
    """The loss backward: kept log-probabilities and the fp32 gradient buffers."""
    if ttn.shifts_logits(ctx.training):
        return ttn.shifted_backward_peak_bytes(ctx)
    if lce.applies(ctx.training):
        return lce.backward_peak_bytes(ctx)
    if ctx.training.framework == "torchtune" and (chunks_loss(ctx.training)
                                                   or ctx.training.compile):
        return (ttn.backward_peak_bytes(ctx) if chunks_loss(ctx.training)
                else ttn.unchunked_compiled_backward_peak_bytes(ctx))
    if ctx.training.framework == "lightning":
        return _lit_backward_peak_bytes(ctx)
    if ctx.training.framework == "unsloth":  # the kept dL/dhidden and its scaled copy
        return uns.loss_parts(ctx)[2]
    if lig.liger(ctx):  # the kept gradients, scaled in place
        return lig.backward_peak_bytes(ctx)
    if trl.applies(ctx):
        return trl.backward_parts(ctx)[0]
    if chunks_loss(ctx.training):  # vramcalc/terms/lowmem.py
        return chunked_backward_peak_bytes(ctx)
    if ctx.training.framework == "megatron":
        return _megatron_backward_peak_bytes(ctx)
    if ttp.loss_parallel(ctx):
        return ttp.loss_parallel_backward_peak_bytes(ctx)
    if copies_shifted_logits(ctx.training):
        return 3 * alloc(_shifted_nv(ctx), "fp32") + 3 * ALLOC_ROUND_BYTES
    return 3 * alloc(_nv(ctx), "fp32") + 3 * ALLOC_ROUND_BYTES


def head_forward_extra_bytes(ctx: RankContext) -> int:
    """Under autocast the final norm's fp32 output is not what lm_head saves (it saves a
    16-bit cast), yet the model keeps it in a local until the forward returns: T·h·4. A
    frozen lm_head (LoRA/QLoRA/DoRA) saves no input: the norm output, T·h·r, is then alive
    only through that local."""
    x = dims(ctx)
    if not ctx.is_last_stage:
        return 0
    if lig.liger(ctx):  # nothing saves the final norm's output (terms/liger.py)
        return lig.head_output_bytes(ctx)
    if trl.applies(ctx):  # the patched forward's local (terms/trl_loss.py)
        return trl.head_output_bytes(ctx)
    if finetunes(ctx.training) and "lm_head" not in ctx.training.modules_to_save:
        # a frozen lm_head saves no input at all, unless an old bitsandbytes 4-bit head holds
        # it (finetune_activations.py); an adapter on it may keep the very tensor
        tr = ctx.training
        held = tr.finetune == "qlora" and tr.quantize_head and tr.nf4.keeps_input
        shared = tr.lora_head and not x.amp and x.r == "fp32"
        return 0 if held or shared else alloc(x.T * x.h, x.r)
    if chunks_loss(ctx.training):  # lm_head saves per-chunk copies, or views of the local
        return alloc(x.T * x.h, x.r) if head_input_split(ctx) else 0
    if x.r == x.c:
        return 0
    return alloc(x.T * x.h, x.r)


def freed_logits_bytes(ctx: RankContext) -> int:
    """Reserved but not allocated at the loss backward: the c-typed logits' block, freed
    before backward (the reference model after the upcast, torchtitan's `del pred`,
    transformers' output dropped by the training loop), is too small for the fp32 buffers
    that backward allocates next (dL/dlogprobs, dL/dlogits: twice its size each), so the
    caching allocator maps new memory beside it. The plain `F.cross_entropy(logits.float())`
    path only (reference, hf, torchtitan, deepspeed), with c narrower than fp32 and the
    block in the large pool (> 1 MiB; smaller blocks serve the backward's small requests).
    Source: the allocator's best fit over cached blocks that are at least the request
    (vramcalc/allocator.py, c10/cuda/CUDACachingAllocator.cpp `get_free_block`); checked
    against the trace engine's replay (tests/test_reserved_hole.py). Before transformers
    4.46 (`loss_in_forward`) the forward's own upcast frees the block ahead of the loss,
    whose fp32 buffers are all larger: a hole at the loss's forward peak as well, whatever
    the micro-batch."""
    tr = ctx.training
    if (not ctx.is_last_stage or ctx.spec.is_encoder or chunks_loss(tr) or tr.liger
            or tr.trl_chunked_ce
            or tr.framework not in ("reference", "hf", "torchtitan", "deepspeed")
            or tr.compute_dtype == "fp32"
            or (copies_shifted_logits(tr) and _shifted_copy(ctx) and not loss_in_forward(tr))):
        return 0  # (4.46-4.48, b > 1: the freed upcast and shifted copy take backward's)
    size = alloc(_nv(ctx), tr.compute_dtype)
    return size if size > 1 << 20 else 0


def loss_root_bytes(ctx: RankContext) -> int:
    """0-dim tensors alive through the whole backward: the loss, the loss scaled by
    1/grad_accum, and the root gradient (ones_like) that backward() seeds."""
    return 3 * ALLOC_ROUND_BYTES if ctx.is_last_stage else 0
