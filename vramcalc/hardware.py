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

from vramcalc import yamlio
from vramcalc.errors import InputError
from vramcalc.record import Record, field

ENV_VAR = "VRAMCALC_PROFILES"
DTYPES = ("bf16", "fp16", "fp8", "fp32")
MAX_COUNT = 1_000_000

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


class GPUProfile(Record):
    """One accelerator, as one torch device sees it (a rank = one device).

    Multi-die packages (MI250X, Ascend 910C) are profiled per die, because each die is a
    separate torch device with its own memory.
    """

    id: str = field(pattern=r"^[a-z0-9][a-z0-9_]*$")
    name: str = field(min_length=1)
    vendor: str = field(min_length=1)
    aliases: list[str] = []  # copied per instance (vramcalc/record.py)
    # Capacity as labelled by the vendor (the "80" of "80GB"); HBM labels are in practice
    # binary (80 GiB of HBM, of which the runtime reports ~79.2 GiB).
    marketed_gb: float = field(gt=0)
    # Bytes the runtime reports (torch.cuda.get_device_properties(d).total_memory).
    memory_total_bytes: int = field(gt=0)
    memory_total_note: str = field(min_length=1)
    memory_bandwidth_bytes_per_s: int = field(gt=0)
    # Dense peak TFLOP/s per dtype; a dtype is absent when unsupported or unconfirmed.
    dense_tflops: dict[str, float]
    intra_node_bytes_per_s: int = field(gt=0)  # per direction, per device, GPU-GPU
    inter_node_bytes_per_s: int = field(gt=0)  # per direction, per device, network
    host_link_bytes_per_s: int = field(gt=0)  # per direction, device <-> host
    gpus_per_node: int = field(gt=0, le=MAX_COUNT)
    bf16_supported: bool
    fused_attention: bool
    context_overhead_bytes: int = field(ge=0)
    memory_api: Literal["cuda", "rocm", "npu", "hpu"]
    mfu_fraction: float = field(gt=0, le=1)
    price_usd_per_hour: float | None = field(None, gt=0)
    sources: list[str] = field(min_length=1)
    notes: str = ""

    @classmethod
    def _prepare(cls, values: dict[str, Any]) -> dict[str, Any]:
        tflops = values.get("dense_tflops")
        if isinstance(tflops, dict):  # a null entry means "unsupported": drop it
            values["dense_tflops"] = {k: v for k, v in tflops.items() if v is not None}
        return values

    def _check(self) -> None:
        for key, tflops in self.dense_tflops.items():
            if key not in DTYPES:
                raise ValueError(
                    f"dense_tflops: unknown dtype {key!r} (expected one of {', '.join(DTYPES)})"
                )
            if tflops <= 0:
                raise ValueError(f"dense_tflops: {key} TFLOP/s must be positive")
        if any(not s.strip() for s in self.sources):
            raise ValueError("sources: sources must not contain empty strings")
        if self.context_overhead_bytes >= self.memory_total_bytes:
            raise ValueError(
                "context_overhead_bytes must be smaller than memory_total_bytes"
            )
        if self.bf16_supported and "bf16" not in self.dense_tflops:
            raise ValueError(
                "bf16_supported is true but dense_tflops has no bf16 entry"
            )

    def peak_tflops(self, dtype: str) -> float | None:
        """Dense peak TFLOP/s for `dtype` ('bf16', 'fp16', 'fp8', 'fp32'), None if unknown."""
        return self.dense_tflops.get(dtype)


class Cluster(Record):
    """`num_nodes` nodes of `gpus_per_node` identical devices."""

    gpu: GPUProfile
    num_nodes: int = field(gt=0, le=MAX_COUNT)
    gpus_per_node: int = field(gt=0, le=MAX_COUNT)

    @property
    def num_gpus(self) -> int:
        """Total devices: num_nodes x gpus_per_node."""
        return self.num_nodes * self.gpus_per_node


def normalize_name(name: str) -> str:
    """Lookup key for ids and aliases: lower case, '-' and ' ' become '_', runs collapsed."""
    key = re.sub(r"[\s\-_]+", "_", name.strip().lower())
    return key.strip("_")


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
    dirs.extend(Path(p).expanduser() for p in env.split(os.pathsep) if p.strip())
    dirs.extend(Path(p).expanduser() for p in (extra or []))
    return dirs


def _validated_profile(data: Any, path: Path) -> dict[str, Any]:
    """A profile file's parsed data, validated (pydantic, vramcalc/record.py), as the
    fields the cache keeps. Raises InputError naming the file."""
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise InputError(f"malformed GPU profile {path}: expected a mapping of fields")
    try:
        profile = GPUProfile(**data)
    except ValidationError as exc:
        parts = [f"{'.'.join(str(x) for x in err['loc']) or 'profile'}: {err['msg']}"
                 for err in exc.errors()]
        raise InputError(f"invalid GPU profile {path}: {'; '.join(parts)}") from None
    except ValueError as exc:  # GPUProfile._check
        raise InputError(f"invalid GPU profile {path}: {exc}") from None
    if profile.id != path.stem:
        raise InputError(
            f"invalid GPU profile {path}: id {profile.id!r} must equal the file name {path.stem!r}"
        )
    return profile.model_dump(mode="json")


