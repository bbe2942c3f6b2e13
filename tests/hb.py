"""A happens-before race detector for the engine's stream protocol, on the CPU (test-only).

``EmulatedStreams`` plays ``offload.seams.Streams`` (CUDA streams, events, the caching
allocator) and the spill file's ``Jobs``, so ``CudaLink`` and the store run unchanged over them
(``EmulatedCudaLink``). Nothing runs concurrently: streams and spill jobs are simulated on the
test's thread and their work runs when a schedule says, so a seed replays exactly. What finds a
race is not timing but vector clocks.

Agents, each with a vector clock: the host thread, every stream (compute, the link's side streams,
any a test makes), every spill job. Edges:

    host queues an item on stream S    the item takes the host's clock (the host ticks first)
    S reaches an event's record        the event takes S's clock
    S.wait_event(e) / wait_stream      S's later items take e's clock
    e.query() True, e.synchronize()    the host takes e's clock (so does stream.synchronize())
    host submits a spill job           the job takes the host's clock
    job future done() / wait() / result() / exception()   the host takes the job's clock

Accesses, each checked against the earlier ones of the same memory (a storage, while it lives):

    a copy                 reads its source, writes its destination              on its stream
    a spill job            reads (write to disk) or writes (read from disk) its host memory
    a host aten op         on memory the engine handed out (reload destinations), reads and
                           writes told apart by the op's schema alias info       on the current stream
    a released host block  written (poisoned) by the host                        host
    a new device block     written by the stream it comes from, as of that stream's last access
                           (the caching allocator may hand back a block that stream used)
    a freed storage        device memory: a write by the stream it was allocated on, after the
                           streams ``record_stream`` named; host memory: a host write

A copy up from pageable memory (the host tier's fallback when its pinned arena is full) makes the
host wait until its stream reaches it, as ``cudaMemcpyAsync`` staging pageable memory does; that
wait is counted (``pageable_copies``, ``pageable_stall_ms`` of virtual time).

Two accesses to overlapping bytes, one of them a write, neither ordered before the other by the
clocks, are a race: recorded with both accesses' stacks (``races``), and the copy or write that
found it writes 0xFF instead of its data, so the gradients show it too. A copy whose source or
destination storage is gone when it runs counts in ``sources_gone``.

Schedules (``Schedule``): ``timed``: each side-stream item and spill job takes a seeded random
0-2 ms of virtual time, which advances ``QUANTUM_MS`` at every host event (an aten op, a query, a
copy started), and work runs once its time has come, whether or not anyone looks. ``adversarial``:
work runs only when forced (a synchronize, a job's result, a host op on its stream after a wait)
or once its completion has been polled a seeded 1..N times. Physically a host op runs after every
item queued before it on its stream (forcing them), as the kernel it stands for would.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import random
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from offload.seams import CudaLink, Host

POISON = 0xFF
"""What a racing copy or write, or a released host block, holds instead of data."""
HOST = 0
"""The host's index in the vector clocks (streams count from 1, spill jobs from ``JOB_AGENTS``)."""
JOB_AGENTS = 1000
MAX_ITEM_MS = 2.0
"""Longest virtual duration of one side-stream item or spill job under a timed schedule."""
QUANTUM_MS = 0.02
"""Virtual time one host event takes, by default: a step of a few hundred ops lets a 0-2 ms copy
land before its use about as often as not. A slower host (``Schedule.quantum_ms``) lets most land."""
STACK_FRAMES = 14
"""Frames kept per access (captured where the host queued it), for race reports."""
NO_KERNEL = frozenset(("set_", "detach_", "empty", "empty_like", "empty_strided", "lift_fresh", "resize_"))
"""Ops that launch no kernel (views aside): they read and write no data, and wait for nothing."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When simulated work runs: ``polls`` None is timed (seeded durations, the host taking
    ``quantum_ms`` per event); else adversarial, work completing only when forced or after a seeded
    1..``polls`` polls of its completion."""

    seed: int = 0
    polls: Optional[int] = None
    quantum_ms: float = QUANTUM_MS

    @property
    def adversarial(self) -> bool:
        return self.polls is not None

    def __str__(self) -> str:
        if self.polls is not None:
            return f"adversarial{self.polls}-{self.seed}"
        return f"timed{self.seed}" + ("" if self.quantum_ms == QUANTUM_MS else f"q{round(self.quantum_ms * 1e3)}")

    @staticmethod
    def named(name: str) -> Schedule:
        """``timed<seed>``, ``timed<seed>q<host us per event>`` or ``adversarial<polls>-<seed>``."""
        if name.startswith("timed"):
            seed, _, quantum_us = name.removeprefix("timed").partition("q")
            return Schedule(int(seed or 0), quantum_ms=int(quantum_us) / 1e3 if quantum_us else QUANTUM_MS)
        if name.startswith("adversarial"):
            polls, _, seed = name.removeprefix("adversarial").partition("-")
            return Schedule(int(seed or 0), int(polls))
        raise ValueError(f"unknown schedule {name!r}; use 'timed<seed>[q<us>]' or 'adversarial<polls>-<seed>'")


