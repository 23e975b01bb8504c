"""Megatron-LM's functional tests outside the calibration set, against vramcalc's estimate.

    python benchmarks/megatron_tests.py --megatron-repo PATH [--markdown] [--all]

PATH is a checkout of NVIDIA/Megatron-LM (the calibration folder's megatron.yaml samples
seven of its test models at d98e8a64). Every GPT and MoE training case under
tests/functional_tests/test_cases whose golden values log `mem-max-allocated-bytes` is read
as megatron.yaml reads its records (see that file's header): the steady-state
`allocated_bytes.all.peak` of global rank world_size − 1 (the last pipeline stage),
compared with that stage's allocated peak. The case's MODEL_ARGS become flags through the
calibration's own mapping (benchmarks/calibration.py `megatron_mapping`); the world size is
the recipe's (tests/test_utils/recipes, 8 GPUs unless a recipe says otherwise).

A case is left out, with the reason, when it needs something the mapping does not express:
an argument that changes memory and is not mapped, a tokenizer whose vocabulary is not
established here, or a GPU without a profile. Arguments that only touch logging, data,
checkpoints, the learning-rate schedule or numerics are listed in NON_MEMORY_ARGS.
Transformer Engine's attention backend `auto` is taken as a fused kernel (flash or cuDNN:
both keep q, k, v, the output and the softmax statistics). Nothing here is fitted.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from calibration import (
    MEGATRON_REVIEWED_ARGS,
    PLATFORM_GPU,
    Mapping,
    Row,
    cli_flags,
    estimate_row,
    megatron_mapping,
)

CASES = "tests/functional_tests/test_cases"
RECIPES = "tests/test_utils/recipes"
FAMILIES = ("gpt", "moe")
GPT2_VOCAB = 50257  # GPT2BPETokenizer with the CI's GPT-2 vocab.json (megatron.yaml header)

# reviewed: no effect on what a training step allocates
NON_MEMORY_ARGS = frozenset({
    "log-interval", "log-num-zeros-in-grad", "log-timers-to-tensorboard",
    "log-memory-to-tensorboard", "log-validation-ppl-to-tensorboard", "load", "save",
    "ckpt-format", "timing-log-level", "save-interval", "distributed-backend", "lr",
    "eval-interval", "tensorboard-dir", "min-lr", "eval-iters", "log-params-norm",
    "data-path", "split", "data-cache-path", "clip-grad", "lr-decay-style", "weight-decay",
    "lr-warmup-fraction", "vocab-file", "lr-decay-iters", "dist-ckpt-strictness",
    "merge-file", "async-save", "use-persistent-ckpt-worker",
    "use-checkpoint-opt_param-scheduler", "tokenizer-type", "tokenizer-model",
    "dist-ckpt-optim-fully-reshardable", "init-method-std", "ckpt-fully-parallel-load",
    "use-checkpoint-args", "no-load-optim", "no-use-tokenizer-model-from-checkpoint-args",
    "auto-detect-ckpt-format", "exit-interval", "adam-beta1", "adam-beta2", "log-throughput",
    "num-workers", "rotary-base", "distributed-timeout-minutes", "lr-warmup-samples",
    "train-samples", "no-mmap-bin-files", "rotary-percent", "norm-epsilon",
    "ckpt-fully-parallel-save", "wandb-project", "wandb-entity", "wandb-exp-name",
    "wandb-save-dir", "exit-duration-in-mins", "logging-level", "lr-decay-samples",
    "save-retain-interval", "check-weight-hash-across-dp-replicas-interval",
    "no-check-for-nan-in-loss-and-grad", "no-ckpt-fully-parallel-save", "seed",
    "timing-log-option", "mock-data", "lr-warmup-init", "adam-eps", "tensorboard-log-interval",
    "decoupled-lr", "lr-warmup-iters", "lr-wsd-decay-style", "no-record-throughput",
    "override-opt_param-scheduler", "decoupled-min-lr", "log-progress", "no-load-rng",
    "ckpt-assume-constant-structure", "log-energy", "lr-wsd-decay-samples",
    "override-opt-param-scheduler", "async-ckpt-use-cpu-shm", "disable-gloo-process-groups",
    "tiktoken-pattern", "data-parallel-random-init", "dataloader-type", "async-strategy",
    "straggler-minmax-count", "verify-integrity", "fim-data", "fim-rate", "fim-spm-rate",
    "ckpt-fully-parallel-load-per-rank-objects", "no-ckpt-load-validate-sharding-integrity",
    "ckpt-drop-redundant-extra-state", "check-for-large-grads", "te-rng-tracker",
    "rerun-mode", "manual-gc", "manual-gc-interval", "no-create-attention-mask-in-dataloader",
    "no-rope-fusion", "no-persist-layer-norm",
    "rotary-interleaved", "use-rotary-position-embeddings", "use-tp-pp-dp-mapping",
    # grad/param buckets are the contiguous buffers the profile counts either way
    "overlap-grad-reduce", "overlap-param-gather", "ddp-average-in-collective",
    "overlap-param-gather-with-optimizer-step",  # the same buffers, gathered earlier
    "test-mode",  # attention.py `run_realtime_tests`: checks, no tensors kept
    "moe-router-load-balancing-type", "moe-aux-loss-coeff", "moe-z-loss-coeff",
    "moe-router-score-function", "moe-router-topk-scaling-factor", "moe-router-pre-softmax",
    "moe-router-enable-expert-bias", "moe-router-bias-update-rate", "moe-router-dtype",
    "moe-permute-fusion", "moe-router-fusion",
    # shapes, read into the model below
    "swiglu", "normalization", "position-embedding-type", "untie-embeddings-and-output-weights",
    "ffn-hidden-size", "group-query-attention", "num-query-groups", "kv-channels",
    "make-vocab-size-divisible-by", "vocab-size", "moe-ffn-hidden-size",
    "moe-token-dispatcher-type", "moe-grouped-gemm", "fp16", "optimizer", "qk-layernorm",
    "moe-shared-expert-intermediate-size", "multi-latent-attention", "q-lora-rank",
    "kv-lora-rank", "qk-head-dim", "qk-pos-emb-head-dim", "v-head-dim",
    # layouts, read into flags below
    "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers",
    "account-for-embedding-in-pipeline-split", "account-for-loss-in-pipeline-split",
    # the loss's reduction (a token count beside the sum) and LayerNorm's zero-centred
    # gamma (TE `zero_centered_gamma`): the same tensors
    "calculate-per-token-loss", "apply-layernorm-1p",
    "num-distributed-optimizer-instances", "num-virtual-stages-per-pipeline-rank",
    "microbatch-group-size-per-virtual-pipeline-stage", "defer-embedding-wgrad-compute",
    "wgrad-deferral-limit",
    # posts the warm-up and flush receives early: one (s, b, h) buffer each, not counted
    "overlap-p2p-communication-warmup-flush",
})
# Megatron-LM d98e8a64 fusions/fused_cross_entropy.py keeps what the unfused vocab-parallel
# cross entropy keeps (vramcalc/terms/logits.py); the TE implementation is not mapped
NATIVE_LOSS_FUSION = "cross-entropy-loss-fusion"


def world_sizes(root: Path) -> dict[tuple[str, str], int]:
    """(test case, recipe folder) -> GPUs, from the recipes' spec (nodes x gpus)."""
    out: dict[tuple[str, str], int] = {}
    for path in sorted((root / RECIPES).glob("*/*.yaml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        spec = data.get("spec") or {}
        gpus = int(spec.get("nodes", 1)) * int(spec.get("gpus", 8))
        for product in data.get("products") or []:
            for case in product.get("test_case") or []:
                out.setdefault((case, path.parent.name), gpus)
    return out


def vocab_size(a: dict[str, Any]) -> int | None:
    """The tokenizer's vocabulary (before padding), or None where not established."""
    kind = a.get("tokenizer-type", "GPT2BPETokenizer")
    if kind == "GPT2BPETokenizer" and "vocab-file" in a:
        return GPT2_VOCAB
    if kind == "NullTokenizer" and "vocab-size" in a:
        return int(a["vocab-size"]) + 1  # _NullTokenizer adds its eod id
    if kind == "TikTokenizer":  # tokenizers/utils/build_tokenizer.py, tiktoken_tokenizer.py
        return int(a.get("vocab-size") or 2**17)  # DEFAULT_TIKTOKEN_MAX_VOCAB
    return None


def derived(a: dict[str, Any], world: int) -> dict[str, Any] | str:
    """megatron.yaml's `derived` fields from the arguments (a reason when not possible)."""
    tp, pp = a.get("tensor-model-parallel-size", 1), a.get("pipeline-model-parallel-size", 1)
    cp = a.get("context-parallel-size", 1)
    if world % (tp * pp * cp):
        return f"tp {tp} x pp {pp} x cp {cp} does not divide {world} GPUs"
    dp = world // (tp * pp * cp)
    gbs, mbs = a.get("global-batch-size"), a["micro-batch-size"]
    if gbs is None or gbs % (mbs * dp):
        return f"global batch {gbs} is not a multiple of micro-batch x dp"
    v = vocab_size(a)
    if v is None:
        return f"vocabulary of tokenizer {a.get('tokenizer-type')!r} not established here"
    h, heads = a["hidden-size"], a["num-attention-heads"]
    step = a.get("make-vocab-size-divisible-by", 128) * tp
    swiglu = bool(a.get("swiglu"))
    ffn = a.get("ffn-hidden-size") or (int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h)
    d: dict[str, Any] = {
        "data_parallel_size": dp,
        "num_microbatches_per_iter": gbs // (mbs * dp),
        "padded_vocab_size": math.ceil(v / step) * step,
        "ffn_hidden_size_effective": ffn,
        "kv_channels_effective": a.get("kv-channels", h // heads),
        "num_query_groups_effective": (a.get("num-query-groups", heads)
                                       if a.get("group-query-attention") else heads),
        # Megatron turns sequence parallelism off without tensor parallelism (validate_args)
        "sequence_parallel": bool(a.get("sequence-parallel")) and tp > 1,
        "distributed_optimizer": bool(a.get("use-distributed-optimizer")),
        "tied_embeddings": not a.get("untie-embeddings-and-output-weights"),
        "position_embedding_type": a.get("position-embedding-type", "learned_absolute"),
        "normalization": a.get("normalization", "LayerNorm"),
        "activation": "swiglu" if swiglu else "gelu",
        "add_bias_linear": not a.get("disable-bias-linear"),
        "hidden_dropout": a.get("hidden-dropout", 0.1),
        "attention_dropout": a.get("attention-dropout", 0.1),
        "optimizer": a.get("optimizer", "adam"),
        "params_dtype": "bf16" if a.get("bf16") else "fp16" if a.get("fp16") else "fp32",
        "fp8": a.get("fp8-format"),
        "transformer_impl": a.get("transformer-impl", "transformer_engine"),
        # Transformer Engine's `auto`: a fused kernel (module docstring)
        "attention_backend": ("flash" if a.get("attention-backend", "auto") == "auto"
                              else a["attention-backend"]),
    }
    if a.get("num-experts"):
        d.update(num_experts=a["num-experts"], moe_router_topk=a.get("moe-router-topk", 2),
                 moe_ffn_hidden_size_effective=a.get("moe-ffn-hidden-size", ffn),
                 expert_tensor_parallel_size_effective=a.get("expert-tensor-parallel-size",
                                                             tp),
                 moe_token_dispatcher_type_effective=a.get("moe-token-dispatcher-type",
                                                           "allgather"),
                 moe_grouped_gemm=bool(a.get("moe-grouped-gemm")))
    return d


def peak(golden: Any) -> int | None:
    metric = golden.get("mem-max-allocated-bytes") if isinstance(golden, dict) else None
    values = (metric.get("values") if isinstance(metric, dict) else None) or {}
    finite = [v for v in values.values() if isinstance(v, (int, float)) and v == v]
    return int(max(finite)) if finite else None


def cases(root: Path) -> list[tuple[str, str, Mapping | str]]:
    """(case, platform, mapping or the reason it is left out) per golden file."""
    sizes = world_sizes(root)
    out: list[tuple[str, str, Mapping | str]] = []
    for family in FAMILIES:
        if not (root / CASES / family).is_dir():
            continue
        for folder in sorted((root / CASES / family).iterdir()):
            config = folder / "model_config.yaml"
            if not config.is_file():
                continue
            data = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
            args = {k.removeprefix("--"): v for k, v in (data.get("MODEL_ARGS") or {}).items()}
            if "train-iters" not in args and "train-samples" not in args:
                continue  # inference
            for golden in sorted(folder.glob("golden_values_*.json")):
                try:
                    values = json.loads(golden.read_text(encoding="utf-8"))
                except ValueError:
                    continue
                measured = peak(values)
                if measured is None:
                    continue
                env, _, platform = golden.stem.removeprefix("golden_values_").partition("_")
                recipe = "gb200" if "gb200" in platform else "h100"
                world = sizes.get((folder.name, recipe), 4 if folder.name.endswith(
                    "_1node") and recipe == "gb200" else 8)
                out.append((folder.name, f"{env}_{platform}",
                            mapping(folder.name, env, platform, args, world, measured)))
    return out


def mapping(name: str, env: str, platform: str, args: dict[str, Any], world: int,
            measured: int) -> Mapping | str:
    known = MEGATRON_REVIEWED_ARGS | NON_MEMORY_ARGS
    if args.get("cross-entropy-fusion-impl", "native") == "native":
        known |= {NATIVE_LOSS_FUSION}
    unknown = sorted(set(args) - known)
    if unknown:
        return "not mapped: " + ", ".join(f"--{k}" for k in unknown)
    if platform not in PLATFORM_GPU:
        return f"no GPU profile for platform {platform}"
    d = derived(args, world)
    if isinstance(d, str):
        return d
    case = {"id": f"{name}__{env}_{platform}", "args": args, "derived": d,
            "measured": {"max_allocated_all_iters": measured}, "platform": platform,
            "world_size": world}
    m = megatron_mapping(case)
    # TE's GroupedLinear keeps its input's per-expert splits (transformer_engine/pytorch/
    # module/grouped_linear.py `_split_quantize`, `prepare_for_saving(*inputmats, ...)`), the
    # bytes SequentialMLP's experts keep: estimated as SequentialMLP
    m.missing = [x for x in m.missing if not x.startswith(("unreviewed Megatron argument",
                                                           "MoE grouped GEMM"))]
    assert m.flags is not None and m.model_fields is not None
    if args.get("multi-latent-attention"):  # MLATransformerConfig's defaults
        nope, rope = args.get("qk-head-dim", 128), args.get("qk-pos-emb-head-dim", 64)
        m.model_fields.update(q_lora_rank=args.get("q-lora-rank"),
                              kv_lora_rank=args.get("kv-lora-rank", 512), qk_nope_head_dim=nope,
                              qk_rope_head_dim=rope, v_head_dim=args.get("v-head-dim", 128),
                              head_dim=nope + rope)
        m.model_fields = {k: v for k, v in m.model_fields.items() if v is not None}
    if args.get("qk-layernorm"):
        m.model_fields["qk_norm"] = True
    if args.get("moe-shared-expert-intermediate-size"):
        m.model_fields.update(num_shared_experts=1, shared_expert_intermediate_size=args[
            "moe-shared-expert-intermediate-size"])
    layout = {"first_stage_layers": args.get("decoder-first-pipeline-num-layers"),
              "last_stage_layers": args.get("decoder-last-pipeline-num-layers"),
              "embedding_in_split": args.get("account-for-embedding-in-pipeline-split"),
              "loss_in_split": args.get("account-for-loss-in-pipeline-split")}
    m.flags.update({k: v for k, v in layout.items() if v})
    if (args.get("attention-backend", "auto") == "auto"
            and args.get("transformer-impl", "transformer_engine") == "transformer_engine"):
        m.notes.append(AUTO)  # chosen by Transformer Engine at run time
    if args.get(NATIVE_LOSS_FUSION):
        m.flags["cross_entropy_loss_fusion"] = True
    if args.get("num-distributed-optimizer-instances", 1) > 1 and m.flags.get("zero"):
        cp = args.get("context-parallel-size", 1)
        m.flags["shard_group"] = (d["data_parallel_size"] * cp
                                  // args["num-distributed-optimizer-instances"])
    if args.get("defer-embedding-wgrad-compute"):
        m.flags["defer_embedding_wgrad"] = args.get("wgrad-deferral-limit", 0)
    if args.get("microbatch-group-size-per-virtual-pipeline-stage"):
        m.flags["pp_group_size"] = args["microbatch-group-size-per-virtual-pipeline-stage"]
    if args.get("num-virtual-stages-per-pipeline-rank", 1) > 1:
        m.flags.update(pp_schedule="interleaved",
                       virtual_stages=args["num-virtual-stages-per-pipeline-rank"])
    return m


AUTO = "attention backend auto"


def run(root: Path) -> tuple[dict[str, list[tuple[str, Row, Row | None]]], list[tuple[str, str, str]]]:
    """Rows per case (golden, estimate, the estimate with eager attention when the backend
    is Transformer Engine's `auto`), and the golden files left out with the reason."""
    rows: dict[str, list[tuple[str, Row, Row | None]]] = {}
    skipped: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, where, m in cases(root):
            if isinstance(m, str):
                skipped.append((name, where, m))
                continue
            eager = None
            if AUTO in m.notes and m.flags is not None:
                other = copy.deepcopy(m)
                assert other.flags is not None
                other.flags["attention"] = "eager"
                eager = estimate_row(other, Path(tmp))
            row = estimate_row(m, Path(tmp))
            if row.error is None:
                skipped.append((name, where, "; ".join(m.missing) or "no estimate"))
                continue
            rows.setdefault(name, []).append((where, row, eager))
    return rows, skipped


def _span(errors: list[float]) -> str:
    lo, hi = min(errors), max(errors)
    return f"{lo:+.1%}" if abs(hi - lo) < 0.0005 else f"{lo:+.1%} … {hi:+.1%}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-repo", type=Path, required=True)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--all", action="store_true", help="also list the cases left out")
    ns = p.parse_args(argv)
    if not (ns.megatron_repo / CASES).is_dir():
        print(f"error: {ns.megatron_repo} has no {CASES} (a Megatron-LM checkout?)",
              file=sys.stderr)
        return 2
    rows, skipped = run(ns.megatron_repo)
    if ns.markdown:
        print("| case | golden files | error | with --attention eager (auto backend) | flags |")
        print("|---|---|---|---|---|")
    errors: list[float] = []
    for name, found in rows.items():
        errs = [r.error for _, r, _ in found if r.error is not None]
        eager = [e.error for _, _, e in found if e is not None and e.error is not None]
        errors += [abs(e) for e in errs]
        if ns.markdown:
            first = found[0][1].mapping.flags or {}
            print(f"| {name} | {len(found)} | {_span(errs)} | "
                  f"{_span(eager) if eager else ''} | {cli_flags(first)} |")
        else:
            for where, r, e in found:
                assert r.estimate_bytes is not None and r.mapping.measured_bytes
                extra = f"  eager {e.error:+.1%}" if e is not None and e.error is not None else ""
                print(f"{name[:72]:72s} {where:26s} {r.estimate_bytes / 2**30:6.2f} "
                      f"{r.mapping.measured_bytes / 2**30:6.2f} {r.error:+7.1%}{extra}")
    if errors:
        within = sum(e <= 0.05 for e in errors)
        print(f"\n{len(errors)} golden files of {len(rows)} cases compared; median |error| "
              f"{statistics.median(errors):.1%}, {within} within 5 %, max {max(errors):.1%}; "
              f"{len(skipped)} left out")
    if ns.all:
        for name, where, why in skipped:
            print(f"left out: {name} {where}: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
