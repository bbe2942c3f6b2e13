"""The host tier (pinned arena, copies with completions, host cap -> disk), driven on the CPU.

No GPU here, so the engine gets a stand-in link through ``offload.engine(link=...)`` (tests/links.py):
``DeferredLink`` lands a copy only when its completion is polled or waited on; ``ThreadedLink``
lands it on a background thread after a delay; both poison a host block the moment the engine
gives it back, and read each source either when the copy completes or, with "-start", over the
copy as a stream does (taken at the start, still alive and unchanged at the end). A store that
used a destination before its copy landed, let a copy's source go before the copy finished, or
started a copy from a source not yet filled, reads 0xFF and the gradients differ. Host memory
comes through the engine's host seam (``tests/hosts.py``); one test drives the pinned arena
(``offload._memory.arena``) directly, white-box, to see when it empties the pinned cache.
"""

from __future__ import annotations

import gc
import logging
import time

import pytest
import torch
import torch.nn as nn

import offload
import offload._memory.arena
from hb import detecting
from hosts import StandInHost
from links import EmulatedCudaLink, EmulatedStreams, LandsOnCue, Reads, ThreadedLink, link_named
from offload.seams import PinnedSlabs
from zoo import MB, wait_clean


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(8)])


def _grads(model, x, eng=None, retain=False):
    model.zero_grad()
    if eng is None:
        loss = model(x).square().mean()
    else:
        with eng:
            loss = model(x).square().mean()
    loss.backward(retain_graph=retain)
    if retain:
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _engine(link, host=None, **kwargs):
    """An engine with a host tier over ``link``; a stand-in ``host`` runs its spill jobs where the
    link's own host would (an emulator's schedule)."""
    if host is not None:
        host.base = getattr(link, "host", None)
    return offload.engine(device="cpu", min_offload_mb=0, link=link, host=host, **kwargs)


@pytest.fixture(
    params=[
        "deferred-1",
        "deferred-4",
        "threaded",
        "deferred-4-start",
        "threaded-start",
        "emulated",
        "emulated-adversarial3-0",
        pytest.param("emulated-timed2q50", marks=pytest.mark.slow),
        pytest.param("emulated-adversarial8-2", marks=pytest.mark.slow),
    ]
)
def link(request):
    with link_named(request.param) as made:
        yield made


@pytest.mark.sweep
@pytest.mark.parametrize("budget_mb", [0, 0.25, 0.5])
def test_host_tier_gradients_bitwise_equal(budget_mb, link):
    model, x = _model(), torch.randn(256, 128)
    want = _grads(model, x)
    eng = _engine(link, budget_mb=budget_mb)
    for _ in range(2):
        eng.reset_stats()
        got = _grads(model, x, eng)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        stats = wait_clean(eng)
        assert stats.offloaded_bytes > 0 and link.d2h_count > 0 and link.h2d_count > 0
        # Each moved storage comes back at most once (one still leaving when backward reached it is
        # served from its original and not read back at all).
        assert 0 < stats.reloaded_bytes <= stats.offloaded_bytes
        assert stats.spilled_bytes == 0  # no host cap: everything fits in host memory
        assert stats.host_in_use_bytes == 0 and stats.spill_files == 0
        assert stats.peak_resident_bytes <= budget_mb * MB
    eng.close()
    assert eng.stats.host_bytes == 0, "close() gives the host memory back"


def test_host_cap_spills_to_disk_and_reads_back(tmp_path, link):
    model, x = _model(), torch.randn(256, 128)
    want = _grads(model, x)
    eng = _engine(link, budget_mb=0.5, host_budget_mb=0.5, spill_dir=tmp_path)
    got = _grads(model, x, eng)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    stats = wait_clean(eng, tmp_path)
    assert stats.spilled_bytes > 0
    assert stats.host_bytes <= 0.5 * MB, "the host cap bounds the memory really held"
    assert stats.host_in_use_bytes == 0
    eng.close()
    assert list(tmp_path.iterdir()) == []


