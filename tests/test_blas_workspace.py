"""The BLAS workspaces a training process holds (vramcalc/terms/transients.py).

Expected bytes from the sources, by hand:
- PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp: a workspace per (handle, stream) pair
  (`cublas_handle_stream_to_workspace`), handles per thread (DeviceThreadHandlePool); the
  size from CUBLAS_WORKSPACE_CONFIG, ":4096:8" = 8 x 4096 KiB, else the GPU's default
  (":4096:8" from sm90, ":4096:2:16:8" = 8 MiB + 128 KiB before);
- torch/csrc/autograd/engine.cpp: the backward runs on autograd's device thread, so a
  training step uses two handles on the same stream;
- NVIDIA/Megatron-LM d98e8a64 megatron/training/determinism.py: --deterministic-mode sets
  CUBLAS_WORKSPACE_CONFIG=:4096:8 unless the launcher did (the functional tests' ENV_VARS
  set the same value);
- Transformer Engine transformer_engine/pytorch/module/base.py `get_workspace`: one
  torch.empty of `get_cublas_workspace_size_bytes()`, 33,554,432 bytes from compute
  capability 9, 4,194,304 before.
"""

from __future__ import annotations

import pytest

from vramcalc.analytic import estimate
from vramcalc.cli import main
from vramcalc.options import build_scenario

MiB = 2**20
PRE_HOPPER = 8 * MiB + 8 * 16 * 2**10  # ":4096:2:16:8"


def _workspace(**kw: object) -> int:
    values = {"model": "gpt2", "gpus": "1xA100", "seq_len": 256, "precision": "bf16", **kw}
    return estimate(build_scenario(values)).subterms["transients/cublas_workspace"]


@pytest.mark.parametrize(("gpu", "te"), [("A100", 4 * MiB), ("H100", 32 * MiB)])
def test_megatron_deterministic_mode_takes_32_mib_per_thread_and_te_its_own(gpu: str,
                                                                            te: int) -> None:
    kw = {"gpus": f"8x{gpu}", "framework": "megatron", "deterministic": True}
    assert _workspace(**kw) == 2 * 32 * MiB + te
    assert _workspace(**kw, transformer_impl="local") == 2 * 32 * MiB


def test_without_deterministic_mode_the_gpu_default_applies() -> None:
    assert _workspace(gpus="8xA100", framework="megatron") == 2 * PRE_HOPPER + 4 * MiB
    assert _workspace(gpus="8xH100", framework="megatron",
                      transformer_impl="local") == 2 * 32 * MiB
    assert _workspace() == 2 * PRE_HOPPER  # the reference profile: no Transformer Engine


def test_the_fp8_policy_runs_transformer_engine_linears() -> None:
    assert _workspace(gpus="1xH100", precision="fp8") == 2 * 32 * MiB + 32 * MiB


def test_transformer_impl_is_megatrons(capsys) -> None:  # noqa: ANN001
    code = main(["estimate", "--model", "gpt2", "--gpus", "1xH100", "--framework", "hf",
                 "--transformer-impl", "local"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error:") and "--framework megatron" in err
    assert len(err.strip().splitlines()) == 1


def test_the_trace_replay_takes_the_second_workspace_in_the_first_backward() -> None:
    """trace/tracker.py: the calling thread's workspace when the first forward starts, the
    autograd thread's when the first backward starts; the report counts both."""
    torch = pytest.importorskip("torch")
    from vramcalc.trace.tracker import MemoryTracker

    tracker = MemoryTracker(workspace_bytes=(3 * MiB, 5 * MiB))
    with tracker:
        tracker.set_phase("forward")
        after_forward = tracker.allocator.allocated
        tracker.set_phase("backward")
        after_backward = tracker.allocator.allocated
        tracker.set_phase("forward")
        torch.empty(0)
    assert (after_forward, after_backward) == (3 * MiB, 8 * MiB)
    assert tracker.allocator.allocated == 8 * MiB  # each taken once, held


def test_the_trace_and_the_analytic_model_count_the_same_workspaces() -> None:
    pytest.importorskip("torch")
    from vramcalc.trace.engine import trace

    scn = build_scenario({"model": "gpt2", "gpus": "1xA100", "seq_len": 128,
                          "precision": "bf16"})
    key = "transients/cublas_workspace"
    assert trace(scn).report.subterms[key] == estimate(scn).subterms[key] == 2 * PRE_HOPPER
