"""The optional training features a TrainingConfig turns on: one predicate each.

Every module that treats a feature differently asks these, so what "on" means is written
once: a parameter-efficient method (LoRA, QLoRA, DoRA: vramcalc/finetune.py), low
precision (FP8 linears or quantization-aware training: vramcalc/terms/lowprec.py),
activation offload (vramcalc/terms/lowmem.py; nothing to offload under full recompute)
and chunked cross entropy (vramcalc/terms/lowmem.py).
"""

from __future__ import annotations

from vramcalc.training import TrainingConfig


def finetunes(training: TrainingConfig) -> bool:
    """A parameter-efficient method: the base is frozen, adapters are trained."""
    return training.finetune != "full"


def low_precision(training: TrainingConfig) -> bool:
    """FP8 linears (Transformer Engine) or quantization-aware training."""
    return training.precision == "fp8" or training.qat != "none"


def offloads_activations(training: TrainingConfig) -> bool:
    """The layers' saved tensors wait in pinned host memory (torchtune OffloadActivations);
    under full recompute (the torchtune profile only: vramcalc/stack_rules.py) torch's
    non-reentrant checkpoint saves each layer's input with `ctx.save_for_backward`
    (torch/utils/checkpoint.py `_NoopSaveInputs`), which the recipe's offloading hooks
    around the model's forward move to the host, with the final norm's tensors."""
    return training.activation_offload and (training.recompute != "full"
                                            or training.framework == "torchtune")


def chunks_loss(training: TrainingConfig) -> bool:
    """Cross entropy over token chunks (torchtune's chunked loss)."""
    return training.chunked_ce > 1
