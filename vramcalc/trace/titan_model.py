"""torchtitan's Llama and its activation checkpointing, for the trace engine (torchtitan
profile), written from torchtitan 9dec370ad26b5f8e9a7333a0e36165018262644b (Dec 2024):

- torchtitan/models/llama/model.py: `Transformer` (tok_embeddings -> blocks -> norm ->
  output, returning the logits), `TransformerBlock.forward` (h = x + attention(norm(x));
  out = h + feed_forward(ffn_norm(h))), `Attention.forward` (wq, wk, wv; view to heads;
  `apply_rotary_emb` on complex numbers in fp32 with the complex64 `freqs_cis` buffer,
  then `type_as`; `repeat_kv` (expand + reshape: a copy when n_rep > 1); transposes;
  `F.scaled_dot_product_attention(is_causal=True)`; transpose().contiguous(); wo),
  `FeedForward.forward` (w2(silu(w1 x) * w3 x)), the buffer `freqs_cis` of
  `precompute_freqs_cis(head_dim, max_seq_len)` (train.py sets max_seq_len = seq_len);
- torchtitan/models/norms.py `RMSNorm.forward`: `self._norm(x.float()).type_as(x) *
  self.weight`, `_norm(x) = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`
  (norm_type "rmsnorm" of train_configs/llama3_8b.toml);
- train.py `loss_fn`: `cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))`,
  with `pred` alive until `del pred` before `loss.backward()`;
- torchtitan/parallelisms/parallelize_llama.py `_apply_ac_to_transformer_block`:
  mode "full": `ptd_checkpoint_wrapper(module, preserve_rng_state=False)` (non-reentrant
  torch.utils.checkpoint); mode "selective" with selective_ac_option "op": the same with
  `context_fn` = `create_selective_checkpoint_contexts(policy)`, the policy saving the
  outputs of the ops in `_save_list` (aten.mm, SDPA efficient / flash attention,
  _c10d_functional.reduce_scatter_tensor, aten.abs, aten.max) except every second mm of
  the block (a per-call counter of mm ops, forward and recompute counted apart), and
  PREFER_RECOMPUTE for everything else; an int option N checkpoints whole every block
  whose 1-based build index is divisible by N (`ptd_checkpoint_wrapper._count`).

This module is vramcalc's own code, not torchtitan's; parameter shapes follow
`vramcalc.model.param_tensors` for the Llama architecture (so the parameter count is the
spec's). On the CPU, SDPA runs `_scaled_dot_product_flash_attention_for_cpu`; the policy
treats it as the CUDA flash op it stands for (an H100 runs flash for bf16, the
memory-efficient kernel for fp32: both are in torchtitan's save list).

torch is imported at module import: only the trace engine imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from vramcalc.model import ModelSpec

aten = torch.ops.aten
ROPE_THETA = 10_000.0  # ModelArgs.rope_theta default (the value changes no memory)
NORM_EPS = 1e-5  # ModelArgs.norm_eps

# torchtitan's `_save_list` (parallelize_llama.py), plus the CPU flash kernel the trace runs
# where CUDA runs `_scaled_dot_product_flash_attention`
SAVE_LIST = frozenset({
    aten.mm.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    aten.abs.default,
    aten.max.default,
})


def op_sac_policy() -> Callable[..., CheckpointPolicy]:
    """torchtitan's per-op SAC policy for one checkpointed call: save the outputs of the
    ops in SAVE_LIST, except every second aten.mm (counted per call, forward and recompute
    apart, so both passes pick the same mms), recompute the rest."""
    mm_count = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            mm_count[mode] += 1
        save = func in SAVE_LIST and not (func == aten.mm.default and mm_count[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_sac_context() -> Any:
    return create_selective_checkpoint_contexts(op_sac_policy())


def checkpoint_modes(num_layers: int, recompute: str, every: int | None) -> list[str]:
    """Each block's checkpointing ("none", "full" or "op"), bottom first: torchtitan's
    `apply_ac` over the blocks in build order. Per-layer SAC wraps block i (0-based) when
    (i + 1) % N == 0 (`_count` is incremented before the test; N = 0 would wrap all)."""
    if recompute == "full":
        return ["full"] * num_layers
    if recompute != "selective":
        return ["none"] * num_layers
    if every is None:
        return ["op"] * num_layers
    return ["full" if (i + 1) % every == 0 else "none" for i in range(num_layers)]


class RMSNorm(nn.Module):
    def __init__(self, width: int, **kw: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # (b, s, h) fp32 copy (x itself when x is fp32)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return normed.type_as(x) * self.weight


def freqs_cis(d: int, seq_len: int, device: torch.device | str | None) -> torch.Tensor:
    """precompute_freqs_cis(head_dim, max_seq_len): (max_seq_len, d/2) complex64."""
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, d, 2, device=device)[: d // 2].float() / d)
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv)
    return torch.polar(torch.ones_like(freqs), freqs)


def rotary(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, s, heads, d) q and k rotated as complex pairs in fp32, back in their dtype."""
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis[0:xq.shape[1]].view(1, xq.shape[1], 1, q.shape[-1])  # (1, s, 1, d/2)
    return (torch.view_as_real(q * f).flatten(3).type_as(xq),
            torch.view_as_real(k * f).flatten(3).type_as(xk))


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(b, s, g, d) -> (b, s, g·n_rep, d): expand + reshape, a copy when n_rep > 1."""
    if n_rep == 1:
        return x
    b, s, g, d = x.shape
    return x[:, :, :, None, :].expand(b, s, g, n_rep, d).reshape(b, s, g * n_rep, d)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, **kw: Any) -> None:
        super().__init__()
        h, a, g, d = spec.hidden_size, spec.num_attention_heads, spec.kv_heads, spec.head_size
        self.n_rep, self.d = a // g, d
        self.wq = nn.Linear(h, a * d, bias=False, **kw)
        self.wk = nn.Linear(h, g * d, bias=False, **kw)
        self.wv = nn.Linear(h, g * d, bias=False, **kw)
        self.wo = nn.Linear(a * d, h, bias=False, **kw)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        xq = self.wq(x).view(b, s, -1, self.d)  # (b, s, a, d)
        xk = self.wk(x).view(b, s, -1, self.d)  # (b, s, g, d)
        xv = self.wv(x).view(b, s, -1, self.d)  # (b, s, g, d)
        xq, xk = rotary(xq, xk, freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)  # (b, s, a, d)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2),
                                             values.transpose(1, 2), is_causal=True)
        out = out.transpose(1, 2).contiguous().view(b, s, -1)  # (b, s, a·d)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec, **kw: Any) -> None:
        super().__init__()
        h, f = spec.hidden_size, spec.intermediate_size
        self.w1 = nn.Linear(h, f, bias=False, **kw)
        self.w2 = nn.Linear(f, h, bias=False, **kw)
        self.w3 = nn.Linear(h, f, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, spec: ModelSpec, ac: str, **kw: Any) -> None:
        super().__init__()
        self.attention = Attention(spec, **kw)
        self.feed_forward = FeedForward(spec, **kw)
        self.attention_norm = RMSNorm(spec.hidden_size, **kw)
        self.ffn_norm = RMSNorm(spec.hidden_size, **kw)
        self.ac = ac

    def block(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        if self.ac == "none":
            return self.block(x, freqs_cis)
        extra: dict[str, Any] = {"context_fn": _op_sac_context} if self.ac == "op" else {}
        return checkpoint(self.block, x, freqs_cis, use_reentrant=False,
                          preserve_rng_state=False, **extra)


class TitanLlama(nn.Module):
    """torchtitan's Transformer: `forward(ids)` returns the logits (`titan_loss` below)."""

    def __init__(self, spec: ModelSpec, seq_len: int, recompute: str = "none",
                 every: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        h, V, d = spec.hidden_size, spec.vocab_size, spec.head_size
        self.tok_embeddings = nn.Embedding(V, h, **kw)
        modes = checkpoint_modes(spec.num_hidden_layers, recompute, every)
        self.layers = nn.ModuleList(TransformerBlock(spec, m, **kw) for m in modes)
        self.norm = RMSNorm(h, **kw)
        self.output = nn.Linear(h, V, bias=False, **kw)
        self.register_buffer("freqs_cis", freqs_cis(d, seq_len, device), persistent=True)

    @property
    def lm_head(self) -> nn.Module:
        """The output projection (the trace engine labels its output as logits)."""
        return self.output

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (b, s, h)
        for layer in self.layers:
            h = layer(h, self.freqs_cis)
        h = self.norm(h)  # the last block's output is dropped here, as torchtitan rebinds h
        return self.output(h)  # (b, s, V) logits


def titan_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """train.py's step: `pred = model(input_ids)`, then `loss_fn(pred, labels)` outside the
    model (after FSDP2's root post-forward), `pred` alive until `del pred`."""
    pred = model(tokens)  # (b, s, V)
    loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
    del pred
    return loss
