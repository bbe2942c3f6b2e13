"""Measured costs, as plain numbers: what the planner reads and the probe writes.

This module owns the data shapes shared by the probe (which measures a machine),
the profiler (which measures a model's regions) and the planner (which turns both
into decisions). Nothing here touches a device; every field carries its unit.

    probe()  ──▶ MachineProfile ─┐
                                 ├──▶ planner ──▶ Plan
    profile step ──▶ RegionProfile[] ┘
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["MB", "MachineProfile", "RegionProfile", "Saved", "Scope", "spill_where"]

MB = 1 << 20
"""Bytes in one MB as the API counts it (MiB, like ``torch.cuda.memory_allocated`` tables): ``budget_mb``,
``host_budget_mb`` and every MB figure the engine prints."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MachineProfile:
    """Bandwidths and fixed costs of moving activation bytes on one machine.

    On a CUDA device the offload link is device->host / host->device over pinned
    memory; on the CPU the "link" is the spill directory (write / read).
    """

    device_type: str
    """``"cuda"`` or ``"cpu"``: which tier sits behind the compute device."""
    device_name: str = ""
    """Human-readable name of the compute device (``torch.cuda.get_device_name`` or the CPU model)."""
    d2h_gb_per_s: float = 0.0
    """Device -> pinned host copy bandwidth, GB/s (1e9 bytes). 0 where there is no such link (CPU)."""
    h2d_gb_per_s: float = 0.0
    """Pinned host -> device copy bandwidth, GB/s. 0 where there is no such link (CPU)."""
    disk_write_gb_per_s: float = 0.0
    """Spill-directory write bandwidth, GB/s."""
    disk_read_gb_per_s: float = 0.0
    """Spill-directory read bandwidth, GB/s."""
    per_tensor_overhead_us: float = 0.0
    """Fixed engine cost per saved tensor moved (pack + unpack bookkeeping), microseconds: what moving
    costs beyond keeping it under the engine (``held_tensor_overhead_us``)."""
    held_tensor_overhead_us: float = 0.0
    """The engine's fixed host cost per saved tensor its store takes, kept or moved (the pack and
    unpack hooks, the store's bookkeeping), microseconds. 0 where the regions' times were measured
    under the engine, which holds it already (``offload.probe()`` leaves it 0); a prediction, whose
    times are the bare model's, sets it (see ``without_host_costs``)."""
    dispatch_overhead_us: float = 0.0
    """Host cost of one op dispatched under a Python ``TorchDispatchMode``, microseconds: a selective
    region pays it on every op of its forward (the stash mode) and again in its re-run (the replay
    mode). 0 where the regions' times were measured so (``offload.probe()`` leaves it 0)."""
    spare_cores: int = 0
    """CPU only: cores this process may run on beyond torch's intra-op threads, free for the spill
    threads. 0: a spill write or read takes the compute's own cores, so it is paid on the step's
    timeline; more: it runs beside the compute, queued like a copy engine's copies.
    ``offload.probe()`` reads it at the time of the call: the whole cores of the process's CPU
    affinity (physical cores where the host has hardware threads; no more than a cgroup CPU quota)
    less ``torch.get_num_threads()``. Ignored on CUDA, where a copy engine moves the bytes. As on
    CUDA, copies in flight count against the budget (``_plan.planner``'s timeline)."""

    def without_host_costs(self) -> MachineProfile:
        """This profile with the engine's host costs (``held_tensor_overhead_us``,
        ``dispatch_overhead_us``) 0: to price a step run without the engine, or to plan from profiles
        measured under it (their times hold those costs already)."""
        return dataclasses.replace(self, held_tensor_overhead_us=0.0, dispatch_overhead_us=0.0)

    def offload_gb_per_s(self) -> tuple[float, float]:
        """(out, back) bandwidth of the first tier behind the compute device, GB/s."""
        if self.device_type == "cuda":
            return self.d2h_gb_per_s, self.h2d_gb_per_s
        return self.disk_write_gb_per_s, self.disk_read_gb_per_s


def spill_where(spare_cores: int) -> str:
    """Where a CPU's spill runs with ``spare_cores`` (``MachineProfile.spare_cores``), in words:
    the timeline the planner prices it on."""
    return "spill beside the compute" if spare_cores else "spill on the compute's cores"


