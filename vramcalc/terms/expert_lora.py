"""PEFT's ParamWrapper on a MoE layer's fused parameters (vramcalc/peft_moe.py): what one
adapted MoE layer keeps for backward and the gradient temporaries of its experts' backward.

peft 0.21.2 `tuners/lora/layer.py`: in forward each wrapped parameter P is replaced, under
`nn.utils.parametrize.cached()`, by W' = baddbmm(P, lhs, rhs, alpha=α/r) (`_LoraFactorsProxy`),
lhs and rhs being lora_B and lora_A reshaped per expert and cast to P's dtype
(`get_delta_factors`). W' needs a gradient, so:

- the experts' linears read slices `W'[e]` and keep them for dL/dx: every W' (E·out·in in
  P's dtype) stays until the layer's backward, where the frozen parameter cost nothing;
- they keep their inputs for dL/dW': the tokens sorted by expert (`moe.rows`) for
  gate_up_proj, act · up (`moe.down_input`) for down_proj, the router's input (`moe.input`)
  for its weight — the saved tensors of full training;
- baddbmm keeps lhs and rhs for their gradients: new tensors when the adapters' dtype is not
  P's (fp32 adapters on a 16-bit model), views otherwise; under autocast they are counted
  with the adapters' 16-bit casts (the autocast-cache term), which they are in size.

In backward each expert's `W'[e]` slice sends a full-size gradient (select_backward) that
autograd adds into W''s gradient buffer: while the experts' backward runs, gate_up_proj's and
down_proj's buffers (E·out·in each, P's dtype) and one new full-size gradient are alive
beside the layer's saved tensors."""

from __future__ import annotations

from vramcalc.peft_moe import wrapped_parameters
from vramcalc.rank import RankContext
from vramcalc.terms.moments import plain_forward_working_bytes
from vramcalc.terms.saved import Moment, Saved, dims
from vramcalc.units import alloc


def wrapped(ctx: RankContext) -> tuple[str, ...]:
    """The MoE parameters PEFT wraps on this rank's MoE layers ('gate_up', 'down',
    'router')."""
    tr = ctx.training
    return wrapped_parameters(ctx.spec, tr.framework, tr.finetune, tr.lora_targets,
                              tr.transformers_version)


def _shapes(ctx: RankContext) -> dict[str, tuple[int, int, int, int]]:
    """(experts, r', in, out) of each wrapped parameter."""
    spec, r = ctx.spec, ctx.training.lora_rank
    E, h, fe = spec.num_local_experts, spec.hidden_size, spec.expert_ffn
    return {"gate_up": (E, 2 * r, h, 2 * fe), "down": (E, r, fe, h), "router": (1, r, h, E)}


def kept_inputs(ctx: RankContext) -> set[str]:
    """Saved tensors of full training that a wrapped parameter's gradient keeps."""
    w = wrapped(ctx)
    out: set[str] = set()
    if "router" in w:
        out |= {"moe.input", "moe.input.cast"}
    if "gate_up" in w:
        out.add("moe.rows")
    if "down" in w:
        out.add("moe.down_input")
    return out


def expert_saved(ctx: RankContext) -> list[Saved]:
    """W' of each wrapped parameter, and baddbmm's lhs and rhs when they are casts."""
    tr = ctx.training
    p_dt, a_dt = tr.weight_dtype, tr.adapter_dtype
    out = []
    for w in wrapped(ctx):
        e, r, i, o = _shapes(ctx)[w]
        out.append(Saved(f"moe.lora.{w}.weight", e * o * i, p_dt, "(E, out, in)",
                         "W + α/r · lhs @ rhs, read by the experts"))
        if a_dt != p_dt and not tr.runs_autocast:  # under autocast: the adapters' casts
            # (terms/finetune_modifier.py adapters_autocast_cache_bytes), the same storages
            out += [Saved(f"moe.lora.{w}.lhs", e * o * r, p_dt, "(E, out, r')",
                          "lora_B per expert, cast to the parameter's dtype"),
                    Saved(f"moe.lora.{w}.rhs", e * r * i, p_dt, "(E, r', in)",
                          "lora_A per expert, cast to the parameter's dtype")]
    return out


