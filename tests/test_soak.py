"""Soak: hundreds of steps with changing shapes under a budget that spills every step.

A leak of one buffer, one extent or one descriptor per step is invisible in a three-step test and
fatal in a week-long run. Here every step must end with the engine holding nothing (``Stats``:
resident bytes 0, no live spill extents, no host blocks in use; open, the engine's one spill
file, kept for reuse and with no name in the spill directory), and what the process holds
(resident set, open descriptors, the host arena's slabs, the spill file's size) must stay flat:
the mean over the last 50 steps may exceed the mean over steps 50-100 by at most a named slack.
Steps 0-50 are warm-up (allocator caches, thread pools, lazy imports, the largest shapes' first
draws).
"""

from __future__ import annotations

import contextlib
import os
import random
import time

import psutil
import pytest
import torch
from torch import nn

import offload
from hb import Schedule, detecting
from links import DeferredLink, ThreadedLink
from zoo import spill_files

pytestmark = pytest.mark.slow  # a soak: hundreds of steps; `-m "not slow"` leaves it out

STEPS = 300
WIDTH = 64
BATCHES = (1, 3, 8, 16)
SEQS = (5, 16, 32, 64)
"""Batch and sequence length, drawn per step. A few values each, not a range: torch's CPU kernels
cache per shape, so a new shape every step grows the resident set with or without the engine; 16
shapes are all seen during warm-up, and what grows after that is a leak."""
BUDGET_MB = 0.25
"""About one largest activation (16 x 64 x 64 fp32 = 256 KiB): most of every step spills."""
RSS_SLACK_BYTES = 8 << 20
"""Allowed growth of the mean resident set. A leak of one largest activation per step over the
200 steps compared would be ~50 MB; allocator noise on this model stays well under 8 MiB."""
FD_SLACK = 2
"""Allowed growth of open descriptors (a worker thread's transient file at the moment of sampling)."""
ARENA_SLACK_BYTES = 0
"""Allowed growth of the host arena's slabs after warm-up: none. Under a cap (1 MiB here) smaller
than a 64 MiB slab, slabs are powers of two sized to the requests; they are reused across steps,
so once the largest shapes have been drawn the bytes held must not grow."""
FILE_SLACK_BYTES = 256 << 10
"""Allowed growth of the spill file: one largest activation (extents are reused, the file grows
only to the most bytes spilled at once, which a rare late ordering of shapes can nudge)."""
SETTLE_TIMEOUT_S = 2.0
"""How long a spill write still in flight for a released tensor may take to land."""
CHECK_EVERY = 25
"""Steps between comparisons against the model without the engine."""


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks, a head: every activation scales with batch x seq."""

    def __init__(self, vocab: int = 97) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(2)
        )
        self.head = nn.Linear(WIDTH, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = h + block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), idx.roll(-1, dims=1).flatten())


def _step(model, idx, eng=None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if eng is None:
        loss = model(idx)
    else:
        with eng:
            loss = model(idx)
    loss.backward()
    return [p.grad for p in model.parameters()]


def _settled(eng) -> offload.Stats:
    """Stats once the writes still in flight for released tensors have landed (no gc: nothing cycles)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        stats = eng.stats
        if _holds_nothing(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.001)


def _holds_nothing(stats: offload.Stats) -> bool:
    return stats.resident_bytes == 0 and stats.spill_bytes == 0 and stats.host_in_use_bytes == 0


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return psutil.Process().num_fds()


def _flat(name: str, series: list, slack) -> None:
    early = sum(series[50:100]) / 50
    late = sum(series[-50:]) / 50
    assert late <= early + slack, f"{name} grew: mean {early:.0f} over steps 50-100, {late:.0f} over the last 50"


def _soak(eng, steps: int, spill_dir, host_cap_bytes=None) -> None:
    model = TinyLM()
    rng = random.Random(0)
    process = psutil.Process()
    rss, fds, host_bytes, file_bytes = [], [], [], []
    for step in range(steps):
        torch.manual_seed(step)
        idx = torch.randint(0, 97, (rng.choice(BATCHES), rng.choice(SEQS)))
        grads = _step(model, idx, eng)
        if step % CHECK_EVERY == 0:
            want = _step(model, idx)
            assert all(torch.equal(a, b) for a, b in zip(grads, want, strict=True)), f"step {step}: gradients differ"
        stats = _settled(eng)
        assert _holds_nothing(stats), f"step {step}: {stats}"
        files = spill_files(spill_dir)  # open, with no name: spill_dir itself lists nothing
        assert len(files) == stats.spill_files <= 1, f"step {step}: {files}, {stats.spill_files} spill files"
        assert list(spill_dir.iterdir()) == [], f"step {step}: {list(spill_dir.iterdir())}"
        file_bytes.append(os.stat(files[0]).st_size if files else 0)
        rss.append(process.memory_info().rss)
        fds.append(_open_fds())
        host_bytes.append(stats.host_bytes)
    stats = eng.stats
    assert stats.spilled_bytes > 0 and stats.reloaded_bytes > 0, "the budget made the larger steps spill"
    assert stats.spill_files == 1, "one spill file, reused by every step"
    _flat("resident set (bytes)", rss, RSS_SLACK_BYTES)
    _flat("open descriptors", fds, FD_SLACK)
    _flat("spill file (bytes)", file_bytes, FILE_SLACK_BYTES)
    if host_cap_bytes is not None:
        assert 0 < max(host_bytes) <= host_cap_bytes, "the arena never passes its cap"
        _flat("host arena (bytes)", host_bytes, ARENA_SLACK_BYTES)


def test_soak_cpu_spill(spill_dir):
    eng = offload.engine(BUDGET_MB, min_offload_mb=0, spill_dir=spill_dir)
    _soak(eng, STEPS, spill_dir)
    eng.close()
    assert list(spill_dir.iterdir()) == []


@pytest.mark.parametrize("link", ["deferred", "threaded", "emulated"])
def test_soak_host_tier(link, spill_dir):
    """The CUDA path's host arena and host cap, emulated on the CPU over the stand-in links and
    ``CudaLink`` under the race detector: the arena reaches a size and stays, within its cap, and
    the cap sends the rest to disk."""
    with contextlib.ExitStack() as stack:
        if link == "emulated":
            made = stack.enter_context(detecting(Schedule.named("adversarial3-0")))
        else:
            made = DeferredLink(2) if link == "deferred" else ThreadedLink(delay_s=0.0005)
        cap = 4 * BUDGET_MB
        eng = offload.engine(
            BUDGET_MB, device="cpu", min_offload_mb=0, link=made, host_budget_mb=cap, spill_dir=spill_dir
        )
        _soak(eng, STEPS, spill_dir, host_cap_bytes=int(cap * 2**20))
        assert eng.stats.host_bytes <= cap * 2**20
        eng.close()
    assert eng.stats.host_bytes == 0, "close() gives the arena's slabs back"
    assert list(spill_dir.iterdir()) == []
    if isinstance(made, ThreadedLink):
        made.close()
        assert made.sources_gone == 0, "a copy's source was let go before the copy finished"
