"""What one saved tensor costs the engine, counted, not timed: torch ops dispatched, locks taken,
calls into the link's streams and events.

The hooks are the ones autograd calls: ``with eng:`` pushes them, and torch's own hook stack
(``torch._C._autograd._top_saved_tensors_default_hooks``, what ``torch.utils.checkpoint`` reads)
hands them back, so pack, unpack and the release of what pack returned are called here exactly as
autograd calls them, one at a time. Counters: a ``TorchDispatchMode`` sees every aten op (an
allocation is one), ``sys.setprofile`` sees every C call (a lock's ``acquire`` is one), and a
``CudaLink`` runs over ``CountingStreams``, a ``Streams`` that counts what the link asks of the
device (events made, recorded, queried; streams made; the current stream read) and completes
everything at once. Nothing is patched.

Reference: a bare hook pair dispatches nothing and takes no lock; the engine's pass-through adds
one op (its detached alias, See Note: [pass through a detached alias] in offload/_memory/hooks.py), and
a save it only counts adds that op and one lock per pack, per unpack and per release.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import sys
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import offload
from offload.seams import CudaLink

NUMEL = 4096
"""fp32 elements of each saved tensor (16 KiB): taken with min_offload_mb=0, passed through under the default."""
LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))
STEPS_FOR_EVENTS = (16, 64)
"""Saved tensors per step in the event test: events made must not grow with them."""


class _Counts(collections.Counter):
    def took(self, **expected: int) -> bool:
        return all(self[name] == n for name, n in expected.items())


class _Stream:
    def __init__(self, counts: _Counts) -> None:
        self.counts = counts

    def wait_event(self, event) -> None:
        self.counts["stream.wait_event"] += 1

    def synchronize(self) -> None:
        self.counts["stream.synchronize"] += 1


class _Event:
    def __init__(self, counts: _Counts) -> None:
        self.counts = counts

    def record(self, stream) -> None:
        self.counts["event.record"] += 1

    def query(self) -> bool:
        self.counts["event.query"] += 1
        return True

    def synchronize(self) -> None:
        self.counts["event.synchronize"] += 1

    def elapsed_time(self, end) -> float:
        self.counts["event.elapsed_time"] += 1
        return 0.0


class CountingStreams:
    """``offload.seams.Streams`` on the CPU that counts every call; copies are done at once and
    every event has completed, so the link's ordering code runs and nothing waits."""

    def __init__(self) -> None:
        self.counts = _Counts()
        self.compute = _Stream(self.counts)

    def current(self):
        self.counts["current"] += 1
        return self.compute

    def new_stream(self):
        self.counts["new_stream"] += 1
        return _Stream(self.counts)

    def event(self, timing: bool = False):
        self.counts["event"] += 1
        return _Event(self.counts)

    def using(self, stream):
        self.counts["using"] += 1
        return contextlib.nullcontext()

    def empty(self, nbytes: int) -> torch.Tensor:
        self.counts["empty"] += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def allocation_queues_work(self) -> bool:
        return False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.counts["copy"] += 1
        dst.copy_(src)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        self.counts["record_stream"] += 1

    def device_calls(self) -> int:
        """Calls that would reach the CUDA driver: everything but reading the current stream."""
        return sum(n for name, n in self.counts.items() if name != "current")


