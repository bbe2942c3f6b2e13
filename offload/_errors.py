"""The one exception the engine raises for its own failures."""

from __future__ import annotations

__all__ = ["OffloadError"]


class OffloadError(RuntimeError):
    """A failure inside the offload engine (a copy, a spill file, the pinned pool).

    The message names the tensor (shape, dtype), the tier involved and what to do.
    Bad arguments raise ``ValueError`` / ``TypeError`` instead.
    """
