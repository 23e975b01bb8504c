"""The megatron profile's layer: what one Megatron-LM transformer layer keeps for backward
(Korthikanti et al. 2022 Table 2 with Megatron-LM d98e8a64's attention cores, dropout, gated
MLPs, FP8 GEMM inputs and MoE layers), as bytes per micro-batch; see `megatron_layer_bytes`.
The per-layer recompute plan is vramcalc/terms/megatron_recompute.py."""

from __future__ import annotations

from collections.abc import Callable

from vramcalc.rank import RankContext
from vramcalc.terms.megatron_mla import megatron_mla_tensors
from vramcalc.terms.saved import dims
from vramcalc.units import alloc, ceil_div

# Megatron-LM's hidden and attention dropout when --dropout is not given: TransformerConfig
# hidden_dropout = attention_dropout = 0.1 (NVIDIA/Megatron-LM d98e8a64, megatron/core/
# transformer/transformer_config.py), the defaults of --hidden-dropout / --attention-dropout
# (megatron/training/arguments.py `_add_network_size_args` builds them from TransformerConfig)
MEGATRON_DEFAULT_DROPOUT = 0.1


def megatron_dropout(ctx: RankContext) -> float:
    """The megatron profile's hidden and attention dropout probability (--dropout)."""
    p = ctx.training.dropout
    return MEGATRON_DEFAULT_DROPOUT if p is None else p


def local_attention_buffer_bytes(ctx: RankContext) -> int:
    """Megatron-LM's local attention (--transformer-impl local: DotProductAttention) takes
    the input of its score matmul from the process's GlobalMemoryBuffer: `get_tensor((b·np,
    sq, sk), query.dtype, "mpu")` for `torch.baddbmm(matmul_input_buffer, ..., beta=0.0)`
    (NVIDIA/Megatron-LM d98e8a64 megatron/core/transformer/dot_product_attention.py;
    megatron/core/utils.py `GlobalMemoryBuffer` allocates it once with torch.empty and keeps
    it). One (b·a/t, s, s) tensor in the compute dtype, held from the first forward on, on
    every rank; 0 for Transformer Engine's layers."""
    tr = ctx.training
    if tr.framework != "megatron" or tr.transformer_impl != "local" or not ctx.num_layers:
        return 0
    x = dims(ctx)
    return alloc(x.b * x.a * x.s * x.s, x.c)


def deferred_wgrad_bytes(ctx: RankContext) -> int:
    """--defer-embedding-wgrad N (Megatron-LM d98e8a64 --defer-embedding-wgrad-compute with
    --wgrad-deferral-limit N, 0 = no limit): the last stage's output layer appends its input
    to `embedding_activation_buffer` in forward (tensor_parallel/layers.py
    ColumnParallelLinear.forward) and its c-typed logits gradient to `grad_output_buffer`
    in backward (LinearWithGradAccumulationAndAsyncCommunication.backward) for the first N
    micro-batches of the step, and computes their weight gradients in the pipeline flush
    (schedules.py `finish_embedding_wgrad_compute`). From the second micro-batch's forward
    to the flush, min(N, m − 1) of them wait: (b·s/t or b·s) x h input + b·s x V/t gradient
    each (last stage)."""
    n = ctx.parallel.defer_embedding_wgrad
    if n is None or not ctx.is_last_stage:
        return 0
    m = ctx.parallel.num_microbatches or ctx.training.grad_accum
    held = min(n or m, m - 1)
    x = dims(ctx)
    rows = x.b * x.s // (ctx.parallel.tp if ctx.parallel.sequence_parallel else 1)
    return held * (alloc(rows * x.h, x.c) + alloc(x.b * x.s * x.V, x.c))


def megatron_held_parts(ctx: RankContext) -> dict[str, int]:
    """Report sub-terms of the megatron profile held beside the layers: the local core's
    GlobalMemoryBuffer (the whole step) and the deferred embedding wgrad buffers (forward
    and backward; the optimizer phase drops them, `StageBase.without`)."""
    parts = {"transients/attention_buffer": local_attention_buffer_bytes(ctx),
             "logits/deferred_wgrad": deferred_wgrad_bytes(ctx)}
    return {k: v for k, v in parts.items() if v}


