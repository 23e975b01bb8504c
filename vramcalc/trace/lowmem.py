"""Chunked cross entropy and activation offloading on the traced models (the analytic side is
vramcalc/terms/lowmem.py).

- `chunked_cross_entropy(head, x, labels, n)`: torchtune's LinearCrossEntropyLoss in eager
  mode (torchtune/modules/loss/cross_entropy_loss.py): the final hidden states (b, s, h) are
  split into n chunks along the sequence (`tensor_split`); each chunk is projected by the
  output layer, upcast to fp32 and reduced by `F.cross_entropy(..., reduction="sum")`; the
  sum is divided by the number of tokens. Each chunk's log-softmax output (fp32) is kept for
  backward, but the fp32 upcast and the gradient buffers of the loss exist one chunk at a
  time. Labels are the next tokens, aligned with the positions (as the reference model and
  torchtune's recipes pass them).
- `offload_layers(layers, tracker)`: torchtune's OffloadActivations (saved-tensor hooks) on
  each transformer layer: a saved tensor of at least 1 KiB that is not a parameter is
  copied to pinned host memory (the trace marks the copy as host memory and drops the
  device reference); in backward the first access to any tensor of a layer brings the
  whole layer back (one layer in flight), freed when the next layer's first tensor comes
  back.

torch is imported only when a trace runs.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MIN_OFFLOAD_BYTES = 1024  # torchtune OffloadActivations(min_offload_size=1024)


def chunked_cross_entropy(head: nn.Module, x: torch.Tensor, labels: torch.Tensor,
                          num_chunks: int) -> torch.Tensor:
    """Mean next-token cross entropy over `num_chunks` sequence chunks (module docstring)."""
    total = None
    for h_chunk, y_chunk in zip(x.tensor_split(num_chunks, dim=1),
                                labels.tensor_split(num_chunks, dim=1), strict=True):
        logits = head(h_chunk)  # (b, s/n, V) in the compute dtype, freed after the upcast
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               y_chunk.reshape(-1), reduction="sum")
        del logits
        total = loss if total is None else total + loss
    assert total is not None
    return total / labels.numel()


def apply_chunked_ce(model: nn.Module, scn: Any) -> nn.Module:
    """Make the model's loss the chunked cross entropy (reference: its `loss_head` hook;
    hf: the causal LM's forward returns the loss of its decoder's hidden states)."""
    n = scn.training.chunked_ce
    if scn.training.framework != "hf":
        model.loss_head = lambda head, x, labels: chunked_cross_entropy(head, x, labels, n)
        return model
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = causal.get_decoder()
    head = causal.get_output_embeddings()

    def forward(self: nn.Module, input_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kw: Any) -> Any:
        hidden = decoder(input_ids=input_ids).last_hidden_state
        return types.SimpleNamespace(loss=chunked_cross_entropy(head, hidden, labels, n))

    causal.forward = types.MethodType(forward, causal)
    return model


class _LayerOffload:
    """Saved-tensor hooks for one layer; `store` is shared by all layers."""

    def __init__(self, index: int, store: _OffloadStore) -> None:
        self.index, self.store = index, store

    def pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or t.untyped_storage().nbytes() < MIN_OFFLOAD_BYTES:
            return t
        return self.store.offload(self.index, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        return self.store.fetch(packed)


class _OffloadStore:
    """Host copies of saved tensors, and the one layer brought back in backward: the first
    access to a layer's tensors materializes all of them on the device; each leaves the
    store when its node takes it (alive while that node runs), so the layer's device copies
    shrink as its backward proceeds and are gone when it ends."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.host: dict[int, dict[int, torch.Tensor]] = {}
        self.device: dict[int, torch.Tensor] = {}
        self.device_layer: int | None = None
        self.next_id = 0

    def offload(self, layer: int, t: torch.Tensor) -> tuple[int, int]:
        host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
        if self.tracker is not None:
            self.tracker.set_host(host)
        key = self.next_id
        self.next_id += 1
        self.host.setdefault(layer, {})[key] = host
        return layer, key

    def host_bytes(self) -> int:
        return sum(h.untyped_storage().nbytes() for d in self.host.values() for h in d.values())

    def fetch(self, packed: tuple[int, int]) -> torch.Tensor:
        layer, key = packed
        if self.device_layer != layer:
            self.device = {}
            self.device_layer = layer
            for k, host in self.host.pop(layer, {}).items():
                self.device[k] = torch.empty_strided(host.size(), host.stride(),
                                                     dtype=host.dtype, device=host.device)
        return self.device.pop(key)


def _active_tracker() -> Any:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from vramcalc.trace.tracker import MemoryTracker

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, MemoryTracker):
            return mode
    return None


def apply_activation_offload(model: nn.Module, scn: Any) -> nn.Module:
    """Wrap each transformer layer's forward in offloading saved-tensor hooks."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = causal.get_decoder().layers if scn.training.framework == "hf" else causal.layers
    store = _OffloadStore(_active_tracker())
    model._vramcalc_offload = store  # type: ignore[attr-defined]
    for i, layer in enumerate(layers):
        hooks = _LayerOffload(i, store)
        original = layer.forward

        def forward(*args: Any, _orig: Any = original, _hooks: Any = hooks, **kw: Any) -> Any:
            with torch.autograd.graph.saved_tensors_hooks(_hooks.pack, _hooks.unpack):
                return _orig(*args, **kw)

        layer.forward = forward
    return model


def apply_memory_options(model: nn.Module, scn: Any) -> nn.Module:
    """Chunked cross entropy and activation offload, when the scenario asks for them."""
    if scn.training.chunked_ce > 1:
        model = apply_chunked_ce(model, scn)
    if scn.training.activation_offload:
        model = apply_activation_offload(model, scn)
    return model
