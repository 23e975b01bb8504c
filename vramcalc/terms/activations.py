"""Term: activations — tensors the forward pass saves for backward, per layer, per micro-batch.

Legend (per rank): b = micro-batch, s = sequence length on this rank (÷cp), h = hidden,
a = attention heads ÷tp, g = kv heads ÷tp (at least 1), d = head dim, f = FFN size ÷tp,
V = vocab ÷tp, T = b·s tokens of a (b, s, h) tensor on this rank (÷tp under sequence
parallelism), E = experts, k = experts per token, fe / fs = expert / shared-expert FFN,
C = ⌈capacity_factor·b·s·k/E⌉ expert capacity. Dtypes: c = compute dtype, r = the
residual stream's dtype (the weights' dtype: fp32 under autocast, else c). Every saved
tensor is one storage, rounded to the allocator's 512 B; a storage saved by several ops
(a norm's output read by q, k and v) is listed once.

Profiles (the per-layer tables are in docs/saved-tensors.md; the trace engine checks them):
- `reference`: vramcalc's own model (vramcalc/trace/reference_model.py): fused RMSNorm
  (input + fp32 rstd), RoPE before the head transpose, FlashAttention-2 keeping q, k, v,
  output and fp32 logsumexp, eager attention keeping the (b, a, s, s) probabilities.
- `hf`: Hugging Face transformers 5.x: RMSNorm upcasts to fp32 in Python (fp32 input copy,
  normalised copy), RoPE tables in the residual dtype, eager softmax in fp32 kept next to
  its 16-bit copy, fused projections for Phi-3 and GPT-2, grouped_mm experts.
- `megatron`: Korthikanti et al. 2022 (arXiv:2205.05198) Table 2, 16-bit activations and
  1-byte dropout masks, FFN 4h generalised to f.

Under autocast (r = fp32, c = 16-bit) every linear casts its fp32 input itself, so a norm
output read by n linears is kept as n 16-bit copies (autocast caches casts of parameters
only; aten/src/ATen/autocast_mode.cpp `cached_cast`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext, lazy
from vramcalc.training import TrainingConfig
from vramcalc.units import DTYPE_BITS, alloc, ceil_div, round_alloc


@dataclass(frozen=True)
class Saved:
    """One storage kept for backward: element count, dtype, shape and reason (for the docs)."""

    name: str
    numel: int
    dtype: str
    shape: str
    why: str = ""
    count: int = 1  # identical storages (one per expert, say)

    @lazy  # summed many times per profile
    def nbytes(self) -> int:
        bits = _BITS[self.dtype]
        return self.count * round_alloc(ceil_div(self.numel * bits, 8))


_BITS = {**DTYPE_BITS, "int32": 32}


@dataclass(frozen=True)
class Dims:
    """Per-rank tensor dimensions (see the legend)."""

    b: int
    s: int
    h: int
    a: int
    g: int
    d: int
    f: int
    V: int
    sp_div: int  # ÷ for (b, s, h) tensors: tp under sequence parallelism, else 1
    c: str  # compute dtype
    r: str = "bf16"  # residual stream / weight dtype

    @property
    def T(self) -> int:
        """Tokens of a (b, s, h) tensor on this rank."""
        return self.b * ceil_div(self.s, self.sp_div)

    @property
    def amp(self) -> bool:
        return self.r != self.c


def dims(ctx: RankContext) -> Dims:
    """The rank's tensor dimensions (memoised on the context: a profile asks a dozen times)."""
    cached = ctx.__dict__.get("_dims")
    if cached is None:
        cached = ctx.__dict__["_dims"] = _dims(ctx)
    return cached


