"""The public engine: one object a user makes once and enters every step.

Owns the user-facing lifecycle: validating the configuration, installing the hooks (context
manager or decorator), the regions, stats and cleanup. What runs underneath is the session
(``_session``: the store, the counters, the hook state); where tensors live is the store's.

    eng = offload.engine(budget_mb=512)
    for batch in data:
        with eng:                      # hooks on: saves go to the store
            loss = model(batch)
        loss.backward()                # hooks off; unpacks still come to the store
        print(eng.stats)               # a frozen snapshot; reading it changes nothing
    eng.close()                        # or let it be collected; the spill file goes either way
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional, TypeVar, Union, cast

import torch

from ._budget import FreeMemory
from ._config import Config
from ._cost import MB, MachineProfile
from ._observe import Observers
from ._plan_cache import PlanCache
from ._planner import Plan
from ._probe import machine_key, probe
from ._regions import AUTO, Regions, RegionsArg, resolve_regions
from ._session import Session
from ._stats import Gauges, Stats
from ._transfer import Link

__all__ = ["Engine", "engine", "explain"]

_Decorated = TypeVar("_Decorated", bound=Callable[..., Any])
"""A function or an nn.Module: ``Engine.__call__`` returns what it was given, wrapped."""


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
        regions: Optional[RegionsArg] = None,
        machine: Optional[MachineProfile] = None,
        link: Optional[Link] = None,
        memory: Optional[FreeMemory] = None,
    ) -> None:
        self.config = config
        self._machine = machine
        plan_cache = None
        if config.plan_cache is not None:
            budget = f"auto reserve {config.reserve_bytes}" if config.follows_free_memory else config.budget_bytes
            plan_cache = PlanCache(config.plan_cache, budget=budget, policy=config.policy, machine_key=machine_key)
        self._session = Session(config, link=link, machine=self._machine_profile, memory=memory, plan_cache=plan_cache)
        self._models: list[torch.nn.Module] = []
        self._closed = False
        self._link_base = Gauges()  # the link's readings at the last reset_stats()
        self._regions: Optional[Regions] = None
        self._regions_to_find = regions == AUTO and model is None  # found in the first model watched
        if regions is not None and not self._regions_to_find:
            self._regions = Regions(resolve_regions(regions, model), config.policy, self._session)
        if model is not None:
            self.watch(model)

    # ------------------------------------------------------------------ user API

    def watch(self, module: torch.nn.Module) -> "Engine":
        """Treat ``module``'s parameters and buffers as never movable (they are kept anyway). With
        ``regions="auto"`` and no ``model=``, the first module watched is searched for its blocks."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"watch() takes an nn.Module, got {type(module).__name__}")
        self._models.append(module)
        if self._regions_to_find:
            self._regions = Regions(resolve_regions(AUTO, module), self.config.policy, self._session)
            self._regions_to_find = False
        return self

    def __enter__(self) -> "Engine":
        if self._closed:
            raise RuntimeError("this offload engine was closed; make a new one with offload.engine(...)")
        if self._regions_to_find:
            raise ValueError(
                "regions='auto' needs the model to search: pass model= to offload.engine(), call "
                "engine.watch(model), or decorate the model itself (engine(model))"
            )
        self._session.eligible.skip_modules(self._models)  # storages can change between steps (to(), load_state_dict)
        if self._regions is not None:
            self._regions.rewrap_compiled()  # a block.compile() since the last step
        self._session.enter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._session.exit(*exc)

    def __call__(self, fn: _Decorated) -> _Decorated:
        """Decorate a function, or a module (its ``forward``), so each call runs under the engine."""
        if isinstance(fn, torch.nn.Module):
            module = fn
            self.watch(module)
            module.forward = self(module.forward)
            return module
        if not callable(fn):
            raise TypeError(f"an offload engine decorates a function or an nn.Module, got {fn!r}")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return cast(_Decorated, wrapper)  # functools.wraps: it reads as fn, called as fn

    @property
    def plan(self) -> Optional[Plan]:
        """The plan in force for the latest step's input shapes (None before the first measured
        step's backward, or without regions). ``print(eng.plan)`` shows region, bytes, forward ms,
        transfer ms, decision, and the predicted overhead and peak."""
        return None if self._regions is None else self._regions.plan

    @property
    def profiling(self) -> bool:
        """True while the regions are still being measured for the latest input shapes: the next
        step will be a profiling step (see ``offload._regions``), not one that follows a final
        plan. Benchmarks warm up until this is False. Always False without regions or with a
        policy that measures nothing ("none", "recompute")."""
        return self._regions is not None and self._regions.profiling()

    @property
    def recent_stages(self) -> tuple:
        """A debug view: the profiling stage of each recent step ("measure", "recompute",
        "offload"), oldest first; None for a step that followed a final plan."""
        return () if self._regions is None else tuple(self._regions.recent_stages)

    @property
    def profiled_steps(self) -> tuple:
        """A debug view: what each recent profiling step measured, oldest first
        (``offload._regions.ProfiledStep``: stage, input signature, region profiles, span)."""
        return () if self._regions is None else tuple(self._regions.profiled)

    @property
    def regions(self) -> tuple:
        """The regions as (qualified name, module) pairs (empty without regions), in order."""
        return () if self._regions is None else tuple(self._regions.regions)

    @property
    def plans(self) -> dict:
        """The plans held, keyed by the first region's input signature: the latest ``MAX_PLANS``
        per input family (``offload._profiler``), measured or derived from a fit."""
        return {} if self._regions is None else dict(self._regions.plans)

    @property
    def observers(self) -> Observers:
        """Who is told of this engine's step boundaries and recomputes: ``add(observer)`` /
        ``remove(observer)`` with an ``offload._observe.Observer`` (traces, metrics use it)."""
        return self._session.observers

    @property
    def stats(self) -> Stats:
        """What the engine did since it was made or since ``reset_stats()`` (a frozen snapshot)."""
        session = self._session
        store = session.store
        if store is None:
            return session.counters.snapshot(Gauges(budget_bytes=self.config.budget_bytes), self._link_base)
        return session.counters.snapshot(store.gauges(), self._link_base)

    def reset_stats(self) -> None:
        """Start a new count (e.g. per step); what the engine holds now (resident bytes, ...) stays."""
        self._session.counters.reset()
        store = self._session.store
        if store is not None:
            store.reset_peak()
            self._link_base = store.gauges()

    def close(self) -> None:
        """Finish copies in flight, free host buffers and remove the spill file. Idempotent."""
        if self._session.store is not None:
            self._session.store.close()
        if self._regions is not None:
            self._regions.restore()
        self._closed = True

    def __repr__(self) -> str:
        if self.config.reserve_bytes is not None:  # budget_mb="auto"
            budget = f"auto, reserve {self.config.reserve_bytes / MB:g} MB"
        else:
            budget = "None" if self.config.budget_bytes is None else f"{self.config.budget_bytes / MB:g} MB"
        return f"offload.Engine(budget={budget}, device={self._session.eligible.device})"

    def _machine_profile(self) -> MachineProfile:
        if self._machine is None:
            self._machine = probe(self._session.eligible.device)  # measured once, then cached on disk
        return self._machine


