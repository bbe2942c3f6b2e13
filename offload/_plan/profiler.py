"""What each step of a region engine is (a profiling stage, or a plan in force), and its plan.

Owns the profiles and plans of one engine's regions, across input shapes. ``Regions`` asks at the
first region of every step (``begin``) and hands back what the step measured (``finish``,
``observe``); the fits live in ``fit``, the decisions in ``policy`` / ``planner``.

Inputs are grouped in families: signatures with the same tensors, dtypes and devices, whose sizes
differ (a batch padded to its own longest sample, a curriculum). One family, one ``ProfileFit``:

    first shape of a family      "measure"  ─▶ nothing has to move: "measure" once more
                                            ─▶ policy "auto" and something moves, or "selective":
                                 "recompute" (every region recomputed: clean times, the recompute
                                              and selective costs) ─▶ "offload" (once per engine,
                                              with a link: calibrates the transfer costs); under
                                              "auto", this round once more at the same inputs on
                                              the next step where the plan depends on its noise
                                              (Note: [a plan that holds still])
    a shape already planned      its plan (least recently used out beyond ``MAX_PLANS``)
    a shape the fit can reach    a plan derived from the fit, no profiling step (its decisions
                                 searched once per ``SEARCH_BUCKET`` of shapes); what the step then
                                 saves through the engine (exact, free) is checked against it, and
                                 a miss beyond ``SIZE_TOLERANCE`` adds the sizes seen to the fit
                                 (its times are not checked: Note: [a derived plan's times are not
                                 checked])
    a shape beyond the fit       "recompute" at that shape (sizes counted by the recomputed regions,
                                 clean times), at most ``MAX_MEASURED_SHAPES`` per family: the second
                                 shape when it differs by ``SECOND_SHAPE_SPREAD``, later ones when
                                 they lie ``EXTRAPOLATION_LIMIT`` outside what was measured;
                                 policy "offload" (which needs sizes only) never profiles again

Why the later shapes are measured by a "recompute" step and not a "measure" one: a "measure" step
holds the budget tensor by tensor, so on a CPU its spill threads share the cores with the forward
(all of them where no core is spare, memory bandwidth and caches where one is) and slow it; a
recomputed region sends only its inputs to the store, so its times are the compute's own, the same
kind of time the first shape's trial measured.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import statistics
from typing import Callable, Optional

import torch

from .._budget import replan_needed
from .._cost import MachineProfile, RegionProfile, Saved, Scope
from .cache import PlanCache
from .fit import TIME_FIELDS, ProfileFit, Shape
from .link_readings import CALIBRATION_TRIES, PLAUSIBLE_LINK_SCALE, LinkReadings, Verdict
from .noise import MAX_SPREAD, Readings
from .pace import WINDOW as PACE_WINDOW
from .pace import StepPace
from .planner import (
    BACKWARD_TO_FORWARD,
    Decision,
    Plan,
    build_plan,
    calibrate_link,
    check_inputs,
    link_usable,
    scale_link,
)
from .policy import Policy, get_policy, make_plan

__all__ = [
    "AFTER_NAME",
    "BEFORE_NAME",
    "EXTRAPOLATION_LIMIT",
    "LIMITS",
    "MAX_TRIAL_ROUNDS",
    "MAX_MEASURED_SHAPES",
    "MAX_PLANS",
    "SEARCH_BUCKET",
    "SECOND_SHAPE_SPREAD",
    "SIZE_TOLERANCE",
    "Measured",
    "Origin",
    "Planning",
    "Profiler",
    "ProfilingLimits",
    "ShapePlan",
    "Stage",
    "family_and_shape",
]

log = logging.getLogger(__name__)

PROFILE_STEPS = 2
""""measure" steps at a family's first shape when no trial follows. The first pays one-time costs
(allocator growth, lazy initialisation, kernel selection: a multiple of the steady forward
time), so its plan is provisional and the second step's replaces it."""

MAX_PLANS = 64
"""Plans kept per family (least recently used out): a plan is a few hundred bytes per region, and
re-deriving one costs a planner run."""
MAX_FAMILIES = 8
"""Input families kept (least recently used out)."""
MAX_MEASURED_SHAPES = 4
"""Shapes per family measured by a profiling step at most; beyond them every shape is derived."""
SECOND_SHAPE_SPREAD = 1.25
"""A second shape whose element count differs from the first's by this factor either way is
measured: two points give every time fit its fixed cost, not only its slope."""
EXTRAPOLATION_LIMIT = 2.0
"""A shape whose element count lies this factor beyond the least or largest measured is measured
(while fewer than ``MAX_MEASURED_SHAPES`` were): a fit is trusted near its points."""
SIZE_TOLERANCE = 0.05
"""A derived plan's saved bytes per region may miss what the step saved by this much before the
sizes seen are added to the fit and the family's derived plans are made again."""
SEARCH_BUCKET = 2 ** (1 / 8)
"""Derived shapes whose element counts and sequence lengths fall in one bucket of this ratio
(x1.09) share the decisions of one planner search, made at the bucket's largest shape (it saves
the most, so its decisions fit the rest); each shape's plan is priced at its own profiles. A loop
whose lengths change every step then searches a bounded number of times, not once a step (a
search costs a few dozen whole-step timelines, each linear in the regions: ``AutoPolicy``)."""


