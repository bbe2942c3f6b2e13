"""The recompute tier: drop a region's saved tensors in forward, re-run its forward in backward.

Why our own instead of ``torch.utils.checkpoint``: its non-reentrant variant holds the region's
inputs by Python reference and installs its own saved-tensor hooks, so an outer engine sees
neither the inputs nor anything inside; a recomputed region would pin its inputs on the device.
Here the inputs go through whatever saved-tensor hooks are outside (the engine's store, or
another library's), so a recomputed region whose inputs are offloaded leaves nothing on the
device. The results equal ``torch.utils.checkpoint(use_reentrant=False)``: the same forward re-run
with the CPU and device RNG states and the autocast state of the original call. One thing
differs, on purpose: the modules' state (``module_state``). The re-run sees the buffers and
numbers the forward saw, and leaves them as the forward left them, where torch's re-run updates
BatchNorm's statistics a second time.

    forward:  inputs ──outer pack──▶ store (any tier)
              fn(inputs) under placeholder hooks: each save ──▶ Slot(i) + (shape, dtype) noted,
                  its value held only until fn returns (an autograd.grad inside fn unpacks it)
    backward: unpack Slot(i) ──▶ first one in this pass? re-run fn once (RNG, autocast restored),
              capture every save in order (an autograd.grad inside the re-run unpacks them),
              check count/shape/dtype ──▶ value i
              each value goes when its slot dies (its node ran), all once every live slot was served

A frame's phase (``FramePhase``) says what it holds::

    FORWARD ──fn returns or raises──▶ WAITING ──first unpack of a pass──▶ RECOMPUTED
                                        ▲                                     │
                                        └──every live slot served (or dead)───┘

A region's backward re-runs its forward at most once per backward pass. Regions nest: a
checkpoint called inside a region packs its inputs through the enclosing region's hooks, so its
recompute unpacks them from the enclosing frame (which recomputes first if it must), and the
enclosing region's re-run runs the inner forward as part of its own. The one thing a region's
forward may not do is run a backward past its own inputs into the graph outside: the re-run
starts from detached inputs and could not do it again, so that raises in forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from typing import Any, Callable, Optional

import torch

from .._errors import OffloadError, inplace_error
from .._memory.hooks import users_own
from .._stats import record
from .module_state import ForwardStart, RegionState, modules_of

__all__ = [
    "Frame",
    "FramePhase",
    "ForwardSaves",
    "RNGState",
    "StopRecompute",
    "checkpoint",
    "droppable",
    "storage_id",
    "synchronize_devices",
]
"""``checkpoint`` is the public verb; the rest is the seam ``selective`` builds on: a ``Frame``
subclass overrides the hooks marked below, and shares the eligibility rule and the helpers."""


class RNGState:
    """The CPU generator's state and those of the CUDA devices ``tensors`` are on, taken now:
    at a region's forward (restored for its recompute), or after an expensive op that draws
    random numbers (set again after its replay, in ``selective``)."""

    def __init__(self, tensors: list) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda_devices = sorted({t.device.index for t in tensors if t.device.type == "cuda"})
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]

    def set(self) -> None:
        """Put every generator back to this state."""
        torch.set_rng_state(self.cpu)
        for d, state in zip(self.cuda_devices, self.cuda, strict=True):
            torch.cuda.set_rng_state(state, d)

    @contextlib.contextmanager
    def restored(self):
        """This state inside, the generators as they were outside (``fork_rng``)."""
        with torch.random.fork_rng(devices=self.cuda_devices):
            self.set()
            yield


class _AutocastState:
    """Autocast on/off and dtype for CPU and CUDA at the region's forward, and whether autocast
    caches its casts (``torch.utils.checkpoint`` restores that too)."""

    def __init__(self) -> None:
        self.states = [(dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda")]
        self.cache_enabled = torch.is_autocast_cache_enabled()

    @contextlib.contextmanager
    def restored(self):
        with contextlib.ExitStack() as stack:
            for dev, enabled, dtype in self.states:
                if enabled or torch.is_autocast_enabled(dev):
                    stack.enter_context(
                        torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=self.cache_enabled)
                    )
            yield


class FramePhase(enum.Enum):
    """What a recompute frame holds now, besides its inputs (the diagram in the module docstring)."""

    FORWARD = "forward"
    """The region's forward (fn) is running: each save is held with its version (``ForwardSaves``),
    and a slot unpacked now returns it. See Note: [saved values live while the forward runs]."""
    WAITING = "waiting"
    """Nothing held but the inputs: the forward returned (or raised), or the last re-run's values
    were all served. The next unpack re-runs the region."""
    RECOMPUTED = "recomputed"
    """The re-run's values are held, each until its slot dies, and none once every live slot was
    unpacked in this pass (See Note: [a re-run's value goes with its slot])."""


@dataclasses.dataclass
class ForwardSaves:
    """What a frame holds while its forward runs (``FramePhase.FORWARD``), dropped when it ends."""

    values: list = dataclasses.field(default_factory=list)
    """Per save, in order: (tensor, its version when saved)."""
    dropped_storages: dict[int, int] = dataclasses.field(default_factory=dict)
    """Storage id -> nbytes of the saves this frame drops (``droppable``)."""


class _Slot:
    """What autograd holds in place of one tensor saved inside a recomputed region."""

    __slots__ = ("frame", "index", "seen_gen", "__weakref__")

    def __init__(self, frame: "Frame", index: int) -> None:
        self.frame, self.index, self.seen_gen = frame, index, -1

    def __del__(self) -> None:
        self.frame.slot_dead(self)


class Frame:
    """One call of a recomputed region: its inputs (through the outer hooks) and how to re-run it."""

    def __init__(
        self,
        fn: Callable,
        name: str,
        args: tuple,
        kwargs: dict,
        on_recompute: Optional[Callable] = None,
        count: Optional[Callable[[torch.Tensor], Optional[int]]] = None,
        state: Optional[RegionState] = None,
        on_held: Optional[Callable[[int], None]] = None,
    ) -> None:
        self.fn, self.name = fn, name
        self.on_held = on_held
        """Told the bytes this frame holds itself (its inputs not counted) when its forward ends,
        holding every save, and when a re-run ends, holding its values (``Stats.peak_region_bytes``)."""
        self.state = RegionState(modules_of(fn), name, learn=False) if state is None else state
        """The state of the modules the region runs, kept across its re-runs: See Note: [a re-run
        leaves module state as the forward left it] (``module_state``)."""
        self._start = ForwardStart.empty()  # the forward's, once it ran
        self.on_recompute = on_recompute  # called with the recompute's wall time, ms (profiling)
        self.count = count
        """Profiling: what the engine would take of each save had the region run as is: None (it
        would pass it through), or the bytes it would newly hold (0 for a storage it holds already)."""
        self.counted_bytes = 0
        self.counted_tensors = 0
        self.args, self.kwargs = args, kwargs
        flat = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        self.rng = RNGState(flat)
        self.autocast = _AutocastState()
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.inputs: list = []  # per tensor argument: (packed, version to check or None, requires_grad)
        self.meta: list = []  # per saved tensor: (shape, dtype), from the original forward
        self.phase = FramePhase.WAITING  # until run() starts the forward
        self.forward_saves = ForwardSaves()
        """What the forward holds: filled in ``FORWARD`` only, an empty one once it ended."""
        self.recomputed: list = []
        """The re-run's values, per save: held in ``RECOMPUTED`` only."""
        self.dropped_bytes = 0
        """Bytes of distinct storages the region saved and this frame dropped (set when forward returns):
        not its inputs, not parameters or leaves that require grad (or their views), nothing kept otherwise."""
        self.changed: list[str] = []
        """Arguments (other than tensors) the forward changed: See Note: [arguments a forward changed]."""
        self.gen = 0
        self.live = 0  # slots autograd still holds
        self.alive: list[bool] = []
        """Per save, whether its slot is still held by autograd."""
        self.unserved = 0  # live slots not yet unpacked in this pass

    @property
    def forward_values(self) -> Optional[list]:
        """Per save: (tensor, version) while the forward runs; None in any other phase."""
        return self.forward_saves.values if self.phase is FramePhase.FORWARD else None

    def _pack_input(self, t: torch.Tensor) -> tuple:
        """(packed, version to check at unpack or None). The outer hooks get the input itself, not
        a detached alias, so they apply their own rules to it (an engine leaves a leaf that requires
        grad where it is, since the caller holds it anyway) and check its version themselves."""
        if self.outer is None:
            return t.detach(), t._version  # the alias shares t's version counter
        packed = self.outer[0](t)
        return packed, (t._version if packed is t else None)

    def _unpack_input(self, packed: Any) -> torch.Tensor:
        return self.outer[1](packed) if self.outer is not None else packed

    def run(self):
        def template(a):
            if isinstance(a, torch.Tensor):
                self.inputs.append((*self._pack_input(a), a.requires_grad))
                return _ARG
            return a

        arg_template = tuple(template(a) for a in self.args)
        kw_template = {k: template(v) for k, v in self.kwargs.items()}
        guards = self._guard_inputs()
        before = _fingerprints(self.args, self.kwargs)  # See Note: [arguments a forward changed]
        self.forward_saves = ForwardSaves()  # See Note: [saved values live while the forward runs]
        self.phase = FramePhase.FORWARD
        start = self.state.forward_started()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack_placeholder, self._unpack_placeholder):
                with self._forward_mode():
                    out = self.fn(*self.args, **self.kwargs)
            start.forward_ended()
            self._start = start
            inputs = {
                storage_id(a) for a in list(self.args) + list(self.kwargs.values()) if isinstance(a, torch.Tensor)
            }
            self._forward_done(inputs)
            after = _fingerprints(self.args, self.kwargs)
            self.changed = [name for name, fingerprint in before.items() if after.get(name) != fingerprint]
            kept = inputs | self._kept_storages()
            self.dropped_bytes = sum(n for key, n in self.forward_saves.dropped_storages.items() if key not in kept)
            if self.on_held is not None:  # not its inputs nor a selective stash: the store holds those
                self.on_held(self.dropped_bytes)
        except BaseException:
            self._forward_aborted()
            raise
        finally:
            self.phase, self.forward_saves = FramePhase.WAITING, ForwardSaves()
            for guard in guards:
                guard.remove()
        self.args, self.kwargs = arg_template, kw_template  # drop references to the real inputs
        return out

    # What a subclass (``selective``) changes: the dispatch mode the forward and the re-run run
    # under, what happens once the forward returned, and which saved storages it keeps itself.
    def _forward_mode(self):
        return contextlib.nullcontext()

    def _rerun_mode(self):
        return contextlib.nullcontext()

    def _forward_done(self, input_storages: set) -> None:
        pass

    def _forward_aborted(self) -> None:
        """The forward raised: let go of whatever it held (a caught OOM retried must not leak it)."""

    def _kept_storages(self) -> set:
        return set()

    def _held_elsewhere(self) -> set:
        """Storages among a re-run's values that something else holds (a selective stash, the store's)."""
        return set()

    # Note: [a frame that cannot re-run holds nothing]
    #     A re-run that raises (it saved other tensors than the forward, or replayed other ops)
    #     leaves a backward that cannot finish. The frame then lets go of its inputs and of the
    #     arguments of its first run: an argument the forward changed may hold a tensor of the
    #     region's own graph (a cache it filled), whose saved variables hold the slots, which hold
    #     this frame; that cycle runs through autograd's C++ graph, which Python's collector cannot
    #     see, so the region's inputs (and their spill extents) would otherwise live for ever.
    def _abandon(self) -> None:
        self.args, self.kwargs, self.inputs, self.recomputed = (), {}, [], []

    # Note: [no backward past a region's inputs]
    #     A backward run inside the region's forward (torch.autograd.grad or .backward()) may go
    #     through the region's own graph, and through tensors the region closes over, exactly as
    #     it would without the engine. It may not go through the graph that produced a tensor
    #     argument: the recompute starts from detached copies of the arguments (the originals may
    #     be offloaded, and holding them is what this tier exists to avoid), so the same backward
    #     in the re-run would find no path, and the gradients of the two runs would differ. Such a
    #     backward runs a tensor argument's grad_fn while the forward is still running; a pre-hook
    #     on each argument's grad_fn, removed when the forward returns, raises then, in forward.
    #     It is conservative: a backward of some outer tensor that runs that node without passing
    #     through the argument is refused too (move it out of the region).
    def _guard_inputs(self) -> list:
        """Pre-hooks on the grad_fn of each tensor argument: See Note: [no backward past a region's inputs]."""
        name = self.name
        guards = []
        for i, a in enumerate(a for a in list(self.args) + list(self.kwargs.values()) if isinstance(a, torch.Tensor)):
            if a.grad_fn is None:
                continue
            node = a.grad_fn.name()

            def refuse(grad_outputs, i=i, node=node):
                raise OffloadError(
                    f"offload: region {name!r} ran a backward (torch.autograd.grad or .backward()) during its forward "
                    f"that reached {node}, the node that produced its tensor input {i}, outside the region; a "
                    f"recomputed region is re-run from detached inputs, so its backward could not do that again. "
                    f"Differentiate with respect to the region's inputs (or tensors created inside it), move the "
                    f"code that needs the outer graph out of the region, or do not recompute this region "
                    f"(leave it out of regions=, or use policy='offload')"
                )

            guards.append(a.grad_fn.register_prehook(refuse))
        return guards

    # Note: [saved values live while the forward runs]
    #     A backward run inside the region's forward unpacks slots before any recompute could
    #     sensibly happen (the region's own forward is still running). While fn runs, each saved
    #     tensor is held with its version, and a slot unpacked then returns it (autograd rebuilds
    #     the unpacked variable around it; with hooks it checks no version, so this does). When fn
    #     returns, or raises, the frame leaves ``FramePhase.FORWARD`` and drops ``ForwardSaves``:
    #     after forward the region holds what it always held, its inputs, and the cycle tensor ->
    #     grad_fn -> slot -> frame -> ForwardSaves is gone. Peak
    #     memory inside one region's forward rises to what the region saves, which its recompute
    #     in backward holds anyway.
    def _pack_placeholder(self, t: torch.Tensor) -> _Slot:
        self.meta.append((t.shape, t.dtype))
        if self.phase is FramePhase.FORWARD:
            self.forward_saves.values.append((t, t._version))
            if droppable(t):
                self.forward_saves.dropped_storages[storage_id(t)] = t.untyped_storage().nbytes()
            counted = None if self.count is None else self.count(t)
            if counted is not None:
                self.counted_bytes += counted
                self.counted_tensors += 1
        self.live += 1
        self.alive.append(True)
        return _Slot(self, len(self.meta) - 1)

    def _unpack_placeholder(self, slot: _Slot) -> torch.Tensor:
        if self.phase is FramePhase.FORWARD:
            value, version = self.forward_saves.values[slot.index]
            if value._version != version:
                raise inplace_error(
                    value.type(),
                    value.shape,
                    value._version,
                    version,
                    f"saved tensor {slot.index} of region {self.name!r}",
                )
            return value
        if self.phase is FramePhase.WAITING:
            self._recompute()  # RECOMPUTED once it returns, or it raised
        value = self.recomputed[slot.index]
        if slot.seen_gen != self.gen:
            slot.seen_gen = self.gen
            self._served_one()
        return value

    # Note: [a re-run's value goes with its slot]
    #     A re-run captures every save of the region at once, but backward needs each only until the
    #     node that saved it has run, when autograd lets go of the node's saved variables and so of
    #     their slots. Held until the last slot was served, the region's whole recomputed set would
    #     sit beside its gradients (on a CNN block, two activations more than
    #     ``torch.utils.checkpoint`` at its peak). So a slot's value goes when the slot dies (and a
    #     value whose slot died before the re-run is not kept at all); what a ``retain_graph=True``
    #     backward keeps alive goes when every live slot was served. A node that reads its saved
    #     tensors twice (a custom Function reading ``ctx.saved_tensors`` again) finds its value
    #     there while it runs, where torch's checkpoint raises.
    def _served_one(self) -> None:
        """One more live slot served (or dead) in this pass: after the last, drop the re-run's values."""
        self.unserved -= 1
        if self.unserved <= 0:
            self.phase, self.recomputed = FramePhase.WAITING, []

    def changed_note(self) -> str:
        """The end of a mismatch error: which arguments the forward changed, if any."""
        if not self.changed:
            return ""
        return (
            f". Its forward changed {', '.join(self.changed)}, and the re-run is given the same object as it is now: "
            f"pass a fresh one to each call, leave it out when training (use_cache=False), or keep this region "
            f"out of regions= (or use policy='offload', which never re-runs)"
        )

    def slot_dead(self, slot: _Slot) -> None:
        self.live -= 1
        self.alive[slot.index] = False
        if self.phase is FramePhase.RECOMPUTED:
            self.recomputed[slot.index] = None  # See Note: [a re-run's value goes with its slot]
            if slot.seen_gen != self.gen:
                self._served_one()

    def _rebuild_args(self):
        tensors = enumerate(self.inputs)

        def fill(a):
            if a is _ARG:
                i, (packed, version, requires_grad) = next(tensors)
                if version is not None and packed._version != version:
                    raise inplace_error(
                        packed.type(),
                        packed.shape,
                        packed._version,
                        version,
                        f"tensor input {i} of region {self.name!r}",
                    )
                return self._unpack_input(packed).detach().requires_grad_(requires_grad)
            return a

        args = tuple(fill(a) for a in self.args)
        kwargs = {k: fill(v) for k, v in self.kwargs.items()}
        return args, kwargs

    # Note: [recompute hooks hold no frame]
    #     The recompute's graph is normally dropped at once, but the region may hand its tensors to
    #     an object outside it (a Hugging Face KV cache passed as an argument appends the recomputed
    #     keys). That object then holds the recompute's graph, whose saved variables hold these
    #     hooks. If the hooks referenced the frame, the cycle frame -> argument -> tensor -> graph ->
    #     hook -> frame would run through autograd's C++ graph, which Python's collector cannot
    #     see: the frame, its inputs' handles and their spill files would never be released. So the
    #     hooks capture only the region's name and a list that is emptied once the values are taken.
    #
    # Note: [inner backward in a recompute]
    #     The re-run may itself run a backward (torch.autograd.grad inside the region), which
    #     unpacks saves of the re-run's own graph: the capture hook packs an index into the
    #     captured list, and the unpack hook returns that entry while the recompute runs. The
    #     saves such a backward makes (create_graph=True) happened in the original forward too,
    #     under the placeholder hooks, so they are slots like any other and are captured in the
    #     same order. When the last of them is made inside such a backward, the early stop is
    #     raised there and unwinds through autograd's engine, which hands a hook's exception back
    #     to the caller of torch.autograd.grad unchanged (torch's own checkpoint relies on it);
    #     that backward's graph belongs to the re-run and is dropped with it.
    def _rerun(
        self,
        mode: Any,
        timed: bool,
        inputs: Optional[tuple] = None,
        on_save: Optional[Callable] = None,
        *,
        whole: bool = False,
    ) -> tuple[list, float]:
        """Re-run the region with its forward's RNG and autocast state, under ``mode``, capturing
        every save in order until the last (then it stops early, unless ``whole``: a profiling
        re-run that counts every op). ``inputs``: (args, kwargs) already rebuilt, else they are
        rebuilt here, inside the clock. Returns the saves and the re-run's wall ms (``timed``: the
        devices synchronized around it, for profiling steps only). ``on_save`` sees each save as it
        is captured (a profiling re-run counts them)."""
        captured: list = []
        total = len(self.meta)

        own: dict[int, int] = {}  # storage id -> nbytes of the saves the region itself makes

        def capture(t: torch.Tensor) -> int:
            captured.append(t.detach())
            if droppable(t):  # judged on the save itself: its detached alias would pass for an activation
                own[storage_id(t)] = t.untyped_storage().nbytes()
            if on_save is not None:
                on_save(t)
            if len(captured) == total and not whole:
                raise StopRecompute  # everything backward needs exists; skip the rest of the region
            return len(captured) - 1

        name = self.name  # the hooks must not reference self: See Note: [recompute hooks hold no frame]

        def unpack_captured(index: int) -> torch.Tensor:
            if index < len(captured):
                return captured[index]
            raise OffloadError(
                f"offload: region {name!r} unpacked a saved tensor of its recompute after the recompute ended; "
                f"a recomputed region's graph can be differentiated only while it is being re-run"
            )

        try:
            if timed:
                synchronize_devices(self.rng.cuda_devices)
            start = time.perf_counter()
            args, kwargs = self._rebuild_args() if inputs is None else inputs
            # See Note: [a re-run leaves module state as the forward left it]
            with self.rng.restored(), self.autocast.restored(), self._start.rerun(), torch.enable_grad():
                with torch.autograd.graph.saved_tensors_hooks(capture, unpack_captured), mode:
                    try:
                        self.fn(*args, **kwargs)
                    except StopRecompute:
                        pass
            if timed:
                synchronize_devices(self.rng.cuda_devices)
            if self.on_held is not None:
                self.on_held(_held_bytes(own, args, kwargs, self._held_elsewhere()))
            return list(captured), (time.perf_counter() - start) * 1e3
        finally:
            captured.clear()  # the re-run's graph may outlive it: See Note: [recompute hooks hold no frame]

    def _recompute(self) -> None:
        try:
            with record("offload::recompute"):
                values, rerun_ms = self._rerun(self._rerun_mode(), timed=self.on_recompute is not None)
            if self.on_recompute is not None:
                self.on_recompute(rerun_ms)
            if len(values) != len(self.meta) or any(
                c.shape != shape or c.dtype != dtype for c, (shape, dtype) in zip(values, self.meta, strict=True)
            ):
                got = [(tuple(c.shape), c.dtype) for c in values]
                want = [(tuple(s), d) for s, d in self.meta]
                raise OffloadError(
                    f"offload: recomputing region {self.name!r} saved {len(got)} tensors {got[:4]}... but its forward "
                    f"saved {len(want)} tensors {want[:4]}...; the region's forward must be deterministic in what it "
                    f"saves (no data-dependent branches on mutable state); exclude it from regions or fix the branch"
                    + self.changed_note()
                )
        except OffloadError:
            self._abandon()
            raise
        # A slot that died before this re-run (its node ran, or never will) needs nothing.
        values = [v if alive else None for v, alive in zip(values, self.alive, strict=True)]
        self.phase, self.recomputed = FramePhase.RECOMPUTED, values
        self.gen += 1
        self.unserved = self.live


# Note: [arguments a forward changed]
#     The re-run of a region is given the arguments of its first run: the same tensors (checked
#     for in-place writes by their versions) and the same other objects. An object the forward
#     changes (a cache it fills, a list it appends to, a counter it bumps) is seen changed by the
#     re-run, which then may take another path and save other tensors. Such objects are
#     fingerprinted before and after the forward (their type, length, attributes and the ids and
#     shapes of the tensors they hold, ``_FINGERPRINT_DEPTH`` levels down), and a recompute that
#     then saves something else names them in its error. The cache arguments Hugging Face's
#     layers take are kept from a re-run region altogether (Note: [a re-run region takes no cache]
#     in ``regions``).
_FINGERPRINT_DEPTH = 3
"""Levels of nested objects fingerprinted (a cache holding per-layer lists of tensors is three)."""
_FINGERPRINT_ITEMS = 64
"""Items of one list, tuple or dict fingerprinted; the length is always."""
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _fingerprint(value: Any, depth: int = _FINGERPRINT_DEPTH) -> Any:
    if isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), tuple(value.shape))
    if depth == 0:
        return ("object", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value), len(value), tuple(_fingerprint(v, depth - 1) for v in value[:_FINGERPRINT_ITEMS]))
    if isinstance(value, dict):
        items = list(value.items())[:_FINGERPRINT_ITEMS]
        return (dict, len(value), tuple((repr(k), _fingerprint(v, depth - 1)) for k, v in items))
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict) and not isinstance(value, torch.nn.Module):
        return (type(value), _fingerprint(attributes, depth - 1))
    return ("object", id(value))


