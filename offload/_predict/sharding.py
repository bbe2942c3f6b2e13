"""What sharding the training state over GPUs, as FSDP's full sharding does, changes in a step.

``predict(sharded_over=N)``: the parameters, their gradients and the optimizer's state are split
over ``N`` GPUs, on one node or across several (``Machine.gpus_per_node``), one FSDP unit per
region and one root unit for the parameters outside the regions (embeddings, head). Per
micro-batch each GPU then

- holds 1/N of the state, plus what is unsharded at the time: the root unit's parameters and
  gradients (FSDP keeps the root gathered from its forward to its backward), the running region's
  and the prefetched next region's parameters, and two regions' unsharded gradients: the running
  region's, and the previous one's while its reduce-scatter overlaps this backward (the largest
  region stands for each);
- all-gathers each region's parameters for its forward and again for its backward, the root's once,
  and reduce-scatters every gradient, in the reduce dtype (FSDP's ``reduce_dtype``: the gradients'
  unless given): each moves (N - 1) / N of its full size (a ring's share) at the slower of the links
  its ring crosses: the node's interconnect, and where N exceeds a node's GPUs the network between
  nodes, each at ``collective_fraction`` of its figure. Across nodes NCCL runs a ring per network
  adapter, each leaving a node through its own adapter (Note: [a ring per adapter]), so the
  network's figure is the node's adapters together, ``Machine.internode_gb_per_s`` x
  ``gpus_per_node``;
- adds ``Assumptions.exposed_fraction`` of that collective time to its step. That fraction is fitted
  on published runs, not derived: it stands for what the overlap with compute fails to hide
  (the first all-gather, the last reduce-scatter, the SMs and memory bandwidth the collectives
  take from the matmuls beside them), and for whatever else those runs spent in proportion to their
  parameters.

Numbers only: nothing here touches torch or a device.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

from .machines import Machine

__all__ = ["NOT_SHARDED", "Sharding", "shard"]

_MIB = 1 << 20
_GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sharding:
    """One step's sharding: what the device holds of the training state, and what its collectives cost."""

    gpus: int
    static_bytes: int
    """Parameters, gradients and optimizer state the device holds: its shard and what is unsharded."""
    collective_bytes: int
    """Bytes each GPU moves over the interconnect in one micro-batch's collectives."""
    collective_ms: float
    """Their time at the interconnect's achieved bandwidth."""
    exposed_ms: float
    """What is added to every policy's step: ``exposed_fraction`` of ``collective_ms``."""
    text: str = ""
    """One line for the printout's assumptions; empty when not sharded."""


NOT_SHARDED = Sharding(gpus=1, static_bytes=0, collective_bytes=0, collective_ms=0.0, exposed_ms=0.0)


def _gpus(value: Any) -> int:
    try:
        gpus = operator.index(value)
    except TypeError:
        gpus = 0
    if isinstance(value, bool) or gpus < 1:
        raise ValueError(
            f"sharded_over= takes the number of GPUs the training state is sharded over, an int >= 1 "
            f"(1: not sharded), got {value!r}"
        )
    return gpus


# Note: [a ring per adapter]
#     A ring over N GPUs of several nodes visits a node's GPUs over its interconnect, then leaves for
#     the next node over one network adapter. NCCL runs as many rings as a node has adapters (one per
#     GPU on a DGX), each with 1/gpus_per_node of the data and its own exit GPU, so each adapter carries
#     one ring's share: a GPU's (N - 1) / N of the data, divided by gpus_per_node. Per GPU, the
#     network then runs like a link of internode_gb_per_s x gpus_per_node, beside the interconnect
#     each GPU still uses for the rings' other hops; the collective runs at the slower of the two.


