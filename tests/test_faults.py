"""Faults behind the budget: a full or vanished spill disk, failing reads, no pinned memory, low host
RAM, and exceptions (KeyboardInterrupt included) in forward or backward.

What must hold after every fault: the step either completes with gradients bitwise equal to the
model without the engine, or fails with ``offload.OffloadError`` naming the tensor (shape, dtype)
and the tier; never wrong data. Afterwards the engine holds nothing (``Stats``: resident bytes 0,
no live spill extents, no host blocks in use; the one spill file, kept for reuse until
``close()``, is the only thing in the spill directory), and the next step is correct.

The behaviour chosen after a failed spill write: the tensor stays in memory (over the budget), one
warning is logged per engine, and every later eviction tries the disk again (a disk that filled
may free up). ``spilled_bytes`` and ``offloaded_bytes`` count only writes that landed.

The disk tier is one spill file per engine, opened at the first spill and written and read through
its descriptor (``pwrite``/``preadv`` on worker threads). Faults are injected without touching the
real filesystem's state where possible, through the engine's host seam (``offload.seams.Host``):
``tests/hosts.py``'s ``StandInHost`` sees the spill file's and the host tier's calls to the OS and
nothing else, so pytest's own I/O is untouched. The host tier runs on the CPU over the stand-in links of
``tests/links.py``, both of them: ``DeferredLink`` (copies land when polled) and ``ThreadedLink``
(copies land on a thread, and a source let go too early is poisoned).
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import threading

import pytest
import torch
from torch import nn

import offload
from hosts import StandInHost
from links import DeferredLink, link_named
from zoo import MB, assert_same, files_under, run_step, spill_files, wait_clean

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


@pytest.fixture
def host():
    """This machine with faults on demand (``tests/hosts.py``); a test passes it as ``host=``."""
    return StandInHost()


def warnings_from(caplog, part: str) -> list[str]:
    """The warnings of the engine's part named ``part`` (its logger's last name: "store", "spill", "arena")."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("offload.") and r.name.rsplit(".", 1)[-1] == part and r.levelno == logging.WARNING
    ]


def only_file(spill_dir) -> str:
    """The engine's one spill file, as ``/proc/self/fd/N`` (``zoo.spill_files``): open, without a
    name, and nothing in ``spill_dir``."""
    files = spill_files(spill_dir)
    entries = list(spill_dir.iterdir())
    assert len(files) == 1 and entries == [], (files, entries)
    return files[0]


# ---------------------------------------------------------------------------------- disk full


@pytest.mark.parametrize(
    "writes_ok, partial, budget_tensors", [(0, False, 0), (3, True, 0), (3, False, 1.5), (0, True, 1.5)]
)
def test_disk_full_keeps_tensors_in_memory(writes_ok, partial, budget_tensors, host, spill_dir, caplog):
    """ENOSPC after ``writes_ok`` writes: exact gradients, one warning, nothing left, stats honest;
    the next step with the disk still full is exact too, and once it frees up the engine spills again."""
    ref = chain_step()
    host.writes_ok, host.partial = writes_ok, partial
    eng = offload.engine(budget_tensors * NBYTES / MB, min_offload_mb=0, spill_dir=spill_dir, host=host)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, chain_step(eng), "disk full")
        stats = wait_clean(eng, spill_dir)
        assert stats.spilled_bytes == writes_ok * NBYTES, "only writes that landed count as spilled"
        assert stats.offloaded_bytes == stats.spilled_bytes
        # Each moved storage comes back at most once; none came back that was not moved.
        assert stats.reloaded_bytes <= stats.offloaded_bytes and (stats.reloaded_bytes > 0) == (writes_ok > 0)
        assert stats.peak_resident_bytes > eng.config.budget_bytes, "kept in memory, over the budget"
        tries = host.writes

        eng.reset_stats()
        assert_same(ref, chain_step(eng), "disk still full")
        stats = wait_clean(eng, spill_dir)
        assert stats.spilled_bytes == stats.offloaded_bytes == 0
        assert host.writes > tries, "later evictions try the disk again"
        messages = warnings_from(caplog, "store")
        assert len(messages) == 1, messages
        assert "spill" in messages[0] and os.strerror(errno.ENOSPC) in messages[0]

        host.writes_ok = None  # the disk freed up
        eng.reset_stats()
        assert_same(ref, chain_step(eng), "disk freed")
        stats = wait_clean(eng, spill_dir)
        assert stats.spilled_bytes > 0 and stats.peak_resident_bytes <= eng.config.budget_bytes
        assert len(warnings_from(caplog, "store")) == 1, "still one warning"
    assert len(host.created) == 1, "one spill file for the engine's life, whatever failed"
    eng.close()
    assert list(spill_dir.iterdir()) == []