def _dims(ctx: RankContext) -> Dims:
    spec, tr, par = ctx.spec, ctx.training, ctx.parallel
    tp = par.tp
    ffn = spec.expert_ffn if spec.is_moe and spec.num_dense_layers == 0 else spec.intermediate_size
    return Dims(
        b=tr.micro_batch_size,
        s=ceil_div(tr.seq_len, par.cp),
        h=spec.hidden_size,
        a=ceil_div(spec.num_attention_heads, tp),
        g=max(spec.kv_heads // tp, 1),
        d=spec.head_size,
        f=ceil_div(ffn, tp),
        V=ceil_div(spec.vocab_size, tp),
        sp_div=tp if par.sequence_parallel else 1,
        c=tr.compute_dtype,
        # FSDP2's MixedPrecisionPolicy all-gathers parameters in c: no autocast, r = c
        r=tr.compute_dtype if ctx.engine == "fsdp2" else tr.weight_dtype,
    )


def _bsh(x: Dims) -> int:
    return x.T * x.h


def hf_family(ctx: RankContext) -> str:
    """The transformers architecture the hf profile follows (vramcalc/trace/hf_models.py)."""
    spec = ctx.spec
    if spec.norm_kind == "layernorm" or spec.mlp_kind == "standard":
        return "gpt2"
    if spec.is_moe:
        return "mixtral" if not (spec.num_shared_experts or spec.qk_norm) else (
            "qwen2_moe" if spec.num_shared_experts else "qwen3_moe")
    if spec.model_type in ("phi3", "gemma") and not (spec.attention_bias or spec.qk_norm):
        return spec.model_type
    return "llama"


# ---- building blocks ------------------------------------------------------------------
def _linear_inputs(x: Dims, name: str, numel: int, readers: int, shape: str) -> list[Saved]:
    """Input of `readers` linears: kept once in r, or one c-typed cast each under autocast."""
    if x.amp:
        return [Saved(f"{name}.cast", numel, x.c, shape,
                      "autocast's c copy of the input, one per linear", readers)]
    return [Saved(name, numel, x.c, shape, "input of the projection(s), for the weight grad")]


def _norm_saved(ctx: RankContext, x: Dims, name: str, tokens: int, width: int,
                shape: str) -> list[Saved]:
    """A norm over `width` of `tokens` rows, as the profile implements it (output excluded)."""
    numel = tokens * width
    stats = shape.replace(", h)", ")") if shape.endswith(", h)") else "(rows)"
    if ctx.spec.norm_kind == "layernorm":  # nn.LayerNorm (both profiles): native_layer_norm
        return [Saved(f"{name}.input", numel, x.r, shape, "LayerNorm input"),
                Saved(f"{name}.mean", tokens, "fp32", stats, "fp32 mean (CUDA acc type)"),
                Saved(f"{name}.rstd", tokens, "fp32", stats, "fp32 1/std")]
    if ctx.training.framework != "hf":  # fused RMSNorm: input + fp32 rstd
        return [Saved(f"{name}.input", numel, x.r, shape, "RMSNorm input (fused kernel)"),
                Saved(f"{name}.rstd", tokens, "fp32", stats, "fp32 1/rms (fused kernel)")]
    # transformers RMSNorm: x32 = x.float(); x32 * rsqrt(mean(x32²) + eps) -> weight * (·).to(r)
    out = [Saved(f"{name}.x_fp32", numel, "fp32", shape,
                 "x.to(float32), kept by pow and mul (the residual itself when r = fp32)"),
           Saved(f"{name}.rstd", tokens, "fp32", stats, "rsqrt output, kept by mul")]
    if hf_family(ctx) == "gemma":  # output = x̂32 · (1 + w.float()), then .type_as(x)
        out += [Saved(f"{name}.xhat_fp32", numel, "fp32", shape, "x̂ in fp32, kept by · (1 + w)"),
                Saved(f"{name}.one_plus_w", width, "fp32", "(width)", "1 + w in fp32")]
    else:
        out.append(Saved(f"{name}.xhat", numel, x.r, shape, "x̂.to(input dtype), kept by w · x̂"))
    return out


def _qk_norm_saved(ctx: RankContext, x: Dims) -> list[Saved]:
    """Per-head q/k RMSNorm (Qwen3): each keeps its input (and the hf profile's fp32 copies)."""
    out: list[Saved] = []
    for n, heads in (("q", x.a), ("k", x.g)):
        tokens, numel = x.b * x.s * heads, x.b * x.s * heads * x.d
        if ctx.training.framework == "hf":
            out += [Saved(f"attn.{n}_norm.x_fp32", numel, "fp32", f"(b, s, {n}heads, d)",
                          "q/k.to(float32)"),
                    Saved(f"attn.{n}_norm.rstd", tokens, "fp32", "(b, s, heads)", "rsqrt"),
                    Saved(f"attn.{n}_norm.xhat", numel, x.c, "(b, s, heads, d)",
                          "x̂.to(c), kept by w · x̂")]
        else:  # autocast casts the 16-bit q/k to the fp32 weight's dtype first
            out += [Saved(f"attn.{n}_norm.input", numel, x.r, "(b, s, heads, d)",
                          "RMSNorm input"),
                    Saved(f"attn.{n}_norm.rstd", tokens, "fp32", "(b, s, heads)", "fp32 1/rms")]
    return out


def attention_core_saved(ctx: RankContext, x: Dims) -> list[Saved]:
    """What the attention core saves beyond its q, k, v inputs (recomputed under selective)."""
    c = x.c
    bsad = x.b * x.s * x.a * x.d
    if ctx.training.attention == "flash":
        # FlashAttention-2 / memory-efficient SDPA: output (b, s, a, d) and logsumexp
        return [Saved("attn.out", bsad, c, "(b, s, a, d)", "SDPA output, kept by SDPA"),
                Saved("attn.lse", x.b * x.a * x.s, "fp32", "(b, a, s)", "logsumexp, fp32")]
    probs = x.b * x.a * x.s * x.s
    hf = ctx.training.framework == "hf"
    # softmax output: fp32 when autocast upcasts softmax (CUDA list) or hf asks dtype=fp32
    # (every hf family but GPT-2, whose softmax runs in the input dtype)
    p_dtype = "fp32" if (x.amp or (hf and hf_family(ctx) != "gpt2")) else c
    out = [Saved("attn.probs", probs, p_dtype, "(b, a, s, s)", "softmax output")]
    if p_dtype != c:
        out.append(Saved("attn.probs_c", probs, c, "(b, a, s, s)",
                         "probs in c, kept by probs @ v"))
    return out


def _attention_saved(ctx: RankContext, x: Dims) -> list[Saved]:
    """q/k/v projections to o_proj input (attention core included unless selective)."""
    spec, tr = ctx.spec, ctx.training
    hf = tr.framework == "hf"
    fam = hf_family(ctx) if hf else "reference"
    c = x.c
    bsad, bsgd = x.b * x.s * x.a * x.d, x.b * x.s * x.g * x.d
    eager = tr.attention == "eager"
    selective = tr.recompute == "selective"
    fused_qkv = fam in ("gpt2", "phi3")
    out = _linear_inputs(x, "attn.input", _bsh(x), 1 if fused_qkv else 3, "(b, s, h) normed")
    if spec.qk_norm:
        out += _qk_norm_saved(ctx, x)
    rope = spec.position_embedding == "rope"
    if eager and not selective:
        # matmul needs contiguous (b·a, s, d) operands: q, k, v copies (or the repeated
        # k, v, which are contiguous), scores -> softmax -> probs @ v -> (b, s, a·d) copy
        if hf:
            out += _hf_eager_qkv(ctx, x, fam)
        else:
            out += [Saved("attn.q", bsad, c, "(b, a, s, d)", "contiguous q for q @ kᵀ"),
                    Saved("attn.k", bsad, c, "(b, a, s, d)", "contiguous/repeated k"),
                    Saved("attn.v", bsad, c, "(b, a, s, d)", "contiguous/repeated v")]
            if x.g < x.a:
                out.append(Saved("attn.repeat_index", x.a, "int64", "(a)",
                                 "repeat_interleave index, kept by index_select", 2))
        out += attention_core_saved(ctx, x)
        out.append(Saved("attn.o_input", bsad, c, "(b, s, a·d)", "contiguous copy for o_proj"))
        return out
    # flash (and selective): the core's inputs q, k, v in c
    if fused_qkv and fam == "gpt2":
        qkv = [Saved("attn.qkv", x.b * x.s * (x.a + 2 * x.g) * x.d, c, "(b, s, 3·h)",
                     "fused c_attn output; q, k, v are views of it")]
    elif fused_qkv:  # phi3: q and k rotated copies, v a view of the fused qkv output
        qk = x.r if (x.amp and selective) else c  # see below
        qkv = [Saved("attn.qkv", x.b * x.s * (x.a + 2 * x.g) * x.d, c, "(b, s, (a+2g)·d)",
                     "fused qkv_proj output, alive through the v view"),
               Saved("attn.q", bsad, qk, "(b, a, s, d)", "rotated q"),
               Saved("attn.k", bsgd, qk, "(b, g, s, d)", "rotated k")]
    else:
        # hf RoPE runs in r under autocast (its tables are in the residual dtype): SDPA keeps
        # 16-bit casts of q, k, but a checkpoint around the core keeps its fp32 inputs
        qk = x.r if (hf and x.amp and rope and selective) else c
        qkv = [Saved("attn.q", bsad, qk, "(b, a, s, d)", "rotated q, SDPA input"),
               Saved("attn.k", bsgd, qk, "(b, g, s, d)", "rotated k, SDPA input"),
               Saved("attn.v", bsgd, c, "(b, g, s, d)", "v, SDPA input")]
    out += qkv
    if selective:
        if eager:
            out.append(Saved("attn.o_input", bsad, c, "(b, s, a·d)",
                             "contiguous copy of the core output for o_proj"))
        else:
            out.append(Saved("attn.out", bsad, c, "(b, s, a, d)",
                             "core output, kept by o_proj (the core is recomputed)"))
    else:
        out += attention_core_saved(ctx, x)
    return out


def _hf_eager_qkv(ctx: RankContext, x: Dims, fam: str) -> list[Saved]:
    """hf eager attention's q, k, v as kept by the two matmuls (repeat_kv copies for GQA)."""
    c, bsad = x.c, x.b * x.s * x.a * x.d
    bsgd = x.b * x.s * x.g * x.d
    if fam == "gpt2":
        return [Saved("attn.qkv", x.b * x.s * 3 * x.a * x.d, c, "(b, s, 3·h)",
                      "fused c_attn output; q, k, v views")]
    # repeat_kv copies k and v unless g == 1 (then expand + reshape stays a view, and
    # matmul folds (b, a) into one batch dimension without a copy only when b == 1)
    k_keep = bsgd if (x.g == x.a or (x.g == 1 and x.b == 1)) else bsad
    out = [Saved("attn.q", bsad, c, "(b, a, s, d)", "rotated q"),
           Saved("attn.k", k_keep, c, "(b, a, s, d)", "rotated k (repeat_kv copy for GQA)")]
    # Phi-3's v is a view of the fused qkv output, kept as such unless repeat_kv copies it
    # or matmul cannot fold (b, a) into one batch dimension (b > 1) and copies it
    v_view = fam == "phi3" and x.b == 1 and (x.g == x.a or x.g == 1)
    if v_view:
        out.append(Saved("attn.qkv", x.b * x.s * (x.a + 2 * x.g) * x.d, c, "(b, s, (a+2g)·d)",
                         "fused qkv_proj output, kept through the v view"))
    else:
        out.append(Saved("attn.v", k_keep, c, "(b, a, s, d)", "v (repeat_kv copy for GQA)"))
    return out


def _mlp_saved(ctx: RankContext, x: Dims, tokens: int, ffn: int, name: str = "mlp",
               readers_input: bool = True) -> list[Saved]:
    """A dense MLP on `tokens` rows (input included when `readers_input`)."""
    c, bsf = x.c, tokens * ffn
    hf = ctx.training.framework == "hf"
    fam = hf_family(ctx) if hf else "reference"
    out: list[Saved] = []
    if ctx.spec.mlp_kind == "gated":
        if readers_input:
            out += _linear_inputs(x, f"{name}.input", tokens * x.h, 1 if fam == "phi3" else 2,
                                  "(T, h) normed")
        if fam == "phi3":
            out.append(Saved(f"{name}.gate_up", 2 * bsf, c, "(T, 2f)",
                             "fused gate_up output; gate and up are views"))
        else:
            out += [Saved(f"{name}.gate", bsf, c, "(T, f)", "activation input"),
                    Saved(f"{name}.up", bsf, c, "(T, f)", "kept by act · up")]
        out += [Saved(f"{name}.act", bsf, c, "(T, f)", "activation output, kept by act · up"),
                Saved(f"{name}.down_input", bsf, c, "(T, f)", "act · up, down_proj input")]
        return out
    if readers_input:
        out += _linear_inputs(x, f"{name}.input", tokens * x.h, 1, "(T, h) normed")
    out.append(Saved(f"{name}.fc_out", bsf, c, "(T, f)", "activation input"))
    if hf and ctx.spec.hidden_act == "gelu_new":
        out += _new_gelu_saved(x, bsf, name)
    else:
        out.append(Saved(f"{name}.act", bsf, c, "(T, f)", "activation output, proj input"))
    return out


def _new_gelu_saved(x: Dims, bsf: int, name: str) -> list[Saved]:
    """transformers NewGELUActivation in Python: 0.5·x·(1 + tanh(√(2/π)(x + 0.044715·x³)))."""
    c = x.c
    p_dtype = "fp32" if x.amp else c  # pow is on CUDA's autocast fp32 list
    return [Saved(f"{name}.gelu.half_x", bsf, c, "(T, f)", "0.5·x, kept by the product"),
            Saved(f"{name}.gelu.tanh", bsf, p_dtype, "(T, f)", "tanh output"),
            Saved(f"{name}.gelu.one_plus", bsf, p_dtype, "(T, f)", "1 + tanh, kept by product"),
            Saved(f"{name}.act", bsf, p_dtype, "(T, f)", "activation output, c_proj input")]


def _moe_saved(ctx: RankContext, x: Dims) -> list[Saved]:
    """A mixture-of-experts MLP (router, top-k dispatch, experts, combine, shared experts)."""
    spec = ctx.spec
    c, T = x.c, x.T
    E, k = spec.num_local_experts, spec.num_experts_per_tok
    fe = ceil_div(spec.expert_ffn, ctx.parallel.tp)
    out: list[Saved] = []
    shared = spec.num_shared_experts
    if ctx.training.framework == "hf":
        return _hf_moe_saved(ctx, x)
    C = max(1, -(-int(ctx.parallel.capacity_factor * T * k * 1_000_000) // (E * 1_000_000)))
    EC = E * C
    readers = 1 + 2 * shared + (1 if spec.shared_expert_gate else 0)
    out += _linear_inputs(x, "moe.input", T * x.h, readers, "(T, h) normed")
    out += [Saved("moe.router_probs", T * E, "fp32", "(T, E)", "softmax output"),
            Saved("moe.topk_index", T * k, "int64", "(T, k)", "kept by topk backward"),
            Saved("moe.topk_weight", T * k, "fp32", "(T, k)", "kept by / sum"),
            Saved("moe.topk_sum", T, "fp32", "(T, 1)", "kept by / sum"),
            Saved("moe.slot", EC, "int64", "(E·C)", "slot -> assignment index"),
            Saved("moe.filled", EC, "bool", "(E·C)", "slot filled mask"),
            Saved("moe.token", EC, "int64", "(E·C)", "slot -> token index"),
            Saved("moe.gate", EC, x.r, "(E·C)", "routing weight per slot, in r")]
    if x.amp:
        per_expert = 2 if spec.mlp_kind == "gated" else 1
        out.append(Saved("moe.expert_input.cast", C * x.h, c, "(C, h)",
                         "autocast copy of an expert's tokens, one per projection",
                         E * per_expert))
    else:
        out.append(Saved("moe.expert_input", EC * x.h, c, "(E·C, h)", "gathered tokens"))
    out += [Saved(t.name.replace("mlp.", "moe.expert."), t.numel, t.dtype, t.shape, t.why, E)
            for t in _mlp_saved(ctx, x, C, fe, readers_input=False)]
    out += [Saved("moe.expert_output", EC * x.h, c, "(E·C, h)", "cat of expert outputs"),
            Saved("moe.weighted", EC * x.h, x.r, "(E·C, h)",
                  "outputs · gate; index_add's backward formula keeps its source")]
    fs = ceil_div(spec.shared_ffn, ctx.parallel.tp)
    for i in range(shared):
        out += _mlp_saved(ctx, x, T, fs, name=f"shared_expert{i}", readers_input=False)
        if spec.shared_expert_gate:
            out += [Saved(f"shared_expert{i}.output", T * x.h, c, "(T, h)", "kept by gate ·"),
                    Saved(f"shared_expert{i}.gate", T, c, "(T, 1)", "sigmoid output")]
    return out


def _hf_moe_saved(ctx: RankContext, x: Dims) -> list[Saved]:
    """transformers MoE blocks (router softmax in fp32, grouped_mm experts on T·k rows)."""
    spec = ctx.spec
    c, T = x.c, x.T
    E, k = spec.num_local_experts, spec.num_experts_per_tok
    S = T * k
    fe = ceil_div(spec.expert_ffn, ctx.parallel.tp)
    shared = spec.num_shared_experts
    readers = 2 + (3 if shared else 0)  # router, experts' gather (+ shared gate, up, gate)
    out = _linear_inputs(x, "moe.input", T * x.h, readers, "(T, h) normed")
    out += [Saved("moe.router_probs", T * E, "fp32", "(T, E)", "softmax output"),
            Saved("moe.topk_index", T * k, "int64", "(T, k)", "kept by topk backward"),
            Saved("moe.topk_weight", T * k, "fp32", "(T, k)", "renormalised top-k weights"),
            Saved("moe.topk_sum", T, "fp32", "(T, 1)", "kept by /="),
            Saved("moe.perm", S, "int64", "(T·k)", "sort permutation"),
            Saved("moe.token_index", S, "int64", "(T·k)", "perm // k, kept by the gather"),
            Saved("moe.offsets", E, "int32", "(E)", "cumsum of tokens per expert, grouped_mm"),
            Saved("moe.inv_perm", S, "int64", "(T·k)", "inverse permutation"),
            Saved("moe.sample_weight", S, "fp32" if hf_family(ctx) == "mixtral" else c, "(T·k)",
                  "routing weight per row (Qwen MoE casts it to c)"),
            Saved("moe.rows", S * x.h, c, "(T·k, h)", "tokens sorted by expert"),
            Saved("moe.gate_up", S * 2 * fe, c, "(T·k, 2fe)", "grouped_mm output"),
            Saved("moe.act", S * fe, c, "(T·k, fe)", "act(gate)"),
            Saved("moe.down_input", S * fe, c, "(T·k, fe)", "act · up"),
            Saved("moe.down_out", S * x.h, c, "(T·k, h)", "kept by · routing weight")]
    if shared:
        fs = ceil_div(spec.shared_ffn, ctx.parallel.tp)
        out += _mlp_saved(ctx, x, T, fs, name="shared_expert", readers_input=False)
        out += [Saved("shared_expert.output", T * x.h, c, "(T, h)", "kept by gate ·"),
                Saved("shared_expert.gate", T, c, "(T, 1)", "sigmoid output")]
    return out


# ---- per layer -------------------------------------------------------------------------
def without_recompute(ctx: RankContext) -> RankContext:
    """The same rank without activation recomputation (what a recomputed layer holds while
    its backward runs); memoised on the context."""
    if ctx.training.recompute == "none":
        return ctx
    plain = ctx.__dict__.get("_without_recompute")
    if plain is None:
        plain = ctx.__dict__["_without_recompute"] = RankContext(
            ctx.spec, ctx.training.model_copy(update={"recompute": "none"}), ctx.parallel,
            ctx.stage)
    return plain


def layer_saved(ctx: RankContext, moe: bool | None = None) -> list[Saved]:
    """Saved tensors of one transformer layer for one micro-batch (reference/hf profiles).

    `moe` picks a dense or MoE layer; by default the kind most of this rank's layers are.
    Memoised per context (a profile asks for the same layer several times); callers get
    their own list.
    """
    if moe is None:
        moe = ctx.spec.is_moe and ctx.shapes.num_moe_layers * 2 >= max(ctx.num_layers, 1)
    memo = ctx.__dict__.setdefault("_layer_saved", {})
    if moe not in memo:
        memo[moe] = tuple(_layer_saved(ctx, moe))
    return list(memo[moe])


def _layer_saved(ctx: RankContext, moe: bool) -> list[Saved]:
    x = dims(ctx)
    if ctx.training.recompute == "full":
        # torch.utils.checkpoint keeps only the layer input
        return [Saved("layer.input", _bsh(x), x.r, "(b, s, h)", "checkpoint input")]
    out = _norm_saved(ctx, x, "input_norm", x.T, x.h, "(b, s, h)")
    out += _attention_saved(ctx, x)
    out += _norm_saved(ctx, x, "post_norm", x.T, x.h, "(b, s, h)")
    if moe:
        out += _moe_saved(ctx, x)
    else:
        out += _mlp_saved(ctx, x, x.T, ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp))
    if ctx.training.finetune != "full":  # frozen base + adapters
        from vramcalc.terms.finetune_activations import adjust_layer_saved

        out = adjust_layer_saved(ctx, out)
    if ctx.training.precision == "fp8" or ctx.training.qat != "none":  # FP8 / QAT linears
        from vramcalc.terms import lowprec

        out = lowprec.adjust_layer_saved(ctx, out)
    return out


def megatron_layer_bytes(ctx: RankContext) -> int:
    """Korthikanti et al. 2022 Table 2 bytes per layer (t = tp, SP and selective recompute)."""
    x = dims(ctx)
    s, b, h, t = x.s, x.b, x.h, ctx.parallel.tp
    a = ctx.spec.num_attention_heads
    ffn_ratio = ctx.spec.intermediate_size / h
    mlp = 19 if ffn_ratio == 4 else 3 + 4 * ffn_ratio  # 19 sbh for f = 4h (2 + 8 + 8 + 1)
    base = 34 - 19 + mlp  # 10 replicated + 24/t sharded in the paper's split
    rec = ctx.training.recompute
    if rec == "full":
        return 2 * s * b * h // (t if ctx.parallel.sequence_parallel else 1)
    core = 0 if rec == "selective" else 5 * a * s / h
    if ctx.parallel.sequence_parallel:
        return int(s * b * h / t * (base + core))
    return int(s * b * h * (10 + (base - 10) / t + core / t))


def layer_activation_bytes(ctx: RankContext, moe: bool | None = None) -> int:
    """Bytes one layer keeps for backward, one micro-batch, on this rank."""
    if ctx.training.framework == "megatron":
        return megatron_layer_bytes(ctx)
    return sum(t.nbytes for t in layer_saved(ctx, moe))


def stage_layer_bytes(ctx: RankContext) -> tuple[int, int, int, int]:
    """(dense layers, bytes per dense layer, MoE layers, bytes per MoE layer) on this rank;
    dense layers come first (first_k_dense_replace)."""
    n_moe = ctx.shapes.num_moe_layers if ctx.spec.is_moe else 0
    n_dense = ctx.num_layers - n_moe
    dense = layer_activation_bytes(ctx, moe=False) if n_dense else 0
    moe = layer_activation_bytes(ctx, moe=True) if n_moe else 0
    return n_dense, dense, n_moe, moe


def eager_forward_moment(ctx: RankContext) -> tuple[int, int]:
    """Eager attention's forward peak inside one layer, at the softmax: (bytes of the layer's
    saved tensors that exist by then, temporaries). The softmax input (scores, c) and output
    (probs, in the softmax dtype) coexist; under autocast CUDA's fp32 rule adds the fp32
    copy of the input."""
    x = dims(ctx)
    tr = ctx.training
    if tr.attention != "eager":
        return 0, 0
    plain = without_recompute(ctx)
    saved = layer_saved(plain, False)
    pre = ("attn.input", "attn.input.cast", "attn.q", "attn.k", "attn.repeat_index",
           "attn.qkv")
    if x.g < x.a or tr.framework == "hf":
        pre += ("attn.v",)  # repeated (or hf's repeat_kv) v exists before the scores
    held = sum(t.nbytes for t in saved if t.name.startswith(("input_norm.", "attn.q_norm",
                                                                  "attn.k_norm")) or t.name in pre)
    bas = x.b * x.a * x.s * x.s
    p_dtype = next((t.dtype for t in saved if t.name == "attn.probs"), x.c)
    # softmax input (scores, c) and output; softmax(x16, dtype=fp32) converts its input
    # first (a CUDA half_to_float kernel skips that copy for fp16; the trace makes it)
    work = alloc(bas, x.c) + alloc(bas, p_dtype)
    if p_dtype != x.c:
        work += alloc(bas, p_dtype)
    if tr.recompute == "full":
        held = sum(t.nbytes for t in saved if t.name in pre)  # the layer keeps nothing
    if x.g < x.a and not (tr.framework == "hf" and x.g == 1 and x.b == 1):
        held += 2 * alloc(x.b * x.s * x.g * x.d, x.c)  # k, v before the repeat (locals)
    if tr.framework == "hf" and tr.recompute == "none":
        held += alloc(x.b * x.s * x.s, x.r)  # the model's additive mask, alive in forward
    return held, work


def forward_end_extra_bytes(ctx: RankContext) -> int:
    """Beyond the saved tensors, while the final norm runs (last stage): transformers keeps
    the embedding output (and GPT-2's position embeddings) and the last residual in locals
    of the model's forward, its RMSNorm makes an fp32 x̂ before the cast (both only when the
    residual is 16-bit), and eager attention's additive mask lives until the model returns."""
    if not ctx.is_last_stage or ctx.training.framework != "hf":
        return 0
    x = dims(ctx)
    extra = 0
    if ctx.spec.norm_kind == "layernorm":
        extra += alloc(_bsh(x), x.r)  # inputs_embeds next to inputs_embeds + positions
        if ctx.is_first_stage and ctx.spec.position_embedding == "learned":
            extra += alloc(x.s * x.h, x.r)
    elif x.r != "fp32":
        extra += 2 * alloc(_bsh(x), x.r) + alloc(_bsh(x), "fp32")
        if hf_family(ctx) == "gemma":
            extra += alloc(_bsh(x), "fp32")  # its fp32 x̂ is saved; the product is fp32 too
    if ctx.training.attention == "eager" and ctx.training.recompute == "none":
        extra += alloc(x.b * x.s * x.s, x.r)
    return extra


def microbatch_activation_bytes(ctx: RankContext) -> int:
    """Everything one micro-batch keeps for backward on this rank at the end of its forward:
    the stage's layers plus the embedding-side and head-side tensors."""
    n_dense, a_dense, n_moe, a_moe = stage_layer_bytes(ctx)
    edges = sum(t.nbytes for t in embedding_saved(ctx) + head_saved(ctx))
    gap = 0
    if ctx.training.finetune != "full":  # the frozen embedding's first layer keeps less
        from vramcalc.terms.finetune_activations import first_layer_unsaved_bytes

        gap = first_layer_unsaved_bytes(ctx)
    if ctx.training.activation_offload and ctx.training.recompute != "full":
        from vramcalc.terms.lowmem import device_layer_bytes, offloaded_edge_bytes

        # the rest is in host memory, the rotary tables and mask the layers saved included
        return (n_dense + n_moe) * device_layer_bytes(layer_saved(ctx)) + edges - (
            offloaded_edge_bytes(ctx))
    return n_dense * a_dense + n_moe * a_moe + edges - gap


def layer_forward_working_bytes(ctx: RankContext) -> int:
    """Temporaries at the end of one layer's forward beyond what it saves: the MLP output
    (T·h in c) next to the new residual (T·h in r). Under full recompute nothing inside the
    layer is kept, and its MLP runs with every intermediate alive at once: the normed input,
    gate, up, act and act·up (T·h + 4·T·f), or fc and act (T·h + 2·T·f)."""
    x = dims(ctx)
    if ctx.training.activation_offload and ctx.training.recompute != "full":
        from vramcalc.terms.lowmem import offload_forward_working_bytes

        return offload_forward_working_bytes(ctx)
    out = alloc(_bsh(x), x.c) + alloc(_bsh(x), x.r)
    if ctx.training.recompute == "full":
        f = ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp)
        n = 4 if ctx.spec.mlp_kind == "gated" else 2
        out = max(out, alloc(_bsh(x), x.c) + n * alloc(x.T * f, x.c))
    if ctx.training.finetune != "full":  # adapters' sums, QLoRA's dequantized weights
        from vramcalc.terms.finetune_activations import forward_working_bytes

        out = max(out, forward_working_bytes(ctx))
    if ctx.training.precision == "fp8" or ctx.training.qat != "none":  # the down projection
        from vramcalc.terms import lowprec

        out = max(out, lowprec.forward_working_bytes(ctx))
    return out


def layer_backward_working_bytes(ctx: RankContext) -> int:
    """Largest gradient-temporary set of one layer's backward (see `layer_backward_moments`)."""
    return max((m.work for m in layer_backward_moments(ctx)), default=0)


@dataclass(frozen=True)
class Moment:
    """One instant inside a layer's backward: what of the layer is still saved (`held`),
    which of its parameter groups already have gradients (`grads`: "mlp" or "mlp+o") and
    the gradient temporaries alive (`work`)."""

    name: str
    held: int
    work: int
    grads: str


def layer_backward_moments(ctx: RankContext, moe: bool | None = None) -> list[Moment]:
    """The instants where one layer's backward can peak (top-down inside the layer).

    Autograd runs the nodes in reverse forward order, frees each node's saved tensors after
    it runs and its incoming gradient once consumed. g = dL/d residual (T·h in r) is held
    through the whole branch. Two instants bound a layer:
    - MLP: gated, the act · up backward: dL/d(act·up), d act, d up (3·T·f in c) with only
      down_proj's input freed; 2-matrix, the activation backward: d act, d fc (2·T·f) with
      the activation output freed;
    - attention core: everything from the post-attention norm up is freed; flash keeps
      dL/d out and allocates dq, dk, dv plus FlashAttention-2's scratch (softmax_d,
      dq_accum in fp32, expanded dk/dv for GQA); eager holds dv while the softmax backward
      turns d probs into d scores (2 (b, a, s, s) buffers in the softmax dtype).
    Under recompute the layer's forward is re-run first, so the layer holds its full
    (non-recomputed) saved set again at these instants.
    """
    x = dims(ctx)
    tr = ctx.training
    if moe is None:
        moe = ctx.spec.is_moe and ctx.shapes.num_moe_layers * 2 >= max(ctx.num_layers, 1)
    plain = without_recompute(ctx)
    saved = layer_saved(plain, moe)
    # before the attention core the layer holds its own saved set (selective: the core is
    # only recomputed when its backward comes; full: the whole layer is recomputed first)
    mlp_saved = saved if tr.recompute == "full" else layer_saved(ctx, moe)
    total = sum(t.nbytes for t in mlp_saved)
    extra = 0
    if tr.recompute == "full" and tr.framework == "hf" and x.r != "fp32" and (
            ctx.spec.norm_kind == "rmsnorm"):
        extra = alloc(_bsh(x), x.r)  # the checkpoint keeps the input next to hf's fp32 copy
    c, r = x.c, x.r
    g_res = alloc(_bsh(x), r)
    out: list[Moment] = []
    # MLP instant
    if moe:
        spec = ctx.spec
        E, k = spec.num_local_experts, spec.num_experts_per_tok
        fe = ceil_div(spec.expert_ffn, ctx.parallel.tp)
        if tr.framework == "hf":
            # the combine's backward: d out (fp32 for Mixtral's fp32 routing weights) is
            # expanded to the T·k rows (a copy), scattered back through the inverse
            # permutation (zeros + index_put), next to d final in fp32 and c
            S = x.T * k
            w = "fp32" if hf_family(ctx) == "mixtral" else c
            work = g_res + 3 * alloc(S * x.h, w) + 2 * alloc(_bsh(x), c)
            out.append(Moment("moe", total + extra, work, "shared"))
        else:
            # the last expert's backward: d(outputs) (E·C, h) and the other experts' input
            # grads (E·C, h in all) wait for the split's backward, next to the expert's own
            # gated-MLP temporaries on C rows
            C = max(1, -(-int(ctx.parallel.capacity_factor * x.T * k * 1_000_000) // (
                E * 1_000_000)))
            gone = sum(t.nbytes for t in mlp_saved if t.name in ("moe.weighted",
                                                                 "moe.expert_output"))
            n_f = 3 if spec.mlp_kind == "gated" else 2
            work = g_res + 2 * alloc(E * C * x.h, c) + n_f * alloc(C * fe, c) + alloc(
                C * x.h, c)
            out.append(Moment("moe", total + extra - gone, work, "shared"))
    else:
        f = ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp)
        bsf = alloc(x.T * f, c)
        kind = ctx.spec.mlp_kind
        if kind == "gated":  # act · up backward: d(act·up), d act, d up
            gone, n_f = ("mlp.down_input",), 3
        elif any(t.name == "mlp.gelu.half_x" for t in saved):
            # hf's Python GELU: the 0.5x · (1 + tanh) product's backward: d out, d 0.5x,
            # d (1 + tanh), with only the product (c_proj's input) freed
            gone, n_f = ("mlp.act",), 3
        else:  # the activation's backward: d act, d fc
            gone, n_f = ("mlp.act",), 2
        freed = sum(t.nbytes for t in mlp_saved if t.name in gone)
        work = g_res + n_f * bsf
        out.append(Moment("mlp", total + extra - freed, work, "down"))
    # attention-core instant
    # eager: probs @ v's backward has run (its probs copy and v are freed)
    gone = ("attn.o_input", "attn.probs_c", "attn.v") if tr.attention == "eager" else (
        "attn.o_input",)
    held = extra + sum(t.nbytes for t in saved if t.name.startswith(("input_norm.", "attn."))
                       and t.name not in gone)
    if tr.recompute == "selective" and tr.attention == "eager" and x.g < x.a and not (
            tr.framework == "hf" and x.g == 1 and x.b == 1):
        held += 2 * alloc(x.b * x.s * x.g * x.d, c)  # the checkpoint's k, v before repeat
    bsad = alloc(x.b * x.s * x.a * x.d, c)
    if tr.attention == "flash":
        bsgd = alloc(x.b * x.s * x.g * x.d, c)
        s128, d32 = -(-x.s // 128) * 128, -(-x.d // (32 if x.d <= 128 else 64)) * (
            32 if x.d <= 128 else 64)
        scratch = alloc(x.b * x.a * s128, "fp32") + alloc(x.b * s128 * x.a * d32, "fp32")
        if x.g < x.a:
            scratch += 2 * bsad
        work = g_res + 2 * bsad + 2 * bsgd + scratch
    else:
        p_dtype = next((t.dtype for t in saved if t.name == "attn.probs"), c)
        work = g_res + bsad + 2 * alloc(x.b * x.a * x.s * x.s, p_dtype)
    out.append(Moment("attention", held, work, "mlp+o"))
    if tr.finetune != "full":  # adapters' tensors, QLoRA's dequantized weights
        from vramcalc.terms.finetune_activations import adjust_moments

        out = adjust_moments(ctx, out, saved)
    if tr.precision == "fp8" or tr.qat != "none":  # FP8 / QAT linears' extra saved tensors
        from vramcalc.terms import lowprec

        out = lowprec.adjust_moments(ctx, out, saved)
    if tr.activation_offload and tr.recompute != "full":  # saved tensors in host memory
        from vramcalc.terms.lowmem import offload_moments

        out = offload_moments(ctx, out, saved)
    return out


