"""Pipeline schedules: how many micro-batches' activations a pipeline rank holds at once."""

from __future__ import annotations

from vramcalc.scenario import Scenario
from vramcalc.sharding import pipeline_chunks


def in_flight_microbatches(scn: Scenario, stage: int) -> float:
    """Micro-batches whose activations pipeline rank `stage` holds at once, in units of one
    micro-batch through all of the rank's layers (m = micro-batches per step, p = pp).

    - 1F1B (PipeDream-flush, Narayanan et al. 2021): rank r runs p − r − 1 warm-up forwards
      then one more before its first backward: min(p − r, m).
    - interleaved with v chunks (Megatron-LM schedules.py): (p − r − 1)·2 + (v − 1)·g warm-up
      chunk forwards plus one, at most m·v, in `get_schedule_table`'s order: groups of g
      micro-batches (--pp-group-size, Megatron's microbatch_group_size_per_vp_stage;
      default p, the last group the rest) run through chunk 0, then chunk 1, ...; with 1/v
      of the rank's layers in each chunk rank 0 holds p·(1 + (p − 1)/(p·v)) (Korthikanti et
      al. 2022 Sec. 4.2.3). Chunks of unequal size (--embedding-in-split / --loss-in-split
      take a layer's place in rank 0's first and the last rank's last chunk) count their
      own layers.
    - GPipe: all m forwards before any backward.
    """
    par = scn.parallel
    p = par.pp
    m = par.num_microbatches or scn.training.grad_accum
    if p == 1:
        return 1
    if par.pp_schedule == "gpipe":
        return m
    if par.pp_schedule == "interleaved" and par.virtual_stages > 1:
        v, g = par.virtual_stages, par.pp_group_size or p
        chunks = min(2 * (p - stage - 1) + (v - 1) * g + 1, m * v)
        layers = [row[stage] for row in pipeline_chunks(scn.model, par)]
        if not sum(layers):
            return chunks / v
        held = 0
        for k in range(chunks):  # the k-th forward: its group's start and size, its chunk
            start = k // (g * v) * g
            held += layers[(k - start * v) // (g if start + g < m else m - start)]
        return held / sum(layers)
    return min(p - stage, m)
