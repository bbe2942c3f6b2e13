"""CudaLink's ordering on the CPU: the real link over emulated streams (``tests/hb.py``).

No GPU here, so ``CudaLink`` runs over ``EmulatedStreams``: CUDA's stream, event and caching
allocator semantics simulated on the test's thread, with every tracked access (a copy's read and
write, an allocation's fill, a producer's write on a side stream, a host write, a host op on a
reload, a free) checked against the earlier ones by happens-before (vector clocks), so a pair of
accesses to the same bytes that nothing orders is a race, found whatever the timing, and the
gradients show it too (the racing op writes 0xFF). Oracle: the model without the engine,
bitwise. Each test here names the guard it checks, and was run once with that guard removed: it
failed. ``test_races.py`` runs the spill-heavy scenarios, and ``test_race_guards.py`` removes every guard in turn.
"""

from __future__ import annotations

import contextlib
import copy
import time

import pytest
import torch
from torch import nn

import hb
import offload
from links import EmulatedCudaLink, EmulatedStreams
from zoo import MB, wait_clean

SIZE = 16 * 1024
"""Elements per saved tensor (64 KiB in fp32)."""
NBYTES = SIZE * 4


def _engine(link, budget_mb, **options):
    return offload.engine(budget_mb, device="cpu", min_offload_mb=0, link=link, **options)


def _under_engine(step, link, budget_mb, **options):
    """``step(eng)`` under a fresh engine over ``link``; its result and the stats once it settled and closed."""
    eng = _engine(link, budget_mb, **options)
    got = step(eng)
    stats = wait_clean(eng)
    eng.close()
    return got, stats


def _grads(model: nn.Module, x: torch.Tensor, eng=None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    if eng is None:
        loss = model(x).square().sum()
    else:
        with eng:
            loss = model(x).square().sum()
    loss.backward()
    return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]


def _assert_equal(want, got, what: str) -> None:
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(a, b), f"{what}: gradient {i} differs"


@pytest.fixture
def streams():
    made = EmulatedStreams(side_delay_s=0.001)
    with made.watching():
        yield made
    made.close()


