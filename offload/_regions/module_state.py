"""Module state across a region's re-run: a re-run sees what the forward saw, and leaves what it left.

A recomputed region runs its forward again in backward (a selective one its cheap ops; a
"recompute" profiling trial twice more). Its modules' own state would be updated by every run:
BatchNorm's running statistics and ``num_batches_tracked``, a spectral norm's power-iteration
vector, a counter. ``torch.utils.checkpoint`` leaves it so (BatchNorm counts two batches per
step). Here:

Note: [a re-run leaves module state as the forward left it]
    The state of a region is each of its modules' buffers and plain-number attributes (``int``,
    ``float``, ``bool`` in the module's ``__dict__``). Every re-run
    - starts from the state the forward started from, so it computes what the forward computed (a
      normalizer that updates its running mean and then divides by it, a power iteration);
    - ends by putting back the state found when it began, the one the forward left, so the model's
      state after a step equals the run without the engine exactly, byte for byte.
    Buffers are written through ``.data``: the bytes go back without a version bump, so a saved
    tensor elsewhere that aliases a buffer sees what it saw before the re-run, and the versions
    are those of the run without the engine.

    After a re-run every buffer of the region gets its bytes back, changed by the forward or not:
    the version counter cannot tell what a forward wrote (BatchNorm writes its running statistics
    without bumping it). The start values a re-run begins from are kept only for the buffers a
    forward changes, which are learned: the first forward of a region in each train/eval setting
    of its modules keeps every buffer and compares them when it ends (one device synchronization
    for them all); later forwards keep only the buffers learned to change (no compare, no
    synchronization), and notice others only by a new tensor or a version bump. A frame made per
    call (``offload.checkpoint``) has nothing to learn from: it keeps every buffer and compares
    none. A buffer a later
    forward changes for the first time has no start value kept: that re-run starts from the value
    the forward left (as ``torch.utils.checkpoint``'s would), the state after it is still exact,
    and where the change was seen a warning says so once.

    forward:  start = region_state.forward_started()   clones of the buffers forwards change
              fn(*args)                                 (all of them, while learning), numbers
              start.forward_ended()                     learn what changed; drop the other clones
    re-run:   with start.rerun():                       every buffer cloned; the changed ones and
                  fn(*args)                             the numbers set as the forward found them;
                                                        after: every buffer and number as on entry
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any, Optional

import torch

__all__ = ["ForwardStart", "RegionState", "modules_of"]

_NUMBERS = (int, float, bool)
"""Attribute types kept as state (exactly these: a subclass may carry anything)."""


def modules_of(fn: Any) -> tuple[torch.nn.Module, ...]:
    """The module a callable runs: ``fn`` itself, or the module a bound method belongs to; none
    for another callable (its state is not looked after)."""
    if isinstance(fn, torch.nn.Module):
        return (fn,)
    owner = getattr(fn, "__self__", None)
    return (owner,) if isinstance(owner, torch.nn.Module) else ()


def _numbers(module: torch.nn.Module) -> dict[str, Any]:
    return {k: v for k, v in module.__dict__.items() if type(v) in _NUMBERS}


def _set_numbers(module: torch.nn.Module, numbers: dict[str, Any]) -> None:
    """Make ``module``'s plain-number attributes exactly ``numbers`` (ones added since go)."""
    for k in [k for k in _numbers(module) if k not in numbers]:
        del module.__dict__[k]
    module.__dict__.update(numbers)


@dataclasses.dataclass
class _Buffer:
    """One buffer at the forward's start: the tensor registered, its version, and its value where kept."""

    module: torch.nn.Module
    name: str
    tensor: torch.Tensor
    version: int
    value: Optional[torch.Tensor] = None
    """A clone taken at the forward's start (the buffers forwards change), else None."""

    def now(self) -> Optional[torch.Tensor]:
        return self.module._buffers.get(self.name)

    def replaced_or_bumped(self) -> bool:
        """Changed in a way the tensor itself shows: a new tensor, or a version bump."""
        now = self.now()
        return now is not self.tensor or self.tensor._version != self.version

    @property
    def key(self) -> tuple[torch.nn.Module, str]:
        return (self.module, self.name)


def _unique_modules(roots: tuple[torch.nn.Module, ...]) -> list[torch.nn.Module]:
    seen: dict[int, torch.nn.Module] = {}
    for root in roots:
        for m in root.modules():
            seen.setdefault(id(m), m)
    return list(seen.values())


def _buffers(modules: list[torch.nn.Module]) -> Iterator[tuple[torch.nn.Module, str, torch.Tensor]]:
    for module in modules:
        for name, t in module._buffers.items():
            if t is not None:
                yield module, name, t


def _write(module: torch.nn.Module, name: str, tensor: Optional[torch.Tensor], value: torch.Tensor) -> None:
    """Make buffer ``name`` the tensor ``tensor`` holding ``value``'s bytes (no version bump)."""
    if tensor is None:
        module._buffers[name] = value.clone()
        return
    if module._buffers.get(name) is not tensor:
        module._buffers[name] = tensor
    tensor.data.copy_(value)  # See Note: [a re-run leaves module state as the forward left it]


