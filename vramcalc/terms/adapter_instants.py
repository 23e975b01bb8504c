"""Forward instants of LoRA / QLoRA / DoRA layers: the worst moment inside an adapted
layer's forward, in its three settings — a layer that saves as it goes, a checkpointed
layer's first forward (saves nothing), and that forward re-run in backward (saves again,
stops early under torch's non-reentrant checkpoint). The saved-tensor tables and the
legend are vramcalc/terms/finetune_activations.py's."""

from __future__ import annotations

from vramcalc.finetune import fused_groups, shapes_for
from vramcalc.qlora import compiled_dequant_kept, dequant_matmul_bytes
from vramcalc.rank import RankContext
from vramcalc.terms.finetune_activations import (
    _in_width,
    _input_dtype,
    _out_width,
    _targets,
    dora_weight_copies,
)
from vramcalc.terms.saved import (
    Dims,
    Saved,
    autocasts_adapters,
    dims,
    gpt2_block_attn_output,
    qlora_fp32_outputs,
    repeats_kv_by_copy,
    returned_attn_weights,
)
from vramcalc.units import alloc

# ---- forward transients ------------------------------------------------------------------
# Where each saved tensor of a layer appears in its forward (for "saved so far" at a moment)
_ORDER = (("input_norm.",), ("attn.input", "lora.q.", "lora.k.", "lora.v.", "lora.qkv.",
                             "attn.q_norm", "attn.k_norm"),
          ("attn.",), ("lora.o.",), ("post_norm.",),
          ("mlp.input", "lora.gate.", "lora.gate_up."), ("mlp.gate", "mlp.act"), ("lora.up.",),
          ("mlp.",), ("lora.down.",))
_STEP_OF = {"q": 1, "k": 1, "v": 1, "qkv": 1, "o": 3, "gate": 5, "up": 7, "gate_up": 5,
            "down": 9}
_LATER_SIBLINGS = {"q": ("k", "v"), "k": ("v",)}  # same step, run after


def _act_before_up(ctx: RankContext) -> bool:
    """A gated MLP written `down(act(gate(x)) * up(x))` (transformers' LlamaMLP, torchtune's
    FeedForward, the reference model): the activation exists when up runs. LitGPT's LLaMAMLP
    and Liger's fused SiLU-mul run both projections first."""
    return (ctx.spec.mlp_kind == "gated" and not ctx.training.liger
            and ctx.training.framework in ("hf", "reference", "torchtune"))


def _step(name: str, act_before_up: bool = True) -> int:
    """Index in _ORDER of the first group whose prefix matches (later groups are more
    specific only for lora.*; attn.* and mlp.* fall through to their generic groups)."""
    if name == "mlp.act" and not act_before_up:
        return _ORDER.index(("mlp.",))
    for i, prefixes in enumerate(_ORDER):
        if name.startswith(prefixes):
            return i
    return len(_ORDER)


def compiled_nf4(ctx: RankContext) -> bool:
    """A dense compiled torchao QLoRA layer, which keeps its dequantized weights
    (vramcalc.qlora.compiled_dequant_kept; finetune_modifier.dequantized_saved)."""
    tr = ctx.training
    return compiled_dequant_kept(tr.compile, tr.finetune, tr.nf4) and not ctx.spec.is_moe


def forward_working_bytes(ctx: RankContext, saved: list[Saved], held: bool = True,
                          moe: bool = False) -> int:
    """Worst transient inside the top layer's forward, under
    LoRA/QLoRA/DoRA: at each adapted or quantized linear, the tensors of the layer saved so
    far plus what is alive and not saved —

    - the linear's input when nothing saves it (the normed input during q/k/v and gate/up,
      the act·up product during down), and under the hf profile the layer's residual and the
      model's `inputs_embeds` local (first stage);
    - QLoRA: the dequantized weight, its two fp32 absmax buffers and the output
      (vramcalc.qlora.dequant_matmul_bytes);
    - the adapter's sum y + B(A(x))·α/r: the base output y (c), B's output and its scaled
      copy (c under autocast, else a_dt; PEFT adds in fp32 and casts back), PEFT's fp32
      input cast when dropout makes it a temporary.

    Returned as bytes above every saved tensor of the micro-batch's layers (the analytic
    forward point adds them; may be negative, the caller takes a max); with `held=False`
    (activation offloading: the saved tensors are in host memory) the temporaries alone.
    Under full recompute the layer saves nothing in forward: its locals and the
    temporaries (`worst_forward_instant(nosave=True)`). `saved`: the saved list of a layer
    of the kind `moe` says."""
    if not ctx.num_layers:
        return 0
    if ctx.training.recompute == "full":
        return worst_forward_instant(ctx, saved, nosave=True, moe=moe)[1]
    kept, rest = worst_forward_instant(ctx, saved, held, moe=moe)
    if kept + rest < 0:
        return 0
    return kept + rest - (sum(t.nbytes for t in saved) if held else 0)


