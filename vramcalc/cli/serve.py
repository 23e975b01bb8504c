"""`vramcalc serve` (and its alias `infer`): serving memory, KV capacity and concurrency."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Optional

import typer
from pydantic import ValidationError

from vramcalc.catalog import resolve_model
from vramcalc.cli.app import emit_json, emit_text, note
from vramcalc.errors import InputError
from vramcalc.hardware import parse_gpus
from vramcalc.render.console import make_console, print_command
from vramcalc.render.serve import print_serve, serve_markdown
from vramcalc.serve import ServeConfig, ServeReport, serve_estimate
from vramcalc.serve.weights import QUANTIZATIONS

EXIT_DOES_NOT_FIT = 1


def serve_config(values: dict[str, Any]) -> ServeConfig:
    """ServeConfig from option values; a bad value is one InputError naming its flag."""
    values = {k: v for k, v in values.items() if v is not None}
    try:
        return ServeConfig(**values)
    except ValidationError as err:
        first = err.errors()[0]
        loc = first.get("loc") or ()
        cause = (first.get("ctx") or {}).get("error")
        if not loc:
            raise InputError(str(cause) if cause else first["msg"]) from None
        name = str(loc[0])
        raise InputError(f"--{name.replace('_', '-')}: {first['msg']} "
                         f"(got {values.get(name)!r})") from None


def run_serve(model: str, gpus: str, values: dict[str, Any], profiles_dir: Path | None
              ) -> ServeReport:
    """Resolve model and GPUs and estimate; notes for aliases go to stderr."""
    spec, model_note = resolve_model(model)
    cluster = parse_gpus(gpus, [profiles_dir] if profiles_dir else None)
    report = serve_estimate(spec, cluster, serve_config(values))
    if model_note:
        note(model_note)
    return report


# the serving options `plan --serve` and `size --serve` share with `serve`, and defaults
ENGINE_OPTIONS = (("engine", "vllm"), ("quantization", "none"), ("kv_cache_dtype", "auto"),
                  ("max_model_len", None), ("enable_lora", False), ("max_loras", None),
                  ("max_lora_rank", None))


def engine_flags(values: dict[str, Any]) -> list[str]:
    """Those of `values`' ENGINE_OPTIONS that differ from their defaults, as flags."""
    words = []
    for name, default in ENGINE_OPTIONS:
        value = values.get(name, default)
        if value is True:
            words.append(f"--{name.replace('_', '-')}")
        elif value not in (default, None, False):
            words.append(f"--{name.replace('_', '-')} {value}")
    return words


def plan_serve_command(model: str, gpus: str, values: dict[str, Any]) -> str:
    """`vramcalc plan --serve` of a serve run's model, GPUs and engine flags: the layouts
    that fit, and on these GPUs the changes that do."""
    return " ".join(["vramcalc plan --serve --model", shlex.quote(model), "--gpus",
                     shlex.quote(gpus), *engine_flags(values)])


def show_serve(report: ServeReport, as_json: bool, markdown: bool,
               plan_command: str | None = None) -> None:
    """The report as JSON (the one place the serve document is built), markdown or table;
    exit code 1 when it does not fit, after `plan_command` (the layouts that do)."""
    if as_json:
        emit_json(report.to_json_dict())
    elif markdown:
        emit_text(serve_markdown(report))
    else:
        console = make_console()
        print_serve(console, report)
        if not report.fits and plan_command:
            print_command(console, "try: ", plan_command)
            console.print("  (it lists the layouts that fit, and on these GPUs the shorter "
                          "context, fp8 KV cache or lighter weights that do)")
    if not report.fits:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


def serve_cmd(
    model: Optional[str] = typer.Option(None, "--model", help="Preset name or alias, or a "
                                        "path to a Hugging Face config.json / its directory."),
    gpus: str = typer.Option("1xH100", "--gpus", help="GPUs: H100, 8xH100, 2x8xA100-80GB."),
    engine: str = typer.Option("vllm", "--engine", help="vllm (the V1 engine) | vllm-v0 "
                               "(the V0 engine of v0.6.4) | sglang | hf (transformers "
                               "generate)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size per model copy."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel size per model copy."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Context "
                                                "length per sequence (default: the model's "
                                                "max_position_embeddings)."),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", help="Sequences per "
                                               "batch (vLLM default 1024 on GPUs of 70 GiB "
                                               "or more except A100, else 256; vllm-v0 256; "
                                               "SGLang: CUDA-graph batch 160; hf: the "
                                               "generate batch, 1)."),
    max_num_batched_tokens: Optional[int] = typer.Option(
        None, "--max-num-batched-tokens", help="Tokens per forward (profiling run, chunked "
        "prefill; vLLM default 8192 on GPUs of 70 GiB or more except A100, else 2048; "
        "vllm-v0: max(max-model-len, 2048), 512 above 32,768 (chunked prefill); SGLang "
        "8192, 2048 under 25,000 MB; hf: the prompt length, default max-model-len)."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="auto (the model's "
                                       "bf16) | fp8 | fp16."),
    quantization: str = typer.Option("none", "--quantization",
                                     help=" | ".join(QUANTIZATIONS) + " (weights layout)."),
    gpu_memory_utilization: Optional[float] = typer.Option(
        None, "--gpu-memory-utilization", help="vLLM: share of the GPU for weights, "
        "activations and KV cache (default 0.9; vllm-v0: also the CUDA context); SGLang: "
        "mem_fraction_static (default by TP: 0.88, 0.87, 0.85, 0.81, 0.79)."),
    expert_parallel: bool = typer.Option(False, "--expert-parallel", help="MoE: whole "
                                         "experts spread over the TP ranks (EP = TP)."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="No CUDA graphs."),
    hf_cache: str = typer.Option("static", "--hf-cache", help="hf: static | dynamic cache."),
    enable_lora: bool = typer.Option(False, "--enable-lora", help="vLLM: LoRA adapter slots "
                                     "in every linear (and, for Llama-family models, the "
                                     "embedding and head), counted with the weights."),
    max_loras: Optional[int] = typer.Option(None, "--max-loras", help="--enable-lora: "
                                            "adapters in one batch (vLLM default 1)."),
    max_lora_rank: Optional[int] = typer.Option(None, "--max-lora-rank", help="--enable-lora:"
                                                " the slots' rank (vLLM default 16; 1, 8, 16, "
                                                "32, 64, 128, 256, 320 or 512)."),
    profiles_dir: Optional[Path] = typer.Option(None, "--profiles-dir", help="Extra folder "
                                                "of GPU profile YAML files."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    markdown: bool = typer.Option(False, "--markdown", help="A markdown report."),
) -> None:
    """Serving memory: weights, activation peak, KV capacity and concurrency (exit 1: does
    not fit)."""
    if not model:
        raise InputError("--model is required (e.g. --model llama3-8b)")
    if as_json and markdown:
        raise InputError("choose one of --json and --markdown")
    values = {"engine": engine, "tp": tp, "pp": pp, "max_model_len": max_model_len,
              "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
              "kv_cache_dtype": kv_cache_dtype, "quantization": quantization,
              "gpu_memory_utilization": gpu_memory_utilization,
              "expert_parallel": expert_parallel, "enforce_eager": enforce_eager,
              "hf_cache": hf_cache, "enable_lora": enable_lora, "max_loras": max_loras,
              "max_lora_rank": max_lora_rank}
    show_serve(run_serve(model, gpus, values, profiles_dir), as_json, markdown,
               plan_serve_command(model, gpus, values))
