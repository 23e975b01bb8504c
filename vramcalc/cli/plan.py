"""`vramcalc plan`, `size` and `check`.

Thin edge: parses options, calls vramcalc.planner / vramcalc.size / vramcalc.check, renders
with vramcalc.render, sets exit codes. Bad input raises InputError (one stderr line, exit 2,
via vramcalc.cli.app.main).
"""

from __future__ import annotations

import inspect
import shlex
import time
from pathlib import Path
from typing import Any, Optional

import typer

from vramcalc.check import check_files, read_inputs
from vramcalc.cli.app import (
    ENGINE,
    KW,
    command_line,
    emit_json,
    emit_text,
    fit_engine,
    given_values,
    note,
    option,
    option_words,
    scenario_command,
    split_values,
)
from vramcalc.cli.serve_plan import SERVE_PLAN_PARAMS, plan_serve, pop_serve_options, size_serve
from vramcalc.errors import InputError
from vramcalc.hardware import GPUProfile, load_profiles, resolve_gpu
from vramcalc.options import (
    OPTIONS_BY_NAME,
    SCENARIO_OPTIONS,
)
from vramcalc.planner import (
    PlanResult,
    search,
    stack_note,
    suggest_changes,
    with_every_stage,
)
from vramcalc.planner.prepare import (  # noqa: F401  (prepare_plan: tests import it from here)
    ALLOWABLE,
    DEFAULT_HEADROOM,
    SEARCHED_OPTIONS,
    prepare_plan,
)
from vramcalc.render.console import LazyProgress, make_console, print_plan_hint
from vramcalc.render.markdown import plan_markdown, plan_summary
from vramcalc.render.plan import check_markdown, config_yaml, print_plan, print_size, strategy_flags
from vramcalc.render.report import print_report
from vramcalc.size import size_cluster
from vramcalc.units import parse_count

_BATCH_PARAMS = [
    option("global_batch_size", Optional[int], None, "--global-batch-size",
           help="Sequences per optimizer step (default: the power of two nearest below 4M "
                "tokens)."),
    option("global_batch_tokens", Optional[str], None, "--global-batch-tokens",
           help="Tokens per optimizer step, e.g. 4M or 16777216 (instead of "
                "--global-batch-size)."),
    option("allow", Optional[str], None, "--allow",
           help="Training settings the search may change, comma-separated: "
                + ",".join(ALLOWABLE) + "."),
    option("mfu", Optional[float], None, "--mfu",
           help="Achievable fraction of peak TFLOP/s (default: the GPU profile's "
                "mfu_fraction)."),
]


# Wall-clock seconds `size` spends scanning GPU counts before it stops and says so
SIZE_TIME_BUDGET_S = 60.0


