"""PyTorch's CUDA caching allocator, replayed over a step's allocation sequence: the ``reserved`` bytes.

An out-of-memory error happens when ``cudaMalloc`` fails, that is at the bytes the caching allocator
has *reserved* (its segments), not at the bytes tensors use. :class:`CachingAllocator` replays the
rules of ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``) over a sequence of
``malloc``/``free``/``empty_cache`` events, one stream, no CUDA graph. Read at pytorch/pytorch
``001074d2`` (the copy the search index stores; none at torch 2.13's ``cf30153c``), with what torch
2.13's installed headers and later copies change: the settings of ``c10/core/AllocatorConfig.h``
(``AcceleratorAllocatorConfig``: ``large_segment_size``, ``max_non_split_rounding_size`` in place of
``kLargeBuffer`` in ``get_free_block``, the per-interval ``roundup_power2_divisions``;
:mod:`~hf_memwatch.estimation.cuda_settings`) and, from the ``AcceleratorAllocatorConfig``-based copy
of the functions, ``release_available_cached_blocks`` and ``garbage_collect_cached_blocks`` passing
over expandable segments' blocks (``release_block`` asserts on them in ``001074d2``):

* **rounding** (``round_size``): every request is rounded up to ``kMinBlockSize`` = 512 B; with
  ``roundup_power2_divisions``, a request whose size interval ``[2^k, 2^k+1)`` MiB (16 intervals from
  1 MiB to 64 GiB, ``AcceleratorAllocatorConfig::roundup_power2_divisions(size)``; smaller sizes use
  the first) has N > 1 divisions and is above 512·N B is rounded up to the next of N divisions of
  its power-of-two interval (``roundup_power2_next_division``). ``roundup_power2_divisions:4`` sets
  every interval; ``[256:1,512:2,>:4]`` one interval each, the first value also every interval
  below it, ``>`` every interval after the last named one (``parseRoundUpPower2Divisions``).
* **pools** (``get_pool``): requests of at most ``kSmallSize`` = 1 MiB come from the small pool,
  larger ones from the large pool; a block never moves between pools.
* **segments** (``get_allocation_size``): when no cached block fits, the small pool reserves a
  ``kSmallBuffer`` = 2 MiB segment, a large request below ``kMinLargeAlloc`` = 10 MiB a
  ``large_segment_size`` (``kLargeBuffer`` = 20 MiB unless ``large_segment_size_mb``) one, and a
  larger request its size rounded up to ``kRoundLarge`` = 2 MiB.
* **best fit** (``get_free_block``): the smallest cached block of the pool at least as large
  (ties: the lowest address). With ``expandable_segments`` a block that borders unmapped address
  space ranks by its size *plus* that space, so the best fit walks on to the next larger block while
  it is smaller in that sense. With ``max_split_size_mb``: a request below it never takes a cached
  block of at least that size, and a request at or above it takes a block only when less than
  ``max_non_split_rounding_size`` (``max_non_split_rounding_mb``, default ``kLargeBuffer`` 20 MiB)
  larger.
* **splitting** (``should_split``): a small-pool block is split when at least 512 B would remain;
  a large-pool block when the request is below ``max_split_size`` and more than ``kSmallSize``
  (1 MiB) would remain; with ``expandable_segments`` whenever at least 512 B would remain.
* **freeing** (``free_block``/``try_merge_blocks``): a freed block merges with its free neighbours of
  the same segment (mapped with mapped, unmapped with unmapped).
* **a failed cudaMalloc** (``malloc``): with no cached block, ``alloc_block`` asks for the segment;
  past the device ``limit`` (the card's memory less what the process holds outside the allocator)
  it fails, then ``release_available_cached_blocks`` frees — only with ``max_split_size`` set — the
  smallest cached oversize block (at least ``max(size, max_split_size)``), else oversize blocks from
  the largest down until that much is freed, and ``alloc_block`` is tried again; failing again,
  ``release_cached_blocks`` frees every cached segment that is wholly free and ``alloc_block`` is
  tried a last time (``num_alloc_retries`` counts it); failing that is an OOM (:class:`AllocatorOOM`).
* **a memory fraction** (``torch.cuda.set_per_process_memory_fraction``, ``setMemoryFraction``):
  ``alloc_block`` fails when the reserve plus the segment would pass ``fraction`` × the card's total;
  with it set and ``garbage_collection_threshold`` > 0, a malloc that needs a new segment first runs
  ``garbage_collect_cached_blocks``: when the reserve is above threshold × that allowance, it frees
  the large pool's wholly free segments whose age (``get_free_block`` calls on the pool since the
  block was cached, ``gc_count``) is at least the mean age, pass after pass, until the excess is freed.
* **empty_cache** (``release_cached_blocks``): every wholly free segment is given back.
* **expandable_segments:True** (Note [Expandable Segments]): one segment per pool, an address range
  of 1⅛ × the card's memory (``find_expandable_block``) mapped by pages, 2 MiB in the small pool and
  ``kLargeBuffer`` (2.13: ``large_segment_size``) in the large one; reserved is the mapped pages. A request no free block fits
  maps pages at the lowest address where free and unmapped space together hold it
  (``try_allocate_expandable_block``/``map_block``); releasing (``empty_cache``, or the failed-map
  retry) unmaps every whole free page anywhere in the segment (``release_blocks``/``unmap_block``),
  leaving unmapped holes that later maps fill first.

Not modelled: several streams (``record_stream``), CUDA graphs' private pools, ``pinned_*`` settings,
``release_lock_on_cudamalloc``, 2.13's ``per_process_memory_fraction`` and ``throw_on_cudamalloc_oom``
keys (the fraction is taken as ``set_per_process_memory_fraction``'s), expandable segments switched
off mid-run, the free-memory callbacks; memory the libraries take outside the allocator (the CUDA context,
cuBLAS handles, NCCL) is :mod:`hf_memwatch.estimation.cuda_device`'s.

Example:
    >>> a = CachingAllocator()
    >>> a.malloc("x", 1000); a.malloc("y", 3 * MiB); a.malloc("z", 30 * MiB + 1)
    >>> a.allocated, a.reserved // MiB          # 1 KiB block in a 2 MiB segment, 20 MiB, 32 MiB
    (34604544, 54)
    >>> a.free("z"); a.empty_cache(); a.reserved // MiB
    22
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from .cuda_settings import (  # noqa: F401  (the replay's public names, re-exported)
    ALLOC_CONF_VARIABLES,
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorConfig,
    MiB,
    allocation_size,
    round_size,
)

UNKNOWN_TOTAL_MEMORY = 1 << 40  # an expandable segment's address range when the card is not named


class AllocatorOOM(RuntimeError):
    """The replay went past its ``limit`` even after freeing the cache: the run would raise an OOM."""


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    segment: int
    small: bool
    allocated: bool = False
    mapped: bool = True
    prev: _Block | None = None
    next: _Block | None = None
    gc_base: int = 0  # the pool's get_free_block calls when the block was cached

    @property
    def split(self) -> bool:
        return self.prev is not None or self.next is not None


@dataclass
class _Pool:
    small: bool
    free: list[tuple[int, int]] = field(default_factory=list)  # sorted (size, addr) of cached mapped blocks
    by_addr: dict[int, _Block] = field(default_factory=dict)  # addr -> cached block
    unmapped: dict[int, _Block] = field(default_factory=dict)  # expandable: addr -> unmapped block
    calls: int = 0  # get_free_blocks_call_count

    def add(self, block: _Block) -> None:
        """``insert_into_blocks``: cache ``block``, its age counted from now."""
        block.gc_base = self.calls
        bisect.insort(self.free, (block.size, block.addr))
        self.by_addr[block.addr] = block

    def remove(self, block: _Block) -> None:
        index = bisect.bisect_left(self.free, (block.size, block.addr))
        del self.free[index]
        del self.by_addr[block.addr]

    def at(self, index: int) -> _Block:
        return self.by_addr[self.free[index][1]]


@dataclass
class _Expandable:
    """One expandable segment: its address range and page (``ExpandableSegment``)."""

    base: int
    size: int
    page: int


class CachingAllocator:
    """One device's caching allocator (one stream); bytes ``allocated``/``reserved`` and their peaks.

    ``limit``: the bytes the allocator may reserve before ``cudaMalloc`` fails (None: no limit) — the
    card's memory less the CUDA context and whatever else holds the card. ``total_memory``: the card's
    memory (the expandable segment's address range, the memory fraction's base). ``memory_fraction``:
    ``torch.cuda.set_per_process_memory_fraction`` (None: not set).
    """

    def __init__(self, config: AllocatorConfig | None = None, limit: int | None = None, *,
                 total_memory: int | None = None, memory_fraction: float | None = None) -> None:
        self.config = config or AllocatorConfig()
        self.limit = limit
        self.total_memory = total_memory
        self.allowed = None if memory_fraction is None else int(memory_fraction * (total_memory or limit or 0))
        self.gc = self.allowed is not None and self.config.garbage_collection_threshold > 0.0
        self.pools = {True: _Pool(small=True), False: _Pool(small=False)}
        self.live: dict[Hashable, _Block] = {}
        self.segments: dict[int, int] = {}  # segment id -> reserved bytes
        self.expandable: dict[int, _Expandable] = {}  # segment id -> its address range
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.num_alloc_retries = self.num_ooms = 0
        self._ids = itertools.count()
        self._next_addr = 0

    # -- the public events ---------------------------------------------------------------------
    def malloc(self, key: Hashable, nbytes: int) -> None:
        """A tensor storage of ``nbytes`` is created (``key`` names it until :meth:`free`)."""
        if nbytes <= 0:
            return  # a zero-size storage takes no block
        size = round_size(nbytes, self.config)
        pool = self.pools[size <= K_SMALL_SIZE]
        block = self._get_free_block(size, pool)
        if block is None:
            if self.gc:
                self._garbage_collect()
            alloc_size = allocation_size(size, self.config.large_segment_size)
            block = self._alloc_block(size, alloc_size, pool)
            if block is None and self._release_available_cached_blocks(size, pool):
                block = self._alloc_block(size, alloc_size, pool)
            if block is None:
                self.empty_cache()
                block = self._alloc_block(size, alloc_size, pool, retry=True)
            if block is None:
                self.num_ooms += 1
                raise AllocatorOOM(f"reserving for {size} bytes over {self.reserved} exceeds the limit {self.limit}")
        block = self._split(block, size, pool)
        block.allocated = True
        self.live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: Hashable) -> None:
        """The storage ``key`` dies: its block goes back to its pool, merged with free neighbours."""
        block = self.live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.allocated = False
        pool = self.pools[block.small]
        for neighbour in (block.prev, block.next):
            self._try_merge(block, neighbour, pool)
        pool.add(block)

    def empty_cache(self) -> None:
        """``release_cached_blocks``: give back every wholly free segment; unmap every whole free page."""
        for pool in (self.pools[False], self.pools[True]):
            to_unmap = []
            for _, addr in list(pool.free):
                block = pool.by_addr[addr]
                if block.segment in self.expandable:
                    to_unmap.append(block)
                elif not block.split:
                    self._release_block(block, pool)
            for block in to_unmap:
                self._unmap_block(block, pool)
                if not block.split:  # the whole segment is unmapped: its address range goes too
                    del pool.unmapped[block.addr], self.expandable[block.segment], self.segments[block.segment]

    # -- the rules -----------------------------------------------------------------------------
    def _get_free_block(self, size: int, pool: _Pool) -> _Block | None:
        """``get_free_block``: best fit (expandable: by the size a block can grow to), with
        ``max_split_size``'s two refusals."""
        if self.gc:
            pool.calls += 1
        index = bisect.bisect_left(pool.free, (size, -1))
        if index == len(pool.free):
            return None
        if self.config.expandable_segments:
            while index + 1 < len(pool.free) and _expandable_size(pool.at(index + 1)) < _expandable_size(pool.at(index)):
                index += 1
        block = pool.at(index)
        limit = self.config.max_split_size
        if limit is not None and size < limit <= block.size:
            return None  # do not return an oversized block for a small request
        if limit is not None and size >= limit and block.size >= size + self.config.max_non_split_rounding:
            return None  # an oversized block is rounded up to, but only within max_non_split_rounding
        pool.remove(block)
        return block

    def _alloc_block(self, size: int, alloc_size: int, pool: _Pool, retry: bool = False) -> _Block | None:
        """``alloc_block``: a new segment (or pages of the expandable one); None where cudaMalloc fails."""
        if retry:
            self.num_alloc_retries += 1
        if self.allowed is not None and self.reserved + alloc_size > self.allowed:
            return None
        if self.config.expandable_segments:
            return self._try_allocate_expandable(size, pool)
        if self.limit is not None and self.reserved + alloc_size > self.limit:
            return None
        segment = next(self._ids)
        self.segments[segment] = alloc_size
        self._grow(alloc_size)
        block = _Block(self._next_addr, alloc_size, segment, pool.small)
        self._next_addr += alloc_size + K_LARGE_BUFFER  # segments are never adjacent: blocks never merge across
        return block

    def _release_available_cached_blocks(self, size: int, pool: _Pool) -> bool:
        """``release_available_cached_blocks``: with ``max_split_size``, free the smallest cached block
        of at least ``max(size, max_split_size)``, else oversize blocks from the largest down until that
        much is freed; True when it was."""
        limit = self.config.max_split_size
        if limit is None:
            return False
        key = max(size, limit)
        index = bisect.bisect_left(pool.free, (key, -1))
        if index < len(pool.free) and pool.at(index).segment not in self.expandable:
            self._release_block(pool.at(index), pool)
            return True
        released = 0
        index -= 1
        while released < key and index >= 0 and pool.at(index).size >= limit:
            block = pool.at(index)
            index -= 1
            if block.segment not in self.expandable:
                released += block.size
                self._release_block(block, pool)
        return released >= key

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: over threshold × the allowance, free the large pool's
        wholly free segments of at least the mean age, pass after pass, until the excess is freed."""
        threshold = int(self.config.garbage_collection_threshold * self.allowed)  # type: ignore[operator]
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self.pools[False]
        freeable = [b for b in (pool.at(i) for i in range(len(pool.free)))
                    if not b.split and b.segment not in self.expandable]
        total_age = sum(pool.calls - b.gc_base for b in freeable)
        count, freed = len(freeable), True
        while reclaimed < target and freed and count > 0:
            mean, freed = total_age / count, False
            for block in [pool.at(i) for i in range(len(pool.free))]:
                age = pool.calls - block.gc_base
                if not block.split and block.segment not in self.expandable and age >= mean:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block, pool)

    def _release_block(self, block: _Block, pool: _Pool) -> None:
        """``release_block``: ``cudaFree`` a wholly free segment."""
        pool.remove(block)
        self.reserved -= self.segments.pop(block.segment)

    def _split(self, block: _Block, size: int, pool: _Pool) -> _Block:
        """``should_split``/``alloc_found_block``: keep ``size`` bytes of ``block``, cache the rest."""
        remaining = block.size - size
        if block.small or self.config.expandable_segments:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            limit = self.config.max_split_size
            split = (limit is None or size < limit) and remaining > K_SMALL_SIZE
        if not split:
            return block
        front = _Block(block.addr, size, block.segment, block.small, prev=block.prev, next=block)
        if block.prev is not None:
            block.prev.next = front
        block.prev, block.addr, block.size = front, block.addr + size, remaining
        pool.add(block)
        return front

    def _try_merge(self, block: _Block, other: _Block | None, pool: _Pool) -> None:
        """``try_merge_blocks``: fold the free neighbour ``other`` (mapped as ``block`` is) into ``block``."""
        if other is None or other.allocated or other.mapped != block.mapped:
            return
        if other.mapped:
            pool.remove(other)
        else:
            del pool.unmapped[other.addr]
        if other is block.prev:
            block.addr, block.prev = other.addr, other.prev
            if other.prev is not None:
                other.prev.next = block
        else:
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
        block.size += other.size

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    # -- expandable segments -------------------------------------------------------------------
    def _try_allocate_expandable(self, size: int, pool: _Pool) -> _Block | None:
        """``try_allocate_expandable_block``: map pages from the lowest address where free and unmapped
        space together hold ``size`` (``find_expandable_block``); None where a map fails."""
        candidate = self._find_expandable(size, pool)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), pool):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None and not following.mapped
            if not self._map_block(following, min(size - candidate.size, following.size), pool):
                return None
            candidate = following  # it took its free predecessor in
        pool.remove(candidate)
        return candidate

    def _find_expandable(self, size: int, pool: _Pool) -> _Block:
        """``find_expandable_block``: the lowest unmapped block (or the free block before it) where
        enough address space starts; else a new segment's whole range, unmapped."""
        for addr in sorted(pool.unmapped):
            block = pool.unmapped[addr]
            if block.prev is not None and not block.prev.allocated:
                block = block.prev
            room, walk = 0, block
            while room < size and walk is not None and not walk.allocated:
                room, walk = room + walk.size, walk.next
            if room >= size:
                return block
        page = K_SMALL_BUFFER if pool.small else self.config.large_segment_size
        total = self.total_memory or UNKNOWN_TOTAL_MEMORY
        span = page * -(-(total + total // 8) // page)  # 1 1/8 of the card's memory, whole pages
        segment = next(self._ids)
        self.segments[segment] = 0
        self.expandable[segment] = _Expandable(self._next_addr, span, page)
        block = _Block(self._next_addr, span, segment, pool.small, mapped=False)
        self._next_addr += span + K_LARGE_BUFFER
        pool.unmapped[block.addr] = block
        return block

    def _map_block(self, block: _Block, nbytes: int, pool: _Pool) -> bool:
        """``map_block``: map the whole pages over ``nbytes`` at the start of the unmapped ``block``."""
        page = self.expandable[block.segment].page
        mapped = min(block.size, page * -(-nbytes // page))
        if self.limit is not None and self.reserved + mapped > self.limit:
            return False  # cuMemCreate: out of memory
        del pool.unmapped[block.addr]
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, block.segment, block.small, mapped=False,
                          prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, mapped
            pool.unmapped[rest.addr] = rest
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.add(block)
        self.segments[block.segment] += mapped
        self._grow(mapped)
        return True

    def _unmap_block(self, block: _Block, pool: _Pool) -> None:
        """``unmap_block``: unmap the whole pages inside the free ``block``; the edges stay free blocks."""
        segment = self.expandable[block.segment]
        start = segment.base + segment.page * -(-(block.addr - segment.base) // segment.page)
        end = segment.base + (block.addr + block.size - segment.base) // segment.page * segment.page
        if start >= end:
            return
        pool.remove(block)
        if start > block.addr:
            before = _Block(block.addr, start - block.addr, block.segment, block.small, prev=block.prev, next=block)
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            pool.add(before)
        if end < block.addr + block.size:
            after = _Block(end, block.addr + block.size - end, block.segment, block.small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = after
            block.next = after
            pool.add(after)
        block.addr, block.size, block.mapped = start, end - start, False
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.unmapped[block.addr] = block
        self.reserved -= end - start
        self.segments[block.segment] -= end - start


def _expandable_size(block: _Block) -> int:
    """``get_free_block``'s ``expandable_size``: a block's size plus the unmapped space after it."""
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


EMPTY_CACHE = "empty_cache"


@dataclass(frozen=True)
class ReplayResult:
    """What a replay reached: the peaks of allocated and reserved bytes, and what it ended with."""

    peak_allocated: int
    peak_reserved: int
    reserved: int
    segments: int
    num_alloc_retries: int


def replay(events: Iterable[tuple[Hashable, int]], config: AllocatorConfig | None = None,
           limit: int | None = None, *, total_memory: int | None = None,
           memory_fraction: float | None = None) -> ReplayResult:
    """Replay ``(key, nbytes)`` events: ``nbytes > 0`` a storage created, ``0`` the storage ``key`` freed,
    ``(EMPTY_CACHE, 0)`` a ``torch.cuda.empty_cache()``. Raises :class:`AllocatorOOM` past ``limit``.

    Example:
        >>> events = [("a", 4 * MiB), ("b", 4 * MiB), ("a", 0), ("c", 16 * MiB)]
        >>> replay(events).peak_reserved // MiB   # a 20 MiB segment (a, b), then one of 16 MiB for c
        36
        >>> replay(events, AllocatorConfig(expandable_segments=True)).peak_reserved // MiB  # 2 pages of 20
        40
    """
    allocator = CachingAllocator(config, limit, total_memory=total_memory, memory_fraction=memory_fraction)
    for key, nbytes in events:
        if key == EMPTY_CACHE:
            allocator.empty_cache()
        elif nbytes > 0:
            allocator.malloc(key, nbytes)
        else:
            allocator.free(key)
    return ReplayResult(allocator.peak_allocated, allocator.peak_reserved, allocator.reserved,
                        len(allocator.segments), allocator.num_alloc_retries)
