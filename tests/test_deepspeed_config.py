"""DeepSpeed's memory-changing config keys (vramcalc/ds_config.py, vramcalc/ds_json.py,
vramcalc/terms/comm.py, vramcalc/terms/ds_checkpointing.py).

Expected values are derived by hand from DeepSpeed 0.16.5 (commit 38327e07) source lines,
cited per test, and from transformers' "auto" rules (huggingface/transformers 02348331,
src/transformers/integrations/deepspeed.py `trainer_config_finalize`). Llama-3-8B shapes:
h = 4096, FFN 14336, 32 heads, 8 kv heads of 128, V = 128256, 32 layers (its config.json):
q = o = 4096² = 16,777,216; k = v = 1024·4096 = 4,194,304; gate = up = down = 14336·4096 =
58,720,256; head = 128256·4096 = 525,336,576 elements.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramcalc.analytic import estimate
from vramcalc.catalog import resolve_model
from vramcalc.cli import main
from vramcalc.ds_config import DeepSpeedConfig, hf_auto_value
from vramcalc.ds_json import deepspeed_settings
from vramcalc.errors import InputError
from vramcalc.hardware import parse_gpus
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import activations as act
from vramcalc.terms import comm
from vramcalc.terms.transients import fused_step_temp_bytes
from vramcalc.terms.weights import weights_bytes
from vramcalc.training import TrainingConfig

SPEC, _ = resolve_model("llama3-8b")
Q = 4096 * 4096
KV = 1024 * 4096
MLP = 14336 * 4096
HEAD = 128256 * 4096
BF16 = 2  # bytes


def ctx(zero: int, train: TrainingConfig | None = None, tp: int = 1, dp: int = 8,
        **ds: object) -> RankContext:
    par = ParallelConfig(dp=dp, tp=tp, zero=zero, deepspeed=DeepSpeedConfig(**ds))
    return RankContext(SPEC, train or TrainingConfig(), par)


def scenario(zero: int, train: TrainingConfig | None = None, tp: int = 1,
             **ds: object) -> Scenario:
    par = ParallelConfig(tp=tp, zero=zero, deepspeed=DeepSpeedConfig(**ds))
    return Scenario(model=SPEC, training=train or TrainingConfig(), parallel=par,
                    cluster=parse_gpus("8xH100")).resolved()


# ---- defaults ---------------------------------------------------------------------------------
def test_defaults_are_deepspeeds() -> None:
    """deepspeed/runtime/zero/config.py: reduce_bucket_size = allgather_bucket_size =
    pp_int(5e8), contiguous_gradients = True, overlap_comm = None → `overlap_comm_valid`
    sets stage == 3, stage3_prefetch_bucket_size pp_int(5e7), stage3_max_live_parameters and
    stage3_max_reuse_distance pp_int(1e9), stage3_param_persistence_threshold pp_int(1e5),
    sub_group_size pp_int(1e9); activation_checkpointing/config.py: every flag False,
    number_checkpoints None."""
    d = ParallelConfig().deepspeed
    assert (d.reduce_bucket_size, d.allgather_bucket_size) == (500_000_000, 500_000_000)
    assert d.contiguous_gradients is True and d.overlap_comm is None
    assert [d.overlap(s) for s in (1, 2, 3)] == [False, False, True]
    assert (d.prefetch_bucket_size, d.max_live_parameters, d.max_reuse_distance) == (
        50_000_000, 1_000_000_000, 1_000_000_000)
    assert (d.param_persistence_threshold, d.sub_group_size) == (100_000, 1_000_000_000)
    assert not (d.partition_activations or d.cpu_checkpointing
                or d.contiguous_memory_optimization) and d.number_checkpoints is None


# ---- ZeRO-1/2 reduce buckets --------------------------------------------------------------------
def test_halving_reduce_bucket_size_halves_the_zero2_bucket() -> None:
    """stage_1_and_2.py `backward`: `buf_0 = torch.empty(int(self.reduce_bucket_size),
    dtype=self.dtype)`, and `buf_1` too when overlap_comm ("double buffers")."""
    assert comm.backward_buffer_bytes(ctx(2, reduce_bucket_size=200_000_000)) == 200_000_000 * BF16
    assert comm.backward_buffer_bytes(ctx(2, reduce_bucket_size=100_000_000)) == 100_000_000 * BF16
    both = ctx(2, reduce_bucket_size=100_000_000, overlap_comm=True)
    assert comm.backward_buffer_bytes(both) == 2 * 100_000_000 * BF16
    # ZeRO-1 allocates the same bucket in every backward
    assert comm.backward_buffer_bytes(ctx(1, reduce_bucket_size=100_000_000)) == 2e8


def test_reduce_bucket_shifts_the_backward_and_forward_peaks_exactly() -> None:
    """The bucket exists from the start of backward (counted from forward on) to the
    reduction epilogue: both phase peaks move by the bucket difference, the optimizer
    step's does not (`_release_ipg_buffers` in the epilogue)."""
    big, small = scenario(2, reduce_bucket_size=400_000_000), scenario(2, reduce_bucket_size=200_000_000)
    rb, rs = estimate(big), estimate(small)
    delta = 200_000_000 * BF16
    assert rb.phases["backward"] - rs.phases["backward"] == delta
    assert rb.phases["forward"] - rs.phases["forward"] == delta
    assert rb.phases["optimizer"] == rs.phases["optimizer"]