def final_norm_backward_work_bytes(ctx: RankContext) -> int:
    """transformers' Python RMSNorm backward through the final norm (the first one, with
    every layer's activations still held): d x̂, the rsqrt/pow/mean chain and d x, five
    fp32 (b, s, h) temporaries at once (its x̂ copy and lm_head's input are freed)."""
    if (ctx.training.framework != "hf" or ctx.spec.norm_kind != "rmsnorm"
            or not ctx.is_last_stage or not ctx.spec.final_norm):
        return 0
    x = dims(ctx)
    return 5 * alloc(_bsh(x), "fp32")


def layer_grad_fraction(ctx: RankContext, part: str) -> float:
    """Share of one layer's gradient bytes in the parameter groups `part` names: "down"
    (the MLP's output projection), "shared" (shared experts), "mlp+o" (the MLP or MoE,
    the post-attention norm and the attention output projection)."""
    prefixes: tuple[str, ...] = {
        "down": ("mlp.down_proj.", "mlp.proj."),
        "shared": ("shared_expert",),
        "mlp+o": ("mlp.", "experts.", "router.", "shared_expert", "post_attention_layernorm.",
                  "attn.o_proj."),
    }[part]
    done = every = 0
    for t in ctx.tensors:
        if t.group not in ("layer", "expert"):
            continue
        n = t.count * t.numel
        every += n
        if t.name.startswith(prefixes):
            done += n
    return done / every if every else 0.0


