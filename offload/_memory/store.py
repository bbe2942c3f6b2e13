"""The store: the budget over one device's saved storages, in pack, unpack, release and close.

Each saved storage is one entry (``entry``); where it is, ``residency`` owns; how its copies in
flight start, land and fail, ``inflight``; which tensors are eligible, ``hooks``. The store
decides when to move: eviction in forward, prefetch and reload in backward, release when autograd
lets go, all under one lock. It never asks which device it runs on (``tiers``).

Tiers, hottest first (``make_tiers``)::

    device (<= budget) ──evict oldest──▶ host (CUDA: pinned) ──host cap: oldest host copies──▶ disk
    device (CPU)       ──evict oldest──────────────────────────────────────────────────────▶ disk

Forward (pack)::

    save t ─▶ entry HOT ─▶ hot + loaded bytes > evict_at?  evict oldest: HOT ─▶ LEAVING (copy below fills)
                        ─▶ resident > budget?              wait for the oldest copy out to land

Backward (unpack of entry k)::

    k HOT/KEPT ─▶ the live tensor ─────────────────────────────┐
    k LEAVING/LOADED ─▶ hit;  k AWAY ─▶ miss: load k now ───────┴─▶ prefetch k-1, k-2, ... while they fit
                                                                  ─▶ wait for k's copy at the point of use
                                                                  ─▶ view; after k's last user: drop it

Invariants (``Residency.check`` states those of the containers and totals):
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
import logging
import threading
import time
from typing import Callable, Optional

import torch

from .._budget import Budget, FreeMemory, make_budget
from .._config import Config
from .._errors import OffloadError, inplace_error
from .._stats import Counters, Gauges, record
from .entry import CopyState, Entry, Handle, Residence, Tier
from .host import Host
from .inflight import InFlight
from .residency import Residency
from .spill import SpillFile
from .tiers import HostTier, as_bytes, make_tiers
from .transfer import Link

__all__ = ["Handle", "Store"]

log = logging.getLogger(__name__)
"""The store's warnings to users (a spill write failing, tensors kept over the budget), wherever in
the store's modules they arise: users filter them by this name."""

_NO_BATCH = contextlib.nullcontext()
"""What a store without a link enters where one would open a batch (a nullcontext can be re-entered)."""

# See Note: [enum members as module globals] in ``entry``
_HOT, _LEAVING, _AWAY, _LOADED, _KEPT, _RELEASED = (
    Residence.HOT,
    Residence.LEAVING,
    Residence.AWAY,
    Residence.LOADED,
    Residence.KEPT,
    Residence.RELEASED,
)
_HOST, _DISK = Tier.HOST, Tier.DISK
_FILLING = CopyState.FILLING


