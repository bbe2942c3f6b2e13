"""Predict before renting the GPU: memory and step time of every policy, from the model alone.

``predict(model, *example_args, machine=...)`` runs one training step (forward, loss, backward;
no optimizer step) of a copy of ``model`` on the meta device: the copy's parameters and every
activation are meta tensors, shapes and dtypes without memory, so a 7B-class model predicts on a
laptop. The model's own parameters are never read, moved or copied.

    model ──copy, parameters as meta──▶ one step on meta, under three observers:
        region hooks       which region runs (the regions the engine would use: ``regions=``)
        saved-tensor hooks what each region saves, by the engine's rules (``_hooks.Eligibility``,
                           each storage counted once per step, as the store counts it), and for a
                           selective run what it drops and what it stashes (``_selective``'s split)
        dispatch mode      per op: FLOPs (``torch.utils.flop_counter``'s formulas), bytes touched,
                           and its roofline time on ``machine``:
                               max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) + op cost
    ──▶ RegionProfile per region (bytes counted; times predicted) ──▶ the planner (``make_plan``)
        for the budget, and for every policy over a list of budgets ──▶ ``Prediction``

Backward ops are charged to the region whose saved tensor was unpacked last (autograd unpacks a
node's saves just before running it). On meta, ``scaled_dot_product_attention`` would take its
math path and save sequence² scores; with ``attention=Attention.FUSED`` (the default) it runs the
fused kernel the target would (flash attention; the CPU's own flash kernel on a CPU machine).

Memory a step needs on the device, for "does it fit": the parameters, their gradients and the
optimizer's state (``state_bytes_per_param``), plus the plan's predicted activation peak. The
temporaries of the op running at the peak are not counted. ``longest`` searches the longest
sequence that fits a device memory under each policy, from fake steps at a few lengths fitted by
``_fit`` (bytes linear in tokens, plus a tokens x sequence term where attention is not fused).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ._config import DEFAULT_MIN_OFFLOAD_BYTES
from ._cost import MB, MachineProfile, RegionProfile, Scope
from ._fit import ProfileFit, Shape
from ._machines import Machine, get_machine
from ._planner import MOVES_BYTES, Plan
from ._policy import AutoPolicy, make_plan
from ._predict_count import RegionCount
from ._predict_machine import measure_machine
from ._predict_step import Attention, fake_step
from ._regions import RegionsArg

__all__ = [
    "BUDGET_FRACTIONS",
    "POLICIES",
    "Attention",
    "Longest",
    "WITHOUT_ENGINE",
    "Prediction",
    "PolicyPoint",
    "RegionCount",
    "held_bytes",
    "measure_machine",
    "predict",
    "write_plot",
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

_GB = 1e9
_LONGEST_CAP = 1 << 20
"""The longest sequence ``longest`` tries, tokens."""
_FIT_LENGTHS = (4, 2, 1)
"""``longest`` fits over fake steps at the example's sequence divided by these."""


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    """What one training step of a model costs on a machine, predicted from a fake step."""

    machine: Machine
    regions: tuple[RegionCount, ...]
    """Before the regions, each region, after them (``Scope``)."""
    other_ms: float
    """Predicted time of the step outside the regions (embedding, head, loss; forward and backward)."""
    plan: Plan
    """The plan of ``policy`` at ``budget_mb``."""
    points: tuple[PolicyPoint, ...]
    """Every policy in ``POLICIES`` at every budget fraction."""
    parameter_bytes: int
    state_bytes: int
    """Gradients and optimizer state: what the step holds besides parameters and activations."""
    forward_flops: int
    backward_flops: int
    longest: tuple[Longest, ...] = ()
    longest_memory_bytes: int = 0
    assumed: tuple[str, ...] = ()
    """Where the model branched on a boolean tensor, taken as true (Note: [a branch on a meta bool
    is taken as true]): file:line of each read."""
    wall_s: float = 0.0
    """Seconds the prediction took (the fake step and the planning)."""

    @property
    def profiles(self) -> tuple[RegionProfile, ...]:
        return tuple(r.profile() for r in self.regions)

    @property
    def static_bytes(self) -> int:
        """Parameters, gradients and optimizer state."""
        return self.parameter_bytes + self.state_bytes

    def table(self) -> str:
        """The policy table: one row per policy and budget."""
        header = (
            f"{'policy':<11} {'budget':>8} {'budget MB':>11} {'peak MB':>11} {'held MB':>11} {'step ms':>11}  "
            f"{'fits':<4}  plan"
        )
        lines = [header, "-" * len(header)]
        for p in self.points:
            fraction = "-" if p.budget_fraction is None else f"{p.budget_fraction:.0%}"
            budget = "-" if p.budget_bytes is None else f"{p.budget_bytes / MB:,.1f}"
            lines.append(
                f"{p.policy:<11} {fraction:>8} {budget:>11} {p.peak_bytes / MB:>11,.1f} {p.held_bytes / MB:>11,.1f} "
                f"{p.step_ms:>11.2f}  "
                f"{'yes' if p.fits else 'NO':<4}  {p.decisions}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        m = self.machine
        lines = [
            f"prediction for {m.name}: {m.achieved_flops() / 1e12:,.2f} TFLOP/s, "
            f"{m.achieved_memory_gb_per_s():,.1f} GB/s memory, link {m.achieved_link_gb_per_s()[0]:,.2f} GB/s "
            f"({m.link}), all achieved",
            f"step: {self.forward_flops / 1e12:,.3f} TFLOP forward, {self.backward_flops / 1e12:,.3f} TFLOP backward; "
            f"parameters {self.parameter_bytes / MB:,.1f} MB, "
            f"gradients and optimizer state {self.state_bytes / MB:,.1f} MB",
            "",
            self.table(),
        ]
        if self.assumed:
            lines += ["", "branches on a boolean tensor taken as true: " + ", ".join(sorted(set(self.assumed)))]
        if self.longest:
            lines += ["", f"longest sequence within {self.longest_memory_bytes / _GB:,.1f} GB of device memory:"]
            lines += [
                f"  {x.policy:<11} {x.sequence:>9,}  (activations {x.peak_bytes / MB:,.0f} MB + "
                f"working set {x.working_bytes / MB:,.0f} MB, step {x.step_ms:,.1f} ms)"
                for x in self.longest
            ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        return {
            "machine": dataclasses.asdict(self.machine),
            "regions": [dataclasses.asdict(r) | {"scope": r.scope.value} for r in self.regions],
            "other_ms": self.other_ms,
            "plan": self.plan.to_dict(),
            "points": [dataclasses.asdict(p) for p in self.points],
            "parameter_bytes": self.parameter_bytes,
            "state_bytes": self.state_bytes,
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
            "longest": [dataclasses.asdict(x) for x in self.longest],
            "longest_memory_bytes": self.longest_memory_bytes,
            "assumed": list(self.assumed),
            "wall_s": self.wall_s,
        }


# -- planning --------------------------------------------------------------------------------------


def _decisions(plan: Plan) -> str:
    """How many regions take each decision: "keep x6, offload x26"."""
    counts: dict[str, int] = {}
    for d in plan.decisions:
        counts[d.value] = counts.get(d.value, 0) + 1
    return ", ".join(f"{name} x{n}" for name, n in counts.items())


def _plan(
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


def _points(
    profiles: Sequence[RegionProfile], link: MachineProfile, other_ms: float, fractions: Sequence[float]
) -> tuple[PolicyPoint, ...]:
    keep_peak = make_plan(profiles, link, None, "none", other_ms=other_ms).predicted_peak_bytes
    points = []
    for policy in POLICIES:
        for fraction in fractions:
            budget = int(keep_peak * fraction)
            plan = _plan(profiles, link, policy, budget, other_ms)
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


def _machine(machine: Union[str, Machine, MachineProfile]) -> Machine:
    if isinstance(machine, Machine):
        return machine
    if isinstance(machine, str):
        return get_machine(machine)
    if isinstance(machine, MachineProfile):
        return measure_machine(machine)
    raise TypeError(
        f"machine= takes a machine name, an offload._machines.Machine or offload.probe()'s MachineProfile, "
        f"got {type(machine).__name__}"
    )


def _check_fractions(budgets: Sequence[float]) -> tuple[float, ...]:
    fractions = tuple(budgets)
    for f in fractions:
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (math.isfinite(f) and f >= 0):
            raise ValueError(f"budgets= are fractions of the peak without the engine (1.0 = 100 %), got {f!r}")
    return fractions


def predict(
    model: torch.nn.Module,
    *example_args: Any,
    machine: Union[str, Machine, MachineProfile] = "h100-sxm",
    budget_mb: Optional[float] = None,
    policy: str = "auto",
    regions: RegionsArg = "auto",
    example_kwargs: Optional[dict] = None,
    budgets: Sequence[float] = BUDGET_FRACTIONS,
    attention: Attention = Attention.FUSED,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    state_bytes_per_param: Optional[float] = None,
    longest_in: Optional[Callable[[int], tuple[tuple, dict]]] = None,
    memory_bytes: Optional[int] = None,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
) -> Prediction:
    """Predict one training step of ``model(*example_args, **example_kwargs)`` on ``machine``.

    ``machine``: a name (``offload._machines.machine_names()``), a ``Machine``, or
    ``offload.probe()`` for this machine (its compute is then measured: ``measure_machine``).
    ``budget_mb`` and ``policy`` choose ``Prediction.plan``; ``budgets`` are the fractions of the
    peak without the engine at which every policy in ``POLICIES`` is tabled. ``regions`` as for
    ``offload.engine`` (modules of ``model`` are mapped onto its copy). ``state_bytes_per_param``:
    gradient and optimizer bytes per parameter (default: a gradient and Adam's two moments in the
    parameter's dtype, 3 x its size). ``longest_in(seq) -> (args, kwargs)``: inputs at another
    sequence length; with it, the longest sequence fitting ``memory_bytes`` (default: the
    machine's) under each policy is searched. Raises ``OffloadError`` for an op that cannot run on
    meta tensors, naming it.
    """
    start = time.perf_counter()
    target = _machine(machine)
    fractions = _check_fractions(budgets)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; predict compares: {', '.join(POLICIES)}")
    if not isinstance(attention, Attention):
        raise TypeError(f"attention= takes an offload._predict.Attention, got {attention!r}")
    kwargs = dict(example_kwargs or {})
    run = fake_step(model, example_args, kwargs, target, regions, attention, loss_fn, min_offload_bytes)
    dtype_bytes = run.parameter_bytes / max(1, sum(p.numel() for p in model.parameters()))
    per_param = 3 * dtype_bytes if state_bytes_per_param is None else float(state_bytes_per_param)
    state_bytes = int(sum(p.numel() for p in model.parameters()) * per_param)
    counts = run.counts
    profiles = tuple(c.profile() for c in counts)
    other_ms = sum(c.forward_ms + c.backward_ms for c in counts if c.scope is not Scope.REGION)
    link = target.machine_profile()
    budget = None if budget_mb is None else int(budget_mb * MB)
    plan = _plan(profiles, link, policy, budget, other_ms)
    longest: tuple[Longest, ...] = ()
    memory = target.memory_bytes if memory_bytes is None else int(memory_bytes)
    if longest_in is not None:
        base_seq = next((c.input_dims[-2] for c in counts if c.scope is Scope.REGION and len(c.input_dims) >= 3), 2)
        longest = _longest(
            model,
            longest_in,
            base_seq,
            target,
            regions,
            attention,
            loss_fn,
            min_offload_bytes,
            memory - (run.parameter_bytes + state_bytes),
        )
    return Prediction(
        machine=target,
        regions=counts,
        other_ms=other_ms,
        plan=plan,
        points=_points(profiles, link, other_ms, fractions),
        parameter_bytes=run.parameter_bytes,
        state_bytes=state_bytes,
        forward_flops=sum(c.forward_flops for c in counts),
        backward_flops=sum(c.backward_flops for c in counts),
        longest=longest,
        longest_memory_bytes=memory if longest_in is not None else 0,
        assumed=run.assumed,
        wall_s=time.perf_counter() - start,
    )


def _longest(
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
        return _plan(profiles, link, policy, max(0, free_bytes - working), other_ms, quick=quick), working

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


def write_plot(prediction: Prediction, path: Union[str, Path]) -> Optional[Path]:
    """Step time against activation peak of every policy point, Pareto front marked, as a PNG at
    ``path``; None where matplotlib is not installed (it is optional)."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in POLICIES:
        points = [p for p in prediction.points if p.policy == policy]
        ax.scatter([p.peak_bytes / MB for p in points], [p.step_ms for p in points], label=policy)
    ordered = sorted(prediction.points, key=lambda p: (p.peak_bytes, p.step_ms))
    front, best = [], math.inf
    for p in ordered:
        if p.step_ms < best:
            front.append(p)
            best = p.step_ms
    ax.plot([p.peak_bytes / MB for p in front], [p.step_ms for p in front], "k--", linewidth=0.8, label="Pareto front")
    ax.set_xlabel("predicted activation peak, MB")
    ax.set_ylabel("predicted step, ms")
    ax.set_title(f"offload.predict on {prediction.machine.name}")
    ax.legend(fontsize=8)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out
