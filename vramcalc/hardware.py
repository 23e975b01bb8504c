"""Accelerator profiles (one YAML per GPU/NPU), name lookup and cluster strings.

Profiles live in the top-level ``hardware_profiles/`` directory (shipped inside the wheel)
plus any directories named by the ``VRAMCALC_PROFILES`` environment variable
(``os.pathsep``-separated) or passed as ``extra_dirs``. Later directories override earlier
ones id by id, so a user can replace a built-in profile. Files are read lazily, on the
first call, and cached per tuple of directories.

Units: bytes and bytes/s are ints (GB = 10**9, GiB = 2**30); TFLOP/s are dense (no 2:4
sparsity) peaks per torch device. Every number in a shipped profile cites the entry of
``shared/reference/hardware.yaml`` it came from in the file's ``sources`` list.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

import vramcalc.safeio as safeio
from vramcalc.errors import InputError, shown, shown_path

ENV_VAR = "VRAMCALC_PROFILES"
DTYPES = ("bf16", "fp16", "fp8", "fp32")
MAX_COUNT = 1_000_000
# Bounds of a profile's numbers: far outside any device, inside what the arithmetic handles
MAX_BYTES = 2**50  # 1 PiB of device memory
MIN_RATE, MAX_RATE = 10**6, 10**16  # bytes/s: 1 MB/s to 10 PB/s
MIN_TFLOPS, MAX_TFLOPS = 1e-3, 1e6
MIN_MFU = 1e-3

# Short aliases that silently pick one variant of a family: normalized alias ->
# (profile id it resolves to, sentence shown to the user; {name} = the profile's name).
ALIAS_NOTES: dict[str, tuple[str, str]] = {
    "h100": (
        "h100_sxm",
        "H100 resolved to {name} (use H100-PCIe or H100-NVL for the PCIe cards)",
    ),
    "a100": (
        "a100_80gb",
        "A100 resolved to {name} (use A100-40GB for the 40 GB card, A100-PCIe for PCIe)",
    ),
    "a100_pcie": (
        "a100_pcie_80gb",
        "A100-PCIe resolved to {name} (use A100-PCIe-40GB for the 40 GB card)",
    ),
    "v100": ("v100_32gb", "V100 resolved to {name} (use V100-16GB for the 16 GB card)"),
    "910b": (
        "ascend_910b2",
        "910B resolved to {name} (use 910B1, 910B3 or 910B4 for the other variants)",
    ),
    "ascend_910b": (
        "ascend_910b2",
        "Ascend-910B resolved to {name} (use 910B1, 910B3 or 910B4 for the other variants)",
    ),
    "ascend910b": (
        "ascend_910b2",
        "Ascend910B resolved to {name} (use 910B1, 910B3 or 910B4 for the other variants)",
    ),
}


class GPUProfile(BaseModel):
    """One accelerator, as one torch device sees it (a rank = one device).

    Multi-die packages (MI250X, Ascend 910C) are profiled per die, because each die is a
    separate torch device with its own memory. Equal profiles hash alike: by id and size
    (`dense_tflops` is a dict).
    """

    # NaN and infinity are refused (allow_inf_nan); every number has an upper bound, and
    # rates a lower one, so the speed model never divides by an underflowed zero
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_]*$", max_length=200)
    name: str = Field(min_length=1)
    vendor: str = Field(min_length=1)
    aliases: tuple[str, ...] = ()
    # Capacity as labelled by the vendor (the "80" of "80GB"); HBM labels are in practice
    # binary (80 GiB of HBM, of which the runtime reports ~79.2 GiB).
    marketed_gb: float = Field(gt=0, le=MAX_BYTES / 1e9)
    # Bytes the runtime reports (torch.cuda.get_device_properties(d).total_memory).
    memory_total_bytes: int = Field(gt=0, le=MAX_BYTES)
    memory_total_note: str = Field(min_length=1)
    memory_bandwidth_bytes_per_s: int = Field(ge=MIN_RATE, le=MAX_RATE)
    # Dense peak TFLOP/s per dtype; a dtype is absent when unsupported or unconfirmed.
    dense_tflops: dict[str, float]
    intra_node_bytes_per_s: int = Field(ge=MIN_RATE, le=MAX_RATE)  # per direction, per device, GPU-GPU
    inter_node_bytes_per_s: int = Field(ge=MIN_RATE, le=MAX_RATE)  # per direction, per device, network
    host_link_bytes_per_s: int = Field(ge=MIN_RATE, le=MAX_RATE)  # per direction, device <-> host
    gpus_per_node: int = Field(gt=0, le=MAX_COUNT)
    bf16_supported: bool
    fused_attention: bool
    # whether FlashAttention-2-class kernels run (flash-attn on sm80+, its ROCm backends, the
    # vendors' FlashAttention-style kernels); false where only PyTorch SDPA's memory-efficient
    # kernel does (V100, T4: Dao-AILab/flash-attention README, "Ampere, Ada, or Hopper GPUs")
    flash_attention_2: bool = True
    context_overhead_bytes: int = Field(ge=0, le=MAX_BYTES)
    # the CUDA context when every kernel image is loaded at start (eager module loading:
    # torch < 1.13, or a CUDA runtime < 11.7); None where no torch of that era ran on the GPU
    context_eager_bytes: int | None = Field(None, ge=0, le=MAX_BYTES)
    # BLAS workspace PyTorch allocates through the caching allocator (counted in
    # max_memory_allocated). Default: the CUDA default before sm90, CUBLAS_WORKSPACE_CONFIG
    # ":4096:2:16:8" = 2 x 4 MiB + 8 x 16 KiB (aten/src/ATen/cuda/CublasHandlePool.cpp).
    blas_workspace_bytes: int = Field(8 * 2**20 + 8 * 16 * 2**10, ge=0, le=MAX_BYTES)
    # Transformer Engine keeps a separate FP8 transpose of each weight (false where the GPU
    # runs non-TN FP8 GEMMs: sm100/sm103, TE is_non_tn_fp8_gemm_supported)
    fp8_separate_transpose: bool = True
    memory_api: Literal["cuda", "rocm", "npu", "hpu"]
    # torch.cuda.get_device_capability() as "major.minor" (NVIDIA's compute capability);
    # None where not given. Stacks pick kernels by it (torchtune's flex attention: >= 7.5)
    cuda_capability: str | None = Field(None, pattern=r"^[0-9]{1,2}\.[0-9]$")
    mfu_fraction: float = Field(ge=MIN_MFU, le=1)
    price_usd_per_hour: float | None = Field(None, gt=0, le=1e6)
    sources: tuple[str, ...] = Field(min_length=1)
    notes: str = ""

    @field_validator("dense_tflops", mode="before")
    @classmethod
    def _drop_unsupported(cls, value: Any) -> Any:
        if isinstance(value, dict):  # a null entry means "unsupported": drop it
            return {k: v for k, v in value.items() if v is not None}
        return value

    @model_validator(mode="after")
    def _check(self) -> GPUProfile:
        for key, tflops in self.dense_tflops.items():
            if key not in DTYPES:
                raise ValueError(
                    f"dense_tflops: unknown dtype {key!r} (expected one of {', '.join(DTYPES)})"
                )
            if not MIN_TFLOPS <= tflops <= MAX_TFLOPS:  # also false for NaN
                raise ValueError(f"dense_tflops: {key} TFLOP/s must be between {MIN_TFLOPS} "
                                 f"and {MAX_TFLOPS:g}")
        if any(not s.strip() for s in self.sources):
            raise ValueError("sources: sources must not contain empty strings")
        for key in ("context_overhead_bytes", "context_eager_bytes"):
            if (getattr(self, key) or 0) >= self.memory_total_bytes:
                raise ValueError(f"{key} must be smaller than memory_total_bytes")
        if self.bf16_supported and "bf16" not in self.dense_tflops:
            raise ValueError(
                "bf16_supported is true but dense_tflops has no bf16 entry"
            )
        return self

    def __hash__(self) -> int:
        return hash((self.id, self.memory_total_bytes))

    def peak_tflops(self, dtype: str) -> float | None:
        """Dense peak TFLOP/s for `dtype` ('bf16', 'fp16', 'fp8', 'fp32'), None if unknown."""
        return self.dense_tflops.get(dtype)


class Cluster(BaseModel):
    """`num_nodes` nodes of `gpus_per_node` identical devices."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: GPUProfile
    num_nodes: int = Field(gt=0, le=MAX_COUNT)
    gpus_per_node: int = Field(gt=0, le=MAX_COUNT)

    @property
    def num_gpus(self) -> int:
        """Total devices: num_nodes x gpus_per_node."""
        return self.num_nodes * self.gpus_per_node


