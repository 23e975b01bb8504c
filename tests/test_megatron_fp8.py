"""The megatron profile's gated MLP and FP8 (Transformer Engine) layers.

Expected bytes are derived by hand (never from the code's output) from Korthikanti et al.
2022 (arXiv:2205.05198) Table 2 and NVIDIA/Megatron-LM d98e8a64:
- gated MLP (SwiGLU): megatron/core/transformer/mlp.py `MLP.forward` runs fc1 to (s, b, 2f)
  and `bias_swiglu_impl` (fusions/fused_bias_swiglu.py SwiGLUFunction, on by default:
  megatron/training/arguments.py `--no-bias-swiglu-fusion` is store_false), which keeps its
  (s, b, 2f) bf16 input; fc2 keeps its (s, b, f) input: the MLP keeps 2 + 4f/h + 2f/h + 1
  (dropout mask) sbh instead of a GELU MLP's 2 + 2f/h + 2f/h + 1;
- FP8: Transformer Engine keeps each GEMM's input as a 1-byte FP8 copy with a (1,) fp32
  scale_inverse (512 B allocated) instead of the bf16 input: QKV and fc1 inputs (replicated
  without sequence parallelism) 2 -> 1 sbh, the output projection's input 2 -> 1 and fc2's
  2f/h -> f/h sbh (÷t); Megatron's delayed-scaling recipe keeps an amax history of length 1
  (megatron/core/transformer/transformer_config.py fp8_amax_history_len = 1), not TE's 1024.
Case: the calibration's GPT (12L, h 512, 8 heads, s 1024, b 4), flash attention (fp32
logsumexp 4·a·s·b), dropout 0.1.
"""

from __future__ import annotations

import pytest
from megatron_models import GPT_SMALL

from vramcalc.errors import InputError
from vramcalc.options import build_scenario
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms.lowprec import check_lowprec, fp8_meta_bytes, fp8_weight_cache_bytes
from vramcalc.terms.megatron_layer import megatron_layer_bytes
from vramcalc.training import TrainingConfig

B, S, H, A = 4, 1024, 512, 8
SBH = S * B * H  # 2_097_152
LSE = 4 * A * S * B  # 131_072
SCALES = 4 * 512  # four (1,) fp32 scale_inverses, 512 B blocks
GATED = GPT_SMALL.model_copy(update={"mlp_kind": "gated", "hidden_act": "silu",
                                     "intermediate_size": 1536})  # f/h = 3


def _ctx(spec: object = GPT_SMALL, precision: str = "bf16", tp: int = 1,
         sp: bool = False) -> RankContext:
    tr = TrainingConfig(seq_len=S, micro_batch_size=B, precision=precision,
                        framework="megatron")
    return RankContext(spec, tr, ParallelConfig(dp=1, tp=tp, sequence_parallel=sp))


def test_gated_mlp_keeps_the_swiglu_input() -> None:
    # 15 sbh outside the MLP + 2 + 4·3 + 2·3 + 1 = 36 sbh
    assert megatron_layer_bytes(_ctx(GATED)) == 36 * SBH + LSE
    # the GELU MLP of the same width: 15 + 2 + 6 + 6 + 1 = 30 sbh
    gelu = GPT_SMALL.model_copy(update={"intermediate_size": 1536})
    assert megatron_layer_bytes(_ctx(gelu)) == 30 * SBH + LSE


def test_fp8_gemm_inputs() -> None:
    # 34 sbh -> 34 - 1 (qkv) - 1 (proj) - 1 (fc1) - 4 (fc2: f/h = 4) = 27 sbh
    assert megatron_layer_bytes(_ctx(precision="fp8")) == 27 * SBH + LSE + SCALES
    # tp 2 without SP: replicated 10 -> 8 sbh, sharded 24 -> 19 sbh, the core ÷2
    assert megatron_layer_bytes(_ctx(precision="fp8", tp=2)) == (
        8 * SBH + 19 * SBH // 2 + LSE // 2 + SCALES)
    # with SP all ÷2
    assert megatron_layer_bytes(_ctx(precision="fp8", tp=2, sp=True)) == (
        (27 * SBH + LSE) // 2 + SCALES)
    # gated: 36 -> 36 - 3 - 3 (fc2: f/h = 3) = 30 sbh
    assert megatron_layer_bytes(_ctx(GATED, "fp8")) == 30 * SBH + LSE + SCALES


def test_fp8_amax_history_is_megatrons() -> None:
    # per GEMM module: forward 3 + backward 2 scales, and amax histories (1, 3) and (1, 2):
    # four fp32 tensors of at most 12 bytes, 512 B each; Megatron's layer has 4 GEMM
    # modules (linear_qkv, linear_proj, linear_fc1, linear_fc2) x 12 layers
    assert fp8_meta_bytes(_ctx(precision="fp8")) == 4 * 512 * 4 * 12
    assert fp8_meta_bytes(_ctx(GATED, "fp8")) == 4 * 512 * 4 * 12  # gate/up fused in fc1
    ref = RankContext(GPT_SMALL, TrainingConfig(seq_len=S, micro_batch_size=B,
                                                precision="fp8"), ParallelConfig(dp=1))
    # the reference profile: q, k, v, o, fc, proj = 6 modules, TE's default history of
    # 1024: (1024, 3) and (1024, 2) fp32
    assert fp8_meta_bytes(ref) == (512 + 12288 + 512 + 8192) * 6 * 12


def test_fp8_weight_cache_of_fused_modules() -> None:
    # the same FP8 bytes (data + transpose: no GPU given, TE keeps both) however the GEMMs
    # are fused — per layer 4·512² (q, k, v, o) + 2·2048·512 (fc, proj) = 3 MiB, 1 byte
    # each, twice — plus one (1,) fp32 scale_inverse (512 B) per module: 4 per layer for
    # Megatron, 6 for the reference profile
    data = 2 * (4 * 512 * 512 + 2 * 2048 * 512) * 12
    assert fp8_weight_cache_bytes(_ctx(precision="fp8"), None) == data + 512 * 4 * 12
    ref = RankContext(GPT_SMALL, TrainingConfig(seq_len=S, micro_batch_size=B,
                                                precision="fp8"), ParallelConfig(dp=1))
    assert fp8_weight_cache_bytes(ref, None) == data + 512 * 6 * 12


def test_fp8_is_accepted_on_megatron_only_among_stacks() -> None:
    base = {"model": "8b", "gpus": "8xH100", "precision": "fp8", "zero": 1}
    check_lowprec(build_scenario({**base, "framework": "megatron"}))
    with pytest.raises(InputError, match="reference and megatron profiles only"):
        check_lowprec(build_scenario({**base, "framework": "hf"}))
    with pytest.raises(InputError, match="mixture-of-experts"):
        check_lowprec(build_scenario({**base, "model": "mixtral-8x7b", "framework": "megatron"}))