# See Note: [a calibration that cannot lie] in ``link_readings``, with the readings it rules.


# Note: [a derived plan's times are not checked]
#     A step under a derived plan checks what its regions saved (exact, and free: the store counts
#     it anyway), not how long their forwards took. A time check (until issue 49: refit where a
#     forward missed the fit by 30 %) cost a clock per region on every planned step (a pair of CUDA
#     events on a GPU), and read one step's wall time: on a machine that drifts 10-20 % from step to
#     step, and far more beside a busy neighbour (``bench/results/whole-step-builds-cpu.md``), it
#     refitted and re-planned on noise, and each re-plan searches again (N = 1,000 regions: about
#     0.5 s, ``bench/results/scale-cpu.md``). No test or result held what it caught. The times a
#     derived plan uses come from the "recompute" trials at up to ``MAX_MEASURED_SHAPES`` shapes,
#     a new one measured where a shape lies ``EXTRAPOLATION_LIMIT`` beyond them.


# Note: [a plan that holds still]
#     Under "auto" a plan follows measured figures: the regions' times (a "recompute" trial) and
#     the link's level (the "offload" trial after it). Each is one step's reading, and beside a
#     busy neighbour one step can run at half speed or twice: builds of one setup planned offload
#     on every block, recompute on every block, or a mix, by which step the neighbour hit
#     (bench/results/whole-step-builds-cpu.md). So:
#     - The noise is measured, not assumed. A "recompute" trial re-runs every region's forward in
#       the step that ran it once: each region's recompute over its forward is one figure read
#       twice in one step, and how far they deviate from their median (``Readings.deviation``) is
#       the step's noise. Where two trial rounds ran, the deviation of their spans counts too.
#     - Plans within that noise are equal: ``AutoPolicy``'s rule 6 takes, among the plans within
#       the noise of the best predicted step (at least its own ``stable_margin``), a fixed policy's
#       plan first, then fewest regions moved, then a fixed order of decisions. That order does
#       not depend on the figures, so builds whose figures differ by their noise plan alike.
#     - Where that choice differs from the plan the figures alone would give (the noise decides),
#       or where the one link reading (or readings too far apart to plan on) would turn the plan
#       from what the probe's figures give (the reading decides), the round is measured once more
#       (``MAX_TRIAL_ROUNDS``) at the same inputs on the next step, the "offload" trial again
#       against its own round's "recompute" trial (the pair runs on adjacent steps, under the same
#       load), and the plan is made from the medians of the rounds.
#     - The link's level is the difference of two steps' spans, each off by the steps' noise (at
#       least ``STEP_TO_STEP_NOISE``): where that leaves the reading uncertain by more than
#       ``MAX_SPREAD`` (a small transfer in a long step, or a noisy step), it is not planned on, as
#       an implausible one is not: beside a busy neighbour this machine read x0.001 to x22 for one
#       setup's link, and which of those a build met decided its plan.
#     A loop whose inputs change on the next step measures no second round: its first round, and
#     the fixed order within its noise, decide.
# Note: [a provisional plan does not stand]
#     A profiling step plans for its inputs at once (the step after it needs a plan if the family's
#     profiling ends there), but where more profiling steps follow, its plan lacks what they measure:
#     a "measure" step's has no trial times (no selective run measured: every region recomputed
#     whole), a "recompute" trial's no link reading. The steps that follow run at their own
#     inputs, so where a loop's lengths change every step they measure other shapes, and the plan
#     of the first would stand for good (issue 47: under "selective", every third step of a loop of
#     three lengths re-ran every block whole). Such a plan is marked ``provisional`` and dropped
#     when the family's profiling ends; its inputs are then planned from the fit, as any shape's.
MAX_TRIAL_ROUNDS = 2
"""Trial rounds at most at a family's deciding inputs: the first, and one more where the noise
decides the plan (Note: [a plan that holds still]). A second gives each figure a median of two
and a spread between steps; each costs a "recompute" step (and an "offload" one with a link)."""
STEP_TO_STEP_NOISE = 0.1
"""How far two steps of one setup may lie apart on a quiet machine (10-20 %: ``noise``), whatever
the noise within each: an "offload" trial's link reading, the difference of two steps' spans, is
known to within this share of a span at best."""
ONE_ROUND_NOISE = MAX_SPREAD / 2
"""What one trial round's figures may be off by, taken before a second round measures it: between
a quiet machine's two steps (``STEP_TO_STEP_NOISE``) and a busy one's (``MAX_SPREAD``). Where a plan
within it differs from the figures' own, the round is measured again."""


