"""One saved storage (an entry), every copy of it the engine holds, and the handles autograd keeps.

An entry is in one ``Residence`` at a time, and owns at most one ``Copy`` per ``Tier``; each copy
carries its own ``CopyState`` and what it waits on. Nothing is implied by which fields are None::

    HOT ──evict──▶ LEAVING ──copy below lands──▶ AWAY ──unpack / prefetch──▶ LOADED ──last user──▶ AWAY
     │               │ └─ unpacked while leaving: the original serves; lands ─▶ LOADED (original kept)
     │               └─ copy below failed ─▶ KEPT
     └─ no room below (and none can be made) ─▶ KEPT

    device bytes held: HOT, LEAVING, LOADED, KEPT (not AWAY)

Note: [version watch]
    Saved-tensor hooks turn off autograd's check that a saved tensor was not modified in place, so
    the store does it. Reading ``_version`` needs a tensor on the same version counter, and the
    tensor pack was given is often a temporary (a view saved by an op) that dies at once, while its
    base lives on and can be modified. So each handle holds ``alias = t.detach()`` (same counter
    and storage, no grad_fn, so no reference cycle). While the entry's data is the original
    storage (HOT, LEAVING, KEPT, or LOADED with the original kept) that costs nothing: the entry
    holds the same storage anyway. When the original goes, the handle ``lets go``: the alias's
    storage is swapped for an empty one and the counter's value put back (``set_`` bumps it), so
    the alias keeps the version counter and no memory. A modification through the base, a view,
    ``detach()``, under ``no_grad`` or ``inference_mode`` bumps that counter, and unpack raises
    PyTorch's error at every budget and on every tier. ``.data`` and ``unsafe_chunk`` share the
    storage but not the counter; PyTorch does not see writes through them either.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import weakref
from typing import Any, Optional, Protocol

import torch

from .pending import FINISHED, AllOf, Pending

__all__ = ["Copy", "CopyState", "Entry", "Handle", "Residence", "Tier", "version_watch"]

log = logging.getLogger(__name__)

_set_version = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)


class Tier(enum.IntEnum):
    """Where a copy lives, hottest first."""

    DEVICE = 0
    HOST = 1
    DISK = 2


class CopyState(enum.Enum):
    FILLING = "filling"
    """Bytes on their way in; ``Copy.filled`` says when they have landed."""
    READY = "ready"
    """The bytes are there and may be read."""


@dataclasses.dataclass(eq=False, slots=True)
class Copy:
    """One copy of an entry's bytes in one tier.

    ``data``: a uint8 tensor (device), a host ``Block`` (host) or an ``Extent`` (disk).
    ``filled``: what the copy waits on while FILLING. ``readers``: a copy in flight that reads this
    one (See Note: [keep-alive until the copy event]); its memory is freed only once that is done.
    ``original``: the saved storage itself, not a copy the engine made.
    """

    tier: Tier
    data: Any
    state: CopyState
    filled: Pending = FINISHED
    readers: Pending = FINISHED
    original: bool = False

    def settled(self) -> bool:
        """Nothing in flight writes or reads this copy's memory any more."""
        return self.filled.done() and self.readers.done()

    def add_reader(self, pending: Pending) -> None:
        """A copy that reads this one has started (a host copy can feed a disk write and an h2d at once)."""
        self.readers = pending if self.readers.done() else AllOf([self.readers, pending])


class Residence(enum.Enum):
    """Where an entry's bytes are, as far as the device budget is concerned."""

    HOT = "hot"
    """The original storage on the device is the only copy."""
    LEAVING = "leaving"
    """The original is still on the device (kept alive) while a copy below fills."""
    AWAY = "away"
    """No bytes on the device."""
    LOADED = "loaded"
    """A device copy serves this backward's users: a reloaded one, or the original kept past its
    copy out because backward reached it first. Dropped after its last user."""
    KEPT = "kept"
    """On the device for good: no room below and none could be made, or its copy out failed."""
    RELEASED = "released"
    """Its last handle died: nothing is held (copies still in flight are freed when they settle)."""


