"""The search space of one plan: the layout groups of a cluster and the options of each.

A layout group is (tp, pp, cp, dp, sp, ep) with its micro-batch splits: tp within a node,
dividing the attention heads (and the KV heads, or a multiple of them); pp dividing the
layers, or as the uneven split given to plan allows (`split_schedules`); cp dividing the sequence (an even share per rank); dp the rest, dividing the global
batch; ep for MoE models, dividing the experts and dp·cp. Multi-latent attention models
keep tp and cp to what the chosen profile's MLA activations cover (`mla_refusal`: the
estimate's own check, vramcalc/scenario.py `mla_unsupported`).
vramcalc/planner/candidates.py turns the groups into candidates. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from vramcalc.hardware import GPUProfile
from vramcalc.parallel import pipeline_split_problem
from vramcalc.planner.request import UNSUPPORTED, PlanRequest
from vramcalc.scenario import Scenario, capability_problem, mla_unsupported
from vramcalc.training import FINETUNES, TrainingConfig

# Megatron-LM's uneven pipeline splits (--first-stage-layers, ...): given to plan, they stay
# on every layout, and pp is searched among the sizes whose split Megatron-LM accepts
SPLIT_KEYS = ("first_stage_layers", "last_stage_layers", "embedding_in_split", "loss_in_split",
              "stage_layers")

Group = tuple  # (tp, pp, cp, dp, sp, ep, [(b, m, [(sched, v), ...]), ...])
Sharding = tuple[int, str, "int | None", int]  # (zero, fsdp, shard_group, shard_stage)


def mla_refusal(base: Scenario, tp: int = 1, cp: int = 1,
                training: TrainingConfig | None = None) -> str | None:
    """What the estimate refuses of a multi-latent attention model at this tp and cp (and
    `training`, default the base's): vramcalc/scenario.py `mla_unsupported`, the check
    `Scenario.resolved` runs; None when it is covered or the model has no MLA."""
    if not base.model.is_mla:
        return None
    par = base.parallel.model_copy(update={"tp": tp, "cp": cp})
    upd: dict[str, Any] = {"parallel": par}
    if training is not None:
        upd["training"] = training
    return mla_unsupported(base.model_copy(update=upd))


def mla_note(base: Scenario) -> str | None:
    """Which parallel axes a multi-latent attention plan holds at 1, and why (None when none
    is held or the model has no MLA)."""
    if not base.model.is_mla or mla_refusal(base):
        return None
    held = [axis for axis, (tp, cp) in (("tp", (2, 1)), ("cp", (1, 2)))
            if mla_refusal(base, tp, cp)]
    if not held:
        return None
    axes = " and ".join(held)
    return (f"{base.model.name}: multi-latent attention's activations are modelled under the "
            f"{base.training.framework} profile without {axes} > 1 (vramcalc/scenario.py "
            f"`mla_unsupported`; estimate refuses those layouts too): {axes} held at 1")


def pipeline_split(base: Scenario) -> dict[str, Any]:
    """The uneven pipeline split the base layout carries (SPLIT_KEYS that are set)."""
    return {k: v for k in SPLIT_KEYS if (v := getattr(base.parallel, k))}


def split_schedules(base: Scenario, pp: int) -> tuple[bool, bool]:
    """(1F1B, interleaved with v = 2) at pipeline size `pp`: whether the base's layers split
    over it — evenly, as its uneven split asks (the estimate's own check,
    `pipeline_split_problem`), or, for the torchtitan profile, as torchtitan splits them
    (`stack_rules.torchtitan_stage_layers`)."""
    spec, L = base.model, base.model.num_hidden_layers
    if not pipeline_split(base):
        if base.training.framework == "torchtitan":  # it splits unevenly by itself, a
            return pp <= L, 1 < pp and 2 * pp <= L  # layer a stage at least
        return L % pp == 0, pp > 1 and L % (2 * pp) == 0
    if pp == 1:
        return False, False  # the split needs pipelining
    ok = [pipeline_split_problem(spec, base.training, base.parallel.model_copy(
        update={"pp": pp, "pp_schedule": sched, "virtual_stages": v})) is None
        for sched, v in (("1f1b", 1), ("interleaved", 2))]
    return ok[0], ok[1]


def split_refusal(base: Scenario, num_gpus: int) -> str | None:
    """Why the base's uneven pipeline split fits no pipeline size of `num_gpus` GPUs (the
    estimate's message at the smallest size), or None."""
    split = pipeline_split(base)
    sizes = [pp for pp in divisors(num_gpus) if pp > 1]
    if not split or any(split_schedules(base, pp)[0] for pp in sizes):
        return None
    flags = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else " " + (
        ",".join(map(str, v)) if isinstance(v, tuple) else str(v))) for k, v in split.items())
    why = (pipeline_split_problem(base.model, base.training, base.parallel.model_copy(
        update={"pp": sizes[0]})) if sizes else "one GPU runs no pipeline")
    return (f"no pipeline-parallel size dividing {num_gpus} GPUs takes the split {flags} "
            f"(at pp={sizes[0] if sizes else 1}: {why})")


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def pow2_upto(n: int) -> list[int]:
    return [1 << k for k in range(n.bit_length())] if n >= 1 else []


