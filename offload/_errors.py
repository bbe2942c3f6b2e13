"""The one exception the engine raises for its own failures, and which faults are not failures.

A fault that loses no data degrades instead of raising, with one warning (``logging``) each:

- a spill write fails (disk full, directory unwritable or gone): the tensor stays in memory, over
  the budget; every later eviction tries the disk again (a disk that filled may free up), and a
  vanished directory is replaced by a fresh private one;
- pinning host memory is refused, or host RAM runs low: the pool stops growing, tensors spill;
- a spill file cannot be removed: it stays until ``close()`` removes the directory.

A fault that loses data raises ``OffloadError``: a spill file that cannot be read back whole (EIO,
truncated, removed) fails the backward that needs it. A later backward (``retain_graph``) reads
it again. Either way the engine releases everything the failed step held.
"""

from __future__ import annotations

__all__ = ["OffloadError"]


class OffloadError(RuntimeError):
    """A failure inside the offload engine (a copy, a spill file, the pinned pool).

    The message names the tensor (shape, dtype), the tier involved and what to do.
    Bad arguments raise ``ValueError`` / ``TypeError`` instead.
    """
