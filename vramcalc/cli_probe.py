"""`vramcalc probe`: measure real device memory (built-in step, or a user's own command)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from vramcalc.cli import _console, _emit_json, _scenario, _split, option, scenario_command
from vramcalc.errors import InputError

EXIT_NO_DEVICE = 3

_EXTRA = [
    option("run", bool, False, "--run", help="Run the command after '--' (python train.py, "
           "torchrun ...) with a memory hook and record each rank's peaks."),
    option("interval", float, 0.0, "--interval", help="With --run: also write records every "
           "N seconds."),
    option("compare", Optional[Path], None, "--compare", help="With --run: a training config "
           "(vramcalc check format) whose estimate is shown beside the measurement."),
    option("device", str, "auto", "--device", help="auto (first GPU/NPU) or cpu (dry run with "
           "the trace tracker)."),
    option("iterations", int, 2, "--iterations", help="Measured iterations after one warm-up."),
    option("out", Optional[Path], None, "--out", help="Folder for the JSON record(s)."),
    option("no_trace", bool, False, "--no-trace", help="Skip the trace engine's prediction."),
    option("nproc", int, 1, "--nproc", help="Launch N ranks with torchrun (DDP or FSDP2), one "
           "record per rank."),
]


@scenario_command("probe", "Measure real GPU/NPU memory and compare with the estimates.",
                  extra=_EXTRA, with_context=True,
                  context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
def probe_cmd(ctx: typer.Context, **kwargs: Any) -> None:
    run, interval, compare = kwargs.pop("run"), kwargs.pop("interval"), kwargs.pop("compare")
    device_name, iterations = kwargs.pop("device"), kwargs.pop("iterations")
    out, no_trace, nproc = kwargs.pop("out"), kwargs.pop("no_trace"), kwargs.pop("nproc")
    values, dirs, as_json = _split(kwargs)
    if run:
        _run_mode(list(ctx.args), interval, compare, out, dirs, as_json)
        return
    if ctx.args:
        raise InputError(f"unexpected arguments {' '.join(ctx.args)!r} (use --run -- CMD)")
    if iterations < 1:
        raise InputError("--iterations must be at least 1")
    if device_name not in ("auto", "cpu"):
        raise InputError(f"--device: expected auto or cpu, got {device_name!r}")
    scn = _scenario(values, dirs)
    from vramcalc.probe.devices import NoDeviceError, find_device

    if nproc > 1:
        _nproc_mode(values, nproc, iterations, out, device_name, as_json)
        return
    try:
        device = find_device(allow_cpu=device_name == "cpu")
    except NoDeviceError as err:
        sys.stderr.write(f"error: {err}\n")
        raise typer.Exit(EXIT_NO_DEVICE) from None
    from vramcalc.probe.builtin import probe_record
    from vramcalc.probe.record import write_record

    record = probe_record(scn, values, device, iterations, with_trace=not no_trace)
    if out is not None:
        name = f"{scn.model.name}-{device.type}-{abs(hash(json.dumps(record['scenario'], sort_keys=True))) % 10**8:08d}.json"
        record["_written_to"] = str(write_record(record, Path(out) / name))
    if as_json:
        _emit_json(record)
        return
    from vramcalc.render_probe import print_probe_record

    print_probe_record(_console(), record)


def _run_mode(cmd: list[str], interval: float, compare: Path | None, out: Path | None,
              dirs: list[Path] | None, as_json: bool) -> None:
    from vramcalc.probe.run_cmd import run_command

    estimate_doc = None
    if compare is not None:
        estimate_doc = _estimate_for_config(compare, dirs)
    code, records = run_command(cmd, interval=interval, out_dir=out)
    doc = {"command": cmd, "exit_code": code, "ranks": records, "estimate": estimate_doc}
    if as_json:
        _emit_json(doc)
    else:
        from vramcalc.render_probe import print_run_records

        print_run_records(_console(), doc)
    if code != 0:
        raise typer.Exit(code)


def _estimate_for_config(path: Path, dirs: list[Path] | None) -> dict[str, Any]:
    from vramcalc.analytic import estimate

    try:
        from vramcalc.check import load_config_values  # the CI guard's config reader
    except ImportError as err:  # pragma: no cover
        raise InputError(f"--compare needs the config reader ({err})") from None
    values = load_config_values(path)
    scn = _scenario(values, dirs)
    rep = estimate(scn)
    return {"config": str(path), "peak_allocated_bytes": rep.peak_allocated_bytes,
            "device_total_bytes": rep.device_total_bytes, "fits": rep.fits}


def _nproc_mode(values: dict[str, Any], nproc: int, iterations: int, out: Path | None,
                device_name: str, as_json: bool) -> None:
    """torchrun N workers (vramcalc.probe.worker); collect one record per rank."""
    import subprocess
    import tempfile

    from vramcalc.probe.devices import NoDeviceError, find_device

    try:
        find_device(allow_cpu=device_name == "cpu")
    except NoDeviceError as err:
        sys.stderr.write(f"error: {err}\n")
        raise typer.Exit(EXIT_NO_DEVICE) from None
    folder = Path(out) if out else Path(tempfile.mkdtemp(prefix="vramcalc-probe-"))
    folder.mkdir(parents=True, exist_ok=True)
    plain = {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(_free_port()), "-m", "vramcalc.probe.worker", "--values",
           json.dumps(plain), "--out", str(folder), "--iterations", str(iterations)]
    proc = subprocess.run(cmd, check=False, capture_output=as_json, text=True)
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    if not records:
        tail = (proc.stderr or "").strip().splitlines()[-1:] if as_json else []
        raise InputError("torchrun wrote no probe record (exit code "
                         f"{proc.returncode}){': ' + tail[0] if tail else ''}")
    errors = [r.get("error") for r in records if r.get("status") == "error"]
    if errors:
        raise InputError(str(errors[0]))
    if as_json:
        _emit_json({"ranks": records, "exit_code": proc.returncode})
    else:
        from vramcalc.render_probe import print_probe_record

        for rec in records:
            rec.setdefault("analytic", None)
            rec.setdefault("measured", {})
            _console().print(f"[bold]rank {rec['rank']}[/bold]")
            print_probe_record(_console(), rec)
    if proc.returncode != 0:
        raise typer.Exit(proc.returncode)


def _free_port() -> int:
    """A free local TCP port for torchrun's rendezvous (fixed ports collide)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