class Scope(enum.Enum):
    """Which saves a profile is of: a region the engine wraps, or what the step saves outside them."""

    REGION = "region"
    """A module the engine wraps: any decision."""
    BEFORE = "before"
    """The saves before the first region and between regions (an embedding's, a residual's): the
    engine cannot act on them as a unit, so the store keeps them while the budget has room and
    moves them first when it has not (``_plan.planner.as_stored``); no policy decides them."""
    AFTER = "after"
    """The saves after the last region until backward (an LM head's logits and its loss): kept or
    moved as they are saved; there is no module to re-run."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RegionProfile:
    """What one region (e.g. one transformer block) costs, measured on one step."""

    name: str
    """Qualified module name, e.g. ``"blocks.3"``."""
    saved_bytes: int
    """Bytes of distinct activation storages the region saves for backward (engine-eligible only)."""
    input_bytes: int = 0
    """Bytes a recomputed region still keeps: its inputs (those not already counted elsewhere)."""
    forward_ms: float = 0.0
    """Wall time of the region's forward, milliseconds (CUDA events on GPU, perf_counter on CPU)."""
    num_tensors: int = 0
    """Number of saved tensors (for per-tensor overheads)."""
    largest_tensor_bytes: int = 0
    """Bytes of the largest storage it saves. The store moves whole tensors, so the room a budget
    leaves for copies in flight holds only as many of these as fit in it: room for fewer than two
    and the reads of an offloaded region wait on backward one at a time (``_plan.planner``). 0: not
    measured; the planner then takes the room as bytes (any split of it)."""
    forward_dispatches: int = 0
    """Ops its forward dispatches, views and detaches included: a selective run pays
    ``MachineProfile.dispatch_overhead_us`` on each, in the forward and again in the re-run.
    0: not counted, nothing charged (the engine's own profiles, whose ``selective_ms`` was measured
    under the replay mode)."""
    backward_ms: float = 0.0
    """Wall time of the region's backward, milliseconds, measured with gradient hooks on its output
    and input. 0: not measured; the planner then assumes ``BACKWARD_TO_FORWARD`` x ``forward_ms``."""
    recompute_ms: float = 0.0
    """Wall time of re-running the region's forward in backward, milliseconds, measured on a step
    that recomputed it (it can differ from ``forward_ms``: recompute stops after the last saved
    tensor, and runs with the RNG and autocast states restored). 0: not measured; the planner
    then charges ``forward_ms``."""

    cheap_bytes: int = 0
    """Bytes a selective recompute drops in forward and regenerates in backward (the saves of its
    cheap ops' outputs), measured on a step that ran the region selectively."""
    expensive_bytes: int = 0
    """Bytes a selective recompute stashes instead (outputs of its matmuls, attention and
    convolutions that the re-run replays): kept hot or moved like any saved tensor."""
    expensive_tensors: int = 0
    """Tensors among ``expensive_bytes`` (for per-tensor overheads when the stash moves)."""
    selective_ms: float = 0.0
    """Wall time of the region's selective re-run in backward (its cheap ops), ms. 0: not measured,
    or the region cannot be split (``note`` says why): the planner then never runs it selectively."""
    forward_flops: int = 0
    """FLOPs of its forward's matmuls, attention and convolutions (torch's flop counter, on a step
    that re-ran it to measure a selective run). The planner does not read it; the fits of times
    across shapes do (``_plan.fit``): times follow FLOPs. 0: not counted."""
    note: str = ""
    """Why the region cannot run selectively ("" where it can or nobody tried), for ``explain()``;
    for the saves after the regions, what they are where the step says (``AFTER_IN_BACKWARD``)."""
    scope: Scope = Scope.REGION
    """A region, or the saves outside the regions (``Scope``); those have sizes only, their time
    is in the step's rest (``other_ms``)."""

    def selective_measured(self) -> bool:
        """Whether a selective run of this region was measured (only then may a plan choose one)."""
        return self.selective_ms > 0

    def backward_or_estimate_ms(self, backward_to_forward: float) -> float:
        """The measured backward time, or ``backward_to_forward`` x the forward where none was measured."""
        return self.backward_ms if self.backward_ms > 0 else backward_to_forward * self.forward_ms

    def recompute_or_forward_ms(self) -> float:
        """The measured recompute time, or the forward time where none was measured."""
        return self.recompute_ms if self.recompute_ms > 0 else self.forward_ms


@dataclasses.dataclass(frozen=True)
class Saved:
    """Bytes and tensors saved through the engine: the running totals (``Session.saved()``), or
    what was saved between two readings of them (their difference)."""

    nbytes: int = 0
    tensors: int = 0
    in_backward_nbytes: int = 0
    """Of ``nbytes``, those saved while autograd ran a backward (a double backward's graph)."""

    def __add__(self, other: Saved) -> Saved:
        return Saved(
            self.nbytes + other.nbytes, self.tensors + other.tensors, self.in_backward_nbytes + other.in_backward_nbytes
        )

    def __sub__(self, other: Saved) -> Saved:
        return Saved(
            self.nbytes - other.nbytes, self.tensors - other.tensors, self.in_backward_nbytes - other.in_backward_nbytes
        )
