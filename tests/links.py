"""Stand-in links for running the host tier (device -> host -> disk) on the CPU.

The engine takes a link through ``offload.engine(link=...)``; these play the CUDA side streams:

- ``DeferredLink``: a copy happens only when its completion is polled ``delay`` times or waited on,
  so the store's use of a destination before its copy landed reads the 0xFF it was filled with.
- ``ThreadedLink``: copies complete on a background thread after ``delay_s``, concurrently with
  compute, as on a side stream. ``released`` overwrites a host block with 0xFF the moment the
  engine gives it back.
- ``EmulatedStreams`` (with ``CudaLink`` itself, see below): CUDA's streams and events emulated on
  the CPU, so the ordering code of the real link runs here.

When the first two read a copy's source is their ``Reads`` mode:

- ``Reads.AT_COMPLETION``: when the copy completes, through a weak reference for a d2h (a source
  the engine let go first yields 0xFF). Kind to a source that is not ready yet: a copy started from
  a host block that a disk read is still filling reads it after the read has landed.
- ``Reads.OVER_THE_COPY``: as a stream does: the bytes are taken when the copy starts, and when it
  completes the source must still be alive and unchanged, else the copy yields 0xFF. A copy
  started before its source was filled, or whose source was given back (and poisoned) or let go
  while it ran, gives garbage. This is the mode to find races with; the other stays to show what
  it hides.

Either way a wrong byte shows up as wrong gradients, and the link counts what it saw.
"""

from __future__ import annotations

import contextlib
import enum
import queue
import threading
import time

import torch

from offload._transfer import CudaLink

POISON = 0xFF


class Reads(enum.Enum):
    """When a stand-in link reads a copy's source (see the module docstring)."""

    AT_COMPLETION = "completion"
    OVER_THE_COPY = "start"


class _Source:
    """A copy's source as the link sees it: a 1-D uint8 tensor, held weakly (its storage) so the
    link itself never keeps it alive, and, reading over the copy, the bytes it had at the start."""

    def __init__(self, src: torch.Tensor, reads: Reads) -> None:
        self.n, self.offset = src.numel(), src.storage_offset()
        self.weak = src.untyped_storage()._weak_ref()
        self.taken = src.clone() if reads is Reads.OVER_THE_COPY else None

    def bytes_now(self):
        """The source's bytes now, or None if the engine let its storage go."""
        weak, self.weak = self.weak, None
        storage = None if torch.UntypedStorage._expired(weak) else torch.UntypedStorage._new_with_weak_ptr(weak)
        torch.UntypedStorage._free_weak_ref(weak)
        if storage is None:
            return None
        return torch.empty(0, dtype=torch.uint8).set_(storage, self.offset, (self.n,), (1,))

    def __del__(self) -> None:
        if self.weak is not None:  # a copy that never completed (its link closed)
            torch.UntypedStorage._free_weak_ref(self.weak)


