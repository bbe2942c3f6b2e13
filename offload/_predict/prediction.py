"""The record of one prediction: the fake step's counts, the policy table, the longest sequences.

``Prediction`` prints as a table (``__str__``): first whether one step fits on the device, then
the machine and the step, the table, and under it what the step includes and excludes and every
assumption it was priced on (``assumptions()``). It converts to plain JSON values (``to_dict``:
what ``python -m offload predict`` writes to prediction.json, the same statements included) and,
with matplotlib installed, plots step time against activation peak (``write_plot``: pareto.png).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any, Optional, Union

from .._cost import RegionProfile, spill_where
from .._plan.planner import Plan
from .count import RegionCount
from .machines import Machine
from .sharding import NOT_SHARDED, Sharding
from .table import POLICIES, SELECTIVE_MEANS, WITHOUT_ENGINE, Longest, PolicyPoint

__all__ = ["EXCLUDES", "INCLUDES", "Prediction", "write_plot"]

_GB = 1e9
_MIB = 1 << 20
"""Every memory figure of the printout is in MiB (2**20 bytes), every time in ms."""
_POLICY_WIDTH = 19
NOT_IN_BUDGET = "does not meet this budget"
"""What a row says in place of its price where the policy's peak exceeds the row's budget."""

INCLUDES = "the forward, the loss and the backward of one micro-batch on one device"
"""What a predicted step is."""
SHARDED_INCLUDES = "; and the exposed part of FSDP's all-gathers and reduce-scatters (sharded_over=)"
"""What a sharded step adds to ``INCLUDES``."""
EXCLUDES = (
    "the optimizer step",
    "tensor parallelism's and DDP's communication, and FSDP's unless priced with sharded_over=",
    "data loading",
    "torch.compile's fusions",
)
"""What a predicted step leaves out: not modelled, so add them where they are exposed."""


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
    transient_bytes: int = 0
    """The step's largest transient: the most bytes its ops held at once besides the saves and the
    parameters' gradients (``transient``), counted in every point's ``device_bytes``."""
    memory_bytes: int = 0
    """Device memory the step may use, bytes: the machine's usable memory
    (``Machine.usable_memory_bytes``) unless the caller gave another figure."""
    state: str = ""
    """What the step holds per parameter besides it (``OptimizerState.describe``)."""
    attention: str = ""
    """How attention was counted, and why (the argument, or the model's config)."""
    selective: str = SELECTIVE_MEANS
    """What the "selective" rows re-run: the built-in rule (``SELECTIVE_MEANS``) or the one given
    (``predict(selective_rule=...)``, ``selective_rule``)."""
    sharding: Sharding = NOT_SHARDED
    """What sharding the training state over GPUs holds and costs (``predict(sharded_over=N)``);
    its exposed collectives are in every point's step."""

    @property
    def includes(self) -> str:
        """What the predicted step is."""
        return INCLUDES + (SHARDED_INCLUDES if self.sharding.gpus > 1 else "")

    @property
    def profiles(self) -> tuple[RegionProfile, ...]:
        return tuple(r.profile() for r in self.regions)

    @property
    def static_bytes(self) -> int:
        """Parameters, gradients and optimizer state."""
        return self.parameter_bytes + self.state_bytes

    def table(self) -> str:
        """The policy table: one row per policy and budget, memory in MiB and time in ms; "fits" is
        against the device's usable memory, "in budget" against the row's budget. A policy that
        takes no budget (``WITHOUT_ENGINE``, "recompute", "selective") and whose peak exceeds a row's
        budget is not priced under it: the row says it does not meet this budget, with its peak."""
        header = (
            f"{'policy':<{_POLICY_WIDTH}} {'budget':>8} {'budget MiB':>11} {'peak MiB':>11} {'held MiB':>11} "
            f"{'step ms':>11}  {'in budget':<9}  {'device MiB':>11}  {'fits':<4}  plan"
        )
        lines = [header, "-" * len(header)]
        for p in self.points:
            fraction = "-" if p.budget_fraction is None else f"{p.budget_fraction:.0%}"
            budget = "-" if p.budget_bytes is None else f"{p.budget_bytes / _MIB:,.1f}"
            head = f"{p.policy:<{_POLICY_WIDTH}} {fraction:>8} {budget:>11} {p.peak_bytes / _MIB:>11,.1f}"
            if not p.fits:
                lines.append(f"{head} {NOT_IN_BUDGET}")
                continue
            lines.append(
                f"{head} {p.held_bytes / _MIB:>11,.1f} {p.step_ms:>11.2f}  {'yes':<9}  "
                f"{p.device_bytes / _MIB:>11,.0f}  {'yes' if p.fits_device else 'NO':<4}  {p.decisions}"
            )
        return "\n".join(lines)

    def fit_summary(self) -> str:
        """Whether one step fits on the device: without the engine, and the fastest way with it."""
        m = self.machine
        memory = f"{self.memory_bytes / _MIB:,.0f} MiB usable of {m.name}'s {m.memory_bytes / _MIB:,.0f}"
        plain = next((p for p in self.points if p.policy == "none"), None)
        if plain is None:
            return f"fits on the device ({memory}): no policy was tabled"
        fitting = sorted(
            (p for p in self.points if p.fits_device and (p.fits or p.policy in WITHOUT_ENGINE)),
            key=lambda p: p.step_ms,
        )
        if plain.fits_device:
            verdict = (
                f"yes without the engine (needs {plain.device_bytes / _MIB:,.0f} MiB, step {plain.step_ms:,.1f} ms)"
            )
        else:
            verdict = f"NO without the engine (needs {plain.device_bytes / _MIB:,.0f} MiB)"
        if not plain.fits_device and fitting:
            best = fitting[0]
            at = "" if best.policy in ("none", "checkpoint") else f" at {best.budget_fraction:.0%} of the peak"
            verdict += (
                f"; yes with {best.policy}{at} (needs {best.device_bytes / _MIB:,.0f} MiB, "
                f"step {best.step_ms:,.1f} ms, "
                f"x{best.step_ms / plain.step_ms:.2f} the step without the engine)"
            )
        elif not fitting:
            verdict += "; NO under any policy and budget of the table"
        return f"does one step fit on the device ({memory})? {verdict}"

    def assumptions(self) -> tuple[str, ...]:
        """Every assumption the prediction was priced on, one a line."""
        m, a = self.machine, self.machine.assumptions
        out_gb_per_s, back_gb_per_s, _ = m.achieved_link_gb_per_s()
        lines = [
            f"compute: {a.flops_fraction:g} of {m.peak_flops / 1e12:,.0f} TFLOP/s peak dense bf16"
            + (" (given)" if "peak_flops" in m.given else "")
            + f" ({a.flops_source})"
            + ("" if m.peak_fp8_flops is None else f"; fp8 peak {m.peak_fp8_flops / 1e12:,.0f} TFLOP/s, not used"),
            "fused attention kernels: "
            + (
                "as the matmuls"
                if a.attention_fraction is None
                else f"{a.attention_fraction:g} of peak ({a.attention_source})"
            ),
            f"memory-bound ops: {a.memory_fraction:g} of {m.memory_gb_per_s:,.0f} GB/s; {a.op_overhead_us:g} us an op",
            f"link ({m.link}): {out_gb_per_s:,.1f} GB/s out, {back_gb_per_s:,.1f} GB/s back",
            f"engine host costs: {a.held_tensor_overhead_us:g} us a saved tensor, {a.per_tensor_overhead_us:g} us a "
            f"tensor moved, {a.dispatch_overhead_us:g} us an op under selective's dispatch modes",
            f"device memory: {m.memory_bytes / _MIB:,.0f} MiB ({m.memory_source or m.source}), less "
            f"{a.context_mib:,.0f} MiB of CUDA context and {a.allocator_fraction:.0%} held by the caching allocator: "
            f"{m.usable_memory_bytes() / _MIB:,.0f} MiB usable"
            + ("" if self.memory_bytes == m.usable_memory_bytes() else f"; {self.memory_bytes / _MIB:,.0f} MiB given"),
            "GPU interconnect: "
            + (
                "not known"
                if m.interconnect_gb_per_s is None
                else f"{m.interconnect} at {m.interconnect_gb_per_s:,.0f} GB/s a direction, "
                f"{m.gpus_per_node} GPUs a node"
            )
            + "; between nodes: "
            + (
                "not known"
                if m.internode_gb_per_s is None
                else f"{m.internode}, {m.internode_gb_per_s:,.0f} GB/s a GPU"
            ),
            f"gradients and optimizer state: {self.state}",
            "sharding: " + (self.sharding.text or "none (the training state whole on one device; sharded_over=1)"),
            f"attention: {self.attention}",
            "dropout: "
            + (
                "CUDA's native_dropout, a 1-byte bool mask saved"
                if m.device_type == "cuda"
                else "as written (the noise saved in the activation's dtype)"
            ),
            f"largest transient: {self.transient_bytes / _MIB:,.0f} MiB (what the step's ops hold at once besides "
            "its saves: at an LM's loss, the logits and their gradient), in every row's device MiB",
        ]
        if m.given:
            lines.append(f"machine figures given, not from its source: {', '.join(m.given)}")
        if self.assumed:
            lines.append("branches on a boolean tensor taken as true: " + ", ".join(sorted(set(self.assumed))))
        return tuple(lines)

    def __str__(self) -> str:
        m = self.machine
        spill = ""
        if m.device_type == "cpu":  # which timeline the planner used (MachineProfile.spare_cores)
            spill = f"; {m.spare_cores} spare core(s), the {spill_where(m.spare_cores)}"
        if m.compute_scale != 1.0:  # a measured CPU, calibrated to a timed reference step
            spill = f"; compute scaled x{m.compute_scale:.2f} to a timed reference step" + spill
        lines = [
            self.fit_summary(),
            f"prediction for {m.name}: {m.achieved_flops() / 1e12:,.2f} TFLOP/s, "
            f"{m.achieved_memory_gb_per_s():,.1f} GB/s memory, link {m.achieved_link_gb_per_s()[0]:,.2f} GB/s "
            f"({m.link}), all achieved{spill}",
            f"step: {self.forward_flops / 1e12:,.3f} TFLOP forward, {self.backward_flops / 1e12:,.3f} TFLOP backward; "
            f"parameters {self.parameter_bytes / _MIB:,.1f} MiB, "
            f"gradients and optimizer state {self.state_bytes / _MIB:,.1f} MiB"
            + (
                f"; held per GPU, sharded over {self.sharding.gpus}: {self.sharding.static_bytes / _MIB:,.1f} MiB"
                if self.sharding.gpus > 1
                else ""
            ),
            "",
            self.table(),
            "",
            f"step: {self.includes}; not modelled, so not in it: {'; '.join(EXCLUDES)}",
            self.selective,
            "assumed:",
            *(f"  {line}" for line in self.assumptions()),
        ]
        if self.longest:
            lines += ["", f"longest sequence within {self.longest_memory_bytes / _MIB:,.0f} MiB of device memory:"]
            lines += [
                f"  {x.policy:<{_POLICY_WIDTH}} {x.sequence:>9,}  (activations {x.peak_bytes / _MIB:,.0f} MiB + "
                f"working set {x.working_bytes / _MIB:,.0f} MiB, step {x.step_ms:,.1f} ms)"
                for x in self.longest
            ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        return {
            "fits": self.fit_summary(),
            "machine": dataclasses.asdict(self.machine),
            "regions": [dataclasses.asdict(r) | {"scope": r.scope.value} for r in self.regions],
            "other_ms": self.other_ms,
            "plan": self.plan.to_dict(),
            "points": [dataclasses.asdict(p) for p in self.points],
            "parameter_bytes": self.parameter_bytes,
            "state_bytes": self.state_bytes,
            "transient_bytes": self.transient_bytes,
            "memory_bytes": self.memory_bytes,
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
            "longest": [dataclasses.asdict(x) for x in self.longest],
            "longest_memory_bytes": self.longest_memory_bytes,
            "step_includes": self.includes,
            "sharding": dataclasses.asdict(self.sharding),
            "step_excludes": list(EXCLUDES),
            "selective": self.selective,
            "assumptions": list(self.assumptions()),
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
        ax.scatter([p.peak_bytes / _MIB for p in points], [p.step_ms for p in points], label=policy)
    ordered = sorted(prediction.points, key=lambda p: (p.peak_bytes, p.step_ms))
    front, best = [], math.inf
    for p in ordered:
        if p.step_ms < best:
            front.append(p)
            best = p.step_ms
    front_mib = [p.peak_bytes / _MIB for p in front]
    ax.plot(front_mib, [p.step_ms for p in front], "k--", linewidth=0.8, label="Pareto front")
    ax.set_xlabel("predicted activation peak, MiB")
    ax.set_ylabel("predicted step, ms")
    ax.set_title(f"offload.predict on {prediction.machine.name}")
    ax.legend(fontsize=8)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out