ORIGINAL_IS_DATA = (Residence.HOT, Residence.KEPT)
"""Residences where the entry's data is the live storage, so a new save of it at the same version is
the same data whatever tensor it comes through (``Entry.holds_as_saved``)."""

# Note: [enum members as module globals]
#     On Python 3.11 reading an enum member through its class (``Residence.HOT``) costs ~70 ns, a
#     lookup on the enum type; a module global costs ~15. The per-tensor paths (pack, unpack, the
#     release of a handle) read a handful each, so they read these globals; every other path
#     spells the member out.
_HOT = Residence.HOT
_KEPT = Residence.KEPT
_DEVICE = Tier.DEVICE
_TIERS = tuple(Tier)  # hottest first; iterating the enum class itself costs ~0.4 us a pass
_READY = CopyState.READY
_weakref = weakref.ref


class Entry:
    """One distinct saved storage and every copy of it the engine holds."""

    __slots__ = (
        "seq",
        "nbytes",
        "key",
        "version",
        "owner",
        "shape",
        "dtype",
        "device",
        "residence",
        "copies",
        "refs",
        "users_left",
        "load_gen",
        "handles",
    )

    def __init__(
        self, seq: int, key: int, storage: torch.UntypedStorage, t: torch.Tensor, nbytes: int, version: int
    ) -> None:
        # Note: [storage key without a weak guard]
        #     ``key`` is the StorageImpl address, which the allocator can reuse once the storage is
        #     freed. No weak reference is needed to keep keys unique: while the original is the data
        #     the entry holds the storage itself; once moved it matches only the same live owner
        #     tensor (``holds_as_saved``), and a live owner keeps the storage, so its address, in use.
        # ``nbytes`` (the storage's) and ``version`` (``t._version``) the store has read already.
        self.seq, self.key, self.nbytes, self.version = seq, key, nbytes, version
        base = t._base
        self.owner = _weakref(t if base is None else base)  # whose version counter t uses
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.residence = _HOT  # See Note: [enum members as module globals]
        self.copies: dict[Tier, Copy] = {_DEVICE: Copy(_DEVICE, storage, _READY, FINISHED, FINISHED, True)}
        self.refs = 0
        """Live handles (saved tensors autograd still holds)."""
        self.users_left = 0
        """Handles not yet served by the device copy of the current load (generation ``load_gen``)."""
        self.load_gen = 0
        self.handles: list = []
        """Weak references to handles whose alias still holds the original. See Note: [version watch]."""

    @property
    def describe(self) -> str:
        """The first saved tensor's shape and dtype, for messages (never its values)."""
        return f"{tuple(self.shape)} {self.dtype} on {self.device}"

    def holds_as_saved(self, t: torch.Tensor, version: int) -> bool:
        """Whether this entry's data is what ``t`` (a tensor being saved at ``version``) holds.

        Where the original is the data, it holds whatever is there now. A moved entry is a
        snapshot: it matches only a tensor on the same version counter (its base's, or its own:
        the owner) at the same version. Tensors can share a storage without sharing a counter
        (``unsafe_chunk`` in the CPU GRU cell, ``.data``): there, equal version numbers say nothing.
        """
        if self.version != version:
            return False
        residence = self.residence
        if residence is _HOT or residence is _KEPT:  # ORIGINAL_IS_DATA
            return True
        base = t._base
        return self.owner() is (t if base is None else base)

    def original_on_device(self) -> bool:
        """Whether the saved storage itself is still one of this entry's copies."""
        device = self.copies.get(_DEVICE)
        return device is not None and device.original

    def nearest(self) -> Copy:
        """The copy closest to the device; an entry the store still tracks always has one."""
        copies = self.copies
        for tier in _TIERS:
            copy = copies.get(tier)
            if copy is not None:
                return copy
        raise RuntimeError(f"offload internal error: the saved tensor {self.describe} has no copy left")

    def device_copy(self) -> Optional[Copy]:
        return self.copies.get(_DEVICE)

    def let_go_handles(self, empty: Optional[torch.UntypedStorage] = None) -> None:
        """The original storage has left this entry: every handle keeps its watch only (See Note:
        [version watch]); ``empty``: a storage of no bytes on the entry's device for the watches."""
        for ref in self.handles:
            h = ref()
            if h is not None:
                h.let_go(empty)
        self.handles = []