def normalize_name(name: str) -> str:
    """Lookup key for ids and aliases: lower case, '-' and ' ' become '_', runs collapsed,
    and a memory size written with a bare G reads as GB (A800-80G, as cluster inventories
    write it; A10G, a model name, keeps its G)."""
    key = re.sub(r"[\s\-_]+", "_", name.strip().lower()).strip("_")
    return re.sub(r"(?<=_)(\d+)g(?=_|$)", r"\1gb", key)


def builtin_profiles_dir() -> Path:
    """The shipped `hardware_profiles/`: inside the package in a wheel, else at the repo top."""
    here = Path(__file__).resolve().parent
    packaged = here / "hardware_profiles"
    if packaged.is_dir():
        return packaged
    return here.parent / "hardware_profiles"


def profiles_dirs(extra: list[Path] | None = None) -> list[Path]:
    """Profile locations in override order: built-in, then $VRAMCALC_PROFILES, then `extra`.

    An entry may also be a single YAML file.
    """
    dirs = [builtin_profiles_dir()]
    env = os.environ.get(ENV_VAR, "")
    dirs.extend(safeio.user_path(p, ENV_VAR) for p in env.split(os.pathsep) if p.strip())
    dirs.extend(safeio.user_path(p, "--profiles-dir") for p in (extra or []))
    return dirs