def finetune_supported() -> bool:
    """Whether `--allow finetune` has methods to search (vramcalc/finetune.py)."""
    return len(FINETUNES) > 1


def given(pinned: Mapping[str, Any], key: str) -> bool:
    return pinned.get(key) is not None


def pick(pinned: Mapping[str, Any], key: str, values: Iterable[Any]) -> list[Any]:
    if given(pinned, key):
        return [v for v in values if v == pinned[key]]
    return list(values)


def sharding_options(dp: int, cp: int, tp: int, pp: int, ep: int, gpn: int,
               pinned: Mapping[str, Any], fsdp_only: bool = False) -> list[Sharding]:
    """(zero, fsdp, shard_group, shard_stage) options for this data-parallel size.

    ZeRO 0-3 without pipelining; with pipelining ZeRO 0-1 and FSDP shard-grad-op / full
    (DeepSpeed runs ZeRO-2/3 without pipeline parallelism only; Megatron and torchtitan
    pipeline with a distributed optimizer or FSDP). FSDP hybrid shards within a node.
    """
    opts: list[Sharding] = [(0, "none", None, 0), (1, "none", None, 1)]  # dp 1: for offload
    if dp > 1:
        if pp == 1:  # torchtitan, torchtune (fsdp_only): FSDP2 full; ZeRO stages refused
            opts += [(0, "full", None, 3)] if fsdp_only else [(2, "none", None, 2), (3, "none", None, 3)]
        else:
            opts += [(0, "grad-op", None, 2), (0, "full", None, 3)]
        per_node = gpn // (tp * cp) if tp * cp <= gpn else 0
        if 1 < per_node < dp and dp % per_node == 0 and per_node % ep == 0:
            opts.append((0, "hybrid", per_node, 3))
    if given(pinned, "fsdp") or given(pinned, "zero") or given(pinned, "shard_group"):
        f = pinned.get("fsdp") or "none"
        z = pinned.get("zero") or 0
        if f == "none":
            return [(z, "none", None, z)]
        stage = {"full": 3, "hybrid": 3, "grad-op": 2}[f]
        group = pinned.get("shard_group") if f == "hybrid" else None
        if f == "hybrid" and (not group or dp % group):
            return []
        return [(z, f, group, stage)]  # both pinned: the engine refuses ZeRO with FSDP
    return opts


def offload_options(stage: int, allowed: bool, pinned: Mapping[str, Any]) -> list[tuple[str, ...]]:
    if "offload" in pinned and pinned["offload"] is not None:
        off = tuple(pinned["offload"])
        if (off and stage == 0) or ("params" in off and stage != 3) or (
                "gradients" in off and stage < 2):
            return []
        return [off]
    if not allowed:
        return [()]
    out: list[tuple[str, ...]] = [()]
    if stage >= 1:
        out.append(("optimizer",))
    if stage == 3:
        out.append(("optimizer", "params"))
    return out


