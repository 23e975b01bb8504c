"""Activations and transients of LoRA / QLoRA / DoRA layers (frozen base, trained adapters).

Legend as in vramcalc/terms/saved.py (b, s, h, a, g, d, f, T = b·s tokens, c compute
dtype, r residual dtype), plus r_a = the adapter rank, p = lora_dropout, a_dt = the
adapters' dtype (TrainingConfig.adapter_dtype).

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
the base output and the LoRA output (T, out) per adapted linear; its weight norm
‖W + B·A‖ (detached) is computed from an (in, in) identity pushed through the adapters, a
copy of W in the input's dtype and two (out, in) sums: forward temporaries, not saved.

Under FSDP1 (vramcalc/terms/fsdp1.py) a block's frozen weights share a flat parameter with
its adapters and get gradients: the layer keeps the full-training list plus the adapters'.

The first layer of the first stage sees the frozen embedding's output, which needs no
gradient: nothing before its first adapter records a tensor (terms/first_layer.py).
"""

from __future__ import annotations

import dataclasses

from vramcalc.finetune import (
    peft_adapted_linears,
)
from vramcalc.peft_moe import adapts_shared_expert_gate
from vramcalc.rank import RankContext
from vramcalc.terms.expert_lora import expert_saved, kept_inputs
from vramcalc.terms.fsdp1 import mixed_units
from vramcalc.terms.saved import (
    Dims,
    Saved,
    autocasts_adapters,
    dims,
    mostly_moe,
    qlora_fp32_outputs,
    relu_output_is_down_input,
)
from vramcalc.terms.saved_layers import plain_layer_saved
from vramcalc.training import TrainingConfig
from vramcalc.units import alloc, ceil_div

# the storage a target reads (name in the full-fine-tuning saved list) and its width; the hf
# profile's fused modules (GPT-2 c_attn, Phi-3 qkv_proj / gate_up_proj) are 'qkv', 'gate_up'
_QKV, _GU = ("q", "k", "v", "qkv"), ("gate", "up", "gate_up")


def _in_width(x: Dims, target: str) -> int:
    return {"o": x.a * x.d, "down": x.f}.get(target, x.h)


def _out_width(x: Dims, target: str) -> int:
    return {"q": x.a * x.d, "k": x.g * x.d, "v": x.g * x.d, "o": x.h, "gate": x.f, "up": x.f,
            "down": x.h, "qkv": (x.a + 2 * x.g) * x.d, "gate_up": 2 * x.f,
            "shared_expert_gate": 1}[target]


def _targets(ctx: RankContext) -> tuple[str, ...]:
    """Adapted linears of a layer (fused modules as one: vramcalc.finetune.adapted_linears)."""
    tr = ctx.training
    return peft_adapted_linears(ctx.spec, tr.lora_targets, tr.framework, tr.finetune,
                                tr.transformers_version)


def _covers(targets: set[str] | tuple[str, ...]) -> set[str]:
    """Target letters an adapter set covers (a fused module covers its members)."""
    out = set(targets)
    if "qkv" in out:
        out |= {"q", "k", "v"}
    if "gate_up" in out:
        out |= {"gate", "up"}
    return out


def _input_dtype(ctx: RankContext, x: Dims, target: str) -> str:
    """dtype of the tensor a LoRA layer receives: a norm output (r) or a c-typed tensor."""
    if target == "down" and qlora_fp32_outputs(ctx, x):
        return x.r
    return x.c if target in ("o", "down") else x.r


