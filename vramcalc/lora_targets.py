"""LoRA target names: what `--lora-targets` accepts and its canonical form."""

from __future__ import annotations

from vramcalc.errors import InputError, suggest

# LoRA target names: q, k, v, o projections and the MLP's gate, up (fc), down (proj)
TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
ALL_LINEAR = "all-linear"
# PEFT's default targets for Llama, Mistral, Qwen2 (and Mixtral): q_proj and v_proj
# (peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, peft 0.21.2).
DEFAULT_TARGETS = "q,v"
_TARGET_ALIASES = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "out_proj": "o",
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down", "fc": "up", "c_fc": "up",
    "fc1": "up", "w1": "gate", "w3": "up", "w2": "down", "proj": "down", "fc2": "down",
    "all_linear": ALL_LINEAR, "all": ALL_LINEAR,
}


def parse_targets(value: object) -> str:
    """'q,v', 'Q_PROJ, v_proj', ['q', 'v'] or 'all-linear' -> canonical 'q,v' / 'all-linear'.

    Unknown names raise InputError with suggestions."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    names: set[str] = set()
    for raw in items:
        word = str(raw).strip().lower().replace(" ", "")
        if not word:
            continue
        word = _TARGET_ALIASES.get(word, word)
        if word == ALL_LINEAR:
            return ALL_LINEAR
        if word not in TARGETS:
            choices = list(TARGETS) + [ALL_LINEAR] + list(_TARGET_ALIASES)
            raise InputError(f"--lora-targets: unknown target {raw!r}{suggest(word, choices)} "
                             f"(choices: {', '.join(TARGETS)} or {ALL_LINEAR})")
        names.add(word)
    if not names:
        raise InputError(f"--lora-targets: give at least one of {', '.join(TARGETS)} or "
                         f"{ALL_LINEAR}")
    return ",".join(t for t in TARGETS if t in names)
