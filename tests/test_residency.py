"""Where each entry is, under random sequences of everything that moves it (model-based).

The store is driven directly, on the CPU, with the host tier over ``tests/links.py``'s
``DeferredLink`` (a copy lands when it has been polled enough, or is waited on) and a small host
cap in front of the real spill file, so evictions, demotions to disk, climbs back through the host,
prefetches and holds all happen. Each sequence mixes packs (new storages, the same tensor again,
eager ones), unpacks of any live handle in any order, landings (polls), spill writes and reads
that fail for a while, and releases (handles dying). After every operation
``Residency.check()`` must hold: every entry in exactly one place, its residence that place's,
the byte totals equal to the sums over the entries, the indexes (host_lru, demoting, climbing,
held) consistent. The model is the tensors themselves: every unpack
that succeeds returns the saved values exactly (``torch.equal``); one that fails raises
``OffloadError``, and only after a read failed (a prefetch's read can fail before its unpack);
once faults stop, every tensor comes back. At the end, with every handle gone and the store
closed, nothing is held.

White-box, on purpose: the store, its residency and its in-flight copies are driven and read
directly (``offload._memory``), because what is checked is their invariants, which no public
seam shows between two operations. Faults come through the public host seam (``tests/hosts.py``).

Checked by hand, each invariant broken on purpose: with ``Residency.move`` not taking
``loaded_bytes`` down when an entry leaves LOADED, every seed fails ("loaded_bytes 16384 != 0");
with a released entry left in ``host_lru``, every seed fails ("host_lru holds #1, which is
Residence.RELEASED, not below").
"""

from __future__ import annotations

import errno
import gc
import random
import threading

import pytest
import torch

from hosts import StandInHost
from links import DeferredLink
from offload._config import Config
from offload._errors import OffloadError
from offload._memory.entry import Residence
from offload._memory.store import Store
from offload._stats import Counters

SIZES = (1024, 4096, 16 * 1024)
"""Elements (fp32) of the saved tensors: 4 KiB to 64 KiB."""
OPERATIONS = 500
"""Operations per sequence: enough that every transition happens several times (see the counts)."""
SEEDS = range(8)
BUDGETS_MB = (0.25, 0.1, 0)
"""At budget 0 pack waits for every copy out to land, so no entry is HOT or LEAVING between operations."""


class _Faults:
    """Spill writes and reads that fail while ``writes`` / ``reads`` is set (ENOSPC / EIO)."""

    def __init__(self) -> None:
        self.host = StandInHost()

    @property
    def failed_reads(self) -> int:
        return self.host.failed_reads

    def set(self, writes: bool, reads: bool) -> None:
        self.host.writes_ok = 0 if writes else None
        self.host.read_error = errno.EIO if reads else None


def _store(tmp_path, budget_mb, host_budget_mb, host: StandInHost, polls: int = 2) -> Store:
    config = Config.from_user(
        budget_mb, device="cpu", min_offload_mb=0, host_budget_mb=host_budget_mb, spill_dir=tmp_path
    )
    return Store(config, torch.device("cpu"), Counters(), link=DeferredLink(polls), host=host)


def _check(store: Store) -> None:
    with store._lock:
        store.residency.check()