class _Ops(TorchDispatchMode):
    def __init__(self, counts: _Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[f"aten.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting():
    """Count aten ops and lock acquisitions on this thread inside the block (the collector held
    off, so no unrelated finalizer runs in it)."""
    counts = _Counts()

    def profile(frame, event, arg) -> None:
        # A lock taken by acquire() is one C call; one taken by a with block shows as its __exit__
        # (CPython reports no call of a with block's __enter__).
        if event == "c_call" and arg.__name__ in ("acquire", "__exit__") and type(arg.__self__) in LOCK_TYPES:
            counts["lock.acquire"] += 1

    gc.disable()
    sys.setprofile(profile)
    try:
        with _Ops(counts):
            yield counts
    finally:
        sys.setprofile(None)
        gc.enable()


def _activation() -> torch.Tensor:
    """A saved tensor as a layer's forward makes it: a non-leaf that requires grad."""
    return torch.randn(NUMEL, requires_grad=True).exp()


def _hooks():
    """The pack and unpack autograd would call now (the innermost pushed)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    assert hooks is not None, "no saved-tensor hooks are installed"
    return hooks


def _phases(eng: offload.Engine, t: torch.Tensor) -> dict[str, _Counts]:
    """Counts of one pack, one unpack and one release of ``t`` under ``eng``."""
    with eng:
        pack, unpack = _hooks()
        with counting() as packed:
            handle = pack(t)
    with counting() as unpacked:
        got = unpack(handle)
    assert torch.equal(got, t) and got.data_ptr() == t.data_ptr(), "the saved tensor itself comes back"
    del got
    with counting() as released:
        del handle
    return {"pack": packed, "unpack": unpacked, "release": released}


def _warm(eng: offload.Engine) -> None:
    """A first save makes the store (and reads the device): not per-tensor work."""
    keep = _activation()
    _phases(eng, keep)


def test_a_bare_pair_is_the_reference():
    """What the counters see of autograd's own bare hook pair: nothing."""
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        pack, unpack = _hooks()
        t = _activation()
        with counting() as counts:
            unpack(pack(t))
    assert counts == {}, counts


def test_a_save_that_only_counts_does_one_op_and_takes_one_lock_per_step():
    """Budget None, a counted step (the first after reset_stats; later ones push no hooks, tested
    below): pack makes the detached alias (one op, no allocation) under one lock; unpack and release
    take the lock once each and dispatch nothing; the link is never asked anything."""
    streams = CountingStreams()
    eng = offload.engine(None, device="cpu", min_offload_mb=0, link=CudaLink(torch.device("cpu"), streams=streams))
    _warm(eng)
    eng.reset_stats()  # the next step is counted, with the hooks on
    before = eng.stats
    t = _activation()
    phases = _phases(eng, t)
    assert phases["pack"] == {"aten.detach": 1, "lock.acquire": 1}, phases["pack"]
    assert phases["unpack"] == {"lock.acquire": 1}, phases["unpack"]
    assert phases["release"] == {"lock.acquire": 1}, phases["release"]
    assert streams.counts == {}, f"a save that only counts asked the link's device: {dict(streams.counts)}"
    stats = eng.stats
    assert stats.saved_tensors - before.saved_tensors == 1
    assert stats.saved_bytes - before.saved_bytes == t.untyped_storage().nbytes()
    assert stats.resident_bytes == 0, "released with its handle"
    eng.close()


def test_a_view_of_a_saved_storage_is_counted_once_on_the_same_path():
    """Dedup stays on the short path: a second save of the same storage (a view) is one op and one
    lock too, and its bytes are not counted again (budget None, a counted step)."""
    eng = offload.engine(None, device="cpu", min_offload_mb=0)
    _warm(eng)
    eng.reset_stats()  # the next step is counted, with the hooks on
    t = _activation()
    with eng:
        pack, unpack = _hooks()
        first = pack(t)
        saved = eng.stats.saved_bytes
        view = t[2:].view(-1, 2)
        with counting() as counts:
            second = pack(view)
    assert counts == {"aten.detach": 1, "lock.acquire": 1}, counts
    assert eng.stats.saved_bytes == saved and eng.stats.saved_tensors == 2  # t and its view (reset after the warm-up)
    got = unpack(second)
    assert torch.equal(got, view) and (got.stride(), got.storage_offset()) == (view.stride(), view.storage_offset())
    del first, second
    eng.close()


def test_a_passed_through_save_dispatches_its_alias_and_takes_no_lock():
    """Under min_offload_mb: the detached alias and nothing else, whatever the budget."""
    streams = CountingStreams()
    eng = offload.engine(0, device="cpu", link=CudaLink(torch.device("cpu"), streams=streams))
    t = _activation()
    with pytest.warns(UserWarning, match="under min_offload_mb"):
        phases = _phases(eng, t)
    assert phases["pack"] == {"aten.detach": 1}, phases["pack"]
    assert phases["unpack"] == {} and phases["release"] == {}, phases
    assert streams.counts == {}
    assert eng.stats.passthrough_tensors == 1 and eng.stats.saved_tensors == 0
    eng.close()


def test_under_a_budget_nothing_reaches_no_event_is_made_or_asked():
    """A budget with room: pack reads which stream is current (PyTorch's thread-local, to fence it
    if the tensor moves later) and nothing else of the device; unpack and release nothing."""
    streams = CountingStreams()
    eng = offload.engine(64, device="cpu", min_offload_mb=0, link=CudaLink(torch.device("cpu"), streams=streams))
    _warm(eng)
    streams.counts.clear()
    t = _activation()
    phases = _phases(eng, t)
    assert phases["pack"] == {"aten.detach": 1, "lock.acquire": 1}, phases["pack"]
    assert phases["unpack"] == {"lock.acquire": 1} and phases["release"] == {"lock.acquire": 1}, phases
    assert streams.counts == {"current": 1}, dict(streams.counts)
    assert streams.device_calls() == 0
    eng.close()


def _step(eng: offload.Engine, saves: int) -> None:
    x = torch.randn(NUMEL, requires_grad=True)
    with eng:
        y = x.exp()
        for _ in range(saves - 1):
            y = y.sin()
    y.sum().backward()
    assert x.grad is not None


def test_moving_every_tensor_makes_no_event_per_tensor():
    """Budget 0, every save copied out and back: the link's events come from pools, so a step
    makes none once one like it has run, however many tensors it moves (See Note: [events back
    to their pool] in offload/_memory/transfer.py); and no stream is made after the link's two."""
    made = {}
    for saves in STEPS_FOR_EVENTS:
        streams = CountingStreams()
        eng = offload.engine(0, device="cpu", min_offload_mb=0, link=CudaLink(torch.device("cpu"), streams=streams))
        _step(eng, saves)  # the pools fill
        first = streams.counts.copy()
        _step(eng, saves)
        stats = eng.stats
        assert stats.saved_tensors == 2 * saves and stats.offloaded_bytes == stats.saved_bytes, "every save moved"
        made[saves] = (streams.counts["event"] - first["event"], streams.counts["new_stream"])
        assert streams.counts["event.record"] - first["event.record"] >= 2 * saves, "each copy has its event"
        eng.close()
    assert made == {saves: (0, 2) for saves in STEPS_FOR_EVENTS}, made


def test_moved_gradients_equal_the_model_without_the_engine():
    """The counting link's copies are real: the chain's gradient equals the one without hooks."""
    torch.manual_seed(0)
    x = torch.randn(NUMEL, requires_grad=True)

    def chain() -> torch.Tensor:
        x.grad = None
        y = x.exp()
        for _ in range(31):
            y = y.sin()
        y.sum().backward()
        assert x.grad is not None
        return x.grad.clone()

    want = chain()
    eng = offload.engine(
        0, device="cpu", min_offload_mb=0, link=CudaLink(torch.device("cpu"), streams=CountingStreams())
    )
    with eng:
        x.grad = None
        y = x.exp()
        for _ in range(31):
            y = y.sin()
    y.sum().backward()
    assert torch.equal(x.grad, want)
    assert eng.stats.offloaded_bytes > 0
    eng.close()