class TanhChain(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.scale = nn.Parameter(torch.tensor(0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.depth):
            x = torch.tanh(x) * self.scale  # tanh saves its output; mul saves it too: two users
        return x


# ---------------------------------------------------------------------------------- item 2


class _ReloadsPerBatch(EmulatedCudaLink):
    """The emulated ``CudaLink``, counting the reloads (``h2d``) each batch (one pack or unpack) starts."""

    def __init__(self, streams) -> None:
        super().__init__(streams)
        self.per_batch: list[int] = [0]

    @contextlib.contextmanager
    def _counted(self):
        self.per_batch.append(0)
        with super().batch():
            yield

    def batch(self):
        return self._counted()

    def h2d(self, src_host, nbytes):
        self.per_batch[-1] += 1
        return super().h2d(src_host, nbytes)


def test_every_reload_destination_is_allocated_before_its_copy(streams):
    """Under deterministic algorithms with ``fill_uninitialized_memory`` each new device tensor is
    filled on the current stream. A batch that starts several reloads (a miss, then prefetches)
    must order each copy after its own destination's fill, not only the first one's (See Note:
    [fences before a copy]). Guard: the re-fence in ``CudaLink.h2d``."""
    streams.fills_new_memory = True
    model, x = TanhChain(12), torch.randn(SIZE)
    want = _grads(copy.deepcopy(model), x)
    link = _ReloadsPerBatch(streams)
    got, stats = _under_engine(lambda eng: _grads(model, x, eng), link, 4 * NBYTES / MB)
    assert max(link.per_batch) >= 2, "a batch started several reloads (the path under test)"
    assert stats.prefetch_misses < stats.reloaded_bytes // NBYTES, "prefetch started reloads ahead of use"
    assert streams.races == [], streams.races[:3]
    _assert_equal(want, got, "every destination filled before its copy")


# ---------------------------------------------------------------------------------- item 4


class ProducedOn(torch.autograd.Function):
    """sin(x), its output written on the stream current at the forward (tracked, late: the
    stream waits ``delay_s`` first), as a kernel on a side stream would write it. Saves it."""

    @staticmethod
    def forward(ctx, x, streams: EmulatedStreams):
        out = torch.full_like(x, float("nan"))
        values, raw = x.sin(), out.data  # ``.data``: a kernel's write bumps no version counter
        streams.write_on(streams.current(), raw, lambda: raw.copy_(values), "the producer's write")
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * (1 - out.square()).sqrt(), None  # cos(x) from sin(x), for x in (-pi/2, pi/2)


def test_a_copy_out_waits_for_the_stream_that_produced_its_source(streams):
    """A tensor saved on a side stream is evicted later, while another stream is current: its copy
    out must wait for the side stream's work (its producer), not only for the current stream's.
    Guard: ``CudaLink`` fencing every stream it saw at a batch (``_producers``) in ``d2h``."""
    side = streams.new_stream()
    side.delay_s = 0.05  # the producer's write lands well after the engine moves on
    x = torch.rand(SIZE) - 0.5  # within (-pi/2, pi/2)

    def step(eng=None):
        xi = x.clone().requires_grad_(True)
        with eng if eng is not None else torch.enable_grad():
            with streams.using(side):
                y = ProducedOn.apply(xi, streams)  # saved on the side stream
            z = torch.tanh(xi * 2)  # saves on the compute stream: the budget evicts y now
            w = torch.tanh(z * 3)
            streams.compute.wait_stream(side)  # the program orders its use of y after the side stream
            loss = (y * w).sum()
        loss.backward()
        return xi.grad.clone()

    want = step()
    link = EmulatedCudaLink(streams)
    got, stats = _under_engine(step, link, 2 * NBYTES / MB)  # one tensor hot, one leaving: y leaves at the next save
    assert stats.offloaded_bytes >= NBYTES and stats.reloaded_bytes >= NBYTES, "y went out and came back"
    assert streams.races == [], streams.races[:3]
    assert torch.equal(want, got), "the copy out read y before its producer had written it"


# ---------------------------------------------------------------------------------- item 3


class TanhOn(torch.autograd.Function):
    """tanh(x) with its forward and backward on ``stream``, as autograd runs a backward node on
    its forward's stream; the backward tells ``use`` which saved tensor it used, on which stream."""

    @staticmethod
    def forward(ctx, x, stream, streams: EmulatedStreams, use):
        with streams.using(stream):
            y = torch.tanh(x)
            ctx.save_for_backward(y)
        ctx.stream, ctx.streams, ctx.use = stream, streams, use
        return y

    @staticmethod
    def backward(ctx, grad):
        with ctx.streams.using(ctx.stream):
            (y,) = ctx.saved_tensors
            ctx.use(y, ctx.stream)
            return grad * (1 - y * y), None, None, None


class Mul(torch.autograd.Function):
    """x * y with its backward on ``stream``: saves both, so a tanh output it takes is used twice."""

    @staticmethod
    def forward(ctx, x, y, stream, streams: EmulatedStreams, use):
        with streams.using(stream):
            ctx.save_for_backward(x, y)
        ctx.stream, ctx.streams, ctx.use = stream, streams, use
        return x * y

    @staticmethod
    def backward(ctx, grad):
        with ctx.streams.using(ctx.stream):
            x, y = ctx.saved_tensors
            ctx.use(x, ctx.stream)
            return grad * y, grad * x, None, None, None


def test_a_reload_used_on_another_stream_is_recorded_there_ready_or_not(streams):
    """Each tanh output is used in backward by the Mul after it (on the other stream) and by its
    own node: the first use reloads it (no prefetch), so its destination belongs to that stream;
    the second use, on the other stream, finds the copy landed. (The budget lets each tanh output
    stay until the Mul has saved it too, so both saves are one entry.) Every use on a stream other
    than the allocating one must be recorded there (See Note: [a reload used on another stream]).
    Guard: ``Store._serve`` ordering a ready reload at each use, not only while it fills."""
    side = streams.new_stream()
    allocated: dict[int, tuple] = {}  # data_ptr -> (its stream, records before it) of the latest destination there
    real_empty = streams.empty

    def empty(nbytes):
        dst = real_empty(nbytes)
        allocated[dst.data_ptr()] = (streams.current(), len(streams.recorded))
        return dst

    streams.empty = empty  # type: ignore[method-assign]  # logs the allocating stream
    foreign: list = []  # per use of a reload on another stream than its own: was it recorded there?

    def use(tensor, stream):
        ptr = tensor.data_ptr()
        if ptr in allocated and allocated[ptr][0] is not stream:
            foreign.append((ptr, stream) in streams.recorded[allocated[ptr][1] :])

    x = torch.randn(SIZE)
    weights = [torch.full((SIZE,), 0.5 + 0.1 * i) for i in range(4)]

    def step(eng=None):
        xi = x.clone().requires_grad_(True)
        with eng if eng is not None else torch.enable_grad():
            h = xi * 1.0
            for i, weight in enumerate(weights):
                first, second = (streams.compute, side) if i % 2 == 0 else (side, streams.compute)
                h = Mul.apply(TanhOn.apply(h, first, streams, use), weight, second, streams, use)
            loss = h.sum()
        loss.backward()
        return xi.grad.clone()

    want = step()
    link = EmulatedCudaLink(streams)
    got, stats = _under_engine(step, link, 2 * NBYTES / MB, prefetch=False)
    assert torch.equal(want, got)
    assert stats.reloaded_bytes >= 3 * NBYTES and streams.races == []
    assert len(foreign) >= 3, "reloads were used on a stream other than their own (the path under test)"
    assert all(foreign), f"{foreign.count(False)} of {len(foreign)} uses on another stream were not recorded there"


# ---------------------------------------------------------------------------------- busy time


class ProducedLate(torch.autograd.Function):
    """tanh(x), its output written by a long kernel on the compute stream (``KERNEL_MS`` of
    virtual time), as a layer's forward would be. Saves it."""

    @staticmethod
    def forward(ctx, x, streams: EmulatedStreams):
        out = torch.full_like(x, float("nan"))
        values, raw = x.tanh(), out.data
        streams.write_on(streams.compute, raw, lambda: raw.copy_(values), "a long kernel", duration_ms=KERNEL_MS)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * (1 - out * out), None


KERNEL_MS = 10.0
COPY_MS = 1.0


def test_copy_busy_time_is_the_copies_not_the_waits_for_compute():
    """A side stream's busy time is what its copies take, not what it waits for: each copy out
    waits for a fence behind a long compute kernel, and the d2h busy time must still be one copy's
    time per copy (the streams' times are virtual, so the sum is exact). The start of a busy span
    is recorded after the stream's waits (``_Direction.enter``); recorded before them, each span
    would hold a kernel's worth of waiting."""
    streams = EmulatedStreams(side_delay_s=COPY_MS / 1e3)
    with streams.watching():
        x = torch.rand(SIZE) - 0.5

        def step(eng=None):
            h = x.clone().requires_grad_(True)
            with eng if eng is not None else torch.enable_grad():
                y = h
                for _ in range(6):
                    y = ProducedLate.apply(y, streams)
                loss = y.sum()
            loss.backward()
            return h.grad.clone()

        want = step()
        link = EmulatedCudaLink(streams)
        got, stats = _under_engine(step, link, 2 * NBYTES / MB, prefetch=False)
    streams.close()
    assert streams.races == [], streams.races[:3]
    assert torch.equal(want, got)
    assert link.d2h_count >= 4 and link.h2d_count >= 4, "copies went out and came back (the path under test)"
    assert stats.d2h_busy_ms == pytest.approx(link.d2h_count * COPY_MS, abs=1e-9), (
        f"{link.d2h_count} copies out of {COPY_MS} ms each, busy {stats.d2h_busy_ms} ms"
    )
    assert stats.h2d_busy_ms == pytest.approx(link.h2d_count * COPY_MS, abs=1e-9)


# ---------------------------------------------------------------------------------- the sanitizer's switch


@pytest.mark.parametrize("switch", [None, "argument", "OFFLOAD_ALWAYS_WAIT", "TORCH_CUDA_SANITIZER"])
def test_under_the_switch_every_use_waits_on_its_copy(switch, monkeypatch):
    """PyTorch's CUDA sanitizer sees stream waits, not ``Event.query()``: a wait at use skipped
    because the copy was done would read to it as a race. Under the switch (the argument, or the
    environment: ours, or the sanitizer's own) the compute stream waits at every use of a reload,
    done or not; without it, a copy already done is not waited for (See Note: [every wait
    unconditional under the sanitizer])."""
    if switch in ("OFFLOAD_ALWAYS_WAIT", "TORCH_CUDA_SANITIZER"):
        monkeypatch.setenv(switch, "1")
    waits: list[bool] = []  # per wait on the compute stream: was its event already done?
    real = hb.EmulatedStream.wait_event

    def wait_event(self, event):
        if self is self.sim.compute and event._record is not None:
            waits.append(self.sim._visible(event._record))
        real(self, event)

    monkeypatch.setattr(hb.EmulatedStream, "wait_event", wait_event)
    streams = EmulatedStreams(side_delay_s=0.0001)  # copies land long before their use
    model, x = TanhChain(8), torch.randn(SIZE)
    with streams.watching():
        want = _grads(copy.deepcopy(model), x)
        link = EmulatedCudaLink(streams, always_wait=True if switch == "argument" else None)
        got, stats = _under_engine(lambda eng: _grads(model, x, eng), link, 4 * NBYTES / MB)
    streams.close()
    assert streams.races == [] and stats.reloaded_bytes > 0
    _assert_equal(want, got, f"switch {switch}")
    if switch is None:
        assert not any(waits), "without the switch a copy already done is not waited for"
    else:
        assert sum(waits) >= 3, "under the switch the copies already done are waited for too"


@pytest.mark.parametrize("always_wait", [False, True])
def test_under_the_switch_a_copy_found_done_is_also_synchronized(always_wait, monkeypatch):
    """The store lets go of a copy's source (a ``set_`` the sanitizer reads as a write on the
    compute stream) once the copy's pending says it is done. The sanitizer does not see
    ``query()``, so under the switch a pending found done synchronizes its event too (free, it is
    done), which the sanitizer sees; without the switch it does not (See Note: [every wait
    unconditional under the sanitizer])."""
    synced: list = []
    real = hb.EmulatedEvent.synchronize
    monkeypatch.setattr(hb.EmulatedEvent, "synchronize", lambda self: (synced.append(self), real(self))[1])
    streams = EmulatedStreams(side_delay_s=0.0001)
    with streams.watching():
        link = EmulatedCudaLink(streams, always_wait=always_wait)
        src, host = torch.ones(NBYTES, dtype=torch.uint8), torch.empty(NBYTES, dtype=torch.uint8)
        with link.batch():
            pending = link.d2h(src, host)
        time.sleep(0.01)  # virtual: the copy lands
        done = pending.done()
    streams.close()
    assert done
    assert (pending.event in synced) is always_wait
    assert streams.races == []


@pytest.mark.parametrize("always_wait", [False, True])
def test_under_the_switch_each_reload_destination_has_a_fence_of_its_own(always_wait, monkeypatch):
    """Two copies back in one batch: without allocation work (no fill) they share the batch's
    fence on the compute stream, which is safe (nothing is queued on it in between). The sanitizer
    reads the ``empty`` that makes each destination as a write on the compute stream, after that
    fence: under the switch each destination's copy waits on a fence recorded after its allocation."""
    fences: list = []
    real = hb.EmulatedEvent.record
    streams = EmulatedStreams(side_delay_s=0.0001)

    def record(self, stream):
        if stream is streams.compute:
            fences.append(self)
        real(self, stream)

    monkeypatch.setattr(hb.EmulatedEvent, "record", record)
    with streams.watching():
        link = EmulatedCudaLink(streams, always_wait=always_wait)
        hosts = [torch.full((NBYTES,), i, dtype=torch.uint8) for i in (1, 2)]
        with link.batch():
            reloads = [link.h2d(host, NBYTES) for host in hosts]
        fences_in_batch = len(fences)
        for _, pending in reloads:
            pending.order_compute()
        landed = [dst.clone() for dst, _ in reloads]
    streams.close()
    assert streams.races == []
    assert [int(t[0]) for t in landed] == [1, 2]
    assert fences_in_batch == (2 if always_wait else 1), (len(fences), always_wait)


def test_each_step_on_a_new_stream_waits_on_its_own_streams_only(streams, monkeypatch):
    """A program that runs each step on a new stream: a copy out waits for a fence on every stream
    that may have produced a tensor still to go out, so once nothing is left hot between steps the
    streams of earlier steps drop out. Without that, the waits of the d2h stream grew with every
    step (one more fence per batch each step). Gradients exact at every step.
    The link served another engine before, closed by then: only a store still using the link
    counts. Guard: ``Store.step_started`` asking ``CudaLink.forget_producers`` when nothing is hot,
    and ``Store.close`` detaching from the link."""
    waits: list[int] = []
    real_wait = hb.EmulatedStream.wait_event

    def counting_wait(self, event):
        if waits and self.name.startswith("side") and self is not current_step_stream[0]:
            waits[-1] += 1
        return real_wait(self, event)

    monkeypatch.setattr(hb.EmulatedStream, "wait_event", counting_wait)
    current_step_stream: list = [None]
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.Tanh())])
    link = EmulatedCudaLink(streams)
    earlier = _engine(link, 2 * 64 * 64 * 4 / MB)  # an engine on this link before, closed: it lets go
    _grads(model, torch.randn(64, 64), earlier)
    earlier.close()
    eng = _engine(link, 2 * 64 * 64 * 4 / MB)
    for step in range(6):
        x = torch.randn(64, 64)
        want = _grads(model, x)
        stream = streams.new_stream()
        current_step_stream[0] = stream
        waits.append(0)
        with streams.using(stream):
            got = _grads(model, x, eng)
        streams.compute.wait_stream(stream)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), f"step {step}"
    stats = wait_clean(eng)
    eng.close()
    assert stats.offloaded_bytes > 0, "the premise: copies went out"
    assert streams.races == [], streams.races[:3]
    assert waits[-1] <= waits[1], f"the d2h stream's waits grew step by step: {waits}"


