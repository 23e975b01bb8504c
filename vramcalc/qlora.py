"""QLoRA's 4-bit base as each implementation stores and runs it: bitsandbytes (`Linear4bit`,
HF transformers / PEFT, Lightning) or torchao (`NF4Tensor`, torchtune), at a release.

Options (TrainingConfig): `qlora_impl` (bnb | torchao; None = bnb), `bnb_version` /
`torchao_version` (None = the current release, below), `nf4_double_quant` (bnb's
`compress_statistics`; None = on) and `quantize_head` (lm_head in NF4 too).

Storage of one quantized weight of n elements, each row one allocation:

| impl            | tensor                     | dtype | elements |
|-----------------|----------------------------|-------|----------|
| bnb, any        | packed codes               | uint8 | ⌈n/2⌉ |
| bnb, double     | absmax (8-bit)             | uint8 | ⌈n/64⌉ |
| bnb, double     | state2.absmax              | fp32  | ⌈⌈n/64⌉/256⌉ |
| bnb, double     | state2.code, offset        | fp32  | 256, 1 |
| bnb, single     | absmax                     | fp32  | ⌈n/64⌉ |
| bnb, any        | code (NF4 table)           | fp32  | 16 |
| torchao         | quantized_data             | uint8 | ⌈n/2⌉ |
| torchao         | quantized_scalers          | int8  | ⌈n/64⌉ |
| torchao ≥ 0.3   | quantization_factor        | bf16  | ⌈n/64/256⌉ |
| torchao < 0.3   | quantization_factor (view) | bf16  | ⌈n/64⌉ (the whole expanded storage) |
| torchao         | scaler_mean, nf4           | bf16  | 1, 16 |

Sources: bitsandbytes functional.py `quantize_4bit` / `quantize_blockwise` /
`get_4bit_type` (0.41.1 @ 18e827d6: a list state, `[absmax, shape, dtype, blocksize,
[offset, state2] or None, quant_type, code]`; 0.50.1 @ 95f9af30: `QuantState`, same
tensors); torchao torchao/dtypes/nf4tensor.py `NF4Tensor.from_tensor` /
`double_quantize_scalers` (v0.1 @ ff288954 and v0.5.0; the `.contiguous()` copy of
quantization_factor came with 9dbc5542 "[NF4][FSDP] return contiguous quantization_factor",
first in v0.3.0).

What a 4-bit linear keeps for backward (the base weight never gets a gradient):

- bitsandbytes before 0.43.2 kept its input: `MatMul4Bit.forward` set `ctx.tensors = (A, B)`
  whenever A or B needed a gradient (bitsandbytes/autograd/_functions.py, 0.41.1 @ 18e827d6
  and 0.43.1 @ 4a6fb352); commit 9e753741 "fix QLoRA mem bug: delete useless buffered
  activation" (#1270, first released in 0.43.2 @ ce53caf3) made it `(None, B)`. The input
  is held as a Python attribute of the autograd node, not a saved variable, so backward
  does not release it: it lives until the graph is freed.
- torchao's `linear_nf4` (`LinearNF4.forward`) keeps only the NF4 weight (v0.1:
  `ctx.nf4_weight = weight`; v0.5.0: `ctx.save_for_backward(weight)`): resident, nothing new.

Dequantizing for a matmul (forward, and again in backward for dL/dx):

- bitsandbytes `dequantize_4bit`: double-quantized absmax decoded to fp32 plus `+= offset`
  (two fp32 ⌈n/64⌉ buffers, backends/cuda/ops.py `_dequant_linear_fallback`), the weight
  (n, compute dtype); single quantization reads the fp32 absmax directly.
- torchao `NF4Tensor.get_original_weight` (v0.1 … v0.5.0, eager): the high and low codes
  widened to int64 (2 × ⌈n/2⌉ × 8 B), looked up in the bf16 table (2 × ⌈n/2⌉), scaled
  (2 × ⌈n/2⌉), stacked into the bf16 weight (n): 14 bytes per element at the stack, all of
  them Python locals until the function returns (`torch.stack`); `_to_copy` then casts the
  bf16 weight to the matmul's dtype (a second copy under fp32, none under bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from vramcalc.units import alloc, ceil_div

QLORA_IMPLS: tuple[str, ...] = ("bnb", "torchao")
BNB_CURRENT = "0.50.1"  # the release vramcalc's bitsandbytes layout was read from
TORCHAO_CURRENT = "0.5.0"  # torchao's NF4Tensor as torchtune 0.3 (Sep 2024) ran it
BNB_FREES_INPUT = (0, 43, 2)  # 9e753741 (#1270), released in 0.43.2
TORCHAO_CONTIGUOUS_FACTOR = (0, 3, 0)  # 9dbc5542 (#298), released in v0.3.0
TORCHAO_CHUNKED_QUANTIZE = (0, 2, 0)  # 6081796b "perform in chunks" (#196), in v0.2.0
TORCHAO_CHUNK = 1024**2  # nf4tensor.py CHUNK_SIZE (elements quantized at once)

NF4_BLOCK = 64  # bitsandbytes Params4bit blocksize / torchao block_size default
NF4_SCALER_BLOCK = 256  # bnb quantize_blockwise of the absmax / torchao scaler_block_size
NF4_STATE2_CODE_ELEMS = 256  # state2.code: the 8-bit dynamic map, copied per tensor
NF4_CODE_ELEMS = 16  # the NF4 lookup table, one per tensor

def parse_version(text: str) -> tuple[int, int, int]:
    """A release as pip or `__version__` prints it -> (major, minor, patch): '0.41.1' ->
    (0, 41, 1), 'v0.3' -> (0, 3, 0). A pre-release, nightly or local build counts as the
    release it leads to ('2.6.0.dev20241112' -> (2, 6, 0), '2.5.1+cu121' -> (2, 5, 1));
    ValueError for anything else."""
    try:
        release = Version(str(text).strip()).release
    except ValueError:  # InvalidVersion, or a number past int()'s digit limit
        release = ()
    if len(release) < 2:
        raise ValueError(f"expected a release such as 0.41.1 or 2.5.1+cu121, got {text!r}")
    return release[0], release[1], release[2] if len(release) > 2 else 0


@dataclass(frozen=True)
class NF4Layout:
    """How one run's 4-bit base is stored and what its linears keep (module docstring)."""

    impl: str  # bnb | torchao
    version: tuple[int, int, int]
    double_quant: bool  # bnb compress_statistics (torchao always double-quantizes)
    head: bool  # lm_head quantized too
    # the dtype bitsandbytes quantized the weights from, which `dequantize_4bit` returns
    # (quant_state.dtype); None: the matmul's input dtype. Lightning's BitsandbytesPrecision
    # quantizes an fp16 copy (`_Linear4bit.quantize`: `weight.contiguous().to(device=device,
    # dtype=torch.half)`), so its bf16 matmuls also cast the dequantized weight
    # (`MatMul4Bit.forward`: `F.dequantize_4bit(B, quant_state).to(A.dtype)`)
    quant_dtype: str | None = None

    @property
    def keeps_input(self) -> bool:
        """bitsandbytes < 0.43.2: each 4-bit matmul holds its input until the graph is freed."""
        return self.impl == "bnb" and self.version < BNB_FREES_INPUT


