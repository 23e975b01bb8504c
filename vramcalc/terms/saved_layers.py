"""The saved-tensor tables of full training, per profile: what one transformer layer, the
embedding side and the head side keep for backward, before any modifier (fine-tuning, low
precision, ...) changes them. Legend and profiles: vramcalc/terms/saved.py; the tables with
their sources: docs/saved-tensors.md.
"""

from __future__ import annotations

from vramcalc.features import finetunes
from vramcalc.rank import RankContext
from vramcalc.terms import encoder as enc
from vramcalc.terms import modernbert as mb
from vramcalc.terms import torchtitan_tp as ttp
from vramcalc.terms.packed import packed_batch_saved
from vramcalc.terms.saved import Dims, Saved, bsh, dims, hf_family, qlora_fp32_outputs
from vramcalc.terms.unsloth import layer_rope_caches, offloads_checkpoints
from vramcalc.units import ceil_div


# ---- building blocks ------------------------------------------------------------------
def _linear_inputs(x: Dims, name: str, numel: int, readers: int, shape: str) -> list[Saved]:
    """Input of `readers` linears: kept once in r, or one c-typed cast each under autocast."""
    if x.amp:
        return [Saved(f"{name}.cast", numel, x.c, shape,
                      "autocast's c copy of the input, one per linear", readers)]
    return [Saved(name, numel, x.c, shape, "input of the projection(s), for the weight grad")]


def norm_saved(ctx: RankContext, x: Dims, name: str, tokens: int, width: int,
                shape: str) -> list[Saved]:
    """A norm over `width` of `tokens` rows, as the profile implements it (output excluded)."""
    numel = tokens * width
    stats = shape.replace(", h)", ")") if shape.endswith(", h)") else "(rows)"
    if ctx.spec.norm_kind == "layernorm":  # nn.LayerNorm (both profiles): native_layer_norm
        return [Saved(f"{name}.input", numel, x.r, shape, "LayerNorm input"),
                Saved(f"{name}.mean", tokens, "fp32", stats, "fp32 mean (CUDA acc type)"),
                Saved(f"{name}.rstd", tokens, "fp32", stats, "fp32 1/std")]
    if ctx.training.framework == "lightning" and ctx.training.litgpt_norm == "input":
        # lit-gpt before 6178c7cc (8641822 lit_gpt/rmsnorm.py), in the input's dtype: x·x and
        # x·rsqrt keep x, rsqrt keeps its output; weight · x̂ keeps x̂ for the weight's gradient
        return [Saved(f"{name}.input", numel, x.r, shape, "RMSNorm input (x·x, x·rsqrt)"),
                Saved(f"{name}.rstd", tokens, x.r, stats, "rsqrt output, input dtype"),
                Saved(f"{name}.xhat", numel, x.r, shape, "x̂, kept by weight · x̂")]
    if ctx.training.framework == "lightning":
        # LitGPT since lit-gpt 6178c7cc (litgpt/model.py RMSNorm at 00af8b0d and 26857050):
        # x = x.float(); x·x and x·rsqrt keep the fp32 x (the input itself when it is fp32),
        # rsqrt its fp32 output; (x̂ · weight.float()).to(dtype) keeps the fp32 x̂ for the
        # weight's gradient
        return [Saved(f"{name}.x_fp32", numel, "fp32", shape, "x.float(), kept by x·x, x·rsqrt"),
                Saved(f"{name}.rstd", tokens, "fp32", stats, "rsqrt output, fp32"),
                Saved(f"{name}.xhat_fp32", numel, "fp32", shape, "x̂ fp32, kept by x̂ · w")]
    if ctx.training.framework not in ("hf", "torchtitan", "torchtune"):  # fused RMSNorm: input + fp32 rstd
        return [Saved(f"{name}.input", numel, x.r, shape, "RMSNorm input (fused kernel)"),
                Saved(f"{name}.rstd", tokens, "fp32", stats, "fp32 1/rms (fused kernel)")]
    # transformers RMSNorm: x32 = x.float(); x32 * rsqrt(mean(x32²) + eps) -> weight * (·).to(r);
    # torchtitan's (models/norms.py RMSNorm) and torchtune's (modules/rms_norm.py) are the
    # same: (x32 · rsqrt(·)).type_as(x) * weight
    out = [Saved(f"{name}.x_fp32", numel, "fp32", shape,
                 "x.to(float32), kept by pow and mul (the residual itself when r = fp32)"),
           Saved(f"{name}.rstd", tokens, "fp32", stats, "rsqrt output, kept by mul")]
    if ctx.training.framework == "hf" and hf_family(ctx) == "gemma":  # x̂32·(1 + w), type_as
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


