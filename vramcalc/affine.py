"""An integer that is an exact affine function of the micro-batch size b, for speed.

For a fixed structure (model, every training option but the micro-batch size, layout,
cluster) most of what the analytic engine computes is c1·b + c0 with integer c1, c0. The
engine can be run once with b replaced by `Affine.symbol(lo, hi)` and the report it
returns evaluated at any b in [lo, hi] with a few multiplications (vramcalc/analytic.py,
`estimate`). That is sound because every operation is exact or refuses:

- +, −, × by an int stay affine, and so do + − × by whole-number floats as long as every
  value on the way is an integer below 2**53 (floats hold those exactly; `flt` marks a
  value the engine holds as a float, `whole` is the exact int()); × by another
  b-dependent value or by a fraction, /, float(), int(), str() and format() raise
  `NotAffine`;
- `x // n` and `x % n` are exact when n divides the slope c1 (then ⌊(c1·b + c0)/n⌋ =
  (c1/n)·b + ⌊c0/n⌋), which covers the allocator's 512-byte rounding for most shapes;
  otherwise they raise `NotAffine`;
- comparisons (and `max`, `min`, `bool`, `==`) answer only when the answer is the same for
  every b of the domain [lo, hi]; otherwise they raise `Split(t)`: the answer is constant
  on [lo, t] and on [t + 1, hi], and the caller retries on the part holding its b.

Results whose slope is 0 are plain ints, so b-independent work stays ordinary Python.
"""

from __future__ import annotations

from typing import Any, NoReturn


class NotAffine(Exception):
    """The computation is not an exact affine function of b (use the concrete path)."""


class Split(Exception):  # noqa: N818 (a signal, like StopIteration)
    """A comparison whose answer changes inside the domain: constant on [lo, at] and on
    [at + 1, hi]."""

    def __init__(self, at: int) -> None:
        super().__init__(at)
        self.at = at


def _refuse(*_: object) -> NoReturn:
    raise NotAffine


_EXACT = 2**53  # floats hold every integer up to here exactly


