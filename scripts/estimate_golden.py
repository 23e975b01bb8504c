"""Refactoring check for the analytic engine: is every estimate byte-identical to before?

    python scripts/estimate_golden.py dump BASELINE.json    # before a change
    python scripts/estimate_golden.py compare BASELINE.json # after it: exit 1 on any difference

The corpus is ~1,500 scenarios drawn with a fixed seed from every option the CLI takes
(dense and MoE models, tp/pp/cp/ep/sequence parallel, ZeRO 0-3, FSDP, offload, recompute,
attention kernels, precisions incl. FP8 and QAT, LoRA/QLoRA/DoRA, the three framework
profiles, odd sizes where the allocator's 512-byte rounding bites, chunked CE, activation
offload), plus runs of micro-batch sizes 1-12 over fixed structures. Each is estimated
with every_stage True and False; an InputError is recorded as its message. `compare`
estimates the corpus twice (in order, then reversed and interleaved with repeats), so
caches that leak between scenarios show up too.

This is NOT an accuracy test: the baseline is the code's own output. Accuracy is what the
test suite checks (analytic vs trace engine, published figures).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = ["70b", "8b", "gpt2", "gpt2-medium", "gemma-2b", "phi3-mini", "mixtral-8x7b",
          "qwen3-8b", "qwen2.5-7b", "llama2-7b", "mistral-7b", "gpt3-175b",
          "moe-shared", "moe-qk", "moe-dense2", "tied-mini", "learned-mini"]
CHOICES: dict[str, list[Any]] = {
    "gpus": ["1xH100", "8xH100", "64xH100", "16xA100-80GB", "8xRTX4090", "32x910B", "2xH100",
             "4xA100-40GB", "128xH100"],
    "seq_len": [77, 128, 500, 1000, 2048, 4096, 8192, 30],
    "micro_batch_size": [1, 2, 3, 4, 5, 8, 16],
    "grad_accum": [1, 2, 4, 8],
    "precision": ["fp32", "amp-bf16", "amp-fp16", "bf16", "fp16", "bf16-pure", "fp8"],
    "optimizer": ["adamw", "adam", "sgd", "sgd-momentum", "lion", "adafactor", "adamw-8bit",
                  "paged-adamw", "paged-adamw-8bit"],
    "optimizer_dtype": ["fp32", "bf16"],
    "attention": ["flash", "eager"],
    "recompute": ["none", "selective", "full"],
    "framework": ["reference", "hf", "megatron"],
    "finetune": ["full", "lora", "qlora", "dora"],
    "lora_rank": [4, 8, 64],
    "lora_targets": ["q,v", "all-linear", "q,k,v,o"],
    "lora_dropout": [0.0, 0.1],
    "chunked_ce": [1, 4, 8],
    "activation_offload": [False, True],
    "qat": ["none", "int8", "int4"],
    "tp": [1, 2, 4, 8],
    "pp": [1, 2, 4],
    "cp": [1, 2],
    "ep": [1, 2, 4],
    "sequence_parallel": [False, True],
    "zero": [0, 1, 2, 3],
    "fsdp": ["none", "full", "grad-op", "hybrid"],
    "shard_group": [2, 4, 8],
    "offload": ["none", "optimizer", "optimizer,gradients", "params", "optimizer,params"],
    "offload_device": ["cpu", "nvme"],
    "pp_schedule": ["1f1b", "interleaved", "gpipe"],
    "virtual_stages": [1, 2],
    "num_microbatches": [4, 8],
    "capacity_factor": [1.0, 1.25],
    "headroom": [0.0, 0.05],
}
# fixed structures swept over micro-batch sizes (the planner's inner loop)
SWEEPS: list[dict[str, Any]] = [
    {"model": "70b", "gpus": "64xH100", "tp": 8, "pp": 4, "zero": 1, "recompute": "selective",
     "grad_accum": 8},
    {"model": "8b", "gpus": "8xH100", "zero": 3},
    {"model": "8b", "gpus": "8xH100", "fsdp": "full", "framework": "hf", "attention": "eager"},
    {"model": "gpt2", "gpus": "1xH100", "seq_len": 77, "precision": "amp-bf16"},
    {"model": "gpt2", "gpus": "2xH100", "seq_len": 77, "framework": "hf", "zero": 2},
    {"model": "mixtral-8x7b", "gpus": "64xH100", "tp": 2, "ep": 4, "pp": 4, "zero": 1},
    {"model": "moe-shared", "gpus": "8xH100", "framework": "hf", "ep": 2, "zero": 2},
    {"model": "moe-dense2", "gpus": "8xH100", "pp": 2, "fsdp": "full", "recompute": "full"},
    {"model": "qwen3-8b", "gpus": "8xH100", "finetune": "qlora", "framework": "hf",
     "seq_len": 1000},
    {"model": "8b", "gpus": "8xH100", "precision": "fp8", "tp": 2, "sequence_parallel": True},
    {"model": "8b", "gpus": "1xH100", "qat": "int4", "precision": "bf16-pure"},
    {"model": "8b", "gpus": "8xH100", "chunked_ce": 8, "activation_offload": True,
     "fsdp": "full"},
    {"model": "70b", "gpus": "64xH100", "tp": 4, "pp": 4, "cp": 2, "framework": "megatron",
     "zero": 1, "sequence_parallel": True, "recompute": "selective"},
    {"model": "gemma-2b", "gpus": "4xA100-40GB", "pp": 2, "pp_schedule": "interleaved",
     "virtual_stages": 3, "num_microbatches": 4, "seq_len": 500, "attention": "eager"},
    {"model": "8b", "gpus": "8xH100", "tp": 8, "framework": "hf", "attention": "eager",
     "recompute": "selective", "precision": "amp-bf16"},
    {"model": "moe-qk", "gpus": "8xH100", "ep": 4, "zero": 1, "capacity_factor": 1.25,
     "seq_len": 500},
]


def _custom_models() -> dict[str, Any]:
    from vramcalc.model import ModelSpec

    base = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=4, intermediate_size=4096, vocab_size=32000)
    return {
        "moe-shared": ModelSpec(name="moe-shared", model_type="qwen2_moe", **{
            **base, "num_local_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 1408, "num_shared_experts": 1,
            "shared_expert_intermediate_size": 2816, "shared_expert_gate": True,
            "attention_bias": True}),
        "moe-qk": ModelSpec(name="moe-qk", model_type="qwen3_moe", qk_norm=True, **{
            **base, "num_local_experts": 16, "num_experts_per_tok": 4,
            "moe_intermediate_size": 768, "head_dim": 128}),
        "moe-dense2": ModelSpec(name="moe-dense2", **{
            **base, "num_local_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 1024, "first_k_dense_replace": 2}),
        "tied-mini": ModelSpec(name="tied-mini", tie_word_embeddings=True, **base),
        "learned-mini": ModelSpec(name="learned-mini", position_embedding="learned",
                                  norm_kind="layernorm", norm_bias=True, mlp_kind="standard",
                                  hidden_act="gelu_new", mlp_bias=True, attention_bias=True,
                                  attention_out_bias=True, **{**base, "vocab_size": 50257}),
    }


def build(values: dict[str, Any]):  # noqa: ANN201
    """A resolved Scenario, or an InputError (custom models are swapped in by name)."""
    from vramcalc.options import build_scenario

    custom = _custom_models()
    name = values["model"]
    if name not in custom:
        return build_scenario(values)
    scn = build_scenario({**values, "model": "8b"})
    scn = scn.model_copy(update={"model": custom[name], "model_note": None,
                                 "parallel": scn.parallel.model_copy(update={"dp": None})})
    return scn.resolved()


def corpus(n_random: int = 8000) -> list[dict[str, Any]]:
    rng = random.Random(20261202)
    out: list[dict[str, Any]] = []
    for _ in range(n_random):
        values: dict[str, Any] = {"model": rng.choice(MODELS)}
        for key, choices in CHOICES.items():
            if rng.random() < 0.3 or key == "gpus":
                values[key] = rng.choice(choices)
        out.append(values)
    for base in SWEEPS:
        out += [{**base, "micro_batch_size": b} for b in range(1, 13)]
    out.append({"model": "8b", "gpus": "1xH100", "no_cluster": True})
    out.append({"model": "70b", "gpus": "64xH100", "tp": 8, "pp": 8, "no_cluster": True})
    return out


def scenarios() -> list[tuple[str, Any]]:
    """(key, scenario) for every corpus entry that builds."""
    from vramcalc.errors import InputError

    out = []
    for values in corpus():
        v = dict(values)
        no_cluster = v.pop("no_cluster", False)
        try:
            scn = build(v)
        except InputError:
            continue
        if no_cluster:
            scn = scn.model_copy(update={"cluster": None})
        out.append((json.dumps(values, sort_keys=True), scn))
    return out


def run(items: list[tuple[str, Any]]) -> dict[str, Any]:
    from vramcalc.analytic import estimate
    from vramcalc.errors import InputError

    out: dict[str, Any] = {}
    for key, scn in items:
        for every in (True, False):
            try:
                res: Any = estimate(scn, every_stage=every).model_dump(mode="json")
            except InputError as err:
                res = {"error": str(err)}
            out[f"{key} every_stage={every}"] = res
    return out


def _diff(base: dict[str, Any], new: dict[str, Any], label: str) -> int:
    bad = 0
    for key in base.keys() | new.keys():
        # as JSON text: 3 and 3.0 differ (the CLI's --json prints them differently)
        if json.dumps(base.get(key), sort_keys=True) != json.dumps(new.get(key), sort_keys=True):
            bad += 1
            if bad <= 5:
                a, b = base.get(key), new.get(key)
                detail = "missing" if a is None or b is None else sorted(
                    k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
                print(f"{label}: DIFF {key}: {detail}")
    return bad


def main() -> None:
    mode, path = sys.argv[1], Path(sys.argv[2])
    items = scenarios()
    if mode == "dump":
        path.write_text(json.dumps(run(items), sort_keys=True))
        print(f"{len(items)} scenarios x 2 written to {path}")
        return
    base = json.loads(path.read_text())
    first = json.loads(json.dumps(run(items)))
    # again in another order, each scenario estimated twice (warm caches from neighbours)
    shuffled = items[::-1] + items[::2]
    random.Random(1).shuffle(shuffled)
    second = json.loads(json.dumps(run(shuffled)))
    bad = _diff(base, first, "in order") + _diff(base, second, "shuffled")
    errors = sum(1 for v in base.values() if "error" in v)
    print(f"{len(items)} scenarios x 2 ({errors} InputErrors): "
          f"{'IDENTICAL' if not bad else f'{bad} DIFFERENCES'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
