"""``offload._profiler``: which step profiles, and which plan each shape gets, driven with numbers.

No model runs: a stand-in session gives the machine and the budget, and each profiling step's
measurements are made up from known formulas (bytes linear in the elements, with a sequence²
attention term where a test needs one). Oracle: the plan ``make_plan`` gives for the profiles the
fit derives at the shape that must decide, and the budget each plan must fit.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from offload._cost import MachineProfile, RegionProfile, Scope
from offload._fit import Shape
from offload._planner import Decision
from offload._profiler import (
    AFTER_NAME,
    BEFORE_NAME,
    EXTRAPOLATION_LIMIT,
    SEARCH_BUCKET,
    SECOND_SHAPE_SPREAD,
    Measured,
    Profiler,
    Stage,
)
from offload._session import Saved

MACHINE = MachineProfile(device_type="cpu", device_name="test machine", disk_write_gb_per_s=1.0, disk_read_gb_per_s=2.0)
BATCH, WIDTH, REGIONS = 2, 64, 3


class StandInSession:
    """What the profiler asks of its session: the machine, the budget in force, the plan cache."""

    def __init__(self, budget_bytes: Optional[int]) -> None:
        self.budget_bytes = budget_bytes
        self.plan_cache = None

    def machine(self) -> MachineProfile:
        return MACHINE

    def budget_in_force(self) -> Optional[int]:
        return self.budget_bytes


def key(seq: int) -> tuple:
    """A step's input signature: one (batch, seq, width) float tensor."""
    return (((BATCH, seq, WIDTH), torch.float32, torch.device("cpu")),)


def per_token_bytes(n: int, s: int) -> int:
    return 34 * n


def with_scores(n: int, s: int) -> int:
    return 34 * n + 2 * n * s  # math attention's (s, s) scores


def profiles(seq: int, stage: Stage, saved=per_token_bytes) -> tuple[RegionProfile, ...]:
    """What a profiling step of ``stage`` measures at ``seq``: [before, *regions, after]."""
    shape = Shape.of((BATCH, seq, WIDTH))
    n = shape.n
    trial = stage is Stage.RECOMPUTE_TRIAL
    regions = [
        RegionProfile(
            name=f"blocks.{i}",
            saved_bytes=saved(n, shape.s),
            input_bytes=4 * n,
            num_tensors=17,
            largest_tensor_bytes=8 * n,
            forward_ms=1e-4 * n,
            backward_ms=2e-4 * n,
            recompute_ms=1e-4 * n if trial else 0.0,
        )
        for i in range(REGIONS)
    ]
    before = RegionProfile(name=BEFORE_NAME, scope=Scope.BEFORE, saved_bytes=0)  # the store would move these first
    after = RegionProfile(name=AFTER_NAME, scope=Scope.AFTER, saved_bytes=4 * n, num_tensors=1)
    return (before, *regions, after)


def profiler(policy: str, budget_bytes: Optional[int]) -> tuple[Profiler, StandInSession]:
    session = StandInSession(budget_bytes)
    regions = [(f"blocks.{i}", torch.nn.Identity()) for i in range(REGIONS)]
    return Profiler(regions, policy, session), session


def step(prof: Profiler, seq: int, saved=per_token_bytes) -> Optional[Stage]:
    """One step at ``seq``: its profiling stage (None: under a plan), finished with made-up figures."""
    stage, _ = prof.begin(key(seq))
    if stage is not None:
        prof.finish(Measured(stage=stage, key=key(seq), profiles=profiles(seq, stage, saved), span_ms=None))
    return stage


def peak_keeping_all(seq: int) -> int:
    return sum(p.saved_bytes for p in profiles(seq, Stage.MEASURE))


def bucket(seq: int) -> tuple[int, int]:
    shape = Shape.of((BATCH, seq, WIDTH))
    return math.floor(math.log(shape.n, SEARCH_BUCKET)), math.floor(math.log(shape.s, SEARCH_BUCKET))