@dataclasses.dataclass(frozen=True)
class ProfilingLimits:
    """How long an engine with regions profiles, and what it keeps (``offload.limits``).

    A loop can bound its profiling steps with them (``Engine.recent_stages``: a stage that is not
    None is a profiling step), or its plans (``Engine.plans``). At a family's first input shape
    the engine runs up to ``profile_steps`` "measure" steps; ``"selective"`` and ``"auto"`` add a
    "recompute" trial at each shape measured (``max_measured_shapes`` at most), and ``"auto"``
    with a host tier or disk an "offload" trial after it, run again while its reading is
    implausible (``calibration_tries`` in all); where the step's noise decides the plan, ``"auto"``
    runs its trial round again (``max_trial_rounds`` in all).
    """

    profile_steps: int
    """"measure" steps at most at a family's first shape (one where a trial follows it)."""
    calibration_tries: int
    """"offload" trials at most whose link reading is implausible before the probe's figures stand."""
    max_trial_rounds: int
    """Trial rounds at most at a family's deciding inputs."""
    max_measured_shapes: int
    """Shapes per family measured by a profiling step; beyond them every shape's plan is derived."""
    max_plans: int
    """Plans kept per family (least recently used out)."""
    size_tolerance: float
    """How far a derived plan's saved bytes per region may miss the step's before it is made again."""
    search_bucket: float
    """Derived shapes whose element counts and lengths lie within this ratio share one plan search."""
    pace_window: int
    """Steps under plans whose times explain's spread is read over."""


LIMITS = ProfilingLimits(
    profile_steps=PROFILE_STEPS,
    calibration_tries=CALIBRATION_TRIES,
    max_trial_rounds=MAX_TRIAL_ROUNDS,
    max_measured_shapes=MAX_MEASURED_SHAPES,
    max_plans=MAX_PLANS,
    size_tolerance=SIZE_TOLERANCE,
    search_bucket=SEARCH_BUCKET,
    pace_window=PACE_WINDOW,
)
"""The profiling limits every engine works under (``offload.limits``)."""


BEFORE_NAME = "(before the regions)"
AFTER_NAME = "(after the regions)"
"""The names of the profiles of the saves outside the regions (``_cost.Scope``): every profile list
here is [before, *regions, after]."""


class Stage(enum.Enum):
    """A profiling step's kind (see the module docstring); its value is what ``Engine.recent_stages`` shows."""

    MEASURE = "measure"
    """Every region runs as is, the budget held tensor by tensor: sizes, first timings."""
    RECOMPUTE_TRIAL = "recompute"
    """Every region recomputed: forward, backward, recompute and selective times free of transfers."""
    OFFLOAD_TRIAL = "offload"
    """Every region offloaded: calibrates the probe's transfer costs by what moving costs a step."""


class Origin(enum.Enum):
    """Where a plan's profiles come from."""

    MEASURED = "measured"
    """Profiling steps at these very inputs."""
    DERIVED = "derived"
    """The family's fit, at shapes measured before."""


