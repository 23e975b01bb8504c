"""torchao's float8 all-gather under FSDP2 (torchtitan profile, --float8 --float8-all-gather:
torchtitan's --float8.enable_fsdp_float8_all_gather, a store_true flag, off by default).

Sources: pytorch/torchtitan 9dec370ad26b5f8e9a7333a0e36165018262644b torchtitan/float8.py
`Float8Handler.__init__` (enable_fsdp_float8_all_gather = parallel_dims.dp_shard_enabled and
the flag; `convert_to_float8_training` skips `output`) and pytorch/ao
eab345c2268a7506355d506ebfc27b5d28e5e7d0 torchao/float8/fsdp_utils.py:

- every Float8Linear weight is a `WeightWithDynamicFloat8CastTensor`; its
  `fsdp_pre_all_gather` casts the local shard to float8_e4m3fn (`hp_tensor_to_float8_dynamic`
  with `reduce_amax=True`, or `hp_tensor_and_scale_to_float8` with the precomputed scale) and
  hands FSDP2 the fp8 data, the fp32 0-dim scale as metadata; `fsdp_post_all_gather` wraps the
  gathered data and that scale in a Float8Tensor, which becomes the unsharded parameter;
- torch 2.13 `_fsdp_collectives.py` `foreach_all_gather`: inputs of mixed dtypes (fp8 weights,
  bf16 norms) are gathered as one uint8 buffer (`_get_all_gather_input_metadatas`), so the
  gathered block is n_linear · 1 B + n_norm · 2 B (the norms still gather in the compute dtype,
  the root module's embedding, final norm and output projection are not Float8Linear);
- float8_linear.py `Float8Linear.forward`: `get_weight_scale` returns None and
  `cast_weight_to_float8_t` returns `weight.t()` when the weight is already fp8
  (`tensor_already_casted_to_fp8`), so the forward casts no weight; the mm saves that
  transposed view of the gathered data, and the grad-input mm's operand is its column-major
  copy (float8_ops.py `preprocess_addmm`), which torch.compile's partition makes again in
  backward: a compiled block keeps no copy of a gathered weight
  (vramcalc/terms/torchtitan_compile.py, tests/test_float8_fsdp.py).

The pre-all-gather cast runs on a shard (1/dp_shard of a weight): `torch.abs` (c), the fp32
upcast times the scale, the clamp (fp32) and the fp8 result, kept until the copy into the
all-gather buffer; it stands where the bf16 path's foreach cast of the fp32 shard to bf16
stands, a shard-sized copy vramcalc does not count for either (docs/methodology.md §13).
"""

from __future__ import annotations

from vramcalc.model_tensors import param_tensors
from vramcalc.rank import RankContext
from vramcalc.units import DTYPE_BITS, alloc, ceil_div

SCALE_BYTES = 512  # one fp32 0-dim scale per gathered Float8Linear weight, one 512 B block


def float8_gather(ctx: RankContext) -> bool:
    """Whether FSDP2 gathers this rank's Float8Linear weights in fp8."""
    tr = ctx.training
    return bool(tr.float8 and tr.float8_all_gather and ctx.engine == "fsdp2")


def block_linear_norm_numels(ctx: RankContext) -> tuple[int, int, int]:
    """(Float8Linear weight elements, norm elements, Float8Linear count) of one block on this
    rank (TP-local): every block tensor but the norms is an nn.Linear weight that
    `convert_to_float8_training` swapped (torchtitan's Llama has no biases)."""
    spec, tp = ctx.spec, ctx.parallel.tp
    lin = norm = count = 0
    for t in param_tensors(spec):
        if t.group != "layer":
            continue
        per_layer = t.count // spec.num_hidden_layers
        n = ceil_div(t.numel, tp) if (t.tp_split and tp > 1) else t.numel
        if "norm" in t.name:
            norm += n * per_layer
        else:
            lin += n * per_layer
            count += per_layer
    return lin, norm, count


def float8_gathered_layer_bytes(ctx: RankContext) -> int:
    """One block unsharded with fp8 all-gather: one uint8 buffer of 1 B per Float8Linear
    weight element and the norms in the compute dtype (as `comm.fsdp_layer_bytes` counts a
    bf16 block, one allocation), and each weight's fp32 scale (fsdp_post_all_gather keeps it
    in the Float8Tensor)."""
    lin, norm, count = block_linear_norm_numels(ctx)
    nbytes = lin + norm * DTYPE_BITS[ctx.training.compute_dtype] // 8
    return alloc(nbytes, "uint8") + count * SCALE_BYTES
