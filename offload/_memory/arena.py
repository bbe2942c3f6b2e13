"""Host memory for the host tier: a few large slabs, carved into aligned blocks, under a byte cap.

Why slabs of our own. ``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host
allocator, which rounds every block up to a power of two and keeps freed blocks for reuse without
giving them back to the OS. Buffers of arbitrary sizes taken from it really pin up to 2x what they
hold, and freeing them frees nothing. So the arena asks it only for slabs whose sizes are powers of
two (rounding adds nothing), carves blocks out of them itself (first fit, merged again on release),
counts whole slabs as held, and when it drops a slab it empties the caching host allocator, so the
pinned bytes held are the bytes counted and ``clear()`` gives them back.

    slab (2^k bytes, pinned once) ─▶ [ block | free | block block | free ... ]   offsets and sizes
                                                                               multiples of ALIGN_BYTES

The cap is the smaller of ``cap_bytes`` (``host_budget_mb``) and what the host can spare now:
available RAM (``Host.ram``) minus a reserve, so the arena never pushes the host into swap or the OOM
killer. When a new slab would break the cap, idle slabs go first; if that is not enough,
``acquire`` returns None and the caller makes room (spills older host copies) or keeps the tensor.
Not thread-safe: the store's lock guards it.

Note: [emptying the pinned cache]
    Giving pinned pages back to the OS empties the caching host allocator of the whole process
    (``torch.accelerator.empty_host_cache``), and its ``cudaFreeHost`` synchronizes the device;
    before it the arena waits for every copy in flight (``settle``). In ``acquire``, under the
    store's lock in a pack, that would stall the step. So a slab dropped there (to make room under
    the cap for a larger one) only leaves the arena: its pages stay in the caching host allocator
    (``unreturned_bytes``, still in ``pinned_bytes``), which may hand them back to this arena's
    next slab of that size, until ``return_unpinned()`` at the next step's start
    (``Store.step_started``) or ``clear()``. Until then what is pinned may pass the cap by those
    pages; the RAM reserve is never passed (available RAM does not count them as free).

Engines made one after another (a benchmark's configurations) can share their idle slabs through
``PinnedSlabs``, passed on their links: an arena then hands its idle slabs there instead of
unpinning them, and takes one of the size it wants from there before it pins a new one.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import torch

from .host import Host, empty_host_cache
from .ranges import ALIGN_BYTES, FreeRanges, round_up

__all__ = ["ALIGN_BYTES", "Block", "HostArena"]

log = logging.getLogger(__name__)

SLAB_BYTES = 64 << 20
"""Smallest slab (64 MiB): pinning costs milliseconds per call, so it is done rarely and in bulk.
A request larger than this gets a slab of the next power of two; the rest of it serves others."""


def _next_pow2(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 0).bit_length()


class _Slab:
    """One pinned allocation and its free ranges."""

    __slots__ = ("tensor", "nbytes", "ranges")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: Optional[torch.Tensor] = tensor  # None once trimmed: its pages went back
        self.nbytes = tensor.numel()
        self.ranges = FreeRanges(self.nbytes)

    @property
    def used_bytes(self) -> int:
        return self.ranges.used_bytes

    def view(self, offset: int, size: int) -> torch.Tensor:
        """The bytes [offset, offset + size) of this slab."""
        assert self.tensor is not None, "offload internal error: a block from a trimmed slab"
        return self.tensor[offset : offset + size]


@dataclasses.dataclass(eq=False, slots=True)
class Block:
    """A piece of a slab: ``tensor`` is its 1-D uint8 view of ``size`` bytes (>= what was asked)."""

    tensor: torch.Tensor
    slab: _Slab
    offset: int
    size: int


class PinnedSlabs:
    """Idle pinned slabs that the host arenas of several engines share.

    Pinning costs milliseconds per call and can synchronize the device, so a benchmark that makes
    one engine per configuration would pin (and unpin) the same gigabytes once per engine. An
    arena sharing this gives its idle slabs here when it trims or closes, and takes one of the
    size it wants before it pins a new slab. Whoever made it calls ``clear()`` once no engine
    needs the slabs: that unpins them, as an arena of its own does at close. Held bytes are
    counted by the arena holding a slab; idle ones here by ``idle_bytes``. Engines use it one
    after another (not thread-safe).
    """

    def __init__(self) -> None:
        self._idle: list[torch.Tensor] = []
        self._pinned = False  # whether any slab given was pinned (not so for the CPU tests' arenas)

    @property
    def idle_bytes(self) -> int:
        return sum(t.numel() for t in self._idle)

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        """An idle slab of exactly ``nbytes`` (a power of two), or None."""
        for i, tensor in enumerate(self._idle):
            if tensor.numel() == nbytes:
                return self._idle.pop(i)
        return None

    def give(self, tensor: torch.Tensor, pinned: bool) -> None:
        """An arena is done with this slab (nothing in flight reads or writes it)."""
        self._idle.append(tensor)
        self._pinned = self._pinned or pinned

    def clear(self, settle: Callable[[], None] = lambda: None) -> None:
        """Unpin every idle slab. ``settle`` waits for the streams that used them: the caching host
        allocator records an event on each such stream when a slab is freed, and frees the slab
        only once those events have completed (See HostArena.trim)."""
        self._idle = []
        if self._pinned:
            settle()
            empty_host_cache()
        self._pinned = False


class HostArena:
    """Pinned (or, for tests on the CPU, plain) host blocks carved from power-of-two slabs."""

    def __init__(
        self,
        cap_bytes: Optional[int],
        pin: bool = True,
        settle: Callable[[], None] = lambda: None,
        shared: Optional[PinnedSlabs] = None,
        host: Optional[Host] = None,
    ) -> None:
        self._cap_bytes = cap_bytes
        self._host = host if host is not None else Host()
        """Where slabs, the RAM reading and giving pinned pages back come from."""
        self._pin = pin
        self._settle = settle
        """Waits for every copy in flight: a dropped slab is given back only once its copies finished."""
        self._shared = shared
        """Where idle slabs go instead of being unpinned, and new ones come from first (or None)."""
        self._slabs: list[_Slab] = []
        self.unreturned_bytes = 0
        """Pinned bytes of slabs dropped in ``acquire``, still cached by torch until ``return_unpinned``."""
        self.failed = False
        """True once pinning failed: later requests get None at once (the caller spills or keeps)."""
        self._warned_low_ram = False

    @property
    def held_bytes(self) -> int:
        """Bytes of every slab the arena holds: what is really pinned, in use or idle."""
        return sum(s.nbytes for s in self._slabs)

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory on this arena's account: its slabs and what it dropped but has not
        yet given back (See Note: [emptying the pinned cache])."""
        return self.held_bytes + self.unreturned_bytes

    @property
    def in_use_bytes(self) -> int:
        """Bytes of blocks handed out and not yet released."""
        return sum(s.used_bytes for s in self._slabs)

    def ram_room_bytes(self) -> int:
        """Host RAM the arena may still take: available now minus the reserve."""
        available, total = self._host.ram()
        return available - self._host.ram_reserve(total)

    def _room_bytes(self) -> int:
        room = self.ram_room_bytes()
        if self._cap_bytes is not None:
            room = min(room, self._cap_bytes - self.held_bytes)
        return room

    def acquire(self, nbytes: int) -> Optional[Block]:
        """A block of at least ``nbytes``, or None if neither the slabs nor the cap have room."""
        size = round_up(max(nbytes, 1))
        for slab in self._slabs:
            offset = slab.ranges.take(size)
            if offset is not None:
                return Block(slab.view(offset, size), slab, offset, size)
        new = self._new_slab(size)
        if new is None:
            return None
        offset = new.ranges.take(size)
        assert offset is not None, "offload internal error: a new slab has no room for the block it was made for"
        return Block(new.view(offset, size), new, offset, size)

    def acquire_all(self, sizes: list[int]) -> Optional[list[Block]]:
        """A block for each of ``sizes`` (a batch's copies out), each taken as ``acquire`` takes one
        (first fit over the slabs, a new slab as for one block), or None, with nothing kept, if
        any one cannot be had. Not one range for the batch: the copy call copies tensor by tensor
        anyway, and a range the size of a batch would pin slabs of that size (beside the ones
        already there) and, when its pinning failed, stop the arena growing for good."""
        blocks: list[Block] = []
        for nbytes in sizes:
            block = self.acquire(nbytes)
            if block is None:
                for taken in blocks:
                    self.release(taken)
                return None
            blocks.append(block)
        return blocks

    def _new_slab(self, size: int) -> Optional[_Slab]:
        if self.failed:
            return None
        wanted = max(SLAB_BYTES, _next_pow2(size))
        smallest = _next_pow2(size)
        if self._shared is not None:  # already pinned: only the cap limits it
            for nbytes in (wanted, smallest):
                fits = self._cap_bytes is None or self.held_bytes + nbytes <= self._cap_bytes
                tensor = self._shared.take(nbytes) if fits else None
                if tensor is not None:
                    return self._add(tensor)
        if self._room_bytes() < wanted:
            self.unreturned_bytes += self._drop_idle()  # See Note: [emptying the pinned cache]
        room = self._room_bytes()
        if room < smallest:
            if not self._warned_low_ram and self.ram_room_bytes() < smallest:  # RAM, not the user's cap
                log.warning(
                    "offload: host RAM is low (the host tier keeps %d MB free for the system); "
                    "it stops at %d MB and further tensors spill to disk or stay on the device",
                    self._host.ram_reserve(self._host.ram()[1]) >> 20,
                    self.held_bytes >> 20,
                )
                self._warned_low_ram = True
            return None
        nbytes = wanted if room >= wanted else smallest
        try:
            tensor = self._host.allocate(nbytes, self._pin)
        except RuntimeError as e:  # pinning refused (locked-memory limit, driver)
            # The message, not the error: a record kept by a handler would keep the error's
            # traceback, whose frames (pack, the module forwards) hold this step's graph.
            log.warning(
                "offload: pinning %d bytes of host memory failed (%s); no more host memory is taken, so "
                "further tensors go to disk through what is held, or stay on the device",
                nbytes,
                str(e),
            )
            self.failed = True
            return None
        return self._add(tensor)

    def _add(self, tensor: torch.Tensor) -> _Slab:
        slab = _Slab(tensor)
        self._slabs.append(slab)
        return slab

    def pageable(self, nbytes: int) -> torch.Tensor:
        """Host memory outside the arena and its cap, not pinned (a last resort of the caller's)."""
        return self._host.pageable(nbytes)

    def release(self, block: Block) -> None:
        """Give a block back; its slab stays for reuse until ``trim`` or ``clear``."""
        block.slab.ranges.give(block.offset, block.size)

    def _drop_idle(self) -> int:
        """Drop every slab with nothing handed out (to the ``PinnedSlabs`` this arena shares, if
        any); returns the pinned bytes dropped that only torch's cache holds now."""
        idle = [s for s in self._slabs if s.used_bytes == 0]
        if not idle:
            return 0
        self._slabs = [s for s in self._slabs if s.used_bytes != 0]
        cached = 0
        for slab in idle:
            if self._shared is not None and slab.tensor is not None:
                self._shared.give(slab.tensor, self._pin)
            elif self._pin:
                cached += slab.nbytes
            slab.tensor = None
        return cached

    def return_unpinned(self) -> None:
        """Give the pinned pages of slabs dropped earlier back to the OS. Synchronizes the device:
        call it outside the hot path (See Note: [emptying the pinned cache])."""
        if self.unreturned_bytes:
            # The caching host allocator frees a block only once the events recorded on it (by the
            # copies that used it) have completed: wait for those copies, or the pages would stay
            # pinned while no longer counted.
            self._settle()
            self._host.return_pinned()
            self.unreturned_bytes = 0

    def trim(self) -> None:
        """Drop every slab with nothing handed out, and give their pinned pages back to the OS (or
        the idle slabs to the ``PinnedSlabs`` this arena shares). Synchronizes the device."""
        self.unreturned_bytes += self._drop_idle()
        self.return_unpinned()

    def clear(self) -> None:
        """Drop idle slabs (blocks still handed out keep theirs until released and trimmed)."""
        self.trim()
