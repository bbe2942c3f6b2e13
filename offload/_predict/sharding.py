"""What sharding the training state over GPUs, as FSDP's full sharding does, changes in a step.

``predict(sharded_over=N)``: the parameters, their gradients and the optimizer's state are split
over ``N`` GPUs of one node. Per micro-batch each GPU then

- holds 1/N of them, plus what is gathered at the time: the parameters outside the regions (the
  root unit: embeddings, head), the running region's and the prefetched next region's parameters,
  and the running region's unsharded gradients (the largest region stands for both);
- all-gathers the parameters for the forward and again for the backward, and reduce-scatters the
  gradients: each moves (N - 1) / N of its full size over the interconnect (a ring's share);
- waits on ``Assumptions.exposed_fraction`` of that time (the rest hides behind compute; named GPUs
  carry one calibrated on published FSDP runs).

Numbers only: nothing here touches torch or a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .machines import Machine

__all__ = ["NOT_SHARDED", "Sharding", "shard"]

_MIB = 1 << 20
_GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sharding:
    """One step's sharding: what the device holds of the training state, and what its collectives cost."""

    gpus: int
    static_bytes: int
    """Parameters, gradients and optimizer state the device holds: its shard and what is gathered."""
    collective_bytes: int
    """Bytes each GPU moves over the interconnect in one micro-batch's collectives."""
    collective_ms: float
    """Their time at the interconnect's achieved bandwidth."""
    exposed_ms: float
    """What the step waits on of it: added to every policy's step."""
    text: str = ""
    """One line for the printout's assumptions; empty when not sharded."""


NOT_SHARDED = Sharding(gpus=1, static_bytes=0, collective_bytes=0, collective_ms=0.0, exposed_ms=0.0)


def shard(
    machine: Machine,
    gpus: int,
    *,
    parameter_bytes: int,
    gradient_bytes: int,
    state_bytes: int,
    region_parameter_bytes: Sequence[int],
) -> Sharding:
    """The sharding of a step whose model has ``parameter_bytes`` of parameters (``gradient_bytes``
    of gradients; ``state_bytes`` of gradients and optimizer state together), its regions
    ``region_parameter_bytes`` each, over ``gpus`` GPUs of ``machine``. ``gpus`` 1: the state
    whole on one device, no collectives."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(
            f"sharded_over= takes the number of GPUs the training state is sharded over (an int >= 1; 1: not "
            f"sharded), got {gpus!r}"
        )
    whole = parameter_bytes + state_bytes
    if gpus == 1:
        return dataclasses.replace(NOT_SHARDED, static_bytes=whole)
    bandwidth = machine.achieved_collective_gb_per_s()
    if bandwidth is None:
        raise ValueError(
            f"sharded_over={gpus}: machine {machine.name!r} has no GPU interconnect figure to price the collectives "
            "on; pass a named GPU (offload.machines()), or sharded_over=1"
        )
    largest = max(region_parameter_bytes, default=0)
    outside = max(0, parameter_bytes - sum(region_parameter_bytes))
    unsharded_gradients = largest * gradient_bytes // max(1, parameter_bytes)
    gathered = outside + 2 * largest + unsharded_gradients
    static = -(-whole // gpus) + gathered
    ring = (gpus - 1) / gpus
    moved = int((2 * parameter_bytes + gradient_bytes) * ring)
    collective_ms = moved / (bandwidth * _GB) * 1e3
    a = machine.assumptions
    exposed_ms = collective_ms * a.exposed_fraction
    text = (
        f"sharded over {gpus} GPUs (FSDP's full sharding): 1/{gpus} of the parameters, gradients and optimizer "
        f"state held, plus {gathered / _MIB:,.0f} MiB gathered (the parameters outside the regions, two regions' "
        f"parameters, one's gradients); each micro-batch all-gathers the parameters twice and reduce-scatters the "
        f"gradients, {moved / _GB:,.2f} GB a GPU over {machine.interconnect} at {a.collective_fraction:g} of "
        f"{machine.interconnect_gb_per_s:,.0f} GB/s a direction: {collective_ms:,.1f} ms, {a.exposed_fraction:g} of it "
        f"exposed ({exposed_ms:,.1f} ms in every step)"
    )
    return Sharding(
        gpus=gpus,
        static_bytes=static,
        collective_bytes=moved,
        collective_ms=collective_ms,
        exposed_ms=exposed_ms,
        text=text,
    )
