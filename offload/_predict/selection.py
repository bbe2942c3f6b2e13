"""Which of a model's blocks are regions: ``predict(regions="every:2")`` and ``--regions every:2``.

Public recipes checkpoint every k-th layer, or the first or last n, or a list; a prediction takes
the same choice as a string, picked from the blocks ``regions="auto"`` finds (the model's repeated
blocks, in order), so the command line can say what Python says with ``regions=blocks[::2]``:

    "every:K"       blocks 0, K, 2K, ...           (every:1 is all of them)
    "every:K:S"     blocks S, S+K, S+2K, ...
    "first:N"       blocks 0 .. N-1
    "last:N"        the last N blocks
    "0,3,5"         those blocks, by index in the order found

Blocks left out are not regions: their saves are kept as any save outside the regions is
(``Scope.BEFORE``), so "checkpoint" with ``regions="every:2"`` is torch.utils.checkpoint on every
second block, the others kept whole. Numbers only here: ``pick`` maps a count to indices.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["Pick", "Selection", "is_selection"]

_USAGE = "every:K, every:K:S, first:N, last:N or a list of indices such as 0,3,5"


class Pick(enum.Enum):
    """How a ``Selection`` picks its blocks."""

    EVERY = "every"
    """Every K-th block from S."""
    FIRST = "first"
    """The first N blocks."""
    LAST = "last"
    """The last N blocks."""
    LISTED = "listed"
    """The blocks at the listed indices."""


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which blocks are regions (see the module docstring)."""

    pick: Pick
    numbers: tuple[int, ...]
    """EVERY: (K, S); FIRST, LAST: (N,); LISTED: the indices."""
    text: str

    @classmethod
    def parse(cls, text: str) -> Selection:
        """``text`` as a selection; a ``ValueError`` names it and the forms it may take."""
        head, _, rest = text.strip().partition(":")
        try:
            if head in ("every", "first", "last"):
                numbers = tuple(int(n) for n in rest.split(":"))
                if head == "every" and len(numbers) == 1:
                    numbers += (0,)
                if len(numbers) != (2 if head == "every" else 1) or numbers[0] < 1 or numbers[-1] < 0:
                    raise ValueError
                return cls(Pick(head), numbers, text)
            indices = tuple(int(n) for n in text.split(","))
            if not indices or min(indices) < 0 or len(set(indices)) != len(indices):
                raise ValueError
            return cls(Pick.LISTED, indices, text)
        except ValueError:
            raise ValueError(
                f"regions={text!r}: a selection of the model's blocks is {_USAGE} (K, N >= 1; indices >= 0, each once)"
            ) from None

    def pick_from(self, count: int) -> tuple[int, ...]:
        """The indices of the chosen blocks of ``count``; a ``ValueError`` where none is chosen or an
        index is past the last block."""
        if self.pick is Pick.EVERY:
            k, start = self.numbers
            chosen = tuple(range(start, count, k))
        elif self.pick is Pick.FIRST:
            chosen = tuple(range(min(self.numbers[0], count)))
        elif self.pick is Pick.LAST:
            chosen = tuple(range(max(0, count - self.numbers[0]), count))
        else:
            late = [i for i in self.numbers if i >= count]
            if late:
                raise ValueError(
                    f"regions={self.text!r}: indices {late} are past the model's {count} blocks (0..{count - 1})"
                )
            chosen = tuple(sorted(self.numbers))
        if not chosen:
            raise ValueError(f"regions={self.text!r} chose none of the model's {count} blocks")
        return chosen


def is_selection(regions: object) -> bool:
    """Whether ``regions`` is a selection string rather than "auto", modules or a filter."""
    return isinstance(regions, str) and regions != "auto"