def adapter_saved(ctx: RankContext, x: Dims, target: str) -> tuple[list[Saved], bool]:
    """(tensors one adapted linear adds, whether A keeps the shared input storage itself)."""
    tr = ctx.training
    a_dt = tr.adapter_dtype
    T, rank, p = x.T, tr.lora_rank, tr.lora_dropout
    width = _in_width(x, target)
    dt = _input_dtype(ctx, x, target)
    cast = tr.framework == "hf" and dt != a_dt  # PEFT _cast_input_dtype
    ac = autocasts_adapters(ctx, x)
    if cast:
        dt = a_dt
    out: list[Saved] = []
    name = f"lora.{target}"
    if p > 0:
        out.append(Saved(f"{name}.dropout_mask", T * width, "bool", "(T, in)",
                         "native_dropout mask"))
    shares = False
    if ac and dt != x.c:
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
    out.append(Saved(f"{name}.a_out", T * rank, x.c if ac else a_dt, "(T, r)", "kept by B"))
    if tr.finetune == "dora":
        o_w = _out_width(x, target)
        o_dt = x.c if ac else a_dt
        # with dropout PEFT recomputes the base output from the dropped fp32 input and
        # W.to(x.dtype) (peft 0.21.2 lora/variants.py DoraLinearVariant): in x's dtype (c
        # under autocast, whose matmul keeps its cast of the copy; `dora_weight_copy_bytes`)
        again = tr.framework == "hf" and p > 0
        # without it, PEFT subtracts the base layer's bias (its weight dtype) from the
        # base output: fp32 beside a c-typed output under autocast over fp32 weights
        spec = ctx.spec
        bias = {"o": spec.attention_out_bias, "gate": spec.mlp_bias, "up": spec.mlp_bias,
                "down": spec.mlp_bias, "gate_up": spec.mlp_bias}.get(target,
                                                                       spec.attention_bias)
        b_dt = ("fp32" if tr.framework == "hf" and bias and tr.weight_dtype == "fp32"
                else x.c)
        out += [Saved(f"{name}.dora_base_out", T * o_w, o_dt if again else b_dt, "(T, out)",
                      "base output (less its bias), kept by (m/‖W‖ − 1) ·"),
                Saved(f"{name}.dora_lora_out", T * o_w, o_dt, "(T, out)",
                      "LoRA output, kept by m/‖W‖ ·")]
        if again and tr.autocast_16bit and not tr.adapters_16bit:
            out.append(Saved(f"{name}.dora_weight_cast", o_w * width, x.c, "(out, in)",
                             "autocast's cast of W.to(x.dtype), kept for dL/dx"))
    return out, shares


def dora_weight_copy_bytes(ctx: RankContext) -> int:
    """One layer's weight copies that DoRA's recomputed base matmuls (hf, dropout) keep
    (`dora_weight_copies`); under full recompute the re-run's (adapter_instants.py)."""
    if ctx.training.recompute == "full":
        return 0
    return sum(dora_weight_copies(ctx).values())


def dora_weight_copies(ctx: RankContext) -> dict[str, int]:
    """Per adapted linear, the weight copy DoRA's recomputed base matmul (hf, dropout) keeps
    when it is a cast of the parameter: W.to(fp32) of 16-bit weights without autocast, or
    autocast's second c cast of an fp32 weight (the base layer's matmul kept the first).
    16-bit adapters leave x in W's dtype: W.to(x.dtype) is W itself."""
    tr = ctx.training
    if (tr.framework != "hf" or tr.finetune != "dora" or not tr.lora_dropout
            or tr.autocast_16bit or tr.adapters_16bit
            or (tr.weight_dtype == "fp32" and not tr.is_autocast)):
        return {}
    x = dims(ctx)
    dt = tr.compute_dtype if tr.is_autocast else "fp32"
    return {t: alloc(_in_width(x, t) * _out_width(x, t), dt) for t in _targets(ctx)}


_DROP_QKV = ("attn.input", "attn.input.cast")
_DROP_GU = ("mlp.input", "mlp.input.cast")