def mla_saved(ctx: RankContext, x: Dims) -> list[Saved]:
    """Multi-latent attention, reference profile, flash attention, one TP rank
    (vramcalc/trace/reference_model.py `MLAttention`; scenario.py `mla_unsupported` refuses
    the rest). Letters: vramcalc/model.py (qr, kr, dn, dr, dv); d = dn + dr.

    The rotary halves and `torch.cat` keep nothing (their backward needs only cos/sin and
    sizes); v (b, a, s, dv) is padded to d so the fused kernel runs with equal head dims, as
    transformers' flash integration does (Megatron-LM pads only THD packing), and the
    output is cropped back to dv: the crop is strided, so o_proj's input is a copy."""
    spec = ctx.spec
    T, c = x.T, x.c
    qr, kr = spec.q_lora_rank, spec.kv_lora_rank or 0
    dr, dv = spec.qk_rope_head_dim or 0, spec.v_head_dim or 0
    bsad = x.b * x.s * x.a * x.d
    out = _linear_inputs(x, "attn.input", bsh(x), 2, "(b, s, h) normed")  # q_a or q, kv_a
    if qr:
        out += norm_saved(ctx, x, "attn.q_a_layernorm", T, qr, "(T, qr)")
        out += _linear_inputs(x, "attn.q_b.input", T * qr, 1, "(T, qr) normed")
    if x.amp:  # the norm upcasts its 16-bit input: that fp32 copy is what it keeps
        out += norm_saved(ctx, x, "attn.kv_a_layernorm", T, kr, "(T, kr)")
    else:  # the norm keeps its input, a view of kv_a's whole output
        out += [Saved("attn.kv_a_out", T * (kr + dr), c, "(T, kr + dr)",
                      "kv_a_proj output; the latent the norm keeps is a view of it"),
                Saved("attn.kv_a_layernorm.rstd", T, "fp32", "(rows)", "fp32 1/rms")]
    out += _linear_inputs(x, "attn.kv_b.input", T * kr, 1, "(T, kr) normed")
    if ctx.training.attention == "eager":
        return out + _mla_eager_core(ctx, x)
    out += [Saved("attn.q", bsad, c, "(b, a, s, d)", "cat(q_nope, rotated q_rope)"),
            Saved("attn.k", bsad, c, "(b, a, s, d)", "cat(k_nope, rotated shared k_rope)")]
    if dv == x.d:  # no pad: v is a view of kv_b's output, o_proj's input a view of the output
        out.append(Saved("attn.kv", T * x.a * (x.d - dr + dv), c, "(T, a·(dn+dv))",
                         "kv_b_proj output, kept through the v view"))
    else:
        out.append(Saved("attn.v", bsad, c, "(b, a, s, d)", "v padded from dv to d"))
    if ctx.training.recompute != "selective":
        out += [Saved("attn.out", bsad, c, "(b, a, s, d)", "SDPA output, kept by SDPA"),
                Saved("attn.lse", x.b * x.a * x.s, "fp32", "(b, a, s)", "logsumexp, fp32")]
    elif dv == x.d:  # the checkpointed core keeps its inputs; o_proj a view of its output
        out.append(Saved("attn.out", bsad, c, "(b, a, s, d)",
                         "core output, kept by o_proj (the core is recomputed)"))
    if dv != x.d:
        out.append(Saved("attn.o_input", T * x.a * dv, c, "(b, s, a·dv)",
                         "copy of the output cropped to dv, o_proj input"))
    return out


