"""Spill files as an attacker on the same machine would see them.

Activations are user data (a batch of text, images, medical records). On disk they must be as
private as the process's memory: a 0700 directory of its own, a 0600 file, a name that says
nothing and cannot be guessed, opened so that a planted symlink or file is never followed or
reused, and nothing left behind however the engine ends (close, garbage collection, interpreter
exit, ``kill -9``). Log lines and errors name shapes and dtypes at most, never values.

The disk tier is one spill file per engine: made in a private directory at the first spill, then
unlinked with the directory before any byte is written, written and read through its descriptor,
closed at close. ``spill_dir`` is empty all along; tests find the file through the process's
descriptors (``zoo.spill_files``), and what the directory was at the create through the host
seam. The attacker's moves that need
timing (a name predicted, a trap laid before the create) are made through the engine's host seam
(``offload.seams.Host``), which sees the spill file's calls to the OS and nothing else.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import re
import shutil
import signal
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
from hosts import StandInHost
from offload.seams import Host
from zoo import assert_same, default_loss, files_under, run_step, spill_file_name, spill_files, wait_clean

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


def _private(spill_dir) -> Path:
    """The private directory the engine's one spill file was made in (gone since the open)."""
    files = spill_files(spill_dir)
    assert len(files) == 1 and list(spill_dir.iterdir()) == [], (files, list(spill_dir.iterdir()))
    return Path(spill_file_name(files[0])).parent


class _OpenFlags(Host):
    """This machine, recording the path, flags and mode of each open of the spill file, and the
    directory it is made in as it is then (``os.lstat``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.dirs: list[os.stat_result] = []

    def open(self, path, flags, mode):
        self.calls.append((path, flags, mode))
        self.dirs.append(os.lstat(os.path.dirname(path)))
        return super().open(path, flags, mode)


def _fds_into(directory) -> dict[int, str]:
    """This process's open descriptors on anything under ``directory`` (deleted files included)."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found[int(fd)] = target
    return found


def test_directory_and_file_are_private_and_the_name_says_nothing(spill_dir):
    """One 0700 directory of our own, one 0600 regular file with a random (uuid4) name, created
    with O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC; both gone from the disk once it is open (the
    descriptor holds it), and close() closes the descriptor.

    Changed with the nameless file (issue 47, item 4): the directory is seen as it was at the
    create (through the host seam), and the file through its descriptor."""
    opens = _OpenFlags()
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host=opens)
    loss = _forward(eng)
    private = _private(spill_dir)
    assert not private.exists(), "the private directory went once the file was open"
    info = opens.dirs[0]
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    assert re.fullmatch(r"offload-[A-Za-z0-9_]{8,}", private.name), "mkdtemp's random suffix"
    files = spill_files(spill_dir)
    assert len(files) == eng.stats.spill_files == 1, "one file per engine"
    path = spill_file_name(files[0])
    info = os.stat(files[0])
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
    assert info.st_nlink == 0 and not os.path.lexists(path), "no name on disk"
    name = os.path.basename(path)
    assert re.fullmatch(r"[0-9a-f]{32}", name), name
    assert uuid.UUID(name).version == 4, f"{name}: random (uuid4), not derived from a clock or a counter"
    # Opened at that path only (twice where the filesystem refuses O_DIRECT: the retry is buffered).
    assert {c[0] for c in opens.calls} == {path} and 1 <= len(opens.calls) <= 2, opens.calls
    for _, flags, mode in opens.calls:
        for flag in ("O_CREAT", "O_EXCL", "O_NOFOLLOW", "O_CLOEXEC"):
            assert flags & getattr(os, flag), f"the spill file is created without {flag}"
        assert mode == 0o600
    held = _fds_into(private)
    assert list(held.values()) == [f"{path} (deleted)"], held
    assert not os.get_inheritable(next(iter(held))), "a child process must not inherit the spill file"
    del loss
    wait_clean(eng, spill_dir)
    eng.close()
    assert _fds_into(private) == {} and list(spill_dir.iterdir()) == []