INDEX_FILE = "_index.yaml"  # the shipped profiles' aliases: {id: [alias, ...]}


def _profile_error(exc: ValidationError) -> str:
    """pydantic's errors as `field: message` parts (a cross-field check: its own words)."""
    parts = []
    for err in exc.errors():
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, Exception) and not err["loc"]:
            parts.append(str(cause))
        else:
            parts.append(f"{'.'.join(str(x) for x in err['loc']) or 'profile'}: {err['msg']}")
    return "; ".join(parts)


def _read_yaml(path: Path) -> Any:
    return safeio.read_yaml(path, "GPU profile", f"GPU profile {shown_path(path)}")


@functools.lru_cache(maxsize=256)
def load_profile_file(path: Path) -> GPUProfile:
    """One profile file, validated (its id must equal the file stem). Raises InputError
    naming the file."""
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise InputError(f"malformed GPU profile {path}: expected a mapping of fields")
    try:
        profile = GPUProfile(**data)
    except ValidationError as exc:
        raise InputError(f"invalid GPU profile {path}: {_profile_error(exc)}") from None
    if profile.id != path.stem:
        raise InputError(
            f"invalid GPU profile {path}: id {profile.id!r} must equal the file name {path.stem!r}"
        )
    return profile


def _profile_files(location: Path) -> list[Path]:
    kind = safeio.path_kind(location)
    if kind == "file":
        return [location]
    if kind == "other":
        raise InputError(f"GPU profile location {shown_path(location)} is not a folder or a "
                         "regular file")
    if kind != "dir":
        raise InputError(f"GPU profile directory {shown_path(location)} does not exist")
    files = [
        p for p in safeio.list_dir(location, "GPU profile directory")
        if p.suffix in (".yaml", ".yml") and safeio.path_kind(p) == "file"
        and p.name != INDEX_FILE
    ]
    stems = [p.stem for p in files]
    for stem in stems:
        if stems.count(stem) > 1:
            raise InputError(
                f"GPU profile {stem!r} is defined twice in {location} (.yaml and .yml)"
            )
    return files


def builtin_aliases() -> dict[str, list[str]]:
    """The shipped profiles' aliases by id, from the catalog's index file (a test checks it
    against the profiles themselves)."""
    data = safeio.load_yaml((builtin_profiles_dir() / INDEX_FILE).read_text(encoding="utf-8"),
                           INDEX_FILE)
    return {str(k): [str(a) for a in v] for k, v in data.items()}


@functools.lru_cache(maxsize=32)
def _catalog(dirs: tuple[Path, ...]) -> tuple[dict[str, Path], dict[str, str], dict[str, str]]:
    """(file by id, id by lookup key, display name by lookup key) over `dirs`. Shipped
    profiles are found by file stem and the index file, without reading them; files in the
    user's folders are read (their aliases live in them)."""
    files: dict[str, Path] = {}
    index: dict[str, str] = {}
    names: dict[str, str] = {}

    def claim(label: str, pid: str, path: Path) -> None:
        key = normalize_name(label)
        other = index.get(key)
        if other is not None and other != pid:
            raise InputError(
                f"GPU name {label!r} in {path} is already used by {other!r} ({files[other]})"
            )
        index[key] = pid
        names.setdefault(key, label)

    builtin, *user = dirs
    for path in _profile_files(builtin):
        files[path.stem] = path
    for pid, aliases in sorted(builtin_aliases().items()):
        claim(pid, pid, files[pid])
        for alias in aliases:
            claim(alias, pid, files[pid])
    for location in user:
        for path in _profile_files(location):
            profile = load_profile_file(path)
            files[profile.id] = path  # later locations override
            claim(profile.id, profile.id, path)
            for alias in profile.aliases:
                claim(alias, profile.id, path)
    return files, index, names


def load_profiles(extra_dirs: list[Path] | None = None) -> dict[str, GPUProfile]:
    """All profiles by id (built-in, then $VRAMCALC_PROFILES, then `extra_dirs`).

    Raises InputError naming the file for malformed YAML, schema errors, a file stem that
    differs from its id, or an alias claimed by two profiles.
    """
    files, _, _ = _catalog(tuple(profiles_dirs(extra_dirs)))
    return {pid: load_profile_file(files[pid]) for pid in sorted(files)}


