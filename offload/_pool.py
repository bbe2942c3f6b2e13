"""Pinned host buffers, allocated once and reused, under a byte cap.

Pinning is slow (milliseconds per call, and it can synchronize the device), so the engine never
pins on the hot path: it asks this pool for a buffer of at least n bytes and gives it back when the
tensor it held is gone. Buffers come in size classes (four per power of two, so at most 25% is
wasted) and are kept on free lists between steps.

The cap is the smaller of ``host_budget_bytes`` and what the host can spare now: available RAM
(psutil) minus a reserve, so the pool never pushes the host into swap or the OOM killer. When a
new buffer would break the cap, idle buffers of other sizes are freed first; if that is not
enough, ``acquire`` returns None and the caller spills to disk instead.
"""

from __future__ import annotations

import logging
from typing import Optional

import psutil
import torch

__all__ = ["PinnedPool", "size_class"]

log = logging.getLogger(__name__)

HOST_RESERVE_FRACTION = 0.10
"""Share of total RAM the pool always leaves free for the rest of the process and the OS."""
HOST_RESERVE_MIN_BYTES = 2 << 30
"""Floor of that reserve: at least 2 GiB stay free, whatever the machine."""
MIN_CLASS_BYTES = 1 << 16
"""Smallest buffer handed out (64 KiB): smaller requests round up so free lists stay short."""


def _reserve_bytes(total_bytes: int) -> int:
    return max(int(total_bytes * HOST_RESERVE_FRACTION), HOST_RESERVE_MIN_BYTES)


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its size class: 4 classes per power of two, at least 64 KiB."""
    if nbytes <= MIN_CLASS_BYTES:
        return MIN_CLASS_BYTES
    step = 1 << max(nbytes.bit_length() - 3, 0)
    return -(-nbytes // step) * step


class PinnedPool:
    """Reusable pinned uint8 host buffers; not thread-safe (the engine's lock guards it)."""

    def __init__(self, cap_bytes: Optional[int], pin: bool = True) -> None:
        self._cap_bytes = cap_bytes
        self._pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self.held_bytes = 0
        """Bytes of every buffer the pool owns, in use or idle."""
        self.failed = False
        """True once pinning failed: later requests go straight to disk."""
        self._warned_low_ram = False

    @staticmethod
    def ram_room_bytes() -> int:
        """Host RAM the pool may still take: available now (psutil) minus the reserve."""
        vm = psutil.virtual_memory()
        return vm.available - _reserve_bytes(vm.total)

    def _room_bytes(self) -> int:
        room = self.ram_room_bytes()
        if self._cap_bytes is not None:
            room = min(room, self._cap_bytes - self.held_bytes)
        return room

    def _trim(self, need: int) -> None:
        """Free idle buffers until ``need`` more bytes fit under the cap, largest first."""
        for cls in sorted(self._free, reverse=True):
            bucket = self._free[cls]
            while bucket and self._room_bytes() < need:
                bucket.pop()
                self.held_bytes -= cls
            if not bucket:
                del self._free[cls]
            if self._room_bytes() >= need:
                return

    def acquire(self, nbytes: int) -> Optional[torch.Tensor]:
        """A host buffer of at least ``nbytes`` (a 1-D uint8 tensor), or None if the cap forbids it."""
        cls = size_class(nbytes)
        bucket = self._free.get(cls)
        if bucket:
            return bucket.pop()
        if self.failed:
            return None
        if self._room_bytes() < cls:
            self._trim(cls)
            if self._room_bytes() < cls:
                if not self._warned_low_ram and self.ram_room_bytes() < cls:  # RAM, not the user's cap
                    log.warning(
                        "offload: host RAM is low (the pinned pool keeps %d MB free for the system); "
                        "the pool stops at %d MB and further tensors spill to disk",
                        _reserve_bytes(psutil.virtual_memory().total) >> 20,
                        self.held_bytes >> 20,
                    )
                    self._warned_low_ram = True
                return None
        try:
            buf = torch.empty(cls, dtype=torch.uint8, pin_memory=self._pin)
        except RuntimeError as e:  # pinning refused (locked-memory limit, driver): fall back to disk
            # The message, not the error: a record kept by a handler would keep the error's
            # traceback, whose frames (pack, the module forwards) hold this step's graph.
            log.warning("offload: pinning a %d-byte host buffer failed (%s); spilling to disk instead", cls, str(e))
            self.failed = True
            return None
        self.held_bytes += cls
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give a buffer back for reuse."""
        self._free.setdefault(buf.numel(), []).append(buf)

    def clear(self) -> None:
        """Drop every idle buffer (buffers still in use are freed when their holders let go)."""
        for cls, bucket in self._free.items():
            self.held_bytes -= cls * len(bucket)
        self._free.clear()
