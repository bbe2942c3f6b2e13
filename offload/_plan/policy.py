"""Policies: how each region's decision is chosen, one class per policy, chosen by name.

A policy turns profiles and a budget into one ``Decision`` per region; ``make_plan`` (in this
module) looks the policy up by name and prices its decisions with ``planner``'s cost model. The fixed policies are the
references every benchmark compares against; "auto" is the planner proper.

    "none"       keep everything (no engine; no budget allowed)
    "offload"    keep the newest regions hot while they fit, offload the rest
    "recompute"  recompute every region (classic full activation checkpointing)
    "selective"  recompute every region's cheap ops, keep (or let the budget move) its expensive
                 outputs; whole-region recompute where a region cannot be split
    "auto"       mix all of them by measured cost, within the budget; within selective, the stash
                 stays hot (SELECTIVE) or is copied out (SELECTIVE_OFFLOAD)

Register your own with ``@register_policy`` on a class with a ``name`` and a
``plan(regions, machine, budget_bytes)`` method; it must be constructible without arguments.
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import logging
import math
from collections.abc import Sequence
from typing import ClassVar

from .._cost import MachineProfile, RegionProfile
from .planner import Decision, Plan, allowed, build_plan, check_inputs, coerce, link_usable, simulate

__all__ = ["AutoPolicy", "Policy", "SelectivePolicy", "get_policy", "make_plan", "policy_names", "register_policy"]

log = logging.getLogger(__name__)

_REGISTRY: dict[str, type] = {}
"""Policy classes by name. The one module-level table: registration is how users extend it."""

_STEP_DIGITS = 9
"""Step times are compared after rounding to 1e-9 ms, so float noise in sums never decides."""


class Policy(abc.ABC):
    """Chooses one decision per region. Subclass, set ``name``, implement ``plan``, register it
    (``offload.register_policy``) and pass ``policy=name`` to ``offload.engine``.

    What the engine must run for a policy before it can plan is said by the class attributes below,
    which the profiler and the regions ask instead of comparing names. The defaults are "auto"'s: a
    policy of your own is profiled as "auto" is (sizes and times measured, a recompute trial where a
    plan moves a block, an offload trial to price the link), so its ``plan`` gets every figure.
    """

    name: ClassVar[str]
    measures: ClassVar[bool] = True
    """Plans from measured profiles, so the regions run profiling steps first. False: a fixed rule
    that needs none ("none", "recompute"): every region takes ``plan``'s decision from the start."""
    times: ClassVar[bool] = True
    """Its decisions depend on measured times, not sizes alone: once a shape's sizes are known it
    measures times too (trials), and later shapes far from the measured ones are measured again.
    False ("offload"): sizes alone, which every step under a plan checks."""
    trial_always: ClassVar[bool] = False
    """Runs the recompute trial (which measures what recomputing and selective recompute cost) even
    where its first plan keeps every block ("selective": its plan is fixed, its costs are not)."""
    prices_link: ClassVar[bool] = True
    """Calibrates the link with an offload trial where its plan moves bytes (``calibrate_link``)."""
    plans_per_rank: ClassVar[bool] = True
    """Each rank's decisions come from its own measurements, so ranks may decide differently: a save
    declared shared (``offload.sharded``) inside its regions is refused. False: a rule every rank
    applies alike to the same sizes."""
    needs_regions: ClassVar[bool] = True
    """Chooses per region, so an engine with it needs ``regions=``."""
    unplanned: ClassVar[Decision] = Decision.KEEP
    """What a region runs as while no plan is in force: throughout, for a policy that measures
    nothing ("recompute": RECOMPUTE)."""
    compares_within_noise: ClassVar[bool] = False
    """Chooses between candidate plans by their predicted times, so two within the trials' noise
    are a tie ("auto"): the profiler measures a round again where the plan turns on that noise,
    and plans with ``within_noise`` of what its trials measured."""

    def within_noise(self, margin: float) -> "Policy":
        """This policy, taking plans whose predicted steps lie within ``margin`` (a fraction) of
        each other as equal. A policy whose plan does not compare times is itself whatever the noise."""
        return self

    @abc.abstractmethod
    def plan(
        self, regions: Sequence[RegionProfile], machine: MachineProfile, budget_bytes: int | None
    ) -> tuple[Decision, ...]:
        """One decision per region, in region order."""


