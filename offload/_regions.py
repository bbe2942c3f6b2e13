"""Regions: measure each one, plan, then keep, offload, recompute or selectively recompute it.

Owns the per-region side of the engine: wrapping the region modules' ``forward``, profiling
steps (saved bytes, forward, backward and recompute time per region), asking the planner for a
decision per region, and carrying each decision out on later steps. Plans are keyed by the
shapes of the first region's inputs, so a new sequence length or batch size is profiled and
planned once, then reused.

Profiling, per new input signature (each stage is one training step, and plans after it)::

    "measure"    every region runs as is, the budget held tensor by tensor: saved bytes and
                 tensors per region, and first timings (the first step also pays warm-up costs)
        nothing has to move (or policy "offload") ─▶ "measure" once more ─▶ final plan
        policy "auto" and something has to move:
    "recompute"  every region recomputed: forward, backward and recompute times free of any
                 transfer (on a CPU the spill threads share the cores, and slowed the forward of
                 a "measure" step 1.5-4x), at the least memory any plan can use. The same step
                 measures what running it selectively would cost (``_selective.profiled_checkpoint``):
                 the bytes its cheap and its expensive ops save, and the re-run's time less its
                 expensive ops' time; a compiled region (one autograd Function) is not split, and noted
    "offload"    every region offloaded (when there is a link): the step time this costs over
                 the "recompute" step calibrates the probe's transfer costs (``calibrate_link``);
                 once per engine: later input signatures reuse the calibration
        ─▶ final plan from those numbers
        policy "selective": "measure", then "recompute" ─▶ final plan (every region SELECTIVE,
        or RECOMPUTE where it cannot be split)

    later steps:  region i ─▶ KEEP: run as is
                            ─▶ OFFLOAD: run; each save starts its copy out at once
                            ─▶ RECOMPUTE: offload.checkpoint(region): only inputs saved
                            ─▶ SELECTIVE: inputs and expensive outputs saved, cheap ops re-run
                            ─▶ SELECTIVE_OFFLOAD: the same, each of those saves starting its copy out at once

Every profiling stage stays within the budget: "measure" holds it per tensor, "recompute"
keeps only the regions' inputs (themselves under the budget) and "offload" moves everything.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

import torch

from ._budget import replan_needed
from ._cost import MachineProfile, RegionProfile
from ._planner import Decision, Plan, calibrate_link, link_usable, scale_link
from ._policy import make_plan
from ._selective import COMPILED_CALL, SelectiveProfile, is_compiled, profiled_checkpoint, selective_checkpoint
from ._session import Session

__all__ = ["ProfiledStep", "Regions", "resolve_regions"]

log = logging.getLogger(__name__)

_PROFILED_POLICIES = ("auto", "offload", "selective")
"""Policies whose decisions depend on measured sizes and times; "recompute" and "none" do not."""

PROFILE_STEPS = 2
""""measure" steps per new input signature when no trial follows. The first pays one-time costs
(allocator growth, lazy initialisation, kernel selection: 10x the steady forward time of the
first block was seen on the CPU), so its plan is provisional and the second step's replaces it."""

MEASURE, RECOMPUTE_TRIAL, OFFLOAD_TRIAL = "measure", "recompute", "offload"
"""Profiling stages (see the module docstring)."""

COMPILED_NOTE = "compiled (torch.compile): one autograd Function that cannot be split; recomputed whole instead"
"""The note ``explain()`` shows for a compiled region a selective plan recomputes whole."""

_RECENT_STEPS = 64
"""Steps whose stage ``Regions.recent_stages`` remembers (for tests and debugging)."""


RegionsArg = Union[Iterable[torch.nn.Module], Callable[[torch.nn.Module, str], bool]]
"""What ``offload.engine(regions=...)`` takes: modules (``model.blocks``) or a ``(module, name) -> bool`` filter."""


