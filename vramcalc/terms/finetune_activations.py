"""Activations and transients of LoRA / QLoRA / DoRA layers (frozen base, trained adapters).

Legend as in vramcalc/terms/activations.py (b, s, h, a, g, d, f, T = b·s tokens, c compute
dtype, r residual dtype), plus r_a = the adapter rank, p = lora_dropout, a_dt = the
adapters' dtype (vramcalc.finetune.adapter_dtype).

What a frozen layer keeps (autograd saves a tensor only for a gradient someone needs):

- a frozen linear y = x Wᵀ keeps nothing new: dL/dx needs W (resident) but not x, so the
  full-fine-tuning entries kept only for weight gradients go — the q/k/v input, the MLP
  input, the down-projection input (2-matrix MLP: the activation output), eager attention's
  o-projection input copy — unless an adapter reads the same storage;
- a norm with a frozen weight: the fused kernels keep what they kept (input, rstd);
  transformers' Python RMSNorm no longer keeps x̂ (only `weight · x̂`'s weight grad read it);
- under autocast a frozen fp32 weight is not cached (autocast caches leaves that require
  grad) but its 16-bit cast is saved by the matmul, for dL/dx: one cast per linear per layer,
  as full fine-tuning's cache (vramcalc.terms.transients).

Each adapted linear y = base(x) + B(A(dropout(x)))·α/r_a (PEFT lora.Linear.forward; the
reference model's LoRALinear does the same without the input cast) adds:

| saved                      | shape    | dtype      | when |
|----------------------------|----------|------------|------|
| PEFT's input cast          | (T, in)  | a_dt       | hf, x.dtype != a_dt, p = 0, no autocast (kept by A) |
| dropout mask               | (T, in)  | bool       | p > 0 (native_dropout) |
| dropout output             | (T, in)  | x's dtype  | p > 0, no autocast (kept by A) |
| autocast cast of A's input | (T, in)  | c          | autocast and A's input not in c |
| A's output                 | (T, r_a) | c (autocast) or a_dt | always (kept by B) |

With p = 0, no cast and no autocast, A keeps x itself: the storage the full model kept
anyway (shared by q, k, v or gate, up), so it stays. DoRA (PEFT's DoraLinearLayer) also keeps
the base output and the LoRA output (T, out) and the (in, in) identity its `lora_B(lora_A(eye))`
weight product reads, per adapted linear.

The first layer of the first stage sees the frozen embedding's output, which needs no
gradient: its input norm records nothing (`first_layer_unsaved_bytes`).
"""

from __future__ import annotations

import dataclasses

from vramcalc.finetune import adapter_dtype, shapes_for, targeted_linears
from vramcalc.terms.activations import Dims, Saved, dims
from vramcalc.terms.context import RankContext
from vramcalc.units import alloc

# the storage a target reads (name in the full-fine-tuning saved list) and its width
_QKV, _GU = ("q", "k", "v"), ("gate", "up")


def _in_width(x: Dims, target: str) -> int:
    return {"o": x.a * x.d, "down": x.f}.get(target, x.h)


def _out_width(x: Dims, target: str) -> int:
    return {"q": x.a * x.d, "k": x.g * x.d, "v": x.g * x.d, "o": x.h, "gate": x.f, "up": x.f,
            "down": x.h}[target]


def _fp32_mlp(ctx: RankContext, x: Dims) -> bool:
    """QLoRA under autocast: bitsandbytes' Linear4bit returns its output in its input's
    dtype (`.to(inp_dtype)`), so the MLP's gate/up outputs and everything elementwise after
    them stay in the residual's fp32."""
    return ctx.training.finetune == "qlora" and x.amp


def _input_dtype(ctx: RankContext, x: Dims, target: str) -> str:
    """dtype of the tensor a LoRA layer receives: a norm output (r) or a c-typed tensor."""
    if target == "down" and _fp32_mlp(ctx, x):
        return x.r
    return x.c if target in ("o", "down") else x.r


def adapter_saved(ctx: RankContext, x: Dims, target: str) -> tuple[list[Saved], bool]:
    """(tensors one adapted linear adds, whether A keeps the shared input storage itself)."""
    tr = ctx.training
    a_dt = adapter_dtype(tr.framework, tr.weight_dtype)
    T, rank, p = x.T, tr.lora_rank, tr.lora_dropout
    width = _in_width(x, target)
    dt = _input_dtype(ctx, x, target)
    cast = tr.framework == "hf" and dt != a_dt  # PEFT _cast_input_dtype
    if cast:
        dt = a_dt
    out: list[Saved] = []
    name = f"lora.{target}"
    if p > 0:
        out.append(Saved(f"{name}.dropout_mask", T * width, "bool", "(T, in)",
                         "native_dropout mask"))
    shares = False
    if x.amp and dt != x.c:
        out.append(Saved(f"{name}.a_input_cast", T * width, x.c, "(T, in)",
                         "autocast's cast of A's input, kept by A"))
    elif p > 0:
        out.append(Saved(f"{name}.dropout_out", T * width, dt, "(T, in)",
                         "dropout output, kept by A"))
    elif cast:
        out.append(Saved(f"{name}.input_cast", T * width, dt, "(T, in)",
                         "PEFT's cast of x to the adapter dtype, kept by A"))
    else:
        shares = True
    out.append(Saved(f"{name}.a_out", T * rank, x.c if x.amp else a_dt, "(T, r)",
                     "A's output, kept by B"))
    if tr.finetune == "dora":
        o_w = _out_width(x, target)
        o_dt = x.c if x.amp else a_dt
        out += [Saved(f"{name}.dora_eye", width * width, a_dt, "(in, in)",
                      "torch.eye kept by lora_A for the weight product"),
                Saved(f"{name}.dora_eye_a", width * rank, a_dt, "(in, r)",
                      "lora_A(eye), kept by lora_B"),
                Saved(f"{name}.dora_base_out", T * o_w, x.c, "(T, out)",
                      "base output, kept by (m/‖W‖ − 1) ·"),
                Saved(f"{name}.dora_lora_out", T * o_w, o_dt, "(T, out)",
                      "LoRA output, kept by m/‖W‖ ·")]
    return out, shares