def test_without_contiguous_gradients_the_bucket_is_its_gradients_and_a_flat_copy() -> None:
    """contiguous_gradients False: no ipg buffer; up to reduce_bucket_size elements of
    gradients wait as tensors (ZeRO-2 frees the ones outside the partition after the
    reduction) and `allreduce_bucket` flattens them (`self.flatten(bucket)`): 2 × min(bucket,
    Ψ_r) in bf16. Llama-3-8B holds 8.03e9 > 5e8 elements."""
    assert comm.backward_buffer_bytes(ctx(2, contiguous_gradients=False)) == 2 * 500_000_000 * BF16
    # ZeRO-1 keeps its full gradients anyway: only the flattened copy is extra
    assert comm.backward_buffer_bytes(ctx(1, contiguous_gradients=False)) == 500_000_000 * BF16
    # optimizer offload forces contiguous gradients in ZeRO-1/2 (`contiguous_gradients or
    # self.cpu_offload`): the bucket again
    off = RankContext(SPEC, TrainingConfig(), ParallelConfig(
        dp=8, zero=2, offload=("optimizer",), deepspeed=DeepSpeedConfig(contiguous_gradients=False)))
    assert comm.backward_buffer_bytes(off) == 500_000_000 * BF16


# ---- ZeRO-3 ------------------------------------------------------------------------------------
def test_zero3_bucket_is_persistent_only_with_contiguous_gradients() -> None:
    """stage3.py: `if self.contiguous_gradients: self.__ipg_bucket_flat_buffer =
    torch.empty(self.reduce_bucket_size, dtype=self.dtype)` at initialisation; overlap_comm
    changes only the stream (one buffer either way)."""
    assert comm.persistent_buffer_bytes(ctx(3, reduce_bucket_size=100_000_000)) == 2e8
    assert comm.persistent_buffer_bytes(ctx(3, overlap_comm=False)) == 500_000_000 * BF16
    assert comm.backward_buffer_bytes(ctx(3)) == 0
    loose = ctx(3, contiguous_gradients=False, reduce_bucket_size=100_000_000)
    assert comm.persistent_buffer_bytes(loose) == 0
    assert comm.backward_buffer_bytes(loose) == 2 * 100_000_000 * BF16


def test_stage3_max_live_parameters_caps_the_prefetch() -> None:
    """partitioned_param_coordinator.py `fetch_sub_module`: `max_params_to_prefetch =
    min(max_n_available_params - n_available_params, prefetch_bucket_sz)`, and the loop adds
    whole parameters `while numel_prefetching < max_params_to_prefetch`. At the turn the head
    (525,336,576) is gathered; with max_live = the head nothing more is prefetched; one
    element more lets the last down_proj (58,720,256) in."""
    assert comm.ds_gathered_numel(ctx(3)) == HEAD + MLP  # defaults (test_parallel.py)
    assert comm.ds_gathered_numel(ctx(3, max_live_parameters=HEAD)) == HEAD
    assert comm.ds_gathered_numel(ctx(3, max_live_parameters=HEAD + 1)) == HEAD + MLP
    assert comm.gather_bytes(ctx(3, max_live_parameters=HEAD)) == HEAD * BF16