def register_policy(cls: type) -> type:
    """Class decorator: make ``cls`` available by ``cls.name``. A taken name is a ``ValueError``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"policy class {cls!r} needs a non-empty string attribute 'name'")
    if not callable(getattr(cls, "plan", None)):
        raise TypeError(f"policy class {cls!r} needs a method plan(regions, machine, budget_bytes)")
    if name in _REGISTRY:
        raise ValueError(
            f"a policy named {name!r} is already registered ({_REGISTRY[name].__qualname__}); choose another name"
        )
    _REGISTRY[name] = cls
    return cls


def get_policy(name: str) -> Policy:
    """A fresh instance of the policy registered as ``name`` (its default configuration)."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(str(name).lower(), policy_names(), n=1)
        hint = f"Did you mean policy={close[0]!r}? " if close else ""
        raise ValueError(
            f"unknown policy {name!r}; valid policies are: {', '.join(policy_names())}. {hint}"
            f"Leave policy out for the default ('auto' with regions=, 'offload' without), or add one "
            f"with offload.register_policy"
        )
    return _REGISTRY[name]()


def policy_names() -> tuple[str, ...]:
    """Registered policy names, sorted."""
    return tuple(sorted(_REGISTRY))


@register_policy
class NonePolicy(Policy):
    """Keep every region on the device: the model without the engine."""

    name = "none"
    measures = False
    plans_per_rank = False
    needs_regions = False

    def plan(self, regions, machine, budget_bytes):
        if budget_bytes is not None:
            raise ValueError(
                f"policy 'none' keeps every activation on the device, so it cannot honour "
                f"budget_bytes={budget_bytes}; use policy 'auto' (or 'offload' / 'recompute'), or budget_mb=None"
            )
        return (Decision.KEEP,) * len(regions)


@register_policy
class OffloadPolicy(Policy):
    """Keep the last regions hot while the predicted peak fits the budget, offload all earlier ones.

    The newest regions are needed first in backward, when there is no compute left to hide
    their reload behind, so the hot regions are a suffix: the longest whose predicted peak fits
    (copies still in flight count), or, when none fits, the one with the least peak. Without a
    budget, keep everything. Over an unusable link it raises rather than pretend.
    """

    name = "offload"
    times = False
    prices_link = False
    plans_per_rank = False
    needs_regions = False

    def plan(self, regions, machine, budget_bytes):
        n = len(regions)
        keep_all = (Decision.KEEP,) * n
        # Priced at the budget: the saves before the regions move where they would not fit (See
        # Note: [the saves outside the regions, as the store treats them] in ``planner``).
        if budget_bytes is None or simulate(regions, keep_all, machine, budget_bytes)[1] <= budget_bytes:
            return keep_all
        if not link_usable(machine):
            out_gb_per_s, back_gb_per_s = machine.offload_gb_per_s()
            raise ValueError(
                f"policy 'offload' needs a link, but this machine moves {out_gb_per_s} GB/s out and "
                f"{back_gb_per_s} GB/s back; use policy 'recompute' or 'auto'"
            )
        candidates = [
            coerce(regions, (Decision.OFFLOAD,) * (n - num_kept) + (Decision.KEEP,) * num_kept) for num_kept in range(n)
        ]
        peaks = [simulate(regions, decisions, machine, budget_bytes)[1] for decisions in candidates]
        fitting = [decisions for decisions, peak in zip(candidates, peaks, strict=True) if peak <= budget_bytes]
        if fitting:
            return fitting[-1]  # the most regions kept hot
        return candidates[peaks.index(min(peaks))]


@register_policy
class RecomputePolicy(Policy):
    """Recompute every region in backward (full activation checkpointing), whatever the budget."""

    name = "recompute"
    measures = False
    plans_per_rank = False
    unplanned = Decision.RECOMPUTE

    def plan(self, regions, machine, budget_bytes):
        return coerce(regions, (Decision.RECOMPUTE,) * len(regions))


@register_policy
class SelectivePolicy(Policy):
    """Run every region selectively (its cheap ops re-run in backward, its matmul, attention and
    convolution outputs stashed through the engine, which keeps or moves them by the budget);
    regions whose selective run was not measured, or that cannot be split (compiled), are
    recomputed whole. Whatever the budget, like "recompute"."""

    name = "selective"
    trial_always = True
    prices_link = False
    plans_per_rank = False
    unplanned = Decision.SELECTIVE

    def plan(self, regions, machine, budget_bytes):
        return _selective_or_recompute(regions)


