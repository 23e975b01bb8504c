"""KV-cache bytes per token on one rank, and the blocks a sequence needs.

Legend: L = layers on the rank, g = num_key_value_heads, d = head_dim, t = tensor-parallel
degree, B = dtype bytes of the cache, kr = kv_lora_rank, dr = qk_rope_head_dim.

- Standard attention (MHA, GQA, MQA): per layer and token, K and V of the rank's KV heads:
  2 · g_t · d · B, with g_t = max(1, g / t): when t exceeds g every rank keeps a copy of
  one KV head (vLLM `ModelConfig.get_num_kv_heads`: max(1, total_num_kv_heads // tp); the
  page is `AttentionSpec.page_size_bytes` = 2 · block_size · num_kv_heads · head_size ·
  dtype bytes, vllm/v1/kv_cache_interface.py).
- Multi-latent attention (DeepSeek-V2/V3): one compressed latent per token and layer,
  (kr + dr) · B, no factor 2 and the same on every TP rank (vLLM `MLAAttentionSpec`,
  SGLang `MLATokenToKVPool`).
- Sliding-window layers keep at most the window (vLLM `SlidingWindowSpec`); the block
  counts per request are in `blocks_per_request`.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramcalc.errors import InputError
from vramcalc.model import ModelSpec
from vramcalc.units import ceil_div

KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}
# vLLM's default block size for CUDA attention backends (CacheConfig.block_size = 16).
VLLM_BLOCK_TOKENS = 16


def kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    """KV heads one TP rank stores: g / t, or one replicated head when t > g. vLLM and
    SGLang need one of g and t to divide the other."""
    g = spec.kv_heads
    if spec.is_mla:
        return 1
    if g % tp and tp % g:
        raise InputError(f"--tp {tp}: the {g} KV heads of {spec.name} cannot be split or "
                         f"replicated evenly over {tp} ranks")
    return max(1, g // tp)


def layer_token_bytes(spec: ModelSpec, tp: int, dtype_bytes: int) -> int:
    """Bytes of one layer's KV cache per token on one rank (module docstring)."""
    if spec.is_mla:
        return ((spec.kv_lora_rank or 0) + (spec.qk_rope_head_dim or 0)) * dtype_bytes
    return 2 * kv_heads_per_rank(spec, tp) * spec.head_size * dtype_bytes


@dataclass(frozen=True)
class KVLayout:
    """The KV cache of one pipeline stage on one rank."""

    num_full_layers: int  # layers that keep every token
    num_sliding_layers: int  # layers that keep the last `window` tokens
    window: int | None
    kv_heads: int  # per rank (1 for MLA: the latent)
    head_dim: int  # per head; MLA: kv_lora_rank + qk_rope_head_dim
    dtype_bytes: int
    layer_token_bytes: int  # one layer, one token

    @property
    def num_layers(self) -> int:
        return self.num_full_layers + self.num_sliding_layers

    @property
    def bytes_per_token(self) -> int:
        """Every layer's K and V for one token, as if all layers kept the whole context."""
        return self.num_layers * self.layer_token_bytes

    def sequence_bytes(self, num_tokens: int) -> int:
        """Exact bytes one sequence of `num_tokens` needs (sliding layers capped at the
        window), without block rounding."""
        local = min(num_tokens, self.window or num_tokens)
        return self.layer_token_bytes * (self.num_full_layers * num_tokens
                                         + self.num_sliding_layers * local)


def stage_layers(num_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """(first layer, layer count) of each pipeline stage. vLLM `get_pp_indices`
    (vllm/distributed/utils.py): L // pp layers each, the remainder one more each on the
    stages before the last, counted from the second-to-last backwards."""
    if pp > num_layers:
        raise InputError(f"--pp {pp} exceeds the model's {num_layers} layers")
    counts = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        counts[-(i + 2)] += 1
    out, start = [], 0
    for n in counts:
        out.append((start, n))
        start += n
    return tuple(out)


def kv_layout(spec: ModelSpec, tp: int, first: int, count: int, dtype_bytes: int) -> KVLayout:
    """The KV layout of layers [first, first + count) on one TP rank."""
    sliding = sum(spec.layer_is_sliding(i) for i in range(first, first + count))
    if spec.is_mla:
        heads, dim = 1, (spec.kv_lora_rank or 0) + (spec.qk_rope_head_dim or 0)
    else:
        heads, dim = kv_heads_per_rank(spec, tp), spec.head_size
    return KVLayout(num_full_layers=count - sliding, num_sliding_layers=sliding,
                    window=spec.sliding_window if sliding else None, kv_heads=heads,
                    head_dim=dim, dtype_bytes=dtype_bytes,
                    layer_token_bytes=layer_token_bytes(spec, tp, dtype_bytes))


# ---- vLLM's paged layout ------------------------------------------------------------------
@dataclass(frozen=True)
class BlockGroups:
    """vLLM's KV cache groups (vllm/v1/core/kv_cache_utils.py
    `_get_kv_cache_groups_uniform_page_size`): layers of one attention type are split into
    groups of `group_size` layers (the smaller type's layer count, or the larger one's when
    it is under 1.25 × the smaller), the last group of a type padded. A block holds one page
    of every layer slot of a group; all groups share one pool."""

    num_full_groups: int
    num_sliding_groups: int
    group_size: int

    @property
    def num_groups(self) -> int:
        return self.num_full_groups + self.num_sliding_groups


def block_groups(layout: KVLayout, hybrid: bool = True) -> BlockGroups:
    """The groups of one stage. Without the hybrid manager (`hybrid=False`,
    --disable-hybrid-kv-cache-manager) sliding layers are treated as full attention."""
    full, sliding = layout.num_full_layers, layout.num_sliding_layers
    if not hybrid or not sliding:
        return BlockGroups(1, 0, full + sliding)
    if not full:
        return BlockGroups(0, 1, sliding)
    small, large = min(full, sliding), max(full, sliding)
    size = large if large < small * 1.25 else small
    return BlockGroups(ceil_div(full, size), ceil_div(sliding, size), size)


def blocks_per_request(layout: KVLayout, groups: BlockGroups, max_model_len: int,
                       max_num_batched_tokens: int, block_tokens: int) -> int:
    """Blocks one request of `max_model_len` tokens holds over all groups: a full group
    cdiv(len, block); a sliding group min(cdiv(window − 1 + max_num_batched_tokens, block)
    + 1, cdiv(len, block)) (`SlidingWindowSpec.max_memory_usage_bytes`)."""
    full_blocks = ceil_div(max_model_len, block_tokens)
    out = groups.num_full_groups * full_blocks
    if groups.num_sliding_groups and layout.window:
        local = ceil_div(layout.window - 1 + max_num_batched_tokens, block_tokens) + 1
        out += groups.num_sliding_groups * min(local, full_blocks)
    return out
