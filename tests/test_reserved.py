"""The analytic reserved estimate (vramcalc/terms/reserved.py): the step replay's mechanism,
derived by hand from the allocator rules (docs/methodology.md §7a)."""

from __future__ import annotations

from vramcalc.terms.reserved import _run, _Step

MiB = 2**20


def _step(**kw: object) -> _Step:
    base = dict(expandable=False, weights=(), states=(), temps=(), other_grads=(),
                layer_grads=(), saved=(), slots=0, loss=(0, 0), kept=False)
    base.update(kw)
    return _Step(**base)  # type: ignore[arg-type]


def test_gradients_larger_than_every_activation_block_need_new_segments() -> None:
    # two layers, one 80 MiB saved tensor each, one 112 MiB gradient each.
    # step 1 forward: two 80 MiB segments (160). Backward, top layer: its 112 MiB gradient
    # fits no cached block (none yet): a new segment (272); its 80 MiB activation is freed.
    # Bottom layer: the cached 80 MiB block is smaller than 112 MiB (best fit needs >=):
    # another segment (384). Requested high-water mark: 80 + 2 x 112 = 304 MiB.
    # Step 2 reuses every cached block (80s for activations, 112s for gradients): no growth.
    st = _step(saved=((80 * MiB, 1),), layer_grads=((112 * MiB, 1),), slots=2)
    assert _run(st) == 384 * MiB - 304 * MiB


def test_blocks_that_fit_are_reused_without_a_gap() -> None:
    # the same with 64 MiB gradients: the bottom layer's gradient takes the freed 80 MiB
    # activation block (best fit; the 16 MiB rest is split off, > kSmallSize). Reserved 160 +
    # 64 = 224 MiB; requested peak 160 + 64 = 224 MiB (top) -> no gap.
    st = _step(saved=((80 * MiB, 1),), layer_grads=((64 * MiB, 1),), slots=2)
    assert _run(st) == 0


def test_lazy_optimizer_states_displace_the_next_steps_logits() -> None:
    # fp32 loss buffers of 250 MiB (no 16-bit logits). Step 1: upcast (segment A), log-probs
    # (B), upcast freed, dL/dlogprobs (best fit: A), dL/dlogits (C): 750 MiB reserved, 750
    # requested at once; all freed. Without optimizer states step 2 reuses A, B, C: no gap.
    assert _run(_step(loss=(0, 250 * MiB))) == 0
    # a 126 MiB state created by the first optimizer step takes the start of A (best fit
    # among equal sizes: the lowest address; the 124 MiB rest is split off). Step 2: upcast
    # (B), log-probs (C), upcast freed, dL/dlogprobs (B), dL/dlogits: no cached block of
    # 250 MiB is left -> a new segment (1000 reserved); requested peak 126 + 3 x 250 = 876
    st = _step(loss=(0, 250 * MiB), states=((126 * MiB, 1),))
    assert _run(st) == 1000 * MiB - 876 * MiB