def megatron_layer_bytes(ctx: RankContext, moe: bool = False) -> int:
    """Bytes one Megatron-LM layer keeps for backward, one micro-batch (t = tp, SP and
    selective recompute): Korthikanti et al. 2022 (arXiv:2205.05198) Table 2,

        sbh·(34 + core)           (÷t for the 24 sharded sbh of the 34 without SP, all ÷t
                                   with SP), FFN 4h generalised to f (19 sbh -> 3 + 4f/h)

    and a gated MLP (SwiGLU, `--swiglu`: fc1 writes (s, b, 2f)) keeps fc1's input 2 sbh,
    the fused SwiGLU's input 4f/h sbh (megatron/core/transformer/mlp.py MLP.forward ->
    `bias_swiglu_impl`, fusions/fused_bias_swiglu.py SwiGLUFunction saves its input;
    --bias-swiglu-fusion is on by default, megatron/training/arguments.py
    `--no-bias-swiglu-fusion` store_false), fc2's input 2f/h sbh and the dropout mask:
    3 + 6f/h,

    with the attention core as `--attention` picks it:

    - eager = Megatron's unfused core (megatron/core/transformer/dot_product_attention.py
      DotProductAttention.forward; TE's UnfusedDotProductAttention is the same): the
      (b, a, s, s) softmax output 2 B, its dropout mask 1 B and the dropout output 2 B that
      `bmm(attention_probs, value)` keeps: core = 5·a·s/h (the raw scores are not saved);
    - flash = Transformer Engine's fused/flash attention (megatron/core/extensions/
      transformer_engine.py TEDotProductAttention -> te DotProductAttention): the kernel
      saves q, k, v and its output (already among the 34: Q, K 4 sbh, V 2 sbh, the output
      projection's input 2 sbh), the fp32 softmax statistics (logsumexp, (b, a, s)) and an
      RNG state for dropout (a few bytes; no mask, no s×s): core = 4·a/h;
    - selective recompute (Megatron's `core_attn`) recomputes the core: core = 0.

    Dropout (`--dropout`, default Megatron's 0.1): with p > 0 the layer keeps the two 1-byte
    masks of its bias-dropout-adds (attention output, MLP output; 2 sbh of the paper's 10
    replicated sbh) and, unfused, the (b, a, s, s) mask and dropout output. With p = 0
    Megatron still calls the dropouts, but they keep nothing: `_bias_dropout_add_func`
    (megatron/core/fusions/fused_bias_dropout.py) computes `residual + dropout(x + bias,
    p)` and DotProductAttention.forward `bmm(attention_dropout(probs), v)`, and
    torch.nn.functional.dropout with p = 0 in training returns its input itself (ATen
    Dropout.cpp: the fused CUDA kernel needs p > 0, `_dropout_impl` returns the input when
    p == 0), so no mask is drawn and no node is recorded; the adds save nothing. Then
    34 -> 32 (10 -> 8 replicated), and the unfused core keeps only the softmax output,
    which `bmm` reads directly: core = 2·a·s/h. Flash attention keeps no mask either way.

    An MoE layer (`moe`) keeps the same attention, norms and bias-dropout-add masks; of the
    MLP's 19 sbh only the norm output (2 sbh, now the router's input, 3 + 4f/h with f = 0)
    and the dropout mask stay, and the experts' side is `megatron_moe_bytes`.

    FP8 (`--precision fp8`, Megatron's `--fp8-format` with Transformer Engine): the four
    GEMM inputs Table 2 counts in bf16 are kept as TE's 1-byte FP8 copies instead
    (vramcalc/terms/lowprec.py gives TE's rule; `LayerNormLinear` keeps its FP8 `ln_out`,
    the local sequence shard under SP, and gathers it again in backward): the QKV and
    fc1 inputs (replicated without SP) 2 -> 1 sbh each, the output projection's input
    2 -> 1 and fc2's input 2f/h -> f/h (sharded), each with a (1,) fp32 scale_inverse.
    The norms' inputs, Q, K, V, the core and the activation's input stay bf16.

    Multi-latent attention (DeepSeek-V2/V3) swaps the attention rows for
    vramcalc/terms/megatron_mla.py's (`megatron_layer_tensors`, summed here).

    Not modelled: grouped-query attention and RoPE keep Table 2's 6 sbh for Q, K and V
    (Megatron splits one fused (s, b, (a + 2g)·d) QKV output into views and rotates q and k
    into new tensors; which of those storages stay alive with fewer KV heads is not derived).
    """
    if ctx.spec.is_mla and ctx.training.recompute != "full":
        # multi-latent attention: vramcalc/terms/megatron_mla.py's rows with Table 2's MLP
        return int(sum(nbytes for _, _, nbytes in megatron_layer_tensors(ctx, moe)))
    x = dims(ctx)
    s, b, h, t = x.s, x.b, x.h, ctx.parallel.tp
    a = ctx.spec.num_attention_heads
    ffn_ratio = 0 if moe else ctx.spec.intermediate_size / h
    # 19 sbh for f = 4h (2 + 8 + 8 + 1); gated, the fused SwiGLU keeps its (s, b, 2f) input
    gated = ctx.spec.mlp_kind == "gated" and not moe
    mlp = 19 if ffn_ratio == 4 and not gated else 3 + (6 if gated else 4) * ffn_ratio
    # the two bias-dropout-add masks (1 B each, replicated without SP), only when p > 0
    masks = 2 if megatron_dropout(ctx) > 0 else 0
    base = 34 - 19 + mlp - (2 - masks)  # 10 (8 without masks) replicated + 24/t sharded
    replicated = 10 - (2 - masks)
    rec = ctx.training.recompute
    if rec == "full":
        return 2 * s * b * h // (t if ctx.parallel.sequence_parallel else 1)
    if rec == "selective":
        core = 0.0
    elif ctx.training.attention == "eager" and megatron_dropout(ctx) > 0:
        core = 5 * a * s / h  # (b, a, s, s): softmax 2 + dropout mask 1 + dropout output 2
    elif ctx.training.attention == "eager":
        core = 2 * a * s / h  # (b, a, s, s): the softmax output, bmm's input itself
    else:
        core = 4 * a / h  # (b, a, s) fp32 logsumexp
    base += qk_norm_coef(ctx)  # sharded, as q and k are
    experts = megatron_moe_bytes(ctx) if moe else 0
    scales = 0
    if ctx.training.precision == "fp8":  # FP8 GEMM inputs (MoE layers are refused)
        replicated -= 2
        base -= 2 + 1 + ffn_ratio
        scales = 4 * alloc(1, "fp32")
    if ctx.parallel.sequence_parallel:
        return int(s * b * h / t * (base + core)) + experts + scales
    return int(s * b * h * (replicated + (base - replicated) / t + core / t)) + experts + scales


