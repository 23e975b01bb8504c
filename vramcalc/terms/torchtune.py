"""The torchtune profile: what torchtune's single-device recipes keep that the reference
profile does not (legend: vramcalc/terms/saved.py; N = b·s tokens, V the vocabulary,
c = r = the recipe's `dtype`, bf16 or fp32: torchtune runs no autocast).

Source: pytorch/torchtune 1814feb17a9038e1a8053ce93111bd26774a8db6 (Nov 2024).

A layer without checkpointing (torchtune/modules/transformer.py
`TransformerSelfAttentionLayer`, rms_norm.py, attention.py, position_embeddings.py,
feed_forward.py) keeps what torchtitan's Llama block keeps (vramcalc/terms/torchtitan.py:
the Python RMSNorm's `x.float()` copy, rstd and x̂; k and v expanded to a heads by
`expand(...).flatten(1, 2)`, a copy when g < a; SDPA's output and logsumexp; the SwiGLU's
four (N, f) tensors). RoPE's `x.float()` copy is not kept: the rotation multiplies it by
the cache, which needs no gradient, so the products keep only the cache's slices (views
of the buffer; with packed sequences `cache[input_pos]` gathers a (b, s, d/2, 2) fp32 copy
per call, which they keep: vramcalc/terms/packed.py).

The loss (recipes/full_finetune_single_device.py `_loss_step`, modules/loss/
ce_chunked_output_loss.py `CEWithChunkedOutputLoss`, transformer.py `chunked_output`),
`--chunked-ce n` = `num_output_chunks`: the model's forward returns the list of the output
projection of each of the n sequence chunks (`h.chunk(n, dim=1)`: ⌈s/n⌉ positions each,
the last one shorter), all n chunks in c, alive together until the recipe's `del logits`
after the loss. The loss upcasts and reduces one chunk at a time:

| loss | kept from forward into backward | forward peak | backward peak |
|---|---|---|---|
| eager | every chunk's fp32 log-probabilities (`log_softmax`), nll's total weight and (b > 1) the chunk's labels copy | the kept ones + all c logits (N·V·c) + the last chunk's fp32 upcast | the kept ones + dL/dlog-probs and dL/dlogits of the first chunk differentiated (2·N_last·V·4) |
| compiled (`compile: True`: `training.compile_loss` compiles `compute_cross_entropy`) | each chunk's c logits (the compiled graph's input) + its row max and log-sum-exp, (N_i) fp32 each (+ labels copy) | the kept ones | the kept ones + the gradient of the largest chunk (N_0·V·c) |

The compiled region's saved set is torch's own answer: AOTAutograd's min-cut partitioner
over inductor's decompositions of `F.cross_entropy(logits.float(), labels, reduction=
"sum")` returns (logits, labels, amax, log) to the backward graph
(tests/test_torchtune.py traces it under FakeTensorMode); inductor fuses the (N_i, V)
pointwise chain into its reduction and gradient kernels, so neither pass allocates an fp32
(N_i, V) buffer. Autograd runs every chunk's cross-entropy backward before the output
projection's (their nodes were created later: higher sequence numbers run first), so at the
end of the loss's backward the c gradients of all n chunks exist at once (N·V·c).

Without chunking (`--chunked-ce 1`, torch.nn.CrossEntropyLoss): the model returns
`self.output(h).float()` and the loss is the reference profile's (vramcalc/terms/logits.py),
or, compiled (the whole loss module compiled), it keeps its fp32 input and the two (N)
vectors and its backward makes one fp32 (N, V) gradient.

Releases before 0.3.0 (`--torchtune-version`; v0.1.0 and v0.2.1 recipes/*_finetune_*.py,
`train`) shift in the recipe: `logits = logits[..., :-1, :].contiguous()` (a fp32 copy of
N' = b·(s-1) positions; with b = 1 the slice is contiguous and `.contiguous()` returns the
model's output itself), `labels = labels[..., 1:].contiguous()`, `logits =
logits.transpose(1, 2)` and `torch.nn.CrossEntropyLoss` over (b, V, s-1). CUDA's log_softmax
makes a contiguous copy of that transposed input while it runs (aten/src/ATen/native/cuda/
SoftMax.cu `host_softmax`: `input_.contiguous()`), beside its output, the kept
log-probabilities. The recipe's `logits` names the shifted copy until the next micro-batch's
model returns: through backward, the optimizer step and the next forward (`recipe_held`),
except in lora_finetune_distributed from 0.2.0, which deletes it after the loss (cb3ed29,
"del logits to save peak memory"). In backward, nll_loss's gradient and log_softmax's
(contiguous: no copies) join the kept log-probabilities. From 0.3.0 labels are shifted with
`torch.hstack` and the logits reshaped, not sliced (the table above); the distributed
recipes moved from FullyShardedDataParallel to FSDP2 then (vramcalc/scenario.py).

RoPE's buffers (`rope_buffer_bytes`, a weights sub-term: they live from the model's build to
the end): each RoPE module registers `theta` (d/2) and `cache`, both fp32 and built for the
model builder's `max_seq_len` (the config's max_position_embeddings: 131,072 for Llama 3.1),
not for the batch: (P, d/2, 2) (modules/position_embeddings.py, Llama3ScaledRoPE), (P, 2d)
for Qwen2's and Phi-3's, which keep cos and sin of the doubled angles
(`torch.cat([freqs.cos(), freqs.sin()], dim=-1)`). Forward slices `cache[:seq_len]`, a view,
so the rotation's products keep nothing of their own. Builders made one layer and
deep-copied it `num_layers` times (`TransformerDecoder` `_get_clones`), each copy with its
own buffers, until they built every layer around one shared RoPE module: Llama 3.1's (and
3.2's) from v0.3.1 (b0895a79, #1554), the others' from v0.6.0 (23896c30, #2282); Gemma 2's
builder always shared it. Llama 3.1-8B under v0.3.0: 32 × 131,072 × 64 × 2 × 4 B = 2.1 GB.
"""

