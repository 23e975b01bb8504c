"""The Python RMSNorm's backward inside a layer (transformers' LlamaRMSNorm and its Qwen3 /
Qwen3-MoE copies, torchtune's `modules/rms_norm.py`): x32 = x.float(), x32 · rsqrt(mean(x32²)
+ eps), cast back, · w.

Hand-derived from torch's derivatives (tools/autograd/derivatives.yaml): `mul.Tensor` gives
grad · other (and grad · self for a second input that needs it), `mean.dim` expands the
gradient and divides it by the width, `pow.Tensor_Scalar` computes grad · (2 · x.pow(1)):
when pow's backward makes its product, d x̂ (fp32), the x32 · rsqrt term of d x32, mean's
expanded gradient and pow's x.pow(1) and 2 · x.pow(1) exist, five (b, s, h) fp32 tensors,
beside dL/d residual. The norm's fp32 input stays saved (pow still reads it); its x̂ copy and
rsqrt output are freed. The post-attention norm runs after the MLP's backward (every MLP or
MoE gradient made, the attention's saved tensors held), the input norm after the attention's.

moe-interleaved (vramcalc/validate/shapes.py): h = 1024, four layers, MoE on layers 1 and 3
(bottom up), so the top layer is MoE and the bottom one dense.

Also the hf GPT-2 eager attention core's instant (the softmax's backward), which the same
layer-instant list holds.
"""

from __future__ import annotations

import pytest

from vramcalc.rank import RankContext
from vramcalc.terms import activations as act
from vramcalc.terms.profile import profile
from vramcalc.validate import scenario_for
from vramcalc.validate.compare import compare


def _ctx(shape: str, framework: str, **kw: object) -> RankContext:
    _, scn = scenario_for(shape, framework=framework, attention="flash", **kw)
    scn = scn.resolved()
    return RankContext(scn.model, scn.training, scn.parallel, 0)


def _moments(ctx: RankContext, moe: bool) -> dict[str, tuple[int, int, str]]:
    return {m.name: (m.held, m.work, m.grads) for m in act.layer_backward_moments(ctx, moe)}


def test_post_attention_and_input_norm_instants_by_hand() -> None:
    # bf16 weights, T = 2 · 512 tokens: dL/d residual (T, h) bf16 beside five fp32 (T, h)
    T, h = 1024, 1024
    ctx = _ctx("moe-interleaved", "hf", precision="bf16-pure", micro_batch_size=2,
               seq_len=512)
    for moe in (False, True):
        moments = _moments(ctx, moe)
        attn_held = moments["attention"][0]  # flash: nothing of the core freed in hf
        held, work, grads = moments["post_norm"]
        assert work == T * h * 2 + 5 * T * h * 4 == 23_068_672
        assert held == attn_held + T * h * 4  # the post-attention norm's fp32 input
        assert grads == "mlp"
        held, work, grads = moments["input_norm"]
        assert (held, work, grads) == (T * h * 4, 23_068_672, "all")
    # a fused norm has no such chain: Liger's, and the reference profile's F.rms_norm
    assert "post_norm" in _moments(_ctx("llama-gqa", "hf", precision="bf16-pure"), False)
    assert "post_norm" not in _moments(_ctx("llama-gqa", "hf", precision="bf16-pure",
                                            liger=True), False)
    assert "post_norm" not in _moments(_ctx("moe-interleaved", "reference",
                                            precision="bf16-pure"), True)


def test_interleaved_layers_peak_at_either_end_of_each_kind() -> None:
    # bottom up: dense, MoE, dense, MoE. Besides the top (MoE) and bottom (dense) layers,
    # the topmost dense layer (1 from the top) and the bottommost MoE layer (2 from the top)
    P = profile(_ctx("moe-interleaved", "torchtune", precision="bf16-pure",
                     micro_batch_size=2, seq_len=256))
    assert P.other_top[0] == 1 and P.other_bottom[0] == 2
    assert {m.name for m in P.other_bottom[1]} >= {"moe", "post_norm", "input_norm"}


@pytest.mark.parametrize("shape,framework,kw", [
    # the top MoE layer's post-attention norm (was -1.19 % at the peak)
    ("moe-interleaved", "hf", {"precision": "bf16-pure", "micro_batch_size": 2,
                               "seq_len": 512}),
    # the bottommost MoE layer's input norm (was -1.35 % at the peak)
    ("moe-interleaved", "torchtune", {"precision": "bf16-pure", "micro_batch_size": 2,
                                      "seq_len": 256}),
    # selective recompute: the core is not yet re-run at the post-attention norm (was -0.5 %
    # in backward)
    ("qwen3-moe", "hf", {"precision": "bf16", "recompute": "selective",
                         "micro_batch_size": 2, "seq_len": 256}),
])
def test_norm_instants_agree_with_the_trace(shape: str, framework: str,
                                            kw: dict[str, object]) -> None:
    pytest.importorskip("torch")
    name, scn = scenario_for(shape, framework=framework, attention="flash", **kw)
    row = compare(name, scn)
    assert abs(row["rel_error"]) < 0.001, row["rel_error"]
    assert abs(row["phases"]["backward"]["rel_error"]) < 0.001, row["phases"]["backward"]


@pytest.mark.parametrize("precision,recompute", [
    ("fp32", "none"),  # was +0.79 % at the peak: v's copy was still counted
    ("bf16-pure", "selective"),  # was -1.28 %: the re-run's q and kᵀ copies were missing
])
def test_hf_gpt2_eager_softmax_backward_holds_the_q_and_k_copies(precision: str,
                                                                 recompute: str) -> None:
    # transformers' GPT-2 eager attention on b = 2: matmul copies q, kᵀ and v out of the
    # fused c_attn output; at the softmax's backward probs @ v's has run (v's copy freed)
    pytest.importorskip("torch")
    name, scn = scenario_for("gpt2-relu", framework="hf", precision=precision,
                             attention="eager", recompute=recompute, micro_batch_size=2,
                             seq_len=512 if recompute == "selective" else 1024)
    row = compare(name, scn)
    assert abs(row["rel_error"]) < 0.001, row["rel_error"]
