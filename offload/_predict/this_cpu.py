"""This CPU, measured as a ``Machine``: what ``predict(machine=offload.probe())`` prices ops with.

A named machine (``machines``) carries datasheet peaks and assumed fractions of them; the machine
at hand is timed instead, each figure the best of ``_REPEATS`` runs after a warm-up (noise only
adds time):

    FLOP/s              a ``_MATMUL_SIZE``² matmul
    memory GB/s         a 64 MiB copy
    op cost             a chain of ``_TINY_OPS`` one-element ops, forward and backward under
                        autograd, over the ops it dispatched
    held tensor         a chain of saves under the engine, against the same without it
    dispatch mode       a forward under a pass-through dispatch mode, against the same without it

The link and per-tensor costs come from ``offload.probe()``'s ``MachineProfile``. A GPU's compute
is not measured here: use a named machine for it.

The best run of a lone matmul, copy and tiny op is what the CPU can do, not what a training step
gets from it: a step's ops run on caches its other ops left cold, fault in freshly allocated
pages, and share the core with the other hardware thread. On the 2-vCPU VM of
``bench/results/predict-cpu.md`` the roofline from those figures priced a step without the
engine 2-18 % fast in most runs, and once, from a slow first matmul sample, right by chance. So
``measure_machine`` also times one reference step, a small transformer stack (``_REFERENCE``: two
``torch.nn.TransformerEncoderLayer`` of width 512, batch 2, sequence 128, a shape neither model
of that bench has) forward and backward, median of ``_REFERENCE_STEPS``, in the dtype asked for,
and scales the compute by what the roofline missed there (``calibrate_compute``): FLOP/s and
memory bandwidth by one factor, the op cost by its inverse, so every op's time by the same
factor; ``Machine.compute_scale`` keeps it. The microbenchmarks keep the proportions of the
three; the timed step sets their level. The engine's host costs (per saved tensor, per tensor
moved, per op under a dispatch mode) are measured against the same work without the engine and
are not scaled.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._config import DEFAULT_MIN_OFFLOAD_BYTES, Config
from .._cost import MB, MachineProfile
from .._memory.probe import probe
from .._memory.session import Session
from .count import is_alias
from .fake_step import Attention, fake_step
from .machines import Machine

__all__ = ["calibrate_compute", "measure_machine", "reference_step_ms"]

log = logging.getLogger(__name__)

_GB = 1e9
_MATMUL_SIZE = 1024
_COPY_BYTES = 64 * MB
_TINY_OPS = 2000
_HELD_TENSORS = 1000
"""Saves in the chain that measures the engine's cost per saved tensor (each of
``DEFAULT_MIN_OFFLOAD_BYTES``, the least the store takes)."""
_REPEATS = 5
_REFERENCE = {"layers": 2, "width": 512, "heads": 8, "ffn": 2048, "batch": 2, "seq": 128}
"""The reference step ``calibrate_compute`` times: a small transformer stack, the kind of step
predicted (matmuls, attention, norms, elementwise ops, under autograd), ~10 GFLOP."""
_REFERENCE_STEPS = 5
_SCALE_WARN = (0.25, 4.0)
"""A calibration factor outside this range is used, with a warning: the reference step or the
microbenchmarks were badly disturbed, or the roofline is far off for this CPU."""


class _CountOps(TorchDispatchMode):
    """Counts the ops dispatched: ``ops`` those ``StepCounter.op`` charges a fixed cost for (not
    ``is_alias``), ``dispatches`` all of them (what a dispatch mode pays on)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.dispatches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.dispatches += 1
        if not is_alias(func):
            self.ops += 1
        return func(*args, **(kwargs or {}))


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that only runs each op: the floor of what ``_regions.selective``'s modes pay per op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _runs_s(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``fn``, after one warm-up (first calls pay for lazy setup)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _best_s(fn: Callable[[], Any]) -> float:
    """Seconds of the least disturbed of ``_REPEATS`` runs of ``fn`` (noise only adds)."""
    return min(_runs_s(fn, _REPEATS))