from __future__ import annotations

from vramcalc.features import finetunes
from vramcalc.model import ModelSpec
from vramcalc.rank import RankContext
from vramcalc.stack_rules import (
    TORCHTUNE_0_2,
    TORCHTUNE_0_3,
    TORCHTUNE_0_3_1,
    TORCHTUNE_0_6,
    TORCHTUNE_OLDEST,
    torchtune_before,
)
from vramcalc.terms.gradients import grad_dtype
from vramcalc.terms.lowmem import head_input_split
from vramcalc.terms.saved import Saved, dims
from vramcalc.terms.saved_layers import moe_saved
from vramcalc.terms.torchtitan import attention_part_saved
from vramcalc.terms.torchtitan import plain_layer_saved as titan_layer_saved
from vramcalc.terms.torchtitan_compile import compiled_block_saved
from vramcalc.training import TrainingConfig
from vramcalc.units import ALLOC_ROUND_BYTES, alloc, ceil_div


def plain_layer_saved(ctx: RankContext, moe: bool = False) -> list[Saved]:
    """One torchtune layer without checkpointing: torchtitan's block table, or the compiled
    layer's (module docstring); a MoE layer (`moe`): the same norms and attention, then the
    experts' table (vramcalc/terms/saved_layers.py `moe_saved`)."""
    if moe:
        return attention_part_saved(ctx) + moe_saved(ctx, dims(ctx))
    return compiled_layer_saved(ctx) if ctx.training.compile else titan_layer_saved(ctx)


def compiled_layer_saved(ctx: RankContext) -> list[Saved]:
    """What a compiled layer's forward keeps for its backward (`compile_model` compiles each
    layer; under checkpointing this is what the recompute in backward keeps). torchtune's
    Llama layer is torchtitan's block op for op, so the min-cut partition is the same: the
    layer's input and each norm's rstd (x̂ recomputed), the matmuls' outputs and inputs,
    SDPA's, silu recomputed (vramcalc/terms/torchtitan_compile.py; vramcalc/trace/compiled.py
    `torchtune_layer` through `compiled_saved`; tests/test_torchtune.py)."""
    return compiled_block_saved(ctx)


def chunk_tokens(ctx: RankContext) -> list[int]:
    """Tokens (b·s_i) of each chunk of `h.chunk(n, dim=1)`: ⌈s/n⌉ positions per chunk, as
    many chunks as that takes (torch.chunk)."""
    x = dims(ctx)
    size = ceil_div(x.s, min(ctx.training.chunked_ce, x.s))
    return [x.b * min(size, x.s - start) for start in range(0, x.s, size)]


def _small(ctx: RankContext, n: int, compiled: bool) -> int:
    """A chunk's kept (n)-sized tensors: its labels copy when b > 1 (`reshape(-1)` of a
    strided chunk), and the compiled graph's row max and log-sum-exp or eager nll_loss's
    0-dim total weight."""
    out = alloc(n, "int64") if dims(ctx).b > 1 else 0
    return out + (2 * alloc(n, "fp32") if compiled else ALLOC_ROUND_BYTES)


def _head_copies(ctx: RankContext, chunks: list[int]) -> int:
    """The output projection's per-chunk input copies beyond the first (a trained head with
    b > 1: `F.linear` of a strided chunk keeps a contiguous copy; vramcalc.terms.lowmem
    `head_input_split`; the first is counted with the head-side activations)."""
    x = dims(ctx)
    return sum(alloc(n * x.h, x.c) for n in chunks[1:]) if head_input_split(ctx) else 0