def _fingerprints(args: tuple, kwargs: dict) -> dict[str, Any]:
    """Fingerprint of each argument that is not a tensor or an immutable value, by its name."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", v) for k, v in kwargs.items()]
    return {
        f"{name} ({type(value).__name__})": _fingerprint(value)
        for name, value in named
        if not isinstance(value, (torch.Tensor, *_IMMUTABLE))
    }


class StopRecompute(Exception):
    """Raised from the capture hook once every saved tensor is back: the rest need not run."""


_ARG = object()
"""Placeholder for a tensor argument in a frame's stored argument template."""


def _held_bytes(own: dict[int, int], args: tuple, kwargs: dict, elsewhere: set) -> int:
    """Bytes of the storages ``own`` (id -> nbytes) a region holds itself: not its inputs', nor
    those in ``elsewhere`` (held by the store)."""
    inputs = {storage_id(a) for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)}
    return sum(n for key, n in own.items() if key not in inputs and key not in elsewhere)


def storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def droppable(t: torch.Tensor) -> bool:
    """Whether dropping a save of ``t`` frees memory: a plain dense tensor the user does not own
    (``_memory.hooks.users_own``, the rule the engine's hooks pass tensors through by)."""
    return not users_own(t) and t.layout is torch.strided and t.device.type != "meta"