def test_a_second_shape_that_differs_by_the_spread_is_measured():
    """One shape measured: a shape ``SECOND_SHAPE_SPREAD`` away is measured by a trial (two points
    give the times their fixed part), though it lies well within ``EXTRAPOLATION_LIMIT``; a shape
    closer than the spread is derived."""
    prof, _ = profiler("selective", None)
    assert [step(prof, 160) for _ in range(3)] == [Stage.MEASURE, Stage.RECOMPUTE_TRIAL, None]
    near, second = 150, 120
    assert 160 / near < SECOND_SHAPE_SPREAD <= 160 / second < EXTRAPOLATION_LIMIT, "the premise"
    assert step(prof, near) is None, "within the spread: derived"
    assert prof.plan_for(key(near)).origin.startswith("derived")
    assert step(prof, second) is Stage.RECOMPUTE_TRIAL, "beyond the spread: measured"
    assert step(prof, 140) is None, "between two measured shapes: derived"


def test_a_buckets_decisions_are_searched_at_its_largest_shape():
    """A budget where keeping everything fits the bucket's smallest shape but not its largest: the
    decisions searched for the first shape seen in the bucket (its smallest) must fit the rest of
    the bucket too, so they are searched at the bucket's top."""
    small, large = 140, 152
    assert bucket(small) == bucket(large), "the premise: one bucket"
    budget = (peak_keeping_all(small) + peak_keeping_all(large)) // 2
    prof, _ = profiler("offload", budget)
    assert [step(prof, 160), step(prof, 160)] == [Stage.MEASURE, Stage.MEASURE]
    assert step(prof, small) is None and step(prof, large) is None, "both derived"
    for seq in (small, large):
        plan = prof.plan_for(key(seq))
        assert plan.origin.startswith("derived"), plan.origin
        assert plan.fits_budget, (seq, str(plan))
    assert Decision.OFFLOAD in prof.plan_for(key(small)).decisions, "the premise: keeping all would fit it"


def test_a_buckets_decisions_are_searched_again_under_another_budget():
    """Decisions searched for a bucket under one budget do not carry to the same bucket under a
    budget far below it (``budget_mb="auto"`` read less free memory): they are searched again."""
    first, second = 150, 152
    assert bucket(first) == bucket(second), "the premise: one bucket"
    prof, session = profiler("offload", 10 * peak_keeping_all(160))
    assert [step(prof, 160), step(prof, 160), step(prof, first)] == [Stage.MEASURE, Stage.MEASURE, None]
    assert set(prof.plan_for(key(first)).decisions) == {Decision.KEEP}, "the premise: plenty of room"
    session.budget_bytes = peak_keeping_all(second) // 2
    assert step(prof, second) is None
    plan = prof.plan_for(key(second))
    assert plan.origin.startswith("derived") and plan.budget_bytes == session.budget_bytes, plan.origin
    assert plan.fits_budget and Decision.OFFLOAD in plan.decisions, str(plan)


def test_plans_derived_before_a_refit_are_derived_again_after_it():
    """One measured shape makes sizes proportional to n; math attention's (s, s) scores are not. A
    step under a derived plan that saw other sizes refits, and a length whose plan was derived
    before the refit is derived again from the new fit when it comes back."""
    prof, _ = profiler("offload", None)
    for _ in range(2):
        step(prof, 64, with_scores)
    assert step(prof, 96, with_scores) is None
    stale = prof.plan_for(key(96))
    n96 = Shape.of((BATCH, 96, WIDTH)).n
    assert [r.saved_bytes for r in stale.regions] != [with_scores(n96, 96)] * REGIONS, "the premise: a miss"
    assert step(prof, 160, with_scores) is None
    n160 = Shape.of((BATCH, 160, WIDTH)).n
    seen = [Saved(with_scores(n160, 160), 17)] * REGIONS
    prof.observe(key(160), [None, *seen, None], [None] * (REGIONS + 2))
    assert prof.misses == 1, "the premise: the sizes at 160 missed, and were refitted"
    assert step(prof, 96, with_scores) is None
    plan = prof.plan_for(key(96))
    assert plan.origin.startswith("derived"), plan.origin
    assert [r.saved_bytes for r in plan.regions] == [with_scores(n96, 96)] * REGIONS, "derived from the new fit"
