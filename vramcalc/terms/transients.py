"""Term: transients — short-lived buffers: optimizer-step temporaries, autocast weight
casts, ZeRO/FSDP gather and reduce buffers, the cuBLAS workspace.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from vramcalc.features import finetunes
from vramcalc.hardware import GPUProfile
from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.seq2seq_shapes import seq2seq_param_order
from vramcalc.sharding import (  # noqa: F401
    layer_param_numels,
    pipeline_chunks,
    sharded_numel,
    stage_moe_mask,
)
from vramcalc.terms import comm
from vramcalc.terms.modifiers import modifiers
from vramcalc.terms.optimizer_states import muon_matrix
from vramcalc.terms.saved import hf_family
from vramcalc.training import TrainingConfig
from vramcalc.units import ALLOC_ROUND_BYTES, MiB, alloc

# PyTorch allocates cuBLAS workspaces through the caching allocator, so they show in
# max_memory_allocated; each GPU profile gives its size (`blas_workspace_bytes`). Without a
# GPU: the default on Hopper and newer, CUBLAS_WORKSPACE_CONFIG ":4096:8" = 8 x 4 MiB
# (aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize).
CUBLAS_WORKSPACE_NO_GPU_BYTES = 32 * MiB
# CublasHandlePool.cpp keeps one workspace per (handle, stream) pair
# (`cublas_handle_stream_to_workspace`), and a handle per thread (DeviceThreadHandlePool).
# A training step runs its forward and optimizer on the calling thread and its backward on
# autograd's device thread (torch/csrc/autograd/engine.cpp `Engine::thread_main`, one
# thread per device): two workspaces, both held from the first backward on.
TRAINING_BLAS_THREADS = 2
# Megatron-LM's --deterministic-mode sets CUBLAS_WORKSPACE_CONFIG=:4096:8 (NVIDIA/Megatron-LM
# d98e8a64 megatron/training/determinism.py DETERMINISM_ENV_VAR_DEFAULTS; the functional
# tests' model_config.yaml ENV_VARS at adc69dba): 8 x 4096 KiB on every GPU
DETERMINISTIC_WORKSPACE_BYTES = 32 * MiB


def te_workspace_bytes(gpu: GPUProfile | None, training: TrainingConfig) -> int:
    """Transformer Engine's own cuBLASLt workspace, one torch.empty for the process
    (transformer_engine/pytorch/module/base.py `get_workspace`,
    `get_cublas_workspace_size_bytes`: 32 MiB from compute capability 9, 4 MiB before):
    Megatron-LM's TE layers (--transformer-impl transformer_engine, its default) and the FP8
    policy's TE linears. 0 otherwise."""
    te = ((training.framework == "megatron" and training.transformer_impl != "local")
          or training.precision == "fp8")
    if not te:
        return 0
    cap = gpu.cuda_capability if gpu is not None else "9.0"
    return 32 * MiB if cap is not None and int(cap.split(".")[0]) >= 9 else 4 * MiB


def blas_workspace_parts(gpu: GPUProfile | None, training: TrainingConfig) -> tuple[int, int]:
    """A training process's BLAS workspaces as (taken in the first forward, taken in the
    first backward): PyTorch's one per thread (the GPU profile's size, or 32 MiB under
    Megatron's --deterministic) and Transformer Engine's with the forward's."""
    size = CUBLAS_WORKSPACE_NO_GPU_BYTES if gpu is None else gpu.blas_workspace_bytes
    if training.deterministic:
        size = DETERMINISTIC_WORKSPACE_BYTES
    return size + te_workspace_bytes(gpu, training), (TRAINING_BLAS_THREADS - 1) * size


def cublas_workspace_bytes(gpu: GPUProfile | None, training: TrainingConfig | None = None,
                           ) -> int:
    """The BLAS workspaces a process holds on the device: one of PyTorch's for a forward
    alone (`training` None: serving), else all of `blas_workspace_parts`."""
    if training is None:
        return CUBLAS_WORKSPACE_NO_GPU_BYTES if gpu is None else gpu.blas_workspace_bytes
    return sum(blas_workspace_parts(gpu, training))


def optimizer_step_temp_bytes(ctx: RankContext) -> int:
    """Optimizer-step temporaries on this rank (cached; see `_optimizer_step_temp_bytes`)."""
    return _cached(_optimizer_step_temp_bytes, ctx)


