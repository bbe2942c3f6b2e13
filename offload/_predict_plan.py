"""Every policy priced on the fake step's profiles: the policy table, and the longest sequence each fits.

Numbers in, plans out (``_policy.make_plan``); the only step run here is ``longest_sequences``'
fake steps at a few lengths.

    RegionProfile per region ──▶ plan_policy(policy, budget) ──▶ Plan
        policy_points:      every policy in ``POLICIES`` at every fraction of the peak without the
                            engine ──▶ PolicyPoint (peak, held, step time, fits)
        longest_sequences:  fake steps at the example's sequence / ``_FIT_LENGTHS``, fitted by
                            ``_fit`` (bytes linear in tokens, plus a tokens x sequence term where
                            attention is not fused) ──▶ per policy, a doubling then a bisection over
                            lengths ──▶ Longest

Memory a step needs on the device, for "does it fit": the parameters, their gradients and the
optimizer's state, plus the plan's predicted activation peak and the running region's own saves
(``_working_bytes``). The temporaries of the op running at the peak are not counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch

from ._cost import MachineProfile, RegionProfile, Scope
from ._fit import ProfileFit, Shape
from ._machines import Machine
from ._planner import MOVES_BYTES, Plan
from ._policy import AutoPolicy, make_plan
from ._predict_step import Attention, fake_step
from ._regions import RegionsArg

__all__ = [
    "BUDGET_FRACTIONS",
    "POLICIES",
    "WITHOUT_ENGINE",
    "Longest",
    "PolicyPoint",
    "held_bytes",
    "longest_sequences",
    "plan_policy",
    "policy_points",
]

POLICIES = ("none", "checkpoint", "offload", "recompute", "selective", "auto")
"""The policies a prediction compares. "checkpoint" is ``torch.utils.checkpoint`` on every region
without the engine: its inputs kept, one more forward in backward, which is what "recompute"
costs in this model too (the engine's recompute may stop early; the prediction does not count on it)."""
WITHOUT_ENGINE = ("none", "checkpoint")
"""The policies of ``POLICIES`` that run without the engine, so are priced without its host costs
(``MachineProfile.without_host_costs``): the model as it is, and ``torch.utils.checkpoint``."""
BUDGET_FRACTIONS = (1.0, 0.5, 0.25, 0.1)
"""The budgets of the policy table, as fractions of the activation peak without the engine."""

_LONGEST_CAP = 1 << 20
"""The longest sequence ``longest_sequences`` tries, tokens."""
_FIT_LENGTHS = (4, 2, 1)
"""``longest_sequences`` fits over fake steps at the example's sequence divided by these."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyPoint:
    """One policy at one budget: the plan's predicted activation peak and step time."""

    policy: str
    budget_fraction: Optional[float]
    """The budget as a fraction of the peak without the engine; None: no budget."""
    budget_bytes: Optional[int]
    peak_bytes: int
    """The plan's predicted activation peak: what it needs on the device (``Plan.predicted_peak_bytes``)."""
    held_bytes: int
    """What the engine will hold at most carrying it out (``held_bytes``): more than ``peak_bytes``
    where the plan moves bytes, since the store prefetches into any room left under the budget."""
    step_ms: float
    fits: bool
    decisions: str
    """The plan's decisions, run-length coded: "keep x2, offload x6"."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Longest:
    """The longest sequence whose parameters, gradients, optimizer state, activation peak and working
    set fit the device memory under one policy (0: not even one token). Searched up to ``_LONGEST_CAP``."""

    policy: str
    sequence: int
    peak_bytes: int
    """The plan's predicted activation peak at that length."""
    working_bytes: int
    """The running region's own saves on top of it (``_working_bytes``)."""
    step_ms: float


def _decisions(plan: Plan) -> str:
    """How many regions take each decision: "keep x6, offload x26"."""
    counts: dict[str, int] = {}
    for d in plan.decisions:
        counts[d.value] = counts.get(d.value, 0) + 1
    return ", ".join(f"{name} x{n}" for name, n in counts.items())


def plan_policy(
    profiles: Sequence[RegionProfile],
    link: MachineProfile,
    policy: str,
    budget: Optional[int],
    other_ms: float,
    *,
    quick: bool = False,
) -> Plan:
    """The plan of ``policy`` ("checkpoint" is "recompute"; "none" takes no budget; those of
    ``WITHOUT_ENGINE`` priced without the engine's host costs). ``quick``:
    "auto" without its local search (``max_search_moves=0``), which fits whenever the full search
    does (it starts from the same fixed plans, all-offload and all-recompute among them): what a
    search over lengths asks."""
    engine_policy: Union[str, AutoPolicy] = "recompute" if policy == "checkpoint" else policy
    if policy in WITHOUT_ENGINE:
        link = link.without_host_costs()
    if quick and policy == "auto":
        engine_policy = AutoPolicy(max_search_moves=0)
    if engine_policy in ("none", "recompute", "selective"):
        plan = make_plan(profiles, link, None, engine_policy, other_ms=other_ms)
        fits = budget is None or plan.predicted_peak_bytes <= budget
        return dataclasses.replace(plan, policy=policy, budget_bytes=budget, fits_budget=fits)
    return dataclasses.replace(make_plan(profiles, link, budget, engine_policy, other_ms=other_ms), policy=policy)


def held_bytes(plan: Plan, keep_peak_bytes: int) -> int:
    """The most the engine holds carrying ``plan`` out: its predicted peak, or where it moves bytes
    over the link and has a budget, up to that budget (the store prefetches moved entries back into
    the room left under it, and holds no more than the step saves: ``keep_peak_bytes``)."""
    moves = any(r.decision in MOVES_BYTES for r in (*plan.regions, *plan.outside))
    if not moves or plan.budget_bytes is None:
        return plan.predicted_peak_bytes
    return max(plan.predicted_peak_bytes, min(plan.budget_bytes, keep_peak_bytes))


def policy_points(
    profiles: Sequence[RegionProfile], link: MachineProfile, other_ms: float, fractions: Sequence[float]
) -> tuple[PolicyPoint, ...]:
    keep_peak = make_plan(profiles, link, None, "none", other_ms=other_ms).predicted_peak_bytes
    points = []
    for policy in POLICIES:
        for fraction in fractions:
            budget = int(keep_peak * fraction)
            plan = plan_policy(profiles, link, policy, budget, other_ms)
            points.append(
                PolicyPoint(
                    policy=policy,
                    budget_fraction=fraction,
                    budget_bytes=budget,
                    peak_bytes=plan.predicted_peak_bytes,
                    held_bytes=held_bytes(plan, keep_peak),
                    step_ms=plan.predicted_step_ms,
                    fits=plan.fits_budget,
                    decisions=_decisions(plan),
                )
            )
    return tuple(points)


def longest_sequences(
    model: torch.nn.Module,
    inputs_at: Callable[[int], tuple[tuple, dict]],
    base_seq: int,
    machine: Machine,
    regions: RegionsArg,
    attention: Attention,
    loss_fn: Optional[Callable[[Any], torch.Tensor]],
    min_offload_bytes: int,
    free_bytes: int,
) -> tuple[Longest, ...]:
    """Per policy, the longest sequence whose predicted activation peak plus working set fits
    ``free_bytes`` (device memory less parameters, gradients and optimizer state), searched over
    profiles fitted (``_fit``) to fake steps at ``base_seq`` and fractions of it."""
    fit: Optional[ProfileFit] = None
    dims: tuple[int, ...] = ()
    for divisor in _FIT_LENGTHS:
        args, kwargs = inputs_at(max(2, base_seq // divisor))
        run = fake_step(model, args, kwargs, machine, regions, attention, loss_fn, min_offload_bytes)
        dims = next((c.input_dims for c in run.counts if c.scope is Scope.REGION and len(c.input_dims) >= 3), ())
        if not dims:
            raise ValueError(
                "longest_in=: the regions' first input is not (batch, sequence, width), so its sequence cannot be "
                "varied; pass regions whose first input is"
            )
        if fit is None:
            fit = ProfileFit([c.name for c in run.counts])
        shape = Shape.of(dims)
        fit.add(shape, [c.profile() for c in run.counts])
        fit.add_other(shape, sum(c.forward_ms + c.backward_ms for c in run.counts if c.scope is not Scope.REGION))
    assert fit is not None  # _FIT_LENGTHS is not empty
    link = machine.machine_profile()

    def plan_at(policy: str, seq: int, quick: bool) -> tuple[Plan, int]:
        profiles, other_ms = fit.derive(Shape.of((*dims[:-2], seq, dims[-1])))
        working = _working_bytes(profiles)
        return plan_policy(profiles, link, policy, max(0, free_bytes - working), other_ms, quick=quick), working

    def fits(policy: str, seq: int) -> bool:
        plan, working = plan_at(policy, seq, quick=True)
        return working <= free_bytes and plan.fits_budget

    results = []
    for policy in POLICIES:
        low, high = 0, 1
        while high <= _LONGEST_CAP and fits(policy, high):
            low, high = high, high * 2
        high = min(high, _LONGEST_CAP + 1)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(policy, middle) else (low, middle)
        plan, working = plan_at(policy, max(1, low), quick=False)
        results.append(
            Longest(
                policy=policy,
                sequence=low,
                peak_bytes=plan.predicted_peak_bytes,
                working_bytes=working,
                step_ms=plan.predicted_step_ms,
            )
        )
    return tuple(results)


def _working_bytes(profiles: Sequence[RegionProfile]) -> int:
    """The running region's own saves, which the planner's peak leaves out (they exist with or
    without the engine): the most any region, or the step after the regions, saves."""
    return max((p.saved_bytes for p in profiles), default=0)