def _selective_or_recompute(regions: Sequence[RegionProfile]) -> tuple[Decision, ...]:
    return coerce(regions, tuple(Decision.SELECTIVE if r.selective_measured() else Decision.RECOMPUTE for r in regions))


@register_policy
@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoPolicy(Policy):
    """The planner: the fastest predicted step whose peak fits the budget.

    Rules, in the order they apply:

    1. No budget: keep everything. Everything fits: keep everything.
    2. Greedy. Start from all KEEP; while the predicted peak exceeds the budget, take one more
       KEEP region off the device, choosing the region and action (OFFLOAD, or RECOMPUTE) that
       adds the least step time per byte it takes off the predicted peak (SELECTIVE and
       SELECTIVE_OFFLOAD too, for regions whose selective run was measured). An offload whose copy hides behind the
       forward that follows it and whose reload hides behind backward adds nothing, so those go
       first, earliest region first; the newest regions, with no compute left to hide behind,
       stay hot. Beyond that the cheaper of exposed transfer and recompute wins, and among
       recomputes the ones that free the most bytes per ms of recompute go first. Over an
       unusable link (0 GB/s) only RECOMPUTE is considered.
    3. Local search from the greedy result: repeatedly move to the first better neighbour (one
       region changed, or two regions swapping decisions) until none is better. Better means,
       in order: fewer bytes over budget, a shorter step, then fewer regions moved when within
       the budget (touch no more than needed) or more when over it (move whatever is free),
       then a lower peak.
    4. Safety net: if the best fixed policy (none, offload, recompute, selective) still ranks better,
       search again from it. So "auto" never predicts a slower step than a fixed policy that
       fits, and fits whenever one of them does.
       Where selective runs were measured, search once more from every measured region
       SELECTIVE_OFFLOAD (SELECTIVE without a link) and keep the better result.
    5. Nothing fits: search again from all-OFFLOAD and all-RECOMPUTE and return the least peak
       found (a local search: the least peak it finds, not a proven minimum).
    6. Stability: among every plan the search priced that fits, those within ``stable_margin`` of
       the best predicted step are equal, and the first of them in a fixed order is returned: a
       fixed policy's plan (the same plan whatever the figures, where it lies within the margin),
       then fewest regions moved, then decisions region by region in the order KEEP, OFFLOAD,
       SELECTIVE, SELECTIVE_OFFLOAD, RECOMPUTE. Two runs of one setup measure costs apart (a few
       percent on a quiet machine, far more beside a busy neighbour: the profiler widens the
       margin to the noise its trials measured); without this, near-equal plans would swap
       between them, and a plan the search found by a path the noise chose would swap with its
       neighbours of the same cost.

    Every prediction comes from ``planner.simulate``; see its module for the cost model.
    Planning is pure Python: a few dozen regions take well under a second, ~80 a few seconds.
    """

    name = "auto"
    max_search_moves: int = 1000
    """Local-search moves at most, per starting point. Finding each move simulates up to O(n^2)
    neighbours (n regions); more moves can only improve the plan, at planning time's expense.
    0 returns the greedy plan (or the best fixed policy's, where that ranks better)."""

    stable_margin: float = 0.03
    """Rule 6: plans whose predicted steps lie within this fraction of the best are taken as equal.
    Larger holds plans steadier across runs, at up to this much predicted step time; 0 turns it off.
    The engine's profiler passes the noise its trial steps measured where that is wider."""
    compares_within_noise = True

    def within_noise(self, margin: float) -> "AutoPolicy":
        """Rule 6's margin widened to ``margin`` where that is wider (kept where it is not)."""
        return self if margin <= self.stable_margin else dataclasses.replace(self, stable_margin=margin)

    def __post_init__(self):
        moves = self.max_search_moves
        if isinstance(moves, bool) or not isinstance(moves, int) or moves < 0:
            raise ValueError(f"max_search_moves must be an int >= 0, got {moves!r}; 0 keeps the greedy plan")
        margin = self.stable_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"stable_margin must be a number in [0, 1), got {margin!r}; 0 turns rule 6 off")

    def plan(self, regions, machine, budget_bytes):
        n = len(regions)
        keep_all = (Decision.KEEP,) * n
        if budget_bytes is None:
            return keep_all
        search = _Search(regions, machine, budget_bytes)
        if search.fits(keep_all):
            return keep_all
        can_offload = link_usable(machine)
        actions: tuple[Decision, ...] = (Decision.OFFLOAD, Decision.RECOMPUTE) if can_offload else (Decision.RECOMPUTE,)
        if any(r.selective_measured() for r in regions):
            actions += (Decision.SELECTIVE, Decision.SELECTIVE_OFFLOAD) if can_offload else (Decision.SELECTIVE,)
        fixed = [keep_all, coerce(regions, (Decision.RECOMPUTE,) * n)]
        if Decision.SELECTIVE in actions:
            fixed.append(_selective_or_recompute(regions))
        if can_offload:
            fixed.append(OffloadPolicy().plan(regions, machine, budget_bytes))
        best = search.improve(search.greedy(actions), actions, self.max_search_moves)
        best_fixed = min(fixed, key=search.rank)
        if search.rank(best_fixed) < search.rank(best):
            best = search.improve(best_fixed, actions, self.max_search_moves)
        if Decision.SELECTIVE in actions:
            # The greedy path takes regions off one at a time and rarely reaches "every stash moved":
            # from a plan of offloads and recomputes, one region alone gains nothing by switching.
            most = Decision.SELECTIVE_OFFLOAD if Decision.SELECTIVE_OFFLOAD in actions else Decision.SELECTIVE
            start = coerce(regions, tuple(most if search.allowed(i, most) else Decision.RECOMPUTE for i in range(n)))
            best = min(best, search.improve(start, actions, self.max_search_moves), key=search.rank)
        if not search.fits(best):
            for action in actions:
                start = coerce(
                    regions, tuple(action if search.allowed(i, action) else Decision.RECOMPUTE for i in range(n))
                )
                other = search.improve(start, actions, self.max_search_moves)
                best = min(best, other, key=search.rank)
        return search.stable(best, self.stable_margin, fixed)