def _cached(fn: Callable[[RankContext], int], ctx: RankContext) -> int:
    return _memo(fn, ctx.spec, ctx.training, ctx.parallel, ctx.stage)


@lru_cache(maxsize=16384)
def _memo(fn: Callable[[RankContext], int], spec: ModelSpec, training: TrainingConfig,
          parallel: ParallelConfig, stage: int) -> int:
    return fn(RankContext(spec, training, parallel, stage))


def _optimizer_step_temp_bytes(ctx: RankContext) -> int:
    """Temporaries of the optimizer step on this rank (PyTorch optimizers, foreach).

    - mixed precision (bf16/fp16 + fp32 master, vramcalc/trace/optim.py): each 16-bit grad
      is replaced by an fp32 copy on its master, one tensor at a time (+2 bytes/param net);
      while the last one is copied its 16-bit grad still exists;
    - then the inner step, on the fp32 masters, adds its own temporaries:
      adam/adamw foreach (PyTorch's default on CUDA): `_foreach_sqrt(exp_avg_sq)` copies the
      second moments (one state-sized tensor per param, all at once); fused
      (`torch._fused_adamw_`): none; the per-parameter loop: see `_loop_step_peak`; lion: the update
      direction, one state-sized tensor per param; adafactor foreach: `row_var @ col_var`
      for every matrix at once (one state-sized tensor per matrix, plus a 512 B row mean
      each; vectors are a second, smaller group); sgd, sgd-momentum and bitsandbytes'
      fused 8-bit kernels update in place.
    Peak = fp32 copies − 16-bit grads + max(last 16-bit grad, inner temporaries).
    """
    if "optimizer" in ctx.parallel.offload or (ctx.engine == "fsdp2" and ctx.parallel.offload):
        return 0
    if ctx.engine in ("deepspeed", "megatron"):
        return fused_step_temp_bytes(ctx)
    temp, inner, copy_peak = optimizer_step_parts(ctx)
    return temp + max(inner, copy_peak)


def optimizer_step_parts(ctx: RankContext) -> tuple[int, int, int]:
    """The torch optimizer step's parts (`_optimizer_step_temp_bytes`, whose docstring gives
    the formulas): (fp32 gradient copies net of the 16-bit gradients they replace, the inner
    step's temporaries, the copy loop's peak above the net copies)."""
    tr = ctx.training
    shard = ctx.state_shard
    tensors = [(sharded_numel(t.numel, shard), t.count, t.rows) for t in ctx.train_tensors]
    temp = copy_peak = 0
    if tr.has_master_weights and tensors:
        temp = sum(c * (alloc(n, "fp32") - alloc(n, tr.grad_dtype)) for n, c, _ in tensors)
        copy_peak = _master_copy_peak(ctx, shard) - temp
    inner = 0
    sd = tr.state_dtype
    if tr.optimizer in ("adam", "adamw") and tr.step_impl in ("loop", "hf-loop"):
        inner = _loop_step_peak(ctx, shard, 2 if tr.step_impl == "loop" else 1)
    elif tr.optimizer in ("adam", "adamw") and tr.step_impl == "fused":
        inner = 0  # torch._fused_adam(w)_: one kernel updates params and states in place
    elif tr.optimizer in ("adam", "adamw", "lion"):
        inner = sum(c * alloc(n, sd) for n, c, _ in tensors)
    elif tr.optimizer == "muon":
        inner = _muon_step_peak(ctx)
    elif tr.optimizer == "adafactor":
        matrices = sum(c * (alloc(n, sd) + ALLOC_ROUND_BYTES) for n, c, rows in tensors
                       if rows and shard == 1)
        vectors = sum(c * alloc(n, sd) for n, c, rows in tensors if not (rows and shard == 1))
        inner = max(matrices, vectors)
    return temp, inner, copy_peak