class _Copier:
    """Carries out one copy for a link: what its ``Reads`` mode reads, checked as that mode says."""

    def __init__(self, link, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.link, self.dst = link, dst
        self.source = _Source(src, link.reads)

    def __call__(self) -> None:
        now = self.source.bytes_now()
        taken = self.source.taken
        if now is None:
            self.link.sources_gone += 1
            self.dst.fill_(POISON)
        elif taken is not None and not torch.equal(now, taken):
            self.link.sources_changed += 1
            self.dst.fill_(POISON)
        else:
            self.dst.copy_(now if taken is None else taken)


class _Polled:
    """Completes when polled ``delay`` times (``done``) or waited on."""

    blocks_host = True

    def __init__(self, copy, delay: int) -> None:
        self._copy, self._polls, self._delay = copy, 0, delay

    def _finish(self) -> None:
        if self._copy is not None:
            self._copy()
            self._copy = None

    def done(self) -> bool:
        self._polls += 1
        if self._polls >= self._delay:
            self._finish()
        return self._copy is None

    def wait(self) -> None:
        self._finish()

    def error(self):
        return None

    def order_compute(self) -> None:
        self._finish()  # the compute stream waits: on the CPU that means the copy is done


class DeferredLink:
    """Copies happen when their completion is polled enough, or waited on."""

    def __init__(self, delay: int = 3, reads: Reads = Reads.AT_COMPLETION) -> None:
        self.delay, self.reads = delay, reads
        self.d2h_count = self.h2d_count = 0
        self.sources_gone = self.sources_changed = 0

    def batch(self):
        return contextlib.nullcontext()

    def d2h(self, src, dst_host):
        self.d2h_count += 1
        return _Polled(_Copier(self, src, dst_host[: src.numel()]), self.delay)

    def h2d(self, src_host, nbytes):
        self.h2d_count += 1
        dst = torch.full((nbytes,), POISON, dtype=torch.uint8)  # garbage until the copy lands
        return dst, _Polled(_Copier(self, src_host[:nbytes], dst), self.delay)

    def released(self, host) -> None:
        host.fill_(POISON)

    def synchronize(self) -> None:
        return None  # a copy lands when it is waited on; the store waits for the ones it needs

    def busy_ms(self):
        return 0.0, 0.0, 0.0


class LandsOnCue(DeferredLink):
    """A DeferredLink whose copies out never land by polling, only when waited on or ``land()`` is
    called: a test decides the moment a copy out lands."""

    def __init__(self, reads: Reads = Reads.AT_COMPLETION) -> None:
        super().__init__(delay=10**9, reads=reads)
        self.out: list = []

    def d2h(self, src, dst_host):
        pending = super().d2h(src, dst_host)
        self.out.append(pending)
        return pending

    def land(self) -> None:
        for pending in self.out:
            pending.wait()


class _Threaded:
    """Completes on the link's thread; ``wait`` blocks until then."""

    blocks_host = True

    def __init__(self) -> None:
        self._event = threading.Event()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()

    def error(self):
        return None

    def order_compute(self) -> None:
        self._event.wait()


class ThreadedLink:
    """Copies complete on a background thread ``delay_s`` after they start (see the module doc)."""

    def __init__(self, delay_s: float = 0.002, reads: Reads = Reads.AT_COMPLETION) -> None:
        self.delay_s, self.reads = delay_s, reads
        self.d2h_count = self.h2d_count = 0
        self.sources_gone = 0
        """Copies whose source the engine had let go before they completed (must stay 0)."""
        self.sources_changed = 0
        """``Reads.OVER_THE_COPY``: copies whose source changed while they ran (must stay 0)."""
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="offload-test-link", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            due, copy, pending = self._queue.get()
            if copy is None:
                return
            time.sleep(max(0.0, due - time.monotonic()))
            copy()
            pending._event.set()

    def _later(self, copy) -> _Threaded:
        pending = _Threaded()
        self._queue.put((time.monotonic() + self.delay_s, copy, pending))
        return pending

    def batch(self):
        return contextlib.nullcontext()

    def d2h(self, src, dst_host):
        self.d2h_count += 1
        return self._later(_Copier(self, src, dst_host[: src.numel()]))

    def h2d(self, src_host, nbytes):
        self.h2d_count += 1
        dst = torch.full((nbytes,), POISON, dtype=torch.uint8)  # garbage until the copy lands
        return dst, self._later(_Copier(self, src_host[:nbytes], dst))

    def released(self, host) -> None:
        host.fill_(POISON)  # a block given back while a copy still reads it yields garbage

    def synchronize(self) -> None:
        done = threading.Event()
        self._queue.put((time.monotonic(), done.set, _Threaded()))  # copies complete in order
        done.wait()

    def busy_ms(self):
        return 0.0, 0.0, 0.0

    def close(self) -> None:
        self._queue.put((0.0, None, None))
        self._thread.join()


# ---------------------------------------------------------------------------------- emulated streams
#
# CUDA's stream semantics on the CPU, for ``CudaLink`` itself (``EmulatedCudaLink``): each stream is
# a thread running its queue in order (``delay_s`` before each item), an event is set when its
# stream reaches it, ``wait_event`` makes a stream wait for it, and the host (the test's thread)
# runs its own work at once. Timing alone would find a missing wait only by luck, so the streams
# also keep vector clocks (who has waited for whom, through events, and what the host has seen
# completed), and every tracked access (a copy's read and write, an allocation's fill, a test's
# producer, a host write) is checked against the earlier accesses to the same bytes: two that
# overlap, one of them a write, neither ordered before the other, are a race. A race is recorded
# in ``races`` and the op writes 0xFF instead of its data, so the gradients show it too. The
# host's own compute (the model's ops) is not tracked: it is done when the host moves on.


class _Record:
    """One ``record`` of an event: set when its stream reaches it, with that stream's clock."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.clock: dict = {}
        self.time = 0.0


class EmulatedEvent:
    """``torch.cuda.Event`` on emulated streams (never recorded: complete, as CUDA has it)."""

    def __init__(self, streams: EmulatedStreams) -> None:
        self._streams, self._record = streams, None

    def record(self, stream: EmulatedStream) -> None:
        record = self._record = _Record()

        def mark() -> None:
            record.clock, record.time = dict(stream.clock), time.perf_counter()
            record.done.set()

        stream.enqueue(mark)

    def query(self) -> bool:
        record = self._record
        if record is None:
            return True
        if record.done.is_set():
            self._streams.host_learns(record.clock)
            return True
        return False

    def synchronize(self) -> None:
        record = self._record
        if record is not None:
            record.done.wait()
            self._streams.host_learns(record.clock)

    def elapsed_time(self, end: EmulatedEvent) -> float:
        assert self._record is not None and end._record is not None
        return (end._record.time - self._record.time) * 1e3


class EmulatedStream:
    """A stream: a thread running its queue in order. The host's own work runs on whichever stream
    is current (the compute stream, ``host_bound``, unless a test made another current): a wait for
    an event there blocks the host too, as the host's next op would be the next kernel there."""

    def __init__(self, streams: EmulatedStreams, index: int, delay_s: float, host_bound: bool = False) -> None:
        self.streams, self.index, self.delay_s, self.host_bound = streams, index, delay_s, host_bound
        self.clock = {index: 0}
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"emulated-stream-{index}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"EmulatedStream({self.index})"

    def _run(self) -> None:
        while True:
            host_clock, op = self._queue.get()
            if op is None:
                return
            if self.delay_s:
                time.sleep(self.delay_s)
            with self.streams.lock:
                _merge(self.clock, host_clock)
                self.clock[self.index] += 1
            op()

    def enqueue(self, op) -> None:
        """Queue ``op`` (run on this stream's thread, after everything the host has seen complete)."""
        self._queue.put((self.streams.host_clock_now(), op))

    def wait_event(self, event: EmulatedEvent) -> None:
        record = event._record
        if record is not None:

            def wait() -> None:
                record.done.wait()
                with self.streams.lock:
                    _merge(self.clock, record.clock)

            self.enqueue(wait)
        if self.host_bound or self.streams.current() is self:
            self.synchronize()

    def wait_stream(self, other: EmulatedStream) -> None:
        event = EmulatedEvent(self.streams)
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        event = EmulatedEvent(self.streams)
        event.record(self)
        event.synchronize()

    def close(self) -> None:
        self._queue.put(({}, None))
        self._thread.join()


def _merge(clock: dict, other: dict) -> None:
    for key, value in other.items():
        if clock.get(key, 0) < value:
            clock[key] = value


HOST = 0
"""The host's index in the vector clocks."""


class EmulatedStreams:
    """``offload._transfer.Streams`` on the CPU (see above). ``fills_new_memory``: ``empty`` queues a
    0xFF fill on the current stream, as ``torch.empty`` does under deterministic algorithms with
    ``fill_uninitialized_memory``. ``side_delay_s``: how long each item on a side stream waits."""

    def __init__(self, side_delay_s: float = 0.001, fills_new_memory: bool = False) -> None:
        self.side_delay_s, self.fills_new_memory = side_delay_s, fills_new_memory
        self.lock = threading.Lock()
        self.host_clock = {HOST: 0}
        self.races: list[str] = []
        self.sources_gone = 0
        self.recorded: list = []  # (data_ptr, stream) of every record_stream
        self._accesses: list = []  # (lo, hi, writes, who, clock value, what)
        self._streams: list[EmulatedStream] = []
        self._local = threading.local()
        self.compute = self._new(0.0, host_bound=True)

    def _new(self, delay_s: float, host_bound: bool = False) -> EmulatedStream:
        stream = EmulatedStream(self, len(self._streams) + 1, delay_s, host_bound)
        self._streams.append(stream)
        return stream

    def close(self) -> None:
        for stream in self._streams:
            stream.close()

    # --------------------------------------------------------------- what CudaLink asks (Streams)

    def current(self) -> EmulatedStream:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self.compute

    def new_stream(self) -> EmulatedStream:
        return self._new(self.side_delay_s)

    def event(self, timing: bool = False) -> EmulatedEvent:
        return EmulatedEvent(self)

    @contextlib.contextmanager
    def using(self, stream: EmulatedStream):
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()

    def empty(self, nbytes: int) -> torch.Tensor:
        dst = torch.full((nbytes,), POISON, dtype=torch.uint8)  # garbage until written
        if self.fills_new_memory:
            self.write_on(self.current(), dst, lambda: dst.fill_(POISON), "the fill of a new allocation")
        return dst

    def allocation_queues_work(self) -> bool:
        return self.fills_new_memory

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream, source = self.current(), _Source(src, Reads.AT_COMPLETION)

        def run() -> None:
            now = source.bytes_now()
            with self.lock:
                raced = self._access(stream, now, False, "a copy's read") if now is not None else False
                raced = self._access(stream, dst, True, "a copy's write") or raced
            if now is None:
                self.sources_gone += 1
            if now is None or raced:
                dst.fill_(POISON)
            else:
                dst.copy_(now)

        stream.enqueue(run)

    def record_stream(self, tensor: torch.Tensor, stream: EmulatedStream) -> None:
        self.recorded.append((tensor.data_ptr(), stream))

    # --------------------------------------------------------------- what tests do on streams

    def write_on(self, stream: EmulatedStream, tensor: torch.Tensor, write, what: str) -> None:
        """Queue ``write()`` on ``stream`` as a tracked write of ``tensor`` (a producer, a fill)."""

        def run() -> None:
            with self.lock:
                raced = self._access(stream, tensor, True, what)
            tensor.fill_(POISON) if raced else write()

        stream.enqueue(run)

    def host_write(self, tensor: torch.Tensor, value: int) -> None:
        """The host writes ``value`` into ``tensor`` now (a host block given back), tracked."""
        with self.lock:
            self.host_clock[HOST] += 1
            self._access(None, tensor, True, "a host write")
        tensor.fill_(value)

    # --------------------------------------------------------------- clocks and the race check

    def host_clock_now(self) -> dict:
        with self.lock:
            return dict(self.host_clock)

    def host_learns(self, clock: dict) -> None:
        with self.lock:
            _merge(self.host_clock, clock)

    def _access(self, stream, tensor: torch.Tensor, writes: bool, what: str) -> bool:
        """Check and log one access (lock held); True if it races an earlier one."""
        lo = tensor.data_ptr()
        hi = lo + tensor.numel() * tensor.element_size()
        clock, who = (self.host_clock, HOST) if stream is None else (stream.clock, stream.index)
        raced = False
        kept = []
        for entry in self._accesses:
            e_lo, e_hi, e_writes, e_who, e_value, e_what = entry
            overlaps = e_lo < hi and lo < e_hi
            ordered = e_who == who or clock.get(e_who, 0) >= e_value
            if overlaps and (writes or e_writes) and not ordered:
                raced = True
                self.races.append(f"{what} on {who} races {e_what} on {e_who} at [{lo:#x}, {hi:#x})")
            if not (overlaps and ordered and writes and e_lo >= lo and e_hi <= hi):
                kept.append(entry)  # an access a later ordered write covers can no longer race
        kept.append((lo, hi, writes, who, clock[who], what))
        self._accesses = kept
        return raced


class EmulatedCudaLink(CudaLink):
    """``CudaLink`` itself on the CPU, over ``EmulatedStreams``; a host block the engine gives back
    is overwritten with 0xFF by the host at once (tracked: a copy still reading it races it)."""

    def __init__(self, streams: EmulatedStreams | None = None, slabs=None) -> None:
        super().__init__(torch.device("cpu"), streams=streams or EmulatedStreams(), slabs=slabs)
        self.emulated: EmulatedStreams = self.streams  # type: ignore[assignment]  # the one passed above
        self.d2h_count = self.h2d_count = 0

    def d2h(self, src_device, dst_host):
        self.d2h_count += 1
        return super().d2h(src_device, dst_host)

    def h2d(self, src_host, nbytes):
        self.h2d_count += 1
        return super().h2d(src_host, nbytes)

    def released(self, host: torch.Tensor) -> None:
        self.emulated.host_write(host, POISON)

    @property
    def sources_gone(self) -> int:
        return self.emulated.sources_gone

    def close(self) -> None:
        self.emulated.close()


@contextlib.contextmanager
def link_named(name: str):
    """A link by its test-parameter name: "disk" (None: no host tier), "deferred-N" (a
    DeferredLink landing after N polls) or "threaded" (a ThreadedLink, closed afterwards), each
    reading its sources at completion, or with a "-start" suffix over the copy (``Reads``); or
    "emulated" (``CudaLink`` itself over ``EmulatedStreams``). Afterwards the link must never have
    copied from a source the engine had let go or changed, nor seen a race."""
    if name == "disk":
        yield None
        return
    if name == "emulated":
        emulated = EmulatedCudaLink()
        try:
            yield emulated
        finally:
            emulated.close()
        assert emulated.emulated.races == [], emulated.emulated.races[:3]
        assert emulated.sources_gone == 0, "a copy's source was let go before the copy finished"
        return
    base = name.removesuffix("-start")
    reads = Reads.AT_COMPLETION if base == name else Reads.OVER_THE_COPY
    made: DeferredLink | ThreadedLink
    if base.startswith("deferred-"):
        made = DeferredLink(int(base.split("-")[1]), reads=reads)
        yield made
    elif base == "threaded":
        made = ThreadedLink(delay_s=0.002, reads=reads)
        try:
            yield made
        finally:
            made.close()
    else:
        raise ValueError(f"unknown test link {name!r}; use 'disk', 'deferred-N', 'threaded' (each may end in '-start')")
    assert made.sources_gone == 0, "a copy's source was let go before the copy finished"
    assert made.sources_changed == 0, "a copy's source changed while the copy ran (started too early, or freed)"
