"""torchtune's q/k norms (Qwen3) and its attention in MoE layers.

Sources (pytorch/torchtune bd2a0fc7):

- torchtune/models/qwen3/_component_builders.py: `q_norm=RMSNorm(dim=head_dim)`,
  `k_norm=RMSNorm(dim=head_dim)`, torchtune's own RMSNorm (torchtune/modules/rms_norm.py:
  `x_fp32 = x.float()`, `(x_fp32 * rsqrt(mean(x_fp32²) + eps)).type_as(x) * scale`), which
  keeps the fp32 copy and the fp32 rsqrt, and x̂ only for a trained scale;
- torchtune/modules/attention.py `MultiHeadAttention.forward`: RoPE on (b, s, heads, d),
  then the transpose to (b, heads, s, d), then `q_norm` / `k_norm`, then k and v expanded to
  every query head (`expand(...).flatten(1, 2)`) for SDPA — in every layer, MoE or dense.

The trace engine runs that order with torchtune's RMSNorm (vramcalc/trace/reference_model.py).
"""

from __future__ import annotations

import pytest

from vramcalc.rank import RankContext
from vramcalc.terms import activations as act
from vramcalc.validate import scenario_for
from vramcalc.validate.compare import compare


def _saved(finetune: str, shape: str = "qwen3-qknorm", moe: bool = False) -> dict[str, int]:
    kw = {"lora_targets": "q,v"} if finetune != "full" else {}
    _, scn = scenario_for(shape, framework="torchtune", finetune=finetune, recompute="none",
                          precision="bf16-pure", micro_batch_size=2, seq_len=512, **kw)
    scn = scn.resolved()
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    return {t.name: t.nbytes for t in act.layer_saved(ctx, moe)}


def test_torchtune_qk_norms_keep_fp32_copies_of_the_rotated_q_and_k() -> None:
    # qwen3-qknorm: 16 query heads, 8 kv heads of 128; b = 2, s = 512
    b, s, a, g, d = 2, 512, 16, 8, 128
    full = _saved("full")
    assert full["attn.q_norm.x_fp32"] == b * s * a * d * 4 == 8_388_608
    assert full["attn.q_norm.rstd"] == b * s * a * 4 == 65_536
    assert full["attn.k_norm.x_fp32"] == b * s * g * d * 4 == 4_194_304
    assert full["attn.k_norm.rstd"] == b * s * g * 4 == 32_768
    assert full["attn.q_norm.xhat"] == b * s * a * d * 2  # the trained scale's x̂
    lora = _saved("lora")
    assert lora["attn.q_norm.x_fp32"] == 8_388_608 and "attn.q_norm.xhat" not in lora


def test_torchtune_moe_layers_expand_k_and_v_like_its_dense_layers() -> None:
    # moe-interleaved: 16 query heads of 64, 4 kv heads; k and v reach SDPA as (b, a, s, d)
    b, s, a, d = 2, 512, 16, 64
    moe, dense = _saved("lora", "moe-interleaved", True), _saved("lora", "moe-interleaved")
    assert moe["attn.k"] == moe["attn.v"] == dense["attn.k"] == b * s * a * d * 2
    assert moe["attn.q_norm.x_fp32"] == dense["attn.q_norm.x_fp32"] == b * s * a * d * 4


@pytest.mark.parametrize("shape,finetune,recompute", [
    ("qwen3-qknorm", "full", "none"),  # was -1.3 %
    ("qwen3-qknorm", "lora", "none"),  # was -1.8 %
    ("qwen3-qknorm", "qlora", "none"),  # was -1.9 %
    ("moe-interleaved", "lora", "none"),  # was -3.1 %
    ("moe-interleaved", "dora", "none"),  # was -2.8 %
    ("moe-interleaved", "qlora", "none"),  # was +2.0 % (forward +2.7 %)
    ("moe-interleaved", "qlora", "full"),  # was -1.4 %
])
def test_torchtune_qk_norm_and_moe_layers_agree_with_the_trace(
        shape: str, finetune: str, recompute: str) -> None:
    pytest.importorskip("torch")
    kw = {"lora_targets": "q,k,v,o", "lora_dropout": 0.0} if finetune != "full" else {}
    name, scn = scenario_for(shape, framework="torchtune", finetune=finetune,
                             recompute=recompute, precision="bf16-pure", micro_batch_size=2,
                             seq_len=512, attention="flash", **kw)
    row = compare(name, scn)
    assert abs(row["rel_error"]) < 0.001, row["rel_error"]
    for phase in ("forward", "backward"):
        assert abs(row["phases"][phase]["rel_error"]) < 0.006, (phase, row["phases"][phase])
