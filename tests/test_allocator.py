"""The caching-allocator model (vramcalc/allocator.py) against hand-derived expectations.

Every expected number below is worked out from the rules of
c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch 001074d25084fdb87a799823e395a50f5ec044d3):
kMinBlockSize = 512, kSmallSize = 1 MiB, kSmallBuffer = 2 MiB, kMinLargeAlloc = 10 MiB,
kLargeBuffer = 20 MiB, kRoundLarge = 2 MiB, `get_allocation_size`, `get_free_block`,
`should_split`, `try_merge_blocks`, and the expandable-segment page sizes (2 MiB small pool,
20 MiB large pool; Note [Expandable Segments]).
"""

from __future__ import annotations

import random
import time

import pytest

from vramcalc.allocator import (
    CachingAllocator,
    OutOfMemory,
    allocation_size,
    min_capacity,
    packed_reserved,
    replay,
    round_size,
)

MiB = 2**20


def test_round_size_is_512_byte_multiples() -> None:
    # round_size: below kMinBlockSize -> 512; else the next multiple of 512
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(1000) == 1024


def test_allocation_size_per_band() -> None:
    # get_allocation_size: <= 1 MiB -> 2 MiB; < 10 MiB -> 20 MiB; else round up to 2 MiB
    assert allocation_size(512) == 2 * MiB
    assert allocation_size(MiB) == 2 * MiB
    assert allocation_size(MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(11 * MiB) == 12 * MiB


def test_mid_size_request_reserves_a_20_mib_segment() -> None:
    a = CachingAllocator()
    a.malloc(3 * MiB // 2)  # 1.5 MiB: large pool, < kMinLargeAlloc -> kLargeBuffer
    assert a.reserved == 20 * MiB
    assert a.allocated == 3 * MiB // 2  # remainder 18.5 MiB > kSmallSize: split
    a.malloc(3 * MiB // 2)  # packed into the same segment's free remainder
    assert a.reserved == 20 * MiB


def test_large_request_rounds_to_2_mib_and_unsplit_remainder_counts_allocated() -> None:
    a = CachingAllocator()
    a.malloc(11 * MiB)  # >= kMinLargeAlloc: segment of 11 MiB rounded up to 12 MiB
    assert a.reserved == 12 * MiB
    # remainder 1 MiB is not > kSmallSize: no split, the whole 12 MiB block is allocated
    assert a.allocated == 12 * MiB


def test_small_requests_pack_into_2_mib_segments() -> None:
    a = CachingAllocator()
    for _ in range(2048):  # 1000 B -> 1024 B blocks; 2 MiB holds exactly 2048
        a.malloc(1000)
    assert a.reserved == 2 * MiB
    assert a.allocated == 2 * MiB
    a.malloc(1000)
    assert a.reserved == 4 * MiB


def test_one_mib_is_small_and_one_mib_plus_one_is_large() -> None:
    a = CachingAllocator()
    a.malloc(MiB)  # kSmallSize itself is small: a 2 MiB segment
    a.malloc(MiB)  # the 1 MiB remainder (>= 512 B, split) fits
    assert a.reserved == 2 * MiB
    a.malloc(MiB + 1)  # rounds to 1 MiB + 512: large pool, kLargeBuffer
    assert a.reserved == 22 * MiB


def test_freed_block_is_reused_and_split_without_new_reserve() -> None:
    a = CachingAllocator()
    h = a.malloc(100 * MiB)
    a.free(h)
    a.malloc(60 * MiB)  # best fit: the cached 100 MiB; remainder 40 MiB > 1 MiB -> split
    assert a.reserved == 100 * MiB
    assert a.allocated == 60 * MiB
    a.malloc(40 * MiB)  # the split remainder
    assert a.reserved == 100 * MiB


@pytest.mark.parametrize("expandable", [False, True])
def test_a_block_freed_by_one_stream_is_not_reused_by_another(expandable: bool) -> None:
    # `get_free_block` hands a cached block only to a request of the stream that allocated
    # it: 100 MiB freed by stream 1 stays reserved when stream 0 asks for 60 MiB
    a = CachingAllocator(expandable=expandable)
    a.free(a.malloc(100 * MiB, stream=1))
    a.malloc(60 * MiB)
    page = 20 * MiB if expandable else 2 * MiB  # 60 MiB is whole pages and 2 MiB units
    assert a.reserved == 100 * MiB + 60 * MiB // page * page
    assert a.stream_reserved == {0: 60 * MiB, 1: 100 * MiB}
    assert a.stream_allocated == {0: 60 * MiB, 1: 0}
    a.malloc(100 * MiB, stream=1)  # its own stream takes it back without a new segment
    assert a.reserved == 160 * MiB
    assert a.allocated == a.peak_allocated == 160 * MiB


def test_large_remainder_under_1_mib_is_not_split() -> None:
    a = CachingAllocator()
    a.free(a.malloc(100 * MiB))
    a.malloc(100 * MiB - MiB // 2)  # remainder 0.5 MiB <= kSmallSize: whole block handed out
    assert a.allocated == 100 * MiB


def test_separate_segments_do_not_merge_but_expandable_ones_do() -> None:
    a = CachingAllocator()
    h1, h2 = a.malloc(100 * MiB), a.malloc(100 * MiB)  # two exact 100 MiB segments
    a.free(h1)
    a.free(h2)
    a.malloc(150 * MiB)  # no single cached block >= 150 MiB: a third segment
    assert a.reserved == 350 * MiB
    assert a.peak_reserved == 350 * MiB

    e = CachingAllocator(expandable=True)
    h1, h2 = e.malloc(100 * MiB), e.malloc(100 * MiB)  # 5 + 5 pages of 20 MiB, one range
    assert e.reserved == 200 * MiB
    e.free(h1)
    e.free(h2)  # merges with its free neighbour: one 200 MiB block
    e.malloc(150 * MiB)
    assert e.reserved == 200 * MiB


def test_freed_neighbours_merge_within_a_segment() -> None:
    a = CachingAllocator()
    a.free(a.malloc(100 * MiB))
    x = a.malloc(40 * MiB)  # [40 used | 60 free]
    y = a.malloc(40 * MiB)  # [40 | 40 | 20 free]
    a.free(x)
    a.free(y)  # merges with both neighbours: [100 free]
    a.malloc(100 * MiB)
    assert a.reserved == 100 * MiB  # without merging this would need a new segment


def test_best_fit_takes_the_smallest_block_that_fits() -> None:
    a = CachingAllocator()
    h50, h30 = a.malloc(50 * MiB), a.malloc(30 * MiB)
    a.free(h50)
    a.free(h30)
    a.malloc(25 * MiB)  # best fit: the 30 MiB block (remainder 5 MiB split off)
    a.malloc(45 * MiB)  # so the 50 MiB block is still whole
    assert a.reserved == 80 * MiB  # first fit would have split the 50 and needed a segment


def test_expandable_maps_whole_pages() -> None:
    e = CachingAllocator(expandable=True)
    e.malloc(11 * MiB)  # large pool page = kLargeBuffer: one 20 MiB page
    assert e.reserved == 20 * MiB
    assert e.allocated == 11 * MiB  # remainder >= 512 B: split under expandable segments
    e.malloc(11 * MiB)  # 9 MiB free at the end: 2 MiB more -> one more page
    assert e.reserved == 40 * MiB
    e.malloc(1000)  # small pool: its own range, 2 MiB pages
    assert e.reserved == 42 * MiB


def test_expandable_prefers_an_inner_free_block_to_the_growable_end() -> None:
    e = CachingAllocator(expandable=True)
    h = e.malloc(10 * MiB)  # [10 used | 10 free end] in one page
    keep = e.malloc(6 * MiB)  # [10 | 6 | 4 free end]
    e.free(h)  # [10 free | 6 | 4 free end]
    e.malloc(3 * MiB)  # best fit by size is the 4 MiB end block, but it ranks as growable:
    # the 3 MiB goes into the 10 MiB hole -> [3 | 7 free | 6 | 4 free end]
    e.malloc(8 * MiB)  # no free block >= 8 MiB: the end block grows by one 20 MiB page
    assert e.reserved == 40 * MiB  # (plain best fit would have left the hole whole: 20 MiB)
    e.free(keep)


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    a = CachingAllocator(max_split_size=50 * MiB)
    a.free(a.malloc(100 * MiB))
    a.malloc(30 * MiB)  # request < max_split may not take a block >= max_split
    assert a.reserved == 130 * MiB
    a.malloc(90 * MiB)  # >= max_split and 100 < 90 + kLargeBuffer: reused, never split
    assert a.reserved == 130 * MiB
    assert a.allocated == 30 * MiB + 100 * MiB


def test_peaks_track_high_water_marks() -> None:
    a = CachingAllocator()
    h = a.malloc(40 * MiB)
    a.free(h)
    assert (a.allocated, a.reserved) == (0, 40 * MiB)  # the segment stays cached
    assert (a.peak_allocated, a.peak_reserved) == (40 * MiB, 40 * MiB)


def test_free_of_unknown_handle_fails() -> None:
    a = CachingAllocator()
    with pytest.raises(KeyError):
        a.free(12345)


@pytest.mark.parametrize("expandable", [False, True])
def test_100k_events_in_well_under_a_second(expandable: bool) -> None:
    rng = random.Random(0)
    a = CachingAllocator(expandable=expandable)
    live: list[int] = []
    t0 = time.perf_counter()
    for _ in range(50_000):
        if live and rng.random() < 0.5:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.malloc(rng.choice((4096, 300_000, 3 * MiB, 40 * MiB))))
    for h in live:
        a.free(h)
    assert time.perf_counter() - t0 < 1.0
    assert a.allocated == 0
    assert a.reserved >= a.peak_allocated


@pytest.mark.parametrize("size,count,expected", [
    (11 * MiB, 3, 36 * MiB),  # each in its own segment, rounded up to kRoundLarge
    (1000, 2049, 4 * MiB),  # 2048 blocks of 1024 B per kSmallBuffer segment
    (3 * MiB, 7, 40 * MiB),  # 21 MiB -> two 20 MiB segments (the replay: 6 + 1 blocks)
    (MiB, 3, 4 * MiB),  # kSmallSize blocks: two per 2 MiB segment
])
def test_packed_reserved_matches_the_replay_where_blocks_tile(size: int, count: int,
                                                              expected: int) -> None:
    assert packed_reserved([(size, count)]) == expected
    a = CachingAllocator()
    for _ in range(count):
        a.malloc(size)
    assert a.reserved == expected  # the replay of the same requests agrees


def test_packed_reserved_is_a_floor_when_blocks_leave_gaps() -> None:
    # 8 MiB blocks: two per 20 MiB segment in a replay (the 4 MiB rest fits no third), so
    # five take three segments (60 MiB); packed by bytes, 40 MiB fill two
    assert packed_reserved([(8 * MiB, 5)]) == 40 * MiB
    a = CachingAllocator()
    for _ in range(5):
        a.malloc(8 * MiB)
    assert a.reserved == 60 * MiB
    # mixed sizes share a pool: 8 + 8 + 2.5 + 1.5 MiB fill one 20 MiB segment in both
    # (each rest > kSmallSize is split off and the next request fits it)
    mixed = [(8 * MiB, 2), (5 * MiB // 2, 1), (3 * MiB // 2, 1)]
    assert packed_reserved(mixed) == 20 * MiB
    a = CachingAllocator()
    for size, n in mixed:
        for _ in range(n):
            a.malloc(size)
    assert a.reserved == 20 * MiB


# ---- the out-of-memory path: release_cached_blocks, then an error ---------------------
def test_a_whole_cached_segment_is_released_before_an_out_of_memory_error() -> None:
    # malloc → alloc_block fails → release_cached_blocks frees every cached block with no
    # neighbour (a whole segment) → alloc_block again
    a = CachingAllocator(capacity=120 * MiB)
    a.free(a.malloc(100 * MiB))  # a 100 MiB segment, cached
    a.malloc(120 * MiB)  # 100 + 120 > 120: the cached segment goes back, then it fits
    assert a.reserved == 120 * MiB
    assert a.num_segments == 1


def test_a_segment_holding_a_live_block_keeps_its_free_remainder() -> None:
    # a 30 MiB request splits the cached 100 MiB segment (best fit; the 70 MiB rest is a
    # free block beside it), so release_cached_blocks cannot return the segment: a new
    # 100 MiB request needs 200 MiB of capacity although only 130 MiB are ever allocated
    def run(capacity: int | None) -> CachingAllocator:
        a = CachingAllocator(capacity=capacity, record=True)
        a.free(a.malloc(100 * MiB))
        a.malloc(30 * MiB)
        a.malloc(100 * MiB)
        return a

    with pytest.raises(OutOfMemory):
        run(199 * MiB)
    done = run(200 * MiB)
    assert done.peak_allocated == 130 * MiB
    assert done.reserved == 200 * MiB
    assert min_capacity(run(None).events or []) == 200 * MiB


def test_min_capacity_without_splits_is_the_largest_live_set() -> None:
    # every block in a segment of its own: whatever is cached can be released, so the
    # smallest capacity is the allocated high-water mark (150 MiB), though an unconstrained
    # run reserves 250 MiB (the 100 MiB segment is cached when 150 MiB are asked for)
    a = CachingAllocator(record=True)
    a.free(a.malloc(100 * MiB))
    h = a.malloc(150 * MiB)
    a.free(h)
    assert a.peak_reserved == 250 * MiB
    assert min_capacity(a.events or []) == 150 * MiB


def test_replay_of_recorded_events_reproduces_the_run() -> None:
    rng = random.Random(3)
    a = CachingAllocator(record=True)
    live: list[int] = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.malloc(rng.choice((4096, 300_000, 3 * MiB, 40 * MiB)), rng.choice((0, 1))))
    b = replay(a.events or [])
    assert (b.peak_allocated, b.peak_reserved, b.allocated, b.reserved) == (
        a.peak_allocated, a.peak_reserved, a.allocated, a.reserved)
    need = min_capacity(a.events or [])
    assert a.peak_allocated <= need <= a.peak_reserved
    replay(a.events or [], capacity=need)  # runs
    with pytest.raises(OutOfMemory):
        replay(a.events or [], capacity=need - 2 * MiB)