FAST_SCHEDULES = ("timed0", "adversarial3-0")
"""The schedules every detector run in the fast suite goes through."""
SLOW_SCHEDULES = ("timed1", "timed2q50", "timed3q100", "adversarial1-1", "adversarial8-2")
"""More seeds, marked slow."""


def _merge(clock: dict, other: dict) -> None:
    for key, value in other.items():
        if clock.get(key, 0) < value:
            clock[key] = value


def _stack() -> traceback.StackSummary:
    return traceback.StackSummary.extract(
        traceback.walk_stack(sys._getframe(2)), limit=STACK_FRAMES, lookup_lines=False
    )


def _span(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """The bytes of its storage ``t`` covers, [lo, hi), or None if it has no elements."""
    if t.numel() == 0:
        return None
    size = t.element_size()
    lo = t.storage_offset() * size
    extent = 1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))
    return lo, lo + extent * size


def _ours(filename: str) -> bool:
    """A frame of the engine or of a test, not of this detector."""
    return ("/offload/" in filename or "/tests/" in filename) and not filename.endswith("/hb.py")


@dataclasses.dataclass
class Access:
    lo: int
    hi: int
    writes: bool
    agent: int
    value: int
    """The agent's own clock entry at the access: ordered before X iff X's clock has at least this."""
    what: str
    stack: traceback.StackSummary


@dataclasses.dataclass
class Race:
    """Two accesses to the same bytes, one a write, that nothing orders."""

    memory: str
    earlier: Access
    later: Access
    names: dict

    def _describe(self, a: Access) -> str:
        frames = [f for f in a.stack if _ours(f.filename)] or list(a.stack)
        where = "".join(traceback.format_list(frames[:8]))
        kind = "write" if a.writes else "read"
        return f"  {a.what} ({kind} of [{a.lo}, {a.hi}) by {self.names.get(a.agent, a.agent)}), queued at:\n{where}"

    def __str__(self) -> str:
        return f"race on {self.memory}:\n{self._describe(self.earlier)}{self._describe(self.later)}"

    __repr__ = __str__


class Memory:
    """A storage the detector tracks, while it lives, and the accesses to it not yet covered."""

    __slots__ = ("name", "nbytes", "device", "alloc", "handed_out", "recorded", "accesses", "weak", "pageable")

    def __init__(self, name: str, nbytes: int, device: bool, alloc: Any, handed_out: bool) -> None:
        self.name, self.nbytes, self.device, self.alloc, self.handed_out = name, nbytes, device, alloc, handed_out
        self.pageable = False
        """Host memory the host tier took when its pinned arena was full (``HostTier.alloc``)."""
        self.recorded: list = []  # streams record_stream named
        self.accesses: list[Access] = []
        self.weak: Any = None

    def tensor(self, like: tuple) -> Optional[torch.Tensor]:
        """The view ``like`` (dtype, size, stride, offset) onto this storage, if it still lives."""
        storage = self.weak()
        if storage is None:
            return None
        dtype, size, stride, offset = like
        return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


class Item:
    """One piece of work queued on a stream."""

    __slots__ = ("stream", "run", "host_clock", "at", "duration", "deps", "merges", "stack", "done", "finish")
    __slots__ += ("clock", "polls", "needed", "synced")

    def __init__(self, stream, run, host_clock, at, duration, deps, merges, stack, needed) -> None:
        self.stream, self.run, self.host_clock, self.at, self.duration = stream, run, host_clock, at, duration
        self.deps, self.merges, self.stack, self.needed = deps, merges, stack, needed
        self.done, self.finish, self.clock, self.polls, self.synced = False, 0.0, {}, 0, False
        """``done``: its work has run (physically: the host's next op needed it, or its time came).
        Whether the host may see it complete is ``EmulatedStreams._visible``."""


