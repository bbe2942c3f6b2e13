"""The race detector proves itself: each guard the CUDA path's ordering rests on is removed, and
a scenario of ``test_races.py`` that reaches it must then show a race or a source gone.

White-box, on purpose: a guard is a line inside the engine (a keep-alive, a wait, a fence), and
removing one means replacing the function that holds it with the same code less the guard, with
``monkeypatch`` (no file edits). Nothing else here reaches past the public seams; the scenarios
themselves are ``test_races.py``'s. ``bench/mutants.py`` does the same for the rest of the suite
by editing a clone's source.
"""

from __future__ import annotations

import pytest

import offload._memory.entry
import offload._memory.inflight
import offload._memory.tiers
import offload._memory.transfer
from hb import Schedule
from offload._memory.entry import CopyState, Tier
from offload._memory.pending import FINISHED
from test_races import Outcome, run_scenario


def _climb_before_the_read_landed(monkeypatch) -> None:
    """disk -> host -> device: the copy up starts from the host block while the disk read into it
    is still in flight (``InFlight.climb`` waits for the hop below to be READY; ``poll`` for its
    ``filled.done()``)."""

    def climb(self, e):
        while e.nearest().tier is not Tier.DEVICE:
            near = e.nearest()
            above = self._above[near.tier]
            e.copies[above.tier] = self._tier[near.tier].start_back(near, above, e.nbytes)

    monkeypatch.setattr(offload._memory.inflight.InFlight, "climb", climb)


def _d2h_source_not_kept(monkeypatch) -> None:
    """A copy out of one tensor does not keep its source alive (``HostTier.start_out``'s ``add_reader``)."""

    def start_out(self, src, nbytes):
        block = self.arena.acquire(nbytes)
        if block is None:
            return None
        filled = self.link.d2h(offload._memory.tiers.as_bytes(src.data)[:nbytes], block.tensor)
        return offload._memory.entry.Copy(Tier.HOST, block, CopyState.FILLING, filled)

    monkeypatch.setattr(offload._memory.tiers.HostTier, "start_out", start_out)


def _batch_sources_not_kept(monkeypatch) -> None:
    """A batch's copy out does not keep its sources alive (``HostTier.start_out_all``'s ``add_reader``)."""

    def start_out_all(self, srcs, sizes):
        blocks = self.arena.acquire_all(sizes)
        if blocks is None:
            return None
        sources = [offload._memory.tiers.as_bytes(src.data)[:n] for src, n in zip(srcs, sizes, strict=True)]
        filled = self.link.d2h_all(sources, [b.tensor for b in blocks])
        return [offload._memory.entry.Copy(Tier.HOST, b, CopyState.FILLING, filled) for b in blocks]

    monkeypatch.setattr(offload._memory.tiers.HostTier, "start_out_all", start_out_all)


def _h2d_source_not_kept(monkeypatch) -> None:
    """A copy up does not keep its host block alive (``HostTier.start_back``'s ``add_reader``)."""

    def start_back(self, copy, above, nbytes):
        dst, filled = self.link.h2d(offload._memory.tiers.as_bytes(copy.data), nbytes)
        return offload._memory.entry.Copy(Tier.DEVICE, dst, CopyState.FILLING, filled)

    monkeypatch.setattr(offload._memory.tiers.HostTier, "start_back", start_back)


def _no_wait_at_use(monkeypatch) -> None:
    """The compute stream uses a reload without waiting for its copy (``CudaLink.wait_on_compute``)."""
    monkeypatch.setattr(
        offload._memory.transfer.CudaLink, "wait_on_compute", lambda self, event: self.streams.current()
    )


def _no_fences(monkeypatch) -> None:
    """Side streams copy without waiting for any fence (``_Direction.enter``)."""

    def enter(self, batch, fences):
        if self.stream is None:
            self.stream = self.streams.new_stream()
        if self.batch is not batch:
            self.batch, self.waited = batch, []
            self._open_span()
        return self.stream

    monkeypatch.setattr(offload._memory.transfer._Direction, "enter", enter)


def _landed_without_its_event(monkeypatch) -> None:
    """A copy out counts as landed whether or not its event says so (``InFlight.poll`` lands
    ``leaving`` entries only once their copy's ``filled.done()``)."""
    real = offload._memory.inflight.InFlight.poll

    def poll(self):
        for e in self.res.leaving:
            e.copies[self.out.tier].filled = FINISHED
        real(self)

    monkeypatch.setattr(offload._memory.inflight.InFlight, "poll", poll)


