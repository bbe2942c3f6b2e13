"""The public engine: one object a user makes once and enters every step.

Owns the user-facing lifecycle: installing the hooks (context manager or decorator), the regions,
stats and cleanup, for a configuration ``offload.engine`` (``_api``) has already checked. What runs
underneath is the session (``_memory.session``: the store, the counters, the hook state); where
tensors live is the store's.

    eng = offload.engine(budget_mb=512)
    for batch in data:
        with eng:                      # hooks on: saves go to the store
            loss = model(batch)
        loss.backward()                # hooks off; unpacks still come to the store
        print(eng.stats)               # a frozen snapshot; reading it changes nothing
    eng.close()                        # or let it be collected; the spill file goes either way
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from typing import Any, Callable, Optional, TypeVar, Union, cast

import torch

from ._attach import attach
from ._budget import FreeMemory
from ._config import Config
from ._cost import MB, MachineProfile
from ._errors import OffloadError
from ._memory.host import Host
from ._memory.probe import machine_key, probe
from ._memory.session import Session
from ._memory.sharded import Sharding
from ._memory.transfer import Link
from ._observe import Observers
from ._plan.cache import PlanCache
from ._plan.planner import Decision, Plan
from ._plan.policy import get_policy
from ._regions.regions import AUTO, NoRegions, Regions, RegionsArg, refuse_foreign, resolve_regions
from ._stats import Gauges, Stats

__all__ = ["Engine", "explain"]


@dataclasses.dataclass(frozen=True)
class _StepSaves:
    """What one step (an outermost enter to its exit, on one thread) saved through the hooks."""

    managed: int
    """Tensors the engine took."""
    small: int
    """Tensors passed through only for being under ``min_offload_mb``."""

    def all_small(self) -> bool:
        return self.managed == 0 and self.small > 0


_Decorated = TypeVar("_Decorated", bound=Callable[..., Any])
"""A function or an nn.Module: ``Engine.__call__`` returns what it was given, wrapped."""


class Engine:
    """Keeps saved activations under a byte budget on the compute device.

    Use it as a context manager around the forward pass, or as a decorator on a function or a
    module's ``forward``. One engine serves many steps; backward may run after the ``with`` ends.
    Build it with :func:`offload.engine`, the one constructor (it validates every setting);
    ``Engine`` is public as the type, and building one from a ``Config`` directly is deprecated.

    Examples:
        At budget 0 every save leaves the device as it is made, and comes back for backward:

        >>> import torch, offload
        >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
        >>> eng = offload.engine(budget_mb=0, min_offload_mb=0)
        >>> with eng:
        ...     loss = model(torch.randn(64, 256)).sum()
        >>> loss.backward()
        >>> eng.stats.offloaded_bytes == eng.stats.saved_bytes > 0
        True
        >>> eng.close()
    """

    def __init__(
        self,
        config: Config,
        model: Optional[torch.nn.Module] = None,
        regions: Optional[RegionsArg] = None,
        machine: Optional[MachineProfile] = None,
        link: Optional[Link] = None,
        memory: Optional[FreeMemory] = None,
        shared_inputs: Optional[Sharding] = None,
        host: Optional[Host] = None,
        *,
        _datasheet: str = "",
        _checked: bool = False,
    ) -> None:
        if not _checked:
            warnings.warn(
                "offload.Engine(config, ...) is deprecated and goes in the next release: build an engine with "
                "offload.engine(...), which validates every setting (Engine stays public as the type)",
                DeprecationWarning,
                stacklevel=2,
            )
        self.config = config
        self._datasheet = _datasheet
        """Where a named machine's figures come from (``offload.engine(machine=offload.machine(...))``), or ""."""
        self._shared_inputs = shared_inputs
        self._machine = machine
        self._machine_given = machine is not None  # the user's figures: never replaced by the trials' bounds
        self._plan_cache: Optional[PlanCache] = None
        """Where final region plans are kept across restarts (``plan_cache=``): the regions' to use."""
        if config.plan_cache is not None:
            budget = f"auto reserve {config.reserve_bytes}" if config.follows_free_memory else config.budget_bytes
            self._plan_cache = PlanCache(
                config.plan_cache, budget=budget, policy=config.policy, machine_key=machine_key
            )
        self._session = Session(config, link=link, machine=self._machine_profile, memory=memory, host=host)
        self._models: list[torch.nn.Module] = []
        self._closed = False
        self._link_base = Gauges()  # the link's readings at the last reset_stats()
        self._regions: Union[Regions, NoRegions] = NoRegions()
        self._regions_to_find = regions == AUTO and model is None  # found in the first model watched
        self._step_start = _StepSaves(0, 0)  # the counts when the latest step began
        self._last_step = _StepSaves(0, 0)
        """What the latest finished step saved (its tensors managed, and those under min_offload_mb)."""
        self._warned_all_small = False
        self._entering = threading.Lock()  # an engine with regions checks and enters under it
        self._region_calls_at_start = 0  # the regions' calls when the latest step began
        self._warned_idle = False  # warned that a step ran none of the regions
        self._checked_checkpointing = False  # looked, at the first step with regions, for a model's own checkpointing
        self._only_counts = config.budget_bytes is None and config.reserve_bytes is None
        """No budget and none following free memory: without regions nothing saved ever moves."""
        if regions is not None and not self._regions_to_find:
            self._regions = Regions(
                resolve_regions(regions, model),
                config.policy,
                self._session,
                self._plan_cache,
                shared_inputs,
                machine_given=machine is not None,
            )
        if model is not None:
            self._watch(model)

    # ------------------------------------------------------------------ user API

    def watch(self, module: torch.nn.Module) -> "Engine":
        """Deprecated: name the model once, as ``offload.engine(..., model=model)`` (or decorate it).
        Treats ``module``'s parameters and buffers as never movable; with ``regions="auto"`` and no
        ``model=``, the first module watched is searched for its blocks."""
        warnings.warn(
            "Engine.watch(model) is deprecated and goes in the next release: name the model once, as "
            "offload.engine(..., model=model) (a decorated module is named by the decoration)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._watch(module)

    def _watch(self, module: torch.nn.Module) -> "Engine":
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"watch() takes an nn.Module, got {type(module).__name__}")
        self._models.append(module)
        if self._regions_to_find:
            self._regions = Regions(
                resolve_regions(AUTO, module),
                self.config.policy,
                self._session,
                self._plan_cache,
                self._shared_inputs,
                machine_given=self._machine_given,
            )
            self._regions_to_find = False
        return self

    def __enter__(self) -> "Engine":
        if self._closed:
            raise OffloadError("this offload engine was closed; make a new one with offload.engine(...)")
        if self._regions_to_find:
            raise ValueError(
                "regions='auto' needs the model to search: pass model= to offload.engine(), "
                "or decorate the model itself (engine(model))"
            )
        self._session.eligible.skip_modules(self._models)  # storages can change between steps (to(), load_state_dict)
        self._regions.rewrap_compiled()  # a block.compile() since the last step
        outermost = not self._session.active()
        if outermost and self._regions.present:
            with self._entering:  # See Note: [one forward at a time] (in ``_regions.regions``)
                self._regions.refuse_another_thread()
                self._session.enter()
        else:
            # Budget None: nothing will move unless regions do, and their outermost entry (above) always
            # pushes the pair, which a nested entry then keeps. See Note: [no hooks where nothing moves]
            self._session.enter(unhooked_ok=self._only_counts)
        if outermost and self._regions.present and not self._checked_checkpointing:
            self._checked_checkpointing = True  # once: the look walks every module (explain() looks again)
            note = _checkpointing_note(self._models)
            if note:
                warnings.warn(f"offload: {note}", UserWarning, stacklevel=2)
        if outermost:
            self._step_start = self._saves_so_far()
            self._region_calls_at_start = self._regions.calls
        return self

    def __exit__(self, *exc: Any) -> None:
        self._session.exit(*exc)
        if not self._session.active():
            if exc and exc[0] is not None:
                self._regions.forward_raised()
            now, start = self._saves_so_far(), self._step_start
            self._last_step = _StepSaves(now.managed - start.managed, now.small - start.small)
            if self._last_step.all_small() and not self._warned_all_small:
                self._warned_all_small = True
                warnings.warn(f"offload: {self._all_small_note()}", UserWarning, stacklevel=2)
            regions = self._regions
            saved = self._last_step.managed + self._last_step.small
            if regions.present and saved and regions.calls == self._region_calls_at_start and not self._warned_idle:
                self._warned_idle = True
                warnings.warn(
                    f"offload: the latest step saved {saved} tensor(s) but ran none of the engine's "
                    f"{len(regions.regions)} regions (the first: {regions.regions[0][0]!r}), so nothing is profiled or "
                    "planned and Engine.profiling stays True. regions= must name modules of the model you run: a "
                    "copy of the model (copy.deepcopy) has blocks of its own; pass regions=model.blocks of that model",
                    UserWarning,
                    stacklevel=2,
                )

    def _saves_so_far(self) -> _StepSaves:
        return _StepSaves(self._session.counters.saved_tensors, self._session.eligible.small_saves)

    def _all_small_note(self) -> str:
        return (
            f"the latest step saved {self._last_step.small} tensor(s), every one under min_offload_mb="
            f"{self.config.min_offload_bytes / MB:g} MiB ({self.config.min_offload_bytes} bytes), so the engine "
            f"managed none of them (they stayed on the device); to manage them pass a smaller min_offload_mb, e.g. "
            f"offload.engine(..., min_offload_mb=0)"
        )

    def __call__(self, fn: _Decorated) -> _Decorated:
        """Decorate a function, or a module (its ``forward``), so each call runs under the engine.

        What it returns carries the engine as ``offload_engine`` (the module, and the wrapped
        function), so the decorator form can read stats and close it::

            model = offload.engine(budget_mb=512)(model)
            ...
            print(model.offload_engine.stats)
            model.offload_engine.close()
        """
        if isinstance(fn, torch.nn.Module):
            module = fn
            refuse_foreign(self._regions.regions, module)  # none: nothing to refuse
            self._watch(module)
            attach(module, "forward", self(module.forward))  # See Note: [a copy carries no engine]
            attach(module, "offload_engine", self)
            return module
        if not callable(fn):
            raise TypeError(f"an offload engine decorates a function or an nn.Module, got {fn!r}")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        wrapper.offload_engine = self  # type: ignore[attr-defined]  # a function attribute
        return cast(_Decorated, wrapper)  # functools.wraps: it reads as fn, called as fn

    def __deepcopy__(self, memo: dict) -> "Engine":
        """Not copied: an engine owns threads, files and device memory, so a structure copied
        with it shares it. A copied *model* carries no engine at all (See Note: [a copy carries
        no engine] in ``offload._attach``)."""
        return self

    @property
    def plan(self) -> Optional[Plan]:
        """The plan in force for the latest step's input shapes (None before the first measured
        step's backward, or without regions). ``print(eng.plan)`` shows region, bytes, forward ms,
        transfer ms, decision, and the predicted overhead and peak. Its step times are read at the
        pace of the latest steps under plans (``Plan.pace``), so each read is a new ``Plan``;
        ``plan.regions`` is the same object for as long as the plan itself is."""
        return self._regions.plan

    @property
    def profiling(self) -> bool:
        """True while the regions are still being measured for the latest input shapes: the next
        step will be a profiling step (see ``offload._regions.regions``), not one that follows a final
        plan. Benchmarks warm up until this is False. Always False without regions or with a
        policy that measures nothing ("none", "recompute")."""
        return self._regions.profiling()

    @property
    def recent_stages(self) -> tuple:
        """A debug view: the profiling stage of each recent step ("measure", "recompute",
        "offload"), oldest first; None for a step that followed a final plan."""
        return tuple(self._regions.recent_stages)

    @property
    def profiled_steps(self) -> tuple:
        """A debug view: what each recent profiling step measured, oldest first
        (``offload._regions.regions.ProfiledStep``: stage, input signature, region profiles, span)."""
        return tuple(self._regions.profiled)

    @property
    def regions(self) -> tuple:
        """The regions as (qualified name, module) pairs (empty without regions), in order."""
        return tuple(self._regions.regions)

    @property
    def plans(self) -> dict:
        """The plans held, keyed by the first region's input signature: the latest ``MAX_PLANS``
        per input family (``offload._plan.profiler``), measured or derived from a fit, each read at
        the pace of the latest steps under plans (``Plan.pace``)."""
        return dict(self._regions.plans)

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
        """Start a new count (e.g. per step); what the engine holds now (resident bytes, ...) stays.
        At budget None (no regions) the next step is counted, with the hooks on (See Note: [no hooks
        where nothing moves] in ``offload._memory.session``)."""
        self._session.counters.reset()
        self._session.count_next_step()
        store = self._session.store
        if store is not None:
            store.reset_peak()
            self._link_base = store.gauges()

    def count_next_step(self) -> None:
        """At budget None without regions, run the next step with the hooks on, so its saves are
        counted, without zeroing the counts as ``reset_stats()`` does (an oracle of bytes saved per
        step calls it before each). Elsewhere every step is counted already. See Note: [no hooks
        where nothing moves] in ``offload._memory.session``."""
        self._session.count_next_step()

    def close(self) -> None:
        """Finish copies in flight, free host buffers and remove the spill file. Idempotent."""
        if self._session.store is not None:
            self._session.store.close()
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
            # Measured once, then cached on disk. Read once per engine too, spare cores included:
            # a torch.set_num_threads after the first step is not seen (make a new engine).
            self._machine = probe(self._session.eligible.device)
        return self._machine


