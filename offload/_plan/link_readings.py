"""What an engine's "offload" trial steps read of the link: the scales accepted (each with how far
off it may be), those rejected as implausible, and the scale transfers are priced at.

The profiler offers each trial's reading (``offer``) and plans at ``scale``; explain says in words
what the readings are (``note``). Pure: numbers in, a verdict and a scale out.
"""

from __future__ import annotations

import enum
import logging
import math
import statistics
from typing import Optional

from .noise import MAX_SPREAD, Readings

__all__ = ["CALIBRATION_TRIES", "PLAUSIBLE_LINK_SCALE", "LinkReadings", "Verdict"]

log = logging.getLogger("offload._plan.profiler")
"""The profiler's logger, as before these readings had a module of their own: users filter the
calibration's messages by that name."""

# Note: [a calibration that cannot lie]
#     The probe times one large buffer with nothing else running; an "offload" trial step scales
#     all transfer costs by what moving every region really cost it (``calibrate_link``). That
#     figure comes from the difference of two noisy step times, and can read absurd: a trial no
#     slower than its reference gives ``calibrate_link``'s floor, x0.001, a link far faster than the
#     disk under it, and a plan built on it would flip with the next build's reading. A transfer
#     cannot be much faster than the probe measured the link alone, and one many times slower says
#     the step was disturbed: a scale outside ``PLAUSIBLE_LINK_SCALE`` is not planned on. The trial is run
#     again (``CALIBRATION_TRIES`` in all); if every one is implausible, the probe's own figures
#     are used, and a warning says so.
PLAUSIBLE_LINK_SCALE = (0.01, 100.0)
"""A calibrated transfer cost may be from a hundredth to 100 times the probe's. Below: the step
that moved everything was no slower than the one that kept it (``calibrate_link`` then returns its
floor, 1e-3), which the bytes it moved rule out, a timing fluke, not a link. A scale well under 1
is plausible (the probe charges each small tensor a disk round trip that a step's spill threads
overlap: x0.17-x0.4 measured on GPT-2 here); one above 100 says the step was disturbed."""

# Note: [a probe slower than the steps]
#     A reading below ``PLAUSIBLE_LINK_SCALE`` says the step that moved everything was no slower
#     than the one that kept it. That is a fluke only where the probe's figures say moving costs
#     more than the steps' noise could hide. The probe's cache can be wrong too: measured by
#     another process under load, it read 348 us a tensor where the machine quiet takes 7.7 us
#     (issue 47), and every engine then read x0.001 and warned. So each trial also gives the
#     highest scale its noise leaves possible (``ceiling``: moving everything would cost the step's
#     noise). Where every trial read too low:
#     - their highest ceiling is 1 or more: the probe's figures are as the steps allow (the
#       transfers hide in the noise); they stand, and nothing is wrong to warn about;
#     - it is below 1: the probe's figures are slower than every step the engine measured allows;
#       transfers are priced at that ceiling (the dearest the steps allow, at least the plausible
#       floor), and the warning says to measure the probe again.
#     Figures the user passed (``machine=``) are what the user says of the machine, not a reading
#     the engine took: they are never replaced (the profiler offers no ceiling), only scaled within
#     the plausible range as any figures are, and too low a reading is measured again, then left.

CALIBRATION_TRIES = 2
"""Offload trials at most whose calibration is implausible before the probe's figures are used."""


class Verdict(enum.Enum):
    """What became of one trial's reading."""

    ACCEPTED = "accepted"
    """Plausible: added to the readings, the scale is their median (or the probe's, x1, where they
    lie too far apart to plan on)."""
    KEPT = "kept"
    """Implausible, and earlier readings were accepted: they stand."""
    AGAIN = "again"
    """Implausible, none accepted yet, tries left: measure it again."""
    PROBE = "probe"
    """Implausible on every try: the probe's own figures (x1) stand."""


