"""The public engine: one object a user makes once and enters every step.

Owns the user-facing lifecycle: building the config, installing the hooks (context manager or
decorator), binding the store to a compute device, stats and cleanup. The work itself is in
``_hooks`` (what to take) and ``_store`` (where it lives).

    eng = offload.engine(budget_mb=512)
    for batch in data:
        with eng:                      # hooks on: saves go to the store
            loss = model(batch)
        loss.backward()                # hooks off; unpacks still come to the store
        print(eng.stats)               # a frozen snapshot
    eng.close()                        # or let it be collected; spill files go either way
"""

from __future__ import annotations

import functools
import threading
from typing import Optional

import torch

from ._config import Config
from ._cost import MachineProfile
from ._hooks import Eligibility, make_hooks
from ._planner import Plan
from ._regions import Regions, resolve_regions
from ._stats import Counters, Stats
from ._store import Store

__all__ = ["Engine", "engine", "explain"]

_GAUGES = ("resident_bytes", "host_bytes", "spill_files")


class Engine:
    """Keeps saved activations under a byte budget on the compute device.

    Use it as a context manager around the forward pass, or as a decorator on a function or a
    module's ``forward``. One engine serves many steps; backward may run after the ``with`` ends.
    Build it with :func:`offload.engine`.
    """

    def __init__(
        self,
        config: Config,
        model: Optional[torch.nn.Module] = None,
        regions=None,
        machine: Optional[MachineProfile] = None,
    ) -> None:
        self.config = config
        self._counters = Counters()
        self._eligible = Eligibility(config.device, config.min_offload_bytes)
        self._stores: dict[torch.device, Store] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._models: list[torch.nn.Module] = []
        if model is not None:
            self.watch(model)
        self._hooks = make_hooks(self._eligible, self._pack, self._unpack, self._passthrough)
        self._closed = False
        self._planned = False
        self._machine = machine
        self._regions = None
        if regions is not None:
            self._regions = Regions(
                resolve_regions(regions, model),
                policy=config.policy,
                budget_bytes=config.budget_bytes,
                machine=self._machine_profile,
                active=self._active,
                eager=self._set_eager,
                on_recompute=self._count_recompute,
                saved_bytes=lambda: (self._counters.saved_bytes, self._counters.saved_tensors),
                planned=self._set_planned,
            )

    # ------------------------------------------------------------------ user API

    def watch(self, module: torch.nn.Module) -> "Engine":
        """Treat ``module``'s parameters and buffers as never movable (they are kept anyway)."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"watch() takes an nn.Module, got {type(module).__name__}")
        self._models.append(module)
        return self

    def __enter__(self) -> "Engine":
        if self._closed:
            raise RuntimeError("this offload engine was closed; make a new one with offload.engine(...)")
        self._eligible.skip_modules(self._models)  # storages can change between steps (to(), load_state_dict)
        ctx = torch.autograd.graph.saved_tensors_hooks(*self._hooks)
        ctx.__enter__()
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(ctx)
        return self

    def __exit__(self, *exc) -> None:
        self._local.stack.pop().__exit__(*exc)

    def __call__(self, fn):
        """Decorate a function, or a module (its ``forward``), so each call runs under the engine."""
        if isinstance(fn, torch.nn.Module):
            module = fn
            self.watch(module)
            module.forward = self(module.forward)
            return module
        if not callable(fn):
            raise TypeError(f"an offload engine decorates a function or an nn.Module, got {fn!r}")

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return wrapper

    @property
    def plan(self) -> Optional[Plan]:
        """The plan in force for the latest step's input shapes (None before the first step with
        regions, or without regions). ``print(eng.plan)`` shows region, bytes, forward ms, transfer
        ms, decision, and the predicted overhead and peak."""
        if self._regions is None:
            return None
        self._regions.finish_pending()
        return self._regions.plan

    @property
    def profiling(self) -> bool:
        """True while the regions are still being measured for the latest input shapes: the next
        step will be a profiling step (see ``offload._regions``), not one that follows a final
        plan. Benchmarks warm up until this is False. Always False without regions or with a
        policy that measures nothing ("none", "recompute")."""
        return self._regions is not None and self._regions.profiling()

    @property
    def plans(self) -> dict:
        """Every plan made so far, keyed by the first region's input signature."""
        if self._regions is None:
            return {}
        self._regions.finish_pending()
        return dict(self._regions.plans)

    @property
    def stats(self) -> Stats:
        """What the engine did since it was made or since ``reset_stats()`` (a frozen snapshot)."""
        for store in list(self._stores.values()):
            store.settle()
        self._counters.host_bytes = sum(s.pool.held_bytes for s in self._stores.values() if s.pool is not None)
        self._counters.spill_files = sum(s.spill_files for s in self._stores.values())
        return self._counters.snapshot()

    def reset_stats(self) -> None:
        """Start a new count (e.g. per step); current gauges (resident bytes, ...) are kept."""
        self._counters.reset(keep=_GAUGES)
        self._counters.peak_resident_bytes = self._counters.resident_bytes

    def close(self) -> None:
        """Finish copies in flight, free pinned buffers and remove spill files. Idempotent."""
        for store in list(self._stores.values()):
            store.close()
        if self._regions is not None:
            self._regions.restore()
        self._closed = True

    def __repr__(self) -> str:
        budget = "None" if self.config.budget_bytes is None else f"{self.config.budget_bytes / 2**20:g} MB"
        return f"offload.Engine(budget={budget}, device={self._eligible.device})"

    # ------------------------------------------------------------------ hook plumbing

    def _store_for(self, device: torch.device) -> Store:
        store = self._stores.get(device)
        if store is None:
            with self._lock:
                store = self._stores.get(device)
                if store is None:
                    store = self._stores[device] = Store(self.config, device, self._counters)
                    store.set_planned(self._planned)
        return store

    def _pack(self, t: torch.Tensor):
        store = self._stores.get(t.device) or self._store_for(t.device)
        return store.pack(t, getattr(self._local, "eager", False))

    def _active(self) -> bool:
        """True while this thread is inside ``with self`` (the hooks may be shadowed by inner ones)."""
        return bool(getattr(self._local, "stack", None))

    def _set_eager(self, eager: bool) -> bool:
        previous = getattr(self._local, "eager", False)
        self._local.eager = eager
        return previous

    def _set_planned(self, planned: bool) -> None:
        """A plan is in force this step (True) or the regions are being measured (False)."""
        self._planned = planned
        for store in list(self._stores.values()):
            store.set_planned(planned)

    def _count_recompute(self) -> None:
        self._counters.recomputed_regions += 1

    def _machine_profile(self) -> MachineProfile:
        if self._machine is None:
            from ._probe import probe  # measuring is deferred to the first plan, then cached on disk

            self._machine = probe(self._eligible.device)
        return self._machine

    def _unpack(self, handle):
        return handle.store.unpack(handle)

    def _passthrough(self) -> None:
        self._counters.passthrough_tensors += 1


