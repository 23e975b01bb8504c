"""torchtune's packed batches (`--packed`, torchtune profile; `dataset.packed: True`).
Legend: vramcalc/terms/saved.py; N = b·s tokens, d the head dim, c the recipe's dtype.

Source: pytorch/torchtune 1814feb17a9038e1a8053ce93111bd26774a8db6 (Nov 2024).

- Every batch is full: datasets/_packed.py `PackedDataset._pad_pack` pads each pack to
  `max_seq_len`, so `--seq-len` is the pack size and every step runs b × s tokens.
- The batch (data/_collate.py `padded_collate_packed`): tokens and labels as unpacked, plus
  `input_pos` (b, s) int64 (each token's position inside its sample) and `mask`, from
  modules/attention_utils.py `packed_block_causal_mask`:
  - flex (`_SUPPORTS_FLEX_ATTENTION`: a CUDA device of compute capability >= 7.5): a
    BlockMask of 128 × 128 blocks — kv/q block counts (b, 1, s/128) and indices
    (b, 1, s/128, s/128) int32, each with its "full" twin (8 tensors) — whose `mask_mod`
    holds the document ids (b, s) int64 on the device; flex attention (the compiled
    `flex_attention`, torch/_higher_order_ops/flex_attention.py `FlexAttentionAutogradOp`)
    keeps q, k, v, its output and logsumexp (b, a, s) fp32, as SDPA's flash kernel does,
    and the mask's tensors, which the batch holds anyway;
  - dense (otherwise): `create_block_causal_mask`, a (b, s, s) bool block-diagonal of
    causal blocks, moved to the device with the batch. `_attention_call` passes
    `mask[:, None]` to SDPA, which cannot use the flash kernel with a mask and runs the
    memory-efficient one; SDPA turns the bool mask into an additive one in q's dtype
    (aten/src/ATen/native/transformers/attention.cpp `convert_boolean_attn_mask`:
    zeros_like + masked_fill_, (b, 1, s, s) c) and `preprocess_mask` expands it to
    (b, a, s, s) (a view), or pads a last dimension that is not a multiple of 16 (a
    materialised (b, a, s, ⌈s/16⌉·16) copy); `_scaled_dot_product_efficient_attention`'s
    backward takes that bias, so every layer keeps its own. Its logsumexp has ⌈s/32⌉·32
    columns (kAlignLSE). The math kernel (no fused kernel available) is not reached on a
    GPU the profiles list; not modelled.
- RoPE (modules/position_embeddings.py `RotaryPositionalEmbeddings.forward`, lines 95-97:
  `self.cache[input_pos]` when input_pos is given): an advanced-index gather, a new
  (b, s, d/2, 2) fp32 tensor per call (q and k: two per layer). Lines 110-118 multiply views
  of it by views of `x.float()`, which requires grad, so each mul saves its cache operand
  for backward (MulBackward0 keeps `other` to differentiate `self`): both gathers live until
  the layer's backward. Unpacked, `cache[:seq_len]` is a view of the buffer: nothing new.
  A compiled layer computes the gather once (AOTAutograd's CSE merges the two identical
  `index` calls) and keeps that one (vramcalc/trace/compiled.py `torchtune_layer_parts`).
  With flex, `compile_friendly_flex_attention` is `torch.compiler.disable`d, so a compiled
  layer breaks into the part before attention and the part after it; their min-cut
  partitions keep the same sizes as the whole layer's (the residual h in place of wo's
  output) plus the gather (tests/test_packed.py).

Not counted: create_block_mask's temporaries while the batch is built (before forward), the
dense mask's `logical_not` temporary inside each SDPA call, the memory-efficient kernel's
backward workspace, the batch during the optimizer step (as ids and labels are not), and
flex attention's `max_scores` (b, a, s) fp32, which torch 2.13's FlexAttentionAutogradOp
also saves and the torch 2.5 of torchtune 1814feb is taken not to.
"""

from __future__ import annotations

from vramcalc.rank import RankContext
from vramcalc.terms.saved import Modifier, Saved, dims
from vramcalc.units import ceil_div

FLEX_BLOCK = 128  # torch.nn.attention.flex_attention _DEFAULT_SPARSE_BLOCK_SIZE
MEM_EFF_ALIGN = 16  # attention.cpp preprocess_mask: mem_eff_alignment
LSE_ALIGN = 32  # aten/src/ATen/native/transformers/cuda/attention.cu: kAlignLSE


def rope_gathers(ctx: RankContext) -> int:
    """`cache[input_pos]` copies a layer keeps: one per RoPE call (q, k), one compiled."""
    return 1 if ctx.training.compile else 2


def packed_layer_saved(ctx: RankContext) -> list[Saved]:
    """What a packed batch adds to one layer's saved tensors (module docstring)."""
    x = dims(ctx)
    out = [Saved("rope.cache_gather", x.b * x.s * x.d, "fp32", "(b, s, d/2, 2)",
                 "cache[input_pos], kept by RoPE's muls", rope_gathers(ctx))]
    if ctx.training.packed_mask == "dense":
        cols = ceil_div(x.s, MEM_EFF_ALIGN) * MEM_EFF_ALIGN
        if cols == x.s:
            out.append(Saved("attn.mask_bias", x.b * x.s * x.s, x.c, "(b, 1, s, s)",
                             "SDPA's additive copy of the bool mask, kept by the "
                             "memory-efficient kernel"))
        else:
            out.append(Saved("attn.mask_bias", x.b * x.a * x.s * cols, x.c,
                             "(b, a, s, s16)", "the additive mask padded to 16 columns"))
        pad = ceil_div(x.s, LSE_ALIGN) * LSE_ALIGN - x.s
        if pad:
            out.append(Saved("attn.lse_pad", x.b * x.a * pad, "fp32", "(b, a, pad)",
                             "the memory-efficient logsumexp's padded columns"))
    return out


def packed_batch_saved(ctx: RankContext) -> list[Saved]:
    """The packed batch's tensors beyond tokens and labels: input_pos and the mask."""
    x = dims(ctx)
    out = [Saved("input_pos", x.b * x.s, "int64", "(b, s)", "the packed batch")]
    if ctx.training.packed_mask == "dense":
        out.append(Saved("attn.block_causal_mask", x.b * x.s * x.s, "bool", "(b, s, s)",
                         "the packed batch's dense mask"))
        return out
    nb = ceil_div(x.s, FLEX_BLOCK)
    out += [Saved("flex.document_ids", x.b * x.s, "int64", "(b, s)", "held by mask_mod"),
            Saved("flex.num_blocks", x.b * nb, "int32", "(b, 1, s/128)",
                  "BlockMask kv/q (full) block counts", 4),
            Saved("flex.indices", x.b * nb * nb, "int32", "(b, 1, s/128, s/128)",
                  "BlockMask kv/q (full) block indices", 4)]
    return out


class PackedBatch(Modifier):
    """torchtune's packed batches (module docstring): RoPE's gathers (and the dense mask's
    additive copy) in every layer."""

    name = "packed"

    def applies(self, ctx: RankContext) -> bool:
        return ctx.training.packed

    def layer_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        return saved + packed_layer_saved(ctx)
