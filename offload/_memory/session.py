"""One engine's runtime: the store, the counters, and what the hooks and the regions may ask of it.

The engine (``_engine``) owns the lifecycle a user sees; this object is what runs underneath, and
the one thing ``Regions`` and the probe talk to:

    hooks ──pack/unpack──▶ Session ──▶ Store (made on the first saved tensor, for its device)
                              └─ saves declared shared ──▶ SharedSaves ──this rank's slice──▶ Store
    Regions ──active? / eagerly() / eagerly_to_end() / marks / set_planned() / saved() / moved_bytes()
              / count_recompute() / machine() / budget_in_force()──▶ Session

State per thread (the hook stack, eager mode) is thread-local: one engine can serve a training
thread and an evaluation thread at once.

Where nothing will move (budget None, no regions) the engine only counts, and a step after the
first runs with its hook pair off the thread's hook stack, so autograd saves natively and no Python
runs per saved tensor (See Note: [no hooks where nothing moves]):

    step 1 after engine() / reset_stats()   hooks on: every save counted exactly, live (stats read
                                            mid-forward, resident and peak gauges), as at any budget
    later steps                             nothing pushed (``Stats.uncounted_steps`` += 1), unless
                                            something is on the hook stack (a user's pair, another
                                            engine) or hooks are disabled: then pushed, as ever

Why sampling the first step, not a walk of the graph's saved tensors after forward: in the
``with eng:`` form the engine never sees the forward's outputs, so it has no roots to walk from;
and a walk (``grad_fn._raw_saved_*``, each storage once, about 1.3 us a saved tensor measured for
issue 48) costs more per save than the goal allows (1.5 x a bare hook pair). Counting with the
hooks on the first step is exact for that step, and the counts say which steps they cover.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from typing import Any, Callable, Optional

import torch

from .._budget import FreeMemory, make_budget
from .._config import Config
from .._cost import MachineProfile, Saved
from .._errors import OffloadError
from .._observe import Observers
from .._stats import Counters
from .entry import Handle
from .hooks import Eligibility, HookPair, never_traced, unhooked, unpack_passed
from .host import Host
from .sharded import ShardedHandle, Sharding, SharedSaves, declared
from .store import Store
from .transfer import Link

__all__ = ["ForwardMarks", "Session"]

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
"""The innermost (pack, unpack) on this thread's hook stack, or None: one C call."""
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled  # type: ignore[attr-defined]  # no stub
"""False inside ``torch.autograd.graph.disable_saved_tensors_hooks``, where pushing a pair raises."""


class _ThreadState(threading.local):
    """What the session keeps per thread; the class attributes are each thread's defaults, so a
    read on a thread that set nothing is a plain attribute read (``getattr`` with a default on a
    bare ``threading.local`` raised and caught an AttributeError, twice per pack)."""

    stack: Optional[list] = None
    """The hook contexts entered on this thread, innermost last (None: never entered)."""
    eager = False
    """Inside ``Session.eagerly()``."""
    eager_to_end = False
    """Saves start their copy out at once until this thread leaves the engine."""
    planned_per_rank = False
    """Inside ``Session.planned_per_rank()``."""
    unhooked_step = False
    token: Optional[contextvars.Token] = None
    """Set where a planned step took the pair off the stack after its entry pushed it (See Note: [a
    step kept whole runs unhooked]): ``hooks.unhooked``'s token, reset at the outermost exit."""
    """This thread's step runs with the engine's pair off the hook stack (See Note: [no hooks where
    nothing moves])."""


@dataclasses.dataclass(eq=False)
class ForwardMarks:
    """What was saved through the engine when it was entered (outermost, on one thread) and when
    it was left (None until then). Regions measure what is saved outside them by these, and tell
    one entry from the next by identity (two entries with nothing counted between them, as after a
    step that ran unhooked, hold equal figures: ``eq=False`` keeps them apart)."""

    entered: Saved
    closed: Optional[Saved] = None