def _wait_on_the_wrong_stream(monkeypatch) -> None:
    """The wait at use goes to the stream the reload was allocated on, not the one using it (a
    stream read once and kept, instead of the current one at each use)."""

    def order_compute(self):
        streams = self.link.streams
        current = streams.current()
        with streams.using(self.alloc_stream if self.alloc_stream is not None else current):
            self.link.wait_on_compute(self.event)
        dst = None if self.dst is None else self.dst()
        if dst is not None and current != self.alloc_stream:
            streams.record_stream(dst, current)

    monkeypatch.setattr(offload._memory.transfer._CopyEvent, "order_compute", order_compute)


def _freed_in_flight(monkeypatch) -> None:
    """A tier frees a copy at once, even while a copy in flight reads or writes it (``_Tier.free``
    waits for ``Copy.settled``)."""
    monkeypatch.setattr(offload._memory.tiers._Tier, "free", lambda self, copy: self._release(copy))


GUARDS = {
    "climb to the device before the disk read landed": _climb_before_the_read_landed,
    "d2h source kept alive": _d2h_source_not_kept,
    "a batch's d2h sources kept alive": _batch_sources_not_kept,
    "h2d source kept alive": _h2d_source_not_kept,
    "wait at the point of use": _no_wait_at_use,
    "fences": _no_fences,
    "fences, a batch's copies out": _no_fences,
    "copy out landed only with its event": _landed_without_its_event,
    "a batch landed only with its event": _landed_without_its_event,
    "wait on the current stream": _wait_on_the_wrong_stream,
    "no free while a copy is in flight": _freed_in_flight,
}

CATCHES = {
    "climb to the device before the disk read landed": ("host_capped", ("timed0", "adversarial3-0")),
    "d2h source kept alive": ("dropped_one_by_one", ("timed0", "timed1")),
    "a batch's d2h sources kept alive": ("budget_50", ("timed0", "timed1")),
    "h2d source kept alive": ("backward_fails", ("timed0", "adversarial3-0")),
    "wait at the point of use": ("backward_fails", ("timed0", "timed2q50")),
    "fences": ("budget_0", ("timed0", "adversarial3-0")),
    "fences, a batch's copies out": ("budget_50", ("timed0", "adversarial3-0")),
    "copy out landed only with its event": ("dropped_one_by_one", ("timed0", "timed1")),
    "a batch landed only with its event": ("budget_50", ("timed0", "timed1")),
    "wait on the current stream": ("two_streams", ("timed0", "timed1")),
    "no free while a copy is in flight": ("backward_fails", ("timed0", "adversarial3-0")),
}
"""Per guard: a scenario that reaches it, and the schedules its removal is tried under."""


@pytest.fixture(scope="module")
def clean_runs(tmp_path_factory):
    """Each (scenario, schedule) run once on the engine as it is, for the guards to compare with."""
    runs: dict = {}

    def run(name: str, schedule: str) -> Outcome:
        if (name, schedule) not in runs:
            runs[name, schedule] = run_scenario(name, Schedule.named(schedule), tmp_path_factory.mktemp("clean"))
        return runs[name, schedule]

    return run


@pytest.mark.slow  # the mutation check: a run per guard removed
@pytest.mark.parametrize("guard", list(GUARDS))
def test_each_guard_removed_is_caught(guard, clean_runs, spill_dir, monkeypatch):
    """Removed, each guard shows a race or a source gone within its schedules; as it is, the same
    runs show none. The wait at the point of use is caught where the gradients still come out
    equal too: the copies happened to land in time, and only the clocks say nothing ordered them."""
    name, schedules = CATCHES[guard]
    for schedule in schedules:
        clean = clean_runs(name, schedule)
        assert clean.moved and clean.equal and not clean.caught, f"{name} under {schedule} as it is: {clean}"
    outcomes = {}
    with monkeypatch.context() as patched:
        GUARDS[guard](patched)
        for schedule in schedules:
            outcomes[schedule] = run_scenario(name, Schedule.named(schedule), spill_dir)
    caught = {schedule: o for schedule, o in outcomes.items() if o.caught and o.moved and o.error is None}
    assert caught, f"removing '{guard}' went unseen in {name} under {', '.join(schedules)}"
    if guard == "wait at the point of use":
        assert any(o.equal for o in caught.values()), "a run whose gradients came out equal was caught too"
