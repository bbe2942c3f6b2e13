"""The planner: per-region decisions from measured numbers, and the cost model that ranks them.

Numbers in, plan out. Nothing here touches torch, a device or a file, so every rule can be
tested with made-up profiles on any machine. This module owns the decision shapes
(``Decision``, ``RegionPlan``, ``Plan``), the timeline cost model (``simulate``) and the entry
point (``policy.make_plan``); *how* decisions are chosen lives in the policies of ``policy``.

Each region (e.g. one transformer block) is, for one training step:

    KEEP       its saved activations stay on the device: costs memory, no time
    OFFLOAD    they are copied out after its forward and back before its backward: costs link
               time, which is free when it hides behind compute
    RECOMPUTE  only its inputs stay; backward re-runs its forward first: costs one forward
    SELECTIVE  its inputs and the outputs of its expensive ops (matmul, attention, convolution:
               the "stash") stay; backward re-runs only its cheap ops first: costs their time
    SELECTIVE_OFFLOAD  the same, with the stash copied out and back like an OFFLOAD region's
               saves: costs the cheap ops' time plus the stash's exposed transfer

The timeline (regions r0..r3; r0, r1 OFFLOAD, r2, r3 KEEP; the link slower than compute):

    compute    |r0 fwd|r1 fwd|r2 fwd|r3 fwd|r3 bwd......|r2 bwd......|wait|r1 bwd......|r0 bwd......|
    out-link          |copy r0....|copy r1....|
    back-link                                |load r1....................| |load r0...|
                                           ^ forward ends, backward starts; copy r1 still in flight

Assumptions, all of them:

- One compute stream. Forward runs regions in order; backward in reverse, each region taking its
  measured ``backward_ms`` (or ``BACKWARD_TO_FORWARD`` times its forward where none was measured),
  plus, if it is recomputed, its measured ``recompute_ms`` first (one more forward where none
  was measured), or if it is selective, its measured ``selective_ms`` (a plan chooses SELECTIVE
  only for regions where that was measured). Without an engine a step is the forward and
  backward sums plus ``other_ms``, the measured rest of the step (the baseline).
- Copies out start when a region's forward ends and queue in order on one out-link; the
  forward of later regions runs concurrently. The link does *not* have to drain before
  backward begins: a copy still in flight only delays the reload of its own region, and keeps
  its bytes on the device until it lands.
- Reloads run on a separate back-link (full duplex: out and back never slow each other; on
  real PCIe both at once can cost either up to half, so a plan whose copies spill into backward
  is optimistic). They go in reverse region order on that one link, at most one ahead of use:
  the reload of an offloaded region starts no earlier than the backward start of the offloaded
  region after it (or the end of the forward, for the last one), no earlier than its own copy
  out has landed and no earlier than the reads before it are done, and otherwise as late as
  still lands it on time (an ideal prefetcher). What has not landed when its backward asks is
  read from then on (beside the backward where the budget leaves room, below); the backward's
  wait for it is the region's exposed transfer time (Note: [a reload is one stream of reads on
  one back-link]).
- The per-tensor engine cost (``machine.per_tensor_overhead_us * num_tensors``) is paid on the
  compute stream, during the forward of each OFFLOAD region. A SELECTIVE_OFFLOAD region is an
  OFFLOAD region of its stash (``expensive_bytes``, ``expensive_tensors``) in every rule here, with
  its inputs resident like a RECOMPUTE region's.
- The engine's host costs are paid on the compute stream too: every saved tensor its store takes,
  kept or moved, costs ``machine.held_tensor_overhead_us`` in the forward (a KEEP or OFFLOAD
  region's ``num_tensors``, a selective region's stash; a recomputed region's saves go to its
  frame's placeholders instead, as ``torch.utils.checkpoint``'s go to its own, and are not
  charged); a selective region costs ``machine.dispatch_overhead_us`` per op its forward dispatches
  (``forward_dispatches``) in the forward, under the stash mode, and again in its re-run, under the
  replay mode. A step without the engine prices with ``MachineProfile.without_host_costs()``.
- On the CPU (``machine.device_type == "cpu"``) there is no copy engine: the "link" is the spill
  threads copying bytes into and out of the page cache. Where torch's intra-op threads take every
  core the process may use (``machine.spare_cores == 0``, torch's default) they share the
  compute's cores and nothing hides: each OFFLOAD region's write is paid on the compute timeline
  right after its forward, and its read right before its backward (the sweep's results in
  ``bench/results/sweep-cpu*.md`` show what that costs). Where cores are spare (torch set to
  fewer threads than the process has cores) the spill threads run beside the compute and their
  writes and reads queue as a copy engine's copies do (``bench/results/predict-cpu.md``).
- A link with 0 GB/s either way is unusable: an OFFLOAD over it would never come back, so
  ``simulate`` refuses it (``ValueError``); policies choose RECOMPUTE there instead.
- Memory counts what the engine holds *for later*, which is what the budget bounds: KEEP
  regions' saved bytes, RECOMPUTE and SELECTIVE_OFFLOAD regions' inputs and SELECTIVE regions'
  inputs plus stash, from the end of the region's forward to the end of its backward. OFFLOAD
  regions add nothing: the engine streams them tensor by tensor, evicting at save time with
  copies in flight bounded inside the budget, and prefetches them back only into room left under
  the budget, handing each to autograd as it is unpacked. Working
  memory of the region being run (its forward's temporaries, a recomputed or reloaded region's
  tensors during its own backward) is not counted: it exists with or without the engine. The
  engine counts copies in flight against the budget, and so does the time model: where the
  room the budget leaves beside what the kept regions hold is smaller than what the out-link has
  queued, the compute waits at the end of the region's forward until the queue fits the room (at
  budget 0, for every copy: the serial timeline); in backward a reload reads ahead only into the
  room left, and the rest of it is read as backward asks for it. The room holds whole
  tensors (a region's ``largest_tensor_bytes``, where measured): with room for one of them or
  none, the rest's reads and the backward take turns; with room for three or more the prefetch
  runs the rest's reads beside the backward (half of that with two). Seen on MiniGPT, 4 x 256,
  batch 4, every block offloaded to disk, on the 2-vCPU Intel Xeon of ``bench/results/shapes-cpu.md``
  ("derive with the room counted in whole tensors", 2026-12-03): at an 8 MB
  budget, backward waited on reads 14-17 ms a step at sequence 250 (largest tensor 2.9 MB, room
  for two), 45 ms at 331 (3.9 MB, two), 150-155 ms at 414 (4.9 MB, one), for 1.7x the bytes of
  250; at 414 with a 16 MB budget (room for three) 20 ms, with 24 MB (four) 10 ms. On a GPU and
  on a CPU with a core spare alike; a CPU without one is serial anyway.
  Where a free and an allocation fall at the same instant the free goes first. So the peak
  never drops below the largest region: its own backward needs all of its bytes.

Exposed time adds up: ``predicted_step_ms = baseline_step_ms + sum(region.exposed_ms)``.

The link's figures come from ``offload.probe()``, which times one large buffer with nothing else
running. A training step moves many tensors while compute runs, so ``calibrate_link`` scales all
transfer costs by one factor fitted to a measured step that offloaded every region (see
``_regions.regions``); the model's shape stays, its level is measured.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from .._cost import MB, MachineProfile, RegionProfile, Scope

__all__ = [
    "AFTER_IN_BACKWARD",
    "MOVES_BYTES",
    "allowed",
    "as_stored",
    "coerce",
    "SELECTIVE_DECISIONS",
    "Decision",
    "Footprint",
    "Plan",
    "RegionPlan",
    "build_plan",
    "calibrate_link",
    "check_inputs",
    "copies_share_compute",
    "footprint",
    "host_ms",
    "link_ms",
    "link_usable",
    "region_transfer_ms",
    "scale_link",
    "simulate",
    "timeline",
    "Timeline",
]

logger = logging.getLogger(__name__)

BACKWARD_TO_FORWARD = 2.0
"""Backward time over forward time of a region: each forward matmul becomes two in backward
(gradient of the input and of the weight), so ~2x."""

AFTER_IN_BACKWARD = (
    "most of it was saved while autograd ran a backward inside the engine (torch.autograd.grad with "
    "create_graph=True: a gradient penalty's graph, a double backward), which no region covers"
)
"""The note of the saves after the regions where most were made during a backward: no LM head's."""

