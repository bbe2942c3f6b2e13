"""Regions: wrap each one's forward, and carry out what the profiler says each step is.

Owns the per-region side of the engine: wrapping the region modules' call, measuring them on
profiling steps (``measurement``), and carrying each region's decision out on steps under a plan.
What a step is (a profiling stage, or a plan for its inputs, measured or derived from other
shapes) is the profiler's (``_plan.profiler``), asked at a step's first region call, the first
after ``with eng:`` (See Note: [region calls]; a region may run any number of times in a step)::

    region call ─▶ the step before it ended: a step under a derived plan hands the profiler what
                     its regions saved (its check); a measured one, its time outside the regions
                  ─▶ profiler.begin(inputs) ─▶ a profiling stage: every region measured
                                                 "measure"    run as is
                                                 "recompute"  recomputed, counting what it saves
                                                 "offload"    each save copied out at once
                                             ─▶ a plan: region i ─▶ KEEP: run as is
                            ─▶ OFFLOAD: run; each save starts its copy out at once
                            ─▶ RECOMPUTE: offload.checkpoint(region): only inputs saved
                            ─▶ SELECTIVE: inputs and expensive outputs saved, cheap ops re-run
                            ─▶ SELECTIVE_OFFLOAD: the same, each of those saves starting its copy out at once
    a backward through a call ends ─▶ a profiling step's measurements go to profiler.finish: a plan

Every profiling stage stays within the budget: "measure" holds it per tensor, "recompute"
keeps only the regions' inputs (themselves under the budget) and "offload" moves everything.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional, Union

import torch

from .._attach import attach, detach
from .._cost import Saved
from .._errors import OffloadError
from .._memory.session import Session
from .._memory.sharded import Sharding, declaring
from .._plan.cache import PlanCache
from .._plan.planner import Decision, Plan
from .._plan.policy import Policy, get_policy
from .._plan.profiler import Measured, Origin, Planning, Profiler, ShapePlan, Stage
from .blocks import Found, find_blocks
from .measurement import Measurement, family_of, finish_after_backward, merged_profile, span_ms
from .module_state import RegionState
from .selective import COMPILED_CALL, is_compiled, profiled_checkpoint, selective_checkpoint
from .steps import AnyStep, PlannedStep, ProfilingStep, Seen, StepPhase, UnplannedStep, begin_step

__all__ = [
    "AUTO",
    "CACHE_ARGUMENTS",
    "NoRegions",
    "ProfiledStep",
    "Regions",
    "RegionsArg",
    "refuse_foreign",
    "resolve_regions",
    "without_cache",
]

COMPILED_NOTE = "compiled (torch.compile): one autograd Function that cannot be split; recomputed whole instead"
"""The note ``explain()`` shows for a compiled region a selective plan recomputes whole."""

_RECENT_STEPS = 64
"""Steps whose stage ``Regions.recent_stages`` remembers (for tests and debugging)."""

AUTO = "auto"
"""``regions="auto"``: the model's repeated blocks, found by ``blocks.find_blocks``."""

RegionsArg = Union[str, Iterable[torch.nn.Module], Callable[[torch.nn.Module, str], bool]]
"""What ``offload.engine(regions=...)`` takes: ``"auto"``, modules (``model.blocks``) or a
``(module, name) -> bool`` filter."""