# ---- per micro-batch, outside the layers -----------------------------------------------
def embedding_saved(ctx: RankContext) -> list[Saved]:
    """Per micro-batch: token ids and labels (int64), RoPE tables, the eager causal mask."""
    if not (ctx.is_first_stage or ctx.is_last_stage):
        return []
    x = dims(ctx)
    spec, tr = ctx.spec, ctx.training
    hf = tr.framework == "hf"
    out = [Saved("input_ids", x.b * x.s, "int64", "(b, s)", "kept by the embedding"),
           Saved("labels", x.b * x.s, "int64", "(b, s)", "the loader's batch")]
    if hf and tr.recompute != "none":
        # the checkpointed calls keep the model's position ids (and eager's float mask)
        out.append(Saved("position_ids", x.s, "int64", "(s)", "checkpoint input"))
        if tr.attention == "eager":
            out.append(Saved("attn.mask", x.b * x.s * x.s, x.r, "(b, 1, s, s)",
                             "additive causal mask, checkpoint input"))
    if spec.position_embedding == "rope":
        # cos, sin (s, d): reference in c, hf in the residual dtype
        out.append(Saved("rope.cos_sin", x.s * x.d, x.r if hf else x.c, "(s, d)",
                         "rotary tables, kept by q·cos, q·sin of every layer", 2))
    elif ctx.is_first_stage:
        out.append(Saved("positions", x.s, "int64", "(s)", "position ids, kept by embedding"))
    if tr.attention == "eager" and not hf:
        out.append(Saved("attn.mask", x.s * x.s, "bool", "(s, s)", "causal mask, masked_fill"))
    return out


