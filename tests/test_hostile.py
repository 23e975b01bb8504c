"""Hostile input (issue 16): each root cause the black-box fuzz found, as a regression test.

Every bad input ends as exit 2 with exactly one `error: ...` line on stderr: never a
traceback, a hang or a silently wrong number. Where `plan` must refuse what `estimate`
refuses, the expected line is estimate's own (the same validation, so the same words).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vramcalc import safeio
from vramcalc.cli import main

ROOT = Path(__file__).resolve().parents[1]
H100 = ROOT / "hardware_profiles" / "h100_sxm.yaml"
HUGE = "9" * 5000  # over Python's 4,300-digit int-string limit
LLAMA_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}


def run(args: list[str]) -> tuple[int, str, str]:
    """`vramcalc ARGS` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


def one_error(args: list[str], *needles: str) -> str:
    """Exit 2 with exactly one `error:` line holding every needle; the line."""
    code, _, err = run(args)
    lines = err.splitlines()
    assert code == 2, (args, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), lines[:5]
    assert "Traceback" not in err and "internal error" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def subprocess_run(args: list[str], timeout: float = 60, **kw: object
                   ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **kw.pop("env", {})}  # type: ignore[dict-item]
    return subprocess.run([sys.executable, "-m", "vramcalc", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, **kw)  # type: ignore[call-overload]


def profile_with(tmp_path: Path, **fields: object) -> Path:
    """A copy of the shipped H100 profile with `fields` replaced, in its own folder."""
    data = yaml.safe_load(H100.read_text())
    data.update(fields)
    folder = tmp_path / "profiles"
    folder.mkdir(exist_ok=True)
    text = yaml.safe_dump(data)
    for key, raw in fields.items():  # YAML spellings PyYAML's dumper will not write
        if isinstance(raw, str) and raw.startswith("RAW:"):
            text = text.replace(f"{key}: {raw}", f"{key}: {raw[4:]}")
    (folder / "h100_sxm.yaml").write_text(text)
    return folder


# ---- numbers over Python's int-string limit --------------------------------------------
def test_huge_int_options(tmp_path: Path) -> None:
    one_error(["estimate", "--model", "70b", "--seq-len", HUGE], "--seq-len")
    one_error(["estimate", "--model", "70b", "--gpus", f"{HUGE}xH100"], "GPU count",
              "5,000-digit")
    one_error(["estimate", "--model", "70b", "--gpus", f"2x{HUGE}xH100"], "GPUs per node")


@pytest.mark.parametrize("kind", ["config.json", "deepspeed", "check", "profile"])
def test_huge_int_in_files(tmp_path: Path, kind: str) -> None:
    if kind == "config.json":
        path = tmp_path / "config.json"
        path.write_text(json.dumps(LLAMA_CONFIG)[:-1] + f', "rope_theta": {HUGE}}}')
        one_error(["estimate", "--model", str(path)], "5,000 digits")
    elif kind == "deepspeed":
        path = tmp_path / "ds.json"
        path.write_text(f'{{"train_micro_batch_size_per_gpu": {HUGE}}}')
        one_error(["estimate", "--model", "8b", "--deepspeed", str(path)], "5,000 digits")
    elif kind == "check":
        path = tmp_path / "train.yaml"
        path.write_text(f"model: 8b\nseq_len: {HUGE}\n")
        one_error(["check", str(path)], "5,000 digits")
    else:
        folder = profile_with(tmp_path, memory_total_bytes=f"RAW:{HUGE}")
        one_error(["estimate", "--model", "8b", "--profiles-dir", str(folder)],
                  "5,000 digits")


# ---- names and paths ------------------------------------------------------------------
@pytest.mark.parametrize(("model", "needle"), [
    ("a" * 256, "unknown model"),            # ENAMETOOLONG as a path
    ("a" * 5000, "characters"),              # cut in the message
    ("/" + "b" * 300 + "/config.json", "no such file"),
    ("~nosuchuser/x", "no such user"),       # pathlib's RuntimeError
    ("/dev/zero", "not a regular file"),
    ("8b\nfoo", "'8b\\nfoo'"),               # a newline cannot split the line
    ("\x1b[31mred", "\\x1b[31mred"),         # a terminal escape is shown escaped
])
def test_model_names(model: str, needle: str) -> None:
    line = one_error(["estimate", "--model", model], needle)
    assert "\x1b" not in line and len(line) < 1000


def test_file_options_with_names_too_long(tmp_path: Path) -> None:
    # a name past NAME_MAX makes stat() raise ENAMETOOLONG, which pathlib's is_dir() passes on
    long = str(tmp_path / ("n" * 300))
    one_error(["estimate", "--model", "gpt2", "--finetune", "peft", "--peft-config",
               long + ".json"], "--peft-config", "File name too long")
    one_error(["max", "--model", "gpt2", "--gpus", "4090", "--plot", long + "/x.png"],
              "--plot", "no such folder")


def test_profile_lookup_with_long_names(tmp_path: Path) -> None:
    one_error(["estimate", "--model", "8b", "--gpus", "a" * 300], "unknown GPU")
    one_error(["estimate", "--model", "8b", "--profiles-dir", "/x" * 3000], "not a valid path")
    one_error(["estimate", "--model", "8b", "--profiles-dir", "~nosuchuser/p"], "no such user")


def test_unreadable_profiles_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "locked"
    folder.mkdir()

    listing = Path.iterdir

    def denied(self: Path) -> object:  # what listing a mode-000 folder raises (not as root)
        if self == folder:
            raise PermissionError(13, "Permission denied", str(self))
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", denied)
    one_error(["estimate", "--model", "8b", "--profiles-dir", str(folder)],
              "Permission denied", str(folder))


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads mode 000")
def test_unreadable_files_for_real(tmp_path: Path) -> None:
    folder = tmp_path / "locked"
    folder.mkdir()
    (folder / "x.yaml").write_text("id: x\n")
    cfg = tmp_path / "train.yaml"
    cfg.write_text("model: 8b\n")
    folder.chmod(0)
    cfg.chmod(0)
    try:
        one_error(["estimate", "--model", "8b", "--profiles-dir", str(folder)], "Permission")
        one_error(["check", str(cfg)], "Permission")
    finally:
        folder.chmod(0o755)
        cfg.chmod(0o644)


# ---- special files: no hang, no unbounded read -----------------------------------------
def test_fifo_and_devices_do_not_block(tmp_path: Path) -> None:
    fifo = tmp_path / "train.yaml"
    os.mkfifo(fifo)
    # a subprocess, so a regression blocks the child (killed by the timeout), not pytest
    proc = subprocess_run(["check", str(fifo)], timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ")
    assert "not a regular file" in proc.stderr and proc.stderr.count("\n") == 1
    one_error(["check", "/dev/zero"], "not a regular file")
    one_error(["check", str(tmp_path)], "a directory")
    one_error(["estimate", "--model", "8b", "--deepspeed", "/dev/zero"], "not a regular file")


def test_oversized_files(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("model: 8b\n" + "x" * (safeio.MAX_FILE_BYTES + 1))
    one_error(["check", str(big)], f"{safeio.MAX_FILE_BYTES:,}")
    many = tmp_path / "many.yaml"  # under the byte limits, over the value limit
    many.write_text("model: 8b\nx: [" + ",".join(["1"] * (safeio.MAX_NODES + 1)) + "]\n")
    one_error(["check", str(many)], "values")


# ---- deep nesting ---------------------------------------------------------------------
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("kind", ["config.json", "deepspeed", "record", "yaml"])
def test_deep_nesting(tmp_path: Path, kind: str) -> None:
    if kind == "config.json":
        path = tmp_path / "config.json"
        path.write_text('{"model_type": "llama", "x": ' + DEEP + "}")
        one_error(["estimate", "--model", str(path)], "nested")
    elif kind == "deepspeed":
        path = tmp_path / "ds.json"
        path.write_text('{"zero_optimization": ' + DEEP + "}")
        one_error(["estimate", "--model", "8b", "--deepspeed", str(path)], "nested")
    elif kind == "record":
        (tmp_path / "r.json").write_text('{"schema": "vramcalc.probe/1", "x": ' + DEEP + "}")
        one_error(["validate", "--records", str(tmp_path)], "nested")
    else:
        path = tmp_path / "train.yaml"
        path.write_text("model: 8b\nx: " + "[" * 200 + "]" * 200 + "\n")
        one_error(["check", str(path)], "nested")


# ---- duplicate keys: the last one must not win silently ---------------------------------
def test_duplicate_keys(tmp_path: Path) -> None:
    cfg = tmp_path / "train.yaml"
    cfg.write_text("model: 70b\ngpus: 8xH100\nmodel: 8b\n")
    one_error(["check", str(cfg)], "duplicate key 'model'")
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps(LLAMA_CONFIG)[:-1] + ', "hidden_size": 128}')
    one_error(["estimate", "--model", str(hf)], "duplicate key 'hidden_size'")
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3, "stage": 1}}')
    one_error(["estimate", "--model", "8b", "--deepspeed", str(ds)], "duplicate key 'stage'")
    prof = profile_with(tmp_path)
    text = (prof / "h100_sxm.yaml").read_text()
    (prof / "h100_sxm.yaml").write_text(text + "mfu_fraction: 0.9\n")
    one_error(["estimate", "--model", "8b", "--profiles-dir", str(prof)], "duplicate key")


