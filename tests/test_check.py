"""`vramcalc check`: config files, DeepSpeed JSON, exit codes 0/1/2, JSON and markdown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vramcalc.check import deepspeed_values, load_config_file, merge_values
from vramcalc.cli import app, main
from vramcalc.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.yaml"
DS_EXAMPLE = ROOT / "examples" / "ds_config.json"
H100_BYTES = 85_045_477_376  # hardware_profiles/h100_sxm.yaml memory_total_bytes


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    rc = main(argv + ["--json"])
    return rc, json.loads(capsys.readouterr().out)


# ---- exit codes -------------------------------------------------------------------------------
def test_example_config_fits_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = run_json(["check", str(EXAMPLE)], capsys)
    assert rc == 0 and doc["fits"] is True
    # 5% headroom from the file: usable = 95% of the H100's 85,045,477,376 bytes
    assert doc["usable_bytes"] == int(H100_BYTES * 0.95)
    assert doc["device_total_bytes"] <= doc["usable_bytes"]
    assert doc["report"]["strategy"]["seq_len"] == 8192  # the file's values are used


def test_does_not_fit_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 70B with AdamW in bf16 needs 16 bytes/param of model states (ZeRO paper): 1.13 TB,
    # 141 GB per GPU even fully sharded over 8 — more than an 80 GB H100
    cfg = write(tmp_path, "big.yaml", "model: 70b\ngpus: 8xH100\nzero: 3\n")
    rc, doc = run_json(["check", str(cfg)], capsys)
    assert rc == 1 and doc["fits"] is False
    assert doc["over_bytes"] == doc["device_total_bytes"] - doc["usable_bytes"] > 0


def test_headroom_key_is_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = EXAMPLE.read_text().replace("headroom: 0.05", "headroom: 0.5")
    cfg = write(tmp_path, "tight.yaml", text)
    rc, doc = run_json(["check", str(cfg)], capsys)
    assert doc["usable_bytes"] == int(H100_BYTES * 0.5)
    assert rc == (0 if doc["device_total_bytes"] <= doc["usable_bytes"] else 1)


def test_flags_override_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = run_json(["check", str(EXAMPLE), "--micro-batch-size", "4"], capsys)
    assert doc["report"]["strategy"]["micro_batch_size"] == 4
    assert rc == (0 if doc["fits"] else 1)


@pytest.mark.parametrize(("text", "needle"), [
    ("model: 8b\ngpus: 8xH100\nmicro_batch: 2\n", "did you mean: micro_batch_size"),
    ("model: 8b\ngpus: 8xH100\nzero: 5\n", "--zero"),
    ("model: 8b\ngpus: 8xH100\nprecision: fp64\n", "--precision"),
    ("model: 8b\ngpus: 8xH100\ntp: 3\n", "tp=3"),
    ("model: 8b\ngpus: [8xH100]\n", "single value"),
    ("model: 8b\n  gpus: : 8xH100\n", "malformed YAML"),
    ("- just\n- a list\n", "mapping"),
    ("gpus: 8xH100\n", "needs a model"),
    ("model: no-such-model\ngpus: 8xH100\n", "no-such-model"),
])
def test_bad_config_exit_2(tmp_path: Path, text: str, needle: str,
                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "bad.yaml", text)
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err


def test_missing_files_and_conflicting_flags_exit_2(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path / "nope.yaml")]) == 2
    assert main(["check", str(EXAMPLE), "--deepspeed", str(tmp_path / "nope.json")]) == 2
    assert main(["check", str(EXAMPLE), "--json", "--markdown"]) == 2
    bad = write(tmp_path, "bad.json", "{not json")
    assert main(["check", "--model", "8b", "--gpus", "8xH100", "--deepspeed", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 4 and "Traceback" not in err


# ---- DeepSpeed -----------------------------------------------------------------------------------
def test_deepspeed_mapping() -> None:
    vals, tbs, notes = deepspeed_values(json.loads(DS_EXAMPLE.read_text()))
    assert vals == {"zero": 3, "offload": "optimizer", "offload_device": "cpu",
                    "micro_batch_size": 4, "grad_accum": 8, "precision": "bf16",
                    "optimizer": "adamw"}
    assert tbs == 256 and notes == []
    vals, _, _ = deepspeed_values({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}},
        "fp16": {"enabled": True}})
    assert vals["offload"] == "optimizer,params" and vals["offload_device"] == "nvme"
    assert vals["precision"] == "fp16"
    vals, _, _ = deepspeed_values({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert vals["offload"] == "optimizer"


def test_deepspeed_auto_values_are_skipped_with_a_note() -> None:
    vals, tbs, notes = deepspeed_values({"train_micro_batch_size_per_gpu": "auto",
                                         "train_batch_size": "auto", "bf16": {"enabled": "auto"},
                                         "zero_optimization": {"stage": 2}})
    assert vals == {"zero": 2} and tbs is None
    assert "train_micro_batch_size_per_gpu" in notes[0] and "bf16.enabled" in notes[0]


@pytest.mark.parametrize("ds", [
    {"bf16": {"enabled": True}, "fp16": {"enabled": True}},
    {"zero_optimization": {"stage": 4}},
    {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
    {"train_micro_batch_size_per_gpu": 0},
    {"zero_optimization": []},
])
def test_deepspeed_bad_values(ds: dict) -> None:
    with pytest.raises(InputError):
        deepspeed_values(ds)


def test_deepspeed_with_model(capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = run_json(["check", "--deepspeed", str(DS_EXAMPLE), "--model", "8b", "--gpus",
                        "8xH100"], capsys)
    s = doc["report"]["strategy"]
    assert (s["zero"], s["offload"], s["micro_batch_size"], s["grad_accum"], s["precision"]) == (
        3, ["optimizer"], 4, 8, "bf16")
    # train_batch_size 256 = 4 x 8 x dp 8: consistent, accepted
    assert rc in (0, 1) and doc["fits"] == (rc == 0)


def test_train_batch_size_derives_accumulation(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    ds = write(tmp_path, "ds.json", json.dumps({"train_batch_size": 512,
                                                "train_micro_batch_size_per_gpu": 2}))
    rc, doc = run_json(["check", "--deepspeed", str(ds), "--model", "8b", "--gpus", "8xH100"],
                       capsys)
    assert doc["report"]["strategy"]["grad_accum"] == 512 // (2 * 8)
    assert any("derived" in n for n in doc["notes"])


def test_train_batch_size_inconsistent_exit_2(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    ds = write(tmp_path, "ds.json", json.dumps({"train_batch_size": 100,
                                                "train_micro_batch_size_per_gpu": 4,
                                                "gradient_accumulation_steps": 8}))
    assert main(["check", "--deepspeed", str(ds), "--model", "8b", "--gpus", "8xH100"]) == 2
    assert "train_batch_size 100" in capsys.readouterr().err


def test_yaml_names_a_deepspeed_file_relative_to_itself(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    write(tmp_path / "conf", "ds.json", json.dumps({"zero_optimization": {"stage": 1}}))
    cfg = write(tmp_path / "conf", "train.yaml", "model: 8b\ngpus: 8xH100\ndeepspeed: ds.json\n"
                "zero: 2\n")
    raw = load_config_file(cfg)
    assert raw["deepspeed"] == tmp_path / "conf" / "ds.json"
    ds_vals, _, _ = deepspeed_values(json.loads((tmp_path / "conf" / "ds.json").read_text()))
    # the YAML config wins over the DeepSpeed file, flags win over both
    assert merge_values(raw, ds_vals, {})["zero"] == 2
    assert merge_values(raw, ds_vals, {"zero": 3})["zero"] == 3
    assert main(["check", str(cfg), "--json"]) in (0, 1)


# ---- output ----------------------------------------------------------------------------------------
def test_markdown_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(EXAMPLE), "--markdown"]) == 0
    md = capsys.readouterr().out
    lines = md.splitlines()
    assert lines[0] == f"### vramcalc check: ✅ fits — `{EXAMPLE}`"
    assert "| term | GB | GiB | share |" in lines and "|---|---:|---:|---:|" in lines
    for term in ("weights", "gradients", "optimizer states", "activations", "logits + loss",
                 "transients", "overhead"):
        assert any(line.startswith(f"| {term} |") for line in lines)
    assert any(line.startswith("| **device total** |") for line in lines)
    assert "GB free**" in md and "5% headroom" in md


def test_markdown_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "big.yaml", "model: 70b\ngpus: 8xH100\n")
    assert main(["check", str(cfg), "--markdown"]) == 1
    md = capsys.readouterr().out
    assert md.startswith("### vramcalc check: ❌ does not fit")
    assert "over by" in md


def test_table_output_with_cli_runner() -> None:
    r = CliRunner().invoke(app, ["check", str(EXAMPLE)], env={"COLUMNS": "120"})
    assert r.exit_code == 0
    assert "FITS on NVIDIA H100" in r.output and "device total" in r.output
    r = CliRunner().invoke(app, ["check", "--model", "70b", "--gpus", "8xH100"])
    assert r.exit_code == 1 and "DOES NOT FIT" in r.output


def test_a_config_that_does_not_fit_points_to_its_plan(tmp_path: Path) -> None:
    # the plan command of the config's values (a list as names, a quoted release), folded
    # at 80 columns with `\` continuations; it runs
    import shlex
    cfg = tmp_path / "train.yaml"
    cfg.write_text("model: 70b\ngpus: 2xH100\nseq_len: 8192\nframework: torchtune\n"
                   "finetune: lora\nlora_targets: [q, k, v]\ntorchtune_version: '0.2'\n"
                   "fsdp: full\n")
    r = CliRunner().invoke(app, ["check", str(cfg)], env={"COLUMNS": "80"})
    assert r.exit_code == 1 and "DOES NOT FIT" in r.stdout
    cmd = shlex.split(r.stdout.split("try: ", 1)[1].split("\n  (it lists", 1)[0]
                      .replace("\\\n", " "))
    assert cmd[:2] == ["vramcalc", "plan"]
    for pair in (["--lora-targets", "q,k,v"], ["--torchtune-version", "0.2"],
                 ["--seq-len", "8192"]):
        assert pair[1] == cmd[cmd.index(pair[0]) + 1]
    assert CliRunner().invoke(app, cmd[1:]).exit_code in (0, 1)
    md = CliRunner().invoke(app, ["check", str(cfg), "--markdown"]).stdout
    assert f"Next: `{' '.join(cmd)}` lists the smallest changes that fit." in md


def test_plan_reads_a_deepspeed_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the file's stage pins the search, its train_batch_size is the global batch, and its
    # memory keys reach every layout: the best plan's device total is what `estimate
    # --deepspeed` gives for the same layout
    ds = write(tmp_path, "ds.json", json.dumps({
        "train_batch_size": 256, "zero_optimization": {
            "stage": 2, "reduce_bucket_size": 1e8, "overlap_comm": True}}))
    rc, doc = run_json(["plan", "--model", "8b", "--gpus", "8xH100", "--framework", "hf",
                        "--deepspeed", str(ds)], capsys)
    best = doc["candidates"][0]
    s = best["strategy"]
    assert s["zero"] == 2 and s["deepspeed"]["reduce_bucket_size"] == 100_000_000
    assert s["dp"] * s["micro_batch_size"] * s["grad_accum"] == 256
    rc, est = run_json(["estimate", "--model", "8b", "--gpus", "8xH100", "--framework", "hf",
                        "--deepspeed", str(ds), "--dp", str(s["dp"]), "--tp", str(s["tp"]),
                        "--micro-batch-size", str(s["micro_batch_size"]), "--grad-accum",
                        str(s["grad_accum"]), "--recompute", s["recompute"],
                        "--headroom", "0.05"], capsys)
    assert est["device_total_bytes"] == best["device_total_bytes"]
    # without the file, DeepSpeed's defaults hold one 5e8-element reduce bucket (overlap_comm
    # off at stage 2) against the file's two of 1e8: the same layout needs more
    rc, plain = run_json(["estimate", "--model", "8b", "--gpus", "8xH100", "--framework", "hf",
                          "--zero", "2", "--dp", str(s["dp"]), "--tp", str(s["tp"]),
                          "--micro-batch-size", str(s["micro_batch_size"]), "--grad-accum",
                          str(s["grad_accum"]), "--recompute", s["recompute"],
                          "--headroom", "0.05"], capsys)
    assert plain["device_total_bytes"] > est["device_total_bytes"]


def test_stage_layers_key_takes_a_list_or_a_string(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # a list of counts or the flag's comma-separated text; anything else one error line
    base = "model: llama3.1-405b\ngpus: 512xH100\ntp: 8\npp: 8\nseq_len: 4096\n"
    sizes = []
    for value in ("[15, 16, 16, 16, 16, 16, 16, 15]", "'15,16,16,16,16,16,16,15'"):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(base + f"stage_layers: {value}\n")
        assert main(["check", str(cfg), "--json"]) in (0, 1)
        out = json.loads(capsys.readouterr().out)["report"]
        assert out["strategy"]["stage_layers"] == [15, 16, 16, 16, 16, 16, 16, 15]
        sizes.append(out["peak_allocated_bytes"])
    assert sizes[0] == sizes[1]
    for bad in ("[15, true]", "[15, {a: 1}]", "[15, [16]]"):
        cfg.write_text(base + f"stage_layers: {bad}\n")
        assert main(["check", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1


def test_engine_trace_checks_the_allocator_fit(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # GPT-2 fp32 at micro-batch 10 on a 4090: the analytic floor leaves 0.48 GB, the trace's
    # fit (the allocator's smallest capacity; docs/trace.md, "The fit") is over the card:
    # the CI guard exits 1 with --engine trace, 0 without
    cfg = tmp_path / "train.yaml"
    cfg.write_text("model: gpt2\ngpus: 1xRTX4090\nframework: hf\nprecision: fp32\n"
                   "attention: eager\nseq_len: 1024\nmicro_batch_size: 10\nheadroom: 0\n",
                   encoding="utf-8")
    assert main(["check", str(cfg), "--json"]) == 0
    analytic = json.loads(capsys.readouterr().out)
    assert main(["check", str(cfg), "--json", "--engine", "trace"]) == 1
    traced = json.loads(capsys.readouterr().out)
    assert traced["report"]["engine"] == "trace"
    assert traced["device_total_bytes"] > analytic["device_total_bytes"]
    assert main(["check", str(cfg), "--engine", "quantum"]) == 2
    assert capsys.readouterr().err.startswith("error: --engine")
