"""The engine's figures as a trainer logs them, shared by the callbacks.

Counters are per log entry (what moved and what was waited for since the previous entry, like
the Trainer's loss, which is averaged since its previous entry); the peak is since the engine was
made (the callbacks never reset the engine's stats, so ``callback.engine.stats`` stays a total);
the budget is the one in force at the entry (with ``budget_mb="auto"`` it follows free memory), left
out when there is none (``budget_mb=None``).
"""

from __future__ import annotations

from .. import Stats
from .._cost import MB

__all__ = ["log_figures"]


def log_figures(since: Stats, now: Stats) -> dict[str, float]:
    """What to log for the steps between two snapshots of one engine's stats (``since`` is older)."""
    figures = {
        "offload_moved_mb": (now.offloaded_bytes - since.offloaded_bytes) / MB,
        "offload_reloaded_mb": (now.reloaded_bytes - since.reloaded_bytes) / MB,
        "offload_peak_resident_mb": now.peak_resident_bytes / MB,
        "offload_reload_wait_ms": now.reload_wait_ms - since.reload_wait_ms,
        "offload_evict_wait_ms": now.evict_wait_ms - since.evict_wait_ms,
    }
    if now.budget_bytes is not None:
        figures["offload_budget_mb"] = now.budget_bytes / MB
    return figures