# ---- shared helpers --------------------------------------------------------------------------
def _carried(values: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    """The options given that the strategy does not set (the stack, its releases, the
    adapters, --headroom ...): they go with the best strategy into its `estimate` command
    and its `check` config, which would otherwise describe another run."""
    used = {f[2:].replace("-", "_") for f in strategy_flags(s) if f.startswith("--")}
    skip = used | set(SEARCHED_OPTIONS) | set(ALLOWABLE) | {"model", "gpus", "seq_len"}
    return {k: v for k, v in values.items()
            if k in OPTIONS_BY_NAME and k not in skip and v != OPTIONS_BY_NAME[k].default}


def _command_line(command: str, values: dict[str, Any], extra: dict[str, Any]) -> str:
    """The command that reruns with `values`, leaving out options at plan's defaults."""
    return command_line(command, values, extra, {"headroom": DEFAULT_HEADROOM})


# ---- plan ----------------------------------------------------------------------------------
@scenario_command(
    "Search every layout (dp/tp/pp/cp/ep, ZeRO/FSDP, recompute, micro-batch, offload when "
    "allowed) on the cluster, keep what fits, rank by estimated tokens/s. When nothing fits, "
    "show the closest strategy and the smallest changes that would fit.",
    extra=_BATCH_PARAMS + [option("top", int, 5, "--top", help="How many strategies to list."),
                           option("deepspeed", Optional[Path], None, "--deepspeed",
                                  help="DeepSpeed JSON config: its ZeRO stage, offload, batch "
                                  "sizes, precision and optimizer pin the search (flags "
                                  "given override them); its memory keys (buckets, ZeRO-3 "
                                  "fetching, activation checkpointing) apply to every layout."),
                           option("markdown", bool, False, "--markdown",
                                  help="A markdown summary for a pull-request comment.")]
    + SERVE_PLAN_PARAMS,
    defaults={**{k: None for k in SEARCHED_OPTIONS}, "headroom": DEFAULT_HEADROOM},
    with_context=True,
)
def plan_cmd(ctx: typer.Context, **kwargs: Any) -> None:
    t0 = time.perf_counter()
    ds_path: Path | None = kwargs.pop("deepspeed", None)
    serve_opts = pop_serve_options(kwargs)
    markdown: bool = kwargs.pop("markdown", False)
    values, dirs, as_json = split_values(kwargs)
    if as_json and markdown:
        raise InputError("choose one of --json and --markdown")
    if markdown and serve_opts["serve"]:
        raise InputError("--markdown is for training plans; plan --serve takes --json")
    if serve_opts["serve"]:
        plan_serve(values.get("model"), str(values.get("gpus", "1xH100")), serve_opts, dirs,
                   as_json, kwargs.get("top") or 5)
        return
    ds_cfg, ds_notes, batch = None, [], kwargs.get("global_batch_size")
    if ds_path is not None:  # the DeepSpeed file fills what the command line leaves out
        inp = read_inputs(None, ds_path, given_values(ctx, values), command="plan")
        values = {**values, **inp.values}
        ds_cfg, ds_notes = inp.deepspeed, inp.notes
        if batch is None and kwargs.get("global_batch_tokens") is None:
            batch = inp.train_batch_size
    extras = {"--global-batch-size": batch,
              "--global-batch-tokens": kwargs.get("global_batch_tokens"),
              "--allow": kwargs.get("allow"), "--mfu": kwargs.get("mfu"),
              "--deepspeed": ds_path}
    base, req, notes = prepare_plan(values, batch, kwargs.get("global_batch_tokens"),
                                    kwargs.get("allow"), kwargs.get("top", 5),
                                    kwargs.get("mfu"), dirs, ds_cfg,
                                    "finetune" in given_values(ctx, values))
    notes = ds_notes + notes
    if (limits := stack_note(base.training.framework)) is not None:
        notes = [limits, *notes]
    progress = LazyProgress(enabled=not as_json)
    try:
        result = search(base, req, progress)
        t_search = time.perf_counter() - t0
        suggestions = []
        if not result.entries:
            profiles = list(load_profiles(dirs).values())
            suggestions = suggest_changes(base, req, profiles, progress,
                                          closest=result.closest)
    finally:
        progress.close()
    elapsed = time.perf_counter() - t0
    if as_json:
        cands = result.entries if result.entries else (
            [result.closest] if result.closest is not None else [])
        for text in notes:
            note(text)
        emit_json({"summary": plan_summary(base, result),
                   "candidates": [e.to_json() for e in cands],
                   "suggestions": [s.to_json() for s in suggestions]})
        return
    _with_every_stage(result)

    tr = base.training
    B = result.global_batch_size
    fixed = (f"Training: seq {tr.seq_len}, global batch {B:,} sequences "
             f"({B * tr.seq_len:,} tokens), {tr.precision}, {tr.optimizer}, attention "
             f"{tr.attention}")
    changeable = [a for a in ALLOWABLE if a not in req.allow]
    if req.allow:
        fixed += f"; may change: {', '.join(sorted(req.allow))}"
    if changeable:
        fixed += f" [dim](held fixed; --allow {','.join(changeable)} to search them)[/dim]"
    doc: dict[str, Any] = {"result": result, "base": base, "elapsed_s": t_search,
                           "suggest_s": elapsed - t_search,
                           "fixed_line": fixed, "notes": notes + _speed_notes(result),
                           "suggestions": suggestions}
    model_text, gpus_text = str(values["model"]), str(values.get("gpus", "1xH100"))
    if result.entries:
        s = result.entries[0].report.strategy
        carried = _carried(values, s)
        doc["estimate_cmd"] = " ".join(
            ["vramcalc", "estimate", "--model", shlex.quote(model_text), "--gpus",
             shlex.quote(gpus_text)] + strategy_flags(s)
            + [shlex.quote(p) for k, v in carried.items() for p in option_words(k, v)]
            + ([f"--deepspeed {shlex.quote(str(ds_path))}"] if ds_path is not None else []))
        doc["config_yaml"] = config_yaml(model_text, gpus_text, s, carried)
    doc["apply"] = [_command_line("plan", {**values, **sg.change}, extras)
                    for sg in suggestions]
    if markdown:
        emit_text(plan_markdown(doc))
    else:
        print_plan(make_console(), doc)


def _with_every_stage(result: PlanResult) -> None:
    """The breakdowns shown (the best entry, or the closest) list every pipeline stage."""
    if result.entries:
        best = with_every_stage(result.entries[0])
        assert best is not None
        result.entries[0] = best
    result.closest = with_every_stage(result.closest)


def _speed_notes(result: PlanResult) -> list[str]:
    entries = list(result.entries) or ([result.closest] if result.closest else [])
    out: list[str] = []
    for e in entries[:1]:
        out += list(e.speed.notes)
    return out


# ---- size ----------------------------------------------------------------------------------
@scenario_command(
    "GPUs, days, GPU-hours and cost to train a model on a token budget, per GPU type (with "
    "--serve: to serve it at a concurrency, per month). Every training option of `plan` "
    "applies (--finetune, the stack and its releases ...); --gpu names the types to size.",
    extra=[option("tokens", Optional[str], None, "--tokens",
                  help="Training tokens, e.g. 2T, 15.6e12, 300B (fine-tuning: the dataset's "
                       "tokens times the epochs)."),
           option("gpu", Optional[list[str]], None, "--gpu",
                  help="GPU type to size (repeat: --gpu H100 --gpu A100-80GB --gpu 910B)."),
           option("days", Optional[float], None, "--days",
                  help="Finish within this many days (GPUs sized to it)."),
           option("price", Optional[list[str]], None, "--price",
                  help="USD per GPU-hour, GPU=USD (repeatable); overrides the profile's "
                       "indicative price."),
           *_BATCH_PARAMS,
           option("max_gpus", int, 131072, "--max-gpus", help="Largest GPU count considered."),
           *SERVE_PLAN_PARAMS],
    defaults={**{k: None for k in SEARCHED_OPTIONS}, "headroom": DEFAULT_HEADROOM},
    with_context=True,
    exclude=("gpus",),
)
def size_cmd(ctx: typer.Context, **kwargs: Any) -> None:
    serve_opts = pop_serve_options(kwargs)
    values, dirs, as_json = split_values(kwargs)
    model, gpu = values.get("model"), kwargs.get("gpu")
    if serve_opts["serve"]:
        size_serve(model, gpu, serve_opts, dirs, as_json)
        return
    tokens, days, max_gpus = kwargs.get("tokens"), kwargs.get("days"), kwargs["max_gpus"]
    if not model:
        raise InputError("--model is required (e.g. --model 70b)")
    if not tokens:
        raise InputError("--tokens is required (e.g. --tokens 2T)")
    if not gpu:
        raise InputError("--gpu is required (repeat it to compare: --gpu H100 --gpu A100-80GB)")
    if not 1 <= max_gpus <= 1_000_000:
        raise InputError(f"--max-gpus must be between 1 and 1,000,000, got {max_gpus}")
    n_tokens = parse_count(tokens)
    profiles: list[GPUProfile] = []
    for name in gpu:
        p = resolve_gpu(name, dirs)
        if p.id not in [q.id for q in profiles]:
            profiles.append(p)
    prices: dict[str, float] = {}
    for item in kwargs.get("price") or []:
        name, sep, usd = item.partition("=")
        if not sep:
            raise InputError(f"--price {item!r}: expected GPU=USD, e.g. H100=2.50")
        p = resolve_gpu(name.strip(), dirs)
        try:
            value = float(usd)
        except ValueError:
            raise InputError(f"--price {item!r}: {usd!r} is not a number") from None
        if not value > 0 or value != value or value > 1e6:
            raise InputError(f"--price {item!r}: price must be positive")
        if p.id not in [q.id for q in profiles]:
            raise InputError(f"--price {item!r}: {p.id} is not one of the --gpu types")
        prices[p.id] = value
    values["gpus"] = f"1x{gpu[0]}"
    base, req, notes = prepare_plan(values, kwargs.get("global_batch_size"),
                                    kwargs.get("global_batch_tokens"), kwargs.get("allow"), 1,
                                    kwargs.get("mfu"), dirs, None,
                                    "finetune" in given_values(ctx, values))
    finetuning = req.finetuning
    if (limits := stack_note(base.training.framework)) is not None:
        notes = [limits, *notes]
    progress = LazyProgress(enabled=not as_json)
    try:
        rows = size_cluster(base, profiles, n_tokens, req, days, prices, max_gpus, progress,
                            SIZE_TIME_BUDGET_S, fewest=finetuning)
    finally:
        progress.close()
    if as_json:
        emit_json({"rows": [r.to_json() for r in rows]})
        return
    tr, seq_len = base.training, base.training.seq_len
    method = "" if tr.finetune == "full" else f", {tr.finetune}"
    title = (f"{base.model.name}: {n_tokens:,} tokens, seq {seq_len}, global batch "
             f"{req.batch_for(seq_len):,} sequences, {tr.precision}, {tr.optimizer}{method}"
             + (f", finish within {days:g} days" if days is not None else
                ": from the smallest cluster that fits to where MFU falls below half its "
                "best" + ("; ◀ the fewest GPUs within 10 % of the least GPU-hours"
                          if finetuning else "")))
    print_size(make_console(), rows, title, notes + ([
        "prices are indicative per-GPU-hour rates from the GPU profiles; '?' = unknown "
        "(give --price GPU=USD)"] if any(r.price_usd_per_hour is None for r in rows) else []))


# ---- check ---------------------------------------------------------------------------------
@scenario_command(
    "CI guard: estimate a training config file (YAML keys = option names, or a torchtune "
    "recipe, LitGPT finetune, LLaMA-Factory or TRL SFT config) and/or a DeepSpeed JSON; exit "
    "0 when it fits, 1 when it does not, 2 on bad input.",
    extra=[
        inspect.Parameter("config", KW, annotation=Optional[Path],
                          default=typer.Argument(None, help="Training config YAML: "
                                                 "vramcalc's keys, a torchtune recipe's, "
                                                 "LitGPT's, LLaMA-Factory's or TRL's "
                                                 "(docs/ci.md).")),
        option("deepspeed", Optional[Path], None, "--deepspeed",
               help="DeepSpeed JSON config (ZeRO stage, offload, batch sizes, bf16/fp16, "
               "and the keys that change memory: buckets, ZeRO-3 prefetch/live parameters, "
               "activation checkpointing)."),
        option("markdown", bool, False, "--markdown",
               help="A markdown summary for a pull-request comment."),
        ENGINE,
    ],
    defaults={o.name: None for o in SCENARIO_OPTIONS},
)
def check_cmd(**kwargs: Any) -> None:
    engine_name: str = kwargs.pop("engine", "analytic")
    values, dirs, as_json = split_values(kwargs)
    config: Path | None = kwargs.pop("config", None)
    ds_path: Path | None = kwargs.pop("deepspeed", None)
    markdown: bool = kwargs.pop("markdown", False)
    if as_json and markdown:
        raise InputError("choose one of --json and --markdown")
    result, source = check_files(config, ds_path, values, dirs,
                                 lambda scn: fit_engine(engine_name, scn))
    plan = None if result.fits or as_json or result.values.get("load_only") else _command_line(
        "plan", result.values, {"--deepspeed": ds_path,
                                "--profiles-dir": dirs[0] if dirs else None})
    if as_json:
        emit_json({"config": source, **result.to_json()})
    elif markdown:
        emit_text(check_markdown(result.report, result.usable_bytes, result.headroom_fraction,
                                 source, result.notes, plan_command=plan))
    else:
        console = make_console()
        print_report(console, result.report)
        for text in result.notes:
            console.print(f"[dim]note: {text}[/dim]")
        if plan:
            print_plan_hint(console, plan)
    if not result.fits:
        raise typer.Exit(1)
