"""The CUDA race tests can fail: each is run once more with one guard removed (the wait at the
point of use, the fence before a copy, the keep-alive of a copy's source) and must then see wrong
gradients, else it tests nothing.

White-box, on purpose: a guard is a line inside the engine, removed by replacing the function that
holds it with the same code less the guard (``monkeypatch``, no file edits). The runs themselves
are ``test_cuda.py``'s. Every test here needs a CUDA device and is skipped cleanly without one.
"""

from __future__ import annotations

import pytest
import torch

import offload._memory.entry
import offload._memory.transfer
from test_cuda import _race_run

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _without_wait_at_use(monkeypatch) -> None:
    """The guard removed: the compute stream does not wait for a reload's event before using it."""
    monkeypatch.setattr(
        offload._memory.transfer.CudaLink, "wait_on_compute", lambda self, event: self.streams.current()
    )


def _without_fence(monkeypatch) -> None:
    """The guard removed: side streams start copies without waiting for any fence, so a d2h can
    read its source before the (delayed) kernel producing it has run."""

    def enter(self, batch, fences):
        if self.stream is None:
            self.stream = self.streams.new_stream()
        self._start = None
        return self.stream

    monkeypatch.setattr(offload._memory.transfer._Direction, "enter", enter)


def _without_keep_alive(monkeypatch) -> None:
    """The guard removed: a copy in flight does not keep its source (See Note: [keep-alive until
    the copy event]), so a host block can go back to the arena, and be filled by a read back from
    disk, while the (delayed) h2d copying from it is still queued."""
    monkeypatch.setattr(offload._memory.entry.Copy, "add_reader", lambda self, pending: None)


@pytest.mark.parametrize(
    "remove, budget, slow_link, host_budget_mb",
    [(_without_wait_at_use, 0, True, None), (_without_fence, 0, False, None), (_without_keep_alive, "some", True, 4)],
    ids=["wait-at-use", "fence", "keep-alive"],
)
def test_race_test_fails_with_its_guard_removed(remove, budget, slow_link, host_budget_mb, spill_dir, monkeypatch):
    """The race test can fail: with a guard removed it must see wrong gradients (else it tests
    nothing). The wait at use matters when the h2d is late (side streams delayed); the fence when
    the producer is late (compute stream delayed); the keep-alive when host blocks are reused
    under a host cap while the h2d is late."""
    remove(monkeypatch)
    with pytest.raises(AssertionError, match="gradient"):
        _race_run(budget, False, spill_dir, slow_link=slow_link, steps=2, host_budget_mb=host_budget_mb)