def engine(
    budget_mb=None,
    *,
    spill_dir=None,
    host_budget_mb=None,
    min_offload_bytes: int = Config.min_offload_bytes,
    device=None,
    prefetch: bool = True,
    spill_workers: int = Config.spill_workers,
    model: Optional[torch.nn.Module] = None,
    policy: Optional[str] = None,
    regions=None,
    machine: Optional[MachineProfile] = None,
) -> Engine:
    """Make an engine that keeps at most ``budget_mb`` MB of saved activations on the device.

    Args:
        budget_mb: MB (2**20 bytes) of engine-managed activations allowed on the compute device,
            copies in flight included. None: no limit (the engine only counts). 0: move everything
            eligible off the device.
        spill_dir: directory for spill files (the disk tier). None: a private temporary directory.
        host_budget_mb: cap on pinned host memory (CUDA); beyond it tensors spill to disk.
            None: as much as the host can spare (psutil), never into swap.
        min_offload_bytes: storages smaller than this stay where they are.
        device: the compute device to manage ('cpu', 'cuda', 'cuda:1'); None: the device of the
            first tensor saved. Tensors elsewhere pass through.
        prefetch: bring tensors back ahead of use in backward (default True).
        spill_workers: threads for spill-file I/O.
        model: a module whose parameters and buffers are never moved (they are detected without
            it too, except buffers: pass the model when it has large buffers).
        policy: how regions meet the budget, one of ``offload.policies()``: "none" (keep and
            count; no budget), "offload" (move tensors; the default without regions), "recompute"
            (checkpoint every region), "auto" (measure each region on the first steps, then keep,
            offload or recompute each by cost; the default with regions). See ``profiling``.
        regions: the units the policy decides on: an iterable of modules (``model.blocks``), or a
            filter ``(module, qualified_name) -> bool`` together with ``model=``.
        machine: a ``MachineProfile`` to plan with instead of measuring this machine with
            ``offload.probe()`` (measured once, then cached on disk).
    """
    if policy is None:
        policy = "auto" if regions is not None else "offload"
    config = Config.from_user(
        budget_mb,
        spill_dir=spill_dir,
        host_budget_mb=host_budget_mb,
        min_offload_bytes=min_offload_bytes,
        device=device,
        prefetch=prefetch,
        spill_workers=spill_workers,
        policy=policy,
        has_regions=regions is not None,
    )
    if machine is not None and not isinstance(machine, MachineProfile):
        raise TypeError(f"machine must be an offload MachineProfile (from offload.probe()), got {machine!r}")
    return Engine(config, model=model, regions=regions, machine=machine)


def explain(what) -> str:
    """The plan table of an engine (its latest plan) or of a ``Plan``, as text."""
    plan = what.plan if isinstance(what, Engine) else what
    if plan is None:
        return "no plan yet: an engine plans after its first step with regions= (policy 'auto' or 'offload')"
    if not isinstance(plan, Plan):
        raise TypeError(f"explain() takes an offload Engine or Plan, got {type(what).__name__}")
    if isinstance(what, Engine) and what.profiling:
        return (
            f"{plan}\n(provisional: these input shapes are still being profiled; "
            "Engine.profiling turns False once the plan is final)"
        )
    return str(plan)
