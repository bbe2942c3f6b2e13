"""The tiered store: where each saved storage lives, and the budget that decides it.

Owns the entries (one per distinct saved storage), the byte accounting, eviction in forward,
prefetch and reload in backward, and release when autograd lets go. It does not decide which
tensors are eligible (``_hooks``) and does not touch streams itself (``_transfer``) or files
(``_spill``); it sequences them.

Tiers, hottest first::

    device (hot, <= budget) ──evict oldest──▶ pinned host (CUDA) ──host cap──▶ disk
                            ──evict oldest──────────────────────────────────▶ disk   (CPU device)

Forward (pack)::

    save t ─▶ entry(hot) ─▶ hot bytes > budget·(1-window)?  evict oldest: copy starts, bytes in flight
                          ─▶ resident (hot + in flight + loaded) > budget?  wait for the oldest copy

Backward (unpack of entry k)::

    k on device? ── yes ─▶ hit ──────────────┐
        └─ no ─▶ miss: reload k now ─────────┴─▶ prefetch k-1, k-2, ... while they fit the budget
                                                 ─▶ wait for k's copy at the point of use ─▶ view

Invariants:
- ``resident_bytes`` counts every device byte the engine holds: hot originals, sources of copies in
  flight (See Note: [keep-alive until the copy event]) and reloaded copies not yet handed out to all
  their users.
- An entry's data is read back only from a copy whose write has completed, or from the source it is
  still keeping alive.
- Everything an entry holds (device bytes, a pool buffer, a spill file) is released when its last
  handle dies, whether or not backward ever ran.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from typing import Optional

import torch

from ._config import Config
from ._errors import OffloadError
from ._pool import PinnedPool
from ._spill import SpillDir
from ._stats import Counters
from ._transfer import CudaLink, is_done, is_event, wait

__all__ = ["Store", "Handle"]

log = logging.getLogger(__name__)

INFLIGHT_FRACTION = 0.25
"""Share of the budget reserved for copies in flight. Eviction starts when hot bytes pass
(1 - this) x budget, so copies drain while compute goes on; pack blocks only at the full budget.
Not while a region plan is in force (``set_planned``): the plan already keeps its regions within
the budget and starts the copies of its offloaded regions at once, so early eviction would only
move tensors the plan keeps (measured: up to a quarter of the budget spilled for nothing)."""


def _record(name: str):
    return torch.autograd.profiler.record_function(name)


class _Entry:
    """One distinct saved storage and every copy of it the engine holds."""

    __slots__ = (
        "seq", "nbytes", "key", "version", "shape", "dtype", "device", "refs", "pending", "load_gen",
        "owner",          # weakref to the tensor whose version counter ``version`` was read from
        "watching",       # the data is still the original storage, See Note: [version watch]
        "handles",        # weakrefs to the handles holding a version alias while watching
        "adopted",        # device_bytes is the original storage, taken back from a copy in flight
        "storage",        # the original's UntypedStorage while it is hot
        "device_bytes",   # uint8 device tensor: a reloaded copy (or the adopted source)
        "device_ready",   # event/future the device copy waits on, or None
        "keepalive",      # source of a copy in flight (device bytes), See Note: [keep-alive until the copy event]
        "out_ready",      # event/future of the copy out (d2h or write), or None once landed
        "host_bytes",     # pinned (or pageable) uint8 host buffer holding the data (CUDA)
        "host_pooled",    # host_bytes came from the pool
        "host_ready",     # future of a disk read into host_bytes, or None
        "host_busy",      # event of the last h2d copy reading host_bytes (CUDA), or None
        "disk_path",      # spill file, once a write started
        "disk_ready",     # future of that write, or None once landed
        "dead",
    )

    def __init__(self, seq: int, nbytes: int, key: int, version: int, storage, t: torch.Tensor) -> None:
        # Note: [storage key without a weak guard]
        #     ``key`` is the StorageImpl address, which the allocator can reuse once the storage is
        #     freed. No weak reference is needed to keep keys unique: while hot the entry holds the
        #     storage itself; once moved it matches only the same live owner tensor
        #     (``holds_as_saved``), and a live owner keeps the storage, so its address, in use.
        self.seq, self.nbytes, self.key, self.version, self.storage = seq, nbytes, key, version, storage
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.refs = 0
        self.pending = 0
        self.load_gen = 0
        self.owner = None
        self.watching, self.handles, self.adopted = True, [], False
        self.device_bytes = self.device_ready = self.keepalive = self.out_ready = None
        self.host_bytes = self.host_ready = self.disk_path = self.disk_ready = None
        self.host_pooled = False
        self.host_busy = None
        self.dead = False

    @property
    def hot(self) -> bool:
        return self.storage is not None

    @property
    def describe(self) -> str:
        """The first saved tensor's shape and dtype, for messages (never its values)."""
        return f"{tuple(self.shape)} {self.dtype} on {self.device}"

    def holds_as_saved(self, owner: torch.Tensor, version: int) -> bool:
        """Whether this entry's data is what a tensor of ``owner``'s version counter at ``version`` holds.

        A hot entry is the storage itself, so it holds whatever is there now. A moved entry is a
        snapshot: it matches only a tensor on the same version counter at the same version.
        Tensors can share a storage without sharing a counter (``unsafe_chunk`` in the CPU GRU cell,
        ``.data``): there, equal version numbers say nothing, and the snapshot may predate an
        in-place write the other counter never saw.
        """
        if self.version != version:
            return False
        return self.hot or self.owner() is owner


