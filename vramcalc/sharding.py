"""Which parameter tensors one rank holds, and at what size.

Per rank: tensor-parallel matrices split ÷tp (norms replicated, vocab-parallel embedding
and head split), pipeline rank r holds the layers of its model chunks (chunk c = r + k·p,
k < v, layers [c·L/(p·v), (c+1)·L/(p·v)); v = 1 outside the interleaved schedule; uneven
splits as Megatron-LM builds them, `chunk_layers`), the
first rank the embedding, the last rank the final norm and head (tied embeddings are held
by both), experts ÷ep (and split ÷etp, the expert tensor-parallel degree, instead of ÷tp). Sharding (ZeRO/FSDP/distributed optimizer) then divides what is
held over the shard group, in one of four layouts (`Layout`):

| layout  | who                                | bytes per rank |
|---------|------------------------------------|----------------|
| tensor  | replicated (DDP, no sharding)      | Σ round512(numel·bits/8) per tensor |
| dim0    | FSDP2 (`fully_shard`, Shard(0))    | Σ round512(⌈rows/N⌉·cols·bits/8): dim 0 padded to a multiple of N |
| flat    | DeepSpeed ZeRO-1/2, Megatron distributed optimizer | round512(⌈Σ numel / N⌉·bits/8): one flat buffer, partitioned |
| persist | DeepSpeed ZeRO-3 parameters        | tensors ≤ stage3_param_persistence_threshold (1e5) elements whole, the rest ⌈numel/N⌉ in one flat buffer |
| group   | FSDP2 gradients                    | dim-0 shards, one buffer per `fully_shard` group (each block, the root): the reduce-scatter output the sharded gradients are views of |

Everything here is cached on hashable inputs: `estimate` is called thousands of times
per plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from vramcalc.model import ModelSpec, ParamTensor
from vramcalc.model_tensors import param_tensors
from vramcalc.parallel import ParallelConfig
from vramcalc.units import alloc, ceil_div

# Row-parallel matrices split their input dimension under TP (Megatron RowParallelLinear):
# o_proj, down_proj and the 2-matrix MLP's output `proj` (".proj": q_proj etc. are column-
# parallel).
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight", ".proj.weight")

# DeepSpeed ZeRO-3 keeps parameters of at most this many elements unpartitioned on every
# rank (stage3_param_persistence_threshold, default 1e5; deepspeed/runtime/zero/config.py,
# DeepSpeed 0.16.5 @ 38327e07; parameter_offload.py `mark_persistent_parameters`:
# `param.ds_numel <= param_threshold`). A DeepSpeed config sets it per scenario
# (ParallelConfig.deepspeed.param_persistence_threshold).
DS_PERSISTENCE_THRESHOLD = 100_000

Layout = Literal["tensor", "dim0", "flat", "persist", "group"]


@dataclass(frozen=True)
class RankTensor:
    """A parameter tensor as one rank holds it: local (TP/EP-split) numel, count on this rank."""

    name: str
    numel: int  # after TP split, before ZeRO-3/FSDP sharding
    count: int
    group: str
    rows: int = 0  # local first dimension (0 for vectors)
    trainable: bool = True  # False: a frozen base weight under LoRA/QLoRA (vramcalc/finetune.py)
    dtype: str | None = None  # storage dtype when not the policy's (adapters, "nf4")

    @property
    def is_expert(self) -> bool:
        return self.group == "expert"


@dataclass(frozen=True, eq=False)
class RankShapes:
    """The parameter tensors of one pipeline rank, with memoized byte sums."""

    tensors: tuple[RankTensor, ...]
    num_layers: int
    num_moe_layers: int
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def nbytes(self, dtype: str, shard: int = 1, expert_shard: int = 1,
               layout: Layout = "tensor", groups: tuple[str, ...] | None = None,
               persist_threshold: int = DS_PERSISTENCE_THRESHOLD) -> int:
        """Bytes one rank keeps of these tensors in `dtype`, sharded over `shard` ranks
        (experts over `expert_shard`) in `layout`; `groups` limits the tensor groups;
        `persist_threshold`: the `persist` layout's largest whole tensor."""
        key = (dtype, shard, expert_shard, layout, groups, persist_threshold)
        hit = self._memo.get(key)
        if hit is None:
            if layout == "group":
                hit = _group_bytes(self, dtype, shard, expert_shard, groups)
            else:
                hit = _sharded_bytes(self.tensors, dtype, shard, expert_shard, layout, groups,
                                     persist_threshold)
            self._memo[key] = hit
        return hit

    def numel(self, groups: tuple[str, ...] | None = None) -> int:
        """Local (TP/EP-split) elements held by this rank, unsharded."""
        key = ("numel", groups)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = sum(t.numel * t.count for t in self.tensors
                                        if groups is None or t.group in groups)
        return hit