def synchronize_devices(cuda_devices: list) -> None:
    """Wait for the region's CUDA devices (if any), so wall time covers their kernels."""
    for index in cuda_devices:
        torch.cuda.synchronize(index)


class _Unpreserved:
    """``preserve_rng_state=False``: the re-run draws from the generators as backward finds them."""

    def __init__(self, cuda_devices: list) -> None:
        self.cuda_devices = cuda_devices  # still synchronized around a timed re-run

    def restored(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _TorchContextFrame(Frame):
    """A ``checkpoint`` frame run under ``context_fn``'s two contexts: the forward under the first,
    the re-run under the second (as ``torch.utils.checkpoint`` runs them)."""

    def __init__(self, *frame: Any, contexts: tuple, preserve_rng_state: bool) -> None:
        super().__init__(*frame)
        self._contexts = contexts
        if not preserve_rng_state:
            self.rng = _Unpreserved(self.rng.cuda_devices)  # type: ignore[assignment]  # the same two members

    def _forward_mode(self):
        return self._contexts[0]

    def _rerun_mode(self):
        return self._contexts[1]


def _refuse(keyword: str, value: Any, why: str) -> ValueError:
    return ValueError(f"offload.checkpoint(..., {keyword}={value!r}) is not supported: {why}")


def checkpoint(
    fn: Callable,
    *args: Any,
    name: Optional[str] = None,
    use_reentrant: Optional[bool] = None,
    context_fn: Optional[Callable[[], tuple]] = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping only its inputs; re-run it in backward for the rest.

    Same results as ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``, with the
    CPU/CUDA RNG and autocast state of this call restored for the recompute (dropout matches
    bitwise). Inside an ``offload.engine`` the inputs go through the engine's tiers, so they can
    be offloaded too. Outside one, the inputs are kept by reference.

    ``fn`` may run a backward of its own (``torch.autograd.grad``, with or without
    ``create_graph``, e.g. a gradient penalty or forces from an energy) and may call
    ``checkpoint`` again; gradients equal those without checkpointing. That backward must stay
    within ``fn``'s graph and the tensors it closes over: one that reaches the node producing a
    tensor argument raises ``OffloadError`` in forward, since the recompute starts from detached
    arguments.

    Args:
        fn: the region's forward; it must save the same tensors (count, shapes, dtypes) when
            re-run, or backward raises ``OffloadError`` naming the region.
        name: the region's name in error messages and traces (default: ``fn``'s name).

    torch's keywords, where their meaning carries over (a call swapped from
    ``torch.utils.checkpoint.checkpoint`` runs the same): ``use_reentrant=False`` (or left out:
    this is the non-reentrant kind), ``preserve_rng_state`` (False: the re-run draws from the
    generators as backward finds them), ``context_fn`` (a forward and a re-run context, e.g.
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts``), ``determinism_check="default"``
    (the re-run's saves are always checked), ``debug=False`` and ``early_stop=True`` (the re-run
    always stops once backward's saves exist). The rest (``use_reentrant=True``,
    ``determinism_check="none"``, ``debug=True``, ``early_stop=False``) raise ``ValueError``
    saying why. Other keywords go to ``fn``, as torch's do.

    Where ``fn`` is a module or a module's bound method, the re-run leaves the module's buffers and
    plain-number attributes as this call left them (BatchNorm counts one batch, not two), and
    sees them as this call found them; see ``offload._regions.module_state``.

    Examples:
        >>> import torch, offload
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> offload.checkpoint(block, x).sum().backward()  # keeps only x; re-runs block in backward
        >>> grad, x.grad = x.grad, None
        >>> block(x).sum().backward()
        >>> torch.equal(grad, x.grad)  # the same gradient as without checkpointing
        True
    """
    if not callable(fn):
        raise TypeError(f"checkpoint() needs a callable first argument, got {fn!r}")
    if use_reentrant:
        raise _refuse(
            "use_reentrant",
            use_reentrant,
            "offload's recompute is the non-reentrant kind (saved-tensor hooks, as torch's use_reentrant=False); "
            "the reentrant kind re-runs fn inside a backward of its own, with no saved tensors for an engine to "
            "offload, and no torch.autograd.grad inside fn; pass use_reentrant=False, or leave it out",
        )
    if determinism_check != "default":
        raise _refuse(
            "determinism_check",
            determinism_check,
            "the re-run's saves are always checked against the forward's (count, shape, dtype), since each is "
            "matched to autograd's slot by its order; pass determinism_check='default', or leave it out",
        )
    if debug:
        raise _refuse(
            "debug", debug, "there is no op trace to print; a re-run that differs raises an error naming the region"
        )
    if not early_stop:
        raise _refuse(
            "early_stop",
            early_stop,
            "the re-run always stops once every save backward needs exists; move side effects that must run "
            "twice out of fn, or pass early_stop=True",
        )
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be True or False, got {preserve_rng_state!r}")
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    region = name or getattr(fn, "__qualname__", None) or type(fn).__name__
    if context_fn is None and preserve_rng_state:
        return Frame(fn, region, args, kwargs).run()
    contexts = (contextlib.nullcontext(), contextlib.nullcontext()) if context_fn is None else context_fn()
    if not (isinstance(contexts, tuple) and len(contexts) == 2):
        raise TypeError(f"context_fn must return two context managers (forward, re-run), got {contexts!r}")
    return _TorchContextFrame(fn, region, args, kwargs, contexts=contexts, preserve_rng_state=preserve_rng_state).run()
