"""Regions: measure each one on a first step, plan, then keep, offload or recompute it.

Owns the per-region side of the engine: wrapping the region modules' ``forward``, profiling a
step (saved bytes and forward time per region), asking the planner for a decision per region,
and carrying each decision out on later steps. Plans are keyed by the shapes of the first
region's inputs, so a new sequence length or batch size is profiled and planned once, then
reused.

    step with new shapes:  region 0 ─measure─▶ region 1 ─measure─▶ ... last ─▶ make_plan() ─▶ cache
    (twice: the first measurement carries warm-up costs; the second plan replaces the first)
    later steps:           region i ─▶ KEEP: run as is (the budget still holds per tensor)
                                     ─▶ OFFLOAD: run; each save starts its copy out at once
                                     ─▶ RECOMPUTE: offload.checkpoint(region): only inputs saved
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from ._cost import MachineProfile, RegionProfile
from ._planner import Decision, Plan, make_plan
from ._recompute import checkpoint

__all__ = ["Regions", "resolve_regions"]

log = logging.getLogger(__name__)

_PROFILED_POLICIES = ("auto", "offload")
"""Policies whose decisions depend on measured sizes and times; "recompute" and "none" do not."""

PROFILE_STEPS = 2
"""Steps measured per new input signature. The first pays one-time costs (allocator growth, lazy
initialisation, kernel selection: 10x the steady forward time of the first block was seen on the
CPU), so its plan is provisional and the second step's measurement replaces it."""


