"""One record per kind of step of the regions: what a step saw, from its first region's forward on.

A step of the regions begins at the first region call after the engine was entered and ends when
the next step begins (See Notes: [a step's span], [region calls] in ``regions``): a region may run
any number of times in it, or not at all. It is one of three kinds, fixed when
it begins by what the profiler says of its inputs:

    ProfilingStep   a profiling stage runs (measure, a trial): one ``Measurement`` per call, a
                    phase (running, awaiting its backward, measured), what a recompute trial counted
    PlannedStep     a plan is in force for its inputs: what each region saved, which the profiler
                    checks the plan against
    UnplannedStep   the policy plans nothing (or there is no plan yet and nothing to measure):
                    every region runs the policy's fixed decision, and the step records nothing

Every kind records what was saved outside the regions (before the first, between two, after the
last); a profiling or planned step hands it to the profiler, which prices it as the step's
"before" and "after" rows.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Callable, Optional, Union

import torch

from .._cost import RegionProfile, Saved, Scope
from .._memory.session import ForwardMarks
from .._plan.planner import AFTER_IN_BACKWARD, Decision
from .._plan.profiler import AFTER_NAME, BEFORE_NAME, ShapePlan, Stage
from .measurement import Measurement

__all__ = ["AnyStep", "PlannedStep", "ProfilingStep", "Seen", "StepPhase", "UnplannedStep", "begin_step"]


@dataclasses.dataclass
class Seen:
    """What a step under a plan saw one region save over its calls (See Note: [region calls] in
    ``regions``), through the store where every save goes there (None where a call's did not). Its
    forward times are not read: See Note: [a derived plan's times are not checked] in
    ``_plan.profiler``."""

    sizes: Optional[Saved]

    def add(self, sizes: Optional[Saved]) -> None:
        """Another call of the region in the same step."""
        self.sizes = None if self.sizes is None or sizes is None else self.sizes + sizes


class StepPhase(enum.Enum):
    """Where a profiling step is. Only the latest step can be awaiting its backward: the next
    one's first region finishes it before it begins (``Regions.finish_measured_step``)."""

    RUNNING = "running"
    """Its regions run forward."""
    AWAITING_BACKWARD = "awaiting backward"
    """Its last region ran forward: what it measured goes to the profiler when its backward ends,
    or when the next step begins if that backward never ran."""
    MEASURED = "measured"
    """Its measurements went to the profiler (or it was abandoned: ``Regions._abandon``)."""


@dataclasses.dataclass(kw_only=True)
class _Step:
    """What every kind of step records: who began it, when, and what was saved outside its regions."""

    key: tuple
    """The first region's input signature."""
    thread: int
    """The thread that began it: See Note: [one forward at a time]."""
    start: float
    """``time.perf_counter()`` when its first region began."""
    moved_at_start: int = 0
    """Bytes the engine had moved off the device when the step began."""
    moved_in_forward: Optional[int] = None
    """Bytes moved off the device while its regions ran forward (None until its last region ran)."""
    marks: Optional[ForwardMarks] = None
    """The engine's marks of the forward this step is part of (what was saved when it was entered,
    and when it closed): with the marks below, what the step saves outside its regions."""
    first_start: Optional[Saved] = None
    """The totals saved when its first region began (None before it did)."""
    last_end: Saved = Saved()
    """The totals saved when its latest region ended."""
    between: Saved = Saved()
    """What was saved in the gaps between its regions so far."""

    def plan_entry(self) -> Optional[ShapePlan]:
        """The plan the step follows (a profiling step's provisional one), or None."""
        return None

    def sends_the_rest_eagerly(self) -> bool:
        """Whether what is saved after the last region (the head's, the loss's) leaves the device
        as it is made: on an offload trial, and under a plan whose decision after the regions is
        offload."""
        return False

    def region_starts(self, saved: Saved) -> None:
        if self.first_start is None:
            self.first_start = saved
        else:
            self.between += saved - self.last_end

    def region_ends(self, saved: Saved) -> None:
        self.last_end = saved

    def outside(self, now: Saved) -> tuple[Saved, Saved]:
        """What was saved before and between the regions, and after the last one until the engine
        was left, or until ``now`` (the totals so far) where it was not left yet: a backward run
        inside ``with eng:`` saves nothing more, as a rule."""
        marks = self.marks
        if marks is None or self.first_start is None:
            return Saved(), Saved()
        before = self.first_start - marks.entered + self.between
        closed = now if marks.closed is None else marks.closed
        return before, closed - self.last_end

    def outside_profiles(self, now: Saved) -> tuple[RegionProfile, RegionProfile]:
        before, after = self.outside(now)
        note = AFTER_IN_BACKWARD if after.in_backward_nbytes * 2 > after.nbytes else ""
        return (
            RegionProfile(name=BEFORE_NAME, scope=Scope.BEFORE, saved_bytes=before.nbytes, num_tensors=before.tensors),
            RegionProfile(
                name=AFTER_NAME, scope=Scope.AFTER, saved_bytes=after.nbytes, num_tensors=after.tensors, note=note
            ),
        )


@dataclasses.dataclass(kw_only=True)
class UnplannedStep(_Step):
    """A step with no plan and nothing to measure: the regions run the policy's fixed decision."""


@dataclasses.dataclass(kw_only=True)
class PlannedStep(_Step):
    """A step under a plan: what each region saved."""

    entry: ShapePlan
    """The plan it follows."""
    seen: dict[int, Seen] = dataclasses.field(default_factory=dict)
    """What it saw of each region, by region index (a region that did not run is absent)."""

    def plan_entry(self) -> Optional[ShapePlan]:
        return self.entry

    def sends_the_rest_eagerly(self) -> bool:
        return self.entry.plan.decision_after() is Decision.OFFLOAD


@dataclasses.dataclass(kw_only=True)
class ProfilingStep(_Step):
    """A profiling step: one stage of the profiler, a measurement per region."""

    stage: Stage
    """Its profiling stage."""
    provisional: Optional[ShapePlan] = None
    """The plan it runs under while it measures (a trial's decisions), or None."""
    phase: StepPhase = StepPhase.RUNNING
    """Where it is: it awaits its backward, then hands the profiler what it measured."""
    measurements: list[Measurement] = dataclasses.field(default_factory=list)
    """One per region call, in call order (See Note: [region calls] in ``regions``)."""
    regions_ms: Optional[float] = None
    """The regions' own time (forwards and backwards), once its backward ran."""
    counted: dict = dataclasses.field(default_factory=dict)
    """A "recompute" trial's storages counted so far: id -> a weak reference to a tensor on it
    (Note: [sizes a recompute trial counts])."""
    largest: int = 0
    """A "recompute" trial: the largest storage counted in the region running now."""
    families: dict[tuple, Measurement] = dataclasses.field(default_factory=dict)
    """A "recompute" trial: the call that measures each measurement family's selective split, by
    family (See Note: [measurement families] in ``measurement``)."""

    def plan_entry(self) -> Optional[ShapePlan]:
        return self.provisional

    def sends_the_rest_eagerly(self) -> bool:
        return self.stage is Stage.OFFLOAD_TRIAL

    # Note: [sizes a recompute trial counts]
    #     A recomputed region hands only its inputs to the store, so what it would save had it run
    #     as is is counted by its own placeholder hooks, by the store's rules: a save the engine
    #     would take (``Eligibility``) counts as a tensor, and its storage's bytes once per step,
    #     as the store counts a storage it already holds (an attention mask or rotary table every
    #     layer saves) no more. The saves a recompute drops are freed when its forward returns, and
    #     the allocator hands their storages' addresses to the next region's tensors: an id is the
    #     same storage only while a tensor seen on it is still alive, so each id keeps a weak
    #     reference to the tensor it was counted for (to its base, for a view made in the region
    #     of a tensor that outlives it, like a rotary table's).
    def count(self, eligible: Callable[[torch.Tensor], bool], t: torch.Tensor) -> Optional[int]:
        if not eligible(t):
            return None
        storage = t.untyped_storage()
        seen = self.counted.get(storage._cdata)
        if seen is not None and seen() is not None:
            return 0
        self.counted[storage._cdata] = weakref.ref(t if t._base is None else t._base)  # a view dies first
        nbytes = storage.nbytes()
        self.largest = max(self.largest, nbytes)
        return nbytes


AnyStep = Union[UnplannedStep, PlannedStep, ProfilingStep]
"""A step of the regions, of whichever kind."""


def begin_step(
    stage: Optional[Stage],
    entry: Optional[ShapePlan],
    *,
    key: tuple,
    thread: int,
    start: float,
    moved_at_start: int,
    marks: Optional[ForwardMarks],
) -> AnyStep:
    """The record of a step that begins, of the kind the profiler's answer for its inputs makes it:
    a stage to run (with the provisional plan it runs under), a plan in force, or neither."""
    if stage is not None:
        return ProfilingStep(
            stage=stage,
            provisional=entry,
            key=key,
            thread=thread,
            start=start,
            moved_at_start=moved_at_start,
            marks=marks,
        )
    if entry is not None:
        return PlannedStep(entry=entry, key=key, thread=thread, start=start, moved_at_start=moved_at_start, marks=marks)
    return UnplannedStep(key=key, thread=thread, start=start, moved_at_start=moved_at_start, marks=marks)