# ---- non-finite and absurd numbers ----------------------------------------------------
@pytest.mark.parametrize(("fields", "needle"), [
    ({"dense_tflops": {"bf16": "RAW:.inf"}}, "not finite"),
    ({"mfu_fraction": "RAW:.nan"}, "not finite"),
    ({"dense_tflops": {"bf16": 1e-300, "fp16": 1e-300}}, "dense_tflops"),
    ({"mfu_fraction": 1e-300}, "mfu_fraction"),
    ({"memory_bandwidth_bytes_per_s": 1}, "memory_bandwidth_bytes_per_s"),
])
def test_profile_numbers(tmp_path: Path, fields: dict, needle: str) -> None:
    flat = {k: v for k, v in fields.items() if not isinstance(v, dict)}
    folder = profile_with(tmp_path, **flat)
    if "dense_tflops" in fields:
        data = yaml.safe_load(H100.read_text())
        data["dense_tflops"] = fields["dense_tflops"]
        text = yaml.safe_dump(data).replace("bf16: RAW:.inf", "bf16: .inf")
        (folder / "h100_sxm.yaml").write_text(text)
    one_error(["size", "--model", "8b", "--tokens", "1T", "--gpu", "H100", "--json",
               "--profiles-dir", str(folder)], needle)


@pytest.mark.parametrize("value", ["1e-300", "nan", "inf", "0", "-1"])
def test_size_mfu(value: str) -> None:
    one_error(["size", "--model", "8b", "--tokens", "1T", "--gpu", "H100", "--mfu", value],
              "--mfu")


