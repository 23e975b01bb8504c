"""Fine-tuning under parallelism: tensor-parallel LoRA adapters, ZeRO-3/FSDP gathers of a
QLoRA base, the speed model of frozen-base steps, fused projections of the hf profile.

Independent sources for the expected values (each test cites the one it uses):
- Tensor-parallel LoRA (PEFT tuners/lora/tp_layer.py `LoraParallelLinear`, Megatron
  backend; NeMo's ParallelLinearAdapter has the same split): for a ColumnParallelLinear base
  (q, k, v, gate, up) lora_A is a plain nn.Linear(in, r) on every rank and lora_B a
  ColumnParallelLinear(r, out): (out/t) × r per rank; for a RowParallelLinear base (o, down)
  lora_A is a RowParallelLinear(in, r): r × (in/t) per rank, and lora_B a plain
  nn.Linear(r, out).
- LoRA parameter count r·(in + out) per adapted matrix (Hu et al. 2021, Sec. 4.1).
- FSDP + QLoRA (Answer.AI fsdp_qlora; bitsandbytes `bnb_4bit_quant_storage`; PEFT docs
  "FSDP + QLoRA"): the packed 4-bit data is stored in a container of the parameters' dtype,
  so FSDP shards and all-gathers ⌈n/2⌉ bytes per weight of n elements; the quantization
  state is module metadata, kept whole on every rank.
"""

from __future__ import annotations

import pytest

from vramcalc.catalog import resolve_model
from vramcalc.finetune import shapes_for
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms import activations as act
from vramcalc.terms.gradients import gradients_bytes
from vramcalc.terms.optimizer_states import optimizer_state_split
from vramcalc.training import TrainingConfig
from vramcalc.units import alloc

LLAMA2_7B, _ = resolve_model("llama2-7b")


def ctx_for(spec, parallel: ParallelConfig | None = None, **kw: object) -> RankContext:  # noqa: ANN001
    return RankContext(spec, TrainingConfig(**kw), parallel or ParallelConfig(dp=1))  # type: ignore[arg-type]


