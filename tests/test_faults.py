"""Faults behind the budget: a full or vanished spill disk, failing reads, no pinned memory, low host
RAM, and exceptions (KeyboardInterrupt included) in forward or backward.

What must hold after every fault: the step either completes with gradients bitwise equal to the
model without the engine, or fails with ``offload.OffloadError`` naming the tensor (shape, dtype)
and the tier; never wrong data. Afterwards the engine holds nothing (resident bytes 0, no spill
files, pool buffers back), and the next step is correct.

The behaviour chosen after a failed spill write: the tensor stays in memory (over the budget), one
warning is logged per engine, and every later eviction tries the disk again (a disk that filled
may free up). ``spilled_bytes`` and ``offloaded_bytes`` count only writes that landed.

Faults are injected without touching the real filesystem's state where possible: ``FaultyOS``
stands in for ``os`` inside ``offload._spill`` only, so pytest's own I/O is untouched.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import threading

import psutil
import pytest
import torch
from torch import nn

import offload
import offload._pool
import offload._spill
from test_host_tier import DeferredLink, _engine_with_host_tier
from zoo import MB, assert_same, files_under, run_step, wait_clean

SIZE = 16 * 1024
"""Elements of each saved tensor in the chain (64 KiB in fp32)."""
DEPTH = 6
NBYTES = SIZE * 4
GATE_TIMEOUT_S = 10.0
"""Longest a test holds a spill write back before letting it fail anyway (a safety net, not a delay)."""


class TanhChain(nn.Module):
    """tanh saves its output and mul saves the same storage: every storage has two users."""

    def __init__(self, depth: int = DEPTH) -> None:
        super().__init__()
        self.depth = depth
        self.scale = nn.Parameter(torch.tensor(0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.depth):
            x = torch.tanh(x) * self.scale
        return x


def chain_input() -> torch.Tensor:
    return torch.randn(SIZE)


def chain_step(eng=None, model=None):
    return run_step(model or TanhChain(), chain_input, eng, loss_fn=torch.sum)


class FaultyOS:
    """Stands in for ``os`` inside ``offload._spill``: writes, opens and reads fail on demand."""

    def __init__(self) -> None:
        self.writes_ok = None
        """Whole writes that succeed before the disk is full; None: the disk never fills."""
        self.partial = False
        """The failing write first lands half its bytes (a disk filling mid-file)."""
        self.open_error = None
        """errno for opening a spill file for writing (EACCES: an unwritable directory)..."""
        self.opens_ok = 0
        """... after this many opens for writing succeeded."""
        self.read_error = None
        """errno for every read (EIO)."""
        self.unlink_error = None
        """errno for removing a spill file (EACCES: the directory turned unwritable)."""
        self.writes = self.opens = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        with self._lock:
            n, self.writes = self.writes, self.writes + 1
        if self.writes_ok is not None and n >= self.writes_ok:
            if self.partial and len(data) > 1:
                os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, data)

    def open(self, path, flags, *args):
        if self.open_error is not None and flags & os.O_CREAT:
            with self._lock:
                n, self.opens = self.opens, self.opens + 1
            if n < self.opens_ok:
                return os.open(path, flags, *args)
            raise OSError(self.open_error, os.strerror(self.open_error), path)
        return os.open(path, flags, *args)

    def unlink(self, path):
        if self.unlink_error is not None:
            raise OSError(self.unlink_error, os.strerror(self.unlink_error), path)
        return os.unlink(path)

    def readv(self, fd, buffers):
        if self.read_error is not None:
            raise OSError(self.read_error, os.strerror(self.read_error))
        return os.readv(fd, buffers)


@pytest.fixture
def faulty(monkeypatch):
    fake = FaultyOS()
    monkeypatch.setattr(offload._spill, "os", fake)
    return fake


def warnings_from(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.WARNING]


def pool_in_use_bytes(eng) -> int:
    """Bytes of pool buffers some entry still holds (held minus idle)."""
    pool = eng._stores[torch.device("cpu")].pool
    return pool.held_bytes - sum(cls * len(bucket) for cls, bucket in pool._free.items())


# ---------------------------------------------------------------------------------- disk full


@pytest.mark.parametrize(
    "writes_ok, partial, budget_tensors", [(0, False, 0), (3, True, 0), (3, False, 1.5), (0, True, 1.5)]
)
def test_disk_full_keeps_tensors_in_memory(writes_ok, partial, budget_tensors, faulty, spill_dir, caplog):
    """ENOSPC after ``writes_ok`` writes: exact gradients, one warning, nothing left, stats honest;
    the next step with the disk still full is exact too, and once it frees up the engine spills again."""
    ref = chain_step()
    faulty.writes_ok, faulty.partial = writes_ok, partial
    eng = offload.engine(budget_tensors * NBYTES / MB, min_offload_bytes=0, spill_dir=spill_dir)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, chain_step(eng), "disk full")
        stats = wait_clean(eng, spill_dir)
        assert stats.spilled_bytes == writes_ok * NBYTES, "only writes that landed count as spilled"
        assert stats.offloaded_bytes == stats.spilled_bytes <= stats.reloaded_bytes
        assert stats.peak_resident_bytes > eng.config.budget_bytes, "kept in memory, over the budget"

        eng.reset_stats()
        assert_same(ref, chain_step(eng), "disk still full")
        wait_clean(eng, spill_dir)
        messages = warnings_from(caplog, "offload._store")
        assert len(messages) == 1, messages
        assert "spill" in messages[0] and os.strerror(errno.ENOSPC) in messages[0]

        faulty.writes_ok = None  # the disk freed up
        eng.reset_stats()
        assert_same(ref, chain_step(eng), "disk freed")
        stats = wait_clean(eng, spill_dir)
        assert stats.spilled_bytes > 0 and stats.peak_resident_bytes <= eng.config.budget_bytes
    eng.close()
    assert files_under(spill_dir) == []


def test_write_failing_after_backward_adopted_its_source(monkeypatch, spill_dir):
    """The last spill write is still in flight when backward reaches its tensor: backward adopts the
    source back and, with both users served, lets it go. Then the write fails. A second backward
    (retain_graph) must still find the data: the source went back to the write, not away."""
    real_write = offload._spill._write_file
    gate = threading.Event()
    writes = []
    depth = 4

    def last_write_fails_late(path, data):
        writes.append(path)
        if len(writes) == depth - 1:  # the newest evicted tensor
            gate.wait(GATE_TIMEOUT_S)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(path, data)

    monkeypatch.setattr(offload._spill, "_write_file", last_write_fails_late)
    model, ref_model = TanhChain(depth), TanhChain(depth)
    torch.manual_seed(0)
    x = chain_input()
    ref_model(x).sum().backward()
    # 2.5 tensors: one hot, one copy in flight; forward never waits on the gated write.
    eng = offload.engine(2.5 * NBYTES / MB, min_offload_bytes=0, spill_dir=spill_dir)
    with eng:
        loss = model(x).sum()
    loss.backward(retain_graph=True)
    assert not gate.is_set() and torch.equal(model.scale.grad, ref_model.scale.grad)
    gate.set()
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert torch.equal(model.scale.grad, ref_model.scale.grad)
    del loss
    wait_clean(eng, spill_dir)
    eng.close()


def test_open_refused_mid_run_keeps_tensors_in_memory(faulty, spill_dir, caplog):
    """The directory turns unwritable after a few spills (EACCES on create): exact, clean, one warning."""
    ref = chain_step()
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    faulty.opens_ok, faulty.open_error = 3, errno.EACCES
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, chain_step(eng), "EACCES mid-run")
    stats = wait_clean(eng, spill_dir)
    assert stats.spilled_bytes == 3 * NBYTES
    assert any(os.strerror(errno.EACCES) in m for m in warnings_from(caplog, "offload._store"))
    faulty.open_error = None
    eng.reset_stats()
    assert_same(ref, chain_step(eng), "writable again")
    assert eng.stats.spilled_bytes == DEPTH * NBYTES
    wait_clean(eng, spill_dir)
    eng.close()


def test_remove_refused_leaves_files_to_close(faulty, spill_dir, caplog):
    """Spill files that cannot be removed (EACCES on unlink) do not fail the step: exact gradients,
    one warning, and close() takes them with the directory."""
    ref = chain_step()
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    faulty.unlink_error = errno.EACCES
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, chain_step(eng), "unlink refused")
        assert_same(ref, chain_step(eng), "unlink refused, second step")
    assert eng.stats.resident_bytes == 0 and eng.stats.spill_files == 0, "the engine holds none of them"
    assert len(files_under(spill_dir)) == 2 * DEPTH, "they wait for close()"
    messages = warnings_from(caplog, "offload._spill")
    assert len(messages) == 1 and os.strerror(errno.EACCES) in messages[0], messages
    eng.close()
    assert list(spill_dir.iterdir()) == []


def test_chmod_unwritable_mid_run(spill_dir, caplog):
    """The real thing: chmod 0500 on the spill directory mid-run (skipped where it has no effect, e.g.
    root; as root run it with ``setpriv --bounding-set -dac_override,-dac_read_search``)."""
    ref = chain_step()
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    model = TanhChain()
    with eng:
        torch.tanh(torch.randn(SIZE, requires_grad=True) * 2).sum().backward()  # makes the private dir
    private = eng._stores[torch.device("cpu")].spill.path
    os.chmod(private, 0o500)
    try:
        if os.access(private, os.W_OK):
            pytest.skip("chmod 0500 does not stop this process from writing (running as root)")
        with caplog.at_level(logging.WARNING, logger="offload"):
            assert_same(ref, chain_step(eng, model), "unwritable directory")
        assert warnings_from(caplog, "offload._store")
        assert eng.stats.resident_bytes == 0 and eng.stats.spill_files == 0
    finally:
        os.chmod(private, 0o700)
    eng.close()  # files that could not be removed while it was 0500 go with the directory
    assert list(spill_dir.iterdir()) == []


def test_spill_dir_removed_mid_forward_fails_clearly_then_recovers(spill_dir, caplog):
    """Files already spilled vanish with their directory: backward fails with an OffloadError naming
    the tensor and the tier (the data is gone), the engine cleans up, and the next step is exact."""
    ref = chain_step()
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    model = TanhChain()
    torch.manual_seed(0)
    with eng:
        h = chain_input().requires_grad_(True)
        for i in range(DEPTH):
            h = torch.tanh(h) * model.scale
            if i == DEPTH // 2:
                assert eng.stats.spill_files > 0  # reading stats lets the writes so far land
                shutil.rmtree(eng._stores[torch.device("cpu")].spill.path)
        loss = h.sum()
    with caplog.at_level(logging.WARNING, logger="offload"):
        with pytest.raises(offload.OffloadError, match=rf"\({SIZE},\) torch.float32 on cpu.*spill file"):
            loss.backward()
    del loss, h
    wait_clean(eng, spill_dir)
    eng.reset_stats()
    assert_same(ref, chain_step(eng, model), "after the directory vanished")
    stats = wait_clean(eng, spill_dir)
    assert stats.spilled_bytes == DEPTH * NBYTES, "a fresh private directory took over"
    assert len(list(spill_dir.iterdir())) == 1
    eng.close()
    assert list(spill_dir.iterdir()) == []


def test_spill_parent_removed_keeps_tensors_in_memory_until_it_returns(spill_dir, caplog):
    """Not even a directory can be made (the spill_dir parent is gone): the step is exact with the
    tensors kept in memory and a warning, never a raw OSError out of forward; then it spills again."""
    ref = chain_step()
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    shutil.rmtree(spill_dir)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, chain_step(eng), "no spill directory")
    stats = wait_clean(eng, spill_dir)
    assert stats.spilled_bytes == 0
    assert any("spill" in m for m in warnings_from(caplog, "offload._store"))
    spill_dir.mkdir()
    eng.reset_stats()
    assert_same(ref, chain_step(eng), "spill directory back")
    assert wait_clean(eng, spill_dir).spilled_bytes == DEPTH * NBYTES
    eng.close()
    assert list(spill_dir.iterdir()) == []


# ---------------------------------------------------------------------------------- failing reads


def _forward(eng, model):
    torch.manual_seed(0)
    with eng:
        x = chain_input().requires_grad_(True)
        loss = model(x).sum()
    eng.stats  # writes land
    return loss


def test_read_error_raises_offload_error_and_releases_everything(faulty, spill_dir):
    """EIO on read: OffloadError naming the tensor and the tier; the failed graph frees everything."""
    ref = chain_step()
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    model = TanhChain()
    loss = _forward(eng, model)
    faulty.read_error = errno.EIO
    with pytest.raises(offload.OffloadError, match=rf"\({SIZE},\) torch.float32 on cpu.*spill file.*{os.strerror(errno.EIO)}"):
        loss.backward()
    del loss
    wait_clean(eng, spill_dir)
    faulty.read_error = None
    assert_same(ref, chain_step(eng, model), "after a failed read")
    wait_clean(eng, spill_dir)
    eng.close()


def test_truncated_spill_file_raises_offload_error(spill_dir):
    ref = chain_step()
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    model = TanhChain()
    loss = _forward(eng, model)
    files = files_under(spill_dir)
    assert files
    for path in files:
        os.truncate(path, 100)
    with pytest.raises(offload.OffloadError, match=rf"\({SIZE},\) torch.float32 on cpu.*spill file.*100 of {NBYTES}"):
        loss.backward()
    del loss
    wait_clean(eng, spill_dir)
    assert_same(ref, chain_step(eng, model), "after a truncated file")
    eng.close()


def test_transient_read_error_then_retry_with_retained_graph(faulty, spill_dir):
    """A read that failed is not remembered as data: backward again (retain_graph) reads the file again."""
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    model, ref_model = TanhChain(), TanhChain()
    torch.manual_seed(0)
    x = chain_input()
    with eng:
        loss = model(x).sum()
    ref_model(x).sum().backward()
    faulty.read_error = errno.EIO
    with pytest.raises(offload.OffloadError):
        loss.backward(retain_graph=True)
    faulty.read_error = None
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert torch.equal(model.scale.grad, ref_model.scale.grad)
    del loss
    wait_clean(eng, spill_dir)
    eng.close()


# ---------------------------------------------------------------------------------- host tier


BATCH = 128
"""Rows of the host-tier MLP's input: 64 KiB per saved activation, one pool size class."""
ACT_MB = BATCH * 128 * 4 / MB
"""One saved activation of the host-tier MLP, in MB (budgets below count in these)."""


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(8)])