def test_host_tier_retain_graph_twice(tmp_path, link):
    model, x = _model(), torch.randn(256, 128)
    want = _grads(model, x, retain=True)
    eng = _engine(link, budget_mb=0.5, host_budget_mb=1, spill_dir=tmp_path)
    got = _grads(model, x, eng, retain=True)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    wait_clean(eng, tmp_path)
    eng.close()


def test_host_tier_forward_without_backward_leaves_nothing(tmp_path, link):
    model, x = _model(), torch.randn(256, 128)
    eng = _engine(link, budget_mb=0.25, host_budget_mb=0.5, spill_dir=tmp_path)
    with eng:
        loss = model(x).square().mean()
    del loss
    gc.collect()
    stats = wait_clean(eng, tmp_path)
    assert stats.resident_bytes == 0 and stats.spill_bytes == 0 and stats.host_in_use_bytes == 0
    eng.close()


def test_fresh_inputs_every_step_under_a_slow_link(tmp_path):
    """A stale copy (from the previous step) cannot look right: the input changes every step."""
    model = _model()
    link = ThreadedLink(delay_s=0.005)
    eng = _engine(link, budget_mb=0.25, host_budget_mb=0.75, spill_dir=tmp_path)
    for step in range(3):
        torch.manual_seed(100 + step)
        x = torch.randn(256, 128)
        want = _grads(model, x)
        got = _grads(model, x, eng)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), f"step {step}"
    wait_clean(eng, tmp_path)
    eng.close()
    link.close()
    assert link.sources_gone == 0


class _SlowReads(StandInHost):
    """Every spill-file read first sleeps ``delay_s`` on its worker thread, so a read back into a
    host block is still in flight when the next unpack polls; counts the reads (``reads``)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def preadv(self, fd, buffers, offset):
        time.sleep(self.delay_s)
        return super().preadv(fd, buffers, offset)


def test_a_climb_from_disk_starts_its_copy_up_only_once_the_read_landed(tmp_path):
    """disk -> host -> device: the copy up from the host block starts only after the disk read into
    it has landed. Reads are slow and the link reads each source over its copy, as a stream does,
    so a copy started on a block still being filled gets garbage (the climb's ``filled.done()``
    condition in ``Store._poll`` is what prevents it; with it removed this test fails)."""
    reads = _SlowReads(delay_s=0.05)
    model, x = _model(), torch.randn(256, 128)
    want = _grads(model, x)
    link = ThreadedLink(delay_s=0.001, reads=Reads.OVER_THE_COPY)
    eng = _engine(link, host=reads, budget_mb=0.5, host_budget_mb=0.25, spill_dir=tmp_path)
    got = _grads(model, x, eng)
    stats = wait_clean(eng, tmp_path)
    eng.close()
    link.close()
    assert stats.spilled_bytes > 0 and reads.reads > 0, "tensors went to disk and were read back"
    assert link.sources_changed == 0, "a copy up started from a host block still being read into"
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


CHAIN_NUMEL = 16 * 1024
"""Elements of each tensor of ``_tanh_chain`` (64 KiB in fp32)."""


def _tanh_chain(x: torch.Tensor, scale: torch.Tensor, depth: int, between_users=None) -> torch.Tensor:
    """``depth`` times ``x = tanh(x) * scale``: tanh saves its output and mul saves it too, so each
    storage but the first has two users in backward, mul's first. ``between_users`` runs between
    the two users of the second newest storage."""
    for i in range(depth):
        y = torch.tanh(x)
        if between_users is not None and i == depth - 2:
            y.register_hook(lambda grad: between_users() or grad)  # after mul's backward, before tanh's
        x = y * scale
    return x


def test_a_leaving_tensor_that_backward_reached_is_not_read_back(tmp_path):
    """Backward reaches a tensor while its copy out is still in flight: its first user is served
    from the original; the copy then lands before the second user. The original must stay for the
    second user, not be dropped and read back (``Store._land_out`` keeps it while ``users_left``)."""
    depth, nbytes = 6, CHAIN_NUMEL * 4
    x, scale = torch.randn(CHAIN_NUMEL), torch.tensor(0.9, requires_grad=True)
    _tanh_chain(x, scale, depth).sum().backward()
    want = scale.grad.clone()
    scale.grad = None
    link = LandsOnCue()
    # Two tensors: the newest stays, the one before it is still leaving when backward starts.
    eng = _engine(link, budget_mb=2 * nbytes / MB, prefetch=False, spill_dir=tmp_path)
    with eng:
        loss = _tanh_chain(x, scale, depth, between_users=link.land).sum()
    leaving = [p for p in link.out if p._copy is not None]
    assert len(leaving) == 1, "one copy out in flight as backward starts (the path under test)"
    loss.backward()
    stats = wait_clean(eng, tmp_path)
    eng.close()
    assert torch.equal(scale.grad, want)
    assert stats.reloaded_bytes == (depth - 2) * nbytes, "neither the hot tensor nor the leaving one came back"
    assert link.h2d_count == depth - 2


def test_a_copy_out_keeps_its_source_until_it_lands(tmp_path):
    """The graph dies while copies out are in flight: their sources stay alive (and counted as
    resident) until the copies land, never let go under them (See Note: [keep-alive until the copy
    event]). Read in the test itself, not only by the fixture's check afterwards."""
    depth, nbytes = 6, CHAIN_NUMEL * 4
    x, scale = torch.randn(CHAIN_NUMEL), torch.tensor(0.9, requires_grad=True)
    link = LandsOnCue(reads=Reads.OVER_THE_COPY)  # copies out land when waited on, or on cue
    eng = _engine(link, budget_mb=2 * nbytes / MB, spill_dir=tmp_path)
    with eng:
        loss = _tanh_chain(x, scale, depth).sum()
    in_flight = eng.stats.resident_bytes - nbytes  # all but the newest tensor: leaving
    assert in_flight > 0, "copies out in flight as the graph dies (the path under test)"
    del loss
    gc.collect()
    assert eng.stats.resident_bytes >= in_flight, "a source in flight was let go (or stopped counting)"
    link.land()
    stats = wait_clean(eng, tmp_path)
    eng.close()
    assert link.sources_gone == 0 and link.sources_changed == 0, "a copy's source went before it landed"
    assert stats.resident_bytes == 0


