"""--torch-version (what an older PyTorch keeps and loads) and --load-only (the reading right
after the model is loaded).

Sources:
- torch < 1.11: softmax's and log_softmax's autograd nodes keep their input beside their
  output (pytorch/pytorch#64000: `_softmax_backward_data(grad, result, dim, self)`);
  pytorch/pytorch#66018 (October 2021) passes the input's dtype instead, first in 1.11
  (transformers v4.20.0 src/transformers/pytorch_utils.py `softmax_backward_data` passes the
  input tensor when `is_torch_less_than_1_11`).
- torch < 1.13: CUDA_MODULE_LOADING is not set to LAZY (pytorch/pytorch#86509 sets it from
  1.13), so the context loads every kernel: the GPU profile's `context_eager_bytes`, 1 GB
  ("Before CUDA 11.7, *all* kernels were loaded into the context once the library was
  loaded, which took >1000MB", pytorch/pytorch#107667).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest

from vramcalc.analytic import estimate
from vramcalc.cli import main
from vramcalc.model import ModelSpec
from vramcalc.options import build_scenario
from vramcalc.qlora import parse_version
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import activations as act
from vramcalc.terms.encoder import logits_saved_bytes
from vramcalc.training import TrainingConfig
from vramcalc.units import round_alloc
from vramcalc.validate.shapes import SHAPES

# the HF "model memory anatomy" runs (benchmarks/calibration.py): BERT-large on a V100
BERT_V100 = {"model": "bert-large", "task": "sequence-classification", "gpus": "1xV100-16GB",
             "framework": "hf", "precision": "fp32", "optimizer": "adamw",
             "optimizer_impl": "loop", "attention": "eager", "set_to_none": False,
             "seq_len": 512, "micro_batch_size": 4}
MiB = 2**20


def _run(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


def _refused(args: list[str], words: str) -> None:
    code, _, err = _run(args)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert words in lines[0]


# ---- softmax keeps its input (torch < 1.11) -------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "amp-fp16"])
def test_softmax_input_kept_per_layer_hand_derived(precision: str) -> None:
    """Every layer's eager softmax keeps its (b, a, s, s) input: fp32 under fp32 and under
    autocast (CUDA's fp32 list; transformers 4.20's fp32 additive mask promotes the scores
    too): 4 · 16 · 512 · 512 · 4 B = 64 MiB per layer, 24 layers, all held at the end of
    forward."""
    def forward(version: str | None) -> int:
        values = {**BERT_V100, "precision": precision, "torch_version": version}
        return estimate(build_scenario(values)).phases["forward"]

    b, a, s, L = 4, 16, 512, 24
    assert forward("1.10") - forward(None) == L * b * a * s * s * 4 == L * 64 * MiB
    assert forward("1.11") == forward(None)  # 1.11 keeps the output only


def test_log_softmax_input_kept_by_the_loss() -> None:
    """The masked-LM loss: log_softmax keeps its (b·s, V) fp32 output and, before 1.11, its
    input, the fp32 logits: b·s·V·4 bytes more."""
    spec = ModelSpec(**{**SHAPES["bert"].model_dump(), "task": "masked_lm"})
    b, s = 2, 128

    def saved(version: str | None) -> int:
        tr = TrainingConfig(framework="hf", seq_len=s, micro_batch_size=b, precision="fp32",
                            attention="eager", torch_version=version)
        scn = Scenario(model=spec, training=tr).resolved()
        return logits_saved_bytes(RankContext(scn.model, scn.training, scn.parallel, 0))

    assert saved("1.10") - saved(None) == round_alloc(b * s * spec.vocab_size * 4)


@pytest.mark.parametrize("kw", [
    {"precision": "fp32"},
    {"precision": "amp-fp16"},
    {"precision": "fp32", "recompute": "full", "grad_accum": 2},
])
def test_trace_agrees_with_old_softmax(kw: dict[str, Any]) -> None:
    """The trace replays torch < 1.11's softmax / log_softmax nodes (vramcalc/trace/
    old_torch.py) on real transformers BERT: the saved set at the end of forward is the
    analytic table's exactly; the peak within 0.5 % (the table's instants)."""
    pytest.importorskip("transformers")
    from vramcalc.trace.engine import trace

    spec = ModelSpec(**{**SHAPES["bert"].model_dump(), "hidden_size": 256,
                        "num_attention_heads": 4, "intermediate_size": 1024})
    tr = TrainingConfig(framework="hf", seq_len=128, micro_batch_size=2, attention="eager",
                        torch_version="1.10", **kw)
    scn = Scenario(model=spec, training=tr)
    traced, analytic = trace(scn), estimate(scn)
    res = scn.resolved()
    ctx = RankContext(res.model, res.training, res.parallel, 0)
    assert act.microbatch_activation_bytes(ctx) == traced.marks["end_forward"].terms()[
        "activations"]
    rel = analytic.peak_allocated_bytes / traced.report.peak_allocated_bytes - 1
    assert abs(rel) < 0.005, rel


def test_old_softmax_on_a_decoder_is_refused() -> None:
    _refused(["estimate", "--model", "llama3-8b", "--torch-version", "1.10"],
             "--torch-version 1.10")


@pytest.mark.parametrize("bad", ["abc", "1", "1.x", "1..2", "", "9" * 5000])
def test_bad_torch_version_is_refused(bad: str) -> None:
    _refused(["estimate", "--model", "llama3-8b", "--torch-version", bad], "--torch-version")


# ---- the CUDA context: lazy or eager module loading ------------------------------------------
@pytest.mark.parametrize(("version", "context"), [
    (None, 500 * MiB), ("2.5", 500 * MiB), ("1.13", 500 * MiB), ("1.12.1", 10**9),
    ("1.10", 10**9)])
def test_context_follows_module_loading(version: str | None, context: int) -> None:
    """The V100 profile: 500 MiB planning default with lazy loading (torch >= 1.13), its
    context_eager_bytes (1 GB, pytorch/pytorch#107667) before; the device total is the
    reserved peak plus that context."""
    values = {**BERT_V100, "torch_version": version, "load": "hf-fp32", "load_only": True}
    rep = estimate(build_scenario(values))
    assert rep.subterms["overhead/context"] == context
    assert rep.device_total_bytes == rep.peak_reserved_bytes + context


def test_no_eager_context_on_a_gpu_no_old_torch_ran_on() -> None:
    """H100 (sm_90) needs CUDA 11.8, which no torch before 1.13 shipped: refused, not a
    silently lazy context."""
    _refused(["estimate", "--model", "bert-large", "--seq-len", "512", "--gpus", "1xH100",
              "--torch-version", "1.12"], "h100_sxm")


# ---- --load-only: the reading right after loading --------------------------------------------
def test_load_only_is_the_load_phase_alone() -> None:
    """from_pretrained(...) without torch_dtype, then .to('cuda'): every parameter an fp32
    block of its own (rounded to 512 B), nothing else allocated; the device holds the
    reserved segments and the context."""
    from vramcalc.model_tensors import param_tensors

    values = {**BERT_V100, "load": "hf-fp32", "load_only": True, "torch_version": "1.10"}
    scn = build_scenario(values)
    rep = estimate(scn)
    weights = sum(t.count * round_alloc(4 * t.numel) for t in param_tensors(scn.model))
    assert rep.phases == {"load": weights} and rep.peak_phase == "load"
    assert rep.peak_allocated_bytes == rep.first_step_peak_bytes == weights
    for term in ("gradients", "optimizer_states", "activations", "logits"):
        assert getattr(rep.terms, term) == 0
    # the caching allocator's segments: at most one partly used 20 MiB segment, one small
    # 2 MiB segment and the 2 MiB rounding of the embedding beyond the blocks
    assert 0 <= rep.peak_reserved_bytes - weights < 24 * MiB
    assert rep.device_total_bytes == rep.peak_reserved_bytes + 10**9
    # the same load phase as a training run's (--load hf-fp32 without --load-only)
    full = estimate(build_scenario({**values, "load_only": False}))
    assert full.phases["load"] == weights and set(full.phases) > {"load"}


def test_load_only_text_and_refusals() -> None:
    code, out, _ = _run(["estimate", "--model", "bert-large", "--gpus", "1xV100-16GB",
                         "--precision", "fp32", "--load", "hf-fp32", "--load-only"])
    assert code == 0 and "right after loading" in out and "load hf-fp32 only" in out
    _refused(["estimate", "--model", "bert-large", "--seq-len", "512", "--load-only"],
             "--load")
    for cmd in ("trace", "plan", "max"):
        _refused([cmd, "--model", "bert-large", "--seq-len", "512", "--gpus", "1xV100-16GB",
                  "--load", "hf-fp32", "--load-only"], "--load-only")



@pytest.mark.parametrize(("text", "release"), [
    ("2.5.1+cu121", (2, 5, 1)),  # torch.__version__ of a CUDA wheel
    ("2.6.0.dev20241112", (2, 6, 0)),  # a nightly
    ("2.4.0a0+git1234abc", (2, 4, 0)),  # a source build
    ("4.47.0.dev0", (4, 47, 0)),  # transformers installed from main
    ("2.5.0rc1", (2, 5, 0)),
    ("v0.3", (0, 3, 0)),
    ("2024.12.4", (2024, 12, 4)),  # Unsloth's calendar releases
])
def test_the_version_strings_pip_prints_are_releases(text: str, release: tuple[int, ...]) -> None:
    """What `pip show` or `__version__` prints is its release (PEP 440, read by packaging),
    so a user can paste it: '2.5.1+cu121' was refused before."""
    assert parse_version(text) == release


def test_a_local_build_follows_its_release() -> None:
    # eager CUDA module loading ends with the 1.13 release, whatever the build's suffix
    def eager(version: str) -> bool:
        return build_scenario({"model": "gpt2", "torch_version": version}).training \
            .eager_module_loading
    assert eager("1.12.1+cu113") and not eager("1.13.0.dev20220901") and not eager("2.5.1+cu121")
