"""Where each entry is: the one owner of the store's containers, residences and byte totals.

An entry the store tracks sits in exactly one place, the one its ``Residence`` names::

    hot       HOT              the original is the only copy                 (save order)
    leaving   LEAVING          the original stays while a copy below fills   (eviction order)
    kept      KEPT             on the device for good
    below     AWAY, LOADED     a copy below is ready; LOADED holds a device copy too (landing order)

and, beside that, in indexes of what is under way or possible for it:

    host_lru    entries in ``below`` whose host copy could make room on the host (oldest first)
    demoting    entries in ``below`` whose host copy is being written to disk
    climbing    LOADED entries whose load is still on an intermediate tier (disk -> host)
    orphans     spill writes in flight whose entry was released (copies, not entries)
    held        the LOADED entry kept for its next user (See Note: [held for the next user] in ``store``)

Byte totals: ``hot_bytes`` (HOT), ``loaded_bytes`` (LOADED) and ``resident_bytes`` (HOT, LEAVING,
LOADED, KEPT), and the peaks of the last (``note_peak``). ``move`` is the only way an entry's
residence changes (``release_hot`` is its short path for the common case): it moves the entry,
its container and the totals together, so they cannot disagree. ``check`` states every
invariant in one place; the store never calls it (it is O(entries)), the tests call it after
every operation.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterator, Optional

from .entry import Copy, CopyState, Entry, Residence, Tier

__all__ = ["DEVICE_HELD", "Orphan", "Residency"]

DEVICE_HELD = frozenset((Residence.HOT, Residence.LEAVING, Residence.LOADED, Residence.KEPT))
"""Residences whose bytes are on the device and counted in ``resident_bytes``."""
# See Note: [enum members as module globals] in ``entry``
_HOT = Residence.HOT
_LEAVING = Residence.LEAVING
_AWAY = Residence.AWAY
_LOADED = Residence.LOADED
_KEPT = Residence.KEPT
_RELEASED = Residence.RELEASED


@dataclasses.dataclass(frozen=True)
class Orphan:
    """A spill write still in flight when its entry was released (a d2h copy cannot fail). Its
    memory is freed by its tier once it settles; the store only has to learn whether it failed."""

    copy: Copy
    nbytes: int
    left_device: bool
    """Counted in ``offloaded_bytes`` (a copy out of the device), not only in ``spilled_bytes``."""


class Residency:
    """The containers of one store's entries and their byte totals, moved together."""

    __slots__ = (
        "by_key",
        "hot",
        "kept",
        "leaving",
        "below",
        "host_lru",
        "demoting",
        "climbing",
        "orphans",
        "held",
        "below_stamp",
        "hot_bytes",
        "loaded_bytes",
        "resident_bytes",
        "peak_resident_bytes",
        "peak_over_budget_bytes",
    )

    def __init__(self) -> None:
        self.by_key: dict[int, Entry] = {}
        """Storage key -> the newest entry of that storage (what a new save may match)."""
        self.hot: dict[int, Entry] = {}
        self.kept: dict[int, Entry] = {}
        self.leaving: collections.deque[Entry] = collections.deque()
        self.below: dict[int, Entry] = {}
        self.host_lru: dict[int, Entry] = {}
        self.demoting: collections.deque[Entry] = collections.deque()
        self.climbing: list[Entry] = []
        self.orphans: list[Orphan] = []
        self.held: Optional[Entry] = None
        self.below_stamp = 0
        """Changes whenever an entry may have become one for the prefetch to load: one landed in
        ``below``, or a load went before all its users had it (given back, dropped for the budget,
        failed). The store's prefetch walk starts over when it changes (See Note: [the prefetch
        walk] in ``store``)."""
        self.hot_bytes = 0
        self.loaded_bytes = 0
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self.peak_over_budget_bytes = 0

    # ------------------------------------------------------------------ moves

    def add(self, e: Entry) -> None:
        """A new entry, HOT: its storage is the newest of its key."""
        self.by_key[e.key] = e
        self.hot[e.seq] = e
        self.hot_bytes += e.nbytes
        self.resident_bytes += e.nbytes

    def move(self, e: Entry, to: Residence) -> None:
        """Take ``e`` out of the place its residence names and put it where ``to`` names, totals
        included. To RELEASED it also leaves every index (its copies are the caller's to free)."""
        was = e.residence
        n = e.nbytes
        if was is _HOT:
            del self.hot[e.seq]
            self.hot_bytes -= n
        elif was is _LEAVING:
            if self.leaving[0] is e:
                self.leaving.popleft()
            else:
                self.leaving.remove(e)
        elif was is _KEPT:
            del self.kept[e.seq]
        elif was is _LOADED:
            self.loaded_bytes -= n
            if self.held is e:
                self.held = None
        elif was is _RELEASED:
            raise RuntimeError(f"offload internal error: the released saved tensor {e.describe} was moved to {to}")
        if to is _LEAVING:
            self.leaving.append(e)
        elif to is _KEPT:
            self.kept[e.seq] = e
        elif to is _AWAY or to is _LOADED:
            if was is not _AWAY and was is not _LOADED:
                self.below[e.seq] = e
                self.below_stamp += 1
            elif to is _AWAY and e.users_left > 0:  # a load dropped before its users: to load again
                self.below_stamp += 1
            if to is _LOADED:
                self.loaded_bytes += n
        elif to is _RELEASED:
            self._forget(e)
        else:  # HOT: only new entries are hot (``add``)
            raise RuntimeError(f"offload internal error: the saved tensor {e.describe} was moved back to {to}")
        # DEVICE_HELD is every residence but AWAY and RELEASED (and ``was`` is not RELEASED here)
        if was is not _AWAY:
            if to is _AWAY or to is _RELEASED:
                self.resident_bytes -= n
        elif to is not _AWAY and to is not _RELEASED:
            self.resident_bytes += n
        e.residence = to

    def release_hot(self, e: Entry) -> None:
        """``move(e, RELEASED)`` for a HOT entry, the common case, kept short (and its only copy goes)."""
        del self.hot[e.seq]
        n = e.nbytes
        self.hot_bytes -= n
        self.resident_bytes -= n
        if self.by_key.get(e.key) is e:
            del self.by_key[e.key]
        e.copies.clear()
        e.residence = _RELEASED

    def _forget(self, e: Entry) -> None:
        if self.by_key.get(e.key) is e:
            del self.by_key[e.key]
        if self.below.pop(e.seq, None) is not None:
            self.host_lru.pop(e.seq, None)
            if e in self.demoting:
                self.demoting.remove(e)
            if e in self.climbing:
                self.climbing.remove(e)

    def note_peak(self, budget_bytes: Optional[int], in_use: Optional[Entry] = None) -> None:
        """Record the peak where the budget holds: after pack and after unpack (the store calls this).

        Inside pack the new tensor is briefly counted before eviction reacts; it exists on the
        device with or without the engine, so that instant is not the engine's residency. After
        an unpack, the tensor autograd is using now is not counted either: a copy held for its
        next user over the budget (See Note: [held for the next user] in ``store``), or ``in_use``, a
        leaving entry whose original served the unpack while its copy out is still on its way (the
        budget fell after its pack: under ``budget_mb="auto"`` someone else took the memory).
        """
        resident = self.resident_bytes
        if self.held is not None:
            resident -= self.held.nbytes
        if in_use is not None and in_use is not self.held:
            resident -= in_use.nbytes
        if resident > self.peak_resident_bytes:
            self.peak_resident_bytes = resident
        if budget_bytes is not None and resident - budget_bytes > self.peak_over_budget_bytes:
            self.peak_over_budget_bytes = resident - budget_bytes  # the budget in force at this instant

    def stop_climbing(self, e: Entry) -> None:
        if e in self.climbing:
            self.climbing.remove(e)

    def entries(self) -> Iterator[Entry]:
        """Every entry tracked (not released), hottest place first."""
        yield from self.hot.values()
        yield from self.leaving
        yield from self.kept.values()
        yield from self.below.values()

    # ------------------------------------------------------------------ invariants

    def check(self) -> None:
        """Raise AssertionError naming the first invariant that does not hold (for tests)."""
        places = {
            Residence.HOT: list(self.hot.values()),
            Residence.LEAVING: list(self.leaving),
            Residence.KEPT: list(self.kept.values()),
        }
        seen: dict[int, str] = {}
        for where, group in (*places.items(), ("below", list(self.below.values()))):
            for e in group:
                assert id(e) not in seen, f"{e.describe} #{e.seq} is in {seen[id(e)]} and {where}"
                seen[id(e)] = str(where)
                allowed = (where,) if isinstance(where, Residence) else (Residence.AWAY, Residence.LOADED)
                assert e.residence in allowed, f"{e.describe} #{e.seq} is {e.residence} but sits in {where}"
        for container, d in (("hot", self.hot), ("kept", self.kept), ("below", self.below)):
            for seq, e in d.items():
                assert e.seq == seq, f"{container}[{seq}] holds entry #{e.seq}"
        for e in self.by_key.values():
            assert id(e) in seen, f"by_key holds {e.describe} #{e.seq}, tracked nowhere ({e.residence})"
        everything = list(self.entries())
        total = {r: sum(e.nbytes for e in everything if e.residence is r) for r in Residence}
        assert self.hot_bytes == total[Residence.HOT], f"hot_bytes {self.hot_bytes} != {total[Residence.HOT]}"
        assert self.loaded_bytes == total[Residence.LOADED], (
            f"loaded_bytes {self.loaded_bytes} != {total[Residence.LOADED]}"
        )
        resident = sum(total[r] for r in DEVICE_HELD)
        assert self.resident_bytes == resident, f"resident_bytes {self.resident_bytes} != {resident}"
        for e in everything:
            device = e.copies.get(Tier.DEVICE)
            if e.residence in (Residence.HOT, Residence.LEAVING, Residence.KEPT):
                assert device is not None and device.original, (
                    f"{e.describe} #{e.seq} {e.residence} without its original"
                )
            if e.residence is Residence.HOT:
                assert len(e.copies) == 1, f"HOT {e.describe} #{e.seq} has copies {sorted(e.copies)}"
            if e.residence is Residence.LEAVING:
                assert len(e.copies) == 2, f"LEAVING {e.describe} #{e.seq} has copies {sorted(e.copies)}"
            if e.residence is Residence.AWAY:
                assert device is None, f"AWAY {e.describe} #{e.seq} holds a device copy"
                assert any(c.state is CopyState.READY for c in e.copies.values()), f"AWAY #{e.seq}: no ready copy"
        for name, index in (("host_lru", list(self.host_lru.values())), ("demoting", list(self.demoting))):
            for e in index:
                assert self.below.get(e.seq) is e, f"{name} holds #{e.seq}, which is {e.residence}, not below"
                assert Tier.HOST in e.copies, f"{name} holds #{e.seq} without a host copy"
        for e in self.demoting:
            disk = e.copies.get(Tier.DISK)
            assert disk is not None and disk.state is CopyState.FILLING, f"demoting #{e.seq} without a disk write"
        for e in self.climbing:
            assert e.residence is Residence.LOADED and self.below.get(e.seq) is e, f"climbing #{e.seq} {e.residence}"
            assert Tier.DEVICE not in e.copies and self.climbing.count(e) == 1, f"climbing #{e.seq}: {e.copies}"
        if self.held is not None:
            held = self.held
            assert held.residence is Residence.LOADED and self.below.get(held.seq) is held, f"held #{held.seq}"
