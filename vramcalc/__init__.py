"""vramcalc: will a training job fit in GPU memory, how should it run, what should I buy?

The public, stable API (docs/api.md) is what `__all__` names: `estimate`, `plan` and
`load_model` take the command-line option names as keywords and return the same objects the
CLI prints (`MemoryReport`, `PlanResult` of `PlanEntry`, `ModelSpec`); bad input raises
`InputError`. `__version__` is the installed version. Everything else may change.

The names load on first use (`vramcalc.api`), so `import vramcalc` stays cheap and never
imports torch; the torch engines live in `vramcalc.trace` and `vramcalc.probe`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vramcalc.api import (
        InputError,
        MemoryReport,
        ModelSpec,
        PlanEntry,
        PlanResult,
        estimate,
        load_model,
        plan,
    )

__all__ = ["InputError", "MemoryReport", "ModelSpec", "PlanEntry", "PlanResult", "__version__",
           "estimate", "load_model", "plan"]


def __getattr__(name: str) -> Any:
    """The public names, imported on first access (PEP 562)."""
    if name == "__version__":
        from vramcalc.provenance import version

        return version()
    if name in __all__:
        from vramcalc import api

        value = getattr(api, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vramcalc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
