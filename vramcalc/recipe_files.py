"""Training configs written for a stack, read as vramcalc options: `vramcalc check` on the
YAML a job already runs with (torchtune recipe configs, LitGPT finetune configs).

**torchtune recipe configs** (a `model:` mapping with a `_component_`), read as the recipes
of pytorch/torchtune bd2a0fc7 use them (recipes/lora_finetune_single_device.py,
full_finetune_distributed.py and the others: `_setup_model`, `_setup_optimizer`,
`_setup_data`, and the components they instantiate):

| torchtune key | option |
|---|---|
| model._component_ `torchtune.models.<family>.[lora_\\|qlora_]<builder>` | model (the builder's preset, or checkpointer.checkpoint_dir's config.json when it exists); finetune lora / qlora |
| model.lora_rank, lora_dropout | lora_rank, lora_dropout |
| model.lora_attn_modules (q_proj, k_proj, v_proj, output_proj), apply_lora_to_mlp (w1, w2, w3) | lora_targets |
| tokenizer.max_seq_len | seq_len (batches are padded to their longest sample, at most this) |
| dataset.packed | packed |
| batch_size, gradient_accumulation_steps | micro_batch_size, grad_accum |
| dtype (bf16, fp32) | precision bf16-pure, fp32 |
| optimizer._component_ (torch.optim.AdamW / Adam / SGD, bitsandbytes.optim.PagedAdamW, PagedAdamW8bit, AdamW8bit, torchao.optim.AdamW8bit), optimizer.fused | optimizer, optimizer_impl (torch's default foreach unless fused) |
| optimizer_in_bwd | optimizer_in_backward |
| loss._component_ (LinearCrossEntropyLoss, CEWithChunkedOutputLoss: num_output_chunks, default 8; torch.nn.CrossEntropyLoss) | chunked_ce; LinearCrossEntropyLoss, which only torchtune's main branch has (after 0.6.1), also torchtune_version 0.7.0 |
| compile | compile |
| enable_activation_checkpointing, enable_activation_offloading | recompute full / none, activation_offload |
| fsdp_cpu_offload | offload params |
| custom_sharded_layers | fsdp_edge_units |
| tensor_parallel_dim | tp |

A distributed recipe shards with FSDP2 (`training.shard_model`): on more than one GPU the
run is FSDP full unless the command line says otherwise.

**LitGPT configs** (`litgpt finetune_lora --config ...`: a top-level `checkpoint_dir`),
read as Lightning-AI/litgpt's litgpt/finetune/lora.py `setup` and `main` use them, under
the lightning profile:

| LitGPT key | option |
|---|---|
| checkpoint_dir | model: its config.json when the folder exists, else the Hugging Face id `litgpt download` named it after (checkpoints/ORG/NAME) |
| precision (bf16-true, bf16-mixed, 32-true, 16-mixed; none: bf16-mixed where the GPU has bf16, else 16-mixed) | precision bf16-pure, amp-bf16, fp32, amp-fp16 |
| quantize (bnb.nf4, bnb.nf4-dq: BitsandbytesPrecision on every Linear, the head too) | finetune qlora, nf4_double_quant, quantize_head; optimizer paged-adamw (`instantiate_bnb_optimizer`) |
| lora_r, lora_dropout, lora_query/key/value/projection/mlp | lora_rank, lora_dropout, lora_targets (no lora_* key: finetune_full) |
| train.micro_batch_size, train.global_batch_size, devices × num_nodes | micro_batch_size, grad_accum = global // devices // micro (`TrainArgs.gradient_accumulation_iters`); the --gpus count must match |
| train.max_seq_length | seq_len (batches are padded to their longest sample, at most this) |
| optimizer (a name or class_path: AdamW, Adam, SGD) | optimizer |

On more than one device LitGPT runs Fabric's FSDPStrategy with activation checkpointing
per Block: FSDP full and recompute full unless the command line says otherwise.

GPUs, headroom and releases come from the command line. Keys that do not change memory
(paths, learning rate, logging, seed, epochs) are ignored; a key that would change it but
is not modelled is an error.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from vramcalc.errors import InputError, shown
from vramcalc.hardware import parse_gpus
from vramcalc.training import LIGHTNING_PRECISIONS

_TT_MODELS = "torchtune.models."
# torchtune builder (without lora_/qlora_ and _base/_instruct) -> vramcalc preset
_TT_PRESETS = {
    "llama2_7b": "llama2-7b", "llama2_13b": "llama2-13b", "llama2_70b": "llama2-70b",
    "llama3_8b": "llama3-8b", "llama3_70b": "llama3-70b",
    "llama3_1_8b": "llama3.1-8b", "llama3_1_70b": "llama3.1-70b",
    "llama3_1_405b": "llama3.1-405b", "llama3_2_1b": "llama3.2-1b",
    "llama3_2_3b": "llama3.2-3b", "llama3_3_70b": "llama3.3-70b",
    "mistral_7b": "mistral-7b", "gemma_2b": "gemma-2b", "gemma_7b": "gemma-7b",
    "gemma2_2b": "gemma2-2b", "gemma2_9b": "gemma2-9b", "gemma2_27b": "gemma2-27b",
    "phi3_mini": "phi3-mini", "phi4_14b": "phi4",
    "qwen2_5_7b": "qwen2.5-7b", "qwen2_5_72b": "qwen2.5-72b",
    "qwen3_0_6b": "qwen3-0.6b", "qwen3_4b": "qwen3-4b", "qwen3_8b": "qwen3-8b",
    "qwen3_14b": "qwen3-14b", "qwen3_32b": "qwen3-32b",
}
_TT_ATTN = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "output_proj": "o"}
_TT_OPTIMIZERS = {
    "torch.optim.AdamW": "adamw", "torch.optim.Adam": "adam", "torch.optim.SGD": "sgd",
    "bitsandbytes.optim.PagedAdamW": "paged-adamw",
    "bitsandbytes.optim.PagedAdamW8bit": "paged-adamw-8bit",
    "bitsandbytes.optim.AdamW8bit": "adamw-8bit", "torchao.optim.AdamW8bit": "adamw-8bit",
}
_TT_CHUNKED = ("torchtune.modules.loss.LinearCrossEntropyLoss",
               "torchtune.modules.loss.CEWithChunkedOutputLoss")
_TT_PLAIN_LOSS = ("torch.nn.CrossEntropyLoss",)
_TT_DEFAULT_CHUNKS = 8  # LinearCrossEntropyLoss / CEWithChunkedOutputLoss num_output_chunks
# LinearCrossEntropyLoss came after release 0.6.1 (9c06c8bd); main's version.txt is 0.7.0
_TT_MAIN = "0.7.0"


def is_torchtune_config(data: dict[str, Any]) -> bool:
    model = data.get("model")
    return isinstance(model, dict) and "_component_" in model


def _section(data: dict[str, Any], key: str, who: str = "torchtune config") -> dict[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{who}: {key} must be a mapping, got {shown(value)}")
    return value


def _component(section: dict[str, Any], key: str) -> str:
    comp = section.get("_component_")
    if not isinstance(comp, str) or not comp:
        raise InputError(f"torchtune config: {key}._component_ must be a name, got "
                         f"{shown(comp)}")
    return comp


def flag(data: dict[str, Any], key: str, where: str = "", who: str = "torchtune config"
          ) -> bool:
    value = data.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InputError(f"{who}: {where}{key} must be True or False, got {shown(value)}")
    return value


def count(value: Any, key: str, who: str = "torchtune config") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{who}: {key} must be a positive whole number, got {shown(value)}")
    return value


def _torchtune_model(data: dict[str, Any], model: dict[str, Any]
                     ) -> tuple[str, str | None, str]:
    """(model option, finetune method or None, the builder) of the model section."""
    comp = _component(model, "model")
    if not comp.startswith(_TT_MODELS):
        raise InputError(f"torchtune config: model._component_ {comp!r} is not a "
                         "torchtune.models builder")
    builder = comp.rsplit(".", 1)[-1]
    method = None
    for prefix in ("qlora_", "lora_"):
        if builder.startswith(prefix):
            method, builder = prefix[:-1], builder[len(prefix):]
            break
    base = re.sub(r"_(base|instruct)$", "", builder)
    ckpt = _section(data, "checkpointer").get("checkpoint_dir")
    if isinstance(ckpt, str) and ckpt:  # as torchtune opens it: relative to the cwd
        if (Path(ckpt) / "config.json").is_file():
            return str(Path(ckpt) / "config.json"), method, comp
    if base not in _TT_PRESETS:
        raise InputError(f"torchtune config: no built-in model for {comp} and no "
                         "config.json in checkpointer.checkpoint_dir: pass --model with the "
                         "checkpoint's config.json")
    return _TT_PRESETS[base], method, comp


def torchtune_values(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Option values of a torchtune recipe config (module table), and a note of what was
    read."""
    model = _section(data, "model")
    name, method, comp = _torchtune_model(data, model)
    vals: dict[str, Any] = {"framework": "torchtune", "model": name}
    if method is not None:
        vals["finetune"] = method
        targets = model.get("lora_attn_modules") or []
        if not isinstance(targets, list) or any(not isinstance(t, str) or t not in _TT_ATTN
                                                for t in targets):
            raise InputError("torchtune config: model.lora_attn_modules must list q_proj, "
                             f"k_proj, v_proj or output_proj, got {shown(targets)}")
        names = [_TT_ATTN[t] for t in targets]
        if flag(model, "apply_lora_to_mlp", "model."):
            names += ["gate", "up", "down"]
        if flag(model, "apply_lora_to_output", "model."):
            raise InputError("torchtune config: model.apply_lora_to_output (LoRA on the "
                             "output projection) is not modelled for the torchtune profile")
        if not names:
            raise InputError("torchtune config: the LoRA model adapts no module")
        vals["lora_targets"] = ",".join(names)
        if model.get("lora_rank") is not None:
            vals["lora_rank"] = count(model["lora_rank"], "model.lora_rank")
        if model.get("lora_dropout") is not None:
            vals["lora_dropout"] = model["lora_dropout"]
    seq = _section(data, "tokenizer").get("max_seq_len")
    if seq is not None:
        vals["seq_len"] = count(seq, "tokenizer.max_seq_len")
    if flag(_section(data, "dataset"), "packed", "dataset."):
        vals["packed"] = True
    for key, name in (("batch_size", "micro_batch_size"),
                      ("gradient_accumulation_steps", "grad_accum"),
                      ("tensor_parallel_dim", "tp")):
        if data.get(key) is not None:
            vals[name] = count(data[key], key)
    dtype = data.get("dtype", "fp32")
    if dtype not in ("bf16", "fp32"):
        raise InputError(f"torchtune config: dtype must be bf16 or fp32, got {shown(dtype)}")
    vals["precision"] = "bf16-pure" if dtype == "bf16" else "fp32"
    opt = _section(data, "optimizer")
    if opt:
        comp_opt = _component(opt, "optimizer")
        if comp_opt not in _TT_OPTIMIZERS:
            raise InputError(f"torchtune config: optimizer {comp_opt} is not modelled (one of "
                             f"{', '.join(_TT_OPTIMIZERS)})")
        vals["optimizer"] = _TT_OPTIMIZERS[comp_opt]
        momentum = opt.get("momentum", 0)
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
            raise InputError(f"torchtune config: optimizer.momentum must be a number, got "
                             f"{shown(momentum)}")
        if comp_opt == "torch.optim.SGD" and momentum:
            vals["optimizer"] = "sgd-momentum"
        if comp_opt.startswith("torch.optim."):
            vals["optimizer_impl"] = "fused" if flag(opt, "fused", "optimizer.") else "foreach"
    loss = _section(data, "loss")
    if loss:
        comp_loss = _component(loss, "loss")
        if comp_loss in _TT_CHUNKED:
            vals["chunked_ce"] = count(loss.get("num_output_chunks", _TT_DEFAULT_CHUNKS),
                                        "loss.num_output_chunks")
            if comp_loss == _TT_CHUNKED[0]:  # only torchtune's main branch has it
                vals["torchtune_version"] = _TT_MAIN
        elif comp_loss in _TT_PLAIN_LOSS:
            vals["chunked_ce"] = 1
        else:
            raise InputError(f"torchtune config: loss {comp_loss} is not modelled (supervised "
                             "fine-tuning losses only)")
    for key, opt_name in (("optimizer_in_bwd", "optimizer_in_backward"),
                          ("compile", "compile"),
                          ("enable_activation_offloading", "activation_offload")):
        if key in data:
            vals[opt_name] = flag(data, key)
    vals["recompute"] = "full" if flag(data, "enable_activation_checkpointing") else "none"
    if flag(data, "fsdp_cpu_offload"):
        vals["offload"] = "params"
    if data.get("custom_sharded_layers"):
        vals["fsdp_edge_units"] = True
    return vals, [f"read as a torchtune recipe config: {comp} is {vals['model']}"]