def adjust_layer_saved(ctx: RankContext, saved: list[Saved]) -> list[Saved]:
    """The full-fine-tuning saved list of one layer turned into the frozen layer's:
    weight-gradient-only entries dropped unless an adapter shares them, adapter tensors added
    (see the module docstring). In a mixture-of-experts layer the router and routed experts
    are frozen (their inputs, the gathered tokens and the experts' down-projection inputs go)
    unless PEFT wraps their fused parameters (terms/expert_lora.py), and the MLP targets
    adapt the shared experts (ffn fs, one adapter set each)."""
    x = dims(ctx)
    tr = ctx.training
    spec = ctx.spec
    targets = _targets(ctx)
    hf = tr.framework == "hf"
    moe = any(t.name.startswith("moe.") for t in saved)
    gated = spec.mlp_kind == "gated"
    added: list[Saved] = []
    keep: set[str] = set()
    for t in targets:
        xt, copies = x, 1
        if moe and t in ("gate", "up", "down"):
            copies = spec.num_shared_experts
            if not copies:
                continue
            xt = dataclasses.replace(x, f=ceil_div(spec.shared_ffn, ctx.parallel.tp))
        extra, shares = adapter_saved(ctx, xt, t)
        added += [dataclasses.replace(e, count=e.count * copies) for e in extra]
        if shares:
            keep.add(t)
    if bnb_keeps_inputs(ctx):
        keep.update(("q", "o", "gate", "down"))  # each 4-bit linear holds its input
    lit = tr.framework == "lightning"
    if lit:
        added = _litgpt_fused_adapter(ctx, x, added)
    if mixed_units(ctx):  # FSDP1: the frozen weights get gradients, their inputs stay
        return saved + added
    drop: set[str] = set()
    if not keep & set(_QKV):
        drop.update(_DROP_QKV)
    if not keep & set(_GU):
        drop.update(_DROP_GU + ("moe.input", "moe.input.cast"))
    selective = tr.recompute == "selective"
    eager = tr.attention == "eager"
    if "o" not in keep:
        drop.add("attn.o_input")
        if selective and not eager:
            drop.add("attn.out")  # the core's output, kept only by o_proj
    down_input = "down_input" if gated else "act"
    if "down" not in keep and not relu_output_is_down_input(ctx):
        drop.add(f"mlp.{down_input}")
        drop.update(f"shared_expert{i}.{down_input}" for i in range(spec.num_shared_experts))
        drop.add(f"shared_expert.{down_input}")  # the hf profile's name
    if moe and not (bnb_keeps_inputs(ctx) and not hf):  # frozen router, routed experts
        drop.update(("moe.expert_input", "moe.expert_input.cast", f"moe.expert.{down_input}",
                     "moe.rows", "moe.down_input"))
    if moe:  # PEFT's adapters on the experts' fused parameters (terms/expert_lora.py)
        drop -= kept_inputs(ctx)
        added += expert_saved(ctx)
        if adapts_shared_expert_gate(spec, tr.framework, tr.finetune, tr.lora_targets):
            added += adapter_saved(ctx, x, "shared_expert_gate")[0]
    # a frozen norm weight needs no x̂ (hf's and torchtune's Python RMSNorm keep it only
    # for the weight's gradient)
    py_norm = tr.framework in ("hf", "torchtune")
    out = [t for t in saved if t.name not in drop
           and not ((py_norm or lit) and t.name.endswith((".xhat", ".xhat_fp32")))]
    if qlora_fp32_outputs(ctx, x):
        # an old 4-bit down projection holds its own 16-bit cast of its input (Linear4bit
        # casts x to the compute dtype before MatMul4Bit), not the fp32 product
        cast = down_input if bnb_keeps_inputs(ctx) else ""
        # relu2's square already runs on the fp32 output: no autocast copy of it
        out = [t for t in out if t.name != "mlp.relu2.fp32"]
        # under selective recompute the checkpointed core keeps its own inputs: the 4-bit
        # projections' fp32 q, k and v (SDPA's 16-bit casts are made again in backward)
        core = ("attn.q", "attn.k", "attn.v", "attn.qkv") if tr.recompute == "selective" else ()
        out = [dataclasses.replace(t, dtype=x.r) if t.name in core or (
            _of_4bit_mlp(t.name) and not t.name.endswith(f".{cast}")) else t for t in out]
    return out + added


_4BIT_MLP_PARTS = ("gate", "up", "gate_up", "act", "down_input", "fc_out",
                   "gelu.half_x")  # GPT-2's NewGELU: 0.5·x of the fp32 fc output


def _of_4bit_mlp(name: str) -> bool:
    """Whether `name` is an intermediate of a 4-bit MLP — the dense one, a routed expert
    (the reference's NF4 experts) or a shared expert — or a 4-bit down projection's output
    that a MoE layer keeps (the experts' concatenated outputs, a gated shared expert's)."""
    owner, _, part = name.partition(".")
    if owner == "moe":
        owner, _, part = part.partition(".")
        return part in _4BIT_MLP_PARTS if owner == "expert" else owner == "expert_output"
    if owner == "mlp" or owner.startswith("shared_expert"):
        return part in _4BIT_MLP_PARTS or (owner != "mlp" and part == "output")
    return False


