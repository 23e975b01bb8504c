"""Low-precision training: FP8 linears (Transformer Engine) and quantization-aware training.

Legend as in vramcalc/terms/saved.py (b, s, h, a, g, d, f, T = b·s tokens on this
rank, c = compute dtype); per block linear: `in` and `out` its local (÷tp) widths,
n = in·out its local weight elements. Only the linears inside the transformer blocks
(q, k, v, o, gate, up, down / fc, proj) change; the embedding, the norms, attention and
lm_head stay as the policy has them (Transformer Engine's default: `te.Linear` modules
replace the block linears, nothing else runs in FP8). docs/methodology.md section 11 gives
every tensor with its source; docs/saved-tensors.md the saved-tensor rows.

**`--precision fp8`** — Transformer Engine (TE) `Linear` under `fp8_autocast` with the
DelayedScaling recipe (TE @ d0067d0d, transformer_engine/common/recipe/__init__.py,
pytorch/module/linear.py, module/base.py, quantization.py, tensor/float8_tensor.py):

- model states as `bf16`: bf16 weights and gradients, fp32 master weights and fp32 Adam
  states (Megatron-LM's mixed-precision optimizer; TE leaves them alone);
- per block linear, persistent (`transients/fp8_weight_cache`): the FP8 weight workspace
  TE caches when the caller passes `is_first_microbatch` (Megatron does;
  `Linear.forward` `cache_name = "weight"`, `_fp8_workspaces`): a Float8Tensor with
  `_data` (out, in) and, on GPUs without non-TN FP8 GEMMs (everything but sm100/103,
  `is_non_tn_fp8_gemm_supported`), `_transpose` (in, out), 1 byte each, plus a (1,) fp32
  `_scale_inv`;
- per block linear, persistent (`transients/fp8_meta`): DelayedScalingRecipeState for
  forward (3 tensors per GEMM: input, weight, output) and backward (2: grad_output,
  grad_input): `scale` (k,) fp32 and `amax_history` (amax_history_len = 1024, k) fp32;
- saved for backward: the linear's input in FP8 e4m3 — TE quantizes it row- and
  column-wise and drops the row-wise data after the forward GEMM
  (`update_usage(rowwise_usage=False)`), so the (in, T) transpose and its (1,) fp32
  scale_inv are kept (non-TN GPUs keep the (T, in) data instead: same bytes). One copy per
  distinct input: q/k/v share the normed input and gate/up the MLP input, as TE's fused
  `LayerNormLinear` (qkv, fc1) saves one FP8 `ln_out`. The bf16 inputs those linears kept
  are no longer saved;
- transients: the quantized input's row-wise data next to its transpose during the forward
  GEMM; in backward the grad_output cast to e5m2 row- and column-wise (2 bytes per element
  of (T, out)) next to dgrad (T, in) and wgrad (out, in) in bf16.

**`--qat int8 | int4`** — fake quantization of every block linear (torchao QAT configs,
pytorch/ao @ 36027d82 torchao/quantization/qat/fake_quantizer.py; the trace runs torch's
own `fake_quantize_per_channel_affine`, which saves a bool mask for its straight-through
estimator, aten `fake_quantize_per_channel_affine_cachemask`):

- int4 = torchao "8da4w": activations int8 asymmetric per token (dynamic), weights int4
  symmetric per group of 32 input columns (`IntxFakeQuantizeConfig(torch.int4,
  group_size=32)`);
- int8 = "8da8w": activations int8 asymmetric per token, weights int8 symmetric per output
  channel (torchao's Int8DynamicActivationInt8Weight target);
- per linear, saved: the fake-quantized input (T, in) c and its mask (T, in) bool (one per
  linear: q, k and v each quantize their input), the fake-quantized weight (out, in) c and
  its mask (out, in) bool;
- per linear, persistent (`transients/qat_qparams`): the last qparams the fake quantizers
  keep (torchao stores `self.scale`, `self.zero_point`): weights (out,) or (n/32,) fp32
  scale + int32 zero point, activations (T,) fp32 + (T,) int32.

Refused (one-line InputError): fp8 together with qat, either with fine-tuning (LoRA, QLoRA,
DoRA), with the hf or megatron profiles, with MoE models, with activation offload; qat under
autocast (amp-*); fp8 under ZeRO-3 / FSDP (TE re-quantizes the gathered weight instead of
caching it); fp8 on a GPU whose profile has no FP8 peak (FP8 tensor cores: Ada, Hopper,
Blackwell, MI300, Gaudi); int4 QAT on linears whose input width is not a multiple of 32.
Widths TE's FP8 GEMMs cannot take (not multiples of 16) get a note, not an error.
"""

from __future__ import annotations

import dataclasses

