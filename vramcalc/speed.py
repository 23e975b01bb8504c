"""Speed model: step time, tokens/s and MFU of one training layout (ranks plans, sizes clusters).

Pure closed-form arithmetic over a model spec, a GPU profile and a layout; no I/O, no torch.
Every formula, its source and the test that pins it are in docs/planning.md.

Legend: N_mm = parameters that take part in matrix multiplies per token (active parameters
minus the input-embedding lookup; a tied head counts once), L = layers, s = sequence length,
A = a·d (attention width: heads × head dim), b = micro-batch, m = micro-batches per step,
B = global batch (sequences) = dp·b·m, W = GPUs = dp·tp·pp·cp, p = pp, v = virtual stages,
c / w / g = bytes per element of the compute / weight / gradient dtype.

Compute (model FLOPs, the convention published MFU figures use; Chowdhery et al. 2022,
PaLM, App. B; Kaplan et al. 2020 for 6N):

    F_model per token = 6·N_mm + 12·L·s·A
    recompute full      adds the layers' forward: 2·(N_mm − V·h) + 4·L·s·A
    recompute selective adds the attention core: 4·L·s·A          (Korthikanti et al. 2022)
    (with full recompute this is Narayanan et al. 2021's 96·L·h²·(1 + s/6h + V/16Lh) per
    token for a 4h MLP without biases)
    t_compute = F_hw · B·s / W / (peak_dtype · efficiency)

`efficiency` is the GPU profile's `mfu_fraction` (calibrated on published MFU) or `--mfu`.
The attention term counts the full s×s products (causal kernels skip about half the work);
we keep the convention of the published MFU figures the efficiencies are calibrated on.

Pipeline bubble (Narayanan et al. 2021, Sec. 2.2): t_bubble = t_compute·(p − 1)/(v·m).

Exposed communication, ring collectives at the link's per-direction bandwidth:
all-reduce 2·(n−1)/n·M/bw, reduce-scatter or all-gather (n−1)/n·M/bw.

- TP (intra-node link): 4 all-reduces of b·(s/cp)·h·c per layer per micro-batch (2 forward,
  2 backward; Shoeybi et al. 2019), 6 with full recompute; sequence parallelism replaces
  each by an all-gather + reduce-scatter of the same volume (Korthikanti et al. 2022).
  Not overlapped.
- CP ring attention: 3·(cp−1) key/value chunk transfers per layer per micro-batch
  (4 with full recompute), overlapped with that layer's attention compute (same rule).
- EP: 4 all-to-alls of the routed tokens per MoE layer per micro-batch (6 with full
  recompute), not overlapped.
- DP / ZeRO over dp·cp ranks (intra-node link when the group fits in one node, else the
  inter-node link). Overlap assumption: each collective hides behind the compute of one
  micro-batch pass it can run alongside — gradient reductions behind a backward pass,
  parameter all-gathers behind a forward (or backward) pass — the excess is exposed, and
  never less than 10% of the collective (NCCL shares the GPU with the compute it hides
  behind; an assumption, OVERLAP_EXPOSED_FRACTION):
    ZeRO-0 (DDP): all-reduce of the gradients once per step;
    ZeRO-1: reduce-scatter once per step + all-gather of the updated weights;
    ZeRO-2: reduce-scatter every micro-batch + all-gather once;
    ZeRO-3 / FSDP: every micro-batch an all-gather in forward, another in backward and a
      reduce-scatter (Rajbhandari et al. 2019: 1.5× DDP volume);
    FSDP hybrid: ZeRO-3 inside the shard group + an all-reduce of the shard across groups.
- PP point-to-point: 2·v sends of b·(s/cp)·h·c/tp per micro-batch (activations forward,
  gradients backward), not overlapped.
- Offload over the host link (PCIe): optimizer offload moves this rank's gradient shard
  to the host and the updated weights back once per step and runs the optimizer on the
  CPU; parameter offload fetches the weight shard for every forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vramcalc.units import DTYPE_BITS

if TYPE_CHECKING:
    from vramcalc.hardware import GPUProfile
    from vramcalc.model import ModelSpec

# CPU optimizer step (DeepSpeed CPU-Adam): memory-bound; per parameter it reads and writes
# the fp32 master weight, momentum and variance (24 B), reads the fp32 gradient (4 B) and
# writes the 16-bit weight (2 B): 30 B, rounded to 32. Assumption, not measured.
CPU_OPTIMIZER_BYTES_PER_PARAM = 32
# Host memory bandwidth one node's CPU optimizer achieves, shared by the node's ranks.
# Assumption: about half the 409.6 GB/s peak of a 2-socket, 8-channel DDR4-3200 server.
HOST_MEMORY_BYTES_PER_S_PER_NODE = 200 * 10**9
# NVMe offload: aggregate read bandwidth of one node's drives. Assumption: 4 PCIe Gen4 NVMe
# drives at ~6.5 GB/s each (vendor sequential-read figures), shared by the node's ranks.
NVME_BYTES_PER_S_PER_NODE = 26 * 10**9
# Overlapped communication is never entirely free: NCCL kernels take SMs and memory
# bandwidth from the compute they run beside. Assumption: at least 10% of an overlapped
# collective's time shows in the step (it also breaks ties in favour of less traffic).
OVERLAP_EXPOSED_FRACTION = 0.1

_COMPUTE_DTYPE = {"fp32": "fp32", "amp-bf16": "bf16", "amp-fp16": "fp16", "bf16": "bf16",
                  "fp16": "fp16", "bf16-pure": "bf16"}
_WEIGHT_DTYPE = {"fp32": "fp32", "amp-bf16": "fp32", "amp-fp16": "fp32", "bf16": "bf16",
                 "fp16": "fp16", "bf16-pure": "bf16"}


@dataclass(frozen=True)
class Layout:
    """How one step runs: parallel degrees, sharding, batch split, recompute, offload.

    `shard_stage` is the ZeRO-equivalent stage (FSDP full/hybrid = 3, grad-op = 2);
    `shard_group` is set for FSDP hybrid (ranks per shard group).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    shard_stage: int = 0
    shard_group: int | None = None
    micro_batch_size: int = 1
    num_microbatches: int = 1
    recompute: str = "none"
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    offload: tuple[str, ...] = ()
    offload_device: str = "cpu"

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step."""
        return self.dp * self.micro_batch_size * self.num_microbatches


@dataclass(frozen=True)
class SpeedReport:
    """One step's time split (seconds, per GPU) and the throughput it implies."""

    step_time_s: float
    tokens_per_s: float
    mfu: float  # model FLOPs / (step time · GPUs · peak of the compute dtype)
    model_flops_per_token: float
    hardware_flops_per_token: float  # model FLOPs + recomputation
    peak_flops_per_gpu: float
    efficiency: float
    parts_s: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def _ring(n: int) -> float:
    """(n − 1)/n: the share of a buffer each rank sends in a ring reduce-scatter/all-gather."""
    return (n - 1) / n if n > 1 else 0.0


