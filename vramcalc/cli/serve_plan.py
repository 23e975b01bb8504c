"""`plan --serve` and `size --serve`: the serving layouts that hold a target concurrency at a
context length, fewest GPUs first, and what they cost per month."""

from __future__ import annotations

import inspect
import shlex
from pathlib import Path
from typing import Any, Optional

import typer

from vramcalc.catalog import resolve_model
from vramcalc.cli.app import emit_json, note
from vramcalc.cli.serve import ENGINE_OPTIONS, engine_flags, serve_config
from vramcalc.errors import InputError
from vramcalc.hardware import GPUProfile, parse_gpus, resolve_gpu
from vramcalc.model import ModelSpec
from vramcalc.render.console import make_console, print_command
from vramcalc.render.serve import print_serve_options
from vramcalc.serve import ServeConfig
from vramcalc.serve.plan import (
    HOURS_PER_MONTH,
    ServeFix,
    ServeOption,
    cheapest_per_gpu,
    fixes_within,
    serve_options,
)

KW = inspect.Parameter.KEYWORD_ONLY


def _opt(name: str, annotation: Any, default: Any, flag: str, text: str) -> inspect.Parameter:
    return inspect.Parameter(name, KW, annotation=annotation,
                             default=typer.Option(default, flag, help=text))


# the options `plan` and `size` take for --serve (one list, shared)
SERVE_PLAN_PARAMS = [
    _opt("serve", bool, False, "--serve", "Serving instead of training: the layouts (TP × "
         "copies, GPU type) that hold --concurrency sequences of --max-model-len tokens."),
    _opt("concurrency", Optional[int], None, "--concurrency", "--serve: concurrent "
         "sequences to hold (default 1)."),
    _opt("max_model_len", Optional[int], None, "--max-model-len", "--serve: context length "
         "per sequence (default: the model's max_position_embeddings)."),
    _opt("engine", str, "vllm", "--engine", "--serve: vllm | vllm-v0 | sglang | hf."),
    _opt("quantization", str, "none", "--quantization", "--serve: none | fp8 | int8 | awq | "
         "gptq | bnb-nf4."),
    _opt("kv_cache_dtype", str, "auto", "--kv-cache-dtype", "--serve: auto | fp8 | fp16."),
    _opt("enable_lora", bool, False, "--enable-lora", "--serve: vLLM's LoRA adapter slots "
         "(serve --help)."),
    _opt("max_loras", Optional[int], None, "--max-loras", "--serve --enable-lora: adapters "
         "in one batch (default 1)."),
    _opt("max_lora_rank", Optional[int], None, "--max-lora-rank", "--serve --enable-lora: "
         "the slots' rank (default 16)."),
]
SERVE_PLAN_NAMES = tuple(p.name for p in SERVE_PLAN_PARAMS)
_SERVE_DEFAULTS = {p.name: p.default.default for p in SERVE_PLAN_PARAMS}


def pop_serve_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The --serve options out of a plan or size call; one given without --serve is bad
    input, not silently a training plan."""
    opts = {name: kwargs.pop(name) for name in SERVE_PLAN_NAMES if name in kwargs}
    if not opts.get("serve"):
        for name, value in opts.items():
            if value != _SERVE_DEFAULTS[name]:
                raise InputError(f"--{name.replace('_', '-')} is a serving option: add "
                                 "--serve")
    return opts


def _base(opts: dict[str, Any]) -> tuple[ServeConfig, int]:
    base = serve_config({k: opts[k] for k, _ in ENGINE_OPTIONS})
    return base, opts["concurrency"] if opts["concurrency"] is not None else 1


def _options(spec: ModelSpec, gpus: list[GPUProfile], opts: dict[str, Any]
             ) -> tuple[list[ServeOption], str]:
    base, concurrency = _base(opts)
    found = serve_options(spec, gpus, base, concurrency)
    max_len = base.max_model_len or spec.max_position_embeddings
    title = (f"{spec.name} served by {base.engine}: {concurrency} concurrent sequence"
             f"{'s' if concurrency > 1 else ''} of {max_len:,} tokens, quantization "
             f"{base.quantization}, kv-cache-dtype {base.kv_cache_dtype}")
    return found, title


def serve_command(model: str, base: ServeConfig, fix: ServeFix) -> str:
    """The `vramcalc serve` line of a fix: its layout on its GPUs, the changed flags."""
    o = fix.option
    cfg = base.model_copy(update=fix.change)
    return " ".join(["vramcalc serve --model", shlex.quote(model),
                     f"--gpus {o.num_gpus}x{o.gpu.id}", f"--tp {o.tp}"]
                    + ([f"--pp {o.pp}"] if o.pp > 1 else []) + engine_flags(cfg.model_dump()))


def plan_serve(model: str | None, gpus: str, opts: dict[str, Any], dirs: list[Path] | None,
               as_json: bool, top: int) -> None:
    """`plan --serve`: every layout on the --gpus type, fewest GPUs first."""
    if not model:
        raise InputError("--model is required (e.g. --model 70b)")
    cluster = parse_gpus(gpus, dirs)
    spec, model_note = resolve_model(model)
    found, title = _options(spec, [cluster.gpu], opts)
    within = [o for o in found if o.num_gpus <= cluster.num_gpus]
    base, concurrency = _base(opts)
    fixes = [] if within else fixes_within(spec, cluster.gpu, base, concurrency,
                                           cluster.num_gpus)
    if as_json:
        emit_json({"options": [o.to_json() for o in found[:top]],
                   "within_gpus": cluster.num_gpus, "num_within": len(within),
                   "fixes_within": [{**f.to_json(), "command": serve_command(model, base, f)}
                                    for f in fixes]})
        return
    gpus_text = f"{cluster.num_gpus} GPU{'s' if cluster.num_gpus > 1 else ''}"
    notes = ([model_note] if model_note else []) + [
        f"{len(within)} of these layouts use at most the {gpus_text} of --gpus"]
    console = make_console()
    print_serve_options(console, found[:top], title, False, notes)
    if fixes:
        console.print(f"On {gpus_text} these changes fit:")
        for f in fixes:
            print_command(console, "  ", serve_command(model, base, f))
    elif not within:
        console.print(f"On {gpus_text} no lighter weights, fp8 KV cache or shorter context "
                      "fits: more GPUs are needed")


def size_serve(model: str | None, gpu: list[str] | None, opts: dict[str, Any],
               dirs: list[Path] | None, as_json: bool) -> None:
    """`size --serve`: per --gpu type, the fewest GPUs that hold the concurrency, and the
    cost per hour and per month (730 h) at the profile's indicative price."""
    if not model:
        raise InputError("--model is required (e.g. --model 70b)")
    if not gpu:
        raise InputError("--gpu is required (repeat it to compare: --gpu H100 --gpu L40S)")
    profiles: list[GPUProfile] = []
    for name in gpu:
        p = resolve_gpu(name, dirs)
        if p.id not in [q.id for q in profiles]:
            profiles.append(p)
    spec, model_note = resolve_model(model)
    found, title = _options(spec, profiles, opts)
    notes = [model_note] if model_note else []
    best = cheapest_per_gpu(found)
    if as_json:
        emit_json({"rows": [o.to_json() for o in best], "hours_per_month": HOURS_PER_MONTH})
        return
    for p in profiles:
        if p.id not in [o.gpu.id for o in best]:
            note(f"{p.name}: no layout serves this on one node group")
    notes.append(f"cost = GPUs × the profile's indicative $/GPU-hour; a month is "
                 f"{HOURS_PER_MONTH} hours")
    print_serve_options(make_console(), best, title, True, notes)