_BYTES_PER_GB = 1e9
"""GB as bandwidths count it (``MachineProfile`` fields are GB/s of 1e9 bytes)."""
_MS_PER_S = 1e3
_MS_PER_US = 1e-3


class Decision(enum.Enum):
    """What happens to one region's saved activations."""

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"
    SELECTIVE = "selective"
    SELECTIVE_OFFLOAD = "selective+offload"


MOVES_BYTES = (Decision.OFFLOAD, Decision.SELECTIVE_OFFLOAD)
"""Decisions that copy bytes out over the link (and so need a usable one)."""
SELECTIVE_DECISIONS = (Decision.SELECTIVE, Decision.SELECTIVE_OFFLOAD)
"""Decisions that run a region selectively (only for regions whose selective run was measured)."""


def allowed(region: RegionProfile, decision: Decision) -> bool:
    """Whether ``region`` may take ``decision``: the selective ones only where a selective run was
    measured; the saves outside the regions are never re-run, and those before or between the
    regions are always kept (see ``Scope``)."""
    if region.scope is Scope.BEFORE:
        return decision is Decision.KEEP
    if region.scope is Scope.AFTER:
        return decision in (Decision.KEEP, Decision.OFFLOAD)
    return decision not in SELECTIVE_DECISIONS or region.selective_measured()


# Note: [the saves outside the regions, as the store treats them]
#     The engine acts on a region as a unit; the saves before the first region (and between
#     regions) it does not: they go to the store like any saved tensor, which keeps them while the
#     budget has room and, being the oldest, evicts them first when it does not. A plan must say
#     the same, or ``explain()`` shows them kept, and the peak over the budget, while the engine
#     moved them all. So a policy never chooses for them (``allowed``: KEEP), and every step is
#     priced, searched and planned with ``as_stored``: kept where the peak fits the budget and
#     keeping costs no time, else moved (OFFLOAD, as the store's eviction moves them, past the
#     budget or to make room for copies in flight; between-region saves are lumped in, though the
#     store evicts those after older regions' saves). ``simulate`` prices it, so the
#     policies' search sees what the plan will say. The saves after the last region are left as
#     the policy decided: an OFFLOAD there makes the engine send them out as they are made, which
#     the store alone would not do.
def as_stored(
    regions: Sequence[RegionProfile], decisions: Sequence[Decision], machine: MachineProfile, budget_bytes: int | None
) -> tuple[Decision, ...]:
    """``decisions`` with the saves before the regions as the store treats them: See Note: [the
    saves outside the regions, as the store treats them]."""
    return _stored_timeline(regions, decisions, machine, budget_bytes)[0]