def resolve_regions(regions: RegionsArg, model: Optional[torch.nn.Module]) -> Found:
    """The regions, as (qualified name, module) pairs, and why these: from ``"auto"``, an iterable
    of modules, or a ``(module, name) -> bool`` filter."""
    if isinstance(regions, str):
        if regions != AUTO:
            raise ValueError(
                f"regions={regions!r}: the one name regions= takes is 'auto' (the model's repeated blocks); "
                "otherwise pass modules (regions=model.blocks) or a filter (module, name) -> bool"
            )
        if model is None:
            raise ValueError("regions='auto' needs the model to search: pass model= (or decorate the model)")
        return find_blocks(model)
    if callable(regions) and not isinstance(regions, torch.nn.Module):
        if model is None:
            raise ValueError("regions= given as a filter (module, name) -> bool needs model= to search; pass model=")
        found = [(name, m) for name, m in model.named_modules() if name and regions(m, name)]
        why = f"the {len(found)} modules the regions= filter chose"
    else:
        if isinstance(regions, torch.nn.Module) and not isinstance(regions, (torch.nn.ModuleList, torch.nn.Sequential)):
            raise TypeError(
                f"regions= takes 'auto', an iterable of nn.Modules (e.g. model.blocks) or a filter function, got one "
                f"{type(regions).__name__}; pass regions=[module] for a single region"
            )
        names = {id(m): name for name, m in model.named_modules()} if model is not None else {}
        found = []
        for i, m in enumerate(regions):
            if not isinstance(m, torch.nn.Module):
                raise TypeError(
                    f"regions= item {i} is {type(m).__name__} ({m!r:.40}), not an nn.Module; pass modules, "
                    "e.g. regions=model.blocks or regions=[model.blocks[i] for i in (0, 2)]"
                )
            found.append((names.get(id(m), f"region{i}"), m))
        why = f"the {len(found)} modules passed as regions="
    if not found:
        raise ValueError("regions= selected no module; pass e.g. regions=model.blocks, or regions='auto' with model=")
    if len({id(m) for _, m in found}) != len(found):
        raise ValueError("regions= lists the same module twice; each region must be a distinct module")
    _refuse_nesting(found)
    if model is not None:
        refuse_foreign(found, model)
    return Found(found, why)


def _refuse_nesting(found: list[tuple[str, torch.nn.Module]]) -> None:
    """A region inside another would be recomputed or moved twice: refused, as a duplicate is."""
    outer_of: dict[int, str] = {}  # id of a module inside a region -> that region's name
    for name, m in found:
        for inner in m.modules():
            if inner is not m:
                outer_of.setdefault(id(inner), name)
    for name, m in found:
        outer = outer_of.get(id(m))
        if outer is not None:
            raise ValueError(
                f"regions= nests region {name!r} inside region {outer!r}; a region is kept, moved or re-run as a "
                f"whole, so one inside another would be handled twice. Pass only the outer ones (e.g. "
                f"regions=model.blocks) or only the inner ones"
            )


def refuse_foreign(found: Sequence[tuple[str, torch.nn.Module]], model: torch.nn.Module) -> None:
    """Regions given as modules must be ``model``'s own: a copy's blocks, say, would never run."""
    own = {id(m) for m in model.modules()}
    foreign = [(i, name, m) for i, (name, m) in enumerate(found) if id(m) not in own]
    if foreign:
        i, name, m = foreign[0]
        raise ValueError(
            f"regions= item {i} ({name}, a {type(m).__name__}) is not a submodule of the model "
            f"({type(model).__name__}), so it would never run under this engine; {len(foreign)} of "
            f"{len(found)} regions are another model's (a copy made with copy.deepcopy has its own blocks). "
            "Pass the regions of the model you run, e.g. regions=model.blocks with model=model"
        )


def _signature(args: tuple, kwargs: dict) -> tuple:
    return tuple(
        (tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else type(a).__name__
        for a in list(args) + list(kwargs.values())
    )


def _input_bytes(args: tuple, kwargs: dict) -> int:
    return sum(a.untyped_storage().nbytes() for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))


def _cuda_device(args: tuple, kwargs: dict) -> Optional[torch.device]:
    return next(
        (a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor) and a.is_cuda), None
    )


_RERUNS = (Decision.RECOMPUTE, Decision.SELECTIVE, Decision.SELECTIVE_OFFLOAD)
"""Decisions whose region is re-run in backward."""

