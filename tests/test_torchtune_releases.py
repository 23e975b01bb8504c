"""torchtune releases before 0.3.0 (`--torchtune-version`, vramcalc/terms/torchtune.py).

Expected values come from outside the analytic code:
- the v0.1.0 / v0.2.1 recipes' loss lines, run on fake tensors and counted by the trace
  engine's tracker (with CUDA's contiguous copy inside log_softmax, aten/src/ATen/native/
  cuda/SoftMax.cu `host_softmax`);
- hand derivations from tensor shapes × dtype sizes and 512-byte allocator blocks.
"""

from __future__ import annotations

import json

import pytest

from vramcalc.cli import main
from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms import logits as lg
from vramcalc.terms import torchtune as ttn
from vramcalc.training import TrainingConfig
from vramcalc.units import ALLOC_ROUND_BYTES

torch = pytest.importorskip("torch")

H, V = 256, 3000
SMALL = ModelSpec(name="small", hidden_size=H, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=768, vocab_size=V,
                  tie_word_embeddings=False)


def ctx_of(b: int, s: int, version: str = "0.1.0", dp: int = 1,
           finetune: str = "full") -> RankContext:
    tr = TrainingConfig(framework="torchtune", precision="bf16-pure", seq_len=s,
                        micro_batch_size=b, torchtune_version=version, finetune=finetune)
    return RankContext(SMALL, tr, ParallelConfig(dp=dp), 0)