def _bytes(dtype: str) -> float:
    return DTYPE_BITS[dtype] / 8


def matmul_params(spec: ModelSpec) -> int:
    """N_mm: active parameters minus the input-embedding lookup (a tied head counts once)."""
    n = spec.num_active_params - spec.embedding_params
    if spec.tie_word_embeddings:
        n += spec.vocab_size * spec.hidden_size
    return n


def model_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """6·N_mm + 12·L·s·A: training FLOPs per token without recomputation (PaLM App. B)."""
    attn = spec.num_attention_heads * spec.head_size
    return 6.0 * matmul_params(spec) + 12.0 * spec.num_hidden_layers * seq_len * attn


def recompute_flops_per_token(spec: ModelSpec, seq_len: int, recompute: str) -> float:
    """Extra forward FLOPs per token: full = 2·(N_mm − V·h) + 4·L·s·A (the transformer
    layers run forward again; the output head does not), selective = 4·L·s·A."""
    attn_fwd = 4.0 * spec.num_hidden_layers * seq_len * spec.num_attention_heads * spec.head_size
    if recompute == "full":
        head = spec.vocab_size * spec.hidden_size
        return 2.0 * (matmul_params(spec) - head) + attn_fwd
    if recompute == "selective":
        return attn_fwd
    return 0.0