def qk_norm_coef(ctx: RankContext) -> float:
    """--qk-layernorm (`qk_norm`): Transformer Engine's norm on each q and k head (Megatron's
    --normalization; transformer_engine/pytorch/ops/basic/layer_norm.py saves x, means and
    rstdevs, rmsnorm.py x and rstdevs), in s·b·h units before ÷t: the 16-bit q and k
    (2·a·d/h + 2·g·d/h) and 4 B per statistic per (token, head)."""
    spec = ctx.spec
    if not spec.qk_norm:
        return 0.0
    a, g, d, h = spec.num_attention_heads, spec.kv_heads, spec.head_size, spec.hidden_size
    stats = 2 if spec.norm_kind == "layernorm" else 1
    return (2 * (a + g) * d + 4 * stats * (a + g)) / h


def megatron_moe_bytes(ctx: RankContext) -> int:
    """Bytes one Megatron-LM MoE layer keeps for backward beyond the norm output and the
    dropout mask (`megatron_layer_bytes`), one micro-batch, NVIDIA/Megatron-LM d98e8a64,
    dropless (no capacity factor), SequentialMLP experts, no fused permute, balanced
    routing. T = s·b/t tokens on the rank (sequence parallel; Megatron refuses TP > 1
    without it in training), k = top-k, E experts, E/ep local, f the expert's FFN width,
    e = the expert TP degree (--etp, Megatron's --expert-tensor-parallel-size; default t).
    The dispatchers' `tp_size`/`tp_group` are the expert TP group and `tp_ep_group` the
    e x ep group (token_dispatcher.py MoETokenDispatcher.__init__: `self.tp_group =
    pg_collection.expt_tp`, `self.tp_ep_group = pg_collection.tp_ep`; parallel_state.py
    builds both from the expert RankGenerator, tp = expert_tensor_parallel_size), whose
    e·ep ranks hold distinct T-token sequence shards. So n = T·e·k tokens reach this
    rank's experts with either dispatcher (allgather, `token_dispatch`: the T·e·ep tokens
    of the e x ep group, k/ep of them local; alltoall: T·k sent and T·k received per EP
    rank by `all_to_all(self.ep_group, ...)`, then `dispatch_postprocess` gathers them
    over the e expert-TP ranks, `gather_from_sequence_parallel_region(..., group=
    self.tp_group)`), and each expert holds an f/e shard (moe/experts.py SequentialMLP
    builds its MLPs on `pg_collection.expt_tp`). With e = t this is Megatron's default;
    without sequence parallelism (t > 1, e = t only) the T = s·b replicated tokens are
    counted once (n = T·k).

    - router (moe/router.py TopKRouter.routing -> moe_utils.py
      `topk_routing_with_score_function`, softmax after top-k, no aux loss: Megatron's
      default `moe_aux_loss_coeff` 0): torch.topk keeps its int64 indices (T·k·8) and the
      fp32 softmax its output (T·k·4); the scatter into (T, E) keeps the same indices;
      `RouterGatingLinearFunction` keeps its input, the norm output (counted in the layer);
    - allgather (token_dispatcher.py MoEAllGatherTokenDispatcher): the all-gathers of the
      tokens (into the global buffer) and the probabilities keep nothing;
      `dispatch_postprocess` masked_selects the local probabilities, and masked_select
      keeps its input and mask, (E/ep, T·e·ep) bf16 + bool = 3·T·e·E; `permute`
      (moe_utils.py) index_selects the tokens and keeps the int64 indices (n·8);
    - alltoall (MoEAlltoAllTokenDispatcher.dispatch_preprocess -> `permute` with probs):
      argsort's first T·k positions (int64, kept by the probabilities' indexing) and the
      token indices they give (int64, kept by index_select): 2·T·k·8; all-to-all,
      gather and `sort_chunks_by_idxs` (split + cat) keep nothing;
    - experts (experts.py SequentialMLP.forward -> mlp.py MLP.forward with the token's
      probability as `per_token_scale`), on the n tokens: the fc1 input (n·h·2), the
      probabilities (n·2), and 3·n·f/e·2: gelu's input, gelu's output (kept by the
      multiply by the probabilities) and fc2's input (unfused: the fused bias-gelu
      refuses `per_token_scale`); gated, the fused weighted SwiGLU
      (fusions/fused_bias_swiglu.py WeightedSwiGLUFunction) keeps its (n, 2f/e) input and
      the weights, and fc2 its input: the same 6·n·f/e + 2·n bytes;
    - combine (`unpermute` without probabilities, scatter_add_) keeps only the index
      already counted; the reduce-scatter / all-to-all keep nothing;
    - shared experts (SharedExpertMLP, built on the dense `pg_collection.tp`, so ÷t even
      when e != t): Table 2's gelu and fc2 inputs, 4·s·b·f_s/t each (their input is the
      norm output; a shared-expert gate is not modelled).

    - --deterministic-mode (`--deterministic`; torch.use_deterministic_algorithms(True)):
      `unpermute` adds with index_add_ instead of scatter_add_ (moe_utils.py, "if
      torch.are_deterministic_algorithms_enabled()"), and index_add_'s backward keeps its
      source (derivatives.yaml index_add: `source: ... expand_as(source)`; IndexAddBackward0
      `_saved_source`): the expert output unpermute receives, bf16 — allgather
      (`combine_preprocess`, before the reduce-scatter) the n local rows, 2·n·h; alltoall
      (`combine_postprocess`, after the all-to-all) the T·k rows, 2·T·k·h. The router
      (`topk_routing_with_score_function`) builds its (T, E) probabilities with index_put_
      at (rows, top_indices), which keeps `rows = arange(T).unsqueeze(1)`, int64, 8·T.

    Not modelled: grouped GEMM, fused permute, token drop, MoE-layer recompute.
    """
    spec, par = ctx.spec, ctx.parallel
    x = dims(ctx)
    t, e = par.tp, par.expert_tp
    E, k = spec.num_local_experts, spec.num_experts_per_tok
    T = x.b * x.s // t if par.sequence_parallel else x.b * x.s
    # ranks of the e x ep group holding distinct tokens, per EP rank: e (1 when t > 1
    # without SP, where the TP ranks hold the same tokens; resolve_layout refuses e != t then)
    g = e if par.sequence_parallel or t == 1 else 1
    n = T * g * k
    fe = ceil_div(spec.expert_ffn, e)
    router = T * k * (8 + 4)
    if ctx.training.dispatcher == "allgather":
        dispatch = 3 * T * g * E + 8 * n
    else:
        dispatch = 2 * 8 * T * k
    experts = 2 * n * x.h + 2 * n + 6 * n * fe
    shared = spec.num_shared_experts * 4 * x.b * x.s * ceil_div(spec.shared_ffn, t)
    if ctx.training.deterministic:
        combined = n if ctx.training.dispatcher == "allgather" else T * k
        router += 8 * T + 2 * combined * x.h
    return router + dispatch + experts + shared


