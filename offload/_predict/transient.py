"""What the fake step holds at once besides its saves: the largest transient, for "does it fit".

A step needs the device memory of its parameters, gradients and optimizer state, of the
activations saved for backward (what a plan keeps, moves or drops), and of the tensors the running
ops hold on top of those: the largest of them is what decides whether the step fits. For a
language model it is the loss: the logits, their fp32 copy and, in backward, that copy's gradient
exist at once (7B-class, micro-batch 6, sequence 2048, vocabulary 50k: ~2.5 GB each in fp32).

``LiveBytes`` follows every storage an op of the fake step creates, by a weak reference on each
tensor on it (a tensor's Python object lives as long as its C++ tensor: autograd's saves keep it),
and is told which storages autograd saved. Replaying the creations and frees in order:

    transient(t) = bytes alive at t - bytes saved for backward - parameters' gradients
    transient_peak_bytes() = max over t

Storages that exist before the step (parameters, inputs) are not followed. Nothing here reads a
clock or a device.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

__all__ = ["LiveBytes"]


class LiveBytes:
    """Creations and frees of the storages ops make during one fake step, in order."""

    def __init__(self) -> None:
        self._ids: dict[int, int] = {}  # storage address -> id of the storage living there now
        self._tensors: dict[int, int] = {}  # id -> tensors alive on it
        self._nbytes: dict[int, int] = {}  # id -> its bytes
        self._saved: set[int] = set()  # ids autograd saved for backward
        self._events: list[tuple[int, int]] = []  # (id, +bytes created / -bytes freed)

    def created(self, t: torch.Tensor, *, new_storage: bool) -> None:
        """An op returned ``t``: a tensor on a new storage (``new_storage``), or a view or the
        in-place result of one (followed only if its storage is)."""
        address = t.untyped_storage()._cdata
        storage_id = self._ids.get(address)
        if storage_id is None:
            if not new_storage:
                return  # a view of a parameter or an input: not the step's memory
            storage_id = len(self._nbytes)
            self._ids[address] = storage_id
            self._nbytes[storage_id] = t.untyped_storage().nbytes()
            self._tensors[storage_id] = 0
            self._events.append((storage_id, self._nbytes[storage_id]))
        self._tensors[storage_id] += 1
        weakref.finalize(t, self._dropped, address, storage_id)

    def saved(self, t: torch.Tensor) -> None:
        """Autograd saved ``t`` for backward."""
        storage_id = self._ids.get(t.untyped_storage()._cdata)
        if storage_id is not None:
            self._saved.add(storage_id)

    def _dropped(self, address: int, storage_id: int) -> None:
        self._tensors[storage_id] -= 1
        if self._tensors[storage_id] == 0:
            self._events.append((storage_id, -self._nbytes[storage_id]))
            if self._ids.get(address) == storage_id:
                del self._ids[address]

    def ids_of(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """Ids of the followed storages of ``tensors`` alive now (e.g. the parameters' gradients)."""
        return {self._ids[a] for a in (t.untyped_storage()._cdata for t in tensors) if a in self._ids}

    def transient_peak_bytes(self, excluded: set[int]) -> int:
        """The most bytes alive at once that were neither saved for backward nor in ``excluded``."""
        live = peak = 0
        for storage_id, delta in self._events:
            if storage_id in self._saved or storage_id in excluded:
                continue
            live += delta
            peak = max(peak, live)
        return peak
