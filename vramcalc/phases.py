"""The composition of allocated memory at one instant of a rank's step (`Phase`) over
what every instant of a stage holds (`StageBase`): the analytic engines' common vocabulary
(vramcalc/analytic.py, vramcalc/analytic_seq2seq.py)."""

from __future__ import annotations


class StageBase:
    """What every moment of a stage holds besides its gradients and its own parts: weights,
    optimizer states (+ master), cuBLAS workspace, persistent comm buffers."""

    __slots__ = ("head", "tail", "total", "terms")

    def __init__(self, head: dict[str, int], tail: dict[str, int]) -> None:
        self.head, self.tail = head, tail
        self.total = sum(head.values()) + sum(tail.values())
        self.terms = _add_terms({}, head)
        _add_terms(self.terms, tail)


    def without(self, key: str) -> StageBase:
        """This base less one of its head parts (what a later moment no longer holds)."""
        if key not in self.head:
            return self
        return StageBase({k: v for k, v in self.head.items() if k != key}, self.tail)


def _add_terms(out: dict[str, int], parts: dict[str, int]) -> dict[str, int]:
    """Add sub-term bytes ("term/detail" keys) into `out` by term."""
    for key, val in parts.items():
        term = key.split("/", 1)[0]
        out[term] = out.get(term, 0) + val
    return out


class Phase:
    """Composition of allocated memory at one moment: the stage's base, `grads` bytes of
    gradients and the moment's own parts. The total is summed once; the full composition
    (`parts`) is only assembled for the moments a report shows (the planner evaluates
    thousands of moments per second)."""

    __slots__ = ("name", "base", "grads", "own", "total", "made", "side")

    def __init__(self, name: str, base: StageBase, grads: int, own: dict[str, int],
                 made: int | None = None, side: int = 0) -> None:
        self.name, self.base, self.grads, self.own = name, base, grads, own
        self.made = made  # first step, optimizer in backward: states created (None: all)
        # of the total, bytes on FSDP2's all-gather copy-in stream (a prefetched block's
        # all-gather output; terms/reserved.py `side_stream_bytes`)
        self.side = side
        self.total = base.total + grads + sum(own.values())

    @property
    def parts(self) -> dict[str, int]:
        return {**self.base.head, "gradients": self.grads, **self.base.tail, **self.own}

    def terms(self) -> dict[str, int]:
        out = dict(self.base.terms)
        out["gradients"] = out.get("gradients", 0) + self.grads
        return _add_terms(out, self.own)
