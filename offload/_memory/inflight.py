"""Copies in flight: how each one starts, lands or fails, and what the entry becomes then.

Three kinds, each in its own container of ``residency`` (which moves the entry)::

    leaving    device ─▶ first tier below   lands: AWAY (original freed), or LOADED if backward
                                           reached it meanwhile;  fails (a spill write): KEPT
    demoting   host ─▶ disk                lands: the host copy of an AWAY entry is freed;
                                           fails: the host copy stays, offered for room again
    climbing   disk ─▶ host ─▶ device      each hop starts when the one below is ready; a failed
                                           read stays until its unpack raises (``forget_load``)

A write still in flight when its entry is released becomes an orphan, settled here too. Nothing
here decides *when* to move (that is the budget's, in ``store``); ``poll`` never blocks.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from .._errors import OffloadError
from .._stats import Counters, record
from .entry import Copy, CopyState, Entry, Residence, Tier
from .pending import FINISHED
from .residency import Orphan, Residency

__all__ = ["InFlight", "wait_quietly"]

# See Note: [enum members as module globals] in ``entry``
_LEAVING, _AWAY, _LOADED, _KEPT = Residence.LEAVING, Residence.AWAY, Residence.LOADED, Residence.KEPT
_DEVICE, _HOST, _DISK = Tier.DEVICE, Tier.HOST, Tier.DISK
_FILLING, _READY = CopyState.FILLING, CopyState.READY


class InFlight:
    """Starts and settles one store's copies between its tiers (called under the store's lock)."""

    def __init__(self, residency: Residency, tiers: list, counters: Counters, warn: Callable[..., None]) -> None:
        self.res = residency
        self._warn = warn
        """The store's ``log.warning``: what goes wrong here (a spill write failing, tensors kept
        over the budget) the store tells its users, under its logger's name."""
        self.tiers = tiers
        self.counters = counters
        self._tier = {t.tier: t for t in tiers}
        self._above = {lower.tier: upper for upper, lower in zip(tiers, tiers[1:], strict=False)}
        self.top = tiers[0]
        self.out = tiers[1]
        """Where eviction sends a hot entry."""
        self.write_failed = False
        self._kept_warned = False

    # ------------------------------------------------------------------ out of the device

    def evict(self, e: Entry) -> None:
        """Start moving a hot entry off the device; its bytes stay resident until the copy lands."""
        with record("offload::d2h" if self.out.tier is _HOST else "offload::spill"):
            copy = self.out.start_out(e.device_copy(), e.nbytes)
        if copy is None:
            copy = self._make_host_room_for(e)
        if copy is None:
            self._keep(e)
            return
        e.copies[copy.tier] = copy
        self.res.move(e, _LEAVING)
        self.counters.offloaded_bytes += e.nbytes
        if copy.tier is _DISK:
            self.counters.spilled_bytes += e.nbytes

    def evict_all(self, batch: list[Entry]) -> None:
        """``evict`` each hot entry of ``batch``, oldest first: into the host tier as one batch where
        it has one range for them all (one copy call), else one by one (making room as ``evict``
        does). See Note: [moves in batches] in ``store``."""
        if len(batch) > 1 and self.out.tier is _HOST:
            with record("offload::d2h"):
                copies = self.out.start_out_all([e.device_copy() for e in batch], [e.nbytes for e in batch])
            if copies is not None:
                for e, copy in zip(batch, copies, strict=True):
                    e.copies[_HOST] = copy
                    self.res.move(e, _LEAVING)
                    self.counters.offloaded_bytes += e.nbytes
                return
        for e in batch:
            self.evict(e)

    def _make_host_room_for(self, e: Entry) -> Optional[Copy]:
        """The host tier is full: free host copies that are also on disk, spill the oldest others
        to disk, and wait for those writes, until ``e`` fits or nothing more can be done."""
        if self.out.tier is not _HOST:
            return None
        res = self.res
        tries = len(res.host_lru)  # each tried once: a failed write puts its entry back
        while tries > 0 and res.host_lru:
            tries -= 1
            self.free_host_copy_or_demote(next(iter(res.host_lru.values())))
            self.poll()
            copy = self.out.start_out(e.device_copy(), e.nbytes)
            if copy is None and res.demoting:
                wait_quietly(res.demoting[0].copies[_DISK])
                self.poll()
                copy = self.out.start_out(e.device_copy(), e.nbytes)
            if copy is not None:
                return copy
        while res.demoting:  # writes started earlier free host room as they land
            wait_quietly(res.demoting[0].copies[_DISK])
            self.poll()
            copy = self.out.start_out(e.device_copy(), e.nbytes)
            if copy is not None:
                return copy
        return None

    def free_host_copy_or_demote(self, e: Entry) -> None:
        del self.res.host_lru[e.seq]
        disk = e.copies.get(_DISK)
        if disk is not None and disk.state is _FILLING:
            return  # being demoted: the write landing frees the host copy, a failed one keeps it (_land_demotion)
        if disk is not None:  # read back from disk earlier: the host copy is a spare
            self._tier[_HOST].free(e.copies.pop(_HOST))
            return
        with record("offload::spill"):
            e.copies[_DISK] = self._tier[_DISK].start_out(e.copies[_HOST], e.nbytes)
        self.res.demoting.append(e)
        self.counters.spilled_bytes += e.nbytes

    def _keep(self, e: Entry) -> None:
        """No room below and none could be made (host tier at its cap, the disk failing): the
        tensor stays on the device, over the budget, rather than push the host toward swap or
        copy synchronously through pageable memory. It is not offered for eviction again."""
        self.res.move(e, _KEPT)
        if not self._kept_warned:
            self._warn(
                "offload: no host memory left below the device (%s); keeping saved tensors on the device "
                "over budget_mb (raise host_budget_mb or free host memory, or use a recompute policy)",
                "spill writes are failing" if self.write_failed else "host_budget_mb or host RAM reached",
            )
            self._kept_warned = True

    # ------------------------------------------------------------------ back up

    def load(self, e: Entry) -> None:
        """Start bringing a moved entry back to the device, for every handle's user of this pass."""
        e.load_gen += 1
        e.users_left = e.refs
        self.res.move(e, _LOADED)
        self.counters.reloaded_bytes += e.nbytes
        self.res.host_lru.pop(e.seq, None)
        self.climb(e)

    def give_back_loads(self, serving: Entry, limit_bytes: int) -> None:
        """The budget fell below what backward has read back ahead of its users (``budget_mb="auto"``:
        someone else took the memory since): let go of the landed loads no user has read yet, the
        ones backward needs last first, until what is resident is within ``limit_bytes`` (the budget,
        plus ``serving`` where it is counted). Each is read again when its turn comes."""
        res = self.res
        for x in sorted(res.below.values(), key=lambda x: x.seq):
            if res.resident_bytes <= limit_bytes:
                return
            device = x.device_copy()
            if (
                x is not serving
                and x.residence is _LOADED
                and x.users_left == x.refs
                and device is not None
                and not device.original
                and device.settled()  # landed: nothing in flight writes the memory that goes
            ):
                self.drop_device(x)

    def drop_device(self, e: Entry) -> None:
        """Every user of this load has its view (or the budget needs the room): the device copy goes."""
        device = e.copies.pop(_DEVICE)
        self.top.free(device)
        self.res.move(e, _AWAY)
        if device.original:
            e.let_go_handles(self.top.empty_storage)
        if _HOST in e.copies:
            self.res.host_lru[e.seq] = e

    def climb(self, e: Entry) -> None:
        """Start the next hop up from the copy nearest the device, if it is ready."""
        near = e.nearest()
        if near.tier is _DEVICE:
            return
        if near.state is _FILLING:
            self.res.climbing.append(e)
            return
        above = self._above[near.tier]
        with record("offload::h2d" if near.tier is _HOST else "offload::read"):
            e.copies[above.tier] = self._tier[near.tier].start_back(near, above, e.nbytes)
        if above.tier is not _DEVICE:
            self.res.climbing.append(e)

    def reload_landing(self, e: Entry) -> Copy:
        """The device copy of a load, the current stream ordered after it: the host waits, hop by
        hop, only until the hop to the device has started (and for that hop where it blocks the host)."""
        start = time.perf_counter()
        host_waited = False
        failure: Optional[OSError] = None
        with record("offload::wait_reload"):
            try:
                while e.device_copy() is None:  # the hop to the device has not started yet
                    near = e.nearest()
                    host_waited = True
                    near.filled.wait()
                    near.state = _READY
                    self.res.stop_climbing(e)
                    self.climb(e)
                device = e.device_copy()
                assert device is not None  # the loop above ran until the hop to the device started
                host_waited = host_waited or device.filled.blocks_host
                device.filled.order_compute()  # every user's stream waits (cheap once it is done)
            except OSError as error:
                failure = error
        if failure is not None:
            # Note: [undo a failed read outside its handler]
            #     The failure's traceback holds this thread's frames, and through them the graph
            #     being unpacked. Anything raised while it is being handled takes it as its
            #     ``__context__``: a spill job that fails as ``forget_load`` asks after it (the
            #     race tests' emulated jobs run on this thread when asked) would keep that chain
            #     in a future an entry still holds, and the graph with it, past the backward. So
            #     the load is undone after the handler has ended, and only then is the error raised.
            self.forget_load(e)
            raise OffloadError(
                f"offload: reading back the saved tensor {e.describe} from the spill file failed: {failure}"
            ) from failure
        assert device is not None  # set in the try, which ended without a failure
        if device.filled.done():
            device.state = _READY  # the pending stays: See Note: [a reload used on another stream]
        if host_waited:
            self.counters.reload_wait_ms += (time.perf_counter() - start) * 1e3
        return device

    def forget_load(self, e: Entry) -> None:
        """A read back failed: undo the load, so a later unpack reads the file again.

        The entry must not keep the failed pending: raising its error here added this thread's
        frames to the error's traceback, and those frames hold the graph being unpacked, which
        holds this entry's handles. Kept, the graph, its handles and the spill file's extents
        would live until the engine closed.
        """
        device = e.copies.pop(_DEVICE, None)
        if device is not None:
            self.top.free(device)
        host = e.copies.get(_HOST)
        if host is not None and host.filled.done() and host.filled.error() is not None:  # a failed read target
            self._tier[_HOST].free(e.copies.pop(_HOST))
        for copy in e.copies.values():  # the failed read was their reader: let its error go too
            if copy.readers.done():
                copy.readers = FINISHED
        self.res.stop_climbing(e)
        self.res.move(e, _AWAY)
        e.users_left = 0
        self.counters.reloaded_bytes -= e.nbytes

    # ------------------------------------------------------------------ completion

    def poll(self) -> None:
        """Retire every copy that has completed; never blocks."""
        for tier in self.tiers:
            tier.poll()
        res = self.res
        out = self.out.tier
        while res.leaving and res.leaving[0].copies[out].filled.done():
            self._land_out(res.leaving[0])
        while res.demoting and res.demoting[0].copies[_DISK].filled.done():
            self._land_demotion(res.demoting.popleft())
        if res.orphans:
            res.orphans = [orphan for orphan in res.orphans if not self._settle_orphan(orphan)]
        if res.climbing:
            climbing, res.climbing = res.climbing, []
            for e in climbing:
                near = e.nearest()
                if near.tier is not _DEVICE and near.filled.done() and near.filled.error() is None:
                    near.state = _READY
                    self.climb(e)
                elif near.tier is not _DEVICE:
                    res.climbing.append(e)  # still in flight, or failed: its unpack raises

    def _land_out(self, e: Entry) -> None:
        """The copy out of the device finished: the original goes, unless backward is using it."""
        copy = e.copies[self.out.tier]
        error = copy.filled.error()
        if error is not None:  # a spill write of the original: keep the tensor rather than lose it
            self._tier[_DISK].free(e.copies.pop(_DISK))
            self.counters.offloaded_bytes -= e.nbytes  # nothing left the device, nothing was written
            self.counters.spilled_bytes -= e.nbytes
            self.res.move(e, _KEPT)
            self._note_write_failure(error)
            return
        copy.state = _READY
        if e.users_left > 0:  # backward reached it while it was leaving: the original serves them
            self.res.move(e, _LOADED)
        else:
            self.top.free(e.copies.pop(_DEVICE))
            self.res.move(e, _AWAY)
            e.let_go_handles(self.top.empty_storage)
        if copy.tier is _HOST:
            self.res.host_lru[e.seq] = e

    def _land_demotion(self, e: Entry) -> None:
        disk = e.copies[_DISK]
        error = disk.filled.error()
        if error is not None:
            self._tier[_DISK].free(e.copies.pop(_DISK))
            self.counters.spilled_bytes -= e.nbytes
            self.res.host_lru[e.seq] = e  # the host copy is still good; keep it there
            self._note_write_failure(error)
            return
        disk.state = _READY
        host = e.copies.get(_HOST)
        if host is not None and e.residence is _AWAY:
            self._tier[_HOST].free(e.copies.pop(_HOST))

    def adopt_orphans(self, e: Entry) -> None:
        """``e`` is being released: its spill writes in flight are kept to learn how they end."""
        if e.residence is _LEAVING:
            copy = e.copies[self.out.tier]
            if copy.tier is _DISK:  # counted when it started and not looked at since: a failure must come out
                self.res.orphans.append(Orphan(copy, e.nbytes, left_device=True))
        if e in self.res.demoting:
            self.res.orphans.append(Orphan(e.copies[_DISK], e.nbytes, left_device=False))

    def _settle_orphan(self, orphan: Orphan) -> bool:
        """An orphan's copy has landed (True) or not yet (False). One that failed moved nothing and
        wrote nothing: it leaves the counters, as a failed write of a live entry does."""
        if not orphan.copy.filled.done():
            return False
        error = orphan.copy.filled.error()
        if error is not None:
            if orphan.left_device:
                self.counters.offloaded_bytes -= orphan.nbytes
            if orphan.copy.tier is _DISK:
                self.counters.spilled_bytes -= orphan.nbytes
            self._note_write_failure(error)
        return True

    def _note_write_failure(self, error: BaseException) -> None:
        if not self.write_failed:
            self._warn("offload: writing to the spill file failed (%s); keeping tensors in memory instead", error)
        self.write_failed = True
        # The future keeps this error, and waiting on it (in pack) added pack's frames to its
        # traceback: the saved tensor and its handle would stay alive in that cycle until gc.
        error.__traceback__ = None

    def wait_oldest_out(self) -> None:
        """Wait for the oldest copy out of the device to land (or fail), then poll: it settles."""
        wait_quietly(self.res.leaving[0].copies[self.out.tier])
        self.poll()

    def wait_all(self) -> None:
        """Wait for every copy in flight (close): each settles at the next ``poll``."""
        res = self.res
        for e in list(res.leaving):
            wait_quietly(e.copies[self.out.tier])
        for e in res.climbing:  # reads to the host land there; no copy up starts now
            wait_quietly(e.nearest())
        for e in res.demoting:
            wait_quietly(e.copies[_DISK])
        for orphan in res.orphans:  # settled by the poll after this, so the counters are final
            wait_quietly(orphan.copy)
        res.climbing = []


def wait_quietly(copy: Copy) -> None:
    try:
        copy.filled.wait()
    except OSError:
        pass  # a failed write is handled where it is landed (InFlight.poll)