def version_watch(t: torch.Tensor, empty: Optional[torch.UntypedStorage] = None) -> Optional[torch.Tensor]:
    """A tensor on ``t``'s version counter that holds no memory (See Note: [version watch]), or None
    where this torch or this tensor allows none (the in-place check is then off for it).

    ``empty``: a storage of no bytes on ``t``'s device to point the watch at, shared by every watch
    (nothing reads or writes through a watch: it is never handed to autograd); None: a new one."""
    if _set_version is None:
        return None
    now = t._version
    if empty is None:
        empty = torch.empty(0, dtype=torch.uint8, device=t.device).untyped_storage()
    try:
        watch = t.detach()
        with torch.no_grad():
            watch.set_(empty, 0, (0,), (1,))
        _set_version((watch,), (now,))
    except RuntimeError:  # a tensor that refuses set_: drop the watch rather than hold the storage
        log.debug("offload: cannot keep a version watch on %s %s; its in-place check is off", tuple(t.shape), t.dtype)
        return None
    return watch


class HandleOwner(Protocol):
    """What a handle needs of the store that made it (the store imports this module, not back)."""

    def unpack(self, h: Handle) -> torch.Tensor: ...

    def on_handle_dead(self, h: Handle) -> None: ...


class Handle:
    """What pack returns to autograd: one saved tensor's view onto an entry.

    When autograd drops it (after the node's backward, or with the graph), the entry loses a user.
    """

    __slots__ = ("store", "entry", "version", "alias", "layout", "seen_gen", "__weakref__")

    def __init__(self, store: HandleOwner, entry: Entry, t: torch.Tensor, version: int) -> None:
        self.store, self.entry = store, entry
        self.version = version  # t._version, read by the store already
        self.seen_gen = -1
        self.alias: Optional[torch.Tensor] = t.detach()  # See Note: [version watch]
        self.layout: Optional[tuple] = None
        if entry.residence is _HOT or entry.original_on_device():  # HOT: its only copy is the original
            entry.handles.append(_weakref(self))
        else:
            self.let_go()

    def let_go(self, empty: Optional[torch.UntypedStorage] = None) -> None:
        """The original storage is gone from the entry: keep the layout and the version counter only
        (``empty``: see ``version_watch``).

        The watch is a new tensor: the alias itself may have been handed to autograd by an unpack
        (autograd uses what unpack returns without a copy where it can), so it is never changed.
        """
        if self.layout is not None:
            return
        a = self.alias
        assert a is not None, "offload internal error: the alias went before the layout was kept"  # set below only
        self.layout = (a.dtype, a.size(), a.stride(), a.storage_offset())
        if _set_version is None:
            return  # an old torch: the alias keeps the storage; still correct, only less memory is freed
        self.alias = version_watch(a, empty)

    def modified(self) -> bool:
        """True if the saved tensor was modified in place after it was saved."""
        return self.alias is not None and self.alias._version != self.version

    def rebuild(self, data: torch.Tensor) -> torch.Tensor:
        """This saved tensor's exact view (dtype, size, stride, storage offset) onto ``data``'s storage."""
        # Only a moved entry is rebuilt, and the original leaving called let_go(), which set the layout.
        assert self.layout is not None, "offload internal error: rebuild() before let_go()"
        dtype, size, stride, offset = self.layout
        return torch.empty(0, dtype=dtype, device=data.device).set_(data.untyped_storage(), offset, size, stride)

    def __del__(self) -> None:
        try:
            self.store.on_handle_dead(self)
        except Exception:  # noqa: BLE001 - a finalizer must not raise; the store logs the cause
            log.exception("offload: releasing a saved tensor failed")
