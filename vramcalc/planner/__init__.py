"""The planner: enumerate layouts, estimate, keep what fits, rank by speed; suggest changes.

Pure: no printing, no files, no exit codes. The CLI passes a progress callback and the list
of GPU profiles (for "another GPU type" suggestions). Modules, each importing only those
before it (docs/planning.md has the details):

- `request`: PlanRequest, what to search;
- `layouts`: the layout groups of a cluster (the search space);
- `candidates`: the candidates of those layouts and their speed (vramcalc.speed);
- `bound`: the memory lower bound that prunes candidates, from the engine's term functions;
- `search`: best-first search, PlanEntry / PlanResult, ranking;
- `suggest`: the smallest changes that make a job fit.
"""

from vramcalc.planner.bound import LOWER_BOUND_MARGIN, MemoryBound
from vramcalc.planner.candidates import Candidate, enumerate_candidates
from vramcalc.planner.layouts import finetune_supported, mla_note
from vramcalc.planner.request import (
    DEFAULT_BATCH_TOKENS,
    MAX_MICRO_BATCH,
    PlanRequest,
    ProgressFn,
    stack_note,
)
from vramcalc.planner.search import (
    PlanEntry,
    PlanResult,
    estimate_candidate,
    search,
    with_every_stage,
)
from vramcalc.planner.suggest import Suggestion, feasible, gpu_counts, suggest_changes

__all__ = [
    "DEFAULT_BATCH_TOKENS",
    "LOWER_BOUND_MARGIN",
    "MAX_MICRO_BATCH",
    "Candidate",
    "MemoryBound",
    "PlanEntry",
    "PlanRequest",
    "PlanResult",
    "ProgressFn",
    "Suggestion",
    "enumerate_candidates",
    "estimate_candidate",
    "feasible",
    "finetune_supported",
    "gpu_counts",
    "mla_note",
    "search",
    "stack_note",
    "suggest_changes",
    "with_every_stage",
]