def _held_tensor_overhead_us() -> float:
    """The engine's host cost per saved tensor it keeps, us: a chain of ``_HELD_TENSORS`` saves run
    forward and backward under the engine at budget None (its ``Session``, hooks and store, as
    ``offload.engine(None)`` installs them) against the same chain without it."""
    x = torch.ones(DEFAULT_MIN_OFFLOAD_BYTES // 4, requires_grad=True)
    session = Session(Config.from_user(None, device=torch.device("cpu")))

    def chain(engine: bool) -> None:
        if engine:
            session.enter()
        try:
            y = x
            for _ in range(_HELD_TENSORS):
                y = y.sin()  # saves its input: one pack in forward, one unpack in backward
            loss = y.sum()
        finally:
            if engine:
                session.exit(None, None, None)
        loss.backward()

    try:
        with_s, without_s = _best_s(lambda: chain(True)), _best_s(lambda: chain(False))
    finally:
        if session.store is not None:
            session.store.close()
    return max(0.0, (with_s - without_s) / _HELD_TENSORS * 1e6)


def _dispatch_overhead_us() -> float:
    """Host cost of one op under a Python dispatch mode, us: a forward of ``_TINY_OPS`` one-element
    ops under autograd inside ``_PassThrough`` against the same without it, over the ops it dispatched."""
    tiny = torch.ones(1, requires_grad=True)

    def forward() -> None:
        y = tiny
        for _ in range(_TINY_OPS):
            y = y * 1.0

    def under_mode() -> None:
        with _PassThrough():
            forward()

    counter = _CountOps()
    with counter:
        forward()
    return max(0.0, (_best_s(under_mode) - _best_s(forward)) / max(1, counter.dispatches) * 1e6)


def measure_machine(
    profile: Optional[MachineProfile] = None, *, dtype: torch.dtype = torch.float32, calibrate: bool = True
) -> Machine:
    """This CPU as a ``Machine``: ``profile`` (default ``offload.probe("cpu")``) for the link and
    per-tensor cost; a timed ``_MATMUL_SIZE``² matmul in ``dtype``, a timed 64 MiB copy, and for
    the cost of one op a chain of ``_TINY_OPS`` one-element ops run forward and backward under
    autograd, over the ops it dispatched (a training step's op pays autograd's bookkeeping too;
    best of ``_REPEATS``); the engine's host costs per saved tensor (``_held_tensor_overhead_us``)
    and per op under a dispatch mode (``_dispatch_overhead_us``). CUDA machines are measured on
    CUDA by the probe's link only: use a named machine for their compute. ``calibrate``: scale the
    compute by a timed reference step (``calibrate_compute``; see the module docstring)."""
    profile = probe("cpu") if profile is None else profile
    if profile.device_type != "cpu":
        raise ValueError(
            f"measure_machine measures this CPU; the profile is of {profile.device_type!r}: pass a named machine "
            "for a GPU's compute"
        )
    import psutil  # a dependency of the package; imported here to keep import offload light

    a = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE, dtype=dtype)
    src = torch.empty(_COPY_BYTES // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    tiny = torch.ones(1, requires_grad=True)

    def chain() -> None:  # a training step's worth of tiny ops: under autograd, forward and backward
        with torch.enable_grad():
            y = tiny
            for _ in range(_TINY_OPS):
                y = y * 1.0
            y.backward()

    counter = _CountOps()
    with counter:
        chain()

    matmul_s = _best_s(lambda: a @ a)
    copy_s = _best_s(lambda: dst.copy_(src))
    tiny_s = _best_s(chain)
    machine = Machine.from_probe(
        profile,
        flops=2 * _MATMUL_SIZE**3 / matmul_s,
        memory_gb_per_s=2 * _COPY_BYTES / copy_s / _GB,
        memory_bytes=int(psutil.virtual_memory().total),
        op_overhead_us=tiny_s / max(1, counter.ops) * 1e6,
        held_tensor_overhead_us=_held_tensor_overhead_us(),
        dispatch_overhead_us=_dispatch_overhead_us(),
    )
    return calibrate_compute(machine, dtype=dtype) if calibrate else machine


def _reference() -> tuple[torch.nn.Sequential, torch.Tensor]:
    r = _REFERENCE
    with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
        torch.manual_seed(0)
        layers = [
            torch.nn.TransformerEncoderLayer(r["width"], r["heads"], r["ffn"], dropout=0.0, batch_first=True)
            for _ in range(r["layers"])
        ]
        x = torch.randn(r["batch"], r["seq"], r["width"])
    return torch.nn.Sequential(*layers), x


def reference_step_ms(machine: Machine, *, dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(predicted, measured) ms of the reference step (``_REFERENCE``) on ``machine`` and on this
    CPU: the roofline of its counted ops, and the median of ``_REFERENCE_STEPS`` timed steps."""
    model, x = _reference()
    model, x = model.to(dtype), x.to(dtype)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    with torch.enable_grad():  # a training step, also when called under no_grad
        times = _runs_s(step, _REFERENCE_STEPS)
        run = fake_step(model, (x,), {}, machine, list(model), Attention.FUSED, None, DEFAULT_MIN_OFFLOAD_BYTES)
    predicted_ms = sum(c.forward_ms + c.backward_ms for c in run.counts)
    return predicted_ms, statistics.median(times) * 1e3


def calibrate_compute(machine: Machine, *, dtype: torch.dtype = torch.float32) -> Machine:
    """``machine`` (this CPU, measured) with its compute scaled so that the roofline prices the
    reference step (``reference_step_ms``) as long as it was measured here: FLOP/s and memory
    bandwidth times ``factor``, the op cost over it, ``factor`` = predicted / measured, kept in
    ``compute_scale``. The microbenchmarks keep the proportions of the three; the timed step sets
    their level. Raises ``ValueError`` for a GPU machine: this times the CPU."""
    if machine.device_type != "cpu":
        raise ValueError(
            f"calibrate_compute times this CPU; {machine.name!r} is a {machine.device_type!r} machine: "
            "a GPU's compute comes from a named machine's figures"
        )
    predicted_ms, measured_ms = reference_step_ms(machine, dtype=dtype)
    factor = predicted_ms / measured_ms
    if not _SCALE_WARN[0] <= factor <= _SCALE_WARN[1]:
        log.warning(
            "offload: the timed reference step took %.1f ms where the measured figures price it at %.1f ms "
            "(x%.2f); the machine was probably disturbed while it was measured: measure again on a quiet machine",
            measured_ms,
            predicted_ms,
            factor,
        )
    op_overhead_us = machine.assumptions.op_overhead_us / factor
    return dataclasses.replace(
        machine,
        peak_flops=machine.peak_flops * factor,
        memory_gb_per_s=machine.memory_gb_per_s * factor,
        assumptions=dataclasses.replace(machine.assumptions, op_overhead_us=op_overhead_us),
        compute_scale=machine.compute_scale * factor,
        source=f"{machine.source}, scaled x{factor:.2f} to a timed reference step",
    )
