"""torch.distributed.pipelining's own buffers under the torchtitan profile's pipeline
(vramcalc/terms/pipelining.py; torch v2.6.0 torch/distributed/pipelining/stage.py,
pytorch/pytorch#144535 and #153383). The bytes are derived by hand for the 405B run of
torchtitan's December 2024 benchmark (Table 5): Llama 3.1 405B, TP 8 with sequence
parallelism, PP 8, 8 micro-batches of 4 x 8,192 tokens."""

from __future__ import annotations

from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms.pipelining import pipelining_held

TABLE5 = {"model": "llama3.1-405b", "gpus": "512xH100", "framework": "torchtitan",
          "precision": "amp-bf16", "optimizer": "adamw", "attention": "flash",
          "fsdp": "grad-op", "tp": 8, "pp": 8, "sequence_parallel": True, "recompute": "full",
          "compile": True, "float8": True, "float8_all_gather": True, "async_tp": True,
          "seq_len": 8192, "micro_batch_size": 4, "num_microbatches": 8}
# one micro-batch's stage boundary: 4 sequences x 8,192/8 tokens (sequence parallel) x 16,384
# hidden x 2 B (bf16)
U = 4 * 1024 * 16384 * 2
# one block's unsharded fp32 gradient, TP-local: q and o (16,384²) and k, v (16,384 x 1,024)
# over 8, the MLP's three 16,384 x 53,248 over 8, two replicated norms of 16,384
LAYER = ((2 * 16384**2 + 2 * 16384 * 1024 + 3 * 16384 * 53248) // 8 + 2 * 16384) * 4


def held(stage: int, **flags: object) -> dict[str, int]:
    scn = build_scenario({k: v for k, v in {**TABLE5, **flags}.items() if v is not None})
    scn = scn.resolved()
    return pipelining_held(RankContext(scn.model, scn.training, scn.parallel, stage), 8)


def test_the_first_and_last_stage_under_1f1b_with_torch_2_6() -> None:
    assert LAYER == 398_491_648 * 4
    assert held(0, torch_version="2.6") == {
        "transients/pipeline_grad_recv": 8 * U, "activations/pipeline_outputs": 8 * U,
        "transients/pipeline_reduce_scatter": LAYER}
    # the last stage receives no gradient and sends no output
    assert held(7, torch_version="2.6") == {"transients/pipeline_grad_recv": 0,
                                             "activations/pipeline_outputs": 0,
                                             "transients/pipeline_reduce_scatter": LAYER}


def test_interleaved_chunks_each_hold_their_own() -> None:
    two = {"pp_schedule": "interleaved", "virtual_stages": 2, "torch_version": "2.6"}
    assert held(3, **two) == {"transients/pipeline_grad_recv": 16 * U,
                              "activations/pipeline_outputs": 16 * U,
                              "transients/pipeline_reduce_scatter": 2 * LAYER}
    # rank 7's second chunk is the last stage (15): one chunk sends
    assert held(7, **two)["transients/pipeline_grad_recv"] == 8 * U


def test_later_releases_keep_only_the_receive_buffers() -> None:
    assert held(0) == {"transients/pipeline_grad_recv": 8 * U}  # a current release
    assert held(0, torch_version="2.7") == {"transients/pipeline_grad_recv": 8 * U,
                                            "activations/pipeline_outputs": 8 * U}
    assert held(0, torch_version="2.8.0") == {"transients/pipeline_grad_recv": 8 * U}


def test_only_the_torchtitan_pipeline() -> None:
    assert held(0, pp=1, gpus="64xH100", fsdp="full", num_microbatches=None) == {}
    megatron = {**TABLE5, "framework": "megatron", "precision": "bf16", "fsdp": None,
                "compile": False, "float8": False, "float8_all_gather": False,
                "async_tp": False, "zero": 1, "optimizer": "adam", "pp": 2}
    scn = build_scenario({k: v for k, v in megatron.items() if v is not None}).resolved()
    assert pipelining_held(RankContext(scn.model, scn.training, scn.parallel, 0), 8) == {}
