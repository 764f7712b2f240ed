"""A model of PyTorch's CUDA caching allocator (one device, one stream), byte for byte.

The rules and constants follow `c10/cuda/CUDACachingAllocator.cpp` (pytorch/pytorch) with the
default `PYTORCH_CUDA_ALLOC_CONF` (no `max_split_size_mb`, no `roundup_power2_divisions`, no
`expandable_segments`, no garbage-collection threshold), and the "CUDA memory management" notes of
the PyTorch docs (`docs/source/notes/cuda.rst`):

- Sizes are rounded up to a multiple of `kMinBlockSize` = 512 bytes (`round_size`).
- Requests of at most `kSmallSize` = 1 MiB go to the small pool, larger ones to the large pool
  (`get_pool`). Pools never lend to each other.
- Best fit: the smallest free block of the pool that is large enough; among equal sizes the lowest
  address (`get_free_block`: `lower_bound` on a set ordered by (stream, size, address)).
- With no such block, a new segment is obtained from cudaMalloc (`get_allocation_size`): 2 MiB
  (`kSmallBuffer`) for a small request; 20 MiB (`kLargeBuffer`) for a request below 10 MiB
  (`kMinLargeAlloc`); otherwise the request rounded up to a multiple of 2 MiB (`kRoundLarge`).
- The block is split when the rest is worth keeping (`should_split`): in the small pool when the rest
  is at least 512 bytes; in the large pool when it is more than 1 MiB. An unsplit block hands its
  whole size to the request (that slack is fragmentation too).
- A freed block merges with free neighbours of the same segment (`free_block` / `try_merge_blocks`);
  live blocks are never moved, and segments are never returned to CUDA while the cache can serve.
- When cudaMalloc fails (here: reserved + new segment > capacity), the allocator frees every cached
  segment that is entirely free (`release_cached_blocks`; `release_available_cached_blocks` only acts
  with `max_split_size_mb` set) and retries once; failing again is an out-of-memory error.

`memory_reserved` is the sum of segment sizes, `memory_allocated` the sum of the sizes of allocated
blocks (after rounding), as in `torch.cuda.memory_stats`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from slackswap.errors import SlackSwapError

K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20


def round_size(size: int) -> int:
    """`round_size`: at least 512 bytes, rounded up to a multiple of 512."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(rounded: int) -> int:
    """`get_allocation_size`: the size of the segment cudaMalloc'd for a request that found no block."""
    if rounded <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if rounded < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((rounded + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


def is_small(rounded: int) -> bool:
    return rounded <= K_SMALL_SIZE


def should_split(block_size: int, rounded: int, small_pool: bool) -> bool:
    remaining = block_size - rounded
    return remaining >= K_MIN_BLOCK_SIZE if small_pool else remaining > K_SMALL_SIZE


@dataclass
class Block:
    address: int
    size: int
    segment: int
    small: bool
    allocated: bool = False
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class OutOfMemory(SlackSwapError):
    """The allocator could not serve a request within its capacity, even after releasing its cache."""

    def __init__(self, size: int, rounded: int, reserved: int, allocated: int, capacity: int):
        self.size, self.rounded, self.capacity = size, rounded, capacity
        self.reserved, self.allocated = reserved, allocated
        super().__init__(
            f"caching allocator out of memory: request of {size} bytes (rounded {rounded}) with {allocated} "
            f"allocated and {reserved} reserved against a capacity of {capacity}"
        )


class CachingAllocator:
    """Segments and blocks of one device and one stream. `capacity_bytes` None: cudaMalloc never fails."""

    def __init__(self, capacity_bytes: int | None = None):
        self.capacity_bytes = capacity_bytes
        self.reserved_bytes = 0
        self.allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.segments: dict[int, Block] = {}  # segment id -> its first block
        self.segment_size: dict[int, int] = {}
        self._free: dict[bool, list[tuple[int, int, Block]]] = {True: [], False: []}  # (size, address, block)
        self._next_address = 0
        self._next_segment = 0
        self.cuda_mallocs = 0
        self.cuda_frees = 0

    # -- the pools -------------------------------------------------------------------------------------
    def _insert_free(self, block: Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.address, block), key=lambda e: (e[0], e[1]))

    def _remove_free(self, block: Block) -> None:
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, (block.size, block.address), key=lambda e: (e[0], e[1]))
        if i >= len(pool) or pool[i][2] is not block:
            raise SlackSwapError(f"allocator model: free block at {block.address} missing from its pool")
        del pool[i]

    def _best_fit(self, rounded: int, small: bool) -> Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (rounded, -1), key=lambda e: (e[0], e[1]))
        if i == len(pool):
            return None
        block = pool[i][2]
        del pool[i]
        return block

    def _cuda_malloc(self, size: int, small: bool) -> Block | None:
        if self.capacity_bytes is not None and self.reserved_bytes + size > self.capacity_bytes:
            return None
        segment = self._next_segment
        self._next_segment += 1
        block = Block(self._next_address, size, segment, small)
        self._next_address += size
        self.segments[segment] = block
        self.segment_size[segment] = size
        self.reserved_bytes += size
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self.cuda_mallocs += 1
        return block

    def release_cached_blocks(self) -> int:
        """Return every entirely free segment to CUDA (`empty_cache`). Returns the bytes released."""
        released = 0
        for small in (True, False):
            keep = []
            for entry in self._free[small]:
                block = entry[2]
                if block.prev is None and block.next is None:
                    released += block.size
                    del self.segments[block.segment]
                    del self.segment_size[block.segment]
                    self.cuda_frees += 1
                else:
                    keep.append(entry)
            self._free[small] = keep
        self.reserved_bytes -= released
        return released

    # -- the public calls ----------------------------------------------------------------------------
    def malloc(self, size: int) -> Block:
        """Serve a request of `size` bytes (> 0). Raises `OutOfMemory` past the capacity."""
        if size <= 0:
            raise SlackSwapError(f"allocator model: request of {size} bytes (PyTorch allocates nothing for 0)")
        rounded = round_size(size)
        small = is_small(rounded)
        block = self._best_fit(rounded, small)
        if block is None:
            segment_size = allocation_size(rounded)
            block = self._cuda_malloc(segment_size, small)
            if block is None:
                self.release_cached_blocks()
                block = self._cuda_malloc(segment_size, small)
            if block is None:
                raise OutOfMemory(size, rounded, self.reserved_bytes, self.allocated_bytes, self.capacity_bytes)
        if should_split(block.size, rounded, small):
            rest = Block(block.address + rounded, block.size - rounded, block.segment, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = rounded
            self._insert_free(rest)
        block.allocated = True
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return block

    def free(self, block: Block) -> None:
        if not block.allocated:
            raise SlackSwapError(f"allocator model: double free of the block at {block.address}")
        block.allocated = False
        self.allocated_bytes -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove_free(neighbour)
                if neighbour is block.prev:
                    block.address = neighbour.address
                    block.prev = neighbour.prev
                    if neighbour.prev is not None:
                        neighbour.prev.next = block
                    else:
                        self.segments[block.segment] = block
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                block.size += neighbour.size
        self._insert_free(block)

    def free_blocks(self, small: bool) -> list[tuple[int, int]]:
        """(address, size) of the cached free blocks of one pool, by size then address (for tests)."""
        return [(b.address, b.size) for _, _, b in self._free[small]]