def head_saved(ctx: RankContext) -> list[Saved]:
    """Last stage: final norm input/statistics and the lm_head input."""
    if not ctx.is_last_stage:
        return []
    x = dims(ctx)
    out: list[Saved] = []
    if ctx.spec.final_norm:
        out += _norm_saved(ctx, x, "final_norm", x.T, x.h, "(b, s, h)")
    out += _linear_inputs(x, "lm_head.input", _bsh(x), 1, "(b, s, h) normed")
    if ctx.training.finetune != "full":  # frozen lm_head
        from vramcalc.terms.finetune_activations import adjust_head_saved

        out = adjust_head_saved(ctx, out)
    if ctx.training.chunked_ce > 1:  # lm_head runs per chunk (vramcalc/terms/lowmem.py)
        from vramcalc.terms.lowmem import adjust_head_saved_chunked

        out = adjust_head_saved_chunked(ctx, out)
    return out


def activation_dtype_bytes(ctx: RankContext) -> int:
    return DTYPE_BITS[ctx.training.compute_dtype] // 8


# ---- everything the analytic engine needs, once per (model, training, layout, stage) ----
@dataclass(frozen=True)
class Profile:
    """Per-micro-batch activation quantities of one rank (bytes); see the functions above."""

    n_dense: int
    dense_layer: int
    n_moe: int
    moe_layer: int
    embedding_side: int  # ids, labels, rope tables, masks (embedding_saved)
    head_side: int  # final norm and lm_head input (head_saved)
    top_moments: tuple[Moment, ...]
    bottom_moments: tuple[Moment, ...]
    eager_forward: tuple[int, int]
    forward_work: int
    forward_end_extra: int
    final_norm_work: int
    head_freed_at_final_norm: int  # lm_head input and the norm's x̂ copy (hf)
    grad_fraction: dict[str, float]
    logits_keep: int
    logits_forward: int
    logits_backward: int
    head_forward_extra: int
    loss_root: int
    autocast_cache_layer: int  # vramcalc.terms.transients, cached here with the rest
    autocast_cache_head: int
    optimizer_step: int

    @property
    def layers(self) -> int:
        return self.n_dense * self.dense_layer + self.n_moe * self.moe_layer

    def bottom_layers(self, n: int) -> int:
        """Activations of the bottom n layers (dense layers come first)."""
        dense = min(n, self.n_dense)
        return dense * self.dense_layer + (n - dense) * self.moe_layer


