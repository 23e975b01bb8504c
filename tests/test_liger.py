"""HF Trainer's use_liger_kernel (`--liger`, vramcalc/terms/liger.py): what Liger's kernels keep.

Expected values from Liger-Kernel's source (linkedin/Liger-Kernel ead96b61), derived by hand:
- ops/fused_linear_cross_entropy.py `fused_linear_cross_entropy_forward`: inc_factor =
  cdiv(V, H), chunk_size = next_power_of_2(cdiv(BT, inc_factor)); its own comment: "BT =
  4096*4, V = 32000, H = 4096 ==> inc_factor = 8, chunk_size = 2048"; grad_input =
  zeros_like(_input), grad_weight = zeros_like(weight) only when the weight requires grad,
  loss_1d (BT, fp32), target_mask; per chunk the (chunk, V) logits and grad_logits @ weight;
  `LigerFusedLinearCrossEntropyFunction.forward` saves grad_input and grad_weight;
- ops/rms_norm.py `LigerRMSNormFunction.forward`: `ctx.save_for_backward(X, W, RSTD)`, RSTD
  (n_rows,) in fp32 under the "llama" casting mode;
- ops/swiglu.py `LigerSiLUMulFunction.forward`: `ctx.save_for_backward(a, b)`, c =
  silu(a)·b made in the kernel; `swiglu_backward` writes the gradients into a and b.
transformers' RMSNorm (modeling_llama.py `LlamaRMSNorm`) keeps x.float(), the rsqrt and x̂ in
the input dtype; its MLP `down_proj(act_fn(gate_proj(x)) * up_proj(x))` keeps gate, up, the
activation output and their product.
"""

from __future__ import annotations

import pytest

from vramcalc.analytic import estimate
from vramcalc.cli import main
from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms import liger
from vramcalc.terms.activations import head_saved, layer_saved
from vramcalc.terms.logits import logits_forward_peak_bytes, logits_saved_bytes

R = 512  # the caching allocator's rounding of every block