def megatron_layer_tensors(ctx: RankContext, moe: bool = False) -> list[tuple[str, str, float]]:
    """`megatron_layer_bytes` tensor by tensor, for `vramcalc explain`: (name, Korthikanti
    et al. 2022 Table 2 size in s·b·h units (or as·b / as²b for the core), bytes on this
    rank). Replicated tensors (the norms' inputs, the QKV and fc1 inputs, the dropout masks)
    are whole on each TP rank without sequence parallelism; the others are ÷t. The bytes add
    up to `megatron_layer_bytes` (which rounds their sum down to an int once)."""
    x = dims(ctx)
    s, b, h, t = x.s, x.b, x.h, ctx.parallel.tp
    a = ctx.spec.num_attention_heads
    sp = ctx.parallel.sequence_parallel
    sbh = s * b * h
    if ctx.training.recompute == "full":
        return [("layer input (checkpoint)", "2 sbh", 2 * sbh / (t if sp else 1))]
    fp8 = ctx.training.precision == "fp8"
    drop = megatron_dropout(ctx) > 0
    g8 = 1 if fp8 else 2  # GEMM inputs: TE's 1-byte FP8 copies under fp8

    def rep(coef: float) -> float:  # replicated across TP ranks unless SP
        return sbh * coef / (t if sp else 1)

    def shard(coef: float) -> float:
        return sbh * coef / t

    if ctx.spec.is_mla:  # MLASelfAttention's rows (FP8 and the eager core are refused)
        out = megatron_mla_tensors(ctx, drop) + _mlp_rows(ctx, moe, rep, shard, g8, drop)
        return out
    out = [("input_layernorm input", "2 sbh", rep(2)),
           ("QKV GEMM input", f"{g8} sbh", rep(g8)),
           ("Q, K (QK^T inputs)", "4 sbh", shard(4)),
           ("V", "2 sbh", shard(2))]
    rec = ctx.training.recompute
    if rec == "selective":
        out.append(("attention core", "recomputed (core_attn)", 0.0))
    elif ctx.training.attention == "eager" and drop:
        out += [("softmax output", "2 as²b", 2 * a * s * s * b / t),
                ("attention dropout mask", "as²b", a * s * s * b / t),
                ("attention dropout output", "2 as²b", 2 * a * s * s * b / t)]
    elif ctx.training.attention == "eager":
        out.append(("softmax output", "2 as²b", 2 * a * s * s * b / t))
    else:
        out.append(("flash softmax statistics (fp32 logsumexp)", "4 asb", 4 * a * s * b / t))
    if ctx.spec.qk_norm:
        qk = qk_norm_coef(ctx)
        out.append(("q/k norm inputs and statistics", f"{qk:.3g} sbh", shard(qk)))
    out.append(("output projection input", f"{g8} sbh", shard(g8)))
    if drop:
        out.append(("bias-dropout-add mask (attention)", "sbh", rep(1)))
    out += _mlp_rows(ctx, moe, rep, shard, g8, drop)
    if fp8:
        out.append(("FP8 scale_inverse of the 4 GEMM inputs", "4 x (1,) fp32",
                    float(4 * alloc(1, "fp32"))))
    return out