class LinkReadings:
    """The link's readings of one engine (See Note: [a calibration that cannot lie] and the
    profiler's Note: [a plan that holds still])."""

    __slots__ = ("scale", "accepted", "first_uncertainty", "rejected", "ceilings", "probe_too_slow")

    def __init__(self) -> None:
        self.scale: Optional[float] = None
        """The scale the probe's transfer costs are priced at; None before any trial (or cached one)."""
        self.accepted: list[float] = []
        """Scales read by trials and accepted, in order."""
        self.first_uncertainty = math.inf
        """How far off the first of ``accepted`` may be, as a share of it (what one reading's is read by)."""
        self.rejected: list[float] = []
        """Scales read and discarded as implausible."""
        self.ceilings: list[float] = []
        """Per rejected reading, the highest scale its step's noise left possible (inf: read too
        high, or not known)."""
        self.probe_too_slow = False
        """Every trial moved everything within its noise where the probe's figures say it could not."""

    @property
    def all_rejected(self) -> bool:
        """Trials read the link and none was plausible: the probe's figures stand, a reading would not."""
        return bool(self.rejected) and not self.accepted

    def adopt(self, scale: Optional[float]) -> None:
        """A plan cache's scale (None: it kept none), where no trial has read one here."""
        if self.scale is None:
            self.scale = scale

    def pooled_uncertainty(self) -> float:
        """How far off the accepted readings' median may be: one reading's, from the noise of the
        steps it is the difference of; several readings', how far they lie apart
        (``Readings.deviation``: two, four times apart, 60 %)."""
        if len(self.accepted) <= 1:
            return self.first_uncertainty
        return Readings(self.accepted).deviation

    @property
    def plannable(self) -> bool:
        """Whether the accepted readings agree well enough to plan on (``MAX_SPREAD``)."""
        return self.pooled_uncertainty() <= MAX_SPREAD

    @property
    def median(self) -> float:
        """The accepted readings' median (some must have been accepted)."""
        return statistics.median(self.accepted)

    def offer(self, scale: float, uncertainty: float, ceiling: float = math.inf) -> Verdict:
        """One trial's reading, relative to the scale it ran at, and how far off it may be;
        ``ceiling``: the highest scale the trial's step noise leaves possible (moving everything
        would cost the noise), inf where unknown (See Note: [a probe slower than the steps])."""
        low, high = PLAUSIBLE_LINK_SCALE
        if low <= scale <= high:
            # A later round's trial ran with the costs scaled already: its reading is relative to them.
            self.accepted.append((self.scale or 1.0) * scale)
            if len(self.accepted) == 1:
                self.first_uncertainty = uncertainty
            self.scale = self.median if self.plannable else 1.0
            log.info(
                "offload: a step that offloaded every region read transfer costs x%.3g the probe's, within %.0f%%; "
                "the trials so far (x%s) plan on x%.3g",
                self.accepted[-1],
                100 * uncertainty,
                ", x".join(f"{c:.3g}" for c in self.accepted),
                self.scale,
            )
            return Verdict.ACCEPTED
        self.rejected.append(scale)
        self.ceilings.append(ceiling if scale < low else math.inf)
        if self.accepted:
            log.info(  # not for the user: a disturbed step, and the earlier trials' reading stands
                "offload: a step that offloaded every region implied transfer costs x%.3g the figures planned "
                "on, outside the plausible x%g..x%g; keeping x%.3g, what the earlier trials read",
                scale,
                low,
                high,
                self.scale,
            )
            return Verdict.KEPT
        if len(self.rejected) < CALIBRATION_TRIES:
            log.info(  # not for the user: the next trial settles it
                "offload: a step that offloaded every region implied transfer costs x%.3g the probe's, outside "
                "the plausible x%g..x%g; measuring it again",
                scale,
                low,
                high,
            )
            return Verdict.AGAIN
        ceiling = max(self.ceilings)
        if ceiling < 1.0:
            # See Note: [a probe slower than the steps]
            self.scale = max(ceiling, low)
            self.probe_too_slow = True
            log.warning(
                "offload: %d steps that offloaded every region were no slower than the steps that kept them, "
                "where the probe's figures predict transfers x%.3g their steps' noise: the probe reads this machine "
                "slower than it is (its cache measured under load?); planning on x%.3g the probe's figures. "
                "Run offload.probe(refresh=True) (python -m offload probe --refresh) on a quiet machine, or pass "
                "machine= with figures measured there",
                len(self.rejected),
                1 / ceiling,
                self.scale,
            )
            return Verdict.PROBE
        self.scale = 1.0
        if ceiling < math.inf:
            log.info(
                "offload: the offload trials moved every region within their steps' noise, as the probe's figures "
                "allow; planning on them"
            )
            return Verdict.PROBE
        log.warning(
            "offload: %d offload steps implied transfer costs x%s the machine's figures, all outside x%g..x%g; "
            "planning on the figures as they are (offload.probe(refresh=True) measures this machine again; "
            "figures passed as machine= are used as given)",
            len(self.rejected),
            ", x".join(f"{s:.3g}" for s in self.rejected),
            low,
            high,
        )
        return Verdict.PROBE

    def note(self) -> str:
        """How transfers are priced, in words, for ``explain()``: the probe's figures as measured, or
        scaled by what the trials read (accepted and rejected)."""
        rejected = ", ".join(f"x{s:.3g}" for s in self.rejected)
        rejected = f"; rejected as implausible: {rejected}" if rejected else ""
        if self.scale is None:
            return f"the probe's figures (no offload trial yet{rejected})"
        if not (self.accepted or self.rejected):
            return f"x{self.scale:.3g} the probe's figures (the plan cache's calibration)"
        if not self.accepted and self.probe_too_slow:
            return (
                f"x{self.scale:.3g} the probe's figures (every offload trial moved everything within its steps' "
                f"noise{rejected}: the probe reads this machine slower than it is; offload.probe(refresh=True) "
                "measures it again)"
            )
        if not self.accepted:
            return f"the probe's figures (every offload trial implausible{rejected})"
        read = ", ".join(f"x{s:.3g}" for s in self.accepted)
        within = f"within {100 * self.pooled_uncertainty():.0f}%"
        if not self.plannable:
            return (
                f"the probe's figures (offload trials read {read}, {within} only: too uncertain to plan on{rejected})"
            )
        return f"x{self.scale:.3g} the probe's figures (offload trials read {read}, {within}{rejected})"