def _mlp_input():
    return torch.randn(BATCH, 128)


def _host_step(model, eng=None):
    return run_step(model, _mlp_input, eng, loss_fn=lambda out: out.square().mean())


def _host_clean(eng, spill_dir):
    stats = wait_clean(eng, spill_dir)
    assert pool_in_use_bytes(eng) == 0, "every pool buffer is back"
    return stats


def test_host_tier_disk_full_keeps_host_copies(faulty, spill_dir, caplog):
    """Host cap reached and the disk is full: the host copies stay, gradients exact, no hang."""
    model = _mlp()
    ref = _host_step(model)
    faulty.writes_ok = 2
    eng = _engine_with_host_tier(DeferredLink(2), budget_mb=3 * ACT_MB, host_budget_mb=2 * ACT_MB, spill_dir=spill_dir)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, _host_step(model, eng), "host tier, disk full")
    stats = _host_clean(eng, spill_dir)
    assert stats.spilled_bytes == 2 * BATCH * 128 * 4
    assert warnings_from(caplog, "offload._store")
    faulty.writes_ok = None
    assert_same(ref, _host_step(model, eng), "host tier, disk freed")
    _host_clean(eng, spill_dir)
    eng.close()


def test_host_tier_read_error_raises_offload_error(faulty, spill_dir):
    model = _mlp()
    ref = _host_step(model)
    eng = _engine_with_host_tier(DeferredLink(2), budget_mb=3 * ACT_MB, host_budget_mb=2 * ACT_MB, spill_dir=spill_dir)
    with eng:
        loss = model(_mlp_input()).square().mean()
    assert eng.stats.spilled_bytes > 0
    faulty.read_error = errno.EIO
    with pytest.raises(offload.OffloadError, match=rf"\({BATCH}, 128\) torch.float32 on cpu.*spill file"):
        loss.backward()
    del loss
    faulty.read_error = None
    _host_clean(eng, spill_dir)
    assert_same(ref, _host_step(model, eng), "host tier after a failed read")
    _host_clean(eng, spill_dir)
    eng.close()


