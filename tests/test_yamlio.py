"""The YAML parse cache (vramcalc/yamlio.py): a hit returns what a fresh parse returns, a
changed file is parsed again, bad caches and uncacheable data fall back to parsing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vramcalc import yamlio


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("VRAMCALC_CACHE_DIR", str(root))
    monkeypatch.setattr(yamlio, "_CACHES", {})
    return root


def _parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = yamlio.safe_load

    def counting(text: str) -> object:
        calls.append(text)
        return real(text)

    monkeypatch.setattr(yamlio, "safe_load", counting)
    return calls


def test_hit_equals_fresh_parse_and_skips_parsing(cache: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "gpu.yaml"
    f.write_text("id: gpu\nsizes: [1, 2.5, 3]\nnested: {a: true, b: null}\n")
    fresh = yamlio.safe_load(f.read_text())
    assert yamlio.load_file(f) == fresh
    assert list(cache.iterdir())  # written
    monkeypatch.setattr(yamlio, "_CACHES", {})  # a new process
    calls = _parses(monkeypatch)
    data = yamlio.load_file(f)
    assert data == fresh and calls == []
    data["id"] = "mutated"  # callers get fresh objects
    assert yamlio.load_file(f)["id"] == "gpu"


def test_changed_file_is_parsed_again(cache: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "gpu.yaml"
    f.write_text("value: 1\n")
    assert yamlio.load_file(f) == {"value": 1}
    f.write_text("value: 22\n")
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    monkeypatch.setattr(yamlio, "_CACHES", {})
    assert yamlio.load_file(f) == {"value": 22}


def test_uncacheable_data_is_not_cached(cache: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "dates.yaml"
    f.write_text("released: 2024-03-18\n8: eight\n")
    first = yamlio.load_file(f)
    monkeypatch.setattr(yamlio, "_CACHES", {})
    calls = _parses(monkeypatch)
    assert yamlio.load_file(f) == first and len(calls) == 1


def test_corrupt_cache_is_ignored(cache: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "gpu.yaml"
    f.write_text("value: 1\n")
    yamlio.load_file(f)
    for c in cache.iterdir():
        c.write_text("{not json")
    monkeypatch.setattr(yamlio, "_CACHES", {})
    assert yamlio.load_file(f) == {"value": 1}
    for c in cache.iterdir():  # rewritten whole
        assert json.loads(c.read_text())["version"] == yamlio._CACHE_VERSION


def test_malformed_yaml_raises_and_disabled_cache_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMCALC_CACHE_DIR", "off")
    monkeypatch.setattr(yamlio, "_CACHES", {})
    f = tmp_path / "bad.yaml"
    f.write_text("a: [1, 2\n")
    with pytest.raises(yamlio.YAMLError):
        yamlio.load_file(f)
    g = tmp_path / "good.yaml"
    g.write_text("a: 1\n")
    assert yamlio.load_file(g) == {"a": 1}
    assert yamlio.cache_dir() is None


def test_cli_resolves_through_the_cache_with_the_same_result(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vramcalc import catalog, hardware

    fresh_gpu = hardware._load_file(hardware.builtin_profiles_dir() / "h100_sxm.yaml") if (
        hardware.builtin_profiles_dir() / "h100_sxm.yaml").exists() else None
    monkeypatch.setattr(yamlio, "_CACHES", {})
    hardware._load_cached.cache_clear()
    catalog._presets.cache_clear()
    catalog._index.cache_clear()
    try:
        first = (hardware.load_profiles(), catalog.list_preset_entries())
        monkeypatch.setattr(yamlio, "_CACHES", {})
        hardware._load_cached.cache_clear()
        catalog._presets.cache_clear()
        catalog._index.cache_clear()
        calls = _parses(monkeypatch)
        second = (hardware.load_profiles(), catalog.list_preset_entries())
        assert calls == []
        assert first == second
        if fresh_gpu is not None:
            assert second[0][fresh_gpu.id] == fresh_gpu
    finally:
        hardware._load_cached.cache_clear()
        catalog._presets.cache_clear()
        catalog._index.cache_clear()
