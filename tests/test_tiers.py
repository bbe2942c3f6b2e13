"""The tier behind the budget (disk, on this CPU): a private file, extents released as backward
consumes them, prefetch, the budget.

On the CPU the engine's device is the CPU itself and the next tier is the engine's one spill file
(made at the first spill, kept and reused until ``close()``), so these tests watch it: its mode
and name, its live extents (``stats.spill_bytes``) while backward consumes them, and that nothing
is held after backward, after a forward never backpropagated, and after an exception, and nothing
is on disk after close. The budget is checked through ``stats.peak_resident_bytes``.

One test is white-box: the byte view the store takes of a storage it moves
(``offload._memory.tiers.as_bytes``, a pure function), read under a dispatch mode.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import offload
import offload._memory.tiers
from hosts import StandInHost
from zoo import MB, assert_same, default_loss, files_under, mlp, run_step, spill_file_name, spill_files, wait_clean

EXTENT_ALIGN_BYTES = 4096
"""What each spilled copy's extent is rounded up to (``offload.Stats.spill_bytes``)."""
SIZE = 64 * 1024
"""Elements of each tensor in the chain model (256 KiB in fp32)."""


class TanhChain(nn.Module):
    """``depth`` tanh's in a row: each saves its output, one storage of the same size per layer."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.scale = nn.Parameter(torch.tensor(0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.depth):
            x = torch.tanh(x) * self.scale  # tanh saves its output; mul saves x (the same storage)
        return x


def chain_input():
    return torch.randn(SIZE)


def deep_mlp():
    return mlp(depth=16, width=128)


def mlp_input():
    return torch.randn(64, 128)


def test_spill_file_is_private_with_a_random_name(spill_dir):
    """One 0600 file, made with a random name in a private directory and open without a name since
    (nothing in ``spill_dir`` while it spills), whose live extents hold every tensor moved (aligned
    to the direct-I/O block), and nothing else.

    Changed with the one-file design: there used to be a file per spilled tensor. Changed with the
    nameless file (issue 47, item 4): the directory and the name went with the open; the 0700
    directory is checked at the create, in ``test_spill_security``."""
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    with eng:
        loss = deep_mlp()(mlp_input()).sum()
    assert list(spill_dir.iterdir()) == [], "spilling, yet nothing on disk names the file"
    files = spill_files(spill_dir)
    stats = eng.stats
    assert len(files) == stats.spill_files == 1
    assert stat.S_IMODE(os.stat(files[0]).st_mode) == 0o600, files[0]
    name = os.path.basename(spill_file_name(files[0]))
    assert re.fullmatch(r"[0-9a-f]{32}", name), f"{name}: a random name, nothing about the tensor in it"
    align = EXTENT_ALIGN_BYTES
    assert stats.offloaded_bytes == stats.saved_bytes > 0, "budget 0 moves everything"
    assert stats.offloaded_bytes <= stats.spill_bytes < stats.offloaded_bytes + stats.saved_tensors * align
    del loss
    wait_clean(eng, spill_dir)
    eng.close()
    assert list(spill_dir.iterdir()) == []


def test_spill_extents_go_as_backward_consumes_them(spill_dir):
    """Mid-backward fewer spill bytes are live than after forward; after backward none are. The
    file stays, the same size, for the next step, and goes at close().

    Changed with the one-file design: this counted files, one per tensor, removed as backward
    consumed them; now what backward releases is extents of the one file (``spill_bytes``)."""
    model = deep_mlp()
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, prefetch=False)
    counts = []
    with eng:
        h = mlp_input()
        for i, layer in enumerate(model):
            h = layer(h)
            if i == len(model) // 2:
                h.register_hook(
                    lambda grad: counts.append((eng.stats.spill_bytes, len(spill_files(spill_dir)))) or grad
                )
        loss = h.sum()
    after_forward = eng.stats.spill_bytes
    assert after_forward >= eng.stats.offloaded_bytes > 0
    [path] = spill_files(spill_dir)
    size = os.path.getsize(path)
    loss.backward()
    assert len(counts) == 1
    assert 0 < counts[0][0] < after_forward, (counts, after_forward)
    assert counts[0][1] == 1, "one file throughout"
    stats = wait_clean(eng, spill_dir)
    assert stats.spill_bytes == 0 and stats.spill_files == 1
    assert spill_files(spill_dir) == [path] and os.path.getsize(path) == size, "kept for the next step"
    eng.close()
    assert eng.stats.spill_files == 0 and spill_files(spill_dir) == [] and list(spill_dir.iterdir()) == []


def test_spill_files_removed_after_exception_in_forward(spill_dir):
    model = deep_mlp()
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    seen = []

    def forward_that_fails():
        out = model(mlp_input())  # noqa: F841 - its graph holds the spilled tensors until this frame dies
        seen.append(len(spill_files(spill_dir)))
        raise KeyError("mid-forward")

    try:
        with eng:
            forward_that_fails()
    except KeyError:
        pass  # the traceback, its frames and the graph go when this block ends
    assert seen[0] == 1
    stats = wait_clean(eng, spill_dir)
    assert stats.offloaded_bytes > 0 and stats.spill_bytes == 0
    eng.close()
    assert list(spill_dir.iterdir()) == []


def test_prefetch_hits_with_a_small_budget(spill_dir):
    """With prefetch, unpacks find reloads already started that without it would be misses. (A
    second user of a reloaded storage counts as a hit either way, so hits alone prove nothing:
    the same step without prefetch is the reference.)"""
    ref = run_step(deep_mlp(), mlp_input)
    runs = {}
    for prefetch in (True, False):
        eng = offload.engine(0.25, min_offload_mb=0, spill_dir=spill_dir, prefetch=prefetch)
        assert_same(ref, run_step(deep_mlp(), mlp_input, eng), f"prefetch={prefetch}")
        runs[prefetch] = wait_clean(eng, spill_dir)
        eng.close()
    with_prefetch, without = runs[True], runs[False]
    assert with_prefetch.offloaded_bytes == without.offloaded_bytes > 0
    assert with_prefetch.prefetch_misses < without.prefetch_misses, (with_prefetch, without)
    assert with_prefetch.prefetch_hits > without.prefetch_hits
    assert without.prefetch_misses > 0 and without.reload_wait_ms > 0, "a miss waits for its read, timed"


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_off_means_every_reload_is_a_miss(prefetch, spill_dir):
    """Without prefetch each moved storage is reloaded by a miss (its second user then hits);
    with prefetch, all but the first reload are started ahead of use. A storage whose write is
    still in flight when backward reaches it is served from its original: neither read nor a miss."""
    nbytes = SIZE * 4
    eng = offload.engine(2 * nbytes / MB, min_offload_mb=0, spill_dir=spill_dir, prefetch=prefetch)
    run_step(TanhChain(16), chain_input, eng, loss_fn=torch.sum)
    stats = wait_clean(eng, spill_dir)
    moved = stats.offloaded_bytes // nbytes
    # Each moved storage comes back by a read, except that the newest may still be on its way out
    # when backward starts: the store then adopts its source instead of reading the file. The
    # budget (2 tensors, hot + in flight) leaves room for at most one write in flight.
    assert moved > 4 and stats.offloaded_bytes - nbytes <= stats.reloaded_bytes <= stats.offloaded_bytes
    if prefetch:
        assert stats.prefetch_misses < moved / 2, stats
    else:
        assert stats.prefetch_misses == stats.reloaded_bytes // nbytes, stats
    eng.close()


@pytest.mark.parametrize("tensors", [1, 2, 3, 4.5, 8])
def test_peak_resident_stays_within_the_budget(tensors, spill_dir):
    """Budgets of 1 to 8 tensors on a chain of equal-size saved tensors: the peak never exceeds it."""
    depth = 16
    nbytes = SIZE * 4
    model = TanhChain(depth)
    ref = run_step(TanhChain(depth), chain_input, loss_fn=torch.sum)
    eng = offload.engine(tensors * nbytes / MB, min_offload_mb=0, spill_dir=spill_dir)
    got = run_step(model, chain_input, eng, loss_fn=torch.sum)
    assert torch.equal(ref.grads["scale"], got.grads["scale"]) and torch.equal(ref.input_grad, got.input_grad)
    stats = wait_clean(eng, spill_dir)
    assert stats.saved_bytes == depth * nbytes, "each layer's storage counts once, though two ops save it"
    assert 0 < stats.offloaded_bytes <= stats.saved_bytes
    if tensors >= 2:
        assert stats.offloaded_bytes < stats.saved_bytes, "the newest tensors stay"
    assert stats.peak_resident_bytes <= eng.config.budget_bytes, stats
    assert stats.prefetch_misses == 0 or stats.reload_wait_ms > 0, "a miss waits for its read, timed"
    if tensors == 1:  # each save leaves its tensor and the one leaving before it: over a budget of one
        assert stats.evict_wait_ms > 0, stats
    eng.close()


def test_budget_none_keeps_everything_and_counts_it(spill_dir):
    depth = 8
    eng = offload.engine(None, min_offload_mb=0, spill_dir=spill_dir)
    w = torch.ones((), requires_grad=True)
    with eng:
        y = TanhChain(depth)(chain_input() * w)
    stats = eng.stats
    assert stats.offloaded_bytes == stats.spilled_bytes == 0
    assert stats.resident_bytes == stats.peak_resident_bytes == stats.saved_bytes == (depth + 1) * SIZE * 4
    default_loss(y).backward()
    del y
    wait_clean(eng, spill_dir)
    assert not spill_dir.exists() or list(spill_dir.iterdir()) == [], "budget None never made a spill dir"
    eng.close()


# ---------------------------------------------------------------------------------- disk failures


DISK_FULL_STEP = r"""
import gc, json, logging, resource, signal, sys, copy
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, like a full disk
import torch
import offload
from zoo import assert_same, mlp, run_step
logging.basicConfig(level=logging.WARNING)
gc.disable()  # what is released must be released by reference counting, not by a later collection
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
model = mlp(depth=4, width=128)
make_input = lambda: torch.randn(64, 128)
ref = run_step(copy.deepcopy(model), make_input)
eng = offload.engine(0, min_offload_bytes=8192, spill_dir=sys.argv[1])  # every managed tensor > 4 KiB
got = run_step(model, make_input, eng)
assert_same(ref, got)
assert_same(ref, run_step(model, make_input, eng))  # the disk still full: every write tried again
print(json.dumps(eng.stats.to_dict()))
eng.close()
print(json.dumps(eng.stats.to_dict()))
"""


def test_disk_full_keeps_tensors_in_memory(spill_dir):
    """Every spill write fails (file size limit: the first lands 4 KiB short, the rest at once):
    both steps are still exact, nothing is counted as moved, nothing is held, and the user is
    told once. The spill file, opened for the first write, stays until close() removes it."""
    tests_dir = Path(__file__).resolve().parent
    path = [str(tests_dir.parent), str(tests_dir), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    done = subprocess.run(
        [sys.executable, "-c", DISK_FULL_STEP, str(spill_dir)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    before, after = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert before["saved_bytes"] > 0
    assert before["offloaded_bytes"] == before["spilled_bytes"] == before["reloaded_bytes"] == 0, before
    assert before["resident_bytes"] == 0 and before["spill_bytes"] == 0 and before["spill_files"] == 1, before
    assert before["peak_resident_bytes"] > 0
    assert after["spill_files"] == 0 and after["spill_bytes"] == 0, after
    assert done.stderr.count("writing to the spill file failed") == 1, done.stderr
    assert os.strerror(errno.EFBIG) in done.stderr, done.stderr
    assert list(spill_dir.iterdir()) == []


def _spilled_step(spill_dir):
    writes = StandInHost()  # records every spill write, to wait for them
    model = deep_mlp()
    ref = run_step(model, mlp_input)
    model.zero_grad(set_to_none=True)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host=writes)
    torch.manual_seed(1234)  # run_step's seeds: the same input, the same math
    x = mlp_input().requires_grad_(True)
    with eng:
        out = model(x)
    assert writes.landed() > 0, "every write has landed before the test edits the file"
    files = spill_files(spill_dir)
    assert len(files) == 1 and files_under(spill_dir) == []
    return eng, model, ref, x, out, files[0]


def test_truncated_spill_file_is_an_offload_error(spill_dir):
    eng, model, ref, x, out, path = _spilled_step(spill_dir)
    os.truncate(path, 10)
    with pytest.raises(offload.OffloadError, match=r"\(64, 128\) torch.float32 on cpu.*spill file.*ended after"):
        default_loss(out).backward()
    del out
    wait_clean(eng, spill_dir)
    eng.close()
    assert list(spill_dir.iterdir()) == []


def test_a_spill_file_without_a_name_is_read_through_its_descriptor(spill_dir):
    """The spill file has no name once open: the engine's descriptor holds the data, so backward
    is exact, and nothing is on disk for a cleaner (or a user) to delete meanwhile.

    Changed with the one-file design: with a file per tensor, each read opened its file by name
    and a deleted one was an OffloadError ("No such file"); now the file is read through the
    descriptor opened at the first spill. Changed with the nameless file (issue 47, item 4): this
    deleted the name by hand; the engine now does so itself at the open."""
    eng, model, ref, x, out, path = _spilled_step(spill_dir)
    assert not os.path.lexists(spill_file_name(path))
    default_loss(out).backward()
    assert torch.equal(out, ref.output) and torch.equal(x.grad, ref.input_grad)
    assert all(torch.equal(p.grad, ref.grads[n]) for n, p in model.named_parameters())
    del out
    stats = wait_clean(eng, spill_dir)
    assert 0 < stats.reloaded_bytes <= stats.offloaded_bytes
    assert files_under(spill_dir) == []
    eng.close()
    assert list(spill_dir.iterdir()) == []


def test_backward_after_close_is_an_offload_error(spill_dir):
    """The error names the tensor, says the engine was closed, and says the fix."""
    eng, model, ref, x, out, path = _spilled_step(spill_dir)
    eng.close()
    assert spill_files(spill_dir) == [], "close() closes the file even while a graph still needs it"
    with pytest.raises(offload.OffloadError, match=r"\(64, 128\) torch.float32 on cpu.*clos") as failure:
        default_loss(out).backward()
    assert "backward before clos" in str(failure.value), f"the fix is not named: {failure.value}"


class _Ops(TorchDispatchMode):
    """The aten ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_a_storage_viewed_as_bytes_dispatches_no_write():
    """PyTorch's CUDA sanitizer is a dispatch mode, and takes the storage ``set_`` returns as
    written on the current stream; the store views the saved storages it moves as bytes while
    copies of them may be in flight on side streams. The view reaches no dispatch mode (See Note:
    [a view is no write]); it is still the storage's whole byte range."""
    saved = torch.arange(6, dtype=torch.float32)
    with _Ops() as seen:
        view = offload._memory.tiers.as_bytes(saved.untyped_storage())
    assert seen.ops == []
    assert view.dtype is torch.uint8 and view.numel() == 24 and view.data_ptr() == saved.data_ptr()