class _LastWriteFailsLate:
    """The spill write of the newest evicted tensor of a ``TanhChain(depth)`` at a 2.5-tensor budget
    (the ``depth - 1``-th evicted: its extent is the ``depth - 1``-th from the file's start, as a fresh
    engine takes them in eviction order) waits for ``gate`` and then fails with ENOSPC. Told by its
    offset, not by when it starts: two spill threads may start consecutive writes in either order."""

    def __init__(self, host: StandInHost, depth: int) -> None:
        self.depth = depth
        self.gate = threading.Event()
        self.started: list = []
        self.gated_done: list = []
        host.before_write = self._before_write

    def _before_write(self, n: int, offset: int) -> None:
        self.started.append(n)
        if offset != (self.depth - 2) * NBYTES or self.gated_done:
            return  # another tensor's, or a later write into the extent the failed one gave back
        try:
            self.gate.wait(GATE_TIMEOUT_S)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        finally:
            self.gated_done.append(n)

    def in_flight(self) -> bool:
        """Every evicted tensor's write started, the gated one not yet through."""
        return len(self.started) == self.depth - 1 and not self.gated_done and not self.gate.is_set()


def _gated_chain(spill_dir, depth: int = 4):
    """(the gated write, the engine, the model, its reference with gradients, the loss under the engine)."""
    host = StandInHost()
    write = _LastWriteFailsLate(host, depth)
    model, ref_model = TanhChain(depth), TanhChain(depth)
    torch.manual_seed(0)
    x = chain_input()
    ref_model(x).sum().backward()
    # 2.5 tensors: one hot, one copy in flight; forward never waits on the gated write.
    eng = offload.engine(2.5 * NBYTES / MB, min_offload_mb=0, spill_dir=spill_dir, host=host)
    with eng:
        loss = model(x).sum()
    return write, eng, model, ref_model, loss


def test_write_failing_after_backward_adopted_its_source(spill_dir):
    """The last spill write is still in flight when backward reaches its tensor: backward serves it
    from its source and, with both users served, lets it go. Then the write fails. A second backward
    (retain_graph) must still find the data: the source went back to the store, not away."""
    write, eng, model, ref_model, loss = _gated_chain(spill_dir)
    loss.backward(retain_graph=True)
    assert torch.equal(model.scale.grad, ref_model.scale.grad)
    assert write.in_flight(), "backward ran with the gated write in flight"
    write.gate.set()
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert torch.equal(model.scale.grad, ref_model.scale.grad)
    del loss
    wait_clean(eng, spill_dir)
    # The write may fail before its tensor died (retired as a live entry) or after (an orphan the
    # next poll retires): close() settles both, so the count is final only then.
    eng.close()
    assert eng.stats.spilled_bytes == (write.depth - 2) * NBYTES, "the failed write is not counted"
    assert list(spill_dir.iterdir()) == []


def test_write_failing_after_its_tensor_died_is_not_counted(spill_dir):
    """The last spill write is still in flight when backward, served from the source, frees the graph:
    the tensor dies with its write in flight. The write then fails. It moved and wrote nothing, so
    once the engine has settled it (close() waits for it) neither count includes it."""
    write, eng, model, ref_model, loss = _gated_chain(spill_dir)
    loss.backward()  # frees the graph
    del loss
    assert torch.equal(model.scale.grad, ref_model.scale.grad)
    assert write.in_flight(), "the gated write's tensor died in flight"
    write.gate.set()
    eng.close()
    stats = eng.stats
    assert stats.spilled_bytes == (write.depth - 2) * NBYTES, "the failed write is not counted as written"
    assert stats.offloaded_bytes == (write.depth - 2) * NBYTES, "nor as moved"
    assert list(spill_dir.iterdir()) == []