def test_stage3_prefetch_bucket_size_sets_how_far_ahead() -> None:
    """Prefetch 2e8 elements, backward order after the head: final norm (persistent, 4096 ≤
    1e5), down, up, gate (3 × 58,720,256 = 176,160,768), the two norms (persistent), o
    (→ 192,937,984), v (→ 197,132,288), k (→ 201,326,592 ≥ 2e8: stop)."""
    prefetched = 3 * MLP + Q + 2 * KV
    assert prefetched == 201_326_592
    assert comm.ds_gathered_numel(ctx(3, prefetch_bucket_size=200_000_000)) == HEAD + prefetched
    assert comm.ds_gathered_numel(ctx(3, prefetch_bucket_size=0)) == HEAD


def test_stage3_max_reuse_distance_zero_releases_everything() -> None:
    """`__params_to_release`: a parameter is kept only when it reappears within
    max_reuse_dist_in_numel of fetches; with 0 nothing is kept across the turn, so what is
    gathered is the largest module (the head) plus the prefetch."""
    assert comm.ds_gathered_numel(ctx(3, max_reuse_distance=0, prefetch_bucket_size=0)) == HEAD


def test_stage3_param_persistence_threshold_keeps_kv_whole() -> None:
    """parameter_offload.py `mark_persistent_parameters`: `param.ds_numel <= param_threshold`
    → not partitioned. With 5e6, k and v (4,194,304 each, 64 tensors) are kept whole on
    every rank instead of 1/8 in the flat partition: +64·(4,194,304 − 524,288)·2 bytes."""
    base = weights_bytes(ctx(3))
    keep = weights_bytes(ctx(3, param_persistence_threshold=5_000_000))
    assert keep - base == 64 * (KV - KV // 8) * BF16
    # and they are no longer gathered: the prefetch skips them (o then k... see above)
    assert comm.ds_gathered_numel(ctx(3, param_persistence_threshold=5_000_000,
                                      prefetch_bucket_size=200_000_000)) == HEAD + 3 * MLP + 2 * Q


def test_sub_group_size_bounds_the_zero3_fp32_gradient() -> None:
    """stage3.py `_prepare_fp32_grad_for_sub_group`: `flatten(averaged_gradients[i]).to(fp32)`
    one sub-group at a time; sub-groups hold sub_group_size elements (`_create_fp16_sub_groups`).
    This rank's partition: ⌈8,030,261,248 / 8⌉ = 1,003,782,656 elements."""
    part = -(-SPEC.num_params // 8)
    assert part == 1_003_782_656
    assert fused_step_temp_bytes(ctx(3)) == 1_000_000_000 * 4
    assert fused_step_temp_bytes(ctx(3, sub_group_size=100_000_000)) == 100_000_000 * 4
    assert fused_step_temp_bytes(ctx(3, sub_group_size=2_000_000_000)) == part * 4


# ---- "auto" -------------------------------------------------------------------------------------
def test_auto_resolves_as_transformers_does() -> None:
    """trainer_config_finalize: reduce_bucket_size = hidden_size * hidden_size; under ZeRO-3
    stage3_prefetch_bucket_size = 0.9 * hidden_size * hidden_size and
    stage3_param_persistence_threshold = 10 * hidden_size. h = 4096: 16,777,216;
    0.9 · 16,777,216 = 15,099,494.4 → int 15,099,494; 40,960."""
    assert hf_auto_value("reduce_bucket_size", 4096) == 16_777_216
    assert hf_auto_value("stage3_prefetch_bucket_size", 4096) == 15_099_494
    assert hf_auto_value("stage3_param_persistence_threshold", 4096) == 40_960
    cfg, notes = deepspeed_settings({"zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": "auto"}},
        4096)
    assert (cfg.reduce_bucket_size, cfg.prefetch_bucket_size,
            cfg.param_persistence_threshold) == (16_777_216, 15_099_494, 40_960)
    assert cfg.max_live_parameters == 1_000_000_000  # not filled by transformers
    assert any("hidden size 4,096" in n for n in notes)
    assert any("stage3_max_live_parameters" in n for n in notes)


def test_json_keys_and_aliases() -> None:
    cfg, notes = deepspeed_settings({"zero_optimization": {
        "reduce_bucket_size": 5e7, "prefetch_bucket_size": 1000, "overlap_comm": True,
        "contiguous_gradients": False, "round_robin_gradients": True, "sub_group_size": 1e8},
        "activation_checkpointing": {"partition_activations": True, "number_checkpoints": 32,
                                     "contiguous_memory_optimization": True}}, 4096)
    assert cfg == DeepSpeedConfig(reduce_bucket_size=50_000_000, prefetch_bucket_size=1000,
                                  overlap_comm=True, contiguous_gradients=False,
                                  sub_group_size=100_000_000, partition_activations=True,
                                  number_checkpoints=32, contiguous_memory_optimization=True)
    assert notes == []
    _, notes = deepspeed_settings({"zero_optimization": {"zero_quantized_weights": True,
                                                         "offload_param": {"buffer_count": 8}},
                                   "communication_data_type": "fp32"}, 4096)
    assert len(notes) == 1 and "zero_quantized_weights" in notes[0]
    assert "offload_param.buffer_count" in notes[0] and "communication_data_type" in notes[0]


@pytest.mark.parametrize("ds, needle", [
    ({"zero_optimization": {"reduce_bucket_size": -1}}, "reduce_bucket_size"),
    ({"zero_optimization": {"reduce_bucket_size": "big"}}, "reduce_bucket_size"),
    ({"zero_optimization": {"stage3_max_live_parameters": 1.5}}, "stage3_max_live_parameters"),
    ({"zero_optimization": {"sub_group_size": True}}, "sub_group_size"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "overlap_comm"),
    ({"zero_optimization": []}, "zero_optimization"),
    ({"activation_checkpointing": {"partition_activations": 1}}, "partition_activations"),
    ({"activation_checkpointing": {"number_checkpoints": 0}}, "number_checkpoints"),
    ({"activation_checkpointing": {"contiguous_memory_optimization": True,
                                   "number_checkpoints": 4}}, "partition_activations"),
    ({"activation_checkpointing": {"contiguous_memory_optimization": True,
                                   "partition_activations": True}}, "number_checkpoints"),
])
def test_bad_values_raise_one_input_error(ds: dict, needle: str) -> None:
    with pytest.raises(InputError, match=needle):
        deepspeed_settings(ds, 4096)


# ---- activation checkpointing ------------------------------------------------------------------
FULL = TrainingConfig(recompute="full")


def test_partition_activations_divides_the_checkpoint_by_tp() -> None:
    """checkpointing.py `partition_activations`: each rank keeps
    `item.view(-1).narrow(0, start, size/mp_size).clone()` and the input itself is emptied
    (`arg.data = torch.empty([])`). Input (1, 4096, 4096) bf16 = 33,554,432 B; tp = 2 →
    16,777,216 B per layer, for the 32 layers of the rank."""
    plain = ctx(0, FULL, tp=2, dp=4)
    part = ctx(0, FULL, tp=2, dp=4, partition_activations=True)
    assert act.layer_activation_bytes(plain) == 4096 * 4096 * BF16
    assert act.layer_activation_bytes(part) == 4096 * 4096 * BF16 // 2
    diff = act.microbatch_activation_bytes(plain) - act.microbatch_activation_bytes(part)
    assert diff == 32 * 4096 * 4096 * BF16 // 2


def test_cpu_checkpointing_moves_the_checkpoints_to_host() -> None:
    """`copy_to_device(args, device=cpu)` / `partition.cpu()`: nothing of a checkpoint stays
    on the device; host RAM per node = 8 GPUs × 32 layers × the (partitioned) input."""
    on_cpu = ctx(0, FULL, tp=2, dp=4, cpu_checkpointing=True)
    assert act.layer_activation_bytes(on_cpu) == 0
    both = scenario(0, FULL, tp=2, partition_activations=True, cpu_checkpointing=True)
    assert estimate(both).host_bytes_per_node == 8 * 32 * 4096 * 4096 * BF16 // 2
    just_cpu = scenario(0, FULL, tp=2, cpu_checkpointing=True)
    assert estimate(just_cpu).host_bytes_per_node == 8 * 32 * 4096 * 4096 * BF16


def test_checkpoint_keys_need_deepspeed_checkpointing_and_full_recompute() -> None:
    """Only models that call deepspeed.checkpointing.checkpoint use the section: the hf
    profile (torch.utils.checkpoint) and runs without full recompute are unchanged."""
    for tr in (TrainingConfig(recompute="full", framework="hf"), TrainingConfig()):
        plain = ctx(0, tr, tp=2, dp=4)
        part = ctx(0, tr, tp=2, dp=4, partition_activations=True, cpu_checkpointing=True)
        assert act.microbatch_activation_bytes(part) == act.microbatch_activation_bytes(plain)


# ---- CLI ---------------------------------------------------------------------------------------
def write(tmp_path: Path, doc: object, name: str = "ds.json") -> Path:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
    return p


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
    rc = main(argv + ["--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out) if out.out.strip() else {}, out.err


def test_estimate_reads_the_deepspeed_file(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    ds = write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 2, "reduce_bucket_size": "auto", "overlap_comm": True}})
    rc, doc, err = run(["estimate", "--model", "8b", "--gpus", "8xH100", "--deepspeed",
                        str(ds)], capsys)
    assert rc == 0
    st = doc["strategy"]
    assert (st["zero"], st["micro_batch_size"]) == (2, 2)
    assert st["deepspeed"]["reduce_bucket_size"] == 4096 * 4096
    assert st["deepspeed"]["overlap_comm"] is True
    assert "note: DeepSpeed \"auto\" filled" in err
    # the same file through check gives the same breakdown (0% headroom for both)
    rc2, doc2, _ = run(["check", "--deepspeed", str(ds), "--model", "8b", "--gpus", "8xH100",
                        "--headroom", "0"], capsys)
    assert rc2 in (0, 1) and doc2["report"]["phases"] == doc["phases"]
    # a flag given on the command line overrides the file; defaults do not
    _, doc3, _ = run(["estimate", "--model", "8b", "--gpus", "8xH100", "--deepspeed", str(ds),
                      "--micro-batch-size", "1"], capsys)
    assert doc3["strategy"]["micro_batch_size"] == 1
    # the two buckets of 16,777,216 bf16 elements instead of the default one of 5e8
    _, base, _ = run(["estimate", "--model", "8b", "--gpus", "8xH100", "--zero", "2",
                      "--micro-batch-size", "2"], capsys)
    assert "deepspeed" not in base["strategy"]
    assert base["phases"]["backward"] - doc["phases"]["backward"] == (
        500_000_000 * BF16 - 2 * 4096 * 4096 * BF16)


@pytest.mark.parametrize("command", ["estimate", "check"])
@pytest.mark.parametrize("doc, needle", [
    ('{"zero_optimization": {"stage": 5}}', "stage"),
    ('{"zero_optimization": {"reduce_bucket_size": -5}}', "reduce_bucket_size"),
    ('{"zero_optimization": {"stage3_prefetch_bucket_size": "lots"}}', "prefetch"),
    ('{"activation_checkpointing": {"cpu_checkpointing": "yes"}}', "cpu_checkpointing"),
    ('{"zero_optimization": ', "malformed JSON"),
])
def test_bad_deepspeed_json_is_one_error_line_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, doc: str,
        needle: str) -> None:
    ds = write(tmp_path, doc)
    rc = main([command, "--model", "8b", "--gpus", "8xH100", "--deepspeed", str(ds)])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]