def test_engines_one_after_another_share_pinned_slabs():
    """Engines whose links share a ``PinnedSlabs`` (a benchmark's configurations) pin once: the
    second takes the slabs the first gave back when it closed, exactly, and the same steps hold
    the same bytes; ``clear()`` lets them go. Without sharing each engine pins its own."""
    counts = StandInHost()  # counts the slabs allocated ("pinned")
    model, x = _model(), torch.randn(256, 128)
    want = _grads(model, x)
    shared = PinnedSlabs()
    held = []
    for _ in range(2):
        with detecting(slabs=shared) as link:
            eng = _engine(link, host=counts, budget_mb=0)
            assert all(torch.equal(a, b) for a, b in zip(want, _grads(model, x, eng), strict=True))
            held.append(wait_clean(eng).host_bytes)
            eng.close()
        assert eng.stats.host_bytes == 0 and shared.idle_bytes == held[-1], "closed: its slabs wait in the pool"
    assert counts.pin_tries == 1 and held[0] == held[1] > 0, "the second engine pinned nothing"
    shared.clear()
    assert shared.idle_bytes == 0
    with detecting() as link:
        eng = _engine(link, host=counts, budget_mb=0)
        _grads(model, x, eng)
        eng.close()
    assert counts.pin_tries == 2, "an engine of its own pins its own"


class _PinsAndEmpties(StandInHost):
    """A host whose slabs are "pinned" in plain memory (no device here), counting every emptying
    of the caching host allocator."""

    def __init__(self) -> None:
        super().__init__()
        self.emptied = 0

    def allocate(self, nbytes: int, pin: bool) -> torch.Tensor:
        return super().allocate(nbytes, False)

    def return_pinned(self) -> None:
        self.emptied += 1


