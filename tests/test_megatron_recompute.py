"""The megatron profile under Megatron-LM's --recompute-method / --recompute-num-layers.

Expected bytes are derived by hand from Korthikanti et al. 2022 (arXiv:2205.05198) Table 2
(34·sbh + 4·asb for TE's flash core with dropout 0.1, see tests/test_megatron_dropout.py)
and the checkpoint input, 2·sbh (a (s, b, h) bf16 tensor), placed where Megatron-LM
d98e8a64 puts them, megatron/core/recompute.py `checkpointed_forward`:
- block N: `use_checkpoint = layer_idx < N`, one layer per checkpoint: the first N layers
  of each chunk keep 2·sbh, the others Table 2;
- uniform N: `chunk_runner(layer_idx, min(layer_idx + N, c), True)`: one 2·sbh input per
  group of N layers; the group's backward re-runs all N layers with grad.
Refusals follow megatron/core/transformer/transformer_config.py `__post_init__` (full
granularity needs a method and recompute_num_layers) and megatron/training/arguments.py
(no method with selective).
Case: the calibration's test model (12L, h 512, 8 heads, f 4h, b 4, s 1024), bf16, one
micro-batch (pp 1: k = 1).
"""

from __future__ import annotations

import pytest
from megatron_models import GPT_SMALL

from vramcalc.analytic import estimate, stage_phases
from vramcalc.errors import InputError
from vramcalc.options import SCENARIO_OPTIONS, build_scenario
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms.activations import microbatch_activation_bytes
from vramcalc.terms.megatron_recompute import layer_plan
from vramcalc.training import TrainingConfig

B, S, H, A, L = 4, 1024, 512, 8, 12
SBH = S * B * H
TABLE2 = 34 * SBH + 4 * A * S * B  # flash core, dropout 0.1: 71_434_240
INPUT = 2 * SBH  # the checkpoint's (s, b, h) bf16 input: 4_194_304


def _ctx(method: str | None = None, n: int | None = None, recompute: str = "full",
         pp: int = 1, v: int = 1) -> RankContext:
    tr = TrainingConfig(seq_len=S, micro_batch_size=B, precision="bf16", framework="megatron",
                        recompute=recompute, recompute_method=method, recompute_num_layers=n)
    par = ParallelConfig(dp=1, pp=pp, pp_schedule="interleaved" if v > 1 else "1f1b",
                         virtual_stages=v, num_microbatches=8 if pp > 1 else None)
    return RankContext(GPT_SMALL, tr, par)


def _layers(ctx: RankContext) -> int:
    """The stage's layer activations (the embedding-side tensors taken off)."""
    none = _ctx(recompute="none")
    edges = microbatch_activation_bytes(none) - L * TABLE2
    return microbatch_activation_bytes(ctx) - edges


def test_none_and_full_are_table_2_and_the_inputs() -> None:
    assert _layers(_ctx(recompute="none")) == L * TABLE2
    assert _layers(_ctx()) == L * INPUT


@pytest.mark.parametrize("n", [1, 4, 11, 12])
def test_block_n_keeps_n_inputs_and_l_minus_n_table_2_sets(n: int) -> None:
    assert _layers(_ctx("block", n)) == n * INPUT + (L - n) * TABLE2


def test_block_4_by_hand() -> None:
    assert _layers(_ctx("block", 4)) == 4 * 4_194_304 + 8 * 71_434_240 == 588_251_136