def nf4_layout(impl: str | None, bnb_version: str | None, torchao_version: str | None,
               double_quant: bool | None, head: bool,
               quant_dtype: str | None = None) -> NF4Layout:
    """The layout the options name (None: bitsandbytes, current release, double quant)."""
    impl = impl or "bnb"
    text = (bnb_version or BNB_CURRENT) if impl == "bnb" else (torchao_version
                                                               or TORCHAO_CURRENT)
    return NF4Layout(impl=impl, version=parse_version(text),
                     double_quant=True if impl == "torchao" or double_quant is None
                     else double_quant, head=head,
                     quant_dtype=quant_dtype if impl == "bnb" else None)


DEFAULT_LAYOUT = nf4_layout(None, None, None, None, False)


def nf4_constant_bytes(n: int, layout: NF4Layout = DEFAULT_LAYOUT, shard: int = 1) -> int:
    """Quantization constants of one 4-bit tensor of n elements (module docstring table),
    as one of `shard` FSDP2 ranks keeps them: torchao's scalers and factors are inner
    tensors of the NF4Tensor parameter, split along dim 0 with the packed data
    (nf4tensor.py `_INNER_TENSOR_NAMES_FOR_SHARDING`, `nf4_split`); its mean and table, and
    bitsandbytes' whole QuantState, are metadata every rank keeps whole."""
    blocks = ceil_div(n, NF4_BLOCK)
    if layout.impl == "torchao":
        scalers, factors = _torchao_scalers(ceil_div(n, shard), layout)
        return (alloc(scalers, "int8") + alloc(factors, "bf16") + alloc(1, "bf16")
                + alloc(NF4_CODE_ELEMS, "bf16"))
    if not layout.double_quant:
        return alloc(blocks, "fp32") + alloc(NF4_CODE_ELEMS, "fp32")
    return (alloc(blocks, "uint8") + alloc(ceil_div(blocks, NF4_SCALER_BLOCK), "fp32")
            + alloc(NF4_STATE2_CODE_ELEMS, "fp32") + alloc(1, "fp32")
            + alloc(NF4_CODE_ELEMS, "fp32"))


