"""A model of PyTorch's CUDA caching allocator: what `torch.cuda.max_memory_reserved` reads.

Written from the rules of `c10/cuda/CUDACachingAllocator.cpp` (pytorch/pytorch at commit
001074d25084fdb87a799823e395a50f5ec044d3, `DeviceCachingAllocator`), not from its code:

- `round_size`: every request is rounded up to a multiple of kMinBlockSize = 512 B
  (roundup_power2_divisions is off by default and not modelled).
- `get_pool`: a rounded size <= kSmallSize (1 MiB) goes to the small pool, larger to the
  large pool; blocks never move between pools.
- `get_free_block`: best fit, the smallest cached free block of the pool whose size is >=
  the request (ties: the lowest address; `BlockComparatorSize`). With max_split_size set
  (default: unlimited) a request below it never takes a block of at least that size, and a
  request at or above it only takes a block smaller than request + kLargeBuffer.
- `get_allocation_size`: with no fitting block, a new segment (cudaMalloc) of kSmallBuffer =
  2 MiB for small requests, kLargeBuffer = 20 MiB for requests below kMinLargeAlloc =
  10 MiB, else the request rounded up to kRoundLarge = 2 MiB.
- `should_split` / `alloc_found_block`: the request takes the start of the block; the rest
  becomes a free block when it is >= kMinBlockSize in the small pool (or under expandable
  segments), and when it is > kSmallSize in the large pool (and the request is below
  max_split_size). Otherwise the whole block is handed out and counted as allocated
  (`allocated_bytes` adds `block->size`, not the request).
- `free_block` / `try_merge_blocks`: a freed block merges with its free neighbours in the
  same segment; segments are never returned to CUDA here (see below).
- Streams (`get_free_block` compares the block's stream with the request's): a block
  freed by one stream is never handed to a request of another, so each stream has its own
  pools (`malloc(nbytes, stream)`), each with its own expandable segment; `reserved` sums
  them all.
- `expandable_segments:True` (Note [Expandable Segments], `find_expandable_block`,
  `map_block`, `try_allocate_expandable_block`): one segment per pool and stream whose
  mapped size grows in pages of 2 MiB (small pool) or 20 MiB (large pool); with no fitting
  free block the free block at the mapped end (if any) is extended by the missing bytes
  rounded up to whole pages. Best fit treats that end block as the size it could grow to,
  so any other fitting block is preferred. Splitting keeps any remainder >= 512 B; every
  freed block merges with its neighbours across the whole mapped range.

- Out of memory (`DeviceCachingAllocator::malloc`): with no fitting cached block the
  allocator asks CUDA for a segment (`alloc_block`); when that would pass the device's
  capacity it calls `release_available_cached_blocks` (a no-op unless max_split_size is
  set) and then `release_cached_blocks`, which returns to CUDA every cached block that is
  a whole segment (`release_blocks`: `!block->prev && !block->next`), and asks again;
  only then is the request an out-of-memory error. A segment that still holds one live
  block keeps its free remainder: that is what a job near its GPU's limit needs beyond its
  allocated bytes. `capacity` turns this path on (default segments; with expandable
  segments torch unmaps the free pages inside any block instead, which is not modelled),
  and `min_capacity` searches for the smallest capacity a recorded sequence of requests
  runs in (near the limit the outcome is not monotone in the capacity: best fit places
  blocks differently, so the answer is a boundary the search found). Under max_split_size
  the partial release of step two is not modelled (step three releases a superset).

Not modelled, as they do not change the peaks of one training process: CUDA events and
cross-stream uses (`recordStream`, `process_events`: a block waits for another stream's
work before it is reused; FSDP2 orders its streams with events instead), CUDA graph private pools,
IPC sharing, garbage_collection_threshold and per-process memory fractions, and
`empty_cache`. Without a capacity the peak reserved is the allocator's unconstrained
high-water mark: what `torch.cuda.max_memory_reserved` reads on a GPU with room to spare.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable

K_MIN_BLOCK_SIZE = 512  # kMinBlockSize
K_SMALL_SIZE = 1 << 20  # kSmallSize: largest "small" request, 1 MiB
K_SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment, 2 MiB
K_LARGE_BUFFER = 20 << 20  # kLargeBuffer: segment for 1-10 MiB requests, 20 MiB
K_MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: 10 MiB
K_ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests rounded up to 2 MiB
_NO_LIMIT = 1 << 62  # max_split_size unset (SIZE_MAX in torch)


class OutOfMemory(Exception):
    """A request that does not fit in the capacity even after the cached segments are
    released (torch.OutOfMemoryError)."""


def round_size(nbytes: int) -> int:
    """The allocator's block size for a request (`round_size`, 512-byte multiples)."""
    return max(-(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE, K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """Bytes of the segment cudaMalloc'ed for a rounded request (`get_allocation_size`)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def packed_reserved(blocks: Iterable[tuple[int, int]]) -> int:
    """Segment bytes holding live blocks given as (bytes, count), packed as tightly as the
    rules allow: each request >= kMinLargeAlloc in a fresh segment of `allocation_size`; the
    1 MiB - 10 MiB ones side by side in kLargeBuffer segments and the <= kSmallSize ones in
    kSmallBuffer segments, each pool's bytes rounded up to whole segments. A lower bound for
    those two pools (a real sequence leaves gaps a later request does not fit), exact for
    the large one: the analytic engine's reserved estimate (vramcalc/terms/reserved.py)."""
    small = mid = large = 0
    for nbytes, count in blocks:
        if count <= 0 or nbytes <= 0:
            continue
        size = round_size(nbytes)
        if size <= K_SMALL_SIZE:
            small += count * size
        elif size < K_MIN_LARGE_ALLOC:
            mid += count * size
        else:
            large += count * allocation_size(size)
    return (large + -(-small // K_SMALL_BUFFER) * K_SMALL_BUFFER
            + -(-mid // K_LARGE_BUFFER) * K_LARGE_BUFFER)


class _Block:
    __slots__ = ("addr", "size", "used", "prev", "next")

    def __init__(self, addr: int, size: int, prev: _Block | None = None,
                 nxt: _Block | None = None) -> None:
        self.addr, self.size, self.used = addr, size, False
        self.prev, self.next = prev, nxt


_ADDR_BITS = 60  # free-list keys: size << _ADDR_BITS | address (addresses stay below 2**60)
_ADDR_MASK = (1 << _ADDR_BITS) - 1


class _Pool:
    """One pool's cached free blocks, sorted by (size, address), and its expandable segment."""

    __slots__ = ("small", "free", "blocks", "page", "base", "mapped", "tail")

    def __init__(self, small: bool, base: int) -> None:
        self.small = small
        self.free: list[int] = []  # size << _ADDR_BITS | address, ascending
        self.blocks: dict[int, _Block] = {}  # free blocks by address
        self.page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        self.base, self.mapped = base, 0  # expandable segment: start, mapped bytes
        self.tail: _Block | None = None  # expandable segment: its last block

    def add(self, b: _Block) -> None:
        insort(self.free, b.size << _ADDR_BITS | b.addr)
        self.blocks[b.addr] = b

    def remove(self, b: _Block) -> None:
        del self.free[bisect_left(self.free, b.size << _ADDR_BITS | b.addr)]
        del self.blocks[b.addr]


class CachingAllocator:
    """Replays malloc/free requests through the rules of the module docstring.

    `malloc(nbytes)` returns a handle for `free(handle)`; `allocated` / `reserved` are the
    current `allocated_bytes` / `reserved_bytes` stats and `peak_allocated` /
    `peak_reserved` what `torch.cuda.max_memory_allocated` / `max_memory_reserved` read.
    """

    def __init__(self, expandable: bool = False, max_split_size: int | None = None,
                 capacity: int | None = None, record: bool = False) -> None:
        self.expandable = expandable
        self.max_split = max_split_size or _NO_LIMIT
        self.capacity = None if expandable else capacity  # bytes CUDA can hand out
        # every request in order, for `min_capacity`: (handle, bytes, stream), bytes -1 = free
        self.events: list[tuple[int, int, int]] | None = [] if record else None
        # segments get disjoint virtual addresses; expandable pools reserve a huge range
        # (the default stream's at 2**57 and 2**58, other streams' 2**52 apart above 3·2**57)
        self._pools: dict[int, tuple[_Pool, _Pool]] = {
            0: (_Pool(True, 1 << 57), _Pool(False, 2 << 57))}
        self._next_addr = 1 << 20
        self._live: dict[int, tuple[_Block, _Pool, int]] = {}
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        # per stream: bytes handed out now, bytes reserved (pools never shrink here)
        self.stream_allocated: dict[int, int] = {0: 0}
        self.stream_reserved: dict[int, int] = {0: 0}
        self.num_segments = 0

    # ---- requests ------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """A block for `nbytes` requested on `stream` (0: the default stream)."""
        size = -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE or K_MIN_BLOCK_SIZE  # round_size
        pools = self._pools.get(stream)
        if pools is None:
            base = (3 << 57) + (len(self._pools) - 1) * (2 << 52)
            pools = self._pools[stream] = (_Pool(True, base), _Pool(False, base + (1 << 52)))
        pool = pools[0] if size <= K_SMALL_SIZE else pools[1]
        block = self._find_free(pool, size)
        if block is None:
            if self.capacity is not None and self.reserved + allocation_size(size) > self.capacity:
                self.release_cached()  # alloc_block failed: release_cached_blocks, retry
                if self.reserved + allocation_size(size) > self.capacity:
                    raise OutOfMemory(f"{size} bytes on stream {stream}: {self.reserved} of "
                                      f"{self.capacity} reserved, {self.allocated} allocated")
            before = self.reserved
            block = self._grow(pool, size) if self.expandable else self._segment(pool, size)
            self.stream_reserved[stream] = (self.stream_reserved.get(stream, 0)
                                            + self.reserved - before)
        else:
            pool.remove(block)
        remaining = block.size - size
        if pool.small or self.expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = size < self.max_split and remaining > K_SMALL_SIZE
        if split:
            rest = _Block(block.addr + size, remaining, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            if pool.tail is block:
                pool.tail = rest
            pool.add(rest)
        block.used = True
        self._live[block.addr] = (block, pool, stream)
        self.allocated += block.size
        self.stream_allocated[stream] = self.stream_allocated.get(stream, 0) + block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.events is not None:
            self.events.append((block.addr, nbytes, stream))
        return block.addr

    def free(self, handle: int) -> None:
        if self.events is not None:
            self.events.append((handle, -1, 0))
        block, pool, stream = self._live.pop(handle)
        block.used = False
        self.allocated -= block.size
        self.stream_allocated[stream] -= block.size
        for nb in (block.prev, block.next):
            if nb is not None and not nb.used:
                pool.remove(nb)
                self._absorb(pool, block, nb)
        pool.add(block)

    def release_cached(self) -> int:
        """`release_cached_blocks`: every cached free block that is a whole segment (no
        neighbour in it) goes back to CUDA; the bytes released. Default segments only."""
        released = 0
        for stream, pools in self._pools.items():
            for pool in pools:
                for b in [b for b in pool.blocks.values() if b.prev is None and b.next is None]:
                    pool.remove(b)
                    released += b.size
                    self.stream_reserved[stream] -= b.size
                    self.num_segments -= 1
        self.reserved -= released
        return released

    # ---- rules ---------------------------------------------------------------------
    def _find_free(self, pool: _Pool, size: int) -> _Block | None:
        """Best fit (`get_free_block`); an expandable pool's end block ranks last."""
        free = pool.free
        i = bisect_left(free, size << _ADDR_BITS)
        if i == len(free):
            return None
        block = pool.blocks[free[i] & _ADDR_MASK]
        if block is pool.tail and i + 1 < len(free):
            block = pool.blocks[free[i + 1] & _ADDR_MASK]
        if size < self.max_split <= block.size:
            return None
        if size >= self.max_split and block.size >= size + K_LARGE_BUFFER:
            return None
        return block

    def _segment(self, pool: _Pool, size: int) -> _Block:
        """A new cudaMalloc'ed segment (`alloc_block`)."""
        seg = allocation_size(size)
        block = _Block(self._next_addr, seg)
        self._next_addr += seg + K_ROUND_LARGE  # a gap: segments never merge
        self._reserve(seg)
        self.num_segments += 1
        return block

    def _grow(self, pool: _Pool, size: int) -> _Block:
        """Map pages at the end of the pool's expandable segment (`map_block`)."""
        end = pool.tail if pool.tail is not None and not pool.tail.used else None
        have = end.size if end is not None else 0
        grow = -(-(size - have) // pool.page) * pool.page
        pool.mapped += grow
        self._reserve(grow)
        if end is not None:
            pool.remove(end)
            end.size += grow
            return end
        block = _Block(pool.base + pool.mapped - grow, grow, pool.tail)
        if pool.tail is not None:
            pool.tail.next = block
        else:
            self.num_segments += 1
        pool.tail = block
        return block

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    @staticmethod
    def _absorb(pool: _Pool, dst: _Block, src: _Block) -> None:
        """Merge the free neighbour `src` into `dst` (`try_merge_blocks`)."""
        if src is dst.prev:
            dst.addr, dst.prev = src.addr, src.prev
            if src.prev is not None:
                src.prev.next = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size
        if pool.tail is src:
            pool.tail = dst


def replay(events: Iterable[tuple[int, int, int]], capacity: int | None = None
           ) -> CachingAllocator:
    """A new allocator (default segments) that has served `events` (CachingAllocator.events)
    in order; raises OutOfMemory when they do not fit in `capacity`."""
    a = CachingAllocator(capacity=capacity)
    handles: dict[int, int] = {}
    for key, nbytes, stream in events:
        if nbytes < 0:
            a.free(handles.pop(key))
        else:
            handles[key] = a.malloc(nbytes, stream)
    return a


def from_start(events: list[tuple[int, int, int]], start: int) -> list[tuple[int, int, int]]:
    """`events` from index `start` on, after the blocks live at `start` requested anew in
    the order they were first requested (their earlier history and its cached blocks
    dropped)."""
    live: dict[int, tuple[int, int, int]] = {}
    for key, nbytes, stream in events[:start]:
        if nbytes < 0:
            del live[key]
        else:
            live[key] = (key, nbytes, stream)
    return [*live.values(), *events[start:]]


def min_capacity(events: list[tuple[int, int, int]]) -> int:
    """The smallest device capacity (bytes the allocator may hold, default segments) in
    which `events` run without an out-of-memory error. Every segment is a multiple of
    kRoundLarge (2 MiB), so only multiples of it matter. The search starts just below the
    highest sum of live rounded requests (never enough less: reserved >= allocated >= it),
    tries the next capacity up, then doubles its step until one runs and bisects back: a
    run that needs little more than its live blocks costs one or two replays, and a
    capacity that fails stops at its error. The outcome is not monotone in the capacity near
    the limit, so the answer runs and one unit less does not, but a smaller capacity may
    run too."""
    unit = K_ROUND_LARGE
    live = peak = 0
    sizes: dict[int, int] = {}
    for key, nbytes, _ in events:
        if nbytes < 0:
            live -= sizes.pop(key)
        else:
            sizes[key] = round_size(nbytes)
            live += sizes[key]
            peak = max(peak, live)

    def runs(units: int) -> bool:
        try:
            replay(events, capacity=units * unit)
        except OutOfMemory:
            return False
        return True

    lo = -(-peak // unit) - 1  # in units: known not to be enough
    step = 1
    while not runs(lo + step):
        lo, step = lo + step, step * 2
    hi = lo + step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if runs(mid):
            hi = mid
        else:
            lo = mid
    return hi * unit
