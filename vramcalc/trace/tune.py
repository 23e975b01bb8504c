"""torchtune on the traced reference model (its layer is the model's `tune_rope` form,
vramcalc/trace/reference_model.py): the recipe's loss and what the trace does not run.

- `output_chunked_cross_entropy(head, x, labels, n)`: `chunked_output` and
  CEWithChunkedOutputLoss (pytorch/torchtune 1814feb), the profile's `--chunked-ce n`
  up to release 0.6.1; `linear_cross_entropy`: LinearCrossEntropyLoss, its main branch's
  (`--torchtune-version 0.7`).
- `apply_recipe_loss(model, scn)`: the recipes before 0.3 (vramcalc/terms/torchtune.py): the
  loop's `logits` holds the shifted fp32 copy of the logits from the loss until the next
  micro-batch's output exists (or, lora_finetune_distributed from 0.2.0, only through the
  loss), and the loss runs over the transposed copy.
- `check_tune(scn)`: compiled layers and loss, packed batches are the analytic engine's.

torch is imported only when a trace runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vramcalc.errors import InputError
from vramcalc.scenario import Scenario
from vramcalc.terms.torchtune import deletes_logits


def check_tune(scn: Scenario) -> None:
    """What the torchtune trace (the reference model with torchtune's layer, and the losses
    below) does not run: compiled layers and loss (their saved
    sets are the partitioner's, vramcalc/terms/torchtune.py), packed batches (any profile's
    trace: the option is torchtune's)."""
    tr = scn.training
    if tr.framework != "torchtune":
        return
    if tr.compile:
        raise InputError("--compile with --framework torchtune: the compiled layers and loss "
                         "are estimated by the analytic engine (their saved sets are the "
                         "partitioner's, vramcalc/terms/torchtune.py)")
    if tr.packed:  # torchtune's own option (stack_rules.py)
        raise InputError("--packed: the traces build unpacked batches (no input_pos or "
                         "document mask); packed sequences are estimated by the analytic "
                         "engine (vramcalc/terms/packed.py)")


def output_chunked_cross_entropy(head: nn.Module, x: torch.Tensor, labels: torch.Tensor,
                                 num_chunks: int) -> torch.Tensor:
    """torchtune's `chunked_output` and CEWithChunkedOutputLoss (1814feb, the torchtune
    profile's loss, vramcalc/terms/torchtune.py): every chunk's logits made first and alive
    until the recipe's `del logits`, each chunk upcast and reduced in turn, the sum divided
    by the count of labels."""
    logits = [head(c) for c in x.chunk(num_chunks, dim=1)]  # (b, ⌈s/n⌉, V) each, in c
    total = (labels != -100).sum()
    targets = [y.reshape(-1) for y in labels.chunk(num_chunks, dim=1)]
    loss: Any = 0.0
    for chunk, y in zip(logits, targets, strict=True):
        loss = loss + F.cross_entropy(chunk.reshape(-1, chunk.shape[-1]).float(), y,
                                      reduction="sum")
    del logits
    return loss / total


def linear_cross_entropy(head: nn.Module, x: torch.Tensor, labels: torch.Tensor,
                         num_chunks: int) -> torch.Tensor:
    """torchtune main's LinearCrossEntropyLoss (`--torchtune-version 0.7`,
    vramcalc/terms/linear_ce.py): the final norm's output flattened, its labelled rows
    selected (a copy, and the int64 indices its backward keeps; every row here, as a traced
    batch has no ignored label: `torch.where` would be data-dependent under FakeTensorMode),
    split into `num_chunks` row ranges, each projected, upcast and summed in turn."""
    targets = labels.reshape(-1)
    rows = torch.arange(targets.numel(), device=targets.device)
    hidden = x.reshape(-1, x.shape[-1]).index_select(0, rows)
    targets = targets.index_select(0, rows)
    total: Any = 0.0
    for h_chunk, y_chunk in zip(hidden.tensor_split(num_chunks, dim=0),
                                targets.tensor_split(num_chunks, dim=0), strict=True):
        logits = head(h_chunk)  # compute_cross_entropy's local: alive through the loss
        total = total + F.cross_entropy(logits.float(), y_chunk, reduction="sum")
        del logits
    return total / targets.numel()


def apply_recipe_loss(model: nn.Module, scn: Any) -> nn.Module:
    """The reference model's loss as torchtune's recipes before 0.3 compute it (module
    docstring; their `train`): `self.output(h).float()`, then in the loop `logits =
    logits[..., :-1, :].contiguous()`, `labels[..., 1:].contiguous()`, the transpose and
    torch.nn.CrossEntropyLoss over (b, V, s - 1)."""
    loop: dict[str, torch.Tensor] = {}  # the recipe's loop variables, alive between calls
    delete = deletes_logits(scn.training, scn.parallel.dp_degree)

    def loss_head(head: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loop["logits"] = head(x).float()  # the previous micro-batch's copy goes now
        loop["logits"] = loop["logits"][..., :-1, :].contiguous()
        loop["labels"] = labels[..., 1:].contiguous()
        loss = F.cross_entropy(loop["logits"].transpose(1, 2), loop["labels"])
        if delete:
            del loop["logits"]
        return loss

    duck: Any = model
    duck.loss_head = loss_head
    return model
