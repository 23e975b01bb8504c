"""The planner's options, as `vramcalc plan` and `vramcalc.plan()` take them: option values
-> (base Scenario, PlanRequest, notes).

Layout options given (dp, tp, zero, recompute, ...) pin the search; training settings stay
fixed unless `allow` names them. Bad values raise InputError with a one-line message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vramcalc.errors import InputError, suggest
from vramcalc.hardware import MIN_MFU, parse_gpus
from vramcalc.options import (
    OPTIONS_BY_NAME,
    build_scenario,
    check_bounds,
    normalize_values,
    parse_stage_layers,
)
from vramcalc.planner.layouts import SPLIT_KEYS, finetune_supported, mla_note
from vramcalc.planner.request import DEFAULT_FINETUNE_BATCH, PlanRequest, recomputes_of
from vramcalc.scenario import Scenario
from vramcalc.units import parse_count

# Layout options the planner searches; a value given on the command line pins it.
SEARCHED_OPTIONS: tuple[str, ...] = (
    "dp", "tp", "pp", "cp", "ep", "sequence_parallel", "zero", "fsdp", "shard_group",
    "offload", "pp_schedule", "virtual_stages", "num_microbatches", "micro_batch_size",
    "grad_accum", "recompute",
)
# Training settings held fixed unless --allow names them.
ALLOWABLE: tuple[str, ...] = ("precision", "optimizer", "offload", "finetune")
# The plan and size default --headroom (estimate's default is 0).
DEFAULT_HEADROOM = 0.05


def parse_allow(text: str | None) -> tuple[frozenset[str], list[str]]:
    """--allow words (validated) and notes for words not supported yet."""
    if not text:
        return frozenset(), []
    words = {w.strip().lower() for w in text.split(",") if w.strip()}
    notes = []
    for w in sorted(words):
        if w not in ALLOWABLE:
            raise InputError(f"--allow: unknown setting {w!r}{suggest(w, ALLOWABLE)} "
                             f"(choices: {', '.join(ALLOWABLE)})")
    if "finetune" in words and not finetune_supported():
        words.discard("finetune")
        notes.append("--allow finetune: fine-tuning methods (LoRA/QLoRA) are not supported by "
                     "the memory engine yet; ignored")
    return frozenset(words), notes


def parse_mfu(mfu: float | None) -> float | None:
    """--mfu, a fraction between MIN_MFU and 1, or None."""
    if mfu is None:
        return None
    if not MIN_MFU <= mfu <= 1:  # also false for NaN
        raise InputError(f"--mfu must be a fraction between {MIN_MFU} and 1, got {mfu}")
    return mfu


def parse_batch(size: int | None, tokens: str | None) -> tuple[int | None, int | None]:
    """(--global-batch-size, --global-batch-tokens as a count); at most one of them."""
    if size is not None and tokens is not None:
        raise InputError("give either --global-batch-size or --global-batch-tokens, not both")
    if size is not None and not 1 <= size <= 10**9:
        raise InputError(f"--global-batch-size must be between 1 and 10^9, got {size}")
    return size, (parse_count(tokens) if tokens is not None else None)


def prepare_plan(values: dict[str, Any], global_batch_size: int | None = None,
                 global_batch_tokens: str | None = None, allow: str | None = None,
                 top: int = 5, mfu: float | None = None, profile_dirs: list[Path] | None = None,
                 deepspeed: Any = None, finetune_given: bool | None = None,
                 ) -> tuple[Scenario, PlanRequest, list[str]]:
    """Option values → (base Scenario, PlanRequest, notes). Layout options given pin it.

    A fine-tuning job (a LoRA/QLoRA/DoRA method, or --finetune given at all:
    `finetune_given`, by default whether `values` names it) gets a fine-tuning global batch
    when none is given (request.py DEFAULT_FINETUNE_BATCH), and a note says which."""
    if finetune_given is None:
        finetune_given = values.get("finetune") is not None
    values = {k: v for k, v in values.items() if v is not None}
    for key in values:
        if key not in OPTIONS_BY_NAME:
            raise InputError(f"unknown option {key!r}{suggest(key, list(OPTIONS_BY_NAME))}")
    searched = {k: values.pop(k) for k in SEARCHED_OPTIONS if k in values}
    if values.get("kbit_prepare") or values.get("use_reentrant") is not None:
        # HF gradient checkpointing's options exist only with full recompute: pinned to it
        searched.setdefault("recompute", "full")
        values["recompute"] = searched["recompute"]
    norm = normalize_values(searched)
    pinned = {k: norm[k] for k in searched}
    check_bounds(pinned)  # a pinned value obeys estimate's bounds (the rest: the search)
    if "offload" in pinned:
        pinned["offload"] = tuple(pinned["offload"])
    values.setdefault("headroom", DEFAULT_HEADROOM)
    if values.get("framework") == "torchtitan":
        # the base layout only has to be one torchtitan runs (its bf16 compute needs FSDP2);
        # the search varies the sharding anyway
        values["fsdp"] = "full"
    if values.get("framework") == "torchtune" and values.get("optimizer_in_backward"):
        gpus = parse_gpus(str(values.get("gpus", "")), profile_dirs).num_gpus
        if gpus > 1:  # full_finetune_single_device: one GPU, unsharded
            raise InputError(f"--optimizer-in-backward runs on one GPU (torchtune's "
                             f"full_finetune_single_device); got {gpus} GPUs")
    elif values.get("framework") == "torchtune":
        values["fsdp"] = "full"  # the same: torchtune's data parallelism is FSDP2's
    # --async-tp is refused at tp 1 (the base layout): set it after, so that the search's
    # layout check (vramcalc.stack_rules.torchtitan_layout_problem) keeps only tp > 1 layouts
    async_tp = values.pop("async_tp", False) and values.get("framework") == "torchtitan"
    # an uneven pipeline split needs pp > 1, which the base layout (pp 1) does not have: it
    # joins the base after, and the search keeps it on every layout (layouts.py SPLIT_KEYS)
    split = {k: values.pop(k) for k in SPLIT_KEYS if values.get(k)}
    if "stage_layers" in split:
        split["stage_layers"] = parse_stage_layers(split["stage_layers"])
    base = build_scenario(values, profile_dirs, deepspeed)
    if split:
        base = base.model_copy(update={"parallel": base.parallel.model_copy(update=split)})
    if async_tp:
        tr = type(base.training).model_validate({**base.training.model_dump(), "async_tp": True})
        base = base.model_copy(update={"training": tr})
    if base.training.load_only:
        raise InputError("--load-only is a reading right after loading, not a training "
                         "layout to plan: use vramcalc estimate")
    if pinned.get("recompute") not in (None, *recomputes_of(base.training.framework)):
        raise InputError(f"--recompute {pinned['recompute']}: the {base.training.framework} "
                         "profile runs none or full (torchtune checkpoints whole layers)")
    assert base.cluster is not None
    allowed, notes = parse_allow(allow)
    size, tokens = parse_batch(global_batch_size, global_batch_tokens)
    if base.training.optimizer_in_backward and size is None and tokens is None:
        raise InputError("--optimizer-in-backward: give --global-batch-size (one GPU and no "
                         "gradient accumulation: the global batch is the micro-batch)")
    if not 1 <= top <= 1000:
        raise InputError(f"--top must be between 1 and 1000, got {top}")
    # torchtune's recipes (full_finetune_*, lora_*) and Unsloth fine-tune a trained model:
    # every run of those profiles is a fine-tuning job, full fine-tuning included
    finetuning = (finetune_given or base.training.finetune != "full"
                  or base.training.framework in ("torchtune", "unsloth"))
    req = PlanRequest(global_batch_size=size, global_batch_tokens=tokens, top_n=top,
                      allow=allowed, pinned=pinned, efficiency=parse_mfu(mfu),
                      finetuning=finetuning)
    if finetuning and size is None and tokens is None:
        notes.append(f"fine-tuning: a global batch of {DEFAULT_FINETUNE_BATCH} sequences "
                     "(Stanford Alpaca's fine-tuning recipe), not a pretraining batch of "
                     "millions of tokens; --global-batch-size N to change it")
    if (held := mla_note(base)) is not None:
        notes.append(held)
    if tokens is not None:
        seq = base.training.seq_len
        batch = req.batch_for(seq)
        if batch * seq != tokens:
            notes.append(f"global batch of {tokens:,} tokens is {tokens / seq:,.1f} sequences "
                         f"of {seq}: using {batch:,} ({batch * seq:,} tokens), a count data "
                         "parallelism splits evenly; --global-batch-size N sets it exactly")
    return base, req, notes