def _version_owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter ``t`` uses: a view shares its base's, anything else has its own."""
    return t if t._base is None else t._base


# Note: [version watch]
#     Saved-tensor hooks turn off autograd's own check that a saved tensor was not modified in
#     place, so the store does it. Reading ``_version`` needs a tensor on the same version counter,
#     and the tensor pack was given is often a temporary (a view saved by an op) that dies at once,
#     while its base lives on and can be modified. So each handle holds ``alias = t.detach()``
#     (same counter and storage, no grad_fn, so no reference cycle) for as long as the entry's data
#     is the original storage: while hot, while its copy out is in flight, while adopted back.
#     That costs no memory: the entry holds the same storage then anyway. When the copy has
#     landed, the store compares the versions one last time (an in-place write during the copy
#     may have torn it: the handle becomes ``stale``) and lets the alias go, so the storage can be
#     freed; from then on the handle reads the snapshot, i.e. the values as saved.


class Handle:
    """What pack returns to autograd: one saved tensor's view onto an entry.

    When autograd drops it (after the node's backward, or with the graph), the entry loses a user.
    """

    __slots__ = (
        "store", "entry", "dtype", "size", "stride", "offset", "version", "alias", "stale", "seen_gen", "__weakref__",
    )

    def __init__(self, store: "Store", entry: _Entry, t: torch.Tensor) -> None:
        self.store, self.entry = store, entry
        self.version = t._version
        self.stale = False
        self.seen_gen = -1
        if entry.watching:  # See Note: [version watch]; the alias also carries the layout until then
            self.alias = t.detach()
            entry.handles.append(weakref.ref(self))
        else:
            self.alias = None
            self._take_layout(t)

    def _take_layout(self, t: torch.Tensor) -> None:
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()

    def rebuild(self, data: torch.Tensor) -> torch.Tensor:
        """This saved tensor's exact view (dtype, size, stride, storage offset) onto ``data``'s storage."""
        if self.alias is not None:
            a = self.alias
            return torch.empty(0, dtype=a.dtype, device=data.device).set_(
                data.untyped_storage(), a.storage_offset(), a.size(), a.stride()
            )
        return torch.empty(0, dtype=self.dtype, device=data.device).set_(
            data.untyped_storage(), self.offset, self.size, self.stride
        )

    def modified(self) -> bool:
        """True if the saved tensor was modified in place after it was saved (and before it was copied)."""
        return self.stale or (self.alias is not None and self.alias._version != self.version)

    def stop_watching(self) -> None:
        """The entry's copy has landed: last version check, then let the original storage go."""
        if self.alias is not None:
            self.stale = self.stale or self.alias._version != self.version
            self._take_layout(self.alias)
            self.alias = None

    def __del__(self) -> None:
        try:
            self.store.on_handle_dead(self)
        except Exception:  # noqa: BLE001 - a finalizer must not raise; the store logs the cause
            log.exception("offload: releasing a saved tensor failed")