def test_json_output_is_strict(capsys: pytest.CaptureFixture[str]) -> None:
    from vramcalc.cli.app import emit_json

    with pytest.raises(ValueError):  # never the invalid `NaN` / `Infinity` literals
        emit_json({"days": float("nan")})
    assert capsys.readouterr().out == ""


# ---- plan: pinned values are checked as estimate checks them ----------------------------
@pytest.mark.parametrize("pin", [["--micro-batch-size", "-1"], ["--micro-batch-size", "0"],
                                 ["--zero", "-1"], ["--zero", "4"], ["--grad-accum", "0"],
                                 ["--virtual-stages", "0"], ["--tp", "0"], ["--dp", "0"],
                                 ["--num-microbatches", "0"], ["--shard-group", "0"]])
def test_plan_pins_obey_estimates_bounds(pin: list[str]) -> None:
    cluster = ["--model", "8b", "--gpus", "8xH100"]
    expected = one_error(["estimate", *cluster, *pin])
    assert one_error(["plan", *cluster, *pin, "--json"]) == expected


@pytest.mark.parametrize("pins", [["--qat", "int4", "--precision", "amp-bf16"],
                                  ["--zero", "3", "--framework", "megatron"],
                                  ["--zero", "3", "--fsdp", "full"]])
def test_plan_contradictory_pins_say_why(pins: list[str]) -> None:
    """Not "NOTHING FITS" with exit 0: the reason the engine refuses every layout, in
    estimate's words."""
    reason = one_error(["estimate", "--model", "8b", "--gpus", "8xH100", *pins])
    line = one_error(["plan", "--model", "8b", "--gpus", "8xH100", *pins])
    assert line.endswith(reason.removeprefix("error: ")), (line, reason)


