"""PyTorch's CUDA caching allocator, replayed over a step's allocation sequence: the ``reserved`` bytes.

An out-of-memory error happens when ``cudaMalloc`` fails, that is at the bytes the caching allocator
has *reserved* (its segments), not at the bytes tensors use. :class:`CachingAllocator` replays the
rules of ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.x, ``DeviceCachingAllocator``) over a
sequence of ``malloc``/``free``/``empty_cache`` events, one stream, no CUDA graph:

* **rounding** (``round_size``): every request is rounded up to ``kMinBlockSize`` = 512 B; with
  ``roundup_power2_divisions:N``, a request above 512·N B is rounded up to the next of N divisions
  of its power-of-two interval (``roundup_power2_next_division``).
* **pools** (``get_pool``): requests of at most ``kSmallSize`` = 1 MiB come from the small pool,
  larger ones from the large pool; a block never moves between pools.
* **segments** (``get_allocation_size``): when no cached block fits, the small pool reserves a
  ``kSmallBuffer`` = 2 MiB segment, a large request below ``kMinLargeAlloc`` = 10 MiB a
  ``kLargeBuffer`` = 20 MiB one, and a larger request its size rounded up to ``kRoundLarge`` = 2 MiB.
* **best fit** (``get_free_block``): the smallest cached block of the pool at least as large
  (ties: the lowest address). With ``max_split_size_mb``: a request below it never takes a cached
  block of at least that size, and a request at or above it takes a block only when less than
  ``kLargeBuffer`` (20 MiB) larger.
* **splitting** (``should_split``): a small-pool block is split when at least 512 B would remain;
  a large-pool block when the request is below ``max_split_size`` and more than ``kSmallSize``
  (1 MiB) would remain; with ``expandable_segments`` whenever at least 512 B would remain.
* **freeing** (``free_block``): a freed block merges with its free neighbours of the same segment.
* **out of memory** (``malloc``/``alloc_block``): past ``limit`` the allocator frees every cached
  segment that is wholly free (``release_cached_blocks``; ``num_alloc_retries`` counts it) and
  tries again; failing again is an OOM (:class:`AllocatorOOM`).
* **empty_cache** (``release_cached_blocks``): every wholly free segment is given back.
* **expandable_segments:True** (Note [Expandable Segments]): one segment per pool that grows by
  pages, 2 MiB in the small pool and 20 MiB in the large one; reserved is the mapped pages. A
  request that no free block fits extends the segment's free tail (or the segment) by whole pages;
  ``empty_cache`` unmaps the free tail's whole pages (torch unmaps every free page; a step's free
  space sits at the tail, where this model puts it).

Not modelled: several streams (``record_stream``), CUDA graphs' private pools,
``garbage_collection_threshold``, ``pinned_*`` settings; memory the libraries take outside the
allocator (the CUDA context, cuBLAS handles, NCCL) is :mod:`hf_memwatch.estimation.cuda_device`'s.

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
import os
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

MiB = 1 << 20
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: every block is a multiple of it
K_SMALL_SIZE = 1 * MiB  # kSmallSize: largest request served by the small pool
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: the small pool's segment size
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: requests (1, 10) MiB get a kLargeBuffer segment
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer (large_segment_size): that segment's size
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: larger requests are rounded up to it
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


class AllocatorOOM(RuntimeError):
    """The replay went past its ``limit`` even after freeing the cache: the run would raise an OOM."""


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` settings that change what is reserved.

    Example:
        >>> AllocatorConfig.parse("max_split_size_mb:128,expandable_segments:True")
        AllocatorConfig(max_split_size=134217728, expandable_segments=True, roundup_power2_divisions=1)
    """

    max_split_size: int | None = None  # bytes; None: unlimited (torch's default, SIZE_MAX)
    expandable_segments: bool = False
    roundup_power2_divisions: int = 1

    @classmethod
    def parse(cls, text: str | None) -> AllocatorConfig:
        """From the text of ``PYTORCH_CUDA_ALLOC_CONF`` (``key:value`` pairs, comma-separated)."""
        values: dict[str, object] = {}
        for item in (text or "").split(","):
            key, _, value = item.strip().partition(":")
            if key == "max_split_size_mb":
                values["max_split_size"] = int(float(value) * MiB)
            elif key == "expandable_segments":
                values["expandable_segments"] = value.strip().lower() == "true"
            elif key == "roundup_power2_divisions" and value.strip().isdigit():
                values["roundup_power2_divisions"] = max(1, int(value))
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls) -> AllocatorConfig:
        """This process's settings (``PYTORCH_CUDA_ALLOC_CONF``, else ``PYTORCH_ALLOC_CONF``)."""
        return cls.parse(next((os.environ[v] for v in ALLOC_CONF_VARIABLES if os.environ.get(v)), None))


