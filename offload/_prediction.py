"""The record of one prediction: the fake step's counts, the policy table, the longest sequences.

``Prediction`` prints as a table (``__str__``), converts to plain JSON values (``to_dict``: what
``python -m offload predict`` writes to prediction.json) and, with matplotlib installed, plots step
time against activation peak (``write_plot``: pareto.png).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any, Optional, Union

from ._cost import MB, RegionProfile, spill_where
from ._machines import Machine
from ._planner import Plan
from ._predict_count import RegionCount
from ._predict_plan import POLICIES, Longest, PolicyPoint

__all__ = ["Prediction", "write_plot"]

_GB = 1e9


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
        spill = ""
        if m.device_type == "cpu":  # which timeline the planner used (MachineProfile.spare_cores)
            spill = f"; {m.spare_cores} spare core(s), the {spill_where(m.spare_cores)}"
        if m.compute_scale != 1.0:  # a measured CPU, calibrated to a timed reference step
            spill = f"; compute scaled x{m.compute_scale:.2f} to a timed reference step" + spill
        lines = [
            f"prediction for {m.name}: {m.achieved_flops() / 1e12:,.2f} TFLOP/s, "
            f"{m.achieved_memory_gb_per_s():,.1f} GB/s memory, link {m.achieved_link_gb_per_s()[0]:,.2f} GB/s "
            f"({m.link}), all achieved{spill}",
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