def _changed_by_value(buffers: list[_Buffer]) -> list[bool]:
    """Per buffer (each with a start value kept), whether its value differs from its start: one
    comparison per device, read with one synchronization. A tensor without values to compare (meta,
    a fake tensor while tracing, another subclass) counts as changed."""
    flags = [True] * len(buffers)
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, b in enumerate(buffers):
        value, now = b.value, b.tensor
        if value is None or b.replaced_or_bumped() or type(now) is not torch.Tensor or now.device.type == "meta":
            continue
        if value.shape == now.shape:
            by_device.setdefault(now.device, []).append((i, torch.ne(value, now).any()))
    for pairs in by_device.values():
        differs = torch.stack([d for _, d in pairs]).tolist()
        for (i, _), d in zip(pairs, differs, strict=True):
            flags[i] = bool(d)
    return flags


class RegionState:
    """What one region's forwards change of its modules' state, learned per train/eval setting."""

    def __init__(self, modules: tuple[torch.nn.Module, ...], name: str, *, learn: bool = True) -> None:
        self.modules = modules
        self.name = name
        self.learn = learn
        """Learn which buffers forwards change (a region, run every step). False for a frame made
        per call (``offload.checkpoint``): it keeps every buffer and compares none, so a call never
        waits for the device."""
        self._changing: dict[tuple[bool, ...], set[tuple[torch.nn.Module, str]]] = {}
        """Per setting of the modules' ``training`` flags: (module, buffer name) of the buffers its
        forwards change (absent: not learned yet)."""
        self._warned = False

    def forward_started(self) -> ForwardStart:
        """The state now, as a forward of the region begins."""
        modules = _unique_modules(self.modules)
        setting = tuple(m.training for m in modules)
        changing = self._changing.get(setting) if self.learn else None
        buffers = []
        for module, name, t in _buffers(modules):
            b = _Buffer(module, name, t, t._version)
            if changing is None or b.key in changing:
                b.value = t.detach().clone()
            buffers.append(b)
        return ForwardStart(
            self, setting, changing is None and self.learn, buffers, [(m, _numbers(m)) for m in modules]
        )

    def learned(self, setting: tuple[bool, ...], learning: bool, changed: list[_Buffer]) -> None:
        """A forward ended having changed ``changed``; warn once where one had no start value kept."""
        known = self._changing.setdefault(setting, set())
        unkept = [b for b in changed if b.value is None and b.now() is b.tensor]
        known.update(b.key for b in changed)
        if unkept and not learning and not self._warned:
            self._warned = True
            names = ", ".join(sorted({b.name for b in unkept}))
            warnings.warn(
                f"offload: region {self.name!r} changed buffer(s) {names} in its forward for the first time this "
                "step; this step's re-run started from the value the forward left, not the one it found (the "
                "model's state after the step is exact). From the next step on the start value is kept for re-runs",
                UserWarning,
                stacklevel=2,
            )


class ForwardStart:
    """The state of a region's modules when one of its forwards began (See Note: [a re-run leaves
    module state as the forward left it])."""

    def __init__(
        self, region: RegionState, setting: tuple[bool, ...], learning: bool, buffers: list[_Buffer], numbers: list
    ) -> None:
        self._region = region
        self._setting = setting
        self._learning = learning
        self._buffers = buffers
        self._numbers = numbers

    @classmethod
    def empty(cls) -> ForwardStart:
        """A start with no module: nothing to keep or put back (a frame before its forward ran)."""
        return cls(RegionState((), ""), (), False, [], [])

    def forward_ended(self) -> None:
        """Learn what the forward changed; keep only what a re-run needs."""
        if self._learning:
            changed = [b for b, c in zip(self._buffers, _changed_by_value(self._buffers), strict=True) if c]
        else:  # the buffers learned to change, and any a new tensor or a version bump shows
            changed = [b for b in self._buffers if b.value is not None or b.replaced_or_bumped()]
        self._region.learned(self._setting, self._learning, changed)
        self._buffers = changed

    @contextlib.contextmanager
    def rerun(self):
        """Inside: the state as the forward found it. After: the state as found on entering."""
        modules = [m for m, _ in self._numbers]
        entered = [(m, name, t, t.detach().clone()) for m, name, t in _buffers(modules)]
        numbers_entered = [(m, _numbers(m)) for m in modules]
        for b in self._buffers:  # the buffers the forward changed, as it found them
            now = b.now()
            if b.value is not None:
                _write(b.module, b.name, b.tensor if now is b.tensor else None, b.value)
            elif now is not b.tensor:  # assigned anew by the forward: its start is the old tensor
                b.module._buffers[b.name] = b.tensor
        for m, numbers in self._numbers:
            _set_numbers(m, numbers)
        try:
            yield
        finally:  # every buffer, changed by the forward or not: a write that bumps no version is not seen
            for m, name, t, value in entered:
                _write(m, name, t, value)
            for m, numbers in numbers_entered:
                _set_numbers(m, numbers)