# ---- LitGPT -----------------------------------------------------------------------------
_LIT = "LitGPT config"
_LIT_QUANT = {"bnb.nf4": False, "bnb.nf4-dq": True}  # -> nf4_double_quant
_LIT_OPTIMIZERS = {"AdamW": "adamw", "torch.optim.AdamW": "adamw", "Adam": "adam",
                   "torch.optim.Adam": "adam", "SGD": "sgd", "torch.optim.SGD": "sgd"}


def is_litgpt_config(data: dict[str, Any]) -> bool:
    return "checkpoint_dir" in data and not is_torchtune_config(data)


def _lit_model(data: dict[str, Any]) -> str:
    """The checkpoint's config.json when the folder exists, else the folder's name under
    `checkpoints/` as a Hugging Face id (`litgpt download` writes checkpoints/ORG/NAME)."""
    ckpt = data.get("checkpoint_dir")
    if not isinstance(ckpt, str) or not ckpt.strip("/"):
        raise InputError(f"{_LIT}: checkpoint_dir must be a path, got {shown(ckpt)}")
    if (Path(ckpt) / "config.json").is_file():
        return str(Path(ckpt) / "config.json")
    parts = Path(ckpt).parts
    return "/".join(parts[1:] if parts[0] == "checkpoints" and len(parts) > 2 else parts[-2:])


