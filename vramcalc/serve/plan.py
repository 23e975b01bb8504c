"""Serving layouts for a target context and concurrency (`plan --serve`, `size --serve`).

Candidates per GPU type: TP in powers of two up to the GPUs of one node (TP must divide the
attention heads, and the KV heads divide it or it them), PP in powers of two while one copy
needs more than a node; each copy is `serve_estimate`d, and the replicas needed for the
concurrency are ⌈concurrency / sequences one copy holds⌉ (the KV-limited count, bounded by
max_num_seqs). Layouts that start and hold at least one sequence are ranked by GPUs needed,
then by cost per hour, then by the larger KV capacity.

When no layout holds the target on the GPUs a user has, `fixes_within` names the changes
that do, each with the layout it fits in: lighter weights (fp8, then a 4-bit checkpoint,
where the GPU runs vLLM's kernels for them),
each at the longest --max-model-len that fits when the full length does not, and an fp8 KV
cache. Deterministic; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramcalc.errors import InputError
from vramcalc.hardware import Cluster, GPUProfile
from vramcalc.model import ModelSpec
from vramcalc.serve.estimate import ServeConfig, ServeReport, serve_estimate
from vramcalc.serve.weights import unsupported_layout
from vramcalc.units import ceil_div

HOURS_PER_MONTH = 730  # 8,760 hours a year / 12
MAX_PP = 16


@dataclass(frozen=True)
class ServeOption:
    gpu: GPUProfile
    tp: int
    pp: int
    replicas: int
    report: ServeReport  # one copy of the model (tp × pp GPUs)

    @property
    def gpus_per_copy(self) -> int:
        return self.tp * self.pp

    @property
    def num_gpus(self) -> int:
        return self.replicas * self.gpus_per_copy

    @property
    def usd_per_hour(self) -> float | None:
        price = self.gpu.price_usd_per_hour
        return None if price is None else price * self.num_gpus

    @property
    def usd_per_month(self) -> float | None:
        hourly = self.usd_per_hour
        return None if hourly is None else hourly * HOURS_PER_MONTH

    def to_json(self) -> dict[str, object]:
        return {"gpu": self.gpu.id, "gpu_name": self.gpu.name, "tp": self.tp, "pp": self.pp,
                "replicas": self.replicas, "num_gpus": self.num_gpus,
                "seqs_per_copy": self.report.max_concurrent_seqs,
                "kv_capacity_tokens": self.report.kv_capacity_tokens,
                "device_total_bytes": self.report.device_total_bytes,
                "usd_per_hour": self.usd_per_hour, "usd_per_month": self.usd_per_month}


def _divides_heads(spec: ModelSpec, tp: int) -> bool:
    g = spec.kv_heads
    return spec.num_attention_heads % tp == 0 and (spec.is_mla or g % tp == 0 or tp % g == 0)


def layouts(spec: ModelSpec, gpu: GPUProfile) -> list[tuple[int, int]]:
    """(tp, pp) candidates for one GPU type: TP within a node, PP across nodes."""
    out = []
    tp = 1
    while tp <= gpu.gpus_per_node:
        if _divides_heads(spec, tp):
            out.append((tp, 1))
        tp *= 2
    top = max((t for t, _ in out), default=1)
    pp = 2
    while pp <= min(MAX_PP, spec.num_hidden_layers):
        out.append((top, pp))
        pp *= 2
    return out


def serve_options(spec: ModelSpec, gpus: list[GPUProfile], base: ServeConfig,
                  concurrency: int) -> list[ServeOption]:
    """Every layout of every GPU type that serves `concurrency` sequences of the base
    config's max_model_len, best first (module docstring)."""
    if concurrency < 1:
        raise InputError(f"--concurrency must be at least 1, got {concurrency}")
    if spec.is_encoder_decoder:
        raise InputError(f"{spec.name}: serving encoder-decoder models (T5, BART) is not "
                         "modelled")
    out: list[ServeOption] = []
    for gpu in gpus:
        for tp, pp in layouts(spec, gpu):
            nodes = ceil_div(tp * pp, gpu.gpus_per_node)
            cluster = Cluster(gpu=gpu, num_nodes=nodes,
                              gpus_per_node=tp * pp if nodes == 1 else gpu.gpus_per_node)
            if cluster.num_gpus % (tp * pp):
                continue
            cfg = base.model_copy(update={"tp": tp, "pp": pp})
            report = serve_estimate(spec, cluster, cfg)
            if not report.fits or report.max_concurrent_seqs < 1:
                continue
            replicas = ceil_div(concurrency, report.max_concurrent_seqs)
            out.append(ServeOption(gpu, tp, pp, replicas, report))
    out.sort(key=lambda o: (o.num_gpus, o.usd_per_hour if o.usd_per_hour is not None else 1e18,
                            -o.report.kv_capacity_tokens, o.gpu.id, o.tp, o.pp))
    return out