class EmulatedStream:
    """A stream: items run in order; ``delay_s`` fixes each item's virtual duration (None: the schedule's)."""

    def __init__(self, sim: EmulatedStreams, index: int, delay_s: Optional[float], name: str) -> None:
        self.sim, self.index, self.delay_s, self.name = sim, index, delay_s, name
        self.clock = {index: 0}
        self.items: deque[Item] = deque()
        self.finish = 0.0
        self.enqueued = 0
        self.last_access = 0
        """The clock value the latest item that touched memory will have (0: none yet)."""

    def __repr__(self) -> str:
        return f"EmulatedStream({self.name})"

    def enqueue(self, run=None, *, deps=(), merges=True, touches=False, duration_ms=None, event=True) -> Item:
        """Queue ``run(item, clock)``; ``event``: the host doing so is a host event (time passes)."""
        return self.sim._enqueue(self, run, list(deps), merges, touches, duration_ms, event)

    def wait_event(self, event: EmulatedEvent) -> None:
        record = event._record
        if record is None:
            return  # never recorded: complete, as CUDA has it
        item = self.enqueue(deps=[record])
        if self.sim.current() is self:  # the host's next op here runs after the wait
            with self.sim._internal():
                self.sim._force(item)

    def wait_stream(self, other: EmulatedStream) -> None:
        event = EmulatedEvent(self.sim)
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        event = EmulatedEvent(self.sim)
        event.record(self)
        event.synchronize()


class EmulatedEvent:
    """``torch.cuda.Event`` on emulated streams (never recorded: complete, as CUDA has it)."""

    def __init__(self, sim: EmulatedStreams) -> None:
        self.sim = sim
        self._record: Optional[Item] = None

    def record(self, stream: EmulatedStream) -> None:
        self._record = stream.enqueue()

    def query(self) -> bool:
        record = self._record
        if record is None:
            return True
        return self.sim._polled(record)

    def synchronize(self) -> None:
        record = self._record
        if record is not None:
            self.sim._sync(record)

    def elapsed_time(self, end: EmulatedEvent) -> float:
        assert self._record is not None and end._record is not None and self._record.done and end._record.done
        return end._record.finish - self._record.finish


class _Job:
    __slots__ = ("agent", "run", "reads", "writes", "clock", "due", "needed", "polls", "future", "stack", "done")

    def __init__(self, agent, run, reads, writes, clock, due, needed, stack) -> None:
        self.agent, self.run, self.reads, self.writes, self.clock = agent, run, reads, writes, clock
        self.due, self.needed, self.stack = due, needed, stack
        self.polls, self.future, self.done = 0, None, False


class _JobFuture(concurrent.futures.Future):
    """A spill job's future: asking it whether it is done, or for its result, is the host learning
    the job's clock (and, in an adversarial schedule, what makes it run)."""

    def __init__(self, sim: EmulatedStreams, job: _Job) -> None:
        super().__init__()
        self._sim, self._job = sim, job

    def done(self) -> bool:
        return self._sim._job_polled(self._job)

    def result(self, timeout=None):
        self._sim._job_forced(self._job)
        return super().result(0)

    def exception(self, timeout=None):
        self._sim._job_forced(self._job)
        return super().exception(0)


class SpillJobs:
    """``offload.seams.Jobs`` as simulated agents (See the module docstring)."""

    def __init__(self, sim: EmulatedStreams) -> None:
        self.sim = sim

    def submit(self, run: Callable[[], object], *, reads=None, writes=None) -> concurrent.futures.Future:
        return self.sim._submit(run, reads, writes)

    def shutdown(self) -> None:
        self.sim._run_jobs()


class _HostOps(TorchDispatchMode):
    """The host's aten ops, as kernels on the current stream (See the module docstring)."""

    def __init__(self, sim: EmulatedStreams) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.sim._busy:
            self.sim._host_op(func, args, kwargs)
        return func(*args, **kwargs)