def litgpt_values(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Option values of a LitGPT finetune config (`litgpt finetune_lora` / `finetune_full`
    --config; litgpt/finetune/lora.py `setup` and `main`, Lightning-AI/litgpt): module
    docstring's LitGPT table."""
    vals: dict[str, Any] = {"framework": "lightning", "model": _lit_model(data)}
    precision = data.get("precision")
    if precision is not None:
        if not isinstance(precision, str) or precision not in LIGHTNING_PRECISIONS:
            raise InputError(f"{_LIT}: precision must be one of "
                             f"{', '.join(LIGHTNING_PRECISIONS)}, got {shown(precision)}")
        vals["precision"] = LIGHTNING_PRECISIONS[precision]
    quantize = data.get("quantize")
    if quantize is not None:
        if not isinstance(quantize, str) or quantize not in _LIT_QUANT:
            raise InputError(f"{_LIT}: quantize {shown(quantize)} is not modelled (bnb.nf4 or "
                             "bnb.nf4-dq)")
        if precision is not None and "mixed" in precision:
            raise InputError(f"{_LIT}: LitGPT refuses quantize with mixed precision")
        vals.update(nf4_double_quant=_LIT_QUANT[quantize], quantize_head=True)
    # finetune/lora.py `setup`'s defaults: LoRA on the query and value projections
    lora = {k: flag({f"lora_{k}": k in ("query", "value"), **data}, f"lora_{k}", who=_LIT)
            for k in ("query", "key", "value", "projection", "mlp", "head")}
    if any(key.startswith("lora_") for key in data):
        if lora["head"]:
            raise InputError(f"{_LIT}: lora_head (LoRA on the output head) is not modelled "
                             "for the lightning profile")
        vals["finetune"] = "qlora" if quantize else "lora"
        if all(lora[k] for k in ("query", "key", "value", "projection", "mlp")):
            vals["lora_targets"] = "all-linear"
        else:
            names = [n for k, n in (("query", "q"), ("key", "k"), ("value", "v"),
                                    ("projection", "o")) if lora[k]]
            names += ["gate", "up", "down"] if lora["mlp"] else []
            if not names:
                raise InputError(f"{_LIT}: the LoRA config adapts no layer")
            vals["lora_targets"] = ",".join(names)
        if data.get("lora_r") is not None:
            vals["lora_rank"] = count(data["lora_r"], "lora_r", _LIT)
        if data.get("lora_dropout") is not None:
            vals["lora_dropout"] = data["lora_dropout"]
    elif quantize:
        raise InputError(f"{_LIT}: quantize needs LoRA (finetune_lora's lora_* keys)")
    train = _section(data, "train", _LIT)
    devices = data.get("devices", 1)
    nodes = data.get("num_nodes", 1)
    if train.get("micro_batch_size") is not None:
        vals["micro_batch_size"] = count(train["micro_batch_size"], "train.micro_batch_size",
                                          _LIT)
    if train.get("global_batch_size") is not None:  # the accumulation: recipe_defaults
        vals["_global_batch"] = count(train["global_batch_size"], "train.global_batch_size",
                                       _LIT)
    if train.get("max_seq_length") is not None:
        vals["seq_len"] = count(train["max_seq_length"], "train.max_seq_length", _LIT)
    vals["optimizer"] = "paged-adamw" if quantize else _lit_optimizer(data.get("optimizer"))
    if isinstance(devices, int) and isinstance(nodes, int) and devices > 0 and nodes > 0:
        vals["_devices"] = devices * nodes  # (-1 and "auto": every GPU there is)
    return vals, [f"read as a LitGPT config: {data['checkpoint_dir']} is {vals['model']}"
                  + ("" if vals.get("finetune") else " (no lora_* keys: finetune_full)")]


def _lit_optimizer(spec: Any) -> str:
    """A LitGPT optimizer: a name or {class_path, init_args} (bnb quantization replaces it
    with PagedAdamW: finetune/lora.py `instantiate_bnb_optimizer`)."""
    name = spec.get("class_path") if isinstance(spec, dict) else spec
    if name is None:
        return "adamw"  # litgpt's default "AdamW"
    if not isinstance(name, str) or name not in _LIT_OPTIMIZERS:
        raise InputError(f"{_LIT}: optimizer {shown(name)} is not modelled (AdamW, Adam or "
                         "SGD)")
    return _LIT_OPTIMIZERS[name]


def recipe_defaults(values: dict[str, Any], recipe: str, profile_dirs: list[Path] | None
                    ) -> dict[str, Any]:
    """What a stack's config leaves to its launch, once the command line is merged in.

    torchtune: a distributed recipe on more than one GPU shards with FSDP2
    (`training.shard_model`); a recipe without tokenizer.max_seq_len needs the longest
    sample's length. LitGPT: `devices` × `num_nodes` must be the --gpus count; on more than
    one it runs Fabric's FSDPStrategy with activation checkpointing per Block; without
    `precision` it takes `get_default_supported_precision(training=True)` (bf16-mixed where
    the GPU has bf16, else 16-mixed); without train.max_seq_length each batch is padded to
    its longest sample."""
    values = dict(values)
    devices = values.pop("_devices", None)
    global_batch = values.pop("_global_batch", None)
    if values.get("seq_len") is None:
        where = {"torchtune": "tokenizer.max_seq_len", "trl": "max_length"}.get(
            recipe, "train.max_seq_length")
        raise InputError(f"the {recipe} config sets no {where}, so each batch is padded to "
                         "its longest sample: give that length with --seq-len")
    gpus = values.get("gpus")
    if not gpus:
        return values
    cluster = parse_gpus(str(gpus), profile_dirs)
    if recipe == "litgpt":
        if devices is not None and devices != cluster.num_gpus:
            raise InputError(f"the LitGPT config runs on devices × num_nodes = {devices} GPUs, "
                             f"--gpus gives {cluster.num_gpus}")
        if global_batch is not None and values.get("grad_accum") is None:
            # TrainArgs.gradient_accumulation_iters: global // devices // micro-batch
            micro = int(values.get("micro_batch_size") or 1)
            values["grad_accum"] = max(global_batch // cluster.num_gpus // micro, 1)
        if values.get("precision") is None:
            values["precision"] = "amp-bf16" if cluster.gpu.bf16_supported else "amp-fp16"
            if values.get("finetune") == "qlora":
                raise InputError("the LitGPT config quantizes without a precision, and "
                                 "LitGPT refuses quantize with its default mixed precision")
    sharded = values.get("fsdp") is not None or values.get("zero") is not None
    if recipe == "trl" and devices is not None and devices != cluster.num_gpus:
        raise InputError(f"the TRL config runs on num_processes = {devices} GPUs, --gpus "
                         f"gives {cluster.num_gpus}")
    if recipe in ("llamafactory", "trl"):  # DDP, or its DeepSpeed file's ZeRO
        return values
    if cluster.num_gpus > 1 and not sharded:
        values["fsdp"] = "full"
        if recipe == "litgpt" and values.get("recompute") is None:
            values["recompute"] = "full"  # activation_checkpointing_policy={Block}
        return values
    if recipe == "torchtune" and not sharded:
        # one GPU: nothing to shard, so custom_sharded_layers changes nothing
        values.pop("fsdp_edge_units", None)
    return values
