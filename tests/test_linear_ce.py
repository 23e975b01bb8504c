"""torchtune main's LinearCrossEntropyLoss (`--torchtune-version 0.7`,
vramcalc/terms/linear_ce.py), refereed by torch itself:

- eager: the loss as written in pytorch/torchtune bd2a0fc7
  torchtune/modules/loss/cross_entropy_loss.py (vramcalc/trace/tune.py
  `linear_cross_entropy`) runs on fake tensors under the trace engine's tracker;
- compiled: `compute_cross_entropy` (projection, `.float()`, cross entropy) goes through
  inductor's min-cut partitioner, which says what its forward keeps.
"""

from __future__ import annotations

import pytest

from vramcalc.model import ModelSpec
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import linear_ce as lce
from vramcalc.terms import logits as lg
from vramcalc.training import TrainingConfig
from vramcalc.units import ALLOC_ROUND_BYTES, alloc

torch = pytest.importorskip("torch")
F = torch.nn.functional

H, V = 256, 3000
SPEC = ModelSpec(name="small", hidden_size=H, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=768, vocab_size=V)


def ctx_of(**kw: object) -> RankContext:
    args = {"framework": "torchtune", "precision": "bf16-pure", "recompute": "full",
            "seq_len": 96, "micro_batch_size": 2, "chunked_ce": 4,
            "torchtune_version": "0.7.0", **kw}
    return RankContext(SPEC, TrainingConfig(**args), Scenario(model=SPEC).parallel, 0)  # type: ignore[arg-type]


def test_only_the_main_branch_uses_it() -> None:
    assert lce.applies(ctx_of().training)
    for kw in ({"torchtune_version": "0.6.1"}, {"torchtune_version": None},
               {"chunked_ce": 1}, {"framework": "reference", "torchtune_version": None}):
        assert not lce.applies(ctx_of(**kw).training)


@pytest.mark.parametrize(("rows", "n"), [(192, 4), (100, 8), (97, 8), (5, 8)])
def test_chunks_follow_tensor_split(rows: int, n: int) -> None:
    ctx = ctx_of(seq_len=rows, micro_batch_size=1, chunked_ce=n)
    sizes = [len(c) for c in torch.arange(rows).tensor_split(min(n, rows), dim=0)]
    assert lce.chunk_tokens(ctx) == sizes


@pytest.mark.parametrize(("b", "s", "n", "trained"), [
    (2, 96, 4, True), (2, 96, 4, False), (1, 96, 3, True), (2, 100, 8, False),
    (1, 100, 8, True), (2, 97, 8, True)])
def test_eager_loss_equals_the_trace(b: int, s: int, n: int, trained: bool) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.tracker import MemoryTracker
    from vramcalc.trace.tune import linear_cross_entropy

    tracker = MemoryTracker()
    with FakeTensorMode(), tracker:
        x = torch.empty(b, s, H, dtype=torch.bfloat16, requires_grad=True)  # final norm out
        head = torch.nn.Linear(H, V, bias=False, dtype=torch.bfloat16)
        head.weight.requires_grad_(trained)
        labels = torch.zeros(b, s, dtype=torch.long)
        tracker.set_phase("forward")
        base = tracker.total
        loss = linear_cross_entropy(head, x, labels, n)
        fwd, kept = tracker.peaks[(0, "forward")].total - base, tracker.total - base
        tracker.set_phase("backward")
        loss.backward()
        bwd = tracker.peaks[(0, "backward")].total - base
    ctx = ctx_of(seq_len=s, micro_batch_size=b, chunked_ce=n,
                 finetune="full" if trained else "lora")
    # a trained head keeps the masked rows: the head side's lm_head.input, b·s·h in bf16
    head_side = alloc(b * s * H, "bf16") if trained else 0
    slack = 2 * ALLOC_ROUND_BYTES  # 0-dim temporaries (the running sum, the division)
    assert 0 <= kept - (lg.logits_saved_bytes(ctx) + head_side) <= slack
    assert 0 <= fwd - (lg.logits_forward_peak_bytes(ctx) + head_side) <= slack
    assert abs(bwd - (lg.logits_backward_peak_bytes(ctx) + head_side)) <= slack


@pytest.mark.parametrize("trained", [True, False])
def test_compiled_chunk_keeps_its_logits_and_two_fp32_numbers_per_row(trained: bool) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.compiled import compiled_saved

    def compute_cross_entropy(h: object, w: object, y: object) -> object:
        return F.cross_entropy(F.linear(h, w).float(), y, reduction="sum")

    rows = 48
    with FakeTensorMode():
        h = torch.empty(rows, H, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(V, H, dtype=torch.bfloat16, requires_grad=trained)
        y = torch.empty(rows, dtype=torch.long)
        saved = compiled_saved(compute_cross_entropy, h, w, y)
    made = sum(alloc(t.nbytes, "int8") for t in saved if not t.is_input)
    inputs = {t.shape for t in saved if t.is_input}
    # the projection's output in bf16 and (rows, 1) fp32 max and log-sum-exp
    assert made == alloc(rows * V, "bf16") + 2 * alloc(rows, "fp32")
    # inputs kept alive: the labels and the weight, and the rows only for dL/dW
    assert inputs == {(rows,), (V, H)} | ({(rows, H)} if trained else set())
    ctx = ctx_of(seq_len=rows, micro_batch_size=1, chunked_ce=2, compile=True)
    per_chunk = alloc(24 * V, "bf16") + 2 * alloc(24, "fp32")
    assert lce.saved_bytes(ctx) == ALLOC_ROUND_BYTES + 2 * alloc(rows, "int64") + 2 * per_chunk


def test_no_list_of_every_chunks_logits_as_in_the_release() -> None:
    # release 0.6.1's CEWithChunkedOutputLoss holds every chunk's bf16 logits while the
    # loss runs; main's loss one chunk's: its forward peak is lower by the other chunks'
    release, main = ctx_of(torchtune_version="0.6.1"), ctx_of()
    b, s, n = 2, 96, 4
    others = alloc(b * s * V // n, "bf16") * (n - 1)
    assert lg.logits_forward_peak_bytes(release) - lg.logits_forward_peak_bytes(main) \
        >= others - alloc(b * s * H, "bf16")
