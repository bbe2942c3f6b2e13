"""The disk tier frees RAM: spilled bytes are not left in the page cache, and one file is reused.

Oracle: ``mincore`` over the spill directory (``offload.bench.pagecache``) while a step runs. A buffered
write would leave every spilled page cached (measured before this tier was rebuilt: 98-100 % of the
bytes spilled per step); direct I/O leaves none, and the fallback (fdatasync + DONTNEED) almost none.
"""

from __future__ import annotations

import errno
import os
import re
import sys

import pytest
import torch

import offload
from hosts import StandInHost
from offload.bench.pagecache import cached_bytes_under
from offload.models.gpt import GPTConfig, MiniGPT
from offload.seams import Host
from zoo import files_under, spill_files, wait_clean

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and O_DIRECT are Linux's")

CACHED_SHARE_MAX = 0.05
"""Most of the spilled bytes allowed in the page cache at any reading (direct I/O measures 0 here;
a buffered write measured 1.0). The slack covers the fallback's pages between write and drop."""


def _real_disk(path) -> bool:
    return Host().filesystem_type(path) not in ("tmpfs", "ramfs", "")


def _gpt():
    torch.manual_seed(0)
    return MiniGPT(GPTConfig(n_layer=2, n_embd=128, n_head=4, seq_len=128))


def _step(model, eng, idx, readings):
    with eng:
        _, loss = model(idx, idx)
    readings.append((cached_bytes_under(eng_dir(eng)), eng.stats.spilled_bytes))
    loss.backward()


def eng_dir(eng) -> str:
    return eng.config.spill_dir


def _takes_o_direct(directory) -> bool:
    """Whether the filesystem under ``directory`` opens a file with ``O_DIRECT`` (EINVAL: it cannot)."""
    path = os.path.join(directory, "o-direct-probe")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    os.remove(path)
    return True


def _open_flags_under(directory) -> list[int]:
    """The open flags (``/proc/self/fdinfo``) of this process's descriptors on files under ``directory``."""
    flags = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            with open(f"/proc/self/fdinfo/{fd}") as info:
                text = info.read()
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target.startswith(str(directory) + os.sep):
            flags.append(int(re.search(r"^flags:\s*([0-7]+)", text, re.MULTILINE).group(1), 8))
    return flags


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered+dontneed"])
def test_spilled_bytes_leave_the_page_cache(direct, tmp_path):
    if not _real_disk(tmp_path):
        pytest.skip(f"{tmp_path} is not on a disk (its pages are RAM whatever the engine does)")
    host = Host()
    host.direct_io = direct
    model = _gpt()
    idx = torch.randint(0, 256, (4, 128))
    eng = offload.engine(0, spill_dir=tmp_path, model=model, host=host)
    readings = []
    for _ in range(3):
        _step(model, eng, idx, readings)
    stats = wait_clean(eng, tmp_path)
    assert stats.spilled_bytes > 0
    (flags,) = _open_flags_under(tmp_path)
    assert bool(flags & os.O_DIRECT) == direct, f"the spill file's open flags: {flags:o}"
    for cached, spilled in readings:
        assert spilled > 0 and cached <= CACHED_SHARE_MAX * spilled, (cached, spilled)
        if direct:
            assert cached == 0, f"direct I/O leaves no page of the file cached: {cached} bytes"
    assert cached_bytes_under(str(tmp_path)) <= CACHED_SHARE_MAX * stats.spilled_bytes, "reads leave no pages either"
    eng.close()


def test_one_spill_file_reused_across_steps(tmp_path):
    model = _gpt()
    idx = torch.randint(0, 256, (4, 128))
    eng = offload.engine(0, spill_dir=tmp_path, model=model)
    sizes = []
    for _ in range(4):
        with eng:
            _, loss = model(idx, idx)
        loss.backward()
        stats = wait_clean(eng, tmp_path)
        files = spill_files(tmp_path)
        assert stats.spill_files == 1 and len(files) == 1 and files_under(tmp_path) == [], files
        assert oct(os.stat(files[0]).st_mode & 0o777) == oct(0o600)
        sizes.append(os.path.getsize(files[0]))
    assert stats.spilled_bytes > 0
    assert sizes[1:] == sizes[:1] * 3, f"extents are reused, the file does not grow: {sizes}"
    eng.close()
    assert list(tmp_path.iterdir()) == [] and spill_files(tmp_path) == []


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_direct_io_is_used_where_the_filesystem_takes_it(tmp_path):
    """Whatever the filesystem (tmpfs takes ``O_DIRECT`` on recent kernels too), where it opens a
    file with ``O_DIRECT`` the spill file is opened so: the buffered fallback is for filesystems
    that refuse it."""
    if not _takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    idx = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
    plain = _gpt()
    _, loss = plain(idx, idx)
    loss.backward()
    model = _gpt()
    eng = offload.engine(0, spill_dir=tmp_path, model=model)
    with eng:
        _, loss = model(idx, idx)
    flags = _open_flags_under(tmp_path)
    assert eng.stats.spilled_bytes > 0 and len(flags) == 1, flags
    assert flags[0] & os.O_DIRECT, f"the spill file is opened without O_DIRECT: flags {flags[0]:o}"
    loss.backward()
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad)
    eng.close()


def test_the_page_cache_reading_sees_a_file_without_a_name(tmp_path):
    """This file's oracle must see the spill file, which has no name once open (issue 47, item 4):
    a buffered file written and then unlinked while open still counts, and stops counting once
    closed; else every reading here would be a vacuous 0."""
    path = tmp_path / "held"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"x" * (1 << 20))
        os.unlink(path)
        assert files_under(tmp_path) == []
        assert cached_bytes_under(str(tmp_path)) == 1 << 20, "a buffered write's pages are all resident"
    finally:
        os.close(fd)
    assert cached_bytes_under(str(tmp_path)) == 0


def test_the_buffered_spill_file_is_opened_through_the_host(tmp_path):
    """Without direct I/O the spill file is still opened by the host the engine was given
    (``offload.seams.Host.open``), never behind its back: a stand-in host sees the one open, and
    the gradients are the model's without the engine."""
    idx = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
    plain = _gpt()
    _, loss = plain(idx, idx)
    loss.backward()
    host = StandInHost()
    host.direct_io = False
    model = _gpt()
    eng = offload.engine(0, spill_dir=tmp_path, model=model, host=host)
    with eng:
        _, loss = model(idx, idx)
    loss.backward()
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad)
    assert eng.stats.spilled_bytes > 0
    assert host.opens == 1 and len(host.created) == 1, (host.opens, host.created)
    eng.close()