def _option_names() -> list[str]:
    return [name for name in inspect.signature(Config.from_user).parameters if name not in ("budget_mb", "has_regions")]


def engine(
    budget_mb: Union[float, str, None] = None,
    *,
    model: Optional[torch.nn.Module] = None,
    regions: Optional[RegionsArg] = None,
    machine: Optional[MachineProfile] = None,
    link: Optional[Link] = None,
    memory: Optional[FreeMemory] = None,
    **options: Any,
) -> Engine:
    """Make an engine that keeps at most ``budget_mb`` MB of saved activations on the device.

    Args:
        budget_mb: MB (2**20 bytes) of engine-managed activations allowed on the compute device,
            copies in flight included. None: no limit (the engine only counts). 0: move everything
            eligible off the device. "auto": follow free memory, keeping ``reserve_mb`` free on the
            device (default ``offload._budget.DEFAULT_RESERVE_MB``); tensors move only when free
            memory falls below it (see ``offload._budget``).
        model: a module whose parameters and buffers are never moved (they are detected without
            it too, except buffers: pass the model when it has large buffers).
        regions: the units the policy decides on: ``"auto"`` (the model's repeated blocks: the
            block classes a Hugging Face model names, else the largest stack of one module type;
            see ``offload._blocks``), an iterable of modules (``model.blocks``), or a filter
            ``(module, qualified_name) -> bool``. "auto" and a filter search ``model=`` (or the
            module the engine decorates).
        machine: a ``MachineProfile`` to plan with instead of measuring this machine with
            ``offload.probe()`` (measured once, then cached on disk).
        link: the transport between the device and host memory (``offload._transfer.Link``).
            None: CUDA side streams on a CUDA device; on the CPU none, and tensors go to disk.
            A test passes its own to run the host tier on the CPU.
        memory: with ``budget_mb="auto"``, how free memory is read: a callable returning the
            free bytes of the compute device, or an ``offload._budget.FreeMemory`` with its own
            re-read rule. None: the device's own reading (CUDA allocator and driver, psutil).
        **options: the engine's settings, each documented on ``offload._config.Config``:
            ``reserve_mb`` (with ``budget_mb="auto"``: MB to keep free on the device),
            ``spill_dir`` (where the spill file goes; None: a private temporary directory),
            ``host_budget_mb`` (cap on host memory below a CUDA device; beyond it tensors spill
            to disk), ``min_offload_bytes`` (smaller storages stay), ``device`` ('cpu', 'cuda',
            'cuda:1'; None: that of the first tensor saved), ``prefetch`` (default True),
            ``spill_workers`` (I/O threads), ``policy`` (one of ``offload.policies()``: "none",
            "offload" (the default without regions), "recompute", "selective", "auto" (the default
            with regions); "recompute", "selective" and "auto" need ``regions=``),
            ``plan_cache`` (with regions: a JSON file keeping final plans across restarts, so a
            restarted job does not profile again; see ``offload._plan_cache``).
    """
    unknown = sorted(set(options) - set(_option_names()))
    if unknown:
        raise TypeError(f"offload.engine() got unknown option(s) {unknown}; valid options: {_option_names()}")
    config = Config.from_user(budget_mb, has_regions=regions is not None, **options)
    if machine is not None and not isinstance(machine, MachineProfile):
        raise TypeError(f"machine must be an offload MachineProfile (from offload.probe()), got {machine!r}")
    memory = FreeMemory.from_user(memory)
    if memory is not None and not config.follows_free_memory:
        raise ValueError(
            f"memory= reads free memory for budget_mb='auto', but budget_mb={budget_mb!r}; "
            f"pass budget_mb='auto' or drop memory="
        )
    return Engine(config, model=model, regions=regions, machine=machine, link=link, memory=memory)


def explain(what: Union[Engine, Plan, None]) -> str:
    """The plan table of an engine (its latest plan) or of a ``Plan``, as text."""
    plan = what.plan if isinstance(what, Engine) else what
    if plan is None:
        return (
            "no plan yet: an engine plans with regions= and a policy that measures ('auto', 'offload' or "
            "'selective'), after its profiling steps; 'recompute' and 'none' make no plan"
        )
    if not isinstance(plan, Plan):
        raise TypeError(f"explain() takes an offload Engine or Plan, got {type(what).__name__}")
    text = str(plan)
    if isinstance(what, Engine) and what._regions is not None:
        text = f"{text}\nregions: {what._regions.why}"
    if isinstance(what, Engine) and what.profiling:
        return (
            f"{text}\n(provisional: these input shapes are still being profiled; "
            "Engine.profiling turns False once the plan is final)"
        )
    return text
