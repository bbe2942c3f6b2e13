"""Predict before renting the GPU: memory and step time of every policy, from the model alone.

``predict(model, *example_args, machine=...)`` runs one training step (forward, loss, backward;
no optimizer step) of a copy of ``model`` on the meta device: the copy's parameters and every
activation are meta tensors, shapes and dtypes without memory, so a 7B-class model predicts on a
laptop. The model's own parameters are never read, moved or copied.

    model ──▶ _predict_step    a meta copy; one step on meta under region hooks, saved-tensor
                               hooks and a dispatch mode
          ──▶ _predict_count   per region: bytes saved, FLOPs, bytes touched, and each op's roofline
                               time on ``machine``:
                                   max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) + op cost
          ──▶ RegionProfile per region (bytes counted; times predicted)
          ──▶ _predict_plan    the plan of ``policy`` at ``budget_mb``; every policy at every budget;
                               the longest sequence each fits
          ──▶ _prediction      ``Prediction``: its table, JSON and plot

``machine`` is a named one (``_machines``: datasheet peaks, assumed fractions) or this CPU,
measured (``_predict_machine``). This module checks what the user passed, adds the parameters,
gradients and optimizer state (``state_bytes_per_param``) to the step's memory, and keeps the
names the package and the benchmarks import from ``offload._predict``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch

from ._config import DEFAULT_MIN_OFFLOAD_BYTES
from ._cost import MB, MachineProfile, Scope
from ._machines import Machine, get_machine
from ._predict_count import RegionCount
from ._predict_machine import measure_machine
from ._predict_plan import (
    BUDGET_FRACTIONS,
    POLICIES,
    WITHOUT_ENGINE,
    Longest,
    PolicyPoint,
    held_bytes,
    longest_sequences,
    plan_policy,
    policy_points,
)
from ._predict_step import Attention, fake_step
from ._prediction import Prediction, write_plot
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


def _machine(machine: Union[str, Machine, MachineProfile], dtype: torch.dtype) -> Machine:
    if isinstance(machine, Machine):
        return machine
    if isinstance(machine, str):
        return get_machine(machine)
    if isinstance(machine, MachineProfile):
        return measure_machine(machine, dtype=dtype)  # timed in the model's own dtype
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
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    target = _machine(machine, dtype)
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
    plan = plan_policy(profiles, link, policy, budget, other_ms)
    longest: tuple[Longest, ...] = ()
    memory = target.memory_bytes if memory_bytes is None else int(memory_bytes)
    if longest_in is not None:
        base_seq = next((c.input_dims[-2] for c in counts if c.scope is Scope.REGION and len(c.input_dims) >= 3), 2)
        longest = longest_sequences(
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
        points=policy_points(profiles, link, other_ms, fractions),
        parameter_bytes=run.parameter_bytes,
        state_bytes=state_bytes,
        forward_flops=sum(c.forward_flops for c in counts),
        backward_flops=sum(c.backward_flops for c in counts),
        longest=longest,
        longest_memory_bytes=memory if longest_in is not None else 0,
        assumed=run.assumed,
        wall_s=time.perf_counter() - start,
    )
