"""Stand-in links for running the host tier (device -> host -> disk) on the CPU.

The engine takes a link through ``offload.engine(link=...)``; these two play the CUDA side streams:

- ``DeferredLink``: a copy happens only when its completion is polled ``delay`` times or waited on,
  so the store's use of a destination before its copy landed reads the 0xFF it was filled with.
- ``ThreadedLink``: copies complete on a background thread after ``delay_s``, concurrently with
  compute, as on a side stream. A d2h reads its source only when it completes, through a weak
  reference: if the engine let the source go before then (the keep-alive removed), the copy
  writes 0xFF instead (on a GPU it would read reused memory). An h2d reads its host block only
  when it completes, and ``released`` overwrites a block with 0xFF the moment the engine gives
  it back: a block freed before its h2d finished yields garbage. Either way gradients differ.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import torch

POISON = 0xFF


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

    def __init__(self, delay: int = 3) -> None:
        self.delay = delay
        self.d2h_count = self.h2d_count = 0

    def batch(self):
        return contextlib.nullcontext()

    def d2h(self, src, dst_host):
        self.d2h_count += 1
        n = src.numel()
        return _Polled(lambda: dst_host[:n].copy_(src), self.delay)

    def h2d(self, src_host, nbytes):
        self.h2d_count += 1
        dst = torch.full((nbytes,), POISON, dtype=torch.uint8)  # garbage until the copy lands
        return dst, _Polled(lambda: dst.copy_(src_host[:nbytes]), self.delay)

    def released(self, host) -> None:
        host.fill_(POISON)

    def synchronize(self) -> None:
        return None  # a copy lands when it is waited on; the store waits for the ones it needs

    def busy_ms(self):
        return 0.0, 0.0, 0.0


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

    def __init__(self, delay_s: float = 0.002) -> None:
        self.delay_s = delay_s
        self.d2h_count = self.h2d_count = 0
        self.sources_gone = 0
        """d2h copies whose source the engine had let go before they completed (must stay 0)."""
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
        n, offset = src.numel(), src.storage_offset()
        weak = src.untyped_storage()._weak_ref()  # the link itself does not keep the source alive

        def copy() -> None:
            storage = None if torch.UntypedStorage._expired(weak) else torch.UntypedStorage._new_with_weak_ptr(weak)
            torch.UntypedStorage._free_weak_ref(weak)
            if storage is None:
                self.sources_gone += 1
                dst_host[:n].fill_(POISON)
                return
            source = torch.empty(0, dtype=torch.uint8).set_(storage, offset, (n,), (1,))
            dst_host[:n].copy_(source)

        return self._later(copy)

    def h2d(self, src_host, nbytes):
        self.h2d_count += 1
        dst = torch.full((nbytes,), POISON, dtype=torch.uint8)  # garbage until the copy lands
        return dst, self._later(lambda: dst.copy_(src_host[:nbytes]))

    def released(self, host) -> None:
        host.fill_(POISON)  # a block given back while an h2d still reads it yields garbage

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
    DeferredLink landing after N polls) or "threaded" (a ThreadedLink, closed afterwards, which
    must never have copied from a source the engine had already let go)."""
    if name == "disk":
        yield None
    elif name.startswith("deferred-"):
        yield DeferredLink(int(name.split("-")[1]))
    elif name == "threaded":
        made = ThreadedLink(delay_s=0.002)
        try:
            yield made
        finally:
            made.close()
        assert made.sources_gone == 0, "a copy's source was let go before the copy finished"
    else:
        raise ValueError(f"unknown test link {name!r}; use 'disk', 'deferred-N' or 'threaded'")
