"""GPU profiles: shipped YAML files, name lookup, cluster strings, user profiles.

Golden figures come from ../shared/reference/hardware.yaml (each row cites the capture or
table the reference took it from), not from the profiles themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from vramcalc.errors import InputError
from vramcalc.hardware import (
    ENV_VAR,
    INDEX_FILE,
    Cluster,
    GPUProfile,
    alias_note,
    builtin_aliases,
    builtin_profiles_dir,
    load_profile_file,
    load_profiles,
    normalize_name,
    parse_gpus,
    profiles_dirs,
    resolve_gpu,
)

GiB = 2**30
BUILTIN = builtin_profiles_dir()
REQUIRED_IDS = {
    "h100_sxm", "h100_pcie", "h100_nvl", "h200", "b200", "a100_40gb", "a100_80gb",
    "a100_pcie_40gb", "a100_pcie_80gb", "a800", "h800", "h20", "l40s", "l4", "a10g",
    "rtx_4090", "rtx_5090", "rtx_3090", "rtx_a6000", "v100_16gb", "v100_32gb", "t4",
    "mi250x", "mi300x", "mi325x", "ascend_910b1", "ascend_910b2", "ascend_910b3",
    "ascend_910b4", "ascend_910c", "gaudi2", "gaudi3",
}  # fmt: skip


@pytest.fixture(autouse=True)
def _no_user_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)


def _profile_dict(profile_id: str = "my_gpu", **update: object) -> dict[str, object]:
    """A valid user profile (an H100 SXM copy under a new id) as plain data."""
    data = yaml.safe_load((BUILTIN / "h100_sxm.yaml").read_text())
    data.update(
        id=profile_id, name=f"Test GPU {profile_id}", aliases=[f"{profile_id}-alias"]
    )
    data.update(update)
    return data


def _write(directory: Path, stem: str, data: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


# ---------------------------------------------------------------- shipped profiles


def test_builtin_dir_is_repo_hardware_profiles() -> None:
    assert BUILTIN.is_dir()
    assert BUILTIN.name == "hardware_profiles"
    assert profiles_dirs()[0] == BUILTIN


def test_every_shipped_profile_parses_and_required_ids_present() -> None:
    profiles = load_profiles()
    stems = {p.stem for p in BUILTIN.glob("*.yaml") if p.name != INDEX_FILE}
    assert set(profiles) == stems
    assert REQUIRED_IDS <= set(profiles)


def test_index_matches_the_profiles() -> None:
    """The alias index (hardware_profiles/_index.yaml, written by scripts/catalog_index.py)
    says what each profile says: a GPU name resolves without reading every file."""
    assert builtin_aliases() == {pid: list(p.aliases) for pid, p in load_profiles().items()}


def test_resolving_a_name_reads_one_profile() -> None:
    load_profile_file.cache_clear()
    resolve_gpu("H100")
    assert load_profile_file.cache_info().currsize == 1


@pytest.mark.parametrize("path", sorted(p for p in BUILTIN.glob("*.yaml") if p.name != INDEX_FILE),
                         ids=lambda p: p.stem)
def test_shipped_profile_file(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    profile = GPUProfile.model_validate(data)
    assert profile.id == path.stem
    assert profile.sources and all(s.strip() for s in profile.sources)
    # usable bytes are a little under the label; HBM/GDDR labels are binary GiB in practice
    ratio = profile.memory_total_bytes / (profile.marketed_gb * GiB)
    assert 0.85 <= ratio <= 1.0, ratio
    assert 0 < profile.context_overhead_bytes < profile.memory_total_bytes
    assert profile.bf16_supported == ("bf16" in profile.dense_tflops)
    if profile.memory_api != "hpu":  # Gaudi NICs are on the die, not behind PCIe
        assert profile.inter_node_bytes_per_s <= profile.host_link_bytes_per_s
    assert 0 < profile.mfu_fraction <= 1
    assert profile.gpus_per_node >= 1


def test_names_are_unique_after_normalization() -> None:
    seen: dict[str, str] = {}
    for profile in load_profiles().values():
        for name in [profile.id, *profile.aliases]:
            key = normalize_name(name)
            assert seen.setdefault(key, profile.id) == profile.id, (name, seen[key])


# Runtime totals (torch.cuda.get_device_properties().total_memory / cudaDeviceProp.totalGlobalMem)
# as captured in the sources the reference cites.
@pytest.mark.parametrize(
    ("gpu_id", "total_bytes"),
    [
        # github:thamada/gls H100SXMx8_deviceQuery.py @e20f22d
        ("h100_sxm", 85_045_477_376),
        ("h100_nvl", 99_861_594_112),  # github:thamada/gls H100 NVL capture @e20f22d
        ("h200", 150_021_734_400),  # github:thamada/gls H200_deviceQuery.py @e20f22d
        # github:thamada/gls A100SXMx4_deviceQuery.py @e20f22d
        ("a100_80gb", 85_100_068_864),
        # bottlerocket capture, via reference a100_sxm4_40gb
        ("a100_40gb", 42_298_834_944),
        ("l40s", 47_803_596_800),  # github:thamada/gls L40S capture @e20f22d
        # github:thamada/gls RTX4090_deviceQuery.py @e20f22d
        ("rtx_4090", 25_386_352_640),
        # github:thamada/gls RTX3090_deviceQuery.py @e20f22d
        ("rtx_3090", 25_327_697_920),
        ("v100_16gb", 16_928_342_016),  # github:thamada/gls V100 capture @e20f22d
        # github:thamada/gls MI300X_deviceQuery.py (HIP) @e20f22d
        ("mi300x", 206_141_652_992),
    ],
)
def test_runtime_total_bytes_golden(gpu_id: str, total_bytes: int) -> None:
    assert load_profiles()[gpu_id].memory_total_bytes == total_bytes


def test_h100_runtime_total_is_smi_minus_reserve() -> None:
    # reference: nvidia-smi 81559 MiB total, 454 MiB driver reserve (gls nvidia-smi -q capture);
    # the reserve is printed rounded to a MiB, so the two agree to within 1 MiB.
    smi_minus_reserve = (81559 - 454) * 2**20
    assert abs(resolve_gpu("H100").memory_total_bytes - smi_minus_reserve) < 2**20


@pytest.mark.parametrize(
    ("gpu_id", "dtype", "tflops"),
    [
        # torchtitan get_peak_flops; datasheet 1979 sparse / 2
        ("h100_sxm", "bf16", 989),
        ("h100_sxm", "fp8", 1979),  # datasheet 3958 sparse / 2
        ("a100_80gb", "bf16", 312),  # A100 datasheet dense (624 sparse)
        ("a100_80gb", "fp8", None),  # no FP8 hardware on Ampere
        ("mi300x", "bf16", 1307.4),  # AMD datasheet dense
        # Huawei table in hicann/torchtitan-npu metrics.py
        ("ascend_910b2", "bf16", 353.89),
        ("v100_32gb", "bf16", None),  # Volta has no BF16
        ("t4", "fp16", 65),  # T4 FP16 tensor peak
    ],
)
def test_dense_tflops_golden(gpu_id: str, dtype: str, tflops: float | None) -> None:
    assert load_profiles()[gpu_id].peak_tflops(dtype) == tflops


def test_links_and_bandwidth_golden() -> None:
    h100 = resolve_gpu("h100_sxm")
    assert h100.memory_bandwidth_bytes_per_s == 3_350_000_000_000  # 3.35 TB/s datasheet
    # NVLink 4: 900 GB/s bidirectional
    assert h100.intra_node_bytes_per_s == 450_000_000_000
    assert h100.host_link_bytes_per_s == 64_000_000_000  # PCIe Gen5 x16 per direction
    # NVLink 3: 600 bidir
    assert resolve_gpu("a100_80gb").intra_node_bytes_per_s == 300_000_000_000
    # 400 GB/s bidirectional
    assert resolve_gpu("h800").intra_node_bytes_per_s == 200_000_000_000
    # NVLink 5: 1.8 TB/s bidir
    assert resolve_gpu("b200").intra_node_bytes_per_s == 900_000_000_000


def test_memory_api_and_bf16_flags() -> None:
    assert resolve_gpu("MI300X").memory_api == "rocm"
    assert resolve_gpu("910B").memory_api == "npu"
    assert resolve_gpu("Gaudi3").memory_api == "hpu"
    assert resolve_gpu("H100").memory_api == "cuda"
    assert not resolve_gpu("V100").bf16_supported
    assert not resolve_gpu("T4").bf16_supported
    assert resolve_gpu("4090").bf16_supported


# ---------------------------------------------------------------- name lookup


@pytest.mark.parametrize(
    ("name", "gpu_id"),
    [
        ("H100", "h100_sxm"),
        ("h100", "h100_sxm"),
        ("h100-sxm", "h100_sxm"),
        ("H100 SXM", "h100_sxm"),
        ("H100_SXM", "h100_sxm"),
        ("A100", "a100_80gb"),
        ("a100-80gb", "a100_80gb"),
        ("A100-40GB", "a100_40gb"),
        ("A100-PCIe", "a100_pcie_80gb"),
        ("4090", "rtx_4090"),
        ("RTX 4090", "rtx_4090"),
        ("rtx4090", "rtx_4090"),
        ("910B", "ascend_910b2"),
        ("910b", "ascend_910b2"),
        ("Ascend-910B", "ascend_910b2"),
        ("910B4", "ascend_910b4"),
        ("910C", "ascend_910c"),
        ("H200", "h200"),
        ("b200", "b200"),
        ("MI300X", "mi300x"),
        ("mi300x", "mi300x"),
        ("Gaudi3", "gaudi3"),
        ("gaudi-3", "gaudi3"),
        ("L40S", "l40s"),
        ("l40s", "l40s"),
        ("T4", "t4"),
        ("V100", "v100_32gb"),
        ("V100-16GB", "v100_16gb"),
        ("  H100  ", "h100_sxm"),
        ("A100-80G", "a100_80gb"),
        ("A100 40G", "a100_40gb"),
        ("A800-80G", "a800"),
        ("V100-16G", "v100_16gb"),
        ("A10G", "a10g"),
        ("NVIDIA A10G", "a10g"),
    ],
)
def test_resolve_gpu_aliases(name: str, gpu_id: str) -> None:
    assert resolve_gpu(name).id == gpu_id


def test_unknown_gpu_suggests_close_names() -> None:
    with pytest.raises(InputError) as info:
        resolve_gpu("H10")
    message = str(info.value)
    assert message.startswith("unknown GPU 'H10'; did you mean:")
    assert "H100" in message or "h100_sxm" in message
    assert "\n" not in message


def test_unknown_gpu_without_close_match() -> None:
    with pytest.raises(InputError, match=r"unknown GPU 'qqqqqqqqqqqqqq'"):
        resolve_gpu("qqqqqqqqqqqqqq")


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("A100", "A100-40GB"),
        ("a100", "NVIDIA A100 SXM4 80GB"),
        ("910B", "Huawei Ascend 910B2"),
        ("V100", "V100-16GB"),
        ("H100", "H100-PCIe"),
        ("8xA100", "A100-40GB"),
    ],
)
def test_alias_note_for_variant_choosing_names(name: str, fragment: str) -> None:
    note = alias_note(name, resolve_gpu(name.split("x")[-1]))
    assert note is not None and fragment in note


@pytest.mark.parametrize("name", ["A100-80GB", "a100_80gb", "H200", "910B2", "MI300X"])
def test_alias_note_none_for_explicit_names(name: str) -> None:
    assert alias_note(name, resolve_gpu(name)) is None


# ---------------------------------------------------------------- cluster strings


@pytest.mark.parametrize(
    ("text", "gpu_id", "num_nodes", "per_node"),
    [
        ("H100", "h100_sxm", 1, 1),
        ("8xH100", "h100_sxm", 1, 8),
        ("4xH100", "h100_sxm", 1, 4),
        ("8XH100", "h100_sxm", 1, 8),
        ("8*H100", "h100_sxm", 1, 8),
        ("8 x H100", "h100_sxm", 1, 8),
        ("16xH100", "h100_sxm", 2, 8),
        ("64x910B", "ascend_910b2", 8, 8),
        ("2x8xA100-80GB", "a100_80gb", 2, 8),
        ("2X8*a100-80gb", "a100_80gb", 2, 8),
        ("4x4090", "rtx_4090", 1, 4),
        ("2x4xrtx_4090", "rtx_4090", 2, 4),
        ("8xMI300X", "mi300x", 1, 8),
        ("32xgb200", "gb200", 8, 4),
        ("1x1xT4", "t4", 1, 1),
    ],
)
def test_parse_gpus(text: str, gpu_id: str, num_nodes: int, per_node: int) -> None:
    cluster = parse_gpus(text)
    assert isinstance(cluster, Cluster)
    assert (cluster.gpu.id, cluster.num_nodes, cluster.gpus_per_node) == (
        gpu_id,
        num_nodes,
        per_node,
    )
    assert cluster.num_gpus == num_nodes * per_node


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("12xH100", "not a multiple of 8"),
        ("0xH100", "between 1 and 1,000,000"),
        ("-1xH100", "positive whole number"),
        ("1.5xH100", "positive whole number"),
        ("2000000xH100", "between 1 and 1,000,000"),
        ("2x0xH100", "between 1 and 1,000,000"),
        ("1000x1001xH100", "more than 1,000,000 GPUs"),
        ("2x2x8xH100", "expected GPU, NxGPU or NODESxPER_NODExGPU"),
        ("8x", "missing GPU name"),
        ("", "missing GPU name"),
        ("8xH1000", "unknown GPU 'H1000'"),
    ],
)
def test_parse_gpus_errors(text: str, fragment: str) -> None:
    with pytest.raises(InputError) as info:
        parse_gpus(text)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_cluster_rejects_nonpositive_counts() -> None:
    with pytest.raises(ValueError):
        Cluster(gpu=resolve_gpu("H100"), num_nodes=0, gpus_per_node=8)


def test_profiles_are_frozen() -> None:
    profile = resolve_gpu("H100")
    with pytest.raises(ValidationError, match="frozen"):
        profile.gpus_per_node = 4  # type: ignore[misc]
    assert profile.gpus_per_node == 8


# ---------------------------------------------------------------- user profiles


def test_user_profile_via_extra_dirs(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "my_gpu",
        _profile_dict("my_gpu", memory_total_bytes=12 * GiB, marketed_gb=12),
    )
    profile = resolve_gpu("MY-GPU-ALIAS", extra_dirs=[tmp_path])
    assert profile.id == "my_gpu"
    assert profile.memory_total_bytes == 12 * GiB
    assert "my_gpu" in load_profiles(extra_dirs=[tmp_path])
    assert "my_gpu" not in load_profiles()
    assert parse_gpus("2x4xmy_gpu", extra_dirs=[tmp_path]).num_gpus == 8


def test_user_profile_via_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    _write(first, "gpu_a", _profile_dict("gpu_a"))
    _write(second, "gpu_b", _profile_dict("gpu_b"))
    monkeypatch.setenv(ENV_VAR, f"{first}{os.pathsep}{second}")
    assert profiles_dirs()[1:] == [first, second]
    assert {"gpu_a", "gpu_b"} <= set(load_profiles())
    assert resolve_gpu("gpu_b").id == "gpu_b"


def test_user_profile_file_path(tmp_path: Path) -> None:
    path = _write(tmp_path, "one_file", _profile_dict("one_file"))
    assert resolve_gpu("one_file", extra_dirs=[path]).id == "one_file"


def test_user_profile_overrides_builtin_id(tmp_path: Path) -> None:
    data = _profile_dict("h100_sxm", aliases=["H100"], price_usd_per_hour=9.99)
    _write(tmp_path, "h100_sxm", data)
    assert resolve_gpu("H100", extra_dirs=[tmp_path]).price_usd_per_hour == 9.99
    assert resolve_gpu("H100").price_usd_per_hour != 9.99


def test_malformed_yaml_via_extra_dirs_names_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "broken", "id: broken\nname: [unclosed\n")
    with pytest.raises(InputError) as info:
        load_profiles(extra_dirs=[tmp_path])
    assert str(path) in str(info.value)
    assert "GPU profile" in str(info.value) and "malformed YAML" in str(info.value)
    assert "\n" not in str(info.value)


def test_malformed_yaml_via_env_names_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path, "broken", "id: broken\n  bad: indentation: here\n")
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    with pytest.raises(InputError) as info:
        resolve_gpu("H100")
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("update", "fragment"),
    [
        ({"memory_totl_bytes": 1}, "memory_totl_bytes"),  # typo -> extra="forbid"
        ({"memory_total_bytes": "lots"}, "memory_total_bytes"),
        ({"sources": []}, "sources"),
        ({"memory_api": "opencl"}, "memory_api"),
        ({"dense_tflops": {"bf16": 1, "int4": 2}}, "int4"),
        ({"mfu_fraction": 1.5}, "mfu_fraction"),
        ({"context_overhead_bytes": 10**15}, "context_overhead_bytes"),
    ],
)
def test_schema_errors_name_file_and_field(
    tmp_path: Path, update: dict[str, object], fragment: str
) -> None:
    path = _write(tmp_path, "my_gpu", _profile_dict("my_gpu", **update))
    with pytest.raises(InputError) as info:
        load_profiles(extra_dirs=[tmp_path])
    message = str(info.value)
    assert str(path) in message and fragment in message
    assert "\n" not in message


def test_stem_must_equal_id(tmp_path: Path) -> None:
    path = _write(tmp_path, "other_name", _profile_dict("my_gpu"))
    with pytest.raises(InputError, match="must equal the file name") as info:
        load_profiles(extra_dirs=[tmp_path])
    assert str(path) in str(info.value)


def test_non_mapping_file(tmp_path: Path) -> None:
    _write(tmp_path, "listy", "- just\n- a list\n")
    with pytest.raises(InputError, match="expected a mapping"):
        load_profiles(extra_dirs=[tmp_path])


def test_alias_collision_between_profiles(tmp_path: Path) -> None:
    _write(tmp_path, "clash", _profile_dict("clash", aliases=["h100"]))
    with pytest.raises(InputError, match="'H100'|'h100'") as info:
        load_profiles(extra_dirs=[tmp_path])
    assert "already used by" in str(info.value) and "clash" in str(info.value)


def test_missing_profile_dir(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        load_profiles(extra_dirs=[tmp_path / "nope"])


def test_load_profiles_returns_a_copy() -> None:
    profiles = load_profiles()
    profiles.pop("h100_sxm")
    assert "h100_sxm" in load_profiles()


def test_hardware_module_does_not_import_torch() -> None:
    code = "import sys, vramcalc.hardware as h; h.parse_gpus('8xH100'); assert 'torch' not in sys.modules"
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )


@pytest.mark.parametrize(("gpu", "expected"), [
    # PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize: the default
    # CUBLAS_WORKSPACE_CONFIG is ":4096:8" on sm90 and newer, ":4096:2:16:8" before
    ("H100", 8 * 4 * 2**20),
    ("B200", 8 * 4 * 2**20),
    ("A100", 2 * 4 * 2**20 + 8 * 16 * 2**10),
    ("A100-40GB", 2 * 4 * 2**20 + 8 * 16 * 2**10),
    ("V100", 2 * 4 * 2**20 + 8 * 16 * 2**10),
    ("RTX4090", 2 * 4 * 2**20 + 8 * 16 * 2**10),
])
def test_cublas_workspace_comes_from_the_profile(gpu: str, expected: int) -> None:
    """The estimate's cuBLAS workspace is the GPU's, by compute capability (an A100 whose
    profile id ends in 'gb' is not a Hopper); a training step holds two, one per thread
    (CublasHandlePool.cpp keys them by (handle, stream), a handle per thread; autograd runs
    the backward on its own device thread)."""
    from vramcalc.analytic import estimate
    from vramcalc.options import build_scenario

    # fp16: V100 has no BF16 (bf16 + flash is refused there, tests/test_capability.py)
    report = estimate(build_scenario({"model": "gpt2", "gpus": f"1x{gpu}", "seq_len": 128,
                                      "precision": "fp16"}))
    assert report.subterms["transients/cublas_workspace"] == 2 * expected