_DROP_QKV = ("attn.input", "attn.input.cast")
_DROP_GU = ("mlp.input", "mlp.input.cast")


def adjust_layer_saved(ctx: RankContext, saved: list[Saved]) -> list[Saved]:
    """The full-fine-tuning saved list of one layer (non-MoE parts) turned into the frozen
    layer's: weight-gradient-only entries dropped unless an adapter shares them, adapter
    tensors added (see the module docstring)."""
    x = dims(ctx)
    tr = ctx.training
    targets = targeted_linears(ctx.spec, tr.lora_targets)
    hf = tr.framework == "hf"
    added: list[Saved] = []
    keep: set[str] = set()
    for t in targets:
        extra, shares = adapter_saved(ctx, x, t)
        added += extra
        if shares:
            keep.add(t)
    drop = set()
    if not keep & set(_QKV):
        drop.update(_DROP_QKV)
    if not keep & set(_GU):
        drop.update(_DROP_GU)
    selective = tr.recompute == "selective"
    eager = tr.attention == "eager"
    if "o" not in keep:
        drop.add("attn.o_input")
        if selective and not eager:
            drop.add("attn.out")  # the core's output, kept only by o_proj
    if "down" not in keep:
        drop.add("mlp.down_input" if ctx.spec.mlp_kind == "gated" else "mlp.act")
    out = [t for t in saved if t.name not in drop
           and not (hf and t.name.endswith((".xhat", ".xhat_fp32")))]
    if _fp32_mlp(ctx, x):
        out = [dataclasses.replace(t, dtype=x.r) if t.name in (
            "mlp.gate", "mlp.up", "mlp.act", "mlp.down_input", "mlp.fc_out") else t for t in out]
    return out + added


def adjust_head_saved(ctx: RankContext, saved: list[Saved]) -> list[Saved]:
    """Final norm and frozen lm_head: the head's input is not kept (nor hf's norm x̂)."""
    hf = ctx.training.framework == "hf"
    return [t for t in saved if not t.name.startswith("lm_head.input")
            and not (hf and t.name.endswith((".xhat", ".xhat_fp32")))]


def first_layer_unsaved_bytes(ctx: RankContext) -> int:
    """Bytes the first layer of the first stage does not keep because its input (the frozen
    embedding's output) needs no gradient: its input norm's tensors, the q/k/v adapters'
    dropout masks and, when no q/k/v is adapted, the attention core's (an approximation
    documented in docs/finetuning.md)."""
    if not ctx.is_first_stage or ctx.training.recompute == "full" or not ctx.num_layers:
        return 0
    from vramcalc.terms.activations import layer_saved

    bottom_moe = ctx.spec.is_moe and ctx.spec.first_k_dense_replace == 0
    saved = layer_saved(ctx, bottom_moe)
    # the input norm, and dropout masks on its output (no grad flows into the dropout)
    gone = sum(t.nbytes for t in saved if t.name.startswith("input_norm.") or t.name in (
        "lora.q.dropout_mask", "lora.k.dropout_mask", "lora.v.dropout_mask"))
    if not set(targeted_linears(ctx.spec, ctx.training.lora_targets)) & set(_QKV):
        gone += sum(t.nbytes for t in saved if t.name.startswith("attn.")
                    and t.name != "attn.out")
    return gone


def autocast_cache_layer_bytes(ctx: RankContext) -> int:
    """Per-layer average of the 16-bit weight casts alive in forward under autocast: the
    trained adapters' (cached) and, unless layers are recomputed, the frozen fp32 linear
    weights' (saved by their matmuls for dL/dx). NF4 weights are not cast; frozen biases'
    casts are not saved. The first layer's q/k/v casts are not saved (no grad there)."""
    n = ctx.num_layers
    if not n:
        return 0
    c = ctx.training.compute_dtype
    fs = shapes_for(ctx)
    total = sum(t.count * alloc(t.numel, c) for t in fs.adapters.tensors
                if t.group in ("layer", "expert") and t.rows)
    if ctx.training.recompute != "full":
        frozen = [t for t in fs.frozen.tensors if t.group in ("layer", "expert") and t.rows
                  and t.name.endswith(".weight") and "norm" not in t.name]
        total += sum(t.count * alloc(t.numel, c) for t in frozen)
        if ctx.is_first_stage:
            total -= sum(alloc(t.numel, c) for t in frozen
                         if t.name in ("attn.q_proj.weight", "attn.k_proj.weight",
                                       "attn.v_proj.weight"))
    return max(total, 0) // n


