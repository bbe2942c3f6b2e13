"""How fast steps under plans run against what their plans predicted: the pace a plan's step is read at.

Numbers in, a number out: nothing here touches torch.

A plan's step time is the cost model's: profiles measured on a few profiling steps (or derived
from them), transfer costs scaled by one "offload" trial. Each of those is one step's reading on a
machine whose speed drifts from minute to minute (10-20 % on the 2-vCPU AMD EPYC of
``bench/results/demo-cpu-selective.md``), and the trial's difference of two step times most of
all. So one engine's predictions share one error for as long as it runs: in one derive run on
that machine (``bench/results/shapes-derive-amd-200c3bd.json``), the median miss over twelve
lengths was -21 % for one MiniGPT engine (every length low, by 13-40 %) and +5 % for another built
alike; on the tiny Llama, -9 % for one and +15 % for another.

Every step under a plan is timed anyway (the next step's first region ends it), so it checks its
plan for free::

    step under a plan      measured ms / the plan's predicted ms  ─▶  the latest ``WINDOW`` ratios
    a plan read            its step, baseline and overhead x the median of them (``Plan.pace``)

The median, so that a step which also ran an evaluation, a checkpoint save, or a new shape's first
allocations does not move it; ``MIN_STEPS`` before any is applied. Plans are held, planned and
cached at the cost model's own times and paced only as they are read out, so the planner never
sees the pace: it corrects what a plan says a step costs, not which plan is chosen.
"""

from __future__ import annotations

import collections
import math
import statistics

from .noise import Readings

__all__ = ["MIN_STEPS", "WINDOW", "StepPace"]

WINDOW = 16
"""Ratios kept (the latest): enough for a median to ignore a few disturbed steps, few enough to
follow the machine within a minute of steps."""
MIN_STEPS = 2
"""Steps timed under plans before the pace departs from 1: one step alone may be the disturbed one."""


class StepPace:
    """Measured ÷ predicted over the latest steps under plans (see the module docstring)."""

    def __init__(self) -> None:
        self._ratios: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def add(self, predicted_ms: float, measured_ms: float) -> None:
        """One step under a plan: what its plan predicted and what it took, ms. A prediction that is
        not a positive finite number (no plan fits: an infinite step) checks nothing."""
        if not (math.isfinite(predicted_ms) and predicted_ms > 0 and math.isfinite(measured_ms) and measured_ms > 0):
            return
        self._ratios.append(measured_ms / predicted_ms)

    @property
    def steps(self) -> int:
        """Ratios held (at most ``WINDOW``)."""
        return len(self._ratios)

    def factor(self) -> float:
        """The median ratio, or 1.0 before ``MIN_STEPS`` were timed."""
        if len(self._ratios) < MIN_STEPS:
            return 1.0
        return statistics.median(self._ratios)

    def steady(self) -> bool:
        """Whether the steps agree well enough to read a plan's times by (``noise.MAX_SPREAD``);
        True before ``MIN_STEPS``, when no pace is applied."""
        return len(self._ratios) < MIN_STEPS or Readings(self._ratios).steady()

    def uncertainty(self) -> str:
        """For ``explain()``: "" where the steps agree, else how far apart they were, in words."""
        if self.steady():
            return ""
        readings = Readings(self._ratios)
        return (
            f"note: these step times are uncertain: the latest {len(self._ratios)} steps under a plan took "
            f"x{min(self._ratios):.3g}..x{max(self._ratios):.3g} what their plans predicted (their middle half "
            f"{readings.spread:.0%} of the median apart: a busy or drifting machine); read the overhead and the "
            f"baseline above as good to about that range"
        )

    def describe(self) -> str:
        """For ``explain()``: the factor and what it rests on."""
        if len(self._ratios) < MIN_STEPS:
            return f"the cost model's (x1: {len(self._ratios)} of {MIN_STEPS} steps under a plan timed so far)"
        return (
            f"x{self.factor():.3g} the cost model's (the median of measured / predicted over the latest "
            f"{len(self._ratios)} steps under a plan; they ranged x{min(self._ratios):.3g}..x{max(self._ratios):.3g})"
        )
