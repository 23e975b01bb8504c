"""Megatron-LM's multi-token prediction (`--mtp-layers`): what one depth adds to the last
pipeline stage, DeepSeek-V3 at tp 8 (SP), pp 8 (5 layers last), ep 8, by hand.

Sources, NVIDIA/Megatron-LM d98e8a64 (Megatron's DeepSeek-V3 recipes pass --mtp-num-layers 1:
examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh, tests/functional_tests/test_cases/mixtral/
deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release/model_config.yaml):
- multi_token_prediction.py MultiTokenPredictionLayer.__init__: enorm, hnorm, final_layernorm
  (h each), eh_proj (2h -> h, column-parallel: h/t output rows, no bias) and one transformer
  layer (DeepSeek-V3's layer spec: MLA + MoE) per depth, on the last rank (`mtp_on_this_rank`);
- gpt_model.py GPTModel.__init__ builds the embedding when `pre_process or self.mtp_process`:
  the last rank of pp 8 holds a (V/t, h) copy (V = 129,280: 16,160 rows at t = 8);
- MultiTokenPredictionLayer's forward keeps per depth enorm's input, hnorm's input, the
  (s, b, 2h) eh_proj input, final_layernorm's input and the output layer's input (its chunk of
  the block's `torch.cat`): 6 (s/t, b, h) bf16 tensors under SP;
- `process_mtp_loss` runs one more vocab-parallel cross entropy per depth before the main
  loss; each keeps Megatron's fp32 buffer (N·V/t·4), target_mask (bool), masked_target_1d
  (int64), the fp32 loss mask and two 0-dim tensors (as the main loss: tests/test_megatron_loss.py).
One MoE layer's parameters on a rank are taken from stage 6, which holds eight MoE layers and
nothing else.
"""

from __future__ import annotations

from typing import Any

import pytest
from megatron_models import GPT_SMALL
from test_catalog import DEEPSEEK_V3

from vramcalc.cli import main
from vramcalc.hf_config import from_hf_config
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms.activations import microbatch_activation_bytes
from vramcalc.terms.logits import logits_saved_bytes
from vramcalc.terms.megatron_layer import megatron_layer_bytes
from vramcalc.terms.megatron_mtp import mtp_saved
from vramcalc.training import TrainingConfig

SPEC = from_hf_config(DEEPSEEK_V3, "DeepSeek-V3 config.json")
H, V, T8 = 7168, 129_280, 8
S, B = 4096, 1


def _ctx(stage: int, mtp: int, recompute: str = "selective") -> RankContext:
    tr = TrainingConfig(seq_len=S, micro_batch_size=B, precision="bf16", framework="megatron",
                        recompute=recompute)
    par = ParallelConfig(dp=8, tp=8, pp=8, ep=8, sequence_parallel=True, last_stage_layers=5,
                         mtp_layers=mtp)
    return RankContext(SPEC, tr, par, stage)