def peak_flops(gpu: GPUProfile, dtype: str) -> tuple[float, str | None]:
    """Dense peak FLOP/s for `dtype`; falls back to fp16, then fp32, with a note."""
    tflops = gpu.peak_tflops(dtype)
    if tflops is not None:
        return tflops * 1e12, None
    for alt in ("fp16", "fp32", "bf16"):
        t = gpu.peak_tflops(alt)
        if t is not None:
            return t * 1e12, (f"{gpu.name} has no {dtype} peak in its profile; "
                              f"speed uses its {alt} peak ({t:g} TFLOP/s)")
    return 1e12, f"{gpu.name} has no TFLOP/s figure; speed assumes 1 TFLOP/s"


PART_NAMES = ("compute", "bubble", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "pp_comm",
              "offload")


class SpeedModel:
    """The speed model for one model, GPU, node size, sequence length and precision.

    Constants are computed once; `base_parts` (layout terms) and `sharding_parts` (ZeRO /
    offload terms) are plain float arithmetic so the planner can call them for thousands
    of candidates. `report(layout)` gives the full SpeedReport.
    """

    def __init__(self, spec: ModelSpec, gpu: GPUProfile, gpus_per_node: int, seq_len: int,
                 precision: str = "bf16", efficiency: float | None = None,
                 capacity_factor: float = 1.0) -> None:
        self.spec, self.gpu, self.gpn, self.seq_len = spec, gpu, gpus_per_node, seq_len
        self.efficiency = efficiency if efficiency is not None else gpu.mfu_fraction
        c_dtype = _COMPUTE_DTYPE[precision]
        self.c = _bytes(c_dtype)
        self.w = _bytes(_WEIGHT_DTYPE[precision])
        self.g = self.w  # gradients are stored in the weight dtype (vramcalc.training)
        self.peak, note = peak_flops(gpu, c_dtype)
        self.notes: tuple[str, ...] = (note,) if note else ()
        self.rate = self.peak * self.efficiency
        self.f_model = model_flops_per_token(spec, seq_len)
        self.f_hw = {r: self.f_model + recompute_flops_per_token(spec, seq_len, r)
                     for r in ("none", "selective", "full")}
        n_exp = spec.num_moe_layers * spec.num_local_experts * spec.expert_params
        self.n_exp = n_exp
        self.n_dense = spec.num_params - n_exp
        self.attn_width = spec.num_attention_heads * spec.head_size
        self.intra, self.inter = gpu.intra_node_bytes_per_s, gpu.inter_node_bytes_per_s
        self.capacity_factor = capacity_factor

    def base_parts(self, dp: int, tp: int, pp: int, cp: int, ep: int, sp: bool, b: int,
                   m: int, recompute: str, v: int) -> tuple[float, ...]:
        """(compute, bubble, tp, cp, ep, pp, forward of one micro-batch, backward of one)."""
        spec, gpn = self.spec, self.gpn
        W = dp * tp * pp * cp
        seq = self.seq_len
        full = recompute == "full"
        f_hw = self.f_hw[recompute]
        t_compute = f_hw * (dp * b * m * seq) / W / self.rate
        t_mb = t_compute / m
        t_fwd = t_mb * (self.f_model / 3.0) / f_hw
        t_bwd = t_mb - t_fwd
        t_bubble = t_compute * (pp - 1) / (v * m)
        s_local = seq / cp
        h = spec.hidden_size
        layers_here = spec.num_hidden_layers / pp
        intra, inter = self.intra, self.inter
        t_tp = 0.0
        if tp > 1:
            bw = intra if tp <= gpn else inter
            n_coll = (6 if full else 4) * layers_here * m
            t_tp = n_coll * 2 * _ring(tp) * b * s_local * h * self.c / bw
        t_cp = 0.0
        if cp > 1:
            bw = intra if tp * cp <= gpn else inter
            kv_heads = max(spec.kv_heads // tp, 1)
            kv_chunk = 2 * b * s_local * kv_heads * spec.head_size * self.c
            comm = (4 if full else 3) * (cp - 1) * kv_chunk / bw
            attn = (16.0 if full else 12.0) * seq * (self.attn_width / tp) * b * s_local / self.rate
            t_cp = _hidden(comm, attn) * layers_here * m
        t_ep = 0.0
        if ep > 1 and spec.is_moe:
            bw = intra if tp * cp * ep <= gpn else inter
            routed = b * s_local * h * self.c * spec.num_experts_per_tok * self.capacity_factor
            if sp:
                routed /= tp
            n_coll = (6 if full else 4) * (spec.num_moe_layers / pp) * m
            t_ep = n_coll * _ring(ep) * routed / bw
        t_pp = 0.0
        if pp > 1:
            bw = intra if W <= gpn else inter
            t_pp = 2 * v * m * (b * s_local * h * self.c / tp) / bw
        return t_compute, t_bubble, t_tp, t_cp, t_ep, t_pp, t_fwd, t_bwd

    def sharding_parts(self, dp: int, tp: int, pp: int, cp: int, ep: int, m: int, stage: int,
                       shard_group: int | None, offload: tuple[str, ...], offload_device: str,
                       t_fwd: float, t_bwd: float) -> tuple[float, float]:
        """(data-parallel / ZeRO communication, offload) seconds per step."""
        gpn, intra, inter = self.gpn, self.intra, self.inter
        psi_d = self.n_dense / (tp * pp)
        psi_e = self.n_exp / (tp * pp * ep)
        w, g = self.w, self.g
        d_d, d_e = dp * cp, max(dp * cp // ep, 1)
        bw = intra if tp * cp * dp <= gpn else inter
        t_dp = 0.0
        if d_d > 1 or d_e > 1:
            if shard_group and shard_group < dp:
                S = shard_group
                bw_s = intra if tp * cp * S <= gpn else inter
                frac = psi_d * _ring(S) + psi_e * _ring(max(S // ep, 1))
                ag, red = frac * w / bw_s, frac * g / bw_s
                t_dp = m * (_hidden(ag, t_fwd) + _hidden(ag + red, t_bwd))
                shard_bytes = (psi_d + psi_e) / S * g
                t_dp += _hidden(2 * _ring(dp // S * cp) * shard_bytes / bw, t_bwd)
            else:
                frac = psi_d * _ring(d_d) + psi_e * _ring(d_e)
                ag, red = frac * w / bw, frac * g / bw
                if stage == 0:
                    t_dp = _hidden(2 * red, t_bwd)
                elif stage == 1:
                    t_dp = _hidden(red, t_bwd) + _hidden(ag, t_fwd)
                elif stage == 2:
                    t_dp = m * _hidden(red, t_bwd) + _hidden(ag, t_fwd)
                else:
                    t_dp = m * (_hidden(ag, t_fwd) + _hidden(ag + red, t_bwd))
        t_off = 0.0
        if offload:
            shard = (shard_group or dp) if stage >= 1 else 1
            psi_s = (psi_d + psi_e) / shard
            host = self.gpu.host_link_bytes_per_s
            if offload_device == "nvme":
                host = min(host, NVME_BYTES_PER_S_PER_NODE / gpn)
            if "optimizer" in offload:
                t_off += psi_s * (4 + w) / host  # fp32 gradients out, weights back
                t_off += psi_s * CPU_OPTIMIZER_BYTES_PER_PARAM / (
                    HOST_MEMORY_BYTES_PER_S_PER_NODE / gpn)
            elif "gradients" in offload:
                t_off += psi_s * g / host
            if "params" in offload:
                t_off += 2 * m * psi_s * w / host
        return t_dp, t_off

    def report(self, lay: Layout) -> SpeedReport:
        """Full speed report of one layout."""
        v = lay.virtual_stages if lay.pp_schedule == "interleaved" else 1
        comp, bub, ttp, tcp, tep, tpp, t_fwd, t_bwd = self.base_parts(
            lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.sequence_parallel,
            lay.micro_batch_size, lay.num_microbatches, lay.recompute, v)
        tdp, toff = self.sharding_parts(lay.dp, lay.tp, lay.pp, lay.cp, lay.ep,
                                        lay.num_microbatches, lay.shard_stage, lay.shard_group,
                                        lay.offload, lay.offload_device, t_fwd, t_bwd)
        parts = dict(zip(PART_NAMES, (comp, bub, ttp, tcp, tep, tdp, tpp, toff), strict=True))
        step = sum(parts.values())
        tokens = lay.global_batch_size * self.seq_len
        W = lay.num_gpus
        return SpeedReport(
            step_time_s=step, tokens_per_s=tokens / step,
            mfu=self.f_model * tokens / (step * W * self.peak),
            model_flops_per_token=self.f_model,
            hardware_flops_per_token=self.f_hw[lay.recompute],
            peak_flops_per_gpu=self.peak, efficiency=self.efficiency, parts_s=parts,
            notes=self.notes)


def _hidden(comm: float, window: float) -> float:
    """Exposed part of a collective overlapped with `window` seconds of compute: the excess,
    and never less than OVERLAP_EXPOSED_FRACTION of it."""
    return max(comm - window, OVERLAP_EXPOSED_FRACTION * comm)


def estimate_speed(
    spec: ModelSpec,
    gpu: GPUProfile,
    gpus_per_node: int,
    layout: Layout,
    seq_len: int,
    precision: str = "bf16",
    efficiency: float | None = None,
    capacity_factor: float = 1.0,
) -> SpeedReport:
    """Step time of `layout` on `layout.num_gpus` GPUs with `gpus_per_node` per node.

    See the module docstring for every term. Seconds are per step; tokens/s are for the
    whole cluster.
    """
    return SpeedModel(spec, gpu, gpus_per_node, seq_len, precision, efficiency,
                      capacity_factor).report(layout)


def layout_of(scn) -> Layout:  # noqa: ANN001 - a Scenario (import kept light)
    """The Layout of a resolved Scenario (dp filled in)."""
    par, tr = scn.parallel, scn.training
    return Layout(
        dp=par.dp_degree, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep,
        sequence_parallel=par.sequence_parallel, shard_stage=par.shard_stage,
        shard_group=par.shard_group if par.fsdp == "hybrid" else None,
        micro_batch_size=tr.micro_batch_size,
        num_microbatches=par.num_microbatches or tr.grad_accum,
        recompute=tr.recompute, pp_schedule=par.pp_schedule,
        virtual_stages=par.virtual_stages, offload=tuple(par.offload),
        offload_device=par.offload_device,
    )


def scenario_speed(scn, efficiency: float | None = None) -> SpeedReport:  # noqa: ANN001
    """Speed of a resolved Scenario with a cluster."""
    if scn.cluster is None:
        raise ValueError("speed needs a cluster (GPU type and count)")
    return estimate_speed(scn.model, scn.cluster.gpu, scn.cluster.gpus_per_node, layout_of(scn),
                          scn.training.seq_len, scn.training.precision, efficiency,
                          scn.parallel.capacity_factor)