def nf4_gathered_constant_bytes(n: int, layout: NF4Layout = DEFAULT_LAYOUT) -> int:
    """The constants FSDP2 all-gathers with a 4-bit weight of n elements: torchao's int8
    scalers and bf16 factors (`NF4Tensor.fsdp_pre_all_gather` returns them beside the
    packed data); none for bitsandbytes, whose QuantState is not a parameter."""
    if layout.impl != "torchao":
        return 0
    scalers, factors = _torchao_scalers(n, layout)
    return scalers + 2 * factors  # int8, bf16: one flat all-gather buffer, no rounding


def _torchao_scalers(n: int, layout: NF4Layout) -> tuple[int, int]:
    """Elements of torchao's int8 quantized_scalers and bf16 quantization_factor for n."""
    blocks = ceil_div(n, NF4_BLOCK)
    return blocks, (ceil_div(blocks, NF4_SCALER_BLOCK)
                    if layout.version >= TORCHAO_CONTIGUOUS_FACTOR else blocks)


def nf4_tensor_bytes(n: int, layout: NF4Layout = DEFAULT_LAYOUT) -> int:
    """Packed data + constants of one 4-bit tensor of n elements."""
    return alloc(ceil_div(n, 2), "uint8") + nf4_constant_bytes(n, layout)


def absmax_decode_bytes(n: int, layout: NF4Layout = DEFAULT_LAYOUT) -> int:
    """bitsandbytes' decoded fp32 absmax and its `+ offset` copy while a double-quantized
    weight of n elements is dequantized (0 otherwise)."""
    if layout.impl != "bnb" or not layout.double_quant:
        return 0
    return 2 * alloc(ceil_div(n, NF4_BLOCK), "fp32")


def compiled_dequant_kept(compiled: bool, finetune: str, layout: NF4Layout) -> bool:
    """torchao's dequantization inside a compiled layer (torchtune `compile: True`):
    inductor fuses `get_original_weight` into one kernel that writes the bf16 weight (no
    int64 codes or halves), and AOTAutograd's min-cut partitioner keeps that weight for the
    backward's dL/dx rather than recomputing it from the packed codes (the index into the
    NF4 table is not recomputed): without checkpointing the forward saves every linear's
    dequantized weight; under checkpointing the recompute keeps each until its dL/dx. Found
    with vramcalc/trace/compiled.py `torchao_nf4_linear` (tests/test_qlora_compile.py) and
    on real CPU runs of torchao 0.5.0 under torch 2.5.1 and 2.13."""
    return compiled and finetune == "qlora" and layout.impl == "torchao"


def dequant_transient_bytes(n: int, dtype: str, layout: NF4Layout = DEFAULT_LAYOUT) -> int:
    """Temporaries of dequantizing one 4-bit weight of n elements for a matmul: bitsandbytes'
    decoded absmax (`absmax_decode_bytes`) and the weight in `dtype`; torchao's
    `get_original_weight` locals at its `torch.stack` (module docstring): int64 codes,
    looked-up and scaled halves, and the bf16 weight."""
    if layout.impl == "torchao":
        half = ceil_div(n, 2)
        return 2 * alloc(half, "int64") + 4 * alloc(half, "bf16") + alloc(n, "bf16")
    q = layout.quant_dtype
    if q is not None and q != dtype:  # the weight in its quantized-from dtype, then cast
        return max(absmax_decode_bytes(n, layout) + alloc(n, q), alloc(n, q) + alloc(n, dtype))
    return absmax_decode_bytes(n, layout) + alloc(n, dtype)


def dequant_matmul_bytes(n: int, dtype: str, layout: NF4Layout, out_bytes: int) -> int:
    """Peak temporaries of a forward 4-bit matmul y = x·dequant(W)ᵀ producing `out_bytes`:
    bitsandbytes keeps its decoded absmax and the weight through F.linear
    (`_dequant_linear_fallback`); a weight dequantized to another dtype and cast (torchao's
    `get_original_weight().to(dtype)` in `_to_copy`, v0.5.0) is alone beside the output,
    its source and the dequantization's locals gone (the cast's two copies never exceed
    those locals)."""
    if layout.impl == "torchao" or layout.quant_dtype not in (None, dtype):
        return max(dequant_transient_bytes(n, dtype, layout), alloc(n, dtype) + out_bytes)
    return dequant_transient_bytes(n, dtype, layout) + out_bytes


def dequant_backward_bytes(n: int, dtype: str, layout: NF4Layout, dx_bytes: int) -> int:
    """Peak temporaries of a 4-bit linear's backward dL/dx = dL/dy · dequant(W): the
    dequantization, then the weight in `dtype` alone next to dL/dx (bitsandbytes frees the
    decoded absmax when `dequantize_4bit` returns, torchao its locals before the cast)."""
    return max(dequant_transient_bytes(n, dtype, layout), alloc(n, dtype) + dx_bytes)
