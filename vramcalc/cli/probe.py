"""`vramcalc probe`: measure real device memory (the built-in step, or a user's own command).

The probe engine (vramcalc/probe/) loads inside the command: it drives torch, an optional
extra. Exit code 3 when no GPU/NPU is found.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import typer

import vramcalc.safeio as safeio
from vramcalc.check import check_files
from vramcalc.cli.app import emit_json, fail, option, scenario_command, split_values
from vramcalc.cli.serve import run_serve
from vramcalc.errors import InputError, shown_path
from vramcalc.options import build_scenario
from vramcalc.render.console import make_console
from vramcalc.render.probe import print_probe_record, print_run_records
from vramcalc.serve.command import parse_serve_command

EXIT_NO_DEVICE = 3
# `probe --run -- CMD`: the words after `--` reach the command as ctx.args
CONTEXT_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": False}

_EXTRA = [
    option("run", bool, False, "--run", help="Run the command after '--' (python train.py, "
           "torchrun ...) with a memory hook and record each rank's peaks."),
    option("interval", float, 0.0, "--interval", help="With --run: also write records every "
           "N seconds."),
    option("compare", Optional[Path], None, "--compare", help="With --run: a training config "
           "(vramcalc check format) whose estimate is shown beside the measurement; `serve`: "
           "the serving estimate of the `vllm serve` / sglang command after -- on --gpus."),
    option("device", str, "auto", "--device", help="auto (first GPU/NPU) or cpu (dry run with "
           "the trace tracker)."),
    option("iterations", int, 2, "--iterations", help="Measured iterations after one warm-up."),
    option("out", Optional[Path], None, "--out", help="Folder for the JSON record(s)."),
    option("no_trace", bool, False, "--no-trace", help="Skip the trace engine's prediction."),
    option("nproc", int, 1, "--nproc", help="Launch N ranks with torchrun (DDP or FSDP2), one "
           "record per rank."),
]


@scenario_command("Measure real GPU/NPU memory and compare with the estimates. Exit code 3 "
                  "when no GPU or NPU is found.",
                  extra=_EXTRA, with_context=True)
def probe_cmd(ctx: typer.Context, **kwargs: Any) -> None:
    run, interval, compare = kwargs.pop("run"), kwargs.pop("interval"), kwargs.pop("compare")
    device_name, iterations = kwargs.pop("device"), kwargs.pop("iterations")
    out, no_trace, nproc = kwargs.pop("out"), kwargs.pop("no_trace"), kwargs.pop("nproc")
    values, dirs, as_json = split_values(kwargs)
    if not 0 <= interval <= 86_400:  # also false for NaN
        raise InputError(f"--interval must be between 0 and 86400 seconds, got {interval}")
    if not 1 <= nproc <= 1024:
        raise InputError(f"--nproc must be between 1 and 1024, got {nproc}")
    if run:
        _run_mode(list(ctx.args), interval, compare, out, dirs, as_json,
                  str(values.get("gpus", "1xH100")))
        return
    if ctx.args:
        raise InputError(f"unexpected arguments {' '.join(ctx.args)!r} (use --run -- CMD)")
    if not 1 <= iterations <= 10_000:
        raise InputError(f"--iterations must be between 1 and 10,000, got {iterations}")
    if device_name not in ("auto", "cpu"):
        raise InputError(f"--device: expected auto or cpu, got {device_name!r}")
    scn = build_scenario(values, dirs)
    from vramcalc.probe import builtin, devices, record  # the probe engine (torch)

    try:
        device = devices.find_device(allow_cpu=device_name == "cpu")
    except devices.NoDeviceError as err:
        raise fail(str(err), EXIT_NO_DEVICE) from None
    if nproc > 1:
        _nproc_mode(values, nproc, iterations, out, as_json)
        return
    rec = builtin.probe_record(scn, values, device, iterations, with_trace=not no_trace)
    if out is not None:
        # the same scenario gets the same name in every run (hash() is salted per process)
        digest = hashlib.sha256(json.dumps(rec["scenario"], sort_keys=True).encode()
                                ).hexdigest()[:8]
        name = f"{_safe_name(scn.model.name)}-{device.type}-{digest}.json"
        rec["_written_to"] = str(record.write_record(rec, Path(out) / name))
    if as_json:
        emit_json(rec)
        return
    print_probe_record(make_console(), rec)


def _run_mode(cmd: list[str], interval: float, compare: Path | None, out: Path | None,
              dirs: list[Path] | None, as_json: bool, gpus: str) -> None:
    """`probe --run -- CMD`: run the user's command under the memory hook; its exit code."""
    estimate_doc = None
    if compare is not None and str(compare) == "serve" and not compare.exists():
        estimate_doc = _serve_estimate_for_command(cmd, gpus, dirs)
    elif compare is not None:
        estimate_doc = _estimate_for_config(compare, dirs)
    from vramcalc.probe.run_cmd import run_command  # the probe engine (torch)

    code, records = run_command(cmd, interval=interval, out_dir=out)
    doc = {"command": cmd, "exit_code": code, "ranks": records, "estimate": estimate_doc}
    if as_json:
        emit_json(doc)
    else:
        print_run_records(make_console(), doc)
    if code != 0:
        raise typer.Exit(code)


