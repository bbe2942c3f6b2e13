"""``offload._plan.profiler``: which step profiles, and which plan each shape gets, driven with numbers.

No model runs: a stand-in session gives the machine and the budget, and each profiling step's
measurements are made up from known formulas (bytes linear in the elements, with a sequence²
attention term where a test needs one). Oracle: the plan ``make_plan`` gives for the profiles the
fit derives at the shape that must decide, and the budget each plan must fit.

White-box, on purpose: ``offload._plan.profiler`` plans from numbers alone, so these tests drive it
directly rather than through the engine; the engine's side is tested through its public API
(test_shapes.py, test_regions.py). The readings it plans on (``_plan.noise``, ``_plan.link_readings``)
and a family's noise margin are driven the same way, with numbers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch

from offload._cost import MachineProfile, RegionProfile, Saved, Scope
from offload._plan.fit import Shape
from offload._plan.link_readings import CALIBRATION_TRIES, PLAUSIBLE_LINK_SCALE, LinkReadings, Verdict
from offload._plan.noise import MAX_SPREAD, Readings
from offload._plan.planner import Decision, region_transfer_ms, scale_link
from offload._plan.profiler import (
    AFTER_NAME,
    BEFORE_NAME,
    EXTRAPOLATION_LIMIT,
    SEARCH_BUCKET,
    SECOND_SHAPE_SPREAD,
    Measured,
    Planning,
    Profiler,
    Stage,
    _Family,
    _regions_ms,
    _Trial,
)

MACHINE = MachineProfile(device_type="cpu", device_name="test machine", disk_write_gb_per_s=1.0, disk_read_gb_per_s=2.0)
BATCH, WIDTH, REGIONS = 2, 64, 3


class StandInSession:
    """What the profiler is handed (``Planning``): the machine, the budget in force, the plan cache."""

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
    return Profiler(regions, policy, Planning(session.budget_in_force, session.machine, session.plan_cache)), session


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
    prof.observe(key(160), [None, *seen, None])
    assert prof.misses == 1, "the premise: the sizes at 160 missed, and were refitted"
    assert step(prof, 96, with_scores) is None
    plan = prof.plan_for(key(96))
    assert plan.origin.startswith("derived"), plan.origin
    assert [r.saved_bytes for r in plan.regions] == [with_scores(n96, 96)] * REGIONS, "derived from the new fit"


def with_selective_runs(seq: int, stage: Stage) -> tuple[RegionProfile, ...]:
    """``profiles``, where a "recompute" trial also measures each region's selective re-run (a
    third of its forward, its cheap ops), as the engine's trial does."""
    measured = profiles(seq, stage)
    if stage is not Stage.RECOMPUTE_TRIAL:
        return measured
    return tuple(
        dataclasses.replace(p, selective_ms=p.forward_ms / 3, cheap_bytes=p.saved_bytes // 2)
        if p.scope is Scope.REGION
        else p
        for p in measured
    )


def test_the_shape_profiled_first_is_planned_again_once_the_trials_that_follow_it_ran_elsewhere():
    """Lengths that change every step: the "measure" step at the first length plans without trial
    times (no selective run measured: every region recomputed whole), and the trial it calls for
    runs at the next step's length. When the first length comes back, its plan is the one the
    family's measurements (the trial's included) give there, as every other length's is; not the
    provisional one for good (issue 47 item 6: every third step re-ran every block whole)."""
    prof, _ = profiler("selective", None)
    seqs = [160, 96, 128] * 3
    for seq in seqs:
        stage, _ = prof.begin(key(seq))
        if stage is not None:
            measured = with_selective_runs(seq, stage)
            prof.finish(Measured(stage=stage, key=key(seq), profiles=measured, span_ms=None))
    assert not prof.profiling(key(160)), "the premise: profiling is over"
    plans = {seq: prof.plan_for(key(seq)) for seq in set(seqs)}
    assert all(Decision.SELECTIVE in plans[seq].decisions for seq in (96, 128)), "the premise: trials choose it"
    assert plans[160].decisions == plans[128].decisions, {seq: str(plan) for seq, plan in plans.items()}


# ------------------------------------------------------------------ trial rounds and their noise

MB = 1 << 20
BLOCK_BYTES = 32 * MB
BLOCK_MS = 16.0
"""Four blocks of 32 MB, 16 ms forward: over this disk (2 GB/s each way) a block's round trip costs
~34 ms against a 16 ms recompute, so "auto" keeps one (the budget's room) and recomputes three;
recomputing all four costs one recompute more, ~7 % of the step: within 20 % noise, not 3 %."""
LINK = MachineProfile(device_type="cpu", device_name="test disk", disk_write_gb_per_s=2.0, disk_read_gb_per_s=2.0)
QUIET = (1.0, 1.0, 1.0, 1.0)
NOISY = (0.6, 1.0, 1.4, 1.0)
"""Each block's recompute over its forward, read in one trial step: 0 and 20 % deviation."""
DISTURBED = (0.2, 0.4, 1.6, 2.0)
"""70 % deviation: beyond ``MAX_SPREAD``, a step something else was running beside."""


def block_profiles(stage: Stage, ratios=QUIET) -> tuple[RegionProfile, ...]:
    trial = stage is Stage.RECOMPUTE_TRIAL
    blocks = [
        RegionProfile(
            name=f"blocks.{i}",
            saved_bytes=BLOCK_BYTES,
            input_bytes=MB,
            num_tensors=20,
            largest_tensor_bytes=4 * MB,
            forward_ms=BLOCK_MS,
            backward_ms=2 * BLOCK_MS,
            recompute_ms=BLOCK_MS * ratio if trial else 0.0,
        )
        for i, ratio in enumerate(ratios)
    ]
    before = RegionProfile(name=BEFORE_NAME, scope=Scope.BEFORE, saved_bytes=0)
    after = RegionProfile(name=AFTER_NAME, scope=Scope.AFTER, saved_bytes=MB, num_tensors=1)
    return (before, *blocks, after)


class Trials:
    """A profiler over the four blocks, policy "auto", the budget one block and a half; each step's
    trials read ``ratios`` and an "offload" trial ``link_scale`` times what the figures predict."""

    def __init__(self) -> None:
        session = StandInSession(int(1.5 * BLOCK_BYTES))
        session.machine = lambda: LINK
        self.prof = Profiler([(f"blocks.{i}", torch.nn.Identity()) for i in range(4)], "auto", session)
        self.stages: list[Optional[Stage]] = []
        self._recompute_span = 0.0

    def step(self, seq: int = 64, ratios=QUIET, link_scale: float = 1.0) -> Optional[Stage]:
        stage, _ = self.prof.begin(key(seq))
        self.stages.append(stage)
        if stage is None:
            return None
        profiles = block_profiles(stage, ratios)
        span = None
        if stage is Stage.RECOMPUTE_TRIAL:
            span = self._recompute_span = sum(p.forward_ms + p.backward_ms + p.recompute_ms for p in profiles)
        elif stage is Stage.OFFLOAD_TRIAL:
            keep_ms = self._recompute_span - sum(p.recompute_ms for p in profiles)
            machine = LINK if self.prof.link.scale is None else scale_link(LINK, self.prof.link.scale)
            transfer_ms = sum(sum(region_transfer_ms(p, machine)) for p in profiles if p.scope is Scope.REGION)
            span = keep_ms + link_scale * transfer_ms
        self.prof.finish(Measured(stage=stage, key=key(seq), profiles=profiles, span_ms=span))
        return stage

    def plan(self, seq: int = 64):
        return self.prof.plan_for(key(seq))


def test_quiet_trials_with_a_clear_winner_run_once():
    """Moving a twentieth as dear as the figures say (the step reads about half: the rest is what
    no link speeds up): offloading three blocks, the "offload" policy's plan, wins by far more than
    any noise; no second round, and the plan is the figures' own."""
    trials = Trials()
    for _ in range(5):
        trials.step(link_scale=0.05)
    assert trials.stages == [Stage.MEASURE, Stage.RECOMPUTE_TRIAL, Stage.OFFLOAD_TRIAL, None, None]
    assert trials.plan().decisions.count(Decision.OFFLOAD) == 3, str(trials.plan())


def test_trials_whose_noise_decides_the_plan_run_once_more_and_plan_within_it():
    """20 % noise in the trial step (a quiet one's would do too: two steps lie ``STEP_TO_STEP_NOISE``
    apart whatever each reads): recomputing every block (a fixed policy's plan, ~7 % slower) is as
    good as keeping one within it, and is the plan the fixed order takes; since that is not what
    the figures alone give, the round runs again on the next step at the same inputs."""
    trials = Trials()
    mirrored = tuple(2 - r for r in NOISY)  # the second round reads each block's figure as far off, the other way
    for ratios in (NOISY, NOISY, NOISY, mirrored, mirrored, NOISY, NOISY):
        trials.step(ratios=ratios)
    measure, recompute, calibrate = Stage.MEASURE, Stage.RECOMPUTE_TRIAL, Stage.OFFLOAD_TRIAL
    assert trials.stages == [measure, recompute, calibrate, recompute, calibrate, None, None]
    plan = trials.plan()
    assert plan.decisions == (Decision.RECOMPUTE,) * 4, str(plan)
    fam = next(iter(trials.prof._families.values()))
    (entry,) = fam.plans.values()
    assert [p.recompute_ms for p in entry.profiles[1:-1]] == [BLOCK_MS] * 4, "the medians of the two rounds"


def test_a_second_round_runs_only_at_the_same_inputs_on_the_next_step():
    trials = Trials()
    for _ in range(3):
        trials.step(ratios=NOISY)
    assert trials.prof.profiling(key(64)), "another round is due at these inputs"
    assert trials.step(seq=60, ratios=NOISY) is not Stage.RECOMPUTE_TRIAL
    assert not trials.prof.profiling(key(64)), "a step at other inputs came first: the first round decides"
    assert trials.step(ratios=NOISY) is None


def test_the_link_is_planned_at_the_median_of_the_rounds_readings():
    trials = Trials()
    for link_scale in (1.0, 1.0, 2.0, 1.0, 2.4):
        trials.step(ratios=NOISY, link_scale=link_scale)
    assert trials.stages[2:5] == [Stage.OFFLOAD_TRIAL, Stage.RECOMPUTE_TRIAL, Stage.OFFLOAD_TRIAL]
    first, second = trials.prof.link.accepted
    assert second > 1.5 * first, "the premise: the second round read a slower link"
    assert trials.prof.link.pooled_uncertainty() <= MAX_SPREAD, "the premise: close enough to plan on"
    assert trials.prof.link.scale == pytest.approx((first + second) / 2)
    assert f"offload trials read x{first:.3g}, x{second:.3g}" in trials.prof.link_note()


def test_a_link_reading_too_uncertain_is_not_planned_on_alone():
    """A "recompute" trial whose blocks' recompute over forward deviate by 70 %: the "offload"
    trial's link reading, the difference of two steps' spans, is known to within far more than
    ``MAX_SPREAD``; where planning on it would change the plan, the round runs again, and the two
    readings, ten times apart, are still too uncertain together: the plan keeps the probe's
    figures, and ``explain()`` says why."""
    trials = Trials()
    for link_scale in (3.0, 3.0, 3.0, 30.0, 30.0, 30.0, 30.0):
        trials.step(ratios=DISTURBED, link_scale=link_scale)
    measure, recompute, calibrate = Stage.MEASURE, Stage.RECOMPUTE_TRIAL, Stage.OFFLOAD_TRIAL
    assert trials.stages == [measure, recompute, calibrate, recompute, calibrate, None, None]
    assert len(trials.prof.link.accepted) == 2 and trials.prof.link.pooled_uncertainty() > MAX_SPREAD
    assert trials.prof.link.scale == 1.0
    assert "too uncertain to plan on" in trials.prof.link_note()


def test_readings_certain_together_are_planned_on():
    """Quiet trials: each link reading is known to within ``STEP_TO_STEP_NOISE`` of a step's span."""
    trials = Trials()
    for _ in range(4):
        trials.step(link_scale=3.0)
    (reading,) = trials.prof.link.accepted
    assert trials.prof.link.pooled_uncertainty() <= MAX_SPREAD and trials.prof.link.scale == reading


def test_link_readings_accept_the_plausible_and_stand_on_the_probe_when_none_is():
    """Numbers alone (``LinkReadings``): an implausible reading before any accepted one is measured
    again, up to ``CALIBRATION_TRIES``, then the probe's figures (x1) stand; one after an accepted
    reading leaves it standing; readings too far apart to plan on price at the probe's figures."""
    low, high = PLAUSIBLE_LINK_SCALE
    readings = LinkReadings()
    assert readings.scale is None and "no offload trial yet" in readings.note()
    verdicts = [readings.offer(low / 10, 0.1) for _ in range(CALIBRATION_TRIES)]
    assert verdicts == [Verdict.AGAIN] * (CALIBRATION_TRIES - 1) + [Verdict.PROBE]
    assert readings.scale == 1.0 and readings.all_rejected and "every offload trial implausible" in readings.note()

    readings = LinkReadings()
    assert readings.offer(0.5, 0.1) is Verdict.ACCEPTED and readings.scale == 0.5
    assert readings.offer(high * 10, 0.1) is Verdict.KEPT and readings.scale == 0.5 and not readings.all_rejected
    assert "rejected as implausible" in readings.note()

    apart = LinkReadings()
    apart.offer(0.5, 0.1)
    apart.offer(4.0, 0.1)  # read at x0.5 already: x2.0 of the probe's, four times the first
    assert apart.accepted == [0.5, 2.0] and apart.pooled_uncertainty() > MAX_SPREAD
    assert apart.scale == 1.0 and "too uncertain to plan on" in apart.note()

    cached = LinkReadings()
    cached.adopt(0.7)
    cached.adopt(0.9)  # the first cached scale stands until a trial reads one
    assert cached.scale == 0.7 and "plan cache" in cached.note()


@pytest.mark.parametrize("ceilings", [(0.02, 0.03), (5.0, 3.0)], ids=["probe-too-slow", "within-noise"])
def test_trials_no_slower_than_keeping_price_the_link_at_what_their_noise_allows(ceilings, caplog):
    """Numbers alone (``LinkReadings``), issue 47 item 7: every "offload" trial read below the
    plausible scale (its step no slower than the one that kept everything), and each says the
    highest scale its noise leaves possible. Below 1 (a probe cache measured under load, its
    figures 50x too slow): transfers are priced at the highest of them, and the one warning says
    to measure the probe again. 1 or more (the probe's figures hide in the noise): they stand,
    and nothing is shown at warning level."""
    low, _ = PLAUSIBLE_LINK_SCALE
    readings = LinkReadings()
    with caplog.at_level("INFO", logger="offload._plan.profiler"):
        verdicts = [readings.offer(low / 10, math.inf, ceiling) for ceiling in ceilings[:CALIBRATION_TRIES]]
    assert verdicts == [Verdict.AGAIN] * (CALIBRATION_TRIES - 1) + [Verdict.PROBE]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if max(ceilings) < 1.0:
        assert readings.scale == max(ceilings) and readings.probe_too_slow
        assert len(warnings) == 1 and "offload.probe(refresh=True)" in warnings[0], warnings
        assert "probe(refresh=True)" in readings.note()
    else:
        assert readings.scale == 1.0 and not readings.probe_too_slow
        assert warnings == []


# ------------------------------------------------------------------ the readings' guards


def test_two_readings_far_apart_are_not_steady():
    """Two readings are a spread too: 1 and 4 lie 60 % of their median apart, past ``MAX_SPREAD``."""
    assert not Readings([1.0, 4.0]).steady()
    assert Readings([1.0, 1.1]).steady()
    assert Readings([3.0]).steady(), "one reading has no spread to judge"


@pytest.mark.parametrize("uncertainty", [0.1, 0.9])
def test_a_single_link_reading_is_plannable_only_within_its_noise(uncertainty):
    """One accepted reading is as uncertain as the steps it is the difference of: past
    ``MAX_SPREAD`` it is kept, but transfers stay priced at the probe's figures (scale 1)."""
    link = LinkReadings()
    assert link.offer(0.5, uncertainty) is Verdict.ACCEPTED
    assert link.pooled_uncertainty() == uncertainty
    plannable = uncertainty <= MAX_SPREAD
    assert link.plannable is plannable
    assert link.scale == (0.5 if plannable else 1.0)


def test_the_noise_margin_is_capped():
    """Trial rounds whose own figures are far apart (a step something else ran beside) widen the
    margin plans are taken as equal within only up to ``MAX_SPREAD``."""
    names = tuple(f"b{i}" for i in range(4))
    profiles = tuple(
        RegionProfile(name=name, saved_bytes=MB, forward_ms=1.0, recompute_ms=ratio)
        for name, ratio in zip(names, (0.05, 0.1, 5.0, 20.0), strict=True)
    )
    fam = _Family(names)
    fam.rounds.append(_Trial(("k",), profiles, 100.0))
    assert fam.rounds[0].noise() > MAX_SPREAD, "the premise: the round's own figures spread past the cap"
    assert fam.noise() == MAX_SPREAD


def test_regions_own_time_is_forward_plus_backward_or_its_estimate():
    """The regions' time an "offload" trial at another shape scales its keep span by: each
    region's forward plus its backward, ``BACKWARD_TO_FORWARD`` x the forward where none was measured."""
    measured = RegionProfile(name="blocks.0", saved_bytes=1, forward_ms=1.0, backward_ms=3.0)
    estimated = RegionProfile(name="blocks.1", saved_bytes=1, forward_ms=2.0)
    assert _regions_ms((measured,)) == 4.0
    assert _regions_ms((measured, estimated)) == 4.0 + 2.0 * 3