def profile(ctx: RankContext) -> Profile:
    """The activation profile of a rank (cached: the planner asks for the same one often)."""
    return _profile(ctx.spec, ctx.training, ctx.parallel, ctx.stage)


@lru_cache(maxsize=8192)
def _profile(spec: ModelSpec, training: TrainingConfig, parallel: ParallelConfig,
             stage: int) -> Profile:
    from vramcalc.terms import logits as lg  # both import this module
    from vramcalc.terms import transients as tr

    ctx = RankContext(spec, training, parallel, stage)
    n_dense, dense, n_moe, moe = stage_layer_bytes(ctx)
    top_moe, bottom_moe = n_moe > 0, n_dense == 0
    return Profile(
        n_dense=n_dense, dense_layer=dense, n_moe=n_moe, moe_layer=moe,
        embedding_side=sum(t.nbytes for t in embedding_saved(ctx)),
        head_side=sum(t.nbytes for t in head_saved(ctx)),
        top_moments=tuple(layer_backward_moments(ctx, top_moe)) if ctx.num_layers else (),
        bottom_moments=tuple(layer_backward_moments(ctx, bottom_moe)) if ctx.num_layers
        else (),
        eager_forward=eager_forward_moment(ctx),
        forward_work=layer_forward_working_bytes(ctx),
        forward_end_extra=forward_end_extra_bytes(ctx),
        final_norm_work=final_norm_backward_work_bytes(ctx),
        head_freed_at_final_norm=sum(t.nbytes for t in head_saved(ctx) if t.name.startswith(
            ("lm_head.", "final_norm.xhat"))),
        grad_fraction={part: layer_grad_fraction(ctx, part)
                       for part in ("down", "shared", "mlp+o")},
        logits_keep=lg.logits_saved_bytes(ctx),
        logits_forward=lg.logits_forward_peak_bytes(ctx),
        logits_backward=lg.logits_backward_peak_bytes(ctx),
        head_forward_extra=lg.head_forward_extra_bytes(ctx),
        loss_root=lg.loss_root_bytes(ctx),
        autocast_cache_layer=tr._autocast_cache_layer_bytes(ctx),
        autocast_cache_head=tr.autocast_cache_head_bytes(ctx),
        optimizer_step=tr._optimizer_step_temp_bytes(ctx),
    )
