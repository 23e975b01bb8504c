"""Uneven pipeline splits (Megatron-LM --decoder-first/last-pipeline-num-layers and
--account-for-embedding/loss-in-pipeline-split).

Expected layer counts and indices are derived by hand from Megatron-LM at d98e8a64:
`get_num_layers_to_build` (megatron/core/transformer/transformer_block.py) for the counts,
`get_transformer_layer_offset` (megatron/core/transformer/transformer_layer.py) for where a
chunk's layers start, and `TransformerConfig.__post_init__` (transformer_config.py) for
what is refused. Each case shows the arithmetic; none is copied from vramcalc's output.
"""

from __future__ import annotations

import json

import pytest

from vramcalc.analytic import candidate_stages, estimate
from vramcalc.catalog import resolve_model
from vramcalc.cli import main
from vramcalc.errors import InputError
from vramcalc.model import ModelSpec
from vramcalc.options import build_scenario
from vramcalc.parallel import ParallelConfig, resolve_layout
from vramcalc.scenario import Scenario
from vramcalc.sharding import chunk_layers, rank_tensors, stage_layer_indices
from vramcalc.training import TrainingConfig

MOE = ModelSpec(name="moe-mini", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=2048, vocab_size=8192,
                num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
                first_k_dense_replace=2)
BIG = ["--model", "llama3.1-405b", "--gpus", "64xH100", "--tp", "8", "--pp", "8"]