def resolve_gpu(name: str, extra_dirs: list[Path] | None = None) -> GPUProfile:
    """The profile whose id or alias matches `name` (case-insensitive; '-', ' ', '_' equal).
    Reads that profile's file only."""
    files, index, names = _catalog(tuple(profiles_dirs(extra_dirs)))
    key = normalize_name(name)
    if key in index:
        return load_profile_file(files[index[key]])
    close = difflib.get_close_matches(key, sorted(names), n=3, cutoff=0.5)
    hint = (
        f"; did you mean: {', '.join(names[c] for c in close)}?"
        if close
        else "; run `vramcalc gpus` for the list"
    )
    raise InputError(f"unknown GPU {shown(name)}{hint}")


def alias_note(name: str, profile: GPUProfile) -> str | None:
    """A sentence when the short name the user typed picked one variant (A100 -> 80GB)."""
    _, _, gpu_name = _split_counts(name)
    entry = ALIAS_NOTES.get(normalize_name(gpu_name))
    if entry is None or entry[0] != profile.id:
        return None
    return entry[1].format(name=profile.name)


_COUNT_PREFIX = re.compile(r"^\s*([+-]?[0-9][0-9_,.]*)\s*[xX*]\s*(.*)$", re.DOTALL)


def _parse_count(token: str, what: str, text: str) -> int:
    if not token.isdigit():
        raise InputError(
            f"bad GPU spec {shown(text)}: {what} {shown(token)} must be a positive whole number"
        )
    value = int(token) if len(token) <= 9 else MAX_COUNT + 1  # no 4,300-digit int()
    if value < 1 or value > MAX_COUNT:
        raise InputError(
            f"bad GPU spec {shown(text)}: {what} must be between 1 and {MAX_COUNT:,}, got "
            + (str(value) if len(token) <= 9 else f"a {len(token):,}-digit number")
        )
    return value


def _split_counts(text: str) -> tuple[str | None, str | None, str]:
    """'2x8xH100' -> ('2', '8', 'H100'); '8xH100' -> (None, '8', 'H100'); 'H100' -> (None, None, 'H100')."""
    tokens: list[str] = []
    rest = text
    while (m := _COUNT_PREFIX.match(rest)) is not None:
        tokens.append(m.group(1))
        rest = m.group(2)
    if len(tokens) > 2:
        raise InputError(
            f"bad GPU spec {shown(text)}: expected GPU, NxGPU or NODESxPER_NODExGPU"
        )
    if len(tokens) == 2:
        return tokens[0], tokens[1], rest.strip()
    if len(tokens) == 1:
        return None, tokens[0], rest.strip()
    return None, None, rest.strip()


def parse_gpus(text: str, extra_dirs: list[Path] | None = None) -> Cluster:
    """Parse 'H100', '8xH100', '64x910B' or '2x8xA100-80GB' ('x', 'X' or '*') into a Cluster.

    A bare count N fills one node when N <= the profile's gpus_per_node, otherwise it must be
    a multiple of gpus_per_node (N / gpus_per_node nodes).
    """
    nodes_token, count_token, gpu_name = _split_counts(text)
    if not gpu_name:
        raise InputError(f"bad GPU spec {shown(text)}: missing GPU name (e.g. 8xH100)")
    gpu = resolve_gpu(gpu_name, extra_dirs)
    if count_token is None:
        return Cluster.model_construct(gpu=gpu, num_nodes=1, gpus_per_node=1)
    count = _parse_count(
        count_token, "GPU count" if nodes_token is None else "GPUs per node", text
    )
    if nodes_token is not None:
        num_nodes = _parse_count(nodes_token, "node count", text)
        if num_nodes * count > MAX_COUNT:
            raise InputError(
                f"bad GPU spec {shown(text)}: more than {MAX_COUNT:,} GPUs in total"
            )
        return Cluster.model_construct(gpu=gpu, num_nodes=num_nodes, gpus_per_node=count)
    per_node = gpu.gpus_per_node
    if count <= per_node:
        return Cluster.model_construct(gpu=gpu, num_nodes=1, gpus_per_node=count)
    if count % per_node:
        raise InputError(
            f"bad GPU spec {shown(text)}: {count} GPUs is not a multiple of {per_node} per {gpu.id} node; "
            f"write NODESxPER_NODExGPU, e.g. {-(-count // per_node)}x{per_node}x{gpu_name}"
        )
    return Cluster.model_construct(gpu=gpu, num_nodes=count // per_node, gpus_per_node=per_node)