class _Planting(Host):
    """This machine, except that the spill file's names are ones the test knows in advance
    (``queue``, then random ones), and each private directory it makes gets, before the engine's
    create, a symlink (or a file) at the name the engine will pick next, as an attacker who could
    predict names and write there would plant it."""

    def __init__(self, planted: str, target: Path) -> None:
        self.planted, self.target = planted, target
        self.queue: list[str] = []
        self.dirs: list[Path] = []

    def file_name(self) -> str:
        return uuid.UUID(self.queue.pop(0)).hex if self.queue else super().file_name()

    def make_directory(self, parent):
        made = Path(super().make_directory(parent))
        self.dirs.append(made)
        if self.queue:
            trap = made / uuid.UUID(self.queue[0]).hex
            if self.planted == "symlink":
                trap.symlink_to(self.target)
            else:
                trap.write_bytes(b"planted")
        return str(made)


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_planted_path_is_never_written_through(planted, spill_dir, tmp_path, caplog):
    """Someone who can predict the next name plants a symlink (or a file) there first: the engine
    refuses to open it (O_EXCL | O_NOFOLLOW), keeps the tensor in memory and says so; the target is
    untouched, the step exact, and the next eviction makes a new directory and a new name.

    Changed with the one-file design: the planted name is the engine's one file, so the trap is
    laid in each private directory as it is made (before, the directory was made first and the
    trap laid for the files of later tensors)."""
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    planting = _Planting(planted, target)
    model = _model()
    ref = run_step(model, _marked_input)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host=planting)
    planting.queue = [str(uuid.uuid4()) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same(ref, run_step(model, _marked_input, eng), f"planted {planted}")
    assert target.read_bytes() == b"precious"
    assert planting.queue == [] and len(planting.dirs) == 4, "three refused creates, then a fresh name"
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("offload")]
    assert any(os.strerror(errno.EEXIST) in m for m in messages), messages
    stats = wait_clean(eng, spill_dir)
    assert stats.spilled_bytes > 0, "names after the planted ones spill normally"
    assert _private(spill_dir) == planting.dirs[-1], "the file is in the last directory made"
    assert list(spill_dir.iterdir()) == [], "the trapped directories went, with their traps, and the last one"
    eng.close()
    assert list(spill_dir.iterdir()) == [] and target.read_bytes() == b"precious"


def test_spill_file_swapped_for_a_symlink_is_not_read(spill_dir, tmp_path):
    """A symlink to attacker-chosen bytes is laid where the spill file was made: reads go through
    the descriptor opened at the first spill, never through the name, so backward is exact and the
    attacker's file is neither opened nor changed; close() leaves what it did not make.

    Changed with the one-file design: with a file per tensor, each read opened the name (and
    O_NOFOLLOW refused the symlink with an OffloadError); now nothing is opened after the first
    spill, so a swapped name has no way in at all, and backward is exact. Changed with the nameless
    file (issue 47, item 4): the name and its directory are gone once the file is open, so the
    attacker makes them again rather than swapping them, and close() has nothing to remove."""
    host = StandInHost()  # records every spill write and every open
    model = _model()
    ref = run_step(model, _marked_input)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host=host)
    model.zero_grad(set_to_none=True)
    with eng:
        out = model(_marked_input())
    assert host.landed() > 0
    fake = tmp_path / "fake"
    [fd_path] = spill_files(spill_dir)
    path = spill_file_name(fd_path)
    assert not os.path.lexists(os.path.dirname(path)), "nothing of it on disk to swap"
    fake.write_bytes(b"\0" * os.path.getsize(fd_path))
    os.mkdir(os.path.dirname(path))
    os.symlink(fake, path)
    opened = host.opens
    default_loss(out).backward()
    assert torch.equal(out, ref.output)
    assert all(torch.equal(p.grad, ref.grads[n]) for n, p in model.named_parameters()), "read through the descriptor"
    assert host.opens == opened and fake.read_bytes() == b"\0" * os.path.getsize(fake)
    del out
    eng.close()
    assert os.path.islink(path) and fake.exists(), "close() removes nothing by name, the target stayed"
    shutil.rmtree(os.path.dirname(path))


