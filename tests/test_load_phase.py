"""The load phase (`--load`, vramcalc/terms/load.py): weights as loaded plus what the loader
keeps in flight, hand-derived from the loaders' source.

Llama-2-7B: the largest layer linear is an MLP matrix, n = 11008 · 4096; the largest tensor
overall is the embedding (and the untied head), 32000 · 4096.

- torchtune (0914d5cf `_setup_model`, `inplace_copy`: `to_nf4(src.to(device))`) with torchao
  v0.1 `NF4Tensor.from_tensor`: the bf16 source (2n bytes), the scaled blocks (2n) and
  `quantize_tensor_nearest`'s `(value - nf4)` and its `.abs()`, two (n, 16) bf16 tensors
  (32n bytes each) alive at once; from v0.2 (6081796b) the search runs over 1024² elements
  at a time into an (n,) uint8 buffer.
- transformers 5 on-the-fly bitsandbytes quantization: the 16-bit source on the device
  (2n) and `quantize_4bit`'s fp32 absmax and its `absmax - offset` copy (4n/64 each).
- transformers 4.x without torch_dtype: every parameter in fp32.
- FSDP from meta: the largest full parameter (the embedding, bf16) and its 1/8 shard.
"""

from __future__ import annotations

import pytest

from vramcalc.analytic import estimate
from vramcalc.cli import main
from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms.tune_init import init_replay

R = 512


def rnd(n: int) -> int:
    return -(-n // R) * R


N_MLP = 11008 * 4096
N_EMB = 32000 * 4096
QLORA = dict(model="llama2-7b", gpus="RTX4090", precision="bf16-pure", finetune="qlora",
             lora_targets="all-linear", recompute="full", seq_len=512, micro_batch_size=2)


def _load_extra(**flags: object) -> tuple[int, int, str]:
    rep = estimate(build_scenario(flags))
    return rep.phases["load"], rep.phases["load"] - _weights(flags), rep.peak_phase


def _weights(flags: dict[str, object]) -> int:
    """The rank's weights as the training steps hold them (no load phase)."""
    rep = estimate(build_scenario({**flags, "load": "none"}))
    return sum(v for k, v in rep.subterms.items() if k.startswith("weights")) or \
        rep.terms.weights


def test_torchtune_torchao_0_1_quantizes_a_whole_weight_at_once() -> None:
    flags = dict(**QLORA, qlora_impl="torchao", torchao_version="0.1", load="torchtune")
    load, extra, peak = _load_extra(**flags)
    one_weight = rnd(2 * N_MLP) + rnd(2 * N_MLP) + 2 * rnd(32 * N_MLP)
    scn = build_scenario(flags).resolved()
    replay = init_replay(RankContext(scn.model, scn.training, scn.parallel))
    assert replay is not None  # the whole init is replayed (tests/test_tune_init.py) ...
    assert load == replay.peak_allocated
    # ... and holds more than one weight's quantization: the template layer deep-copied
    # per layer (a dequantized weight in flight) and the layers' rotary caches
    assert extra > one_weight
    assert peak == "load"  # ~3 GB of search tensors over a 4 GB model


def test_torchtune_torchao_0_2_quantizes_in_chunks() -> None:
    _, extra, peak = _load_extra(**QLORA, qlora_impl="torchao", torchao_version="0.2",
                                 load="torchtune")
    chunk = 1024**2
    assert extra == rnd(2 * N_MLP) + rnd(2 * N_MLP) + rnd(N_MLP) + 2 * rnd(32 * chunk)
    assert peak != "load"


def test_hf_quantize_on_load_one_weight_at_a_time() -> None:
    _, extra, _ = _load_extra(**QLORA, load="hf")
    assert extra == rnd(2 * N_MLP) + 2 * rnd(N_MLP // 64 * 4)


def test_hf_fp32_load_holds_four_bytes_per_parameter() -> None:
    flags = dict(model="llama2-7b", gpus="A100-80GB", precision="bf16-pure", finetune="lora",
                 seq_len=256, load="hf-fp32")
    rep = estimate(build_scenario(flags))
    params = 6_738_415_616  # Llama-2-7B (transformers' numel on the meta device)
    params += 32 * 2 * 8 * (4096 + 4096)  # q, v adapters r=8, made by PEFT in fp32 too
    tensors = 3 + 32 * 13  # embedding, final norm, head; 9 base + 4 adapters per layer
    assert 0 <= rep.phases["load"] - 4 * params < R * tensors
    assert rep.peak_phase == "load"


def test_meta_materialisation_holds_shards_and_one_full_parameter() -> None:
    flags = dict(model="llama2-7b", gpus="8xA100-80GB", precision="bf16", fsdp="full",
                 seq_len=2048, load="meta")
    rep = estimate(build_scenario(flags))
    weights = estimate(build_scenario({**flags, "load": "none"})).terms.weights
    assert rep.phases["load"] - weights == rnd(2 * N_EMB) + rnd(2 * (N_EMB // 8))


def test_no_load_phase_by_default() -> None:
    rep = estimate(build_scenario(dict(QLORA)))
    assert "load" not in rep.phases


@pytest.mark.parametrize("args,needle", [
    (["--finetune", "qlora", "--load", "torchtune"], "--qlora-impl torchao"),
    (["--finetune", "qlora", "--load", "hf", "--qlora-impl", "torchao"], "bitsandbytes"),
    (["--finetune", "qlora", "--load", "hf-fp32"], "--load hf"),
    (["--load", "meta"], "meta device"),
    (["--load", "meta", "--gpus", "8xH100", "--zero", "3"], "--fsdp"),
    (["--load", "hf", "--gpus", "8xH100", "--fsdp", "full"], "--load meta"),
    (["--load", "disk"], "--load"),
])
def test_unmodelled_load_paths_exit_2(args: list[str], needle: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "7b", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]