def _r(n: int) -> int:
    return -(-n // R) * R


def _ctx(**kw: object) -> RankContext:
    values = {"model": "llama2-7b", "gpus": "1xH100", "framework": "hf",
              "precision": "bf16-pure", "seq_len": 4096, "micro_batch_size": 4, **kw}
    scn = build_scenario(values).resolved()
    return RankContext(scn.model, scn.training, scn.parallel, 0)


def test_chunk_size_is_liger_own_example() -> None:
    # BT = 4096·4 tokens, V = 32000, H = 4096: inc_factor 8, chunk_size 2048
    assert liger.chunk_tokens(_ctx(liger=True)) == 2048
    # Llama-3.1-8B, 8192 tokens: cdiv(128256, 4096) = 32, next_pow2(256) = 256
    assert liger.chunk_tokens(_ctx(model="llama3.1-8b", micro_batch_size=1, seq_len=8192,
                                   liger=True)) == 256


def test_fused_loss_keeps_the_hidden_gradient_and_no_logits() -> None:
    ctx = _ctx(liger=True, finetune="lora")
    T, h, V, chunk = 4 * 4096, 4096, 32000, 2048
    kept = _r(T * h * 2) + 2 * R  # grad_input (bf16 hidden states), loss and its division
    assert logits_saved_bytes(ctx) == kept
    labels = _r(4 * 4097 * 8) + _r(T * 8)  # padded (b, s+1) int64 and the shifted copy
    vectors = _r(T * 4) + _r(T)  # loss_1d fp32, target_mask bool
    # from the second chunk on the previous chunk's logits are still bound (Liger's local
    # `logits_chunk`) when the next chunk's are made: two (chunk, V) blocks
    per_chunk = 2 * _r(chunk * V * 2)
    assert _r(chunk * V * 2) > _r(chunk * h * 2)  # larger than logits + grad_logits @ weight
    assert logits_forward_peak_bytes(ctx) == kept + labels + vectors + per_chunk
    # the eager loss of the same batch keeps fp32 log-probabilities: 2 GB
    eager = logits_saved_bytes(_ctx(finetune="lora"))
    assert eager > T * V * 4 > 15 * kept


def test_full_training_makes_the_head_gradient_in_forward() -> None:
    lora = logits_forward_peak_bytes(_ctx(liger=True, finetune="lora"))
    full = logits_forward_peak_bytes(_ctx(liger=True))
    assert full - lora == _r(32000 * 4096 * 2)  # zeros_like(lm_head.weight), bf16


def test_norms_and_swiglu_keep_less() -> None:
    eager = layer_saved(_ctx(micro_batch_size=1), False)
    fused = layer_saved(_ctx(micro_batch_size=1, liger=True), False)
    T, h, f = 4096, 4096, 11008
    # per RMSNorm: x.float() (4 B) and x̂ (2 B) become X (2 B); the SwiGLU drops act (2 B)
    per_norm = _r(T * h * 4) + _r(T * h * 2) - _r(T * h * 2)
    assert (sum(t.nbytes for t in eager) - sum(t.nbytes for t in fused)
            == 2 * per_norm + _r(T * f * 2))
    assert {t.name for t in fused} >= {"input_norm.input", "input_norm.rstd", "mlp.gate",
                                       "mlp.up", "mlp.down_input"}
    assert "mlp.act" not in {t.name for t in fused}
    # the head: the final norm's X and RSTD; lm_head's input is not kept
    assert [t.name for t in head_saved(_ctx(micro_batch_size=1, liger=True))] == [
        "final_norm.input", "final_norm.rstd"]


def test_liger_lowers_a_lora_peak_by_about_the_logits() -> None:
    values = {"model": "llama3.1-8b", "gpus": "1xH100", "framework": "hf",
              "precision": "bf16-pure", "finetune": "lora", "seq_len": 8192,
              "recompute": "full"}
    eager = estimate(build_scenario(values))
    fused = estimate(build_scenario({**values, "liger": True}))
    logits_fp32 = 8192 * 128256 * 4
    assert eager.peak_allocated_bytes - fused.peak_allocated_bytes > 2 * logits_fp32
    assert fused.terms.logits < logits_fp32 / 10


@pytest.mark.parametrize(("args", "words"), [
    (["--framework", "torchtune"], "--framework hf"),
    (["--framework", "hf", "--model", "gemma-7b"], "Llama, Mistral and Qwen2"),
    (["--framework", "hf", "--model", "qwen3-8b"], "Llama, Mistral and Qwen2"),
    (["--framework", "hf", "--gpus", "2xH100", "--tp", "2"], "data parallelism"),
    (["--framework", "hf", "--chunked-ce", "4"], "--chunked-ce"),
])
def test_liger_refusals(capsys, args: list[str], words: str) -> None:  # noqa: ANN001
    base = ["estimate", "--model", "llama3.1-8b", "--gpus", "1xH100", "--liger"]
    argv = base + args
    if "--model" in args:
        argv = ["estimate", "--gpus", "1xH100", "--liger"] + args
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error:") and words in err
    assert len(err.strip().splitlines()) == 1


def test_the_trace_stand_ins_save_what_liger_saves() -> None:
    """vramcalc/trace/liger.py on real CPU tensors: the Functions keep Liger's tensors."""
    torch = pytest.importorskip("torch")
    from vramcalc.trace.liger import _RMSNorm, _SiLUMul

    x = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(16, dtype=torch.bfloat16, requires_grad=True)
    y = _RMSNorm.apply(x, w)
    kept = y.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in kept] == [(16, 16), (16,), (16,)]  # X rows, W, RSTD
    assert kept[2].dtype == torch.float32 and kept[0].data_ptr() == x.data_ptr()
    a = torch.randn(4, 32, requires_grad=True)
    b = torch.randn(4, 32, requires_grad=True)
    c = _SiLUMul.apply(a * 1, b * 1)
    assert len(c.grad_fn.saved_tensors) == 2  # a and b, no activation output


def test_the_trace_and_the_analytic_model_agree_on_liger_rows() -> None:
    pytest.importorskip("torch")
    from vramcalc.trace.engine import trace
    from vramcalc.validate import scenario_for

    for kw in ({"precision": "amp-bf16"}, {"precision": "bf16-pure", "finetune": "lora",
                                           "recompute": "full"}):
        _, scn = scenario_for("llama-gqa", framework="hf", liger=True, **kw)
        ana, tra = estimate(scn), trace(scn).report
        assert abs(ana.peak_allocated_bytes / tra.peak_allocated_bytes - 1) < 0.03


def test_liger_lora_forward_counts_the_residual_once() -> None:
    # LigerRMSNorm keeps X, the residual itself: the forward instant at each adapter holds
    # it once (transformers' RMSNorm keeps an fp32 copy beside it instead)
    pytest.importorskip("torch")
    from vramcalc.trace.engine import trace
    from vramcalc.validate import scenario_for

    for targets in ("all-linear", "up"):
        _, scn = scenario_for("llama-deep", framework="hf", liger=True, finetune="lora",
                              precision="bf16-pure", lora_targets=targets)
        ana, tra = estimate(scn), trace(scn).report
        assert ana.peak_phase == tra.peak_phase == "forward"
        assert abs(ana.peak_allocated_bytes / tra.peak_allocated_bytes - 1) < 1e-4