# ---- size stops early -----------------------------------------------------------------
def test_size_stops_when_the_context_fills_the_memory() -> None:
    # H100 profile: 524,288,000 B context of ~85 GB; 0.995 headroom leaves ~0.42 GB
    code, out, _ = run(["size", "--model", "8b", "--tokens", "1T", "--gpu", "H100",
                        "--headroom", "0.995", "--json"])
    row = json.loads(out)["rows"][0]
    assert code == 0 and row["num_gpus"] is None and "CUDA context" in row["notes"][0]


def test_size_time_budget_says_so() -> None:
    from vramcalc.cli.plan import prepare_plan
    from vramcalc.hardware import resolve_gpu
    from vramcalc.size import size_cluster

    base, req, _ = prepare_plan({"model": "8b", "gpus": "1xH100", "headroom": 0.9})
    rows = size_cluster(base, [resolve_gpu("H100")], 10**12, req, time_budget_s=0.0)
    assert rows[0].entry is None and "time budget" in rows[0].notes[0]


def test_moe_with_absurd_expert_count(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_CONFIG, "model_type": "mixtral",
                                "num_local_experts": 100_000, "num_experts_per_tok": 2}))
    one_error(["size", "--model", str(path), "--tokens", "1T", "--gpu", "H100"],
              "num_local_experts")


# ---- validate --records ---------------------------------------------------------------
@pytest.mark.parametrize(("record", "needle"), [
    ({"kind": "builtin", "status": "ok", "device": {"name": "x"}}, "scenario"),
    ({"kind": "builtin", "status": "ok", "scenario": [], "device": {"name": "x"}}, "scenario"),
    ({"kind": "builtin", "status": "ok", "scenario": {"model": "gpt2"}, "device": "gpu"},
     "device"),
    ({"kind": "builtin", "status": "ok", "scenario": {"model": "gpt2"},
      "device": {"name": "x"}, "measured": {"max_memory_allocated_bytes": "lots"}},
     "max_memory_allocated_bytes"),
    ({"kind": "builtin", "status": "ok", "scenario": {"model": "gpt2", "zero": 9},
      "device": {"name": "x"}, "measured": {"max_memory_allocated_bytes": 10}}, "--zero"),
])
def test_validate_records_with_missing_or_wrong_fields(tmp_path: Path, record: dict,
                                                       needle: str) -> None:
    (tmp_path / "r.json").write_text(json.dumps({"schema": "vramcalc.probe/1", **record}))
    one_error(["validate", "--records", str(tmp_path)], needle, "r.json")


