"""Every policy priced on the fake step's profiles: the policy table, and the longest sequence each fits.

Numbers in, plans out (``_plan.policy.make_plan``); the only step run here is ``longest_sequences``'
fake steps at a few lengths.

    RegionProfile per region ──▶ plan_policy(policy, budget) ──▶ Plan
        policy_points:      every policy in ``POLICIES`` at every fraction of the peak without the
                            engine ──▶ PolicyPoint (peak, held, step time, fits)
        longest_sequences:  fake steps at the example's sequence / ``_FIT_LENGTHS``, fitted by
                            ``_plan.fit`` (bytes linear in tokens, plus a tokens x sequence term where
                            attention is not fused) ──▶ per policy, a doubling then a bisection over
                            lengths ──▶ Longest

Memory a step needs on the device, for "does it fit" (``device_bytes``): the parameters, their
gradients and the optimizer's state, plus what the engine holds carrying the plan out
(``held_bytes``), the saves of a region being reloaded or re-run (``_working_bytes``), and the
step's largest transient (``transient``: the loss's logits and their gradient), against the
device's usable memory (``Machine.usable_memory_bytes``).

"auto" in the table is the fastest plan the planner finds at that budget or, priced at that budget,
at any smaller budget of the table (Note: [the best plan never gets cheaper as the budget falls]),
without rule 6's stability margin (``AutoPolicy.stable_margin``: a prediction has no measurement
noise to be stable against).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch

from .._cost import MachineProfile, RegionProfile, Scope
from .._plan.fit import ProfileFit, Shape
from .._plan.planner import MOVES_BYTES, Decision, Plan, build_plan
from .._plan.policy import AutoPolicy, make_plan
from .._regions.regions import RegionsArg
from .fake_step import Attention, fake_step
from .machines import Machine
from .selective_rule import BUILT_IN, SelectiveRule

__all__ = [
    "BUDGET_FRACTIONS",
    "POLICIES",
    "SELECTIVE_MEANS",
    "WITHOUT_ENGINE",
    "DeviceMemory",
    "Longest",
    "PolicyPoint",
    "device_bytes",
    "held_bytes",
    "longest_sequences",
    "plan_policy",
    "policy_points",
]

POLICIES = ("none", "checkpoint", "checkpoint-partial", "offload", "recompute", "selective", "auto")
"""The policies a prediction compares. "checkpoint" is ``torch.utils.checkpoint`` on every region
without the engine: its inputs kept, one more forward in backward, which is what "recompute"
costs in this model too (the engine's recompute may stop early; the prediction does not count on it).
"checkpoint-partial" is ``torch.utils.checkpoint`` on the fewest regions whose peak meets the budget,
spread evenly (every k-th where that many is a k-th of them), the others kept: the public recipes'
partial checkpointing, recomputing only as much as the budget needs (``partial_checkpoint``).
"selective" is this engine's (``SELECTIVE_MEANS``), not Megatron-LM's selective recompute."""
SELECTIVE_MEANS = (
    "selective re-runs each region's cheap ops in backward (norms, activations, elementwise and rotary ops; "
    "their outputs dropped) and keeps or moves the outputs of its matmuls and attention: not Megatron-LM's "
    "selective recompute, which re-runs attention's core (scores, softmax, dropout, softmax x V) and keeps the rest"
)
"""What the "selective" rows re-run, said under the table so that nobody compares them with
Megatron-LM's figures (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2)."""
WITHOUT_ENGINE = ("none", "checkpoint", "checkpoint-partial")
"""The policies of ``POLICIES`` that run without the engine, so are priced without its host costs
(``MachineProfile.without_host_costs``): the model as it is, and ``torch.utils.checkpoint``."""
BUDGET_FRACTIONS = (1.0, 0.5, 0.25, 0.1)
"""The budgets of the policy table, as fractions of the activation peak without the engine."""

_AUTO = AutoPolicy(stable_margin=0.0)
""""auto" as a prediction prices it: the planner's search without rule 6's stability margin."""
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
    """The plan's peak fits its budget."""
    decisions: str
    """The plan's decisions, run-length coded: "keep x2, offload x6"."""
    device_bytes: int = 0
    """What the step needs of the device's memory under this plan: parameters, gradients, optimizer
    state, ``held_bytes``, the working set of a region being reloaded or re-run, and the step's
    largest transient (see the module docstring)."""
    fits_device: bool = True
    """``device_bytes`` fits the device's usable memory (``Machine.usable_memory_bytes``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Longest:
    """The longest sequence whose parameters, gradients, optimizer state, activation peak and working
    set fit the device memory under one policy (0: not even one token). Searched up to ``_LONGEST_CAP``."""

    policy: str
    sequence: int
    peak_bytes: int
    """The plan's predicted activation peak at that length."""
    working_bytes: int
    """The running region's own saves and the step's largest transient on top of it."""
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
    if policy == "checkpoint-partial":
        return partial_checkpoint(tuple(profiles), link, budget, other_ms)
    if policy == "auto":
        engine_policy = AutoPolicy(max_search_moves=0, stable_margin=0.0) if quick else _AUTO
    if engine_policy in ("none", "recompute", "selective"):
        plan = make_plan(profiles, link, None, engine_policy, other_ms=other_ms)
        fits = budget is None or plan.predicted_peak_bytes <= budget
        return dataclasses.replace(plan, policy=policy, budget_bytes=budget, fits_budget=fits)
    return dataclasses.replace(make_plan(profiles, link, budget, engine_policy, other_ms=other_ms), policy=policy)


def spread(count: int, n: int) -> tuple[int, ...]:
    """``n`` of ``count`` regions spread evenly, from the first: every k-th where ``n`` is ``count / k``."""
    return tuple(sorted({i * count // n for i in range(n)}))


def partial_checkpoint(
    profiles: tuple[RegionProfile, ...], link: MachineProfile, budget: Optional[int], other_ms: float
) -> Plan:
    """torch.utils.checkpoint on the fewest regions (``spread`` evenly) whose predicted peak meets
    ``budget``, the others kept: none where there is no budget or keeping all meets it, all where
    nothing less does (the plan then does not fit when even that does not). Priced as ``link``
    says (without the engine's host costs: ``WITHOUT_ENGINE``)."""
    plan = make_plan(profiles, link, None, "none", other_ms=other_ms)
    region_at = [i for i, p in enumerate(profiles) if p.scope is Scope.REGION]
    if budget is not None and plan.predicted_peak_bytes > budget:
        base = _decisions_of(make_plan(profiles, link, None, "recompute", other_ms=other_ms), profiles)
        for n in range(1, len(region_at) + 1):
            chosen = {region_at[i] for i in spread(len(region_at), n)}
            decisions = tuple(d if i in chosen else Decision.KEEP for i, d in enumerate(base))
            plan = build_plan(profiles, decisions, link, None, "checkpoint-partial", other_ms)
            if plan.predicted_peak_bytes <= budget:
                break
    fits = budget is None or plan.predicted_peak_bytes <= budget
    return dataclasses.replace(plan, policy="checkpoint-partial", budget_bytes=budget, fits_budget=fits)


def held_bytes(plan: Plan, keep_peak_bytes: int) -> int:
    """The most the engine holds carrying ``plan`` out: its predicted peak, or where it moves bytes
    over the link and has a budget, up to that budget (the store prefetches moved entries back into
    the room left under it, and holds no more than the step saves: ``keep_peak_bytes``)."""
    moves = any(r.decision in MOVES_BYTES for r in (*plan.regions, *plan.outside))
    if not moves or plan.budget_bytes is None:
        return plan.predicted_peak_bytes
    return max(plan.predicted_peak_bytes, min(plan.budget_bytes, keep_peak_bytes))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """What a step needs of the device besides its activations, and what the device has."""

    static_bytes: int
    """Parameters, their gradients and the optimizer's state."""
    transient_bytes: int
    """The step's largest transient (``StepRun.transient_bytes``)."""
    usable_bytes: int
    """The device's usable memory (``Machine.usable_memory_bytes``)."""


def _decisions_of(plan: Plan, profiles: Sequence[RegionProfile]) -> tuple[Decision, ...]:
    """``plan``'s decision for each of ``profiles``, the saves outside the regions included."""
    by_name = {r.name: r.decision for r in (*plan.outside, *plan.regions)}
    return tuple(by_name[p.name] for p in profiles)


def device_bytes(plan: Plan, profiles: Sequence[RegionProfile], keep_peak_bytes: int, memory: DeviceMemory) -> int:
    """What the step needs of the device under ``plan`` (see the module docstring)."""
    decisions = _decisions_of(plan, profiles)
    working = _working_bytes([p for p, d in zip(profiles, decisions, strict=True) if d is not Decision.KEEP])
    return memory.static_bytes + held_bytes(plan, keep_peak_bytes) + working + memory.transient_bytes


# Note: [the best plan never gets cheaper as the budget falls]
#     A plan that fits a budget fits every larger one, and costs no more there (the planner's time
#     model only loses room as the budget falls: See Note: [a reload is one stream of reads on one
#     back-link] in ``_plan.planner``). So the fastest plan that fits a budget is never slower than the
#     fastest that fits a smaller one. "auto" is a search, not the proven fastest: the plan it finds at a
#     smaller budget can beat the one it finds at a larger. The table's "auto" takes, at each
#     budget, the faster of its own plan and the plans found at the smaller budgets, priced at
#     this one, so its step never falls as the budget falls.


def policy_points(
    profiles: Sequence[RegionProfile],
    link: MachineProfile,
    other_ms: float,
    fractions: Sequence[float],
    memory: Optional[DeviceMemory] = None,
) -> tuple[PolicyPoint, ...]:
    """Every policy in ``POLICIES`` at every fraction of the peak without the engine; with
    ``memory``, what each needs of the device and whether it fits."""
    keep_peak = make_plan(profiles, link, None, "none", other_ms=other_ms).predicted_peak_bytes
    profiles = tuple(profiles)
    ordered = sorted(set(fractions))  # smallest budget first
    plans: dict[str, dict[float, Plan]] = {}
    for policy in POLICIES:
        plans[policy] = {}
        for fraction in ordered:
            budget = int(keep_peak * fraction)
            plan = plan_policy(profiles, link, policy, budget, other_ms)
            if policy == "auto":
                plan = _best_auto(plan, plans, profiles, link, budget, other_ms, keep_peak, memory)
            plans[policy][fraction] = plan
    points = []
    for policy in POLICIES:
        for fraction in fractions:
            plan = plans[policy][fraction]
            needed = 0 if memory is None else device_bytes(plan, profiles, keep_peak, memory)
            points.append(
                PolicyPoint(
                    policy=policy,
                    budget_fraction=fraction,
                    budget_bytes=int(keep_peak * fraction),
                    peak_bytes=plan.predicted_peak_bytes,
                    held_bytes=held_bytes(plan, keep_peak),
                    step_ms=plan.predicted_step_ms,
                    fits=plan.fits_budget,
                    decisions=_decisions(plan),
                    device_bytes=needed,
                    fits_device=memory is None or needed <= memory.usable_bytes,
                )
            )
    return tuple(points)


# Note: [auto never takes a plan over the device when one fits]
#     The planner's search knows the budget, not the device: at a large budget its fastest plan can
#     keep more than the device holds once the training state and the working set are added, while a
#     plan of a smaller budget, or a fixed policy's, fits both. The table's "auto" prices each of those
#     candidates at its own budget and takes the fastest that fits the budget and the device; only
#     where none fits the device does it take the fastest that fits the budget.


def _best_auto(
    plan: Plan,
    plans: dict[str, dict[float, Plan]],
    profiles: tuple[RegionProfile, ...],
    link: MachineProfile,
    budget: int,
    other_ms: float,
    keep_peak: int,
    memory: Optional[DeviceMemory],
) -> Plan:
    """ "auto" at ``budget``: the fastest of its own ``plan``, the plans it found at smaller budgets
    and the engine's fixed policies' plans at any budget of the table, each priced at this
    budget (See Note: [the best plan never gets cheaper as the budget falls]); one that fits the
    device before any that does not (See Note: [auto never takes a plan over the device when one fits])."""
    candidates = [plan]
    for policy, by_fraction in plans.items():
        if policy in WITHOUT_ENGINE:
            continue
        for other in by_fraction.values():
            candidates.append(build_plan(profiles, _decisions_of(other, profiles), link, budget, "auto", other_ms))

    def rank(candidate: Plan) -> tuple[bool, float]:
        over = memory is not None and device_bytes(candidate, profiles, keep_peak, memory) > memory.usable_bytes
        return over, candidate.predicted_step_ms

    fitting = [c for c in candidates if c.fits_budget]
    return min(fitting, key=rank) if fitting else plan


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
    *,
    extra_ms: float = 0.0,
    rule: SelectiveRule = BUILT_IN,
) -> tuple[Longest, ...]:
    """Per policy, the longest sequence whose predicted activation peak plus working set fits
    ``free_bytes`` (usable device memory less parameters, gradients and optimizer state), searched
    over profiles fitted (``_plan.fit``) to fake steps at ``base_seq`` and fractions of it; the working
    set is the largest region's saves plus the step's largest transient, taken as growing with the
    sequence at the most bytes per token any of those steps had. ``extra_ms``: time every step adds
    whatever its length (a sharded step's exposed collectives)."""
    fit: Optional[ProfileFit] = None
    dims: tuple[int, ...] = ()
    transient_per_token = 0.0  # the largest transient grows with the tokens (the loss's logits)
    for divisor in _FIT_LENGTHS:
        args, kwargs = inputs_at(max(2, base_seq // divisor))
        run = fake_step(model, args, kwargs, machine, regions, attention, loss_fn, min_offload_bytes, rule)
        dims = next((c.input_dims for c in run.counts if c.scope is Scope.REGION and len(c.input_dims) >= 3), ())
        if not dims:
            raise ValueError(
                "longest_in=: the regions' first input is not (batch, sequence, width), so its sequence cannot be "
                "varied; pass regions whose first input is"
            )
        if fit is None:
            fit = ProfileFit([c.name for c in run.counts])
        transient_per_token = max(transient_per_token, run.transient_bytes / dims[-2])
        shape = Shape.of(dims)
        fit.add(shape, [c.profile() for c in run.counts])
        fit.add_other(shape, sum(c.forward_ms + c.backward_ms for c in run.counts if c.scope is not Scope.REGION))
    assert fit is not None  # _FIT_LENGTHS is not empty
    link = machine.machine_profile()

    def plan_at(policy: str, seq: int, quick: bool) -> tuple[Plan, int]:
        profiles, other_ms = fit.derive(Shape.of((*dims[:-2], seq, dims[-1])))
        working = _working_bytes(profiles) + int(transient_per_token * seq)
        return plan_policy(
            profiles, link, policy, max(0, free_bytes - working), other_ms + extra_ms, quick=quick
        ), working

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