def _stored_timeline(
    regions: Sequence[RegionProfile], decisions: Sequence[Decision], machine: MachineProfile, budget_bytes: int | None
) -> tuple[tuple[Decision, ...], Timeline]:
    kept = tuple(Decision.KEEP if r.scope is Scope.BEFORE else d for r, d in zip(regions, decisions, strict=True))
    kept_timeline = _run_timeline(regions, kept, machine, budget_bytes)
    moved = tuple(
        Decision.OFFLOAD if r.scope is Scope.BEFORE and r.saved_bytes > 0 else d
        for r, d in zip(regions, kept, strict=True)
    )
    if budget_bytes is None or moved == kept or not link_usable(machine):
        return kept, kept_timeline
    # The store evicts them for room whenever it needs room: past the budget, and for copies in
    # flight that would otherwise wait. So they move where that fits, or is faster (kept on a tie).
    moved_timeline = _run_timeline(regions, moved, machine, budget_bytes)
    kept_fits, moved_fits = kept_timeline.peak_bytes <= budget_bytes, moved_timeline.peak_bytes <= budget_bytes
    if moved_fits and (not kept_fits or moved_timeline.step_ms < kept_timeline.step_ms):
        return moved, moved_timeline
    if not kept_fits and moved_timeline.peak_bytes < kept_timeline.peak_bytes:
        return moved, moved_timeline
    return kept, kept_timeline


def coerce(regions: Sequence[RegionProfile], decisions: Sequence[Decision]) -> tuple[Decision, ...]:
    """``decisions`` with every one a region may not take (``allowed``) made KEEP: a fixed policy's
    rule (recompute everything, offload a prefix) applied to the saves outside the regions."""
    return tuple(d if allowed(r, d) else Decision.KEEP for r, d in zip(regions, decisions, strict=True))


class Footprint(NamedTuple):
    """What one decision makes of one region: bytes (and tensors) it moves over the link, bytes it
    keeps on the device between forward and backward, bytes it drops to regenerate in backward,
    and the re-run backward pays for first, ms. A tuple, not a dataclass: the timeline makes one
    per region per pricing, and a frozen dataclass costs several times more to build."""

    moved_bytes: int
    moved_tensors: int
    resident_bytes: int
    dropped_bytes: int
    rerun_ms: float
    stored_tensors: int
    """Saved tensors the engine's store takes (kept or moved), for its host cost per tensor."""


def footprint(region: RegionProfile, decision: Decision) -> Footprint:
    """The ``Footprint`` of ``decision`` for ``region`` (see the module docstring)."""
    if decision is Decision.KEEP:
        return Footprint(0, 0, region.saved_bytes, 0, 0.0, region.num_tensors)
    if decision is Decision.OFFLOAD:
        return Footprint(region.saved_bytes, region.num_tensors, 0, 0, 0.0, region.num_tensors)
    if decision is Decision.RECOMPUTE:
        return Footprint(0, 0, region.input_bytes, region.saved_bytes, region.recompute_or_forward_ms(), 0)
    if decision is Decision.SELECTIVE:
        return Footprint(
            0,
            0,
            region.expensive_bytes + region.input_bytes,
            region.cheap_bytes,
            region.selective_ms,
            region.expensive_tensors,
        )
    return Footprint(
        region.expensive_bytes,
        region.expensive_tensors,
        region.input_bytes,
        region.cheap_bytes,
        region.selective_ms,
        region.expensive_tensors,
    )


def host_ms(region: RegionProfile, decision: Decision, machine: MachineProfile) -> tuple[float, float]:
    """(forward, re-run) ms of the engine's host costs for ``region`` under ``decision`` (see the
    module docstring): its store's cost per tensor taken, and a selective region's dispatch modes."""
    return _host_ms(region, decision, footprint(region, decision), machine)


def _host_ms(region: RegionProfile, decision: Decision, fp: Footprint, machine: MachineProfile) -> tuple[float, float]:
    forward_ms = machine.held_tensor_overhead_us * _MS_PER_US * fp.stored_tensors
    if decision not in SELECTIVE_DECISIONS:
        return forward_ms, 0.0
    dispatch_ms = machine.dispatch_overhead_us * _MS_PER_US * region.forward_dispatches
    return forward_ms + dispatch_ms, dispatch_ms


