"""Speed model: step time, tokens/s and MFU of one training layout (ranks plans, sizes clusters).

Pure closed-form arithmetic over a model spec, a GPU profile and a layout; no I/O, no torch.
Every formula, its source and the test that pins it are in docs/planning.md.

Legend: N_mm = parameters that take part in matrix multiplies per token (active parameters minus
the input-embedding lookup; a tied head counts once), L = layers, s = sequence length, A = a·d
(attention width: heads × head dim; vramcalc/flops.py `attention_width`), b = micro-batch, m =
micro-batches per step, B = global batch (sequences) = dp·b·m, W = GPUs = dp·tp·pp·cp, p = pp, v =
virtual stages, c / w / g = bytes per element of the compute / weight / gradient dtype.

Compute (model FLOPs, the convention published MFU figures use; Chowdhery et al. 2022,
PaLM, App. B; Kaplan et al. 2020 for 6N), vramcalc/flops.py (multi-latent attention's
A = a·(d_qk + d_v)/2 and the multi-token-prediction depths there):

    F_model per token = 6·N_mm + 12·L·s·A
    recompute full      adds the layers' forward: 2·(N_mm − V·h) + 4·L·s·A
    recompute selective adds the attention core: 4·L·s·A (Korthikanti et al. 2022); under
    torchtitan its per-op SAC's unsaved mms, or the full forward of every N-th layer
    t_compute = F_hw · B·s / W / (peak_dtype · efficiency)

Parameter-efficient fine-tuning (LoRA, QLoRA, DoRA; `finetune`): the frozen base skips the
weight-gradient matmuls, so per token the base costs its forward 2·N_mm and the input gradients
2·N_mm, and the N_ad adapter parameters the usual 6·N_ad (Hu et al. 2021, Sec. 4.2 ascribes LoRA's
~25 % training speed-up to not computing most gradients):

    F_model per token (PEFT) = 4·N_mm + 6·N_ad + 12·L·s·A
    recompute full adds 2·(N_mm − V·h) + 2·N_ad + 4·L·s·A; selective 4·L·s·A

MFU counts F_model (the PaLM definition: no recomputation), so a LoRA step at the same efficiency
shows full training's MFU and a tokens/s higher by (6·N_mm + 12LsA)/(4·N_mm + 6·N_ad + 12LsA);
tools that count LoRA with 6·N print 1.5× our MFU for the same step time. QLoRA also dequantizes
every NF4 weight before each matmul (a memory-bound pass timed at the profile's bandwidth), and
under PEFT data parallelism reduces the adapters' gradients only; docs/planning.md has both
formulas.

`efficiency` is the GPU profile's `mfu_fraction` (calibrated on published MFU) or `--mfu`. The
attention term counts the full s×s products (causal kernels skip about half), as the published MFU
figures the efficiencies are calibrated on do.

Pipeline bubble (Narayanan et al. 2021, Sec. 2.2): t_bubble = t_compute·(p − 1)/(v·m).

Exposed communication, ring collectives at the link's per-direction bandwidth:
all-reduce 2·(n−1)/n·M/bw, reduce-scatter or all-gather (n−1)/n·M/bw.

- TP (intra-node link, not overlapped): 4 all-reduces of b·(s/cp)·h·c per layer per
  micro-batch (2 forward, 2 backward; Shoeybi et al. 2019), 6 with full recompute; sequence
  parallelism replaces each by an all-gather + reduce-scatter of the same volume
  (Korthikanti et al. 2022).
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
      reduce-scatter (Rajbhandari et al. 2019: 1.5× DDP volume); under torchtitan's
      --float8-all-gather the block linears' weights are gathered at 1 byte each; under HF
      Trainer's no_sync() (`reduce_once`, hf_stack.py) FSDP reduces in the last one only;
    FSDP hybrid: ZeRO-3 inside the shard group + an all-reduce of the shard across groups.
- PP point-to-point: 2·v sends of b·(s/cp)·h·c/tp per micro-batch (activations forward,
  gradients backward), not overlapped.
- Offload over the host link (PCIe): optimizer offload moves this rank's gradient shard
  to the host and the updated weights back once per step and runs the optimizer on the
  CPU; parameter offload fetches the weight shard for every forward and backward.
- Paged optimizer states that do not fit on the device (their pages in host RAM,
  vramcalc.terms.optimizer_states.paged_residency) fault in over the host link when the
  optimizer step touches them and are evicted again for the next step's tensors: twice
  their bytes per step, not overlapped (the step waits on its page faults).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramcalc.finetune import _finetune_shapes
from vramcalc.flops import (
    attention_width,
    fp8_peak_flops,
    model_flops_per_token,
    peak_flops,
    recompute_flops_per_token,
    seq2seq_flops,
)
from vramcalc.hardware import GPUProfile
from vramcalc.hf_stack import trainer_no_sync
from vramcalc.model import ModelSpec
from vramcalc.model_tensors import param_tensors
from vramcalc.scenario import Scenario
from vramcalc.training import COMPUTE_DTYPE, WEIGHT_DTYPE, TrainingConfig, adapter_dtype
from vramcalc.units import DTYPE_BITS

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
    paged_host_bytes: int = 0  # this rank's paged optimizer pages that live in host RAM
    reduce_once: bool = False  # FSDP gradients reduced once per step (HF Trainer's no_sync)

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


def float8_linear_params(spec: ModelSpec) -> int:
    """Parameters torchao's float8 all-gather sends at 1 byte: every block weight but the
    norms and the routed experts (convert_to_float8_training swaps each block nn.Linear; the
    embedding, final norm and output projection are not swapped; vramcalc/terms/float8_fsdp.py)."""
    return sum(t.numel * t.count for t in param_tensors(spec)
               if t.group == "layer" and "norm" not in t.name)


PART_NAMES = ("compute", "bubble", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "pp_comm",
              "offload", "dequant")


@dataclass(frozen=True)
class PeftCounts:
    """Whole-model counts of a parameter-efficient method, for the speed model: adapter
    parameters, NF4-quantized parameters, and bytes per step-relevant element."""

    adapter_params: int = 0
    quantized_params: int = 0
    adapter_bytes: float = 2.0  # bytes per adapter element (PEFT: fp32)
    # frozen weights as ZeRO-3/FSDP gather them, bytes: (dense, routed experts)
    gathered_weight_bytes: tuple[float, float] = (0.0, 0.0)


def peft_counts(spec: ModelSpec, precision: str, finetune: str, lora_rank: int = 8,
                lora_targets: str = "q,v", framework: str = "reference",
                extras: tuple[str, bool, bool] = ("", False, False),
                adapters_16bit: bool = False) -> PeftCounts | None:
    """PeftCounts of `finetune` on the whole model (None for full training); `extras`: the
    hf profile's modules_to_save, lora_embedding and lora_head (vramcalc/hf_stack.py)."""
    if finetune in ("full", "none", None):
        return None
    w_dtype = WEIGHT_DTYPE.get(precision, "bf16")
    a_dt = adapter_dtype(framework, w_dtype, adapters_16bit)
    fs = _finetune_shapes(spec, 1, ((spec.num_hidden_layers,),), 1, 0, finetune, lora_rank,
                          lora_targets, framework, a_dt, False, *extras)
    w = _bytes(w_dtype)
    dense = exp = 0.0
    for t in fs.frozen.tensors:
        b = t.numel * t.count * w
        exp, dense = (exp + b, dense) if t.is_expert else (exp, dense + b)
    for t in fs.quantized.tensors:
        b = t.numel * t.count * 0.5  # packed 4-bit data; absmax stays whole on every rank
        exp, dense = (exp + b, dense) if t.is_expert else (exp, dense + b)
    n_ad = fs.adapters.numel()
    return PeftCounts(adapter_params=n_ad, quantized_params=fs.quantized.numel(),
                      adapter_bytes=_bytes(a_dt),
                      gathered_weight_bytes=(dense + n_ad * _bytes(a_dt), exp))


