"""The one exception the engine raises for its own failures, and which faults are not failures.

A fault that loses no data degrades instead of raising, with one warning (``logging``) each:

- a spill write fails (disk full, the spill file cannot be made): the tensor stays in memory, over
  the budget; every later eviction tries the disk again (a disk that filled may free up);
- pinning host memory is refused, or host RAM runs low: the host tier stops growing; older host
  copies go to disk to make room, and where none can, tensors stay on the device over the budget.

A fault that loses data raises ``OffloadError``: a spill file that cannot be read back whole (EIO,
truncated) fails the backward that needs it. A later backward (``retain_graph``) reads it again.
Either way the engine releases everything the failed step held. The spill file is open for the
engine's life, so a spill directory removed under it (a /tmp cleaner) loses nothing.
"""

from __future__ import annotations

__all__ = ["OffloadError", "inplace_error"]


class OffloadError(RuntimeError):
    """A failure inside the offload engine (a copy, the spill file, host memory).

    The message names the tensor (shape, dtype), the tier involved and what to do.
    Bad arguments raise ``ValueError`` / ``TypeError`` instead.
    """


def inplace_error(type_name: str, shape: tuple[int, ...], now: int, expected: int, where: str = "") -> RuntimeError:
    """The error PyTorch raises for a saved tensor modified in place, for checks the engine does itself.

    Saved-tensor hooks switch off autograd's own version check, so the engine (its store, the
    pass-through path and the recompute path) compares versions and raises this instead, worded as
    PyTorch words it, so that code and people matching on it see the same error with and without
    the engine. ``type_name`` is ``Tensor.type()`` (``torch.FloatTensor``); ``where`` names the
    tensor's place where that helps (``tensor input 0 of region 'blocks.1'``).
    """
    dims = ", ".join(str(d) for d in shape)
    place = f", {where}," if where else ""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{type_name} [{dims}]]{place} is at version {now}; expected version {expected} instead. Hint: enable anomaly "
        "detection to find the operation that failed to compute its gradient, with "
        "torch.autograd.set_detect_anomaly(True). "
        "(offload checked this: saved-tensor hooks turn off PyTorch's own check.)"
    )