def test_block_beyond_the_chunk_checkpoints_every_layer() -> None:
    assert _layers(_ctx("block", 100)) == L * INPUT


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 12])
def test_uniform_n_keeps_one_input_per_group(n: int) -> None:
    assert _layers(_ctx("uniform", n)) == (L // n) * INPUT


def test_uniform_last_group_may_be_shorter() -> None:
    # groups [0, 5), [5, 10), [10, 12): three inputs
    assert _layers(_ctx("uniform", 5)) == 3 * INPUT


def test_block_counts_per_virtual_chunk() -> None:
    # pp 2 x v 2: 6 layers on a rank, two chunks of 3; block 2 checkpoints 2 of each chunk
    plan = layer_plan(_ctx("block", 2, pp=2, v=2), INPUT, TABLE2)
    assert plan is not None
    assert plan.kept == (INPUT, INPUT, TABLE2, INPUT, INPUT, TABLE2)
    plan = layer_plan(_ctx("uniform", 2, pp=2, v=2), INPUT, TABLE2)
    assert plan is not None
    assert plan.kept == (INPUT, 0, INPUT, INPUT, 0, INPUT)  # groups [0,2),[2,3) per chunk


def test_uniform_backward_holds_the_group() -> None:
    # top layer's backward: the other groups' inputs, its group's lower N − 1 Table 2 sets
    plan = layer_plan(_ctx("uniform", 4), INPUT, TABLE2)
    assert plan is not None
    assert plan.below(L - 1) == 2 * INPUT + 3 * TABLE2
    assert plan.below(8) == 2 * INPUT  # the top group's bottom layer
    full = layer_plan(_ctx("uniform", 1), INPUT, TABLE2)
    assert full is not None and full.below(L - 1) == (L - 1) * INPUT


def _scn(**kw: object) -> Scenario:
    vals = {o.name: o.default for o in SCENARIO_OPTIONS}
    vals.update(model="llama2-7b", framework="megatron", gpus="8xH100", tp=2, pp=2,
                sequence_parallel=True, grad_accum=8, recompute="full")
    vals.update(kw)
    return build_scenario(vals)


def test_uniform_1_is_todays_full_recompute() -> None:
    a = estimate(_scn()).model_dump(mode="json")
    b = estimate(_scn(recompute_method="uniform", recompute_num_layers=1)).model_dump(
        mode="json")
    for key in ("strategy",):
        a.pop(key), b.pop(key)
    assert a == b
    for st in (0, 1):
        pa, _, _ = stage_phases(_scn().resolved(), st, None)
        pb, _, _ = stage_phases(_scn(recompute_method="uniform",
                                     recompute_num_layers=1).resolved(), st, None)
        assert [p.parts for p in pa] == [p.parts for p in pb]


def test_block_sits_between_full_and_none() -> None:
    act = {name: estimate(_scn(**kw)).terms.activations for name, kw in {
        "none": {"recompute": "none"}, "full": {},
        "block": {"recompute_method": "block", "recompute_num_layers": 4}}.items()}
    assert act["full"] < act["block"] < act["none"]


@pytest.mark.parametrize(("kw", "message"), [
    ({"framework": "hf", "recompute_method": "block", "recompute_num_layers": 2},
     "--recompute-method block: only the megatron profile models Megatron-LM's recompute "
     "method; the hf profile checkpoints every layer (use --framework megatron, or leave "
     "it out)"),
    ({"framework": "reference", "recompute_num_layers": 2},
     "--recompute-num-layers 2: only the megatron profile"),
    ({"recompute": "selective", "recompute_method": "uniform", "recompute_num_layers": 1},
     "--recompute-method uniform: needs --recompute full (Megatron-LM allows a recompute "
     "method only with --recompute-granularity full)"),
    ({"recompute": "none", "recompute_method": "block", "recompute_num_layers": 1},
     "needs --recompute full"),
    ({"recompute_method": "block"},
     "--recompute-method block: give --recompute-method uniform|block and "
     "--recompute-num-layers N together (Megatron-LM requires both with full recompute)"),
    ({"recompute_num_layers": 3}, "--recompute-num-layers 3: give --recompute-method"),
    ({"recompute_method": "blocks", "recompute_num_layers": 3}, "--recompute-method"),
    ({"recompute_method": "block", "recompute_num_layers": 0}, "--recompute-num-layers"),
])
def test_refusals(kw: dict[str, object], message: str) -> None:
    with pytest.raises(InputError) as err:
        _scn(**kw)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