_PREFERENCE = (Decision.KEEP, Decision.OFFLOAD, Decision.SELECTIVE, Decision.SELECTIVE_OFFLOAD, Decision.RECOMPUTE)
"""Rule 6's order among near-equal plans: what touches a region least first."""


class _Search:
    """Memoized cost model over one problem (regions, machine, budget), and the moves of "auto"."""

    def __init__(self, regions: Sequence[RegionProfile], machine: MachineProfile, budget_bytes: int):
        self._regions = tuple(regions)
        self._machine = machine
        self._budget_bytes = budget_bytes
        self._costs: dict[tuple[Decision, ...], tuple[float, int]] = {}

    def allowed(self, i: int, decision: Decision) -> bool:
        """Region i may take ``decision`` (``planner.allowed``)."""
        return allowed(self._regions[i], decision)

    def cost(self, decisions: tuple[Decision, ...]) -> tuple[float, int]:
        """(step_ms, peak_bytes), simulated once per distinct assignment."""
        if decisions not in self._costs:
            self._costs[decisions] = simulate(self._regions, decisions, self._machine, self._budget_bytes)
        return self._costs[decisions]

    def fits(self, decisions: tuple[Decision, ...]) -> bool:
        return self.cost(decisions)[1] <= self._budget_bytes

    def rank(self, decisions: tuple[Decision, ...]) -> tuple:
        """Smaller is better: bytes over budget, step time, then regions moved (fewer within the
        budget: touch no more than needed; more over it: whatever moves for free should), peak."""
        step_ms, peak_bytes = self.cost(decisions)
        over_bytes = max(0, peak_bytes - self._budget_bytes)
        moved = sum(d is not Decision.KEEP for d in decisions)
        return (over_bytes, round(step_ms, _STEP_DIGITS), -moved if over_bytes else moved, peak_bytes)

    def stable(
        self, best: tuple[Decision, ...], margin: float, fixed: Sequence[tuple[Decision, ...]] = ()
    ) -> tuple[Decision, ...]:
        """Rule 6 of ``AutoPolicy``: the first, in a fixed order, of the priced plans that fit
        within ``margin`` of ``best``'s step (``best`` itself where it does not fit); the fixed
        policies' plans ``fixed`` come first in that order."""
        if not self.fits(best) or margin == 0:
            return best
        limit_ms = self.cost(best)[0] * (1 + margin)
        near = [d for d, (step_ms, peak) in self._costs.items() if peak <= self._budget_bytes and step_ms <= limit_ms]
        return min(
            near,
            key=lambda d: (d not in fixed, sum(x is not Decision.KEEP for x in d), [_PREFERENCE.index(x) for x in d]),
        )

    def greedy(self, actions: tuple[Decision, ...]) -> tuple[Decision, ...]:
        """Rule 2 of ``AutoPolicy``: move regions off, least ms per freed byte first, until it fits."""
        decisions = (Decision.KEEP,) * len(self._regions)
        while not self.fits(decisions):
            step_ms, peak_bytes = self.cost(decisions)
            best = None  # (ms per byte the peak drops, region index, action); ties keep the earliest
            for i in range(len(self._regions)):
                if decisions[i] is not Decision.KEEP:
                    continue
                for action in actions:
                    if not self.allowed(i, action):
                        continue
                    trial = decisions[:i] + (action,) + decisions[i + 1 :]
                    trial_step_ms, trial_peak_bytes = self.cost(trial)
                    if trial_peak_bytes >= peak_bytes:
                        continue
                    added_ms = max(0.0, round(trial_step_ms - step_ms, _STEP_DIGITS))
                    ms_per_byte = added_ms / (peak_bytes - trial_peak_bytes)
                    if best is None or ms_per_byte < best[0]:
                        best = (ms_per_byte, i, action)
            if best is None:
                break  # no single move lowers the peak; local search takes it from here
            decisions = decisions[: best[1]] + (best[2],) + decisions[best[1] + 1 :]
        return decisions

    def improve(
        self, decisions: tuple[Decision, ...], actions: tuple[Decision, ...], max_moves: int
    ) -> tuple[Decision, ...]:
        """Rule 3 of ``AutoPolicy``: take the first better neighbour, scanning on cyclically from
        the last move, until a full cycle finds none (a local optimum) or ``max_moves`` are made."""
        n = len(decisions)
        choices = (Decision.KEEP,) + actions
        # A move is (i, Decision): set region i to it, or (i, j): swap the decisions of i and j.
        moves: list[tuple[int, Decision | int]] = [(i, choice) for i in range(n) for choice in choices]
        moves += [(i, j) for i in range(n) for j in range(i + 1, n)]
        current, current_rank = decisions, self.rank(decisions)
        made = tried_since_move = position = 0
        while moves and made < max_moves and tried_since_move < len(moves):
            i, other = moves[position]
            position = (position + 1) % len(moves)
            tried_since_move += 1
            if isinstance(other, Decision):
                if current[i] is other or not self.allowed(i, other):
                    continue
                neighbour = current[:i] + (other,) + current[i + 1 :]
            else:
                if current[i] is current[other]:
                    continue
                if not (self.allowed(i, current[other]) and self.allowed(other, current[i])):
                    continue
                swapped = list(current)
                swapped[i], swapped[other] = current[other], current[i]
                neighbour = tuple(swapped)
            neighbour_rank = self.rank(neighbour)
            if neighbour_rank < current_rank:
                current, current_rank = neighbour, neighbour_rank
                made += 1
                tried_since_move = 0
        return current