def _litgpt_fused_adapter(ctx: RankContext, x: Dims, added: list[Saved]) -> list[Saved]:
    """LitGPT's LoRAQKVLinear (8641822 lit_gpt/lora.py): one dropout on the fused qkv
    linear's input and one A for every enabled slice (r rows each): the q/k/v adapters'
    masks and dropout outputs are one tensor, their A outputs one (T, r·n) tensor. Unless
    q, k and v are all adapted, `zero_pad` scatters B's output (T, enabled widths) into the
    fused width with an out-of-place `index_copy`, whose backward keeps its source (for
    `expand_as`) and the index (int64, the enabled widths)."""
    qkv = [t for t in added if t.name.startswith(("lora.q.", "lora.k.", "lora.v."))]
    if not qkv:
        return added
    out = [t for t in added if t not in qkv]
    for part in ("dropout_mask", "dropout_out", "a_input_cast"):
        first = next((t for t in qkv if t.name.endswith("." + part)), None)
        if first is not None:
            out.append(dataclasses.replace(first, name=f"lora.qkv.{part}"))
    a_outs = [t for t in qkv if t.name.endswith(".a_out")]
    if a_outs:
        out.append(dataclasses.replace(a_outs[0], name="lora.qkv.a_out", shape="(T, r·n)",
                                       numel=sum(t.numel for t in a_outs)))
    letters = {t.name.split(".")[1] for t in qkv}
    if letters != {"q", "k", "v"}:
        width = sum(_out_width(x, t) for t in sorted(letters))
        out += [Saved("lora.qkv.pad_source", x.T * width, a_outs[0].dtype if a_outs else x.c,
                      "(T, enabled)", "B's output, kept by zero_pad's index_copy"),
                Saved("lora.qkv.pad_index", width, "int64", "(enabled)",
                      "lora_ind, kept by index_copy")]
    return out


def adjust_head_saved(ctx: RankContext, saved: list[Saved]) -> list[Saved]:
    """Final norm and frozen lm_head: the head's input is not kept (nor hf's norm x̂) —
    unless lm_head is a 4-bit linear of a bitsandbytes release that holds its input, or a
    trained copy of the head (modules_to_save) keeps it for its weight gradient."""
    tr = ctx.training
    py_norm = tr.framework in ("hf", "torchtune")
    head_keeps = (bnb_keeps_inputs(ctx) and tr.quantize_head) or "lm_head" in tr.modules_to_save
    out = [t for t in saved if (head_keeps or not t.name.startswith("lm_head.input"))
           and not (py_norm and t.name.endswith((".xhat", ".xhat_fp32")))]
    if tr.lora_head and ctx.is_last_stage:
        # PEFT's lora.Linear on lm_head, its input the final norm's output (T, h) in r: what
        # any adapted linear keeps (`adapter_saved`); when A keeps the norm output itself,
        # that is full training's lm_head input. Named lm_head.* (freed with the head's
        # backward, before the layers')
        extra, shares = adapter_saved(ctx, dims(ctx), "head")
        out += [dataclasses.replace(t, name=t.name.replace("lora.head.", "lm_head.lora."))
                for t in extra]
        if shares and not head_keeps:
            out += [t for t in saved if t.name.startswith("lm_head.input")]
    return out


def embedding_trained(tr: TrainingConfig) -> bool:
    """Whether the embedding's output needs a gradient under a PEFT method: a trained copy
    of it (modules_to_save) or an adapter on it (--lora-embedding)."""
    return "embed_tokens" in tr.modules_to_save or tr.lora_embedding


def held_4bit_inputs(ctx: RankContext) -> list[Saved]:
    """Under full recompute, what an old bitsandbytes release still holds of a checkpointed
    layer: `MatMul4Bit` keeps its input as a node attribute, which non-reentrant
    checkpointing (torch.utils.checkpoint, use_reentrant=False: saved-tensor hooks) does not
    intercept, so each 4-bit linear's input stays alive until the graph is freed — the q/k/v
    and gate/up inputs, o's (the attention output) and down's. Reentrant checkpointing runs
    the forward without grad, where `needs_input_grad` is all False and nothing is held."""
    if not bnb_keeps_inputs(ctx):
        return []
    plain = RankContext(ctx.spec, ctx.training.model_copy(update={"recompute": "none"}),
                        ctx.parallel, ctx.stage)
    full = adjust_layer_saved(plain, plain_layer_saved(plain, mostly_moe(plain)))
    names = {t.name for t in full}
    down = "mlp.down_input" if ctx.spec.mlp_kind == "gated" else "mlp.act"
    o_in = "attn.o_input" if "attn.o_input" in names else "attn.out"
    wanted = set(_DROP_QKV + _DROP_GU) | {o_in, down}
    return [t for t in full if t.name in wanted]


def bnb_keeps_inputs(ctx: RankContext) -> bool:
    """QLoRA on a bitsandbytes release before 0.43.2: `MatMul4Bit` holds each 4-bit linear's
    input (vramcalc/qlora.py), so the inputs full fine-tuning saves for weight gradients
    stay (the q/k/v and gate/up inputs, o's and down's), except in the first layer, whose
    input needs no gradient (`ctx.tensors = (None, None)`)."""
    return ctx.training.finetune == "qlora" and ctx.training.nf4.keeps_input