class EmulatedStreams:
    """``offload.seams.Streams`` and the spill file's ``Jobs`` on the CPU, watched for races
    (See the module docstring). ``side_delay_s`` fixes the virtual duration of each item on a side
    stream; ``fills_new_memory``: ``empty`` queues a 0xFF fill on the current stream, as
    ``torch.empty`` does under deterministic algorithms with ``fill_uninitialized_memory``.
    Use inside ``watching()``: the host's ops are seen only there."""

    def __init__(
        self, schedule: Optional[Schedule] = None, side_delay_s: Optional[float] = None, fills_new_memory: bool = False
    ) -> None:
        self.schedule = schedule or Schedule()
        self.side_delay_s, self.fills_new_memory = side_delay_s, fills_new_memory
        self._rng = random.Random(self.schedule.seed)
        self._lock = threading.RLock()
        self.host_clock = {HOST: 0}
        self.now = 0.0
        """Virtual milliseconds."""
        self.races: list[Race] = []
        self.sources_gone = 0
        self.pageable_copies = 0
        self.pageable_stall_ms = 0.0
        """Host time (virtual) spent waiting for a copy stream because a copy's source was pageable."""
        self.recorded: list = []  # (data_ptr, stream) of every record_stream
        self._names: dict = {HOST: "the host"}
        self._streams: list[EmulatedStream] = []
        self._memories: dict[int, Memory] = {}
        self._jobs: list[_Job] = []
        self._job_count = 0
        self._busy = 0
        self._closed = False
        self._local = threading.local()
        self.jobs = SpillJobs(self)
        self.compute = self._new(0.0, "the compute stream")

    def _new(self, delay_s: Optional[float], name: str) -> EmulatedStream:
        stream = EmulatedStream(self, len(self._streams) + 1, delay_s, name)
        self._streams.append(stream)
        self._names[stream.index] = name
        return stream

    @contextlib.contextmanager
    def watching(self):
        """See the host's aten ops (a dispatch mode on this thread) inside the block; there, the
        thread sleeping (``time.sleep``: a test waiting for the engine to settle) is virtual time
        passing, not real time."""
        real_sleep, thread = time.sleep, threading.get_ident()

        def sleep(seconds: float) -> None:
            if threading.get_ident() != thread:
                real_sleep(seconds)
                return
            self.now += seconds * 1e3
            self._host_event()

        time.sleep = sleep
        try:
            with _HostOps(self):
                yield self
        finally:
            time.sleep = real_sleep

    @contextlib.contextmanager
    def _internal(self):
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1

    def close(self) -> None:
        """Run everything still queued (a CUDA context's work finishes too); later frees are ignored."""
        self.drain()
        self._closed = True

    def drain(self) -> None:
        """Run every item queued and every job submitted (and what running them queued)."""
        with self._internal():
            while self._jobs or any(stream.items for stream in self._streams):
                for stream in self._streams:
                    if stream.items:
                        self._force(stream.items[-1])
                self._run_jobs()

    # --------------------------------------------------------------- what CudaLink asks (Streams)

    def current(self) -> EmulatedStream:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self.compute

    def new_stream(self) -> EmulatedStream:
        return self._new(self.side_delay_s, f"side stream {len(self._streams) + 1}")

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
        """A new device block from the current stream's pool: its bytes are garbage (0xFF), and it
        counts as written by that stream as of its last access (the block may be one it used)."""
        stream = self.current()
        with self._internal():
            dst = torch.full((nbytes,), POISON, dtype=torch.uint8)
        memory = self.device_memory(dst, alloc=stream, handed_out=True, what="a reload destination")
        if stream.last_access:
            with self._lock:
                new = Access(0, nbytes, True, stream.index, stream.last_access, "the block's last use", _stack())
                memory.accesses.append(new)
        if self.fills_new_memory:
            self.write_on(stream, dst, lambda: dst.fill_(POISON), "the fill of a new allocation")
        return dst

    def allocation_queues_work(self) -> bool:
        return self.fills_new_memory

    def copy_all(self, dsts: list, srcs: list) -> None:
        """One submission of several copies: each checked as its own, all queued on the current stream."""
        for dst, src in zip(dsts, srcs, strict=True):
            self.copy(dst, src)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream, called = self.current(), self.now
        src_memory, dst_memory = self._memory_of(src), self._memory_of(dst)
        src_like, dst_like = _layout(src), _layout(dst)
        src_span, dst_span = _span(src), _span(dst)

        def run(item: Item, clock: dict) -> None:
            raced = False
            if src_span is not None:
                raced = self._check(src_memory, *src_span, False, stream.index, clock, "a copy's read", item.stack)
            if dst_span is not None:
                wrote = self._check(dst_memory, *dst_span, True, stream.index, clock, "a copy's write", item.stack)
                raced = raced or wrote
            src_now, dst_now = src_memory.tensor(src_like), dst_memory.tensor(dst_like)
            if src_now is None or dst_now is None:
                self.sources_gone += 1
            if dst_now is not None:
                dst_now.fill_(POISON) if src_now is None or raced else dst_now.copy_(src_now)

        item = stream.enqueue(run, touches=True)
        if not src_memory.device and not self._pinned(src):
            # cudaMemcpyAsync from pageable memory stages it through pinned memory: the host waits
            # for the stream to reach the copy (everything queued before it, and the copy).
            # Once it returns the source has been read: the host may reuse or free it.
            self.pageable_copies += 1
            with self._internal():
                self._force(item)
            with self._lock:
                self.pageable_stall_ms += max(0.0, item.finish - called)
                self.now = max(self.now, item.finish)
                _merge(self.host_clock, item.clock)

    def record_stream(self, tensor: torch.Tensor, stream: EmulatedStream) -> None:
        self.recorded.append((tensor.data_ptr(), stream))
        memory = self._memory_of(tensor)
        if stream is not memory.alloc and stream not in memory.recorded:
            memory.recorded.append(stream)

    # --------------------------------------------------------------- memories

    def device_memory(self, t: torch.Tensor, alloc=None, handed_out=False, what="device memory") -> Memory:
        """Track ``t``'s storage as device memory allocated on ``alloc`` (None: the compute stream)."""
        return self._track(t, True, alloc or self.compute, handed_out, what)

    def host_memory(self, t: torch.Tensor, what: str = "host memory") -> Memory:
        return self._track(t, False, None, False, what)

    def _memory_of(self, t: torch.Tensor) -> Memory:
        memory = self._memories.get(t.untyped_storage()._cdata)
        return memory if memory is not None else self.device_memory(t)

    def _track(self, t: torch.Tensor, device: bool, alloc, handed_out: bool, what: str) -> Memory:
        storage = t.untyped_storage()
        key = storage._cdata
        with self._lock:
            memory = self._memories.get(key)
            if memory is None:
                name = f"{what} #{len(self._names) + self._job_count}-{key & 0xFFFF:04x} ({storage.nbytes()} bytes)"
                memory = Memory(name, storage.nbytes(), device, alloc, handed_out)
                memory.weak = weakref.ref(storage, lambda _ref, key=key, memory=memory: self._freed(key, memory))
                self._memories[key] = memory
            return memory

    def live_reload_destinations(self) -> int:
        """Device blocks ``empty`` handed out whose storage is still alive (weak references)."""
        return sum(1 for memory in self._memories.values() if memory.handed_out and memory.weak() is not None)

    def _pinned(self, t: torch.Tensor) -> bool:
        """Host memory is the arena's (pinned on a device) unless the host tier allocated it itself."""
        memory = self._memories.get(t.untyped_storage()._cdata)
        return memory is None or not memory.pageable

    def _freed(self, key: int, memory: Memory) -> None:
        with self._lock:
            if self._memories.get(key) is memory:
                del self._memories[key]
            if self._closed:
                return
            if not memory.device:
                self._host_access(memory, 0, memory.nbytes, True, "the free of host memory")
                return
            # Device memory goes back to its stream's pool: reused by that stream's later work, and
            # by no one before the streams record_stream named have done what they queued so far.
            deps = [stream.enqueue(event=False) for stream in memory.recorded]

            def run(item: Item, clock: dict) -> None:
                self._check(memory, 0, memory.nbytes, True, memory.alloc.index, clock, "the free", item.stack)

            memory.alloc.enqueue(run, deps=deps, merges=False, event=False, duration_ms=0.0)

    # --------------------------------------------------------------- what tests do on streams

    def write_on(self, stream: EmulatedStream, tensor: torch.Tensor, write, what: str, duration_ms=None) -> None:
        """Queue ``write()`` on ``stream`` as a tracked write of ``tensor`` (a producer, a fill)."""
        memory, span = self._memory_of(tensor), _span(tensor)

        def run(item: Item, clock: dict) -> None:
            raced = span is not None and self._check(memory, *span, True, stream.index, clock, what, item.stack)
            tensor.fill_(POISON) if raced else write()

        stream.enqueue(run, touches=True, duration_ms=duration_ms)

    def host_write(self, tensor: torch.Tensor, value: int) -> None:
        """The host writes ``value`` into ``tensor`` now (a host block given back), tracked."""
        span = _span(tensor)
        if span is not None:
            self._host_access(self._memory_of(tensor), *span, True, "a host write")
        with self._internal():
            tensor.fill_(value)

    def _host_access(self, memory: Memory, lo: int, hi: int, writes: bool, what: str) -> bool:
        with self._lock:
            self.host_clock[HOST] += 1
            return self._check(memory, lo, hi, writes, HOST, self.host_clock, what, _stack())

    # --------------------------------------------------------------- the race check

    def _check(self, memory: Memory, lo: int, hi: int, writes: bool, agent: int, clock: dict, what, stack) -> bool:
        """Check one access against the earlier ones of ``memory`` and log it; True if it races."""
        with self._lock:
            new = Access(lo, hi, writes, agent, clock.get(agent, 0), what, stack)
            raced = False
            kept = []
            for old in memory.accesses:
                overlaps = old.lo < hi and lo < old.hi
                ordered = old.agent == agent or clock.get(old.agent, 0) >= old.value
                if overlaps and (writes or old.writes) and not ordered:
                    raced = True
                    self.races.append(Race(memory.name, old, new, self._names))
                if not (overlaps and ordered and writes and lo <= old.lo and old.hi <= hi):
                    kept.append(old)  # an access a later ordered write covers can no longer race
            kept.append(new)
            memory.accesses = kept
            return raced

    # --------------------------------------------------------------- the schedule

    def _duration(self, stream: Optional[EmulatedStream], duration_ms: Optional[float]) -> float:
        if duration_ms is not None:
            return duration_ms
        if stream is not None and stream.delay_s is not None:
            return stream.delay_s * 1e3
        if self.schedule.adversarial:
            return 0.0
        return self._rng.uniform(0.0, MAX_ITEM_MS)

    def _needed(self) -> int:
        return self._rng.randint(1, self.schedule.polls) if self.schedule.polls else 0

    def _enqueue(self, stream, run, deps, merges, touches, duration_ms, event) -> Item:
        with self._lock:
            self.host_clock[HOST] += 1
            duration = self._duration(stream, duration_ms) if run is not None else 0.0
            item = Item(stream, run, dict(self.host_clock), self.now, duration, deps, merges, _stack(), self._needed())
            stream.items.append(item)
            stream.enqueued += 1
            if touches:
                stream.last_access = stream.enqueued
        if event:
            self._host_event()
        return item

    def _execute(self, item: Item) -> None:
        stream = item.stream
        with self._lock:
            _merge(stream.clock, item.host_clock)
            stream.clock[stream.index] += 1
            start = max(item.at, stream.finish)
            clock = stream.clock
            for dep in item.deps:
                start = max(start, dep.finish)
                if item.merges:
                    _merge(stream.clock, dep.clock)
            if item.deps and not item.merges:  # a free: after these, but the stream itself waits for nothing
                clock = dict(stream.clock)
                for dep in item.deps:
                    _merge(clock, dep.clock)
            item.finish = stream.finish = start + item.duration
            item.clock = dict(clock)
            item.done = True
        if item.run is not None:
            with self._internal():
                item.run(item, clock)

    def _force(self, item: Item) -> None:
        """Run ``item``'s stream up to it, and whatever that waits for."""
        while not item.done:
            stream = item.stream
            head = stream.items[0]
            for dep in head.deps:
                self._force(dep)
            if stream.items and stream.items[0] is head:
                stream.items.popleft()
                self._execute(head)

    def _host_event(self) -> None:
        """The host did something: virtual time passes, and (timed) work whose time has come runs."""
        self.now += self.schedule.quantum_ms
        if self.schedule.adversarial or self._busy:
            return
        with self._internal():
            progress = True
            while progress:
                progress = False
                for stream in self._streams:
                    while stream.items and self._due(stream.items[0]):
                        self._execute(stream.items.popleft())
                        progress = True
                for job in [j for j in self._jobs if j.due <= self.now]:
                    self._run_job(job)
                    progress = True

    def _due(self, item: Item) -> bool:
        if any(not dep.done for dep in item.deps):
            return False
        start = max([item.at, item.stream.finish, *(dep.finish for dep in item.deps)])
        return start + item.duration <= self.now

    def _visible(self, record: Item) -> bool:
        """Whether the host may see ``record`` reached: run, and (timed) its virtual time has come or
        (adversarial) it was polled enough. Work run early because a host op needed it (the host
        only queued that op) does not count."""
        if not record.done:
            return False
        if record.synced:
            return True
        if self.schedule.adversarial:
            return record.polls >= record.needed
        return record.finish <= self.now

    def _polled(self, record: Item) -> bool:
        """An event's ``query()``: has the stream reached ``record``? (the host learns its clock if so)"""
        self._host_event()
        if not self._visible(record):
            record.polls += 1
            if self.schedule.adversarial and record.polls >= record.needed:
                with self._internal():
                    self._force(record)
        if self._visible(record):
            with self._lock:
                _merge(self.host_clock, record.clock)
            return True
        return False

    def _sync(self, record: Item) -> None:
        with self._internal():
            self._force(record)
        with self._lock:
            record.synced = True
            self.now = max(self.now, record.finish)
            _merge(self.host_clock, record.clock)

    def _host_op(self, func, args, kwargs) -> None:
        """An aten op on the host thread: a kernel on the current stream (See the module docstring)."""
        self._host_event()
        if func.is_view or func.overloadpacket.__name__ in NO_KERNEL:
            return
        stream = self.current()
        accesses = self._op_accesses(func, args, kwargs)
        if accesses:
            what = f"the host's {func}"

            def run(item: Item, clock: dict) -> None:
                for memory, span, writes in accesses:
                    self._check(memory, *span, writes, stream.index, clock, what, item.stack)

            stream.enqueue(run, touches=True)
        if stream.items:
            with self._internal():
                self._force(stream.items[-1])

    def _op_accesses(self, func, args, kwargs) -> list:
        if not self._memories:
            return []
        found = []
        for i, argument in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            values = value if isinstance(value, (list, tuple)) else (value,)
            for t in values:
                if not isinstance(t, torch.Tensor) or t.layout is not torch.strided or t.device.type != "cpu":
                    continue
                memory = self._memories.get(t.untyped_storage()._cdata)
                span = _span(t)
                if memory is not None and memory.handed_out and span is not None:
                    writes = argument.alias_info is not None and argument.alias_info.is_write
                    found.append((memory, span, writes))
        return found

    # --------------------------------------------------------------- spill jobs

    def _submit(self, run, reads, writes) -> concurrent.futures.Future:
        with self._lock:
            self.host_clock[HOST] += 1
            self._job_count += 1
            agent = JOB_AGENTS + self._job_count
            self._names[agent] = f"spill job {self._job_count} ({'a write to disk' if reads is not None else 'a read'})"
            clock = dict(self.host_clock)
            clock[agent] = 1
            duration = 0.0 if self.schedule.adversarial else self._rng.uniform(0.0, MAX_ITEM_MS)
            job = _Job(agent, run, reads, writes, clock, self.now + duration, self._needed(), _stack())
            for t in (reads, writes):
                if t is not None and t.untyped_storage()._cdata not in self._memories:
                    self.host_memory(t, what="host memory a spill job uses")
            job.future = _JobFuture(self, job)
            self._jobs.append(job)
        self._host_event()
        return job.future

    def _run_job(self, job: _Job) -> None:
        if job.done:
            return
        job.done = True
        self._jobs.remove(job)
        raced = False
        for t, writes in ((job.reads, False), (job.writes, True)):
            span = None if t is None else _span(t)
            if t is not None and span is not None:
                what = "a spill job's read of its source" if not writes else "a spill job's write of its destination"
                raced = self._check(self._memory_of(t), *span, writes, job.agent, job.clock, what, job.stack) or raced
        with self._internal():
            try:
                result = job.run()
            except BaseException as error:  # noqa: BLE001 - the future carries it, as a worker's does
                # A worker thread's frames end at its loop; these (run on the host, when forced) go
                # on up the host's stack, whose frames hold the graph being unpacked: cut them off.
                concurrent.futures.Future.set_exception(job.future, error.with_traceback(None))
            else:
                if raced and job.writes is not None:
                    job.writes.fill_(POISON)
                concurrent.futures.Future.set_result(job.future, result)
        job.run = job.reads = job.writes = None  # a finished job holds no memory

    def _job_polled(self, job: _Job) -> bool:
        self._host_event()
        if not job.done:
            job.polls += 1
            if self.schedule.adversarial and job.polls >= job.needed:
                self._run_job(job)
        if job.done:
            with self._lock:
                _merge(self.host_clock, job.clock)
            return True
        return False

    def _job_forced(self, job: _Job) -> None:
        self._run_job(job)
        with self._lock:
            _merge(self.host_clock, job.clock)

    def _run_jobs(self) -> None:
        for job in list(self._jobs):
            self._run_job(job)