def _muon_step_peak(ctx: RankContext) -> int:
    """torch.optim.Muon beside a foreach AdamW, stepped one after the other. AdamW (the
    embeddings, head, norms, biases): `_foreach_sqrt` copies their second moments. Muon
    (torch/optim/_muon.py `_single_tensor_muon`, one matrix at a time): the Nesterov update
    `grad.lerp(buf, momentum)` (m·n in the gradients' dtype), then
    `_zeropower_via_newtonschulz`: its bf16 copy (the update itself when already bf16)
    and, in each of the five iterations, X·Xᵀ and the addmm update (k² bf16, k = min(m, n))
    and the new X (m·n bf16) beside the previous one: m·n·g + 2·m·n·2 + 2·k²·2 at the
    largest matrix."""
    sd = ctx.training.state_dtype
    adamw = muon = 0
    for t in ctx.train_tensors:
        if muon_matrix(t):
            k = min(t.rows, t.numel // t.rows)
            muon = max(muon, alloc(t.numel, sd) + 2 * alloc(t.numel, "bf16")
                       + 2 * alloc(k * k, "bf16"))
        else:
            adamw += t.count * alloc(t.numel, sd)
    return max(adamw, muon)


def _loop_step_peak(ctx: RankContext, shard: int, temps: int = 2) -> int:
    """Temporaries of a per-parameter Adam/AdamW step. torch's (`foreach=False`;
    torch/optim/adam.py `_single_tensor_adam`, temps = 2): for parameter i,
    `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` holds the square root
    and the quotient at once while the previous parameter's `denom` is still bound, so the
    peak is max_i (n_{i−1} + 2·n_i) in the state dtype, parameters in model order (two
    consecutive layers cover the step from one layer to the next). transformers' AdamW
    (HF Trainer's adamw_hf; v4.31.0 src/transformers/optimization.py `AdamW.step`,
    temps = 1): `denom = exp_avg_sq.sqrt().add_(eps)` is one new tensor, the other updates
    are in place: max_i (n_{i−1} + n_i)."""
    sd = ctx.training.state_dtype

    def a(n: int) -> int:
        return alloc(sharded_numel(n, shard), sd)

    if finetunes(ctx.training):  # adapters, `count` identical tensors in a row
        seq = [(t.numel, t.count) for t in ctx.train_tensors]
    elif ctx.spec.is_encoder_decoder:  # T5, BART: every tensor in model order
        seq = [(n, 1) for n in seq2seq_param_order(ctx.spec)]
    else:
        emb, layers, tail = _module_order(ctx)
        seq = [(n, 1) for n in emb + [n for layer in layers for n in layer] + tail]
    best = prev = 0
    for n, count in seq:
        cur = a(n)
        best = max(best, prev + temps * cur, (temps + 1) * cur if count > 1 else 0)
        prev = cur
    return best


def _module_order(ctx: RankContext) -> tuple[list[int], list[list[int]], list[int]]:
    """Numels of (embedding, each layer of the rank bottom to top, final norm + head)
    parameters in the order model.parameters() yields them (vramcalc/trace/
    reference_model.py module order; transformers' decoder layers register self_attn, mlp,
    then their two norms, and its MoE blocks keep each projection of all experts as one
    (E, out, in) parameter: modeling_qwen3_moe.py `Qwen3MoeExperts`, the router after
    them, Mixtral's and Qwen2-MoE's before)."""
    spec = ctx.spec
    by_name = {t.name: t for t in ctx.tensors}

    def take(*names: str) -> list[int]:
        return [by_name[n].numel for n in names if n in by_name]

    def lin(prefix: str) -> list[int]:
        return take(f"{prefix}.weight", f"{prefix}.bias")

    def mlp(prefix: str) -> list[int]:
        mats = ("gate_proj", "up_proj", "down_proj") if spec.mlp_kind == "gated" else (
            "fc", "proj")
        return [n for m in mats for n in lin(f"{prefix}.{m}")]

    attn = [n for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
            for n in lin(f"attn.{proj}")]
    norms = lin("input_layernorm") + lin("post_attention_layernorm")
    n_moe = ctx.shapes.num_moe_layers
    experts = next((t.count for t in ctx.tensors if t.name.startswith("experts.")), 0)
    E = experts // max(n_moe, 1)  # experts per MoE layer on this rank
    shared = next((t.count for t in ctx.tensors if t.name.startswith("shared_expert.")), 0)
    tail = lin("norm") + take("lm_head.weight")
    emb = take("embed_tokens", "embed_positions")
    hf = ctx.training.framework == "hf" and spec.norm_kind == "rmsnorm" and (
        spec.model_type != "phi3")
    if hf:
        gate_up, down = (sum(take(f"experts.{m}.weight")) * E
                         for m in ("gate_proj", "down_proj"))
        fused = [2 * gate_up, down] if spec.mlp_kind == "gated" else [gate_up, down]
        router = lin("router")
        moe = (fused + router if hf_family(ctx) == "qwen3_moe" else router + fused) + (
            mlp("shared_expert") * (shared // max(n_moe, 1)) + lin("shared_expert_gate"))
        kinds = {False: attn + mlp("mlp") + norms, True: attn + moe + norms}
    else:
        kinds = {False: norms[:1] + attn + norms[1:] + mlp("mlp"),
                 True: norms[:1] + attn + norms[1:] + lin("router") + mlp("experts") * E
                 + mlp("shared_expert") * (shared // max(n_moe, 1))
                 + lin("shared_expert_gate")}
    mask = stage_moe_mask(spec, pipeline_chunks(spec, ctx.parallel), ctx.stage) if n_moe else (
        (False,) * ctx.num_layers)
    return emb, [kinds[m] for m in mask], tail


def _master_copy_peak(ctx: RankContext, shard: int) -> int:
    """Peak of the mixed-precision wrapper's copy loop above the 16-bit gradients: while
    parameter i is copied, the fp32 copies of 0..i and the 16-bit grads of i.. exist,
    i.e. Σ_{j<i}(fp32_j − g16_j) + fp32_i. The prefix grows along the model, so only the
    embedding and the last layer, final norm and head can hold the maximum."""
    g = ctx.training.grad_dtype

    def delta(n: int) -> int:
        return alloc(sharded_numel(n, shard), "fp32") - alloc(sharded_numel(n, shard), g)

    if finetunes(ctx.training):  # adapters only, in model order (vramcalc/finetune.py)
        best = prefix = 0
        for t in ctx.train_tensors:  # `count` identical tensors in a row; delta >= 0, so
            d = delta(t.numel)       # the last of them holds the largest prefix
            best = max(best, prefix + (t.count - 1) * d
                       + alloc(sharded_numel(t.numel, shard), "fp32"))
            prefix += t.count * d
        return best

    def walk(numels: list[int], best: int, prefix: int) -> tuple[int, int]:
        for n in numels:
            best = max(best, prefix + alloc(sharded_numel(n, shard), "fp32"))
            prefix += delta(n)
        return best, prefix

    if ctx.spec.is_encoder_decoder:  # T5, BART: every tensor in model order
        return walk(seq2seq_param_order(ctx.spec), 0, 0)[0]
    emb, layers, tail = _module_order(ctx)
    best, prefix = walk(emb, 0, 0)
    # the layers of one kind share one list: its peak above the layer's start and its
    # growth are walked once per kind, then added layer by layer
    unique = {id(layer): layer for layer in layers}
    kinds = {k: walk(layer, 0, 0) for k, layer in unique.items()}
    for layer in layers:
        peak, growth = kinds[id(layer)]
        best = max(best, prefix + peak)
        prefix += growth
    return walk(tail, best, prefix)[0]


def autocast_cache_layer_bytes(ctx: RankContext) -> int:
    """One layer's autocast weight casts (cached; see `_autocast_cache_layer_bytes`)."""
    return _cached(_autocast_cache_layer_bytes, ctx)


def _autocast_cache_layer_bytes(ctx: RankContext) -> int:
    """torch.autocast casts each fp32 weight and bias of a linear to the compute dtype once
    per forward (the cast cache) and the matmul saves the cast for backward: one layer's
    linear parameters in 16 bits (norm weights are not cast). Average over the stage's
    layers when dense and MoE layers mix; none for 16-bit weights (bf16-autocast). A
    modifier may change it (frozen weights' casts under fine-tuning:
    vramcalc/terms/finetune_activations.py)."""
    tr = ctx.training
    if ctx.engine == "fsdp2":  # FSDP2 casts via its MP policy
        return 0
    n = ctx.num_layers
    c = tr.compute_dtype
    total = sum(t.count * alloc(t.numel, c) for t in ctx.tensors
                if t.group in ("layer", "expert") and "norm" not in t.name)
    cache = total // n if n and tr.is_autocast else 0  # 16-bit weights are not cast
    for m in modifiers(ctx):
        cache = m.autocast_cache_layer_bytes(ctx, cache)
    return cache


def autocast_cache_head_bytes(ctx: RankContext) -> int:
    """The lm_head weight cast (last stage) under autocast."""
    if (not ctx.training.runs_autocast or not ctx.is_last_stage or ctx.engine == "fsdp2"
            or ctx.training.liger or ctx.training.trl_chunked_ce):
        return 0  # fused or chunked losses that skip lm_head: counted in their peaks
    if ctx.spec.is_encoder:  # the head's linears (and the tied masked-LM decoder weight)
        c = ctx.training.compute_dtype
        out = sum(alloc(t.numel, c) for t in ctx.tensors
                  if t.group == "head" and "norm" not in t.name)
        if ctx.spec.task == "masked_lm" and ctx.spec.tie_word_embeddings:
            out += alloc(ctx.spec.vocab_size * ctx.spec.hidden_size, c)
        return out
    x = sharded_numel(ctx.spec.vocab_size * ctx.spec.hidden_size, ctx.parallel.tp)
    out = alloc(x, ctx.training.compute_dtype) if ctx.training.is_autocast else 0
    if ctx.training.lora_head and not ctx.training.adapters_16bit:
        # the trained fp32 A (r, h) and B (V, r) are cached too (16-bit ones are not cast)
        r, c = ctx.training.lora_rank, ctx.training.compute_dtype
        out += alloc(r * ctx.spec.hidden_size, c) + alloc(ctx.spec.vocab_size * r, c)
    return out


def gather_buffer_bytes(ctx: RankContext, at: str = "blocks") -> int:
    """Communication buffers alive during forward and backward: ZeRO-3 / FSDP2 unsharded
    parameters (vramcalc.terms.comm.gather_bytes) and, from the start of backward on,
    DeepSpeed ZeRO-1/2 reduce buckets (comm.backward_buffer_bytes; counted from forward on,
    which only matters when forward is the peak). Persistent buffers (DDP buckets,
    ZeRO-3's reduce bucket) are `persistent_buffer_bytes`. `at`: "blocks", "head" (the
    output projection and the loss) or "embedding" (its backward; comm.gather_bytes)."""
    return comm.gather_bytes(ctx, at) + comm.backward_buffer_bytes(ctx)


def reduce_buffer_bytes(ctx: RankContext, layer: int = 0, done: float = 1.0,
                        freed: int | None = None) -> int:
    """Extra at an instant of the backward of the `layer`-th layer from the top: its
    gradients are whole until reduced; FSDP2 also holds the previous layer's reduce-scatter
    input and the next layer's prefetched parameters (vramcalc.terms.comm.reduce_bytes:
    `done` share of the layer's gradients computed, `freed` bytes the layer releases when its
    backward ends)."""
    return comm.reduce_bytes(ctx, layer, done, freed)


def persistent_buffer_bytes(ctx: RankContext) -> int:
    """Communication buffers held for the whole step (vramcalc.terms.comm)."""
    return comm.persistent_buffer_bytes(ctx)


def fused_step_temp_bytes(ctx: RankContext) -> int:
    """Optimizer-step temporaries of DeepSpeed ZeRO and Megatron-LM (fused multi-tensor Adam:
    no `_foreach_sqrt` copy).

    DeepSpeed ZeRO-1/2 convert this rank's flat 16-bit gradient partition to fp32 for the
    step (stage_1_and_2.py step(): `single_grad_partition = flatten(...).to(fp32)`), 4Ψ/N on
    top of the 16-bit partition (the estimator's 18Ψ/N = 2 + 4 + 4 + 8); ZeRO-3 does the same
    one sub-group (sub_group_size, default 1e9 elements) at a time (stage3.py
    `_prepare_fp32_grad_for_sub_group`; `_create_fp16_sub_groups` closes a sub-group at the
    parameter that reaches sub_group_size, so one can exceed it by less than a parameter:
    counted as sub_group_size). Megatron-LM points the fp32 master's .grad at its
    fp32 main-grad buffer (no copy).
    """
    if ctx.engine != "deepspeed" or not ctx.training.has_master_weights:
        return 0
    shard = ctx.parallel.shard_degree
    numel = -(-ctx.train_shapes.numel() // shard)  # the optimizer's parameters only
    if ctx.parallel.zero >= 3:
        numel = min(numel, ctx.parallel.deepspeed.sub_group_size)
    return alloc(numel, "fp32")
