"""Parallel layouts: validation (one clear line, exit 2) and per-rank semantics.

Expected values are hand-derived from the definitions cited in each test (Megatron-LM's
layer placement and vocab-parallel layers, PyTorch DDP/FSDP2 and DeepSpeed defaults at the
versions in vramcalc/terms/comm.py), never copied from the code's output.
"""

from __future__ import annotations

import pytest

from vramcalc.analytic import candidate_stages, estimate
from vramcalc.catalog import resolve_model
from vramcalc.cli import main
from vramcalc.errors import InputError
from vramcalc.model import ModelSpec
from vramcalc.model_tensors import param_tensors
from vramcalc.offload import offload_footprint, offload_traffic
from vramcalc.options import build_scenario
from vramcalc.parallel import ParallelConfig, resolve_layout
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.sharding import chunk_layers, rank_tensors, stage_layer_indices
from vramcalc.terms import comm
from vramcalc.terms.activations import layer_activation_bytes
from vramcalc.terms.logits import logits_saved_bytes
from vramcalc.terms.weights import weights_by_group, weights_bytes
from vramcalc.training import TrainingConfig
from vramcalc.units import alloc

LLAMA = ModelSpec(name="llama-mini", hidden_size=1024, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, intermediate_size=4096,
                  vocab_size=32768)
MOE = ModelSpec(name="moe-mini", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=2048, vocab_size=8192,
                num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
                first_k_dense_replace=2)
TIED = LLAMA.model_copy(update={"tie_word_embeddings": True})


# ---- validation: one line, exit 2 ---------------------------------------------------------------
@pytest.mark.parametrize(("args", "fragment"), [
    (["--gpus", "8xH100", "--tp", "3"], "cannot be split"),
    (["--gpus", "6xH100", "--tp", "6"], "does not divide num_attention_heads"),
    (["--gpus", "8xH100", "--pp", "8", "--model", "gpt2-medium", "--tp", "1"], None),
    (["--gpus", "3x8xH100", "--pp", "3"], "not divisible by pp"),
    (["--gpus", "8xH100", "--dp", "4"], "does not match 8 GPUs"),
    (["--gpus", "8xH100", "--ep", "2"], "needs a mixture-of-experts model"),
    (["--gpus", "8xH100", "--cp", "8", "--seq-len", "4100"], "does not divide seq_len"),
    (["--gpus", "8xH100", "--zero", "3", "--fsdp", "full"], "either --zero or --fsdp"),
    (["--gpus", "8xH100", "--fsdp", "hybrid"], "needs --shard-group"),
    (["--gpus", "8xH100", "--fsdp", "hybrid", "--shard-group", "3"], "does not divide"),
    (["--gpus", "8xH100", "--zero", "3", "--pp", "2"], "does not run with pipeline"),
    (["--gpus", "8xH100", "--offload", "optimizer"], "offload needs ZeRO-1"),
    (["--gpus", "8xH100", "--zero", "2", "--offload", "params"], "parameter offload needs"),
    (["--gpus", "8xH100", "--fsdp", "full", "--offload", "optimizer"], "CPUOffloadPolicy"),
    (["--gpus", "8xH100", "--fsdp", "full", "--offload", "params", "--offload-device", "nvme"],
     "ZeRO-Infinity"),
    (["--gpus", "8xH100", "--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2",
      "--num-microbatches", "3"], "to be a multiple of"),
    (["--gpus", "8xH100", "--virtual-stages", "2"], "need --pp-schedule interleaved"),
    (["--gpus", "8xH100", "--sequence-parallel"], "needs --tp > 1"),
    (["--gpus", "8xH100", "--framework", "megatron", "--zero", "3"], "distributed optimizer"),
    (["--gpus", "8xH100", "--framework", "megatron", "--offload", "optimizer"],
     "use --zero 1 --offload optimizer"),
    (["--gpus", "8xH100", "--num-microbatches", "4"], "use --grad-accum"),
])
def test_bad_layouts_one_line_exit_2(args: list[str], fragment: str | None, capsys) -> None:
    argv = ["estimate", "--model", "llama3-8b", *args]
    if "--model" in args:
        argv = ["estimate", *args]
    rc = main(argv)
    err = capsys.readouterr().err
    if fragment is None:  # a valid layout (gpt2-medium has 24 layers: 8 stages of 3)
        assert rc == 0
        return
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert fragment in err


