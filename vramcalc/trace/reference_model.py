"""vramcalc's reference decoder-only transformer, built from a ModelSpec.

This is the model the `reference` framework profile describes: the trace engine runs it
under FakeTensorMode and docs/saved-tensors.md lists, per layer, every tensor it keeps for
backward. Parameter names and shapes follow `vramcalc.model.param_tensors`, so
`sum(p.numel() for p in model.parameters()) == spec.num_params`.

Two block styles, chosen by the spec's fields:
- Llama-style: RMSNorm, rotary positions, grouped-query attention (g <= a kv heads),
  SwiGLU MLP, optional q/k/v and o biases, optional per-head q/k RMSNorm (Qwen3), and
  mixture-of-experts layers (router + top-k experts + optional shared experts);
- GPT-2-style: LayerNorm with bias, learned positions, 2-matrix GELU MLP, biases, tied head;
- parallel blocks (`parallel_residual`: phi, GPT-J, GPT-NeoX): x + attn(norm(x)) + mlp(norm'(x)),
  one norm shared by both branches when num_layer_norms is 1.

Attention `flash` calls F.scaled_dot_product_attention (a fused kernel: it keeps q, k, v,
its output and the fp32 logsumexp); `eager` writes softmax(QKᵀ/√d)V out, keeping the
(b, a, s, s) probabilities. Recompute `full` checkpoints every layer, `selective` only the
attention core (torch.utils.checkpoint, use_reentrant=False). The forward returns the loss
(cross entropy on next-token labels, computed in fp32) so the training loop holds no logits.

Legend: b batch, s sequence, h hidden, a heads, g kv heads, d head dim, f FFN size,
V vocab, P max positions, E experts, k experts per token, N = b·s tokens,
C = ⌈capacity_factor · N·k / E⌉ expert capacity.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vramcalc.errors import InputError, shown
from vramcalc.model import ModelSpec
from vramcalc.trace.titan_model import RMSNorm as PlainRMSNorm
from vramcalc.trace.titan_model import freqs_cis, repeat_kv, rotary

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypedDict

    from typing_extensions import Unpack

    class Factory(TypedDict):
        """torch's factory keywords, passed down to every parameter the model builds."""

        dtype: torch.dtype | None
        device: torch.device | str | None

    LossHead = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

ROPE_THETA = 10_000.0  # rotary base (Su et al. 2021); it changes values, not memory
NORM_EPS = 1e-5


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls run in: the autocast dtype when autocast is on, else x's dtype."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


@torch.library.custom_op("vramcalc::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[
        torch.Tensor, torch.Tensor]:
    """RMSNorm as one kernel: (weight · x / rms(x), rstd (..., 1) fp32).

    On CUDA this is aten's fused kernel; elsewhere the same math in plain ops. As a custom
    op its fake kernel allocates exactly the two outputs, as the fused kernel does (aten's
    fake implementation would decompose and allocate fp32 temporaries)."""
    if x.is_cuda:
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        return y, rstd
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32
    return (xf * rstd).to(x.dtype) * weight, rstd


@rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(x, dtype=torch.result_type(x, weight))
    return out, x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("vramcalc::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d x, d weight) of `rms_norm_op`; fused on CUDA, plain ops elsewhere."""
    if x.is_cuda:
        dx, dw = torch.ops.aten._fused_rms_norm_backward(
            grad, x, [x.shape[-1]], rstd, weight, [True, True])
        return dx, dw
    xhat = x.float() * rstd
    gw = grad.float() * weight.float()
    dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    dw = (grad.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@rms_norm_backward_op.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, weight, _eps = inputs
    ctx.save_for_backward(x, weight, output[1])  # input + fp32 rstd, as fused kernels keep


def _rms_backward(ctx, grad, _grad_rstd):  # noqa: ANN001, ANN202
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(grad, x, weight, rstd)
    return dx, dw, None


rms_norm_op.register_autograd(_rms_backward, setup_context=_rms_setup)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = NORM_EPS, **kw: Unpack[Factory]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, **kw))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            # mixed dtypes only under autocast (16-bit q/k into qk_norm); CUDA autocast runs
            # rms_norm in fp32, so the saved input is the fp32 copy
            x = x.to(self.weight.dtype)
        return rms_norm_op(x, self.weight, self.eps)[0]