@dataclasses.dataclass(frozen=True, kw_only=True)
class RegionPlan:
    """One region's decision and what the cost model predicts it costs."""

    name: str
    """Qualified module name of the region, e.g. ``"blocks.3"``."""
    decision: Decision
    saved_bytes: int
    """Bytes the region saves for backward (from its profile)."""
    forward_ms: float
    """Measured forward time of the region, milliseconds."""
    transfer_ms: float
    """Link time to move its saved bytes out and back, ms, whatever the decision (inf: no link)."""
    exposed_ms: float
    """Step time this region adds, ms: 0 for KEEP, one forward for RECOMPUTE, its cheap ops for
    SELECTIVE, per-tensor cost plus the wait for its reload for OFFLOAD (0 when the transfer
    hides), both of the last for SELECTIVE_OFFLOAD; plus the engine's host costs (``host_ms``)."""
    resident_bytes: int
    """Bytes it keeps on the device between its forward and backward: all for KEEP, its inputs
    for RECOMPUTE and SELECTIVE_OFFLOAD, inputs and stash for SELECTIVE, 0 for OFFLOAD (once its
    copy has landed)."""
    dropped_bytes: int = 0
    """Saved bytes it drops in forward and regenerates in backward: all for RECOMPUTE, the cheap
    ops' for the selective decisions, none otherwise."""
    note: str = ""
    """Why the region was not offered the selective decisions, where it was not (from its profile)."""
    scope: Scope = Scope.REGION
    """A region, or the saves outside the regions (``Scope``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Decisions for every region, with the step time and peak the cost model predicts (its step
    times read at ``pace``)."""

    regions: tuple[RegionPlan, ...]
    policy: str
    """Name of the policy that chose the decisions."""
    budget_bytes: int | None
    """Activation bytes allowed on the device; None: no limit."""
    baseline_step_ms: float
    """The step without the engine: ``other_ms`` (what no profile covers) plus, for every profile
    (the regions and the parts outside them), its measured ``forward_ms`` and its ``backward_ms``
    (``BACKWARD_TO_FORWARD`` x ``forward_ms`` where no backward was measured)."""
    predicted_step_ms: float
    predicted_overhead_ms: float
    """``predicted_step_ms - baseline_step_ms``: the sum of the regions' exposed time."""
    predicted_peak_bytes: int
    """Most saved-activation bytes on the device at any instant of the step."""
    fits_budget: bool
    """``predicted_peak_bytes <= budget_bytes`` (True without a budget)."""
    origin: str = ""
    """Where the regions' profiles come from, for ``explain()``: "measured" at these inputs, or
    "derived, ..." from a fit over other shapes (``fit``), naming them; "" for a plan made by hand."""
    outside: tuple[RegionPlan, ...] = ()
    """The saves outside the regions (``Scope.BEFORE`` and ``Scope.AFTER``), planned with them:
    in the predicted peak, transfer and step like any region. Empty where none was measured."""
    pace: float = 1.0
    """What steps under this engine's plans measured against what their plans predicted, lately
    (``pace``, engine-wide): the three step times above are the cost model's times this. 1.0
    until two steps under plans were timed, and for a plan made by hand or predicted. The
    baseline is scaled alike, though no step without the engine was timed. The regions' figures
    stay the model's; the planner never sees the pace."""

    def paced(self, pace: float) -> Plan:
        """This plan with its step times read at ``pace`` instead of its own (the same decisions)."""
        scale = pace / self.pace
        return dataclasses.replace(
            self,
            baseline_step_ms=self.baseline_step_ms * scale,
            predicted_step_ms=self.predicted_step_ms * scale,
            predicted_overhead_ms=self.predicted_overhead_ms * scale,
            pace=pace,
        )

    def decision_after(self) -> Decision:
        """What happens to the saves after the last region (KEEP where none were planned)."""
        return next((r.decision for r in self.outside if r.scope is Scope.AFTER), Decision.KEEP)

    @property
    def decisions(self) -> tuple[Decision, ...]:
        return tuple(region.decision for region in self.regions)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values: decisions as their strings, an infinite time as None."""

        def finite(ms: float) -> float | None:
            return ms if math.isfinite(ms) else None

        return {
            "policy": self.policy,
            "budget_bytes": self.budget_bytes,
            "baseline_step_ms": finite(self.baseline_step_ms),
            "predicted_step_ms": finite(self.predicted_step_ms),
            "predicted_overhead_ms": finite(self.predicted_overhead_ms),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "fits_budget": self.fits_budget,
            "origin": self.origin,
            "pace": self.pace,
            "regions": [_region_dict(r, finite) for r in self.regions],
            "outside": [_region_dict(r, finite) | {"scope": r.scope.value} for r in self.outside],
        }

    def __str__(self) -> str:
        shown = [r for r in self.outside if r.saved_bytes > 0]  # nothing outside: no row
        name_width = max([len("region")] + [len(r.name) for r in (*self.regions, *shown)])
        header = (
            f"{'region':<{name_width}}  {'MB':>10}  {'fwd ms':>9}  {'transfer ms':>11}"
            f"  {'decision':<17}  {'exposed ms':>10}  {'drops MB':>10}"
        )
        budget = "none" if self.budget_bytes is None else f"{_mb(self.budget_bytes)} MB"
        lines = [f"offload plan: policy {self.policy}, budget {budget}", header, "-" * len(header)]
        for r in self.regions:
            lines.append(
                f"{r.name:<{name_width}}  {_mb(r.saved_bytes):>10}  {r.forward_ms:>9.3f}"
                f"  {r.transfer_ms:>11.3f}  {r.decision.value:<17}  {r.exposed_ms:>10.3f}  {_mb(r.dropped_bytes):>10}"
            )
        for r in shown:  # their time is the step's rest, not a region's forward
            lines.append(
                f"{r.name:<{name_width}}  {_mb(r.saved_bytes):>10}  {'-':>9}"
                f"  {r.transfer_ms:>11.3f}  {r.decision.value:<17}  {r.exposed_ms:>10.3f}  {_mb(r.dropped_bytes):>10}"
            )
        lines.append("-" * len(header))
        lines.extend(f"note: {r.name}: {r.note}" for r in self.regions if r.note)
        after = next((r for r in self.outside if r.scope is Scope.AFTER), None)
        if after is not None and after.note:
            lines.append(f"note: {after.name}: {after.note}")
        elif after is not None and self.regions and after.saved_bytes > max(r.saved_bytes for r in self.regions):
            lines.append(
                f"note: {after.name}: the step saves more after its last region than any region does "
                f"(an LM head's logits and their loss: batch x sequence x vocabulary); a loss computed in chunks "
                f"of tokens, each under offload.checkpoint, saves one chunk's logits at a time"
            )
        percent = 100.0 * self.predicted_overhead_ms / self.baseline_step_ms if self.baseline_step_ms > 0 else 0.0
        lines.append(
            f"predicted overhead: {self.predicted_overhead_ms:.3f} ms "
            f"({percent:.1f}% of the {self.baseline_step_ms:.3f} ms baseline step)"
        )
        if self.pace != 1.0:
            lines.append(f"step times read at x{self.pace:.3g} the cost model's, as steps under plans measured")
        lines.append(f"predicted peak: {_mb(self.predicted_peak_bytes)} MB vs budget {budget}{self._verdict()}")
        if self.origin:
            lines.append(f"profiles: {self.origin}")
        return "\n".join(lines)

    def _verdict(self) -> str:
        """Whether the peak fits the budget, and where it does not, what the store does then: the
        decisions (a fixed policy's, or the best of none that fit) keep more than the budget, and
        the store moves the oldest saves beyond it off the device as they are made, over the link
        (a cost the step is not priced with); with no link it cannot."""
        working = "a re-run region's own working set comes on top while it runs"
        if self.budget_bytes is None or self.fits_budget:
            return f"{'' if self.budget_bytes is None else '  (fits)'} (what the store holds; {working})"
        over = f"{_mb(self.predicted_peak_bytes - self.budget_bytes)} MB"
        if all(math.isfinite(r.transfer_ms) for r in (*self.regions, *self.outside)):
            return (
                f": these decisions keep {over} more, so the store moves the oldest saves beyond the budget off "
                f"the device as they are made and holds the budget, at a transfer cost the predicted step leaves "
                f"out ({working})"
            )
        return f"  (OVER BUDGET by {over}: with no link to move them to, the store keeps them; {working})"


def _mb(nbytes: int) -> str:
    return f"{nbytes / MB:,.1f}"


def _region_dict(r: RegionPlan, finite: Any) -> dict[str, Any]:
    return {
        "name": r.name,
        "decision": r.decision.value,
        "saved_bytes": r.saved_bytes,
        "forward_ms": finite(r.forward_ms),
        "transfer_ms": finite(r.transfer_ms),
        "exposed_ms": finite(r.exposed_ms),
        "resident_bytes": r.resident_bytes,
        "dropped_bytes": r.dropped_bytes,
        "note": r.note,
    }


# -- cost model ------------------------------------------------------------------------------


def link_usable(machine: MachineProfile) -> bool:
    """True when bytes can go out *and* come back (both bandwidths > 0)."""
    out_gb_per_s, back_gb_per_s = machine.offload_gb_per_s()
    return out_gb_per_s > 0 and back_gb_per_s > 0


def copies_share_compute(machine: MachineProfile) -> bool:
    """True where moving bytes takes the compute's own cores (the CPU device and its disk tier,
    with no core to spare beyond torch's threads), so a transfer cannot hide behind compute; False
    where a copy engine moves them (CUDA) or the spill threads have cores of their own."""
    return machine.device_type == "cpu" and machine.spare_cores == 0


def link_ms(nbytes: int, gb_per_s: float) -> float:
    """Time to move ``nbytes`` at ``gb_per_s``, ms (inf at 0 GB/s)."""
    if gb_per_s <= 0:
        return math.inf
    return nbytes / (gb_per_s * _BYTES_PER_GB) * _MS_PER_S


def region_transfer_ms(region: RegionProfile, machine: MachineProfile) -> tuple[float, float]:
    """(out, back) link time of the region's saved bytes, ms; inf over an unusable link."""
    out_gb_per_s, back_gb_per_s = machine.offload_gb_per_s()
    return link_ms(region.saved_bytes, out_gb_per_s), link_ms(region.saved_bytes, back_gb_per_s)


_FREE, _ALLOCATE, _FREE_AFTER = 0, 1, 2
"""The order of a timeline's events at one instant (see ``_run_timeline``)."""


@dataclasses.dataclass(frozen=True)
class Timeline:
    """One step as the cost model runs it: its time, its peak, and each region's exposed time."""

    step_ms: float
    peak_bytes: int
    exposed_ms: tuple[float, ...]
    """Per region, in region order: the step time it adds (``RegionPlan.exposed_ms``)."""


def _run_timeline(
    regions: Sequence[RegionProfile],
    decisions: Sequence[Decision],
    machine: MachineProfile,
    budget_bytes: int | None = None,
) -> Timeline:
    if len(decisions) != len(regions):
        raise ValueError(f"got {len(decisions)} decisions for {len(regions)} regions; pass one per region")
    out_gb_per_s, back_gb_per_s = machine.offload_gb_per_s()
    if any(d in MOVES_BYTES for d in decisions) and not link_usable(machine):
        raise ValueError(
            f"cannot OFFLOAD over a link of {out_gb_per_s} GB/s out, {back_gb_per_s} GB/s back "
            f"(device {machine.device_type!r}): bytes would never come back; use RECOMPUTE, SELECTIVE or KEEP"
        )
    for region, decision in zip(regions, decisions, strict=True):
        if decision in SELECTIVE_DECISIONS and not region.selective_measured():
            raise ValueError(
                f"region {region.name!r} cannot be {decision.value}: no selective run of it was measured "
                f"(selective_ms is 0{'; ' + region.note if region.note else ''}); use RECOMPUTE"
            )
        if region.scope is not Scope.REGION and not (
            allowed(region, decision) or (region.scope is Scope.BEFORE and decision is Decision.OFFLOAD)
        ):  # a region's one refusal (selective, not measured) is the check above
            raise ValueError(
                f"{region.name!r} ({region.scope.value} the regions) cannot be {decision.value}: the saves outside "
                f"the regions are never re-run, and those before or between them are kept"
            )
    overhead_ms_per_tensor = machine.per_tensor_overhead_us * _MS_PER_US
    serial = copies_share_compute(machine)
    # (time_ms, order, +/- bytes): at one instant a region's free goes first, then allocations, then
    # the free of the saves after the last region: their backward (the head's, the loss's) takes
    # no time here (it is in the step's rest), yet they are resident when the forward ends.
    events: list[tuple[float, int, int]] = []
    exposed_ms = [0.0] * len(regions)
    copy_landed_ms = [0.0] * len(regions)

    # Forward: compute runs region after region; copies out queue on the out-link.
    now_ms = 0.0
    out_link_free_ms = 0.0
    footprints = [footprint(region, decision) for region, decision in zip(regions, decisions, strict=True)]
    host = [_host_ms(r, d, fp, machine) for r, d, fp in zip(regions, decisions, footprints, strict=True)]
    held_bytes = 0  # what the kept regions hold so far: the room for copies in flight is the rest of the budget
    queued_bytes = 0  # bytes put on the out-link so far
    for i, (region, decision) in enumerate(zip(regions, decisions, strict=True)):
        now_ms += region.forward_ms + host[i][0]
        exposed_ms[i] += host[i][0]
        fp = footprints[i]
        held_bytes += fp.resident_bytes
        if decision in MOVES_BYTES:
            overhead_ms = overhead_ms_per_tensor * fp.moved_tensors
            now_ms += overhead_ms
            exposed_ms[i] += overhead_ms
            out_ms = link_ms(fp.moved_bytes, out_gb_per_s)
            if serial:
                now_ms += out_ms
                exposed_ms[i] += out_ms
                copy_landed_ms[i] = now_ms
            else:
                copy_start_ms = max(now_ms, out_link_free_ms)
                out_link_free_ms = copy_landed_ms[i] = copy_start_ms + out_ms
                queued_bytes += fp.moved_bytes
                if budget_bytes is not None:  # copies in flight count against the budget
                    room_bytes = _whole_tensors(max(0, budget_bytes - held_bytes), region.largest_tensor_bytes)
                    # the compute waits until what is still queued fits the room: the out-link has
                    # written all but ``room_bytes`` of the queue, the newest copy last
                    drained_ms = out_link_free_ms - link_ms(min(room_bytes, queued_bytes), out_gb_per_s)
                    if drained_ms > now_ms:
                        exposed_ms[i] += drained_ms - now_ms
                        now_ms = drained_ms
        if decision is not Decision.OFFLOAD:
            events.append((now_ms, _ALLOCATE, fp.resident_bytes))

    # Backward: reverse order; an offloaded region waits for its reload (see the docstring).
    prefetch_floor_ms = now_ms
    back_link_free_ms = 0.0  # See Note: [a reload is one stream of reads on one back-link]
    for i in reversed(range(len(regions))):
        region, decision = regions[i], decisions[i]
        needed_ms = now_ms
        start_ms = needed_ms
        fp = footprints[i]
        held_bytes -= fp.resident_bytes  # region i's own inputs are held until its backward ends: counted below
        backward_ms = region.backward_or_estimate_ms(BACKWARD_TO_FORWARD)
        if decision in MOVES_BYTES and serial:
            start_ms = needed_ms + link_ms(fp.moved_bytes, back_gb_per_s)
            exposed_ms[i] += start_ms - needed_ms
        elif decision in MOVES_BYTES:
            back_room_bytes = None if budget_bytes is None else max(0, budget_bytes - held_bytes - fp.resident_bytes)
            earliest_ms = max(copy_landed_ms[i], prefetch_floor_ms, back_link_free_ms)
            start_ms, back_link_free_ms = _reload(
                link_ms(fp.moved_bytes, back_gb_per_s),
                link_ms(_ahead_bytes(fp.moved_bytes, back_room_bytes, region.largest_tensor_bytes), back_gb_per_s),
                _streamed_share(back_room_bytes, region.largest_tensor_bytes),
                earliest_ms,
                needed_ms,
                backward_ms,
            )
            exposed_ms[i] += start_ms - needed_ms
            prefetch_floor_ms = start_ms
        rerun_ms = fp.rerun_ms + host[i][1]
        exposed_ms[i] += rerun_ms
        now_ms = start_ms + rerun_ms + backward_ms
        if decision is not Decision.OFFLOAD:
            order = _FREE_AFTER if region.scope is Scope.AFTER else _FREE
            events.append((now_ms, order, -fp.resident_bytes))

    resident_bytes = peak_bytes = 0
    for _, _, delta_bytes in sorted(events):
        resident_bytes += delta_bytes
        if resident_bytes > peak_bytes:
            peak_bytes = resident_bytes
    return Timeline(step_ms=now_ms, peak_bytes=peak_bytes, exposed_ms=tuple(exposed_ms))


def _whole_tensors(room_bytes: int, largest_bytes: int) -> int:
    """The bytes of ``room_bytes`` that whole tensors of ``largest_bytes`` fill: the store moves
    tensors whole, so a room of 1.9 such tensors holds one in flight. ``largest_bytes`` 0 (not
    measured): the room as bytes."""
    if largest_bytes <= 0:
        return room_bytes
    return room_bytes // largest_bytes * largest_bytes


def _ahead_bytes(moved_bytes: int, room_bytes: int | None, largest_bytes: int) -> int:
    """Of a reload's ``moved_bytes``, the most that may be read before its backward asks: what
    the room holds in whole tensors (``room_bytes`` None, no budget: all of them)."""
    if room_bytes is None:
        return moved_bytes
    return min(moved_bytes, _whole_tensors(room_bytes, largest_bytes))


def _streamed_share(room_bytes: int | None, largest_bytes: int) -> float:
    """The share of an offloaded region's backward that its reads after the backward asked run beside.
    With room for one of its largest tensors or none, each read waits for the one before it to be
    used and freed: none (the reads and the compute take turns). With room for three or more the
    prefetch keeps a read in flight while backward uses the others: all of it. Two: half. 0 where
    ``largest_bytes`` was not measured (the reads of the rest all wait, as before it was), 1 where
    it was and there is no budget (``room_bytes`` None: room for any number)."""
    if largest_bytes <= 0:
        return 0.0
    if room_bytes is None:
        return 1.0
    return min(1.0, max(0.0, (room_bytes // largest_bytes - 1) / 2))


# Note: [a reload is one stream of reads on one back-link]
#     A region's reload is its moved bytes read in order over the one back-link. Reads start at
#     ``earliest_ms``: its copy out has landed, the backward of the offloaded region after it has
#     started (at most one region read ahead), and the back-link has finished the reads before
#     it. Until its backward asks (``needed_ms``) at most the room's bytes are read (``ahead_ms``
#     of link time, as late as still lands them on time); whatever is left, for want of room or
#     of time, is read from then on, and runs beside the backward by the room's streamed share.
#     Every byte counts once on the link, whether read ahead or beside, so more room or an
#     earlier start never makes a step slower: the read ahead only takes bytes off the rest
#     (See Note: [the best plan never gets cheaper as the budget falls] in ``_predict.table``).


def _reload(
    read_ms: float, ahead_ms: float, streamed: float, earliest_ms: float, needed_ms: float, backward_ms: float
) -> tuple[float, float]:
    """(backward start, back-link free), ms, of one region's reload of ``read_ms`` link time (see
    Note: [a reload is one stream of reads on one back-link]); ``ahead_ms``: the link time of the
    most the room lets read ahead; ``streamed``: ``_streamed_share``."""
    read_before_ms = min(ahead_ms, max(0.0, needed_ms - earliest_ms))
    rest_ms = read_ms - read_before_ms
    rest_start_ms = max(needed_ms, earliest_ms)
    start_ms = rest_start_ms + rest_ms - streamed * min(rest_ms, backward_ms)
    return start_ms, rest_start_ms + rest_ms


def simulate(
    regions: Sequence[RegionProfile],
    decisions: Sequence[Decision],
    machine: MachineProfile,
    budget_bytes: int | None = None,
) -> tuple[float, int]:
    """(step_ms, peak_bytes) of one training step under ``decisions``, per the module docstring;
    with ``budget_bytes``, the compute waits where copies in flight would not fit in the room the
    budget leaves, and the saves before the regions move where they would not fit (See Note:
    [the saves outside the regions, as the store treats them]).

    Raises ``ValueError`` for an OFFLOAD over an unusable (0 GB/s) link.
    """
    timeline = _stored_timeline(regions, decisions, machine, budget_bytes)[1]
    return timeline.step_ms, timeline.peak_bytes


def timeline(
    regions: Sequence[RegionProfile],
    decisions: Sequence[Decision],
    machine: MachineProfile,
    budget_bytes: int | None = None,
) -> tuple[tuple[Decision, ...], Timeline]:
    """``simulate``'s step with its parts: the decisions as stored (``as_stored``) and the
    ``Timeline`` they run, each region's exposed time included (what a search learns costs from)."""
    return _stored_timeline(regions, decisions, machine, budget_bytes)


_SCALE_RANGE = (1e-3, 1e3)
"""Transfer costs are scaled by at most this much either way by ``calibrate_link``."""
_CALIBRATION_ROUNDS = 60
"""Bisection rounds of ``calibrate_link`` (on a log scale: far finer than timing noise)."""


def scale_link(machine: MachineProfile, scale: float) -> MachineProfile:
    """``machine`` with every transfer cost (bytes and per tensor) multiplied by ``scale`` > 0."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    return dataclasses.replace(
        machine,
        d2h_gb_per_s=machine.d2h_gb_per_s / scale,
        h2d_gb_per_s=machine.h2d_gb_per_s / scale,
        disk_write_gb_per_s=machine.disk_write_gb_per_s / scale,
        disk_read_gb_per_s=machine.disk_read_gb_per_s / scale,
        per_tensor_overhead_us=machine.per_tensor_overhead_us * scale,
    )


def calibrate_link(
    regions: Sequence[RegionProfile],
    machine: MachineProfile,
    offload_exposed_ms: float,
    budget_bytes: int | None = None,
) -> tuple[MachineProfile, float]:
    """(machine, scale): ``machine`` with its transfer costs scaled by one factor so that moving
    every region costs ``offload_exposed_ms`` more than keeping every region, as measured on a
    step that did exactly that.

    Why: the probe measures the link alone (one large buffer, nothing else running), while a
    training step moves many tensors of many sizes while compute runs. On a CPU with no core to
    spare the spill threads and the compute share cores, and the same bytes cost more than the
    probe predicts.
    One factor keeps the model's shape (what hides
    behind what, bytes and per-tensor costs in proportion) and fixes its level from a measured
    step. The scale is clamped to [1e-3, 1e3]; an unusable link is returned unchanged.
    ``budget_bytes``: the budget the step ran under (its copies in flight counted against it).
    """
    if not math.isfinite(offload_exposed_ms):
        raise ValueError(f"offload_exposed_ms must be finite, got {offload_exposed_ms!r}")
    regions = tuple(regions)
    if not regions or not link_usable(machine):
        return machine, 1.0
    keep_ms = _run_timeline(regions, (Decision.KEEP,) * len(regions), machine).step_ms
    offload_all = coerce(regions, (Decision.OFFLOAD,) * len(regions))

    def exposed_ms(scale: float) -> float:
        return _run_timeline(regions, offload_all, scale_link(machine, scale), budget_bytes).step_ms - keep_ms

    low, high = _SCALE_RANGE
    if offload_exposed_ms <= exposed_ms(low):
        return scale_link(machine, low), low
    if offload_exposed_ms >= exposed_ms(high):
        return scale_link(machine, high), high
    log_low, log_high = math.log(low), math.log(high)
    for _ in range(_CALIBRATION_ROUNDS):  # exposed time never falls as the scale grows
        middle = (log_low + log_high) / 2
        if exposed_ms(math.exp(middle)) < offload_exposed_ms:
            log_low = middle
        else:
            log_high = middle
    scale = math.exp((log_low + log_high) / 2)
    return scale_link(machine, scale), scale


# -- entry point -----------------------------------------------------------------------------


def check_inputs(regions: Sequence[RegionProfile], machine: MachineProfile, budget_bytes: int | None) -> None:
    if budget_bytes is not None and (
        isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0
    ):
        raise ValueError(f"budget_bytes must be None (no limit) or an int >= 0, got {budget_bytes!r}")
    for region in regions:
        for field in ("saved_bytes", "input_bytes", "num_tensors", "largest_tensor_bytes", "forward_dispatches"):
            if getattr(region, field) < 0:
                raise ValueError(f"region {region.name!r}: {field} must be >= 0, got {getattr(region, field)!r}")
        for field in ("cheap_bytes", "expensive_bytes", "expensive_tensors"):
            if getattr(region, field) < 0:
                raise ValueError(f"region {region.name!r}: {field} must be >= 0, got {getattr(region, field)!r}")
        for field in ("forward_ms", "backward_ms", "recompute_ms", "selective_ms"):
            value = getattr(region, field)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"region {region.name!r}: {field} must be finite and >= 0, got {value!r}")
    machine_fields = ("d2h_gb_per_s", "h2d_gb_per_s", "disk_write_gb_per_s", "disk_read_gb_per_s")
    for field in machine_fields + ("per_tensor_overhead_us", "held_tensor_overhead_us", "dispatch_overhead_us"):
        value = getattr(machine, field)
        if math.isnan(value) or value < 0:
            raise ValueError(f"machine profile: {field} must be >= 0 (0: unusable), got {value!r}")
    spare = machine.spare_cores
    if isinstance(spare, bool) or not isinstance(spare, int) or spare < 0:
        raise ValueError(f"machine profile: spare_cores must be an int >= 0 (0: none), got {spare!r}")


def build_plan(
    regions: tuple[RegionProfile, ...],
    decisions: tuple[Decision, ...],
    machine: MachineProfile,
    budget_bytes: int | None,
    policy_name: str,
    other_ms: float = 0.0,
) -> Plan:
    decisions, timeline = _stored_timeline(regions, decisions, machine, budget_bytes)
    region_plans = []
    for region, decision, exposed_ms in zip(regions, decisions, timeline.exposed_ms, strict=True):
        fp = footprint(region, decision)
        region_plans.append(
            RegionPlan(
                name=region.name,
                decision=decision,
                saved_bytes=region.saved_bytes,
                forward_ms=region.forward_ms,
                transfer_ms=sum(region_transfer_ms(region, machine)),
                exposed_ms=exposed_ms,
                resident_bytes=fp.resident_bytes,
                dropped_bytes=fp.dropped_bytes,
                note=region.note,
                scope=region.scope,
            )
        )
    outside = tuple(r for r in region_plans if r.scope is not Scope.REGION)
    baseline_step_ms = other_ms + sum(r.forward_ms + r.backward_or_estimate_ms(BACKWARD_TO_FORWARD) for r in regions)
    return Plan(
        regions=tuple(r for r in region_plans if r.scope is Scope.REGION),
        outside=outside,
        policy=policy_name,
        budget_bytes=budget_bytes,
        baseline_step_ms=baseline_step_ms,
        predicted_step_ms=other_ms + timeline.step_ms,
        predicted_overhead_ms=other_ms + timeline.step_ms - baseline_step_ms,
        predicted_peak_bytes=timeline.peak_bytes,
        fits_budget=budget_bytes is None or timeline.peak_bytes <= budget_bytes,
    )
