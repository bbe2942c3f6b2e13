"""A reload's device memory goes when the store lets the reload go, not when its entry does.

The store drops a reloaded copy after its last user (or for the budget, or as a give-back under
``budget_mb="auto"``); the bytes must then really be free: nothing in flight, no pending kept as
a reader of the copy below, may hold the destination. Read from live storages (weak references to
every destination the engine allocated), never from the store's own counts, which it keeps right
either way. Oracle for the gradients: the model without the engine, bitwise.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import offload
from hb import detecting
from zoo import MB

NUMEL = 16 * 1024
NBYTES = NUMEL * 4
DEPTH = 8


class TanhChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(DEPTH):
            x = torch.tanh(x) * self.scale
        return x


class _ByteAllocations(TorchDispatchMode):
    """Weak references to the storage of every uint8 tensor allocated inside (the engine's device
    destinations: the model's own tensors are float)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.empty.memory_format and out.dtype is torch.uint8 and out.numel() > 0:
            self.storages.append(weakref.ref(out.untyped_storage()))
        return out

    def live(self) -> int:
        return sum(ref() is not None for ref in self.storages)


SETTLE_S = 0.05
"""Time for the copies still in flight to land (virtual under the detector), so nothing the store
let go is still waiting for one."""


def _store_polls(eng) -> None:
    """Make the store retire what it let go (a free waits for a copy in flight to settle, and is
    finished at the store's next poll): let the copies land, then one small save under the engine."""
    time.sleep(SETTLE_S)
    with eng:
        torch.tanh(torch.randn(NUMEL, requires_grad=True))


def _backward_twice(eng, allocations, live) -> None:
    """Backward with retain_graph: every reload is dropped after its last user, while the entries
    live on (the graph is kept). Then no reload's memory may be live; a second backward reads them
    all back again, and the gradients are those of the model without the engine."""
    torch.manual_seed(0)
    x = torch.randn(NUMEL)
    model = TanhChain()
    reference = copy.deepcopy(model)
    reference(x).sum().backward(retain_graph=False)
    with eng:
        loss = model(x).sum()
    with allocations:
        loss.backward(retain_graph=True)
    _store_polls(eng)
    gc.collect()
    stats = eng.stats
    assert stats.reloaded_bytes >= (DEPTH - 2) * NBYTES, "the path under test: tensors were read back"
    assert live() == 0, f"{live()} reloads dropped by the store still hold their device memory"
    assert torch.equal(model.scale.grad, reference.scale.grad)
    model.scale.grad = None
    loss.backward()
    assert torch.equal(model.scale.grad, reference.scale.grad)
    del loss
    eng.close()


def test_a_dropped_reload_from_the_host_frees_its_device_memory(spill_dir):
    """The CUDA path: each copy up's pending was kept as a reader of the host copy, and it held
    the destination (for ``record_stream``), so the device memory lived until the entry's next
    reload or release."""
    with detecting() as link:
        eng = offload.engine(2 * NBYTES / MB, device="cpu", min_offload_mb=0, link=link, spill_dir=spill_dir)
        _backward_twice(eng, contextlib.nullcontext(), link.emulated.live_reload_destinations)


def test_a_dropped_reload_from_disk_frees_its_device_memory(spill_dir):
    """The CPU's disk tier: the read's future kept its destination as its result, and the future
    stayed as a reader of the disk copy."""
    allocations = _ByteAllocations()
    eng = offload.engine(2 * NBYTES / MB, min_offload_mb=0, spill_dir=spill_dir)
    _backward_twice(eng, allocations, allocations.live)
