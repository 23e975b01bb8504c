"""Hugging Face Hub ids: config.json only, from a cache folder laid out as the Hub's, offline.

The cache layout is huggingface_hub's (models--org--name/snapshots/<revision>/config.json, with
refs/main holding the revision); the config is Qwen/Qwen2.5-7B-Instruct's (the keys that
shape parameters), whose count is Qwen2.5-7B's: 7,615,616,512 (safetensors total on
huggingface.co/Qwen/Qwen2.5-7B-Instruct, as tests/test_catalog.py cites for the base model).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramcalc.catalog import resolve_model
from vramcalc.cli import main
from vramcalc.errors import InputError
from vramcalc.hub import looks_like_hub_id

pytest.importorskip("huggingface_hub")

QWEN25_7B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "model_type": "qwen2",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "vocab_size": 152064,
    # remote code a config may name: never imported or run
    "auto_map": {"AutoModelForCausalLM": "evil.Model"},
}  # fmt: skip
REVISION = "a09a35458c702b33eeacc393d103063234e8bc28"


def lay_out(cache: Path, repo_id: str, cfg: dict) -> Path:
    org, name = repo_id.split("/")
    repo = cache / f"models--{org}--{name}"
    snap = repo / "snapshots" / REVISION
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(cfg))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snap / "config.json"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


def test_reads_config_json_from_the_cache(cache: Path) -> None:
    path = lay_out(cache, "Qwen/Qwen2.5-7B-Instruct-1M", QWEN25_7B_INSTRUCT)
    spec, note = resolve_model("Qwen/Qwen2.5-7B-Instruct-1M")
    assert spec.num_params == 7_615_616_512
    assert spec.name == "Qwen/Qwen2.5-7B-Instruct-1M" and str(path) in spec.source
    assert note is not None and "Hugging Face" in note


def test_offline_without_the_file_is_one_clear_error(cache: Path) -> None:
    with pytest.raises(InputError, match="HF_HUB_OFFLINE") as info:
        resolve_model("someorg/not-cached-model")
    assert "\n" not in str(info.value)


def test_a_preset_id_needs_no_hub(cache: Path) -> None:
    spec, _ = resolve_model("Qwen/Qwen2.5-7B")
    assert spec.name == "qwen2.5-7b"


def test_hf_home_is_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lay_out(tmp_path / "home" / "hub", "acme/tiny-llm", QWEN25_7B_INSTRUCT)
    assert resolve_model("acme/tiny-llm")[0].num_params == 7_615_616_512


def test_download_uses_hf_token(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not cached and online: huggingface_hub's download is called for config.json alone,
    with HF_TOKEN (replaced here: no network in tests)."""
    import huggingface_hub

    calls = []

    def fake_download(repo_id: str, filename: str, **kw: object) -> str:
        calls.append((repo_id, filename, kw.get("token")))
        return str(lay_out(cache, repo_id, QWEN25_7B_INSTRUCT))

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata",
                        lambda url, token=None: calls.append((url, token)))
    spec, _ = resolve_model("acme/gated-llm")
    assert calls == [
        ("https://huggingface.co/acme/gated-llm/resolve/main/config.json", "hf_test_token"),
        ("acme/gated-llm", "config.json", "hf_test_token")]
    assert spec.num_params == 7_615_616_512


@pytest.mark.parametrize("text,hub", [("Qwen/Qwen2.5-7B", True), ("a/b/c", False),
                                      ("../x", False), ("org/..", False), ("x", False)])
def test_hub_id_shape(text: str, hub: bool) -> None:
    assert looks_like_hub_id(text) is hub


def test_cli_estimate_with_a_hub_id(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lay_out(cache, "acme/qwen-like", QWEN25_7B_INSTRUCT)
    assert main(["estimate", "--model", "acme/qwen-like", "--gpus", "1xH100", "--json"]) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["num_params"] == 7_615_616_512
    assert main(["estimate", "--model", "acme/missing", "--gpus", "1xH100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "HF_HUB_OFFLINE" in err


def test_without_huggingface_hub_says_what_to_install(cache: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(InputError, match=r"pip install 'llm-vramcalc\[hub\]'"):
        resolve_model("acme/anything")
