"""Spill files as an attacker on the same machine would see them.

Activations are user data (a batch of text, images, medical records). On disk they must be as
private as the process's memory: a 0700 directory of its own, 0600 files, names that say nothing
and cannot be guessed, opened so that a planted symlink or file is never followed or reused, and
nothing left behind however the engine ends (close, garbage collection, interpreter exit). Log
lines and errors name shapes and dtypes at most, never values.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import re
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

import offload
import offload._spill
from zoo import assert_same, default_loss, files_under, run_step, wait_clean

WIDTH = 128
BATCH = 64
MARKER = 1234.5678
"""A value no message has any reason to contain: if it shows up in a log line, data leaked."""


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)])


def _marked_input():
    return torch.full((BATCH, WIDTH), MARKER)


def _forward(eng, model=None):
    with eng:
        return (model or _model())(_marked_input()).sum()


def _store(eng):
    return eng._stores[torch.device("cpu")]


class _Names:
    """Stands in for ``uuid`` inside ``offload._spill``: hands out names the test knows in advance."""

    def __init__(self) -> None:
        self.queue: list[str] = []

    def uuid4(self):
        return uuid.UUID(self.queue.pop(0)) if self.queue else uuid.uuid4()


def test_directory_and_files_are_private_and_names_say_nothing(spill_dir):
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    loss = _forward(eng)
    private = Path(_store(eng).spill.path)
    assert private.parent == spill_dir
    info = os.lstat(private)
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    assert re.fullmatch(r"offload-[A-Za-z0-9_]{8,}", private.name), "mkdtemp's random suffix"
    files = files_under(spill_dir)
    assert files and len(files) == eng.stats.spill_files
    for path in files:
        info = os.lstat(path)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600, path
        name = os.path.basename(path)
        assert re.fullmatch(r"[0-9a-f]{32}", name), name
        assert uuid.UUID(name).version == 4, f"{name}: random (uuid4), not derived from a clock or a counter"
    del loss
    wait_clean(eng, spill_dir)
    eng.close()


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_planted_path_is_never_written_through(planted, spill_dir, tmp_path, monkeypatch, caplog):
    """Someone who can predict the next name plants a symlink (or a file) there first: the engine
    refuses to open it (O_EXCL | O_NOFOLLOW), keeps the tensor in memory and says so; the target is
    untouched and the step exact."""
    names = _Names()
    monkeypatch.setattr(offload._spill, "uuid", names)
    model = _model()
    ref = run_step(model, _marked_input)
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    private = Path(eng._store_for(torch.device("cpu")).spill._ensure_open())  # before any spill
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    predicted = [uuid.uuid4().hex for _ in range(3)]
    for name in predicted:
        if planted == "symlink":
            (private / name).symlink_to(target)
        else:
            (private / name).write_bytes(b"planted")
    names.queue = list(predicted)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, run_step(model, _marked_input, eng), f"planted {planted}")
    assert target.read_bytes() == b"precious"
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("offload")]
    assert any(os.strerror(errno.EEXIST) in m for m in messages), messages
    stats = wait_clean(eng, spill_dir)
    assert stats.spilled_bytes > 0, "names after the planted ones spill normally"
    eng.close()
    assert not private.exists() and target.read_bytes() == b"precious"


def test_spill_file_swapped_for_a_symlink_is_not_read(spill_dir, tmp_path):
    """A spill file replaced by a symlink to attacker-chosen bytes: the read refuses it (O_NOFOLLOW)
    and backward fails with an OffloadError instead of computing with those bytes."""
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    loss = _forward(eng)
    assert eng.stats.spill_files > 0  # settles: every write has landed
    fake = tmp_path / "fake"
    for path in files_under(spill_dir):
        fake.write_bytes(b"\0" * os.path.getsize(path))
        os.unlink(path)
        os.symlink(fake, path)
    with pytest.raises(offload.OffloadError, match=rf"\({BATCH}, {WIDTH}\) torch.float32 on cpu.*spill file"):
        loss.backward()
    del loss
    wait_clean(eng, spill_dir)
    eng.close()


def test_logs_and_errors_name_shapes_and_dtypes_at_most(spill_dir, monkeypatch, caplog):
    """Every line the engine logs or raises while things go wrong (a failed write, a failed read, a
    tmpfs warning) carries no tensor values."""
    real_write = offload._spill._write_file
    calls = []

    def every_other_write_fails(path, data):
        calls.append(path)
        if len(calls) % 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(path, data)

    monkeypatch.setattr(offload._spill, "_write_file", every_other_write_fails)
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    with caplog.at_level(logging.DEBUG, logger="offload"):
        loss = _forward(eng)
        assert eng.stats.spill_files > 0
        for path in files_under(spill_dir):
            os.truncate(path, 10)
        with pytest.raises(offload.OffloadError) as failure:
            loss.backward()
    texts = [r.getMessage() for r in caplog.records if r.name.startswith("offload")] + [str(failure.value)]
    assert len(texts) >= 2
    values = {f"{MARKER}", f"{MARKER:.4f}", f"{MARKER:g}", "1234.5", "1.2346e+03"}
    for text in texts:
        assert not any(v in text for v in values), text
        assert "tensor(" not in text, text
    del loss, failure
    wait_clean(eng, spill_dir)
    eng.close()


def test_tmpfs_spill_directory_warns(caplog):
    shm = Path("/dev/shm")
    if not shm.is_dir() or offload._spill._filesystem_type(shm) != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm here")
    with tempfile.TemporaryDirectory(dir=shm) as parent:
        eng = offload.engine(0, min_offload_bytes=0, spill_dir=parent)
        with caplog.at_level(logging.WARNING, logger="offload"):
            loss = _forward(eng)
        messages = [r.getMessage() for r in caplog.records if r.name == "offload._spill"]
        assert any("tmpfs" in m and "RAM" in m for m in messages), messages
        loss.backward()
        del loss
        eng.close()
        assert os.listdir(parent) == []


def test_directory_removed_on_close_but_the_users_parent_stays(spill_dir):
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    loss = _forward(eng)
    private = Path(_store(eng).spill.path)
    assert private.is_dir()
    loss.backward()
    eng.close()
    assert not private.exists()
    assert spill_dir.is_dir(), "the parent is the user's; only the engine's private directory goes"


def test_directory_removed_when_the_engine_is_collected(spill_dir):
    """Dropped without close(): the directory goes with the engine, but not before a graph that
    still needs its files is gone too (the graph's handles keep the store alive)."""
    model = _model()
    ref = run_step(model, _marked_input)
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    model.zero_grad(set_to_none=True)
    with eng:
        out = model(_marked_input())
    private = Path(_store(eng).spill.path)
    del eng
    gc.collect()
    assert private.is_dir() and files_under(private), "backward still needs these files"
    default_loss(out).backward()
    assert torch.equal(out, ref.output)
    assert all(torch.equal(p.grad, ref.grads[n]) for n, p in model.named_parameters())
    del out
    gc.collect()
    assert not private.exists()


def test_directory_removed_at_interpreter_exit(spill_dir):
    """A process that spills and exits without close(), with a graph still alive: nothing is left."""
    script = textwrap.dedent(
        """
        import sys, torch, offload
        eng = offload.engine(0, min_offload_bytes=0, spill_dir=sys.argv[1])
        w = torch.randn(256, 256, requires_grad=True)
        with eng:
            h = torch.randn(64, 256)
            for _ in range(4):
                h = torch.tanh(h @ w)
            loss = h.sum()
        assert eng.stats.spill_files > 0
        print(eng._stores[torch.device("cpu")].spill.path)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(spill_dir)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    private = Path(done.stdout.strip().splitlines()[-1])
    assert private.parent == spill_dir
    assert not private.exists(), f"left behind: {files_under(private)}"
    assert list(spill_dir.iterdir()) == []
