"""Pipeline schedules: how many micro-batches' activations a pipeline rank holds at once."""

from __future__ import annotations

from vramcalc.scenario import Scenario


def in_flight_microbatches(scn: Scenario, stage: int) -> float:
    """Micro-batches whose activations pipeline rank `stage` holds at once, in units of one
    micro-batch through all of the rank's layers (m = micro-batches per step, p = pp).

    - 1F1B (PipeDream-flush, Narayanan et al. 2021): rank r runs p − r − 1 warm-up forwards
      then one more before its first backward: min(p − r, m).
    - interleaved with v chunks (Megatron-LM schedules.py): (p − r − 1)·2 + (v − 1)·p warm-up
      chunk forwards plus one, at most m·v, each holding 1/v of the rank's layers; rank 0
      holds p·(1 + (p − 1)/(p·v)) (Korthikanti et al. 2022 Sec. 4.2.3).
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
        v = par.virtual_stages
        chunks = min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
        return chunks / v
    return min(p - stage, m)