class _NoPinning:
    """Stands in for ``torch`` inside ``offload._pool``: pinned allocations fail after ``ok`` of them."""

    def __init__(self, ok: int) -> None:
        self.ok = ok

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        if "pin_memory" in kwargs:
            if self.ok <= 0:
                raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
            self.ok -= 1
        return torch.empty(*args, **kwargs)


@pytest.mark.parametrize("ok", [0, 2])
def test_pinning_fails_falls_back_to_disk(ok, monkeypatch, spill_dir, caplog):
    model = _mlp()
    ref = _host_step(model)
    monkeypatch.setattr(offload._pool, "torch", _NoPinning(ok))
    eng = _engine_with_host_tier(DeferredLink(2), budget_mb=3 * ACT_MB, spill_dir=spill_dir)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, _host_step(model, eng), "pinning refused")
    stats = _host_clean(eng, spill_dir)
    assert stats.spilled_bytes > 0
    assert stats.host_bytes <= ok * offload._pool.size_class(BATCH * 128 * 4)
    assert any("pinning" in m for m in warnings_from(caplog, "offload._pool"))
    assert_same(ref, _host_step(model, eng), "pinning refused, second step")
    _host_clean(eng, spill_dir)
    eng.close()


def test_no_pinning_and_a_failing_disk_keep_tensors_on_the_device(faulty, monkeypatch, spill_dir, caplog):
    """Nowhere safe to put them (no pinned memory, and pageable copies would pile up in host RAM
    behind a failing disk): tensors stay on the device over the budget, with one warning, exact."""
    model = _mlp()
    ref = _host_step(model)
    monkeypatch.setattr(offload._pool, "torch", _NoPinning(0))
    faulty.writes_ok = 1
    eng = _engine_with_host_tier(DeferredLink(2), budget_mb=2 * ACT_MB, spill_dir=spill_dir)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, _host_step(model, eng), "no pinning, disk failing")
    stats = _host_clean(eng, spill_dir)
    assert stats.peak_resident_bytes > 2 * BATCH * 128 * 4, "over the budget rather than into host RAM"
    store = eng._stores[torch.device("cpu")]
    assert not store._stuck and not store._host_lru, "nothing left held after the step"
    assert any("keeping saved tensors on the device" in m for m in warnings_from(caplog, "offload._store"))
    eng.close()


