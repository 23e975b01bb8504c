"""Read a serving engine's command line (`vllm serve M …`, `python -m sglang.launch_server
--model-path M …`) into `vramcalc serve` option values, for `probe --run --compare serve`.

Recognised flags (vLLM `EngineArgs.add_cli_args`, SGLang `ServerArgs.add_cli_args` names):
tensor/pipeline parallel size, max model length (SGLang `--context-length`), max sequences
(`--max-running-requests`), batched tokens (`--chunked-prefill-size`), KV-cache dtype,
quantization, GPU memory share (`--mem-fraction-static`), eager mode, vLLM's LoRA slots
(`--enable-lora`, `--max-loras`, `--max-lora-rank`). Others are ignored.
"""

from __future__ import annotations

from typing import Any

from vramcalc.errors import InputError

_INT = {
    "--tensor-parallel-size": "tp", "-tp": "tp", "--tp-size": "tp", "--tp": "tp",
    "--pipeline-parallel-size": "pp", "-pp": "pp", "--pp-size": "pp",
    "--max-model-len": "max_model_len", "--context-length": "max_model_len",
    "--max-num-seqs": "max_num_seqs", "--max-running-requests": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--chunked-prefill-size": "max_num_batched_tokens",
    "--max-loras": "max_loras", "--max-lora-rank": "max_lora_rank",
}
_FLOAT = {"--gpu-memory-utilization": "gpu_memory_utilization",
          "--mem-fraction-static": "gpu_memory_utilization"}
_QUANT = {"fp8": "fp8", "awq": "awq", "awq_marlin": "awq", "gptq": "gptq",
          "gptq_marlin": "gptq", "bitsandbytes": "bnb-nf4", "w8a8_int8": "int8"}


def _kv_dtype(value: str) -> str:
    if value.startswith("fp8"):
        return "fp8"
    if value in ("auto", "fp16", "float16", "half", "bfloat16", "bf16"):
        return "auto" if value in ("auto", "bfloat16", "bf16") else "fp16"
    raise InputError(f"serving command: --kv-cache-dtype {value!r} is not modelled")


def parse_serve_command(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """(model, `vramcalc serve` option values) from an engine's command line."""
    words = list(argv)
    if len(words) >= 2 and words[0].endswith("vllm") and words[1] == "serve":
        engine, rest = "vllm", words[2:]
        model = rest.pop(0) if rest and not rest[0].startswith("-") else None
    elif "sglang.launch_server" in words:
        engine, rest, model = "sglang", words[words.index("sglang.launch_server") + 1:], None
    else:
        raise InputError("--compare serve needs `vllm serve MODEL ...` or `python -m "
                         "sglang.launch_server --model-path MODEL ...` after --")
    values: dict[str, Any] = {"engine": engine}
    i = 0
    while i < len(rest):
        word, value = rest[i], None
        if "=" in word and word.startswith("--"):
            word, value = word.split("=", 1)
        elif i + 1 < len(rest) and not rest[i + 1].startswith("-"):
            value = rest[i + 1]
            i += 1
        i += 1
        try:
            if word in ("--model", "--model-path"):
                model = value
            elif word in _INT and value is not None:
                values[_INT[word]] = int(value)
            elif word in _FLOAT and value is not None:
                values[_FLOAT[word]] = float(value)
            elif word == "--kv-cache-dtype" and value is not None:
                values["kv_cache_dtype"] = _kv_dtype(value)
            elif word == "--quantization" and value is not None:
                if value not in _QUANT:
                    raise InputError(f"serving command: --quantization {value!r} is not "
                                     "modelled")
                values["quantization"] = _QUANT[value]
            elif word in ("--enforce-eager", "--disable-cuda-graph"):
                values["enforce_eager"] = True
                if value is not None:
                    i -= 1  # a flag without a value: the next word is not its value
            elif word in ("--enable-expert-parallel", "--enable-lora"):
                values["expert_parallel" if "expert" in word else "enable_lora"] = True
                if value is not None:
                    i -= 1
        except ValueError:
            raise InputError(f"serving command: {word} {value!r} is not a number") from None
    if not model:
        raise InputError("serving command: no model given")
    return model, values