def round_size(size: int, divisions: int = 1) -> int:
    """``round_size``: the block size a request of ``size`` bytes gets.

    Example:
        >>> round_size(1), round_size(513), round_size(1536), round_size(1200 * 1024, divisions=4)
        (512, 1024, 1536, 1310720)
    """
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * -(-size // K_MIN_BLOCK_SIZE)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: ``size`` up to the next of ``divisions`` steps between powers of 2."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc`` reserves for a rounded request none fits.

    Example:
        >>> [allocation_size(n) // MiB for n in (512, MiB, MiB + 512, 10 * MiB, 10 * MiB + 1)]
        [2, 2, 20, 10, 12]
    """
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * -(-size // K_ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    segment: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class _Pool:
    small: bool
    free: list[tuple[int, int]] = field(default_factory=list)  # sorted (size, addr) of cached blocks
    by_addr: dict[int, _Block] = field(default_factory=dict)  # addr -> cached block

    def add(self, block: _Block) -> None:
        bisect.insort(self.free, (block.size, block.addr))
        self.by_addr[block.addr] = block

    def remove(self, block: _Block) -> None:
        index = bisect.bisect_left(self.free, (block.size, block.addr))
        del self.free[index]
        del self.by_addr[block.addr]

    def best_fit(self, size: int) -> _Block | None:
        index = bisect.bisect_left(self.free, (size, -1))
        return self.by_addr[self.free[index][1]] if index < len(self.free) else None


class CachingAllocator:
    """One device's caching allocator (one stream); bytes ``allocated``/``reserved`` and their peaks.

    ``limit``: the bytes ``cudaMalloc`` may reserve in all (None: no limit).
    """

    def __init__(self, config: AllocatorConfig | None = None, limit: int | None = None) -> None:
        self.config = config or AllocatorConfig()
        self.limit = limit
        self.pools = {True: _Pool(small=True), False: _Pool(small=False)}
        self.live: dict[Hashable, _Block] = {}
        self.segments: dict[int, int] = {}  # segment id -> reserved bytes
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.num_alloc_retries = self.num_ooms = 0
        self._ids = itertools.count()
        self._next_addr = 0
        self._tails: dict[bool, _Block] = {}  # expandable segments: the last block of each pool's segment

    # -- the public events ---------------------------------------------------------------------
    def malloc(self, key: Hashable, nbytes: int) -> None:
        """A tensor storage of ``nbytes`` is created (``key`` names it until :meth:`free`)."""
        if nbytes <= 0:
            return  # a zero-size storage takes no block
        size = round_size(nbytes, self.config.roundup_power2_divisions)
        small = size <= K_SMALL_SIZE
        block = self._find(size, small)
        if block is None:
            block = self._reserve(size, small)
        self.pools[small].remove(block)
        block = self._split(block, size)
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
            if neighbour is not None and not neighbour.allocated:
                pool.remove(neighbour)
                self._merge(block, neighbour)
        pool.add(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: give back every wholly free segment (expandable: the free tail)."""
        for small, pool in self.pools.items():
            if self.config.expandable_segments:
                self._unmap_tail(small)
                continue
            for block in [b for b in pool.by_addr.values() if b.prev is None and b.next is None]:
                pool.remove(block)
                self.reserved -= self.segments.pop(block.segment)

    # -- the rules -----------------------------------------------------------------------------
    def _find(self, size: int, small: bool) -> _Block | None:
        """``get_free_block``: best fit, with ``max_split_size``'s two refusals."""
        block = self.pools[small].best_fit(size)
        limit = self.config.max_split_size
        if block is None or limit is None or self.config.expandable_segments:
            return block
        if size < limit and block.size >= limit:
            return None  # do not return an oversized block for a small request
        if size >= limit and block.size >= size + K_LARGE_BUFFER:
            return None  # do not return an oversized block for a large request
        return block

    def _reserve(self, size: int, small: bool) -> _Block:
        """``alloc_block``: a new segment (or pages of the expandable one), freeing the cache once if over."""
        grow = self._pages_needed(size, small) if self.config.expandable_segments else allocation_size(size)
        if self.limit is not None and self.reserved + grow > self.limit:
            self.num_alloc_retries += 1
            self.empty_cache()
            block = self._find(size, small)
            if block is not None:
                return block
            grow = self._pages_needed(size, small) if self.config.expandable_segments else grow
            if self.reserved + grow > self.limit:
                self.num_ooms += 1
                raise AllocatorOOM(f"reserving {grow} bytes over {self.reserved} exceeds the limit {self.limit}")
        self.reserved += grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if self.config.expandable_segments:
            return self._extend(grow, small)
        segment = next(self._ids)
        self.segments[segment] = grow
        block = _Block(self._next_addr, grow, segment, small)
        self._next_addr += grow + K_LARGE_BUFFER  # segments are never adjacent: blocks never merge across
        self.pools[small].add(block)
        return block

    def _split(self, block: _Block, size: int) -> _Block:
        """``should_split``: keep ``size`` bytes of ``block``, return the rest to the pool."""
        remaining = block.size - size
        if block.small or self.config.expandable_segments:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            limit = self.config.max_split_size
            split = (limit is None or size < limit) and remaining > K_SMALL_SIZE
        if not split:
            return block
        rest = _Block(block.addr + size, remaining, block.segment, block.small, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        if self._tails.get(block.small) is block:
            self._tails[block.small] = rest
        self.pools[block.small].add(rest)
        return block

    def _merge(self, block: _Block, other: _Block) -> None:
        """Fold the free neighbour ``other`` into ``block`` (``try_merge_blocks``)."""
        if other is block.prev:
            block.addr, block.prev = other.addr, other.prev
            if other.prev is not None:
                other.prev.next = block
        else:
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
            if self._tails.get(block.small) is other:
                self._tails[block.small] = block
        block.size += other.size

    # -- expandable segments -------------------------------------------------------------------
    @staticmethod
    def _page(small: bool) -> int:
        return K_SMALL_BUFFER if small else K_LARGE_BUFFER

    def _pages_needed(self, size: int, small: bool) -> int:
        """Bytes of new pages that let the segment's free tail (if any) hold ``size``."""
        tail = self._tails.get(small)
        have = tail.size if tail is not None and not tail.allocated else 0
        page = self._page(small)
        return page * -(-(size - have) // page)

    def _extend(self, grow: int, small: bool) -> _Block:
        """Map ``grow`` more bytes at the end of the pool's segment; the free tail that results."""
        pool, tail = self.pools[small], self._tails.get(small)
        if tail is None:
            self.segments[0 if small else 1] = 0
        self.segments[0 if small else 1] += grow
        if tail is not None and not tail.allocated:
            pool.remove(tail)
            tail.size += grow
            pool.add(tail)
            return tail
        addr = (1 << 50 if small else 0) if tail is None else tail.addr + tail.size  # one address range per pool
        block = _Block(addr, grow, 0 if small else 1, small, prev=tail)
        if tail is not None:
            tail.next = block
        self._tails[small] = block
        pool.add(block)
        return block

    def _unmap_tail(self, small: bool) -> None:
        tail = self._tails.get(small)
        if tail is None or tail.allocated:
            return
        pages = tail.size // self._page(small) * self._page(small)
        if not pages:
            return
        pool = self.pools[small]
        pool.remove(tail)
        tail.size -= pages
        self.reserved -= pages
        self.segments[0 if small else 1] -= pages
        if tail.size:
            pool.add(tail)
        else:  # the whole tail block is gone
            if tail.prev is not None:
                tail.prev.next = None
            self._tails[small] = tail.prev
            if tail.prev is None:
                self._tails.pop(small)


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
           limit: int | None = None) -> ReplayResult:
    """Replay ``(key, nbytes)`` events: ``nbytes > 0`` a storage created, ``0`` the storage ``key`` freed,
    ``(EMPTY_CACHE, 0)`` a ``torch.cuda.empty_cache()``.

    Example:
        >>> events = [("a", 4 * MiB), ("b", 4 * MiB), ("a", 0), ("c", 16 * MiB)]
        >>> replay(events).peak_reserved // MiB   # a 20 MiB segment (a, b), then one of 16 MiB for c
        36
        >>> replay(events, AllocatorConfig(expandable_segments=True)).peak_reserved // MiB  # 2 pages of 20
        40
    """
    allocator = CachingAllocator(config, limit)
    for key, nbytes in events:
        if key == EMPTY_CACHE:
            allocator.empty_cache()
        elif nbytes > 0:
            allocator.malloc(key, nbytes)
        else:
            allocator.free(key)
    return ReplayResult(allocator.peak_allocated, allocator.peak_reserved, allocator.reserved,
                        len(allocator.segments), allocator.num_alloc_retries)