from vramcalc.errors import InputError
from vramcalc.features import finetunes, low_precision
from vramcalc.hardware import GPUProfile
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms.saved import Modifier, Moment, Saved, dims, relu_output_is_down_input
from vramcalc.units import alloc

# TE DelayedScaling defaults (common/recipe/__init__.py): amax_history_len = 1024.
FP8_AMAX_HISTORY_LEN = 1024
# Megatron-LM builds its own DelayedScaling recipe from TransformerConfig
# fp8_amax_history_len = 1 (NVIDIA/Megatron-LM d98e8a64, megatron/core/transformer/
# transformer_config.py; fp8_recipe "delayed" is its default)
MEGATRON_FP8_AMAX_HISTORY_LEN = 1
# module/base.py set_meta_tensor: "Max. number of fp8 tensors per GEMM = 3 (input, weight,
# output) for fwd and 2 (grad_output and grad_input) for bwd".
FP8_FWD_TENSORS_PER_GEMM = 3
FP8_BWD_TENSORS_PER_GEMM = 2
# TE assert_dim_for_fp8_exec: FP8 GEMM dimensions must be multiples of 16.
FP8_DIM_MULTIPLE = 16
# torchao QAT: int4 weights per group of 32 columns (the 8da4w example config).
QAT_INT4_GROUP = 32
QAT_SCHEMES = {"int8": "8da8w (int8 per-token activations, int8 per-channel weights)",
               "int4": "8da4w (int8 per-token activations, int4 weights per group of 32)"}


def fp8_transpose(gpu: GPUProfile | None) -> bool:
    """Whether TE keeps a separate FP8 transpose (the GPU profile says; GPUs with non-TN FP8
    GEMMs, sm100/sm103, keep one FP8 buffer for row- and column-wise use)."""
    return gpu is None or gpu.fp8_separate_transpose