def test_emptying_the_pinned_cache_stays_out_of_acquire(monkeypatch):
    """At its cap with idle slabs too small for a request, the arena drops them for a larger one;
    the caching host allocator is emptied (process-wide, and it synchronizes the device), and the
    copies settled first, only once the step is over (``return_unpinned``, from the store as the
    next step starts), never in ``acquire``, which runs under the store's lock in a pack (See
    Note: [emptying the pinned cache]).

    White-box: the arena (a pure data structure once its host is a stand-in) is driven directly.
    torch's own ways to empty the cache count too, so an emptying that went around the host would
    be seen."""
    stand_in = _PinsAndEmpties()

    def emptied_around_the_host() -> None:
        stand_in.emptied += 1

    for owner, name in ((getattr(torch, "accelerator", None), "empty_host_cache"), (torch._C, "_host_emptyCache")):
        if owner is not None:
            monkeypatch.setattr(owner, name, emptied_around_the_host, raising=False)
    settled = []
    slab = offload._memory.arena.SLAB_BYTES
    arena = offload._memory.arena.HostArena(2 * slab, pin=True, settle=lambda: settled.append(True), host=stand_in)
    blocks = [arena.acquire(slab * 5 // 8) for _ in range(2)]  # one 64 MiB slab each: the cap
    assert all(b is not None for b in blocks) and arena.held_bytes == 2 * slab
    for block in blocks:
        arena.release(block)
    large = arena.acquire(slab * 3 // 2)  # fits in no idle slab: they go for one of 2 x 64 MiB
    assert large is not None and arena.held_bytes == 2 * slab
    assert stand_in.emptied == 0 and settled == [], "acquire emptied the pinned cache (hot path)"
    assert arena.pinned_bytes == 4 * slab, "the dropped slabs' pages are still pinned, and counted"
    arena.return_unpinned()
    assert stand_in.emptied == 1 and settled == [True] and arena.pinned_bytes == 2 * slab
    arena.release(large)
    arena.clear()
    assert stand_in.emptied == 2 and arena.pinned_bytes == 0


def _pageable_run(host_budget_mb: float, spill_dir, budget_mb: float = 0) -> tuple:
    """The MLP at ``budget_mb``, its copies 1 ms each (virtual), under ``host_budget_mb``: what the
    pageable fallback cost (copies from pageable memory, virtual ms the host waited for them)."""
    model, x = _model(), torch.randn(256, 128)
    want = _grads(model, x)
    streams = EmulatedStreams(side_delay_s=0.001)
    link = EmulatedCudaLink(streams)
    with streams.watching():
        eng = _engine(link, budget_mb=budget_mb, host_budget_mb=host_budget_mb, spill_dir=spill_dir)
        got = _grads(model, x, eng)
        stats = wait_clean(eng, spill_dir)
        eng.close()
    link.close()
    assert streams.races == [], streams.races[:1]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    return stats, streams.pageable_copies, streams.pageable_stall_ms, streams.now


def test_the_pageable_fallback_makes_the_host_wait_for_the_copy_stream(spill_dir, caplog):
    """A read back from disk finds the pinned tier full and lands in pageable memory; its copy to
    the device then stages through pinned memory, so the host waits until the h2d stream reaches
    it: every copy queued there before, and the fence that stream waits on, i.e. compute's work
    up to the reload (cudaMemcpyAsync from pageable memory; ``copy_kernel_cuda`` records no event
    it could wait on instead). On the emulated link that wait is measured in virtual time; with
    the host tier roomy enough, it is zero."""
    with caplog.at_level(logging.WARNING, logger="offload"):
        capped, copies, stall_ms, _ = _pageable_run(0.25, spill_dir, budget_mb=0.5)
    assert capped.spilled_bytes > 0 and copies > 0, "reads back from disk landed in pageable memory"
    assert stall_ms >= copies * 1.0, "each one held the host for at least its own 1 ms copy"
    assert any("pageable" in r.getMessage() for r in caplog.records), "the fallback is said once"
    roomy, none, no_stall_ms, _ = _pageable_run(4.0, spill_dir, budget_mb=0.5)
    assert roomy.spilled_bytes == 0 and none == 0 and no_stall_ms == 0.0