class SpeedModel:
    """The speed model for one model, GPU, node size, sequence length and precision.

    Constants are computed once; `base_parts` (layout terms) and `sharding_parts` (ZeRO /
    offload terms) are plain float arithmetic so the planner can call them for thousands
    of candidates. `report(layout)` gives the full SpeedReport.
    """

    def __init__(self, spec: ModelSpec, gpu: GPUProfile, gpus_per_node: int, seq_len: int,
                 precision: str = "bf16", efficiency: float | None = None,
                 capacity_factor: float = 1.0, peft: PeftCounts | None = None,
                 selective: str | int = "core", float8: bool = False,
                 mtp_layers: int = 0, target_len: int | None = None,
                 float8_gather: bool = False) -> None:
        self.spec, self.gpu, self.gpn, self.seq_len = spec, gpu, gpus_per_node, seq_len
        self.efficiency = efficiency if efficiency is not None else gpu.mfu_fraction
        c_dtype = COMPUTE_DTYPE[precision]
        self.c = _bytes(c_dtype)
        self.w = _bytes(WEIGHT_DTYPE[precision])
        self.g = self.w  # gradients are stored in the weight dtype (vramcalc.training)
        self.peak, note = peak_flops(gpu, c_dtype)
        if precision == "fp8" or float8:  # block linears at the FP8 peak (TE or torchao)
            self.peak, note = fp8_peak_flops(spec, gpu, seq_len, mtp_layers)
        self.notes: tuple[str, ...] = (note,) if note else ()
        self.rate = self.peak * self.efficiency
        self.peft = peft
        n_ad = peft.adapter_params if peft else 0
        self.f_model = model_flops_per_token(spec, seq_len, n_ad if peft else None, mtp_layers)
        self.f_hw = {r: self.f_model + recompute_flops_per_token(spec, seq_len, r, selective,
                                                                 mtp_layers)
                     + (2.0 * n_ad if peft and r == "full" else 0.0)
                     for r in ("none", "selective", "full")}
        if spec.is_encoder_decoder:  # two stacks over s and t tokens (flops.py)
            self.f_model, self.f_hw = seq2seq_flops(spec, seq_len, target_len or seq_len)
        n_exp = spec.num_moe_layers * spec.num_local_experts * spec.expert_params
        self.n_exp = n_exp
        self.n_dense = spec.num_params - n_exp
        # bytes moved per step by data parallelism, whole model (÷tp·pp, experts ÷ep later):
        # weights all-gathered (ZeRO-3/FSDP), gradients reduced, updated weights gathered
        # after the step (ZeRO-1/2); dense and routed-expert parts
        w = self.w
        if peft is None:
            self.gather_b = (self.n_dense * w, n_exp * w)
            self.grad_b = (self.n_dense * self.g, n_exp * self.g)
            self.update_b = self.gather_b
            self.train_params = float(spec.num_params)
            self.dequant_s_per_param = 0.0
        else:
            self.gather_b = peft.gathered_weight_bytes
            self.grad_b = (n_ad * peft.adapter_bytes, 0.0)  # expert adapters are replicated too
            self.update_b = self.grad_b
            self.train_params = float(n_ad)
            # read n/2 packed + n/64 absmax bytes, write n·c (module docstring)
            self.dequant_s_per_param = (0.5 + 1 / 64 + self.c) / gpu.memory_bandwidth_bytes_per_s
        if float8_gather and peft is None:  # block linears all-gathered in fp8, 1 B each
            self.gather_b = (self.gather_b[0] - float8_linear_params(spec) * (w - 1),
                             self.gather_b[1])
        self.attn_width = attention_width(spec)
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

    def dequant_time(self, tp: int, pp: int, m: int, recompute: str) -> float:
        """QLoRA: seconds per step spent dequantizing this rank's NF4 weights (module doc)."""
        if not self.dequant_s_per_param or self.peft is None:
            return 0.0
        passes = 3 if recompute == "full" else 2
        return m * passes * self.peft.quantized_params / (tp * pp) * self.dequant_s_per_param

    def sharding_parts(self, dp: int, tp: int, pp: int, cp: int, ep: int, m: int, stage: int,
                       shard_group: int | None, offload: tuple[str, ...], offload_device: str,
                       t_fwd: float, t_bwd: float, reduce_once: bool = False,
                       ) -> tuple[float, float]:
        """(data-parallel / ZeRO communication, offload) seconds per step."""
        r_m = 1 if reduce_once else m  # micro-batches whose backward reduces
        gpn, intra, inter = self.gpn, self.intra, self.inter
        div_d, div_e = tp * pp, tp * pp * ep
        d_d, d_e = dp * cp, max(dp * cp // ep, 1)
        bw = intra if tp * cp * dp <= gpn else inter

        def moved(parts: tuple[float, float], n_d: int, n_e: int) -> float:
            """Bytes each rank sends in a ring over n_d dense / n_e expert ranks."""
            return parts[0] / div_d * _ring(n_d) + parts[1] / div_e * _ring(n_e)

        t_dp = 0.0
        if d_d > 1 or d_e > 1:
            if shard_group and shard_group < dp:
                S = shard_group
                bw_s = intra if tp * cp * S <= gpn else inter
                S_e = max(S // ep, 1)
                ag = moved(self.gather_b, S, S_e) / bw_s
                red = moved(self.grad_b, S, S_e) / bw_s
                t_dp = (m * _hidden(ag, t_fwd) + (m - r_m) * _hidden(ag, t_bwd)
                        + r_m * _hidden(ag + red, t_bwd))
                shard_bytes = (self.grad_b[0] / div_d + self.grad_b[1] / div_e) / S
                t_dp += _hidden(2 * _ring(dp // S * cp) * shard_bytes / bw, t_bwd)
            else:  # each stage moves only some of: gathers, reductions, updated shards
                red = moved(self.grad_b, d_d, d_e) / bw
                if stage == 0:
                    t_dp = _hidden(2 * red, t_bwd)
                elif stage == 1:
                    upd = moved(self.update_b, d_d, d_e) / bw
                    t_dp = _hidden(red, t_bwd) + _hidden(upd, t_fwd)
                elif stage == 2:
                    upd = moved(self.update_b, d_d, d_e) / bw
                    t_dp = r_m * _hidden(red, t_bwd) + _hidden(upd, t_fwd)
                else:
                    ag = moved(self.gather_b, d_d, d_e) / bw
                    t_dp = (m * _hidden(ag, t_fwd) + (m - r_m) * _hidden(ag, t_bwd)
                            + r_m * _hidden(ag + red, t_bwd))
        t_off = 0.0
        if offload:
            shard = (shard_group or dp) if stage >= 1 else 1
            if self.peft is None:
                psi_d = self.n_dense / div_d
                psi_e = self.n_exp / div_e
                psi_s = (psi_d + psi_e) / shard  # trained parameters of the rank's shard
                w_b, g_b = self.w, self.g
            else:  # the optimizer holds the adapters only
                psi_s = self.train_params / div_d / shard
                w_b = g_b = self.peft.adapter_bytes
            weights_s = (self.gather_b[0] / div_d + self.gather_b[1] / div_e) / shard
            host: float = self.gpu.host_link_bytes_per_s
            if offload_device == "nvme":
                host = min(host, NVME_BYTES_PER_S_PER_NODE / gpn)
            if "optimizer" in offload:
                t_off += psi_s * (4 + w_b) / host  # fp32 gradients out, weights back
                t_off += psi_s * CPU_OPTIMIZER_BYTES_PER_PARAM / (
                    HOST_MEMORY_BYTES_PER_S_PER_NODE / gpn)
            elif "gradients" in offload:
                t_off += psi_s * g_b / host
            if "params" in offload:
                t_off += 2 * m * weights_s / host
        return t_dp, t_off

    def report(self, lay: Layout) -> SpeedReport:
        """Full speed report of one layout."""
        v = lay.virtual_stages if lay.pp_schedule == "interleaved" else 1
        comp, bub, ttp, tcp, tep, tpp, t_fwd, t_bwd = self.base_parts(
            lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.sequence_parallel,
            lay.micro_batch_size, lay.num_microbatches, lay.recompute, v)
        tdp, toff = self.sharding_parts(lay.dp, lay.tp, lay.pp, lay.cp, lay.ep,
                                        lay.num_microbatches, lay.shard_stage, lay.shard_group,
                                        lay.offload, lay.offload_device, t_fwd, t_bwd,
                                        lay.reduce_once)
        tdq = self.dequant_time(lay.tp, lay.pp, lay.num_microbatches, lay.recompute)
        toff += 2 * lay.paged_host_bytes / self.gpu.host_link_bytes_per_s
        parts = dict(zip(PART_NAMES, (comp, bub, ttp, tcp, tep, tdp, tpp, toff, tdq),
                         strict=True))
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


def estimate_speed(spec: ModelSpec, gpu: GPUProfile, gpus_per_node: int, layout: Layout,
                   seq_len: int, precision: str = "bf16", efficiency: float | None = None,
                   capacity_factor: float = 1.0, peft: PeftCounts | None = None,
                   selective: str | int = "core", float8: bool = False,
                   mtp_layers: int = 0, target_len: int | None = None,
                   float8_gather: bool = False) -> SpeedReport:
    """Step time of `layout` (module docstring); seconds per step, tokens/s of the cluster."""
    return SpeedModel(spec, gpu, gpus_per_node, seq_len, precision, efficiency, capacity_factor,
                      peft, selective, float8, mtp_layers, target_len,
                      float8_gather).report(layout)


def scenario_speed(scn: Scenario, efficiency: float | None = None) -> SpeedReport:
    """Speed of a resolved Scenario with a cluster."""
    if scn.cluster is None:
        raise ValueError("speed needs a cluster (GPU type and count)")
    par, tr = scn.parallel, scn.training
    layout = Layout(
        dp=par.dp_degree, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep,
        sequence_parallel=par.sequence_parallel, shard_stage=par.shard_stage,
        shard_group=par.shard_group if par.fsdp == "hybrid" else None,
        micro_batch_size=tr.micro_batch_size, num_microbatches=par.num_microbatches or
        tr.grad_accum, recompute=tr.recompute, pp_schedule=par.pp_schedule,
        virtual_stages=par.virtual_stages, offload=tuple(par.offload),
        offload_device=par.offload_device, reduce_once=trainer_no_sync(tr, par))
    return estimate_speed(scn.model, scn.cluster.gpu, scn.cluster.gpus_per_node, layout,
                          tr.seq_len, tr.precision, efficiency, par.capacity_factor,
                          training_peft(scn.model, tr), tr.selective_kind, tr.float8,
                          par.mtp_layers, tr.target_len, tr.float8 and tr.float8_all_gather)


def training_peft(spec: ModelSpec, tr: TrainingConfig) -> PeftCounts | None:
    """PeftCounts of a TrainingConfig's fine-tuning method (None for full training)."""
    return peft_counts(spec, tr.precision, tr.finetune, tr.lora_rank, tr.lora_targets,
                       tr.framework, (tr.modules_to_save, tr.lora_embedding, tr.lora_head),
                       tr.adapters_16bit)
