"""The store: where each saved storage lives, and the budget that decides it.

Owns the entries (one per distinct saved storage), the device byte accounting, eviction in
forward, prefetch and reload in backward, and release when autograd lets go. It sequences the
tiers (``_tiers``) and never asks which device it runs on; which tensors are eligible is
``_hooks``' business, and what each copy is, ``_entry``'s.

Tiers, hottest first (``make_tiers``)::

    device (<= budget) ──evict oldest──▶ host (CUDA: pinned) ──host cap: oldest host copies──▶ disk
    device (CPU)       ──evict oldest──────────────────────────────────────────────────────▶ disk

Forward (pack)::

    save t ─▶ entry HOT ─▶ hot bytes > budget·(1-window)?  evict oldest: HOT ─▶ LEAVING (copy below fills)
                        ─▶ resident > budget?              wait for the oldest copy out to land

Backward (unpack of entry k)::

    k HOT/KEPT ─▶ the live tensor ─────────────────────────────┐
    k LEAVING/LOADED ─▶ hit;  k AWAY ─▶ miss: load k now ───────┴─▶ prefetch k-1, k-2, ... while they fit
                                                                  ─▶ wait for k's copy at the point of use
                                                                  ─▶ view; after k's last user: drop it

Invariants:
- ``resident_bytes`` counts every device byte the engine holds: HOT, LEAVING (the source of a copy in
  flight, See Note: [keep-alive until the copy event]), LOADED and KEPT entries, and device copies
  freed while something in flight still reads or writes them.
- An entry's data is read back only from a copy that is READY (or, while LEAVING, from the original).
- A moved storage comes back once per backward: a device copy is dropped after the last user of
  its load, never for the budget's sake (a later user would read it again).
- Everything an entry holds is released when its last handle dies, whether or not backward ran.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Optional

import torch

from ._budget import FollowFree, FreeMemory, default_free_memory
from ._config import Config
from ._entry import ORIGINAL_IS_DATA, Copy, CopyState, Entry, Handle, Residence, Tier
from ._errors import OffloadError, inplace_error
from ._pending import FINISHED
from ._spill import SpillFile
from ._stats import Counters, record
from ._tiers import HostTier, as_bytes, make_tiers
from ._transfer import Link

__all__ = ["Handle", "Store"]

log = logging.getLogger(__name__)

INFLIGHT_FRACTION = 0.25
"""Share of the budget reserved for copies in flight. Eviction starts when hot bytes pass
(1 - this) x budget, so copies drain while compute goes on; pack blocks only at the full budget.
Not while a region plan is in force (``set_planned``): the plan already keeps its regions within
the budget and starts the copies of its offloaded regions at once, so early eviction would only
move tensors the plan keeps (measured: up to a quarter of the budget spilled for nothing).
A budget that follows free memory has its own window (``_budget.INFLIGHT_FRACTION_OF_RESERVE``)."""


class Store:
    """Entries, tiers and the budget for one engine on its compute device."""

    def __init__(
        self,
        config: Config,
        device: torch.device,
        counters: Counters,
        link: Optional[Link] = None,
        memory: Optional[FreeMemory] = None,
    ) -> None:
        self.config = config
        self.device = device
        self.counters = counters
        self.budget = config.budget_bytes
        """The budget in force, bytes: ``budget_mb``, or with "auto" the latest reading's (None: no limit)."""
        self.evict_at: Optional[int] = None
        self._follow: Optional[FollowFree] = None
        if config.reserve_bytes is not None:  # budget_mb="auto"
            self._follow = FollowFree(config.reserve_bytes, memory or default_free_memory(device))
        self._planned = False
        self.spill = SpillFile(config.spill_dir, config.spill_workers)
        self.tiers = make_tiers(device, config.host_budget_bytes, self.spill, link)
        self._tier = {t.tier: t for t in self.tiers}
        self._above = {lower.tier: upper for upper, lower in zip(self.tiers, self.tiers[1:], strict=False)}
        self._top = self.tiers[0]
        self._out = self.tiers[1]  # where eviction sends a hot entry
        host = self._tier.get(Tier.HOST)
        self.link: Optional[Link] = host.link if isinstance(host, HostTier) else None
        self._lock = threading.Lock()
        self._dead: collections.deque = collections.deque()  # (entry, unseen) released while locked
        self._by_key: dict[int, Entry] = {}
        self._hot: dict[int, Entry] = {}  # seq -> HOT entries, save order (oldest first)
        self._kept: dict[int, Entry] = {}  # seq -> KEPT entries
        self._leaving: collections.deque = collections.deque()  # LEAVING entries, eviction order
        self._away: dict[int, Entry] = {}  # seq -> entries with a copy below, save order
        self._host_lru: dict[int, Entry] = {}  # seq -> AWAY entries with an idle host copy (room to make)
        self._demoting: collections.deque = collections.deque()  # host copies being written to disk
        self._climbing: list[Entry] = []  # loads still on an intermediate tier (disk -> host)
        self._orphans: list[_Orphan] = []  # spill writes in flight when their entry was released
        self._held: Optional[Entry] = None  # See Note: [held for the next user]
        self._seq = 0
        self._hot_bytes = 0
        self._loaded_bytes = 0
        self._resident_bytes = 0
        self.peak_resident_bytes = 0
        self.peak_over_budget_bytes = 0
        self._write_failed = False
        self._kept_warned = False
        self.set_planned(False)
        if self._follow is not None:
            self._read_free()

    def set_planned(self, planned: bool) -> None:
        """Evict at the full budget (a region plan is in force) or keep the in-flight window."""
        self._planned = planned
        if self.budget is None:
            return
        if planned:
            self.evict_at = self.budget
        elif self._follow is not None:
            self.evict_at = self._follow.evict_at
        else:
            self.evict_at = int(self.budget * (1 - INFLIGHT_FRACTION))

    # ------------------------------------------------------------------ a budget that follows free memory

    @property
    def free_readings(self) -> int:
        """How often free memory was read (0 with a fixed budget)."""
        return 0 if self._follow is None else self._follow.readings

    def read_free(self) -> None:
        """Read free memory now (the engine calls this as a step starts); nothing with a fixed budget."""
        if self._follow is not None:
            with self._lock:
                self._read_free()

    def _read_free(self) -> None:
        assert self._follow is not None  # called only with budget_mb="auto"
        self.budget = self._follow.read(self.resident_bytes)
        self.set_planned(self._planned)

    def _maybe_read_free(self, nbytes: int) -> None:
        """Count ``nbytes`` saved or loaded; read free memory when the rule says (``_budget``)."""
        if self._follow is not None and self._follow.due(nbytes):
            self._read_free()

    # ------------------------------------------------------------------ readings (change nothing)

    @property
    def resident_bytes(self) -> int:
        """Device bytes the engine holds now (see the invariants)."""
        return self._resident_bytes + self._top.waiting_bytes

    @property
    def host_bytes(self) -> int:
        """Host bytes the host tier really holds (pinned slabs), 0 without one."""
        host = self._tier.get(Tier.HOST)
        return host.arena.held_bytes if isinstance(host, HostTier) else 0

    @property
    def host_in_use_bytes(self) -> int:
        host = self._tier.get(Tier.HOST)
        return host.in_use_bytes if isinstance(host, HostTier) else 0

    @property
    def spill_files(self) -> int:
        return self.spill.files

    @property
    def spill_bytes(self) -> int:
        """Bytes of spill-file extents holding copies now."""
        return self._tier[Tier.DISK].used_bytes

    def copy_ms(self) -> tuple[float, float, float]:
        """(d2h busy, h2d busy, compute stall) in ms from the link; zeros without one."""
        if self.link is None:
            return 0.0, 0.0, 0.0
        with self._lock:  # the link's event lists change under pack and unpack
            return self.link.busy_ms()

    def reset_peak(self) -> None:
        self.peak_resident_bytes = self.resident_bytes
        self.peak_over_budget_bytes = 0

    def _note_peak(self, in_use: Optional[Entry] = None) -> None:
        """Record the peak where the budget holds: after pack and after unpack.

        Inside pack the new tensor is briefly counted before eviction reacts; it exists on the
        device with or without the engine, so that instant is not the engine's residency. After
        an unpack, the tensor autograd is using now is not counted either: a copy held for its
        next user over the budget (See Note: [held for the next user]), or ``in_use``, a leaving
        entry whose original served the unpack while its copy out is still on its way (the
        budget fell after its pack: under ``budget_mb="auto"`` someone else took the memory).
        """
        resident = self._resident_bytes
        if self._held is not None:
            resident -= self._held.nbytes
        if in_use is not None and in_use is not self._held:
            resident -= in_use.nbytes
        if resident > self.peak_resident_bytes:
            self.peak_resident_bytes = resident
        if self.budget is not None and resident - self.budget > self.peak_over_budget_bytes:
            self.peak_over_budget_bytes = resident - self.budget  # the budget in force at this instant

    def _batch(self):
        return self.link.batch() if self.link is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ forward

    def pack(self, t: torch.Tensor, eager: bool = False) -> Handle:
        """Take a saved tensor; ``eager``: start its copy out now (a region planned OFFLOAD)."""
        with self._lock:
            self._drain_dead()
            storage = t.untyped_storage()
            key = storage._cdata
            e = self._by_key.get(key)
            if e is None or not e.holds_as_saved(t if t._base is None else t._base, t._version):
                self._seq += 1
                e = Entry(self._seq, key, storage, t)
                self._by_key[key] = e
                self._hot[e.seq] = e
                self._hot_bytes += e.nbytes
                self._resident_bytes += e.nbytes
                self.counters.saved_bytes += e.nbytes
                if self._follow is not None:  # after counting it: it is allocated, not free
                    self._maybe_read_free(e.nbytes)
            elif e.users_left > 0:
                e.users_left += 1  # a save during backward (double backward) is a user of this load too
            e.refs += 1
            self.counters.saved_tensors += 1
            handle = Handle(self, e, t)
            if self.budget is not None or eager:
                with self._batch():
                    if eager and e.residence is Residence.HOT:
                        self._evict(e)
                    self._poll()
                    self._enforce_budget()
            self._drain_dead()
            self._note_peak()
            return handle

    def _enforce_budget(self) -> None:
        if self.budget is None:
            return
        assert self.evict_at is not None  # set_planned() sets it whenever there is a budget
        while self._hot and self._hot_bytes + self._loaded_bytes > self.evict_at:
            self._evict(next(iter(self._hot.values())))
        if self._resident_bytes > self.budget and self._leaving:
            start = time.perf_counter()
            with record("offload::wait_evict"):
                while self._resident_bytes > self.budget and self._leaving:
                    _wait_quietly(self._leaving[0].copies[self._out.tier])
                    self._poll()
            self.counters.evict_wait_ms += (time.perf_counter() - start) * 1e3

    def _evict(self, e: Entry) -> None:
        """Start moving a hot entry off the device; its bytes stay resident until the copy lands."""
        del self._hot[e.seq]
        self._hot_bytes -= e.nbytes
        with record("offload::d2h" if self._out.tier is Tier.HOST else "offload::spill"):
            copy = self._out.start_out(e.device_copy(), e.nbytes)
        if copy is None:
            copy = self._make_host_room_for(e)
        if copy is None:
            self._keep(e)
            return
        e.copies[copy.tier] = copy
        e.residence = Residence.LEAVING
        self._leaving.append(e)
        self.counters.offloaded_bytes += e.nbytes
        if copy.tier is Tier.DISK:
            self.counters.spilled_bytes += e.nbytes

    def _make_host_room_for(self, e: Entry) -> Optional[Copy]:
        """The host tier is full: free host copies that are also on disk, spill the oldest others
        to disk, and wait for those writes, until ``e`` fits or nothing more can be done."""
        if self._out.tier is not Tier.HOST:
            return None
        tries = len(self._host_lru)  # each tried once: a failed write puts its entry back
        while tries > 0 and self._host_lru:
            tries -= 1
            self._free_host_copy_or_demote(next(iter(self._host_lru.values())))
            self._poll()
            copy = self._out.start_out(e.device_copy(), e.nbytes)
            if copy is None and self._demoting:
                _wait_quietly(self._demoting[0].copies[Tier.DISK])
                self._poll()
                copy = self._out.start_out(e.device_copy(), e.nbytes)
            if copy is not None:
                return copy
        while self._demoting:  # writes started earlier free host room as they land
            _wait_quietly(self._demoting[0].copies[Tier.DISK])
            self._poll()
            copy = self._out.start_out(e.device_copy(), e.nbytes)
            if copy is not None:
                return copy
        return None

    def _free_host_copy_or_demote(self, e: Entry) -> None:
        del self._host_lru[e.seq]
        disk = e.copies.get(Tier.DISK)
        if disk is not None and disk.state is CopyState.FILLING:
            return  # being demoted: the write landing frees the host copy, a failed one keeps it (_land_demotion)
        if disk is not None:  # read back from disk earlier: the host copy is a spare
            self._tier[Tier.HOST].free(e.copies.pop(Tier.HOST))
            return
        with record("offload::spill"):
            e.copies[Tier.DISK] = self._tier[Tier.DISK].start_out(e.copies[Tier.HOST], e.nbytes)
        self._demoting.append(e)
        self.counters.spilled_bytes += e.nbytes

    def _keep(self, e: Entry) -> None:
        """No room below and none could be made (host tier at its cap, the disk failing): the
        tensor stays on the device, over the budget, rather than push the host toward swap or
        copy synchronously through pageable memory. It is not offered for eviction again."""
        e.residence = Residence.KEPT
        self._kept[e.seq] = e
        if not self._kept_warned:
            log.warning(
                "offload: no host memory left below the device (%s); keeping saved tensors on the device "
                "over budget_mb (raise host_budget_mb or free host memory, or use a recompute policy)",
                "spill writes are failing" if self._write_failed else "host_budget_mb or host RAM reached",
            )
            self._kept_warned = True

    # ------------------------------------------------------------------ completion

    def _poll(self) -> None:
        """Retire every copy that has completed; never blocks."""
        for tier in self.tiers:
            tier.poll()
        out = self._out.tier
        while self._leaving and self._leaving[0].copies[out].filled.done():
            self._land_out(self._leaving.popleft())
        while self._demoting and self._demoting[0].copies[Tier.DISK].filled.done():
            self._land_demotion(self._demoting.popleft())
        if self._orphans:
            self._orphans = [orphan for orphan in self._orphans if not self._settle_orphan(orphan)]
        if self._climbing:
            climbing, self._climbing = self._climbing, []
            for e in climbing:
                near = e.nearest()
                if near.tier is not Tier.DEVICE and near.filled.done() and near.filled.error() is None:
                    near.state = CopyState.READY
                    self._climb(e)
                elif near.tier is not Tier.DEVICE:
                    self._climbing.append(e)  # still in flight, or failed: its unpack raises

    def _land_out(self, e: Entry) -> None:
        """The copy out of the device finished: the original goes, unless backward is using it."""
        copy = e.copies[self._out.tier]
        error = copy.filled.error()
        if error is not None:
            self._out_failed(e, error)
            return
        copy.state = CopyState.READY
        self._away[e.seq] = e
        if copy.tier is Tier.HOST:
            self._host_lru[e.seq] = e
        if e.users_left > 0:  # backward reached it while it was leaving: the original serves them
            e.residence = Residence.LOADED
            self._loaded_bytes += e.nbytes
        else:
            self._drop_original(e)

    def _out_failed(self, e: Entry, error: BaseException) -> None:
        """A spill write of the original failed: keep the tensor on the device rather than lose it."""
        self._tier[Tier.DISK].free(e.copies.pop(Tier.DISK))
        self.counters.offloaded_bytes -= e.nbytes  # nothing left the device, nothing was written
        self.counters.spilled_bytes -= e.nbytes
        e.residence = Residence.KEPT
        self._kept[e.seq] = e
        self._note_write_failure(error)

    def _land_demotion(self, e: Entry) -> None:
        disk = e.copies[Tier.DISK]
        error = disk.filled.error()
        if error is not None:
            self._tier[Tier.DISK].free(e.copies.pop(Tier.DISK))
            self.counters.spilled_bytes -= e.nbytes
            self._host_lru[e.seq] = e  # the host copy is still good; keep it there
            self._note_write_failure(error)
            return
        disk.state = CopyState.READY
        host = e.copies.get(Tier.HOST)
        if host is not None and e.residence is Residence.AWAY:
            self._tier[Tier.HOST].free(e.copies.pop(Tier.HOST))

    def _settle_orphan(self, orphan: _Orphan) -> bool:
        """An orphan's copy has landed (True) or not yet (False). One that failed moved nothing and
        wrote nothing: it leaves the counters, as ``_out_failed`` does for a live entry."""
        if not orphan.copy.filled.done():
            return False
        error = orphan.copy.filled.error()
        if error is not None:
            if orphan.left_device:
                self.counters.offloaded_bytes -= orphan.nbytes
            if orphan.copy.tier is Tier.DISK:
                self.counters.spilled_bytes -= orphan.nbytes
            self._note_write_failure(error)
        return True

    def _note_write_failure(self, error: BaseException) -> None:
        if not self._write_failed:
            log.warning("offload: writing to the spill file failed (%s); keeping tensors in memory instead", error)
        self._write_failed = True
        # The future keeps this error, and waiting on it (in pack) added pack's frames to its
        # traceback: the saved tensor and its handle would stay alive in that cycle until gc.
        error.__traceback__ = None

    def _drop_original(self, e: Entry) -> None:
        """The entry's data is a finished copy below now; the original storage goes."""
        self._top.free(e.copies.pop(Tier.DEVICE))
        self._resident_bytes -= e.nbytes
        e.residence = Residence.AWAY
        for ref in e.handles:  # See Note: [version watch]
            h = ref()
            if h is not None:
                h.let_go()
        e.handles = []

    # ------------------------------------------------------------------ backward

    def unpack(self, h: Handle) -> torch.Tensor:
        with self._lock:
            self._drain_dead()
            e = h.entry
            if h.modified():  # See Note: [version watch]
                a = h.alias
                assert a is not None  # modified() is False without one
                raise inplace_error(a.type(), e.shape, a._version, h.version)
            if e.residence in ORIGINAL_IS_DATA:
                alias = h.alias
                assert alias is not None  # a handle lets its alias go only once the original has left
                return alias  # the live tensor itself, detached (autograd makes its own shallow copy)
            if e.residence is Residence.RELEASED:
                raise OffloadError(
                    f"offload: the saved tensor {e.describe} was released because the engine was closed; "
                    "run backward before closing the engine"
                )
            with self._batch():
                self._poll()
                self._maybe_read_free(0)
                held = self._held
                if held is not None and held is not e:
                    self._held = None
                    if (
                        held.residence is Residence.LOADED
                        and self.budget is not None
                        and self._resident_bytes > self.budget
                    ):
                        self._drop_device(held)  # its next user is not next: it reads it again
                if e.residence is Residence.AWAY:
                    self.counters.prefetch_misses += 1
                    self._load(e)
                else:
                    self.counters.prefetch_hits += 1
                    if e.users_left <= 0:  # LEAVING, first user of this pass: the original serves
                        e.load_gen += 1
                        e.users_left = e.refs
                if self.config.prefetch:
                    self._prefetch(e.seq)
                view = self._serve(e, h)
                self._drain_dead()
            self._note_peak(in_use=e if e.residence is Residence.LEAVING else None)
            return view

    def _load(self, e: Entry) -> None:
        """Start bringing a moved entry back to the device (prefetch or miss)."""
        e.load_gen += 1
        e.users_left = e.refs
        e.residence = Residence.LOADED
        self._loaded_bytes += e.nbytes
        self._resident_bytes += e.nbytes
        self.counters.reloaded_bytes += e.nbytes
        self._host_lru.pop(e.seq, None)
        self._climb(e)
        self._maybe_read_free(e.nbytes)  # after the climb allocated its device copy, if it did

    def _climb(self, e: Entry) -> None:
        """Start the next hop up from the copy nearest the device, if it is ready."""
        near = e.nearest()
        if near.tier is Tier.DEVICE:
            return
        if near.state is CopyState.FILLING:
            self._climbing.append(e)
            return
        above = self._above[near.tier]
        with record("offload::h2d" if near.tier is Tier.HOST else "offload::read"):
            e.copies[above.tier] = self._tier[near.tier].start_back(near, above, e.nbytes)
        if above.tier is not Tier.DEVICE:
            self._climbing.append(e)

    def _serve(self, e: Entry, h: Handle) -> torch.Tensor:
        """Hand ``h`` its view of the device copy, once the copy is usable on the current stream."""
        device = e.device_copy()
        if device is None or device.state is CopyState.FILLING:
            start = time.perf_counter()
            host_waited = False
            with record("offload::wait_reload"):
                try:
                    while e.device_copy() is None:  # the hop to the device has not started yet
                        near = e.nearest()
                        host_waited = True
                        near.filled.wait()
                        near.state = CopyState.READY
                        if e in self._climbing:
                            self._climbing.remove(e)
                        self._climb(e)
                    device = e.device_copy()
                    assert device is not None  # the loop above ran until the hop to the device started
                    host_waited = host_waited or device.filled.blocks_host
                    device.filled.order_compute()  # every user's stream waits (cheap once it is done)
                except OSError as error:
                    self._forget_load(e)
                    raise OffloadError(
                        f"offload: reading back the saved tensor {e.describe} from the spill file failed: {error}"
                    ) from error
            if device.filled.done():
                device.state = (
                    CopyState.READY
                )  # the pending stays: See Note: [a reload used on another stream] in _transfer
            if host_waited:
                self.counters.reload_wait_ms += (time.perf_counter() - start) * 1e3
        elif not device.original:
            device.filled.order_compute()  # See Note: [a reload used on another stream] in _transfer
        if device.original:
            assert h.alias is not None  # the original is still here: the handle has not let it go
            view = h.alias
        else:
            view = h.rebuild(as_bytes(device.data))
        if h.seen_gen != e.load_gen:
            h.seen_gen = e.load_gen
            e.users_left -= 1
            if e.users_left <= 0 and e.residence is Residence.LOADED:
                self._drop_device(e)
            elif e.residence is Residence.LOADED and self.budget is not None and self._resident_bytes > self.budget:
                self._held = e  # See Note: [held for the next user]
        return view

    # Note: [held for the next user]
    #     A storage with several users in backward (a norm output feeding two matmuls, the qkv
    #     buffer) has them one right after the other. Dropping its copy after the first user
    #     whenever the budget is tight (always at budget 0) read it back once per user: measured
    #     157 MB read for 128.7 MB moved. So a copy with users left stays after its unpack even
    #     over the budget, as the one tensor autograd is using, and goes at the start of the
    #     next unpack of another storage if the budget still needs the room; only then is it read
    #     again (its next user was not next). The peak after an unpack does not count it: those
    #     bytes are the tensor in use, held by autograd with or without the engine.

    def _forget_load(self, e: Entry) -> None:
        """A read back failed: undo the load, so a later unpack reads the file again.

        The entry must not keep the failed pending: raising its error here added this thread's
        frames to the error's traceback, and those frames hold the graph being unpacked, which
        holds this entry's handles. Kept, the graph, its handles and the spill file's extents
        would live until the engine closed.
        """
        device = e.copies.pop(Tier.DEVICE, None)
        if device is not None:
            self._top.free(device)
        host = e.copies.get(Tier.HOST)
        if host is not None and host.filled.done() and host.filled.error() is not None:  # a failed read target
            self._tier[Tier.HOST].free(e.copies.pop(Tier.HOST))
        for copy in e.copies.values():  # the failed read was their reader: let its error go too
            if copy.readers.done():
                copy.readers = FINISHED
        if e in self._climbing:
            self._climbing.remove(e)
        e.residence = Residence.AWAY
        e.users_left = 0
        self._loaded_bytes -= e.nbytes
        self._resident_bytes -= e.nbytes
        self.counters.reloaded_bytes -= e.nbytes

    def _prefetch(self, seq: int) -> None:
        """Start reloading the entries saved just before ``seq`` while they fit the budget."""
        room = None if self.budget is None else self.budget - self._resident_bytes
        for s in reversed(self._away):
            if s >= seq:
                continue
            e = self._away[s]
            if e.residence is not Residence.AWAY or (e.load_gen and e.users_left <= 0):
                continue  # on its way, or already served in this pass (a later unpack is a miss)
            if room is not None:
                if e.nbytes > room:
                    return
                room -= e.nbytes
            try:
                self._load(e)
            except torch.cuda.OutOfMemoryError:
                # A prefetch is a guess: no room on the device now is no error; the unpack that
                # needs this tensor loads it (and raises, if there is still no room then).
                self._forget_load(e)
                return
            if self._climbing:
                return  # one load through an intermediate tier ahead at a time

    def _drop_device(self, e: Entry) -> None:
        """Every user of this load has its view: the engine stops holding the device copy."""
        if self._held is e:
            self._held = None
        device = e.copies.pop(Tier.DEVICE)
        self._top.free(device)
        self._loaded_bytes -= e.nbytes
        self._resident_bytes -= e.nbytes
        e.residence = Residence.AWAY
        if device.original:
            for ref in e.handles:  # See Note: [version watch]
                h = ref()
                if h is not None:
                    h.let_go()
            e.handles = []
        if Tier.HOST in e.copies:
            self._host_lru[e.seq] = e

    # ------------------------------------------------------------------ release

    def on_handle_dead(self, h: Handle) -> None:
        """Called from ``Handle.__del__`` on any thread, possibly while this thread holds the lock."""
        if self._lock.acquire(blocking=False):
            try:
                e = h.entry
                was_hot = e.residence is Residence.HOT  # its release defers no free: nothing new to retire
                self._release_ref(e, h.seen_gen != e.load_gen)
                if self._dead:
                    self._drain_dead()
                if not was_hot:
                    for tier in self.tiers:  # frees that waited for a copy: retire them now if they can be
                        tier.poll()
            finally:
                self._lock.release()
        else:
            self._dead.append((h.entry, h.seen_gen != h.entry.load_gen))

    def _drain_dead(self) -> None:
        while self._dead:
            self._release_ref(*self._dead.popleft())

    def _release_ref(self, e: Entry, unseen: bool) -> None:
        e.refs -= 1
        if unseen and e.users_left > 0 and e.residence in (Residence.LOADED, Residence.LEAVING):
            e.users_left -= 1
            if e.users_left <= 0 and e.refs > 0 and e.residence is Residence.LOADED:
                self._drop_device(e)
        if e.refs <= 0:
            self._release(e)

    def _release(self, e: Entry) -> None:
        """Free everything an entry holds; copies still in flight are freed when they settle."""
        if e.residence is Residence.RELEASED:  # close() released it; its last handle died since
            return
        if self._by_key.get(e.key) is e:
            del self._by_key[e.key]
        residence = e.residence
        if residence is Residence.HOT:  # the common case, kept short: only the original, nothing in flight
            del self._hot[e.seq]
            self._hot_bytes -= e.nbytes
            self._resident_bytes -= e.nbytes
            e.copies.clear()
            e.residence = Residence.RELEASED
            return
        if self._held is e:
            self._held = None
        if residence is Residence.KEPT:
            del self._kept[e.seq]
        elif residence is Residence.LEAVING:
            self._leaving.remove(e)
            copy = e.copies[self._out.tier]
            if copy.tier is Tier.DISK:  # counted when it started and not looked at since: a failure must come out
                self._orphans.append(_Orphan(copy, e.nbytes, left_device=True))
        elif residence is Residence.LOADED:
            self._loaded_bytes -= e.nbytes
        if residence is not Residence.AWAY:
            self._resident_bytes -= e.nbytes
        self._away.pop(e.seq, None)
        self._host_lru.pop(e.seq, None)
        if e in self._demoting:
            self._demoting.remove(e)
            self._orphans.append(_Orphan(e.copies[Tier.DISK], e.nbytes, left_device=False))
        if e in self._climbing:
            self._climbing.remove(e)
        for tier, copy in e.copies.items():
            self._tier[tier].free(copy)
        e.copies = {}
        e.residence = Residence.RELEASED

    # ------------------------------------------------------------------ engine-level

    def close(self) -> None:
        """Wait for all copies, free every buffer and the spill file. Live handles then fail to unpack."""
        with self._lock:
            self._drain_dead()
            for e in list(self._leaving):
                _wait_quietly(e.copies[self._out.tier])
            for e in self._climbing:  # reads to the host land there; no copy up starts now
                _wait_quietly(e.nearest())
            for e in self._demoting:
                _wait_quietly(e.copies[Tier.DISK])
            for orphan in self._orphans:  # settled by the poll below, so the counters are final
                _wait_quietly(orphan.copy)
            self._climbing = []
            self._poll()
            live = {
                id(e): e
                for group in (
                    self._hot.values(),
                    self._kept.values(),
                    self._leaving,
                    self._away.values(),
                    self._by_key.values(),
                )
                for e in group
            }
            for e in live.values():
                if e.residence is not Residence.RELEASED:
                    self._release(e)  # what a live handle still points at goes; its unpack raises
            if self.link is not None:
                self.link.synchronize()
            for tier in self.tiers:
                tier.drain()
            host = self._tier.get(Tier.HOST)
            if isinstance(host, HostTier):
                host.arena.clear()
            self.spill.close()


@dataclasses.dataclass(frozen=True)
class _Orphan:
    """A spill write still in flight when its entry was released (a d2h copy cannot fail). Its
    memory is freed by its tier once it settles; the store only has to learn whether it failed."""

    copy: Copy
    nbytes: int
    left_device: bool
    """Counted in ``offloaded_bytes`` (a copy out of the device), not only in ``spilled_bytes``."""


def _wait_quietly(copy: Copy) -> None:
    try:
        copy.filled.wait()
    except OSError:
        pass  # a failed write is handled where it is landed (_poll)