def worst_forward_instant(ctx: RankContext, saved: list[Saved], held: bool = True,
                          nosave: bool = False, rerun: bool = False,
                          moe: bool = False) -> tuple[int, int]:
    """(the layer's tensors saved so far, what else is alive) at the worst instant of
    `forward_working_bytes`.

    `nosave`: a checkpointed layer's first forward, which saves nothing; alive are the
    forward's locals (`_checkpointed_locals`) and the linear's temporaries. `rerun`: its
    forward run again in backward. torch's non-reentrant checkpoint stops that run once
    the last tensor the first run saved is saved again (`set_checkpoint_early_stop`, on
    by default; torch/utils/checkpoint.py `_recomputation_hook` raises
    `_StopRecomputationError`), and autograd saves a node's inputs before it computes: with
    an adapted down projection the run ends at B's input, so neither B's output nor the
    adapter's sum exists (`_early_stop`). `moe`: a MoE layer, whose MLP adapters are its
    shared experts' (routed experts' adapters: vramcalc/terms/expert_lora.py); without
    shared experts its MLP has none."""
    tr = ctx.training
    x = dims(ctx)
    hf = tr.framework == "hf"
    a_dt = tr.adapter_dtype
    targets = set(_targets(ctx))
    names = {t.name for t in saved}
    T, c, r = x.T, x.c, x.r
    ac = autocasts_adapters(ctx, x)
    # hf's norms save an fp32 copy, not the residual itself (LigerRMSNorm keeps X: in `kept`)
    # (nn.LayerNorm, GPT-2's, keeps its input: the residual itself)
    keep_r = (tr.framework in ("hf", "torchtune") and r != "fp32" and not tr.liger
              and ctx.spec.norm_kind != "layernorm")
    groups = fused_groups(ctx.spec, tr.framework)
    linears = (["qkv"] if "qkv" in groups else ["q", "k", "v"]) + ["o"] + (
        (["gate_up"] if "gate_up" in groups else ["gate", "up"]) + ["down"]
        if ctx.spec.mlp_kind == "gated" else ["up", "down"])
    routed_only = moe and not ctx.spec.num_shared_experts  # no adapted MLP in the layer
    best = (0, -(1 << 62))
    act_first = _act_before_up(ctx)
    relu_mlp = ctx.spec.mlp_kind != "gated" and ctx.spec.hidden_act in ("relu", "relu2")
    casts = recomputed_casts(ctx) if rerun else {}
    copies = dora_weight_copies(ctx)
    if rerun:  # kept by the re-run's base matmuls like the casts
        casts = {k: casts.get(k, 0) + copies.get(k, 0) for k in {*casts, *copies}}
    for t in linears:
        if routed_only and _STEP_OF[t] >= 5:  # no dense MLP linear in this layer
            continue
        adapted = t in targets
        if not adapted and tr.finetune != "qlora":
            continue
        # a frozen 4-bit down projection saves nothing through the checkpoint's hooks: the
        # re-run stops at act·up's inputs, before it (the act·up instant below)
        if rerun and t == "down" and not adapted and not tr.reentrant and not compiled_nf4(ctx):
            continue
        step = _STEP_OF[t]
        mlp = step >= 5
        # q, k and v run in that order: at q's instant k's and v's tensors do not exist
        after = _LATER_SIBLINGS.get(t, ())
        kept = sum(s.nbytes for s in saved if _step(s.name, act_first) <= step
                   and not s.name.startswith(tuple(f"lora.{a}." for a in after))) if (
            held and not nosave) else 0
        if rerun:  # the re-run's weight casts so far, each kept by its matmul
            kept += sum(b for letter, b in casts.items()
                        if _STEP_OF[letter] <= step and letter not in after)
        w_in, w_out = _in_width(x, t), _out_width(x, t)
        in_dt = _input_dtype(ctx, x, t)
        work = 0
        if nosave:
            work = _checkpointed_locals(ctx, x, t)
        if keep_r and not nosave:
            # the layer's input (the caller's variable) and, in the MLP, the residual
            work += alloc(T * x.h, r) * (2 if mlp else 1)
        if (hf and ctx.is_first_stage and (ctx.num_layers > 1 or not keep_r)
                and tr.recompute != "full"):
            # inputs_embeds, alive through the decoder's forward (the first layer's
            # checkpoint under full recompute)
            work += alloc(T * x.h, r)
        if not nosave and ((not mlp and "attn.input" not in names)
                           or (mlp and "mlp.input" not in names)):
            work += alloc(T * x.h, r)  # the normed input, the attention's / MLP's argument
        if step >= _STEP_OF["o"] and not rerun:  # hf eager attention's returned
            work += returned_attn_weights(ctx, x)  # probabilities (a re-run saves them)
        if mlp:
            work += gpt2_block_attn_output(ctx, x)
        down_in = "mlp.down_input" if ctx.spec.mlp_kind == "gated" else "mlp.act"
        if t == "down" and down_in not in names and not nosave:
            work += alloc(T * w_in, _input_dtype(ctx, x, "down"))
        y_dt = r if qlora_fp32_outputs(ctx, x) else c  # Linear4bit returns its input's dtype
        y = alloc(T * w_out, y_dt)
        if compiled_nf4(ctx):
            base_moment = y  # the fused kernel's bf16 weight is saved: in `kept`
        elif tr.finetune == "qlora" and y_dt != c:
            # Linear4bit under autocast: x.to(compute dtype) for the 16-bit matmul, whose
            # output it casts back to x's dtype (bitsandbytes nn/modules.py)
            y_c = alloc(T * w_out, c)
            base_moment = alloc(T * w_in, c) + max(
                dequant_matmul_bytes(w_in * w_out, c, tr.nf4, y_c), y_c + y)
        elif tr.finetune == "qlora":
            base_moment = dequant_matmul_bytes(w_in * w_out, c, tr.nf4, y)
        else:
            base_moment = 0
        lora_moment = 0
        if adapted and tr.finetune == "dora":
            pre = post = 0  # alive from the weight norm on; at the combination only
            cast_x = hf and in_dt != a_dt
            if nosave:  # what A keeps otherwise (PEFT's cast of x) and lora_B's output
                o_dt = c if ac else a_dt
                pre = alloc(T * w_in, a_dt) if cast_x else 0
                post = alloc(T * w_out, o_dt)
                if hf and tr.lora_dropout > 0:  # dropout's output; the base output recomputed
                    # from it and the weight copy that matmul reads (DoraLinearVariant)
                    pre += alloc(T * w_in, a_dt)
                    # and W.to(x.dtype), which without autocast the weight norm made
                    post += alloc(T * w_out, o_dt) + (copies.get(t, 0) if tr.is_autocast
                                                      else 0)
            elif hf:
                # PEFT's cast of x, which A does not keep (it keeps dropout's output, or
                # under autocast its own 16-bit cast), and under autocast dropout's output:
                # locals while the DoRA layer runs
                if cast_x and (tr.lora_dropout > 0 or ac):
                    pre = alloc(T * w_in, a_dt)
                if tr.lora_dropout > 0 and ac and a_dt != c:
                    pre += alloc(T * w_in, a_dt)
            # saved by this linear after its weight norm (A's and the combination's inputs,
            # the recomputed base output and its weight's cast): not there before it
            later = 0 if nosave or not held else sum(
                s.nbytes for s in saved if s.name.startswith(f"lora.{t}.")
                and not s.name.endswith((".dropout_mask", ".dropout_out", ".input_cast")))
            copy = copies.get(t, 0) if rerun else 0  # in `kept`: the re-run's casts
            lora_moment = _dora_forward_bytes(ctx, x, t, rerun and t == "down"
                                              and _stops_in_down(ctx), pre, post, nosave,
                                              later + copy, 0 if tr.is_autocast else copy)
        elif adapted:
            o_dt = c if ac else a_dt
            extra = 0
            if hf and (tr.lora_dropout > 0 or ac or nosave) and in_dt != a_dt:
                # PEFT's cast, bound to the forward's local `x` while the adapters run: A
                # keeps the dropout output or (autocast) its own 16-bit cast instead
                extra = alloc(T * w_in, a_dt)
            # PEFT's y + B(A(x))·α/r, promoted to fp32 beside fp32 adapters without autocast
            sum_dt = "fp32" if (hf and a_dt == "fp32" and not ac) or y_dt == "fp32" else c
            lora_moment = y + max(2 * alloc(T * w_out, o_dt),
                                  alloc(T * w_out, o_dt) + alloc(T * w_out, sum_dt)) + extra
            # while A runs: its argument, dropout's output, unless A keeps it, and in a
            # checkpointed forward autocast's cast of it (A keeps that cast otherwise)
            dt_a = a_dt if hf and in_dt != a_dt else in_dt
            ac_cast = ac and dt_a != c
            a_moment = y + extra
            if tr.lora_dropout > 0 and (nosave or ac_cast):
                a_moment += alloc(T * w_in, dt_a)
            if nosave and ac_cast:
                a_moment += alloc(T * w_in, c)
            lora_moment = max(lora_moment, a_moment)
            if rerun and t == "down" and _early_stop(ctx):
                lora_moment = a_moment
        # the base layer runs before the adapter (PEFT's and torchtune's forward): at its
        # matmul none of this linear's adapter tensors exist yet
        own = sum(s.nbytes for s in saved if s.name.startswith(f"lora.{t}.")) if (
            held and not nosave and adapted) else 0
        best = max(best, (kept - own, work + base_moment), (kept, work + lora_moment), key=sum)
        if t == "up" and relu_mlp and not nosave:
            # relu runs on up's output: both (T, f) exist beside what the layer saved so
            # far (relu keeps its output; relu2's square runs after it)
            name = "mlp.act" if ctx.spec.hidden_act == "relu" else "mlp.fc_out"
            relu_out = next((s.nbytes for s in saved if s.name == name), 0)
            best = max(best, (kept + relu_out, work + y + (0 if relu_out else y)), key=sum)
    if rerun and "down" not in targets and ctx.spec.mlp_kind == "gated":
        # a frozen down projection's matmul saves its weight before it runs, ending the
        # re-run beside act·up (Liger's fused output c); a 4-bit one saves nothing through
        # the hooks, so the run ends at act·up's inputs, before the product
        step = _ORDER.index(("mlp.",))
        kept = sum(s.nbytes for s in saved if _step(s.name, act_first) <= step) + sum(casts.values())
        work = alloc(T * x.h, r) * 2 if keep_r else 0
        if "mlp.input" not in names:
            work += alloc(T * x.h, r)
        if not (tr.finetune == "qlora" and tr.nf4.impl == "torchao" and not compiled_nf4(ctx)):
            work += alloc(T * x.f, _input_dtype(ctx, x, "down"))
        best = max(best, (kept, work), key=sum)
    return best


