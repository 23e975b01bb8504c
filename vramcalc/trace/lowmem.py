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
- `apply_activation_offload(model, scn)`: torchtune's OffloadActivations (saved-tensor hooks,
  torchtune/training/_activation_offloading.py, single stream) on each transformer layer: a
  saved tensor of at least 1 KiB that is not a parameter (nor a view of one, such as the
  transposed weight a matmul keeps) is copied to pinned host memory, one copy per packed
  tensor (the trace marks the copy as host memory and drops the device reference); in
  backward each comes back to the device when its node runs and is released after it.

torch is imported only when a trace runs.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vramcalc.terms.linear_ce import applies as linear_ce
from vramcalc.terms.torchtune import shifts_logits
from vramcalc.trace.tune import (
    apply_recipe_loss,
    linear_cross_entropy,
    output_chunked_cross_entropy,
)

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
    """Make the model's loss the chunked cross entropy (reference: its `loss_head` hook,
    torchtune's own under the torchtune profile; hf: the causal LM's forward returns the
    loss of its decoder's hidden states)."""
    n = scn.training.chunked_ce
    # a ReferenceModel, or a transformers causal LM (or the PEFT model around one): duck-typed
    duck: Any = model
    if scn.training.framework == "torchtune":
        loss = linear_cross_entropy if linear_ce(scn.training) else output_chunked_cross_entropy
        duck.loss_head = lambda head, x, labels: loss(head, x, labels, n)
        return model
    if scn.training.framework != "hf":
        duck.loss_head = lambda head, x, labels: chunked_cross_entropy(head, x, labels, n)
        return model
    causal = duck.get_base_model() if hasattr(duck, "get_base_model") else duck
    decoder = causal.get_decoder()
    head = causal.get_output_embeddings()

    def forward(self: nn.Module, input_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kw: Any) -> Any:
        if labels is None:  # the trace always passes labels: the model returns its loss
            raise ValueError("the chunked cross entropy needs labels")
        hidden = decoder(input_ids=input_ids).last_hidden_state
        return types.SimpleNamespace(loss=chunked_cross_entropy(head, hidden, labels, n))

    causal.forward = types.MethodType(forward, causal)
    return model


class _LayerOffload:
    """Saved-tensor hooks for one layer; `store` is shared by all layers."""

    def __init__(self, index: int, store: _OffloadStore, params: set[int]) -> None:
        self.index, self.store, self.params = index, store, params

    def pack(self, t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        if st._cdata in self.params or st.nbytes() < MIN_OFFLOAD_BYTES:
            return t  # parameters (and views of them, e.g. a weight's transpose) stay
        return self.store.offload(self.index, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        return self.store.fetch(packed)


class _OffloadStore:
    """Host copies of saved tensors (torchtune's single-stream OffloadActivations: one copy
    per packed tensor, brought back to the device when its node needs it in backward and
    released when that node is done). Only the copies' shapes are kept: their bytes are host
    memory, which the trace does not count."""

    def __init__(self) -> None:
        self.host: dict[int, tuple[Any, Any, Any, Any]] = {}
        self.next_id = 0

    def offload(self, layer: int, t: torch.Tensor) -> int:
        key = self.next_id
        self.next_id += 1
        self.host[key] = (t.size(), t.stride(), t.dtype, t.device)
        return key

    def fetch(self, key: int) -> torch.Tensor:
        size, stride, dtype, device = self.host.pop(key)
        return torch.empty_strided(size, stride, dtype=dtype, device=device)


def _offload_model_forward(model: nn.Module, store: _OffloadStore, params: set[int]) -> None:
    """torchtune's recipes with activation checkpointing (recipes/*_single_device.py
    `with self.activations_handling_ctx: logits = self._model(**batch)`): the hooks wrap the
    model's forward from outside every checkpoint, so each checkpoint's saved inputs go to
    the host and the layers' own tensors to the checkpoint (recomputed in backward, outside
    the hooks); `get_act_offloading_ctx_manager` turns them off inside the output projection,
    and the loss runs after the context: here the hooks end when the head first runs."""
    hooks = _LayerOffload(0, store, params)
    duck: Any = model
    head = duck.lm_head
    ctx: list[Any] = []

    def enter(*_: Any) -> None:
        ctx.append(torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack))
        ctx[-1].__enter__()

    def leave(*_: Any) -> None:
        if ctx:
            ctx.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    head.register_forward_pre_hook(leave)
    model.register_forward_hook(leave)


def apply_activation_offload(model: nn.Module, scn: Any) -> nn.Module:
    """Wrap each transformer layer's forward in offloading saved-tensor hooks (torchtune's
    recipes with checkpointing: the whole model's forward, `_offload_model_forward`)."""
    # a ReferenceModel, or a transformers causal LM (or the PEFT model around one): duck-typed
    duck: Any = model
    if scn.training.framework == "torchtune" and scn.training.recompute == "full":
        store = _OffloadStore()
        duck._vramcalc_offload = store
        _offload_model_forward(model, store,
                               {p.untyped_storage()._cdata for p in model.parameters()})
        return model
    causal = duck.get_base_model() if hasattr(duck, "get_base_model") else duck
    layers = causal.get_decoder().layers if scn.training.framework == "hf" else causal.layers
    store = _OffloadStore()
    duck._vramcalc_offload = store
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    for i, layer in enumerate(layers):
        hooks = _LayerOffload(i, store, params)
        original = layer.forward

        def forward(*args: Any, _orig: Any = original, _hooks: Any = hooks, **kw: Any) -> Any:
            with torch.autograd.graph.saved_tensors_hooks(_hooks.pack, _hooks.unpack):
                return _orig(*args, **kw)

        layer.forward = forward
    return model


def apply_memory_options(model: nn.Module, scn: Any) -> nn.Module:
    """Chunked cross entropy and activation offload, when the scenario asks for them."""
    if shifts_logits(scn.training):
        model = apply_recipe_loss(model, scn)
    if scn.training.chunked_ce > 1:
        model = apply_chunked_ce(model, scn)
    if scn.training.activation_offload:
        model = apply_activation_offload(model, scn)
    return model
