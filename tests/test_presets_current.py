"""Current presets (Llama 3.2/3.3, Gemma 2/3, Qwen3 dense and MoE, Mistral Small/NeMo, Phi-4):
each count against its model card's rounded figure and, where one is published, the exact
count. Every preset is also built by transformers on the meta device and its numel compared
(tests/test_catalog.py::test_preset_matches_transformers).

Exact counts, each from outside vramcalc:
- keras-team/keras-hub presets `params` (keras_hub/src/models/{gemma,gemma3,qwen3}/*_presets.py
  @02aeee5 / @1df65da): gemma2-2b, gemma2-27b, gemma3-1b, qwen3-0.6b/4b/14b/32b;
- the safetensors / GGUF `general.parameter_count` totals of the Hugging Face checkpoints:
  Llama-3.2-1B 1,235,814,400, Llama-3.2-3B 3,212,749,824, Llama-3.3-70B 70,553,706,496,
  Qwen3-30B-A3B 30,532,122,624, phi-4 14,659,507,200, Mistral-Nemo 12,247,782,400,
  Mistral-Small-24B 23,572,403,200.
"""

from __future__ import annotations

import pytest

from vramcalc.catalog import get_preset, resolve_model

# (preset, exact count or None, card total in billions, card active in billions or None)
# The card figures: the "Number of Parameters" / model-size line of each model card on
# huggingface.co/<hf_repo> (the preset's hf_repo).
CARDS = [
    ("llama3.2-1b", 1_235_814_400, 1.23, None),  # Llama 3.2 card: "1.23B"
    ("llama3.2-3b", 3_212_749_824, 3.21, None),  # Llama 3.2 card: "3.21B"
    ("llama3.3-70b", 70_553_706_496, 70, None),  # Llama 3.3 card: "70B"
    ("gemma2-2b", 2_614_341_888, 2.6, None),  # Gemma 2 report table 1: 2.6B (keras-hub)
    ("gemma2-27b", 27_227_128_320, 27, None),  # Gemma 2 card: 27B (keras-hub)
    ("gemma3-1b", 999_885_952, 1, None),  # Gemma 3 card: 1B (keras-hub)
    ("gemma3-27b", None, 27, None),  # Gemma 3 card: 27B (text decoder 27.0B + vision 0.4B)
    ("qwen3-0.6b", 596_049_920, 0.6, None),  # Qwen3-0.6B card: 0.6B
    ("qwen3-4b", 4_022_468_096, 4.0, None),  # Qwen3-4B card: 4.0B
    ("qwen3-14b", 14_768_307_200, 14.8, None),  # Qwen3-14B card: 14.8B
    ("qwen3-32b", 32_762_123_264, 32.8, None),  # Qwen3-32B card: 32.8B
    ("qwen3-30b-a3b", 30_532_122_624, 30.5, 3.3),  # card: 30.5B total, 3.3B activated
    ("qwen3-235b-a22b", None, 235, 22),  # card: 235B total, 22B activated
    ("mistral-nemo-12b", 12_247_782_400, 12, None),  # card: 12B
    ("mistral-small-24b", 23_572_403_200, 24, None),  # card: 24B
    ("phi4", 14_659_507_200, 14, None),  # Phi-4 card: 14B
]


def _rounds_to(count: int, billions: float) -> bool:
    """`count` is the card's figure as cards state one: rounded or truncated to a size label
    (Phi-4's 14.66B is "14B", Llama 3.3's 70.55B is "70B"), so within 5 %."""
    return abs(count / 1e9 - billions) <= 0.05 * billions


@pytest.mark.parametrize(("name", "exact", "card", "active"), CARDS)
def test_count_matches_the_model_card(name: str, exact: int | None, card: float,
                                      active: float | None) -> None:
    spec = get_preset(name).spec
    if exact is not None:
        assert spec.num_params == exact
    assert _rounds_to(spec.num_params, card), (name, spec.num_params)
    if active is not None:
        assert _rounds_to(spec.num_active_params, active), (name, spec.num_active_params)


@pytest.mark.parametrize(("text", "name"), [
    ("meta-llama/Llama-3.2-1B-Instruct", "llama3.2-1b"),
    ("meta-llama/Llama-3.3-70B-Instruct", "llama3.3-70b"),
    ("google/gemma-3-27b-it", "gemma3-27b"),
    ("google/gemma-2-2b", "gemma2-2b"),
    ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"),
    ("Qwen/Qwen3-0.6B-Base", "qwen3-0.6b"),
    ("mistralai/Mistral-Small-24B-Instruct-2501", "mistral-small-24b"),
    ("mistralai/Mistral-Nemo-Instruct-2407", "mistral-nemo-12b"),
    ("microsoft/phi-4", "phi4"),
    ("phi-4", "phi4"),
])
def test_hub_ids_find_the_presets(text: str, name: str) -> None:
    assert resolve_model(text)[0].name == name


def test_qwen3_moe_experts() -> None:
    spec = get_preset("qwen3-235b-a22b").spec
    assert (spec.num_local_experts, spec.num_experts_per_tok, spec.expert_ffn) == (128, 8, 1536)