class Affine:
    """c1·b + c0 for every integer b in [lo, hi] (c1 != 0, lo < hi); `flt`: the value the
    engine computes is a float, exactly equal to it (every |value| on the way ≤ 2**53)."""

    __slots__ = ("c1", "c0", "lo", "hi", "flt")

    def __init__(self, c1: int, c0: int, lo: int, hi: int, flt: bool = False) -> None:
        self.c1, self.c0, self.lo, self.hi, self.flt = c1, c0, lo, hi, flt

    @staticmethod
    def symbol(lo: int, hi: int) -> Affine | int:
        """b itself on [lo, hi] (a plain int when the domain is one point)."""
        return lo if lo == hi else Affine(1, 0, lo, hi)

    def at(self, b: int) -> int:
        return self.c1 * b + self.c0

    def whole(self) -> Affine:
        """int() of the value: exact (it is an integer), and no longer a float."""
        return Affine(self.c1, self.c0, self.lo, self.hi) if self.flt else self

    def _new(self, c1: int, c0: int, flt: bool) -> Affine | int | float:
        if flt:
            # every float on the way must be an exact integer: narrow the domain to where
            # |c1·b + c0| <= 2**53 (an interval), or refuse
            cuts = []
            for v in (self, Affine(c1, c0, self.lo, self.hi)):
                if v.c1 and abs(v.at(self.lo)) > _EXACT:
                    raise NotAffine
                if v.c1 and abs(v.at(self.hi)) > _EXACT:  # the last b within the bound
                    cuts.append(((_EXACT if v.c1 > 0 else -_EXACT) - v.c0) // v.c1)
            if cuts:
                raise Split(min(cuts))
            if not c1:
                if abs(c0) > _EXACT:
                    raise NotAffine
                return float(c0)
        return Affine(c1, c0, self.lo, self.hi, flt) if c1 else c0

    def _coefs(self, other: object) -> tuple[int, int, bool]:
        """(c1, c0, is a float) of an operand: ints, integral floats, Affines of this domain."""
        t = type(other)
        if t is int or t is bool:
            return 0, int(other), False  # type: ignore[call-overload]
        if t is float and other.is_integer():  # type: ignore[attr-defined]
            return 0, int(other), True  # type: ignore[call-overload]
        if t is Affine and (other.lo, other.hi) == (self.lo, self.hi):  # type: ignore[attr-defined]
            return other.c1, other.c0, other.flt  # type: ignore[attr-defined]
        raise NotAffine  # fractional floats, other domains

    # ---- arithmetic ------------------------------------------------------------------
    def __add__(self, other: object) -> Affine | int | float:
        if type(other) is int and not self.flt:  # the common case, fast
            return Affine(self.c1, self.c0 + other, self.lo, self.hi)
        c1, c0, flt = self._coefs(other)
        return self._new(self.c1 + c1, self.c0 + c0, flt or self.flt)

    __radd__ = __add__

    def __sub__(self, other: object) -> Affine | int | float:
        c1, c0, flt = self._coefs(other)
        return self._new(self.c1 - c1, self.c0 - c0, flt or self.flt)

    def __rsub__(self, other: object) -> Affine | int | float:
        c1, c0, flt = self._coefs(other)
        return self._new(c1 - self.c1, c0 - self.c0, flt or self.flt)

    def __neg__(self) -> Affine | int | float:
        if not self.flt:
            return Affine(-self.c1, -self.c0, self.lo, self.hi)
        return self._new(-self.c1, -self.c0, self.flt)

    def __pos__(self) -> Affine:
        return self

    def __mul__(self, other: object) -> Affine | int | float:
        if type(other) is int and not self.flt:  # the common case, fast
            return Affine(self.c1 * other, self.c0 * other, self.lo, self.hi) if other else 0
        c1, c0, flt = self._coefs(other)
        if c1:
            raise NotAffine  # quadratic in b
        return self._new(self.c1 * c0, self.c0 * c0, flt or self.flt)

    __rmul__ = __mul__

    def __floordiv__(self, other: object) -> Affine | int:
        if self.flt:
            raise NotAffine
        if type(other) is Affine:
            # a multiple of the divisor: q exactly (the divisor is never 0 on the domain)
            q = self.c1 // other.c1
            if other.flt or self.c1 != q * other.c1 or self.c0 != q * other.c0 or not other:
                raise NotAffine
            return q
        if type(other) is not int or not other or self.c1 % other:
            raise NotAffine
        return Affine(self.c1 // other, self.c0 // other, self.lo, self.hi)

    def __mod__(self, other: object) -> int:
        if self.flt or type(other) is not int or not other or self.c1 % other:
            raise NotAffine
        return self.c0 % other

    __truediv__ = __rtruediv__ = __rfloordiv__ = __rmod__ = __divmod__ = __rdivmod__ = _refuse
    __pow__ = __rpow__ = __int__ = __index__ = __float__ = __complex__ = _refuse
    __round__ = __trunc__ = __floor__ = __ceil__ = __format__ = __str__ = _refuse

    def __repr__(self) -> str:
        return (f"Affine({self.c1}·b + {self.c0}, b in [{self.lo}, {self.hi}]"
                f"{', float' if self.flt else ''})")

    # ---- comparisons: constant over the domain, or Split -----------------------------
    def _decide(self, other: object, holds: tuple[int, ...]) -> bool:
        """Whether sign(self − other) is in `holds` for every b of the domain; Split at the
        first b where the answer changes."""
        c1, c0, _ = self._coefs(other)
        d1, d0 = self.c1 - c1, self.c0 - c0
        lo, hi = self.lo, self.hi

        def truth(b: int) -> bool:
            v = d1 * b + d0
            return ((v > 0) - (v < 0)) in holds

        first = truth(lo)
        if d1:
            # the sign of d1·b + d0 changes only next to its root −d0/d1: between
            # ⌊root⌋ − 1, ⌊root⌋ and ⌊root⌋ + 1
            fl = -d0 // d1
            for t in (fl - 1, fl, fl + 1):
                if lo <= t < hi and truth(t) != truth(t + 1):
                    raise Split(t)
        return first

    def __lt__(self, other: object) -> bool:
        return self._decide(other, (-1,))

    def __le__(self, other: object) -> bool:
        return self._decide(other, (-1, 0))

    def __gt__(self, other: object) -> bool:
        return self._decide(other, (1,))

    def __ge__(self, other: object) -> bool:
        return self._decide(other, (0, 1))

    def __eq__(self, other: object) -> bool:
        if type(other) is Affine and (other.lo, other.hi) != (self.lo, self.hi):
            return False  # symbols of two domains never meet in one computation
        if type(other) not in (int, bool, Affine):
            return NotImplemented
        return self._decide(other, (0,))

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __bool__(self) -> bool:
        return self._decide(0, (-1, 1))

    def __abs__(self) -> Affine | int:
        return self if self >= 0 else -self

    def __hash__(self) -> int:
        return hash((Affine, self.c1, self.c0, self.lo, self.hi))


def whole(x: Any) -> Any:
    """int(x) for a number; an `Affine` stays one (its value is an integer already)."""
    return x.whole() if type(x) is Affine else int(x)


class Max:
    """The largest of `values` (ints and Affines of one domain) where which one is largest
    depends on b: kept for evaluation at a given b (no arithmetic on it)."""

    __slots__ = ("values",)

    def __init__(self, values: tuple[Any, ...]) -> None:
        self.values = values

    def at(self, b: int) -> int:
        return max(v.at(b) if type(v) is Affine else v for v in self.values)


def largest(*values: Any) -> Any:
    """max(values), or a `Max` when the answer depends on b (no domain split)."""
    try:
        return max(values)
    except Split:
        return Max(values)
