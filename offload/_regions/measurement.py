"""One region's figures on a profiling step: forward now, backward when its gradient hooks fire.

Owned by ``Regions`` (which measures) and read by ``_plan.profiler`` (which plans from the profiles):

    forward     saved bytes and tensors through the engine (the store's count, or, on a
                "recompute" trial, what the recomputed region counted), wall time
    backward    hooks on the region's output (start) and inputs (end); a recomputed region's
                backward includes its recompute, timed on its own and taken out

On CUDA every stamp synchronizes the device first, so each figure is device time plus launch
overhead, the way a step experiences it. CUDA events would avoid the synchronizations; since only
the few profiling steps pay for them, the simpler wall-clock stamps are used.

Note: [measurement families]
    Regions of one module class, with the same parameter and buffer shapes, run on inputs of one
    signature (80 identical decoder layers) are one measurement family (``family_of``). What is
    measured once per family on a "recompute" trial and reused by its other calls in that step is
    the selective split: the extra re-run under a dispatch mode that counts which saves are cheap
    to re-make, which expensive outputs a selective run stashes, its time and the forward's FLOPs
    (``SelectiveProfile``). That re-run (one more forward of the region, under a dispatch mode
    that works in Python per op) is the one per-region cost of profiling beyond running the region
    itself, so a model of N identical blocks pays it once, not N times. On the CPU's tiny blocks
    of ``bench/results/scale-cpu.md`` the "recompute" trial step ran x0.55-0.98 with families
    (one process, interleaved, 100 to 3,000 regions), and the whole profiling x0.90-1.14, within
    the machine's noise; the count of re-runs is what a test holds
    (``tests/test_measurement_families.py``). What stays per call, because it is the step's own
    work and costs nothing extra: the sizes the store (or the recompute's placeholders)
    counted, the forward, recompute and backward clocks. What this gives up: regions of one class
    and shape that compute differently (a flag set per layer, data-dependent routing) share one
    split; their times and sizes are still their own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from .._cost import RegionProfile
from .selective import SelectiveProfile

__all__ = [
    "Measurement",
    "family_of",
    "finish_after_backward",
    "merged_profile",
    "span_ms",
    "tensors_in",
]


def family_of(module: torch.nn.Module, signature: tuple, compiled: bool) -> tuple:
    """A region call's measurement family (See Note: [measurement families]): its module's class,
    whether it is compiled, the shapes and dtypes of its parameters and buffers, and the call's
    input signature."""
    tensors = (*module.named_parameters(), *module.named_buffers())
    return (type(module), compiled, tuple((name, tuple(t.shape), t.dtype) for name, t in tensors), signature)


def finish_after_backward(out: Any, finish: Callable[[], None]) -> None:
    """Run ``finish`` once the backward that reaches ``out`` (the last region's output) completes."""
    outputs = [t for t in tensors_in(out) if t.requires_grad]
    if not outputs:
        return
    queued: list[bool] = []

    def queue(grad: torch.Tensor) -> None:
        if not queued:
            queued.append(True)
            torch.autograd.Variable._execution_engine.queue_callback(finish)

    outputs[0].register_hook(queue)  # dies with the output; fires at most once per step's backward


def span_ms(measurements: list) -> Optional[float]:
    """Wall time from the first region's forward start to the end of its backward, ms (None
    where its backward was not timed): the regions' whole share of a step, head and loss included."""
    if not measurements or measurements[0].end is None:
        return None
    return (measurements[0].end - measurements[0].forward_start) * 1e3


def tensors_in(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


class Measurement:
    """One region on a profiling step (see the module docstring)."""

    def __init__(self, *, name: str, index: int, input_bytes: int) -> None:
        self.name, self.index, self.input_bytes = name, index, input_bytes
        self.saved_bytes = self.num_tensors = self.largest_tensor_bytes = 0
        self.forward_start, self.forward_ms = 0.0, 0.0
        self.recompute_ms = 0.0
        self.start = self.end = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.selective: Optional[SelectiveProfile] = None  # a "recompute" step: what selective would cost
        self.shares: Optional[Measurement] = None
        """The call of its family whose selective split it reuses (See Note: [measurement families])."""
        self.note = ""

    def add_recompute(self, ms: float) -> None:
        self.recompute_ms += ms

    def add_selective(self, selective: SelectiveProfile) -> None:
        self.selective = selective
        self.note = selective.why_not and f"recomputed whole: {selective.why_not}"

    def time_backward(self, args: tuple, kwargs: dict, out: Any, cuda: Optional[torch.device]) -> None:
        outputs = [t for t in tensors_in(out) if t.requires_grad]
        inputs = [t for t in tensors_in(list(args) + list(kwargs.values())) if t.requires_grad]
        if not (outputs and inputs):
            return

        def stamp():
            if cuda is not None:
                torch.cuda.synchronize(cuda)
            return time.perf_counter()

        def at_output(grad):
            if self.start is None:
                self.start = stamp()

        def at_input(grad):
            self.end = stamp()

        self._hooks.append(outputs[0].register_hook(at_output))
        self._hooks.extend(t.register_hook(at_input) for t in inputs)

    def raw_backward_ms(self) -> float:
        """Measured wall time of the region's backward (its recompute included), or 0 where the
        hooks did not both fire."""
        if self.start is None or self.end is None or self.end <= self.start:
            return 0.0
        return (self.end - self.start) * 1e3

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def profile(self) -> RegionProfile:
        raw_ms = self.raw_backward_ms()
        selective = self._split()
        return RegionProfile(
            name=self.name,
            saved_bytes=self.saved_bytes,
            input_bytes=self.input_bytes,
            forward_ms=self.forward_ms,
            num_tensors=self.num_tensors,
            largest_tensor_bytes=self.largest_tensor_bytes,
            backward_ms=max(0.0, raw_ms - self.recompute_ms - self.profiling_ms()) if raw_ms > 0 else 0.0,
            recompute_ms=self.recompute_ms,
            forward_flops=0 if selective is None else selective.forward_flops,
            note=self.note or (f"recomputed whole: {selective.why_not}" if selective and selective.why_not else ""),
            **_selective_fields(selective),
        )

    def _split(self) -> Optional[SelectiveProfile]:
        """The selective split measured on this call, or on the family's call it shares."""
        if self.selective is not None or self.shares is None:
            return self.selective
        return self.shares.selective

    def profiling_ms(self) -> float:
        """Wall time of the extra re-run that measured selective costs on this call (none, or a
        split shared from its family: 0), ms."""
        return 0.0 if self.selective is None else self.selective.rerun_ms


def _selective_fields(s: Optional[SelectiveProfile]) -> dict:
    if s is None or s.why_not:
        return {}
    return {
        "selective_ms": s.selective_ms,
        "cheap_bytes": s.cheap_bytes,
        "expensive_bytes": s.expensive_bytes,
        "expensive_tensors": s.expensive_tensors,
    }


_SUMMED = (
    "saved_bytes",
    "input_bytes",
    "forward_ms",
    "num_tensors",
    "forward_dispatches",
    "backward_ms",
    "recompute_ms",
    "forward_flops",
)
"""``RegionProfile`` fields that add up over a region's calls in one step."""
_SELECTIVE = ("cheap_bytes", "expensive_bytes", "expensive_tensors", "selective_ms")
"""The fields of a measured selective run: summed where every call measured one, else all 0."""


def merged_profile(name: str, calls: Sequence[Measurement]) -> RegionProfile:
    """One region's profile over its calls in a step (See Note: [region calls] in ``regions``): the
    sums of what adds up, the largest storage of any call; a selective run only where every call
    measured one (a call that cannot be split makes the region unsplittable); a region that did
    not run saves and costs nothing."""
    profiles = [m.profile() for m in calls]
    if len(profiles) == 1:
        return profiles[0]
    if not profiles:
        return RegionProfile(name=name, saved_bytes=0)
    merged = {field: sum(getattr(p, field) for p in profiles) for field in _SUMMED}
    every = all(p.selective_measured() for p in profiles)
    merged.update({field: sum(getattr(p, field) for p in profiles) if every else 0 for field in _SELECTIVE})
    note = next((p.note for p in profiles if p.note), "")
    largest = max(p.largest_tensor_bytes for p in profiles)
    return dataclasses.replace(profiles[0], **merged, largest_tensor_bytes=largest, note=note)