def _load_file(path: Path) -> GPUProfile:
    try:  # through the validated-file cache (vramcalc/yamlio.py)
        data = yamlio.load_file(path, _validated_profile,
                                yamlio.code_key(__name__, "vramcalc.record"))
    except yamlio.YAMLError as exc:
        reason = " ".join(str(exc).split())
        raise InputError(f"malformed GPU profile {path}: {reason}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read GPU profile {path}: {exc}") from None
    return GPUProfile.from_dump(data)


def _profile_files(location: Path) -> list[Path]:
    if location.is_file():
        return [location]
    if not location.is_dir():
        raise InputError(f"GPU profile directory {location} does not exist")
    files = sorted(
        p for p in location.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file()
    )
    stems = [p.stem for p in files]
    for stem in stems:
        if stems.count(stem) > 1:
            raise InputError(
                f"GPU profile {stem!r} is defined twice in {location} (.yaml and .yml)"
            )
    return files


@functools.lru_cache(maxsize=32)
def _load_cached(
    dirs: tuple[Path, ...],
) -> tuple[dict[str, GPUProfile], dict[str, str]]:
    profiles: dict[str, GPUProfile] = {}
    origin: dict[str, Path] = {}
    for location in dirs:
        for path in _profile_files(location):
            profile = _load_file(path)
            profiles[profile.id] = profile  # later locations override earlier ones
            origin[profile.id] = path
    index: dict[str, str] = {}
    for pid in sorted(profiles):
        index[normalize_name(pid)] = pid
    for pid in sorted(profiles):
        for alias in profiles[pid].aliases:
            key = normalize_name(alias)
            other = index.get(key)
            if other is not None and other != pid:
                raise InputError(
                    f"GPU name {alias!r} in {origin[pid]} is already used by {other!r} ({origin[other]})"
                )
            index[key] = pid
    return profiles, index


def load_profiles(extra_dirs: list[Path] | None = None) -> dict[str, GPUProfile]:
    """All profiles by id (built-in, then $VRAMCALC_PROFILES, then `extra_dirs`).

    Raises InputError naming the file for malformed YAML, schema errors, a file stem that
    differs from its id, or an alias claimed by two profiles.
    """
    profiles, _ = _load_cached(tuple(profiles_dirs(extra_dirs)))
    return dict(profiles)


def resolve_gpu(name: str, extra_dirs: list[Path] | None = None) -> GPUProfile:
    """The profile whose id or alias matches `name` (case-insensitive; '-', ' ', '_' equal)."""
    profiles, index = _load_cached(tuple(profiles_dirs(extra_dirs)))
    key = normalize_name(name)
    if key in index:
        return profiles[index[key]]
    candidates = sorted(
        {pid for pid in profiles} | {a for p in profiles.values() for a in p.aliases}
    )
    by_key = {normalize_name(c): c for c in candidates}
    close = difflib.get_close_matches(key, list(by_key), n=3, cutoff=0.5)
    hint = (
        f"; did you mean: {', '.join(by_key[c] for c in close)}?"
        if close
        else "; run `vramcalc gpus` for the list"
    )
    raise InputError(f"unknown GPU {name!r}{hint}")


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
            f"bad GPU spec {text!r}: {what} {token!r} must be a positive whole number"
        )
    value = int(token)
    if value < 1 or value > MAX_COUNT:
        raise InputError(
            f"bad GPU spec {text!r}: {what} must be between 1 and {MAX_COUNT:,}, got {value}"
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
            f"bad GPU spec {text!r}: expected GPU, NxGPU or NODESxPER_NODExGPU"
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
        raise InputError(f"bad GPU spec {text!r}: missing GPU name (e.g. 8xH100)")
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
                f"bad GPU spec {text!r}: more than {MAX_COUNT:,} GPUs in total"
            )
        return Cluster.model_construct(gpu=gpu, num_nodes=num_nodes, gpus_per_node=count)
    per_node = gpu.gpus_per_node
    if count <= per_node:
        return Cluster.model_construct(gpu=gpu, num_nodes=1, gpus_per_node=count)
    if count % per_node:
        raise InputError(
            f"bad GPU spec {text!r}: {count} GPUs is not a multiple of {per_node} per {gpu.id} node; "
            f"write NODESxPER_NODExGPU, e.g. {-(-count // per_node)}x{per_node}x{gpu_name}"
        )
    return Cluster.model_construct(gpu=gpu, num_nodes=count // per_node, gpus_per_node=per_node)