def saved_bytes(ctx: RankContext) -> int:
    """Kept from the end of forward into backward (module docstring's table)."""
    x = dims(ctx)
    compiled = ctx.training.compile
    chunks = chunk_tokens(ctx)
    per_logit = x.c if compiled else "fp32"
    out = ALLOC_ROUND_BYTES  # the loss
    for n in chunks:
        out += alloc(n * x.V, per_logit) + _small(ctx, n, compiled)
    return out + _head_copies(ctx, chunks)


def forward_peak_bytes(ctx: RankContext) -> int:
    """The loss in forward: what it keeps, and in eager mode all chunks' c logits (alive in
    the recipe until `del logits`) and a chunk's fp32 upcast (none when c is fp32:
    `.float()` returns the chunk itself)."""
    x = dims(ctx)
    if ctx.training.compile:
        return saved_bytes(ctx)
    chunks = chunk_tokens(ctx)
    logp = [alloc(n * x.V, "fp32") for n in chunks]
    upcast = [0 if x.c == "fp32" else p for p in logp]
    rest = saved_bytes(ctx) - sum(logp) + sum(alloc(n * x.V, x.c) for n in chunks)
    # chunk i's log_softmax: its upcast and the log-probabilities of chunks 0..i (a short
    # last chunk can make an earlier one the peak)
    return rest + max(sum(logp[:i + 1]) + upcast[i] for i in range(len(chunks)))


def backward_peak_bytes(ctx: RankContext) -> int:
    """The loss backward (module docstring), and after it the output projection's chunks,
    last first: at the last chunk's node every chunk's c gradient, its dX and, for a trained
    projection, its weight gradient; once the next chunk's node is done (its gradient and
    input copy released), the two weight gradients and their sum (3·V·h in the gradient
    dtype) next to the gradients and input copies of the chunks not reached yet and the two
    dX chunks waiting for the split's backward (tests/test_torchtune.py traces both)."""
    x = dims(ctx)
    chunks = chunk_tokens(ctx)
    kept = saved_bytes(ctx)
    grads = [alloc(n * x.V, x.c) for n in chunks]
    # chunk i's cross-entropy backward (last chunk first): the chunks not reached keep their
    # saved logits (compiled) or log-probabilities (eager), the ones done have their c
    # gradient; chunk i holds its gradient (compiled) or its two fp32 gradient buffers
    saved = [alloc(n * x.V, x.c if ctx.training.compile else "fp32") for n in chunks]
    rest = kept - sum(saved)
    work = grads if ctx.training.compile else [2 * b for b in saved]
    during = max(rest + sum(saved[:i + 1]) + work[i] + sum(grads[i + 1:])
                 for i in range(len(chunks)))
    dx = [alloc(n * x.h, x.c) for n in chunks]
    copies = [d if head_input_split(ctx) else 0 for d in dx]  # the first: head activations
    scalars = 2 * ALLOC_ROUND_BYTES
    after = sum(grads) + sum(copies[1:]) + dx[-1] + scalars
    if not finetunes(ctx.training):
        after += alloc(x.V * x.h, grad_dtype(ctx))
        if len(chunks) > 1:
            after = max(after, sum(grads[:-2]) + sum(copies[1:-2]) + sum(dx[-2:]) + scalars
                        + 3 * alloc(x.V * x.h, grad_dtype(ctx)))
    return max(during, after)


# ---- without chunking, compiled (the whole torch.nn.CrossEntropyLoss compiled) -----------
def unchunked_compiled_saved_bytes(ctx: RankContext) -> int:
    """The compiled loss keeps its fp32 input (the model's `.float()` logits) and the row
    max and log-sum-exp, (N) fp32 each, + the loss."""
    x = dims(ctx)
    n = x.b * x.s
    return alloc(n * x.V, "fp32") + 2 * alloc(n, "fp32") + ALLOC_ROUND_BYTES


def unchunked_compiled_forward_peak_bytes(ctx: RankContext) -> int:
    """The model's c logits and their fp32 upcast exist together before the loss runs."""
    x = dims(ctx)
    n = x.b * x.s
    cast = 0 if x.c == "fp32" else alloc(n * x.V, x.c)
    return unchunked_compiled_saved_bytes(ctx) + cast


def unchunked_compiled_backward_peak_bytes(ctx: RankContext) -> int:
    """The kept set + the compiled backward's fp32 gradient (N·V·4)."""
    x = dims(ctx)
    return unchunked_compiled_saved_bytes(ctx) + alloc(x.b * x.s * x.V, "fp32")


