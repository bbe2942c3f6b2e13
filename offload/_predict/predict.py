"""Predict before renting the GPU: memory and step time of every policy, from the model alone.

``predict(model, *example_args, machine=...)`` runs one training step (forward, loss, backward;
no optimizer step) of a copy of ``model`` on the meta device: the copy's parameters and every
activation are meta tensors, shapes and dtypes without memory, so a 7B-class model predicts on a
laptop. The model's own parameters are never read, moved or copied.

    model ──▶ fake_step        a meta copy; one step on meta under region hooks, saved-tensor
                               hooks and a dispatch mode
          ──▶ count            per region: bytes saved, FLOPs, bytes touched, and each op's roofline
                               time on ``machine``:
                                   max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) + op cost
          ──▶ RegionProfile per region (bytes counted; times predicted)
          ──▶ table            the plan of ``policy`` at ``budget_mb``; every policy at every budget,
                               with what it needs of the device; the longest sequence each fits
          ──▶ prediction       ``Prediction``: whether it fits, its table, what it assumed, JSON, plot

``machine`` is a named one (``machines``: datasheet peaks, calibrated compute efficiency,
assumed fractions) or this CPU, measured (``this_cpu``). This module checks what the user
passed, adds the parameters, gradients and optimizer state (``train_state.OptimizerState``; with
``sharded_over``, a device's shard and what is gathered, and the exposed collectives in every
step: ``sharding``) and the step's largest transient to the step's memory, and keeps the names the package and the
benchmarks import from ``offload._predict.predict``.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import torch

from .._config import DEFAULT_MIN_OFFLOAD_BYTES
from .._cost import MB, MachineProfile, Scope
from .._regions.regions import RegionsArg, resolve_regions
from .count import RegionCount
from .fake_step import Attention, fake_step
from .machines import Machine, get_machine
from .prediction import EXCLUDES, Prediction, write_plot
from .selection import Selection, is_selection
from .selective_rule import BUILT_IN, SelectiveRule, get_rule
from .sharding import shard
from .table import (
    BUDGET_FRACTIONS,
    POLICIES,
    SELECTIVE_MEANS,
    WITHOUT_ENGINE,
    DeviceMemory,
    Longest,
    PolicyPoint,
    held_bytes,
    longest_sequences,
    plan_policy,
    policy_points,
)
from .this_cpu import measure_machine
from .train_state import MIXED_PRECISION, OptimizerState

__all__ = [
    "BUDGET_FRACTIONS",
    "EXCLUDES",
    "POLICIES",
    "Attention",
    "Longest",
    "WITHOUT_ENGINE",
    "OptimizerState",
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
        f"machine= takes a machine name, an offload._predict.machines.Machine or offload.probe()'s MachineProfile, "
        f"got {type(machine).__name__}"
    )


def _selected(model: torch.nn.Module, regions: RegionsArg) -> RegionsArg:
    """``regions``, a selection string (``selection``) made into the blocks it picks of those
    ``regions="auto"`` finds in ``model``."""
    if not is_selection(regions):
        return regions
    selection = Selection.parse(str(regions))
    blocks = [module for _, module in resolve_regions("auto", model).regions]
    return [blocks[i] for i in selection.pick_from(len(blocks))]


def _deprecated_bytes(old: str, new: str) -> None:
    warnings.warn(
        f"offload.predict({old}=...) is deprecated: pass {new}= (MiB, the unit of every size offload takes)",
        DeprecationWarning,
        stacklevel=3,  # the user's call: _deprecated_bytes <- predict <- the caller
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
    attention: Union[Attention, str] = Attention.FUSED,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    state: OptimizerState = MIXED_PRECISION,
    state_bytes_per_param: Optional[float] = None,
    longest_in: Optional[Callable[[int], tuple[tuple, dict]]] = None,
    memory_mb: Optional[float] = None,
    min_offload_mb: float = DEFAULT_MIN_OFFLOAD_BYTES / MB,
    attention_source: str = "",
    assume: Optional[Mapping[str, float]] = None,
    sharded_over: int = 1,
    reduce_dtype: Optional[torch.dtype] = None,
    selective_rule: Union[SelectiveRule, str] = BUILT_IN,
    memory_bytes: Optional[int] = None,
    min_offload_bytes: Optional[int] = None,
) -> Prediction:
    """Predict one training step of ``model(*example_args, **example_kwargs)`` on ``machine``.

    ``machine``: a name (``offload.machines()``), a ``Machine`` (e.g. a named one, ``offload.machine(name)``,
    ``.with_assumptions(flops_fraction=0.5)``), or ``offload.probe()`` for this machine (its compute is then
    measured: ``measure_machine``). ``budget_mb`` and ``policy`` choose ``Prediction.plan``; ``budgets`` are the
    fractions of the peak without the engine at which every policy in ``POLICIES`` is tabled. ``regions`` as for
    ``offload.engine`` (modules of ``model`` are mapped onto its copy), or a selection of the blocks "auto" finds:
    ``"every:2"``, ``"first:4"``, ``"last:4"``, ``"0,3,5"`` (``selection``): the others' saves are kept.
    ``attention``: ``"fused"`` (the default: SDPA counted as the target's fused kernel, no sequence² scores) or
    ``"as-written"`` (what the model's code saves on its own: a model running eager attention); ``attention_source``
    says where that choice came from, for the printout. ``state``: the dtypes of the gradients, master weights and
    optimizer moments (default: bf16/fp16 training with fp32 master weights and Adam's moments in fp32,
    ``OptimizerState``); ``state_bytes_per_param`` overrides it with one figure. ``longest_in(seq) -> (args,
    kwargs)``: inputs at another sequence length; with it, the longest sequence fitting the device under each policy
    is searched. ``memory_mb``: device memory the step may use, MiB (default: the machine's usable memory,
    ``Machine.usable_memory_bytes``). ``min_offload_mb``: as ``offload.engine``'s. ``memory_bytes`` and
    ``min_offload_bytes``: the same in bytes, deprecated (a ``DeprecationWarning``; MiB is every size's
    unit). ``sharded_over``: the GPUs the parameters, gradients and optimizer state are
    sharded over, as FSDP's full sharding does with a unit per region (``sharding``): the device holds its shard,
    and every step adds the exposed part of the collectives, at the slower of the links their ring crosses (the
    node's interconnect; beyond ``Machine.gpus_per_node`` GPUs, the network between nodes); 1 (the default): one
    device holds them whole and no collective is priced. ``reduce_dtype``: the dtype the gradients are
    reduce-scattered in (FSDP's ``MixedPrecision.reduce_dtype``; default: the gradients'). With
    ``state_bytes_per_param`` the gradients are taken in the parameters' dtype. ``selective_rule``: which ops
    the "selective" rows save and re-run (``selective_rule.SelectiveRule``, or a named one: "built-in", the
    default and this engine's; "torchtitan-op"). Raises ``OffloadError`` for an op
    that cannot run on meta tensors, naming it.

    Examples:
        A model built on the meta device allocates no weights; the prediction says whether a step
        fits an H100 and what the plan for a 64 MB budget keeps:

        >>> import torch, offload
        >>> from offload.models import GPTConfig, MiniGPT
        >>> with torch.device("meta"):
        ...     model = MiniGPT(GPTConfig(n_layer=4, n_embd=512, n_head=8, seq_len=1024))
        >>> tokens = torch.zeros(2, 1024, dtype=torch.long, device="meta")
        >>> prediction = offload.predict(model, tokens, tokens, machine="h100-sxm", budget_mb=64)
        >>> prediction.plan.fits_budget, prediction.points[0].fits_device
        (True, True)
    """
    start = time.perf_counter()
    if memory_bytes is not None:
        _deprecated_bytes("memory_bytes", "memory_mb")
        if memory_mb is not None:
            raise ValueError("predict() takes memory_mb= or the deprecated memory_bytes=, not both")
        memory_mb = memory_bytes / MB
    if min_offload_bytes is not None:
        _deprecated_bytes("min_offload_bytes", "min_offload_mb")
        min_offload_mb = min_offload_bytes / MB
    min_offload = int(min_offload_mb * MB)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    target = _machine(machine, dtype)
    if assume:
        target = target.with_assumptions(**dict(assume))
    fractions = _check_fractions(budgets)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; predict compares: {', '.join(POLICIES)}")
    attention = Attention.of(attention)
    if not isinstance(state, OptimizerState):
        raise TypeError(f"state= takes an offload._predict.predict.OptimizerState, got {state!r}")
    kwargs = dict(example_kwargs or {})
    regions = _selected(model, regions)
    rule = get_rule(selective_rule) if isinstance(selective_rule, str) else selective_rule
    if not isinstance(rule, SelectiveRule):
        raise TypeError(f"selective_rule= takes a SelectiveRule or a rule's name, got {selective_rule!r}")
    run = fake_step(model, example_args, kwargs, target, regions, attention, loss_fn, min_offload, rule)
    num_parameters = sum(p.numel() for p in model.parameters())
    if state_bytes_per_param is None:
        per_param = state.bytes_per_parameter(dtype)
        state_text = state.describe(dtype)
    else:
        per_param = float(state_bytes_per_param)
        state_text = f"{per_param:g} bytes per parameter besides it (given)"
    state_bytes = int(num_parameters * per_param)
    grad_dtype = (state.grad_dtype or dtype) if state_bytes_per_param is None else dtype
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise TypeError(f"reduce_dtype= takes a floating torch.dtype or None (the gradients'), got {reduce_dtype!r}")
    sharding = shard(
        target,
        sharded_over,
        parameter_bytes=run.parameter_bytes,
        gradient_bytes=num_parameters * grad_dtype.itemsize,
        reduce_bytes=num_parameters * (reduce_dtype or grad_dtype).itemsize,
        state_bytes=state_bytes,
        region_parameter_bytes=run.region_parameter_bytes,
    )
    counts = run.counts
    profiles = tuple(c.profile() for c in counts)
    other_ms = sum(c.forward_ms + c.backward_ms for c in counts if c.scope is not Scope.REGION)
    link = target.machine_profile()
    budget = None if budget_mb is None else int(budget_mb * MB)
    outside_ms = other_ms + sharding.exposed_ms  # what every plan's step adds to its regions'
    plan = plan_policy(profiles, link, policy, budget, outside_ms)
    memory = target.usable_memory_bytes() if memory_mb is None else int(memory_mb * MB)
    device = DeviceMemory(static_bytes=sharding.static_bytes, transient_bytes=run.transient_bytes, usable_bytes=memory)
    longest: tuple[Longest, ...] = ()
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
            min_offload,
            memory - sharding.static_bytes,
            extra_ms=sharding.exposed_ms,
            rule=rule,
        )
    attention_text = {
        Attention.FUSED: "fused: SDPA counted as the target's flash kernel (q, k, v, output and log-sum-exp saved; "
        "grouped-query k and v as they are)",
        Attention.AS_WRITTEN: "as written: what the model's own code saves (SDPA's math path on meta; eager attention "
        "saves its sequence² scores)",
    }[attention]
    return Prediction(
        machine=target,
        regions=counts,
        other_ms=other_ms,
        plan=plan,
        points=policy_points(profiles, link, outside_ms, fractions, device),
        parameter_bytes=run.parameter_bytes,
        state_bytes=state_bytes,
        forward_flops=sum(c.forward_flops for c in counts),
        backward_flops=sum(c.backward_flops for c in counts),
        longest=longest,
        longest_memory_bytes=memory if longest_in is not None else 0,
        assumed=run.assumed,
        wall_s=time.perf_counter() - start,
        transient_bytes=run.transient_bytes,
        memory_bytes=memory,
        state=state_text,
        sharding=sharding,
        attention=attention_text + (f" ({attention_source})" if attention_source else ""),
        selective=SELECTIVE_MEANS if rule is BUILT_IN else f"selective re-runs by the rule {rule.describe()}",
    )
