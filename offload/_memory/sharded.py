"""Saves that every rank of a process group makes alike, stored once across the group.

Under tensor parallelism without sequence parallelism every rank of the group saves the same
activations: a block's input, a norm's output, the input of a column-parallel linear. Declared
shared, such a save keeps 1/N of its storage on each of the N ranks, and backward gathers it::

    pack:   the storage's bytes ──rank r's slice of N (padded to equal slices)──▶ the store, as
            any save (kept, moved to host or disk under the budget: 1/N of the bytes move too)
            verify=True: a checksum of the save all-gathered; ranks that differ raise
    unpack: the slice back from the store ──all_gather──▶ N slices in one buffer ──▶ the saved
            tensor's exact view (size, stride, offset, dtype); views of one storage share it;
            then the gather of the shard saved just before this one starts (async, ahead of it)

Two ways to declare: ``with offload.sharded(group):`` around the code whose saves are shared
(inside an engine), or ``engine(shared_inputs=group)``, which declares the inputs of the regions
planned recompute (the tensors DeepSpeed's ``partition_activations`` and Megatron's
``distribute_saved_activations`` split); their other saves are not kept, so nothing else is declared.

Note: [collectives in one order on every rank]
    Every rank must call the same collectives in the same order, or gathers pair up the wrong
    slices (or hang). So each decision here depends only on what is the same on every rank: the
    order of saves and unpacks, the declaration, the ``prefetch`` setting. Nothing depends on the
    budget or free memory, which differ between ranks: the gather ahead (one shard, the one saved
    just before the shard being unpacked) starts whether or not the budget has room for it, and
    the gathered tensors are held outside the store's budget, as the tensors in use are.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import logging
import time
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

from .._errors import OffloadError, inplace_error
from .._stats import Counters
from .entry import Handle, version_watch
from .hooks import unhooked

__all__ = ["ShardedHandle", "SharedSaves", "Sharding", "declared", "declaring", "sharded", "sharding_for"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Sharding:
    """A declaration: saves identical on every rank of ``group`` (``world`` ranks, this one ``rank``)."""

    group: Any
    world: int
    rank: int
    verify: bool = False
    where: str = ""
    """Where the saves come from, for messages (a region's name)."""

    def at(self, where: str) -> Sharding:
        return dataclasses.replace(self, where=where)


_DECLARED: contextvars.ContextVar[Optional[Sharding]] = contextvars.ContextVar("offload_sharded", default=None)


def sharding_for(group: Any = None, *, verify: bool = False, what: str = "offload.sharded()") -> Optional[Sharding]:
    """The declaration for ``group`` (None: the default group), or None for a group of one rank
    (nothing to split: saves go to the store whole). Raises where there is no group to split over."""
    if not isinstance(verify, bool):
        raise TypeError(f"{what}: verify must be True or False, got {verify!r}")
    dist = torch.distributed
    if not dist.is_available():
        raise OffloadError(f"{what}: this build of torch has no torch.distributed; saves cannot be shared across ranks")
    if not dist.is_initialized():
        raise OffloadError(
            f"{what}: torch.distributed is not initialized; call torch.distributed.init_process_group() first "
            "(torchrun sets up its environment), or leave these saves undeclared"
        )
    if group is None:
        group = dist.group.WORLD
    try:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    except (RuntimeError, ValueError, TypeError, AttributeError) as error:
        raise OffloadError(
            f"{what}: {group!r} is not a torch.distributed process group ({type(error).__name__}: {error}); pass one "
            "from torch.distributed.new_group(), or None for the default group"
        ) from error
    if rank < 0:
        raise OffloadError(f"{what}: this process is not a member of the group {group!r}; pass a group it belongs to")
    if world == 1:
        return None
    return Sharding(group, world, rank, verify)


@contextlib.contextmanager
def sharded(group: Any = None, *, verify: bool = False) -> Iterator[None]:
    """Declare the saves made inside this block identical on every rank of ``group``.

    Inside an engine, each such save keeps only this rank's 1/N slice (which the engine keeps or
    moves like any save) and backward all-gathers the slices back into the exact tensor. Every
    rank of the group must run the same saves in the same order (as tensor-parallel ranks do).
    ``group``: a ``torch.distributed`` process group (None: the default one); a group of one
    rank splits nothing. ``verify=True``: each save's checksum is compared across the group at
    once (one small collective per save) and a save that differs raises ``OffloadError`` naming
    it; for tests and first runs. Outside an engine nothing is saved through it, so nothing changes
    (torch.distributed must still be initialized). Inside regions it needs a policy that decides
    alike on every rank (not "auto", which plans each rank from its own measurements).
    """
    sharding = sharding_for(group, verify=verify)
    token = _DECLARED.set(sharding)
    try:
        pair = unhooked.get()
        if pair is not None and torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
            # See Note: [no hooks where nothing moves] (in ``session``): the engine's pair, off the
            # stack, would have been innermost here, and only its pack reads the declaration.
            with torch.autograd.graph.saved_tensors_hooks(*pair):
                yield
        else:
            yield
    finally:
        _DECLARED.reset(token)


@contextlib.contextmanager
def declaring(sharding: Optional[Sharding]) -> Iterator[None]:
    """The engine's own declaration (the inputs of a region planned recompute)."""
    token = _DECLARED.set(sharding)
    try:
        yield
    finally:
        _DECLARED.reset(token)


declared: Callable[[], Optional[Sharding]] = _DECLARED.get
"""``declared()``: the declaration in force on this thread (None: saves are this rank's own). The
context variable's own ``get``, with no Python frame of ours around it: every pack asks."""


class ShardState(enum.Enum):
    SLICED = "sliced"
    """Only this rank's slice is held (in the store)."""
    GATHERING = "gathering"
    """An all-gather of every rank's slice is on its way."""
    GATHERED = "gathered"
    """The whole storage is here, until every handle of this backward has its view."""


class _Shard:
    """One declared storage: this rank's slice in the store and, while backward uses it, the whole."""

    __slots__ = (
        "piece",
        "nbytes",
        "slice_bytes",
        "sharding",
        "owner",
        "version",
        "describe",
        "before",
        "state",
        "buffer",
        "work",
        "sending",
        "gathers",
        "refs",
        "unserved",
        "forward",
        "stream",
        "__weakref__",
    )

    def __init__(
        self, piece: Handle, t: torch.Tensor, sharding: Sharding, before: Optional[_Shard], forward: int
    ) -> None:
        self.piece = piece
        self.forward = forward
        """Which forward (outermost entry of the engine) saved it: gathers ahead stay within one."""
        self.stream: Any = None  # GATHERING on CUDA: the stream current when the gather started
        self.nbytes = t.untyped_storage().nbytes()
        self.slice_bytes = piece.entry.nbytes
        self.sharding = sharding
        self.owner = weakref.ref(t if t._base is None else t._base)
        self.version = t._version
        where = f" in {sharding.where!r}" if sharding.where else ""
        self.describe = f"{tuple(t.shape)} {t.dtype}{where}"
        self.before = None if before is None else weakref.ref(before)
        """The shard saved just before this one: gathered ahead when this one is unpacked."""
        self.state = ShardState.SLICED
        self.buffer: Optional[torch.Tensor] = None  # GATHERING, GATHERED: world x slice_bytes uint8
        self.work: Any = None  # GATHERING: the all-gather's work handle
        self.sending: Optional[torch.Tensor] = None  # GATHERING: this rank's slice, kept until the gather is done
        self.gathers = 0
        self.refs = 0  # live handles
        self.unserved = 0  # GATHERED: handles without their view of this gather yet

    def holds(self, t: torch.Tensor, sharding: Sharding) -> bool:
        """Whether a new save of ``t``'s storage is this shard (same owner, version and group)."""
        owner = t if t._base is None else t._base
        return self.owner() is owner and self.version == t._version and self.sharding.group is sharding.group


class ShardedHandle:
    """What pack returns to autograd for a declared save: its view onto a shard."""

    __slots__ = ("shard", "layout", "version", "watch", "served", "saves", "__weakref__")

    def __init__(self, saves: SharedSaves, shard: _Shard, t: torch.Tensor) -> None:
        self.saves, self.shard = saves, shard
        self.layout = (t.dtype, t.size(), t.stride(), t.storage_offset())
        self.version = t._version
        self.watch = version_watch(t)  # the storage itself is not kept: See Note: [version watch]
        self.served = -1  # the shard's gather this handle last had its view of
        shard.refs += 1

    def __del__(self) -> None:
        try:
            self.saves.handle_dead(self)
        except Exception:  # noqa: BLE001 - a finalizer must not raise
            log.exception("offload: releasing a shared saved tensor failed")


FLAT_GATHER_BACKENDS = frozenset(("nccl", "gloo", "xccl"))
"""Backends whose all-gather writes into one flat tensor (their process groups implement
``_allgather_base``); any other gets the list form."""


def _backend_of(group: Any, device: torch.device) -> str:
    """The backend ``group`` runs collectives on ``device`` with ("cpu:gloo,cuda:nccl" names one per device)."""
    name = str(torch.distributed.get_backend(group)).lower()
    for part in name.split(","):
        kind, _, backend = part.partition(":")
        if backend and kind == device.type:
            return backend
    return name


def _all_gather_into(buffer: torch.Tensor, piece: torch.Tensor, group: Any) -> Any:
    """Every rank's ``piece`` into ``buffer`` (rank order), async: straight into one flat buffer
    where the backend can (NCCL's list form gathers into a flat copy of its own, then copies out).

    The form is chosen by backend, never by trying one and retrying with the other: a collective
    that raised on one rank (an NCCL error) may have gone through on the others, and a second
    collective there would meet no partner (See Note: [collectives in one order on every rank])."""
    dist = torch.distributed
    if _backend_of(group, piece.device) in FLAT_GATHER_BACKENDS:
        # torch 2.13 names the flat form all_gather_single (all_gather_into_tensor warns); 2.11 has only the old name.
        flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return flat(buffer, piece, group=group, async_op=True)
    parts = list(buffer.view(-1, piece.numel()).unbind(0))
    return dist.all_gather(parts, piece, group=group, async_op=True)


# Note: [a gather finished on another stream]
#     A gather ahead starts in one node's unpack and is waited on in another's, and autograd runs
#     each node on the stream its forward ran on. ``work.wait()`` orders only the stream current
#     then after the gather. The slice sent and the buffer were allocated on the starting stream,
#     so that stream is made to wait for the current one (reuse of their blocks there comes after
#     the gather and the first use), and the buffer is recorded on the current stream, which reads it.


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a flat uint8 tensor (no copy)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


CHECKSUM_CHUNK = 1 << 22
"""Bytes summed at a time by ``_checksum`` (its temporaries are ~24 bytes per byte of a chunk)."""


def _checksum(data: torch.Tensor) -> torch.Tensor:
    """The byte count and two sums of the bytes, plain and weighted by position within each chunk
    and by the chunk's index (float64: exact for any storage that fits a device), so that equal sums
    with the bytes moved around still differ (bytes 1021 apart within a chunk swapped do not)."""
    total = torch.zeros(3, dtype=torch.float64, device=data.device)
    total[0] = data.numel()
    weights = torch.arange(min(CHECKSUM_CHUNK, data.numel()), device=data.device, dtype=torch.float64)
    weights.remainder_(1021).add_(1)
    for index, start in enumerate(range(0, data.numel(), CHECKSUM_CHUNK)):
        values = data[start : start + CHECKSUM_CHUNK].to(torch.float64)
        total[1] += values.sum()
        total[2] += (values * weights[: values.numel()]).sum() * (index % 1019 + 1)
    return total


class SharedSaves:
    """The declared saves of one engine: slices into the store, gathers out of it."""

    def __init__(self, counters: Counters, prefetch: bool) -> None:
        self.counters = counters
        self.prefetch = prefetch
        self._live: weakref.WeakValueDictionary[int, _Shard] = weakref.WeakValueDictionary()
        self._last: Optional[weakref.ref] = None  # the latest shard made (the next one's ``before``)
        self._forward = 0
        self._gathered: weakref.WeakSet[_Shard] = weakref.WeakSet()  # GATHERING or GATHERED
        self._cleanup_queued = False

    def new_forward(self) -> None:
        """The engine was entered (outermost): shards saved from now on belong to a new forward."""
        self._forward += 1
        self._last = None

    # ------------------------------------------------------------------ forward

    def pack(self, t: torch.Tensor, sharding: Sharding, keep: Callable[[torch.Tensor], Handle]) -> Any:
        """This rank's slice of ``t``'s storage to ``keep`` (the store), or ``t`` itself to it where
        the storage is smaller than the group (nothing to split)."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < sharding.world:
            return keep(t)
        if sharding.verify:
            self._verify(t, sharding)
        key = storage._cdata
        shard = self._live.get(key)
        if shard is None or not shard.holds(t, sharding):
            slice_bytes = -(-nbytes // sharding.world)
            lo = min(nbytes, sharding.rank * slice_bytes)
            hi = min(nbytes, lo + slice_bytes)
            piece = torch.zeros(slice_bytes, dtype=torch.uint8, device=t.device)
            piece[: hi - lo].copy_(_bytes_of(t)[lo:hi])
            before = None if self._last is None else self._last()
            shard = _Shard(keep(piece), t, sharding, before, self._forward)
            self._live[key] = shard
            self._last = weakref.ref(shard)
            self.counters.shared_bytes += nbytes
            self.counters.shared_kept_bytes += slice_bytes
        return ShardedHandle(self, shard, t)

    def _verify(self, t: torch.Tensor, sharding: Sharding) -> None:
        """Raise naming ``t`` where a rank of the group saved something else (one small all-gather)."""
        mine = _checksum(_bytes_of(t))
        every = [torch.empty_like(mine) for _ in range(sharding.world)]
        torch.distributed.all_gather(every, mine, group=sharding.group)
        differ = [r for r, theirs in enumerate(every) if not torch.equal(theirs, every[0])]
        if differ:
            where = f" in region {sharding.where!r}" if sharding.where else ""
            raise OffloadError(
                f"offload: the saved tensor {tuple(t.shape)} {t.dtype}{where} was declared shared "
                f"(identical on every rank of the group), but group ranks {differ} saved other values than group "
                "rank 0; "
                "declare only saves every rank computes alike (replicated inputs, norms before a "
                "column-parallel linear), or move this one out of offload.sharded()"
            )

    # ------------------------------------------------------------------ backward

    def unpack(self, h: ShardedHandle) -> torch.Tensor:
        if h.watch is not None and h.watch._version != h.version:
            dtype, size, _, _ = h.layout
            raise inplace_error(h.watch.type(), tuple(size), h.watch._version, h.version)
        shard = h.shard
        if shard.state is ShardState.SLICED:
            self._start(shard)
        if shard.state is ShardState.GATHERING:
            self._finish(shard)
        buffer = shard.buffer  # held here: a handle dying while this runs may drop the shard's
        assert buffer is not None  # GATHERED
        dtype, size, stride, offset = h.layout
        view = torch.empty(0, dtype=dtype, device=buffer.device).set_(buffer.untyped_storage(), offset, size, stride)
        if h.served != shard.gathers:
            h.served = shard.gathers
            shard.unserved -= 1
            if shard.unserved <= 0:
                self._done(shard)
        if self.prefetch:
            self._ahead(shard)
        return view

    def _start(self, shard: _Shard) -> None:
        """Start the all-gather of every rank's slice of ``shard`` (See Note: [collectives in one order
        on every rank])."""
        piece = shard.piece.store.unpack(shard.piece)  # from whichever tier holds it
        sharding = shard.sharding
        buffer = torch.empty(sharding.world * shard.slice_bytes, dtype=torch.uint8, device=piece.device)
        shard.work = _all_gather_into(buffer, piece, sharding.group)
        shard.sending = piece  # the backend may read it until the gather is done
        shard.stream = torch.cuda.current_stream(piece.device) if piece.is_cuda else None
        self._gathered.add(shard)
        self._queue_cleanup()
        shard.buffer = buffer
        shard.state = ShardState.GATHERING
        shard.gathers += 1
        self.counters.gathered_bytes += buffer.numel()

    def _finish(self, shard: _Shard) -> None:
        start = time.perf_counter()
        shard.work.wait()  # CUDA: the current stream waits for the gather; gloo: the host does
        self.counters.gather_wait_ms += (time.perf_counter() - start) * 1e3
        if shard.stream is not None:  # See Note: [a gather finished on another stream]
            current = torch.cuda.current_stream(shard.stream.device)
            if current != shard.stream:
                shard.stream.wait_stream(current)
                assert shard.buffer is not None  # GATHERING
                shard.buffer.record_stream(current)
            shard.stream = None
        shard.work = None
        shard.sending = None
        shard.state = ShardState.GATHERED
        shard.unserved = shard.refs

    def _done(self, shard: _Shard) -> None:
        """Every live handle has its view: the views keep the memory while autograd uses them."""
        shard.buffer = None
        shard.state = ShardState.SLICED
        self._gathered.discard(shard)

    def _ahead(self, shard: _Shard) -> None:
        before = None if shard.before is None else shard.before()
        if (
            before is not None
            and before.forward == shard.forward
            and before.state is ShardState.SLICED
            and before.gathers == 0
        ):
            self._start(before)

    def _queue_cleanup(self) -> None:
        """At the end of this backward, drop every gathered buffer still held: a handle this
        backward never reached (``autograd.grad(inputs=...)``) or a gather ahead it never used. No
        collective is started there, so every rank may do it whenever its backward ends."""
        if self._cleanup_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        except RuntimeError:  # not inside a backward (a gather started from a plain call): nothing to queue
            return
        self._cleanup_queued = True

    def _end_of_backward(self) -> None:
        self._cleanup_queued = False
        for shard in list(self._gathered):
            if shard.state is ShardState.GATHERING:
                self._finish(shard)
            self._done(shard)

    def handle_dead(self, h: ShardedHandle) -> None:
        shard = h.shard
        shard.refs -= 1
        if shard.state is ShardState.GATHERED and h.served != shard.gathers:
            shard.unserved -= 1
            if shard.unserved <= 0:
                self._done(shard)