def _mla_eager_core(ctx: RankContext, x: Dims) -> list[Saved]:
    """MLA's written-out core (v unpadded, (b, a, s, dv)) and o_proj's input copy."""
    spec, c = ctx.spec, x.c
    dn, dv = spec.qk_nope_head_dim or 0, spec.v_head_dim or 0
    bsad, bsav = x.b * x.s * x.a * x.d, x.b * x.s * x.a * dv
    o_input = Saved("attn.o_input", bsav, c, "(b, s, a·dv)", "contiguous copy for o_proj")
    if ctx.training.recompute == "selective":  # the checkpoint keeps the core's inputs
        return [Saved("attn.q", bsad, c, "(b, s, a, d)", "cat output, checkpoint input"),
                Saved("attn.k", bsad, c, "(b, s, a, d)", "cat output, checkpoint input"),
                Saved("attn.kv", x.T * x.a * (dn + dv), c, "(T, a·(dn+dv))",
                      "kv_b_proj output, kept through the v view"), o_input]
    return [Saved("attn.q", bsad, c, "(b, a, s, d)", "contiguous q for q @ kᵀ"),
            Saved("attn.k", bsad, c, "(b, a, s, d)", "contiguous k"),
            Saved("attn.v", bsav, c, "(b, a, s, dv)", "contiguous v for probs @ v"),
            *attention_core_saved(ctx, x), o_input]


def _attention_saved(ctx: RankContext, x: Dims) -> list[Saved]:
    """q/k/v projections to o_proj input (attention core included unless selective)."""
    spec, tr = ctx.spec, ctx.training
    if spec.is_mla:
        return mla_saved(ctx, x)
    hf = tr.framework == "hf"
    fam = hf_family(ctx) if hf else "reference"
    c = x.c
    bsad, bsgd = x.b * x.s * x.a * x.d, x.b * x.s * x.g * x.d
    eager = tr.attention == "eager"
    selective = tr.recompute == "selective"
    # LitGPT's CausalSelfAttention (8641822 lit_gpt/model.py) projects q, k, v with one
    # `attn` linear, ropes q and k into new tensors (torch.cat) and hands SDPA v as a view
    # of the fused output: Phi-3's layout below
    fused_qkv = fam in ("gpt2", "phi3") or tr.framework == "lightning"
    out = _linear_inputs(x, "attn.input", bsh(x), 1 if fused_qkv else 3, "(b, s, h) normed")
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
    elif fused_qkv:  # phi3, lightning: q and k rotated copies, v a view of the qkv output
        qk = x.r if (x.amp and selective) else c  # see below
        v_kept = (Saved("attn.v", bsgd, c, "(b, g, s, d)", "autocast's cast of the fp32 v")
                  if _qkv_in_residual_dtype(ctx, x) and not selective else
                  Saved("attn.qkv", x.b * x.s * (x.a + 2 * x.g) * x.d, c, "(b, s, (a+2g)·d)",
                        "fused qkv_proj output, alive through the v view"))
        qkv = [v_kept, Saved("attn.q", bsad, qk, "(b, a, s, d)", "rotated q"),
               Saved("attn.k", bsgd, qk, "(b, g, s, d)", "rotated k")]
    else:
        # hf RoPE runs in r under autocast (its tables are in the residual dtype), as the
        # reference model's q/k norms (F.rms_norm, on the fp32 list): SDPA keeps 16-bit casts
        # of q, k, a checkpoint around the core its fp32 inputs (Liger's RoPE rotates the
        # c-typed projections in place: terms/liger.py)
        qk = x.r if (x.amp and rope and selective and not tr.liger and (
            hf or (ctx.spec.qk_norm and tr.framework == "reference"))) else c
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


def _qkv_in_residual_dtype(ctx: RankContext, x: Dims) -> bool:
    """QLoRA under autocast: bitsandbytes' Linear4bit returns its input's dtype, so a fused
    4-bit qkv fed by an fp32 norm gives fp32; attention keeps autocast's 16-bit cast of v."""
    return qlora_fp32_outputs(ctx, x) and x.r != x.c


