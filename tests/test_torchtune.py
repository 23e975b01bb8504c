"""The torchtune profile (`--framework torchtune`, vramcalc/terms/torchtune.py).

Expected values come from outside the analytic code:
- torch itself: AOTAutograd's partitioners run torchtune's compiled cross entropy
  (written from pytorch/torchtune 1814feb `CEWithChunkedOutputLoss.compute_cross_entropy`)
  under FakeTensorMode and say what its forward keeps for backward (inductor's min-cut
  partition for `compile: True`; the default partition of the undecomposed graph keeps what
  the eager operators' autograd formulas keep);
- torch.chunk's own chunk sizes; autograd's own node order on real CPU tensors;
- hand derivations from tensor shapes × dtype sizes, 512-byte allocator blocks, each with
  the torchtune source line it follows.
"""

from __future__ import annotations

import warnings

import pytest

from vramcalc.analytic import estimate
from vramcalc.cli import main
from vramcalc.model import ModelSpec
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import torchtune as ttn
from vramcalc.terms.activations import activation_host_bytes
from vramcalc.training import TrainingConfig
from vramcalc.units import ALLOC_ROUND_BYTES, alloc

torch = pytest.importorskip("torch")

SMALL = ModelSpec(name="small", hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=768, vocab_size=3000,
                  tie_word_embeddings=True)


def ctx_of(**kw: object) -> RankContext:
    args = {"framework": "torchtune", "precision": "bf16-pure", "recompute": "full",
            "seq_len": 96, "micro_batch_size": 2, "chunked_ce": 4, **kw}
    return RankContext(SMALL, TrainingConfig(**args), Scenario(model=SMALL).parallel, 0)  # type: ignore[arg-type]


def _fake_chunk(n: int, vocab: int, dtype: object) -> tuple[object, object]:
    logits = torch.empty(n, vocab, dtype=dtype, requires_grad=True)
    labels = torch.empty(n, dtype=torch.long)
    return logits, labels