# Note: [a re-run region takes no cache]
#     A region that is re-run in backward must see, the second time, what it saw the first. A
#     cache object passed to it (a KV cache, T5's encoder-decoder cache) is filled by the first
#     run, so the re-run reads the cross-attention keys it stored instead of computing them: it
#     saves fewer tensors than the forward did (T5's decoder blocks: 52 against 56) and the
#     recompute raises. Hugging Face's own checkpointed layers (``GradientCheckpointingLayer``)
#     meet the same problem by running such a layer with ``use_cache=False`` and its cache
#     arguments set to None, unless the layer declares ``_can_checkpoint_with_cache`` (it only
#     reads the cache); a re-run region here does the same, for its forward and its re-run alike.
#     In training the outputs are those with the cache: a block computes the same keys and
#     values either way.
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""Keyword arguments that carry a cache object, by the names Hugging Face's layers use."""


def without_cache(module: torch.nn.Module, kwargs: dict) -> dict:
    """``kwargs`` for a region that will be re-run: See Note: [a re-run region takes no cache]."""
    if not kwargs:
        return kwargs
    changed = dict(kwargs)
    if changed.get("use_cache"):
        changed["use_cache"] = False
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for name in CACHE_ARGUMENTS:
            if changed.get(name) is not None:
                changed[name] = None
    return changed


_SIZES_SEEN = (Decision.KEEP, Decision.OFFLOAD)
"""Decisions under which a region's every save goes through the store, so a step sees its sizes."""


class NoRegions:
    """An engine without ``regions=``: the null object of ``Regions``, so the engine asks one
    kind of object and never whether it has one. Nothing is wrapped, profiled or planned."""

    present = False
    """Whether the engine has regions (False here)."""
    regions: tuple = ()
    recent_stages: tuple = ()
    profiled: tuple = ()
    calls = 0
    plan: Optional[Plan] = None

    @property
    def plans(self) -> dict[tuple, Plan]:
        return {}

    def profiling(self) -> bool:
        return False

    def rewrap_compiled(self) -> None:
        pass

    def restore(self) -> None:
        pass

    def refuse_another_thread(self) -> None:
        pass  # an engine without regions serves several threads at once

    def forward_raised(self) -> None:
        pass