def test_global_batch_derives_microbatches() -> None:
    tr = TrainingConfig(micro_batch_size=2)
    par = resolve_layout(LLAMA, tr, ParallelConfig(pp=2, global_batch_size=64), 8)
    assert par.dp == 4 and par.num_microbatches == 64 // (4 * 2)
    with pytest.raises(InputError, match="not divisible by dp x micro-batch"):
        resolve_layout(LLAMA, tr, ParallelConfig(pp=2, global_batch_size=60), 8)
    with pytest.raises(InputError, match="contradicts"):
        resolve_layout(LLAMA, tr, ParallelConfig(pp=2, global_batch_size=64,
                                                 num_microbatches=4), 8)


# ---- pipeline stages: weights per stage ------------------------------------------------------------
def _held(spec: ModelSpec, par: ParallelConfig, stage: int) -> int:
    return sum(t.numel * t.count for t in rank_tensors(spec, par, stage))


def test_pipeline_stage_placement() -> None:
    """Megatron-LM: the first stage holds the embedding, the last the final norm and head;
    every stage L/p layers; the stages add up to the model."""
    par = ParallelConfig(dp=1, pp=4)
    h, V = LLAMA.hidden_size, LLAMA.vocab_size
    per_layer = LLAMA.dense_layer_params
    assert _held(LLAMA, par, 0) == V * h + 2 * per_layer
    assert _held(LLAMA, par, 1) == _held(LLAMA, par, 2) == 2 * per_layer
    assert _held(LLAMA, par, 3) == 2 * per_layer + h + V * h
    assert sum(_held(LLAMA, par, st) for st in range(4)) == LLAMA.num_params


def test_tied_embeddings_are_held_by_both_ends() -> None:
    par = ParallelConfig(dp=1, pp=4)
    V, h = TIED.vocab_size, TIED.hidden_size
    assert _held(TIED, par, 3) == 2 * TIED.dense_layer_params + h + V * h  # its own copy
    assert sum(_held(TIED, par, st) for st in range(4)) == TIED.num_params + V * h


def test_interleaved_chunks_are_round_robin() -> None:
    """Megatron-LM virtual pipeline: rank r holds chunks r, r + p, ... of L/(p·v) layers."""
    assert stage_layer_indices(chunk_layers(16, 4, 2), 1) == (2, 3, 10, 11)
    assert stage_layer_indices(chunk_layers(8, 2, 1), 1) == (4, 5, 6, 7)


def test_moe_layers_per_stage_with_leading_dense_layers() -> None:
    """first_k_dense_replace = 2 dense layers land on stage 0 (of 4 stages x 2 layers)."""
    par = ParallelConfig(dp=2, pp=4, ep=2)
    names0 = {t.name.split(".")[0] for t in rank_tensors(MOE, par, 0)}
    names1 = {t.name.split(".")[0] for t in rank_tensors(MOE, par, 1)}
    assert "mlp" in names0 and "experts" not in names0
    assert "experts" in names1 and "mlp" not in names1
    scn = Scenario(model=MOE, parallel=par).resolved()
    assert candidate_stages(scn) == [0, 1, 3]


def test_every_stage_is_reported_and_candidates_contain_the_worst() -> None:
    scn = Scenario(model=LLAMA, training=TrainingConfig(seq_len=1024),
                   parallel=ParallelConfig(dp=1, pp=4, num_microbatches=8))
    full = estimate(scn)
    fast = estimate(scn, every_stage=False)
    assert [s.stage for s in full.stages] == [0, 1, 2, 3]
    assert [s.stage for s in fast.stages] == [0, 3]
    assert full.device_total_bytes == fast.device_total_bytes == max(
        s.device_total_bytes for s in full.stages)
    # 1F1B: earlier stages hold more micro-batches in flight
    totals = [s.device_total_bytes for s in full.stages[:3]]
    assert totals == sorted(totals, reverse=True)