def expert_moments(ctx: RankContext, moe_held: int, saved: list[Saved]) -> list[Moment]:
    """The backward instants of an adapted MoE layer's experts (transformers 5 runs them as
    two `_grouped_mm` calls over the tokens sorted by expert, S = T·k rows): down_proj's
    backward makes dL/dW'_down (E·h·fe) and dL/d act·up (S·fe) beside dL/d its output
    (the routing weights' product, S·h) and dL/d the layer's output; gate_up_proj's, once
    down's W' and inputs are freed, dL/dW'_gate_up (E·2fe·h), dL/d its input (S·h) and dL/d
    its output (S·2fe), the SiLU's and act · up's saved tensors freed. `moe_held`: what the
    layer holds at the first (the plain MoE instant's held set)."""
    w = wrapped(ctx)
    x = dims(ctx)
    c, p_dt = x.c, ctx.training.weight_dtype
    S = x.T * ctx.spec.num_experts_per_tok
    fe = ctx.spec.expert_ffn
    g = alloc(x.b * x.s * x.h, x.r)
    out = []
    size = {k: alloc(e * o * i, p_dt) for k, (e, _, i, o) in _shapes(ctx).items()}
    if "down" in w:
        # the routing weights' product has run its backward: the down output it kept for
        # the weights' gradient is gone
        gone = sum(t.nbytes for t in saved if t.name == "moe.down_out")
        out.append(Moment("experts_down", moe_held - gone,
                          g + alloc(S * x.h, c) + size["down"] + alloc(S * fe, c), "shared"))
    if "gate_up" in w:
        # down_proj's, the routing product's and act · up's backward have run
        gone = sum(t.nbytes for t in saved if t.name.startswith("moe.lora.down.") or t.name in (
            "moe.down_input", "moe.down_out", "moe.gate_up", "moe.act"))
        out.append(Moment("experts_gate_up", moe_held - gone,
                          g + size["gate_up"] + alloc(S * x.h, c) + alloc(S * 2 * fe, c),
                          "shared"))
    return out


def checkpointed_experts_bytes(ctx: RankContext) -> int:
    """A checkpointed MoE layer's forward (full recompute saves nothing) still makes each
    wrapped parameter's W', cached until the experts return: the plain instant's
    temporaries (vramcalc.terms.moments `plain_forward_working_bytes`) beside them."""
    w = wrapped(ctx)
    if ctx.training.recompute != "full" or not w or not ctx.shapes.num_moe_layers:
        return 0
    p_dt = ctx.training.weight_dtype
    return plain_forward_working_bytes(ctx) + sum(
        alloc(e * o * i, p_dt) for k, (e, _, i, o) in _shapes(ctx).items() if k in w)


def combine_instant_bytes(ctx: RankContext, saved: list[Saved]) -> int:
    """The end of an hf MoE layer's experts (transformers 5 integrations/moe.py
    `grouped_mm_experts_forward`), above every saved tensor of the layer: the routing
    product and its copy in token order (`weighted_out[inv_perm]`, S·h each) — or under
    autocast the copy, the fp32 per-token sum and its cast back —, beside the
    function's locals that nothing saves — the tokens sorted by expert when the experts are
    frozen, the experts' output when the routing weights need no gradient, the block's
    normed input when the router is frozen, the layer's input and its residual. `saved`: a
    MoE layer's saved list (empty without MoE layers)."""
    if (ctx.training.framework != "hf" or not saved or ctx.training.recompute == "full"):
        return 0
    x = dims(ctx)
    S = x.T * ctx.spec.num_experts_per_tok
    names = {t.name for t in saved}
    locals_ = sum(alloc(S * x.h, x.c) for n in ("moe.rows", "moe.down_out") if n not in names)
    if "moe.input" not in names:  # the block's normed input, an argument nothing saves
        locals_ += alloc(x.T * x.h, x.c)
    if x.r != "fp32":  # the layer's input (the caller's variable) and the residual after
        # attention, which the RMSNorms keep only as fp32 copies
        locals_ += 2 * alloc(x.T * x.h, x.r)
    at_index = 2 * alloc(S * x.h, x.c)
    # under autocast `sum` is on CUDA's fp32 list: the per-token sum is fp32 (T·h), then
    # cast back, while the reordered product is still bound and the product freed
    at_cast = (alloc(S * x.h, x.c) + alloc(x.T * x.h, "fp32") + alloc(x.T * x.h, x.c)
               if ctx.training.runs_autocast else 0)
    return max(at_index, at_cast) + locals_