@dataclasses.dataclass(frozen=True)
class ShapePlan:
    """The plan for one input signature, the profiles and rest-of-step time it was made from."""

    plan: Plan
    profiles: tuple[RegionProfile, ...]
    other_ms: float
    origin: Origin
    provisional: bool = False
    """Made by a profiling step that more profiling steps follow (a "measure" step before its
    trials, a "recompute" trial before its "offload" one): they may run at other inputs, so when
    the family's profiling ends the plan is dropped, and its inputs planned again from all that
    was measured (Note: [a provisional plan does not stand])."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """What one profiling step measured: its stage and inputs, a profile per region, the regions'
    span (first forward start to last backward end, ms; None where not timed), and whether its
    forward moved nothing (a "measure" step that spilled ran beside its spill threads: on a CPU
    its times are not the compute's own, so only its sizes count)."""

    stage: Stage
    key: tuple
    profiles: tuple[RegionProfile, ...]
    span_ms: Optional[float]
    clean: bool = True


def family_and_shape(key: tuple) -> tuple[tuple, Shape]:
    """A signature's family (its first tensor's rank, dtype and device) and that tensor's shape.

    The other arguments (an attention mask, positions) follow the first one's sizes, or come and
    go (a mask passed only when a batch is padded): one fit serves them all, and where what a step
    saves differs from the fit, the check on sizes refits (see the module docstring)."""
    first = next((item for item in key if isinstance(item, tuple)), None)
    if first is None:
        return (), Shape.of(())
    return ((len(first[0]), first[1], first[2]),), Shape.of(first[0])


class _Repr(str):
    """A signature known only by its repr (a previous run's, not seen in this one yet)."""

    def __repr__(self) -> str:
        return str(self)


@dataclasses.dataclass(frozen=True)
class _Trial:
    """One "recompute" trial: its inputs, profiles and span. The family's latest is what the
    "offload" trial that follows it calibrates against; those at the family's deciding inputs are
    its trial rounds (Note: [a plan that holds still])."""

    key: tuple
    profiles: tuple[RegionProfile, ...]
    span_ms: Optional[float]

    def noise(self) -> float:
        """The deviation of each region's recompute over its forward (``Readings.deviation``: one
        region far off, the first one's warm-up say, moves it nothing): one figure read twice in one
        step (0 where fewer than two regions have both)."""
        ratios = [
            p.recompute_ms / p.forward_ms
            for p in self.profiles
            if p.scope is Scope.REGION and p.recompute_ms > 0 and p.forward_ms > 0
        ]
        return Readings(ratios).deviation if len(ratios) >= 2 else 0.0


@dataclasses.dataclass(frozen=True)
class _Searched:
    """One planner search for a bucket of derived shapes, and what it was searched under."""

    budget_bytes: Optional[int]
    link_scale: Optional[float]
    decisions: tuple[Decision, ...]


class _Family:
    """One input family's fit, plans and profiling in progress."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.fit = ProfileFit(names)
        self.plans: collections.OrderedDict[tuple, ShapePlan] = collections.OrderedDict()
        self.queue: list[Stage] = []
        """Profiling stages still to run: the family's next steps run them, at their own shapes."""
        self.running = False
        """A profiling step of this family has begun and not finished."""
        self.sizes: Optional[tuple[tuple, tuple[RegionProfile, ...]]] = None
        """The latest "measure" step's signature and sizes, while trials follow it."""
        self.latest_trial: Optional[_Trial] = None
        self.adopted = False
        """Whether the plan cache was read for this family."""
        self.cached: dict[str, ShapePlan] = {}
        """Final plans a previous run left (``plan_cache=``), by the repr of their signature."""
        self.searched: collections.OrderedDict[tuple[int, int], _Searched] = collections.OrderedDict()
        """Decisions searched for derived shapes, by bucket (``SEARCH_BUCKET``)."""
        self.rounds: list[_Trial] = []
        """The trial rounds at the family's first trial inputs (Note: [a plan that holds still])."""
        self.repeat_at: Optional[tuple] = None
        """The inputs whose next step, if it is the family's next step, runs another trial round."""
        self.repeat_calibrates = False
        """Whether that round's "recompute" trial is followed by an "offload" trial."""
        self.repeating = False
        """A repeated trial round is under way (its "recompute" trial queued or run, its "offload" trial not yet)."""

    def keep(self, key: tuple, entry: ShapePlan) -> None:
        self.plans[key] = entry
        self.plans.move_to_end(key)
        while len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)

    def remember_search(self, bucket: tuple[int, int], searched: _Searched) -> None:
        self.searched[bucket] = searched
        while len(self.searched) > MAX_PLANS:
            self.searched.popitem(last=False)

    def profiling(self) -> bool:
        return self.running or bool(self.queue)

    def noise(self) -> float:
        """How noisy the trial rounds' figures are, as a share of a step (0 before any round; at
        most ``MAX_SPREAD``: readings spread wider are not built on elsewhere either): the
        deviation of each round's recompute over forward per region (one figure read twice in one
        step), of the rounds' spans, and at least what two steps differ by on a quiet machine (See
        Note: [a plan that holds still])."""
        if not self.rounds:
            return 0.0
        # Between two steps: with one round unknown (a whole step run slower shows in none of its
        # own readings), ONE_ROUND_NOISE; with more, what their spans read, and at least
        # STEP_TO_STEP_NOISE over the square root of their number (their medians are planned on).
        between = ONE_ROUND_NOISE if len(self.rounds) == 1 else STEP_TO_STEP_NOISE / math.sqrt(len(self.rounds))
        spreads = [between] + [trial.noise() for trial in self.rounds]
        spans = [trial.span_ms for trial in self.rounds if trial.span_ms]
        if len(spans) >= 2:
            spreads.append(Readings(spans).deviation)
        return min(max(spreads), MAX_SPREAD)

    def round_profiles(self, key: tuple, profiles: tuple[RegionProfile, ...]) -> tuple[RegionProfile, ...]:
        """``profiles`` with each time the median over the trial rounds at ``key`` where more than one ran."""
        rounds = [trial.profiles for trial in self.rounds if trial.key == key]
        if len(rounds) < 2:
            return profiles
        return tuple(
            dataclasses.replace(p, **{f: statistics.median(getattr(r[i], f) for r in rounds) for f in TIME_FIELDS})
            for i, p in enumerate(profiles)
        )

    def settle(self) -> None:
        """The family's profiling is over for now: drop what only it needed, and the plans made
        from a fit that has changed since, or before the profiling ended (See Note: [a
        provisional plan does not stand])."""
        self.sizes = None
        self.latest_trial = None
        self.searched.clear()
        for key in [k for k, entry in self.plans.items() if entry.origin is Origin.DERIVED or entry.provisional]:
            del self.plans[key]


@dataclasses.dataclass(frozen=True)
class Planning:
    """What planning needs of the engine it plans for, handed over by the regions: the profiler
    reads these and nothing else of the runtime (it does not import the session)."""

    budget_in_force: Callable[[], Optional[int]]
    """The byte budget to plan against now: ``budget_mb``, or with "auto" the latest reading."""
    machine: Callable[[], MachineProfile]
    """The machine's transfer costs (measured on first use, then cached)."""
    plan_cache: Optional[PlanCache]
    """Where final plans are kept across restarts (``plan_cache=``), or None."""
    machine_given: bool = False
    """The machine's figures are the user's (``machine=``), not the probe's: trials still scale
    them within the plausible range, but never replace them (See Note: [a probe slower than the
    steps] in ``link_readings``)."""