def test_open_refused_keeps_tensors_in_memory_until_writable(host, spill_dir, caplog):
    """The spill file cannot be created (EACCES): every write fails like a full disk's, exact,
    one warning, nothing left on disk (not even the private directory); once the directory is
    writable again the engine opens its file and spills.

    Changed with the one-file design: this used to refuse the create after three spills (one file
    per tensor). Now the file is created once, at the first spill, so a directory turning
    unwritable later cannot stop the writes (``test_chmod_unwritable_mid_run``); the create is
    the one place an unwritable directory can fail, and every eviction retries it."""
    ref = chain_step()
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host=host)
    host.open_error = errno.EACCES
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, chain_step(eng), "EACCES")
        assert_same(ref, chain_step(eng), "EACCES, second step")
    stats = wait_clean(eng, spill_dir)
    assert stats.spilled_bytes == stats.offloaded_bytes == stats.reloaded_bytes == 0
    assert stats.spill_files == 0 and list(spill_dir.iterdir()) == [], "a directory without its file is not kept"
    assert stats.peak_resident_bytes > 0
    assert len(host.created) >= 2 * DEPTH, "every eviction tried to create the file again"
    messages = warnings_from(caplog, "store")
    assert len(messages) == 1 and "spill" in messages[0] and os.strerror(errno.EACCES) in messages[0], messages
    host.open_error = None
    eng.reset_stats()
    assert_same(ref, chain_step(eng), "writable again")
    stats = wait_clean(eng, spill_dir)
    assert stats.spilled_bytes == DEPTH * NBYTES and stats.spill_files == 1
    only_file(spill_dir)
    eng.close()
    assert list(spill_dir.iterdir()) == []


def _refuse_removal(monkeypatch):
    """Make every unlink and rmdir fail with EACCES, as in a directory turned read-only (root is
    not stopped by modes, so the refusal is injected where the engine asks the OS)."""

    def refused(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(os, "unlink", refused)
    monkeypatch.setattr(os, "rmdir", refused)


def test_a_spill_file_whose_name_cannot_be_removed_is_not_used(spill_dir, caplog, monkeypatch):
    """The name of a new spill file cannot be removed (EACCES on unlink and rmdir): the file is not
    used, since its bytes would outlive a killed process; the step is exact with the tensors in
    memory and one warning, the empty file left behind holds no tensor byte, and once names can be
    removed the engine spills into a nameless file. close() then removes nothing by name.

    Changed with the nameless file (issue 47, item 4): this was close()'s removal refused, which
    emptied the file it left; now the one removal is the open's, and a refused one fails the open."""
    ref = chain_step()
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    with caplog.at_level(logging.WARNING, logger="offload"):
        with monkeypatch.context() as m:
            _refuse_removal(m)
            assert_same(ref, chain_step(eng), "the name cannot be removed")
        stats = wait_clean(eng)
        assert stats.spilled_bytes == stats.offloaded_bytes == 0 and stats.spill_files == 0
        assert spill_files(spill_dir) == [], "no descriptor kept on a named file"
        left = files_under(spill_dir)
        assert left and all(os.path.getsize(path) == 0 for path in left), "what is left holds no tensor byte"
        messages = warnings_from(caplog, "store")
        assert len(messages) == 1 and "spill" in messages[0] and os.strerror(errno.EACCES) in messages[0], messages
        for private in spill_dir.iterdir():
            shutil.rmtree(private)
        eng.reset_stats()
        assert_same(ref, chain_step(eng), "names removable again")
        stats = wait_clean(eng, spill_dir)
        assert stats.spilled_bytes == DEPTH * NBYTES
        only_file(spill_dir)
        said = len(warnings_from(caplog, "spill"))  # each refused open could not remove its directory
        with monkeypatch.context() as m:
            _refuse_removal(m)
            eng.close()
    assert eng.stats.spill_files == 0 and spill_files(spill_dir) == [] and list(spill_dir.iterdir()) == []
    assert len(warnings_from(caplog, "spill")) == said, "close() has no name to remove"


def test_chmod_unwritable_mid_run(spill_dir, caplog):
    """The real thing: chmod 0500 on the spill directory mid-run (skipped where it has no effect, e.g.
    root; as root run it with ``setpriv --bounding-set -dac_override,-dac_read_search``).

    Changed with the one-file design: the file is open before the chmod, and writes and reads go
    through its descriptor, so the step spills as usual, exactly and without a warning. Changed
    with the nameless file (issue 47, item 4): the file has no name to remove, so close() needs no
    write to the directory either, and leaves it as it was."""
    ref = chain_step()
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    model = TanhChain()
    with eng:
        torch.tanh(torch.randn(SIZE, requires_grad=True) * 2).sum().backward()  # opens the spill file
    eng.reset_stats()
    only_file(spill_dir)
    os.chmod(spill_dir, 0o500)
    try:
        if os.access(spill_dir, os.W_OK):
            pytest.skip("chmod 0500 does not stop this process from writing (running as root)")
        with caplog.at_level(logging.WARNING, logger="offload"):
            assert_same(ref, chain_step(eng, model), "unwritable directory")
            stats = wait_clean(eng, spill_dir)
            assert stats.spilled_bytes == DEPTH * NBYTES, "the open file takes the writes"
            eng.close()
        assert warnings_from(caplog, "store") == [] and warnings_from(caplog, "spill") == []
        assert list(spill_dir.iterdir()) == [] and spill_files(spill_dir) == []
    finally:
        os.chmod(spill_dir, 0o700)


def test_spill_dir_removed_mid_forward_still_reads_back(spill_dir, host, caplog):
    """The spill directory is removed mid-forward (a /tmp cleaner): the open descriptor keeps the
    file's data, so backward is exact, and so is the next step, through the same nameless file.

    Changed with the one-file design: with a file per tensor the data went with the directory and
    backward failed with an OffloadError; one open file survives its name. Changed with the
    nameless file (issue 47, item 4): the private directory is gone once the file is open, so the
    cleaner removes ``spill_dir`` itself."""
    ref = chain_step()
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host=host)
    model = TanhChain()
    got = None
    with caplog.at_level(logging.WARNING, logger="offload"):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)  # run_step's seeds: the same input and the same math
        x = chain_input().requires_grad_(True)
        with eng:
            h = x
            for i in range(DEPTH):
                h = torch.tanh(h) * model.scale
                if i == DEPTH // 2:
                    assert host.landed() > 0  # data written before the removal is read after it
                    only_file(spill_dir)
                    shutil.rmtree(spill_dir)
            loss = h.sum()
        loss.backward()
        got = (h.detach().clone(), model.scale.grad.clone(), x.grad.clone())
        del loss, h
        stats = wait_clean(eng)
        assert stats.spilled_bytes == DEPTH * NBYTES and 0 < stats.reloaded_bytes <= stats.offloaded_bytes
        assert torch.equal(got[0], ref.output) and torch.equal(got[1], ref.grads["scale"])
        assert torch.equal(got[2], ref.input_grad)
        eng.reset_stats()
        assert_same(ref, chain_step(eng, model), "after the directory vanished")
        stats = wait_clean(eng)
    assert stats.spilled_bytes == DEPTH * NBYTES and stats.spill_files == 1, "the same open file serves"
    assert len(spill_files(spill_dir)) == 1 and not spill_dir.exists(), "nothing new appears in its place"
    eng.close()
    assert spill_files(spill_dir) == [] and not spill_dir.exists()
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("offload") and r.levelno >= logging.WARNING]
    assert warned == [], "nothing failed"