_LETTER = {"attn.q_proj.": "q", "attn.k_proj.": "k", "attn.v_proj.": "v", "attn.o_proj.": "o",
           "mlp.gate_proj.": "gate", "mlp.up_proj.": "up", "mlp.fc.": "up",
           "mlp.down_proj.": "down", "mlp.proj.": "down"}


def recomputed_casts(ctx: RankContext) -> dict[str, int]:
    """LoRA/DoRA under autocast with full recompute: the recomputed layer casts its frozen
    fp32 weights to 16 bits again, and each matmul keeps its cast for dL/dx (autocast caches
    only casts of weights that need a gradient). Bytes per linear (q, k, v, o, gate, up,
    down). Dense layers (no NF4 weights, which are dequantized, not cast)."""
    tr = ctx.training
    if (tr.recompute != "full" or not dims(ctx).amp or tr.finetune not in ("lora", "dora")
            or ctx.spec.is_moe):
        return {}
    out: dict[str, int] = {}
    for t in shapes_for(ctx).frozen.tensors:
        if t.group == "layer" and t.rows and t.name.endswith(".weight"):
            letter = next((v for k, v in _LETTER.items() if t.name.startswith(k)), None)
            if letter:
                out[letter] = out.get(letter, 0) + alloc(t.numel, tr.compute_dtype)
    return out