def test_low_host_ram_caps_the_pool_and_spills(monkeypatch, spill_dir, caplog):
    """psutil reports barely more than the reserve free: the pool stays within it, the rest spills."""
    total = 16 << 30
    reserve = max(int(total * offload._pool.HOST_RESERVE_FRACTION), offload._pool.HOST_RESERVE_MIN_BYTES)
    room = 3 * offload._pool.size_class(BATCH * 128 * 4)
    real = psutil.virtual_memory()

    def low_memory():
        pool = getattr(low_memory, "pool", None)
        used = 0 if pool is None else pool.held_bytes
        return real._replace(total=total, available=reserve + room - used)

    monkeypatch.setattr(psutil, "virtual_memory", low_memory)
    model = _mlp()
    ref = _host_step(model)
    eng = _engine_with_host_tier(DeferredLink(2), budget_mb=3 * ACT_MB, spill_dir=spill_dir)
    low_memory.pool = eng._stores[torch.device("cpu")].pool
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, _host_step(model, eng), "low host RAM")
    stats = _host_clean(eng, spill_dir)
    assert stats.spilled_bytes > 0
    assert 0 < stats.host_bytes <= room, "the pool never dips into the reserve"
    assert any("RAM" in m for m in warnings_from(caplog, "offload._pool"))
    eng.close()


