"""Counters of what the engine did, the frozen snapshot users read, and the profiler's named ranges.

The store updates a mutable ``Counters`` under its lock; ``Engine.stats`` hands out a frozen
``Stats`` built from it and from the store's gauges (what it holds now), which are read, never
reset. Byte counts are of distinct storages: a storage saved by several ops (or as several views)
counts once. At budget None (no regions) only counted steps are in the counts: the first step after
the engine was made or ``reset_stats()``; ``Stats.uncounted_steps`` says how many ran since uncounted.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional, Union

import torch

__all__ = ["Counters", "Gauges", "Stats", "record"]

_profiling = torch._C._autograd._profiler_enabled
"""Whether a profiler (``torch.profiler``, legacy or Kineto) records now: one C call, ~30 ns."""
_NO_RANGE = contextlib.nullcontext()
"""What ``record`` returns while no profiler records (a nullcontext can be entered again and again)."""


def record(name: str) -> Union[torch.autograd.profiler.record_function, contextlib.nullcontext]:
    """A named range in ``torch.profiler`` traces (``offload::d2h``, ``offload::recompute``, ...),
    or nothing while no profiler records: a ``record_function`` costs ~5 us on the CPU even then
    (it enters a dispatcher op), which was most of the store's own time per moved tensor."""
    if _profiling():
        return torch.autograd.profiler.record_function(name)
    return _NO_RANGE


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stats:
    """A snapshot of one engine's work since it was made or since ``reset_stats()``."""

    saved_tensors: int = 0
    """Saved tensors the engine manages (each pack of an eligible tensor)."""
    passthrough_tensors: int = 0
    """Saved tensors left untouched: parameters and their views, tiny ones, other devices, fakes."""
    saved_bytes: int = 0
    """Bytes of distinct storages the engine manages."""
    offloaded_bytes: int = 0
    """Bytes moved off the compute device (to host memory on CUDA, to disk on the CPU)."""
    reloaded_bytes: int = 0
    """Bytes brought back to the compute device for backward. A moved storage comes back once per
    backward when its users there are adjacent, so for a plain training step this is about
    ``offloaded_bytes``; one whose users are far apart is read again when the budget needs the room
    meanwhile (so at budget 0 this is a little more than ``offloaded_bytes``)."""
    spilled_bytes: int = 0
    """Bytes written to the spill file."""
    resident_bytes: int = 0
    """Engine-managed activation bytes on the compute device now, copies in flight included (a gauge)."""
    peak_resident_bytes: int = 0
    """The most ``resident_bytes`` has been since the engine was made or ``reset_stats()``."""
    peak_over_budget_bytes: int = 0
    """The most ``resident_bytes`` exceeded the budget in force at that instant (0: the budget held
    throughout). With ``budget_mb="auto"`` the budget moves within a step, so this, not
    ``budget_bytes`` at the end, says whether every instant kept to it."""
    host_bytes: int = 0
    """Host memory the host tier holds now (CUDA: pinned slabs, in use or idle, and those dropped
    in this step whose pages go back as the next starts; a gauge)."""
    host_in_use_bytes: int = 0
    """Of ``host_bytes``, what holds copies now; the rest is idle, kept for reuse (a gauge)."""
    spill_bytes: int = 0
    """Bytes of the spill file holding copies now, each copy's extent rounded up to a multiple of
    4 KiB, the block direct I/O needs (a gauge)."""
    spill_files: int = 0
    """Spill files on disk now: one per engine once it first spilled, none after ``close()`` (a gauge)."""
    prefetch_hits: int = 0
    """Unpacks whose tensor was already back on (or on its way to) the device."""
    prefetch_misses: int = 0
    """Unpacks that had to start their own reload."""
    reload_wait_ms: float = 0.0
    """Time backward stalled for data to come back: host waits for disk reads, plus on CUDA the
    compute stream's waits on copies not yet landed (CUDA events)."""
    evict_wait_ms: float = 0.0
    """Host-side time pack spent waiting for copies to drain to stay within the budget."""
    d2h_busy_ms: float = 0.0
    """CUDA: time the device-to-host stream spent copying (CUDA events); 0 elsewhere.
    ``offloaded_bytes`` over it is the achieved d2h bandwidth."""
    h2d_busy_ms: float = 0.0
    """CUDA: time the host-to-device stream spent copying (CUDA events); 0 elsewhere."""
    recomputed_regions: int = 0
    """Region forwards run as recompute (inputs kept, the rest re-run in backward)."""
    peak_region_bytes: int = 0
    """The most bytes one recomputed or selective region held itself, outside the store: every
    tensor its forward saved, held while that forward ran, or its re-run's values in backward
    (distinct storages, its inputs not counted). Working memory, freed when the region is done;
    ``torch.utils.checkpoint`` holds the re-run's values too, but not the forward's."""
    peak_held_bytes: int = 0
    """The most the engine held on the device at once: ``resident_bytes`` plus what a recomputed or
    selective region held itself at that instant (read when such a region's forward or re-run
    ends), and never less than ``peak_resident_bytes``. The budget bounds ``resident_bytes``; this
    says what a re-run region's working set adds to it."""
    budget_bytes: Optional[int] = None
    """The byte budget in force now (a gauge): ``budget_mb`` in bytes, or with ``budget_mb="auto"``
    resident + free - reserve at the latest reading of free memory; None: no limit (or "auto"
    before the first eligible tensor was saved: nothing has been read yet)."""
    recomputed_bytes: int = 0
    """Bytes of saved tensors dropped in forward and regenerated in backward instead of kept or moved
    (distinct storages, not the regions' inputs or parameters; a selective region's stash is saved,
    not counted here)."""
    shared_bytes: int = 0
    """Bytes of distinct storages saved as shared by a process group (``offload.sharded``,
    ``shared_inputs=``): what this rank would have saved whole."""
    shared_kept_bytes: int = 0
    """Of those, the bytes this rank keeps (its slice of each: about ``shared_bytes`` / N, padded);
    they are in ``saved_bytes`` and move under the budget like any save."""
    gathered_bytes: int = 0
    """Bytes all-gathered in backward to rebuild shared saves (every rank's slice, padding included)."""
    gather_wait_ms: float = 0.0
    """Host time unpacks waited for those gathers (gloo: the gather itself; CUDA: the stream wait)."""
    uncounted_steps: int = 0
    """Steps run with no hook of the engine's installed, so that none of their saves is in any count
    above: at budget None without regions the engine counts the first step after it was made or
    after ``reset_stats()`` and lets autograd save natively in later steps (See Note: [no hooks
    where nothing moves] in ``offload._memory.session``; ``Engine.count_next_step()`` counts the
    next). Saves declared with ``offload.sharded`` reach the engine even in those steps (it slices
    them) and are counted. With regions, a step under a plan measured at its inputs that keeps
    everything within the budget runs unhooked from its first region on (See Note: [a step kept
    whole runs unhooked]) and counts here too. 0: every step was counted."""

    def to_dict(self) -> dict:
        """The fields as a plain dict, for CSV or JSON writers."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gauges:
    """What a store holds now and its link's busy times, read in one go (``Store.gauges``); the
    fields named as in ``Stats`` mean what they mean there."""

    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    peak_over_budget_bytes: int = 0
    host_bytes: int = 0
    host_in_use_bytes: int = 0
    spill_bytes: int = 0
    spill_files: int = 0
    budget_bytes: Optional[int] = None
    d2h_busy_ms: float = 0.0
    h2d_busy_ms: float = 0.0
    stall_ms: float = 0.0
    """Compute-stream time spent waiting on copies (CUDA events), added to ``reload_wait_ms``."""


_FROM_LINK = ("d2h_busy_ms", "h2d_busy_ms")
"""Fields read from the link (CUDA events), offset by what they were at the last reset."""
_GAUGES = tuple(f.name for f in dataclasses.fields(Gauges) if f.name not in _FROM_LINK + ("stall_ms",))
"""Fields read from the store when a snapshot is taken, never counted."""


class Counters:
    """The engine's mutable tally of events; gauges are not here (the store owns what it holds)."""

    __slots__ = tuple(f.name for f in dataclasses.fields(Stats) if f.name not in _GAUGES + _FROM_LINK)
    # The same names spelled out for type checkers, which cannot read a computed __slots__
    # (tests/test_typing.py checks that the two lists agree).
    saved_tensors: int
    passthrough_tensors: int
    saved_bytes: int
    offloaded_bytes: int
    reloaded_bytes: int
    spilled_bytes: int
    prefetch_hits: int
    prefetch_misses: int
    reload_wait_ms: float
    evict_wait_ms: float
    recomputed_regions: int
    peak_region_bytes: int
    peak_held_bytes: int
    recomputed_bytes: int
    shared_bytes: int
    shared_kept_bytes: int
    gathered_bytes: int
    gather_wait_ms: float
    uncounted_steps: int

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Zero every counter."""
        for name in self.__slots__:
            setattr(self, name, 0.0 if name.endswith("_ms") else 0)

    def snapshot(self, gauges: Gauges, since: Gauges) -> Stats:
        """A frozen ``Stats`` of these counters and ``gauges``; the link's times counted from ``since``."""
        values: dict[str, Any] = {name: getattr(self, name) for name in self.__slots__}
        for name in _GAUGES:
            values[name] = getattr(gauges, name)
        for name in _FROM_LINK:
            values[name] = getattr(gauges, name) - getattr(since, name)
        values["reload_wait_ms"] += gauges.stall_ms - since.stall_ms
        values["peak_held_bytes"] = max(values["peak_held_bytes"], gauges.peak_resident_bytes)
        return Stats(**values)
