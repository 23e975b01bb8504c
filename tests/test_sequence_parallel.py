"""Sequence parallelism splits only the norm and dropout regions over the sequence
(Korthikanti et al. 2022, arXiv:2205.05198 §4.2.2 and Table 2: TP gives s·b·h·(10 + 24/t),
TP + SP (s·b·h/t)·34 — the 24/t of the tensor-parallel regions is the same in both).

So in the reference and hf saved tables a (b, s, h)-shaped tensor on the rank has T = b·s/t
rows under SP, while the column-parallel outputs — q, k, v, the attention core, the MLP's
(·, f/t) intermediates — keep every token of the micro-batch."""

from __future__ import annotations

import pytest

from vramcalc.model import ModelSpec
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms.activations import layer_saved
from vramcalc.training import TrainingConfig

SPEC = ModelSpec(name="sp-llama", hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=4, intermediate_size=2816, vocab_size=32000)
T = 4  # tensor-parallel degree


def _table(framework: str, sp: bool, attention: str) -> dict[str, int]:
    tr = TrainingConfig(seq_len=2048, micro_batch_size=2, precision="bf16", optimizer="adamw",
                        framework=framework, attention=attention)  # type: ignore[arg-type]
    par = ParallelConfig(dp=1, tp=T, sequence_parallel=sp)
    return {s.name: s.numel * s.count for s in layer_saved(RankContext(SPEC, tr, par, 0))}


@pytest.mark.parametrize("framework", ["reference", "hf"])
@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_sp_splits_only_the_sequence_regions(framework: str, attention: str) -> None:
    plain, split = _table(framework, False, attention), _table(framework, True, attention)
    assert plain.keys() == split.keys()
    bsh = 2 * 2048 * 1024  # b·s·h elements of a replicated (b, s, h) tensor
    shrunk = {n for n in plain if plain[n] != split[n]}
    assert shrunk, "SP must split the norm regions"
    for n in shrunk:  # norm inputs, the linears' (sharded) inputs, fp32 norm statistics
        assert split[n] * T == plain[n], n
        assert plain[n] in (bsh, 2 * 2048), n
    kept = {n for n in plain if n.startswith("mlp.") and n != "mlp.input"}
    assert kept and all(plain[n] == split[n] == 2 * 2048 * 2816 // T for n in kept)