# ---------------------------------------------------------------------------------- exceptions


class FailsOnCall(nn.Module):
    """Identity that raises a new ``error`` on its ``n``-th call (counting from 1), once.

    A new exception each time: a raised exception's traceback holds the frames it passed through,
    and with them the graph; one kept on the module would keep that graph alive.
    """

    def __init__(self, n: int, error: type) -> None:
        super().__init__()
        self.n, self.error, self.calls = n, error, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.n:
            raise self.error("raised on purpose")
        return x


def _faulty_mlp(fail):
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(128, 128), nn.Tanh(), fail]
    return nn.Sequential(*layers)


def _assert_reset(eng, spill_dir, host_tier: bool):
    gc.collect()
    stats = wait_clean(eng, spill_dir)
    assert stats.resident_bytes == 0 and stats.spill_files == 0
    store = eng._stores[torch.device("cpu")]
    assert not store._hot and not store._moved and not store._inflight and not store._retiring
    if host_tier:
        assert pool_in_use_bytes(eng) == 0


@pytest.mark.parametrize("host_tier", [False, True])
@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_exception_in_forward_resets(error, host_tier, spill_dir):
    fail = FailsOnCall(3, error)
    model = _faulty_mlp(fail)
    fail.calls = 10  # the reference run never fails
    ref = run_step(model, _mlp_input)
    fail.calls = 0
    if host_tier:
        eng = _engine_with_host_tier(DeferredLink(3), budget_mb=3 * ACT_MB, host_budget_mb=2 * ACT_MB, spill_dir=spill_dir)
    else:
        eng = offload.engine(3 * ACT_MB, min_offload_bytes=0, spill_dir=spill_dir)
    with pytest.raises(error):
        run_step(model, _mlp_input, eng)
    _assert_reset(eng, spill_dir, host_tier)
    assert not getattr(eng._local, "stack", None), "the hooks are off after the exception"
    assert_same(ref, run_step(model, _mlp_input, eng), "the step after")
    _assert_reset(eng, spill_dir, host_tier)
    eng.close()


@pytest.mark.parametrize("host_tier", [False, True])
@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_exception_in_backward_resets(error, host_tier, spill_dir):
    fail = FailsOnCall(10**9, error)
    model = _faulty_mlp(fail)
    ref = run_step(model, _mlp_input)
    if host_tier:
        eng = _engine_with_host_tier(DeferredLink(3), budget_mb=3 * ACT_MB, host_budget_mb=2 * ACT_MB, spill_dir=spill_dir)
    else:
        eng = offload.engine(3 * ACT_MB, min_offload_bytes=0, spill_dir=spill_dir)

    def raise_in_backward(grad):
        raise error("raised on purpose in backward")

    with eng:
        x = _mlp_input()
        h = model[:6](x)
        h.register_hook(raise_in_backward)  # half the reloads done, the rest still spilled
        loss = model[6:](h).square().mean()
    with pytest.raises(error):
        loss.backward()
    del loss, h
    _assert_reset(eng, spill_dir, host_tier)
    assert_same(ref, run_step(model, _mlp_input, eng), "the step after")
    _assert_reset(eng, spill_dir, host_tier)
    eng.close()