def _layout(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset()


class _EmulatedHost(Host):
    """This machine, except that the spill file's jobs run on the emulated streams' schedule and
    the host tier's pageable memory (its fallback when the arena is full) is known as such."""

    def __init__(self, emulated: "EmulatedStreams") -> None:
        self.emulated = emulated

    def jobs(self, workers: int):
        return self.emulated.jobs

    def pageable(self, nbytes: int) -> torch.Tensor:
        out = super().pageable(nbytes)
        self.emulated.host_memory(out, what="pageable memory").pageable = True
        return out


class EmulatedCudaLink(CudaLink):
    """``CudaLink`` itself on the CPU, over ``EmulatedStreams``; its spill file's jobs run there too
    (the ``host`` it offers), and a host block the engine gives back is overwritten with 0xFF by the host at
    once (tracked: a copy or job still using it races it)."""

    def __init__(
        self,
        streams: Optional[EmulatedStreams] = None,
        slabs=None,
        schedule: Optional[Schedule] = None,
        always_wait: Optional[bool] = None,
    ):
        streams = streams or EmulatedStreams(schedule)
        super().__init__(torch.device("cpu"), streams=streams, slabs=slabs, always_wait=always_wait)
        self.emulated: EmulatedStreams = self.streams  # type: ignore[assignment]  # the one passed above
        self.host = _EmulatedHost(self.emulated)
        self.d2h_count = self.h2d_count = 0
        self.d2h_batches = 0
        """Copies out started by ``d2h_all`` (one call each, of one or more tensors)."""
        self.d2h_singles = 0
        """Copies out started by ``d2h`` (one tensor each)."""

    def d2h(self, src_device, dst_host):
        self.d2h_count += 1
        self.d2h_singles += 1
        self.emulated.device_memory(src_device, what="a saved tensor")
        self.emulated.host_memory(dst_host, what="a host slab")
        return super().d2h(src_device, dst_host)

    def d2h_all(self, srcs_device, dsts_host):
        self.d2h_count += len(srcs_device)
        self.d2h_batches += 1
        for src, dst in zip(srcs_device, dsts_host, strict=True):
            self.emulated.device_memory(src, what="a saved tensor")
            self.emulated.host_memory(dst, what="a host slab")
        return super().d2h_all(srcs_device, dsts_host)

    def h2d(self, src_host, nbytes):
        self.h2d_count += 1
        pinned = self.emulated._pinned(src_host)
        self.emulated.host_memory(src_host, what="a host slab" if pinned else "pageable memory")
        return super().h2d(src_host, nbytes)

    def released(self, host: torch.Tensor) -> None:
        self.emulated.host_write(host, POISON)

    @property
    def races(self) -> list:
        return self.emulated.races

    @property
    def sources_gone(self) -> int:
        return self.emulated.sources_gone

    def close(self) -> None:
        self.emulated.close()


@contextlib.contextmanager
def detecting(schedule: Optional[Schedule] = None, slabs=None):
    """An ``EmulatedCudaLink`` watched for the whole block; afterwards (everything run) it must have
    seen no race and no copy whose source or destination was gone."""
    link = EmulatedCudaLink(schedule=schedule, slabs=slabs)
    try:
        with link.emulated.watching():
            yield link
    finally:
        link.close()
    assert link.races == [], f"{len(link.races)} race(s) under {link.emulated.schedule}; the first:\n{link.races[0]}"
    assert link.sources_gone == 0, "a copy's source or destination was let go before the copy ran"
