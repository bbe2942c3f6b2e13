"""Free ranges of a linear space (a pinned slab, the spill file), first fit, merged on release.

Both the host arena's slabs and the spill file's extents hand out pieces of one address range
and take them back in any order; this is that bookkeeping, once. Sizes are the caller's (already
aligned); ``end`` is where an unbounded space (a file) grows when no free range fits.
"""

from __future__ import annotations

import bisect
from typing import Optional

__all__ = ["ALIGN_BYTES", "FreeRanges", "round_up"]

ALIGN_BYTES = 4096
"""Offsets and sizes of host blocks and spill extents are multiples of this: a page, and the
logical block size direct I/O needs (512 or 4096 on today's disks; 4096 is safe for both), so a
host block can be written to the spill file as it is."""


def round_up(nbytes: int, unit: int = ALIGN_BYTES) -> int:
    """``nbytes`` rounded up to a multiple of ``unit``."""
    return -(-nbytes // unit) * unit


class FreeRanges:
    """Sorted free (offset, size) ranges over ``[0, limit)``, or over a space that grows (limit None)."""

    __slots__ = ("offsets", "sizes", "end", "limit", "used_bytes")

    def __init__(self, limit: Optional[int] = None) -> None:
        self.limit = limit
        self.offsets: list[int] = [0] if limit else []
        self.sizes: list[int] = [limit] if limit else []
        self.end = limit or 0
        self.used_bytes = 0

    def take(self, size: int) -> Optional[int]:
        """The offset of a free range of ``size`` bytes, or None when a bounded space has none."""
        for i, free in enumerate(self.sizes):
            if free >= size:
                offset = self.offsets[i]
                if free == size:
                    del self.offsets[i], self.sizes[i]
                else:
                    self.offsets[i], self.sizes[i] = offset + size, free - size
                self.used_bytes += size
                return offset
        if self.limit is not None:
            return None
        offset, self.end = self.end, self.end + size
        self.used_bytes += size
        return offset

    def give(self, offset: int, size: int) -> None:
        """Take back a range handed out by ``take``, merging it with its free neighbours."""
        self.used_bytes -= size
        i = bisect.bisect(self.offsets, offset)
        self.offsets.insert(i, offset)
        self.sizes.insert(i, size)
        if i + 1 < len(self.offsets) and offset + size == self.offsets[i + 1]:  # merge right
            self.sizes[i] += self.sizes.pop(i + 1)
            self.offsets.pop(i + 1)
        if i > 0 and self.offsets[i - 1] + self.sizes[i - 1] == offset:  # merge left
            self.sizes[i - 1] += self.sizes.pop(i)
            self.offsets.pop(i)