def _recipe_loss(b: int, s: int, delete: bool) -> tuple[int, int, int, int]:
    """The v0.1.0 recipes' loop from the model's output on, on fake tensors, two micro-batches:
    (forward peak, kept after forward, backward peak, held after backward) of the second, above
    what existed before the first (the loop's `logits` and `labels` live on between them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.tracker import MemoryTracker

    F = torch.nn.functional
    tracker = MemoryTracker()
    loop: dict[str, object] = {}
    with FakeTensorMode(), tracker:
        x = torch.empty(b, s, H, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(V, H, dtype=torch.bfloat16)  # a frozen head (LoRA)
        batch = torch.zeros(b, s, dtype=torch.long)  # the loop's `batch` keeps the labels
        base = tracker.total
        for it in range(2):
            tracker.iteration = it
            tracker.set_phase("forward")
            out = F.linear(x, w).float()  # modules/transformer.py `self.output(h).float()`
            loop["logits"] = out  # recipes/*_finetune_*.py `train`
            del out
            loop["logits"] = loop["logits"][..., :-1, :].contiguous()  # type: ignore[index]
            loop["labels"] = batch[..., 1:].contiguous()
            loop["logits"] = loop["logits"].transpose(1, 2)  # type: ignore[attr-defined]
            loss = torch.nn.CrossEntropyLoss()(loop["logits"], loop["labels"])
            if delete:  # lora_finetune_distributed from 0.2.0
                del loop["logits"]
            kept = tracker.total - base
            tracker.set_phase("backward")
            loss.backward()
            x.grad = None
            del loss
        fwd = tracker.peaks[(1, "forward")].total - base
        bwd = tracker.peaks[(1, "backward")].total - base
        held = tracker.total - base
    return fwd, kept, bwd, held


@pytest.mark.parametrize(("b", "s", "delete"), [(2, 96, False), (1, 96, False),
                                                 (2, 96, True), (3, 50, False), (2, 2, False)])
def test_recipe_loss_equals_the_trace(b: int, s: int, delete: bool) -> None:
    fwd, kept, bwd, held = _recipe_loss(b, s, delete)
    ctx = (ctx_of(b, s, "0.2.1", dp=2, finetune="lora") if delete else ctx_of(b, s))
    recipe = sum(ttn.recipe_held(ctx).values())
    slack = 2 * ALLOC_ROUND_BYTES  # 0-dim temporaries not modelled
    assert 0 <= held - recipe <= slack
    assert 0 <= kept - (recipe + lg.logits_saved_bytes(ctx)) <= slack
    assert 0 <= fwd - (recipe + lg.logits_forward_peak_bytes(ctx)) <= slack
    assert abs(bwd - (recipe + lg.logits_backward_peak_bytes(ctx))) <= slack


def test_llama2_7b_tutorial_batch_by_hand() -> None:
    # b = 2, s = 512, V = 32000: the shifted copy is 2 x 511 x 32000 x 4 B = 130,816,000 B
    # (a multiple of 512), the labels copy 2 x 511 x 8 = 8,176 B -> 8,192 B
    spec = ModelSpec(name="l2", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, intermediate_size=11008, vocab_size=32000)
    tr = TrainingConfig(framework="torchtune", precision="bf16-pure", seq_len=512,
                        micro_batch_size=2, torchtune_version="0.1", finetune="lora")
    ctx = RankContext(spec, tr, ParallelConfig(dp=1), 0)
    assert ttn.recipe_held(ctx) == {"logits/recipe_logits": 130_816_000 + 8_192}
    # log_softmax's output and the copy of its transposed input (the model's bf16 output and
    # its upcast, 2 x 512 x 32000 x 6 B = 196,608,000 B, come earlier)
    assert lg.logits_forward_peak_bytes(ctx) == 2 * 130_816_000
    assert lg.logits_backward_peak_bytes(ctx) == 3 * 130_816_000 + 3 * 512
    # lora_finetune_distributed deletes it from 0.2.0, not in 0.1.0 or the other recipes
    dist = RankContext(spec, tr.model_copy(update={"torchtune_version": "0.2.0"}),
                       ParallelConfig(dp=2), 0)
    assert ttn.recipe_held(dist) == {"logits/recipe_logits": 8_192}
    assert not ttn.recipe_held(RankContext(spec, tr.model_copy(
        update={"torchtune_version": "0.3.0"}), ParallelConfig(dp=1), 0))


def _estimate(*flags: str, capsys: pytest.CaptureFixture[str]) -> dict:  # type: ignore[type-arg]
    code = main(["estimate", "--model", "llama2-7b", "--framework", "torchtune", "--precision",
                 "bf16-pure", "--seq-len", "512", "--micro-batch-size", "2", "--json", *flags])
    out = capsys.readouterr().out
    assert code == 0
    return json.loads(out)  # type: ignore[no-any-return]


def test_the_held_logits_reach_every_phase(capsys: pytest.CaptureFixture[str]) -> None:
    # full fine-tuning on one GPU: the recipe's logits are alive in the optimizer step too
    now = _estimate("--gpus", "1xH100", "--optimizer-impl", "foreach", capsys=capsys)
    old = _estimate("--gpus", "1xH100", "--optimizer-impl", "foreach", "--torchtune-version",
                    "0.1.0", capsys=capsys)
    held = 130_816_000 + 8_192
    # and 0.1.0's builder deep-copies the layer: 32 RoPE modules, each with theta (64 fp32,
    # one 512-byte block) and cache (4,096, 64, 2) fp32, where v0.6.0's builds one
    rope = 31 * (512 + 4096 * 64 * 2 * 4)
    assert old["phases"]["optimizer"] - now["phases"]["optimizer"] == held + rope


@pytest.mark.parametrize(("version", "impl"), [("0.3.0", "foreach"), ("0.3.1", "fused"),
                                               (None, "fused")])
def test_configs_fuse_adamw_from_0_3_1(version: str | None, impl: str) -> None:
    # torchtune cca50f0 (#1575, in v0.3.1) put `fused: True` in the AdamW configs; before
    # it torch.optim.AdamW ran torch's CUDA default, foreach
    tr = TrainingConfig(framework="torchtune", precision="bf16-pure",
                        torchtune_version=version)
    assert tr.step_impl == impl


def test_distributed_recipes_before_0_3_wrap_fsdp1(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ("--gpus", "2xRTX4090", "--fsdp", "full", "--finetune", "lora", "--lora-targets",
             "q,v")
    fsdp2 = _estimate(*flags, capsys=capsys)
    old = _estimate(*flags, "--torchtune-version", "0.1.0", capsys=capsys)
    fsdp1 = _estimate(*flags, "--fsdp-impl", "fsdp1", "--torchtune-version", "0.1.0",
                      capsys=capsys)
    assert old == fsdp1 and old != fsdp2
    assert any("FSDP1" in n for n in old["notes"])


@pytest.mark.parametrize(("flags", "words"), [
    (["--torchtune-version", "0.0.9"], "0.1.0 and later"),
    (["--torchtune-version", "0.2.1", "--chunked-ce", "8"], "came in 0.3.0"),
    (["--torchtune-version", "0.2.1", "--compile"], "came in 0.3.0"),
    (["--torchtune-version", "0.3.0", "--recompute", "full", "--activation-offload"],
     "came in 0.3.1"),
    (["--torchtune-version", "0.1.0", "--packed"], "came in 0.2.0"),
    (["--torchtune-version", "0.1.0", "--framework", "hf", "--precision", "bf16"],
     "--framework torchtune"),
    (["--torchtune-version", "one"], "--torchtune-version")])
def test_refused_releases_exit_2(flags: list[str], words: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "llama2-7b", "--gpus", "1xH100", "--framework",
                 "torchtune", "--precision", "bf16-pure", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and words in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("version", ["0.1.0", "0.2.1"])
def test_distributed_trace_moves_as_the_analytic_engine(version: str) -> None:
    # the FSDP2 trace of a LoRA run on two ranks (where both engines place each phase's peak
    # at the same moment), with and without the recipe's loss: each phase's peak moves by
    # what the analytic engine's moves (held copy, log_softmax's input copy; 0.2.1's
    # lora_finetune_distributed deletes the copy after the loss)
    from vramcalc.analytic import estimate
    from vramcalc.scenario import Scenario
    from vramcalc.trace.distributed import trace_any
    from vramcalc.validate import SHAPES

    def scn(release: str | None) -> Scenario:
        tr = TrainingConfig(framework="torchtune", precision="bf16-pure", seq_len=128,
                            micro_batch_size=2, grad_accum=2, finetune="lora",
                            torchtune_version=release)
        return Scenario(model=SHAPES["llama-gqa"], training=tr,
                        parallel=ParallelConfig(dp=2, fsdp="full", fsdp_impl="fsdp2"))

    now, old = scn(None), scn(version)
    ana_now, ana_old = estimate(now), estimate(old)
    tra_now, tra_old = trace_any(now), trace_any(old)
    for phase in ("forward", "backward", "optimizer"):
        moved = ana_old.phases[phase] - ana_now.phases[phase]
        assert tra_old.phases[phase] - tra_now.phases[phase] == moved, phase
    # the copy outlives the loss only where the recipe does not delete it
    # (both releases' builders give every layer its own RoPE buffers: weights, not held)
    held = (ana_old.phases["optimizer"] - ana_now.phases["optimizer"]
            - (ana_old.terms.weights - ana_now.terms.weights))
    assert (held > 10**6) == (version == "0.1.0")


@pytest.mark.parametrize("flags", [
    {}, {"recompute": "full"}, {"finetune": "lora", "lora_targets": "q,v"},
    {"finetune": "lora", "lora_targets": "all-linear", "recompute": "full", "chunked_ce": 4},
    {"finetune": "qlora", "recompute": "full"}, {"chunked_ce": 4},
    {"finetune": "lora", "recompute": "full", "activation_offload": True},
    {"optimizer_in_backward": True, "recompute": "full"},
    {"finetune": "lora", "torchtune_version": "0.1.0", "recompute": "full"},
    {"torchtune_version": "0.2.1"}], ids=repr)
def test_the_trace_runs_torchtunes_layer_and_loss(flags: dict[str, object]) -> None:
    # the single-rank trace of the torchtune profile (the reference model with torchtune's
    # layer: plain-op RMSNorm, complex-pair RoPE, repeated k and v; its chunked loss; the
    # recipe's loss before 0.3) agrees with the analytic profile phase by phase, within the
    # rotary table the traced model registers as a buffer (s x d/2 complex64)
    from vramcalc.analytic import estimate
    from vramcalc.scenario import Scenario
    from vramcalc.trace.distributed import trace_any
    from vramcalc.validate import SHAPES

    spec = SHAPES["llama-gqa"]
    tr = TrainingConfig(framework="torchtune", precision="bf16-pure", seq_len=256,
                        micro_batch_size=2, **flags)  # type: ignore[arg-type]
    scn = Scenario(model=spec, training=tr)
    ana, tra = estimate(scn), trace_any(scn)
    table = 256 * spec.head_size // 2 * 8
    for phase, traced in tra.phases.items():
        assert 0 <= traced - ana.phases[phase] <= table + 4 * 512, phase
    assert ana.peak_phase == tra.peak_phase


@pytest.mark.parametrize(("flags", "words"), [
    (["--compile"], "analytic engine"), (["--load", "torchtune"], "--load torchtune")])
def test_what_the_torchtune_trace_leaves_to_the_analytic_engine(
        flags: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["trace", "--model", "llama3.2-1b", "--gpus", "1xH100", "--framework",
                 "torchtune", "--precision", "bf16-pure", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and words in err


def test_the_torchtune_trace_runs_models_without_rotary_positions() -> None:
    # learned positions (GPT-2's shape): torchtune's layer without its RoPE step
    from vramcalc.analytic import estimate
    from vramcalc.scenario import Scenario
    from vramcalc.trace.distributed import trace_any
    from vramcalc.validate import SHAPES

    tr = TrainingConfig(framework="torchtune", precision="bf16-pure", seq_len=256,
                        micro_batch_size=2)
    scn = Scenario(model=SHAPES["gpt2"], training=tr)
    ana, tra = estimate(scn), trace_any(scn)
    assert abs(ana.peak_allocated_bytes - tra.peak_allocated_bytes) <= 4 * 512
