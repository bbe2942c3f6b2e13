"""Copies between a CUDA device and pinned host memory, on two side streams: the one module that
touches CUDA streams. Importing it does not initialize CUDA; streams are made on first use.

    compute:  ──fwd k──fence──fwd k+1── ... ──bwd k+1──fence──────────wait(ev)──bwd k──
    d2h:               └wait──d2h k──ev_k ...
    h2d:                                             └wait──h2d k──ev   (one stream per direction,
                                                                        so backward's first reloads
                                                                        never queue behind forward's
                                                                        last copies out)

Note: [keep-alive until the copy event]
    The source of a copy in flight (a device tensor for d2h, a host block for h2d) is kept by
    reference until the copy's event has completed; only then may the caching allocator (or the
    arena) hand its memory to someone else. The store records this as the source copy's
    ``readers``. We do this instead of ``Tensor.record_stream`` so the engine's byte accounting
    stays exact: the bytes count as resident until the event says done.

Note: [one fence per batch]
    A side stream must not start a copy before the compute stream has finished what came before
    it: the kernel that produced a d2h source, and every earlier use of the block an h2d writes
    (allocated from the compute stream's pool, See Note: [reload destination on the compute
    stream]). One event recorded on the compute stream at the start of a batch (one pack, one
    unpack) covers every copy the batch starts: all of their sources were produced, and all blocks
    they reuse were freed, before it, and no compute work is queued inside a batch. So each copy
    costs one event (its own completion), plus one fence per batch, not a ``wait_stream`` each.

Note: [reload destination on the compute stream]
    A reload destination is allocated while the compute stream is current, so the allocator ties
    the block to the stream that will use and free it. The h2d stream waits for the batch's fence
    (the block may have been used there before), writes it, and the compute stream waits on the
    copy's event at the point of use, never earlier.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Optional, Protocol

import torch

from ._pending import Pending

__all__ = ["CudaLink", "Link"]


class Link(Protocol):
    """The transport between a device and host memory; ``offload.engine(link=...)`` takes one.

    Copies return pendings (``offload._pending.Pending``); ``h2d`` allocates its destination.
    ``released`` is told when the engine lets a host buffer go (a test link may poison it).
    """

    def batch(self) -> contextlib.AbstractContextManager[None]: ...

    def d2h(self, src_device: torch.Tensor, dst_host: torch.Tensor) -> Pending: ...

    def h2d(self, src_host: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, Pending]: ...

    def released(self, host: torch.Tensor) -> None: ...

    def synchronize(self) -> None: ...

    def busy_ms(self) -> tuple[float, float, float]: ...


class _CopyEvent:
    """A copy's completion event, as a pending. ``order_compute`` is the GPU-side wait at use.

    For an h2d it also knows the destination and the stream it was allocated on: a destination
    used on another stream (a prefetch started by one stream's node, used by another's) is
    recorded on the user's stream, so the allocator does not hand its block back to the
    allocating stream while the user's kernels still read it.
    """

    __slots__ = ("event", "link", "dst", "alloc_stream")
    blocks_host = False

    def __init__(
        self,
        event: "torch.cuda.Event",
        link: "CudaLink",
        dst: Optional[torch.Tensor] = None,
        alloc_stream: Optional["torch.cuda.Stream"] = None,
    ) -> None:
        self.event, self.link, self.dst, self.alloc_stream = event, link, dst, alloc_stream

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def error(self) -> None:
        return None

    def order_compute(self) -> None:
        self.link.wait_on_compute(self.event)
        if self.dst is not None:
            current = torch.cuda.current_stream(self.link.device)
            if current != self.alloc_stream:
                self.dst.record_stream(current)


class _Direction:
    """One side stream, the fence it last waited for, and its busy time per batch (CUDA events)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Optional["torch.cuda.Stream"] = None
        self.fenced: Optional[object] = None  # the batch whose fence this stream waited for
        self.spans: collections.deque = collections.deque()  # (start, end) events, until folded
        self.busy_ms = 0.0
        self._start: Optional["torch.cuda.Event"] = None
        self._last: Optional["torch.cuda.Event"] = None

    def enter(self, batch: object, fence: "torch.cuda.Event") -> "torch.cuda.Stream":
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        if self.fenced is not batch:
            self.stream.wait_event(fence)
            self.fenced = batch
            self._open_span()
        elif self._last is not None and self._last.query():
            # The stream ran dry inside this batch (the host waited between two copies, e.g. for
            # spill writes to make host room): that idle gap is not busy time.
            self._close_span()
            self._open_span()
        return self.stream

    def _open_span(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record(self.stream)

    def finish_copy(self) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        self._last = event
        return event

    def _close_span(self) -> None:
        if self._start is not None and self._last is not None:
            self.spans.append((self._start, self._last))
        self._start = self._last = None

    def close_batch(self) -> None:
        self._close_span()
        self.fold()

    def fold(self) -> float:
        """Add the spans that have finished (they finish in order on one stream) to ``busy_ms``.

        Run at every batch's end, so the events do not pile up when nobody reads the stats."""
        while self.spans and self.spans[0][1].query():
            start, end = self.spans.popleft()
            self.busy_ms += start.elapsed_time(end)
        return self.busy_ms


class CudaLink:
    """Two side streams of one CUDA device (d2h, h2d) and the copies over them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._d2h = _Direction(device)
        self._h2d = _Direction(device)
        self._batch: Optional[object] = None
        self._fence: Optional["torch.cuda.Event"] = None
        self._stalls: collections.deque = collections.deque()  # (before, after) around waits that had to wait
        self._stall_ms = 0.0

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """One pack or unpack: copies started inside share one fence. See Note: [one fence per batch]."""
        if self._batch is not None:
            raise RuntimeError("offload internal error: link batches do not nest (the store's lock is not re-entrant)")
        self._batch = object()
        self._fence = None
        try:
            yield
        finally:
            self._d2h.close_batch()
            self._h2d.close_batch()
            self._batch = self._fence = None

    def _fence_now(self) -> "torch.cuda.Event":
        if self._fence is None:
            self._fence = torch.cuda.Event()
            self._fence.record(torch.cuda.current_stream(self.device))
        return self._fence

    def _enter(self, direction: _Direction) -> "torch.cuda.Stream":
        if self._batch is None:
            raise RuntimeError("offload internal error: a copy was started outside link.batch()")
        return direction.enter(self._batch, self._fence_now())

    def before_copy(self, stream: "torch.cuda.Stream") -> None:
        """Called on the side stream (current) before each copy is queued; nothing by default.
        Race tests override it to delay a side stream (``torch.cuda._sleep``)."""

    def d2h(self, src_device: torch.Tensor, dst_host: torch.Tensor) -> _CopyEvent:
        """Start copying ``src_device`` (uint8) into the front of pinned ``dst_host``.

        See Note: [keep-alive until the copy event]: the caller keeps ``src_device`` until it is done.
        """
        stream = self._enter(self._d2h)
        with torch.cuda.stream(stream):
            self.before_copy(stream)
            dst_host[: src_device.numel()].copy_(src_device, non_blocking=True)
        return _CopyEvent(self._d2h.finish_copy(), self)

    def h2d(self, src_host: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, _CopyEvent]:
        """Start copying ``nbytes`` of pinned ``src_host`` to a new device tensor; returns (tensor, pending).

        See Note: [reload destination on the compute stream].
        """
        alloc_stream = torch.cuda.current_stream(self.device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        stream = self._enter(self._h2d)
        with torch.cuda.stream(stream):
            self.before_copy(stream)
            dst.copy_(src_host[:nbytes], non_blocking=True)
        return dst, _CopyEvent(self._h2d.finish_copy(), self, dst=dst, alloc_stream=alloc_stream)

    def wait_on_compute(self, event: "torch.cuda.Event") -> None:
        """Make the current stream wait for ``event`` (GPU-side); time the stall if there is one."""
        compute = torch.cuda.current_stream(self.device)
        if event.query():
            return
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(event)
        after.record(compute)
        self._stalls.append((before, after))
        self._fold_stalls()

    def _fold_stalls(self) -> None:
        while self._stalls and self._stalls[0][1].query():
            before, after = self._stalls.popleft()
            self._stall_ms += before.elapsed_time(after)

    def released(self, host: torch.Tensor) -> None:
        return None

    def synchronize(self) -> None:
        """Wait until both side streams have finished every copy queued on them."""
        for direction in (self._d2h, self._h2d):
            if direction.stream is not None:
                direction.stream.synchronize()

    def busy_ms(self) -> tuple[float, float, float]:
        """(d2h busy, h2d busy, compute stall) in ms, over the copies and waits finished so far."""
        self._fold_stalls()
        return self._d2h.fold(), self._h2d.fold(), self._stall_ms
