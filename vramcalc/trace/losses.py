"""The loss one micro-batch computes, as each stack calls it (the trace and the probes run
it on the model vramcalc/trace/engine.py builds)."""

from __future__ import annotations

from typing import Any


def step_loss(model: Any, tr: Any, ids: Any, labels: Any, tracker: Any = None) -> Any:
    """The scalar loss of one micro-batch (`tr`: a vramcalc.training.TrainingConfig;
    `tracker`: the trace's MemoryTracker, None on a real device)."""
    if tr.trl_chunked_ce:  # TRL SFTTrainer's chunked_nll (vramcalc/trace/trl.py)
        from vramcalc.trace.trl import trl_chunked_loss

        return trl_chunked_loss(model, ids, labels, tracker)
    if tr.framework == "hf":
        # the output object (and its logits) is dropped at once, as Trainer.compute_loss does
        return model(input_ids=ids, labels=labels).loss
    if tr.framework == "torchtitan":  # the loss runs outside the model (train.py)
        from vramcalc.trace.titan_model import titan_loss

        return titan_loss(model, ids, labels)
    return model(ids, labels)
