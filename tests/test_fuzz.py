"""Fuzz every command with hostile command lines and hostile files (issue 16).

The invariant, for every draw: exit 0 or 1 with sane output (JSON that parses strictly,
byte counts non-negative integers, MFU in [0, 1]), or exit 2 with exactly one `error:`
line; never a traceback, never the last-resort "internal error" (a boundary that missed a
case), never a hang (an alarm stops a draw after HANG_S seconds: a hang guard, not a timing
assertion).

Draws: argv values (over-long integers, NaN/inf, negative and zero counts, control
characters, long names, `~nosuchuser`, special files) and files (JSON and YAML with
duplicate keys, deep nesting, huge integers, non-finite numbers, wrong types, binary junk;
FIFOs, /dev/zero, folders, symlink loops, missing paths) for estimate, explain, plan, size,
check, gpus, models, validate --records, probe --run and trace (and its --peft-config
file); serve when it exists.
CI draws FUZZ_EXAMPLES cases in all (derandomized, tests/conftest.py);
`FUZZ_EXAMPLES=20000 HYPOTHESIS_PROFILE=explore pytest tests/test_fuzz.py` is the longer
run on demand.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramcalc import safeio
from vramcalc.cli import COMMANDS, main

HANG_S = 10
FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "1000"))
# split of the draws between the two tests
ARGV_EXAMPLES = FUZZ_EXAMPLES * 3 // 5
FILE_EXAMPLES = FUZZ_EXAMPLES - ARGV_EXAMPLES
SETTINGS = {"deadline": None, "suppress_health_check": list(HealthCheck)}

HUGE = "9" * 5000
NUMBERS = ["0", "-1", "1", "2", "8", "3", HUGE, "9" * 30, "1e3", "1.5", "nan", "inf", "-inf",
           "1e-300", "1e308", "", " ", "0x10", "1_000", "+2"]
TEXTS = ["", " ", "a" * 300, "a" * 5000, "8b\nfoo", "\x1b[31mred", "~nosuchuser/x", "/dev/zero",
         "/", "..", "%s%n", "{}", "[]", "null", "\u202e", "x" * 255 + "/config.json"]
MODELS = ["gpt2", "8b", "70b", "mixtral-8x7b", "llama2-7b"]
GPUS = ["H100", "8xH100", "2x8xA100-80GB", "4090", "0xH100", f"{HUGE}xH100", "8x", "x",
        "8xNOPE", "1x1x1xH100", "-8xH100", "8*H100"]
PINS = ["--tp", "--pp", "--dp", "--cp", "--ep", "--zero", "--micro-batch-size",
        "--grad-accum", "--virtual-stages", "--num-microbatches", "--shard-group"]
CHOICES = {"--fsdp": ["full", "hybrid", "grad-op", "bogus"],
           "--precision": ["amp-bf16", "fp8", "fp32", "fp64", "bf16-autocast"],
           "--framework": ["megatron", "torchtitan", "hf", "torchtune", "lightning", "unsloth",
                           "deepspeed", "nope"],
           "--fsdp-impl": ["fsdp1", "fsdp2", "x"], "--optimizer-impl": ["foreach", "fused", "x"],
           "--load": ["hf-fp32", "torchtune", "x"], "--qlora-impl": ["torchao", "bnb", "x"],
           "--qat": ["int4", "int8"], "--recompute": ["full", "selective", "x"],
           "--offload": ["optimizer", "params,optimizer", "gpu"],
           "--pp-schedule": ["interleaved", "gpipe"], "--finetune": ["lora", "qlora"],
           "--stage-layers": ["16,16", "15,16,16,16,16,16,16,15", "0,1", "a,b", ",", "9" * 30,
                              ",".join(["1"] * 200_000)]}
# stack releases: every one of them must parse or refuse with one line
VERSIONS = ["0.1.0", "0.2", "0.3.1", "2.4", "4.39.0", "9999.1", "x", "", "0.1.0.dev0", "1e3",
            "-1", "1..2", "v0.1", "9" * 30, HUGE]
for _flag in ("--torchtune-version", "--transformers-version", "--torch-version",
              "--bnb-version", "--torchao-version", "--unsloth-version"):
    CHOICES[_flag] = VERSIONS
FLOATS = ["--headroom", "--capacity-factor", "--lora-dropout", "--dropout"]


# ---- the invariant --------------------------------------------------------------------
class Hang(BaseException):  # not an Exception: main's last-resort handler must not catch it
    pass


def _alarm(*_: Any) -> None:
    raise Hang


def _strict(text: str) -> Any:
    def refuse(token: str) -> Any:
        raise AssertionError(f"invalid JSON constant {token}")
    return json.loads(text, parse_constant=refuse)


SIGNED = {"free_bytes"}  # usable minus device total: negative when it does not fit


def _sane(doc: Any) -> None:
    """Byte counts are non-negative ints; MFU in [0, 1]; walked without recursion."""
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if (str(key).endswith("_bytes") and key not in SIGNED and value is not None
                        and not isinstance(value, (dict, list))):
                    assert isinstance(value, int) and value >= 0, (key, value)
                if key == "mfu" and isinstance(value, (int, float)):
                    assert 0 <= value <= 1, value
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def check_invariant(args: list[str]) -> None:
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    except Hang:
        raise AssertionError(f"no answer within {HANG_S} s: {args!r}"[:2000]) from None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    text = err.getvalue()
    shown = repr(args)[:1500]
    assert "Traceback" not in text and "internal error" not in text, (shown, text[-3000:])
    assert code in (0, 1, 2), (shown, code, text[-1000:])
    if code == 2:
        lines = text.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (shown, lines[:4])
        assert len(lines[0]) < 2000, shown
        return
    if "--json" in args and "--run" not in args and out.getvalue().strip():
        _sane(_strict(out.getvalue()))


# ---- command lines --------------------------------------------------------------------
@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    number = st.sampled_from(NUMBERS)
    cmd = draw(st.sampled_from(["estimate", "explain", "plan", "plan", "size", "check",
                                "gpus", "models", "probe", "validate", "serve", "max"]))
    if cmd in ("gpus", "models"):
        args = [cmd] + draw(st.lists(st.sampled_from(
            ["--json", "--profiles-dir", "/dev/zero", "~nosuchuser", "-x", HUGE]), max_size=3))
        return args
    if cmd == "validate":
        return [cmd, "--records", draw(st.sampled_from(TEXTS + ["/tmp"]))]
    if cmd == "probe":
        return [cmd, "--run", "--", draw(st.sampled_from(
            ["/dev/zero", "/", "/etc/hostname", "/nonexistent/x", "", "a" * 300]))]
    if cmd == "size":
        args = [cmd, "--model", draw(st.sampled_from(MODELS[:3] + TEXTS[:4])),
                "--tokens", draw(st.sampled_from(["1B", "2T", "0", "nan", "1e30", HUGE, "x"])),
                "--gpu", draw(st.sampled_from(["H100", "4090", "A100", "nope", "a" * 300])),
                "--max-gpus", draw(st.sampled_from(["8", "64", "0", HUGE]))]
        for flag in draw(st.lists(st.sampled_from(
                ["--mfu", "--days", "--headroom", "--seq-len", "--price",
                 "--global-batch-size"]), max_size=3, unique=True)):
            value = draw(number)
            args += [flag, f"H100={value}" if flag == "--price" else value]
        for flag in draw(st.lists(st.sampled_from(sorted(CHOICES)), max_size=2, unique=True)):
            args += [flag, draw(st.sampled_from(CHOICES[flag]))]  # every training option
        return args + (["--json"] if draw(st.booleans()) else [])
    if cmd == "check":
        args = [cmd, draw(st.sampled_from(TEXTS + ["examples/train.yaml"]))]
    else:
        args = [cmd, "--model", draw(st.sampled_from(MODELS + TEXTS)),
                "--gpus", draw(st.sampled_from(GPUS if cmd != "plan" else GPUS[:3]))]
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            args += [draw(st.sampled_from(PINS)), draw(number)]
        elif kind == 1:
            flag = draw(st.sampled_from(sorted(CHOICES)))
            args += [flag, draw(st.sampled_from(CHOICES[flag]))]
        elif kind == 2:
            args += [draw(st.sampled_from(FLOATS)), draw(number)]
        elif cmd == "serve":
            args += [draw(st.sampled_from(SERVE_FLAGS)), draw(st.sampled_from(
                NUMBERS + ["fp8", "auto", "awq", "gptq", "bnb-nf4", "vllm", "vllm-v0", "sglang",
                          "hf"]))] + (["--enable-lora"] if draw(st.booleans()) else [])
        elif cmd == "max":
            args += [draw(st.sampled_from(["--maximize", "--step"])), draw(st.sampled_from(
                NUMBERS + ["seq-len", "micro-batch", "batch"]))]
        else:
            args += ["--seq-len", draw(st.sampled_from(["16", "4096", "0", "-5", HUGE]))]
    return args + (["--json"] if draw(st.booleans()) else [])


SERVE_FLAGS = ["--tp", "--pp", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
               "--kv-cache-dtype", "--quantization", "--engine", "--gpu-memory-utilization",
               "--max-loras", "--max-lora-rank"]


@settings(max_examples=ARGV_EXAMPLES, **SETTINGS)
@given(command_lines())
def test_fuzz_command_lines(args: list[str]) -> None:
    check_invariant(args)


# ---- files ----------------------------------------------------------------------------
DEEP_JSON = "[" * 50_000 + "]" * 50_000
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}
JSON_VALUES = [0, -1, 1, 2.5, 10**40, 1e308, None, True, "auto", "x" * 400, [], {}, [1] * 3]
RAW_JSON = [HUGE, "NaN", "Infinity", "-Infinity", "1e400", DEEP_JSON, '"\\u0000"', "1.0"]


def _json_doc(draw: st.DrawFn, base: dict[str, Any]) -> str:
    """A JSON object built on `base` with values replaced, then maybe a raw token spliced
    in, a duplicate key added or the text cut."""
    doc = dict(base)
    for key in draw(st.lists(st.sampled_from(sorted(base) + ["extra"]), max_size=3)):
        doc[key] = draw(st.sampled_from(JSON_VALUES))
    text = json.dumps(doc)
    trick = draw(st.integers(0, 4))
    if trick == 0:
        key = draw(st.sampled_from(sorted(base)))
        text = text[:-1] + f', "{key}": {draw(st.sampled_from(RAW_JSON))}}}'
    elif trick == 1:
        key = draw(st.sampled_from(sorted(base)))
        text = text[:-1] + f', "{key}": {json.dumps(base[key])}}}'  # a duplicate key
    elif trick == 2:
        text = text[: draw(st.integers(0, len(text)))]  # cut short
    return text


YAML_VALUES = ["8b", "70b", "8xH100", "0", "-1", HUGE, ".inf", ".nan", "-.inf", "1e400",
               "[1, 2]", "{a: 1}", "null", "~", "yes", "!!python/object:os.system x",
               "&a [1]", "*a", "'\x1b[2J'", "x" * 400, "0.1", "'0.1.0'", "torchtune", "hf",
               "lora", "qlora", "fsdp1", "full", "q,v", "true"]
YAML_KEYS = ["model", "gpus", "seq_len", "micro_batch_size", "zero", "tp", "precision",
             "deepspeed", "headroom", "offload", "modle", "model", "framework", "finetune",
             "fsdp", "fsdp_impl", "torchtune_version", "transformers_version", "lora_targets",
             "load", "packed", "compile", "chunked_ce", "peft_config"]
PROFILE_KEYS = ["memory_total_bytes", "mfu_fraction", "dense_tflops", "gpus_per_node",
                "context_overhead_bytes", "memory_bandwidth_bytes_per_s", "id", "aliases",
                "price_usd_per_hour", "marketed_gb"]


def _yaml_doc(draw: st.DrawFn, keys: list[str], head: str) -> str:
    lines = [head] + [f"{draw(st.sampled_from(keys))}: {draw(st.sampled_from(YAML_VALUES))}"
                      for _ in range(draw(st.integers(0, 4)))]
    if draw(st.integers(0, 5)) == 0:
        lines.append("x: " + "[" * 300 + "]" * 300)
    return "\n".join(lines) + "\n"


SPECIAL = ["fifo", "dev_zero", "dir", "loop", "missing", "long_name", "no_user", "binary"]


@st.composite
def hostile_files(draw: st.DrawFn) -> tuple[str, str, str]:
    """(command, what the file is, its text or the name of a special file)."""
    cmd = draw(st.sampled_from(["estimate", "explain", "plan", "size", "check", "check",
                                "deepspeed", "profile", "validate", "trace", "peft",
                                "recipe"]))
    if draw(st.integers(0, 5)) == 0:
        return cmd, "special", draw(st.sampled_from(SPECIAL))
    if cmd in ("estimate", "explain", "plan", "size", "trace"):
        return cmd, "config.json", _json_doc(draw, LLAMA)
    if cmd == "deepspeed":
        base = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
        return cmd, "ds.json", _json_doc(draw, base)
    if cmd == "peft":  # a PEFT adapter config for `trace --peft-config`
        base = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
                "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
        return cmd, "adapter_config.json", _json_doc(draw, base)
    if cmd == "validate":
        base = {"schema": "vramcalc.probe/1", "kind": "builtin", "status": "ok",
                "scenario": {"model": "gpt2", "seq_len": 64}, "device": {"name": "x"},
                "measured": {"max_memory_allocated_bytes": 10**9}}
        return cmd, "record.json", _json_doc(draw, base)
    if cmd == "profile":
        head = Path(__file__).resolve().parents[1].joinpath(
            "hardware_profiles", "h100_sxm.yaml").read_text()
        return cmd, "h100_sxm.yaml", _yaml_doc(draw, PROFILE_KEYS, head)
    if cmd == "recipe":  # a torchtune, LitGPT, LLaMA-Factory or TRL config for `check`
        kind = draw(st.integers(0, 3))
        if kind == 1:
            return cmd, "recipe.yaml", _yaml_doc(draw, LITGPT_KEYS, LITGPT_HEAD)
        if kind == 2:
            return cmd, "recipe.yaml", _yaml_doc(draw, LF_KEYS, LF_HEAD)
        if kind == 3:
            return cmd, "recipe.yaml", _yaml_doc(draw, TRL_KEYS, TRL_HEAD)
        return cmd, "recipe.yaml", _yaml_doc(draw, RECIPE_KEYS, RECIPE_HEAD)
    return cmd, "train.yaml", _yaml_doc(draw, YAML_KEYS, "model: gpt2\ngpus: 1xH100")


RECIPE_HEAD = ("model:\n  _component_: torchtune.models.llama3_2.lora_llama3_2_1b\n"
               "  lora_attn_modules: [q_proj, v_proj]\ntokenizer:\n  max_seq_len: 64")
LF_HEAD = "model_name_or_path: meta-llama/Llama-3.2-1B\nstage: sft\nbf16: true\ncutoff_len: 64"
LF_KEYS = ["finetuning_type", "lora_rank", "lora_target", "quantization_bit", "pure_bf16",
           "fp16", "per_device_train_batch_size", "gradient_accumulation_steps", "flash_attn",
           "optim", "deepspeed", "disable_gradient_checkpointing", "use_reentrant_gc",
           "double_quantization", "stage", "neat_packing", "additional_target"]
TRL_HEAD = "model_name_or_path: meta-llama/Llama-3.2-1B\nmax_length: 64\nuse_peft: true"
TRL_KEYS = ["dtype", "bf16", "fp16", "use_peft", "use_dora", "lora_r", "lora_dropout",
            "lora_target_modules", "max_length", "per_device_train_batch_size",
            "gradient_checkpointing", "gradient_checkpointing_kwargs", "attn_implementation",
            "optim", "use_liger_kernel", "loss_type", "deepspeed", "num_processes",
            "load_in_4bit", "use_bnb_nested_quant", "bnb_4bit_quant_type", "torch_dtype",
            "packing", "packing_strategy", "padding_free"]
LITGPT_HEAD = ("checkpoint_dir: checkpoints/meta-llama/Llama-3.2-1B\nprecision: bf16-true\n"
               "lora_r: 8\ntrain:\n  micro_batch_size: 1\n  max_seq_length: 64")
LITGPT_KEYS = ["precision", "quantize", "devices", "num_nodes", "lora_r", "lora_query",
               "lora_mlp", "lora_head", "lora_dropout", "train", "optimizer", "checkpoint_dir"]
RECIPE_KEYS = ["batch_size", "gradient_accumulation_steps", "dtype", "compile",
               "optimizer_in_bwd", "enable_activation_checkpointing",
               "enable_activation_offloading", "fsdp_cpu_offload", "custom_sharded_layers",
               "tensor_parallel_dim", "optimizer", "loss", "dataset", "checkpointer", "model",
               "tokenizer"]


def _materialize(folder: Path, name: str, text: str) -> Path:
    if name != "special":
        path = folder / name
        path.write_text(text, encoding="utf-8")
        return path
    if text == "fifo":
        path = folder / "config.json"
        os.mkfifo(path)
        return path
    if text == "dev_zero":
        return Path("/dev/zero")
    if text == "dir":
        (folder / "d").mkdir()
        return folder / "d"
    if text == "loop":
        path = folder / "loop.json"
        path.symlink_to(path)
        return path
    if text == "long_name":
        return folder / ("n" * 300 + ".json")
    if text == "no_user":
        return Path("~nosuchuser/config.json")
    if text == "binary":
        path = folder / "bin.json"
        path.write_bytes(bytes(range(256)) * 4)
        return path
    return folder / "missing.json"


def _argv(cmd: str, path: Path, folder: Path) -> list[str]:
    p = str(path)
    if cmd == "check":
        return ["check", p, "--json"]
    if cmd == "recipe":
        return ["check", p, "--gpus", "1xH100", "--json"]
    if cmd == "deepspeed":
        return ["estimate", "--model", "gpt2", "--deepspeed", p, "--json"]
    if cmd == "profile":
        return ["estimate", "--model", "gpt2", "--gpus", "2xH100", "--profiles-dir",
                str(path.parent if safeio.path_kind(path) == "file" else path), "--json"]
    if cmd == "validate":
        return ["validate", "--records",
                str(path.parent if safeio.path_kind(path) == "file" else path), "--json"]
    if cmd == "size":
        return ["size", "--model", p, "--tokens", "1B", "--gpu", "H100", "--max-gpus", "8",
                "--json"]
    if cmd == "plan":
        return ["plan", "--model", p, "--gpus", "2xH100", "--json"]
    if cmd == "trace":
        return ["trace", "--model", p, "--seq-len", "16", "--json"]
    if cmd == "peft":
        model = folder / "model"  # beside the drawn file, which may be a FIFO
        model.mkdir()
        (model / "config.json").write_text(json.dumps(LLAMA), encoding="utf-8")
        return ["trace", "--model", str(model), "--framework", "hf", "--seq-len", "16",
                "--peft-config", p, "--json"]
    return [cmd, "--model", p, "--seq-len", "64", "--json"]


@settings(max_examples=FILE_EXAMPLES, **SETTINGS)
@given(hostile_files())
def test_fuzz_files(drawn: tuple[str, str, str]) -> None:
    cmd, name, text = drawn
    if cmd in ("trace", "peft"):  # load the torch engine outside the hang guard (seconds, once)
        pytest.importorskip("torch")
        import vramcalc.trace.distributed  # noqa: F401
        if cmd == "peft":
            pytest.importorskip("peft")
    with tempfile.TemporaryDirectory(prefix="vramcalc-fuzz-") as tmp:
        folder = Path(tmp)
        argv = _argv(cmd, _materialize(folder, name, text), folder)
        check_invariant(argv)
        if cmd in ("check", "deepspeed", "recipe") and name != "special":  # the table too
            check_invariant([a for a in argv if a != "--json"])


def test_every_command_is_fuzzed() -> None:
    """A new command joins the fuzz."""
    fuzzed = {"estimate", "explain", "plan", "size", "check", "gpus", "models", "validate",
              "probe", "trace", "serve", "max"}
    assert {name for name, _, _ in COMMANDS} <= fuzzed