def make_plan(
    regions: Sequence[RegionProfile],
    machine: MachineProfile,
    budget_bytes: int | None,
    policy: str | Policy = "auto",
    *,
    other_ms: float = 0.0,
) -> Plan:
    """Choose a decision per region with ``policy`` (a registered name or a policy object) and
    predict what the step costs. ``budget_bytes``: activation bytes allowed on the device, None
    for no limit. ``other_ms``: measured time of the step outside the regions (embedding, head,
    loss, optimizer), added to the baseline and the prediction alike. Raises ``ValueError`` for
    bad numbers or a policy that cannot honour them."""
    if not (math.isfinite(other_ms) and other_ms >= 0):
        raise ValueError(f"other_ms must be finite and >= 0, got {other_ms!r}")
    regions = tuple(regions)
    check_inputs(regions, machine, budget_bytes)
    chosen = get_policy(policy) if isinstance(policy, str) else policy
    decisions = tuple(chosen.plan(regions, machine, budget_bytes))
    if len(decisions) == len(regions) and all(isinstance(d, Decision) for d in decisions):
        decisions = coerce(regions, decisions)  # a user's policy need not know the saves outside the regions
    if len(decisions) != len(regions) or not all(isinstance(d, Decision) for d in decisions):
        raise ValueError(
            f"policy {chosen.name!r} returned {decisions!r}; it must return one Decision per region ({len(regions)})"
        )
    plan = build_plan(regions, decisions, machine, budget_bytes, chosen.name, other_ms)
    log.debug("planned %d regions with policy %r:\n%s", len(regions), chosen.name, plan)
    return plan