@pytest.mark.sweep
@pytest.mark.parametrize("seed", SEEDS)
def test_every_entry_is_in_one_place_after_every_operation(seed, tmp_path, caplog):
    rng = random.Random(seed)
    faults = _Faults()
    budget_mb = BUDGETS_MB[seed % len(BUDGETS_MB)]
    store = _store(tmp_path, budget_mb, host_budget_mb=0.25, host=faults.host)
    tensors: list[torch.Tensor] = []  # kept alive, so a save of the same tensor again finds its entry
    live: list[tuple[object, torch.Tensor]] = []  # (handle, the values it must give back)
    seen: dict[str, int] = {}
    places: set[Residence] = set()
    for step in range(OPERATIONS):
        op = rng.choices(("pack", "pack_again", "unpack", "release", "poll", "faults"), weights=(6, 2, 6, 3, 3, 1))[0]
        if op == "pack_again" and not tensors:
            op = "pack"
        if op in ("unpack", "release") and not live:
            op = "pack"
        seen[op] = seen.get(op, 0) + 1
        if op == "pack":
            t = torch.full((rng.choice(SIZES),), float(step))
            live.append((store.pack(t, eager=rng.random() < 0.3), t.clone()))
            if rng.random() < 0.5:
                tensors.append(t)
        elif op == "pack_again":
            t = rng.choice(tensors)
            live.append((store.pack(t), t.clone()))
        elif op == "unpack":
            handle, want = rng.choice(live)
            try:
                got = store.unpack(handle)
            except OffloadError:
                seen["failed_unpack"] = seen.get("failed_unpack", 0) + 1
                # a read that failed (a prefetch's, perhaps earlier) fails one unpack, then is forgotten
                assert seen["failed_unpack"] <= faults.failed_reads, "an unpack failed without a failed read"
            else:
                assert torch.equal(got, want), f"seed {seed} step {step}: an unpack gave other values"
                del got
        elif op == "release":
            live.pop(rng.randrange(len(live)))
            if rng.random() < 0.3 and tensors:
                tensors.pop(rng.randrange(len(tensors)))  # handles hold no cycle: refcounting frees them now
        elif op == "poll":
            with store._lock:
                store._flight.poll()
        else:
            faults.set(writes=rng.random() < 0.5, reads=rng.random() < 0.5)
        _check(store)
        places.update(e.residence for e in store.residency.entries())
    faults.set(writes=False, reads=False)
    for handle, want in live:  # every tensor still comes back right
        assert torch.equal(store.unpack(handle), want), f"seed {seed}: an unpack at the end gave other values"
        _check(store)
    live.clear()
    tensors.clear()
    handle = want = t = None  # the loops' last references too
    gc.collect()
    _check(store)
    assert list(store.residency.entries()) == [], "every handle died: no entry is left"
    store.close()
    gauges = store.gauges()
    assert gauges.resident_bytes == 0 and gauges.host_in_use_bytes == 0 and gauges.spill_bytes == 0, gauges
    want = {Residence.AWAY, Residence.LOADED} | ({Residence.HOT, Residence.LEAVING} if budget_mb else set())
    assert want <= places, places
    assert seen.get("pack", 0) > 50 and seen.get("unpack", 0) > 50 and seen.get("release", 0) > 20, seen


def test_a_demotion_failing_after_its_tensor_died_is_not_counted(tmp_path):
    """A host copy is being written to disk (demoted) when its tensor dies; the write then fails.
    It wrote nothing, so once the store has settled it (close() waits for it) spilled_bytes does not
    count it: the store keeps the write as an orphan (``InFlight.adopt_orphans``) to learn how it ended.

    Driven through the store itself: a demotion starts where pack makes host room, and pack waits
    for it to land before it returns, holding the store's lock, so a handle dying meanwhile has its
    release queued until after the write's failure is taken; the orphan path, a release handled
    while the write is still in flight, is reached only by starting the demotion as that code
    does. (``test_faults.py`` runs the public path: a second thread's forward demotes while the
    first graph is freed.)"""
    host = StandInHost()
    gate = threading.Event()

    def held_then_failed(n: int, offset: int) -> None:
        gate.wait(10.0)
        raise OSError(errno.ENOSPC, "No space left on device")

    host.before_write = held_then_failed
    store = _store(tmp_path, 0, host_budget_mb=1, host=host, polls=1)
    t = torch.randn(16 * 1024)
    handle = store.pack(t)
    del t
    with store._lock:
        store._flight.poll()
        entry = next(iter(store.residency.host_lru.values()))
        store._flight.free_host_copy_or_demote(entry)  # as making host room starts a demotion
    assert store.counters.spilled_bytes == entry.nbytes, "the demotion is in flight, counted"
    del handle, entry  # the tensor dies with its write in flight
    gc.collect()
    assert list(store.residency.entries()) == []
    gate.set()  # ... and then the write fails
    store.close()
    assert store.counters.spilled_bytes == 0, "a write that failed is not counted as spilled"
    assert host.writes == 1
    assert list(tmp_path.iterdir()) == [], "the spill file and its directory went with close()"
