"""Speed model (vramcalc.speed): FLOP counts, bubble, communication terms, invariants.

Expected values are derived by hand from published parameter counts
(../shared/reference/published-figures.md) and the formulas' sources, never copied from
the code's output.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramcalc.catalog import resolve_model
from vramcalc.hardware import resolve_gpu
from vramcalc.speed import (
    OVERLAP_EXPOSED_FRACTION,
    Layout,
    SpeedModel,
    estimate_speed,
    model_flops_per_token,
    recompute_flops_per_token,
)

H100 = resolve_gpu("H100")  # 989 dense BF16 TFLOP/s, NVLink 450 GB/s, 50 GB/s NIC per GPU
A100 = resolve_gpu("A100-80GB")


def spec(name: str):  # noqa: ANN201
    return resolve_model(name)[0]


# ---- FLOPs -----------------------------------------------------------------------------
def test_flops_gpt2_small_tied_embeddings() -> None:
    # GPT-2 small: 124,439,808 params (published-figures.md); token embedding 50257·768,
    # learned positions 1024·768; the tied head multiplies by the 50257·768 matrix.
    n_mm = 124_439_808 - (50257 * 768 + 1024 * 768) + 50257 * 768
    assert n_mm == 123_653_376
    # PaLM App. B: 6N + 12·L·s·(a·d) with L = 12, a·d = 768, s = 1024
    expected = 6 * n_mm + 12 * 12 * 1024 * 768
    assert model_flops_per_token(spec("gpt2"), 1024) == expected


def test_flops_llama2_7b() -> None:
    # Llama-2-7B: 6,738,415,616 params, untied: subtract the 32000·4096 input embedding
    n_mm = 6_738_415_616 - 32000 * 4096
    expected = 6 * n_mm + 12 * 32 * 4096 * 4096
    assert model_flops_per_token(spec("llama2-7b"), 4096) == expected


def test_full_recompute_matches_megatron_formula() -> None:
    # Narayanan et al. 2021: 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)) FLOPs per step with full
    # recomputation, for a 4h MLP; GPT-3 175B (L 96, h 12288, V 50257, s 2048). Biases,
    # norms and the learned position table make our count differ by well under 0.1%.
    L, h, V, s = 96, 12288, 50257, 2048
    megatron = 96 * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    gpt3 = spec("gpt3-175b")
    ours = model_flops_per_token(gpt3, s) + recompute_flops_per_token(gpt3, s, "full")
    assert ours == pytest.approx(megatron, rel=1e-3)


def test_selective_recompute_adds_attention_core_forward() -> None:
    # Korthikanti et al. 2022: selective recompute reruns QKᵀ and attention·V: 4·L·s·(a·d)
    assert recompute_flops_per_token(spec("llama2-7b"), 4096, "selective") == 4 * 32 * 4096 * 4096
    assert recompute_flops_per_token(spec("llama2-7b"), 4096, "none") == 0


def test_torchtitan_selective_recompute_flops() -> None:
    # torchtitan 9dec370 per-op SAC (parallelize_llama.py: every second mm of a block is
    # recomputed; in call order wq, wk, wv, wo, w1, w3, w2 that is wk, wo, w3; SDPA is saved):
    # Llama-3-8B, h 4096, 32 heads of 128, 8 KV heads, f 14336, 32 layers:
    # 2·(4096·1024 + 4096·4096 + 4096·14336) = 159,383,552 per layer
    llama = spec("llama3-8b")
    assert recompute_flops_per_token(llama, 8192, "selective", "op") == 32 * 159_383_552
    # selective_ac_option 2: every second block is checkpointed whole: 16 of 32 layers
    full = recompute_flops_per_token(llama, 8192, "full")
    assert recompute_flops_per_token(llama, 8192, "selective", 2) == full / 2
    assert recompute_flops_per_token(llama, 8192, "selective", 3) == full * 10 / 32
    # the profile picks it from the training config
    from vramcalc.training import TrainingConfig
    assert TrainingConfig(framework="torchtitan", recompute="selective",
                          precision="fp32").selective_kind == "op"
    assert TrainingConfig(framework="torchtitan", recompute="selective", recompute_every=4,
                          precision="fp32").selective_kind == 4
    assert TrainingConfig(recompute="selective").selective_kind == "core"


def test_moe_counts_active_parameters_only() -> None:
    mix = spec("mixtral-8x7b")
    # top-2 of 8 experts: 6 routed experts per layer are idle for any one token
    n_mm = mix.num_params - 6 * mix.num_hidden_layers * mix.expert_params - mix.embedding_params
    assert model_flops_per_token(mix, 4096) == 6 * n_mm + 12 * 32 * 4096 * 4096


# ---- compute time, bubble, MFU -------------------------------------------------------------
def test_compute_time_single_rank() -> None:
    # one H100, Llama-2-7B, one sequence of 4096 tokens: FLOPs / (989e12 · 0.40)
    f = 6 * (6_738_415_616 - 32000 * 4096) + 12 * 32 * 4096 * 4096
    r = estimate_speed(spec("llama2-7b"), H100, 8, Layout(), 4096)
    assert r.parts_s["compute"] == pytest.approx(f * 4096 / (989e12 * 0.40), rel=1e-12)
    assert r.step_time_s == pytest.approx(r.parts_s["compute"])
    # alone on one GPU nothing is communicated: MFU is exactly the efficiency
    assert r.mfu == pytest.approx(0.40)
    assert r.tokens_per_s == pytest.approx(4096 / r.step_time_s)


def test_mfu_override() -> None:
    r = estimate_speed(spec("llama2-7b"), H100, 8, Layout(), 4096, efficiency=0.5)
    assert r.mfu == pytest.approx(0.5)


@pytest.mark.parametrize(("pp", "m", "schedule", "v", "fraction"), [
    (4, 8, "1f1b", 1, 3 / 8),  # (p − 1)/m, Narayanan et al. 2021 Sec. 2.2.1
    (4, 8, "interleaved", 2, 3 / 16),  # ÷ v, Sec. 2.2.2
    (8, 64, "1f1b", 1, 7 / 64),
])
def test_pipeline_bubble(pp: int, m: int, schedule: str, v: int, fraction: float) -> None:
    lay = Layout(pp=pp, num_microbatches=m, pp_schedule=schedule, virtual_stages=v)
    r = estimate_speed(spec("llama2-7b"), H100, 8, lay, 4096)
    assert r.parts_s["bubble"] / r.parts_s["compute"] == pytest.approx(fraction)


# ---- communication -------------------------------------------------------------------------
def test_tensor_parallel_all_reduces() -> None:
    # Megatron TP: 4 all-reduces of b·s·h per layer per micro-batch (2 forward, 2 backward),
    # ring all-reduce 2·(t−1)/t·M/bw; Llama-2-7B, tp 2, bf16, NVLink 450 GB/s per direction
    msg = 1 * 4096 * 4096 * 2
    expected = 4 * 32 * 2 * (1 / 2) * msg / 450e9
    r = estimate_speed(spec("llama2-7b"), H100, 8, Layout(tp=2, sequence_parallel=True), 4096)
    assert r.parts_s["tp_comm"] == pytest.approx(expected)
    full = estimate_speed(spec("llama2-7b"), H100, 8,
                          Layout(tp=2, sequence_parallel=True, recompute="full"), 4096)
    assert full.parts_s["tp_comm"] == pytest.approx(expected * 6 / 4)


def test_tensor_parallel_across_nodes_uses_the_network() -> None:
    # 16-way TP on 8-GPU nodes crosses nodes: the 50 GB/s NIC instead of 450 GB/s NVLink
    lay_in = Layout(tp=8, sequence_parallel=True)
    lay_out = Layout(tp=16, sequence_parallel=True)
    m = spec("llama2-70b")
    t_in = estimate_speed(m, H100, 8, lay_in, 4096).parts_s["tp_comm"]
    t_out = estimate_speed(m, H100, 8, lay_out, 4096).parts_s["tp_comm"]
    # same message, ring factor 15/16 vs 7/8, bandwidth 50 vs 450 GB/s
    assert t_out / t_in == pytest.approx((15 / 16) / (7 / 8) * 450 / 50)


def test_ddp_all_reduce_exposed_beyond_one_backward() -> None:
    # Llama-2-70B on 2 nodes x 8 A100, pure DP (dp 16), one micro-batch of 512 tokens: the
    # bf16 gradient all-reduce (2·15/16·2 bytes·N ≈ 8.1 s on the 32 GB/s network) is longer
    # than the one backward pass it can hide behind (≈ 1.1 s), so the excess is exposed.
    n = spec("llama2-70b")
    r = estimate_speed(n, A100, 8, Layout(dp=16), 512)
    comm = 2 * (15 / 16) * n.num_params * 2 / 32e9  # A100 profile: 32 GB/s NIC
    f = model_flops_per_token(n, 512)
    backward = (2 / 3) * f * 512 / (312e12 * 0.45)
    assert comm > backward
    assert r.parts_s["dp_comm"] == pytest.approx(comm - backward, rel=1e-9)


def test_overlapped_collective_still_costs_a_tenth() -> None:
    # inside one node the ZeRO-1 reduce-scatter + all-gather of GPT-2 small are far shorter
    # than a pass: only OVERLAP_EXPOSED_FRACTION of each shows
    g = spec("gpt2")
    r = estimate_speed(g, H100, 8, Layout(dp=8, shard_stage=1, micro_batch_size=8), 1024)
    per = (7 / 8) * g.num_params * 2 / 450e9
    assert r.parts_s["dp_comm"] == pytest.approx(2 * OVERLAP_EXPOSED_FRACTION * per)


def test_zero3_gathers_every_micro_batch() -> None:
    # ZeRO-3: all-gather forward, all-gather + reduce-scatter backward, per micro-batch;
    # 3x the traffic of ZeRO-1 per micro-batch (Rajbhandari et al. 2019, Sec. 7)
    n = spec("llama2-70b")
    one = estimate_speed(n, H100, 8, Layout(dp=16, shard_stage=3, num_microbatches=1), 4096)
    four = estimate_speed(n, H100, 8, Layout(dp=16, shard_stage=3, num_microbatches=4), 4096)
    assert four.parts_s["dp_comm"] == pytest.approx(4 * one.parts_s["dp_comm"])


def test_no_sync_reduces_once_per_step() -> None:
    # HF Trainer's no_sync(): every micro-batch still gathers the weights forward and
    # backward, only the last one reduce-scatters. Llama-2-70B over 2 nodes (dp 16, the
    # 50 GB/s NIC): an all-gather or reduce-scatter of the bf16 weights sends 15/16·2·N
    # bytes (2.6 s); a micro-batch's backward is 2/3 of its compute (3.1 s), which hides one
    # collective but not two.
    n = spec("llama2-70b")
    lay = Layout(dp=16, shard_stage=3, num_microbatches=4)
    every = estimate_speed(n, H100, 8, lay, 4096).parts_s["dp_comm"]
    once = estimate_speed(n, H100, 8, replace(lay, reduce_once=True), 4096).parts_s["dp_comm"]
    c = (15 / 16) * n.num_params * 2 / 50e9
    bwd = (2 / 3) * model_flops_per_token(n, 4096) * 4096 / (989e12 * H100.mfu_fraction)
    assert c < bwd < 2 * c
    # three backward passes hide their gather and no longer expose a reduce-scatter
    exposed_pair = 2 * c - bwd
    exposed_one = OVERLAP_EXPOSED_FRACTION * c
    assert every - once == pytest.approx(3 * (exposed_pair - exposed_one), rel=1e-9)


def test_pipeline_p2p() -> None:
    # 2 sends of b·s·h/tp per micro-batch per stage boundary (activation, gradient), 16 GPUs
    # over 2 nodes: network bandwidth
    lay = Layout(pp=2, tp=8, sequence_parallel=True, num_microbatches=8)
    r = estimate_speed(spec("llama2-70b"), H100, 8, lay, 4096)
    assert r.parts_s["pp_comm"] == pytest.approx(2 * 8 * (4096 * 8192 * 2 / 8) / 50e9)


def test_optimizer_offload_moves_shard_over_pcie() -> None:
    n = spec("llama2-7b")
    r = estimate_speed(n, H100, 8, Layout(dp=8, shard_stage=1, offload=("optimizer",)), 4096)
    shard = n.num_params / 8
    pcie = shard * (4 + 2) / 64e9  # fp32 gradients out, bf16 weights back, PCIe Gen5 x16
    cpu = shard * 32 / (200e9 / 8)  # CPU-Adam: 32 B/param at 200 GB/s per node
    assert r.parts_s["offload"] == pytest.approx(pcie + cpu)


def test_paged_pages_in_host_ram_cross_pcie_twice_per_step() -> None:
    n = spec("llama2-7b")
    lay = Layout(dp=8, shard_stage=1)
    plain = estimate_speed(n, H100, 8, lay, 4096)
    paged = estimate_speed(n, H100, 8, replace(lay, paged_host_bytes=10**10), 4096)
    # faulted in for the step and evicted for the next one, over PCIe Gen5 x16
    assert paged.parts_s["offload"] - plain.parts_s["offload"] == pytest.approx(2e10 / 64e9)
    assert paged.step_time_s > plain.step_time_s

def test_missing_dtype_peak_falls_back_with_a_note() -> None:
    v100 = resolve_gpu("V100")  # no bf16 tensor cores: the profile has no bf16 peak
    r = estimate_speed(spec("gpt2"), v100, 8, Layout(), 1024, "bf16")
    assert r.peak_flops_per_gpu == 125e12  # its fp16 peak
    assert r.notes and "bf16" in r.notes[0]


# ---- invariants -----------------------------------------------------------------------------
layouts = st.builds(
    lambda dp, tp, pp, cp, stage, b, m, rec, off: Layout(
        dp=dp, tp=tp, pp=pp, cp=cp, shard_stage=stage, micro_batch_size=b, num_microbatches=m,
        recompute=rec, sequence_parallel=tp > 1,
        offload=off if stage else ()),
    dp=st.sampled_from([1, 2, 8, 64]), tp=st.sampled_from([1, 2, 8]),
    pp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]),
    stage=st.integers(0, 3), b=st.sampled_from([1, 2, 4]), m=st.sampled_from([1, 4, 32]),
    rec=st.sampled_from(["none", "selective", "full"]),
    off=st.sampled_from([(), ("optimizer",)]),
)


@settings(max_examples=200, deadline=None)
@given(lay=layouts, model=st.sampled_from(["llama2-7b", "llama3-70b", "gpt2", "mixtral-8x7b"]))
def test_invariants(lay: Layout, model: str) -> None:
    m = spec(model)
    sm = SpeedModel(m, H100, 8, 4096)
    r = sm.report(lay)
    assert all(v >= 0 and math.isfinite(v) for v in r.parts_s.values())
    assert r.step_time_s == pytest.approx(sum(r.parts_s.values()))
    # MFU never exceeds the achievable fraction, and recompute only lowers it further
    assert 0 < r.mfu <= r.efficiency * r.model_flops_per_token / r.hardware_flops_per_token + 1e-12
    assert r.tokens_per_s == pytest.approx(lay.global_batch_size * 4096 / r.step_time_s)
    # more recomputation is never faster (it can hide exactly as much exposed communication
    # as it adds compute, hence the rounding tolerance)
    order = ["none", "selective", "full"]
    i = order.index(lay.recompute)
    if i < 2:
        from dataclasses import replace

        slower = sm.report(replace(lay, recompute=order[i + 1]))
        assert slower.step_time_s >= r.step_time_s * (1 - 1e-12)


def test_float8_all_gather_sends_block_linears_at_one_byte() -> None:
    """torchtitan --float8 --float8-all-gather (torchao fsdp_utils.py: each Float8Linear
    shard is cast to float8_e4m3fn before FSDP2's all-gather): on Llama-3.1-8B the weights
    FSDP gathers shrink from 2 B per parameter to 1 B for the block linears. By hand from
    the config: per layer q, o 4096² each, k, v 4096·1024 each, gate/up/down 4096·14336 each
    = 218,103,808 linear weights, 32 layers; the rest (embedding, output, norms) stays bf16."""
    from vramcalc.speed import float8_linear_params

    llama = spec("llama3.1-8b")
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert per_layer == 218_103_808
    assert float8_linear_params(llama) == 32 * per_layer
    plain = SpeedModel(llama, H100, 8, 8192, "bf16", float8=True)
    fp8 = SpeedModel(llama, H100, 8, 8192, "bf16", float8=True, float8_gather=True)
    assert plain.gather_b[0] - fp8.gather_b[0] == 32 * per_layer  # 2 B -> 1 B each
    assert fp8.grad_b == plain.grad_b  # gradients still reduce-scatter in bf16
    lay = Layout(dp=64, micro_batch_size=1, num_microbatches=1, shard_stage=3)
    assert fp8.report(lay).parts_s["dp_comm"] < plain.report(lay).parts_s["dp_comm"]
