"""TRL SFTTrainer's `loss_type="chunked_nll"` (`--trl-chunked-ce`), restated for the trace:
huggingface/trl f2cd5771 (1.10.0.dev0) trl/trainer/sft_trainer.py `_patch_chunked_ce_lm_head`,
`_chunked_cross_entropy_loss` and `_chunk`, the default loss from TRL 1.7.

The patched forward runs the decoder to its final norm (`base_model`, no lm_head), then:
shift by one position, pack the valid labels to the front (`argsort` of the mask, a gather
of the hidden rows), and run chunks of 256 rows through `_chunk` under non-reentrant
`torch.utils.checkpoint`: `h.float() @ w.float().t()`, log_softmax, nll_loss (summed), the
argmax for the accuracy metric and the entropy sum. The trace's labels are random token ids,
so every label is valid: the two data-dependent steps (`n_valid == 0`, the chunk count from
`n_valid`) are decided in Python with that count; the tensors TRL makes for them are made
too. The returned metrics die with the model output before backward, as in SFTTrainer's
compute_loss. Analytic twin: vramcalc/terms/trl_loss.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

CHUNK_ROWS = 256  # sft_trainer.py _CHUNKED_LM_HEAD_CHUNK_SIZE


def _chunk(h: torch.Tensor, w: torch.Tensor, lbl: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logits = h.float() @ w.float().t()
    log_p = F.log_softmax(logits, dim=-1)
    chunk_loss = F.nll_loss(log_p, lbl, ignore_index=-100, reduction="sum")
    valid = lbl != -100
    chunk_correct = ((logits.argmax(dim=-1) == lbl) & valid).sum().float()
    chunk_entropy = (-(log_p.exp() * log_p).sum(dim=-1) * valid).sum()
    return chunk_loss, chunk_correct, chunk_entropy


def _chunked_loss(hidden_states: torch.Tensor, weight: torch.Tensor,
                  labels: torch.Tensor) -> torch.Tensor:
    hidden = hidden_states[..., :-1, :].reshape(-1, hidden_states.size(-1))
    labels = labels[..., 1:].reshape(-1)
    valid = labels != -100
    n_valid = valid.sum()
    correct = hidden.new_zeros((), dtype=torch.float32)
    entropy_sum = hidden.new_zeros((), dtype=torch.float32)
    _ = n_valid == 0  # TRL's empty-batch test; every label is valid here
    order = valid.to(torch.int8).argsort(descending=True, stable=True)
    hidden = hidden[order]
    labels = labels[order]
    _ = (n_valid / CHUNK_ROWS).ceil().to(torch.int64) * CHUNK_ROWS  # TRL's n_padded
    n_padded = -(-hidden.shape[0] // CHUNK_ROWS) * CHUNK_ROWS
    loss = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, n_padded, CHUNK_ROWS):
        chunk_loss, chunk_correct, chunk_entropy = torch.utils.checkpoint.checkpoint(
            _chunk, hidden[start:start + CHUNK_ROWS], weight, labels[start:start + CHUNK_ROWS],
            use_reentrant=False)
        loss = loss + chunk_loss
        correct = correct + chunk_correct
        entropy_sum = entropy_sum + chunk_entropy
    return loss / n_valid


def trl_chunked_loss(model: Any, ids: torch.Tensor, labels: torch.Tensor,
                     tracker: Any = None) -> torch.Tensor:
    """The loss SFTTrainer's patched forward returns (PEFT: patched on the inner model). The
    tracker's "logits" region runs from the final norm's output to the moment its gradient
    is ready, as around an lm_head (vramcalc/trace/engine.py `watch_logits`)."""
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden_states = target.base_model(input_ids=ids, use_cache=False).last_hidden_state
    if tracker is None:  # a probe on a real device
        return _chunked_loss(hidden_states, target.get_output_embeddings().weight, labels)
    tracker.region = "logits"
    if hidden_states.requires_grad:
        hidden_states.register_hook(lambda _grad: setattr(tracker, "region", None))
    loss = _chunked_loss(hidden_states, target.get_output_embeddings().weight, labels)
    tracker.region = None
    return loss