def test_spill_parent_removed_keeps_tensors_in_memory_until_it_returns(spill_dir, caplog):
    """Not even a directory can be made (a file stands where the spill_dir was; a spill_dir merely
    missing is made again by the first spill): the step is exact with the tensors kept in memory
    and one warning, never a raw OSError out of forward; then it spills again."""
    ref = chain_step()
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    shutil.rmtree(spill_dir)
    spill_dir.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, chain_step(eng), "no spill directory")
        stats = wait_clean(eng)
        assert stats.spilled_bytes == stats.offloaded_bytes == 0 and stats.spill_files == 0
        assert stats.peak_resident_bytes > 0
        messages = warnings_from(caplog, "store")
        assert len(messages) == 1 and "spill" in messages[0] and os.strerror(errno.ENOTDIR) in messages[0], messages
        spill_dir.unlink()
        spill_dir.mkdir()
        eng.reset_stats()
        assert_same(ref, chain_step(eng), "spill directory back")
        stats = wait_clean(eng, spill_dir)
    assert stats.spilled_bytes == DEPTH * NBYTES and stats.spill_files == 1
    only_file(spill_dir)
    eng.close()
    assert list(spill_dir.iterdir()) == []


# ---------------------------------------------------------------------------------- failing reads


def _forward(eng, model, host):
    torch.manual_seed(0)
    with eng:
        x = chain_input().requires_grad_(True)
        loss = model(x).sum()
    assert host.landed() == DEPTH
    return loss


def test_read_error_raises_offload_error_and_releases_everything(host, spill_dir):
    """EIO on read: OffloadError naming the tensor and the tier; the failed graph frees everything."""
    ref = chain_step()
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host=host)
    model = TanhChain()
    loss = _forward(eng, model, host)
    host.read_error = errno.EIO
    with pytest.raises(
        offload.OffloadError, match=rf"\({SIZE},\) torch.float32 on cpu.*spill file.*{os.strerror(errno.EIO)}"
    ):
        loss.backward()
    assert host.reads > 0
    del loss
    wait_clean(eng, spill_dir)
    host.read_error = None
    eng.reset_stats()
    assert_same(ref, chain_step(eng, model), "after a failed read")
    stats = wait_clean(eng, spill_dir)
    assert stats.spilled_bytes == DEPTH * NBYTES and 0 < stats.reloaded_bytes <= stats.offloaded_bytes
    eng.close()
    assert list(spill_dir.iterdir()) == []


