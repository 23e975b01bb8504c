"""The modifiers of a rank: the training features that change what its layers save and
hold, as explicit objects (vramcalc.terms.saved.Modifier), in the order their hooks run.

| modifier              | on when                                   | module |
|-----------------------|-------------------------------------------|--------|
| `FinetuneActivations` | LoRA / QLoRA / DoRA                       | vramcalc/terms/finetune_modifier.py    |
| `LowPrecision`        | FP8 linears or QAT                        | vramcalc/terms/lowprec.py |
| `ActivationOffload`   | activation offload without full recompute | vramcalc/terms/lowmem.py |
| `ChunkedLoss`         | chunked cross entropy                     | vramcalc/terms/lowmem.py |
| `DeepSpeedCheckpointing` | DeepSpeed partition_activations / cpu_checkpointing with full recompute | vramcalc/terms/ds_checkpointing.py |
| `UnslothCheckpointing` | unsloth profile, full recompute (offloaded checkpoints) | vramcalc/terms/unsloth.py |
| `UnslothLoraKernels` | unsloth profile, dense gated MLP | vramcalc/terms/unsloth.py |
| `UnslothDequantBuffer` | unsloth profile, QLoRA | vramcalc/terms/unsloth.py |
| `PackedBatch` | torchtune profile, packed sequences | vramcalc/terms/packed.py |
| `LigerKernels` | hf profile, `--liger` | vramcalc/terms/liger.py |
| `TrlChunkedLoss` | hf profile, `--trl-chunked-ce` | vramcalc/terms/trl_loss.py |

(vramcalc.features has the predicates.) Fine-tuning adjusts a layer's saved list before low
precision does, and activation offload sees the backward moments both have adjusted.
"""

from __future__ import annotations

from vramcalc.hardware import GPUProfile
from vramcalc.rank import RankContext
from vramcalc.terms.ds_checkpointing import DeepSpeedCheckpointing
from vramcalc.terms.finetune_modifier import FinetuneActivations
from vramcalc.terms.liger import LigerKernels
from vramcalc.terms.lowmem import ActivationOffload, ChunkedLoss
from vramcalc.terms.lowprec import LowPrecision
from vramcalc.terms.packed import PackedBatch
from vramcalc.terms.saved import Modifier
from vramcalc.terms.trl_loss import TrlChunkedLoss
from vramcalc.terms.unsloth import (
    UnslothCheckpointing,
    UnslothDequantBuffer,
    UnslothLoraKernels,
)

MODIFIERS: tuple[Modifier, ...] = (FinetuneActivations(), LowPrecision(), ActivationOffload(),
                                   ChunkedLoss(), DeepSpeedCheckpointing(),
                                   UnslothLoraKernels(), UnslothCheckpointing(),
                                   UnslothDequantBuffer(), PackedBatch(), LigerKernels(),
                                   TrlChunkedLoss())


def modifiers(ctx: RankContext) -> tuple[Modifier, ...]:
    """The modifiers that apply to this rank, in hook order (memoised on the context)."""
    cached = ctx.__dict__.get("_modifiers")
    if cached is None:
        cached = ctx.__dict__["_modifiers"] = tuple(m for m in MODIFIERS if m.applies(ctx))
    return cached


def persistent_parts(ctx: RankContext, gpu: GPUProfile | None) -> dict[str, int]:
    """Report sub-terms the rank's modifiers hold for the whole step (FP8 weight cache and
    scaling state, QAT qparams; empty without a modifier that has any)."""
    out: dict[str, int] = {}
    for m in modifiers(ctx):
        out.update(m.persistent_parts(ctx, gpu))
    return out