def test_check_notes_unused_checkpoint_keys(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    ds = write(tmp_path, {"zero_optimization": {"stage": 1},
                          "activation_checkpointing": {"partition_activations": True}})
    rc, doc, _ = run(["check", "--deepspeed", str(ds), "--model", "8b", "--gpus", "8xH100"],
                     capsys)
    assert rc in (0, 1) and any("--recompute full" in n for n in doc["notes"])


def test_example_deepspeed_files(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/: the Hugging Face ZeRO-3 template ("auto" filled from h = 4096) and a
    Megatron-DeepSpeed-style file partitioning the checkpoints over tp = 2."""
    root = Path(__file__).resolve().parents[1] / "examples"
    rc, doc, err = run(["estimate", "--model", "8b", "--gpus", "8xH100", "--recompute", "full",
                        "--deepspeed", str(root / "ds_zero3_hf.json")], capsys)
    assert rc == 0 and doc["strategy"]["zero"] == 3
    ds = doc["strategy"]["deepspeed"]
    assert (ds["reduce_bucket_size"], ds["prefetch_bucket_size"],
            ds["param_persistence_threshold"]) == (16_777_216, 15_099_494, 40_960)
    rc, doc, err = run(["estimate", "--model", "8b", "--gpus", "8xH100", "--recompute", "full",
                        "--tp", "2", "--deepspeed", str(root / "ds_checkpointing.json")], capsys)
    assert rc == 0 and doc["strategy"]["deepspeed"]["partition_activations"] is True
    assert "activation_checkpointing" not in err  # it applies: no note


def test_stage_0_is_estimated_as_ddp_with_a_note(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    ds = write(tmp_path, {"zero_optimization": {"stage": 0, "reduce_bucket_size": 1000}})
    rc, doc, err = run(["estimate", "--model", "gpt2", "--gpus", "2xH100", "--deepspeed",
                        str(ds)], capsys)
    assert rc == 0 and doc["engine"] == "analytic" and "estimated as PyTorch DDP" in err
    _, _, err = run(["estimate", "--model", "gpt2", "--gpus", "2xH100", "--deepspeed", str(ds),
                     "--zero", "1"], capsys)
    assert "PyTorch DDP" not in err


# ---- properties ---------------------------------------------------------------------------------
GPT2, _ = resolve_model("gpt2")
SIZES = st.sampled_from([0, 1_000, 1_000_000, 50_000_000, 500_000_000])


@settings(max_examples=40, deadline=None)
@given(zero=st.sampled_from([1, 2, 3]), a=SIZES, b=SIZES, overlap=st.booleans(),
       contiguous=st.booleans(), keep=st.sampled_from([0, 1_000, 100_000, 10_000_000]))
def test_larger_buckets_never_lower_the_peak(zero: int, a: int, b: int, overlap: bool,
                                             contiguous: bool, keep: int) -> None:
    """Every DeepSpeed size is an upper bound on a buffer: raising reduce_bucket_size,
    stage3_prefetch_bucket_size or stage3_max_live_parameters never lowers the peak, and the
    terms stay non-negative ints."""
    lo, hi = sorted((a, b))

    def peak(size: int) -> int:
        ds = DeepSpeedConfig(reduce_bucket_size=size, prefetch_bucket_size=size,
                             max_live_parameters=size, overlap_comm=overlap,
                             contiguous_gradients=contiguous, param_persistence_threshold=keep)
        scn = Scenario(model=GPT2, training=TrainingConfig(seq_len=256),
                       parallel=ParallelConfig(zero=zero, deepspeed=ds),
                       cluster=parse_gpus("4xH100")).resolved()
        rep = estimate(scn)
        assert all(isinstance(v, int) and v >= 0 for v in rep.phases.values())
        return rep.peak_allocated_bytes

    assert peak(hi) >= peak(lo)


@settings(max_examples=30, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), part=st.booleans(), cpu=st.booleans(),
       b=st.sampled_from([1, 2, 3]))
def test_deepspeed_checkpointing_never_adds_device_activations(tp: int, part: bool, cpu: bool,
                                                               b: int) -> None:
    tr = TrainingConfig(recompute="full", micro_batch_size=b, seq_len=512)
    plain = RankContext(GPT2, tr, ParallelConfig(dp=1, tp=tp))
    ds = RankContext(GPT2, tr, ParallelConfig(dp=1, tp=tp, deepspeed=DeepSpeedConfig(
        partition_activations=part, cpu_checkpointing=cpu)))
    assert act.microbatch_activation_bytes(ds) <= act.microbatch_activation_bytes(plain)