def test_truncated_spill_file_raises_offload_error(spill_dir, host):
    """The file is cut 100 bytes into the newest tensor's extent (the first backward reads): the read
    ends early, an OffloadError names the tensor, the tier and how far it got; the failed graph
    releases everything and the next step, writing the file again, is exact."""
    ref = chain_step()
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host=host)
    model = TanhChain()
    loss = _forward(eng, model, host)
    path = only_file(spill_dir)
    # A fresh engine takes extents in eviction order from offset 0, so the newest is at the end.
    os.truncate(path, (DEPTH - 1) * NBYTES + 100)
    with pytest.raises(
        offload.OffloadError, match=rf"\({SIZE},\) torch.float32 on cpu.*spill file.*ended after 100 of {NBYTES} bytes"
    ):
        loss.backward()
    del loss
    wait_clean(eng, spill_dir)
    eng.reset_stats()
    assert_same(ref, chain_step(eng, model), "after a truncated file")
    assert wait_clean(eng, spill_dir).spilled_bytes == DEPTH * NBYTES
    eng.close()
    assert list(spill_dir.iterdir()) == []


def test_transient_read_error_then_retry_with_retained_graph(host, spill_dir):
    """A read that failed is not remembered as data: backward again (retain_graph) reads the file again."""
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host=host)
    model, ref_model = TanhChain(), TanhChain()
    torch.manual_seed(0)
    x = chain_input()
    with eng:
        loss = model(x).sum()
    ref_model(x).sum().backward()
    host.read_error = errno.EIO
    with pytest.raises(offload.OffloadError, match="spill file"):
        loss.backward(retain_graph=True)
    host.read_error = None
    reads = host.reads
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert torch.equal(model.scale.grad, ref_model.scale.grad)
    assert host.reads > reads, "the retry read the file"
    del loss
    wait_clean(eng, spill_dir)
    eng.close()


# ---------------------------------------------------------------------------------- host tier


BATCH = 128
"""Rows of the host-tier MLP's input: 64 KiB per saved activation."""
ACT_BYTES = BATCH * 128 * 4
ACT_MB = ACT_BYTES / MB
"""One saved activation of the host-tier MLP, in MB (budgets below count in these)."""


HOST_LINKS = (
    "deferred",
    "threaded",
    "threaded-start",
    "emulated",
    "emulated-adversarial3-0",
    pytest.param("emulated-timed2q50", marks=pytest.mark.slow),
)
"""The links a host tier runs over in these tests (``tests/links.py``'s names)."""


@pytest.fixture(params=HOST_LINKS)
def link(request):
    """The stand-ins for the CUDA side streams (the threaded one also reading each source over
    its copy, as a stream does) and CudaLink over emulated streams; a run must never have copied
    from a source the engine had already let go, or one that changed while the copy ran, nor
    raced."""
    with link_named("deferred-2" if request.param == "deferred" else request.param) as made:
        yield made


def _host_engine(link, budget_mb, host=None, **options):
    """An engine with a host tier over ``link``; a stand-in ``host`` runs its spill jobs where the
    link's own host would (an emulator's schedule)."""
    if host is not None:
        host.base = getattr(link, "host", None)
    return offload.engine(budget_mb, device="cpu", min_offload_mb=0, link=link, host=host, **options)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(8)])


def _mlp_input():
    return torch.randn(BATCH, 128)


def _host_step(model, eng=None):
    return run_step(model, _mlp_input, eng, loss_fn=lambda out: out.square().mean())


def _host_clean(eng, spill_dir):
    stats = wait_clean(eng, spill_dir)
    assert stats.host_in_use_bytes == 0, "every host block is back"
    return stats


