"""`--optimizer muon`: torch.optim.Muon on the layers' matrices, AdamW on the rest.

torch/optim/_muon.py (torch 2.13): `_init_group` makes one `momentum_buffer`
(`zeros_like(p.grad)`) per parameter, and `Muon.__init__` refuses any parameter that is not
2-D, so the embeddings, head, norms and biases step with AdamW (two states). The step runs
one matrix at a time (`_single_tensor_muon`; foreach is not implemented): the Nesterov update
`grad.lerp(buf, momentum)`, then `_zeropower_via_newtonschulz`: a bf16 copy, and per
iteration X·Xᵀ, the addmm update (k × k, k = min(m, n)) and the next X beside the previous one.
The trace engine runs the real torch.optim.Muon under FakeTensorMode.
"""

from __future__ import annotations

from typing import Any

import pytest

from vramcalc.errors import InputError
from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms.optimizer_states import optimizer_state_split
from vramcalc.terms.transients import optimizer_step_parts
from vramcalc.validate.shapes import SHAPES, scenario_for


def _ctx(**kw: Any) -> RankContext:
    _, scn = scenario_for("llama-deep", optimizer="muon", **kw)
    scn = scn.resolved()
    return RankContext(scn.model, scn.training, scn.parallel)


def test_states_one_momentum_per_layer_matrix_two_for_the_rest() -> None:
    spec = SHAPES["llama-deep"]  # h 1024, 16 heads (4 kv), f 2816, V 1024, 4 layers, untied
    h, f, V, L = 1024, 2816, 1024, 4
    kv = 4 * 64
    matrices = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]
    assert spec.intermediate_size == f and spec.vocab_size == V
    muon = L * sum(m * n for m, n in matrices)
    adamw = 2 * V * h + (2 * L + 1) * h  # embedding, head; two norms a layer, the final norm
    split = optimizer_state_split(_ctx(precision="bf16-pure"))
    # bf16-pure: the states take the bf16 gradients' dtype (zeros_like(p.grad)); each
    # tensor rounded to 512 B, which these sizes already are except the 2 KiB norms
    assert split["states"] == (muon + 2 * adamw) * 2


def test_newton_schulz_peak_by_hand() -> None:
    """The largest matrix (f × h = 2816 × 1024, k = 1024) in fp32 (bf16 + masters):
    update 4·m·n, two bf16 X's 2·2·m·n, X·Xᵀ and its addmm 2·2·k²; AdamW's foreach
    sqrt copies of the rest (embedding, head, norms) are smaller."""
    m, n, k = 2816, 1024, 1024
    _, inner, _ = optimizer_step_parts(_ctx(precision="bf16"))
    assert inner == 4 * m * n + 2 * 2 * m * n + 2 * 2 * k * k


@pytest.mark.parametrize("kw", [{"precision": "bf16"}, {"precision": "bf16-pure"},
                                {"precision": "amp-bf16"}, {"precision": "fp32"}],
                         ids=["bf16", "bf16-pure", "amp-bf16", "fp32"])
@pytest.mark.parametrize("shape", ["llama-deep", "moe"])
def test_analytic_agrees_with_torch_muon(shape: str, kw: dict[str, Any]) -> None:
    pytest.importorskip("torch")
    from vramcalc.validate import compare

    name, scn = scenario_for(shape, optimizer="muon", **kw)
    r = compare(name, scn)
    assert "error" not in r, r.get("error")
    assert r["terms"]["optimizer_states"]["analytic"] == r["terms"]["optimizer_states"]["trace"]
    assert r["phases"]["optimizer"]["analytic"] == r["phases"]["optimizer"]["trace"]
    assert abs(r["rel_error"]) <= 0.001


@pytest.mark.parametrize(("flags", "needle"), [
    ({"framework": "hf"}, "--framework reference"),
    ({"gpus": "8xH100", "fsdp": "full"}, "one GPU or DDP"),
    ({"gpus": "8xH100", "zero": 1}, "one GPU or DDP"),
    ({"gpus": "8xH100", "tp": 2}, "TP"),
    ({"finetune": "lora"}, "full training"),
])
def test_refused_where_not_modelled(flags: dict[str, Any], needle: str) -> None:
    with pytest.raises(InputError, match=needle):
        build_scenario({"model": "llama3-8b", "gpus": "1xH100", "optimizer": "muon", **flags})


def test_ddp_keeps_the_same_states() -> None:
    one = build_scenario({"model": "llama3-8b", "gpus": "1xH100", "optimizer": "muon"})
    ddp = build_scenario({"model": "llama3-8b", "gpus": "8xH100", "optimizer": "muon"})
    states = [optimizer_state_split(RankContext(s.model, s.training, s.parallel))["states"]
              for s in (one, ddp)]
    assert states[0] == states[1] > 0