def _mlp_rows(ctx: RankContext, moe: bool, rep: Callable[[float], float],
              shard: Callable[[float], float], g8: int,
              drop: bool) -> list[tuple[str, str, float]]:
    """Table 2's MLP rows (pre-MLP norm to the MLP's bias-dropout-add mask), or an MoE
    layer's router input and `megatron_moe_bytes`."""
    h = ctx.spec.hidden_size
    out = [("pre_mlp_layernorm input", "2 sbh", rep(2))]
    if moe:
        out.append(("router input", "2 sbh", rep(2)))
    else:
        f = ctx.spec.intermediate_size / h
        out.append(("fc1 input", f"{g8} sbh", rep(g8)))
        if ctx.spec.mlp_kind == "gated":
            out.append(("fused SwiGLU input (s, b, 2f)", f"{4 * f:g} sbh", shard(4 * f)))
        else:
            out.append(("GeLU input (s, b, f)", f"{2 * f:g} sbh", shard(2 * f)))
        out.append(("fc2 input", f"{g8 * f:g} sbh", shard(g8 * f)))
    if drop:
        out.append(("bias-dropout-add mask (MLP)", "sbh", rep(1)))
    if moe:
        out.append(("experts: router, dispatch, expert MLPs", "megatron_moe_bytes",
                    float(megatron_moe_bytes(ctx))))
    return out