# ---- before 0.3.0: the recipe slices the logits (module docstring) --------------------------
def shifts_logits(tr: TrainingConfig) -> bool:
    """Whether the recipe shifts the logits itself (--torchtune-version before 0.3.0)."""
    return tr.framework == "torchtune" and torchtune_before(tr, TORCHTUNE_0_3)


def _shifted(ctx: RankContext) -> int:
    """One fp32 (b, s-1, V) buffer."""
    x = dims(ctx)
    return alloc(x.b * (x.s - 1) * x.V, "fp32")


def deletes_logits(tr: TrainingConfig, dp: int) -> bool:
    """lora_finetune_distributed (dp > 1) from 0.2.0 deletes `logits` after the loss."""
    return finetunes(tr) and dp > 1 and not torchtune_before(tr, TORCHTUNE_0_2)


def _deletes_logits(ctx: RankContext) -> bool:
    return deletes_logits(ctx.training, ctx.parallel.dp_degree)


def _recipe_logits(ctx: RankContext) -> int:
    """The storage the recipe's `logits` holds: the shifted copy, or with b = 1 the model's
    fp32 output (the slice is contiguous already)."""
    x = dims(ctx)
    return alloc(x.b * x.s * x.V, "fp32") if x.b == 1 else _shifted(ctx)


def recipe_held(ctx: RankContext) -> dict[str, int]:
    """Held all step on the last stage: the recipe's `logits` (unless deleted) and its
    shifted labels copy (b > 1)."""
    if not shifts_logits(ctx.training) or not ctx.is_last_stage:
        return {}
    x = dims(ctx)
    labels = alloc(x.b * (x.s - 1), "int64") if x.b > 1 else 0
    return {"logits/recipe_logits": labels + (0 if _deletes_logits(ctx) else _recipe_logits(ctx))}


def shifted_saved_bytes(ctx: RankContext) -> int:
    """Kept for backward besides `recipe_held`: the log-probabilities, the loss and
    nll_loss's total weight."""
    return _shifted(ctx) + 2 * ALLOC_ROUND_BYTES


def shifted_forward_peak_bytes(ctx: RankContext) -> int:
    """Besides `recipe_held`, the largest of: the model's output and its fp32 upcast; the
    upcast and the shifted copy (b > 1); log_softmax's output and the contiguous copy of its
    transposed input (none when s - 1 = 1); the log-probabilities and the two scalars. The
    recipe's copy is counted here where `recipe_held` does not count it."""
    x = dims(ctx)
    nv = x.b * x.s * x.V
    own = _recipe_logits(ctx) if _deletes_logits(ctx) else 0
    upcast = alloc(nv, "fp32")
    cast = upcast + (0 if x.c == "fp32" else alloc(nv, x.c))
    shift = upcast + (own if x.b > 1 else 0)
    copy = _shifted(ctx) if x.s > 2 else 0
    return max(cast, shift, own + _shifted(ctx) + max(copy, 2 * ALLOC_ROUND_BYTES))


def shifted_backward_peak_bytes(ctx: RankContext) -> int:
    """log_softmax's backward: the kept log-probabilities, nll_loss's gradient and its own
    output (fp32 (b, V, s-1) each), the loss, its scaled copy and their gradient."""
    return 3 * _shifted(ctx) + 3 * ALLOC_ROUND_BYTES


def rope_shared_from(spec: ModelSpec) -> tuple[int, ...]:
    """The first release whose builder makes one RoPE module for all of `spec`'s layers
    (module docstring; Gemma 2's builder always did)."""
    if spec.model_type == "gemma2":
        return TORCHTUNE_OLDEST
    return TORCHTUNE_0_3_1 if spec.rope_scaling == "llama3" else TORCHTUNE_0_6


def rope_modules(ctx: RankContext) -> int:
    """RoPE modules of a torchtune model on this rank: one per layer where the release's
    builder deep-copies the layer, else one (module docstring)."""
    spec = ctx.spec
    if spec.position_embedding != "rope" or spec.is_mla:
        return 0
    return ctx.num_layers if torchtune_before(ctx.training, rope_shared_from(spec)) else 1


def tune_rope(ctx: RankContext) -> tuple[int, int, int]:
    """(positions, modules, cache elements per position) of the model's RoPE buffers."""
    spec = ctx.spec
    d = spec.head_size
    width = 2 * d if spec.model_type in ("qwen2", "qwen3", "qwen3_moe", "phi3") else d
    return spec.max_position_embeddings, rope_modules(ctx), width


def rope_buffer_bytes(ctx: RankContext) -> int:
    """Device bytes of the torchtune model's RoPE buffers, `theta` and `cache` per module."""
    positions, modules, width = tune_rope(ctx)
    return modules * (alloc(ctx.spec.head_size // 2, "fp32") + alloc(positions * width, "fp32"))
