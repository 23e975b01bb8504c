"""Serving layouts for a target context and concurrency (`plan --serve`, `size --serve`).

Candidates per GPU type: TP in powers of two up to the GPUs of one node (TP must divide the
attention heads, and the KV heads divide it or it them), PP in powers of two while one copy
needs more than a node; each copy is `serve_estimate`d, and the replicas needed for the
concurrency are ⌈concurrency / sequences one copy holds⌉ (the KV-limited count, bounded by
max_num_seqs). Layouts that start and hold at least one sequence are ranked by GPUs needed,
then by cost per hour, then by the larger KV capacity. Deterministic; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramcalc.errors import InputError
from vramcalc.hardware import Cluster, GPUProfile
from vramcalc.model import ModelSpec
from vramcalc.serve.estimate import ServeConfig, ServeReport, serve_estimate
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
