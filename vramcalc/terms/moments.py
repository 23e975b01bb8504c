"""Instants inside one layer (and around the head) where a rank's memory can peak: the
backward moments of a layer, eager attention's softmax in forward, the final norm, and the
share of a layer's gradients that exists at each. Legend: vramcalc/terms/saved.py. These
functions take the layer's saved lists as arguments; vramcalc.terms.activations composes
them with the rank's modifiers.
"""

from __future__ import annotations

from vramcalc.features import finetunes
from vramcalc.rank import RankContext
from vramcalc.terms import encoder as enc
from vramcalc.terms import modernbert as mb
from vramcalc.terms.moe_instants import combine_moment, last_expert_moment
from vramcalc.terms.saved import (
    Moment,
    Saved,
    bsh,
    dims,
    expert_capacity,
    flash_scratch_bytes,
    gpt2_block_attn_output,
    hf_family,
    qlora_fp32_outputs,
    relu_output_is_down_input,
    returned_attn_weights,
)
from vramcalc.terms.torchtitan import checkpointed_forward_work as tt_checkpointed_forward_work
from vramcalc.terms.torchtitan import recompute_extra as tt_recompute_extra
from vramcalc.units import alloc, ceil_div


def plain_forward_working_bytes(ctx: RankContext) -> int:
    """Temporaries at the end of one layer's forward beyond what it saves: the MLP output
    (T·h in c) next to the new residual (T·h in r). Under full recompute nothing inside the
    layer is kept, and its MLP runs with every intermediate alive at once beside the normed
    input and the residual after attention: gate, up, act and act·up (4·T·f), or fc and act
    (2·T·f; relu2: fc, relu and the square)."""
    if ctx.spec.is_encoder:  # vramcalc/terms/encoder.py
        return (mb if mb.is_modernbert(ctx) else enc).forward_working_bytes(ctx)
    x = dims(ctx)
    held = returned_attn_weights(ctx, x) + gpt2_block_attn_output(ctx, x)
    out = alloc(bsh(x), x.c) + alloc(bsh(x), x.r) + held
    if ctx.training.framework == "torchtitan":
        return max(out, tt_checkpointed_forward_work(ctx))
    if (ctx.training.recompute != "full" and ctx.spec.mlp_kind != "gated"
            and ctx.spec.hidden_act in ("relu", "relu2")):
        # relu keeps its output, not its input: fc's output, the activation's argument, is
        # bound until the activation returns, beside everything the layer saves
        out = max(out, alloc(x.N * ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp),
                             x.c) + held)
    if ctx.training.recompute == "full":
        f = ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp)
        n = 4 if ctx.spec.mlp_kind == "gated" else 2
        dt = x.c
        mlp = 0
        if ctx.training.liger:  # a, b and c (terms/liger.py) beside the normed input Y (r)
            # and the attention's residual
            n, normed = 3, 2 * alloc(bsh(x), x.r)
        elif qlora_fp32_outputs(ctx, x):
            # bitsandbytes' Linear4bit returns its input's dtype, fp32 under autocast: up,
            # act and act·up (gate is freed once act exists) in fp32, beside the normed input
            # and the attention's residual
            n, normed, dt = (3 if ctx.spec.mlp_kind == "gated" else 2), 2 * alloc(
                bsh(x), x.r), x.r
        elif ctx.spec.mlp_kind == "gated":
            # act(gate(x)) * up(x): gate's output is freed once act exists, so act, up and
            # act·up beside the normed input and the residual after attention (both r)
            n, normed = 3, 2 * alloc(bsh(x), x.r)
        else:
            # proj(act(fc(x))): the normed input and the residual after attention (both r),
            # fc's output (the activation's argument, bound until it returns) and act's;
            # relu2's square(relu(·)) adds the square, under autocast in fp32 (pow is on
            # CUDA's fp32 list) beside relu's fp32 copy
            normed = 2 * alloc(bsh(x), x.r)
            if ctx.spec.hidden_act == "relu2":
                n, mlp = 2, (2 * alloc(x.N * f, "fp32") if x.amp else alloc(x.N * f, dt))
        # the caller counts the layer's autocast weight casts (transients.py
        # `_autocast_cache_layer_bytes`): down's is made after this instant
        later = alloc(ceil_div(ctx.spec.hidden_size * ctx.spec.intermediate_size,
                               ctx.parallel.tp), x.c) if (
            ctx.training.is_autocast and ctx.engine != "fsdp2"
            and not finetunes(ctx.training)) else 0
        out = max(out, normed + n * alloc(x.N * f, dt) + mlp + held - later)
        if (ctx.training.finetune in ("lora", "dora") and x.amp and not ctx.training.liger
                and ctx.spec.mlp_kind == "gated"):
            # frozen fp32 weights under autocast are cast at every call (no cache: they need
            # no gradient): at up's matmul its weight's cast and the normed input's, beside
            # act and up's output
            w_up = alloc(ceil_div(ctx.spec.hidden_size * ctx.spec.intermediate_size,
                                  ctx.parallel.tp), x.c)
            out = max(out, normed + 2 * alloc(x.N * f, dt) + w_up + alloc(bsh(x), x.c) + held)
    return out


