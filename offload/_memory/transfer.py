"""Copies between a CUDA device and pinned host memory, on two side streams: the one module that
touches CUDA streams. Importing it does not initialize CUDA; streams are made on first use.

    compute:  ──fwd k──fence──fwd k+1── ... ──bwd k+1──alloc──fence──────────wait(ev)──bwd k──
    d2h:               └wait──d2h k──ev_k ...
    h2d:                                                   └wait──h2d k──ev   (one stream per direction,
                                                                              so backward's first reloads
                                                                              never queue behind forward's
                                                                              last copies out)

``CudaLink`` asks everything of the device through ``Streams`` (``CudaStreams``: torch.cuda's), so
the tests can run its ordering on the CPU over emulated streams (``tests/links.py``).

Note: [keep-alive until the copy event]
    The source of a copy in flight (a device tensor for d2h, a host block for h2d) is kept by
    reference until the copy's event has completed; only then may the caching allocator (or the
    arena) hand its memory to someone else. The store records this as the source copy's
    ``readers``. We do this instead of ``Tensor.record_stream`` so the engine's byte accounting
    stays exact: the bytes count as resident until the event says done.

Note: [fences before a copy]
    A side stream starts a copy only after waiting for fences: events recorded on the streams
    whose work the copy depends on, what it reads and what it overwrites. One fence per stream
    per batch (one pack, one unpack) serves every copy the batch starts; a stream waits for each
    fence once.
    - d2h: the source was produced on the stream that saved it (or on one that stream waited for),
      and the oldest entry is evicted later, maybe while another stream is current (a forward on a
      side stream, an overlapped block). So the link remembers every stream current at a batch
      (``_producers``), and a d2h waits for a fence on each: all their work so far, the producer's
      included. With one stream that is one fence per batch; a stream that did not produce this
      tensor only delays the copy, never corrupts it. The set is started over whenever no saved
      tensor is left to copy out (``forget_producers``, asked by the store as a step starts with
      nothing hot, and only where one store uses the link): a program that runs each step on a
      new stream would otherwise have each copy out wait on a fence of every stream it ever used.
    - h2d: the destination block comes from the compute stream's pool, so the copy must follow every
      earlier use of the block there and the block's own allocation. A fence recorded on the compute
      stream after the destination was allocated covers both. Usually an allocation queues no work,
      and no compute work is queued inside a batch, so the batch's first fence covers its later
      copies too. But under ``torch.use_deterministic_algorithms`` with
      ``torch.utils.deterministic.fill_uninitialized_memory``, ``torch.empty`` queues a fill kernel
      on the current stream (ATen's ``empty_cuda``): then each destination gets a fence of its own,
      after its fill, or a later reload of the batch (a miss and then prefetches) would have its
      landed bytes overwritten by its late fill.

Note: [reload destination on the compute stream]
    A reload destination is allocated while the compute stream is current, so the allocator ties
    the block to the stream that will use and free it. The h2d stream waits for a fence recorded
    after the allocation (See Note: [fences before a copy]), writes it, and the compute stream
    waits on the copy's event at the point of use, never earlier.

Note: [every wait unconditional under the sanitizer]
    The wait at use is skipped when the copy's event has already completed (``query()``): the
    stream is then ordered after it anyway. PyTorch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``)
    sees stream waits and synchronizations but not a query's answer, so to it a skipped wait reads
    as a race. With ``always_wait`` (``OFFLOAD_ALWAYS_WAIT=1``, and on by itself under the
    sanitizer) the stream waits at every use, done or not: what the sanitizer checks is then the
    protocol itself. Two more answers it cannot see are made visible under ``always_wait``:
    a copy found done by ``query()`` is also synchronized (free once it is done), since the store
    then lets go of the copy's source (a ``set_``, which the sanitizer reads as a write on the
    compute stream); and each reload destination gets a fence of its own, since the sanitizer
    reads the ``empty`` that makes it as a write on the compute stream after the batch's fence.
    That is the sanitizer's model of an allocation, not work on the stream: what makes the fence
    needed outside the sanitizer is the fill ``empty`` may queue, which the sanitizer does not see
    as such (See Note: [fences before a copy]); under it the fence answers the write it does see.

Note: [events back to their pool]
    A CUDA event costs a driver call to create and another to destroy, and one was made per copy,
    per fence and per stall timed. They come from two pools instead (timing and plain), and go
    back when nothing will ask about their latest record: re-recording an event changes what a
    later query, synchronize or stream wait on it refers to, while a stream wait already queued
    keeps the record it was made against (``cudaStreamWaitEvent`` takes the event as it is at the
    call). So a fence goes back when its batch ends (its streams have queued their waits), a
    span's start and a stall's two events once their times are folded, and a copy's event when
    its pending (``_CopyEvent``) is collected: the store holds the pending as long as anything may
    wait on the copy, and a busy span that ends at the copy holds it too. Streams are never made
    per copy: two side streams per link, and the current stream's object is kept per stream
    (``CudaStreams.current``), not built anew at each pack and unpack.

Note: [a reload used on another stream]
    Autograd runs each backward node on its forward's stream, so a destination allocated on one
    stream (the unpack that missed it, or the one whose prefetch started it) may be used on
    another. The caching allocator knows only the allocating stream: freed, the block could go to a
    new tensor there while the user's kernels still read it. So every use on another stream is
    recorded on that stream (``record_stream``), ready or not: the store asks at every use
    (``order_compute``), not only while the copy fills. The allocator then keeps the block until
    the user's work is done; the engine stops counting its bytes when it drops the copy, that much
    earlier.
"""

