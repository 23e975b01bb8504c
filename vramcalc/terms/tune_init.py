"""torchtune's QLoRA model init replayed through the caching-allocator model: the reserved
memory the init leaves cached, which every later `max_memory_reserved` read includes
(`--load torchtune --finetune qlora --qlora-impl torchao`, torchao before v0.2).

Why it matters: torchtune logs its training figures after `memory_stats_log(reset_stats=
True)` (torchtune 0914d5cf torchtune/utils/memory.py), and `reset_peak_memory_stats` sets
each peak to the *current* value. Allocated memory is back to the weights by then, but the
segments the init reserved stay cached (the recipe never calls `empty_cache`), so the
training window's reserved peak starts at the init's. torchao v0.1 quantizes a whole weight
at once through two (n, 16) bf16 search tensors (1.4 GB each for a Llama-2-7B MLP matrix);
the small NF4 storages made between them split those cached blocks, so the next search needs
new segments. The replay finds how many (`init_replay`); the analytic reserved estimate is
then at least its high-water mark (`init_reserved_bytes`).

The sequence, in the order the source runs it (each tensor one request, each free when its
last Python reference goes):

1. Build on the device (torchtune 0914d5cf recipes/lora_finetune_single_device.py
   `_setup_model`: `with utils.set_default_dtype(self._dtype), self._device:
   config.instantiate(cfg_model)`), torchtune/models/llama2/_component_builders.py
   `lora_llama2`: one template layer — attention q, k, v, output_proj, then its
   `RotaryPositionalEmbeddings` (fp32 `theta` and a (max_seq_len, head_dim/2, 2) fp32
   `cache`, torchtune/modules/position_embeddings.py `build_rope_cache`), the MLP w1 (gate),
   w2 (down), w3 (up), the two RMSNorm scales — then `tok_embeddings`, the output linear
   and the final norm. Each adapted linear is torchtune/modules/peft/lora.py `LoRALinear`:
   an `nn.Linear` weight in bf16, `to_nf4(linear.weight)`, the bf16 weight dropped when
   `_create_weight_and_bias` returns, then `lora_a` and `lora_b`. A linear without an adapter
   stays a bf16 `nn.Linear`.
2. `TransformerDecoder.__init__`: `self.layers = _get_clones(layer, num_layers)`
   (torchtune/modules/transformer.py), one `copy.deepcopy` per layer, module by module in
   registration order (sa_norm, attn, mlp_norm, mlp). torch's `Tensor.__deepcopy__` calls
   `clone()` on a wrapper subclass (no storage), which torchtune registers for NF4Tensor
   (torchtune/utils/_register_nf4_dispatch_ops.py `clone`: `to_nf4(w.get_original_weight())`):
   a full dequantize, a full quantize, then `new_tensor.__dict__ = deepcopy(self.__dict__)`
   copies the source's five storages and drops the clone's own. Plain parameters and buffers
   are copied storage by storage. The template is dropped when the builder returns.
3. `model.load_state_dict(cpu_state_dict)`: for each NF4 weight, torchtune's `inplace_copy`
   runs `to_nf4(src.to(device))` — the 16-bit source on the device, then a quantize — and
   rebinds the five storages (the old ones freed). Other parameters are copied in place.

torchao v0.1 (pytorch/ao ff2889540075e8c8d0a2f4b9900da1b9136ae376,
torchao/dtypes/nf4tensor.py), for a bf16 weight of n elements (b = n/64 blocks):

- `NF4Tensor.from_tensor`: the 16-entry bf16 `nf4` table; `double_quantize_scalers`:
  `get_block_absmax` (`blocks.abs()`: n bf16; `.max(dim=1)`: b bf16 values and b int64
  indices), `− mean` (b), the scaler absmax (`abs`: b; max over b/256), `2 * absmax` and
  `256 / …` on the expanded (b/256, 256) view (b each: the stored quantization factor is a
  `[:, 0]` view of the second), `scaler_blocks * factor`, `.round()`, `.clamp()` (b each),
  `.to(int8)` (b); `convert_to_norm_float_weight`: `get_block_absmax` again, the scaled
  blocks (n bf16), `quantize_tensor_nearest` (`value − nf4` and `.abs()`: two (n, 16) bf16,
  then `.min(dim=-1)`: n bf16 values and n int64 indices), the high nibbles shifted (n/2
  int64) and or-ed (n/2 int64), `.to(uint8)` (n/2).
- `get_original_weight`: each nibble half `(>> 4)` / `(& 0b1111)` (n/2 uint8) widened to
  int64, looked up in the table (n/2 bf16), the scalers decoded (`/ factor`, `+ mean`: b bf16
  each), the expanded scalers flattened (a copy, n/2 bf16) and multiplied (n/2 bf16) per
  half, `torch.stack` (n bf16).

From torchao v0.2 (6081796b) the nearest-code search runs in chunks, and torchtune from
July 2024 builds each layer on its own instead of deep-copying a template; neither is
replayed (`init_replay` returns None, and the packing floor of vramcalc/terms/reserved.py
applies). The checkpoint is taken to hold the training dtype (a checkpoint in another 16-bit
dtype adds one more n-element copy per weight while loading; the build, not the load, sets
the high-water mark here).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from vramcalc.allocator import CachingAllocator
from vramcalc.finetune import adapted_linears
from vramcalc.model import ModelSpec
from vramcalc.qlora import NF4_BLOCK, NF4_CODE_ELEMS, NF4_SCALER_BLOCK, TORCHAO_CHUNKED_QUANTIZE
from vramcalc.rank import RankContext
from vramcalc.units import alloc, ceil_div

_BYTES = {"bf16": 2, "fp32": 4, "int64": 8, "int8": 1, "uint8": 1}  # itemsize


@dataclass(frozen=True)
class InitReplay:
    """High-water marks of the replayed init (`max_memory_allocated` /
    `max_memory_reserved` read before torchtune's reset), the bytes left allocated, and the
    high-water mark of the requests alone (each rounded to 512 B; allocated also counts the
    remainders of large-pool blocks handed out whole)."""

    peak_allocated: int
    peak_reserved: int
    end_allocated: int
    peak_requested: int


@dataclass(frozen=True)
class _Model:
    """What the replay depends on: the model, the adapters and the layers built."""

    spec: ModelSpec
    rank: int
    targets: str
    layers: int


class _Heap:
    """The allocator model with element counts and dtypes in, handles out."""

    def __init__(self) -> None:
        self.alloc = CachingAllocator()
        self.sizes: dict[int, int] = {}
        self.requested = self.peak_requested = 0

    def new(self, n: int, dtype: str) -> int:
        h = self.alloc.malloc(n * _BYTES[dtype])
        self.sizes[h] = alloc(n, dtype)
        self.requested += self.sizes[h]
        self.peak_requested = max(self.peak_requested, self.requested)
        return h

    def drop(self, *handles: int) -> None:
        for h in handles:
            self.alloc.free(h)
            self.requested -= self.sizes.pop(h)


def _absmax(heap: _Heap, n: int, block: int, dtype: str = "bf16") -> int:
    """`get_block_absmax`: |x| (n), `.max(dim=1)` values and indices; keeps the values."""
    ab = heap.new(n, dtype)
    vals, idx = heap.new(n // block, dtype), heap.new(n // block, "int64")
    heap.drop(ab, idx)
    return vals


def quantize(heap: _Heap, n: int) -> tuple[int, ...]:
    """torchao v0.1 `NF4Tensor.from_tensor` of a bf16 weight of n elements already on the
    device; returns the five storages (quantized_scalers, quantization_factor, scaler_mean,
    quantized_data, nf4)."""
    b = ceil_div(n, NF4_BLOCK)
    nf4 = heap.new(NF4_CODE_ELEMS, "bf16")
    # double_quantize_scalers
    scalers = _absmax(heap, n, NF4_BLOCK)
    mean = heap.new(1, "bf16")
    centred = heap.new(b, "bf16")
    heap.drop(scalers)
    s_absmax = _absmax(heap, b, NF4_SCALER_BLOCK)
    twice = heap.new(b, "bf16")
    factor = heap.new(b, "bf16")
    heap.drop(twice)
    blocks = heap.new(b, "bf16")
    rounded = heap.new(b, "bf16")
    heap.drop(blocks)
    clamped = heap.new(b, "bf16")
    heap.drop(rounded)
    q_scalers = heap.new(b, "int8")
    heap.drop(clamped, centred, s_absmax)
    # convert_to_norm_float_weight
    scales = _absmax(heap, n, NF4_BLOCK)
    scaled = heap.new(n, "bf16")
    diff = heap.new(16 * n, "bf16")
    absdiff = heap.new(16 * n, "bf16")
    heap.drop(diff)
    vals, codes = heap.new(n, "bf16"), heap.new(n, "int64")
    heap.drop(vals, absdiff)
    shifted = heap.new(n // 2, "int64")
    combined = heap.new(n // 2, "int64")
    heap.drop(shifted)
    data = heap.new(n // 2, "uint8")
    heap.drop(combined, codes, scaled, scales)
    return q_scalers, factor, mean, data, nf4


def dequantize(heap: _Heap, n: int) -> int:
    """torchao v0.1 `get_original_weight` of n elements; returns the bf16 weight."""
    b = ceil_div(n, NF4_BLOCK)
    halves = []
    for _ in range(2):
        nib = heap.new(n // 2, "uint8")
        halves.append(heap.new(n // 2, "int64"))
        heap.drop(nib)
    looked = [heap.new(n // 2, "bf16") for _ in range(2)]
    div = heap.new(b, "bf16")
    scalers = heap.new(b, "bf16")
    heap.drop(div)
    scaled = []
    for _ in range(2):
        flat = heap.new(n // 2, "bf16")
        scaled.append(heap.new(n // 2, "bf16"))
        heap.drop(flat)
    weight = heap.new(n, "bf16")
    heap.drop(*halves, *looked, scalers, *scaled)
    return weight


def _nf4_sizes(n: int) -> tuple[tuple[int, str], ...]:
    """The five storages of `quantize`, in NF4Tensor.__dict__ order (what deepcopy copies)."""
    b = ceil_div(n, NF4_BLOCK)
    return ((b, "int8"), (b, "bf16"), (1, "bf16"), (n // 2, "uint8"), (NF4_CODE_ELEMS, "bf16"))


def _layer_linears(m: _Model) -> list[tuple[int, int, bool]]:
    """(in, out, adapted) of one layer's linears in torchtune's construction order."""
    s = m.spec
    h, hd, ffn = s.hidden_size, s.head_size, s.intermediate_size
    q, kv = s.num_attention_heads * hd, s.kv_heads * hd
    adapted = set(adapted_linears(s, m.targets, "torchtune"))
    dims = [("q", h, q), ("k", h, kv), ("v", h, kv), ("o", q, h),
            ("gate", h, ffn), ("down", ffn, h), ("up", h, ffn)]
    return [(i, o, name in adapted) for name, i, o in dims]


def _rope(m: _Model) -> tuple[tuple[int, str], ...]:
    half = m.spec.head_size // 2
    return ((half, "fp32"), (m.spec.max_position_embeddings * half * 2, "fp32"))


def _build_rope(heap: _Heap, m: _Model) -> list[int]:
    """`RotaryPositionalEmbeddings._rope_init`: theta (fp32), then `build_rope_cache`:
    positions, the (s, d/2) angles, cos, sin, the stacked cache; keeps theta and cache."""
    half, s = m.spec.head_size // 2, m.spec.max_position_embeddings
    ar = heap.new(2 * half, "int64")
    steps = [heap.new(half, "fp32") for _ in range(3)]
    theta = heap.new(half, "fp32")
    heap.drop(ar, *steps)
    pos = heap.new(s, "fp32")
    angles = heap.new(s * half, "fp32")
    cos, sin = heap.new(s * half, "fp32"), heap.new(s * half, "fp32")
    cache = heap.new(s * half * 2, "fp32")
    heap.drop(cos, sin, pos, angles)
    return [theta, cache]


def _template(heap: _Heap, m: _Model) -> list[int]:
    rank, h = m.rank, m.spec.hidden_size
    out: list[int] = []
    for idx, (i, o, adapted) in enumerate(_layer_linears(m)):
        if idx == 4:
            out += _build_rope(heap, m)
        w = heap.new(i * o, "bf16")
        if adapted:
            out += quantize(heap, i * o)
            heap.drop(w)
            out += [heap.new(rank * i, "bf16"), heap.new(o * rank, "bf16")]
        else:
            out.append(w)
    return out + [heap.new(h, "bf16"), heap.new(h, "bf16")]


def _clone(heap: _Heap, m: _Model) -> tuple[list[int], list[tuple[int, int]]]:
    """One `copy.deepcopy` of the template; returns its storages and its NF4 weights'
    (numel, index of their five storages)."""
    rank, h = m.rank, m.spec.hidden_size
    out: list[int] = [heap.new(h, "bf16")]  # sa_norm
    nf4: list[tuple[int, int]] = []
    for idx, (i, o, adapted) in enumerate(_layer_linears(m)):
        if idx == 4:
            out += [heap.new(n, dt) for n, dt in _rope(m)]  # pos_embeddings buffers
            out.append(heap.new(h, "bf16"))  # mlp_norm
        n = i * o
        if not adapted:
            out.append(heap.new(n, "bf16"))
            continue
        weight = dequantize(heap, n)
        own = quantize(heap, n)
        heap.drop(weight)
        nf4.append((n, len(out)))
        out += [heap.new(k, dt) for k, dt in _nf4_sizes(n)]
        heap.drop(*own)
        out += [heap.new(rank * i, "bf16"), heap.new(o * rank, "bf16")]
    return out, nf4


def replayable(ctx: RankContext) -> bool:
    """The runs `init_replay` covers (module docstring)."""
    tr, s = ctx.training, ctx.spec
    llama_like = (not s.is_encoder and s.num_local_experts == 0 and not s.is_mla
                  and s.mlp_kind == "gated" and s.norm_kind == "rmsnorm"
                  and s.num_layer_norms == 2 and not s.qk_norm
                  and s.position_embedding == "rope" and not (
                      s.attention_bias or s.attention_out_bias or s.mlp_bias))
    return (tr.load == "torchtune" and tr.finetune == "qlora" and tr.nf4.impl == "torchao"
            and tr.nf4.version < TORCHAO_CHUNKED_QUANTIZE and tr.weight_dtype == "bf16"
            and llama_like and ctx.parallel.tp == 1 and ctx.parallel.pp == 1
            and ctx.param_shard == 1)


def init_replay(ctx: RankContext) -> InitReplay | None:
    """Build, clone and load as the module docstring lists, through the allocator model;
    None for runs it does not cover (`replayable`)."""
    if not replayable(ctx):
        return None
    return _replay(_Model(ctx.spec, ctx.training.lora_rank, ctx.training.lora_targets,
                          ctx.num_layers))


@lru_cache(maxsize=16)
def _replay(m: _Model) -> InitReplay:
    """`init_replay` (~0.1 s for a 7B model; cached in memory per model and adapters)."""
    s, heap = m.spec, _Heap()
    template = _template(heap, m)
    heap.new(s.vocab_size * s.hidden_size, "bf16")  # tok_embeddings, kept
    if not s.tie_word_embeddings:
        heap.new(s.hidden_size * s.vocab_size, "bf16")  # output, kept
    heap.new(s.hidden_size, "bf16")  # final norm, kept
    layers = [_clone(heap, m) for _ in range(m.layers)]
    heap.drop(*template)
    for storages, nf4 in layers:  # load_state_dict, module order
        for n, at in nf4:
            src = heap.new(n, "bf16")
            fresh = quantize(heap, n)
            heap.drop(src)
            heap.drop(*storages[at:at + 5])
            storages[at:at + 5] = fresh
    return InitReplay(heap.alloc.peak_allocated, heap.alloc.peak_reserved,
                      heap.alloc.allocated, heap.peak_requested)


def init_reserved_bytes(ctx: RankContext) -> int:
    """The init's reserved high-water mark that training reads include (0: not replayed)."""
    rep = init_replay(ctx)
    return rep.peak_reserved if rep else 0