def _aot_kept(tokens: list[int], vocab: int, dtype: object, inductor: bool) -> int:
    """Bytes the partitioned forward keeps over all chunks (512-byte blocks)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.compiled import compiled_saved, torchtune_cross_entropy

    total = 0
    with FakeTensorMode():
        for n in tokens:
            saved = compiled_saved(torchtune_cross_entropy, *_fake_chunk(n, vocab, dtype),
                                   inductor=inductor)
            total += sum(alloc(t.nbytes, "int8") for t in saved)
    return total


def test_compiled_chunk_keeps_its_16_bit_logits_and_two_fp32_numbers_per_token() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.compiled import compiled_saved, torchtune_cross_entropy

    with FakeTensorMode():
        saved = compiled_saved(torchtune_cross_entropy, *_fake_chunk(48, 3000, torch.bfloat16))
    kinds = sorted((t.shape, str(t.dtype), t.is_input) for t in saved)
    # no fp32 (N, V) log-probabilities: the bf16 input, the labels, the row max and lse
    assert kinds == sorted([((48, 3000), "torch.bfloat16", True), ((48,), "torch.int64", True),
                            ((48, 1), "torch.float32", False),
                            ((48, 1), "torch.float32", False)])


@pytest.mark.parametrize("compiled", [True, False])
def test_kept_bytes_equal_what_torch_keeps_per_chunk(compiled: bool) -> None:
    # b = 2: each chunk's labels are a copy (`reshape(-1)` of a strided chunk), the chunk's
    # logits its own output-projection result: every saved tensor is its own block; + the
    # loss (0-dim); a tied head trained (b > 1): the other chunks' head-input copies
    ctx = ctx_of(compile=compiled)
    tokens = ttn.chunk_tokens(ctx)
    copies = sum(alloc(n * 256, "bf16") for n in tokens[1:])
    expected = _aot_kept(tokens, 3000, torch.bfloat16, inductor=compiled) + (
        ALLOC_ROUND_BYTES + copies)
    assert ttn.saved_bytes(ctx) == expected


def test_unchunked_compiled_loss_keeps_its_fp32_input_and_two_vectors() -> None:
    ctx = ctx_of(chunked_ce=1, compile=True)
    n = 2 * 96
    # recipe: logits.reshape(-1, V) of the model's `.float()` output (a view), labels
    # reshape(-1) of the contiguous shifted labels (a view): neither is a new block
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.compiled import compiled_saved, torchtune_cross_entropy

    with FakeTensorMode():
        saved = compiled_saved(torchtune_cross_entropy, *_fake_chunk(n, 3000, torch.float32))
    made = sum(alloc(t.nbytes, "int8") for t in saved if not t.is_input)
    logits_in = sum(alloc(t.nbytes, "int8") for t in saved if t.dtype == torch.float32
                    and t.is_input)
    assert ttn.unchunked_compiled_saved_bytes(ctx) == made + logits_in + ALLOC_ROUND_BYTES


@pytest.mark.parametrize(("s", "n"), [(96, 4), (100, 8), (7, 3), (4096, 8), (5, 8)])
def test_chunks_follow_torch_chunk(s: int, n: int) -> None:
    ctx = ctx_of(seq_len=s, chunked_ce=n)
    sizes = [c.numel() for c in torch.empty(2, s).chunk(n, dim=1)]
    assert ttn.chunk_tokens(ctx) == sizes


def test_every_chunk_loss_backward_runs_before_the_output_projections() -> None:
    # autograd's own order on real CPU tensors: the model computes all chunks' logits,
    # then the loss upcasts and reduces them one by one (torchtune transformer.py
    # `chunked_output`, ce_chunked_output_loss.py `forward`); record when each chunk's
    # logits gradient and each chunk's hidden-state gradient appear
    torch.manual_seed(0)
    h = torch.randn(2, 12, 8, requires_grad=True)
    w = torch.randn(20, 8, requires_grad=True)
    order: list[str] = []
    chunks = h.chunk(3, dim=1)
    logits = [torch.nn.functional.linear(c, w) for c in chunks]
    for i, (c, lg) in enumerate(zip(chunks, logits, strict=True)):
        lg.register_hook(lambda g, i=i: order.append(f"dlogits{i}"))
        c.register_hook(lambda g, i=i: order.append(f"dh{i}"))
    labels = torch.randint(0, 20, (2, 12))
    total = sum(torch.nn.functional.cross_entropy(lg.float().reshape(-1, 20), y.reshape(-1),
                                                  reduction="sum")
                for lg, y in zip(logits, labels.chunk(3, dim=1), strict=True))
    total.backward()
    first_dh = min(i for i, e in enumerate(order) if e.startswith("dh"))
    assert sorted(order[:first_dh]) == ["dlogits0", "dlogits1", "dlogits2"]


def test_offload_moves_each_checkpointed_layers_input_to_the_host() -> None:
    # torch/utils/checkpoint.py `_NoopSaveInputs` saves the layer input with
    # save_for_backward inside the recipe's OffloadActivations context: b·s·h·2 per layer
    ctx = ctx_of(activation_offload=True, chunked_ce=1)
    assert activation_host_bytes(ctx) == 2 * alloc(2 * 96 * 256, "bf16")


def test_compiled_loss_lowers_the_peak_by_the_fp32_log_probabilities() -> None:
    # Llama 3.2 3B-like vocabulary on a small body: the loss dominates; compiled, the loss
    # keeps 2·N·V bytes instead of 4·N·V at the backward's start
    base = {"framework": "torchtune", "precision": "bf16-pure", "recompute": "full",
            "seq_len": 1024, "micro_batch_size": 2, "chunked_ce": 8}
    spec = SMALL.model_copy(update={"vocab_size": 128256})
    eager = estimate(Scenario(model=spec, training=TrainingConfig(**base)))  # type: ignore[arg-type]
    comp = estimate(Scenario(model=spec, training=TrainingConfig(**base, compile=True)))  # type: ignore[arg-type]
    assert comp.peak_allocated_bytes < eager.peak_allocated_bytes
    n_v = 2 * 1024 * 128256
    # eager's forward holds all bf16 logits + all fp32 log-probs at the loss
    assert eager.peak_allocated_bytes - comp.peak_allocated_bytes >= n_v * 2


@pytest.mark.parametrize(("flags", "words"), [
    (["--compile"], "only the torchtune and torchtitan profiles"),
    (["--framework", "torchtune", "--precision", "bf16"], "bf16-pure or fp32"),
    (["--framework", "torchtune", "--activation-offload", "--precision", "bf16-pure"],
     "activation checkpointing"),
    (["--framework", "torchtune", "--recompute", "selective", "--precision", "bf16-pure"],
     "whole layers"),
    (["--framework", "torchtune", "--attention", "eager", "--precision", "bf16-pure"],
     "flex"),
])
def test_settings_torchtune_does_not_run_are_refused(flags: list[str], words: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "llama3-8b", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and words in err


def test_fused_adamw_is_the_profiles_default() -> None:
    # recipes/configs/llama3_2/3B_lora_single_device.yaml (1814feb): `fused: True`
    tr = TrainingConfig(framework="torchtune", precision="bf16-pure")
    assert tr.step_impl == "fused"
    assert TrainingConfig(framework="torchtune", precision="bf16-pure",
                          optimizer_impl="foreach").step_impl == "foreach"


def _layer_args(spec: ModelSpec, b: int, s: int) -> list[object]:
    h, f = spec.hidden_size, spec.intermediate_size
    a, g, d = spec.num_attention_heads, spec.kv_heads, spec.head_size

    def p(*shape: int) -> object:
        return torch.empty(*shape, dtype=torch.bfloat16, requires_grad=True)

    return [p(b, s, h), p(h), p(a * d, h), p(g * d, h), p(g * d, h), p(h, a * d), p(h),
            p(f, h), p(h, f), p(f, h), torch.empty(4 * s, d // 2, 2)]


@pytest.mark.parametrize("compiled", [False, True])
# GQA (k, v expanded copies), MHA, and MQA (the expanded k, v are views of one head)
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_layer_table_equals_what_torch_keeps(compiled: bool, kv_heads: int) -> None:
    # torchtune's layer written from its source, partitioned by AOTAutograd: the default
    # partition of the eager graph (what eager autograd keeps) or inductor's min-cut; every
    # saved tensor that is not a parameter or the rope cache, each its own 512-byte block
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.compiled import compiled_saved, torchtune_layer

    spec = SMALL.model_copy(update={"num_key_value_heads": kv_heads})
    b, s = 2, 64
    with FakeTensorMode():
        args = _layer_args(spec, b, s)
        saved = compiled_saved(torchtune_layer(8, kv_heads), *args, inductor=compiled)
    x_shape = (b, s, spec.hidden_size)
    traced = sum(alloc(t.nbytes, "int8") for t in saved
                 if not t.is_input or t.shape == x_shape)  # the layer input, not weights
    ctx = RankContext(spec, TrainingConfig(framework="torchtune", precision="bf16-pure",
                                           seq_len=s, micro_batch_size=b, compile=compiled,
                                           recompute="full"),
                      Scenario(model=spec).parallel, 0)
    assert sum(t.nbytes for t in ttn.plain_layer_saved(ctx)) == traced


def test_plan_proposes_what_torchtunes_recipes_run() -> None:
    # torchtune 1814feb: single-device recipes, or the *_distributed recipes' FSDP2
    # (`training.shard_model`); whole-layer checkpointing or none; bf16 or fp32 parameters
    from vramcalc.cli.plan import prepare_plan
    from vramcalc.planner import search

    base, req, _ = prepare_plan({"model": "llama3-8b", "framework": "torchtune",
                                 "precision": "bf16-pure", "gpus": "8xA100-80GB"},
                                allow="precision,optimizer,finetune", top=50)
    entries = search(base, req).entries
    assert entries
    for e in entries:
        p, t = e.scenario.parallel, e.scenario.training
        assert (p.tp, p.pp, p.cp, p.ep, p.zero, p.fsdp) == (1, 1, 1, 1, 0, "full")
        assert t.recompute in ("none", "full") and t.precision in ("bf16-pure", "fp32")


def test_plan_refuses_selective_recompute(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "llama3-8b", "--framework", "torchtune", "--precision",
                 "bf16-pure", "--recompute", "selective"])
    assert code == 2 and "none or full" in capsys.readouterr().err


def _chunked_ce(logits: list[object], labels: object, n: int) -> object:
    """CEWithChunkedOutputLoss.forward (1814feb), with compute_cross_entropy inlined."""
    F = torch.nn.functional
    total_elements = (labels != -100).sum()
    chunk_labels = [y.reshape(-1) for y in labels.chunk(n, dim=1)]
    chunk_logits = [lg.reshape(-1, lg.size(-1)) for lg in logits]
    total_loss = 0.0
    for logits_chunk, labels_chunk in zip(chunk_logits, chunk_labels, strict=True):
        total_loss += F.cross_entropy(logits_chunk.float(), labels_chunk, ignore_index=-100,
                                      reduction="sum")
    return total_loss / total_elements


def _loss_step(x: object, w: object, labels: object, n: int) -> object:
    """The recipe's `_loss_step` from the final norm's output on: the model's output
    (`chunked_output`, or `self.output(h).float()`), the loss, `del logits`."""
    F = torch.nn.functional
    if n > 1:
        logits = [F.linear(c, w) for c in x.chunk(n, dim=1)]
        loss = _chunked_ce(logits, labels, n)
    else:
        logits = F.linear(x, w).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
    del logits
    return loss


@pytest.mark.parametrize(("b", "n", "trained", "s"), [
    (2, 4, True, 96), (2, 4, False, 96), (1, 3, True, 96), (2, 1, False, 96),
    (2, 8, False, 100), (1, 8, True, 100),  # 100 = 7 x 13 + 9: uneven chunks
    (2, 8, False, 97)])  # 97 = 7 x 13 + 6
def test_eager_loss_peaks_equal_the_trace(b: int, n: int, trained: bool, s: int) -> None:
    # the recipe's `_loss_step` on fake tensors, counted by the trace engine's tracker:
    # `chunked_output` (one output projection per chunk), CEWithChunkedOutputLoss's forward
    # (or, n = 1, `self.output(h).float()` and torch.nn.CrossEntropyLoss), `del logits`,
    # then backward down to the final norm's output; all above what exists before the head
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.tracker import MemoryTracker

    h, V = 256, 3000
    tracker = MemoryTracker()
    with FakeTensorMode(), tracker:
        x = torch.empty(b, s, h, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(V, h, dtype=torch.bfloat16, requires_grad=trained)
        labels = torch.zeros(b, s, dtype=torch.long)
        tracker.set_phase("forward")
        base = tracker.total
        loss = _loss_step(x, w, labels, n)
        fwd_peak, kept = tracker.peaks[(0, "forward")].total - base, tracker.total - base
        tracker.set_phase("backward")
        loss.backward()
        bwd_peak = tracker.peaks[(0, "backward")].total - base
    ctx = ctx_of(seq_len=s, micro_batch_size=b, chunked_ce=n,
                 finetune="full" if trained else "lora")
    spec = SMALL.model_copy(update={"tie_word_embeddings": False, "vocab_size": V})
    ctx = RankContext(spec, ctx.training, ctx.parallel, 0)
    from vramcalc.terms import logits as lg_terms
    from vramcalc.terms.activations import head_saved
    from vramcalc.terms.lowmem import head_input_split

    # the output projection's first chunk copy (a trained head with b > 1); otherwise it
    # keeps views of x, which exists before the head
    head = sum(t.nbytes for t in head_saved(ctx) if t.name.startswith("lm_head")) if (
        head_input_split(ctx)) else 0
    slack = 4 * ALLOC_ROUND_BYTES  # 0-dim temporaries (token count, sums) not modelled
    assert 0 <= kept - (lg_terms.logits_saved_bytes(ctx) + head) <= slack
    assert 0 <= fwd_peak - (lg_terms.logits_forward_peak_bytes(ctx) + head) <= slack
    assert abs(bwd_peak - (lg_terms.logits_backward_peak_bytes(ctx) + head)) <= slack


@pytest.mark.parametrize("finetune", ["full", "lora", "qlora"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiling_never_keeps_more(finetune: str, recompute: str) -> None:
    # the min-cut partition keeps a subset-or-cheaper set of the eager one (it may only
    # trade a saved tensor for recomputation), and the compiled loss keeps c instead of fp32
    # per logit: the estimate with --compile never exceeds the eager one
    kw = {"framework": "torchtune", "precision": "bf16-pure", "recompute": recompute,
          "seq_len": 512, "micro_batch_size": 2, "chunked_ce": 4, "finetune": finetune}
    spec = SMALL.model_copy(update={"vocab_size": 32000})
    eager = estimate(Scenario(model=spec, training=TrainingConfig(**kw)))  # type: ignore[arg-type]
    comp = estimate(Scenario(model=spec, training=TrainingConfig(**kw, compile=True)))  # type: ignore[arg-type]
    assert comp.peak_allocated_bytes <= eager.peak_allocated_bytes
    assert comp.terms.activations <= eager.terms.activations


def test_fsdp_cpu_offload_is_fsdp2s_cpu_offload_policy(capsys: pytest.CaptureFixture[str]) -> None:
    """`fsdp_cpu_offload: True` (torchtune 30b8519e training/_distributed.py `shard_model`)
    passes CPUOffloadPolicy() to every fully_shard: the bf16 parameter shards, their bf16
    gradients and AdamW's two bf16 states (the optimizer steps the host's parameters) live
    in host RAM, 2 + 2 + 2 + 2 bytes a parameter over the node's 8 ranks, none on the GPU."""
    import json
    code = main(["estimate", "--model", "llama3.2-1b", "--framework", "torchtune",
                 "--precision", "bf16-pure", "--gpus", "8xA100-80GB", "--fsdp", "full",
                 "--offload", "params", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert all(report["terms"][t] == 0 for t in ("gradients", "optimizer_states"))
    # only the RoPE module's buffers, which are no parameters, stay: theta (32 fp32, one
    # 512-byte block) and cache (131,072, 32, 2) fp32 (`rope_init` on the device)
    assert report["terms"]["weights"] == 512 + 131_072 * 32 * 2 * 4
    n = 1_235_814_400  # Llama-3.2-1B (tied embeddings)
    assert 8 * n <= report["host_bytes_per_node"] < 8 * n * 1.001  # + shard padding


def test_plan_keeps_the_edge_units(capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --fsdp-edge-units` keeps the units in every FSDP candidate it estimates."""
    import json
    code = main(["plan", "--model", "llama3.1-70b", "--framework", "torchtune", "--gpus",
                 "8xA100-80GB", "--fsdp", "full", "--offload", "params", "--fsdp-edge-units",
                 "--global-batch-size", "16", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["candidates"]
    assert all(c["strategy"].get("fsdp_edge_units") for c in doc["candidates"])


def test_builtin_rms_norm_keeps_what_the_python_norm_kept() -> None:
    # torchtune 1450d61 (#2054, release 0.5 on): RMSNorm.forward is
    # F.rms_norm(x.float(), normalized_shape, weight=self.scale, eps).to(x.dtype); with bf16
    # weights the dtypes differ and torch runs its composite path, which keeps the fp32
    # input, the rstd and the fp32 x-hat, as the profile's layer table counts
    n, h = 6, 16
    x = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
    scale = torch.ones(h, dtype=torch.bfloat16, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(t: object) -> object:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()  # type: ignore[attr-defined]
        return t

    with warnings.catch_warnings(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        warnings.simplefilter("ignore")  # torch's "Cannot dispatch to fused implementation"
        torch.nn.functional.rms_norm(x.float(), (h,), weight=scale, eps=1e-6).to(x.dtype)
    storages = sorted(v for k, v in kept.items() if v != h * 2)  # the weight is a parameter
    # rstd, x.float(), x-hat (a fused kernel would keep the input and rstd only)
    assert storages == [4 * n, 4 * n * h, 4 * n * h]