def test_logs_and_errors_name_shapes_and_dtypes_at_most(spill_dir, caplog):
    """Every line the engine logs or raises while things go wrong (a failed write, a failed read, a
    tmpfs warning) carries no tensor values."""
    writes = StandInHost()

    def every_other_write_fails(n: int, offset: int) -> None:
        if n % 2 == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    writes.before_write = every_other_write_fails
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host=writes)
    with caplog.at_level(logging.DEBUG, logger="offload"):
        loss = _forward(eng)
        assert writes.landed() > 0 and eng.stats.spill_files == 1
        for path in spill_files(spill_dir):
            os.truncate(path, 10)
        with pytest.raises(offload.OffloadError) as failure:
            loss.backward()
    texts = [r.getMessage() for r in caplog.records if r.name.startswith("offload")] + [str(failure.value)]
    assert len(texts) >= 2
    assert any(os.strerror(errno.ENOSPC) in t for t in texts) and "spill file" in texts[-1], texts
    values = {f"{MARKER}", f"{MARKER:.4f}", f"{MARKER:g}", "1234.5", "1.2346e+03"}
    for text in texts:
        assert not any(v in text for v in values), text
        assert "tensor(" not in text, text
    del loss, failure
    wait_clean(eng, spill_dir)
    eng.close()


def test_tmpfs_spill_directory_warns(caplog):
    shm = Path("/dev/shm")
    if not shm.is_dir() or Host().filesystem_type(shm) != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm here")
    with tempfile.TemporaryDirectory(dir=shm) as parent:
        eng = offload.engine(0, min_offload_mb=0, spill_dir=parent)
        with caplog.at_level(logging.WARNING, logger="offload"):
            loss = _forward(eng)
        messages = [
            r.getMessage() for r in caplog.records if r.name.startswith("offload.") and r.name.endswith(".spill")
        ]
        assert len(messages) == 1 and "tmpfs" in messages[0] and "RAM" in messages[0], messages
        loss.backward()
        del loss
        eng.close()
        assert os.listdir(parent) == []


def test_directory_removed_on_close_but_the_users_parent_stays(spill_dir):
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    loss = _forward(eng)
    private = _private(spill_dir)
    assert not private.exists() and len(_fds_into(private)) == 1, "open, with no name"
    loss.backward()
    del loss
    stats = wait_clean(eng, spill_dir)
    assert stats.spill_bytes == 0 and stats.spill_files == 1, "kept for the next step, holding nothing"
    eng.close()
    assert not private.exists() and _fds_into(private) == {}
    assert eng.stats.spill_files == 0
    assert spill_dir.is_dir(), "the parent is the user's; only the engine's private directory goes"


def test_directory_removed_when_the_engine_is_collected(spill_dir):
    """Dropped without close(): the directory goes with the engine, but not before a graph that
    still needs its file is gone too (the graph's handles keep the store alive)."""
    model = _model()
    ref = run_step(model, _marked_input)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    model.zero_grad(set_to_none=True)
    with eng:
        out = model(_marked_input())
    private = _private(spill_dir)
    del eng
    gc.collect()
    assert _fds_into(private), "backward still needs this file"
    default_loss(out).backward()
    assert torch.equal(out, ref.output)
    assert all(torch.equal(p.grad, ref.grads[n]) for n, p in model.named_parameters())
    del out
    gc.collect()
    assert _fds_into(private) == {}, "its descriptor closed"
    assert list(spill_dir.iterdir()) == []


