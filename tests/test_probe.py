"""probe: the CPU fallback path end to end, --run on a real script, records, exit codes."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from vramcalc.cli import main
from vramcalc.cli.probe import free_port
from vramcalc.probe.builtin import _failed_alloc_bytes

pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.yaml"
TRAIN_SCRIPT = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    loss = model(torch.randn(16, 32)).square().mean()
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
print("done")
"""


def test_no_device_exits_3(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["probe", "--model", "gpt2", "--seq-len", "64"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: no GPU or NPU found") and err.count("\n") == 1


def test_cpu_dry_run_record(tmp_path: Path, capsys) -> None:
    rc = main(["probe", "--model", "gpt2", "--seq-len", "64", "--micro-batch-size", "2",
               "--device", "cpu", "--out", str(tmp_path), "--json"])
    assert rc == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["schema"] == "vramcalc.probe/1" and rec["status"] == "ok"
    assert rec["device"]["type"] == "cpu" and rec["measured"]["dry_run"] is True
    # the dry run's "measured" peak is the trace tracker's count of a real PyTorch step
    assert rec["measured"]["max_memory_allocated_bytes"] == rec["trace"]["peak_allocated_bytes"]
    assert isinstance(rec["analytic"]["rel_error"], float)
    assert rec["scenario"]["model"] == "gpt2"
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    # the stored record is read back by validate --records
    assert main(["validate", "--records", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["num_scenarios"] == 1


def test_run_mode_on_a_real_script(tmp_path: Path, capsys) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    out = tmp_path / "records"
    rc = main(["probe", "--json", "--out", str(out), "--run", "--", sys.executable, str(script)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out.split("done\n")[-1])
    assert doc["exit_code"] == 0 and len(doc["ranks"]) == 1
    rank = doc["ranks"][0]
    assert rank["rank"] == 0 and rank["final"] is True
    assert rank["device"]["type"] == "cpu"  # torch imported, no CUDA: no-op device part
    assert rank["host_peak_rss_bytes"] > 0
    assert (out / f"rank0-{rank['pid']}.json").exists()


def test_run_mode_compares_with_the_config_estimate(tmp_path: Path, capsys) -> None:
    """`probe --run --compare CFG -- CMD` shows the estimate `vramcalc check CFG` makes
    beside the measured records."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    assert main(["check", str(EXAMPLE), "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)
    rc = main(["probe", "--json", "--out", str(tmp_path / "r"), "--run", "--compare",
               str(EXAMPLE), "--", sys.executable, str(script)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out.split("done\n")[-1])
    assert len(doc["ranks"]) == 1
    assert doc["estimate"] == {
        "config": str(EXAMPLE), "fits": checked["fits"],
        "peak_allocated_bytes": checked["report"]["peak_allocated_bytes"],
        "device_total_bytes": checked["device_total_bytes"]}
    rc = main(["probe", "--out", str(tmp_path / "r2"), "--run", "--compare", str(EXAMPLE),
               "--", sys.executable, str(script)])
    assert rc == 0
    assert f"estimate for {EXAMPLE}: peak allocated" in capsys.readouterr().out


def test_run_mode_compare_with_a_bad_config(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: 8b\nseq_lenn: 4096\n")
    assert main(["probe", "--run", "--compare", str(bad), "--", sys.executable, "-c",
                 "pass"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'seq_lenn'" in err


def test_run_mode_propagates_exit_code(tmp_path: Path) -> None:
    assert main(["probe", "--out", str(tmp_path), "--run", "--", sys.executable, "-c",
                 "raise SystemExit(5)"]) == 5


@pytest.mark.skipif(shutil.which("torchrun") is None and not Path(sys.executable).with_name(
    "torchrun").exists(), reason="torchrun not on PATH")
def test_run_mode_one_record_per_rank(tmp_path: Path, capsys) -> None:
    script = tmp_path / "ddp.py"
    script.write_text("import os, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "dist.barrier()\n"
                      "dist.destroy_process_group()\n")
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    rc = main(["probe", "--json", "--out", str(tmp_path / "r"), "--run", "--", torchrun,
               "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    ranks = sorted(r["rank"] for r in doc["ranks"])
    assert ranks == [0, 1]


def test_run_needs_a_command(capsys) -> None:
    assert main(["probe", "--run"]) == 2
    assert "needs a command" in capsys.readouterr().err


def test_records_folder_errors(tmp_path: Path, capsys) -> None:
    assert main(["validate", "--records", str(tmp_path / "nope")]) == 2
    (tmp_path / "x.json").write_text("{}")
    assert main(["validate", "--records", str(tmp_path)]) == 2
    assert "not a vramcalc probe record" in capsys.readouterr().err


def test_oom_message_parsing() -> None:
    # message format of c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x)
    msg = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
           "79.14 GiB of which 3.06 MiB is free.")
    assert _failed_alloc_bytes(msg) == 20 * 2**20
    assert _failed_alloc_bytes("something else") is None


@pytest.mark.parametrize("layout", [[], ["--fsdp", "full"]], ids=["ddp", "fsdp2"])
def test_nproc_launches_one_record_per_rank(tmp_path: Path, capsys, layout: list[str]) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text("hidden_size: 64\nnum_hidden_layers: 2\nnum_attention_heads: 4\n"
                    "intermediate_size: 128\nvocab_size: 256\n")
    rc = main(["probe", "--model", str(spec), "--seq-len", "32", "--gpus", "2xH100", *layout,
               "--nproc", "2", "--device", "cpu", "--out", str(tmp_path / "r"), "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(r["rank"] for r in doc["ranks"]) == [0, 1]
    assert all(r["status"] == "ok" and r["world_size"] == 2 for r in doc["ranks"])