def _stops_in_down(ctx: RankContext) -> bool:
    """Whether a non-reentrant checkpoint's re-run forward ends in an adapted down
    projection (`worst_forward_instant`, `rerun_pending_bytes`)."""
    tr = ctx.training
    return tr.recompute == "full" and not tr.reentrant and "down" in _targets(ctx)


def _early_stop(ctx: RankContext) -> bool:
    """Whether the re-run stops at the down adapter's B (LoRA / QLoRA): before B's output
    and the sum."""
    return _stops_in_down(ctx) and ctx.training.finetune in ("lora", "qlora")


def rerun_pending_bytes(ctx: RankContext) -> int:
    """Gradients a non-reentrant checkpoint's re-run forward waits beside (beyond dL/d the
    layer's output): autograd reaches the first node with a saved tensor (whose unpacking
    starts the re-run) after the adapted down projection's sum: its scaled gradient
    dL/d B(A(x))·α/r (T·h in B's output dtype); when PEFT promoted the sum to fp32 (an
    fp32 adapter beside 16-bit weights), dL/d the base output cast back (T·h, c); with an
    fp32 residual (autocast over fp32 weights), dL/d the 16-bit MLP output cast from the
    residual's gradient (T·h, c). Without a down adapter the first node, down's own matmul,
    saves its weight (a 4-bit one does not: its dL/dx waits instead)."""
    tr = ctx.training
    x = dims(ctx)
    if (tr.recompute == "full" and not tr.reentrant and tr.finetune == "qlora"
            and not compiled_nf4(ctx) and "down" not in _targets(ctx)):
        # a 4-bit linear keeps its state as node attributes, not saved tensors: down's
        # backward runs before the first unpack, and its dL/d act·up (T·f) waits, cast
        # back to its input's dtype under autocast (Linear4bit's x.to(compute dtype))
        return alloc(x.T * x.f, x.r if qlora_fp32_outputs(ctx, x) else x.c)
    if not _stops_in_down(ctx):
        return 0
    th = x.T * x.h
    if ctx.training.finetune == "dora":
        # PEFT's DoRA adds result_dora = (m/‖W‖ − 1)·base + m/‖W‖·lora·α/r (promoted to
        # the magnitude's dtype) to the base output; its `·α/r` node saves no tensor, the
        # product before it does: dL/d result_dora and its scaled copy, and when promoted
        # the base output's gradient cast back (peft 0.21.2 tuners/lora/dora.py)
        d_dt = ctx.training.adapter_dtype
        out = 2 * alloc(th, d_dt) + alloc(th, x.c) if d_dt != x.c else alloc(th, x.c)
    else:
        o_dt = x.c if autocasts_adapters(ctx, x) else ctx.training.adapter_dtype
        out = alloc(th, o_dt) + (alloc(th, x.c) if o_dt != x.c else 0)
    if x.r != x.c:  # the 16-bit MLP output added to an fp32 residual: its gradient cast
        out += alloc(x.T * x.h, x.c)
    return out