def test_host_tier_disk_full_keeps_host_copies(link, host, spill_dir, caplog):
    """Host cap reached and the disk full after two writes: the host copies stay where they are,
    newer tensors stay on the device, gradients exact, no hang; once the disk frees up the oldest
    host copies are written to disk again and the budget holds."""
    model = _mlp()
    ref = _host_step(model)
    host.writes_ok = 2
    eng = _host_engine(link, 3 * ACT_MB, host=host, host_budget_mb=2 * ACT_MB, spill_dir=spill_dir)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, _host_step(model, eng), "host tier, disk full")
        stats = _host_clean(eng, spill_dir)
        assert stats.spilled_bytes == 2 * ACT_BYTES, "only the writes that landed"
        assert stats.peak_resident_bytes > 3 * ACT_BYTES, "the newest tensors stayed on the device"
        assert stats.host_bytes <= 2 * ACT_BYTES
        messages = warnings_from(caplog, "store")
        failed = [m for m in messages if "spill" in m and os.strerror(errno.ENOSPC) in m]
        assert len(failed) == 1 and len(set(messages)) == len(messages), "each cause said once"
        host.writes_ok = None
        eng.reset_stats()
        assert_same(ref, _host_step(model, eng), "host tier, disk freed")
        stats = _host_clean(eng, spill_dir)
    assert stats.spilled_bytes > 2 * ACT_BYTES and stats.peak_resident_bytes <= 3 * ACT_BYTES
    assert 0 < stats.reloaded_bytes <= stats.offloaded_bytes
    eng.close()
    assert list(spill_dir.iterdir()) == []


def test_host_tier_read_error_raises_offload_error(link, host, spill_dir):
    model = _mlp()
    ref = _host_step(model)
    eng = _host_engine(link, 3 * ACT_MB, host=host, host_budget_mb=2 * ACT_MB, spill_dir=spill_dir)
    with eng:
        loss = model(_mlp_input()).square().mean()
    assert eng.stats.spilled_bytes > 0
    host.read_error = errno.EIO
    with pytest.raises(
        offload.OffloadError, match=rf"\({BATCH}, 128\) torch.float32 on cpu.*spill file.*{os.strerror(errno.EIO)}"
    ):
        loss.backward()
    del loss
    host.read_error = None
    _host_clean(eng, spill_dir)
    eng.reset_stats()
    assert_same(ref, _host_step(model, eng), "host tier after a failed read")
    stats = _host_clean(eng, spill_dir)
    assert stats.spilled_bytes > 0 and 0 < stats.reloaded_bytes <= stats.offloaded_bytes
    eng.close()
    assert list(spill_dir.iterdir()) == []


def test_a_demotion_failing_while_its_tensor_dies_is_not_counted(spill_dir):
    """A host copy is being written to disk (demoted) when its graph is freed; the write then fails.
    It wrote nothing, so once the engine has settled (close() waits for it) spilled_bytes does not
    count it, and the host copy it would have freed goes with its tensor.

    A demotion starts when the host tier is full, and pack waits for it to land before it returns
    (holding the store's lock), so the graph is freed from another thread: a second thread's
    forward demotes the first forward's oldest host copy, its write is held back, the first graph
    is freed (its release finds the lock held and is queued), and then the write fails: the
    failure is taken first, the queued release after it. Where the release is handled first, with
    the write still in flight (the orphan path), is driven through the store itself in
    ``test_residency.py``."""
    model = _mlp()
    host = StandInHost()
    eng = _host_engine(DeferredLink(1), 0, host=host, host_budget_mb=2 * ACT_MB, spill_dir=spill_dir)
    with eng:
        loss = model(_mlp_input()).square().mean()
    host.landed()
    landed = host.writes
    assert landed > 0 and eng.stats.spilled_bytes == landed * ACT_BYTES, "the first forward demoted its oldest"
    gate, held = threading.Event(), threading.Event()

    def fail_the_next_write_late(n: int, offset: int) -> None:
        if n == landed:
            held.set()
            gate.wait(GATE_TIMEOUT_S)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    host.before_write = fail_the_next_write_late
    second: list = []

    def forward_on_another_thread() -> None:
        with eng:
            second.append(model(_mlp_input()).square().mean())

    thread = threading.Thread(target=forward_on_another_thread)
    thread.start()
    assert held.wait(GATE_TIMEOUT_S), "the second forward demoted a host copy of the first"
    del loss  # the first graph goes: the tensor dies with its write in flight
    gc.collect()
    gate.set()  # ... and then the write fails
    thread.join(GATE_TIMEOUT_S)
    assert not thread.is_alive()
    second.clear()
    gc.collect()
    host.landed()
    eng.close()
    assert host.writes > landed, "the demotion was tried"
    assert eng.stats.spilled_bytes == (host.writes - 1) * ACT_BYTES, "a write that failed is not counted as spilled"
    assert list(spill_dir.iterdir()) == []