def test_two_engines_on_one_link_never_forget_each_others_streams(streams):
    """One link serves two engines (one ``Seams(link=...)`` passed to both). Engine B saves a tensor
    produced late on a side stream and keeps it hot across its two forwards; between them engine A
    starts a step with nothing of its own hot. A must not make the link forget the side stream:
    B's tensor is copied out later, under B, and that copy must still wait for its producer.
    Guard: ``CudaLink.forget_producers`` forgets only where one store uses the link (``attach``)."""
    side = streams.new_stream()
    side.delay_s = 0.05  # the producer's write lands well after the engine moves on
    x = torch.rand(SIZE) - 0.5  # within (-pi/2, pi/2)
    link = EmulatedCudaLink(streams)
    a, b = _engine(link, 2 * NBYTES / MB), _engine(link, 2 * NBYTES / MB)
    with a:  # A's store exists (made at its first save) and ends the step with nothing hot
        warm = torch.tanh(x.clone().requires_grad_(True) * 2)
    warm.sum().backward()

    def run(eng_b=None, eng_a=None) -> torch.Tensor:
        xi = x.clone().requires_grad_(True)
        with eng_b if eng_b is not None else contextlib.nullcontext():
            with streams.using(side):
                y = ProducedOn.apply(xi, streams)  # saved hot, under B
        if eng_a is not None:
            with eng_a:  # A's step starts: nothing of A's is hot
                pass
        with eng_b if eng_b is not None else contextlib.nullcontext():
            z = torch.tanh(xi * 2)  # saves on the compute stream: B's budget evicts y now
            w = torch.tanh(z * 3)
            streams.compute.wait_stream(side)
            loss = (y * w).sum()
        loss.backward()
        return xi.grad.clone()

    want = run()
    got = run(b, a)
    stats = wait_clean(b)
    a.close()
    b.close()
    assert stats.offloaded_bytes >= NBYTES, "y went out"
    assert streams.races == [], streams.races[:3]
    assert torch.equal(want, got), "the copy out read y before its producer had written it"