def _hf_eager_qkv(ctx: RankContext, x: Dims, fam: str) -> list[Saved]:
    """hf eager attention's q, k, v as kept by the two matmuls (repeat_kv copies for GQA)."""
    c, bsad = x.c, x.b * x.s * x.a * x.d
    bsgd, cast = x.b * x.s * x.g * x.d, _qkv_in_residual_dtype(ctx, x)
    if fam == "gpt2":  # views of c_attn's output; of a 4-bit one's (fp32) matmul keeps casts
        return ([Saved(f"attn.{n}", bsad, c, "(b, a, s, d)", f"cast of the {n} view") for n in "qkv"]
                if cast else [Saved("attn.qkv", 3 * bsad, c, "(b, s, 3·h)", "fused c_attn output")])
    # repeat_kv copies k, v unless g = a or g = 1 = b (a view); autocast's cast for the matmul of an
    # fp32 k (rotated by fp32 cos, sin under amp) or v (4-bit, autocast) is (b, a, s, d)
    v_keep = bsgd if (x.g == x.a or x.g == 1 == x.b) and not cast else bsad
    k_keep = v_keep if x.r == x.c else bsad
    out = [Saved("attn.q", bsad, c, "(b, a, s, d)", "rotated q"),
           Saved("attn.k", k_keep, c, "(b, a, s, d)", "rotated k (repeat_kv copy for GQA)")]
    # Phi-3's v is a view of the fused qkv output, kept as such unless repeat_kv copies it
    # or matmul cannot fold (b, a) into one batch dimension (b > 1) and copies it
    v_view = fam == "phi3" and x.b == 1 and (x.g == x.a or x.g == 1) and not cast
    if v_view:
        out.append(Saved("attn.qkv", x.b * x.s * (x.a + 2 * x.g) * x.d, c, "(b, s, (a+2g)·d)",
                         "fused qkv_proj output, kept through the v view"))
    else:
        out.append(Saved("attn.v", v_keep, c, "(b, a, s, d)", "v (repeat_kv copy for GQA)"))
    return out


def mlp_saved(ctx: RankContext, x: Dims, tokens: int, ffn: int, name: str = "mlp",
               readers_input: bool = True, rows: int | None = None) -> list[Saved]:
    """A dense MLP on `tokens` rows (input included when `readers_input`); its (·, ffn)
    intermediates on `rows` (default `tokens`; the dense layer's under TP: `Dims.N`)."""
    c, bsf = x.c, (tokens if rows is None else rows) * ffn
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
            if ctx.spec.hidden_act != "relu":  # relu keeps its output (the act), not the gate
                out.append(Saved(f"{name}.gate", bsf, c, "(T, f)", "activation input"))
            out.append(Saved(f"{name}.up", bsf, c, "(T, f)", "kept by act · up"))
        out += [Saved(f"{name}.act", bsf, c, "(T, f)", "activation output, kept by act · up"),
                Saved(f"{name}.down_input", bsf, c, "(T, f)", "act · up, down_proj input")]
        return out
    if readers_input:
        out += _linear_inputs(x, f"{name}.input", tokens * x.h, 1, "(T, h) normed")
    act = ctx.spec.hidden_act
    if act == "relu":  # threshold_backward reads relu's output, which is also proj's input
        return [*out, Saved(f"{name}.act", bsf, c, "(T, f)", "relu output, proj input")]
    # relu2 (square(relu(x))): relu's output, kept by relu and by the square (under
    # autocast the square runs on an fp32 copy, which it keeps: pow is on CUDA's fp32 list)
    if hf and act == "gelu_new" and x.amp:  # pow keeps its fp32 copy of the fc output
        out.append(Saved(f"{name}.fc_out", bsf, "fp32", "(T, f)", "pow's fp32 input"))
    else:
        out.append(Saved(f"{name}.fc_out", bsf, c, "(T, f)",
                         "relu output" if act == "relu2" else "activation input"))
    if act == "relu2" and x.amp:
        out.append(Saved(f"{name}.relu2.fp32", bsf, "fp32", "(T, f)", "fp32 relu output"))
    if hf and act == "gelu_new":
        out += _new_gelu_saved(x, bsf, name)
    else:
        out.append(Saved(f"{name}.act", bsf, c, "(T, f)", "activation output, proj input"))
    return out


def _new_gelu_saved(x: Dims, bsf: int, name: str) -> list[Saved]:
    """transformers NewGELUActivation in Python: 0.5·x·(1 + tanh(√(2/π)(x + 0.044715·x³)))."""
    c = x.c
    p_dtype = "fp32" if x.amp else c  # pow is on CUDA's autocast fp32 list
    # the activation output is fp32 under autocast; c_proj keeps its 16-bit cast
    return [Saved(f"{name}.gelu.half_x", bsf, c, "(T, f)", "0.5·x, kept by the product"),
            Saved(f"{name}.gelu.tanh", bsf, p_dtype, "(T, f)", "tanh output"),
            Saved(f"{name}.gelu.one_plus", bsf, p_dtype, "(T, f)", "1 + tanh, kept by product"),
            Saved(f"{name}.act", bsf, c, "(T, f)", "activation output (its cast), c_proj input")]


