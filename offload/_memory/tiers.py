"""The tiers below the budget, behind one small interface the store sequences.

    DeviceTier ──start_out──▶ HostTier (CUDA: pinned arena + link) ──start_out──▶ DiskTier (spill file)
               ◀─start_back──                                      ◀─start_back──
    CPU device:  DeviceTier ──start_out──▶ DiskTier                 (host memory *is* the device)

Every tier below the device has the same four verbs:

- ``start_out(src, nbytes)``: start copying ``nbytes`` of ``src`` (a ready copy in the tier above)
  into this tier; returns the new copy (FILLING), or None when this tier has no room. The copy is
  added to ``src.readers``, so ``src`` stays alive until it has landed (See Note: [keep-alive until
  the copy event] in ``transfer``).
- ``start_back(copy, above, nbytes)``: start copying this tier's ready ``copy`` into a new copy in
  the tier ``above``; returns it (FILLING). It is added to ``copy.readers`` likewise.
- ``free(copy)``: the store no longer needs the copy; its memory goes back once nothing in flight
  writes or reads it (``Copy.settled``), which ``poll`` checks for the ones that had to wait.
- ``poll()``: finish the frees that waited.

The device tier is the top: it only allocates destinations (``alloc``) and frees.
Which tiers exist is decided once, in ``make_tiers``; the store never asks which device it runs on.
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch

from .arena import Block, HostArena
from .entry import Copy, CopyState, Tier
from .host import Host
from .pending import FINISHED
from .spill import SpillFile
from .transfer import CudaLink, Link

__all__ = ["DeviceTier", "DiskTier", "HostTier", "make_tiers"]

log = logging.getLogger(__name__)


def as_bytes(data: Union[torch.UntypedStorage, Block, torch.Tensor]) -> torch.Tensor:
    """A device or host copy's memory as a 1-D uint8 tensor: the original is kept as its
    UntypedStorage, a host copy as an arena ``Block`` (or a pageable tensor)."""
    if isinstance(data, torch.UntypedStorage):
        # Note: [a view is no write]
        #     This view touches no data, but a dispatch mode sees ``set_`` return its storage as
        #     written, on the current stream: to PyTorch's CUDA sanitizer that is a write racing a
        #     copy in flight on a side stream (a second copy out started in one batch, after its
        #     fence; a stats reading while the copy runs). So the view is made out of their sight.
        with torch._C._DisableTorchDispatch():
            return torch.empty(0, dtype=torch.uint8, device=data.device).set_(data)
    if isinstance(data, Block):
        return data.tensor
    return data


class _Tier:
    """What every tier shares: frees deferred until their copy has settled."""

    tier: Tier

    def __init__(self) -> None:
        self._waiting: list[Copy] = []

    def free(self, copy: Copy) -> None:
        if copy.settled():
            self._release(copy)
        else:
            self._waiting.append(copy)

    def poll(self) -> None:
        if self._waiting:
            still = []
            for copy in self._waiting:
                if copy.settled():
                    self._release(copy)
                else:
                    still.append(copy)
            self._waiting = still

    def drain(self) -> None:
        """Wait for every deferred free (close)."""
        for copy in self._waiting:
            for pending in (copy.filled, copy.readers):
                try:
                    pending.wait()
                except OSError:
                    pass
            self._release(copy)
        self._waiting = []

    def _release(self, copy: Copy) -> None:
        raise NotImplementedError


class DeviceTier(_Tier):
    """The compute device: where saved tensors start and come back to."""

    tier = Tier.DEVICE

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.empty_storage = torch.empty(0, dtype=torch.uint8, device=device).untyped_storage()
        """A storage of no bytes on the device: every handle's version watch points at it (See
        Note: [version watch] in ``entry``), so letting go of an original allocates nothing."""

    @property
    def waiting_bytes(self) -> int:
        """Device bytes freed by the store but still read or written by a copy in flight (a reading:
        copies that have settled since the last ``poll`` no longer count)."""
        return sum(as_bytes(c.data).numel() for c in self._waiting if not c.settled())

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A destination for a read from below, on the current stream. See Note: [reload destination
        on the compute stream]."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _release(self, copy: Copy) -> None:
        copy.data, copy.filled = None, FINISHED  # See Note: [a pending does not hold its destination]


class HostTier(_Tier):
    """Host memory below a CUDA device (pinned, from the arena), reached over a link."""

    tier = Tier.HOST

    def __init__(self, arena: HostArena, link: Link) -> None:
        super().__init__()
        self.arena = arena
        self.link = link
        self._warned_pageable = False

    def start_out(self, src: Copy, nbytes: int) -> Optional[Copy]:
        block = self.arena.acquire(nbytes)
        if block is None:
            return None
        filled = self.link.d2h(as_bytes(src.data)[:nbytes], block.tensor)
        src.add_reader(filled)  # See Note: [keep-alive until the copy event]
        return Copy(Tier.HOST, block, CopyState.FILLING, filled)

    def start_out_all(self, srcs: list[Copy], sizes: list[int]) -> Optional[list[Copy]]:
        """``start_out`` for a batch: a block per source, all filled by one copy call where the
        link has one (``d2h_all``: on CUDA one fence set and one event for the batch), or None,
        with nothing taken, when the arena cannot give every block (the caller moves them one
        by one, making room below as it goes)."""
        blocks = self.arena.acquire_all(sizes)
        if blocks is None:
            return None
        sources = [as_bytes(src.data)[:n] for src, n in zip(srcs, sizes, strict=True)]
        d2h_all = getattr(self.link, "d2h_all", None)
        if d2h_all is not None:
            filled = d2h_all(sources, [b.tensor for b in blocks])
            fills = [filled] * len(blocks)
        else:  # a link that copies one tensor a call (a test's, or an older seam)
            fills = [self.link.d2h(source, b.tensor) for source, b in zip(sources, blocks, strict=True)]
        copies = []
        for src, block, pending in zip(srcs, blocks, fills, strict=True):
            src.add_reader(pending)  # See Note: [keep-alive until the copy event]
            copies.append(Copy(Tier.HOST, block, CopyState.FILLING, pending))
        return copies

    def start_back(self, copy: Copy, above: DeviceTier, nbytes: int) -> Copy:
        dst, filled = self.link.h2d(as_bytes(copy.data), nbytes)
        copy.add_reader(filled)  # See Note: [keep-alive until the copy event]: the host block too
        return Copy(Tier.DEVICE, dst, CopyState.FILLING, filled)

    def alloc(self, nbytes: int) -> Union[Block, torch.Tensor]:
        """A destination for a read from disk: a block, or pageable memory when the arena is full."""
        block = self.arena.acquire(nbytes)
        if block is not None:
            return block
        if not self._warned_pageable:
            log.warning(
                "offload: no pinned host memory left for a read back from disk; using pageable memory "
                "(its copy to the device is slower); raise host_budget_mb to avoid this"
            )
            self._warned_pageable = True
        return self.arena.pageable(nbytes)

    @property
    def in_use_bytes(self) -> int:
        """Arena bytes holding copies the store still needs, or that a copy in flight still uses
        (a reading: blocks whose copies have settled since the last ``poll`` no longer count)."""
        return self.arena.in_use_bytes - sum(
            c.data.size for c in self._waiting if isinstance(c.data, Block) and c.settled()
        )

    def _release(self, copy: Copy) -> None:
        data = copy.data
        copy.data = None
        if isinstance(data, torch.Tensor):  # pageable fallback
            return
        self.link.released(data.tensor)
        self.arena.release(data)


class DiskTier(_Tier):
    """Extents of the engine's spill file, written from and read into host memory."""

    tier = Tier.DISK

    def __init__(self, spill: SpillFile) -> None:
        super().__init__()
        self.spill = spill

    def start_out(self, src: Copy, nbytes: int) -> Copy:
        extent, filled = self.spill.write(as_bytes(src.data)[:nbytes])
        src.add_reader(filled)  # See Note: [keep-alive until the copy event]
        return Copy(Tier.DISK, extent, CopyState.FILLING, filled)

    def start_back(self, copy: Copy, above: Union[DeviceTier, HostTier], nbytes: int) -> Copy:
        dst = above.alloc(nbytes)
        filled = self.spill.read(copy.data, as_bytes(dst)[:nbytes])
        copy.add_reader(filled)
        return Copy(above.tier, dst, CopyState.FILLING, filled)

    @property
    def used_bytes(self) -> int:
        """Spill-file bytes holding copies the store still needs, or that a write or read in flight
        still uses (a reading: extents whose I/O has settled since the last ``poll`` no longer count)."""
        return self.spill.used_bytes - sum(c.data.size for c in self._waiting if c.settled())

    def _release(self, copy: Copy) -> None:
        self.spill.free(copy.data)
        copy.data = None


def make_tiers(
    device: torch.device, host_budget_bytes: Optional[int], spill: SpillFile, link: Optional[Link], host: Host
) -> list:
    """The tiers for one engine, hottest first. A host tier sits between the device and the disk
    when there is a link: CUDA side streams on a CUDA device, or the link a test passes."""
    tiers: list = [DeviceTier(device)]
    if link is None and device.type == "cuda":
        link = CudaLink(device)
    if link is not None:
        shared = link.slabs if isinstance(link, CudaLink) else None  # pinned slabs shared with other engines
        arena = HostArena(
            host_budget_bytes, pin=device.type == "cuda", settle=link.synchronize, shared=shared, host=host
        )
        tiers.append(HostTier(arena, link))
    tiers.append(DiskTier(spill))
    return tiers
