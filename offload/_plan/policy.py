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

from .._cost import MachineProfile, RegionProfile, Scope
from .planner import (
    MOVES_BYTES,
    Decision,
    Plan,
    Timeline,
    allowed,
    build_plan,
    check_inputs,
    coerce,
    copies_share_compute,
    footprint,
    host_ms,
    link_ms,
    link_usable,
    simulate,
    timeline,
)

__all__ = ["AutoPolicy", "Policy", "SelectivePolicy", "get_policy", "make_plan", "policy_names", "register_policy"]

log = logging.getLogger(__name__)

_REGISTRY: dict[str, type] = {}
"""Policy classes by name. The one module-level table: registration is how users extend it."""

_MS_PER_US = 1e-3
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

        # The peak never falls as more regions stay hot (each adds its bytes, an offloaded one
        # none), so the regions that fit are found by bisection: O(log n) timelines, not n.
        def candidate(num_kept: int) -> tuple[Decision, ...]:
            return coerce(regions, (Decision.OFFLOAD,) * (n - num_kept) + (Decision.KEEP,) * num_kept)

        if simulate(regions, candidate(0), machine, budget_bytes)[1] > budget_bytes:
            return candidate(0)  # none fits: the least peak
        fits, over = 0, n  # candidate(fits) fits; candidate(over) (keep everything) does not
        while over - fits > 1:
            middle = (fits + over) // 2
            if simulate(regions, candidate(middle), machine, budget_bytes)[1] <= budget_bytes:
                fits = middle
            else:
                over = middle
        return candidate(fits)  # the most regions kept hot


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

    The search, and why it is this one. What a plan holds for later is a sum over the regions
    (each region's bytes are held from the end of its forward to the end of its backward, and
    every such interval contains the end of the forward), so the budget is one knapsack
    constraint. What a plan costs is a sum too, exactly for KEEP, RECOMPUTE and SELECTIVE (the
    re-run and the engine's host costs are the region's own), but not for the decisions that move
    bytes: a copy's exposed time depends on what else queues on the link and on the room the kept
    regions leave. So each region's cost of moving is *estimated*, and the estimates are learned
    from whole-step timelines, a bounded number of them:

    1. No budget: keep everything. Everything fits: keep everything.
    2. A table, per region and per decision it may take: the bytes it holds for later (exact) and
       the ms it adds (exact where nothing moves; for a move, an estimate, below).
    3. Fill: from every region's cheapest decision, take the steps along each region's lower convex
       hull of (bytes held, ms added) in the order of least ms per byte freed, ties to the earliest
       region, until the held bytes fit; the last step is then replaced by the cheapest single
       change that closes what was still over, where that costs less. O(n log n) for n regions.
    4. Learn: price the filled plan on the whole timeline (``planner.timeline``, O(n)), learn from
       it, and fill again, up to ``_ROUNDS`` times or until a plan repeats. Twice over: first every
       move's estimate is its per-tensor cost plus one shared price per ms of link time (0 at
       first: every copy hides; then what the moved regions' exposure over their link time says),
       then each region's own exposure, first from a step that moves every region. Where copies
       take the compute's cores (a CPU without a spare core) a move costs exactly its serial write
       and read, and nothing is learned.
    5. Safety net: the fixed policies' plans (none, offload, recompute, selective) are candidates
       too, so "auto" never predicts a slower step than a fixed policy that fits, and fits
       whenever one does; the fill's least-bytes plan fits whenever any plan does.
    6. Polish, on whole-timeline prices, within a fixed amount of work (``_POLISH_REGION_STEPS``
       regions walked, so on a few regions it covers every neighbour many times over and on
       thousands a few dozen): where it affords it, the search of old first (a greedy from all
       KEEP, each change priced on the whole timeline, O(n^2) timelines); then first-improvement
       local search from the best plan so far (one region changed; two regions swapping decisions
       where the n(n-1)/2 swaps fit in the work, else single changes in the order the table expects
       them to gain), again from the best fixed plan where that ranks better, from every stash moved
       where selective runs were measured, and from each action everywhere where nothing fits;
       last, where every pair of regions each changed fits in the work, the better of those pairs.
       Better means, in order: fewer bytes over budget, a shorter step, then fewer regions moved
       when within the budget or more when over it, then a lower peak.
    7. Stability: among every plan the search priced that fits, those within ``stable_margin`` of
       the best predicted step are equal, and the first of them in a fixed order is returned: a
       fixed policy's plan (the same plan whatever the figures, where it lies within the margin),
       then fewest regions moved, then decisions region by region in the order KEEP, OFFLOAD,
       SELECTIVE, SELECTIVE_OFFLOAD, RECOMPUTE. Two runs of one setup measure costs apart (a few
       percent on a quiet machine, far more beside a busy neighbour: the profiler widens the
       margin to the noise its trials measured); without this, near-equal plans would swap
       between them.

    Cost: O(n log n) for the fills and O(n) per whole timeline, with a bounded number of them
    (2 x ``_ROUNDS`` fills, four fixed plans, the offload policy's bisection of log n, the polish's
    fixed work), so planning grows near linearly in the regions: 0.25-0.4 s for 1,000 regions on
    the 2-vCPU Xeon of ``bench/results/scale-cpu.md``, against 2.2 s for 60 before. What it gives up
    against the search before it (a greedy that priced every single change on the whole timeline,
    O(n^2) timelines a move, then a local search over every single change and every swap): on many
    regions, interactions between moves (copies queueing on one link, the room the kept regions
    leave) are seen only through the learned estimates and a short polish, not per candidate, and
    the polish stops far from a local optimum. On a few regions it runs the old search and more
    (starts from the fills, pairs of changes): on 300 random problems of up to 8 regions
    (``tests/test_planner_search.py``'s generator, seed 7) one plan lands more than 2 % above the
    exhaustive optimum (2.5 %), against 11 for the search before (up to 1.96 x).

    Every prediction comes from ``planner``'s timeline; see its module for the cost model.
    """

    name = "auto"
    max_search_moves: int = 1000
    """Local-search moves at most, per start (rule 6), each to a better neighbour; the polish's
    work is bounded by ``_POLISH_REGION_STEPS`` too. 0: no local search (the best of the fills,
    the fixed policies' plans and, on a few regions, the greedy of rule 6)."""

    stable_margin: float = 0.03
    """Rule 7: plans whose predicted steps lie within this fraction of the best are taken as equal.
    Larger holds plans steadier across runs, at up to this much predicted step time; 0 turns it off.
    The engine's profiler passes the noise its trial steps measured where that is wider."""
    compares_within_noise = True

    def within_noise(self, margin: float) -> "AutoPolicy":
        """Rule 7's margin widened to ``margin`` where that is wider (kept where it is not)."""
        return self if margin <= self.stable_margin else dataclasses.replace(self, stable_margin=margin)

    def __post_init__(self):
        moves = self.max_search_moves
        if isinstance(moves, bool) or not isinstance(moves, int) or moves < 0:
            raise ValueError(f"max_search_moves must be an int >= 0, got {moves!r}; 0 keeps the filled plan")
        margin = self.stable_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"stable_margin must be a number in [0, 1), got {margin!r}; 0 turns rule 7 off")

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
        table = _Table(regions, machine, actions)
        candidates = list(fixed)
        # Two ways to learn what moves cost (rule 4): one price per ms of link time, shared by
        # every move; and each region's own exposure, first from a step that moves them all.
        for per_region in (False, True):
            if per_region:
                moving = [m for m in (Decision.OFFLOAD, Decision.SELECTIVE_OFFLOAD) if m in actions]
                if not moving or table.exact:
                    break
                for move in moving:
                    start = coerce(regions, tuple(move if allowed(r, move) else Decision.RECOMPUTE for r in regions))
                    table.learn(*search.timeline(start), per_region=True)
            else:
                table.price_link(0.0)
            for _ in range(_ROUNDS):
                decisions = table.fill(budget_bytes)
                if decisions in candidates:
                    break
                candidates.append(decisions)
                table.learn(*search.timeline(decisions), per_region=per_region)
        # On a few regions the polish's work also covers the search of old (rule 6): its greedy
        # first, priced change by change on the whole timeline, then the best fill.
        greedy = search.greedy(actions)
        best = search.improve(
            min(candidates, key=search.rank) if greedy is None else greedy, actions, self.max_search_moves, table
        )
        if greedy is not None:
            best = min(
                best,
                search.improve(min(candidates, key=search.rank), actions, self.max_search_moves, table),
                key=search.rank,
            )
        # Further starts, as many as the polish's work allows: the best fixed policy's plan where it
        # still ranks better; every stash moved (one region alone gains nothing by switching to it
        # from a plan of offloads and recomputes); where nothing fits, every region on each action.
        starts = [min(fixed, key=search.rank)]
        if Decision.SELECTIVE in actions:
            most = Decision.SELECTIVE_OFFLOAD if Decision.SELECTIVE_OFFLOAD in actions else Decision.SELECTIVE
            starts.append(coerce(regions, tuple(most if allowed(r, most) else Decision.RECOMPUTE for r in regions)))
        if not search.fits(best):
            for action in actions:
                starts.append(
                    coerce(regions, tuple(action if allowed(r, action) else Decision.RECOMPUTE for r in regions))
                )
        for k, start in enumerate(starts):
            if k > 0 or search.rank(start) < search.rank(best):
                best = min(best, search.improve(start, actions, self.max_search_moves, table), key=search.rank)
        if self.max_search_moves > 0:
            best = search.improve_pairs(best, actions, self.max_search_moves, table)
        return search.stable(best, self.stable_margin, fixed)


_ROUNDS = 6
"""Fills per way of learning (rule 4), each priced on one whole timeline. On 300 random problems of
``tests/test_planner_search.py``'s generator (seed 7), 3 rounds left 6 plans more than 2 % above the
exhaustive optimum, 6 rounds one."""
_POLISH_REGION_STEPS = 20_000
"""Rule 6's work: regions walked by the polish's whole-timeline pricings, at most. A fixed amount, so
the polish does not grow with the regions: about 0.25 s at the timeline's ~13 us a region on the
2-vCPU Xeon of ``bench/results/scale-cpu.md``; it covers the old search and every pair of changes
on up to 8 regions, which the random problems of ``tests/test_planner_search.py`` need."""

_PREFERENCE = (Decision.KEEP, Decision.OFFLOAD, Decision.SELECTIVE, Decision.SELECTIVE_OFFLOAD, Decision.RECOMPUTE)
"""Rule 7's order among near-equal plans: what touches a region least first."""


class _Table:
    """Per region, the decisions it may take, with the bytes each holds for later and the ms each
    adds (``AutoPolicy`` rules 2-4): exact where nothing moves, learned from timelines where
    bytes move. The saves before the regions get an OFFLOAD entry (the store moves them where
    that fits, See Note: [the saves outside the regions, as the store treats them] in
    ``planner``); a plan says KEEP for them and ``as_stored`` decides."""

    def __init__(self, regions: Sequence[RegionProfile], machine: MachineProfile, actions: tuple[Decision, ...]):
        self._regions = tuple(regions)
        self.exact = copies_share_compute(machine)
        """Moves cost exactly their serial link time (copies take the compute's cores): nothing to learn."""
        out_gb_per_s, back_gb_per_s = machine.offload_gb_per_s()
        per_tensor_ms = machine.per_tensor_overhead_us * _MS_PER_US
        self.choices: list[tuple[Decision, ...]] = []
        self.held_bytes: list[dict[Decision, int]] = []
        self.own_ms: list[dict[Decision, float]] = []
        self.move_ms: list[dict[Decision, float]] = []
        """The learned part: the exposed time of a region's move beyond its own costs."""
        self._per_tensor_ms: list[dict[Decision, float]] = []
        self._link_ms: list[dict[Decision, float]] = []
        can_move = Decision.OFFLOAD in actions
        for region in self._regions:
            choices = tuple(d for d in (Decision.KEEP,) + actions if allowed(region, d))
            if region.scope is Scope.BEFORE and can_move and region.saved_bytes > 0:
                choices += (Decision.OFFLOAD,)
            held, own, move, per_tensor, link_time = {}, {}, {}, {}, {}
            for d in choices:
                fp = footprint(region, d)
                forward_ms, rerun_ms = host_ms(region, d, machine)
                held[d] = fp.resident_bytes
                own[d] = forward_ms + rerun_ms + fp.rerun_ms
                if d in MOVES_BYTES:
                    per_tensor[d] = per_tensor_ms * fp.moved_tensors
                    link_time[d] = link_ms(fp.moved_bytes, out_gb_per_s) + link_ms(fp.moved_bytes, back_gb_per_s)
                    move[d] = per_tensor[d] + (link_time[d] if self.exact else 0.0)
            self.choices.append(choices)
            self.held_bytes.append(held)
            self.own_ms.append(own)
            self.move_ms.append(move)
            self._per_tensor_ms.append(per_tensor)
            self._link_ms.append(link_time)

    def ms(self, i: int, decision: Decision) -> float:
        return self.own_ms[i][decision] + self.move_ms[i].get(decision, 0.0)

    def price_link(self, ms_per_link_ms: float) -> None:
        """Every move's estimate: its per-tensor cost plus ``ms_per_link_ms`` per ms of link time
        (out and back) it takes: 0, every copy hides; 1, none does. Where moves cost exactly their
        serial link time (``exact``) they keep it."""
        if self.exact:
            return
        for i, moves in enumerate(self._link_ms):
            for d, link_time_ms in moves.items():
                self.move_ms[i][d] = self._per_tensor_ms[i][d] + ms_per_link_ms * link_time_ms

    def learn(self, decisions: Sequence[Decision], timeline: Timeline, *, per_region: bool) -> None:
        """What the moves of ``decisions`` exposed in ``timeline`` (the step they run): each moved
        region's own exposure becomes its estimate (``per_region``), or their sum over their link
        time becomes the price of every move's link time."""
        if self.exact:
            return
        exposed_ms = link_time_ms = 0.0
        for i, d in enumerate(decisions):
            if d in MOVES_BYTES and d in self.own_ms[i]:
                exposure_ms = max(0.0, timeline.exposed_ms[i] - self.own_ms[i][d] - self._per_tensor_ms[i][d])
                if per_region:
                    self.move_ms[i][d] = self._per_tensor_ms[i][d] + exposure_ms
                exposed_ms += exposure_ms
                link_time_ms += self._link_ms[i][d]
        if not per_region and link_time_ms > 0:
            self.price_link(exposed_ms / link_time_ms)

    def fill(self, budget_bytes: int) -> tuple[Decision, ...]:
        """Rule 3 of ``AutoPolicy``: the cheapest decisions by the table that fit ``budget_bytes``
        (the least bytes held where none fit)."""
        cache: dict[tuple, list[tuple[int, float, Decision]]] = {}
        hulls = [self._hull(i, cache) for i in range(len(self._regions))]
        at = [0] * len(hulls)
        held = sum(hull[0][0] for hull in hulls)
        steps = sorted(
            ((ms - hull[k][1]) / (hull[k][0] - nbytes), i, k + 1)
            for i, hull in enumerate(hulls)
            for k, (nbytes, ms, _) in enumerate(hull[1:])
        )
        last = None  # (region, its hull point, bytes held) before the last step taken
        for _, i, k in steps:
            if held <= budget_bytes:
                break
            last = (i, at[i], held)
            held -= hulls[i][at[i]][0] - hulls[i][k][0]
            at[i] = k
        decisions = [hull[k][2] for hull, k in zip(hulls, at, strict=True)]
        if last is not None and held <= budget_bytes:
            # The last step may free far more than was still over: from before it, the cheapest
            # single change that closes the gap.
            i, k, held = last
            decisions[i] = hulls[i][k][2]
            j, d = min(
                ((j, d) for j, now in enumerate(decisions) for d in self.choices[j]
                 if self.held_bytes[j][now] - self.held_bytes[j][d] >= held - budget_bytes),
                key=lambda c: (self.ms(c[0], c[1]) - self.ms(c[0], decisions[c[0]]), c[0]),
            )  # fmt: skip
            held -= self.held_bytes[j][decisions[j]] - self.held_bytes[j][d]
            decisions[j] = d
        return tuple(
            Decision.KEEP if r.scope is Scope.BEFORE else d for r, d in zip(self._regions, decisions, strict=True)
        )

    def _hull(self, i: int, cache: dict[tuple, list[tuple[int, float, Decision]]]) -> list[tuple[int, float, Decision]]:
        """(bytes held, ms, decision) of region i from its cheapest decision (least bytes, then
        ``_PREFERENCE``, among equal ms) along the lower convex hull of its decisions to its least
        bytes held: each step frees bytes at more ms per byte than the one before."""

        def order(p: tuple[int, float, Decision]) -> tuple:
            return (round(p[1], _STEP_DIGITS), p[0], _PREFERENCE.index(p[2]))

        points = [(self.held_bytes[i][d], self.ms(i, d), d) for d in self.choices[i]]
        key = tuple(points)  # regions alike (a stack of one block) share one hull
        if key in cache:
            return cache[key]
        start = min(points, key=order)
        cheapest: dict[int, tuple[int, float, Decision]] = {}  # per bytes held, below the start's
        for p in points:
            if p[0] < start[0] and (p[0] not in cheapest or order(p) < order(cheapest[p[0]])):
                cheapest[p[0]] = p
        hull = [start]
        for p in sorted(cheapest.values(), key=lambda p: -p[0]):  # freeing more and more
            while len(hull) >= 2 and _turn(hull[-2], hull[-1], p) <= 0:
                hull.pop()
            hull.append(p)
        cache[key] = hull
        return hull


def _turn(o: tuple[int, float, Decision], a: tuple[int, float, Decision], b: tuple[int, float, Decision]) -> float:
    """Cross product of o->a and o->b in (bytes freed, ms): > 0 where a lies below the line o-b."""
    return (o[0] - a[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (o[0] - b[0])


class _Search:
    """Memoized cost model over one problem (regions, machine, budget), and the polish of "auto"."""

    def __init__(self, regions: Sequence[RegionProfile], machine: MachineProfile, budget_bytes: int):
        self._regions = tuple(regions)
        self._machine = machine
        self._budget_bytes = budget_bytes
        self._costs: dict[tuple[Decision, ...], tuple[float, int]] = {}
        self._polish_pricings = _POLISH_REGION_STEPS // max(1, len(self._regions))
        """What is left of rule 6's work, in neighbours priced: shared by every start it polishes."""

    def polish_left(self) -> int:
        return self._polish_pricings

    def allowed(self, i: int, decision: Decision) -> bool:
        """Region i may take ``decision`` (``planner.allowed``)."""
        return allowed(self._regions[i], decision)

    def timeline(self, decisions: tuple[Decision, ...]) -> tuple[tuple[Decision, ...], Timeline]:
        """The whole step ``decisions`` run (``planner.timeline``), its cost remembered."""
        stored, run = timeline(self._regions, decisions, self._machine, self._budget_bytes)
        self._costs[decisions] = (run.step_ms, run.peak_bytes)
        return stored, run

    def cost(self, decisions: tuple[Decision, ...]) -> tuple[float, int]:
        """(step_ms, peak_bytes), priced once per distinct assignment."""
        if decisions not in self._costs:
            self.timeline(decisions)
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
        """Rule 7 of ``AutoPolicy``: the first, in a fixed order, of the priced plans that fit
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

    def greedy(self, actions: tuple[Decision, ...]) -> tuple[Decision, ...] | None:
        """Rule 6 of ``AutoPolicy``: from all KEEP, move regions off one at a time, the change that
        adds the least step time per byte it takes off the peak first (each priced on the whole
        timeline), until it fits. None where its pricings (at most n x actions a move, n moves)
        would not fit in what is left of the polish's work, which it draws on."""
        n = len(self._regions)
        if n * n * len(actions) > self._polish_pricings:
            return None
        decisions = (Decision.KEEP,) * n
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
                    self._polish_pricings -= 1
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
        self, decisions: tuple[Decision, ...], actions: tuple[Decision, ...], max_moves: int, table: _Table
    ) -> tuple[Decision, ...]:
        """Rule 6 of ``AutoPolicy``: take the first better neighbour, scanning on cyclically from
        the last move, until a full cycle finds none (a local optimum), ``max_moves`` are made or
        the polish's work is spent. Where not every neighbour can be priced, single changes come
        in the order the table expects them to gain, those it expects to fit first."""
        n = len(decisions)
        max_pricings = self._polish_pricings
        # A move is (i, Decision): set region i to it, or (i, j): swap the decisions of i and j.
        moves: list[tuple[int, Decision | int]] = [
            (i, choice) for i in range(n) for choice in (Decision.KEEP,) + actions if self.allowed(i, choice)
        ]
        if len(moves) + n * (n - 1) // 2 <= max_pricings:
            moves += [(i, j) for i in range(n) for j in range(i + 1, n)]
        else:
            held_bytes = sum(table.held_bytes[i][d] for i, d in enumerate(decisions))

            def expected(move: tuple[int, Decision | int]) -> tuple[bool, float]:
                i, choice = move
                assert isinstance(choice, Decision)
                now = decisions[i]
                over = held_bytes + table.held_bytes[i][choice] - table.held_bytes[i][now] > self._budget_bytes
                return over, table.ms(i, choice) - table.ms(i, now)

            moves.sort(key=expected)
        current, current_rank = decisions, self.rank(decisions)
        made = tried_since_move = position = 0
        while moves and made < max_moves and tried_since_move < len(moves) and self._polish_pricings > 0:
            i, other = moves[position]
            position = (position + 1) % len(moves)
            tried_since_move += 1
            if isinstance(other, Decision):
                if current[i] is other:
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
            neighbour_rank = self._polish_rank(neighbour)
            if neighbour_rank < current_rank:
                current, current_rank = neighbour, neighbour_rank
                made += 1
                tried_since_move = 0
        return current

    def improve_pairs(
        self, decisions: tuple[Decision, ...], actions: tuple[Decision, ...], max_moves: int, table: _Table
    ) -> tuple[Decision, ...]:
        """Rule 6's last reach, where the polish's work still covers every pair of regions each
        changed (n(n-1)/2 x actions^2 neighbours: a few regions): a better pair is taken, then
        ``improve`` again from it, until no pair is better. Two changes at once find what one
        cannot where a region that moves frees the room another's cheaper decision needs."""
        n = len(decisions)
        choices = [tuple(c for c in (Decision.KEEP,) + actions if self.allowed(i, c)) for i in range(n)]
        sizes = [len(c) for c in choices]
        pair_count = (sum(sizes) ** 2 - sum(k * k for k in sizes)) // 2
        current, current_rank = decisions, self.rank(decisions)
        while pair_count <= self._polish_pricings:
            pairs = ((i, a, j, b) for i in range(n) for j in range(i + 1, n) for a in choices[i] for b in choices[j])
            for i, a, j, b in pairs:
                if current[i] is a or current[j] is b:
                    continue
                neighbour = list(current)
                neighbour[i], neighbour[j] = a, b
                neighbour_rank = self._polish_rank(tuple(neighbour))
                if neighbour_rank < current_rank:
                    current = self.improve(tuple(neighbour), actions, max_moves, table)
                    current_rank = self.rank(current)
                    break
            else:
                break
        return current

    def _polish_rank(self, decisions: tuple[Decision, ...]) -> tuple:
        """``rank``, each assignment not priced before counted against the polish's work."""
        if decisions not in self._costs:
            self._polish_pricings -= 1
        return self.rank(decisions)


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