def resolve_regions(regions: RegionsArg, model: Optional[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) pairs from an iterable of modules or a ``(module, name) -> bool`` filter."""
    if callable(regions) and not isinstance(regions, torch.nn.Module):
        if model is None:
            raise ValueError("regions= given as a filter (module, name) -> bool needs model= to search; pass model=")
        found = [(name, m) for name, m in model.named_modules() if name and regions(m, name)]
    else:
        if isinstance(regions, torch.nn.Module) and not isinstance(regions, (torch.nn.ModuleList, torch.nn.Sequential)):
            raise TypeError(
                f"regions= takes an iterable of nn.Modules (e.g. model.blocks) or a filter function, got one "
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
    if not found:
        raise ValueError("regions= selected no module; pass e.g. regions=model.blocks")
    if len({id(m) for _, m in found}) != len(found):
        raise ValueError("regions= lists the same module twice; each region must be a distinct module")
    return found


def _signature(args: tuple, kwargs: dict) -> tuple:
    return tuple(
        (tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else type(a).__name__
        for a in list(args) + list(kwargs.values())
    )


def _input_bytes(args: tuple, kwargs: dict) -> int:
    return sum(a.untyped_storage().nbytes() for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))


class Regions:
    """The regions of one engine: wrapped forwards, profiles, plans per input signature."""

    def __init__(
        self, regions: list[tuple[str, torch.nn.Module]], policy: str, budget_bytes: Optional[int], session: Session
    ) -> None:
        self.regions = regions
        self.policy = policy
        self.budget_bytes = budget_bytes
        self._session = session
        self.plans: dict[tuple, Plan] = {}
        self.plan: Optional[Plan] = None
        self.recent_stages: collections.deque = collections.deque(maxlen=_RECENT_STEPS)
        """The profiling stage of each recent step, oldest first; None: the step followed a plan."""
        self.profiled: collections.deque = collections.deque(maxlen=_RECENT_STEPS)
        """What each recent profiling step measured (``ProfiledStep``), oldest first."""
        self._key: Optional[tuple] = None
        self._stage: Optional[str] = None
        self._profiles: Optional[list[_Measurement]] = None
        self._stages: dict[tuple, list[str]] = {}  # signature -> profiling stages still to run
        self._sizes: dict[tuple, list[RegionProfile]] = {}  # from its latest "measure" step
        self._timed: dict[tuple, tuple[list[RegionProfile], Optional[float]]] = {}  # "recompute" step
        self._link_scale: Optional[float] = None  # from the first "offload" trial, reused for new shapes
        self._pending: Optional[_Pending] = None  # measured, backward still to run
        self._step_start: Optional[float] = None
        self._last_step: Optional[tuple[float, float, str]] = (
            None  # (start, regions' ms, stage) of the last measured step
        )
        self._other_ms = 0.0
        self._wrapped: list[_Wrapped] = []
        for index, (name, module) in enumerate(regions):
            self._install(index, name, module)

    def _install(self, index: int, name: str, module: torch.nn.Module) -> None:
        """Wrap the region's call (See Note: [a block compiled in place])."""
        attr = COMPILED_CALL if getattr(module, COMPILED_CALL, None) is not None else "forward"
        self._wrapped.append(_Wrapped(module, index, name, attr, module.__dict__.get(attr)))
        setattr(module, attr, self._wrap(index, name, module, getattr(module, attr)))

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

    def _wrap(self, index: int, name: str, module: torch.nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        def region_forward(*args: Any, **kwargs: Any) -> Any:
            if not (self._session.active() and torch.is_grad_enabled()):
                return forward(*args, **kwargs)
            if index == 0:
                self._begin_step(args, kwargs)
            if self._profiles is not None:
                return self._measure(index, name, module, forward, args, kwargs)
            decision = self._decision(index)
            if decision is Decision.RECOMPUTE:
                return self._recompute(forward, args, kwargs, name, selective=False)
            if decision is Decision.SELECTIVE:
                return self._recompute(forward, args, kwargs, name, selective=not is_compiled(module))
            if decision is Decision.SELECTIVE_OFFLOAD:
                with self._session.eagerly():
                    return self._recompute(forward, args, kwargs, name, selective=not is_compiled(module))
            if decision is Decision.OFFLOAD:
                return self._eagerly(forward, args, kwargs)
            return forward(*args, **kwargs)

        region_forward.__wrapped__ = forward  # type: ignore[attr-defined]  # functions take attributes; Callable does not say so
        return region_forward

    def _recompute(self, forward: Callable[..., Any], args: tuple, kwargs: dict, name: str, *, selective: bool) -> Any:
        """Run a region as a (selective) recompute and count what it dropped."""
        on_recompute = self._session.observers.recompute_timer(name)  # a traced step times it
        out, run = selective_checkpoint(forward, args, kwargs, name, selective=selective, on_recompute=on_recompute)
        self._session.count_recompute(run.dropped_bytes)
        return out

    def _eagerly(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        with self._session.eagerly():
            return forward(*args, **kwargs)

    def _begin_step(self, args: tuple, kwargs: dict) -> None:
        now = time.perf_counter()
        self.finish_pending()  # a measured step whose backward never ran (or ran without its callback)
        if self._last_step is not None:
            # The last measured step ran from its first region to now (embedding, head, loss and
            # the optimizer included): what it cost outside the regions goes into later plans.
            start, regions_ms, last_stage = self._last_step
            self._last_step = None
            if last_stage != OFFLOAD_TRIAL:  # moving everything slows the rest too
                self._other_ms = max(0.0, (now - start) * 1e3 - regions_ms)
        if self._profiles is not None and self._key is not None:
            # The last profiling step never reached its last region (its forward raised, or
            # skipped regions): run that stage again rather than plan from half a measurement.
            assert self._stage is not None  # a profiling step has both: profiles and its stage
            self._stages.setdefault(self._key, []).insert(0, self._stage)
        self._step_start = now
        key = _signature(args, kwargs)
        if self._session.plan_cache is not None and self.policy in _PROFILED_POLICIES and key not in self._stages:
            self._adopt_cached(key)  # a previous run's final plan for these inputs: no profiling
        self.plan = self.plans.get(key)
        self._key = key
        stage: Optional[str] = None
        if self.policy in _PROFILED_POLICIES:
            stages = self._stages.setdefault(key, [MEASURE])
            if stages:
                stage = stages.pop(0)
        if (
            stage is None
            and self.plan is not None
            and replan_needed(self.plan.budget_bytes, self._session.budget_in_force())
        ):
            self.plan = self._replan(key)  # budget_mb="auto": free memory moved well away from the plan's budget
        self._stage = stage
        self._profiles = [] if stage is not None else None
        self.recent_stages.append(stage)
        # A plan in force already keeps its regions within the budget, so the store need not
        # start evicting early (its in-flight window); while measuring, it must, unless the
        # provisional plan keeps everything: then the window would only spill what fits, and
        # slow the very step that measures the times the final plan predicts with.
        plan = self.plan
        keeps_all = plan is not None and plan.fits_budget and all(d is Decision.KEEP for d in plan.decisions)
        self._session.set_planned(plan is not None and (stage is None or (stage == MEASURE and keeps_all)))
        if stage is not None:
            self._session.machine()  # measured (or read from the cache) now, not inside backward

    def finish_pending(self) -> None:
        """Plan from the last measured step: at the end of its backward (a callback queued on the
        autograd engine), or when the next step begins if that backward never ran."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        key, stage, measurements = pending.key, pending.stage, pending.measurements
        for m in measurements:
            m.remove_hooks()
        profiles = [m.profile() for m in measurements]
        if self._step_start is not None:
            self._last_step = (self._step_start, sum(m.forward_ms + m.raw_backward_ms() for m in measurements), stage)
        machine = self._session.machine()
        if self._link_scale is not None:
            machine = scale_link(machine, self._link_scale)
        span_ms = _span_ms(measurements)
        if stage == MEASURE:
            first = key not in self._sizes
            self._sizes[key] = profiles
            used = profiles
            plan = self._make_plan(profiles, machine)
            if first:
                moves = any(d is not Decision.KEEP for d in plan.decisions)
                if self.policy == "auto" and moves:
                    # The link's calibration is a property of the machine, not of the shapes:
                    # measured once, it serves every later input signature.
                    calibrate = link_usable(machine) and self._link_scale is None
                    self._stages[key] = [RECOMPUTE_TRIAL] + ([OFFLOAD_TRIAL] if calibrate else [])
                elif self.policy == "selective":
                    self._stages[key] = [RECOMPUTE_TRIAL]
                else:
                    self._stages[key] = [MEASURE] * (PROFILE_STEPS - 1)
        elif stage == RECOMPUTE_TRIAL:
            # The trial's times and selective figures, the "measure" step's sizes (a recomputed
            # region saves only its inputs): every new profile field follows the trial by default.
            timed = [
                dataclasses.replace(
                    p, saved_bytes=size.saved_bytes, num_tensors=size.num_tensors, input_bytes=size.input_bytes
                )
                for size, p in zip(self._sizes[key], profiles, strict=True)
            ]
            if span_ms is not None:  # less the re-runs that only measured selective costs
                span_ms -= sum(m.profiling_ms() for m in measurements)
            self._timed[key] = (timed, span_ms)
            used = timed
            plan = self._make_plan(timed, machine)
        else:
            timed, recompute_span_ms = self._timed.get(key, (self._sizes[key], None))
            if span_ms is not None and recompute_span_ms is not None:
                # The "recompute" step less its recomputes is a step that keeps everything.
                keep_span_ms = recompute_span_ms - sum(r.recompute_ms for r in timed)
                machine, scale = calibrate_link(timed, machine, span_ms - keep_span_ms)
                self._link_scale = (self._link_scale or 1.0) * scale
                log.info("offload: transfer costs calibrated x%.3g by a step that offloaded every region", scale)
            used = timed
            plan = self._make_plan(timed, machine)
        self.profiled.append(ProfiledStep(stage=stage, inputs=key, regions=tuple(used), span_ms=span_ms))
        self.plans[key] = plan
        if self._key == key:
            self.plan = plan
        log.info("offload plan for inputs %s (after a %r step):\n%s", key, stage, plan)
        if self._session.plan_cache is not None and not self._stages.get(key):  # final: keep it for a restart
            self._session.plan_cache.store(key, self.regions, plan, used, self._other_ms, self._link_scale)

    def profiling(self) -> bool:
        """True while the latest input signature still has profiling steps to run (or none ran yet)."""
        if self.policy not in _PROFILED_POLICIES:
            return False
        return self._key is None or self._pending is not None or bool(self._stages.get(self._key, [MEASURE]))

    def _make_plan(self, profiles: list[RegionProfile], machine: MachineProfile) -> Plan:
        budget = self._session.budget_in_force()  # budget_mb, or with "auto" the latest reading
        return make_plan(profiles, machine, budget, self.policy, other_ms=self._other_ms)

    def _adopt_cached(self, key: tuple) -> None:
        cache = self._session.plan_cache
        assert cache is not None  # called only with plan_cache=
        cached = cache.lookup(key, self.regions)
        if cached is None:
            return
        self.plans[key] = cached.plan
        self._sizes[key] = list(cached.profiles)
        self._timed[key] = (list(cached.profiles), None)
        self._stages[key] = []
        if self._link_scale is None:
            self._link_scale = cached.link_scale
        if self._other_ms == 0.0:
            self._other_ms = cached.other_ms

    def _replan(self, key: tuple) -> Plan:
        """The plan for ``key`` made again from its measurements, at the budget in force now."""
        profiles = self._timed[key][0] if key in self._timed else self._sizes[key]  # a plan was made from them
        machine = self._session.machine()
        if self._link_scale is not None:
            machine = scale_link(machine, self._link_scale)
        plan = self._make_plan(profiles, machine)
        self.plans[key] = plan
        log.info("offload: budget in force %s, re-planned inputs %s:\n%s", plan.budget_bytes, key, plan)
        return plan

    def _decision(self, index: int) -> Decision:
        if self.plan is not None:
            return self.plan.regions[index].decision
        return {"recompute": Decision.RECOMPUTE, "selective": Decision.SELECTIVE}.get(self.policy, Decision.KEEP)

    def _measure(
        self, index: int, name: str, module: torch.nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        cuda = next(
            (a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor) and a.is_cuda), None
        )
        m = _Measurement(name=name, input_bytes=_input_bytes(args, kwargs))
        if cuda is not None:
            torch.cuda.synchronize(cuda)
        bytes_before, tensors_before = self._session.saved()
        start = time.perf_counter()
        if self._stage == RECOMPUTE_TRIAL:
            compiled = is_compiled(module)
            on_recompute = self._session.observers.recompute_timer(name, m.add_recompute)
            assert on_recompute is not None  # never None when given a callback of its own
            out, run = profiled_checkpoint(
                forward,
                args,
                kwargs,
                name,
                split=not compiled,
                on_recompute=on_recompute,
                on_selective=m.add_selective,
            )
            self._session.count_recompute(run.dropped_bytes)
            if compiled:
                m.note = COMPILED_NOTE
        elif self._stage == OFFLOAD_TRIAL:
            out = self._eagerly(forward, args, kwargs)
        else:
            out = forward(*args, **kwargs)
        if cuda is not None:
            torch.cuda.synchronize(cuda)
        m.forward_start, m.forward_ms = start, (time.perf_counter() - start) * 1e3
        bytes_after, tensors_after = self._session.saved()
        m.saved_bytes, m.num_tensors = bytes_after - bytes_before, tensors_after - tensors_before
        m.time_backward(args, kwargs, out, cuda)
        # Only a profiling step measures, and _begin_step gave it a key, a stage and its list.
        assert self._profiles is not None and self._key is not None and self._stage is not None
        self._profiles.append(m)
        if index == len(self.regions) - 1:
            self._pending = _Pending(key=self._key, stage=self._stage, measurements=self._profiles)
            self._profiles = None
            _finish_after_backward(out, self.finish_pending)
        return out


# Note: [a block compiled in place]
#     ``block.compile()`` (unlike ``torch.compile(block)``, which returns a wrapper module) sets the
#     module's ``_compiled_call_impl``: its ``__call__`` then runs a compiled ``_call_impl`` that
#     calls ``self.forward`` inside the traced graph. Wrapping ``forward`` there would put the
#     region's own machinery (checkpoint placeholders, timing) inside what Dynamo traces, and the
#     recompute would re-run the eager forward: a different set of saved tensors than the compiled
#     forward saved, and the engine's determinism check raised. So a block compiled in place is
#     wrapped around its compiled call instead: the region runs (and re-runs) the compiled code.
#     ``_compiled_call_impl`` (``_selective.COMPILED_CALL``) is private to torch (2.2+); a module
#     without it is wrapped on forward.


@dataclasses.dataclass(frozen=True)
class _Wrapped:
    """One region's wrapped attribute and what it held before (None: the class's own)."""

    module: torch.nn.Module
    index: int
    name: str
    attr: str
    original: object

    def put_back(self) -> None:
        if self.original is None:
            self.module.__dict__.pop(self.attr, None)
        else:
            setattr(self.module, self.attr, self.original)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfiledStep:
    """One profiling step: its stage, the input signature, the region profiles its plan was made
    from (a trial's times merged with the "measure" step's sizes), and the regions' span (first
    forward start to last backward end, ms; None where not timed)."""

    stage: str
    inputs: tuple
    regions: tuple
    span_ms: Optional[float]


@dataclasses.dataclass(kw_only=True)
class _Pending:
    """A profiling step whose forward is measured; its plan waits for its backward."""

    key: tuple
    stage: str
    measurements: list


def _finish_after_backward(out: Any, finish: Callable[[], None]) -> None:
    """Run ``finish`` once the backward that reaches ``out`` (the last region's output) completes."""
    outputs = [t for t in _tensors(out) if t.requires_grad]
    if not outputs:
        return
    queued: list[bool] = []

    def queue(grad: torch.Tensor) -> None:
        if not queued:
            queued.append(True)
            torch.autograd.Variable._execution_engine.queue_callback(finish)

    outputs[0].register_hook(queue)  # dies with the output; fires at most once per step's backward


def _span_ms(measurements: list) -> Optional[float]:
    """Wall time from the first region's forward start to the end of its backward, ms (None
    where its backward was not timed): the regions' whole share of a step, head and loss included."""
    if not measurements or measurements[0].end is None:
        return None
    return (measurements[0].end - measurements[0].forward_start) * 1e3


def _tensors(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class _Measurement:
    """One region on a measured step: forward figures now, backward time when its hooks fire.

    The region's backward runs between the gradient reaching its output (hook on the output) and
    the gradient of its inputs being complete (hooks on the inputs); a recomputed region's
    backward includes its recompute, timed on its own. On CUDA every stamp synchronizes the device
    first, so each figure is device time plus launch overhead, the way a step experiences it.
    CUDA events would avoid the synchronizations; since only the few profiling steps pay for
    them, the simpler wall-clock stamps are used.
    """

    def __init__(self, *, name: str, input_bytes: int) -> None:
        self.name, self.input_bytes = name, input_bytes
        self.saved_bytes = self.num_tensors = 0
        self.forward_start, self.forward_ms = 0.0, 0.0
        self.recompute_ms = 0.0
        self.start = self.end = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.selective: Optional[SelectiveProfile] = None  # a "recompute" step: what selective would cost
        self.note = ""

    def add_recompute(self, ms: float) -> None:
        self.recompute_ms += ms

    def add_selective(self, selective: SelectiveProfile) -> None:
        self.selective = selective
        self.note = selective.why_not and f"recomputed whole: {selective.why_not}"

    def time_backward(self, args: tuple, kwargs: dict, out: Any, cuda: Optional[torch.device]) -> None:
        outputs = [t for t in _tensors(out) if t.requires_grad]
        inputs = [t for t in _tensors(list(args) + list(kwargs.values())) if t.requires_grad]
        if not (outputs and inputs):
            return

        def stamp():
            if cuda is not None:
                torch.cuda.synchronize(cuda)
            return time.perf_counter()

        def at_output(grad):
            if self.start is None:
                self.start = stamp()

        def at_input(grad):
            self.end = stamp()

        self._hooks.append(outputs[0].register_hook(at_output))
        self._hooks.extend(t.register_hook(at_input) for t in inputs)

    def raw_backward_ms(self) -> float:
        """Measured wall time of the region's backward (its recompute included), or 0 where the
        hooks did not both fire."""
        if self.start is None or self.end is None or self.end <= self.start:
            return 0.0
        return (self.end - self.start) * 1e3

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def profile(self) -> RegionProfile:
        raw_ms = self.raw_backward_ms()
        return RegionProfile(
            name=self.name,
            saved_bytes=self.saved_bytes,
            input_bytes=self.input_bytes,
            forward_ms=self.forward_ms,
            num_tensors=self.num_tensors,
            backward_ms=max(0.0, raw_ms - self.recompute_ms - self.profiling_ms()) if raw_ms > 0 else 0.0,
            recompute_ms=self.recompute_ms,
            note=self.note,
            **self._selective_fields(),
        )

    def profiling_ms(self) -> float:
        """Wall time of the extra re-run that measured selective costs (none: 0), ms."""
        return 0.0 if self.selective is None else self.selective.rerun_ms

    def _selective_fields(self) -> dict:
        s = self.selective
        if s is None or s.why_not:
            return {}
        return {
            "selective_ms": s.selective_ms,
            "cheap_bytes": s.cheap_bytes,
            "expensive_bytes": s.expensive_bytes,
            "expensive_tensors": s.expensive_tensors,
        }
