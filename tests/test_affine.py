"""The symbolic micro-batch size (vramcalc/affine.py) and the compiled reports it feeds.

Expected values come from plain integer arithmetic on every b of the domain (the semantics
the symbol stands for), and compiled reports are compared with the engine run as written
(`analytic._estimate`) — never with stored output.
"""

from __future__ import annotations

import operator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vramcalc import analytic
from vramcalc.affine import Affine, Max, NotAffine, Split, largest, whole
from vramcalc.errors import InputError
from vramcalc.options import build_scenario

COEF = st.integers(-2000, 2000)


@st.composite
def affines(draw: st.DrawFn) -> tuple[Affine, int, int]:
    lo = draw(st.integers(1, 20))
    hi = lo + draw(st.integers(1, 30))
    c1 = draw(COEF.filter(bool))
    return Affine(c1, draw(COEF), lo, hi), lo, hi


def _at(v: object, b: int) -> object:
    return v.at(b) if isinstance(v, Affine) else v


def _other(draw: st.DrawFn, lo: int, hi: int) -> object:
    if draw(st.booleans()):
        return draw(COEF)
    return Affine(draw(COEF.filter(bool)), draw(COEF), lo, hi)


@given(affines(), st.data())
def test_arithmetic_is_exact_or_refused(a: tuple[Affine, int, int], data: st.DataObject) -> None:
    x, lo, hi = a
    y = _other(data.draw, lo, hi)
    for op in (operator.add, operator.sub, operator.mul):
        try:
            got = op(x, y)
        except NotAffine:
            assert op is operator.mul and isinstance(y, Affine)  # quadratic in b
            continue
        for b in range(lo, hi + 1):
            assert _at(got, b) == op(x.at(b), _at(y, b))
    n = data.draw(st.sampled_from([2, 3, 8, 512, -4, 7]))
    for op in (operator.floordiv, operator.mod):
        try:
            got = op(x, n)
        except NotAffine:
            assert x.c1 % n  # only refused when the quotient is not affine
            continue
        for b in range(lo, hi + 1):
            assert _at(got, b) == op(x.at(b), n)


@given(affines(), st.data())
def test_comparisons_hold_on_the_domain_or_split_where_they_flip(
        a: tuple[Affine, int, int], data: st.DataObject) -> None:
    x, lo, hi = a
    y = _other(data.draw, lo, hi)
    for op in (operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne):
        truth = [op(x.at(b), _at(y, b)) for b in range(lo, hi + 1)]
        try:
            got = op(x, y)
        except Split as cut:
            assert lo <= cut.at < hi
            left, right = truth[: cut.at - lo + 1], truth[cut.at - lo + 1:]
            assert len(set(left)) == 1 and right[0] != left[0]
            continue
        assert all(t == got for t in truth)


@given(affines(), st.data())
def test_largest_defers_when_the_maximum_depends_on_b(a: tuple[Affine, int, int],
                                                      data: st.DataObject) -> None:
    x, lo, hi = a
    y = _other(data.draw, lo, hi)
    got = largest(x, y)
    for b in range(lo, hi + 1):
        value = got.at(b) if isinstance(got, (Affine, Max)) else got
        assert value == max(x.at(b), _at(y, b))


def test_refused_operations() -> None:
    x = Affine(3, 1, 2, 10)
    for bad in (lambda: int(x), lambda: float(x), lambda: f"{x}", lambda: str(x),
                lambda: x / 2, lambda: x * 1.5, lambda: x ** 2, lambda: range(x),
                lambda: x // Affine(2, 0, 2, 10)):
        with pytest.raises(NotAffine):
            bad()


def test_floats_stay_exact_below_2_to_the_53() -> None:
    x = Affine(1_000_000, 0, 2, 2**40)
    with pytest.raises(Split) as cut:  # x · 1e6 passes 2**53 inside the domain
        x * 1e6
    assert cut.value.at == 2**53 // 10**12
    y = Affine(1_000_000, 0, 2, 9000) * 1e6  # exact everywhere on this domain
    assert whole(y).at(9000) == int(9000 * 1_000_000 * 1e6)
    with pytest.raises(NotAffine):
        Affine(4, 0, 2, 10) * 1.25


# ---- compiled reports equal the engine as written --------------------------------------------
SCENARIOS = [
    {"model": "70b", "gpus": "64xH100", "tp": 8, "pp": 4, "zero": 1, "recompute": "selective",
     "grad_accum": 8},
    {"model": "8b", "gpus": "8xH100", "fsdp": "full", "framework": "hf", "attention": "eager"},
    {"model": "gpt2", "gpus": "2xH100", "seq_len": 77, "zero": 2, "precision": "amp-bf16"},
    {"model": "mixtral-8x7b", "gpus": "64xH100", "tp": 2, "ep": 4, "pp": 4, "zero": 1},
    {"model": "qwen3-8b", "gpus": "8xH100", "finetune": "qlora", "framework": "hf"},
    {"model": "8b", "gpus": "8xH100", "precision": "fp8", "tp": 2, "sequence_parallel": True},
    {"model": "8b", "gpus": "8xH100", "chunked_ce": 8, "activation_offload": True,
     "fsdp": "full", "recompute": "full"},
    {"model": "8b", "gpus": "8xH100", "tp": 8, "framework": "hf", "attention": "eager",
     "recompute": "selective", "precision": "amp-bf16"},
]


def _dump(fn, scn, every: bool) -> object:  # noqa: ANN001
    try:
        return fn(scn, every).model_dump()
    except InputError as err:
        return str(err)


@pytest.mark.parametrize("values", SCENARIOS, ids=lambda v: "-".join(map(str, v.values())))
def test_compiled_report_equals_the_engine(values: dict) -> None:
    # ascending and descending b (a piece's first report is the model for later ones, and
    # the peak phase changes with b); repeats are served from compiled pieces
    for order in ((1, 2, 3, 5, 8, 13, 64, 1, 5), (64, 13, 8, 5, 3, 2, 1, 2, 64)):
        analytic._PLANS.clear()
        for every in (True, False):
            for b in order:
                scn = build_scenario({**values, "micro_batch_size": b})
                assert _dump(analytic.estimate, scn, every) == _dump(analytic._estimate, scn,
                                                                     every)
    key = analytic._structure_key(build_scenario(values), True)
    assert key in analytic._PLANS and analytic._PLANS[key]  # compiled (at least tried)