from __future__ import annotations

import collections
import contextlib
import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch

from .pending import Pending

if TYPE_CHECKING:
    from .arena import PinnedSlabs

__all__ = ["ALWAYS_WAIT_ENV", "CudaLink", "CudaStreams", "Link", "Streams"]

POOL_MAX_EVENTS = 256
"""Idle events an event pool keeps for reuse (a step's copies in flight are far fewer); one given
back beyond it is dropped. See Note: [events back to their pool]."""
KNOWN_STREAMS_MAX = 64
"""Current-stream objects ``CudaStreams.current`` keeps; more (a program making streams without end)
and it starts over."""

ALWAYS_WAIT_ENV = "OFFLOAD_ALWAYS_WAIT"
"""Set to 1, every wait at use is a stream wait (See Note: [every wait unconditional under the sanitizer])."""
SANITIZER_ENV = "TORCH_CUDA_SANITIZER"
"""PyTorch's switch for its CUDA sanitizer (the ``_sanitizer`` module of ``torch.cuda``, not imported
on a CPU build): it turns ``always_wait`` on too."""


def _always_wait_from_env() -> bool:
    return os.environ.get(ALWAYS_WAIT_ENV, "") == "1" or SANITIZER_ENV in os.environ  # as torch reads it


class Link(Protocol):
    """The transport between a device and host memory; ``offload.engine(seams=offload.Seams(link=...))`` takes one.

    Copies return pendings (``offload.seams.Pending``); ``h2d`` allocates its destination.
    ``released`` is told when the engine lets a host buffer go (a test link may poison it). A link
    that stands in for the whole machine (an emulator) may also offer ``host`` (an
    ``offload.seams.Host``), used where ``offload.engine(host=...)`` gives none (a host given
    replaces it): its spill file's I/O then runs on the emulator's schedule too.
    """

    def batch(self) -> contextlib.AbstractContextManager[None]: ...

    def d2h(self, src_device: torch.Tensor, dst_host: torch.Tensor) -> Pending: ...

    # Optional: ``d2h_all(srcs, dsts) -> Pending``, several copies out behind one set of fences
    # with one completion, which the host tier uses for a batch where a link has it; and
    # ``attach()``, ``detach()`` and ``forget_producers()``: a store says it uses the link, stops,
    # and has no saved tensor left to copy out.

    def h2d(self, src_host: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, Pending]: ...

    def released(self, host: torch.Tensor) -> None: ...

    def synchronize(self) -> None: ...

    def busy_ms(self) -> tuple[float, float, float]: ...