class Session:
    """The store, counters and thread-local hook state of one engine."""

    def __init__(
        self,
        config: Config,
        *,
        link: Optional[Link] = None,
        machine: Optional[Callable[[], MachineProfile]] = None,
        memory: Optional[FreeMemory] = None,
        host: Optional[Host] = None,
    ) -> None:
        self.config = config
        self.budget = make_budget(config.budget_bytes, config.reserve_bytes, memory)
        """The engine's one budget (none, fixed, or following free memory), made here once; the
        store, made at the first save, holds it too."""
        self.counters = Counters()
        self.eligible = Eligibility(config.device, config.min_offload_bytes)
        self._link = link
        self._host = host
        self._machine = machine
        self._store: Optional[Store] = None
        self._store_lock = threading.Lock()
        self._local = _ThreadState()
        self._inside: set[int] = set()  # threads inside the engine now
        self._inside_lock = threading.Lock()
        self.observers = Observers()
        """Told of step boundaries and recomputes (``offload._observe``); empty: nothing is called."""
        self.marks: Optional[ForwardMarks] = None
        """What had been saved when the engine was last entered, and when that forward closed."""
        self.shared = SharedSaves(self.counters, config.prefetch)
        """Saves declared identical across a process group (``offload._memory.sharded``)."""
        self.hooks = self._make_hooks()
        """The (pack, unpack) pair for ``torch.autograd.graph.saved_tensors_hooks``."""
        self._count_next = True
        """The next step that could run unhooked is counted instead (the first after the engine was
        made or ``count_next_step()``)."""

    # ------------------------------------------------------------------ the hooks

    @property
    def store(self) -> Optional[Store]:
        """The store, once the first eligible tensor was saved (it fixes the device)."""
        return self._store

    def _open_store(self, device: torch.device) -> Store:
        with self._store_lock:  # two threads saving their first tensor at once make one store
            if self._store is None:
                self._store = Store(
                    self.config, device, self.counters, link=self._link, budget=self.budget, host=self._host
                )
        return self._store

    def _make_hooks(self) -> HookPair:
        """The (pack, unpack) pair, closures over what they read per tensor: in a chain of saves a
        Python frame costs about twice what it costs in a loop (it runs cold between torch's own
        work), so the pair calls the eligibility test and the store and nothing in between."""
        take, counters, observers, local, shared = (
            self.eligible.take,
            self.counters,
            self.observers,
            self._local,
            self.shared,
        )

        def pack(t: torch.Tensor) -> Any:
            storage = take(t)
            if storage is None:
                counters.passthrough_tensors += 1
                return (
                    t.detach(),
                    t._version,
                )  # hooks.pack_passed(t), inline: See Note: [pass through a detached alias]
            store = self._store or self._open_store(t.device)
            eager = local.eager or local.eager_to_end
            sharding = declared()
            if sharding is None:
                return store.pack(t, eager, storage)
            return self._pack_shared(t, sharding, store, eager)

        def unpack(packed: Any) -> torch.Tensor:
            if type(packed) is tuple:  # hooks.unpack_passed(packed), its check inline
                alias, version = packed
                if alias._version == version:
                    return alias
                return unpack_passed(packed)  # raises PyTorch's in-place error
            if observers.awaiting_backward:
                observers.unpacked()
            if type(packed) is Handle:
                return packed.store.unpack(packed)
            assert isinstance(packed, ShardedHandle)  # pack returns one of the three
            return shared.unpack(packed)

        return never_traced(pack), never_traced(unpack)  # See Note: [Dynamo never traces the hooks]

    def _pack_shared(self, t: torch.Tensor, sharding: Sharding, store: Store, eager: bool) -> ShardedHandle:
        """A save declared shared across a process group (``offload.sharded``): this rank's slice goes to the store."""
        if self._local.planned_per_rank:
            raise OffloadError(
                f"offload: a save declared shared (offload.sharded) inside a region under policy='auto': each "
                "rank plans its regions from its own measurements, so ranks may keep one region and recompute "
                "it on another, and the gathers would pair up the wrong tensors; declare outside the regions, "
                "or pass policy='recompute', 'offload' or 'selective' "
                f"(the saved tensor: {tuple(t.shape)} {t.dtype})"
            )
        return self.shared.pack(t, sharding, lambda kept: store.pack(kept, eager))

    # ------------------------------------------------------------------ the hook stack (per thread)

    # Note: [no hooks where nothing moves]
    #     At budget None without regions nothing the engine takes ever moves, so its hooks would
    #     only count: a Python pack and unpack per saved tensor (10-12 x a bare pair, issue 48) for
    #     nothing but a number. So an unhooked step (``enter(unhooked=True)``) pushes nothing and
    #     autograd saves natively (its own in-place check, its own lifetimes). Three rules keep
    #     every save where it went before:
    #     - the first such step after the engine was made or ``count_next_step()`` pushes the pair:
    #       it is the counted step (``Stats.uncounted_steps`` counts the others);
    #     - an entry that finds anything on this thread's hook stack (a user's pair, another engine,
    #       ``no_offload``) pushes the pair, since only the innermost pair is called and the one
    #       below must see nothing from inside ``with eng:``, as before; a nested entry of an unhooked
    #       step asks again, so a pair the user pushed inside the step is shadowed as it was;
    #     - an entry while hooks are disabled (``disable_saved_tensors_hooks``) pushes, so it raises
    #       torch's error as before.
    #     ``offload.sharded`` needs the engine's pack to slice its saves: while a step is unhooked,
    #     ``hooks.unhooked`` holds the pair and the declaration pushes it for its block.

    def enter(self, unhooked_ok: bool = False) -> None:
        """Install the hooks on this thread (nested entries stack); tell the store a step starts
        (with budget_mb="auto" it reads free memory; it gives back pinned pages dropped last step).
        ``unhooked_ok``: nothing saved will move, so the pair may stay off the stack (See Note: [no
        hooks where nothing moves])."""
        if self._store is not None:
            self._store.step_started()
        stack = self._local.stack
        if stack is None:
            stack = self._local.stack = []
        clear = _top_hooks(False) is None and _hooks_enabled()  # See Note: [no hooks where nothing moves]
        if not stack:
            unhooked_step = unhooked_ok and clear and not self._count_next
            if unhooked_ok and clear:
                self._count_next = False
            self._local.unhooked_step = unhooked_step
            if unhooked_step:
                self.counters.uncounted_steps += 1
        if self._local.unhooked_step and clear:
            stack.append(unhooked.set(self.hooks))
        else:
            ctx = torch.autograd.graph.saved_tensors_hooks(*self.hooks)
            ctx.__enter__()
            stack.append(ctx)
        if len(stack) == 1:
            with self._inside_lock:
                self._inside.add(threading.get_ident())
            self.marks = ForwardMarks(entered=self.saved())
            self.shared.new_forward()
        if self.observers and len(stack) == 1:
            self.observers.entered()

    # Note: [a step kept whole runs unhooked]
    #     With regions, a step whose plan keeps everything (every region and what is saved around
    #     them: measured at these very inputs, predicted within the budget) moves nothing either.
    #     The plan is known only at the step's first region call, after the saves before it went
    #     through the pair; from there ``unhook_rest_of_step`` takes the pair off the stack for the
    #     rest of the outermost entry, and ``exit`` puts it back just before the entry's own pop.
    #     It does so only where the pair is the only one on the stack: it pops the pair and, if
    #     another (a user's, another engine's, its own of an outer entry) is then on top, pushes it
    #     straight back, so nothing saved inside is ever shown to an outer pair. A nested entry
    #     meanwhile pushes as ever; ``offload.sharded`` pushes the pair for its block
    #     (``hooks.unhooked``). The step's saves are then not counted (``Stats.uncounted_steps``);
    #     its plan held them within the budget when it was measured, at these inputs.
    def unhook_rest_of_step(self) -> bool:
        """Take this thread's pair off the hook stack until the outermost entry is left, where it
        is the only pair there: See Note: [a step kept whole runs unhooked]. True where taken off."""
        if not self._local.stack:
            return False
        top = _top_hooks(False)
        if top is None or top[0] is not self.hooks[0]:
            return False  # a pair pushed inside the engine is on top: it stays, and so does ours
        _pop_hooks()
        if _top_hooks(False) is not None:  # a pair below ours: it must not see this step's saves
            _push_hooks(*self.hooks)
            return False
        self._local.unhooked_step = True
        self._local.token = unhooked.set(self.hooks)
        self.counters.uncounted_steps += 1
        return True

    def count_next_step(self) -> None:
        """Count the next step with the hooks on, though it could run without (``reset_stats``)."""
        self._count_next = True

    def exit(self, *exc: Any) -> None:
        stack = self._local.stack
        assert stack, "offload internal error: the engine was left on a thread that did not enter it"
        entry = stack.pop()
        if type(entry) is contextvars.Token:
            unhooked.reset(entry)
        else:
            if not stack and self._local.token is not None:  # See Note: [a step kept whole runs unhooked]
                unhooked.reset(self._local.token)
                self._local.token = None
                _push_hooks(*self.hooks)  # the entry's own exit pops it
            entry.__exit__(*exc)
        if not stack:
            with self._inside_lock:
                self._inside.discard(threading.get_ident())
            self._local.eager_to_end = False
            self._local.unhooked_step = False
            marks = self.marks
            if marks is not None and marks.closed is None:
                marks.closed = self.saved()
        if self.observers and not stack:
            self.observers.exited()

    # ------------------------------------------------------------------ what regions may ask

    def active(self) -> bool:
        """True while this thread is inside the engine (its hooks may be shadowed by inner ones)."""
        return bool(self._local.stack)

    def others_inside(self, me: int) -> list[int]:
        """The threads other than ``me`` (a ``threading.get_ident()``) inside the engine now."""
        with self._inside_lock:
            return sorted(t for t in self._inside if t != me)

    @contextlib.contextmanager
    def planned_per_rank(self):
        """A region runs under a decision each rank made from its own measurements (policy "auto"):
        a save declared shared in it is refused (See Note: [collectives in one order on every rank])."""
        previous = self._local.planned_per_rank
        self._local.planned_per_rank = True
        try:
            yield
        finally:
            self._local.planned_per_rank = previous

    @contextlib.contextmanager
    def eagerly(self):
        """Saves in this block start their copy out at once (a region planned OFFLOAD)."""
        previous = self._local.eager
        self._local.eager = True
        try:
            yield
        finally:
            self._local.eager = previous

    def eagerly_to_end(self) -> None:
        """Saves from now until this thread leaves the engine start their copy out at once (the
        saves after the last region, planned OFFLOAD)."""
        self._local.eager_to_end = True

    def set_planned(self, planned: bool) -> None:
        """A plan is in force this step (True) or the regions are being measured (False): the
        budget (``Budget.set_planned``) evicts at its full size or keeps its in-flight window."""
        self.budget.set_planned(planned)

    def saved(self) -> Saved:
        """Bytes and tensors saved through the engine so far: regions measure themselves by the difference."""
        in_backward = 0 if self._store is None else self._store.saved_in_backward_bytes
        return Saved(self.counters.saved_bytes, self.counters.saved_tensors, in_backward)

    def take_largest_saved(self) -> int:
        """Bytes of the largest storage the store took since the last call (0: none, or no store
        yet); the next call counts from here. A region reads it at its start and its end."""
        return 0 if self._store is None else self._store.take_largest()

    def moved_bytes(self) -> int:
        """Bytes moved off the device so far: a profiling step that moved none ran alone on the device."""
        return self.counters.offloaded_bytes

    def budget_in_force(self) -> Optional[int]:
        """The byte budget to plan against now: ``budget_mb``, or with "auto" the latest reading
        (None before the first eligible tensor was saved: nothing to budget yet)."""
        return self.budget.bytes

    def region_held(self, nbytes: int) -> None:
        """A recomputed or selective region holds ``nbytes`` itself now (its forward's saves as the
        forward ends, or its re-run's values): the peaks of ``Stats.peak_region_bytes`` and
        ``Stats.peak_held_bytes``."""
        counters = self.counters
        counters.peak_region_bytes = max(counters.peak_region_bytes, nbytes)
        resident = 0 if self._store is None else self._store.resident_bytes
        counters.peak_held_bytes = max(counters.peak_held_bytes, resident + nbytes)

    def count_recompute(self, dropped_bytes: int = 0) -> None:
        self.counters.recomputed_regions += 1
        self.counters.recomputed_bytes += dropped_bytes

    def machine(self) -> MachineProfile:
        """The machine's transfer costs, for planning (the engine measures them on first use)."""
        if self._machine is None:
            raise RuntimeError("offload internal error: this session has no machine profile to plan with")
        return self._machine()
