"""The megatron profile's multi-latent attention layer, DeepSeek-V3's dims, bytes by hand.

Every expected number below is derived tensor by tensor from NVIDIA/Megatron-LM d98e8a64
(never read off the code's output):
- megatron/core/models/gpt/gpt_layer_specs.py `get_gpt_layer_with_transformer_engine_
  submodules` (multi_latent_attention, no mla_down_proj_fusion): input_layernorm is a
  separate TENorm (keeps its input, 2·h per token); linear_q_down_proj and
  linear_kv_down_proj are `backend.linear()` = TELinear, which MLASelfAttention.__init__
  builds with parallel_mode="duplicated" (whole weights, no gather; both keep the norm
  output, one tensor, 2·h); with --qk-layernorm, mla_qk_norm_config.py makes the up
  projections TELayerNormColumnParallelLinear: each keeps its norm's input and its GEMM
  input (ln_out): 2·qr + 2·qr for q, 2·(kr + dr) (kv_compressed is a torch.split view of
  the whole kv down-projection output) + 2·kr for kv;
- multi_latent_attention.py `qkv_up_proj_and_rope_apply`: query (s, b, a, dn + dr), key
  (s, b, a, dn + dr) and value.contiguous() (s, b, a, dv) are new tensors kept by the core
  (2·a·192 + 2·a·192 + 2·a·128); TE flash keeps its fp32 logsumexp (4·a) and its output
  (s, b, a·dv), linear_proj's input (2·a·128); the attention bias-dropout-add keeps a 1-byte
  mask (h) at Megatron's default dropout 0.1;
- the dense MLP (gated, f = 18432): pre-MLP norm input 2·h, fc1 input 2·h, fused SwiGLU
  input 4·f, fc2 input 2·f, mask h (Korthikanti Table 2 as tests/test_megatron_dropout.py).
DeepSeek-V3 (config.json): h 7168, a 128, qr 1536, kr 512, dn 128, dr 64, dv 128.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_catalog import DEEPSEEK_V3

from vramcalc.cli import main
from vramcalc.hf_config import from_hf_config
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms.megatron_layer import megatron_layer_bytes, megatron_layer_tensors
from vramcalc.terms.saved import dims
from vramcalc.terms.saved_layers import mla_saved
from vramcalc.training import TrainingConfig

SPEC = from_hf_config(DEEPSEEK_V3, "DeepSeek-V3 config.json")
S, B = 4096, 1
T = S * B
H, A, QR, KR, DR, DV, D, F = 7168, 128, 1536, 512, 64, 128, 192, 18432

# per token, whole on each TP rank without SP (÷t with SP): input_layernorm input, the
# down projections' input, q_compressed, q ln_out, kv down output, kv ln_out, dropout mask
ATT_REP = 2 * H + 2 * H + 2 * QR + 2 * QR + 2 * (KR + DR) + 2 * KR + H  # 44_160
# per token, split over the heads (÷t): query, key, value, logsumexp, core output
ATT_HEADS = 2 * A * D + 2 * A * D + 2 * A * DV + 4 * A + 2 * A * DV  # 164_352
MLP_REP = 2 * H + 2 * H + H  # pre-MLP norm input, fc1 input, mask: 35_840
MLP_SHARD = 4 * F + 2 * F  # SwiGLU input, fc2 input: 110_592


def _ctx(tp: int = 1, sp: bool = False, recompute: str = "none",
         framework: str = "megatron") -> RankContext:
    tr = TrainingConfig(seq_len=S, micro_batch_size=B, precision="bf16", framework=framework,
                        recompute=recompute)
    return RankContext(SPEC, tr, ParallelConfig(dp=1, tp=tp, sequence_parallel=sp))


def test_tp1_dense_layer_by_hand() -> None:
    assert ATT_REP == 44_160 and ATT_HEADS == 164_352
    expected = T * (ATT_REP + ATT_HEADS + MLP_REP + MLP_SHARD)
    assert expected == 1_453_850_624
    assert megatron_layer_bytes(_ctx()) == expected


def test_tp8_sequence_parallel_splits_everything() -> None:
    # the duplicated down projections run on the local s/t shard; the rest as Table 2
    expected = T * (ATT_REP + ATT_HEADS + MLP_REP + MLP_SHARD) // 8
    assert expected == 181_731_328
    assert megatron_layer_bytes(_ctx(tp=8, sp=True)) == expected


def test_tp8_without_sp_keeps_the_latents_whole() -> None:
    expected = T * (ATT_REP + ATT_HEADS // 8 + MLP_REP + MLP_SHARD // 8)
    assert expected == 468_451_328
    assert megatron_layer_bytes(_ctx(tp=8)) == expected


def test_selective_recompute_drops_only_the_logsumexp() -> None:
    # checkpoint_core_attention: q, k, v are the checkpoint's inputs, the output linear_proj's
    assert megatron_layer_bytes(_ctx()) - megatron_layer_bytes(_ctx(recompute="selective")) \
        == T * 4 * A
    # full recompute: the layer input alone, 2·s·b·h ÷ t under SP (unchanged by MLA)
    assert megatron_layer_bytes(_ctx(tp=8, sp=True, recompute="full")) == 2 * T * H // 8


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (8, True)])
def test_unfused_core_keeps_the_scores_in_place_of_the_logsumexp(tp: int, sp: bool) -> None:
    """--attention eager (TE's UnfusedDotProductAttention, which Megatron's
    --attention-backend unfused selects): the (b, a/t, s, s) softmax output (2 B), the
    dropout mask (1 B) and output (2 B) at the default dropout 0.1 (Korthikanti et al.
    2022 Table 2's 5·a·s²·b), where the flash core keeps its fp32 logsumexp (4·a per
    token)."""
    def ctx(attention: str) -> RankContext:
        tr = TrainingConfig(seq_len=S, micro_batch_size=B, precision="bf16",
                            framework="megatron", attention=attention)
        return RankContext(SPEC, tr, ParallelConfig(dp=1, tp=tp, sequence_parallel=sp))

    diff = megatron_layer_bytes(ctx("eager")) - megatron_layer_bytes(ctx("flash"))
    assert diff == 5 * B * A * S * S // tp - T * 4 * A // tp


def test_moe_layer_keeps_the_same_attention() -> None:
    rows = [(name, nbytes) for name, _, nbytes in megatron_layer_tensors(_ctx(8, True), True)]
    names = [name for name, _ in rows]
    attention = rows[:names.index("pre_mlp_layernorm input")]
    assert sum(nbytes for _, nbytes in attention) == T * (ATT_REP + ATT_HEADS) / 8
    assert names[-1] == "experts: router, dispatch, expert MLPs"


def test_against_the_reference_profile_at_tp1() -> None:
    """The same tensors as the reference profile's MLA table (vramcalc/terms/saved_layers.py
    `mla_saved`, from the down projections' input on, bf16, flash) except where Megatron's
    layer differs: the reference pads v from dv to d for its kernel and crops the output
    back with a copy (2·a·(d - dv) + 2·a·d more per token); Megatron's TE attention takes
    k_channels = d, v_channels = dv (MultiLatentAttention.__init__), pads nothing outside
    THD packing and hands its (s, b, a·dv) output to linear_proj itself. The reference
    also counts the latent norms' fp32 1/rms, which Table 2's convention leaves out."""
    ref_ctx = _ctx(framework="reference")
    ref = sum(r.numel * (4 if r.dtype == "fp32" else 2) * r.count
              for r in mla_saved(ref_ctx, dims(ref_ctx)) if not r.name.endswith(".rstd"))
    meg = {name: nbytes for name, _, nbytes in megatron_layer_tensors(_ctx())}
    meg_same = sum(meg.values()) - meg["input_layernorm input"] \
        - meg["bias-dropout-add mask (attention)"] - T * (MLP_REP + MLP_SHARD)
    assert ref - meg_same == T * (2 * A * (D - DV) + 2 * A * D) == 268_435_456


def _write(tmp_path: Path, cfg: dict[str, Any]) -> str:
    import json
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize(("extra", "missing"),
                         [(["--cp", "2", "--gpus", "2xH100"], "cp=2"),
                          (["--precision", "fp8", "--gpus", "1xH100"], "FP8")])
def test_megatron_mla_refusals_are_one_line(tmp_path: Path, capsys: Any, extra: list[str],
                                            missing: str) -> None:
    cfg = {**DEEPSEEK_V3, "num_hidden_layers": 2, "n_routed_experts": 8}
    assert main(["estimate", "--model", _write(tmp_path, cfg), "--framework", "megatron",
                 *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "--framework megatron" in err and f"; not {missing}" in err


def test_deepseek_v3_estimates_under_megatron(capsys: Any) -> None:
    assert main(["estimate", "--model", "deepseek-v3", "--gpus", "512xH100",
                 "--framework", "megatron", "--tp", "8", "--sequence-parallel", "--pp", "8",
                 "--ep", "8", "--last-stage-layers", "5", "--recompute", "selective"]) == 0
    assert "FITS" in capsys.readouterr().out
