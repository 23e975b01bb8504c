"""Phase: load — the model being loaded and prepared, before the first step (`--load`).

The load phase holds the rank's weights as they are being loaded (no gradients, no
optimizer states, no activations) plus what the loader keeps in flight: `transients/load`.
It is reported beside forward, backward and optimizer step, and is the peak when it is the
largest (a `max_memory_allocated` read that was never reset includes it; torchtune resets
the peaks after model init, `memory_stats_log(reset_stats=True)`, so its training figures
exclude the allocated peak — but not the segments the init left reserved, which
vramcalc/terms/tune_init.py replays where it can).

| --load    | what is on the device while loading | in flight (transients/load) |
|-----------|-------------------------------------|-----------------------------|
| none      | not modelled (default)              | |
| hf        | the training weights (transformers 5 `from_pretrained(dtype="auto")`: the checkpoint's dtype; LoRA/PEFT wrap afterwards) | QLoRA: one 16-bit checkpoint weight on the device and bitsandbytes' fp32 absmax (plus its `absmax − mean` copy with double quantization) while it is quantized, one weight at a time |
| hf-fp32   | every weight in fp32 (transformers 4.x `from_pretrained` without `torch_dtype`: "the model will get loaded in torch.float (fp32)"), moved to the GPU before any cast | — |
| torchtune | the training weights, built on the device (`with set_default_dtype(dtype), device: config.instantiate(model)`) | QLoRA: torchao before v0.2: the whole init replayed (vramcalc/terms/tune_init.py: template layer, deep copies, load); from v0.2: `to_nf4` of one weight: the bf16 source on the device and torchao's quantization temporaries (`torchao_quantize_bytes`) |
| meta      | this rank's shards (FSDP2 `fully_shard` on the meta device, `to_empty`, then the full state dict loaded parameter by parameter) | the largest full parameter and its local shard copy |

Sources:
- transformers 5.24 core_model_loading.py `convert_and_load_state_dict_in_model`: on-the-fly
  quantization loads synchronously ("to avoid worker threads loading full-precision tensors
  to GPU faster than the main thread can quantize them"), one parameter at a time, the
  tensor materialised on its device (`spawn_materialize` → `tensor.to(device, dtype)`) and
  quantized by `Bnb4bitQuantize.convert` (integrations/bitsandbytes.py:
  `bnb.nn.Params4bit(value, ...).to(value.device)`), the source freed with
  `del realized_value`; bitsandbytes functional.py `quantize_4bit` (0.50.1): fp32 absmax
  (n/64), with compress_statistics `quantize_blockwise(absmax - offset)`;
  modeling_utils.py `from_pretrained`: `if dtype is None: dtype = "auto"` (5.x) — 4.x
  documented "If not specified - the model will get loaded in torch.float (fp32)".
- torchtune 0914d5cf recipes/lora_finetune_single_device.py `_setup_model` (model built on
  the device, `load_state_dict` of a CPU state dict, `memory_stats_log` after init);
  torchtune/modules/peft/lora.py (`to_nf4(linear.weight)` at construction);
  torchtune/utils/_register_nf4_dispatch_ops.py `inplace_copy`
  (`to_nf4(args[0][1].to(dest_tensor.device))`).
- torchao torchao/dtypes/nf4tensor.py `NF4Tensor.from_tensor`: `get_block_absmax` (|x| in
  the input dtype), `convert_to_norm_float_weight` (scaled blocks, then
  `quantize_tensor_nearest`: `(value.unsqueeze(-1) - nf4).abs()`, a (numel, 16) tensor and its
  abs at once; v0.1 over the whole weight, from 6081796b "perform in chunks" (v0.2.0) over
  CHUNK_SIZE = 1024² elements into a uint8 buffer), then the two nibbles combined
  (v0.1: int64 codes, shifted and or-ed halves).
- torchtune torchtune/training/_distributed.py `load_from_full_model_state_dict` (full tensor
  to the device, `distribute_tensor`, the local shard copied in); torchtitan `to_empty`.
"""

from __future__ import annotations

from vramcalc.errors import InputError
from vramcalc.finetune import shapes_for
from vramcalc.qlora import NF4_BLOCK, TORCHAO_CHUNK, TORCHAO_CHUNKED_QUANTIZE, NF4Layout
from vramcalc.rank import RankContext
from vramcalc.sharding import RankShapes
from vramcalc.terms.tune_init import init_replay, init_reserved_bytes
from vramcalc.terms.weights import weight_parts
from vramcalc.units import alloc, ceil_div