def cheapest_per_gpu(options: list[ServeOption]) -> list[ServeOption]:
    """The first (fewest GPUs) option of each GPU type, in the order of `options`."""
    seen: set[str] = set()
    out = []
    for o in options:
        if o.gpu.id not in seen:
            seen.add(o.gpu.id)
            out.append(o)
    return out


# lighter weight layouts to suggest, per engine, in the order tried: vLLM and SGLang load fp8
# and AWQ checkpoints; transformers loads bitsandbytes 4-bit
LIGHTER_WEIGHTS = {"vllm": ("fp8", "awq"), "vllm-v0": ("fp8", "awq"), "sglang": ("fp8", "awq"),
                   "hf": ("bnb-nf4",)}
WEIGHT_BITS = {"none": 16, "fp8": 8, "int8": 8, "awq": 4, "gptq": 4, "bnb-nf4": 4}


@dataclass(frozen=True)
class ServeFix:
    """A change of the serving flags, and the layout (fewest GPUs) that then fits."""

    change: dict[str, object] = field(hash=False)  # ServeConfig field -> value
    option: ServeOption

    def to_json(self) -> dict[str, object]:
        return {"change": dict(self.change), "option": self.option.to_json()}


def _first_within(spec: ModelSpec, gpu: GPUProfile, cfg: ServeConfig, concurrency: int,
                  num_gpus: int) -> ServeOption | None:
    return next((o for o in serve_options(spec, [gpu], cfg, concurrency)
                 if o.num_gpus <= num_gpus), None)


def _longest(spec: ModelSpec, gpu: GPUProfile, cfg: ServeConfig, concurrency: int,
             num_gpus: int, max_len: int) -> tuple[int, ServeOption] | None:
    """The longest max_model_len below `max_len` that some layout within `num_gpus` serves
    (a longer context only adds KV and, for vllm-v0 and hf, prefill tokens, so bisect)."""
    found = _first_within(spec, gpu, cfg.model_copy(update={"max_model_len": 1}), concurrency,
                          num_gpus)
    if found is None:
        return None
    lo, hi = 1, max_len  # lo is served, hi is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        o = _first_within(spec, gpu, cfg.model_copy(update={"max_model_len": mid}),
                          concurrency, num_gpus)
        if o is None:
            hi = mid
        else:
            lo, found = mid, o
    return lo, found


def fixes_within(spec: ModelSpec, gpu: GPUProfile, base: ServeConfig, concurrency: int,
                 num_gpus: int) -> list[ServeFix]:
    """Changes that serve `concurrency` sequences on at most `num_gpus` GPUs of `gpu` when
    the base flags do not (module docstring); empty when they do."""
    if _first_within(spec, gpu, base, concurrency, num_gpus):
        return []
    max_len = base.max_model_len or spec.max_position_embeddings
    out: list[ServeFix] = []
    weights = [base.quantization] + [q for q in LIGHTER_WEIGHTS[base.engine]
                                     if WEIGHT_BITS[q] < WEIGHT_BITS[base.quantization]
                                     and not unsupported_layout(q, gpu)]
    for quant in weights:
        cfg = base.model_copy(update={"quantization": quant})
        change: dict[str, object] = {} if quant == base.quantization else {"quantization": quant}
        # the base layout's full length is known not to fit (above)
        full = _first_within(spec, gpu, cfg, concurrency, num_gpus) if change else None
        if full:
            out.append(ServeFix(change, full))
            break
        shorter = _longest(spec, gpu, cfg, concurrency, num_gpus, max_len)
        if shorter:
            out.append(ServeFix({**change, "max_model_len": shorter[0]}, shorter[1]))
    if base.engine != "hf" and base.kv_cache_dtype != "fp8":
        cfg = base.model_copy(update={"kv_cache_dtype": "fp8"})
        full = _first_within(spec, gpu, cfg, concurrency, num_gpus)
        if full:
            out.append(ServeFix({"kv_cache_dtype": "fp8"}, full))
    return out
