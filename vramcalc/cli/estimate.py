"""`vramcalc estimate`, `explain` and `trace`: one scenario's memory, its formulas, and the
fake-tensor dry run of the same scenario."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Optional

import typer

from vramcalc.analytic import estimate
from vramcalc.check import checked_scenario, read_inputs
from vramcalc.cli.app import (
    command_line,
    emit_json,
    emit_text,
    given_values,
    note,
    option,
    scenario_command,
    split_values,
)
from vramcalc.cli.serve import run_serve, show_serve
from vramcalc.errors import InputError
from vramcalc.evidence import evidence_json
from vramcalc.explain import explain
from vramcalc.lengths import padded_batches, read_lengths
from vramcalc.options import build_scenario
from vramcalc.render.console import make_console, print_plan_hint, with_progress
from vramcalc.render.markdown import estimate_markdown
from vramcalc.render.report import print_explain, print_report
from vramcalc.report import MemoryReport


def show_report(report: MemoryReport, as_json: bool, markdown: str | None = None,
                notes: list[str] | None = None, plan_command: str | None = None) -> None:
    """A memory report as JSON, as markdown (for a pull-request comment; `markdown` names
    the scenario) or as the table with the fit verdict (and, when it does not fit,
    `plan_command`: the plan of the same flags)."""
    if as_json:
        doc = report.to_json_dict()
        if report.usable_bytes is not None:  # as check --json: the published runs' band
            doc["evidence"] = evidence_json(str(report.strategy.get("framework", "reference")),
                                            report.device_total_bytes,
                                            report.usable_bytes - report.device_total_bytes)
        emit_json(doc)
    elif markdown is not None:
        headroom = 0.0
        if report.usable_bytes is not None and report.gpu is not None:
            headroom = 1 - report.usable_bytes / report.gpu.memory_total_bytes
        emit_text(estimate_markdown(report, headroom, markdown, notes or [], plan_command))
    else:
        console = make_console()
        print_report(console, report)
        if report.fits is False and plan_command:
            print_plan_hint(console, plan_command)


MARKDOWN = option("markdown", bool, False, "--markdown",
                  help="A markdown summary for a pull-request comment (like check --markdown).")


DEEPSPEED = option("deepspeed", Optional[Path], None, "--deepspeed",
                   help="DeepSpeed JSON config: ZeRO stage, offload, batch sizes, bf16/fp16, "
                   "optimizer, and the keys that change memory (reduce/prefetch buckets, "
                   "stage3_max_live_parameters, contiguous_gradients, activation "
                   "checkpointing). Flags given on the command line override it.")


# `--mode inference` (not listed in --help): the serving estimate, as `vramcalc serve`
MODE = inspect.Parameter("mode", inspect.Parameter.KEYWORD_ONLY, annotation=str,
                         default=typer.Option("train", "--mode", hidden=True))


@scenario_command("One scenario's per-GPU memory breakdown and fit check.",
                  extra=[DEEPSPEED, MARKDOWN, MODE], with_context=True)
def estimate_cmd(ctx: typer.Context, **kwargs: Any) -> None:
    ds_path: Path | None = kwargs.pop("deepspeed", None)
    mode = kwargs.pop("mode", "train")
    markdown: bool = kwargs.pop("markdown", False)
    values, dirs, as_json = split_values(kwargs)
    if as_json and markdown:
        raise InputError("choose one of --json and --markdown")
    md = f"{values.get('model')} on {values.get('gpus', '1xH100')}" if markdown else None
    if mode not in ("train", "inference"):
        raise InputError(f"--mode must be train or inference, got {mode!r}")
    if mode == "inference":
        note("estimate --mode inference is `vramcalc serve` (vLLM defaults; see serve --help)")
        if not values.get("model"):
            raise InputError("--model is required (e.g. --model llama3-8b)")
        serve_values = {"tp": values.get("tp"), "pp": values.get("pp"),
                        "max_model_len": values.get("seq_len")}
        show_serve(run_serve(str(values["model"]), str(values.get("gpus", "1xH100")),
                             serve_values, dirs[0] if dirs else None), as_json, False)
        return
    plan = None if as_json or values.get("load_only") else command_line(  # when it does not fit
        "plan", values, {"--deepspeed": ds_path, "--profiles-dir": dirs[0] if dirs else None})
    if ds_path is None:
        show_report(estimate(build_scenario(values, dirs)), as_json, md, plan_command=plan)
        return
    # the DeepSpeed file fills what the command line leaves at its defaults
    inp = read_inputs(None, ds_path, given_values(ctx, values), command="estimate")
    scn, notes = checked_scenario(inp.values, inp.train_batch_size, dirs,
                                  frozenset(inp.values), inp.deepspeed)
    show_report(estimate(scn), as_json, md, inp.notes + notes, plan_command=plan)
    if md is None:
        for text in inp.notes + notes:
            note(text)


@scenario_command("Every formula with this scenario's numbers substituted.")
def explain_cmd(**kwargs: Any) -> None:
    values, dirs, as_json = split_values(kwargs)
    doc = explain(build_scenario(values, dirs))
    if as_json:
        emit_json(doc)
    else:
        print_explain(make_console(), doc)


LENGTHS = option("lengths", Optional[Path], None, "--lengths",
                 help="Token counts of your training samples (a text file, one integer per "
                 "sample): replay --steps micro-batches, each padded to its longest sample "
                 "and cut at --seq-len: the peak reserved such a run reports, which creeps "
                 "over steps of varying shape while memory is ample.")
STEPS = option("steps", Optional[int], None, "--steps",
               help="Micro-batches to replay with --lengths (the last one at --seq-len); "
               "default 64.")


@scenario_command("Fake-tensor dry run of a real PyTorch training step (needs torch).",
                  extra=[LENGTHS, STEPS])
def trace_cmd(**kwargs: Any) -> None:
    lengths_file: Path | None = kwargs.pop("lengths", None)
    steps: int | None = kwargs.pop("steps", None)
    values, dirs, as_json = split_values(kwargs)
    scn = build_scenario(values, dirs)
    seq_lens = None
    if lengths_file is not None:
        tr = scn.training
        seq_lens = padded_batches(read_lengths(lengths_file), tr.micro_batch_size, tr.seq_len,
                                  64 if steps is None else steps)
    elif steps is not None:
        raise InputError("--steps counts the micro-batches --lengths replays: give --lengths "
                         "FILE too")
    try:  # the torch engine loads for this command only (torch is an optional extra)
        from vramcalc.trace.distributed import trace_any
    except ImportError as err:
        raise InputError(f"trace needs PyTorch: pip install torch ({err})") from None
    # FSDP2 data parallelism runs on a fake process group
    report = with_progress("tracing", lambda progress: trace_any(scn, progress, seq_lens),
                           as_json)
    plan = None if as_json or values.get("load_only") else command_line(  # when it does not fit
        "plan", values, {"--profiles-dir": dirs[0] if dirs else None})
    show_report(report, as_json, plan_command=plan)