def _checkpointing_note(models: list[torch.nn.Module]) -> str:
    """What to do where a watched Hugging Face model runs its own activation checkpointing ("" where
    none does). Read from the property transformers documents, ``is_activation_checkpointing``
    (``is_gradient_checkpointing`` before it was renamed), never from the layers' attributes."""
    for model in models:
        for documented in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            if isinstance(getattr(type(model), documented, None), property):
                if getattr(model, documented):
                    return (
                        f"{type(model).__name__} runs its own activation checkpointing "
                        f"(model.{documented} is True, from model.gradient_checkpointing_enable() or the Trainer's "
                        "gradient_checkpointing=True), so the engine's regions see only their inputs (about nothing "
                        "saved a layer) and plan nothing worth planning. Turn it off "
                        "(model.gradient_checkpointing_disable(), gradient_checkpointing=False) and let the "
                        "engine's policy recompute what it should (policy='auto' or 'recompute'), or keep it and "
                        "drop the engine (or its regions=: the engine alone then moves what lies between the layers)"
                    )
                break  # the newer name answered: the deprecated alias would say the same
    return ""


def _no_plan_note(eng: Engine) -> str:
    """What an engine without a plan does with each save, and what it did so far."""
    config, stats = eng.config, eng.stats
    if config.reserve_bytes is not None:
        budget = f"free device memory less a reserve of {config.reserve_bytes / MB:g} MB"
    elif stats.budget_bytes is None:
        budget = "no budget (it only counts)"
    else:
        budget = f"a budget of {stats.budget_bytes / MB:g} MB"
    so_far = (
        f"so far: {stats.saved_tensors} tensors ({stats.saved_bytes / MB:.1f} MB) taken, "
        f"{stats.offloaded_bytes / MB:.1f} MB moved off the device, "
        f"at most {stats.peak_resident_bytes / MB:.1f} MB held there"
    )
    if not eng._regions.present and eng._only_counts:
        return (
            f"no plan: this engine has no budget and no regions=, so nothing it takes ever moves. It counts the first "
            f"step after it was made or after reset_stats() with its saved-tensor hooks on (every save of at least "
            f"{config.min_offload_bytes} bytes); later steps run with no hooks at all, autograd saving natively (See "
            f"Note: [no hooks where nothing moves] in offload._memory.session); uncounted steps since (run with no "
            f"hooks): {stats.uncounted_steps}; {so_far} in counted steps. Pass budget_mb= to keep saves under a "
            "budget, or regions= (regions='auto' with model=, or regions=model.blocks) to have each block kept, moved "
            "or recomputed by its measured cost"
        )
    if not eng._regions.present:
        return (
            f"no plan: this engine has no regions=, so it decides per saved tensor, not per block. Every save of at "
            f"least {config.min_offload_bytes} bytes goes to its store, which keeps the newest on the device under "
            f"{budget} and moves the oldest beyond it (prefetching them back in backward); {so_far}. Pass regions= "
            "(regions='auto' with model=, or regions=model.blocks) to have each block kept, moved or recomputed by "
            "its measured cost"
        )
    policy = get_policy(config.policy)
    if not policy.measures:
        what = {Decision.RECOMPUTE: "recomputed in backward", Decision.KEEP: "kept as it runs"}.get(
            policy.unplanned, f"run as {policy.unplanned.value}"
        )
        return (
            f"no plan: policy {config.policy!r} measures nothing; every one of the {len(eng._regions.regions)} regions "
            f"is {what}, and the store holds the rest under {budget}; {so_far}"
        )
    return (
        f"no plan yet: the regions are planned after their first profiling step (policy {config.policy!r}); until "
        f"then the store holds every save under {budget}; {so_far}"
    )