def _ring_gb_per_s(machine: Machine, gpus: int) -> tuple[float, str]:
    """The achieved GB/s a direction of a ring over ``gpus`` GPUs of ``machine``, and what it runs
    over: the node's interconnect, or where the ring leaves the node the slower of it and the
    network between nodes (every GPU's share of the ring's traffic crosses both)."""
    fraction = machine.assumptions.collective_fraction
    crosses = gpus > machine.gpus_per_node
    intra = machine.interconnect_gb_per_s if machine.gpus_per_node > 1 else None
    if (intra is None and machine.gpus_per_node > 1) or (crosses and machine.internode_gb_per_s is None):
        missing = "between nodes" if crosses else "within a node"
        raise ValueError(
            f"sharded_over={gpus}: machine {machine.name!r} has no GPU interconnect figure {missing} to price the "
            f"collectives on ({machine.gpus_per_node} GPUs a node); pass a named GPU (offload.machines()), give this "
            "one its figures with machine.with_interconnect(gb_per_s, 'what it is') or "
            "machine.replace(internode_gb_per_s=..., internode='what it is') (--interconnect-gb-per-s, "
            "--internode-gb-per-s), or pass sharded_over=1"
        )
    links = []
    if intra is not None:
        links.append((intra, f"{machine.interconnect} at {fraction:g} of {intra:,.0f} GB/s a direction"))
    if crosses:
        assert machine.internode_gb_per_s is not None  # refused above
        adapters = machine.internode_gb_per_s * machine.gpus_per_node  # See Note: [a ring per adapter]
        links.append(
            (
                adapters,
                f"{machine.internode} between nodes of {machine.gpus_per_node} GPUs, a ring per adapter, at "
                f"{fraction:g} of {machine.gpus_per_node} x {machine.internode_gb_per_s:,.0f} GB/s a direction",
            )
        )
    slowest, what = min(links, key=lambda link: link[0])
    if len(links) > 1:
        other = next(text for gb_per_s, text in links if text != what)
        what = f"the slower of the links its ring crosses, {what} (the other: {other})"
    return slowest * fraction, what


def shard(
    machine: Machine,
    gpus: Any,
    *,
    parameter_bytes: int,
    gradient_bytes: int,
    reduce_bytes: int,
    state_bytes: int,
    region_parameter_bytes: Sequence[int],
) -> Sharding:
    """The sharding of a step whose model has ``parameter_bytes`` of parameters, ``gradient_bytes``
    of gradients (``reduce_bytes`` in the dtype they are reduce-scattered in) and ``state_bytes`` of
    gradients and optimizer state together, its regions ``region_parameter_bytes`` each, over
    ``gpus`` GPUs of ``machine``. ``gpus`` 1: the state whole on one device, no collectives."""
    gpus = _gpus(gpus)
    whole = parameter_bytes + state_bytes
    if gpus == 1:
        return dataclasses.replace(NOT_SHARDED, static_bytes=whole)
    bandwidth, over = _ring_gb_per_s(machine, gpus)
    per_gradient_byte = gradient_bytes / max(1, parameter_bytes)
    largest = max(region_parameter_bytes, default=0)
    root = max(0, parameter_bytes - sum(region_parameter_bytes))
    unsharded = int(root * (1 + per_gradient_byte) + largest * 2 * (1 + per_gradient_byte))
    ring = (gpus - 1) / gpus
    moved = int((2 * parameter_bytes - root + reduce_bytes) * ring)
    collective_ms = moved / (bandwidth * _GB) * 1e3
    exposed_ms = collective_ms * machine.assumptions.exposed_fraction
    return Sharding(
        gpus=gpus,
        static_bytes=-(-whole // gpus) + unsharded,
        collective_bytes=moved,
        collective_ms=collective_ms,
        exposed_ms=exposed_ms,
        text=_describe(machine, gpus, unsharded, moved, collective_ms, exposed_ms, over),
    )


def _describe(
    machine: Machine, gpus: int, unsharded: int, moved: int, collective_ms: float, exposed_ms: float, over: str
) -> str:
    a = machine.assumptions
    return (
        f"sharded over {gpus} GPUs (FSDP's full sharding, a unit per region and a root unit): 1/{gpus} of the "
        f"parameters, gradients and optimizer state held, plus {unsharded / _MIB:,.0f} MiB unsharded (the root's "
        f"parameters and gradients, two regions' parameters and gradients); each micro-batch all-gathers the "
        f"regions' parameters twice and the root's once and reduce-scatters the gradients, {moved / _GB:,.2f} GB a "
        f"GPU over {over}: {collective_ms:,.1f} ms, {a.exposed_fraction:g} of it added to the step "
        f"({exposed_ms:,.1f} ms)"
    )