def _checkpointed_locals(ctx: RankContext, x: Dims, target: str) -> int:
    """What a checkpointed layer's first forward (nothing saved) holds besides its input,
    the checkpoint, when `target`'s linear runs: the normed input (the attention's or the
    MLP's argument, r); in the MLP the residual after attention (r); at up, the
    activation (gate's output under Liger, which runs both projections first); at down,
    its input (act·up, or the activation of a 2-matrix MLP). What nothing holds is freed
    as soon as the next op has read it (gate's output once act exists). In the reference
    and torchtune attention (vramcalc/trace/reference_model.py `Attention.forward`) the
    projections' outputs are locals until it returns: at k, q; at v, q and k; at o, q, k,
    v (after RoPE; torchtune's k and v repeated to every head, copies when 1 < g < a) and o's
    input."""
    out = alloc(x.T * x.h, x.r)
    if _STEP_OF[target] >= 5:
        out += alloc(x.T * x.h, x.r)
    if ctx.training.framework in ("reference", "torchtune") and target in ("k", "v", "o"):
        qkv_dt = x.r if qlora_fp32_outputs(ctx, x) else x.c
        kv = x.a if (ctx.training.framework == "torchtune" and target == "o"
                     and repeats_kv_by_copy(x)) else x.g
        out += alloc(x.T * x.a * x.d, qkv_dt)  # q
        if target in ("v", "o"):
            out += alloc(x.T * kv * x.d, qkv_dt)  # k
        if target == "o":
            out += alloc(x.T * kv * x.d, qkv_dt) + alloc(x.T * x.a * x.d, x.c)  # v, o's input
    gated = ctx.spec.mlp_kind == "gated"
    if (target == "up" and gated) or target == "down":
        out += alloc(x.T * x.f, _input_dtype(ctx, x, "down"))  # act·up or act, same dtype
    return out


