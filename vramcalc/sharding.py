"""Which parameter tensors one rank holds, and at what size.

Per rank: tensor-parallel matrices split ÷tp (norms replicated, vocab-parallel embedding
and head split), pipeline stages hold L/pp layers (first stage: embedding; last stage:
final norm and head; tied embeddings are held by both), experts ÷ep. ZeRO-3 / FSDP then
shards every tensor over the shard group (FSDP2 shards dim 0 with padding: ceil division).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramcalc.model import ModelSpec, ParamTensor, param_tensors
from vramcalc.parallel import ParallelConfig
from vramcalc.units import ceil_div


# Row-parallel matrices split their input dimension under TP (Megatron RowParallelLinear).
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight", "proj.weight")


@dataclass(frozen=True)
class RankTensor:
    """A parameter tensor as one rank holds it: local (TP/EP-split) numel, count on this rank."""

    name: str
    numel: int  # after TP split, before ZeRO-3/FSDP sharding
    count: int
    group: str
    rows: int = 0  # local first dimension (0 for vectors)


def stage_layers(spec: ModelSpec, parallel: ParallelConfig) -> int:
    """Transformer layers held by one pipeline stage (all virtual chunks together)."""
    return spec.num_hidden_layers // parallel.pp


def rank_tensors(spec: ModelSpec, parallel: ParallelConfig, stage: int = 0) -> list[RankTensor]:
    """Parameter tensors held by a rank of pipeline stage `stage` (before ZeRO-3 sharding)."""
    pp, tp, ep = parallel.pp, parallel.tp, parallel.ep
    first, last = stage == 0, stage == pp - 1
    layer_frac_num = stage_layers(spec, parallel)
    out: list[RankTensor] = []
    for t in param_tensors(spec):
        numel = ceil_div(t.numel, tp) if (t.tp_split and tp > 1) else t.numel
        count = _stage_count(t, spec, layer_frac_num, first, last)
        if t.group == "expert" and count:
            count = ceil_div(count, ep)
        rows = t.rows
        if rows and t.tp_split and tp > 1 and not t.name.endswith(ROW_PARALLEL):
            rows = ceil_div(rows, tp)
        if count:
            out.append(RankTensor(name=t.name, numel=numel, count=count, group=t.group,
                                  rows=rows))
    return out


def _stage_count(t: ParamTensor, spec: ModelSpec, stage_layers_n: int, first: bool,
                 last: bool) -> int:
    L = spec.num_hidden_layers
    if t.group == "embedding":
        if first:
            return t.count
        # tied embeddings: the last stage keeps its own copy of the token embedding
        if last and spec.tie_word_embeddings and t.name == "embed_tokens":
            return t.count
        return 0
    if t.group in ("final", "head"):
        return t.count if last else 0
    # per-layer tensors: t.count is a multiple of the number of layers holding them
    if t.name.startswith("experts.") or t.name.startswith("router") or t.name.startswith(
        "shared_expert"
    ):
        per_layer = t.count // max(spec.num_moe_layers, 1)
        # MoE layers sit after the first_k_dense_replace dense layers; spread evenly
        return per_layer * _moe_layers_on_stage(spec, stage_layers_n)
    if t.name.startswith("mlp."):
        per_layer = t.count // max(spec.num_dense_layers, 1)
        return per_layer * (stage_layers_n - _moe_layers_on_stage(spec, stage_layers_n))
    return t.count * stage_layers_n // L


def _moe_layers_on_stage(spec: ModelSpec, stage_layers_n: int) -> int:
    """MoE layers on the worst stage (stages after the leading dense layers hold only MoE)."""
    if not spec.is_moe:
        return 0
    return min(stage_layers_n, spec.num_moe_layers)


def sharded_numel(numel: int, shard: int) -> int:
    """Elements one rank keeps when a tensor is sharded over `shard` ranks (padded)."""
    return ceil_div(numel, shard) if shard > 1 else numel


def layer_param_numels(spec: ModelSpec, parallel: ParallelConfig) -> list[int]:
    """Local numels of one transformer layer's tensors (the unit FSDP gathers at once)."""
    tp = parallel.tp
    out = []
    for t in param_tensors(spec):
        if t.group not in ("layer", "expert"):
            continue
        n = ceil_div(t.numel, tp) if (t.tp_split and tp > 1) else t.numel
        layers = spec.num_hidden_layers if t.group == "layer" else max(spec.num_moe_layers, 1)
        per_layer = max(t.count // layers, 1)
        if t.group == "expert":
            per_layer = ceil_div(per_layer, parallel.ep)
        out.extend([n] * per_layer)
    return out