def _datasheet_note(source: str) -> str:
    """What ``explain`` says of a named machine's figures: datasheet, not measured here."""
    return (
        f"planned on a named machine's datasheet figures, not measured on this one ({source}); "
        "drop machine= to measure this machine (offload.probe())"
    )


def _held_note(stats: Stats) -> str:
    """What re-run regions held beside the store, measured ("" where none ran)."""
    if stats.peak_region_bytes == 0:
        return ""
    budget = "no budget" if stats.budget_bytes is None else f"budget {stats.budget_bytes / MB:.1f} MB"
    return (
        f"measured: the store held at most {stats.peak_resident_bytes / MB:.1f} MB ({budget}); with what recomputed "
        f"and selective regions held themselves while they ran (their saves during their forward, their re-run's "
        f"values in backward; the largest {stats.peak_region_bytes / MB:.1f} MB), {stats.peak_held_bytes / MB:.1f} MB"
    )


def explain(what: Union[Engine, Plan, None]) -> str:
    """The plan table of an engine (its latest plan) or of a ``Plan``, as text."""
    plan = what.plan if isinstance(what, Engine) else what
    small = f"\n{what._all_small_note()}" if isinstance(what, Engine) and what._last_step.all_small() else ""
    regions = what._regions if isinstance(what, Engine) and isinstance(what._regions, Regions) else None
    found = f"\nregions: {regions.why}" if regions is not None else ""
    checkpointing = _checkpointing_note(what._models) if regions is not None and isinstance(what, Engine) else ""
    found += f"\nnote: {checkpointing}" if checkpointing else ""
    if plan is None:
        if isinstance(what, Engine):
            return _no_plan_note(what) + small + found
        return "no plan: explain() of None (an engine's plan before it made one)"
    if not isinstance(plan, Plan):
        raise TypeError(f"explain() takes an offload Engine or Plan, got {type(what).__name__}")
    text = str(plan) + small
    if isinstance(what, Engine) and isinstance(what._regions, Regions):
        uncertain = what._regions.pace_uncertainty()
        if uncertain:
            text = f"{text}\n{uncertain}"
        text = (
            f"{text}{found}\ntransfers priced at: {what._regions.link_note()}\nstep times: {what._regions.pace_note()}"
        )
        if what._datasheet:
            text = f"{text}\nmachine: {_datasheet_note(what._datasheet)}"
        held = _held_note(what.stats)
        if held:
            text = f"{text}\n{held}"
    if isinstance(what, Engine) and what.profiling:
        return (
            f"{text}\n(provisional: these input shapes are still being profiled; "
            "Engine.profiling turns False once the plan is final)"
        )
    return text