def _dora_forward_bytes(ctx: RankContext, x: Dims, target: str, stop: bool = False,
                        pre: int = 0, post: int = 0, nosave: bool = False,
                        later: int = 0, copy: int = 0) -> int:
    """PEFT DoraLinearLayer.forward's temporaries (peft 0.21.2 tuners/lora/dora.py), the
    largest of three instants:

    - `get_lora_weight`: torch.eye(in) in the adapters' dtype, under autocast lora_A's 16-bit
      cast of it, lora_A(eye) (in, r) and lora_B's product (in, out);
    - the weight norm: what lora_weight = lora_B(lora_A(eye))ᵀ's graph keeps (lora_A's input,
      the eye itself or under autocast its cast — the eye is a local of get_lora_weight —, and
      lora_A(eye); nothing in a checkpointed layer's first forward, which saves nothing),
      lora_weight cast to x's dtype, W cast to it, scaling·lora_weight and W + that;
    - the combination (m/‖W‖ − 1)·base + m/‖W‖·lora·α/r, whose products (T, out) take the
      magnitude's dtype (fp32 beside fp32 adapters; torchtune's DoRALinear keeps it in the
      model's), beside the graph and lora_weight and W in x's dtype (locals until the layer
      returns); with dropout under autocast, before it, the base output recomputed from the
      dropped input's 16-bit cast.

    `stop`: a re-run that ends at m/‖W‖·lora, whose inputs are the last tensors the layer
    saves: only the first product exists. `pre`: locals alive at every instant; `post`:
    those made after the weight norm; `later`: saved bytes the caller counts that the layer
    makes after the weight norm (absent at the first two instants); `copy`: W in x's dtype
    (without autocast the copy the base matmul keeps) when the caller counts it."""
    tr = ctx.training
    a_dt = tr.adapter_dtype
    w_in, w_out, r_a = _in_width(x, target), _out_width(x, target), tr.lora_rank
    x_dt = a_dt if tr.framework == "hf" else _input_dtype(ctx, x, target)
    n = w_in * w_out
    ac = autocasts_adapters(ctx, x) and a_dt != x.c
    eye = alloc(w_in * w_in, a_dt)
    eye_cast = alloc(w_in * w_in, x.c) if ac else 0
    a_eye = alloc(w_in * r_a, x.c if ac else a_dt)
    graph = 0 if nosave else (eye_cast or eye) + a_eye
    y = alloc(x.T * w_out, x.c)  # the base layer's output, made first
    # lora_B(lora_A(eye)), the (in, out) product, is made while the eye is still bound
    at_eye = y + eye + eye_cast + a_eye + alloc(n, x.c if ac else a_dt) + pre - later
    cast_w = alloc(n, x_dt) if (x_dt != tr.weight_dtype or tr.finetune == "qlora") else 0
    norm = y + graph + alloc(n, x_dt) + cast_w + 2 * alloc(n, x_dt) + pre - later
    # the products take the magnitude's dtype (the adapters'), promoted beside x.c
    prod = "fp32" if "fp32" in (a_dt, x.c) else x.c
    # lora_weight and W in x's dtype stay bound as locals until the layer returns
    held = graph + alloc(n, x_dt) + cast_w - copy
    combine = held + y + (1 if stop else 3) * alloc(x.T * w_out, prod) + pre + post
    # with dropout the base output is recomputed from the dropped input, which autocast
    # casts for that matmul
    at_base = (held + y + alloc(x.T * w_in, x.c) + pre + post
               if tr.framework == "hf" and tr.lora_dropout > 0 and ac else 0)
    return max(at_eye, norm, combine, at_base)