def _per_stage(chunks: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    return tuple(sum(col) for col in zip(*chunks, strict=True))


# ---- per-stage layer counts -------------------------------------------------------------------
@pytest.mark.parametrize(("args", "expected"), [
    # 126 − 15 − 15 = 96 layers over 8 − 2 = 6 middle stages: 16 each
    ((126, 8, 1, 15, 15), (15, 16, 16, 16, 16, 16, 16, 15)),
    # first only: 126 − 14 = 112 over 7 stages (the last is a middle one): 16 each
    ((126, 8, 1, 14, None), (14, 16, 16, 16, 16, 16, 16, 16)),
    # last only: 126 − 14 = 112 over the first 7 stages
    ((126, 8, 1, None, 14), (16, 16, 16, 16, 16, 16, 16, 14)),
    # pp = 2, both given: no middle stage
    ((126, 2, 1, 60, 66), (60, 66)),
    # interleaved v = 2: rank counts 30 | 32 32 | 32 (126 − 62 = 64 over 2); chunks halve them
    ((126, 4, 2, 30, 32), (30, 32, 32, 32)),
])
def test_first_last_stage_layers(args: tuple, expected: tuple[int, ...]) -> None:
    num_layers, pp, v, first, last = args
    chunks = chunk_layers(num_layers, pp, v, first, last)
    assert _per_stage(chunks) == expected
    assert all(len(row) == pp for row in chunks) and len(chunks) == v
    assert sum(expected) == num_layers


@pytest.mark.parametrize(("args", "expected"), [
    # (126 + 1 + 1)/8 = 16 per stage; rank 0 builds one less (the embedding), rank 7 too (loss)
    ((126, 8, 1, True, True), (15, 16, 16, 16, 16, 16, 16, 15)),
    # embedding only: (63 + 1)/8 = 8; rank 0 builds 7
    ((63, 8, 1, True, False), (7, 8, 8, 8, 8, 8, 8, 8)),
    # loss only: (63 + 1)/8 = 8; rank 7 builds 7
    ((63, 8, 1, False, True), (8, 8, 8, 8, 8, 8, 8, 7)),
    # v = 2: 128/(4·2) = 16 per chunk; chunk 0 of rank 0 and chunk 1 of rank 3 build 15
    ((126, 4, 2, True, True), (31, 32, 32, 31)),
])
def test_embedding_and_loss_in_split(args: tuple, expected: tuple[int, ...]) -> None:
    num_layers, pp, v, emb, loss = args
    assert _per_stage(chunk_layers(num_layers, pp, v, embedding=emb, loss=loss)) == expected


def test_layer_indices_follow_megatron_offsets() -> None:
    """get_transformer_layer_offset, uneven + interleaved (126 layers, p 4, v 2, first 30,
    last 32): per-chunk counts first 15, middle 16, last 16; total_virtual_chunks = 15 +
    64/2 + 16 = 63. Rank 1 (middle rank 0): chunk 0 at 0 + 15 = 15, chunk 1 at 63 + 15 = 78.
    Rank 3 (middle rank 2): chunk 1 at 63 + 15 + 2·16 = 110, 16 layers up to 126."""
    chunks = chunk_layers(126, 4, 2, 30, 32)
    assert stage_layer_indices(chunks, 1) == (*range(15, 31), *range(78, 94))
    assert stage_layer_indices(chunks, 3) == (*range(47, 63), *range(110, 126))
    # embedding in the split, p 8 (63 layers): offset = r·8 − 1 for r > 0
    chunks = chunk_layers(63, 8, 1, embedding=True)
    assert stage_layer_indices(chunks, 0) == tuple(range(7))
    assert stage_layer_indices(chunks, 1) == tuple(range(7, 15))
    # embedding + loss, v 2 (126 layers, p 4): total_virtual_chunks = 128/2 = 64;
    # rank 0 chunk 1 at 64 + 0 − 1 = 63, rank 2 chunk 0 at 0 + 2·16 − 1 = 31
    chunks = chunk_layers(126, 4, 2, embedding=True, loss=True)
    assert stage_layer_indices(chunks, 0) == (*range(0, 15), *range(63, 79))
    assert stage_layer_indices(chunks, 2) == (*range(31, 47), *range(95, 111))
    every = sorted(i for st in range(4) for i in stage_layer_indices(chunks, st))
    assert every == list(range(126))


# ---- Llama-3.1-405B on 64 H100 ----------------------------------------------------------------
def test_405b_needs_an_uneven_split(capsys) -> None:
    assert main(["estimate", *BIG]) == 2
    assert "not divisible by pp" in capsys.readouterr().err
    assert main(["estimate", *BIG, "--first-stage-layers", "15", "--last-stage-layers", "15",
                 "--json"]) in (0, 1)  # 1: does not fit (exit code of a valid estimate)
    report = json.loads(capsys.readouterr().out)
    assert [s["num_layers"] for s in report["stages"]] == [15] + [16] * 6 + [15]
    worst = max(s["device_total_bytes"] for s in report["stages"])
    assert report["device_total_bytes"] == worst
    assert report["strategy"]["first_stage_layers"] == 15


def test_405b_stage_weights_add_up_to_the_model() -> None:
    """Invariant: the stages together hold every parameter once (untied embeddings)."""
    spec, _ = resolve_model("llama3.1-405b")
    for kw in ({"first_stage_layers": 15, "last_stage_layers": 15},
               {"first_stage_layers": 14}, {"last_stage_layers": 14},
               {"embedding_in_split": True, "loss_in_split": True}):
        par = ParallelConfig(dp=1, pp=8, **kw)
        held = sum(t.numel * t.count for st in range(8) for t in rank_tensors(spec, par, st))
        assert held == spec.num_params, kw


def test_moe_stage_weights_add_up_and_candidates_hold_the_worst() -> None:
    """8 layers, first two dense; p 4, first 1, last 1: stages hold 1 | 3 3 | 1 layers
    (0 | 1-3 | 4-6 | 7), so the MoE layer counts are 0, 2, 3, 1."""
    tr = TrainingConfig(seq_len=512)
    par = resolve_layout(MOE, tr, ParallelConfig(pp=4, first_stage_layers=1,
                                                 last_stage_layers=1), 4)
    held = sum(t.numel * t.count for st in range(4) for t in rank_tensors(MOE, par, st))
    assert held == MOE.num_params
    chunks = chunk_layers(8, 4, 1, 1, 1)
    assert [stage_layer_indices(chunks, st) for st in range(4)] == [
        (0,), (1, 2, 3), (4, 5, 6), (7,)]
    scn = Scenario(model=MOE, training=tr, parallel=ParallelConfig(
        pp=4, first_stage_layers=1, last_stage_layers=1))
    full, fast = estimate(scn, every_stage=True), estimate(scn, every_stage=False)
    assert fast.device_total_bytes == full.device_total_bytes
    assert candidate_stages(scn.resolved()) == [0, 1, 2, 3]  # (1,0) (3,2) (3,3) + last


@pytest.mark.parametrize("split", [
    {"first_stage_layers": 15, "last_stage_layers": 15},
    {"first_stage_layers": 14},
    {"first_stage_layers": 6, "last_stage_layers": 30},  # 126 − 36 = 90 over 6 middle: 15
    {"embedding_in_split": True, "loss_in_split": True},
])
def test_candidate_stages_contain_the_worst_rank(split: dict) -> None:
    """estimate(every_stage=False) sees only candidate_stages; it must give the answer of
    estimating every stage."""
    scn = build_scenario({"model": "llama3.1-405b", "gpus": "64xH100", "tp": 8, "pp": 8,
                          "seq_len": 1024, **split})
    full, fast = estimate(scn, every_stage=True), estimate(scn, every_stage=False)
    assert fast.device_total_bytes == full.device_total_bytes
    worst = max(range(8), key=lambda i: full.stages[i].device_total_bytes)
    assert worst in candidate_stages(scn.resolved())


# ---- refusals: one line, exit 2 ---------------------------------------------------------------
@pytest.mark.parametrize(("extra", "fragment"), [
    (["--first-stage-layers", "15", "--embedding-in-split"], "cannot be combined"),
    (["--first-stage-layers", "16", "--last-stage-layers", "16"], "do not split evenly"),
    (["--first-stage-layers", "100", "--last-stage-layers", "30"], "leaves -4 layers"),
    (["--first-stage-layers", "0"], "greater than 0"),
    (["--pp-schedule", "interleaved", "--virtual-stages", "2", "--num-microbatches", "8",
      "--first-stage-layers", "15", "--last-stage-layers", "15"],
     "--first-stage-layers 15 is not divisible by --virtual-stages 2"),
    # 126 − 36 = 90 over 6 middle stages: 15 each, odd
    (["--pp-schedule", "interleaved", "--virtual-stages", "2", "--num-microbatches", "8",
      "--first-stage-layers", "18", "--last-stage-layers", "18"],
     "hold 15 layers each, not divisible by --virtual-stages 2"),
    (["--embedding-in-split"], "(= 127) is not divisible by pp=8"),
    # 128/8 = 16 layers per stage, v = 3
    (["--pp-schedule", "interleaved", "--virtual-stages", "3", "--num-microbatches", "8",
      "--embedding-in-split", "--loss-in-split"], "not divisible by --virtual-stages 3"),
])
def test_refusals(extra: list[str], fragment: str, capsys) -> None:
    assert main(["estimate", *BIG, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert fragment in err


def test_refusals_without_pipeline_and_with_leftover_layers() -> None:
    spec, _ = resolve_model("llama3.1-405b")
    tr = TrainingConfig()
    with pytest.raises(InputError, match="need --pp > 1"):
        resolve_layout(spec, tr, ParallelConfig(first_stage_layers=126), 1)
    # p 2, both given: no middle stage may be left any layer (60 + 60 leaves 6)
    with pytest.raises(InputError, match="leaves 6 layers for the 0 middle"):
        resolve_layout(spec, tr, ParallelConfig(pp=2, first_stage_layers=60,
                                                last_stage_layers=60), 2)