def dim0_numel(t: RankTensor, shard: int) -> int:
    """FSDP2 shard of one tensor: dim 0 padded to a multiple of the shard group."""
    if shard <= 1:
        return t.numel
    if t.rows:
        return ceil_div(t.rows, shard) * (t.numel // t.rows)
    return ceil_div(t.numel, shard)


def _sharded_bytes(tensors: tuple[RankTensor, ...], dtype: str, shard: int, expert_shard: int,
                   layout: Layout, groups: tuple[str, ...] | None,
                   persist_threshold: int = DS_PERSISTENCE_THRESHOLD) -> int:
    sel = [t for t in tensors if groups is None or t.group in groups]
    if layout == "tensor" or (shard <= 1 and expert_shard <= 1 and layout != "flat"):
        return sum(t.count * alloc(t.numel, dtype) for t in sel)
    if layout == "dim0":
        return sum(t.count * alloc(dim0_numel(t, expert_shard if t.is_expert else shard), dtype)
                   for t in sel)
    total = 0
    for experts in (False, True):
        part = [t for t in sel if t.is_expert == experts]
        if not part:
            continue
        n = expert_shard if experts else shard
        if layout == "flat":
            total += alloc(ceil_div(sum(t.numel * t.count for t in part), n), dtype)
            continue
        # persist: small tensors whole, the rest partitioned into one flat buffer
        kept = [t for t in part if t.numel <= persist_threshold]
        flat = sum(t.count * ceil_div(t.numel, n) for t in part
                   if t.numel > persist_threshold)
        total += sum(t.count * alloc(t.numel, dtype) for t in kept) + alloc(flat, dtype)
    return total


def _group_bytes(shapes: RankShapes, dtype: str, shard: int, expert_shard: int,
                 groups: tuple[str, ...] | None) -> int:
    """FSDP2 `group` layout: one allocation per fully_shard group (root, each block)."""
    def n(t: RankTensor) -> int:
        return dim0_numel(t, expert_shard if t.is_expert else shard)

    sel = [t for t in shapes.tensors if groups is None or t.group in groups]
    root = sum(n(t) * t.count for t in sel if t.group in ("embedding", "final", "head"))
    total = alloc(root, dtype) if root else 0
    n_moe = shapes.num_moe_layers
    n_dense = shapes.num_layers - n_moe
    common = dense = moe = 0
    for t in sel:
        if t.group not in ("layer", "expert"):
            continue
        if t.name.startswith("mlp."):
            dense += n(t) * (t.count // max(n_dense, 1))
        elif t.name.startswith(("experts.", "router", "shared_expert")):
            moe += n(t) * (t.count // max(n_moe, 1))
        else:
            common += n(t) * (t.count // max(shapes.num_layers, 1))
    if n_dense and common + dense:
        total += n_dense * alloc(common + dense, dtype)
    if n_moe and common + moe:
        total += n_moe * alloc(common + moe, dtype)
    return total


@lru_cache(maxsize=1024)
def chunk_layers(num_layers: int, pp: int, v: int = 1, first: int | None = None,
                 last: int | None = None, embedding: bool = False,
                 loss: bool = False, stages: tuple[int, ...] | None = None
                 ) -> tuple[tuple[int, ...], ...]:
    """Transformer layers of virtual chunk j on pipeline rank r, `out[j][r]`, as Megatron-LM
    builds them (d98e8a64, megatron/core/transformer/transformer_block.py:
    `get_num_layers_to_build`); the layout must have passed `resolve_layout`.

    - even: L/(p·v) per chunk.
    - `first`/`last` (--decoder-first/last-pipeline-num-layers): rank 0 holds `first`, rank
      p−1 `last`, the other ranks (L − first − last)/(ranks left) each; a rank's v chunks
      hold 1/v of its layers each.
    - `embedding`/`loss` (--account-for-embedding/loss-in-pipeline-split): the embedding
      (loss) counts as one layer, (L + e + l)/(p·v) per chunk, and the first chunk of rank 0
      (the last chunk of rank p−1) builds one transformer layer less.

    - `stages` (torchtitan's split, `stack_rules.torchtitan_stage_layers`): the layers of each
      pipeline stage in order, stage s = chunk s // p of rank s mod p (torchtitan's "loop"
      stage assignment, pipelining_utils.py `stage_ids_this_rank`).

    Layers are numbered chunk by chunk in the order (j, r) (transformer_layer.py:
    `get_transformer_layer_offset`), which `stage_layer_indices` follows.
    """
    if stages is not None:
        return tuple(tuple(stages[j * pp:(j + 1) * pp]) for j in range(v))
    if first is not None or last is not None:
        rest, left = num_layers, pp
        for n in (first, last):
            if n is not None:
                rest, left = rest - n, left - 1
        middle = rest // left if left > 0 else 0
        per_rank = [middle] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
        return tuple(tuple(n // v for n in per_rank) for _ in range(v))
    per_chunk = (num_layers + embedding + loss) // (pp * v)
    out = [[per_chunk] * pp for _ in range(v)]
    out[0][0] -= embedding
    out[-1][-1] -= loss
    return tuple(tuple(row) for row in out)


def pipeline_chunks(spec: ModelSpec, parallel: ParallelConfig) -> tuple[tuple[int, ...], ...]:
    """`chunk_layers` of a model under a layout (`out[j][r]`: chunk j of rank r)."""
    p = parallel
    chunks = chunk_layers(spec.num_hidden_layers, p.pp, p.pp_chunks, p.first_stage_layers,
                          p.last_stage_layers, p.embedding_in_split, p.loss_in_split,
                          p.stage_layers)
    if not p.mtp_layers:
        return chunks
    # Megatron-LM's MTP block is built on the last pipeline rank's last virtual chunk
    # (multi_token_prediction.py `mtp_on_this_rank`), each depth one more transformer layer
    # numbered after the decoder's (`get_mtp_layer_offset`)
    last = chunks[-1][:-1] + (chunks[-1][-1] + p.mtp_layers,)
    return chunks[:-1] + (last,)


def stage_layers(spec: ModelSpec, parallel: ParallelConfig, stage: int) -> int:
    """Transformer layers held by pipeline rank `stage` (all its virtual chunks together)."""
    return sum(row[stage] for row in pipeline_chunks(spec, parallel))


def stage_layer_indices(chunks: tuple[tuple[int, ...], ...], stage: int) -> tuple[int, ...]:
    """Global indices of the layers pipeline rank `stage` holds: chunks[j][r] layers per
    chunk, numbered chunk by chunk in the order (j, r) (so v > 1 is round robin)."""
    out: list[int] = []
    start = 0
    for row in chunks:
        for r, n in enumerate(row):
            if r == stage:
                out.extend(range(start, start + n))
            start += n
    return tuple(out)


def moe_layers_on_stage(spec: ModelSpec, chunks: tuple[tuple[int, ...], ...], stage: int) -> int:
    """MoE layers on pipeline rank `stage` (ModelSpec.is_moe_layer)."""
    if not spec.is_moe:
        return 0
    return sum(stage_moe_mask(spec, chunks, stage))


def stage_moe_mask(spec: ModelSpec, chunks: tuple[tuple[int, ...], ...],
                   stage: int) -> tuple[bool, ...]:
    """Whether each layer of pipeline rank `stage` is an MoE layer, in order. An MTP depth's
    layer (an index past the decoder's, `pipeline_chunks`) is of the decoder's last layer's
    kind: Megatron-LM d98e8a64 gpt_builders.py "Use spec of the last layer in decoder block
    as spec of the transformer layer in MTP"."""
    last = spec.num_hidden_layers - 1
    return tuple(spec.is_moe_layer(min(i, last)) for i in stage_layer_indices(chunks, stage))


def rank_shapes(spec: ModelSpec, parallel: ParallelConfig, stage: int = 0) -> RankShapes:
    """The tensors pipeline rank `stage` holds (cached on the degrees that matter)."""
    return _rank_shapes(spec, parallel.tp, pipeline_chunks(spec, parallel), parallel.ep, stage,
                        parallel.expert_tp, parallel.mtp_layers)


@lru_cache(maxsize=4096)
def _rank_shapes(spec: ModelSpec, tp: int, chunks: tuple[tuple[int, ...], ...], ep: int,
                 stage: int, etp: int | None = None, mtp: int = 0) -> RankShapes:
    """Routed experts split over the expert-TP group (`etp`, Megatron-LM's
    --expert-tensor-parallel-size: moe/experts.py builds them on `pg_collection.expt_tp`),
    everything else (shared experts included) over `tp`."""
    first, last = stage == 0, stage == len(chunks[0]) - 1
    n_layers = sum(row[stage] for row in chunks)
    n_moe = moe_layers_on_stage(spec, chunks, stage)
    out: list[RankTensor] = []
    for t in param_tensors(spec):
        count = _stage_count(t, spec, n_layers, n_moe, first, last)
        if t.group == "expert" and count:
            count = ceil_div(count, ep)
        numel, rows = t.numel, t.rows
        deg = (etp or tp) if t.group == "expert" else tp
        if t.tp_split and deg > 1:
            if not rows:
                numel = ceil_div(numel, deg)
            elif t.name.endswith(ROW_PARALLEL):  # input dimension split (padded)
                numel = rows * ceil_div(numel // rows, deg)
            else:  # output dimension split, padded like Megatron's vocab padding
                rows = ceil_div(rows, deg)
                numel = rows * (t.numel // t.rows)
        if count:
            out.append(RankTensor(name=t.name, numel=numel, count=count, group=t.group,
                                  rows=rows))
    if mtp and last:
        out += mtp_tensors(spec, tp, mtp, first)
    return RankShapes(tensors=tuple(out), num_layers=n_layers, num_moe_layers=n_moe)


def mtp_tensors(spec: ModelSpec, tp: int, depths: int, first: bool) -> list[RankTensor]:
    """The multi-token-prediction modules' own tensors on the last pipeline rank, beyond
    their transformer layers (counted as layers of the stage, `pipeline_chunks`):
    NVIDIA/Megatron-LM d98e8a64 multi_token_prediction.py MultiTokenPredictionLayer.__init__
    builds per depth enorm and hnorm (h each), eh_proj (2h -> h, column-parallel: the h
    output rows ÷ tp, no bias) and final_layernorm (h); the output layer is shared with the
    main model's. gpt_model.py GPTModel.__init__ builds the embedding wherever
    `pre_process or self.mtp_process`, so a last rank that is not the first holds its own
    (V/tp, h) copy (untied models too; tied ones hold it already)."""
    h = spec.hidden_size
    norms = 3 * (2 if spec.norm_bias else 1)  # enorm, hnorm, final_layernorm (+ biases)
    out = [RankTensor(name="mtp.norms", numel=h, count=norms * depths, group="head"),
           RankTensor(name="mtp.eh_proj.weight", numel=ceil_div(h, tp) * 2 * h, count=depths,
                      group="head", rows=ceil_div(h, tp))]
    if not first and not spec.tie_word_embeddings:
        rows = ceil_div(spec.vocab_size, tp)
        out.append(RankTensor(name="embed_tokens", numel=rows * h, count=1, group="embedding",
                              rows=rows))
    return out


def rank_tensors(spec: ModelSpec, parallel: ParallelConfig, stage: int = 0) -> tuple[RankTensor, ...]:
    """Parameter tensors held by a rank of pipeline stage `stage` (before sharding)."""
    return rank_shapes(spec, parallel, stage).tensors


def _stage_count(t: ParamTensor, spec: ModelSpec, n_layers: int, n_moe: int, first: bool,
                 last: bool) -> int:
    if t.group == "embedding":
        if first:
            return t.count
        # tied embeddings: the last stage keeps its own copy of the token embedding
        if last and spec.tie_word_embeddings and t.name == "embed_tokens":
            return t.count
        return 0
    if t.group in ("final", "head"):
        return t.count if last else 0
    if spec.is_encoder_decoder:  # one stage (pp = 1), two stacks: every tensor as listed
        return t.count
    # per-layer tensors: t.count is a multiple of the number of layers holding them
    if t.name.startswith(("experts.", "router", "shared_expert")):
        return t.count // max(spec.num_moe_layers, 1) * n_moe
    if t.name.startswith("mlp."):
        return t.count // max(spec.num_dense_layers, 1) * (n_layers - n_moe)
    return t.count // spec.num_hidden_layers * n_layers


def sharded_numel(numel: int, shard: int) -> int:
    """Elements one rank keeps when a tensor is sharded over `shard` ranks (padded)."""
    return ceil_div(numel, shard) if shard > 1 else numel


def layer_param_numels(spec: ModelSpec, parallel: ParallelConfig) -> list[int]:
    """Local numels of one transformer layer's tensors (the unit FSDP gathers at once).

    For a model with both dense and MoE layers this is the larger (MoE) layer.
    """
    return list(_layer_param_numels(spec, parallel.tp, parallel.ep, parallel.expert_tp))


@lru_cache(maxsize=1024)
def _layer_param_numels(spec: ModelSpec, tp: int, ep: int, etp: int | None = None
                        ) -> tuple[int, ...]:
    moe = spec.is_moe and spec.num_moe_layers > 0
    out: list[int] = []
    for t in param_tensors(spec):
        if t.group not in ("layer", "expert"):
            continue
        if moe and t.name.startswith("mlp."):
            continue  # dense MLP of the leading dense layers: the MoE layer is larger
        deg = (etp or tp) if t.group == "expert" else tp
        n = ceil_div(t.numel, deg) if (t.tp_split and deg > 1) else t.numel
        if t.name.startswith(("experts.", "router", "shared_expert")):
            per_layer = t.count // max(spec.num_moe_layers, 1)
        elif t.name.startswith("mlp."):
            per_layer = t.count // max(spec.num_dense_layers, 1)
        else:
            per_layer = t.count // spec.num_hidden_layers
        if t.group == "expert":
            per_layer = ceil_div(per_layer, ep)
        out.extend([n] * per_layer)
    return tuple(out)