# ---- tensor parallelism ----------------------------------------------------------------------
def test_tp_splits_matrices_and_vocab_and_replicates_norms() -> None:
    """Megatron: column/row-parallel matrices and the vocab-parallel embedding/head ÷t; norms
    replicated on every TP rank."""
    t = 4
    tr = TrainingConfig(precision="bf16")
    one = weights_by_group(RankContext(LLAMA, tr, ParallelConfig(dp=1)))
    split = weights_by_group(RankContext(LLAMA, tr, ParallelConfig(dp=1, tp=t)))
    assert split["embedding"] * t == one["embedding"]
    assert split["head"] * t == one["head"]
    assert split["final"] == one["final"]
    norms = alloc(LLAMA.hidden_size, "bf16") * 2 * LLAMA.num_hidden_layers
    assert split["layer"] - norms == (one["layer"] - norms) // t


def test_vocab_parallel_cross_entropy_splits_the_logits() -> None:
    tr = TrainingConfig(seq_len=1024, micro_batch_size=2)
    full = logits_saved_bytes(RankContext(LLAMA, tr, ParallelConfig(dp=1)))
    split = logits_saved_bytes(RankContext(LLAMA, tr, ParallelConfig(dp=1, tp=8)))
    tokens, V = 2 * 1024, LLAMA.vocab_size
    # the (b, s, V/t) fp32 log-probabilities are split; per-rank scalars are not
    assert split - alloc(tokens * V // 8, "fp32") == full - alloc(tokens * V, "fp32") >= 0


def test_sequence_parallel_splits_the_replicated_activations() -> None:
    tr = TrainingConfig(seq_len=2048, framework="megatron")
    no_sp = layer_activation_bytes(RankContext(LLAMA, tr, ParallelConfig(dp=1, tp=4)))
    sp = layer_activation_bytes(RankContext(LLAMA, tr, ParallelConfig(
        dp=1, tp=4, sequence_parallel=True)))
    assert sp < no_sp


# ---- context parallelism ---------------------------------------------------------------------
def test_cp_splits_activations_by_sequence() -> None:
    tr = TrainingConfig(seq_len=4096)
    one = layer_activation_bytes(RankContext(LLAMA, tr, ParallelConfig(dp=1)))
    four = layer_activation_bytes(RankContext(LLAMA, tr, ParallelConfig(dp=1, cp=4)))
    assert four * 4 == pytest.approx(one, rel=0.01)


def test_cp_ring_buffers() -> None:
    """TransformerEngine p2p ring: by the last step cp − 1 received K/V chunks, plus per-step
    outputs and fp32 log-sum-exp; backward double-buffers K/V and dK/dV."""
    b, s, cp = 2, 8192, 4
    ctx = RankContext(LLAMA, TrainingConfig(seq_len=s, micro_batch_size=b),
                      ParallelConfig(dp=1, cp=cp))
    tok = b * s // cp
    kv = alloc(2 * tok * 4 * 64, "bf16")  # 4 kv heads x head dim 64
    out = alloc(tok * 16 * 64, "bf16") + alloc(tok * 16, "fp32")
    assert comm.cp_forward_bytes(ctx) == (cp - 1) * kv + cp * out
    assert comm.cp_backward_bytes(ctx) == 4 * kv


# ---- expert parallelism ------------------------------------------------------------------------
def test_ep_shards_experts_only() -> None:
    tr = TrainingConfig(precision="bf16")
    one = weights_by_group(RankContext(MOE, tr, ParallelConfig(dp=4)))
    four = weights_by_group(RankContext(MOE, tr, ParallelConfig(dp=4, ep=4)))
    assert four["expert"] * 4 == one["expert"]
    assert four["layer"] == one["layer"] and four["embedding"] == one["embedding"]


def test_ep_dispatch_buffers() -> None:
    """All-to-all: b·s·k rows sent and b·s·k·capacity rows received, h wide, compute dtype."""
    tr = TrainingConfig(seq_len=1024, micro_batch_size=2)
    ctx = RankContext(MOE, tr, ParallelConfig(dp=4, ep=4, capacity_factor=1.25))
    rows = 2 * 1024 * 2
    assert comm.moe_routed_tokens(ctx) == rows * 5 // 4
    assert comm.ep_dispatch_bytes(ctx) == alloc(rows * 512, "bf16") + alloc(
        rows * 5 // 4 * 512, "bf16")


# ---- sharding engines: buffers ---------------------------------------------------------------------
def test_ddp_buckets_copy_the_gradients() -> None:
    """torch DDP, gradient_as_bucket_view=False: the buckets hold a second gradient copy."""
    ctx = RankContext(LLAMA, TrainingConfig(precision="bf16"), ParallelConfig(dp=8))
    assert comm.persistent_buffer_bytes(ctx) == alloc(LLAMA.num_params, "bf16")
    single = RankContext(LLAMA, TrainingConfig(), ParallelConfig(dp=1))
    assert comm.persistent_buffer_bytes(single) == 0


def test_deepspeed_reduce_buckets() -> None:
    """reduce_bucket_size 5e8 elements: ZeRO-1/2 one bucket during backward (overlap_comm off),
    ZeRO-3 one bucket for the whole run."""
    tr = TrainingConfig(precision="bf16")
    z2 = RankContext(LLAMA, tr, ParallelConfig(dp=8, zero=2))
    z3 = RankContext(LLAMA, tr, ParallelConfig(dp=8, zero=3))
    assert comm.backward_buffer_bytes(z2) == 10**9 and comm.persistent_buffer_bytes(z2) == 0
    assert comm.persistent_buffer_bytes(z3) == 10**9 and comm.backward_buffer_bytes(z3) == 0


def test_deepspeed_zero3_keeps_the_head_gathered_across_the_turn() -> None:
    """Reuse distance 1e9 elements: the head (used again at once in backward) stays gathered;
    with Llama-3-8B's 525M-element head nothing else qualifies (2 x 525M > 1e9 before the
    last layer), and the prefetcher queues modules up to 5e7 elements."""
    spec, _ = resolve_model("llama3-8b")
    ctx = RankContext(spec, TrainingConfig(), ParallelConfig(dp=8, zero=3))
    head = spec.vocab_size * spec.hidden_size
    down, up, gate = (spec.hidden_size * spec.intermediate_size,) * 3
    # backward order after the head: final norm (persistent), then the last layer's
    # down_proj (58.7M ≥ 5e7 stops the prefetch)
    assert comm.ds_gathered_numel(ctx) == head + down
    assert up == gate == down


def test_fsdp2_gathers_root_and_one_block() -> None:
    """FSDP2: root (embedding + norm + head) unsharded from forward into backward, one block
    all-gathered at a time in the compute dtype; grad-op keeps every block."""
    tr = TrainingConfig(precision="amp-bf16")
    full = RankContext(LLAMA, tr, ParallelConfig(dp=4, fsdp="full"))
    root = sum(alloc(n, "bf16") for n in (LLAMA.vocab_size * 1024, 1024, LLAMA.vocab_size * 1024))
    block = alloc(LLAMA.dense_layer_params, "bf16")
    assert comm.gather_bytes(full) == root + block
    op = RankContext(LLAMA, tr, ParallelConfig(dp=4, fsdp="grad-op"))
    assert comm.gather_bytes(op) == root + (8 + 1) * block  # + the block being copied out


# ---- offload -----------------------------------------------------------------------------------------
def test_deepspeed_offload_host_bytes() -> None:
    """ZeRO-Offload: fp32 master + Adam + fp32 grads on the host (16Ψ/N); ZeRO-3 adds the 16-bit
    gradient partition buffer (18Ψ/N) and with params offload the 16-bit partitions (20Ψ/N)."""
    psi, n = LLAMA.num_params, 8
    tr = TrainingConfig(precision="bf16")
    z2 = offload_footprint(RankContext(LLAMA, tr, ParallelConfig(dp=n, zero=2,
                                                                 offload=("optimizer",))))
    z3 = offload_footprint(RankContext(LLAMA, tr, ParallelConfig(dp=n, zero=3,
                                                                 offload=("optimizer",))))
    z3p = offload_footprint(RankContext(LLAMA, tr, ParallelConfig(
        dp=n, zero=3, offload=("optimizer", "params"))))
    assert z2.host_bytes == pytest.approx(16 * psi / n, rel=1e-4)
    assert z3.host_bytes == pytest.approx(18 * psi / n, rel=1e-4)
    assert z3p.host_bytes == pytest.approx(20 * psi / n, rel=1e-4)
    # every micro-step's gather of 16-bit partitions crosses PCIe twice (forward, backward)
    assert z3p.pcie_h2d_bytes_per_step == 2 * 2 * -(-psi // n)


def test_offload_lowers_device_bytes_and_reports_host_ram() -> None:
    base = {"model": "llama3-8b", "gpus": "2x8xH100", "zero": 3, "recompute": "full"}
    dev = estimate(build_scenario(base))
    off = estimate(build_scenario({**base, "offload": "optimizer"}))
    assert off.peak_allocated_bytes < dev.peak_allocated_bytes
    assert dev.host_bytes_per_node == 0 and off.host_bytes_per_node > 0
    nvme = estimate(build_scenario({**base, "offload": "optimizer", "offload_device": "nvme"}))
    assert nvme.nvme_bytes_per_node > 0 and nvme.host_bytes_per_node < off.host_bytes_per_node
    traffic = offload_traffic(build_scenario({**base, "offload": "optimizer"}))
    assert traffic.pcie_d2h_bytes_per_step > 0 and traffic.pcie_h2d_bytes_per_step > 0


def test_fsdp2_cpu_offload_moves_all_model_states() -> None:
    rep = estimate(build_scenario({"model": "llama3-8b", "gpus": "8xH100", "fsdp": "full",
                                   "offload": "params", "precision": "amp-bf16"}))
    assert rep.terms.weights == rep.terms.gradients == rep.terms.optimizer_states == 0
    assert rep.host_bytes_per_node > 0


# ---- gradient accumulation ------------------------------------------------------------------------
def test_gradient_buffers_across_micro_steps() -> None:
    """With accumulation DDP keeps full gradients through the next forward; ZeRO-2 keeps only
    its partition (which DeepSpeed allocates once anyway)."""
    base = {"model": "llama3-8b", "gpus": "8xH100", "recompute": "full", "seq_len": 2048}
    ddp1 = estimate(build_scenario(base))
    ddp4 = estimate(build_scenario({**base, "grad_accum": 4}))
    assert ddp4.phases["forward"] - ddp1.phases["forward"] == pytest.approx(
        2 * 8_030_261_248, rel=0.001)
    z2a = estimate(build_scenario({**base, "zero": 2}))
    z2b = estimate(build_scenario({**base, "zero": 2, "grad_accum": 4}))
    assert z2a.phases["forward"] == z2b.phases["forward"]


def test_megatron_distributed_optimizer_keeps_the_full_fp32_grad_buffer() -> None:
    tr = TrainingConfig(precision="bf16", framework="megatron")
    ctx = RankContext(LLAMA, tr, ParallelConfig(dp=8, zero=1))
    from vramcalc.terms.gradients import gradients_bytes

    assert gradients_bytes(ctx) == alloc(LLAMA.num_params, "fp32")
    assert weights_bytes(ctx) == sum(t.count * alloc(t.numel, "bf16")
                                     for t in param_tensors(LLAMA))