# ---- probe ----------------------------------------------------------------------------
def test_probe_run_errors(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a program\n")
    text.chmod(0o644)
    one_error(["probe", "--run", "--", str(text)], "cannot run")  # EACCES
    text.chmod(0o755)
    one_error(["probe", "--run", "--", str(text)], "cannot run")  # ENOEXEC (no #!)
    one_error(["probe", "--run", "--out", str(text), "--", "true"], "--out", "File exists")


def test_probe_run_records_only_the_launchers_ranks(tmp_path: Path) -> None:
    """A Python child of the job (a data-loader worker, a tool) inherits the hook; only the
    process the launcher started writes a record."""
    script = ("import subprocess, sys; "
              "subprocess.run([sys.executable, '-c', 'pass'], check=True)")
    proc = subprocess_run(["probe", "--run", "--json", "--", sys.executable, "-c", script],
                          env={"TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["ranks"]) == 1
    assert not list(tmp_path.glob("vramcalc-probe-*"))  # the temporary folder is gone


def test_probe_record_names_do_not_depend_on_the_hash_seed(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    names = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        proc = subprocess_run(["probe", "--model", "gpt2", "--seq-len", "32", "--device", "cpu",
                               "--no-trace", "--iterations", "1", "--out", str(out), "--json"],
                              timeout=300, env={"PYTHONHASHSEED": seed})
        assert proc.returncode == 0, proc.stderr[-2000:]
        names.append(sorted(p.name for p in out.glob("*.json")))
    assert names[0] == names[1] and len(names[0]) == 1


# ---- trace ----------------------------------------------------------------------------
@pytest.mark.parametrize("framework", ["reference", "hf"])
def test_trace_unknown_hidden_act(tmp_path: Path, framework: str) -> None:
    pytest.importorskip("torch")
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "hidden_act": "zap"}))
    for command in ("trace", "estimate"):  # never counted as some other activation
        one_error([command, "--model", str(tmp_path), "--seq-len", "16", "--framework",
                   framework], "hidden_act 'zap'")


# ---- the last resort ------------------------------------------------------------------
def test_unexpected_errors_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import vramcalc.cli.estimate as est

    def boom(*_: object, **__: object) -> None:
        raise RuntimeError("something\nunforeseen")

    monkeypatch.setattr(est, "explain", boom)
    code, _, err = run(["explain", "--model", "8b"])
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: internal error (RuntimeError: something unforeseen)")
    assert "VRAMCALC_DEBUG=1" in err
    monkeypatch.setenv("VRAMCALC_DEBUG", "1")
    code, _, err = run(["explain", "--model", "8b"])
    assert code == 2 and "Traceback" in err and err.splitlines()[-1].startswith("error: ")


def test_closed_stdout_is_quiet() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "vramcalc", "explain", "--model", "70b",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader went away (`| head`) before the output was written
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 1 and err == b""


# ---- the standing guarantees (docs/reliability.md) ----------------------------------
@pytest.mark.parametrize("where", ["check", "model", "profile"])
def test_yaml_code_tags_are_refused(tmp_path: Path, where: str) -> None:
    tag = "!!python/object/apply:os.system ['touch pwned']"
    if where == "check":
        path = tmp_path / "train.yaml"
        path.write_text(f"model: {tag}\n")
        one_error(["check", str(path)], "python/object")
    elif where == "model":
        path = tmp_path / "m.yaml"
        path.write_text(f"hidden_size: {tag}\n")
        one_error(["estimate", "--model", str(path)], "python/object")
    else:
        folder = profile_with(tmp_path)
        with (folder / "h100_sxm.yaml").open("a") as fh:
            fh.write(f"zz_extra: {tag}\n")
        one_error(["estimate", "--model", "8b", "--profiles-dir", str(folder)], "python/object")
    assert not Path("pwned").exists() and not (tmp_path / "pwned").exists()


def test_remote_code_in_a_config_is_never_run(tmp_path: Path) -> None:
    """auto_map names modeling code next to config.json (what trust_remote_code would
    import): vramcalc reads the shapes only."""
    marker = tmp_path / "imported"
    (tmp_path / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "config.json").write_text(json.dumps({
        **LLAMA_CONFIG, "auto_map": {"AutoConfig": "modeling_evil.Cfg",
                                     "AutoModelForCausalLM": "modeling_evil.Evil"}}))
    for cmd in ("estimate", "explain", "plan"):
        code, _, err = run([cmd, "--model", str(tmp_path), "--gpus", "2xH100", "--seq-len",
                            "64", "--json"])
        assert code in (0, 1), err
    assert not marker.exists()


def test_planner_commands_open_no_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    def no_network(*_: object, **__: object) -> None:
        raise AssertionError("a socket was opened")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    for args in (["estimate", "--model", "70b", "--gpus", "8xH100"],
                 ["explain", "--model", "8b"],
                 ["plan", "--model", "8b", "--gpus", "8xH100"],
                 ["size", "--model", "gpt2", "--tokens", "1B", "--gpu", "H100"],
                 ["check", str(ROOT / "examples" / "train.yaml")],
                 ["gpus"], ["models"]):
        code, _, err = run([*args, "--json"])
        assert code in (0, 1) and err == "", (args, err)


def test_output_does_not_depend_on_the_hash_seed() -> None:
    outs = {subprocess_run(["plan", "--model", "mixtral-8x7b", "--gpus", "2x8xH100", "--json"],
                           env={"PYTHONHASHSEED": seed}).stdout for seed in ("0", "1", "77")}
    assert len(outs) == 1 and json.loads(outs.pop())["candidates"]


def test_probe_run_cleans_up_when_terminated(tmp_path: Path) -> None:
    """A cancelled CI job (SIGTERM) takes the command down and leaves no temporary folder."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "vramcalc", "probe", "--run", "--",
                             sys.executable, "-c", "import time; time.sleep(120)"],
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for _ in range(600):  # until the folder exists (the command has started)
        if list(tmp_path.glob("vramcalc-probe-*")):
            break
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert proc.stderr is not None and b"Traceback" not in proc.stderr.read()
    assert not list(tmp_path.glob("vramcalc-probe-*"))