def test_pinning_fails_after_two_slabs_spills_the_oldest(link, host, spill_dir, caplog):
    """Pinning refused after two slabs: one warning from the arena, the host tier stays at what it
    pinned, the oldest host copies go to disk to make room, exact, nothing left in use.

    The cap (4 activations) makes the slabs one activation each (a slab is smaller than 64 MiB
    only where the cap is), so the third slab is the one pinning refuses."""
    model = _mlp()
    ref = _host_step(model)
    host.pins_ok = 2
    eng = _host_engine(link, 3 * ACT_MB, host=host, host_budget_mb=4 * ACT_MB, spill_dir=spill_dir)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, _host_step(model, eng), "pinning refused")
        stats = _host_clean(eng, spill_dir)
        assert host.pin_tries == 3, "no new slab is tried once pinning failed"
        assert stats.spilled_bytes > 0
        assert 0 < stats.host_bytes <= 2 * ACT_BYTES, "what was pinned, no more"
        assert stats.peak_resident_bytes <= 3 * ACT_BYTES
        eng.reset_stats()
        assert_same(ref, _host_step(model, eng), "pinning refused, second step")
        stats = _host_clean(eng, spill_dir)
        assert stats.spilled_bytes > 0 and 0 < stats.reloaded_bytes <= stats.offloaded_bytes
    messages = warnings_from(caplog, "arena")
    assert len(messages) == 1 and "pinning" in messages[0], messages
    assert warnings_from(caplog, "store") == []
    eng.close()
    assert list(spill_dir.iterdir()) == []


def test_no_pinning_at_all_keeps_tensors_on_the_device(link, host, spill_dir, caplog):
    """No host memory can be pinned: with no host copy to demote there is no safe place below the
    device, so tensors stay on it over the budget (no synchronous pageable copies), one warning
    each from the arena and the store, exact.

    Changed with the tier rebuild: this used to fall back to the disk through pageable memory;
    issue 9 removed that per-tensor synchronous path, so the tensor is kept instead."""
    model = _mlp()
    ref = _host_step(model)
    host.pins_ok = 0
    eng = _host_engine(link, 2 * ACT_MB, host=host, spill_dir=spill_dir)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, _host_step(model, eng), "no pinning")
        assert_same(ref, _host_step(model, eng), "no pinning, second step")
    stats = _host_clean(eng, spill_dir)
    assert stats.peak_resident_bytes > 2 * ACT_BYTES, "over the budget rather than into pageable host RAM"
    assert stats.offloaded_bytes == stats.spilled_bytes == stats.host_bytes == 0
    assert stats.spill_files == 0 and list(spill_dir.iterdir()) == []
    arena = warnings_from(caplog, "arena")
    assert len(arena) == 1 and "pinning" in arena[0], arena
    store = warnings_from(caplog, "store")
    assert len(store) == 1 and "no host memory left below the device" in store[0], store
    eng.close()


def test_limited_pinning_and_a_failing_disk_keep_tensors_on_the_device(link, host, spill_dir, caplog):
    """Two slabs pinned, then pinning refused, and the disk failing from its first write: the two
    host copies stay, every newer tensor stays on the device over the budget, exact, and after the
    step nothing is held (device, host blocks, spill extents).

    Changed with the tier rebuild: "no pinning" alone now never reaches the disk (the test above),
    so the disk's failure is tested behind a host tier that filled."""
    model = _mlp()
    ref = _host_step(model)
    host.pins_ok = 2
    host.writes_ok = 0
    eng = _host_engine(link, 2 * ACT_MB, host=host, host_budget_mb=4 * ACT_MB, spill_dir=spill_dir)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, _host_step(model, eng), "limited pinning, disk failing")
    stats = _host_clean(eng, spill_dir)
    assert stats.peak_resident_bytes > 2 * ACT_BYTES, "over the budget rather than into host RAM"
    assert stats.spilled_bytes == 0 and stats.offloaded_bytes == 2 * ACT_BYTES, "two host copies, no more"
    assert stats.resident_bytes == 0 and stats.spill_bytes == 0
    assert host.writes > 0, "the disk was tried"
    store = warnings_from(caplog, "store")
    assert any("keeping saved tensors on the device" in m for m in store), store
    assert len([m for m in store if os.strerror(errno.ENOSPC) in m]) == 1 and len(set(store)) == len(store), store
    eng.close()
    assert list(spill_dir.iterdir()) == []