def resolve_regions(regions, model: Optional[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) pairs from an iterable of modules or a ``(module, name) -> bool`` filter."""
    if callable(regions) and not isinstance(regions, torch.nn.Module):
        if model is None:
            raise ValueError("regions= given as a filter (module, name) -> bool needs model= to search; pass model=")
        found = [(name, m) for name, m in model.named_modules() if name and regions(m, name)]
    else:
        if isinstance(regions, torch.nn.Module) and not isinstance(regions, (torch.nn.ModuleList, torch.nn.Sequential)):
            raise TypeError("regions= takes an iterable of nn.Modules (e.g. model.blocks) or a filter function")
        names = {id(m): name for name, m in model.named_modules()} if model is not None else {}
        found = []
        for i, m in enumerate(regions):
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"regions= item {i} is {type(m).__name__}, not an nn.Module")
            found.append((names.get(id(m), f"region{i}"), m))
    if not found:
        raise ValueError("regions= selected no module; pass e.g. regions=model.blocks")
    if len({id(m) for _, m in found}) != len(found):
        raise ValueError("regions= lists the same module twice; each region must be a distinct module")
    return found


def _signature(args, kwargs) -> tuple:
    return tuple(
        (tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else type(a).__name__
        for a in list(args) + list(kwargs.values())
    )


def _input_bytes(args, kwargs) -> int:
    return sum(a.untyped_storage().nbytes() for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))


class Regions:
    """The regions of one engine: wrapped forwards, profiles, plans per input signature."""

    def __init__(
        self,
        regions: list[tuple[str, torch.nn.Module]],
        policy: str,
        budget_bytes: Optional[int],
        machine: Callable[[], MachineProfile],
        active: Callable[[], bool],
        eager: Callable[[bool], bool],
        on_recompute: Callable[[], None],
        saved_bytes: Callable[[], tuple[int, int]],
    ) -> None:
        self.regions = regions
        self.policy = policy
        self.budget_bytes = budget_bytes
        self._machine = machine
        self._active = active
        self._eager = eager
        self._on_recompute = on_recompute
        self._saved = saved_bytes
        self.plans: dict[tuple, Plan] = {}
        self.plan: Optional[Plan] = None
        self._profiles: Optional[list[_Measurement]] = None
        self._measured: dict[tuple, int] = {}
        self._pending: Optional[tuple[tuple, list[_Measurement]]] = None  # measured, backward still to run
        self._step_start: Optional[float] = None
        self._step_profiled = False
        self._other_ms = 0.0
        self._originals = []
        for index, (name, module) in enumerate(regions):
            self._originals.append((module, module.__dict__.get("forward")))
            module.forward = self._wrap(index, name, module.forward)

    def restore(self) -> None:
        """Put the modules' own forwards back."""
        for module, original in self._originals:
            if original is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = original
        self._originals = []

    def _wrap(self, index: int, name: str, forward):
        def region_forward(*args, **kwargs):
            if not (self._active() and torch.is_grad_enabled()):
                return forward(*args, **kwargs)
            if index == 0:
                self._begin_step(args, kwargs)
            decision = self._decision(index)
            if self._profiles is not None:
                return self._measure(index, name, forward, args, kwargs)
            if decision is Decision.RECOMPUTE:
                self._on_recompute()
                return checkpoint(forward, *args, name=name, **kwargs)
            if decision is Decision.OFFLOAD:
                previous = self._eager(True)
                try:
                    return forward(*args, **kwargs)
                finally:
                    self._eager(previous)
            return forward(*args, **kwargs)

        region_forward.__wrapped__ = forward
        return region_forward

    def _begin_step(self, args, kwargs) -> None:
        now = time.perf_counter()
        if self._step_profiled and self._step_start is not None and self._pending is not None:
            # The measured step ran from its first region to now: whatever its regions' forward and
            # backward did not cover (embedding, head, loss, optimizer) is the rest of the step.
            step_ms = (now - self._step_start) * 1e3
            self._other_ms = max(0.0, step_ms - sum(m.forward_ms + m.backward_ms() for m in self._pending[1]))
        self.finish_pending()
        self._step_start = now
        key = _signature(args, kwargs)
        self.plan = self.plans.get(key)
        self._key = key
        measuring = self.policy in _PROFILED_POLICIES and self._measured.get(key, 0) < PROFILE_STEPS
        self._profiles = [] if measuring else None
        self._step_profiled = measuring

    def finish_pending(self) -> None:
        """Plan from the last measured step, now that its backward has run (or will not be timed)."""
        if self._pending is None:
            return
        key, measurements = self._pending
        self._pending = None
        for m in measurements:
            m.remove_hooks()
        profiles = [m.profile() for m in measurements]
        self._measured[key] = self._measured.get(key, 0) + 1
        plan = make_plan(profiles, self._machine(), self.budget_bytes, self.policy, other_ms=self._other_ms)
        self.plans[key] = plan
        if self._key == key:
            self.plan = plan
        log.info("offload plan for inputs %s:\n%s", key, plan)

    def _decision(self, index: int) -> Decision:
        if self.plan is not None:
            return self.plan.regions[index].decision
        return Decision.RECOMPUTE if self.policy == "recompute" else Decision.KEEP

    def _measure(self, index: int, name: str, forward, args, kwargs):
        cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if cuda:
            torch.cuda.synchronize()
        bytes_before, tensors_before = self._saved()
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        forward_ms = (time.perf_counter() - start) * 1e3
        bytes_after, tensors_after = self._saved()
        m = _Measurement(
            name=name,
            saved_bytes=bytes_after - bytes_before,
            input_bytes=_input_bytes(args, kwargs),
            forward_ms=forward_ms,
            num_tensors=tensors_after - tensors_before,
        )
        m.time_backward(args, kwargs, out, cuda)
        self._profiles.append(m)
        if index == len(self.regions) - 1:
            self._pending, self._profiles = (self._key, self._profiles), None
        return out


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class _Measurement:
    """One region on a measured step: forward figures now, backward time when its hooks fire.

    The region's backward runs between the gradient reaching its output (hook on the output) and
    the gradient of its inputs being complete (hooks on the inputs). On CUDA the hooks synchronize,
    which is acceptable on the measured steps only.
    """

    def __init__(self, *, name, saved_bytes, input_bytes, forward_ms, num_tensors) -> None:
        self.name, self.saved_bytes, self.input_bytes = name, saved_bytes, input_bytes
        self.forward_ms, self.num_tensors = forward_ms, num_tensors
        self._start = self._end = None
        self._hooks = []

    def time_backward(self, args, kwargs, out, cuda: bool) -> None:
        outputs = [t for t in _tensors(out) if t.requires_grad]
        inputs = [t for t in _tensors(list(args) + list(kwargs.values())) if t.requires_grad]
        if not (outputs and inputs):
            return

        def stamp():
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def at_output(grad):
            if self._start is None:
                self._start = stamp()

        def at_input(grad):
            self._end = stamp()

        self._hooks.append(outputs[0].register_hook(at_output))
        self._hooks.extend(t.register_hook(at_input) for t in inputs)

    def backward_ms(self) -> float:
        """Measured backward time, or 0 where the hooks did not both fire (the planner then estimates)."""
        if self._start is None or self._end is None or self._end <= self._start:
            return 0.0
        return (self._end - self._start) * 1e3

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def profile(self) -> RegionProfile:
        return RegionProfile(
            name=self.name, saved_bytes=self.saved_bytes, input_bytes=self.input_bytes,
            forward_ms=self.forward_ms, num_tensors=self.num_tensors, backward_ms=self.backward_ms(),
        )
