"""Bytes per parameter for every precision policy and optimizer (model states).

Independent sources:
- ZeRO paper (Rajbhandari et al. 2019, arXiv:1910.02054, Sec. 3): mixed-precision Adam keeps
  2Ψ (16-bit weights) + 2Ψ (16-bit grads) + 12Ψ (fp32 master, momentum, variance) = 16Ψ.
- PyTorch optimizers (torch.optim docs): AdamW keeps exp_avg and exp_avg_sq (2 tensors the
  size of the parameter); SGD with momentum keeps momentum_buffer; plain SGD keeps none.
- Megatron-LM distributed-optimizer docs: fp32 training 16 B/param (4 + 4 + 8).
- bitsandbytes 8-bit Adam (Dettmers et al. 2022): 1 byte per state element plus one fp32
  absmax per block; `Optimizer2State.init_state` in bitsandbytes/optim/optimizer.py uses
  256-element blocks (2048 in releases before 0.44), fp32 states below min_8bit_size=4096.

A one-layer model with large, 512-byte-aligned tensors keeps allocator rounding out of the
arithmetic, so the expected values are plain products.
"""

from __future__ import annotations

import pytest

from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms.gradients import gradients_bytes
from vramcalc.terms.optimizer_states import optimizer_state_split
from vramcalc.terms.weights import weights_bytes
from vramcalc.training import TrainingConfig

# every tensor numel is a multiple of 4096, so no 512-byte rounding and no partial 8-bit block
SPEC = ModelSpec(hidden_size=4096, num_hidden_layers=1, num_attention_heads=32,
                 intermediate_size=8192, vocab_size=4096, final_norm=False)
# norms (4096 elements) are the smallest tensors: 4096 x 1 byte = 4096 B, a multiple of 512
N = SPEC.num_params


def model_state_bytes(precision: str, optimizer: str, **kw) -> tuple[int, int, int]:
    tr = TrainingConfig(precision=precision, optimizer=optimizer, **kw)
    ctx = RankContext(SPEC, tr, ParallelConfig(dp=1))
    opt = optimizer_state_split(ctx)
    return weights_bytes(ctx), gradients_bytes(ctx), opt["states"] + opt["master"]


@pytest.mark.parametrize(
    ("precision", "optimizer", "w", "g", "o"),
    [
        ("bf16", "adamw", 2, 2, 12),  # ZeRO paper: 2 + 2 + 12 = 16
        ("fp16", "adam", 2, 2, 12),  # ZeRO paper (fp16 mixed precision)
        ("fp32", "adamw", 4, 4, 8),  # Megatron docs fp32 row: 16 B/param
        ("amp-bf16", "adamw", 4, 4, 8),  # autocast keeps fp32 params/grads/states
        ("amp-fp16", "adamw", 4, 4, 8),
        ("bf16-pure", "adamw", 2, 2, 4),  # bf16 states, no master copy
        ("fp32", "sgd", 4, 4, 0),  # torch.optim.SGD without momentum keeps no state
        ("fp32", "sgd-momentum", 4, 4, 4),  # momentum_buffer
        ("bf16", "sgd-momentum", 2, 2, 8),  # fp32 master + fp32 momentum
        ("fp32", "lion", 4, 4, 4),  # Lion keeps one moment (Chen et al. 2023, Alg. 2)
    ],
)
def test_bytes_per_param(precision: str, optimizer: str, w: int, g: int, o: int) -> None:
    wb, gb, ob = model_state_bytes(precision, optimizer)
    assert (wb, gb, ob) == (w * N, g * N, o * N)


def test_zero_paper_total_is_16_bytes_per_param() -> None:
    assert sum(model_state_bytes("bf16", "adamw")) == 16 * N


def test_adamw_8bit_states() -> None:
    # 2 states x 1 byte + 2 x fp32 absmax per 256 elements (every tensor is a 256-multiple);
    # the two 4096-element norms have 16 blocks -> 64 B of absmax, one 512-byte block each
    # plus the two shared 256-entry fp32 quantization maps ("dynamic", "udynamic": fill_qmap)
    _, _, ob = model_state_bytes("fp32", "adamw-8bit")
    norms = 2 * 4096
    assert ob == 2 * N + 2 * 4 * ((N - norms) // 256) + 2 * 2 * 512 + 2 * 256 * 4


def test_adafactor_factored_states() -> None:
    # matrices keep rows + cols fp32 elements; vectors keep a full second moment
    _, _, ob = model_state_bytes("fp32", "adafactor")
    h, f, V = 4096, 8192, 4096
    mats = [(V, h), (h, h), (h, h), (h, h), (h, h), (f, h), (f, h), (h, f), (V, h)]
    vectors = 2 * h  # two layer norms
    expected = 4 * (sum(r + c for r, c in mats) + vectors)
    assert ob == expected


def test_optimizer_dtype_bf16_halves_states() -> None:
    _, _, fp32_states = model_state_bytes("fp32", "adamw")
    _, _, bf16_states = model_state_bytes("fp32", "adamw", optimizer_dtype="bf16")
    assert bf16_states * 2 == fp32_states


def test_zero_paper_figure_1_model_states() -> None:
    """ZeRO paper Fig. 1: Ψ = 7.5B, N_d = 64 -> 120, 31.4, 16.6, 1.9 GB (decimal, rounded)."""
    psi, nd = 7.5e9, 64
    spec = ModelSpec(hidden_size=4096, num_hidden_layers=1, num_attention_heads=32,
                     intermediate_size=int((psi - 4096 * 4096 * 4) // (3 * 4096)) // 4096 * 4096,
                     vocab_size=4096, final_norm=False)
    scale = psi / spec.num_params  # the spec has ~7.5B params; scale the tiny difference away
    expected = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in expected.items():
        ctx = RankContext(spec, TrainingConfig(precision="bf16"), ParallelConfig(dp=nd, zero=stage))
        opt = optimizer_state_split(ctx)
        total = weights_bytes(ctx) + gradients_bytes(ctx) + opt["states"] + opt["master"]
        assert total * scale / 1e9 == pytest.approx(gb, abs=0.05)