def test_low_host_ram_caps_the_arena_and_spills(link, host, spill_dir, caplog):
    """The host reports barely more than the reserve free: the arena stops growing within it (one
    warning), the oldest host copies go to disk, exact."""
    total = 16 << 30
    reserve = 2 << 30  # 10 % of 16 GiB is under the reserve's 2 GiB floor
    room = 3 * ACT_BYTES  # three slabs of one activation each (the room is under 64 MiB)
    # What the arena holds is no longer available, as the OS would report (asking the engine
    # instead would re-enter it from inside its own pack).
    host.ram_reading = lambda available, _total: (reserve + room - host.held_bytes, total)
    model = _mlp()
    ref = _host_step(model)
    eng = _host_engine(link, 3 * ACT_MB, host=host, spill_dir=spill_dir)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, _host_step(model, eng), "low host RAM")
        stats = _host_clean(eng, spill_dir)
        assert stats.spilled_bytes > 0
        assert 0 < stats.host_bytes <= room, "the arena never dips into the reserve"
        assert stats.host_bytes == host.held_bytes, "host_bytes counts the slabs really held"
        assert_same(ref, _host_step(model, eng), "low host RAM, second step")
        assert 0 < _host_clean(eng, spill_dir).host_bytes <= room
    messages = warnings_from(caplog, "arena")
    assert len(messages) == 1 and "host RAM is low" in messages[0], messages
    eng.close()
    assert eng.stats.host_bytes == 0
    assert list(spill_dir.iterdir()) == []


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


def _assert_reset(eng, spill_dir):
    """The engine holds nothing (device bytes, spill extents, host blocks) and its hooks are off."""
    gc.collect()
    stats = _host_clean(eng, spill_dir)
    assert stats.resident_bytes == 0 and stats.spill_bytes == 0 and stats.spill_files <= 1
    saved = stats.saved_tensors
    torch.tanh(torch.randn(BATCH, 128, requires_grad=True)).sum().backward()  # outside the engine
    assert eng.stats.saved_tensors == saved, "the hooks are off after the exception"


@pytest.fixture(params=["disk", *HOST_LINKS])
def tier(request):
    """Below the device: the disk alone, or a host tier (with a cap, then disk) over either link."""
    with link_named("deferred-3" if request.param == "deferred" else request.param) as made:
        yield made


def _exception_engine(link, spill_dir):
    if link is None:
        return offload.engine(3 * ACT_MB, min_offload_mb=0, spill_dir=spill_dir)
    return _host_engine(link, 3 * ACT_MB, host_budget_mb=2 * ACT_MB, spill_dir=spill_dir)


@pytest.mark.sweep
@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_exception_in_forward_resets(error, tier, spill_dir):
    fail = FailsOnCall(3, error)
    model = _faulty_mlp(fail)
    fail.calls = 10  # the reference run never fails
    ref = run_step(model, _mlp_input)
    fail.calls = 0
    eng = _exception_engine(tier, spill_dir)
    with pytest.raises(error):
        run_step(model, _mlp_input, eng)
    _assert_reset(eng, spill_dir)
    assert eng.stats.offloaded_bytes > 0, "the failed forward had moved tensors"
    eng.reset_stats()
    assert_same(ref, run_step(model, _mlp_input, eng), "the step after")
    _assert_reset(eng, spill_dir)
    eng.close()
    assert list(spill_dir.iterdir()) == []


@pytest.mark.sweep
@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_exception_in_backward_resets(error, tier, spill_dir):
    fail = FailsOnCall(10**9, error)
    model = _faulty_mlp(fail)
    ref = run_step(model, _mlp_input)
    eng = _exception_engine(tier, spill_dir)

    def raise_in_backward(grad):
        raise error("raised on purpose in backward")

    with eng:
        x = _mlp_input()
        h = model[:6](x)
        h.register_hook(raise_in_backward)  # half the reloads done, the rest still moved
        loss = model[6:](h).square().mean()
    with pytest.raises(error):
        loss.backward()
    del loss, h
    _assert_reset(eng, spill_dir)
    assert eng.stats.reloaded_bytes > 0, "backward had reloaded tensors before the exception"
    eng.reset_stats()
    assert_same(ref, run_step(model, _mlp_input, eng), "the step after")
    _assert_reset(eng, spill_dir)
    eng.close()
    assert list(spill_dir.iterdir()) == []


@pytest.mark.parametrize("budget", [None, 0], ids=["hot", "moved"])
def test_freeing_the_graph_after_close_counts_nothing_twice(budget, spill_dir):
    """close() releases what a live graph still points at; when that graph is freed afterwards, its
    handles' releases find the entries gone and change nothing (resident bytes stay 0, not below)."""
    model = TanhChain(4)
    eng = offload.engine(budget, min_offload_mb=0, spill_dir=spill_dir)
    with eng:
        loss = model(chain_input()).sum()
    eng.close()
    assert eng.stats.resident_bytes == 0
    del loss
    gc.collect()
    assert eng.stats.resident_bytes == 0
