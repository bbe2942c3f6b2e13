"""offload: activation memory as a budget, not a wall.

    import offload
    with offload.engine(budget_mb=512):
        loss = model(batch)
    loss.backward()
"""

from ._engine import Engine, engine
from ._errors import OffloadError
from ._hooks import no_offload
from ._recompute import checkpoint
from ._stats import Stats

__all__ = ["Engine", "OffloadError", "Stats", "checkpoint", "engine", "no_offload"]
__version__ = "0.1.0"