def moe_saved(ctx: RankContext, x: Dims) -> list[Saved]:
    """A mixture-of-experts MLP (router, top-k dispatch, experts, combine, shared experts)."""
    spec = ctx.spec
    c, T = x.c, x.T
    E, k = spec.num_local_experts, spec.num_experts_per_tok
    fe = ceil_div(spec.expert_ffn, ctx.parallel.expert_tp)  # experts split over expert TP
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
            for t in mlp_saved(ctx, x, C, fe, readers_input=False)]
    out += [Saved("moe.expert_output", EC * x.h, c, "(E·C, h)", "cat of expert outputs"),
            Saved("moe.weighted", EC * x.h, x.r, "(E·C, h)",
                  "outputs · gate; index_add's backward formula keeps its source")]
    fs = ceil_div(spec.shared_ffn, ctx.parallel.tp)
    for i in range(shared):
        out += mlp_saved(ctx, x, T, fs, name=f"shared_expert{i}", readers_input=False)
        if spec.shared_expert_gate:
            out += [Saved(f"shared_expert{i}.output", T * x.h, c, "(T, h)", "kept by gate ·"),
                    Saved(f"shared_expert{i}.sigmoid", T, c, "(T, 1)", "sigmoid output")]
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
        out += mlp_saved(ctx, x, T, fs, name="shared_expert", readers_input=False)
        out += [Saved("shared_expert.output", T * x.h, c, "(T, h)", "kept by gate ·"),
                Saved("shared_expert.sigmoid", T, c, "(T, 1)", "sigmoid output")]
    return out


# ---- per layer -------------------------------------------------------------------------
def checkpoint_saved(ctx: RankContext) -> list[Saved]:
    """A layer under full recompute: torch.utils.checkpoint keeps only the layer input."""
    x = dims(ctx)
    return [Saved("layer.input", bsh(x), x.r, "(b, s, h)", "checkpoint input")]


def plain_layer_saved(ctx: RankContext, moe: bool) -> list[Saved]:
    """Saved tensors of one transformer layer for one micro-batch, full training without
    full recompute (reference/hf profiles; no modifier applied): input norm, attention,
    post-attention norm, then the dense MLP or the mixture of experts (`moe`); an encoder's
    post-LayerNorm layer (vramcalc/terms/encoder.py)."""
    if ctx.spec.is_encoder:
        return (mb if mb.is_modernbert(ctx) else enc).layer_saved(ctx)
    x = dims(ctx)
    out = norm_saved(ctx, x, "input_norm", x.T, x.h, "(b, s, h)")
    out += _attention_saved(ctx, x)
    if ctx.spec.parallel_residual:
        return out + _parallel_mlp_saved(ctx, x)
    out += norm_saved(ctx, x, "post_norm", x.T, x.h, "(b, s, h)")
    if moe:
        out += moe_saved(ctx, x)
    else:
        out += mlp_saved(ctx, x, x.T, ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp),
                         rows=x.N)
    return out


def _parallel_mlp_saved(ctx: RankContext, x: Dims) -> list[Saved]:
    """The MLP branch of a parallel block, x + attn(norm(x)) + mlp(norm'(x)): no residual
    between the branches. One shared norm (phi, GPT-J: num_layer_norms 1): the MLP reads the
    attention's normed input, so its input is that storage (a separate cast under autocast).
    Two norms (GPT-NeoX use_parallel_residual): the second norm's input is the block input
    the first already keeps; its statistics are its own."""
    f = ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp)
    mlp = mlp_saved(ctx, x, x.T, f, rows=x.N)
    if ctx.spec.num_layer_norms == 1:
        return [t for t in mlp if x.amp or t.name != "mlp.input"]
    norm = norm_saved(ctx, x, "post_norm", x.T, x.h, "(b, s, h)")
    return [t for t in norm if t.name != "post_norm.input"] + mlp