def checkpoint_input_extra(ctx: RankContext) -> int:
    """A recomputed layer's checkpointed input, held beside the re-run's saved tensors when
    its first norm saves an fp32 copy instead of the input itself (hf's and torchtitan's /
    torchtune's RMSNorm); 0 otherwise (the saved list holds it)."""
    tr = ctx.training
    x = dims(ctx)
    if tr.recompute == "full" and tr.framework == "hf" and x.r != "fp32" and (
            ctx.spec.norm_kind == "rmsnorm") and not tr.liger:  # LigerRMSNorm keeps x itself
        return alloc(bsh(x), x.r)  # the checkpoint keeps the input next to hf's fp32 copy
    if tr.framework in ("torchtitan", "torchtune") and tr.recompute != "none" and not (
            tr.compile):  # a compiled layer keeps the checkpoint's input itself
        return tt_recompute_extra(ctx)  # the same beside torchtitan's (torchtune's) norm copy
    return 0


def plain_backward_moments(ctx: RankContext, moe: bool, saved: list[Saved],
                           mlp_saved: list[Saved]) -> list[Moment]:
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
    (non-recomputed) saved set again at these instants: `saved` is the layer's saved list
    without recompute, `mlp_saved` what it holds before the attention core (under selective
    recompute its own saved list, else `saved`).
    """
    x = dims(ctx)
    tr = ctx.training
    total = sum(t.nbytes for t in mlp_saved)
    extra = checkpoint_input_extra(ctx)
    if ctx.spec.is_encoder:  # vramcalc/terms/encoder.py; the checkpoint keeps x itself
        x = dims(ctx)
        extra = alloc(bsh(x), x.r) if tr.recompute == "full" and x.amp else 0
        return (mb if mb.is_modernbert(ctx) else enc).backward_moments(ctx, saved, extra)
    c, r = x.c, x.r
    g_res = alloc(bsh(x), r)
    out: list[Moment] = []
    # MLP instant
    if moe:
        spec = ctx.spec
        E, k = spec.num_local_experts, spec.num_experts_per_tok
        fe = ceil_div(spec.expert_ffn, ctx.parallel.expert_tp)
        if tr.framework == "hf":
            # the combine's backward: d out (fp32 for Mixtral's fp32 routing weights) is
            # expanded to the T·k rows (a copy), scattered back through the inverse
            # permutation (zeros + index_put), next to d final in fp32 and c
            S = x.T * k
            w = "fp32" if hf_family(ctx) == "mixtral" else c
            work = g_res + 3 * alloc(S * x.h, w) + 2 * alloc(bsh(x), c)
            out.append(Moment("moe", total + extra, work, "shared"))
        else:
            C = expert_capacity(ctx, x.T)
            # the shared experts ran after the combine, so their backward has run first:
            # their saved tensors are freed and dL/d their input (T, h, r) waits for the
            # routed experts' to be added to it
            # (under autocast each shared projection's cast of the input, beside the router's)
            shared = sum(t.nbytes for t in mlp_saved if t.name.startswith("shared_expert")) + sum(
                t.nbytes // t.count * (t.count - 1) for t in mlp_saved
                if t.name == "moe.input.cast")
            held = total + extra - shared
            g = g_res + (alloc(bsh(x), x.r) if spec.num_shared_experts else 0)
            out.append(last_expert_moment(ctx, x, E, C, fe, held, mlp_saved, g))
            # every expert's backward has run: SplitBackward concatenates their dL/d input
            # slices (E·C, h, r) while they live; the experts' saved tensors and the
            # gathered tokens they kept are freed
            own = sum(t.nbytes for t in mlp_saved if t.name.startswith((
                "moe.expert.", "moe.expert_input", "moe.expert_output", "moe.weighted")))
            out.append(Moment("experts_done", held - own,
                              g + 2 * alloc(E * C * x.h, x.r), "experts"))
            out.append(combine_moment(x, E * C, held, mlp_saved, g, tr.recompute == "full"))
    else:
        f = ceil_div(ctx.spec.intermediate_size, ctx.parallel.tp)
        # torchtitan's ColwiseParallel w1/w3 run on the all-gathered (N, h) input: their
        # outputs and gradients are (N, f/t), not the sequence shard's (vramcalc/terms/
        # torchtitan_tp.py)
        rows = x.N  # the column-parallel outputs: every token (vramcalc/terms/saved.py)
        # QLoRA under autocast: the 4-bit linears return fp32, so the MLP's gradients are
        # fp32 (the forward's dtype; plain_forward_working_bytes)
        bsf = alloc(rows * f, x.r if qlora_fp32_outputs(ctx, x) else c)
        kind = ctx.spec.mlp_kind
        gone: tuple[str, ...]
        if kind == "gated":  # act · up backward: d(act·up), d act, d up
            gone, n_f = ("mlp.down_input",), 3
        elif any(t.name == "mlp.gelu.half_x" for t in saved):
            # hf's Python GELU: the 0.5x · (1 + tanh) product's backward: d out, d 0.5x,
            # d (1 + tanh), with only the product (c_proj's input) freed
            gone, n_f = ("mlp.act",), 3
        elif relu_output_is_down_input(ctx):  # d act, d fc; relu's output (proj's input)
            gone, n_f = (), 2  # is kept until threshold_backward has run
        elif ctx.spec.hidden_act == "relu2":
            # square's backward (pow_backward: grad · (2 · r.pow(1))): d act and three
            # temporaries, in fp32 under autocast (pow is on CUDA's fp32 list)
            gone, n_f = ("mlp.act",), 4
            bsf = alloc(rows * f, "fp32" if x.amp else c)
        else:  # the activation's backward: d act, d fc
            gone, n_f = ("mlp.act",), 2
        freed = sum(t.nbytes for t in mlp_saved if t.name in gone)
        work = g_res + n_f * bsf
        out.append(Moment("mlp", total + extra - freed, work, "down"))
    # attention-core instant
    # eager: probs @ v's backward has run (its probs copy and v are freed)
    core_gone: tuple[str, ...] = ("attn.o_input", "attn.probs_c", "attn.v") if (
        tr.attention == "eager") else ("attn.o_input",)
    if tr.attention == "eager" and ctx.spec.position_embedding == "rope":
        # a fused qkv output (Phi-3's qkv_proj) is held by v's view alone once RoPE has made
        # q and k new tensors: it goes with v
        core_gone += ("attn.qkv",)
    held = extra + sum(t.nbytes for t in saved if t.name.startswith(("input_norm.", "attn."))
                       and t.name not in core_gone)
    if tr.attention == "eager" and tr.framework == "hf" and x.b > 1 and (
            hf_family(ctx) == "gpt2") and not qlora_fp32_outputs(ctx, x):
        # GPT-2's matmuls copy q, kᵀ and v out of the fused c_attn output (b > 1: batch and
        # heads do not fold into one dimension); probs @ v's backward has freed v's copy,
        # and under selective recompute the re-run's q and kᵀ copies sit beside the output
        bsad_c = alloc(x.b * x.s * x.a * x.d, c)
        held += 2 * bsad_c if tr.recompute == "selective" else -bsad_c
    if tr.recompute == "selective" and tr.attention == "eager":
        # the checkpointed core's inputs (its own saved list) live until the region's
        # backward ends: the re-run's q and k (kept by q @ kᵀ, whose backward is next) are
        # those tensors (or views of GPT-2's fused output) unless a cast (autocast's, of
        # fp32 q, k, v) or a repeat (GQA) made new ones; its v went with probs @ v's
        # backward, the input v did not
        rerun = {t.name: t for t in saved}
        for t in mlp_saved:
            again = rerun.get(t.name)
            if t.name == "attn.v" or (t.name in ("attn.q", "attn.k", "attn.qkv") and (
                    again is None or (again.numel, again.dtype) != (t.numel, t.dtype))):
                held += t.nbytes
    bsad = alloc(x.b * x.s * x.a * x.d, c)
    if tr.attention == "flash":
        bsgd = alloc(x.b * x.s * x.g * x.d, c)
        scratch = flash_scratch_bytes(x.b, x.a, x.s, x.d)
        repeated = tr.framework in ("torchtitan", "torchtune")
        if x.g < x.a and not repeated:
            scratch += 2 * bsad
        if repeated:  # repeat_kv (torchtune: expand + flatten): SDPA sees a heads of k, v
            bsgd = bsad
        work = g_res + 2 * bsad + 2 * bsgd + scratch
    else:
        p_dtype = next((t.dtype for t in saved if t.name == "attn.probs"), c)
        # dL/dv, in v's dtype: under autocast fp32 from a 4-bit projection (the matmul's
        # gradient for its 16-bit cast of v is cast back)
        dv = alloc(x.b * x.s * x.a * x.d, x.r if qlora_fp32_outputs(ctx, x) else c)
        work = g_res + dv + 2 * alloc(x.b * x.a * x.s * x.s, p_dtype)
    out.append(Moment("attention", held, work, "mlp+o"))
    if chain := rmsnorm_backward_work_bytes(ctx):
        # the Python RMSNorms' backwards, beside dL/d residual: the post-attention norm's
        # after the MLP's (every MLP gradient made; the attention's saved tensors, under
        # selective recompute without its core, and the norm's fp32 input held), the input
        # norm's after the attention's (every gradient of the layer made)
        attn = extra + sum(t.nbytes for t in mlp_saved if t.name.startswith(
            ("input_norm.", "attn.", "lora.q.", "lora.k.", "lora.v.", "lora.qkv.", "lora.o."))
            or t.name == "post_norm.x_fp32")
        out.append(Moment("post_norm", attn, g_res + chain, "mlp"))
        x32 = sum(t.nbytes for t in saved if t.name == "input_norm.x_fp32")
        out.append(Moment("input_norm", extra + x32, g_res + chain, "all"))
    if tr.reentrant and tr.recompute == "full":
        # torch's reentrant CheckpointFunction.backward binds the re-run forward's output
        # (`outputs`, the layer's output, T·h in r) until its inner backward returns; the
        # non-reentrant checkpoint keeps only the tensors the re-run saves
        # (torch/utils/checkpoint.py `CheckpointFunction.backward`)
        out = [Moment(m.name, m.held + g_res, m.work, m.grads) for m in out]
    return out


def rmsnorm_backward_work_bytes(ctx: RankContext) -> int:
    """The Python RMSNorm's backward (transformers' LlamaRMSNorm, torchtune's
    `modules/rms_norm.py`: x32 = x.float(), x32 · rsqrt(mean(x32²) + eps), cast, · w): at
    pow's backward d x̂ in fp32, the x32 · rsqrt term of d x32, mean's expanded gradient
    and pow's three (b, s, h) fp32 temporaries exist at once; 0 where the norm is another
    kernel (LigerRMSNorm's backward writes dX into dY: terms/liger.py)."""
    if (ctx.training.framework not in ("hf", "torchtune") or ctx.spec.norm_kind != "rmsnorm"
            or ctx.training.liger or ctx.spec.is_encoder):
        return 0
    x = dims(ctx)
    return 5 * alloc(bsh(x), "fp32")


def final_norm_backward_work_bytes(ctx: RankContext) -> int:
    """The final norm's backward (the first one, with every layer's activations still
    held): `rmsnorm_backward_work_bytes` (its x̂ copy and lm_head's input are freed)."""
    if not ctx.is_last_stage or not ctx.spec.final_norm:
        return 0
    return rmsnorm_backward_work_bytes(ctx)


_PARTS: dict[str, tuple[str, ...]] = {
    "none": ("-",),  # no parameter: a layer's backward has not started
    "down": ("mlp.down_proj.", "mlp.proj."),
    "shared": ("shared_expert",),
    "experts_but_one": ("shared_expert",),  # + (E − 1)/E of the routed experts below
    "experts": ("shared_expert", "experts."),
    "mlp": ("mlp.", "experts.", "router.", "shared_expert", "post_attention_layernorm."),
    "mlp+o": ("mlp.", "experts.", "router.", "shared_expert", "post_attention_layernorm.",
              "attn.o_proj."),
    "all": ("",),
}
GRAD_PARTS = tuple(_PARTS)
_MOE_ONLY = ("experts.", "router.", "shared_expert")


def _per_layer(ctx: RankContext, moe: bool | None) -> list[tuple[str, float]]:
    """(name, elements) of the layer tensors: of a layer of one kind (`moe`: a MoE layer's
    experts, router and shared experts, a dense layer's MLP, both kinds' attention and
    norms), or (None) of all the rank's layers, proportional to the average layer."""
    n, n_moe = ctx.num_layers, ctx.shapes.num_moe_layers
    out: list[tuple[str, float]] = []
    for t in ctx.tensors:
        if t.group not in ("layer", "expert"):
            continue
        if moe is None:
            out.append((t.name, t.count * t.numel))
            continue
        moe_only, dense_only = t.name.startswith(_MOE_ONLY), t.name.startswith("mlp.")
        if (moe_only and not moe) or (dense_only and moe):
            continue
        having = n_moe if moe_only else n - n_moe if dense_only else n
        if having:
            out.append((t.name, t.count * t.numel / having))
    return out


def layer_grad_fraction(ctx: RankContext, part: str, moe: bool | None = None) -> float:
    """Share of one layer's gradient bytes in the parameter groups `part` names: "down"
    (the MLP's output projection), "shared" (shared experts), "experts" (the routed and
    shared experts), "experts_but_one" (all but one routed expert), "mlp" (the MLP or MoE
    and the post-attention norm), "mlp+o" (and the attention output projection), "all". `moe`: of a layer of
    that kind, else of the rank's average layer."""
    prefixes = _PARTS[part]
    E = ctx.spec.num_local_experts or 1
    done = every = 0.0
    for name, n in _per_layer(ctx, moe):
        every += n
        if name.startswith(prefixes):
            done += n
        elif part == "experts_but_one" and name.startswith("experts."):
            done += n * (E - 1) // E
    return done / every if every else 0.0


def kind_grad_shares(ctx: RankContext) -> tuple[float, float] | None:
    """A dense and a MoE layer's gradient elements relative to the rank's average layer,
    when its layers are of both kinds (an interleaved MoE model, dense layers first); None
    otherwise."""
    n_moe = ctx.shapes.num_moe_layers
    if not ctx.spec.is_moe or not n_moe or n_moe >= ctx.num_layers:
        return None
    avg = sum(n for _, n in _per_layer(ctx, None)) / ctx.num_layers
    if not avg:
        return None
    return (sum(n for _, n in _per_layer(ctx, False)) / avg,
            sum(n for _, n in _per_layer(ctx, True)) / avg)


def eager_forward_moment(ctx: RankContext, saved: list[Saved]) -> tuple[int, int]:
    """Eager attention's forward peak inside one layer, at the softmax: (bytes of the layer's
    saved tensors that exist by then, temporaries). The softmax input (scores, c) and output
    (probs, in the softmax dtype) coexist; under autocast CUDA's fp32 rule adds the fp32
    copy of the input. `saved`: a dense layer's saved list without recompute."""
    if ctx.spec.is_encoder:  # vramcalc/terms/encoder.py
        return (mb if mb.is_modernbert(ctx) else enc).eager_forward_moment(ctx, saved)
    x = dims(ctx)
    tr = ctx.training
    # q, k and v are projected before the scores (v too: the reference and torchtune
    # attention, transformers' repeat_kv)
    pre: tuple[str, ...] = ("attn.input", "attn.input.cast", "attn.q", "attn.k", "attn.v",
                            "attn.repeat_index", "attn.qkv")
    # (and the q, k, v adapters' tensors under fine-tuning, made before the scores)
    held = sum(t.nbytes for t in saved if t.name.startswith((
        "input_norm.", "attn.q_norm", "attn.k_norm", "lora.q.", "lora.k.", "lora.v.",
        "lora.qkv.")) or t.name in pre)
    bas = x.b * x.a * x.s * x.s
    p_dtype = next((t.dtype for t in saved if t.name == "attn.probs"), x.c)
    # softmax input (scores, c) and output; softmax(x16, dtype=fp32) converts its input
    # first (a CUDA half_to_float kernel skips that copy for fp16; the trace makes it)
    if tr.framework == "hf" and x.r != x.c:
        # transformers adds the causal mask in the model's dtype (fp32 under amp): the
        # scores are promoted before the softmax, which needs no copy of them
        work = alloc(bas, x.r) + alloc(bas, p_dtype)
    else:
        work = alloc(bas, x.c) + alloc(bas, p_dtype)
        if p_dtype != x.c:
            work += alloc(bas, p_dtype)
    kv_dt, k_dt = x.c, None
    if tr.recompute == "full":
        held = sum(t.nbytes for t in saved if t.name in pre)  # the layer keeps nothing
    if (tr.framework == "hf" and tr.recompute != "full" and ctx.spec.norm_kind == "rmsnorm"
            and x.r != "fp32"):
        # the decoder layer's `residual`, its 16-bit input, which its RMSNorm copied to fp32
        held += alloc(bsh(x), x.r)
    if (tr.framework == "hf" and not x.amp and tr.recompute != "full"
            and not any(t.name in ("attn.input", "attn.input.cast") for t in saved)):
        # frozen projections keep no input (PEFT's adapters keep their own casts of it): the
        # decoder layer's normed `hidden_states` is a local, not a saved tensor
        held += alloc(bsh(x), x.r)
    if x.amp and tr.recompute != "full" and tr.framework in ("reference", "hf"):
        # the normed input (r) is the attention's argument until it returns (transformers:
        # the decoder layer's `hidden_states`); under autocast the linears keep 16-bit
        # casts of it, not it
        held += alloc(bsh(x), x.r)
    if tr.recompute == "full" and tr.framework == "reference":
        # its first forward's locals (trace/reference_model.py `Attention.forward`): the
        # normed input (r; autocast's casts of it are freed after each linear, a frozen
        # linear keeps none) and q, k, v in the projections' output dtype (under autocast
        # fp32 from a 4-bit base, whose output takes x's dtype)
        kv_dt = x.r if qlora_fp32_outputs(ctx, x) else x.c
        normed = next((t.numel for t in saved if t.name in ("attn.input", "attn.input.cast")),
                      bsh(x))
        held = alloc(normed, x.r) + sum(t.count * alloc(t.numel, kv_dt) for t in saved if t.name
                                        in ("attn.q", "attn.k", "attn.v"))
        held += sum(t.nbytes for t in saved if t.name == "attn.repeat_index")
    elif tr.recompute == "full" and tr.framework == "hf" and ctx.spec.position_embedding == "rope":
        # transformers' first forward of a checkpointed layer (LlamaAttention.forward): the
        # decoder layer's normed input (r), q and k after RoPE, promoted to cos/sin's dtype
        # (r: LlamaRotaryEmbedding returns them in x's dtype), v in the projection's, and the
        # repeats of k and v for GQA; the casts autocast and PEFT made are freed by then
        kv_dt = x.r if qlora_fp32_outputs(ctx, x) else x.c  # v's
        k_dt = "fp32" if "fp32" in (kv_dt, x.r) else kv_dt
        held = alloc(bsh(x), x.r) + sum(t.count * alloc(t.numel, kv_dt if t.name == "attn.v"
                                                        else k_dt)
                                        for t in saved if t.name in ("attn.q", "attn.k", "attn.v"))
    elif tr.framework == "hf" and x.amp and ctx.spec.position_embedding == "rope":
        # under autocast q and k leave RoPE in fp32 (cos and sin take the fp32 residual's
        # dtype), k's repeats too, and v from a 4-bit projection is fp32: locals beside the
        # 16-bit casts of q and kᵀ the scores' matmul keeps (which they replace in a
        # checkpointed core's first forward); v's cast comes after the softmax
        v_dt = x.r if qlora_fp32_outputs(ctx, x) else x.c
        for t in saved:
            dt = v_dt if t.name == "attn.v" else "fp32"
            if t.name in ("attn.q", "attn.k", "attn.v") and dt != t.dtype:
                held += t.count * alloc(t.numel, dt) - (
                    t.nbytes if t.name == "attn.v" or tr.recompute == "selective" else 0)
        k_dt = "fp32"
    elif tr.framework == "reference" and qlora_fp32_outputs(ctx, x):
        # fp32 q, k, v from the 4-bit projections (k, v repeated for GQA) are the
        # attention's locals beside the 16-bit casts autocast made of q and kᵀ for the
        # scores (kept by the matmul; freed again in a checkpointed core's first forward);
        # v's cast comes after the softmax
        kv_dt = x.r
        qkv = [t for t in saved if t.name in ("attn.q", "attn.k", "attn.v")]
        held += sum(t.count * alloc(t.numel, x.r) for t in qkv) - sum(
            t.nbytes for t in qkv if t.name == "attn.v" or tr.recompute == "selective")
    if x.g < x.a and not (tr.framework == "hf" and x.g == 1 and x.b == 1):
        # k and v before the repeat (locals; k_dt: k's where RoPE promoted it)
        held += alloc(x.b * x.s * x.g * x.d, k_dt or kv_dt) + alloc(x.b * x.s * x.g * x.d, kv_dt)
    if tr.framework == "hf" and tr.recompute == "none":
        held += alloc(x.b * x.s * x.s, x.r)  # the model's additive mask, alive in forward
    return held, work