def test_directory_removed_at_interpreter_exit(spill_dir):
    """A process that spills and exits without close(), with a graph still alive: nothing is left."""
    script = textwrap.dedent(
        """
        import pathlib, sys, torch, offload
        eng = offload.engine(0, min_offload_mb=0, spill_dir=sys.argv[1])
        w = torch.randn(256, 256, requires_grad=True)
        with eng:
            h = torch.randn(64, 256)
            for _ in range(4):
                h = torch.tanh(h @ w)
            loss = h.sum()
        assert eng.stats.spill_files == 1
        assert list(pathlib.Path(sys.argv[1]).iterdir()) == [], "nothing in spill_dir while spilling"
        print("spilled")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(spill_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "spilled"
    assert list(spill_dir.iterdir()) == [], f"left behind: {files_under(spill_dir)}"


def test_a_missing_spill_dir_is_made_when_needed_and_removed_at_close(tmp_path):
    """Create what you remove: checking the settings makes nothing; the first spill makes the
    directory (and its missing parents), and close() removes what it made."""
    import offload

    missing = tmp_path / "a" / "b" / "spill"
    eng = offload.engine(budget_mb=0, min_offload_mb=0, spill_dir=missing)
    assert not (tmp_path / "a").exists(), "building the engine made nothing"
    x = torch.randn(64, 64, requires_grad=True)
    with eng:
        y = x.sin().cos().sum()
    y.backward()
    assert missing.is_dir() and eng.stats.spilled_bytes > 0
    eng.close()
    assert not (tmp_path / "a").exists(), "close() removes the directories the engine made"


def test_a_spill_dir_that_existed_stays(tmp_path):
    import offload

    spill = tmp_path / "mine"
    spill.mkdir()
    eng = offload.engine(budget_mb=0, min_offload_mb=0, spill_dir=spill)
    x = torch.randn(64, 64, requires_grad=True)
    with eng:
        y = x.sin().sum()
    y.backward()
    eng.close()
    assert spill.is_dir() and list(spill.iterdir()) == []


def test_a_spill_dir_under_a_read_only_parent_is_refused(tmp_path):
    import offload

    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match=r"does not exist, and its parent .* is not a writable directory"):
        offload.engine(budget_mb=0, spill_dir=locked / "spill")


def test_two_engines_sharing_a_missing_spill_dir(tmp_path):
    """Two engines (two ranks on one node) share a spill_dir that did not exist: both spill, and
    one closing first never takes anything from under the other.

    Changed with the nameless file (issue 47, item 4): the other's file is no longer in the
    directory, so the first to close removes the (empty) directories it made, and the other goes
    on through its descriptor; nothing made is left once both are closed."""
    import offload

    missing = tmp_path / "shared" / "spill"
    engines = [offload.engine(budget_mb=0, min_offload_mb=0, spill_dir=missing) for _ in range(2)]

    def step(eng):
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with eng:
            y = x.sin().cos().sum()
        y.backward()
        return x.grad

    grads = [step(eng) for eng in engines]
    assert all(eng.stats.spilled_bytes > 0 for eng in engines)
    engines[0].close()  # the engine that made the directories, empty now: they go
    assert len(spill_files(missing)) == 1, "the other's file is open, with no name"
    assert torch.equal(step(engines[1]), grads[1])
    engines[1].close()
    assert spill_files(missing) == [] and not (tmp_path / "shared").exists()


def test_spill_dir_is_empty_while_the_engine_spills(spill_dir):
    """At every spill write, as it starts, ``spill_dir`` lists nothing: no tensor byte is ever
    written into a file that has a name (issue 47, item 4)."""
    host = StandInHost()
    seen: list[list[str]] = []
    host.before_write = lambda n, offset: seen.append(os.listdir(spill_dir))
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host=host)
    loss = _forward(eng)
    assert host.landed() > 0 and len(seen) == host.writes
    assert seen == [[]] * len(seen), seen
    loss.backward()
    del loss
    wait_clean(eng, spill_dir)
    eng.close()


def test_a_process_killed_mid_spill_leaves_nothing(spill_dir):
    """SIGKILL while the spill file holds a step's activations: no cleanup runs, yet nothing is left
    in ``spill_dir``, since the file never had a name once written (issue 47, item 4; before, the
    private directory and the file with every spilled byte stayed for good)."""
    script = textwrap.dedent(
        """
        import sys, torch, offload
        eng = offload.engine(0, min_offload_mb=0, spill_dir=sys.argv[1])
        w = torch.randn(256, 256, requires_grad=True)
        with eng:
            h = torch.randn(64, 256)
            for _ in range(4):
                h = torch.tanh(h @ w)
            loss = h.sum()
        assert eng.stats.spilled_bytes > 0
        print("spilled", flush=True)
        sys.stdin.readline()  # held here, its graph on disk, until killed
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(spill_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        line = child.stdout.readline()
        assert line.strip() == "spilled", child.stderr.read()
        assert list(spill_dir.iterdir()) == [], "the child spills with nothing in spill_dir"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for stream in (child.stdin, child.stdout, child.stderr):
            stream.close()
    assert list(spill_dir.iterdir()) == [], f"left behind: {files_under(spill_dir)}"