class Profiler:
    """The profiles and plans of one engine's regions (see the module docstring)."""

    def __init__(self, regions: list[tuple[str, torch.nn.Module]], policy: str, planning: Planning) -> None:
        self.regions = regions
        self.names = (BEFORE_NAME, *(name for name, _ in regions), AFTER_NAME)
        """The profiles' names, in their order: the saves before the regions, each region, the saves after."""
        self.policy = policy
        self._policy: Policy = get_policy(policy)
        """What the policy needs measured (``Policy.measures``, ``times``, ...), asked instead of its name."""
        self._planning = planning
        self._families: collections.OrderedDict[tuple, _Family] = collections.OrderedDict()
        self.link = LinkReadings()
        """What the "offload" trials read of the link, and the scale transfers are priced at."""
        self.misses = 0
        """Derived plans whose sizes or times missed what their step saw (each added it to the fit)."""
        self._pace = StepPace()
        """Steps under plans, timed against their plans: every plan read out is read at its pace."""

    # ------------------------------------------------------------------ queries

    def _family(self, family: tuple) -> _Family:
        fam = self._families.get(family)
        if fam is None:
            fam = self._families[family] = _Family(self.names)
            while len(self._families) > MAX_FAMILIES:
                self._families.popitem(last=False)
        self._families.move_to_end(family)
        return fam

    def plan_for(self, key: tuple) -> Optional[Plan]:
        """The plan held for ``key`` (read at the pace of steps under plans), or None."""
        fam = self._families.get(family_and_shape(key)[0])
        entry = None if fam is None else fam.plans.get(key)
        return None if entry is None else self.paced(entry.plan)

    def plans(self) -> dict[tuple, Plan]:
        """The plans held, by input signature (bounded: see ``MAX_PLANS``), read at the pace."""
        pace = self._pace.factor()
        return {key: entry.plan.paced(pace) for fam in self._families.values() for key, entry in fam.plans.items()}

    def step_timed(self, entry: ShapePlan, step_ms: float) -> None:
        """A step under ``entry``'s plan took ``step_ms`` (See Note: [a step's span])."""
        self._pace.add(entry.plan.predicted_step_ms, step_ms)

    def paced(self, plan: Plan) -> Plan:
        """``plan`` with its step times read at the pace steps under plans measured (``pace``).
        Plans are held at the cost model's own times; only what is read out is paced."""
        return plan.paced(self._pace.factor())

    def pace_note(self) -> str:
        """At what pace plans read their step times, in words, for ``explain()``."""
        return self._pace.describe()

    def pace_uncertainty(self) -> str:
        """ "" where the steps under plans agree, else a note on how far apart they were (``explain()``)."""
        return self._pace.uncertainty()

    def profiling(self, key: Optional[tuple]) -> bool:
        """Whether the next step at ``key`` (None: before any step) would be a profiling step."""
        if not self._policy.measures:
            return False
        if key is None:
            return True
        family, shape = family_and_shape(key)
        fam = self._families.get(family)
        if fam is None or fam.profiling() or fam.repeat_at == key:
            return True
        return key not in fam.plans and repr(key) not in fam.cached and self._needs_measure(fam, shape)

    def _needs_measure(self, fam: _Family, shape: Shape) -> bool:
        if not fam.fit:
            return True
        if not self._policy.times or len(fam.fit.measured) >= MAX_MEASURED_SHAPES:
            return False  # a policy of sizes alone ("offload"): every step under a plan checks them
        if not fam.fit.measured:
            return True  # sizes only (a "measure" step that spilled): a trial measures the times
        distance = fam.fit.distance(shape)
        return distance >= (SECOND_SHAPE_SPREAD if len(fam.fit.measured) == 1 else EXTRAPOLATION_LIMIT)

    def link_note(self) -> str:
        """How this engine prices a transfer, in words, for ``explain()``."""
        return self.link.note()

    def _machine(self) -> MachineProfile:
        machine = self._planning.machine()
        return machine if self.link.scale is None else scale_link(machine, self.link.scale)

    def _policy_for(self, fam: _Family) -> Policy:
        """The policy plans are made with: under "auto", rule 6's margin widened to the noise of
        the family's trials (See Note: [a plan that holds still])."""
        return self._policy.within_noise(fam.noise())

    def _entry(
        self, fam: _Family, profiles: tuple[RegionProfile, ...], other_ms: float, origin: Origin, why: str
    ) -> ShapePlan:
        budget = self._planning.budget_in_force()  # budget_mb, or with "auto" the latest reading
        plan = make_plan(profiles, self._machine(), budget, self._policy_for(fam), other_ms=other_ms)
        return ShapePlan(dataclasses.replace(plan, origin=why), profiles, other_ms, origin)

    def _derived(self, fam: _Family, shape: Shape) -> ShapePlan:
        """The plan for a shape from the family's fit; its decisions are searched once per bucket
        (``SEARCH_BUCKET``), at the bucket's largest shape."""
        profiles, other_ms = fam.fit.derive(shape)
        budget = self._planning.budget_in_force()
        machine = self._machine()
        n_bucket, s_bucket = (math.floor(math.log(v, SEARCH_BUCKET)) for v in (shape.n, shape.s))
        bucket = (n_bucket, s_bucket)
        searched = fam.searched.get(bucket)
        if (
            searched is not None
            and searched.link_scale == self.link.scale
            and not replan_needed(searched.budget_bytes, budget)
        ):
            decisions = searched.decisions
            fam.searched.move_to_end(bucket)
        else:
            top = Shape(n=math.ceil(SEARCH_BUCKET ** (n_bucket + 1)), s=math.ceil(SEARCH_BUCKET ** (s_bucket + 1)))
            top_profiles, top_other_ms = fam.fit.derive(top)
            top_plan = make_plan(top_profiles, machine, budget, self._policy_for(fam), other_ms=top_other_ms)
            chosen = {r.name: r.decision for r in (*top_plan.outside, *top_plan.regions)}
            decisions = tuple(chosen.get(p.name, Decision.KEEP) for p in top_profiles)
            fam.remember_search(bucket, _Searched(budget, self.link.scale, decisions))
            log.info("offload: decisions searched for inputs up to n=%d, s=%d: %s", top.n, top.s, decisions)
        check_inputs(profiles, machine, budget)
        plan = build_plan(profiles, decisions, machine, budget, self.policy, other_ms)
        why = f"derived, {fam.fit.describe()}"
        return ShapePlan(dataclasses.replace(plan, origin=why), profiles, other_ms, Origin.DERIVED)

    def _calibration_due(self, plan: Plan) -> bool:
        return (
            self._policy.prices_link
            and any(d is not Decision.KEEP for d in plan.decisions)
            and self.link.scale is None
            and link_usable(self._planning.machine())
        )

    def _trials(self, fam: _Family, plan: Plan) -> list[Stage]:
        """The trial steps a plan calls for while the family has no trial times yet."""
        policy = self._policy
        if fam.fit.has("recompute_ms") or not policy.times:
            return []
        if not (policy.trial_always or any(d is not Decision.KEEP for d in plan.decisions)):
            return []
        return [Stage.RECOMPUTE_TRIAL] + ([Stage.OFFLOAD_TRIAL] if self._calibration_due(plan) else [])

    # ------------------------------------------------------------------ a step begins

    def begin(self, key: tuple) -> tuple[Optional[Stage], Optional[ShapePlan]]:
        """What the step at ``key`` is: (its profiling stage or None, the plan to follow or None)."""
        if not self._policy.measures:
            return None, None
        family, shape = family_and_shape(key)
        fam = self._family(family)
        if not fam.adopted:
            fam.adopted = True
            self._adopt_cached(family, fam)
        entry = fam.plans.get(key)
        if entry is None and repr(key) in fam.cached:
            entry = fam.cached.pop(repr(key))
            fam.keep(key, entry)
        stage: Optional[Stage] = None
        if fam.repeat_at is not None and not fam.queue:
            # See Note: [a plan that holds still]: another round only on the very next step at its inputs.
            if key == fam.repeat_at:
                fam.queue = [Stage.RECOMPUTE_TRIAL] + ([Stage.OFFLOAD_TRIAL] if fam.repeat_calibrates else [])
                fam.repeating = True
            fam.repeat_at = None
        if fam.queue:
            stage = fam.queue.pop(0)
        elif entry is not None:
            fam.plans.move_to_end(key)
            if replan_needed(entry.plan.budget_bytes, self._planning.budget_in_force()):
                # budget_mb="auto": free memory moved well away from the plan's budget
                entry = self._entry(fam, entry.profiles, entry.other_ms, entry.origin, entry.plan.origin)
                fam.keep(key, entry)
                log.info(
                    "offload: budget in force %s, re-planned inputs %s:\n%s", entry.plan.budget_bytes, key, entry.plan
                )
        elif not fam.fit:
            stage = Stage.MEASURE
        elif self._needs_measure(fam, shape):
            stage = Stage.RECOMPUTE_TRIAL
        else:
            entry = self._derived(fam, shape)
            fam.queue = self._trials(fam, entry.plan)
            stage = fam.queue.pop(0) if fam.queue else None
            if stage is None:
                fam.keep(key, entry)
        fam.running = fam.running or stage is not None
        return stage, entry

    # ------------------------------------------------------------------ a step ends

    def finish(self, measured: Measured) -> ShapePlan:
        """Plan from a profiling step's measurements (at the end of its backward); returns the plan
        with the profiles it was made from."""
        key, stage, profiles = measured.key, measured.stage, measured.profiles
        family, shape = family_and_shape(key)
        fam = self._family(family)
        fam.running = False
        if stage is Stage.MEASURE:
            first = not fam.fit
            fam.sizes = (key, profiles)
            # Its times count unless they are not the compute's own: the first step pays warm-up
            # costs, and under "auto" or "selective" (whose trials measure clean times) a step that
            # spilled ran beside its spill threads. "offload" never runs a trial: its steps spill alike.
            fam.fit.add(shape, profiles, times=not first and (measured.clean or not self._policy.times))
            entry = self._entry(fam, profiles, fam.fit.other_ms(shape), Origin.MEASURED, "measured")
            trials = self._trials(fam, entry.plan)
            fam.queue = trials or ([Stage.MEASURE] * (PROFILE_STEPS - 1) if first else [])
        elif stage is Stage.RECOMPUTE_TRIAL:
            if fam.sizes is not None and fam.sizes[0] == key:
                # The "measure" step at these inputs counted the sizes as the store does.
                profiles = tuple(
                    dataclasses.replace(p, **_sizes_of(s)) for s, p in zip(fam.sizes[1], profiles, strict=True)
                )
            fam.latest_trial = _Trial(key, profiles, measured.span_ms)
            in_round = self._policy.compares_within_noise and (not fam.rounds or fam.repeating)
            if in_round:
                fam.rounds.append(fam.latest_trial)
            timed = fam.round_profiles(key, profiles)
            fam.fit.add(shape, timed, times=True)
            entry = self._entry(fam, timed, fam.fit.other_ms(shape), Origin.MEASURED, "measured")
            if not fam.queue and self._calibration_due(entry.plan):
                fam.queue = [Stage.OFFLOAD_TRIAL]
            if in_round and not fam.queue:
                self._round_done(fam, key, entry, calibrated=False)
        else:
            entry = self._calibrate(fam, key, shape, measured)
            if fam.rounds and (fam.repeating or len(fam.rounds) == 1) and not fam.queue:
                self._round_done(fam, key, entry, calibrated=True)
        if fam.queue:
            entry = dataclasses.replace(entry, provisional=True)  # See Note: [a provisional plan does not stand]
        fam.keep(key, entry)
        if not fam.profiling():
            fam.settle()
            self._store_cached(family, fam)
        log.info("offload plan for inputs %s (after a %r step):\n%s", key, stage.value, entry.plan)
        return entry

    def _round_done(self, fam: _Family, key: tuple, entry: ShapePlan, *, calibrated: bool) -> None:
        """A trial round ended at ``key``: where the plan within its noise differs from the plan its
        figures alone give, run another round on the next step at the same inputs (See Note: [a
        plan that holds still])."""
        fam.repeating = False
        if self._decided_by_noise(fam, key, entry):
            # Not where every reading was implausible: the probe's figures stand, a reading would not.
            fam.repeat_at = key
            fam.repeat_calibrates = calibrated and not self.link.all_rejected
            log.info(
                "offload: the trials at inputs %s read %.0f%% noise, the link within %.0f%%: measuring them again",
                key,
                100 * fam.noise(),
                100 * self.link.pooled_uncertainty(),
            )

    def _decided_by_noise(self, fam: _Family, key: tuple, entry: ShapePlan) -> bool:
        """Whether another round is due (a round can run at the same inputs, and): the plan within
        the noise differs from the one the figures alone give, or the link readings decide the plan
        (it differs at their median and at the probe's figures) while one reading, or readings too
        far apart to plan on, are all there is."""
        if len(fam.rounds) >= MAX_TRIAL_ROUNDS or fam.rounds[-1].key != key:
            return False
        budget = self._planning.budget_in_force()
        policy = self._policy_for(fam)
        if not isinstance(policy, str):
            alone = make_plan(entry.profiles, self._machine(), budget, self.policy, other_ms=entry.other_ms)
            if alone.decisions != entry.plan.decisions:
                return True
        if not self.link.accepted or (len(self.link.accepted) > 1 and self.link.plannable):
            return False
        probe = self._planning.machine()
        read = scale_link(probe, self.link.median)
        at_reading = make_plan(entry.profiles, read, budget, policy, other_ms=entry.other_ms)
        at_probe = make_plan(entry.profiles, probe, budget, policy, other_ms=entry.other_ms)
        return at_reading.decisions != at_probe.decisions

    def _calibrate(self, fam: _Family, key: tuple, shape: Shape, measured: Measured) -> ShapePlan:
        """An "offload" trial: scale the probe's transfer costs by what moving every region cost
        this step over keeping it, as the latest "recompute" trial (less its recomputes) tells."""
        if fam.sizes is not None and fam.sizes[0] == key:
            sizes = fam.sizes[1]
        else:
            sizes = fam.fit.derive(shape)[0]
        trial = fam.latest_trial
        if trial is not None and _same_size(family_and_shape(trial.key)[1], shape):
            timed = trial.profiles
        else:
            derived = fam.fit.derive(shape)[0]
            timed = tuple(dataclasses.replace(d, **_sizes_of(s)) for s, d in zip(sizes, derived, strict=True))
        if measured.span_ms is not None and trial is not None and trial.span_ms is not None:
            # The "recompute" step less its recomputes is a step that keeps everything; at another
            # shape, scaled by the regions' own time there.
            keep_span_ms = trial.span_ms - sum(r.recompute_ms for r in trial.profiles)
            keep_span_ms *= _regions_ms(timed) / max(_regions_ms(trial.profiles), 1e-9)
            budget = self._planning.budget_in_force()
            excess_ms = measured.span_ms - keep_span_ms
            _, scale = calibrate_link(timed, self._machine(), excess_ms, budget)
            noise_ms = self._noise(fam, trial.profiles, measured) * measured.span_ms
            uncertainty = noise_ms / excess_ms if excess_ms > 0 else math.inf
            ceiling = math.inf
            if (
                scale < PLAUSIBLE_LINK_SCALE[0] and not self._planning.machine_given
            ):  # See Note: [a probe slower than the steps]
                _, ceiling = calibrate_link(timed, self._machine(), noise_ms, budget)
            if self.link.offer(scale, uncertainty, ceiling) is Verdict.AGAIN:  # Note: [a calibration that cannot lie]
                fam.queue.insert(0, Stage.OFFLOAD_TRIAL)
        timed = fam.round_profiles(key, timed)
        return self._entry(fam, timed, fam.fit.other_ms(shape), Origin.MEASURED, "measured")

    def _noise(self, fam: _Family, recompute: tuple[RegionProfile, ...], measured: Measured) -> float:
        """How far off an "offload" trial's excess over keeping may be, as a share of the step's
        span: each of the two steps it is the difference of may be off by their noise (the larger
        of the "recompute" trial's, the "offload" trial's own: each region's forward there over its
        forward in the other, and ``STEP_TO_STEP_NOISE``)."""
        ratios = [
            o.forward_ms / r.forward_ms
            for r, o in zip(recompute, measured.profiles, strict=True)
            if r.scope is Scope.REGION and r.forward_ms > 0 and o.forward_ms > 0
        ]
        noise = max(
            STEP_TO_STEP_NOISE,
            fam.rounds[-1].noise() if fam.rounds else 0.0,
            Readings(ratios).deviation if len(ratios) >= 2 else 0.0,
        )
        return noise

    def rerun(self, key: tuple, stage: Stage) -> None:
        """A profiling step that never reached its last region: run its stage again next time."""
        fam = self._family(family_and_shape(key)[0])
        fam.running = False
        fam.queue.insert(0, stage)

    def other_ms(self, key: tuple, ms: float) -> None:
        """The time a measured step took outside the regions (embedding, head, loss, optimizer)."""
        family, shape = family_and_shape(key)
        self._family(family).fit.add_other(shape, ms)

    def observe(self, key: tuple, sizes: list[Optional[Saved]]) -> None:
        """What a step under a plan saw each region save, where its decision sent every save to the
        store (None elsewhere). Checked against a derived plan; a miss beyond ``SIZE_TOLERANCE``
        adds what was seen to the fit (see the module docstring). Times are not checked: See
        Note: [a derived plan's times are not checked]."""
        family, shape = family_and_shape(key)
        fam = self._families.get(family)
        entry = None if fam is None else fam.plans.get(key)
        if fam is None or entry is None or entry.origin is not Origin.DERIVED:
            return
        missed_sizes = [
            i
            for i, seen in enumerate(sizes)
            if seen is not None
            and abs(seen.nbytes - entry.profiles[i].saved_bytes) > SIZE_TOLERANCE * max(seen.nbytes, 1)
        ]
        if not missed_sizes:
            return
        self.misses += 1
        log.info(
            "offload: the plan derived for inputs %s missed the sizes of regions %s (by > %.0f%%); refitting",
            key,
            [self.names[i] for i in missed_sizes],
            100 * SIZE_TOLERANCE,
        )
        for i, seen in enumerate(sizes):
            if seen is not None:
                fam.fit.add_sizes(shape, i, seen.nbytes, seen.tensors)
        fam.settle()
        self._store_cached(family, fam)

    # ------------------------------------------------------------------ the plan cache

    def _adopt_cached(self, family: tuple, fam: _Family) -> None:
        cache = self._planning.plan_cache
        if cache is None:
            return
        cached = cache.lookup(family, self.regions, self.names)
        if cached is None:
            return
        fam.fit = cached.fit
        fam.cached = {
            text: ShapePlan(plan, profiles, other_ms, Origin.MEASURED)
            for text, plan, profiles, other_ms in cached.plans
        }
        self.link.adopt(cached.link_scale)

    def _store_cached(self, family: tuple, fam: _Family) -> None:
        cache = self._planning.plan_cache
        if cache is None or fam.profiling():
            return  # only a family with nothing being profiled is final
        measured: list[tuple[object, Plan, tuple[RegionProfile, ...], float]] = [
            (key, e.plan, e.profiles, e.other_ms) for key, e in fam.plans.items() if e.origin is Origin.MEASURED
        ]
        measured += [(_Repr(text), e.plan, e.profiles, e.other_ms) for text, e in fam.cached.items()]
        cache.store(family, self.regions, fam.fit, measured[-MAX_PLANS:], self.link.scale)


def _sizes_of(profile: RegionProfile) -> dict:
    """The fields of ``profile`` that a "measure" step counts as the store does (its sizes)."""
    return {
        "saved_bytes": profile.saved_bytes,
        "num_tensors": profile.num_tensors,
        "input_bytes": profile.input_bytes,
        "largest_tensor_bytes": profile.largest_tensor_bytes,
    }


def _same_size(a: Shape, b: Shape) -> bool:
    return (a.n, a.s) == (b.n, b.s)


def _regions_ms(profiles: tuple[RegionProfile, ...]) -> float:
    return sum(p.forward_ms + p.backward_or_estimate_ms(BACKWARD_TO_FORWARD) for p in profiles)