def variants(base: Scenario, req: PlanRequest, gpu: GPUProfile
             ) -> list[tuple[str, str, str | None, tuple[str, ...]]]:
    """(precision, optimizer, finetune, changed settings) combinations allowed."""
    tr = base.training
    precs: list[str] = [tr.precision]
    if "precision" in req.allow:
        extra: tuple[str, ...] = ("bf16", "bf16-pure") if gpu.peak_tflops("bf16") else ("fp16",)
        if tr.framework == "hf":  # HF Trainer's bf16=True over a model loaded in bf16
            extra += ("bf16-autocast",) if gpu.peak_tflops("bf16") else ("fp16-autocast",)
        if gpu.peak_tflops("fp8") and not tr.float8:  # FP8 tensor cores (torchtitan: its
            extra += ("fp8",)  # --float8, candidates.precision_update); refusals go later
        precs = [p for p in precs + [x for x in extra if x not in precs]  # what the GPU runs
                 if not capability_problem(tr.model_copy(update={"precision": p}), gpu)]
    opts: list[str] = [tr.optimizer]
    if "optimizer" in req.allow and tr.optimizer in ("adam", "adamw"):
        opts.append("adamw-8bit")
    fts: list[str | None] = [tr.finetune]
    if "finetune" in req.allow:
        fts += [f for f in FINETUNES if f != tr.finetune]
    out: list[tuple[str, str, str | None, tuple[str, ...]]] = []
    for p in precs:
        for o in opts:
            for f in fts:
                changed = tuple(n for n, new, old in (("precision", p, tr.precision),
                                                     ("optimizer", o, tr.optimizer),
                                                     ("finetune", f, tr.finetune)) if new != old)
                out.append((p, o, f, changed))
    return out


def layouts(base: Scenario, req: PlanRequest) -> Iterator[Group]:
    """(tp, pp, cp, dp, sp, ep, [(b, m, [(sched, v), ...]), ...]) of every valid layout,
    micro-batches ascending; a multi-latent attention model's only at the tp and cp its
    profile covers (`mla_refusal`)."""
    assert base.cluster is not None
    spec, tr, cl = base.model, base.training, base.cluster
    pinned = req.pinned
    W, gpn = cl.num_gpus, cl.gpus_per_node
    seq = tr.seq_len
    B = req.batch_for(seq)
    heads, kv = spec.num_attention_heads, spec.kv_heads
    accum_pin = pinned.get("grad_accum") or pinned.get("num_microbatches")
    off_limits = UNSUPPORTED.get(tr.framework, (frozenset(), ""))[0]
    for tp in pick(pinned, "tp", divisors(min(gpn, W))):
        if W % tp or heads % tp or (kv % tp and tp % kv) or (
                spec.is_mla and mla_refusal(base, tp)):
            continue
        for pp in pick(pinned, "pp", divisors(W // tp)):
            one_f_one_b, interleaved = split_schedules(base, pp)
            if not one_f_one_b or (pp > 1 and "pp" in off_limits):
                continue
            for cp in pick(pinned, "cp", divisors(W // (tp * pp))):
                if seq % cp or (cp > 1 and (seq // cp) % 2) or (
                        spec.is_mla and cp > 1 and mla_refusal(base, tp, cp)):
                    continue
                dp = W // (tp * pp * cp)
                if (given(pinned, "dp") and pinned["dp"] != dp) or B % dp:
                    continue
                sp_ok = tp > 1 and seq % (tp * cp) == 0
                if given(pinned, "sequence_parallel"):
                    sps = [pinned["sequence_parallel"]] if (
                        sp_ok or not pinned["sequence_parallel"]) else []
                else:
                    sps = [sp_ok]
                eps = [1]
                if spec.is_moe:
                    eps = [e for e in divisors(spec.num_local_experts) if (dp * cp) % e == 0]
                eps = [e for e in pick(pinned, "ep", eps) if e == 1 or "ep" not in off_limits]
                per_rank = B // dp
                if given(pinned, "micro_batch_size"):
                    b0 = pinned["micro_batch_size"]
                    mbs_list = [b0] if per_rank % b0 == 0 else []
                else:
                    mbs_list = [b for b in pow2_upto(min(per_rank, req.max_micro_batch))
                                if per_rank % b == 0]
                    if per_rank <= req.max_micro_batch and per_rank not in mbs_list:
                        mbs_list.append(per_rank)
                batches = []
                for b in mbs_list:
                    m = per_rank // b
                    if accum_pin is not None and m != accum_pin:
                        continue
                    if given(pinned, "pp_schedule"):
                        sch = pinned["pp_schedule"]
                        v = pinned.get("virtual_stages") or (2 if sch == "interleaved" else 1)
                        scheds = [(sch, v)] if pp > 1 or sch == "1f1b" else []
                    else:
                        # GPipe keeps all m micro-batches in flight for the same bubble as
                        # 1F1B, so it is never better; searched only when asked for.
                        scheds = [("1f1b", 1)]
                        if interleaved and m % pp == 0:
                            scheds.append(("interleaved", 2))
                    if scheds:
                        batches.append((b, m, scheds))
                if not batches:
                    continue
                for sp in sps:
                    for ep in eps:
                        yield tp, pp, cp, dp, sp, ep, batches
