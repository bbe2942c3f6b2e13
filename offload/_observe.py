"""Step boundaries and recompute times, told to whoever asked (traces, metrics): the observer seam.

The engine has no notion of a training step of its own: the user enters it around a forward and
runs backward after. This module turns what the session sees into step events, one step per
forward (outermost ``with eng:`` with grad enabled) and the backward that unpacks from it::

    IDLE ──enter──▶ FORWARD ──exit──▶ FORWARD_DONE ──first unpack in a backward──▶ BACKWARD
      ▲              step_began          forward_ended        backward_began          │
      │                                      │ enter (no backward came: an evaluation  │
      │                                      ▼  or a forward whose saves all passed)   │
      └──────────── step_ended(backward=False) / step_ended(backward=True) ◀───────────┘
                                              end of that backward (autograd callback)

One thread steps at a time; only its outermost entry counts; nested entries, and entries under
``torch.no_grad()`` (they save nothing), are ignored. An unpack during the forward (a
``torch.autograd.grad`` inside it) does not start the backward. The end of the backward is an
autograd final callback queued by the first unpack, so it fires when ``backward()`` finishes.
A backward that unpacks nothing from the engine (every save of the step passed through: tiny
tensors under ``min_offload_bytes``, parameters) is not seen: that step ends, without a backward,
when the next one begins.

Cost when nobody observes: the session checks ``if observers`` at each outermost entry and exit,
and one attribute per unpack. Recomputes are timed only when an observer asks, for this step
(``wants_recompute_times``): timing synchronizes a CUDA device before and after each recompute.
"""

from __future__ import annotations

import enum
import time
from typing import Callable, Optional

import torch

__all__ = ["Observer", "Observers", "StepPhase"]


class StepPhase(enum.Enum):
    """Where the current step is (see the module docstring)."""

    IDLE = "idle"
    FORWARD = "forward"
    FORWARD_DONE = "forward_done"
    BACKWARD = "backward"


class Observer:
    """Base class of what an engine tells about its steps; override what you need.

    Every time is ``time.time_ns()`` (what OpenTelemetry stamps spans with). Calls come from the
    thread that runs the forward, except ``backward_began``, ``recomputed`` and ``step_ended``
    after a backward, which come from the thread autograd runs the backward on (on CUDA, its
    device thread).
    """

    def wants_recompute_times(self) -> bool:
        """Asked as each step begins: True to be told each region recompute's wall time this step."""
        return False

    def step_began(self, time_ns: int) -> None:
        """The step's forward began (the outermost ``with eng:`` was entered)."""

    def forward_ended(self, time_ns: int) -> None:
        """The step's forward ended (the outermost ``with eng:`` was left)."""

    def backward_began(self, time_ns: int) -> None:
        """The step's backward unpacked its first tensor from the engine."""

    def recomputed(self, region: str, ms: float, end_ns: int) -> None:
        """A region's forward was re-run in backward, taking ``ms`` and ending at ``end_ns``."""

    def step_ended(self, time_ns: int, backward: bool) -> None:
        """The step ended: its backward finished (``backward=True``), or the next step began (or
        the observer was removed) before any backward unpacked from it (``backward=False``)."""


class Observers:
    """An engine's observers and the phase of its current step."""

    def __init__(self) -> None:
        self._observers: list[Observer] = []
        self.phase = StepPhase.IDLE
        self.awaiting_backward = False
        """``phase is FORWARD_DONE``, kept as a plain attribute: the session reads it per unpack."""
        self._timed = False  # an observer asked for this step's recompute times

    def __bool__(self) -> bool:
        return bool(self._observers)

    def add(self, observer: Observer) -> None:
        """Start telling ``observer`` (from the next step on)."""
        if not isinstance(observer, Observer):
            raise TypeError(f"an engine observer must subclass offload._observe.Observer, got {observer!r}")
        self._observers.append(observer)

    def remove(self, observer: Observer) -> None:
        """Stop telling ``observer``; a step it saw begin is ended for it first (backward=False)."""
        if observer not in self._observers:
            return
        if self.phase is not StepPhase.IDLE:
            observer.step_ended(time.time_ns(), backward=False)
        self._observers.remove(observer)
        if not self._observers:
            self._set(StepPhase.IDLE)
            self._timed = False

    # ------------------------------------------------------------------ what the session tells

    def entered(self) -> None:
        """The outermost ``with eng:`` of a thread was entered."""
        if not torch.is_grad_enabled() or self.phase is StepPhase.BACKWARD:
            return
        now = time.time_ns()
        if self.phase is StepPhase.FORWARD_DONE:
            self._end(now, backward=False)
        if self.phase is StepPhase.IDLE:
            self._set(StepPhase.FORWARD)
            self._timed = any(o.wants_recompute_times() for o in self._observers)
            for o in self._observers:
                o.step_began(now)

    def exited(self) -> None:
        """The outermost ``with eng:`` of a thread was left."""
        if self.phase is not StepPhase.FORWARD:
            return
        self._set(StepPhase.FORWARD_DONE)
        now = time.time_ns()
        for o in self._observers:
            o.forward_ended(now)

    def unpacked(self) -> None:
        """The first unpack after the forward ended: the backward began, if one is running."""
        if self.phase is not StepPhase.FORWARD_DONE or torch._C._current_graph_task_id() == -1:
            return  # an unpack outside any backward (reading grad_fn._saved_* by hand)
        self._set(StepPhase.BACKWARD)
        now = time.time_ns()
        for o in self._observers:
            o.backward_began(now)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        if self.phase is StepPhase.BACKWARD:
            self._end(time.time_ns(), backward=True)

    def _set(self, phase: StepPhase) -> None:
        self.phase = phase
        self.awaiting_backward = phase is StepPhase.FORWARD_DONE

    def _end(self, now: int, backward: bool) -> None:
        self._set(StepPhase.IDLE)
        self._timed = False
        for o in self._observers:
            o.step_ended(now, backward=backward)

    # ------------------------------------------------------------------ what the regions ask

    def recompute_timer(
        self, region: str, also: Optional[Callable[[float], None]] = None
    ) -> Optional[Callable[[float], None]]:
        """The ``on_recompute`` callback for a region's recompute this step: it tells the
        observers (when one asked for times this step) and calls ``also``. None when neither."""
        if not self._timed:
            return also

        def on_recompute(ms: float) -> None:
            end_ns = time.time_ns()
            if also is not None:
                also(ms)
            for o in self._observers:
                o.recomputed(region, ms, end_ns)

        return on_recompute
