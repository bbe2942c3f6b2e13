"""The tier behind the budget (disk, on this CPU): private files, prompt removal, prefetch, the budget.

On the CPU the engine's device is the CPU itself and the next tier is the spill directory, so
these tests watch the files: their modes and names while they exist, their count while backward
consumes them, and that nothing is left after backward, after a forward never backpropagated,
and after an exception. The budget is checked through ``stats.peak_resident_bytes``.
"""

from __future__ import annotations

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

import offload
from zoo import MB, default_loss, files_under, mlp, run_step, wait_clean

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


def test_spill_files_are_private_with_random_names(spill_dir):
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    with eng:
        loss = deep_mlp()(mlp_input()).sum()
    dirs = list(spill_dir.iterdir())
    assert len(dirs) == 1 and dirs[0].is_dir()
    assert stat.S_IMODE(os.stat(dirs[0]).st_mode) == 0o700
    files = files_under(spill_dir)
    assert len(files) == eng.stats.spill_files > 1
    names = [os.path.basename(f) for f in files]
    assert len(set(names)) == len(names)
    for path, name in zip(files, names):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        assert re.fullmatch(r"[0-9a-f]{32}", name), f"{name}: a random name, nothing about the tensor in it"
    del loss
    wait_clean(eng, spill_dir)
    eng.close()


def test_spill_files_go_as_backward_consumes_them(spill_dir):
    """Mid-backward there are fewer files than after forward; after backward there are none."""
    model = deep_mlp()
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir, prefetch=False)
    counts = []
    with eng:
        h = mlp_input()
        for i, layer in enumerate(model):
            h = layer(h)
            if i == len(model) // 2:
                h.register_hook(lambda grad: counts.append(len(files_under(spill_dir))) or grad)
        loss = h.sum()
    after_forward = len(files_under(spill_dir))
    assert after_forward == eng.stats.spill_files > 0
    loss.backward()
    assert len(counts) == 1
    assert 0 < counts[0] < after_forward, (counts, after_forward)
    assert eng.stats.spill_files == 0
    assert files_under(spill_dir) == []
    eng.close()


def test_spill_files_removed_after_exception_in_forward(spill_dir):
    model = deep_mlp()
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    seen = []

    def forward_that_fails():
        out = model(mlp_input())  # noqa: F841 - its graph holds the spilled tensors until this frame dies
        seen.append(len(files_under(spill_dir)))
        raise KeyError("mid-forward")

    try:
        with eng:
            forward_that_fails()
    except KeyError:
        pass  # the traceback, its frames and the graph go when this block ends
    assert seen[0] > 0
    wait_clean(eng, spill_dir)
    eng.close()


def test_prefetch_hits_with_a_small_budget(spill_dir):
    model = deep_mlp()
    eng = offload.engine(0.25, min_offload_bytes=0, spill_dir=spill_dir)
    run_step(model, mlp_input, eng)
    stats = wait_clean(eng, spill_dir)
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0
    assert stats.prefetch_hits > 0, stats
    assert stats.reload_wait_ms >= 0 and stats.evict_wait_ms >= 0
    eng.close()


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_off_means_every_reload_is_a_miss(prefetch, spill_dir):
    """Without prefetch each moved storage is reloaded by a miss (its second user then hits);
    with prefetch, all but the first reload are started ahead of use."""
    nbytes = SIZE * 4
    eng = offload.engine(2 * nbytes / MB, min_offload_bytes=0, spill_dir=spill_dir, prefetch=prefetch)
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
        assert stats.prefetch_misses == moved, stats
    eng.close()


@pytest.mark.parametrize("tensors", [1, 2, 3, 4.5, 8])
def test_peak_resident_stays_within_the_budget(tensors, spill_dir):
    """Budgets of 1 to 8 tensors on a chain of equal-size saved tensors: the peak never exceeds it."""
    depth = 16
    nbytes = SIZE * 4
    model = TanhChain(depth)
    ref = run_step(TanhChain(depth), chain_input, loss_fn=torch.sum)
    eng = offload.engine(tensors * nbytes / MB, min_offload_bytes=0, spill_dir=spill_dir)
    got = run_step(model, chain_input, eng, loss_fn=torch.sum)
    assert torch.equal(ref.grads["scale"], got.grads["scale"]) and torch.equal(ref.input_grad, got.input_grad)
    stats = wait_clean(eng, spill_dir)
    assert stats.saved_bytes == depth * nbytes, "each layer's storage counts once, though two ops save it"
    assert 0 < stats.offloaded_bytes <= stats.saved_bytes
    if tensors >= 2:
        assert stats.offloaded_bytes < stats.saved_bytes, "the newest tensors stay"
    assert stats.peak_resident_bytes <= eng.config.budget_bytes, stats
    assert stats.reload_wait_ms >= 0 and stats.evict_wait_ms >= 0
    eng.close()


def test_budget_none_keeps_everything_and_counts_it(spill_dir):
    depth = 8
    eng = offload.engine(None, min_offload_bytes=0, spill_dir=spill_dir)
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
print(json.dumps(eng.stats.to_dict()))
"""


def test_disk_full_keeps_tensors_in_memory(spill_dir):
    """Every spill write fails (file size limit): the step is still exact, nothing is counted as
    moved, nothing is left behind, and the user is told once."""
    tests_dir = Path(__file__).resolve().parent
    path = [str(tests_dir.parent), str(tests_dir), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    done = subprocess.run(
        [sys.executable, "-c", DISK_FULL_STEP, str(spill_dir)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["saved_bytes"] > 0
    assert stats["offloaded_bytes"] == stats["spilled_bytes"] == stats["reloaded_bytes"] == 0, stats
    assert stats["resident_bytes"] == 0 and stats["spill_files"] == 0, stats
    assert done.stderr.count("writing a spill file failed") == 1, done.stderr
    assert files_under(spill_dir) == []


def _spilled_step(spill_dir):
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    with eng:
        loss = deep_mlp()(mlp_input()).sum()
    files = files_under(spill_dir)
    assert files
    return eng, loss, files


def test_truncated_spill_file_is_an_offload_error(spill_dir):
    eng, loss, files = _spilled_step(spill_dir)
    for path in files:
        os.truncate(path, 10)
    with pytest.raises(offload.OffloadError, match=r"\(64, 128\) torch.float32"):
        loss.backward()
    del loss
    eng.close()


def test_deleted_spill_file_is_an_offload_error(spill_dir):
    eng, loss, files = _spilled_step(spill_dir)
    for path in files:
        os.unlink(path)
    with pytest.raises(offload.OffloadError, match="No such file"):
        loss.backward()
    del loss
    eng.close()


def test_backward_after_close_is_an_offload_error(spill_dir):
    eng, loss, _ = _spilled_step(spill_dir)
    eng.close()
    with pytest.raises(offload.OffloadError, match=r"close\(\)"):
        loss.backward()