def block_linears(ctx: RankContext) -> list[tuple[str, int, int, int]]:
    """(name, out, in, count) of the block linears' local weights on this rank."""
    out = []
    for t in ctx.tensors:
        if t.group != "layer" or not t.rows or not t.name.endswith(".weight") or (
                "norm" in t.name or t.name.startswith(("router.", "shared_expert_gate."))):
            continue
        out.append((t.name[: -len(".weight")], t.rows, t.numel // t.rows, t.count))
    return out


def check_lowprec(scn: Scenario) -> None:
    """Refuse what the FP8 / QAT model does not cover (InputError, one line each)."""
    tr = scn.training
    if not low_precision(tr):
        return
    flag = "--precision fp8" if tr.precision == "fp8" else f"--qat {tr.qat}"
    if tr.precision == "fp8" and tr.qat != "none":
        raise InputError("--precision fp8 and --qat cannot be combined: choose FP8 training or "
                         "quantization-aware training")
    if finetunes(tr):
        extra = " (QLoRA's base is already 4-bit NF4)" if tr.finetune == "qlora" else ""
        raise InputError(f"{flag} with --finetune {tr.finetune} is not modelled{extra}; "
                         "use --finetune full")
    if tr.framework != "reference" and not (tr.precision == "fp8" and
                                            tr.framework == "megatron"):
        where = "the reference and megatron profiles" if tr.precision == "fp8" else (
            "the reference profile")
        raise InputError(f"{flag} is modelled on {where} only; use --framework reference")
    if scn.model.is_moe:
        raise InputError(f"{flag}: mixture-of-experts models are not modelled yet "
                         f"({scn.model.name} is MoE)")
    if tr.activation_offload:
        raise InputError(f"{flag} with --activation-offload is not modelled")
    if tr.qat != "none" and tr.is_autocast:
        raise InputError(f"--qat {tr.qat} fake-quantizes in the weights' dtype; autocast "
                         f"({tr.precision}) is not modelled: use --precision bf16, bf16-pure, "
                         "fp16 or fp32")
    par = scn.parallel
    if tr.precision == "fp8" and (par.zero >= 3 or par.fsdp in ("full", "hybrid")):
        raise InputError("--precision fp8 with ZeRO-3 / FSDP full sharding is not modelled "
                         "(TE re-quantizes the gathered weight each step); use --zero 1 or 2")
    gpu = scn.cluster.gpu if scn.cluster is not None else None
    if tr.precision == "fp8" and gpu is not None and gpu.peak_tflops("fp8") is None:
        raise InputError(f"--precision fp8 needs a GPU with FP8 tensor cores (Ada, Hopper, "
                         f"Blackwell, MI300, Gaudi); {gpu.name} has none")
    ctx = RankContext(scn.model, tr, par, 0)
    for name, _rows, cols, _ in block_linears(ctx):
        if tr.qat == "int4" and cols % QAT_INT4_GROUP:
            raise InputError(f"--qat int4: {name} has {cols} input columns on this rank, not a "
                             f"multiple of the group size {QAT_INT4_GROUP}")


# ---- persistent state -----------------------------------------------------------------
# Megatron-LM's GEMM modules fuse q, k, v into `linear_qkv` and gate, up into `linear_fc1`
# (megatron/core/models/gpt/gpt_layer_specs.py: TELayerNormColumnParallelLinear; fc1 writes
# (s, b, 2f) with gated_linear_unit)
_MEGATRON_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv",
                   "gate_proj": "fc1", "up_proj": "fc1"}


def fp8_gemms(ctx: RankContext) -> list[tuple[str, int, int, int]]:
    """(name, out, in, count) per FP8 GEMM module: the block linears, fused as the stack
    builds them (the megatron profile fuses qkv and gate/up; else one module each)."""
    lins = block_linears(ctx)
    if ctx.training.framework != "megatron":
        return lins
    merged: dict[str, list[int]] = {}
    for name, rows, cols, count in lins:
        key = _MEGATRON_FUSED.get(name.split(".")[-1], name)
        if key in merged:
            merged[key][0] += rows
        else:
            merged[key] = [rows, cols, count]
    return [(k, r, c, n) for k, (r, c, n) in merged.items()]


def fp8_weight_cache_bytes(ctx: RankContext, gpu: GPUProfile | None) -> int:
    """TE's cached FP8 weights: per GEMM module `_data` (+ `_transpose`) + `_scale_inv`."""
    copies = 2 if fp8_transpose(gpu) else 1
    return sum(c * (copies * alloc(rows * cols, "fp8") + alloc(1, "fp32"))
               for _, rows, cols, c in fp8_gemms(ctx))


def fp8_meta_bytes(ctx: RankContext) -> int:
    """DelayedScalingRecipeState per GEMM module: forward and backward scale + amax history."""
    history = (MEGATRON_FP8_AMAX_HISTORY_LEN if ctx.training.framework == "megatron"
               else FP8_AMAX_HISTORY_LEN)
    per = 0
    for k in (FP8_FWD_TENSORS_PER_GEMM, FP8_BWD_TENSORS_PER_GEMM):
        per += alloc(k, "fp32") + alloc(history * k, "fp32")
    return per * sum(c for *_, c in fp8_gemms(ctx))


def qat_group_count(scheme: str, rows: int, cols: int) -> int:
    """Weight scales of one linear: one per output channel (int8), per 32 columns (int4)."""
    return rows if scheme == "int8" else rows * cols // QAT_INT4_GROUP


def qat_qparam_bytes(ctx: RankContext) -> int:
    """The fake quantizers' last scales (fp32) and zero points (int32, 4 bytes) per linear."""
    scheme = ctx.training.qat
    T = ctx.training.micro_batch_size * -(-ctx.training.seq_len // ctx.parallel.cp)
    return sum(c * 2 * (alloc(qat_group_count(scheme, rows, cols), "fp32") + alloc(T, "fp32"))
               for _, rows, cols, c in block_linears(ctx))


def persistent_parts(ctx: RankContext, gpu: GPUProfile | None) -> dict[str, int]:
    """Report sub-terms alive for the whole step (empty unless FP8 or QAT)."""
    tr = ctx.training
    if tr.precision == "fp8":
        return {"transients/fp8_weight_cache": fp8_weight_cache_bytes(ctx, gpu),
                "transients/fp8_meta": fp8_meta_bytes(ctx)}
    if tr.qat != "none":
        return {"transients/qat_qparams": qat_qparam_bytes(ctx)}
    return {}


# ---- saved tensors ----------------------------------------------------------------------
def _widths(ctx: RankContext) -> dict[str, tuple[int, int]]:
    """(out, in) per linear role of one dense layer on this rank."""
    return {name.split(".")[-1]: (rows, cols) for name, rows, cols, _ in block_linears(ctx)}


# the input a role reads: the entry of the full-training saved list it replaces
_ATTN_IN, _O_IN = "attn.input", "attn.o_input"
_MLP_IN = "mlp.input"


def adjust_layer_saved(ctx: RankContext, saved: list[Saved]) -> list[Saved]:
    """The bf16 layer's saved list turned into the FP8 / QAT one (module docstring)."""
    tr = ctx.training
    x = dims(ctx)
    T, c = x.T, x.c
    gated = ctx.spec.mlp_kind == "gated"
    o_in = x.a * x.d
    down_name = "mlp.down_input" if gated else "mlp.act"
    f_local = next((t.numel // T for t in saved if t.name == down_name), 0)
    selective_flash = tr.recompute == "selective" and tr.attention == "flash"
    out = [t for t in saved if t.name not in (_ATTN_IN, _MLP_IN, down_name, _O_IN)
           and not (selective_flash and t.name == "attn.out")]
    if relu_output_is_down_input(ctx):
        out += [dataclasses.replace(t, name="mlp.relu", why="relu output (threshold_backward)")
                for t in saved if t.name == down_name]
    # (name, elements per copy, copies, shape, what reads it)
    inputs = [(_ATTN_IN, T * x.h, 3, "(b, s, h)", "q, k, v"),
              (_O_IN, T * o_in, 1, "(b, s, a·d)", "o_proj"),
              (_MLP_IN, T * x.h, 2 if gated else 1, "(b, s, h)", "gate, up" if gated else "fc"),
              (down_name, T * f_local, 1, "(b, s, f)", "down_proj" if gated else "proj")]
    if tr.precision == "fp8":
        for name, numel, _copies, shape, who in inputs:
            out += [Saved(name, numel, "fp8", shape.replace("(b, s, ", "(").replace(")", ", T)"),
                          f"FP8 e4m3 transpose of the input of {who} (TE: one per input)"),
                    Saved(f"{name}.scale_inv", 1, "fp32", "(1)", "its Float8Tensor scale_inv")]
        return out
    for name, numel, copies, shape, who in inputs:
        out += [Saved(name, numel, c, shape, f"fake-quantized input of {who} (one per linear)",
                      copies),
                Saved(f"{name}.mask", numel, "bool", shape, "fake-quant STE mask", copies)]
    for role, (rows, cols) in _widths(ctx).items():
        prefix = "attn" if role in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        out += [Saved(f"{prefix}.{role}.wq", rows * cols, c, "(out, in)",
                      "fake-quantized weight, kept by the matmul"),
                Saved(f"{prefix}.{role}.wmask", rows * cols, "bool", "(out, in)",
                      "fake-quant STE mask of the weight")]
    return out


# entries the down / o projections' backward frees beyond their input (moments.py frees
# "mlp.down_input" / "mlp.act" and "attn.o_input" itself)
_DOWN_EXTRA = ("mlp.down_input.scale_inv", "mlp.act.scale_inv", "mlp.down_input.mask",
               "mlp.act.mask", "mlp.down_proj.wq", "mlp.down_proj.wmask", "mlp.proj.wq",
               "mlp.proj.wmask")
_O_EXTRA = ("attn.o_input.scale_inv", "attn.o_input.mask", "attn.o_proj.wq",
            "attn.o_proj.wmask")


def adjust_moments(ctx: RankContext, moments: list[Moment], saved: list[Saved]
                   ) -> list[Moment]:
    """Free what the down (MLP instant) and o (attention instant) projections' backward
    released besides their inputs."""
    def gone(names: tuple[str, ...]) -> int:
        return sum(t.nbytes for t in saved if t.name in names)

    # relu: moments.py keeps "mlp.act" (relu's output, read by threshold_backward); here it
    # is the projection's own quantized copy, freed with it (the output is "mlp.relu")
    relu = ("mlp.act",) if relu_output_is_down_input(ctx) else ()
    out = []
    for m in moments:
        if m.name == "mlp":
            m = dataclasses.replace(m, held=m.held - gone(_DOWN_EXTRA + relu))
        elif m.name == "attention":
            m = dataclasses.replace(m, held=m.held - gone(_O_EXTRA))
        out.append(m)
    return out


def forward_working_bytes(ctx: RankContext) -> int:
    """The down projection's forward (the layer's largest): its 16-bit input (act·up, no
    longer saved) and the GEMM output, plus under FP8 the input's row-wise FP8 data next to
    the saved transpose."""
    x = dims(ctx)
    f = next((cols for name, _rows, cols, _ in block_linears(ctx)
              if name.endswith(("down_proj", "mlp.proj"))), x.h)
    work = alloc(x.N * f, x.c) + alloc(x.N * x.h, x.c)  # row-parallel: (N, h) before its
    if ctx.training.precision == "fp8":  # reduce(-scatter)
        work += alloc(x.N * f, "fp8")
    return work


class LowPrecision(Modifier):
    """FP8 linears (Transformer Engine) or quantization-aware training (the functions
    above)."""

    name = "lowprec"

    def applies(self, ctx: RankContext) -> bool:
        return low_precision(ctx.training)

    def layer_saved(self, ctx: RankContext, saved: list[Saved]) -> list[Saved]:
        return adjust_layer_saved(ctx, saved)

    def backward_moments(self, ctx: RankContext, moments: list[Moment],
                         saved: list[Saved]) -> list[Moment]:
        return adjust_moments(ctx, moments, saved)

    def forward_working_bytes(self, ctx: RankContext, saved: list[Saved],
                              layers_on_device: bool, moe: bool) -> int:
        return forward_working_bytes(ctx)

    def persistent_parts(self, ctx: RankContext, gpu: GPUProfile | None) -> dict[str, int]:
        return persistent_parts(ctx, gpu)
