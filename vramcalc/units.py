"""Dtype sizes, rounding and unit formatting.

Sizes are counted in bits so 4-bit types never round to zero bytes.
GB means 10**9 bytes and GiB means 2**30 bytes; the two are never mixed.
"""

from __future__ import annotations

from vramcalc.errors import InputError

DTYPE_BITS: dict[str, int] = {
    "fp32": 32,
    "tf32": 32,
    "bf16": 16,
    "fp16": 16,
    "fp8": 8,
    "int8": 8,
    "uint8": 8,
    "int4": 4,
    "nf4": 4,
    "int64": 64,
    "int32": 32,
    "bool": 8,
}

GB = 10**9
GiB = 2**30
MiB = 2**20

# CUDA caching allocator rounds every block up to 512 bytes
# (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize = 512).
ALLOC_ROUND_BYTES = 512


def ceil_div(count: int, degree: int) -> int:
    """Divide a count by a parallel degree, rounding up (the one helper for sharding)."""
    return -(-count // degree)


def nbytes(count: int, dtype: str) -> int:
    """Bytes taken by `count` elements of `dtype`, rounded up to a whole byte."""
    return ceil_div(count * DTYPE_BITS[dtype], 8)


def round_alloc(num_bytes: int) -> int:
    """Round one allocation up as the CUDA caching allocator does (512-byte blocks)."""
    if num_bytes <= 0:
        return 0
    return ceil_div(num_bytes, ALLOC_ROUND_BYTES) * ALLOC_ROUND_BYTES


def alloc(count: int, dtype: str) -> int:
    """Allocator bytes of one tensor of `count` elements of `dtype` (512-byte rounded)."""
    return round_alloc(nbytes(count, dtype))


def fmt_gb(num_bytes: int, digits: int = 2) -> str:
    """Format bytes in decimal gigabytes (10**9)."""
    return f"{num_bytes / GB:,.{digits}f} GB"


def fmt_gib(num_bytes: int, digits: int = 2) -> str:
    """Format bytes in binary gibibytes (2**30)."""
    return f"{num_bytes / GiB:,.{digits}f} GiB"


def parse_count(text: str) -> int:
    """Parse a count such as `2e12`, `300B`, `1.5T`, `800M`, `4096` (tokens, sizes).

    k, M, B (or G) and T are decimal (10^3 ... 10^12); Ki, Mi, Gi and Ti are binary
    (2^10 ... 2^40), as in IEC 80000-13: `4Mi` is 4,194,304.
    """
    s = str(text).strip().replace("_", "").replace(",", "")
    mult = 1
    binary = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    decimal = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
    if s[-2:].lower() in binary:
        mult, s = binary[s[-2:].lower()], s[:-2]
    elif s and s[-1].lower() in decimal:
        mult, s = decimal[s[-1].lower()], s[:-1]
    try:
        value = float(s) * mult
    except ValueError:
        raise InputError(f"not a number: {text!r} (examples: 4096, 2e12, 300B, 1.5T, "
                         "4Mi)") from None
    if value != value or value <= 0 or value > 1e18:
        raise InputError(f"count out of range: {text!r}")
    return int(round(value))
