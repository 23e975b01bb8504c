"""PEFT's LoRA on transformers 5's fused MoE experts (the hf profile).

transformers 5 stores a MoE layer's routed experts as two 3-D parameters,
`experts.gate_up_proj` (E, 2·fe, h) and `experts.down_proj` (E, h, fe), where transformers 4
had one `nn.Linear` per expert. PEFT converts a LoRA config written for the old layout
(peft 0.21.2 `utils/transformers_weight_conversion.py` `_convert_peft_config_moe`, called by
`get_peft_model` through `convert_peft_config_for_transformers`) for the model types that
transformers' own checkpoint conversion maps to the "qwen2_moe" or "mixtral" pattern
(transformers 5 `conversion_mapping._MODEL_TO_CONVERSION_PATTERN`; PEFT adds "mixtral"):

- the old expert names in `target_modules` (`gate_proj`, `up_proj`, `down_proj` for the
  qwen2_moe pattern; `w1`, `w3`, `w2` for Mixtral's) move to `target_parameters`: the fused
  `gate_up_proj` (only with both halves, else ValueError "Cannot convert PEFT target(s) ...";
  rank and alpha doubled by `rank_pattern` / `alpha_pattern`, α/r unchanged) and
  `down_proj`. They leave `target_modules`, so a dense layer's or a shared expert's
  `gate_proj` / `up_proj` / `down_proj` `nn.Linear` gets no adapter;
- `target_modules="all-linear"` resolves to every `nn.Linear` plus those old names and the
  router's `gate` (`_resolve_string_target_modules`), whose weight becomes a target
  parameter too.

Each target parameter gets a `ParamWrapper` (peft 0.21.2 `tuners/lora/layer.py`): lora_A
(r·E, in) and lora_B (out, r·E) as one `nn.Linear` each (E = 1 for the router's 2-D weight),
and in forward a parametrization `W + α/r · lhs @ rhs` (one `baddbmm`, cached for the
forward) that replaces the parameter. It refuses lora_dropout > 0 and DoRA. The hf profile
builds Qwen3-MoE (qk-norm, no shared expert: the qwen2_moe pattern), Mixtral and Qwen2-MoE
(`qwen2_moe` itself is not in the table: PEFT leaves its targets alone)."""

from __future__ import annotations

from vramcalc.errors import InputError
from vramcalc.model import ModelSpec
from vramcalc.sharding import RankShapes, RankTensor

# the hf profile's MoE families (vramcalc/trace/hf_models.py `hf_family`) that PEFT converts
_PATTERN = {"qwen3_moe": "qwen2_moe", "mixtral": "mixtral"}
_MLP = ("gate", "up", "down")


def moe_family(spec: ModelSpec) -> str:
    """The transformers MoE class the hf profile builds: Qwen2-MoE (a gated shared expert),
    Qwen3-MoE (qk-norm) or Mixtral."""
    if spec.num_shared_experts:
        return "qwen2_moe"
    return "qwen3_moe" if spec.qk_norm else "mixtral"


def _before_5(transformers_version: str | None) -> bool:
    return transformers_version is not None and int(transformers_version.split(".")[0]) < 5


def wrapped_parameters(spec: ModelSpec, framework: str, method: str, targets: str,
                       transformers_version: str | None = None) -> tuple[str, ...]:
    """The MoE parameters PEFT wraps ('gate_up', 'down', 'router'); () when none."""
    if (framework != "hf" or not spec.is_moe or method not in ("lora", "qlora", "dora")
            or _before_5(transformers_version)):
        return ()
    pattern = _PATTERN.get(moe_family(spec))
    if pattern is None:
        return ()
    if targets == "all-linear":
        return ("gate_up", "down", "router")
    if pattern == "mixtral":  # its old names are w1 / w3 / w2, not vramcalc's letters
        return ()
    wanted = set(targets.split(","))
    out = []
    if wanted >= {"gate", "up"}:
        out.append("gate_up")
    if "down" in wanted:
        out.append("down")
    return tuple(out)


def adapts_shared_expert_gate(spec: ModelSpec, framework: str, method: str,
                              targets: str) -> bool:
    """Qwen2-MoE's `shared_expert_gate` is an `nn.Linear(h, 1)`: PEFT's "all-linear" takes
    it (qwen2_moe is not converted, so nothing else of the MoE block changes)."""
    return (framework == "hf" and spec.is_moe and spec.shared_expert_gate
            and targets == "all-linear" and method in ("lora", "qlora", "dora"))


def converted_letters(spec: ModelSpec, framework: str, method: str, targets: str,
                      transformers_version: str | None = None) -> frozenset[str]:
    """MLP target letters that PEFT moves from `target_modules` to the experts' parameters:
    no dense layer or shared expert keeps an adapter for them."""
    if not wrapped_parameters(spec, framework, method, targets, transformers_version):
        return frozenset()
    if _PATTERN[moe_family(spec)] != "qwen2_moe":
        return frozenset()
    return frozenset(_MLP if targets == "all-linear" else set(targets.split(",")) & set(_MLP))