class Streams(Protocol):
    """What ``CudaLink`` asks of its device: streams (``wait_event``, ``synchronize``), events
    (``record``, ``query``, ``synchronize``, ``elapsed_time``), and memory."""

    def current(self) -> Any:
        """The device's current stream."""

    def new_stream(self) -> Any: ...

    def event(self, timing: bool = False) -> Any: ...

    def using(self, stream: Any) -> contextlib.AbstractContextManager:
        """Make ``stream`` current inside the block."""

    def empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of uint8 on the device, from the current stream's pool."""

    def allocation_queues_work(self) -> bool:
        """Whether ``empty`` queues work on the current stream now (a fill, See Note: [fences before a copy])."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on the current stream."""

    def copy_all(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """Queue ``dst.copy_(src)`` for each pair on the current stream, in one call."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...


class CudaStreams:
    """``Streams`` of one CUDA device, through torch.cuda."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._known: dict[tuple, "torch.cuda.Stream"] = {}
        self._initialized = False
        # What torch.cuda.current_stream reads: (stream_id, device_index, device_type). Looked up,
        # not written out as an attribute: CPU builds, where tests/test_torch_names.py checks every
        # name the CUDA path uses, have none; without it, current_stream itself is asked.
        self._read_current: Optional[Callable[[int], tuple]] = getattr(torch._C, "_cuda_getCurrentStream", None)

    def current(self) -> "torch.cuda.Stream":
        """``torch.cuda.current_stream(device)``, whose Stream object is built once per stream:
        asked at every pack and unpack under a budget. See Note: [events back to their pool]."""
        if self._read_current is None:
            return torch.cuda.current_stream(self.device)
        if not self._initialized:
            torch.cuda._lazy_init()  # what current_stream does first
            self._initialized = True
        index = self.device.index
        if index is None:
            index = torch.cuda.current_device()
        key = self._read_current(index)  # as current_stream reads it
        stream = self._known.get(key)
        if stream is None:
            if len(self._known) >= KNOWN_STREAMS_MAX:
                self._known.clear()
            stream = self._known[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        return stream

    def new_stream(self) -> "torch.cuda.Stream":
        return torch.cuda.Stream(self.device)

    def event(self, timing: bool = False) -> "torch.cuda.Event":
        return torch.cuda.Event(enable_timing=timing)

    def using(self, stream: "torch.cuda.Stream") -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def allocation_queues_work(self) -> bool:
        # The same two flags ATen's empty_cuda reads before it queues fill_empty_deterministic_.
        fill: bool = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]  # a module property
        return fill and torch.are_deterministic_algorithms_enabled()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def copy_all(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream: "torch.cuda.Stream") -> None:
        tensor.record_stream(stream)


class _EventPool:
    """Events of one kind (timing or not), reused. See Note: [events back to their pool]."""

    __slots__ = ("_streams", "_timing", "_idle")

    def __init__(self, streams: Streams, timing: bool) -> None:
        self._streams, self._timing = streams, timing
        self._idle: list = []

    def take(self) -> Any:
        """An event to record: one given back, or a new one."""
        idle = self._idle
        return idle.pop() if idle else self._streams.event(timing=self._timing)

    def give(self, event: Any) -> None:
        """``event``'s latest record will not be asked about again: it may be recorded anew."""
        if len(self._idle) < POOL_MAX_EVENTS:
            self._idle.append(event)  # one list operation: safe from a finalizer on any thread


class _CopyEvent:
    """A copy's completion event, as a pending. ``order_compute`` is the GPU-side wait at use.

    For an h2d it also knows the destination and the stream it was allocated on, and records any
    other stream that uses it: See Note: [a reload used on another stream]. It knows the
    destination weakly: See Note: [a pending does not hold its destination]. Its event goes back
    to the link's pool when it is collected: See Note: [events back to their pool].
    """

    __slots__ = ("event", "link", "dst", "alloc_stream")
    blocks_host = False

    def __init__(
        self, event: Any, link: "CudaLink", dst: Optional[torch.Tensor] = None, alloc_stream: Any = None
    ) -> None:
        # Note: [a pending does not hold its destination]
        #     An h2d's pending is also kept as a reader of the host copy it reads (See Note:
        #     [keep-alive until the copy event]), until that copy's next reader or its release. Held
        #     strongly here, the destination would outlive the store dropping it (after its last
        #     user, for the budget, a give-back under budget_mb="auto"): two copies' worth of device
        #     memory, and a give-back freeing nothing. The device copy holds the tensor; this only
        #     needs it while that copy is in use, to record other streams on it.
        self.event, self.link, self.alloc_stream = event, link, alloc_stream
        self.dst = None if dst is None else weakref.ref(dst)

    def done(self) -> bool:
        if not self.event.query():
            return False
        if self.link.always_wait:  # See Note: [every wait unconditional under the sanitizer]
            self.event.synchronize()
        return True

    def wait(self) -> None:
        self.event.synchronize()

    def error(self) -> None:
        return None

    def order_compute(self) -> None:
        current = self.link.wait_on_compute(self.event)
        dst = None if self.dst is None else self.dst()
        if dst is not None and current != self.alloc_stream:
            self.link.streams.record_stream(dst, current)

    def __del__(self) -> None:
        self.link.copy_events.give(self.event)  # See Note: [events back to their pool]


class _Direction:
    """One side stream, the fences it waited for in the current batch, and its busy time (events)."""

    def __init__(self, streams: Streams, timing: _EventPool) -> None:
        self.streams = streams
        self.timing = timing  # span starts and copy events: See Note: [events back to their pool]
        self.stream: Any = None
        self.batch: Optional[object] = None  # the batch the fences below belong to
        self.waited: list = []  # fences this stream waited for in that batch
        self.spans: collections.deque = collections.deque()  # (start event, last copy's pending), until folded
        self.busy_ms = 0.0
        self._start: Any = None
        self._last: Optional[_CopyEvent] = None  # the latest copy's pending in the open span

    def enter(self, batch: object, fences: list) -> Any:
        """The side stream, made to wait for every fence of ``fences`` it has not waited for yet.

        A busy span starts after those waits: waiting for compute is not the link being busy, and
        a span begun before them would make the achieved GB/s understate the link."""
        if self.stream is None:
            self.stream = self.streams.new_stream()
        opening = False
        if self.batch is not batch:
            self.batch, self.waited = batch, []
            opening = True
        elif self._last is not None and self._last.event.query():
            # The stream ran dry inside this batch (the host waited between two copies, e.g. for
            # spill writes to make host room): that idle gap is not busy time.
            self._close_span()
            opening = True
        for fence in fences:
            if not any(fence is waited for waited in self.waited):
                self.stream.wait_event(fence)
                self.waited.append(fence)
        if opening:
            self._open_span()
        return self.stream

    def _open_span(self) -> None:
        if self._start is not None:  # a span opened again before it held a copy
            self.timing.give(self._start)
        self._start = self.timing.take()
        self._start.record(self.stream)

    def finish_copy(self, link: "CudaLink", dst: Optional[torch.Tensor] = None, alloc_stream: Any = None) -> _CopyEvent:
        """The pending of the copy just queued on this stream: an event recorded after it."""
        event = self.timing.take()
        event.record(self.stream)
        self._last = pending = _CopyEvent(event, link, dst=dst, alloc_stream=alloc_stream)
        return pending

    def _close_span(self) -> None:
        if self._start is not None:
            if self._last is not None:
                self.spans.append((self._start, self._last))
            else:
                self.timing.give(self._start)
        self._start = self._last = None

    def close_batch(self) -> None:
        self._close_span()
        self.batch, self.waited = None, []
        self.fold()

    def fold(self) -> float:
        """Add the spans that have finished (they finish in order on one stream) to ``busy_ms``.

        Run at every batch's end, so the events do not pile up when nobody reads the stats."""
        spans = self.spans
        while spans and spans[0][1].event.query():
            start, end = spans.popleft()
            self.busy_ms += start.elapsed_time(end.event)
            self.timing.give(start)  # the end's event goes back with its pending
        return self.busy_ms


class _Batch:
    """``CudaLink.batch()``: one object entered again at every pack and unpack (a generator-based
    context manager made one per call, ~1 us)."""

    __slots__ = ("link",)

    def __init__(self, link: "CudaLink") -> None:
        self.link = link

    def __enter__(self) -> None:
        self.link._open_batch()

    def __exit__(self, *exc: Any) -> None:
        self.link._close_batch()


class CudaLink:
    """Two side streams of one CUDA device (d2h, h2d) and the copies over them.

    ``slabs``: pinned slabs the engine's host arena shares with other engines made one after
    another (``offload.seams.PinnedSlabs``); None: it pins its own and unpins them at close.
    ``always_wait``: wait at every use, even for a copy already done (See Note: [every wait
    unconditional under the sanitizer]); None: from the environment.
    """

    def __init__(
        self,
        device: torch.device,
        streams: Optional[Streams] = None,
        slabs: Optional["PinnedSlabs"] = None,
        always_wait: Optional[bool] = None,
    ) -> None:
        self.device = device
        self.always_wait = _always_wait_from_env() if always_wait is None else always_wait
        self.streams: Streams = streams if streams is not None else CudaStreams(device)
        self.slabs = slabs
        self.copy_events = _EventPool(self.streams, timing=True)
        """Timing events: copies, busy spans, stalls. See Note: [events back to their pool]."""
        self._fence_events = _EventPool(self.streams, timing=False)
        self._d2h = _Direction(self.streams, self.copy_events)
        self._h2d = _Direction(self.streams, self.copy_events)
        self._batch: Optional[object] = None
        self._batch_context = _Batch(self)
        self._fences: list = []  # (stream, fence) recorded in this batch: See Note: [fences before a copy]
        self._batch_fences: list = []  # every fence recorded in this batch, given back at its end
        self._producers: list = []  # every stream current at a batch so far
        self._stores = 0  # stores using this link now (``attach``): See ``forget_producers``
        self._stalls: collections.deque = collections.deque()  # (before, after) around waits that had to wait
        self._stall_ms = 0.0

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """One pack or unpack: copies started inside share its fences. See Note: [fences before a copy]."""
        return self._batch_context

    def _open_batch(self) -> None:
        if self._batch is not None:
            raise RuntimeError("offload internal error: link batches do not nest (the store's lock is not re-entrant)")
        self._batch = object()
        current = self.streams.current()
        if current not in self._producers:  # identity first, then the stream's own ==
            self._producers.append(current)

    def attach(self) -> None:
        """A store uses this link (``Store`` calls it once, ``detach`` at close)."""
        self._stores += 1

    def detach(self) -> None:
        self._stores -= 1

    def forget_producers(self) -> None:
        """The one store using this link has no saved tensor left to copy out: the streams seen so
        far produced nothing a later d2h reads; the next batch's current stream starts the list
        again. With two stores on one link (one ``Seams(link=...)`` given to two engines) the
        other may still hold tensors from any of them: nothing is forgotten. See Note: [fences
        before a copy]."""
        if self._stores <= 1:
            self._producers = []

    def _close_batch(self) -> None:
        try:
            self._d2h.close_batch()
            self._h2d.close_batch()
        finally:
            self._batch, self._fences = None, []
            if self._batch_fences:
                give = self._fence_events.give  # their waits are queued: See Note: [events back to their pool]
                for fence in self._batch_fences:
                    give(fence)
                self._batch_fences = []

    def _fence_on(self, stream: Any) -> Any:
        """This batch's fence on ``stream``: an event recorded there the first time it is asked for."""
        for fenced, fence in self._fences:
            if fenced == stream:
                return fence
        fence = self._fence_events.take()
        fence.record(stream)
        self._fences.append((stream, fence))
        self._batch_fences.append(fence)
        return fence

    def _refence(self, stream: Any) -> None:
        """Forget this batch's fence on ``stream``: work was queued there since it was recorded."""
        self._fences = [(fenced, fence) for fenced, fence in self._fences if fenced != stream]

    def _enter(self, direction: _Direction, streams: list) -> Any:
        if self._batch is None:
            raise RuntimeError("offload internal error: a copy was started outside link.batch()")
        return direction.enter(self._batch, [self._fence_on(s) for s in streams])

    def before_copy(self, stream: Any) -> None:
        """Called on the side stream (current) before each copy is queued; nothing by default.
        Race tests override it to delay a side stream (``torch.cuda._sleep``)."""

    def d2h(self, src_device: torch.Tensor, dst_host: torch.Tensor) -> _CopyEvent:
        """Start copying ``src_device`` (uint8) into the front of pinned ``dst_host``, after every
        stream that may have produced it. See Note: [fences before a copy].

        See Note: [keep-alive until the copy event]: the caller keeps ``src_device`` until it is done.
        """
        stream = self._enter(self._d2h, self._producers)
        with self.streams.using(stream):
            self.before_copy(stream)
            self.streams.copy(dst_host[: src_device.numel()], src_device)
        return self._d2h.finish_copy(self)

    def d2h_all(self, srcs_device: list[torch.Tensor], dsts_host: list[torch.Tensor]) -> _CopyEvent:
        """``d2h`` for a batch: each source into the front of its pinned block, after the same
        fences, from one Python call, with one event for them all (See Note: [moves in batches]
        in ``store``). Across devices ``torch._foreach_copy_`` copies tensor by tensor in C++
        (one ``cudaMemcpyAsync`` and one host-allocator event record each, as ``d2h`` makes):
        what the batch saves is the Python, the fences and the events per tensor. Every source
        is kept until the batch's event, as ``d2h``'s one is."""
        stream = self._enter(self._d2h, self._producers)
        with self.streams.using(stream):
            self.before_copy(stream)
            self.streams.copy_all(
                [dst[: src.numel()] for src, dst in zip(srcs_device, dsts_host, strict=True)], srcs_device
            )
        return self._d2h.finish_copy(self)

    def h2d(self, src_host: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, _CopyEvent]:
        """Start copying ``nbytes`` of pinned ``src_host`` to a new device tensor; returns (tensor, pending).

        See Note: [reload destination on the compute stream].
        """
        alloc_stream = self.streams.current()
        if self.always_wait or self.streams.allocation_queues_work():
            # Its fill comes after the batch's fence (See Note: [fences before a copy]); under the
            # sanitizer its allocation does too (See Note: [every wait unconditional under the sanitizer]).
            self._refence(alloc_stream)
        dst = self.streams.empty(nbytes)
        stream = self._enter(self._h2d, [alloc_stream])
        with self.streams.using(stream):
            self.before_copy(stream)
            self.streams.copy(dst, src_host[:nbytes])
        return dst, self._h2d.finish_copy(self, dst=dst, alloc_stream=alloc_stream)

    def wait_on_compute(self, event: Any) -> Any:
        """Make the current stream wait for ``event`` (GPU-side); time the stall if there is one.
        Returns the current stream."""
        compute = self.streams.current()
        if not self.always_wait and event.query():  # See Note: [every wait unconditional under the sanitizer]
            return compute
        before, after = self.copy_events.take(), self.copy_events.take()
        before.record(compute)
        compute.wait_event(event)
        after.record(compute)
        self._stalls.append((before, after))
        self._fold_stalls()
        return compute

    def _fold_stalls(self) -> None:
        while self._stalls and self._stalls[0][1].query():
            before, after = self._stalls.popleft()
            self._stall_ms += before.elapsed_time(after)
            self.copy_events.give(before)
            self.copy_events.give(after)

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