LOADS: tuple[str, ...] = ("none", "hf", "hf-fp32", "torchtune", "meta")
__all__ = ["LOADS", "check_load", "init_reserved_bytes", "load_parts"]


def torchao_quantize_bytes(n: int, layout: NF4Layout) -> int:
    """Peak temporaries of torchao's `to_nf4` on a bf16 weight of n elements (beyond the
    weight itself and the NF4 storages it returns): the scaled blocks (n, bf16) alive while
    the codes are found, plus the nearest-code search — before v0.2 over the whole weight:
    `value − nf4` and its abs, two (n, 16) bf16 tensors at once; from v0.2 the same over one
    chunk of 1024² elements, next to the (n,) uint8 code buffer."""
    scaled = alloc(n, "bf16")
    if layout.version < TORCHAO_CHUNKED_QUANTIZE:
        return scaled + 2 * alloc(16 * n, "bf16")
    chunk = min(n, TORCHAO_CHUNK)
    return scaled + alloc(n, "uint8") + 2 * alloc(16 * chunk, "bf16")


def bnb_quantize_bytes(n: int, layout: NF4Layout) -> int:
    """bitsandbytes `quantize_4bit` temporaries beyond its outputs: with double quantization
    the fp32 absmax and its `absmax − offset` copy (the quantized absmax is the output);
    without, the fp32 absmax is the output itself."""
    return 2 * alloc(ceil_div(n, NF4_BLOCK), "fp32") if layout.double_quant else 0


def _largest(shapes: RankShapes) -> int:
    return max((t.numel for t in shapes.tensors), default=0)


def check_load(ctx: RankContext) -> None:
    """InputError for a load path that is not modelled with these settings."""
    tr, load = ctx.training, ctx.training.load
    qlora = tr.finetune == "qlora"
    if load == "torchtune" and qlora and tr.nf4.impl != "torchao":
        raise InputError("--load torchtune with --finetune qlora: torchtune quantizes with "
                         "torchao's NF4Tensor; add --qlora-impl torchao")
    if load == "hf" and qlora and tr.nf4.impl != "bnb":
        raise InputError("--load hf with --finetune qlora: transformers quantizes on load "
                         "with bitsandbytes; use --qlora-impl bnb")
    if load == "hf-fp32" and qlora:
        raise InputError("--load hf-fp32 with --finetune qlora: transformers 4.x loads a "
                         "bitsandbytes model without torch_dtype in float16 "
                         "(Bnb4BitHfQuantizer.update_torch_dtype), not fp32; use --load hf")
    if load in ("hf", "hf-fp32", "torchtune") and ctx.param_shard > 1:
        raise InputError(f"--load {load} with sharded parameters: use --load meta (FSDP "
                         "materialises each rank's shards from the meta device)")
    if load == "meta" and qlora:
        raise InputError("--load meta with --finetune qlora is not modelled (FSDP-QLoRA "
                         "loads and quantizes per rank); use --load none")
    if load == "meta" and (ctx.param_shard == 1 or ctx.parallel.fsdp == "none"):
        raise InputError("--load meta: models FSDP materialising its parameter shards from "
                         "the meta device (--fsdp full or hybrid); otherwise use --load hf "
                         "or torchtune")


def load_parts(ctx: RankContext) -> dict[str, int] | None:
    """The load phase's parts of this rank (None with --load none): the weights as loaded
    ("weights…" keys) and `transients/load` (module docstring)."""
    tr = ctx.training
    if tr.load == "none":
        if tr.load_only:
            raise InputError("--load-only reports the load phase: say how the model is "
                             "loaded with --load (hf, hf-fp32, torchtune or meta)")
        return None
    check_load(ctx)
    parts = dict(weight_parts(ctx))
    inflight = 0
    if tr.load == "hf-fp32":
        parts = {"weights": sum(t.count * alloc(t.numel, "fp32") for t in ctx.shapes.tensors)}
    elif tr.load == "meta":
        big = _largest(ctx.shapes)
        inflight = alloc(big, tr.weight_dtype) + alloc(ceil_div(big, ctx.param_shard),
                                                       tr.weight_dtype)
    elif tr.finetune == "qlora":
        n = _largest(shapes_for(ctx).quantized)
        src = alloc(n, "bf16")  # the 16-bit checkpoint tensor on the device
        inflight = src + (torchao_quantize_bytes(n, tr.nf4) if tr.load == "torchtune"
                          else bnb_quantize_bytes(n, tr.nf4))
        replay = init_replay(ctx)  # torchtune's whole init, where replayed (tune_init.py)
        if replay is not None:
            inflight = replay.peak_allocated - sum(parts.values())
    parts["transients/load"] = inflight
    return parts