# ---- forward transients ------------------------------------------------------------------
# Where each saved tensor of a layer appears in its forward (for "saved so far" at a moment)
_ORDER = (("input_norm.",), ("attn.input", "lora.q.", "lora.k.", "lora.v.", "attn.q_norm",
                             "attn.k_norm"),
          ("attn.",), ("lora.o.",), ("post_norm.",), ("mlp.input", "lora.gate.", "lora.up."),
          ("mlp.",), ("lora.down.",))
_STEP_OF = {"q": 1, "k": 1, "v": 1, "o": 3, "gate": 5, "up": 5, "down": 7}


def _step(name: str) -> int:
    """Index in _ORDER of the first group whose prefix matches (later groups are more
    specific only for lora.*; attn.* and mlp.* fall through to their generic groups)."""
    for i, prefixes in enumerate(_ORDER):
        if name.startswith(prefixes):
            return i
    return len(_ORDER)


def forward_working_bytes(ctx: RankContext) -> int:
    """Worst transient inside the top layer's forward beyond what the forward-phase formula
    already counts (every saved tensor of the micro-batch, head included), under
    LoRA/QLoRA/DoRA: at each adapted or quantized linear, the tensors of the layer saved so
    far plus what is alive and not saved —

    - the linear's input when nothing saves it (the normed input during q/k/v and gate/up,
      the act·up product during down), and under the hf profile the layer's residual and the
      model's `inputs_embeds` local (first stage);
    - QLoRA: the dequantized weight, its two fp32 absmax buffers and the output
      (vramcalc.finetune.dequant_transient_bytes);
    - the adapter's sum y + B(A(x))·α/r: the base output y (c), B's output and its scaled
      copy (c under autocast, else a_dt; PEFT adds in fp32 and casts back), PEFT's fp32
      input cast when dropout makes it a temporary.

    Returned as bytes above the formula's count (may be negative; the caller takes a max)."""
    from vramcalc.finetune import dequant_transient_bytes
    from vramcalc.terms.activations import head_saved, layer_saved

    tr = ctx.training
    if tr.recompute == "full" or not ctx.num_layers:
        return 0
    x = dims(ctx)
    saved = layer_saved(ctx, ctx.spec.is_moe and ctx.spec.first_k_dense_replace == 0)
    full_layer = sum(t.nbytes for t in saved)
    head = sum(t.nbytes for t in head_saved(ctx))
    hf = tr.framework == "hf"
    a_dt = adapter_dtype(tr.framework, tr.weight_dtype)
    targets = set(targeted_linears(ctx.spec, tr.lora_targets))
    names = {t.name for t in saved}
    T, c, r = x.T, x.c, x.r
    always = 0
    if hf:
        always += alloc(T * x.h, r) if r != "fp32" else 0  # the residual local
        if ctx.is_first_stage:
            always += alloc(T * x.h, r)  # inputs_embeds, alive through the decoder's forward
    linears = ["q", "k", "v", "o"] + (["gate", "up", "down"] if ctx.spec.mlp_kind == "gated"
                                      else ["up", "down"])
    best = -(1 << 62)
    for t in linears:
        adapted = t in targets
        if not adapted and tr.finetune != "qlora":
            continue
        step = _STEP_OF[t]
        held = sum(s.nbytes for s in saved if _step(s.name) <= step)
        w_in, w_out = _in_width(x, t), _out_width(x, t)
        work = always
        if t in _QKV and "attn.input" not in names:
            work += alloc(T * x.h, r)  # the normed input, alive as the projections' argument
        if t in _GU and "mlp.input" not in names:
            work += alloc(T * x.h, r)
        if t == "down" and not ({"mlp.down_input", "mlp.act"} & names):
            work += alloc(T * w_in, _input_dtype(ctx, x, "down"))
        y = alloc(T * w_out, c)
        if tr.finetune == "qlora":
            n = w_in * w_out
            base_moment = dequant_transient_bytes(n, c) + y
        else:
            base_moment = 0
        lora_moment = 0
        if adapted:
            o_dt = c if x.amp else a_dt
            extra = 0
            if hf and tr.lora_dropout > 0 and _input_dtype(ctx, x, t) != a_dt:
                extra = alloc(T * w_in, a_dt)  # PEFT's cast, a temporary before dropout
            sum_dt = "fp32" if hf and a_dt == "fp32" else c
            lora_moment = y + max(2 * alloc(T * w_out, o_dt),
                                  alloc(T * w_out, o_dt) + alloc(T * w_out, sum_dt)) + extra
        best = max(best, held + work + max(base_moment, lora_moment))
    if best < 0:
        return 0
    return best - full_layer - head