class Store:
    """Entries, tiers and the budget for one engine on its compute device."""

    def __init__(
        self,
        config: Config,
        device: torch.device,
        counters: Counters,
        link: Optional[Link] = None,
        memory: Optional[FreeMemory] = None,
        budget: Optional[Budget] = None,
        host: Optional[Host] = None,
    ) -> None:
        self.config = config
        self.device = device
        self.counters = counters
        # The engine's one budget, made with its session; a store made alone (a test) makes its own.
        self.budget = make_budget(config.budget_bytes, config.reserve_bytes, memory) if budget is None else budget
        self.budget.bind(device)
        if host is None:  # one its link carries (an emulator), or this machine; a host given replaces both
            host = getattr(link, "host", None) or Host()
        self.spill = SpillFile(config.spill_dir, config.spill_workers, host)
        self.tiers = make_tiers(device, config.host_budget_bytes, self.spill, link, host)
        self._tier = {t.tier: t for t in self.tiers}
        self._top = self.tiers[0]
        host_tier = self._tier.get(_HOST)
        self._host: Optional[HostTier] = host_tier if isinstance(host_tier, HostTier) else None
        self.link: Optional[Link] = None if self._host is None else self._host.link
        self._attached = False
        """This store told its link it uses it (``attach``), and has not said it stopped."""
        attach = getattr(self.link, "attach", None)
        if attach is not None:
            attach()  # See CudaLink.forget_producers: a link two stores share forgets nothing
            self._attached = True
        self._lock = threading.Lock()
        self._dead: collections.deque = collections.deque()  # (entry, unseen) released while locked
        self.residency = Residency()
        self._flight = InFlight(self.residency, self.tiers, counters, warn=log.warning)
        self._seq = 0
        self._largest_new_bytes = 0
        """Bytes of the largest storage taken since ``take_largest`` last read it (regions measure
        their largest save by it: ``RegionProfile.largest_tensor_bytes``)."""
        self._walk: list[int] = []
        self._walk_at = 0
        self._walk_stamp: Optional[int] = None  # None: never walked
        """The prefetch's walk of ``below`` (See Note: [the prefetch walk])."""
        self.saved_in_backward_bytes = 0
        """Bytes of the storages taken while autograd ran a backward (``torch.autograd.grad`` with
        ``create_graph=True``: a gradient penalty's graph), of all ``counters.saved_bytes``."""
        if self.budget.follows_free_memory:
            self.budget.read(0)

    def take_largest(self) -> int:
        """Bytes of the largest storage taken since the last call, and start it over."""
        with self._lock:
            largest, self._largest_new_bytes = self._largest_new_bytes, 0
        return largest

    def step_started(self) -> None:
        """The engine is entered (a step starts): read free memory, give back the pinned pages of
        host slabs dropped during the last step, out of the hot path (See Note: [emptying the
        pinned cache] in ``arena``), and, with nothing hot left to copy out, let the link forget
        the streams earlier saves came from (See Note: [fences before a copy] in ``transfer``)."""
        self.read_free()
        host = self._host
        if host is not None and host.arena.unreturned_bytes:
            with self._lock:
                host.arena.return_unpinned()
        forget = getattr(self.link, "forget_producers", None)
        if forget is not None:
            with self._lock:  # a pack on another thread adds to both under it
                if not self.residency.hot:  # nothing left to copy out: no stream seen so far matters
                    forget()

    def read_free(self) -> None:
        """Read free memory now; nothing with a fixed budget. Here and not on ``Budget``: a reading
        pairs free memory with ``resident_bytes`` at the same instant, so it takes the store's lock,
        as a reading inside pack or unpack holds it."""
        if self.budget.follows_free_memory:
            with self._lock:
                self.budget.read(self.resident_bytes)

    def _maybe_read_free(self, nbytes: int) -> None:
        """Count ``nbytes`` saved or loaded; read free memory when the rule says (``_budget``)."""
        budget = self.budget
        if budget.follows_free_memory and budget.due(nbytes):  # a fixed budget is never read
            budget.read(self.resident_bytes)

    # ------------------------------------------------------------------ readings (change nothing)

    @property
    def resident_bytes(self) -> int:
        """Device bytes the engine holds now (see the invariants)."""
        return self.residency.resident_bytes + self._top.waiting_bytes

    def gauges(self) -> Gauges:
        """What the store holds now, and the link's busy times (zeros without one)."""
        host = self._host
        d2h_ms = h2d_ms = stall_ms = 0.0
        if self.link is not None:  # unlocked without one: a free-memory reading inside pack may read stats
            with self._lock:  # the link's event lists change under pack and unpack
                d2h_ms, h2d_ms, stall_ms = self.link.busy_ms()
        return Gauges(
            resident_bytes=self.resident_bytes,
            peak_resident_bytes=self.residency.peak_resident_bytes,
            peak_over_budget_bytes=self.residency.peak_over_budget_bytes,
            host_bytes=0 if host is None else host.arena.pinned_bytes,
            host_in_use_bytes=0 if host is None else host.in_use_bytes,
            spill_bytes=self._tier[_DISK].used_bytes,
            spill_files=self.spill.files,
            budget_bytes=self.budget.bytes,
            d2h_busy_ms=d2h_ms,
            h2d_busy_ms=h2d_ms,
            stall_ms=stall_ms,
        )

    def reset_peak(self) -> None:
        self.residency.peak_resident_bytes = self.resident_bytes
        self.residency.peak_over_budget_bytes = 0

    def _batch(self):
        return self.link.batch() if self.link is not None else _NO_BATCH

    # ------------------------------------------------------------------ forward

    def pack(self, t: torch.Tensor, eager: bool = False, storage: Optional[torch.UntypedStorage] = None) -> Handle:
        """Take a saved tensor (``storage``: its storage, where the caller has read it already);
        ``eager``: start its copy out now (a region planned OFFLOAD)."""
        if storage is None:
            storage = t.untyped_storage()
        key = storage._cdata
        version = t._version
        res = self.residency
        lock = self._lock
        lock.acquire()
        try:
            if self._dead:
                self._drain_dead()
            e = res.by_key.get(key)
            new = e is None or not e.holds_as_saved(t, version)
            if e is None or new:
                self._seq += 1
                nbytes = storage.nbytes()
                e = Entry(self._seq, key, storage, t, nbytes, version)
                res.add(e)
                self.counters.saved_bytes += nbytes
                if torch._C._current_autograd_node() is not None:  # a node's backward is running
                    self.saved_in_backward_bytes += nbytes
                if nbytes > self._largest_new_bytes:
                    self._largest_new_bytes = nbytes
                if self.budget.follows_free_memory:  # after counting it: it is allocated, not free
                    self._maybe_read_free(nbytes)
            elif e.users_left > 0:
                e.users_left += 1  # a save during backward (double backward) is a user of this load too
            e.refs += 1
            self.counters.saved_tensors += 1
            handle = Handle(self, e, t, version)
            if self.budget.bytes is None and not eager:
                # Note: [a pack that only counts]
                #     With no budget in force and no copy asked for, nothing can start, land or
                #     need room: no link batch, no poll, no eviction. Only a new entry raises what
                #     is resident, so only then can the peak rise (``note_peak`` takes off what is
                #     held for a next user, never adds, so a resident figure at or under the peak
                #     cannot make a new one). A copy in flight from an earlier budget lands at the
                #     next pack or unpack that polls; its bytes stay counted until then.
                if new and res.resident_bytes > res.peak_resident_bytes:
                    res.note_peak(None)
                return handle
            with self._batch():
                if eager and e.residence is _HOT:
                    self._flight.evict(e)
                self._flight.poll()
                self._enforce_budget()
            if self._dead:
                self._drain_dead()
            res.note_peak(self.budget.bytes)
            return handle
        finally:
            lock.release()

    def _enforce_budget(self) -> None:
        budget, evict_at, res = self.budget.bytes, self.budget.evict_at, self.residency
        if budget is None:
            return
        assert evict_at is not None  # Budget.set_planned sets it whenever there is a budget
        over = res.hot_bytes + res.loaded_bytes - evict_at
        room = self.budget.batch_bytes if self._host is not None else 0  # See Note: [moves in batches]
        if over > room and res.hot:
            batch = []
            for e in res.hot.values():  # oldest first
                batch.append(e)
                over -= e.nbytes
                if over <= 0:
                    break
            self._flight.evict_all(batch)
        self._wait_leaving(lambda: res.resident_bytes - budget)

    # Note: [moves in batches]
    #     Eviction into the host tier waits until hot (and loaded) bytes pass ``evict_at`` by
    #     ``Budget.batch_bytes`` (half the in-flight window), then moves everything over
    #     ``evict_at`` at once, oldest first: a pinned block per tensor (``acquire_all``: each
    #     taken as one would be) and one ``Link.d2h_all`` call. On CUDA that is one set of fences
    #     and one event for the batch where each tensor had its own, and one Python call; the
    #     copies themselves are still one ``cudaMemcpyAsync`` each (``torch._foreach_copy_``
    #     across devices loops ``copy_`` in C++). No more is moved than before (a batch ends at
    #     ``evict_at``, where eviction always ended). What it costs:
    #     - half the window for copies in flight: what is hot may sit ``batch_bytes`` above
    #       ``evict_at``, so what is resident passes the budget (which a pack waits on) when
    #       tensors kept on the device or device copies still being freed pass half the window,
    #       not the whole of it;
    #     - a pack that has to wait for a copy out waits for the oldest batch's one event, so for
    #       the whole batch, where it waited for one tensor (the time is ``evict_wait_ms``).
    #     Where the room is 0 eviction starts at ``evict_at`` as before, and what is over then
    #     (one tensor, or more after a large save) still goes as one batch: a region plan in
    #     force (``evict_at`` is the budget) and budget 0 have no window. The copies a region
    #     planned OFFLOAD starts at each save go one by one; so does a batch the arena cannot
    #     give every block (making room below as a single eviction does). A CPU device spills
    #     straight to disk, one write a tensor: there a batch would save nothing, so there is
    #     no room either.

    def _wait_leaving(self, excess: Callable[[], int]) -> None:
        """Wait for copies out to land, in order (one stream, or polled so), while ``excess()``
        bytes are still over the budget; the time goes to ``evict_wait_ms``."""
        res = self.residency
        if excess() <= 0 or not res.leaving:
            return
        start = time.perf_counter()
        with record("offload::wait_evict"):
            while excess() > 0 and res.leaving:
                self._flight.wait_oldest_out()
        self.counters.evict_wait_ms += (time.perf_counter() - start) * 1e3

    # ------------------------------------------------------------------ backward

    def unpack(self, h: Handle) -> torch.Tensor:
        lock = self._lock
        lock.acquire()
        try:
            if self._dead:
                self._drain_dead()
            e = h.entry
            alias = h.alias
            if alias is not None and alias._version != h.version:  # h.modified(): See Note: [version watch]
                raise inplace_error(alias.type(), e.shape, alias._version, h.version)
            residence = e.residence
            if residence is _HOT or residence is _KEPT:  # ORIGINAL_IS_DATA
                assert alias is not None  # a handle lets its alias go only once the original has left
                return alias  # the live tensor itself, detached (autograd makes its own shallow copy)
            return self._unpack_moved(e, h)
        finally:
            lock.release()

    def _unpack_moved(self, e: Entry, h: Handle) -> torch.Tensor:
        """Unpack ``h`` of an entry whose data is not (only) the original: under the lock."""
        if e.residence is _RELEASED:
            raise OffloadError(
                f"offload: the saved tensor {e.describe} was released because the engine was closed; "
                "run backward before closing the engine"
            )
        with self._batch():
            self._flight.poll()
            self._maybe_read_free(0)
            held = self.residency.held
            if held is not None and held is not e:
                self.residency.held = None
                if self.budget.bytes is not None and self.residency.resident_bytes > self.budget.bytes:
                    self._flight.drop_device(held)  # its next user is not next: it reads it again
            if e.residence is _LEAVING and e.users_left <= 0:
                # its first user of this pass: the original serves, and stays when its copy lands
                e.load_gen += 1
                e.users_left = e.refs
            self._fit_fallen_budget(e)
            if e.residence is _AWAY:  # a miss: it comes back now, whatever the budget
                self.counters.prefetch_misses += 1
                self._maybe_read_free(e.nbytes)  # before its device copy, as a prefetch reads
                self._flight.load(e)
            else:
                self.counters.prefetch_hits += 1
            if self.config.prefetch:
                self._prefetch(e.seq)
            self._fit_fallen_budget(e)  # a reading since may have found the budget lower
            view = self._serve(e, h)
            self._drain_dead()
        self.residency.note_peak(self.budget.bytes, in_use=e if e.residence is _LEAVING else None)
        return view

    def _fit_fallen_budget(self, serving: Entry) -> None:
        """Only a budget that follows free memory falls under what backward holds: when it has,
        what is not moved yet goes, then the loads no user has read. ``serving``, in use, is not
        counted (the peak after the unpack does not count it either)."""
        budget = self.budget.bytes
        if not self.budget.follows_free_memory or budget is None:
            return
        own = serving.nbytes if serving.residence in (_LOADED, _LEAVING) else 0
        limit = budget + own  # a leaving original that lands in use stays LOADED: ``own`` holds throughout
        if self.residency.resident_bytes <= limit:
            return
        self._shed_unmoved(serving, limit)  # See Note: [a budget that falls in backward]
        if self.residency.resident_bytes > limit:
            self._flight.give_back_loads(serving, limit)

    def _shed_unmoved(self, serving: Entry, limit: int) -> None:
        """Start moving the tensors not moved yet, oldest first, until what is leaving (``serving``
        aside) covers what is resident over ``limit``, then wait for them to land."""
        res = self.residency

        def excess() -> int:
            return res.resident_bytes - limit

        leaving = sum(x.nbytes for x in res.leaving if x is not serving)
        while res.hot and excess() > leaving:
            x = next(iter(res.hot.values()))
            leaving += x.nbytes
            self._flight.evict(x)
        self._wait_leaving(excess)

    def _serve(self, e: Entry, h: Handle) -> torch.Tensor:
        """Hand ``h`` its view of the device copy, once the copy is usable on the current stream."""
        device = e.device_copy()
        if device is None or device.state is _FILLING:
            device = self._flight.reload_landing(e)
        elif not device.original:
            device.filled.order_compute()  # See Note: [a reload used on another stream] in ``transfer``
        if device.original:
            assert h.alias is not None  # the original is still here: the handle has not let it go
            view = h.alias
        else:
            view = h.rebuild(as_bytes(device.data))
        if h.seen_gen != e.load_gen:
            h.seen_gen = e.load_gen
            e.users_left -= 1
            if e.users_left <= 0 and e.residence is _LOADED:
                self._flight.drop_device(e)
            elif (
                e.residence is _LOADED
                and self.budget.bytes is not None
                and self.residency.resident_bytes > self.budget.bytes
            ):
                self.residency.held = e  # See Note: [held for the next user]
        return view

    # Note: [a budget that falls in backward]
    #     Under ``budget_mb="auto"`` the budget falls when the step allocates outside the engine,
    #     and backward allocates (gradients, an optimizer's first state). The tensors the engine
    #     has not moved yet go first, oldest first (backward needs them last), just enough of them
    #     to cover the excess, and the unpack waits until they have left, as a pack does in
    #     forward; then, if still over, the loads read ahead (``give_back_loads``). It happens
    #     where a plan keeps a block before one it offloads: backward reaches the offloaded block
    #     while the kept one is whole. The tensor being unpacked is not counted: it is in use, and
    #     if its copy out is still on its way its original serves this unpack and stays when the
    #     copy lands (marked in use before anything is waited for). A read back costs less than a
    #     device out of memory. The prefetch's own loads keep to the budget in force too (See
    #     Note: [a prefetch asks the budget in force]).

    # Note: [held for the next user]
    #     A storage with several users in backward (a norm output feeding two matmuls, the qkv
    #     buffer) has them one right after the other. Dropping its copy after the first user
    #     whenever the budget is tight (always at budget 0) read it back once per user. So a
    #     copy with users left stays after its unpack even over the budget, as the one tensor
    #     autograd is using, and goes at the start of the next unpack of another storage if the
    #     budget still needs the room; only then is it read again (its next user was not next).
    #     The peak after an unpack does not count it: those bytes are the tensor in use, held by
    #     autograd with or without the engine.

    # Note: [a prefetch asks the budget in force]
    #     Free memory is read by a rule (``_budget``: after so many bytes saved or loaded, or so
    #     many milliseconds), not on every unpack, so backward can allocate gradients that no
    #     reading has seen until one of the prefetch's loads comes due. So a prefetch never takes
    #     its room once, as it starts (a reading that found the budget lower would not stop the
    #     loads after it, and the unpack would return over the budget): each load first
    #     counts its bytes toward a reading, taken before the load (resident and free then both
    #     leave its bytes out, where after it a load still climbing through the host would be
    #     counted resident and not yet taken from free), and a prefetch goes only if it fits the
    #     budget in force then; a miss reads the same way and goes whatever the budget. What a
    #     reading shows already over goes before the unpack returns (``_fit_fallen_budget``,
    #     after the prefetch too).

    # Note: [the prefetch walk]
    #     Each unpack of a moved tensor starts loads of the ones saved just before it, latest
    #     landed first, while they fit the budget. Walking all of ``below`` from its newest end at
    #     each unpack passed again over every load already ahead of backward: at a budget of half
    #     a step, the whole budget's worth of entries per unpack, so a step of N moved saves cost
    #     O(N^2). So the walk is a list of ``below``'s keys, newest landed first, with a cursor
    #     past its front of entries done for this pass (released, loaded, or served); the next
    #     walk starts at the cursor. An entry past the cursor can become one to load again only by
    #     landing in ``below`` or by a load dropped before its users had it, and both change
    #     ``Residency.below_stamp``: then the list is made again and walked from its front.

    def _prefetch(self, seq: int) -> None:
        """Start reloading the entries saved just before ``seq`` while they fit the budget in force."""
        res = self.residency
        below = res.below
        if self._walk_stamp != res.below_stamp:
            self._walk = list(reversed(below))
            self._walk_at = 0
            self._walk_stamp = res.below_stamp
        walk = self._walk
        front = True  # still in the walk's front of entries done for this pass
        for i in range(self._walk_at, len(walk)):
            s = walk[i]
            e = below.get(s)
            if e is None or e.residence is not _AWAY or (e.load_gen and e.users_left <= 0):
                if front:  # released, loaded or already served: nothing more to do for it this pass
                    self._walk_at = i + 1
                continue
            front = False
            if s >= seq:
                continue  # saved after the tensor being unpacked: not ahead of backward
            self._maybe_read_free(e.nbytes)  # See Note: [a prefetch asks the budget in force]
            if self.budget.bytes is not None and e.nbytes > self.budget.bytes - res.resident_bytes:
                return
            try:
                self._flight.load(e)
            except torch.cuda.OutOfMemoryError:
                # A prefetch is a guess: no room on the device now is no error; the unpack that
                # needs this tensor loads it (and raises, if there is still no room then).
                self._flight.forget_load(e)
                return
            if res.climbing:
                return  # one load through an intermediate tier ahead at a time

    # ------------------------------------------------------------------ release

    def on_handle_dead(self, h: Handle) -> None:
        """Called from ``Handle.__del__`` on any thread, possibly while this thread holds the lock."""
        lock = self._lock
        if lock.acquire(False):
            try:
                e = h.entry
                if e.residence is _HOT:  # the common case, kept short: nothing in flight, nothing to retire
                    e.refs -= 1  # _release_ref: a HOT entry has no load whose users to count down
                    if e.refs <= 0:
                        self.residency.release_hot(e)
                    if self._dead:
                        self._drain_dead()
                    return
                self._release_ref(e, h.seen_gen != e.load_gen)
                if self._dead:
                    self._drain_dead()
                for tier in self.tiers:  # frees that waited for a copy: retire them now if they can be
                    tier.poll()
            finally:
                lock.release()
        else:
            self._dead.append((h.entry, h.seen_gen != h.entry.load_gen))

    def _drain_dead(self) -> None:
        while self._dead:
            self._release_ref(*self._dead.popleft())

    def _release_ref(self, e: Entry, unseen: bool) -> None:
        e.refs -= 1
        if unseen and e.users_left > 0 and e.residence in (_LOADED, _LEAVING):
            e.users_left -= 1
            if e.users_left <= 0 and e.refs > 0 and e.residence is _LOADED:
                self._flight.drop_device(e)
        if e.refs <= 0:
            self._release(e)

    def _release(self, e: Entry) -> None:
        """Free everything an entry holds; copies still in flight are freed when they settle."""
        if e.residence is _RELEASED:  # close() released it; its last handle died since
            return
        if e.residence is _HOT:  # the common case, kept short: only the original, nothing in flight
            self.residency.release_hot(e)
            return
        self._flight.adopt_orphans(e)
        for tier, copy in e.copies.items():
            self._tier[tier].free(copy)
        self.residency.move(e, _RELEASED)
        e.copies = {}

    # ------------------------------------------------------------------ engine-level

    def close(self) -> None:
        """Wait for all copies, free every buffer and the spill file. Live handles then fail to unpack."""
        with self._lock:
            self._drain_dead()
            self._flight.wait_all()
            self._flight.poll()
            for e in list(self.residency.entries()):
                self._release(e)  # what a live handle still points at goes; its unpack raises
            if self.link is not None:
                self.link.synchronize()
                if self._attached:  # once, however often close() runs
                    self._attached = False
                    self.link.detach()  # type: ignore[attr-defined]  # attached: the link has both
            for tier in self.tiers:
                tier.drain()
            if self._host is not None:
                self._host.arena.clear()
            self.spill.close()
