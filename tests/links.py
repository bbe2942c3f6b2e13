"""Stand-in links for running the host tier (device -> host -> disk) on the CPU.

The engine takes a link through ``offload.engine(link=...)``; these play the CUDA side streams:

- ``DeferredLink``: a copy happens only when its completion is polled ``delay`` times or waited on,
  so the store's use of a destination before its copy landed reads the 0xFF it was filled with.
- ``ThreadedLink``: copies complete on a background thread after ``delay_s``, concurrently with
  compute, as on a side stream. ``released`` overwrites a host block with 0xFF the moment the
  engine gives it back.
- ``EmulatedCudaLink`` (``tests/hb.py``): ``CudaLink`` itself over CUDA's streams, events and
  caching allocator emulated on the CPU, with the spill file's jobs, under a happens-before race
  detector (vector clocks), so the ordering code of the real link runs here.

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

from hb import POISON, EmulatedCudaLink, EmulatedStreams, Schedule, detecting

__all__ = ["DeferredLink", "EmulatedCudaLink", "EmulatedStreams", "LandsOnCue", "Reads", "ThreadedLink", "link_named"]


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


@contextlib.contextmanager
def link_named(name: str):
    """A link by its test-parameter name: "disk" (None: no host tier), "deferred-N" (a
    DeferredLink landing after N polls) or "threaded" (a ThreadedLink, closed afterwards), each
    reading its sources at completion, or with a "-start" suffix over the copy (``Reads``); or
    "emulated" (``CudaLink`` itself under the race detector, ``hb.detecting``), optionally with a
    schedule: "emulated-timed1", "emulated-adversarial3-0" (``hb.Schedule.named``). Afterwards the
    link must never have copied from a source the engine had let go or changed, nor seen a race."""
    if name == "disk":
        yield None
        return
    if name == "emulated" or name.startswith("emulated-"):
        schedule = Schedule.named(name.removeprefix("emulated-")) if name != "emulated" else Schedule()
        with detecting(schedule) as emulated:
            yield emulated
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
        raise ValueError(
            f"unknown test link {name!r}; use 'disk', 'deferred-N', 'threaded' (each may end in '-start') or "
            "'emulated[-<schedule>]'"
        )
    assert made.sources_gone == 0, "a copy's source was let go before the copy finished"
    assert made.sources_changed == 0, "a copy's source changed while the copy ran (started too early, or freed)"