# ---- 1. tensor parallelism splits the adapters with their base ---------------------------
@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tp_adapter_parameters_per_rank(t: int) -> None:
    """Llama-2-7B (h 4096, f 11008, 32 layers), r 8, all-linear. Per rank and layer, from
    PEFT's LoraParallelLinear: q, k, v (column-parallel) r·(h + h/t) each; o (row-parallel)
    r·(h/t + h); gate, up r·(h + f/t); down r·(f/t + h)."""
    h, f, L, r = 4096, 11008, 32, 8
    per_layer = 4 * r * (h + h // t) + 3 * r * (h + f // t)
    ctx = ctx_for(LLAMA2_7B, ParallelConfig(tp=t, dp=1), finetune="lora", lora_rank=r,
                  lora_targets="all-linear")
    assert shapes_for(ctx).adapters.numel() == L * per_layer
    if t == 1:  # Hu et al.: r·(in + out) per matrix, 4 attention + 3 MLP matrices
        assert per_layer == 4 * r * 2 * h + 3 * r * (h + f)


def test_tp_column_parallel_splits_b_row_parallel_splits_a() -> None:
    ctx = ctx_for(LLAMA2_7B, ParallelConfig(tp=4, dp=1), finetune="lora",
                  lora_targets="q,o,up,down")
    by = {x.name: x for x in shapes_for(ctx).adapters.tensors}
    r, h, f = 8, 4096, 11008
    assert by["attn.q_proj.lora_A"].numel == r * h  # replicated nn.Linear(in, r)
    assert by["attn.q_proj.lora_B"].numel == (h // 4) * r  # ColumnParallelLinear(r, out)
    assert by["attn.o_proj.lora_A"].numel == r * (h // 4)  # RowParallelLinear(in, r)
    assert by["attn.o_proj.lora_B"].numel == h * r  # replicated nn.Linear(r, out)
    assert by["mlp.up_proj.lora_B"].numel == (f // 4) * r
    assert by["mlp.down_proj.lora_A"].numel == r * (f // 4)
    assert by["mlp.down_proj.lora_B"].numel == h * r


def test_tp_adapter_states_follow_the_split() -> None:
    """PEFT (hf profile) keeps adapters in fp32: gradients 4 B and AdamW states 8 B per
    adapter element on each rank, no master. Llama-2-7B, q and v, tp 2, per layer:
    A 8 × 4096 and B 2048 × 8 for each of q, v. HF Trainer's default AdamW is fused, whose
    step counts are 0-dim fp32 device tensors (torch/optim/adam.py `_init_group`): 512 B for
    each of the 32 · 2 · 2 adapter tensors."""
    ctx = ctx_for(LLAMA2_7B, ParallelConfig(tp=2, dp=1), finetune="lora", framework="hf",
                  precision="bf16")
    n = 32 * 2 * (8 * 4096 + 2048 * 8)
    assert gradients_bytes(ctx) == 4 * n  # every tensor a multiple of 512 B
    opt = optimizer_state_split(ctx)
    assert (opt["states"], opt["master"]) == (8 * n + 128 * 512, 0)


@pytest.mark.parametrize("t", [2, 4])
def test_tp_ranks_together_hold_the_adapters_plus_replicas(t: int) -> None:
    """Summed over the t ranks: every adapter once, plus t − 1 extra copies of the replicated
    halves (A of column-parallel, B of row-parallel) — never fewer elements than tp = 1."""
    kw = {"finetune": "lora", "lora_targets": "all-linear"}
    whole = shapes_for(ctx_for(LLAMA2_7B, **kw)).adapters.numel()
    rank = shapes_for(ctx_for(LLAMA2_7B, ParallelConfig(tp=t, dp=1), **kw)).adapters.numel()
    h, L, r = 4096, 32, 8
    replicated = L * (3 * r * h + r * h + 2 * r * h + r * h)  # A of q,k,v,gate,up; B of o,down
    assert t * rank == whole + (t - 1) * replicated
    assert t * rank >= whole


def test_tp_adapter_activations_are_per_rank() -> None:
    """With dropout each adapter keeps a bool mask of its input: A of q reads the whole
    (T, h) normed input (column-parallel base, input replicated); A of o reads this rank's
    (T, h/t) slice of the attention output (row-parallel base); A's output is (T, r)."""
    T, h, t = 4096, 4096, 4  # default seq 4096, micro-batch 1
    ctx = ctx_for(LLAMA2_7B, ParallelConfig(tp=t, dp=1), finetune="lora",
                  lora_targets="q,o", lora_dropout=0.1)
    saved = {x.name: x for x in act.layer_saved(ctx)}
    assert saved["lora.q.dropout_mask"].nbytes == alloc(T * h, "bool")
    assert saved["lora.o.dropout_mask"].nbytes == alloc(T * h // t, "bool")
    assert saved["lora.q.a_out"].nbytes == alloc(T * 8, "bf16")


# ---- 2. ZeRO-3 / FSDP gathers of a QLoRA base are packed 4-bit ---------------------------
def _fsdp_ctx(spec, world: int = 8, **kw: object) -> RankContext:  # noqa: ANN001
    from vramcalc.parallel import resolve_layout

    tr = TrainingConfig(**kw)  # type: ignore[arg-type]
    par = resolve_layout(spec, tr, ParallelConfig(dp=world, fsdp="full"), world)
    return RankContext(spec, tr, par)


def test_fsdp_qlora_gathers_packed_4bit_blocks() -> None:
    """Llama-2-7B QLoRA (q, v adapters, PEFT fp32 under bf16), FSDP over 8 GPUs. One block
    all-gathered: the seven NF4 matrices as bitsandbytes' packed storage, (4h² + 3hf)/2 bytes
    (quantize_4bit: ((n + 1) // 2, 1) uint8, or n/4 bf16 with quant_storage=bf16 — the same
    bytes), two bf16 RMSNorm weights, and the fp32 q and v adapters (8 × 4096 + 4096 × 8
    each). A bf16 block would be 4× the matrices."""
    from vramcalc.terms.comm import fsdp_layer_bytes

    h, f, r = 4096, 11008, 8
    packed = (4 * h * h + 3 * h * f) // 2
    expected = packed + 2 * h * 2 + 2 * (r * h + h * r) * 4
    ctx = _fsdp_ctx(LLAMA2_7B, finetune="qlora", framework="hf", precision="bf16")
    assert fsdp_layer_bytes(ctx) == alloc(expected, "uint8")
    lora = _fsdp_ctx(LLAMA2_7B, finetune="lora", framework="hf", precision="bf16")
    assert fsdp_layer_bytes(lora) == alloc(4 * packed + 2 * h * 2 + 2 * (2 * r * h) * 4,
                                           "uint8")


def test_fsdp_qlora_shards_the_packed_storage() -> None:
    """FSDP2 shards dim 0 of the packed (n/2, 1) storage: n/(2N) bytes of each NF4 weight
    per rank (Llama-2-7B dims divide evenly); the quantization state stays whole."""
    from vramcalc.finetune import nf4_constant_bytes
    from vramcalc.terms.weights import weight_parts

    h, f, L = 4096, 11008, 32
    ctx = _fsdp_ctx(LLAMA2_7B, finetune="qlora", framework="hf", precision="bf16")
    parts = weight_parts(ctx)
    per_layer = 4 * alloc(h * h // 2 // 8, "uint8") + 3 * alloc(h * f // 2 // 8, "uint8")
    assert parts["weights/nf4"] == L * per_layer
    assert parts["weights/nf4_constants"] == L * (4 * nf4_constant_bytes(h * h)
                                                  + 3 * nf4_constant_bytes(h * f))


def test_fsdp2_shards_and_gathers_torchaos_nf4_scalers() -> None:
    """torchao's NF4Tensor is itself the parameter: FSDP2 splits its int8 scalers (one per
    64 elements) and bf16 factors (one per 256 scalers) along dim 0 with the packed data,
    and all-gathers the three (nf4tensor.py `_INNER_TENSOR_NAMES_FOR_SHARDING`, `nf4_split`,
    `fsdp_pre_all_gather`); the bf16 mean and the 16-entry table stay whole. Llama-2-7B
    torchtune QLoRA on 8 ranks, every allocation rounded to torch's 512-byte blocks."""
    from vramcalc.finetune import gathered_layer_bytes
    from vramcalc.terms.weights import weight_parts

    h, f, L, world = 4096, 11008, 32, 8

    def consts(n: int) -> int:  # one rank's share, plus the whole mean and table
        return (alloc(n // world // 64, "int8") + alloc(n // world // 64 // 256, "bf16")
                + alloc(1, "bf16") + alloc(16, "bf16"))

    ctx = _fsdp_ctx(LLAMA2_7B, world, finetune="qlora", framework="torchtune",
                    precision="bf16-pure", lora_targets="all-linear")
    assert weight_parts(ctx)["weights/nf4_constants"] == L * (4 * consts(h * h)
                                                              + 3 * consts(h * f))
    gathered = gathered_layer_bytes(ctx, "bf16")
    assert sorted(gathered)[-3:] == [h * f // 2 + h * f // 64 + h * f // 64 // 256 * 2] * 3
    # bitsandbytes' QuantState is no parameter: whole on every rank, never gathered
    bnb = _fsdp_ctx(LLAMA2_7B, world, finetune="qlora", framework="torchtune",
                    precision="bf16-pure", lora_targets="all-linear", qlora_impl="bnb")
    assert max(gathered_layer_bytes(bnb, "bf16")) == h * f // 2


def test_fsdp2_trace_shards_torchaos_scalers() -> None:
    """The referee for the test above: FSDP2 over 4 fake ranks shards the NF4 stand-in's
    torchao scalers and factors (parameters) and keeps its mean and table (buffers) whole;
    the trace's weights equal the analytic ones, whose constants are a quarter of each
    weight's scalers (h 1024, 4 kv heads of 64, f 2816)."""
    pytest.importorskip("torch")
    from vramcalc.finetune import nf4_constant_bytes
    from vramcalc.parallel import resolve_layout
    from vramcalc.scenario import Scenario
    from vramcalc.terms.weights import weight_parts
    from vramcalc.trace.distributed import distributed_trace
    from vramcalc.validate import SHAPES, analytic_points, trace_points

    spec = SHAPES["llama-deep"]
    tr = TrainingConfig(seq_len=256, micro_batch_size=1, precision="bf16-pure",
                        framework="torchtune", finetune="qlora", lora_targets="all-linear")
    scn = Scenario(model=spec, training=tr, parallel=ParallelConfig(dp=4, fsdp="full"))
    assert trace_points(distributed_trace(scn))["weights"] == analytic_points(scn)["weights"]
    h, kv, f = 1024, 256, 2816
    shapes = [h * h] * 2 + [kv * h] * 2 + [f * h] * 3
    ctx = RankContext(spec, tr, resolve_layout(spec, tr, scn.parallel, 4))
    split = sum(nf4_constant_bytes(n, tr.nf4, 4) for n in shapes)
    assert split < sum(nf4_constant_bytes(n, tr.nf4) for n in shapes)
    assert weight_parts(ctx)["weights/nf4_constants"] == spec.num_hidden_layers * split


def test_deepspeed_zero3_qlora_fetches_packed_containers() -> None:
    """DeepSpeed ZeRO-3 + QLoRA (bnb_4bit_quant_storage = bf16): each NF4 weight is a bf16
    container of n/4 elements, so a layer's fetch is (4h² + 3hf)/4 elements plus the norms
    (2h, persistent) — the adapters (r × 4096 < 1e5 elements) are persistent, never
    fetched."""
    from vramcalc.parallel import resolve_layout
    from vramcalc.terms.comm import ds_module_order

    h, f = 4096, 11008
    tr = TrainingConfig(finetune="qlora", framework="hf", precision="bf16")
    par = resolve_layout(LLAMA2_7B, tr, ParallelConfig(dp=8, zero=3), 8)
    order = ds_module_order(RankContext(LLAMA2_7B, tr, par))
    layer = [n for n in order[1:-2] if n > 100_000]  # between embedding and norm + head
    assert sum(layer) == 32 * (4 * h * h + 3 * h * f) // 4
    assert max(layer) == h * f // 4


def test_lora_ddp_buckets_and_fsdp_reduce_cover_the_adapters_only() -> None:
    """DDP's reducer buckets only parameters that require grad (a copy of the adapters'
    gradients, not of the frozen 7B): Llama-2-7B q, v adapters in fp32 (hf)."""
    from vramcalc.terms.comm import ddp_bucket_bytes

    tr = TrainingConfig(finetune="lora", framework="hf", precision="bf16")
    ctx = RankContext(LLAMA2_7B, tr, ParallelConfig(dp=2))
    assert ctx.engine == "ddp"
    assert ddp_bucket_bytes(ctx) == alloc(32 * 2 * (8 * 4096 + 4096 * 8), "fp32")


def test_fsdp2_trace_gathers_packed_qlora_blocks() -> None:
    """The referee: FSDP2 over 4 fake ranks, QLoRA on every linear of the small-vocabulary
    shape (h 1024, 16 heads, 4 kv heads of 64, f 2816, V 1024), peak in the layers'
    backward. At the peak the trace holds the root (embedding + head + norm in bf16) and
    one packed block: matrices (2·1024² + 2·256·1024 + 3·2816·1024)/2 bytes, two norms
    2·1024·2, bf16 adapters r·(in + out) = 145,408 elements."""
    pytest.importorskip("torch")
    from vramcalc.analytic import estimate
    from vramcalc.scenario import Scenario
    from vramcalc.trace.distributed import distributed_trace
    from vramcalc.validate import SHAPES, analytic_points, trace_points

    spec = SHAPES["llama-deep"]
    scn = Scenario(model=spec, training=TrainingConfig(
        seq_len=1024, micro_batch_size=2, precision="bf16", finetune="qlora",
        lora_targets="all-linear"), parallel=ParallelConfig(dp=4, fsdp="full"))
    res = distributed_trace(scn)
    root = alloc(1024 * 1024, "bf16") * 2 + alloc(1024, "bf16")
    block = (2 * 1024 * 1024 + 2 * 256 * 1024 + 3 * 2816 * 1024) // 2 + 2 * 1024 * 2 + (
        145_408 * 2)
    assert res.report.subterms["transients/gather_buffers"] == root + block
    bf16_block = 4 * (block - 2 * 1024 * 2 - 145_408 * 2)  # what 16-bit sizing would hold
    # 16-bit sizing would be off by more than the tolerance (once for the block, again for
    # the prefetched next one)
    assert bf16_block - block > 0.03 * res.report.peak_allocated_bytes
    ana = estimate(scn)
    assert abs(ana.peak_allocated_bytes / res.report.peak_allocated_bytes - 1) <= 0.03
    a, t = analytic_points(scn), trace_points(res)
    for term in ("weights", "gradients", "optimizer_states"):
        assert a[term] == t[term], term


# ---- 3. speed: a frozen base skips its weight-gradient matmuls --------------------------
# Llama-2-7B: 6,738,415,616 parameters (model card / published-figures.md), untied
# embedding 32000 × 4096 (the lookup is not a matmul; the head is); PEFT's default LoRA on
# q, v with r = 8: 4,194,304 adapter parameters (print_trainable_parameters).
N_MM_7B = 6_738_415_616 - 32000 * 4096
N_AD_7B = 4_194_304
ATTN_7B = 12 * 32 * 4096 * 4096  # 12·L·s·A at s = 4096 (PaLM App. B)


def _speed(finetune: str = "full", layout=None, gpus: int = 8, **kw: object):  # noqa: ANN001, ANN202
    from vramcalc.hardware import resolve_gpu
    from vramcalc.speed import Layout, estimate_speed, peft_counts

    peft = peft_counts(LLAMA2_7B, "bf16", finetune, **kw)  # type: ignore[arg-type]
    return estimate_speed(LLAMA2_7B, resolve_gpu("H100"), gpus, layout or Layout(), 4096,
                          "bf16", peft=peft)


def test_lora_flops_per_token() -> None:
    """Forward 2N, input gradients 2N, no weight gradients for the frozen base; adapters
    6·N_ad; the attention core's 12·L·s·A unchanged (its backward is all input gradients)."""
    r = _speed("lora")
    assert r.model_flops_per_token == 4 * N_MM_7B + 6 * N_AD_7B + ATTN_7B
    assert _speed().model_flops_per_token == 6 * N_MM_7B + ATTN_7B


def test_lora_full_recompute_adds_the_forward_of_layers_and_adapters() -> None:
    from vramcalc.speed import Layout

    r = _speed("lora", Layout(recompute="full"))
    fwd_layers = 2 * (N_MM_7B - 32000 * 4096) + 2 * N_AD_7B + 4 * 32 * 4096 * 4096
    assert r.hardware_flops_per_token == 4 * N_MM_7B + 6 * N_AD_7B + ATTN_7B + fwd_layers


def test_lora_is_faster_than_full_training_by_the_flop_ratio() -> None:
    """One H100, no communication: step time is FLOPs / (peak · efficiency), so LoRA's
    tokens/s exceed full training's by (6N + 12LsA)/(4N + 6N_ad + 12LsA) ≈ 1.40, and the
    MFU (the method's own FLOPs) is the same."""
    full, lora = _speed(gpus=1), _speed("lora", gpus=1)
    ratio = (6 * N_MM_7B + ATTN_7B) / (4 * N_MM_7B + 6 * N_AD_7B + ATTN_7B)
    assert lora.tokens_per_s / full.tokens_per_s == pytest.approx(ratio, rel=1e-12)
    assert 1.39 < ratio < 1.41
    assert lora.mfu == pytest.approx(full.mfu, rel=1e-12)


def test_qlora_pays_memory_bound_dequantization() -> None:
    """QLoRA dequantizes each of the 32·(4h² + 3hf) NF4 parameters twice per micro-batch
    (forward, backward): reads 1/2 + 1/64 bytes, writes 2 (bf16), at the H100 SXM's 3.35 TB/s
    (hardware_profiles/h100_sxm.yaml)."""
    n_q = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    qlora, lora = _speed("qlora", gpus=1), _speed("lora", gpus=1)
    t_dq = 2 * n_q * (0.5 + 1 / 64 + 2) / 3.35e12
    assert qlora.parts_s["dequant"] == pytest.approx(t_dq, rel=1e-12)
    assert lora.parts_s["dequant"] == 0.0
    assert qlora.step_time_s == pytest.approx(lora.step_time_s + t_dq, rel=1e-12)
    assert qlora.model_flops_per_token == lora.model_flops_per_token


def test_lora_data_parallel_reduces_only_the_adapters() -> None:
    """DDP over 8 H100s in one node: the all-reduce moves the adapters' fp32 gradients (PEFT,
    hf profile) instead of the 16-bit gradients of every parameter; both hide behind the
    backward pass, so only the 10 % overlap floor shows and the ratio is the bytes' ratio."""
    from vramcalc.speed import Layout

    full = _speed(layout=Layout(dp=8))
    lora = _speed("lora", Layout(dp=8), framework="hf")
    bytes_ratio = (N_AD_7B * 4) / (6_738_415_616 * 2)
    assert lora.parts_s["dp_comm"] / full.parts_s["dp_comm"] == pytest.approx(bytes_ratio,
                                                                              rel=1e-9)


def test_fsdp_qlora_all_gathers_packed_weights() -> None:
    """ZeRO-3/FSDP all-gather the frozen weights: QLoRA's NF4 matrices as packed n/2 bytes,
    the embedding, head and norms in bf16, the fp32 adapters (hf)."""
    from vramcalc.speed import peft_counts

    pc = peft_counts(LLAMA2_7B, "bf16", "qlora", framework="hf")
    assert pc is not None
    n_q = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    bf16_rest = 2 * 32000 * 4096 + (2 * 32 + 1) * 4096
    assert pc.quantized_params == n_q
    assert pc.gathered_weight_bytes == (bf16_rest * 2 + n_q / 2 + N_AD_7B * 4, 0.0)


# ---- 4. hf fused projections: one adapter per fused module (PEFT) ------------------------
def test_phi3_fused_adapters_by_hand() -> None:
    """Phi-3-mini (h 3072, 32 heads of 96, no GQA, f 8192, 32 layers): PEFT adapts qkv_proj
    (3072 → 9216) and gate_up_proj (3072 → 16384) as single modules; any of their member
    targets maps onto them. r 8: q,v → 32·8·(3072 + 9216); all-linear → + o (3072 → 3072),
    gate_up, down (8192 → 3072)."""
    spec, _ = resolve_model("phi3-mini")
    h, f, L, r = 3072, 8192, 32, 8
    qkv = ctx_for(spec, finetune="lora", framework="hf", lora_targets="q,v")
    assert shapes_for(qkv).adapters.numel() == L * r * (h + 3 * h)
    every = ctx_for(spec, finetune="lora", framework="hf", lora_targets="all-linear")
    per_layer = r * (h + 3 * h) + r * (h + h) + r * (h + 2 * f) + r * (f + h)
    assert shapes_for(every).adapters.numel() == L * per_layer
    # the reference profile builds separate q, k, v, gate, up: one adapter each
    ref = ctx_for(spec, finetune="lora", framework="reference", lora_targets="q,v")
    assert shapes_for(ref).adapters.numel() == L * 2 * r * (h + h)


@pytest.mark.parametrize(("shape", "kw"), [
    ("gpt2", {"finetune": "lora"}),
    ("phi3-fused", {"finetune": "qlora", "lora_targets": "all-linear"}),
    ("phi3-fused", {"finetune": "lora", "lora_targets": "up,v", "lora_dropout": 0.1}),
])
def test_peft_trace_of_fused_models(shape: str, kw: dict) -> None:
    """PEFT's get_peft_model on transformers' GPT-2 / Phi-3 (small configs), traced: the
    analytic peak within 3 %, weights (adapters, NF4 storage), gradients and optimizer states
    exact."""
    pytest.importorskip("peft")
    from vramcalc.analytic import estimate
    from vramcalc.trace.engine import trace
    from vramcalc.validate import analytic_points, scenario_for, trace_points

    _, scn = scenario_for(shape, framework="hf", **kw)
    res = trace(scn)
    ana = estimate(scn)
    assert abs(ana.peak_allocated_bytes / res.report.peak_allocated_bytes - 1) <= 0.03
    a, t = analytic_points(scn), trace_points(res)
    for term in ("weights", "gradients", "optimizer_states"):
        assert a[term] == t[term], term


@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_phi3_qlora_under_autocast_keeps_what_the_trace_keeps(attention: str) -> None:
    """QLoRA on Phi-3 under bf16 autocast: bitsandbytes' Linear4bit returns its fp32 input's
    dtype, so the fused qkv output is fp32 and attention keeps autocast's 16-bit cast of v,
    not the fused output; the head's weight cast exists only from the head on. Every phase
    agrees with the trace (PEFT and transformers' Phi-3 under FakeTensorMode) within 1 MB;
    the old rule was 1.6 MB per layer and the head's cast high in forward."""
    pytest.importorskip("peft")
    from vramcalc.analytic import stage_phases
    from vramcalc.trace.engine import trace
    from vramcalc.validate import scenario_for

    _, scn = scenario_for("phi3-fused", framework="hf", finetune="qlora",
                          lora_targets="all-linear", precision="amp-bf16",
                          attention=attention)
    scn = scn.resolved()
    phases, _, _ = stage_phases(scn, 0, scn.cluster.gpu if scn.cluster else None)
    res = trace(scn)
    for p in phases:
        assert abs(p.total - res.phases[p.name].total) <= 1_000_000, p.name