def _estimate_for_config(path: Path, dirs: list[Path] | None) -> dict[str, Any]:
    """`--compare CFG`: the estimate `vramcalc check CFG` makes, for the side-by-side."""
    result, source = check_files(path, None, {}, dirs)
    rep = result.report
    return {"config": source, "peak_allocated_bytes": rep.peak_allocated_bytes,
            "device_total_bytes": rep.device_total_bytes, "fits": result.fits}


def _serve_estimate_for_command(cmd: list[str], gpus: str, dirs: list[Path] | None
                                ) -> dict[str, Any]:
    """`--compare serve`: `vramcalc serve` for the engine command being run, per GPU; its
    torch-allocated part (weights, activation peak, KV cache) beside max_memory_allocated."""
    model, values = parse_serve_command(cmd)
    report = run_serve(model, gpus, values, dirs[0] if dirs else None)
    t = report.terms
    return {"config": f"vramcalc serve --engine {report.engine} ({model}, {report.gpu})",
            "peak_allocated_bytes": t.weights + t.activation_peak + t.kv_cache,
            "device_total_bytes": report.device_total_bytes, "fits": report.fits,
            "serve": report.to_json_dict()}


def _nproc_mode(values: dict[str, Any], nproc: int, iterations: int, out: Path | None,
                as_json: bool) -> None:
    """torchrun N workers (vramcalc.probe.worker); collect one record per rank."""
    plain = {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items()}
    with tempfile.TemporaryDirectory(prefix="vramcalc-probe-") as tmp:  # unless --out
        folder = Path(out) if out else Path(tmp)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise InputError(f"--out {shown_path(folder)}: cannot make the folder: "
                             f"{err.strerror or type(err).__name__}") from None
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), "-m", "vramcalc.probe.worker", "--values",
               json.dumps(plain), "--out", str(folder), "--iterations", str(iterations)]
        proc = subprocess.run(cmd, check=False, capture_output=as_json, text=True)
        records = [safeio.read_json(p, "probe record")
                   for p in sorted(folder.glob("rank*.json"))]
    if not records:
        tail = (proc.stderr or "").strip().splitlines()[-1:] if as_json else []
        raise InputError("torchrun wrote no probe record (exit code "
                         f"{proc.returncode}){': ' + tail[0] if tail else ''}")
    errors = [r.get("error") for r in records if r.get("status") == "error"]
    if errors:
        raise InputError(str(errors[0]))
    if as_json:
        emit_json({"ranks": records, "exit_code": proc.returncode})
    else:
        console = make_console()
        for rec in records:
            rec.setdefault("analytic", None)
            rec.setdefault("measured", {})
            console.print(f"[bold]rank {rec['rank']}[/bold]")
            print_probe_record(console, rec)
    if proc.returncode != 0:
        raise typer.Exit(proc.returncode)


def _safe_name(text: str) -> str:
    """A model name as part of a file name: letters, digits, `.`, `_`, `-`; at most 64."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:64] or "model"


def free_port() -> int:
    """A free local TCP port for torchrun's rendezvous (fixed ports collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
