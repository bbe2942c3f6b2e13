"""How far apart repeated readings are, and when they are too far apart to build on.

Numbers in, numbers out. A time read once on a shared machine can be off by any factor: a busy
neighbour, a page-cache flush, a frequency change. So the engine takes several readings where a
figure is kept or decides something (the probe's figures, the pace of steps under plans), reads
their median, and says how spread they were: the interquartile range over the median. Where that
spread is wider than ``MAX_SPREAD`` the figure is not kept (the probe does not cache it) or is
flagged as uncertain (``explain()``), rather than stated as if it were known.

    readings  4.1  4.3  4.4  4.6  9.8   ─▶  median 4.4, quartiles 4.3..4.6, spread 0.07: kept
    readings  0.4  1.7  2.2  4.1  20    ─▶  median 2.2, quartiles 1.7..4.1, spread 1.1: not kept
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["MAX_SPREAD", "Readings"]

MAX_SPREAD = 0.5
"""The widest interquartile range, as a share of the median, of readings a figure is built on.
Repeated readings of one step or one copy spread by the machine's drift (10-20 % on the 2-vCPU
AMD EPYC of ``bench/results/demo-cpu-selective.md``); beyond half the median, something else was
running."""


class Readings:
    """Repeated readings of one figure: their median and how spread they are."""

    def __init__(self, values: Sequence[float]) -> None:
        if not values:
            raise ValueError("Readings needs at least one value")
        self.values = tuple(values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def iqr(self) -> float:
        """The interquartile range (0 for a single reading)."""
        if len(self.values) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.values, n=4, method="inclusive")
        return abs(q3 - q1)

    @property
    def spread(self) -> float:
        """Interquartile range over the median (0 for one or two readings' worth of agreement, inf
        where the median is 0 and the readings differ)."""
        iqr, median = self.iqr, self.median
        if median == 0:
            return 0.0 if iqr == 0 else float("inf")
        return iqr / abs(median)

    @property
    def deviation(self) -> float:
        """The median absolute deviation from the median, over the median: like ``spread``, but one
        reading in three far off moves it nothing (0 for one reading, inf where the median is 0
        and the readings differ). For few readings where one may be disturbed."""
        if len(self.values) < 2:
            return 0.0
        median = self.median
        mad = statistics.median(abs(v - median) for v in self.values)
        if median == 0:
            return 0.0 if mad == 0 else float("inf")
        return mad / abs(median)

    def steady(self) -> bool:
        """Whether the readings agree well enough to build on (``spread <= MAX_SPREAD``)."""
        return self.spread <= MAX_SPREAD