class Store:
    """Entries, tiers and the budget for one engine on one compute device."""

    def __init__(self, config: Config, device: torch.device, counters: Counters, link=None) -> None:
        self.config = config
        self.device = device
        self.counters = counters
        self.budget = config.budget_bytes
        self.evict_at = None
        self.set_planned(False)
        # ``cuda``: a host tier sits between the device and the disk. ``link`` may be given to run
        # that path with another transport (the tests drive it on the CPU with synchronous copies).
        self.cuda = device.type == "cuda" or link is not None
        self.link = link if link is not None else (CudaLink(device) if self.cuda else None)
        self.pool = PinnedPool(config.host_budget_bytes, pin=device.type == "cuda") if self.cuda else None
        self.spill = SpillDir(config.spill_dir, config.spill_workers)
        self._lock = threading.Lock()
        self._dead: collections.deque = collections.deque()
        self._by_key: dict[int, _Entry] = {}
        self._hot: dict[int, _Entry] = {}         # seq -> entry, save order (oldest first)
        self._moved: dict[int, _Entry] = {}       # seq -> entry, eviction order == save order
        self._inflight: collections.deque = collections.deque()   # entries with a copy out in flight
        self._writes: collections.deque = collections.deque()     # CUDA: host -> disk writes in flight
        self._reading: collections.deque = collections.deque()    # CUDA: disk -> host reads in flight
        self._host_lru: dict[int, _Entry] = {}    # CUDA: entries whose only copy is in host memory
        self._stuck: dict[int, _Entry] = {}       # CUDA: hot entries with nowhere safe to go (see _keep_on_device)
        self._stuck_warned = False
        self._retiring: list = []                 # (waitable, callback) for released entries' copies
        self._seq = 0
        self._hot_bytes = 0
        self._loaded_bytes = 0
        self._write_failed = False

    def set_planned(self, planned: bool) -> None:
        """Evict at the full budget (a region plan is in force) or keep the in-flight window."""
        if self.budget is not None:
            self.evict_at = self.budget if planned else int(self.budget * (1 - INFLIGHT_FRACTION))

    # ------------------------------------------------------------------ accounting

    def _note_peak(self) -> None:
        """Record the peak at the points where the budget holds: after pack and after unpack.

        Inside pack the new tensor is briefly counted before eviction reacts; it exists on the
        device with or without the engine, so that instant is not the engine's residency.
        """
        c = self.counters
        if c.resident_bytes > c.peak_resident_bytes:
            c.peak_resident_bytes = c.resident_bytes

    # ------------------------------------------------------------------ forward

    def pack(self, t: torch.Tensor, eager: bool = False) -> Handle:
        """Take a saved tensor; ``eager``: start its copy out now (a region planned OFFLOAD)."""
        with self._lock:
            self._drain_dead()
            storage = t.untyped_storage()
            key = storage._cdata
            version = t._version
            owner = _version_owner(t)
            entry = self._by_key.get(key)
            if entry is None or entry.dead or not entry.holds_as_saved(owner, version):
                nbytes = storage.nbytes()
                self._seq += 1
                entry = _Entry(self._seq, nbytes, key, version, storage, t)
                entry.owner = weakref.ref(owner)
                self._by_key[key] = entry
                self._hot[entry.seq] = entry
                self._hot_bytes += nbytes
                self.counters.saved_bytes += nbytes
                self.counters.resident_bytes += nbytes
            entry.refs += 1
            self.counters.saved_tensors += 1
            handle = Handle(self, entry, t)
            if eager and entry.hot:
                self._evict(entry)
            if self.budget is not None or eager:
                self._poll()
                self._enforce_budget()
            self._drain_dead()
            self._note_peak()
            return handle

    def _enforce_budget(self) -> None:
        if self.budget is None:
            return
        while self._hot and self._hot_bytes + self._loaded_bytes > self.evict_at:
            self._evict(next(iter(self._hot.values())))
        if self.counters.resident_bytes > self.budget and self._inflight:
            start = time.perf_counter()
            with _record("offload::wait_evict"):
                while self.counters.resident_bytes > self.budget and self._inflight:
                    self._wait_out(self._inflight[0])
                    self._poll()
            self.counters.evict_wait_ms += (time.perf_counter() - start) * 1e3

    def _evict(self, e: _Entry) -> None:
        """Start moving a hot entry off the device; its bytes stay resident until the copy lands."""
        buf = None
        if self.cuda:
            buf = self._host_buffer(e.nbytes)
            if buf is None and (self._write_failed or self.pool.ram_room_bytes() < e.nbytes):
                self._keep_on_device(e)
                return
        del self._hot[e.seq]
        self._hot_bytes -= e.nbytes
        source = torch.empty(0, dtype=torch.uint8, device=self.device).set_(e.storage)
        e.storage = None
        self._moved[e.seq] = e
        self.counters.offloaded_bytes += e.nbytes
        if self.cuda:
            if buf is not None:
                with _record("offload::d2h"):
                    e.out_ready = self.link.d2h(source, buf)
                e.host_bytes, e.host_pooled, e.keepalive = buf, True, source
                self._inflight.append(e)
                return
            # No pinned memory left: copy through pageable memory (synchronous) and spill that.
            with _record("offload::d2h_pageable"):
                host = source.to("cpu")
            self._stop_watching(e)
            self.counters.resident_bytes -= e.nbytes
            e.host_bytes, e.host_pooled = host, False
            self._start_write(e, host)
            self._writes.append(e)
            return
        self._start_write(e, source)
        e.keepalive, e.out_ready = source, e.disk_ready
        self._inflight.append(e)

    def _keep_on_device(self, e: _Entry) -> None:
        """No pinned room, and pageable memory is unsafe (host RAM short, or the disk failing so
        pageable copies would pile up in RAM): the tensor stays on the device, over the budget,
        rather than push the host toward swap. It is not offered for eviction again."""
        del self._hot[e.seq]
        self._hot_bytes -= e.nbytes
        self._stuck[e.seq] = e
        if not self._stuck_warned:
            log.warning(
                "offload: no pinned host memory left and %s; keeping saved tensors on the device over "
                "budget_mb (raise host_budget_mb or free host memory, or use a recompute policy)",
                "spill writes are failing" if self._write_failed else "host RAM is short",
            )
            self._stuck_warned = True

    def _stop_watching(self, e: _Entry) -> None:
        """The entry's data is a finished copy now. See Note: [version watch]."""
        e.watching = False
        for ref in e.handles:
            h = ref()
            if h is not None:
                h.stop_watching()
        e.handles = []

    def _start_write(self, e: _Entry, data: torch.Tensor) -> None:
        """Start writing ``data`` (CPU bytes) to a spill file; ``data`` must live until the write lands."""
        with _record("offload::spill"):
            e.disk_path, e.disk_ready = self.spill.write(data)
        self.counters.spilled_bytes += e.nbytes

    def _host_buffer(self, nbytes: int) -> Optional[torch.Tensor]:
        """A pinned buffer for a d2h copy; spills the oldest host-only entries to make room."""
        buf = self.pool.acquire(nbytes)
        # Each host-only entry is tried once: a failed write puts its entry back in _host_lru, so
        # with a full disk "while _host_lru" would spin forever.
        tries = len(self._host_lru)
        while buf is None and self._host_lru and tries > 0:
            tries -= 1
            self._spill_host(next(iter(self._host_lru.values())))
            self._poll()
            buf = self.pool.acquire(nbytes)
            if buf is None and self._writes:
                self._wait_write(self._writes[0])
                self._poll()
                buf = self.pool.acquire(nbytes)
        return buf

    def _wait_write(self, e: _Entry) -> None:
        try:
            wait(e.disk_ready)
        except OSError:
            pass  # handled in _poll, which sees the failed future

    def _spill_host(self, e: _Entry) -> None:
        """CUDA: write a host-only entry to disk; its pool buffer returns when the write lands."""
        del self._host_lru[e.seq]
        self._start_write(e, e.host_bytes[: e.nbytes])  # a pool buffer can be longer than the data
        self._writes.append(e)

    # ------------------------------------------------------------------ completion

    def _wait_out(self, e: _Entry) -> None:
        try:
            wait(e.out_ready)
        except OSError:
            pass  # handled in _poll, which sees the failed future

    def _poll(self) -> None:
        """Retire every copy that has completed, in order; never blocks."""
        while self._inflight and is_done(self._inflight[0].out_ready):
            self._land_out(self._inflight.popleft())
        while self._writes and self._writes[0].disk_ready.done():
            self._land_host_spill(self._writes.popleft())
        if self._retiring:
            still = []
            for waitable, callback in self._retiring:
                if is_done(waitable):
                    callback()
                else:
                    still.append((waitable, callback))
            self._retiring = still

    def _land_out(self, e: _Entry) -> None:
        """The copy out of the device finished: free its source (unless it was adopted back)."""
        ready, e.out_ready = e.out_ready, None
        failed = None if is_event(ready) else ready.exception()
        if failed is not None:
            self._write_failure(e, failed)
            return
        if not self.cuda:
            e.disk_ready = None
        elif e.host_bytes is not None and e.disk_path is None and not e.dead:
            self._host_lru[e.seq] = e
        if not e.adopted:  # an adopted original is still the data handed out: keep watching it
            self._stop_watching(e)
        if e.keepalive is not None:
            e.keepalive = None
            self.counters.resident_bytes -= e.nbytes

    def _land_host_spill(self, e: _Entry) -> None:
        failed = e.disk_ready.exception()
        e.disk_ready = None
        if failed is not None:
            self._host_lru[e.seq] = e  # the host copy is still good; keep it there
            self.counters.spilled_bytes -= e.nbytes
            self.spill.remove(e.disk_path)
            e.disk_path = None
            self._note_write_failure(failed)
            return
        if e.device_ready is None and e.host_ready is None:
            self._free_host(e)

    def _write_failure(self, e: _Entry, error: BaseException) -> None:
        """A spill write failed: keep the tensor on the device (over budget) rather than lose it."""
        self.counters.offloaded_bytes -= e.nbytes  # nothing left the device, nothing was written
        self.counters.spilled_bytes -= e.nbytes
        self.spill.remove(e.disk_path)
        e.disk_path = e.disk_ready = None
        if e.keepalive is not None and e.device_bytes is None:
            e.device_bytes = e.keepalive
            self._loaded_bytes += e.nbytes
            e.pending = 1 << 30  # never dropped on unpack: this is now the only copy
        e.keepalive = None
        self._note_write_failure(error)

    def _note_write_failure(self, error: BaseException) -> None:
        if not self._write_failed:
            log.warning("offload: writing a spill file failed (%s); keeping tensors in memory instead", error)
        self._write_failed = True
        # The future keeps this error, and waiting on it (in pack) added pack's frames to its
        # traceback: the saved tensor and its handle would stay alive in that cycle until gc.
        error.__traceback__ = None

    def _free_host(self, e: _Entry) -> None:
        """Give the entry's host buffer back, once no h2d copy still reads it."""
        if e.host_bytes is not None:
            buf, busy = e.host_bytes, e.host_busy
            e.host_bytes = e.host_busy = None
            self._host_lru.pop(e.seq, None)
            if e.host_pooled:
                if busy is not None and not is_done(busy):
                    self._retiring.append((busy, lambda buf=buf: self.pool.release(buf)))
                else:
                    self.pool.release(buf)

    # ------------------------------------------------------------------ backward

    def unpack(self, h: Handle) -> torch.Tensor:
        with self._lock:
            self._drain_dead()
            e = h.entry
            if h.modified():  # See Note: [version watch]
                now = "a later version" if h.alias is None else f"version {h.alias._version}"
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: {e.describe} is at {now}; expected version {h.version} "
                    "instead (offload checked this because saved-tensor hooks turn off PyTorch's own check)"
                )
            if e.hot:
                return h.alias  # the live tensor itself, detached (autograd makes its own shallow copy)
            self._poll()
            if e.device_bytes is None and e.device_ready is None:
                self.counters.prefetch_misses += 1
                self._load(e)
            else:
                self.counters.prefetch_hits += 1
            if self.config.prefetch:
                self._prefetch(e.seq)
            self._ready(e)
            data = e.device_bytes
            view = h.rebuild(data)
            if h.seen_gen != e.load_gen:
                h.seen_gen = e.load_gen
                e.pending -= 1
                if e.pending <= 0:
                    self._drop_device_copy(e)
            if self.budget is not None and self.counters.resident_bytes > self.budget:
                # Other users of this storage are still to come, but holding it for them would break
                # the budget: let it go (autograd holds this view) and read it again for them.
                self._drop_device_copy(e)
            self._drain_dead()
            self._note_peak()
            return view

    def _load(self, e: _Entry) -> None:
        """Start bringing a moved entry back to the device (prefetch or miss)."""
        e.load_gen += 1
        e.pending = e.refs
        self._loaded_bytes += e.nbytes
        if e.keepalive is not None:
            # Its copy out is still in flight: the source holds the same bytes (and is counted as
            # resident already); adopt it back instead of reading what is not written yet.
            e.device_bytes, e.keepalive = e.keepalive, None
            e.adopted = True
            return
        self.counters.resident_bytes += e.nbytes
        self.counters.reloaded_bytes += e.nbytes
        if not self.cuda:
            buf = torch.empty(e.nbytes, dtype=torch.uint8)
            with _record("offload::read"):
                e.device_ready = self.spill.read(e.disk_path, buf)
            e.device_bytes = buf
            return
        if e.host_bytes is None:
            self._read_to_host(e)
        if e.host_ready is not None:  # the read lands later; _ready() finishes the trip
            e.device_bytes = None
            e.device_ready = e.host_ready
            return
        self._h2d(e)

    def _read_to_host(self, e: _Entry) -> None:
        buf = self.pool.acquire(e.nbytes)
        e.host_pooled = buf is not None
        if buf is None:
            buf = torch.empty(e.nbytes, dtype=torch.uint8)
        e.host_bytes = buf
        with _record("offload::read"):
            e.host_ready = self.spill.read(e.disk_path, buf[: e.nbytes])
        self._reading.append(e)

    def _h2d(self, e: _Entry) -> None:
        with _record("offload::h2d"):
            e.device_bytes, e.device_ready = self.link.h2d(e.host_bytes, e.nbytes)
        e.host_busy = e.device_ready  # See Note: [keep-alive until the copy event]: the buffer too
        self._host_lru.pop(e.seq, None)

    def _ready(self, e: _Entry) -> None:
        """Make the device copy usable by the stream current now; the host waits only if it must."""
        if e.device_ready is None:
            return
        start = time.perf_counter()
        with _record("offload::wait_reload"):
            try:
                if e.host_ready is not None:
                    e.host_ready.result()
                    e.host_ready = None
                    self._h2d(e)
                if is_event(e.device_ready):
                    self.link.wait_on_compute(e.device_ready)
                else:
                    e.device_ready.result()
            except OSError as error:
                self._forget_load(e)
                raise OffloadError(
                    f"offload: reading back the saved tensor {e.describe} from spill file tier failed: {error}"
                ) from error
        e.device_ready = None
        self.counters.reload_wait_ms += (time.perf_counter() - start) * 1e3

    def _forget_load(self, e: _Entry) -> None:
        """A read back failed: undo the load, so a later unpack reads the file again.

        The entry must not keep the failed future: raising its error here added this thread's
        frames to the error's traceback, and those frames hold the graph being unpacked, which
        holds this entry's handles. Kept, the graph, its handles and every spill file would live
        until the engine closed.
        """
        e.device_bytes = e.device_ready = e.host_ready = None
        if e.host_bytes is not None and e.disk_path is not None:  # a read target only; the file is the copy
            self._free_host(e)
        if e in self._reading:
            self._reading.remove(e)
        self._loaded_bytes -= e.nbytes
        self.counters.resident_bytes -= e.nbytes
        self.counters.reloaded_bytes -= e.nbytes

    def _prefetch(self, seq: int) -> None:
        """Start reloading the entries saved just before ``seq`` while they fit the budget."""
        while self._reading:
            # One loop for both cases: a read finished at its use (host_ready None) can sit behind
            # one still in flight, and surfaces at the head only once that one is popped.
            e = self._reading[0]
            if e.host_ready is not None and not e.host_ready.done():
                break
            self._reading.popleft()
            if e.host_ready is not None and not e.dead and e.host_ready.exception() is None:
                e.host_ready = None
                self._h2d(e)  # the disk read of an earlier prefetch landed: start its h2d now
        room = None if self.budget is None else self.budget - self.counters.resident_bytes
        for s in reversed(self._moved):
            if s >= seq:
                continue
            e = self._moved[s]
            if e.device_bytes is not None or e.device_ready is not None:
                continue
            if e.load_gen and e.pending <= 0:
                continue  # already handed to all its users in this pass; a later unpack is a miss
            if room is not None:
                if e.nbytes > room:
                    return
                room -= e.nbytes
            self._load(e)
            if self.cuda and e.host_ready is not None:
                return  # one disk read ahead at a time on CUDA; the h2d follows at use

    def _drop_device_copy(self, e: _Entry) -> None:
        """Every live user has its view: the engine stops holding the reloaded copy."""
        if e.device_bytes is None:
            return
        if e.disk_path is None and e.host_bytes is None:
            return  # the only copy (its spill write failed): dropping it would lose the tensor
        if e.adopted and e.out_ready is not None:
            # Its copy out is still in flight, reading these bytes: See Note: [keep-alive until the
            # copy event]. Hand them back as the copy's source; they stay resident until it lands.
            # Freed now, the copy could read reused memory (CUDA), a reload would race the write,
            # and a write that then failed would leave no copy at all.
            e.keepalive, e.device_bytes = e.device_bytes, None
            e.adopted = False
            self._loaded_bytes -= e.nbytes
            return
        e.device_bytes = None
        self._loaded_bytes -= e.nbytes
        self.counters.resident_bytes -= e.nbytes
        if e.adopted:
            e.adopted = False
            if e.out_ready is None:  # its copy landed while adopted: later unpacks read that copy
                self._stop_watching(e)

    # ------------------------------------------------------------------ release

    def on_handle_dead(self, h: Handle) -> None:
        """Called from ``Handle.__del__`` on any thread, possibly while this thread holds the lock."""
        if self._lock.acquire(blocking=False):
            try:
                self._release_handle(h)
                self._drain_dead()
            finally:
                self._lock.release()
        else:
            self._dead.append((h.entry, h.seen_gen != h.entry.load_gen))

    def _drain_dead(self) -> None:
        while self._dead:
            entry, unseen = self._dead.popleft()
            self._release_entry_ref(entry, unseen)

    def _release_handle(self, h: Handle) -> None:
        self._release_entry_ref(h.entry, h.seen_gen != h.entry.load_gen)

    def _release_entry_ref(self, e: _Entry, unseen: bool) -> None:
        e.refs -= 1
        if unseen and e.device_bytes is not None and not e.hot:
            e.pending -= 1
            if e.pending <= 0 and e.refs > 0:
                self._drop_device_copy(e)
        if e.refs <= 0:
            self._release(e)

    def _release(self, e: _Entry) -> None:
        """Free everything an entry holds; copies still in flight are finished first (in _poll)."""
        e.dead = True
        if self._by_key.get(e.key) is e:
            del self._by_key[e.key]
        if e.hot:
            if self._hot.pop(e.seq, None) is not None:
                self._hot_bytes -= e.nbytes
            else:
                del self._stuck[e.seq]
            self.counters.resident_bytes -= e.nbytes
            e.storage = None
            return
        self._moved.pop(e.seq, None)
        self._host_lru.pop(e.seq, None)
        waits = [w for w in (e.out_ready, e.device_ready, e.host_ready, e.disk_ready) if w is not None]
        if waits:
            self._retiring.append((_AllOf(waits), lambda e=e: self._finish_release(e)))
            self._poll()
        else:
            self._finish_release(e)

    def _finish_release(self, e: _Entry) -> None:
        for queue in (self._inflight, self._writes):
            if e in queue:
                queue.remove(e)
        if e.keepalive is not None:
            e.keepalive = None
            self.counters.resident_bytes -= e.nbytes
        if e.device_bytes is not None or e.device_ready is not None:
            # A load is counted from its start: on CUDA a prefetch whose disk read was still in
            # flight has no device bytes yet (device_ready is that read), but its bytes count.
            e.device_bytes = None
            self._loaded_bytes -= e.nbytes
            self.counters.resident_bytes -= e.nbytes
        e.out_ready = e.device_ready = e.host_ready = e.disk_ready = None
        if self.cuda:
            self._free_host(e)
        if e.disk_path is not None:
            self.spill.remove(e.disk_path)
            e.disk_path = None

    # ------------------------------------------------------------------ engine-level

    def settle(self) -> None:
        """Process releases and completed copies now (used before reading stats and on close)."""
        with self._lock:
            self._drain_dead()
            self._poll()

    def close(self) -> None:
        """Wait for all copies, free every buffer and file. Live handles then fail to unpack."""
        with self._lock:
            self._drain_dead()
            for e in list(self._inflight):
                self._wait_out(e)
            for waitable, _ in self._retiring:
                try:
                    wait(waitable)
                except OSError:
                    pass
            self._poll()
            if self.pool is not None:
                self.pool.clear()
            self.spill.close()

    @property
    def spill_files(self) -> int:
        return self.spill.files


class _AllOf:
    """Several events/futures seen as one waitable."""

    __slots__ = ("items",)

    def __init__(self, items) -> None:
        self.items = items

    def done(self) -> bool:
        return all(is_done(w) for w in self.items)

    def result(self) -> None:
        for w in self.items:
            try:
                wait(w)
            except OSError:
                pass