def expert_lora_problem(spec: ModelSpec, framework: str, method: str, targets: str,
                        dropout: float, transformers_version: str | None = None
                        ) -> str | None:
    """What PEFT refuses (ValueError) when it converts the targets to expert parameters."""
    halves = set(targets.split(",")) & {"gate", "up"}
    if (framework == "hf" and spec.is_moe and not _before_5(transformers_version)
            and _PATTERN.get(moe_family(spec)) == "qwen2_moe" and len(halves) == 1
            and method in ("lora", "qlora", "dora")):
        return (f"--lora-targets {targets}: transformers 5 fuses {spec.name}'s expert gate "
                "and up projections into one parameter, and PEFT converts a target to it "
                "only with both (peft 0.21.2 _convert_peft_config_moe: \"Cannot convert "
                "PEFT target(s)\"); target gate and up together")
    if (framework == "hf" and spec.is_moe and _before_5(transformers_version)
            and method in ("lora", "qlora", "dora") and (targets == "all-linear" or (
                moe_family(spec) != "mixtral" and set(targets.split(",")) & set(_MLP)))):
        # transformers 4 kept one nn.Linear per expert (Mixtral's w1/w2/w3, the Qwen MoEs'
        # gate_proj/up_proj/down_proj), which PEFT adapts one by one
        return (f"--transformers-version {transformers_version}: transformers 4 keeps "
                f"{spec.name}'s experts as one nn.Linear each, which --lora-targets {targets} "
                "adapts expert by expert; that is not modelled (transformers 5's fused "
                "experts are): give 5.0 or later, or target the attention (q,k,v,o)")
    wrapped = wrapped_parameters(spec, framework, method, targets, transformers_version)
    if not wrapped:
        return None
    if method == "dora":
        return (f"--finetune dora: PEFT puts {spec.name}'s expert parameters under a "
                "ParamWrapper, which refuses DoRA (peft 0.21.2 tuners/lora/layer.py); target "
                "the attention only (--lora-targets q,k,v,o)")
    if dropout > 0:
        return (f"--lora-dropout {dropout:g}: PEFT puts {spec.name}'s expert parameters under "
                "a ParamWrapper, which refuses dropout (peft 0.21.2 tuners/lora/layer.py: "
                "\"does not work with lora_dropout != 0\"); give --lora-dropout 0")
    return None


def check_expert_lora(spec: ModelSpec, framework: str, method: str, targets: str,
                      dropout: float, transformers_version: str | None = None) -> None:
    """InputError for what `expert_lora_problem` finds."""
    problem = expert_lora_problem(spec, framework, method, targets, dropout,
                                  transformers_version)
    if problem:
        raise InputError(problem)


def mlp_names(letters: frozenset[str]) -> set[str]:
    """The dense MLP's and shared experts' weight names of these target letters."""
    mats = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    return {f"{p}{mats[t]}.weight" for t in letters for p in ("mlp.", "shared_expert.")}


def expert_adapters(base: RankShapes, spec: ModelSpec, rank: int, a_dtype: str,
                    wrapped: tuple[str, ...], method: str = "lora",
                    shared_gate: bool = False) -> list[RankTensor]:
    """PEFT's ParamWrapper adapters on a MoE layer's fused parameters (vramcalc/peft_moe.py):
    lora_A (r'·E, in) and lora_B (out, r'·E) per wrapped parameter, r' = 2r for the fused
    gate_up_proj (its rank_pattern), E = 1 for the router's 2-D weight; and Qwen2-MoE's
    `shared_expert_gate` (`adapts_shared_expert_gate`) as a plain LoRA linear. One per MoE
    layer."""
    if not base.num_moe_layers:
        return []
    out = []
    seg = [t for t in base.tensors if t.name == "shared_expert_gate.weight"]
    if shared_gate and seg:  # A (r, h), B (1, r)
        out += [RankTensor(name="shared_expert_gate.lora_A", numel=rank * seg[0].numel,
                           count=seg[0].count, group="layer", rows=rank, dtype=a_dtype),
                RankTensor(name="shared_expert_gate.lora_B", numel=rank, count=seg[0].count,
                           group="layer", rows=1, dtype=a_dtype)]
        if method == "dora":  # one magnitude per output row
            out.append(RankTensor(name="shared_expert_gate.lora_magnitude", numel=1,
                                  count=seg[0].count, group="layer", dtype=a_dtype))
    if not wrapped:
        return out
    n = base.num_moe_layers
    experts = sum(t.count for t in base.tensors if t.name == "experts.gate_proj.weight") // n
    h, fe = spec.hidden_size, spec.expert_ffn
    dims = {"gate_up": (experts, 2 * rank, h, 2 * fe), "down": (experts, rank, fe, h),
            "router": (1, rank, h, experts)}
    stems = {"gate_up": "experts.gate_up_proj", "down": "experts.down_proj",
             "router": "router"}
    for w in wrapped:
        e, r, in_f, out_f = dims[w]
        out += [RankTensor(name=f"{stems[w]}.lora_A", numel=r * e * in_f, count=n,
                           group="layer", rows=r * e, dtype=a_dtype),
                RankTensor(name=f"{stems[w]}.lora_B", numel=out_f * r * e, count=n,
                           group="layer", rows=out_f, dtype=a_dtype)]
    return out
