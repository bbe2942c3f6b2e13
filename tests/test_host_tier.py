"""The CUDA path's host tier (pinned pool, copies with events, host cap -> disk), driven on the CPU.

No GPU here, so the store's device->host->disk logic runs with a stand-in transport whose copies
are *deferred*: a copy happens only when its event completes (polled ``delay`` times, or waited
on). A store that used a destination before its event, or returned a host buffer before the copy
reading it landed, would read NaN-filled memory and the gradients would differ.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

import offload
from offload._store import Store


class _DeferredEvent:
    def __init__(self, copy, delay: int) -> None:
        self._copy, self._polls, self._delay = copy, 0, delay

    def _finish(self) -> None:
        if self._copy is not None:
            self._copy()
            self._copy = None

    def query(self) -> bool:
        self._polls += 1
        if self._polls >= self._delay:
            self._finish()
        return self._copy is None

    def synchronize(self) -> None:
        self._finish()


class DeferredLink:
    """Copies happen when their event completes, as on a side stream."""

    def __init__(self, delay: int = 3) -> None:
        self.delay = delay
        self.d2h_count = self.h2d_count = 0

    def d2h(self, src, dst_host):
        self.d2h_count += 1
        n = src.numel()
        return _DeferredEvent(lambda: dst_host[:n].copy_(src), self.delay)

    def h2d(self, src_host, nbytes):
        self.h2d_count += 1
        dst = torch.full((nbytes,), 0xFF, dtype=torch.uint8)  # garbage until the copy lands
        return dst, _DeferredEvent(lambda: dst.copy_(src_host[:nbytes]), self.delay)

    def wait_on_compute(self, event) -> None:
        event.synchronize()  # the compute stream waits: on the CPU that means the copy is done


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(8)])


def _grads(model, x, eng=None, retain=False):
    model.zero_grad()
    if eng is None:
        loss = model(x).square().mean()
    else:
        with eng:
            loss = model(x).square().mean()
    loss.backward(retain_graph=retain)
    if retain:
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _engine_with_host_tier(link, **kwargs):
    eng = offload.engine(device="cpu", min_offload_bytes=0, **kwargs)
    device = torch.device("cpu")
    eng._stores[device] = Store(eng.config, device, eng._counters, link=link)
    return eng


@pytest.mark.parametrize("budget_mb", [0, 0.25, 0.5])
@pytest.mark.parametrize("delay", [1, 4])
def test_host_tier_gradients_bitwise_equal(budget_mb, delay):
    model, x = _model(), torch.randn(256, 128)
    want = _grads(model, x)
    link = DeferredLink(delay)
    eng = _engine_with_host_tier(link, budget_mb=budget_mb)
    for _ in range(2):
        got = _grads(model, x, eng)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    stats = eng.stats
    assert stats.offloaded_bytes > 0 and link.d2h_count > 0 and link.h2d_count > 0
    assert stats.spilled_bytes == 0  # no host cap: everything fits in host memory
    assert stats.resident_bytes == 0 and stats.spill_files == 0
    assert stats.peak_resident_bytes <= budget_mb * 2**20
    eng.close()


def test_host_cap_spills_to_disk_and_reads_back(tmp_path):
    model, x = _model(), torch.randn(256, 128)
    want = _grads(model, x)
    eng = _engine_with_host_tier(DeferredLink(2), budget_mb=0.5, host_budget_mb=0.5, spill_dir=tmp_path)
    got = _grads(model, x, eng)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    stats = eng.stats
    assert stats.spilled_bytes > 0
    assert stats.host_bytes <= 0.5 * 2**20
    assert stats.spill_files == 0
    eng.close()
    assert list(tmp_path.iterdir()) == []


def test_host_tier_retain_graph_twice(tmp_path):
    model, x = _model(), torch.randn(256, 128)
    want = _grads(model, x, retain=True)
    eng = _engine_with_host_tier(DeferredLink(3), budget_mb=0.5, host_budget_mb=1, spill_dir=tmp_path)
    got = _grads(model, x, eng, retain=True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    eng.close()


def test_host_tier_forward_without_backward_leaves_nothing(tmp_path):
    model, x = _model(), torch.randn(256, 128)
    eng = _engine_with_host_tier(DeferredLink(5), budget_mb=0.25, host_budget_mb=0.5, spill_dir=tmp_path)
    with eng:
        loss = model(x).square().mean()
    del loss
    gc.collect()
    stats = eng.stats
    assert stats.resident_bytes == 0
    assert stats.spill_files == 0
    store = eng._stores[torch.device("cpu")]
    assert not store._hot and not store._moved and not store._host_lru
    eng.close()