def make_norm(spec: ModelSpec, width: int, tune: bool = False,
              **kw: Unpack[Factory]) -> nn.Module:
    """The spec's norm; `tune`: torchtune's RMSNorm in plain ops (its fp32 copy and x̂ kept)."""
    if spec.norm_kind == "layernorm":
        return nn.LayerNorm(width, eps=NORM_EPS, bias=spec.norm_bias, **kw)
    return PlainRMSNorm(width, **kw) if tune else RMSNorm(width, **kw)


def activation(name: str):  # noqa: ANN201
    """The spec's hidden_act as a function (each saves its input, relu its output)."""
    if name in ("silu", "swish"):
        return F.silu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "relu":
        return F.relu
    if name == "relu2":  # transformers ReLUSquaredActivation, Megatron-LM squared_relu
        return lambda x: torch.square(F.relu(x))
    raise InputError(f"trace: unsupported hidden_act {shown(name)} (supported: silu, swish, "
                     "gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, gelu_python_tanh, relu, "
                     "relu2)")


class TuneRope(nn.Module):
    """A torchtune RoPE module's buffers, fp32: `theta` (d/2) and `cache` (positions, width)
    with each position's (cos, sin) pairs of its d/2 angles first (width d: Llama's whole
    cache; width 2d: Qwen2's and Phi-3's, whose cache holds each angle twice)."""

    def __init__(self, d: int, positions: int, width: int,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.rotated = d // 2  # the complex pairs a head rotates
        pairs = torch.view_as_real(freqs_cis(d, positions, device)).flatten(1)  # (P, d)
        theta = 1.0 / ROPE_THETA ** (torch.arange(0, d, 2, device=device)[: d // 2].float() / d)
        cache = pairs if width == d else torch.cat([pairs, torch.zeros_like(pairs)], dim=1)
        self.register_buffer("theta", theta, persistent=False)
        self.register_buffer("cache", cache, persistent=False)

    def table(self) -> torch.Tensor:
        """The cache as a (P, d/2) complex64 view of its (cos, sin) pairs."""
        cache = self.get_buffer("cache")
        return torch.view_as_complex(cache.view(cache.shape[0], -1, 2))[:, :self.rotated]


def rope_tables(s: int, d: int, device: torch.device, dtype: torch.dtype):  # noqa: ANN201
    """cos, sin: (s, 1, d) rotary tables in the compute dtype, built once per forward."""
    inv = 1.0 / ROPE_THETA ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(s, device=device, dtype=torch.float32), inv)  # (s, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (s, 1, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, s, heads, d) -> same; keeps only cos/sin for backward (shared by all layers)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, attention: str, recompute: str, tune: bool = False,
                 rope: TuneRope | None = None, **kw: Unpack[Factory]) -> None:
        super().__init__()
        self.tune = tune  # torchtune's: complex-pair RoPE in fp32, k and v repeated to a heads
        self.pos_embeddings = rope  # torchtune's RoPE module (its own or one shared by all)
        h, a, g, d = spec.hidden_size, spec.num_attention_heads, spec.kv_heads, spec.head_size
        self.a, self.g, self.d = a, g, d
        self.q_proj = nn.Linear(h, a * d, bias=spec.attention_bias, **kw)
        self.k_proj = nn.Linear(h, g * d, bias=spec.attention_bias, **kw)
        self.v_proj = nn.Linear(h, g * d, bias=spec.attention_bias, **kw)
        self.o_proj = nn.Linear(a * d, h, bias=spec.attention_out_bias, **kw)
        # torchtune's q/k norms are its RMSNorm (Qwen3: torchtune/models/qwen3
        # _component_builders.py), run after RoPE (torchtune/modules/attention.py)
        self.q_norm = make_norm(spec, d, tune, **kw) if spec.qk_norm else None
        self.k_norm = make_norm(spec, d, tune, **kw) if spec.qk_norm else None
        self.attention = attention
        self.selective = recompute == "selective"

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(q kᵀ/√d) v: q (b, a, s, d), k and v (b, g, s, d) -> (b, a, s, d)."""
        if self.attention == "flash":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=k.shape[1] != q.shape[1])
        if self.g != self.a:  # eager attention needs k and v for every head: (b, a, s, d)
            k = k.repeat_interleave(self.a // self.g, dim=1)
            v = v.repeat_interleave(self.a // self.g, dim=1)
        if mask is None:  # the model builds the causal mask whenever attention is eager
            raise ValueError("eager attention needs the causal mask")
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.d))  # (b, a, s, s)
        att = att.masked_fill(mask, float("-inf"))  # mask: (s, s) bool, True above diagonal
        att = F.softmax(att, dim=-1)  # (b, a, s, s): saved by softmax and by att @ v
        return att @ v  # (b, a, s, d)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.a, self.d)  # (b, s, a, d)
        k = self.k_proj(x).view(b, s, self.g, self.d)  # (b, s, g, d)
        v = self.v_proj(x).view(b, s, self.g, self.d)  # (b, s, g, d)
        if self.q_norm is not None and self.k_norm is not None and not self.tune:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.tune:  # torchtune's layer (vramcalc/terms/torchtune.py): torchtitan's ops
            if self.pos_embeddings is not None:  # the cache's complex view (None: learned)
                q, k = rotary(q, k, self.pos_embeddings.table())
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            k, v = repeat_kv(k, self.a // self.g), repeat_kv(v, self.a // self.g)
        elif rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, heads, s, d)
        if self.selective:
            y = checkpoint(self.core, q, k, v, mask, use_reentrant=False,
                           preserve_rng_state=False)
        else:
            y = self.core(q, k, v, mask)
        y = y.transpose(1, 2).reshape(b, s, self.a * self.d)  # (b, s, a·d)
        return self.o_proj(y)  # (b, s, h)


class MLAttention(Attention):
    """Multi-latent attention (DeepSeek-V2/V3; shapes in vramcalc/model.py `mla_tensors`):
    q = q_b(norm(q_a(x))) or q_proj(x), (b, s, a, dn+dr); the latent c = kv_a(x)[..., :kr]
    expands to k_nope and v via kv_b(norm(c)), (b, s, a, dn+dv); one rotary key
    kv_a(x)[..., kr:] (b, s, 1, dr) is shared by every head. The core runs with q/k heads
    dn+dr wide and v heads dv wide (softmax scale 1/√(dn+dr))."""

    def __init__(self, spec: ModelSpec, attention: str, recompute: str,
                 **kw: Unpack[Factory]) -> None:
        nn.Module.__init__(self)
        h, a = spec.hidden_size, spec.num_attention_heads
        qr, kr = spec.q_lora_rank, spec.kv_lora_rank or 0
        self.dn, self.dr = spec.qk_nope_head_dim or 0, spec.qk_rope_head_dim or 0
        self.dv, self.kr = spec.v_head_dim or 0, kr
        self.a = self.g = a
        self.d = self.dn + self.dr
        bias = spec.attention_bias
        self.q_proj = nn.Linear(h, a * self.d, bias=False, **kw) if not qr else None  # type: ignore[assignment]
        self.q_a_proj = nn.Linear(h, qr, bias=bias, **kw) if qr else None
        self.q_a_layernorm = make_norm(spec, qr, **kw) if qr else None
        self.q_b_proj = nn.Linear(qr, a * self.d, bias=False, **kw) if qr else None
        self.kv_a_proj_with_mqa = nn.Linear(h, kr + self.dr, bias=bias, **kw)
        self.kv_a_layernorm = make_norm(spec, kr, **kw)
        self.kv_b_proj = nn.Linear(kr, a * (self.dn + self.dv), bias=False, **kw)
        self.o_proj = nn.Linear(a * self.dv, h, bias=spec.attention_out_bias, **kw)
        self.attention = attention
        self.selective = recompute == "selective"

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        a, dn, dr = self.a, self.dn, self.dr
        if self.q_proj is not None:
            q = self.q_proj(x)  # (b, s, a·(dn+dr))
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # (b, s, qr) inside
        q_nope, q_rope = q.view(b, s, a, self.d).split((dn, dr), dim=-1)  # (b, s, a, dn|dr)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((self.kr, dr), dim=-1)  # (b, s, kr|dr)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, a, dn + self.dv)
        k_nope, v = kv.split((dn, self.dv), dim=-1)  # (b, s, a, dn), (b, s, a, dv)
        k_rope = k_rope.view(b, s, 1, dr)  # one rotary key for all heads
        if rope is not None:
            q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope, *rope)
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)  # (b, a, s, dn+dr)
        k = torch.cat((k_nope, k_rope.expand(b, s, a, dr)), dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)  # (b, a, s, dv)
        if self.attention == "flash" and self.dv != self.d:
            # fused kernels take equal head dims: pad v to dn+dr, crop the output back
            # (transformers integrations/flash_attention.py, Megatron-LM MLA's v pad)
            v = F.pad(v, (0, self.d - self.dv))  # (b, a, s, dn+dr)
        if self.selective:
            y = checkpoint(self.core, q, k, v, mask, use_reentrant=False,
                           preserve_rng_state=False)
        else:
            y = self.core(q, k, v, mask)  # (b, a, s, dv or dn+dr)
        y = y[..., :self.dv].transpose(1, 2).reshape(b, s, a * self.dv)  # (b, s, a·dv)
        return self.o_proj(y)  # (b, s, h)


class MLP(nn.Module):
    """Gated: down(act(gate(x)) · up(x)); standard: proj(act(fc(x)))."""

    def __init__(self, spec: ModelSpec, ffn: int, **kw: Unpack[Factory]) -> None:
        super().__init__()
        h, bias = spec.hidden_size, spec.mlp_bias
        self.gated = spec.mlp_kind == "gated"
        if self.gated:
            self.gate_proj = nn.Linear(h, ffn, bias=bias, **kw)
            self.up_proj = nn.Linear(h, ffn, bias=bias, **kw)
            self.down_proj = nn.Linear(ffn, h, bias=bias, **kw)
        else:
            self.fc = nn.Linear(h, ffn, bias=bias, **kw)
            self.proj = nn.Linear(ffn, h, bias=bias, **kw)
        self.act = activation(spec.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., h) -> (..., h)
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))  # (..., f) inside
        return self.proj(self.act(self.fc(x)))


def capacity_slots(expert: torch.Tensor, num_experts: int, capacity: int):  # noqa: ANN201
    """Static-shape top-k dispatch (Switch Transformer capacity, Fedus et al. 2021).

    expert: (N, k) chosen experts. Returns slot (E·C,) int64, the flat (token·k + choice)
    assignment that fills each expert slot, and filled (E·C,) bool. An expert takes its
    first C assignments in token order and drops the rest; with balanced routing and
    capacity_factor 1 nothing is dropped.
    """
    flat = expert.reshape(-1)  # (N·k,)
    n = flat.numel()
    order = torch.argsort(flat, stable=True)  # (N·k,) assignments grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # (E,)
    start = counts.cumsum(0) - counts  # (E,) first sorted position of each expert
    j = torch.arange(capacity, device=flat.device)  # (C,)
    pos = (start[:, None] + j[None, :]).clamp(max=n - 1)  # (E, C)
    filled = j[None, :] < counts[:, None]  # (E, C)
    return order[pos].reshape(-1), filled.reshape(-1)


class MoE(nn.Module):
    """Router + top-k routed experts (+ shared experts, optionally sigmoid-gated)."""

    def __init__(self, spec: ModelSpec, capacity_factor: float, **kw: Unpack[Factory]) -> None:
        super().__init__()
        h, E = spec.hidden_size, spec.num_local_experts
        self.num_experts, self.top_k, self.capacity_factor = E, spec.num_experts_per_tok, capacity_factor
        self.router = nn.Linear(h, E, bias=spec.router_bias, **kw)
        self.experts = nn.ModuleList(MLP(spec, spec.expert_ffn, **kw) for _ in range(E))
        self.shared_experts = nn.ModuleList(
            MLP(spec, spec.shared_ffn, **kw) for _ in range(spec.num_shared_experts))
        self.shared_expert_gate = (nn.Linear(h, 1, bias=False, **kw)
                                   if spec.shared_expert_gate else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        E, k = self.num_experts, self.top_k
        C = max(1, math.ceil(self.capacity_factor * b * s * k / E))
        xt = x.reshape(b * s, h)  # (N, h)
        probs = F.softmax(self.router(xt).float(), dim=-1)  # (N, E) fp32
        weight, expert = probs.topk(k, dim=-1)  # (N, k)
        weight = weight / weight.sum(dim=-1, keepdim=True)  # renormalised over the top k
        slot, filled = capacity_slots(expert, E, C)  # (E·C,)
        token = slot // k  # (E·C,) source token of each slot
        xin = xt[token]  # (E·C, h) tokens gathered per expert
        gate = (weight.reshape(-1)[slot] * filled).to(x.dtype)  # (E·C,) 0 for empty slots
        ys = torch.cat([expert(part) for expert, part in zip(
            self.experts, xin.split(C), strict=True)])  # (E·C, h); each expert sees (C, h)
        y = torch.zeros_like(xt).index_add(0, token, ys * gate[:, None])  # (N, h)
        for shared in self.shared_experts:
            out = shared(xt)  # (N, h)
            if self.shared_expert_gate is not None:
                out = torch.sigmoid(self.shared_expert_gate(xt)) * out
            y = y + out
        return y.view(b, s, h)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, moe: bool, attention: str, recompute: str,
                 capacity_factor: float, tune: bool = False, rope: TuneRope | None = None,
                 **kw: Unpack[Factory]) -> None:
        super().__init__()
        self.input_layernorm = make_norm(spec, spec.hidden_size, tune, **kw)
        self.attn = (MLAttention(spec, attention, recompute, **kw) if spec.is_mla
                     else Attention(spec, attention, recompute, tune, rope, **kw))
        self.post_attention_layernorm = (make_norm(spec, spec.hidden_size, tune, **kw)
                                         if spec.num_layer_norms >= 2 else None)
        self.mlp: nn.Module = (MoE(spec, capacity_factor, **kw) if moe
                               else MLP(spec, spec.intermediate_size, **kw))
        self.parallel = spec.parallel_residual

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None) -> torch.Tensor:  # (b, s, h) -> (b, s, h)
        if self.parallel:  # x + attn(norm(x)) + mlp(norm'(x)); one norm when shared
            n = self.input_layernorm(x)  # (b, s, h)
            m = n if self.post_attention_layernorm is None else self.post_attention_layernorm(x)
            return x + self.attn(n, rope, mask) + self.mlp(m)
        assert self.post_attention_layernorm is not None
        x = x + self.attn(self.input_layernorm(x), rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class ReferenceModel(nn.Module):
    """The whole decoder; `forward(input_ids, labels)` returns the mean next-token loss."""

    def __init__(self, spec: ModelSpec, attention: str = "flash", recompute: str = "none",
                 capacity_factor: float = 1.0, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 tune_rope: tuple[int, int, int] | None = None) -> None:
        super().__init__()
        kw: Factory = {"dtype": dtype, "device": device}
        h, V = spec.hidden_size, spec.vocab_size
        self.spec, self.attention, self.recompute = spec, attention, recompute
        # tune_rope: torchtune's layer (its norms, RoPE and repeated k/v: torchtitan's ops,
        # vramcalc/terms/torchtune.py) and its RoPE modules' buffers: (positions, modules,
        # cache elements per position)
        tune = tune_rope is not None
        self.embed_tokens = nn.Embedding(V, h, **kw)
        self.embed_positions = (nn.Embedding(spec.max_position_embeddings, h, **kw)
                                if spec.position_embedding == "learned" else None)
        # torchtune's RoPE modules (0: none, MLA keeps its own): one per layer, each built
        # with its layer, or one built first and shared (terms/torchtune.py `rope_modules`)
        positions, modules, width = tune_rope or (0, 0, 0)
        self.tune_rope = modules > 0

        def rope() -> TuneRope:
            return TuneRope(spec.head_size, positions, width, device)

        shared = rope() if modules == 1 else None
        self.layers = nn.ModuleList(
            Block(spec, spec.is_moe_layer(i), attention, recompute, capacity_factor, tune,
                  shared or (rope() if modules > 1 else None), **kw)
            for i in range(spec.num_hidden_layers))
        self.norm = make_norm(spec, h, tune, **kw) if spec.final_norm else None
        self.lm_head = nn.Linear(h, V, bias=spec.lm_head_bias, **kw)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.loss_head: LossHead | None = None  # (lm_head, x, labels) -> loss, when set

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.shape  # (b, s) int64; labels (b, s) int64 are the next tokens
        x = self.embed_tokens(input_ids)  # (b, s, h)
        if self.embed_positions is not None:
            x = x + self.embed_positions(torch.arange(s, device=x.device))  # + (s, h)
        rope: Any = None
        if self.spec.position_embedding == "rope" and not self.tune_rope:
            rope = rope_tables(s, self.spec.qk_rope_head_dim or self.spec.head_size, x.device,
                               compute_dtype(x))
        mask = None
        if self.attention == "eager":
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)  # (s, s)
        for layer in self.layers:
            if self.recompute == "full":  # keep only each layer's input (b, s, h)
                x = checkpoint(layer, x, rope, mask, use_reentrant=False,
                               preserve_rng_state=False)
            else:
                x = layer(x, rope, mask)
        if self.norm is not None:
            x = self.norm(x)
        if self.loss_head is not None:  # chunked cross entropy (vramcalc/trace/lowmem.py)
            return self.loss_head(self.lm_head, x, labels)
        logits = self.lm_head(x).float()  # (b, s, V) fp32; the 16-bit logits are freed at once
        return F.cross_entropy(logits.view(b * s, -1), labels.reshape(b * s))