# ---- per micro-batch, outside the layers -----------------------------------------------
def embedding_saved(ctx: RankContext) -> list[Saved]:
    """Per micro-batch: token ids and labels (int64), RoPE tables, the eager causal mask."""
    if not (ctx.is_first_stage or ctx.is_last_stage):
        return []
    if ctx.spec.is_encoder:  # vramcalc/terms/encoder.py
        return (mb if mb.is_modernbert(ctx) else enc).embedding_saved(ctx)
    x = dims(ctx)
    spec, tr = ctx.spec, ctx.training
    hf = tr.framework == "hf"
    out = [Saved("input_ids", x.b * x.s, "int64", "(b, s)", "kept by the embedding"),
           Saved("labels", x.b * x.s, "int64", "(b, s)", "the loader's batch")]
    if tr.packed:  # torchtune's input_pos and document mask (vramcalc/terms/packed.py)
        out += packed_batch_saved(ctx)
    if tr.lora_embedding and ctx.is_first_stage:
        # PEFT lora.Embedding: after_A = F.embedding(ids, Aᵀ) (T, r) in the adapters' dtype,
        # kept by after_A @ Bᵀ (under autocast its 16-bit cast is what the matmul keeps)
        out.append(Saved("lora.embed.a_out", x.T * tr.lora_rank, x.c if x.amp or tr.autocast_16bit
                         else tr.adapter_dtype, "(T, r)", "kept by B"))
    if hf and tr.recompute != "none":
        # the checkpointed calls keep the model's position ids (and eager's float mask)
        out.append(Saved("position_ids", x.s, "int64", "(s)", "checkpoint input"))
        if tr.attention == "eager":
            out.append(Saved("attn.mask", x.b * x.s * x.s, x.r, "(b, 1, s, s)",
                             "additive causal mask, checkpoint input"))
    # the embedding output made a leaf requiring grad (enable_input_require_grads) is held by
    # its AccumulateGrad: Unsloth offloads it; under PEFT GPT-2 adds the positions to it
    peft_leaf = (hf and tr.recompute == "full" and finetunes(tr) and not tr.lora_embedding
                 and "embed_tokens" not in tr.modules_to_save and spec.position_embedding == "learned")
    if (offloads_checkpoints(ctx) or peft_leaf) and ctx.is_first_stage:
        out.append(Saved("unsloth.embedding_output" if not peft_leaf else "inputs_embeds",
                         x.T * x.h, x.r, "(b, s, h)", "leaf held by its AccumulateGrad"))
    if spec.position_embedding == "rope" and tr.framework in ("torchtitan", "torchtune"):
        pass  # RoPE reads a buffer (torchtitan's freqs_cis, torchtune's cache): nothing saved
    elif spec.position_embedding == "rope" and not layer_rope_caches(ctx):
        # cos, sin (s, d): reference in c, hf in the residual dtype; MLA rotates dr dims
        width = spec.qk_rope_head_dim or x.d
        out.append(Saved("rope.cos_sin", x.s * width, x.r if hf else x.c, "(s, d)",
                         "rotary tables, kept by q·cos, q·sin of every layer", 2))
    elif ctx.is_first_stage:
        out.append(Saved("positions", x.s, "int64", "(s)", "position ids, kept by embedding"))
    if tr.attention == "eager" and not hf:
        out.append(Saved("attn.mask", x.s * x.s, "bool", "(s, s)", "causal mask, masked_fill"))
    return out


def plain_head_saved(ctx: RankContext) -> list[Saved]:
    """Last stage, full training: final norm input/statistics and the lm_head input (an
    encoder's head: vramcalc/terms/encoder.py)."""
    if ctx.spec.is_encoder:
        return (mb if mb.is_modernbert(ctx) else enc).head_saved(ctx)
    x = dims(ctx)
    out: list[Saved] = []
    if ctx.spec.final_norm:
        out += norm_saved(ctx, x, "final_norm", x.T, x.h, "(b, s, h)")
    if ttp.loss_parallel(ctx):  # torchtitan's ColwiseParallel head saves the gathered input
        return out + [Saved("lm_head.input", ttp.head_input_numel(ctx), x.c, "(b, s, h)",
                            "all-gathered normed input of the vocab-parallel head")]
    out += _linear_inputs(x, "lm_head.input", bsh(x), 1, "(b, s, h) normed")
    return out
