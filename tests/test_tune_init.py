"""torchtune's QLoRA model init replayed through the allocator model
(vramcalc/terms/tune_init.py): torchtune 0914d5cf (`lora_llama2` builds one template layer
on the GPU and deep-copies it per layer; `LoRALinear` quantizes with torchao v0.1 `to_nf4`;
torchtune's NF4 `clone` dequantizes and re-quantizes) and its training reads taken after
`reset_peak_memory_stats`, which leaves the init's cached segments in the reserved peak.

Llama-2-7B, r = 8 on q, k, v, output_proj and the MLP (7B_qlora_single_device.yaml at
0914d5cf): h = 4096, ffn = 11008, V = 32000, 32 layers, rotary cache per layer
(max_seq_len 4096, head_dim 128: (4096, 64, 2) fp32).
"""

from __future__ import annotations

from vramcalc.analytic import estimate
from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms.tune_init import init_replay

R = 512
H, F, V, L, RANK = 4096, 11008, 32000, 32, 8
TUNE = dict(model="llama2-7b", framework="torchtune", precision="bf16-pure", optimizer="adamw",
            attention="flash", recompute="full", seq_len=512, optimizer_impl="foreach",
            finetune="qlora", lora_rank=RANK, lora_targets="q,k,v,o,gate,up,down",
            qlora_impl="torchao", torchao_version="0.1", load="torchtune",
            micro_batch_size=2, grad_accum=16)


def rnd(n: int) -> int:
    return -(-n // R) * R


def _replay(**over: object):  # noqa: ANN202
    scn = build_scenario({**TUNE, **over}).resolved()
    return init_replay(RankContext(scn.model, scn.training, scn.parallel))


def _nf4(n: int) -> int:
    """torchao v0.1 NF4Tensor storages: int8 scalers (n/64), the bf16 quantization factor
    (a [:, 0] view of an n/64 tensor, `double_quantize_scalers`), the bf16 mean, the packed
    uint8 data (n/2) and the 16-entry bf16 table."""
    b = n // 64
    return rnd(b) + rnd(2 * b) + rnd(2) + rnd(n // 2) + rnd(32)


def _lora(i: int, o: int) -> int:
    return rnd(RANK * i * 2) + rnd(o * RANK * 2)


LINEARS = [(H, H)] * 4 + [(H, F), (F, H), (H, F)]
# one layer: seven NF4 weights with their adapters, rotary theta (64 fp32) and cache
# (4096 x 64 x 2 fp32), two RMSNorm scales (bf16)
LAYER = (sum(_nf4(i * o) + _lora(i, o) for i, o in LINEARS) + rnd(64 * 4)
         + rnd(4096 * 64 * 2 * 4) + 2 * rnd(2 * H))
REST = 2 * rnd(V * H * 2) + rnd(2 * H)  # tok_embeddings, output (bf16), final norm


def test_peak_request_is_the_last_clones_last_mlp_search() -> None:
    """The requests' high-water mark, by hand: while the 32nd deep copy quantizes its last
    MLP weight (up_proj, n = 4096·11008) the template and 31 copies are whole, the 32nd lacks
    that weight's storages and adapters, and in flight are: the dequantized bf16 weight
    (torchtune `clone`: `to_nf4(w.get_original_weight())`, 2n), and of `from_tensor` the
    table, the int8 scalers, the factor, the mean, the block absmax values
    (`get_block_absmax(...).max(dim=1).values`, n/64 bf16), the scaled blocks (2n) and
    `quantize_tensor_nearest`'s `value - nf4` and its `.abs()` (two (n, 16) bf16)."""
    rep = _replay()
    assert rep is not None
    n = H * F
    b = n // 64
    inflight = (rnd(2 * n) + rnd(32) + rnd(b) + rnd(2 * b) + rnd(2) + rnd(2 * b)
                + rnd(2 * n) + 2 * rnd(32 * n))
    assert rep.peak_requested == 33 * LAYER - (_nf4(n) + _lora(H, F)) + REST + inflight
    assert rep.end_allocated >= 32 * LAYER + REST  # the template is gone, the copies stay
    assert rep.peak_allocated >= rep.peak_requested  # + unsplit large-pool remainders


def test_init_reserved_matches_the_tutorials_model_init_reading() -> None:
    """torchtune 0914d5cf docs/source/tutorials/qlora_finetune.rst: 'Peak memory reserved,
    model init' 9.13 GB for this QLoRA config (a measurement, not an input of the replay)."""
    rep = _replay()
    assert rep is not None
    assert abs(rep.peak_reserved - 9.13e9) / 9.13e9 < 0.02
    # the fragmentation is the mechanism: ~1.8 GB above the allocated high-water mark
    assert rep.peak_reserved - rep.peak_allocated > 1.5e9


def test_training_reserved_starts_at_the_inits() -> None:
    """torchtune logs training after `memory_stats_log(reset_stats=True)`; the reset sets
    the reserved peak to the current reserved, i.e. the init's cached segments."""
    rep = _replay()
    assert rep is not None
    with_load = estimate(build_scenario(TUNE))
    assert with_load.peak_reserved_bytes == rep.peak_reserved
    assert with_load.phases["load"] == rep.peak_allocated
    without = estimate(build_scenario({**TUNE, "load": "none"}))
    assert without.peak_reserved_bytes < rep.peak_reserved  # the packing floor only


def test_runs_the_replay_does_not_cover() -> None:
    """torchao v0.2 quantizes in 1024² chunks (6081796b) and is not replayed; neither are
    bitsandbytes QLoRA or plain LoRA."""
    assert _replay(torchao_version="0.2") is None
    assert _replay(load="none") is None
    assert _replay(finetune="lora", qlora_impl=None, torchao_version=None) is None


def test_unadapted_linears_stay_bf16_and_are_copied() -> None:
    """q and v adapted only: k, output_proj and the MLP are plain bf16 nn.Linear weights,
    copied storage by storage by deepcopy (no quantize). The peak is the 32nd copy's v_proj
    search (n = 4096²): the template and 31 copies whole, the 32nd's sa_norm, q_proj (NF4 +
    adapters) and k_proj (bf16) made, and the same in-flight tensors as above."""
    rep = _replay(lora_targets="q,v")
    assert rep is not None
    n = H * H
    b = n // 64
    plain = 2 * rnd(2 * n) + 3 * rnd(2 * H * F)  # k, output_proj, w1, w2, w3 in bf16
    layer = (2 * (_nf4(n) + _lora(H, H)) + plain + rnd(64 * 4) + rnd(4096 * 64 * 2 * 4)
             + 2 * rnd(2 * H))
    partial = rnd(2 * H) + _nf4(n) + _lora(H, H) + rnd(2 * n)
    inflight = (rnd(2 * n) + rnd(32) + rnd(b) + rnd(2 * b) + rnd(2) + rnd(2 * b)
                + rnd(2 * n) + 2 * rnd(32 * n))
    assert rep.peak_requested == 32 * layer + partial + REST + inflight