class Regions:
    """The regions of one engine: wrapped forwards, a step record, and the profiler."""

    present = True
    """Whether the engine has regions (``NoRegions`` says False)."""

    def __init__(
        self,
        found: Found,
        policy: str,
        session: Session,
        plan_cache: Optional[PlanCache] = None,
        shared_inputs: Optional[Sharding] = None,
        machine_given: bool = False,
    ) -> None:
        self.regions = found.regions
        self._shared_inputs = shared_inputs
        """Declares the inputs of regions run as recompute shared by a process group (``offload._memory.sharded``)."""
        self.why = found.why
        """How the regions were chosen (``explain()`` prints it)."""
        self.policy = policy
        self._policy: Policy = get_policy(policy)
        """What the policy needs (``Policy.measures``, ``plans_per_rank``, ...), asked instead of its name."""
        self._session = session
        self._profiler = Profiler(
            self.regions, policy, Planning(session.budget_in_force, session.machine, plan_cache, machine_given)
        )
        self.recent_stages: collections.deque = collections.deque(maxlen=_RECENT_STEPS)
        """The profiling stage of each recent step, oldest first; None: the step followed a plan."""
        self.profiled: collections.deque = collections.deque(maxlen=_RECENT_STEPS)
        """What each recent profiling step measured (``ProfiledStep``), oldest first."""
        self._step: Optional[AnyStep] = None  # the latest step begun (None before the first)
        self.calls = 0
        """Region forwards run under the engine so far (the engine warns when a step ran none)."""
        self._states = {name: RegionState((module,), name) for name, module in self.regions}
        """Each region's modules' state across its re-runs, by name: See Note: [a re-run leaves module
        state as the forward left it] (``module_state``)."""
        self._wrapped: list[_Wrapped] = []
        for index, (name, module) in enumerate(self.regions):
            self._install(index, name, module)

    # ------------------------------------------------------------------ what the engine reads

    @property
    def plan(self) -> Optional[Plan]:
        """The plan for the latest step's inputs (None before one exists)."""
        if self._step is None:
            return None
        plan = self._profiler.plan_for(self._step.key)
        entry = self._step.plan_entry()
        if plan is None and entry is not None:
            plan = self._profiler.paced(entry.plan)  # a trial's provisional plan, derived
        return plan

    @property
    def plans(self) -> dict[tuple, Plan]:
        return self._profiler.plans()

    def link_note(self) -> str:
        """How transfers are priced (the probe's figures, or as the offload trials calibrated them)."""
        return self._profiler.link_note()

    def pace_note(self) -> str:
        """At what pace plans read their step times (``_plan.pace``), in words."""
        return self._profiler.pace_note()

    def pace_uncertainty(self) -> str:
        """ "" where steps under plans agree with each other, else a note saying how far apart they were."""
        return self._profiler.pace_uncertainty()

    def profiling(self) -> bool:
        """True while the latest inputs still have profiling steps to run (or none ran yet)."""
        step = self._step
        awaiting = isinstance(step, ProfilingStep) and step.phase is StepPhase.AWAITING_BACKWARD
        if awaiting and self._policy.measures:
            return True
        return self._profiler.profiling(None if step is None else step.key)

    # ------------------------------------------------------------------ wrapping

    def _install(self, index: int, name: str, module: torch.nn.Module) -> None:
        """Wrap the region's call (See Note: [a block compiled in place])."""
        attr = COMPILED_CALL if getattr(module, COMPILED_CALL, None) is not None else "forward"
        wrapper = self._wrap(index, name, module, getattr(module, attr))
        previous = attach(module, attr, wrapper)  # See Note: [a copy carries no engine]
        self._wrapped.append(_Wrapped(module, index, name, attr, previous))

    def rewrap_compiled(self) -> None:
        """Re-wrap the regions compiled in place since the engine wrapped them (at ``with eng:``)."""
        for w in list(self._wrapped):
            if w.attr == "forward" and getattr(w.module, COMPILED_CALL, None) is not None:
                w.put_back()
                self._wrapped.remove(w)
                self._install(w.index, w.name, w.module)

    def restore(self) -> None:
        """Put the modules' own forwards back."""
        for w in self._wrapped:
            w.put_back()
        self._wrapped = []

    # Note: [a region is a graph break]
    #     A region's wrapper decides at run time, step by step (profile, keep, move, re-run), and keeps
    #     a record of the step; none of that can be a graph. In a model compiled whole
    #     (``torch.compile(model)``, ``model.compile()``) Dynamo traced into the wrapper, the engine's
    #     clocks and the probe's ``time.strftime`` included, and failed. So the wrapper is
    #     ``torch.compiler.disable``d: Dynamo breaks the graph at each region and calls it as Python.
    #     The region's own module then runs eagerly (a break inside ``for block in self.blocks`` makes
    #     Dynamo run that whole forward eagerly, compiling the modules it calls one by one), unless it
    #     is compiled itself: a compiled block called from the wrapper still runs its compiled code.
    #     Hence the docs' advice to compile the blocks. The hooks' side: See Note: [Dynamo never
    #     traces the hooks].
    def _wrap(self, index: int, name: str, module: torch.nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        def region_forward(*args: Any, **kwargs: Any) -> Any:
            if not (self._session.active() and torch.is_grad_enabled()):
                return forward(*args, **kwargs)
            if self._policy.plans_per_rank:
                with self._session.planned_per_rank():
                    return region_step(*args, **kwargs)
            return region_step(*args, **kwargs)

        def region_step(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self._begins_step(index):
                self._begin_step(args, kwargs)
            step = self._step
            assert step is not None  # _begins_step is True while there is none
            step.region_starts(self._session.saved())
            if isinstance(step, ProfilingStep) and step.phase is not StepPhase.MEASURED:
                out = self._measure(step, index, name, module, forward, args, kwargs)
            elif isinstance(step, ProfilingStep):  # a call after its backward was measured: See Note: [region calls]
                out = self._run(self._decision(index), forward, args, kwargs, name, module)
            else:
                out = self._planned(step, index, name, module, forward, args, kwargs)
            step.region_ends(self._session.saved())
            step.moved_in_forward = self._session.moved_bytes() - step.moved_at_start
            if index == len(self.regions) - 1 and step.sends_the_rest_eagerly():
                self._session.eagerly_to_end()  # the head's and the loss's saves leave as they are made
            return out

        region_forward = torch.compiler.disable(region_forward)  # See Note: [a region is a graph break]
        region_forward.__wrapped__ = forward  # type: ignore[attr-defined]  # functions take attributes; Callable does not say so
        return region_forward

    # Note: [one forward at a time]
    #     A step of the regions is one record (``steps``): the profiler's stage, the measurements,
    #     what the step saw. Two threads running forwards through one engine's regions at once
    #     would write into one record (a profiling step then holds 13 measurements for 14 regions,
    #     or a negative size outside the regions). So an engine with regions lets one thread in at
    #     a time (``Engine.__enter__`` checks and enters under one lock: ``refuse_another_thread``).
    #     Forwards from several threads one after another are fine. A profiling step awaits its
    #     backward after its thread left the engine; when another thread's step begins before
    #     that backward ended, the profiling step is not planned from (its backward was not
    #     measured alone): its stage runs again (``_abandon``), and its backward's callback, bound to
    #     it, finds it superseded. An engine without regions serves several threads at once.
    def refuse_another_thread(self) -> None:
        """Raise ``OffloadError`` where a thread other than this one is inside the engine."""
        me = threading.get_ident()
        others = self._session.others_inside(me)
        if others:
            raise OffloadError(
                f"offload: thread {me} entered an engine with regions= while thread {others[0]} is inside it; an "
                f"engine with regions runs one forward at a time (its profiling and plans follow one sequence of "
                f"steps). Make one engine per thread (offload.engine(...) in each), or leave regions= out: an "
                f"engine without regions serves several threads at once"
            )

    def _planned(
        self,
        step: Union[PlannedStep, UnplannedStep],
        index: int,
        name: str,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        args: tuple,
        kwargs: dict,
    ) -> Any:
        """A region on a step under a plan: its decision, and what the step sees of it."""
        decision = self._decision(index)
        if isinstance(step, UnplannedStep):
            return self._run(decision, forward, args, kwargs, name, module)
        saved_before = self._session.saved()
        out = self._run(decision, forward, args, kwargs, name, module)
        sizes = self._session.saved() - saved_before
        # Each call of the region adds to one record: See Note: [region calls]
        step.seen.setdefault(index, Seen(Saved())).add(sizes if decision in _SIZES_SEEN else None)
        return out

    def _run(
        self,
        decision: Decision,
        forward: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        name: str,
        module: torch.nn.Module,
    ) -> Any:
        """Carry one region's decision out."""
        if decision in _RERUNS:
            kwargs = without_cache(module, kwargs)
        if decision is Decision.RECOMPUTE:
            if self._shared_inputs is not None:  # a plain recompute keeps only its inputs: they are what is declared
                with declaring(self._shared_inputs.at(name)):
                    return self._recompute(forward, args, kwargs, name, selective=False)
            return self._recompute(forward, args, kwargs, name, selective=False)
        if decision is Decision.SELECTIVE:
            return self._recompute(forward, args, kwargs, name, selective=not is_compiled(module))
        if decision is Decision.SELECTIVE_OFFLOAD:
            with self._session.eagerly():
                return self._recompute(forward, args, kwargs, name, selective=not is_compiled(module))
        if decision is Decision.OFFLOAD:
            with self._session.eagerly():
                return forward(*args, **kwargs)
        return forward(*args, **kwargs)

    def _recompute(self, forward: Callable[..., Any], args: tuple, kwargs: dict, name: str, *, selective: bool) -> Any:
        """Run a region as a (selective) recompute and count what it dropped."""
        on_recompute = self._session.observers.recompute_timer(name)  # a traced step times it
        out, run = selective_checkpoint(
            forward,
            args,
            kwargs,
            name,
            selective=selective,
            on_recompute=on_recompute,
            state=self._states[name],
            on_held=self._session.region_held,
        )
        self._session.count_recompute(run.dropped_bytes)
        return out

    def _decision(self, index: int) -> Decision:
        entry = None if self._step is None else self._step.plan_entry()
        if entry is not None:
            return entry.plan.regions[index].decision
        return self._policy.unplanned

    # ------------------------------------------------------------------ step boundaries

    # Note: [region calls]
    #     A step does not run each region exactly once, in order: a block is called twice (shared
    #     or tied weights, a block reused), a step runs a subset (one engine over a GAN's two
    #     networks, whose discriminator step runs the discriminator alone; a block skipped by
    #     control flow, an early exit), or a region runs a varying number of times (a recurrent
    #     block). So a step is not "region 0 to the last region": it begins at the first region
    #     call after the engine was entered (its outermost ``with eng:``, a new ``ForwardMarks``),
    #     and every region call until the next such entry is part of it. Each call is measured
    #     and run on its own (a re-run region re-runs per call), and a region's profile is the sum
    #     of its calls' (``measurement.merged_profile``): a region called twice saves and costs
    #     twice, one that did not run is a zero row, and the plan's one decision for a region
    #     applies to each of its calls. What this gives up: the planner's timeline places a
    #     region's calls at its index, not where they ran. A profiling step's figures go to the
    #     profiler when the first backward through one of its calls' outputs ends; a call after
    #     that (a forward that runs its own backward, as a gradient penalty does) runs the
    #     step's decision unmeasured. One ``with eng:`` around several forwards and backwards
    #     still begins a step at region 0 once the previous step's backward was measured; so a
    #     forward whose own backward ran through its regions begins a new step where it calls the
    #     first region again.
    def _begins_step(self, index: int) -> bool:
        """Whether this call of region ``index`` begins a step: See Note: [region calls]."""
        step = self._step
        if step is None or step.marks is not self._session.marks:
            return True
        return index == 0 and isinstance(step, ProfilingStep) and step.phase is StepPhase.MEASURED

    def forward_raised(self) -> None:
        """The engine was left with an exception: a profiling step still measuring is not planned
        from (its stage runs again), as one whose backward another thread overtook."""
        step = self._step
        if isinstance(step, ProfilingStep) and step.phase is not StepPhase.MEASURED:
            self._abandon(step)

    def _begin_step(self, args: tuple, kwargs: dict) -> None:
        now = time.perf_counter()
        last = self._step
        if (
            isinstance(last, ProfilingStep)
            and last.phase is StepPhase.AWAITING_BACKWARD
            and last.thread != threading.get_ident()
        ):
            self._abandon(last)  # See Note: [one forward at a time]
        else:
            self.finish_measured_step()  # a measured step whose backward never ran (or ran without its callback)
        if last is not None:
            self._end_step(last, now)
        key = _signature(args, kwargs)
        stage, entry = self._profiler.begin(key)
        step = begin_step(
            stage,
            entry,
            key=key,
            thread=threading.get_ident(),
            start=now,
            moved_at_start=self._session.moved_bytes(),
            marks=self._session.marks,
        )
        self._step = step
        self.recent_stages.append(None if stage is None else stage.value)
        # A plan in force already keeps its regions within the budget, so the store need not
        # start evicting early (its in-flight window); while measuring, it must, unless the
        # provisional plan keeps everything: then the window would only spill what fits, and
        # slow the very step that measures the times the final plan predicts with.
        plan = None if entry is None else entry.plan
        keeps_all = plan is not None and plan.fits_budget and all(d is Decision.KEEP for d in plan.decisions)
        self._session.set_planned(plan is not None and (stage is None or (stage is Stage.MEASURE and keeps_all)))
        if isinstance(step, PlannedStep) and self._keeps_everything(step.entry):
            self._session.unhook_rest_of_step()  # See Note: [a step kept whole runs unhooked]
        if stage is not None:
            self._session.machine()  # measured (or read from the cache) now, not inside backward

    def _keeps_everything(self, entry: ShapePlan) -> bool:
        """Whether a step under ``entry`` moves nothing and needs nothing counted: a plan measured at
        these inputs (not derived: a derived plan is checked against what its steps save), within a
        fixed budget (not one following free memory), keeping every region and every save around
        them. See Note: [a step kept whole runs unhooked] in ``offload._memory.session``."""
        plan = entry.plan
        return (
            entry.origin is Origin.MEASURED
            and plan.fits_budget
            and not self._session.config.follows_free_memory
            and all(r.decision is Decision.KEEP for r in (*plan.regions, *plan.outside))
        )

    # Note: [a step's span]
    #     A step is timed from its first region's forward to the next step's first region (``now``):
    #     the embedding, head, loss, backward, optimizer and the loop's own work included, so a
    #     "step" is one forward with its backward (a micro-batch, under gradient accumulation).
    #     ``other_ms`` (a profiling step's time outside its regions) and the pace of steps under
    #     plans (``_plan.pace``) are both read on this span, so they agree.
    def _end_step(self, step: AnyStep, now: float) -> None:
        """What the step before this one leaves for the profiler."""
        if isinstance(step, UnplannedStep):
            return
        if isinstance(step, PlannedStep):
            if len(step.seen) == len(self.regions):  # every region ran
                self._profiler.step_timed(step.entry, (now - step.start) * 1e3)
            if step.seen:
                before, after = step.outside(self._session.saved())
                sizes = [None if i not in step.seen else step.seen[i].sizes for i in range(len(self.regions))]
                self._profiler.observe(step.key, [before, *sizes, after])
            return
        if step.regions_ms is None:
            # Nothing it measured went to the profiler (its forward raised, or another thread's
            # step overtook it): run that stage again rather than plan from half a measurement.
            self._profiler.rerun(step.key, step.stage)
        elif (
            step.regions_ms is not None and step.stage is not Stage.OFFLOAD_TRIAL
        ):  # moving everything slows the rest too
            # See Note: [a step's span]
            self._profiler.other_ms(step.key, max(0.0, (now - step.start) * 1e3 - step.regions_ms))

    def _abandon(self, step: ProfilingStep) -> None:
        """A profiling step another thread's step overtook before its backward ended: its stage
        runs again rather than plan from a backward not measured alone."""
        step.phase = StepPhase.MEASURED
        for m in step.measurements:
            m.remove_hooks()
        step.measurements = []  # as a step that never reached its last region: _end_step runs its stage again

    def finish_measured_step(self, step: Optional[ProfilingStep] = None) -> None:
        """Plan from the last profiling step (``step``, where its backward's callback names it): at
        the end of its backward (a callback queued on the autograd engine), or when the next step
        begins if that backward never ran. A step no longer the latest was overtaken: nothing."""
        if step is None and isinstance(self._step, ProfilingStep):
            step = self._step
        if step is None or step is not self._step or step.phase is not StepPhase.AWAITING_BACKWARD:
            return
        step.phase = StepPhase.MEASURED
        for m in step.measurements:
            m.remove_hooks()
        step.regions_ms = sum(m.forward_ms + m.raw_backward_ms() for m in step.measurements)
        span = span_ms(step.measurements)
        if span is not None and step.stage is Stage.RECOMPUTE_TRIAL:
            span -= sum(
                m.profiling_ms() for m in step.measurements
            )  # less the re-runs that only measured selective costs
        before, after = step.outside_profiles(self._session.saved())
        calls: list[list[Measurement]] = [[] for _ in self.regions]
        for m in step.measurements:
            calls[m.index].append(m)
        regions = (merged_profile(name, of) for (name, _), of in zip(self.regions, calls, strict=True))
        profiles = (before, *regions, after)
        clean = step.moved_in_forward == 0
        measured = Measured(stage=step.stage, key=step.key, profiles=profiles, span_ms=span, clean=clean)
        entry = self._profiler.finish(measured)
        self.profiled.append(
            ProfiledStep(
                stage=step.stage.value,
                inputs=step.key,
                regions=entry.profiles[1:-1],
                outside=(entry.profiles[0], entry.profiles[-1]),
                span_ms=span,
            )
        )

    # ------------------------------------------------------------------ a profiling step

    def _measure(
        self,
        step: ProfilingStep,
        index: int,
        name: str,
        module: torch.nn.Module,
        forward: Callable[..., Any],
        args: tuple,
        kwargs: dict,
    ) -> Any:
        cuda = _cuda_device(args, kwargs)
        m = Measurement(name=name, index=index, input_bytes=_input_bytes(args, kwargs))
        if cuda is not None:
            torch.cuda.synchronize(cuda)
        saved_before = self._session.saved()
        self._session.take_largest_saved()  # from here: this region's
        step.largest = 0
        start = time.perf_counter()
        counted: Optional[Saved] = None
        if step.stage is Stage.RECOMPUTE_TRIAL:
            compiled = is_compiled(module)
            # See Note: [measurement families]: the family's first call measures its split, the rest reuse it.
            first = step.families.setdefault(family_of(module, _signature(args, kwargs), compiled), m)
            m.shares = None if first is m else first
            on_recompute = self._session.observers.recompute_timer(name, m.add_recompute)
            assert on_recompute is not None  # never None when given a callback of its own
            out, run = profiled_checkpoint(
                forward,
                args,
                without_cache(module, kwargs),
                name,
                split=not compiled and m.shares is None,
                on_recompute=on_recompute,
                on_selective=m.add_selective,
                count=functools.partial(step.count, self._session.eligible),
                state=self._states[name],
                on_held=self._session.region_held,
            )
            self._session.count_recompute(run.dropped_bytes)
            counted = Saved(run.counted_bytes, run.counted_tensors)  # the store saw only its inputs
            if compiled:
                m.note = COMPILED_NOTE
        elif step.stage is Stage.OFFLOAD_TRIAL:
            with self._session.eagerly():
                out = forward(*args, **kwargs)
        else:
            out = forward(*args, **kwargs)
        if cuda is not None:
            torch.cuda.synchronize(cuda)
        m.forward_start, m.forward_ms = start, (time.perf_counter() - start) * 1e3
        saved = self._session.saved() - saved_before if counted is None else counted
        m.saved_bytes, m.num_tensors = saved.nbytes, saved.tensors
        m.largest_tensor_bytes = self._session.take_largest_saved() if counted is None else step.largest
        m.time_backward(args, kwargs, out, cuda)
        step.measurements.append(m)
        step.phase = StepPhase.AWAITING_BACKWARD  # See Note: [region calls]
        finish_after_backward(out, functools.partial(self.finish_measured_step, step))  # once: it checks the phase
        return out


# Note: [a block compiled in place]
#     ``block.compile()`` (unlike ``torch.compile(block)``, which returns a wrapper module) sets the
#     module's ``_compiled_call_impl``: its ``__call__`` then runs a compiled ``_call_impl`` that
#     calls ``self.forward`` inside the traced graph. Wrapping ``forward`` there would put the
#     region's own machinery (checkpoint placeholders, timing) inside what Dynamo traces, and the
#     recompute would re-run the eager forward: a different set of saved tensors than the compiled
#     forward saved, and the engine's determinism check raised. So a block compiled in place is
#     wrapped around its compiled call instead: the region runs (and re-runs) the compiled code.
#     ``_compiled_call_impl`` (``selective.COMPILED_CALL``) is private to torch (2.2+); a module
#     without it is wrapped on forward.


@dataclasses.dataclass(frozen=True)
class _Wrapped:
    """One region's wrapped attribute and what the instance held before (``_attach``'s token)."""

    module: torch.nn.Module
    index: int
    name: str
    attr: str
    original: object

    def put_back(self) -> None:
        detach(self.module, self.attr, self.original)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfiledStep:
    """One profiling step: its stage, the input signature, the region profiles its plan was made
    from (a trial's times merged with the "measure" step's sizes), and the regions' span (first
    forward start to last backward end, ms; None where not timed)."""

    stage: str
    inputs: tuple
    regions: tuple
    span_ms: Optional[float]
    outside: tuple = ()
    """The profiles of what the step saved before or between the regions, and after the last."""
