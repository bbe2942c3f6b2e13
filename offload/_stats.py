"""Counters of what the engine did, and the frozen snapshot users read.

The engine updates a mutable ``Counters`` under its lock; ``Engine.stats`` hands out a frozen
``Stats`` copy. Byte counts are of distinct storages: a storage saved by several ops (or as
several views) counts once.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Stats", "Counters"]


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
    """Bytes moved off the compute device (to pinned host on CUDA, to disk on the CPU)."""
    reloaded_bytes: int = 0
    """Bytes brought back to the compute device for backward."""
    spilled_bytes: int = 0
    """Bytes written to spill files."""
    resident_bytes: int = 0
    """Engine-managed activation bytes on the compute device now, copies in flight included."""
    peak_resident_bytes: int = 0
    """The most ``resident_bytes`` has been."""
    host_bytes: int = 0
    """Pinned host bytes the engine's pool holds now (CUDA)."""
    prefetch_hits: int = 0
    """Unpacks whose tensor was already back on (or on its way to) the device."""
    prefetch_misses: int = 0
    """Unpacks that had to start their own reload."""
    reload_wait_ms: float = 0.0
    """Host-side time unpack spent waiting for data to come back."""
    evict_wait_ms: float = 0.0
    """Host-side time pack spent waiting for copies to drain to stay within the budget."""
    spill_files: int = 0
    """Spill files on disk now."""
    recomputed_regions: int = 0
    """Region forwards run as recompute (inputs kept, the rest re-run in backward)."""

    def to_dict(self) -> dict:
        """The fields as a plain dict, for CSV or JSON writers."""
        return dataclasses.asdict(self)


class Counters:
    """The engine's mutable tally; read it only through ``snapshot()``."""

    __slots__ = tuple(f.name for f in dataclasses.fields(Stats))

    def __init__(self) -> None:
        for f in dataclasses.fields(Stats):
            setattr(self, f.name, f.default)

    def snapshot(self) -> Stats:
        return Stats(**{name: getattr(self, name) for name in self.__slots__})

    def reset(self, *, keep: tuple[str, ...] = ()) -> None:
        """Zero every counter except the gauges named in ``keep`` (current resident bytes, ...)."""
        for f in dataclasses.fields(Stats):
            if f.name not in keep:
                setattr(self, f.name, f.default)
