"""The megatron profile's dropout (`--dropout`): masks kept only when p > 0.

Expected bytes are derived by hand (never from the code's output) from Korthikanti et al.
2022 (arXiv:2205.05198) Table 2, 34·sbh + 5·as²b per layer, minus exactly what Megatron-LM
d98e8a64 does not keep when dropout is 0:
- megatron/core/fusions/fused_bias_dropout.py `_bias_dropout_add_func`: `residual +
  dropout(x + bias, p)`; torch's dropout with p = 0 in training returns its input itself
  (ATen Dropout.cpp: the fused kernel needs p > 0, `_dropout_impl` returns the input when
  p == 0), so the two 1-byte masks (attention output, MLP output) disappear: -2·sbh, from
  the paper's 10 replicated sbh (÷t only under sequence parallelism);
- megatron/core/transformer/dot_product_attention.py `DotProductAttention.forward`:
  `bmm(attention_dropout(probs), v)` then reads the softmax output itself: the unfused core
  loses its 1-byte mask and its 2-byte dropout output, -3·as²b.
Defaults: TransformerConfig hidden_dropout = attention_dropout = 0.1
(megatron/core/transformer/transformer_config.py; the --hidden-dropout / --attention-dropout
defaults, megatron/training/arguments.py `_add_network_size_args`).
Case: the calibration's test model (12L, h 512, 8 heads, f 4h, b 4, s 1024), bf16.
"""

from __future__ import annotations

import pytest
from megatron_models import GPT_SMALL

from vramcalc.errors import InputError
from vramcalc.options import build_scenario
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms.megatron_layer import megatron_layer_bytes
from vramcalc.training import TrainingConfig

B, S, H, A = 4, 1024, 512, 8
SBH = S * B * H  # 2_097_152
AS2B = A * S * S * B  # 33_554_432
LSE = 4 * A * S * B  # fp32 logsumexp (b, a, s) of the flash core: 131_072


def _bytes(dropout: float | None, attention: str = "flash", tp: int = 1, sp: bool = False,
           recompute: str = "none") -> int:
    tr = TrainingConfig(seq_len=S, micro_batch_size=B, precision="bf16", framework="megatron",
                        attention=attention, recompute=recompute, dropout=dropout)
    par = ParallelConfig(dp=1, tp=tp, sequence_parallel=sp)
    return megatron_layer_bytes(RankContext(GPT_SMALL, tr, par))


def test_default_is_megatrons_0_1_table_2() -> None:
    assert _bytes(None) == 34 * SBH + LSE == 71_434_240
    assert _bytes(None) == _bytes(0.1) == _bytes(0.05)


def test_dropout_0_drops_the_two_bias_dropout_add_masks() -> None:
    assert _bytes(0.0) == 32 * SBH + LSE == 67_239_936
    assert _bytes(None) - _bytes(0.0) == 2 * SBH  # two (s, b, h) bool masks


def test_unfused_core_keeps_only_the_softmax_output_without_dropout() -> None:
    # p > 0: softmax 2 B + mask 1 B + dropout output 2 B; p = 0: the softmax output alone
    assert _bytes(None, "eager") == 34 * SBH + 5 * AS2B == 239_075_328
    assert _bytes(0.0, "eager") == 32 * SBH + 2 * AS2B == 134_217_728
    assert _bytes(None, "eager") - _bytes(0.0, "eager") == 2 * SBH + 3 * AS2B


def test_tensor_parallel_masks_are_replicated_without_sp() -> None:
    # 10 replicated (8 without masks) + 24/t sharded, core/t
    assert _bytes(None, tp=2) == 10 * SBH + 12 * SBH + LSE // 2 == 46_202_880
    assert _bytes(0.0, tp=2) == 8 * SBH + 12 * SBH + LSE // 2 == 42_008_576
    assert _bytes(None, "eager", tp=2) - _bytes(0.0, "eager", tp=2) == 2 * SBH + 3 * AS2B // 2


def test_sequence_parallel_shards_the_masks() -> None:
    assert _bytes(None, tp=2, sp=True) == 34 * SBH // 2 + LSE // 2 == 35_717_120
    assert _bytes(0.0, tp=2, sp=True) == 32 * SBH // 2 + LSE // 2 == 33_619_968


def test_recompute() -> None:
    assert _bytes(0.0, recompute="selective") == 32 * SBH  # core recomputed either way
    assert _bytes(None, recompute="selective") == 34 * SBH
    assert _bytes(0.0, recompute="full") == _bytes(None, recompute="full") == 2 * SBH


def _scenario(**kw: object) -> object:
    return build_scenario({"model": "gpt2", "gpus": "1xH100", **kw})


def test_other_profiles_model_dropout_off_and_accept_only_0() -> None:
    for fw in ("reference", "hf"):
        _scenario(framework=fw, dropout=0)
        with pytest.raises(InputError, match="only the megatron profile models dropout"):
            _scenario(framework=fw, dropout=0.1)
    _scenario(framework="megatron", dropout=0.3)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_probability_bounds(p: float) -> None:
    with pytest.raises(InputError, match="--dropout"):
        _scenario(framework="megatron", dropout=p)


@pytest.mark.parametrize(("tp", "norm", "stats"), [(1, "layernorm", 2), (4, "layernorm", 2),
                                                   (4, "rmsnorm", 1)])
def test_qk_layernorm_keeps_q_k_and_their_row_statistics(tp: int, norm: str,
                                                         stats: int) -> None:
    """--qk-layernorm: Transformer Engine's norm on each q and k head (the model's
    normalization): ops/basic/layer_norm.py `save_for_backward(x, means, rstdevs)`,
    rmsnorm.py `(x, rstdevs)`. Per layer on a TP rank: q and k in bf16, (s·b·a/t)·d·2 B
    each, and 4 B per statistic per (token, head); the rest of the layer is unchanged."""
    spec = GPT_SMALL.model_copy(update={"norm_kind": norm})
    tr = TrainingConfig(seq_len=S, micro_batch_size=B, precision="bf16", framework="megatron")
    par = ParallelConfig(dp=1, tp=tp)
    plain = megatron_layer_bytes(RankContext(spec, tr, par))
    qk = megatron_layer_bytes(RankContext(spec.model_copy(update={"qk_norm": True}), tr, par))
    d = H // A
    rows = S * B * A // tp  # (token, head) rows of q on this rank; k has as many (no GQA)
    assert qk - plain == 2 * (rows * d * 2) + 2 * stats * rows * 4