def _round(n: int) -> int:  # the caching allocator's 512-byte blocks
    return -(-n // 512) * 512


def test_parameters_of_one_depth_on_the_last_stage() -> None:
    moe_layer = _ctx(6, 0).shapes.numel() // 8
    eh_proj = (H // T8) * 2 * H  # 12,845,056
    norms = 3 * H
    embedding = (V // T8) * H  # 115,834,880
    assert eh_proj == 12_845_056 and embedding == 115_834_880
    added = _ctx(7, 1).shapes.numel() - _ctx(7, 0).shapes.numel()
    assert added == moe_layer + eh_proj + norms + embedding
    assert _ctx(7, 1).num_layers == 6 and _ctx(7, 1).shapes.num_moe_layers == 6
    for stage in (0, 3, 6):  # the other stages do not move
        assert _ctx(stage, 1).shapes.numel() == _ctx(stage, 0).shapes.numel()


def test_activations_of_one_depth() -> None:
    tokens = S * B // T8  # sequence parallel
    extras = 6 * tokens * H * 2  # enorm, hnorm, final norm, output-layer inputs + eh_proj 2h
    assert extras == 44_040_192
    layer = megatron_layer_bytes(_ctx(7, 1), moe=True)
    added = microbatch_activation_bytes(_ctx(7, 1)) - microbatch_activation_bytes(_ctx(7, 0))
    assert added == layer + extras
    assert microbatch_activation_bytes(_ctx(3, 1)) == microbatch_activation_bytes(_ctx(3, 0))


def test_one_more_loss_per_depth() -> None:
    n = S * B
    one_loss = (_round(n * (V // T8) * 4) + _round(n) + _round(n * 8) + _round(n * 4)
                + 2 * 512)
    assert one_loss == 264_765_440 + 4_096 + 32_768 + 16_384 + 1_024 == 264_819_712
    assert logits_saved_bytes(_ctx(7, 1)) - logits_saved_bytes(_ctx(7, 0)) == one_loss
    assert logits_saved_bytes(_ctx(7, 2)) - logits_saved_bytes(_ctx(7, 0)) == 2 * one_loss


@pytest.mark.parametrize(("extra", "needle"),
                         [(["--framework", "reference"], "--framework megatron"),
                          (["--framework", "megatron", "--recompute", "full",
                            "--recompute-method", "block", "--recompute-num-layers", "1"],
                           "each MTP depth alone"),
                          (["--framework", "megatron", "--recompute", "full",
                            "--recompute-method", "uniform", "--recompute-num-layers", "2"],
                           "each MTP depth alone")])
def test_refusals_are_one_line(capsys: Any, extra: list[str], needle: str) -> None:
    assert main(["estimate", "--model", "8b", "--mtp-layers", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err


def test_the_last_stage_grows_through_the_cli(capsys: Any) -> None:
    args = ["estimate", "--model", "deepseek-v3", "--gpus", "512xH100", "--framework",
            "megatron", "--tp", "8", "--sequence-parallel", "--pp", "8", "--ep", "8",
            "--last-stage-layers", "5", "--recompute", "selective", "--json"]
    import json
    assert main(args) == 0
    base = json.loads(capsys.readouterr().out)["stages"]
    assert main([*args, "--mtp-layers", "1"]) == 0
    mtp = json.loads(capsys.readouterr().out)["stages"]
    assert mtp[-1]["num_layers"] == base[-1]["num_layers"] + 1
    assert mtp[-1]["device_total_bytes"] > base[-1]["device_total_bytes"]
    assert mtp[:-1] == base[:-1]


@pytest.mark.parametrize(("moe_layers", "moe_on_last"),
                         [(tuple(range(3, 61)), 6), (tuple(range(3, 60)), 4)])
def test_the_mtp_layer_is_of_the_last_layers_kind(moe_layers: tuple[int, ...],
                                                  moe_on_last: int) -> None:
    # gpt_builders.py: "Use spec of the last layer in decoder block as spec of the
    # transformer layer in MTP"; stage 7 holds layers 56..60 and the MTP layer
    spec = SPEC.model_copy(update={"first_k_dense_replace": 0, "moe_layers": moe_layers})
    ctx = _ctx(7, 1)
    ctx = RankContext(spec, ctx.training, ctx.parallel, 7)
    assert ctx.num_layers == 6 and ctx.shapes.num_moe_layers == moe_on_last


def test_fp8_keeps_eh_projs_input_in_one_byte() -> None:
    # the calibration's small GPT (h 512) under --precision fp8 (TE): `_concat_embeddings`
    # runs in the FP8 context, so eh_proj keeps its (s, b, 2h) input as 1-byte FP8 + a
    # (1,) fp32 scale (one 512-byte block)
    def saved(precision: str) -> int:
        tr = TrainingConfig(seq_len=1024, micro_batch_size=4, precision=precision,
                            framework="megatron")
        ctx = RankContext(GPT_SMALL, tr, ParallelConfig(dp=1, mtp_layers=1))
        return sum(t.nbytes for t in mtp_saved(ctx))

    sbh = 1024 * 4 * 512
    assert saved("bf16") == 6 * sbh * 2
    assert saved("bf16") - saved("fp8") == 2 * sbh - 512  # 2 B -> 1 B over 2h, + the scale


def test_full_recompute_keeps_the_checkpoints_inputs_and_the_output_chunk() -> None:
    # `_checkpointed_forward` (uniform, one layer): the checkpoint keeps the depth's hidden
    # states and the embedding; the output layer its chunk of the cat: 3 (s/t, b, h) bf16
    tokens = S * B // T8
    full = microbatch_activation_bytes(_ctx(7, 1, "full"))
    assert full - microbatch_activation_bytes(_ctx(7, 0, "full")) == 3 * tokens * H * 2
    assert main(["estimate", "--model", "8b", "--framework", "megatron", "--recompute", "full",
                 "--mtp-layers", "1"]) == 0
