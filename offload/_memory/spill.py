"""The disk tier's medium: one private spill file per engine, carved into extents, written and read
on worker threads, with direct I/O so that spilled bytes really leave RAM.

Why direct I/O. A buffered write leaves the file's pages in the page cache, dirty until the kernel
writes them back and clean until it needs the memory, and a container's memory limit counts them:
buffered spill files held all 198 MB a MiniGPT step spilled at budget 0 in the page cache, with
direct I/O none of it (2-vCPU AMD EPYC, ``bench/results/disk-tier-cpu.md``). ``O_DIRECT`` moves
the bytes between the disk and an aligned buffer of ours without the page cache. Where the
filesystem refuses it (tmpfs, some network filesystems), each write is followed by ``fdatasync``
and ``posix_fadvise(DONTNEED)`` on its range, and each read by ``DONTNEED``, on the worker thread;
tmpfs keeps its warning (its pages are RAM).

Why one file. A file per tensor pays a create and an unlink per tensor besides its write and read.
Extents are offsets into one file, multiples of ``ALIGN_BYTES``, taken first-fit and merged on
release; they are reused across steps, so the file grows to the most bytes spilled at once and
stays until ``close()``.

Why no name. The file is unlinked, and its private directory removed, the moment it is open,
before any tensor byte is written (See Note: [the spill file has no name]): what holds the bytes is
the descriptor alone, so the kernel frees them when the process ends however it ends, ``kill -9``
and a crash included, and nothing on disk names them meanwhile (``spill_dir`` is as it was). It
needs no ``O_TMPFILE``, which some filesystems refuse: the name lives for two system calls inside
a 0700 directory of our own.

    write: [worker] chunk of data ──copy──▶ aligned bounce buffer ──pwrite(offset)──▶ file ─▶ done
    read:  [worker] file ──pread(offset)──▶ aligned bounce buffer ──copy──▶ out ─▶ done

Every call to the operating system goes through the engine's ``Host`` (``host``), and so does
where the jobs run (``Host.jobs``: worker threads by default). Each job names the memory it reads
or writes, so a test's runner can run jobs on its own schedule and check every job's accesses
against the streams' (``tests/hb.py``).

Security: a private directory (``mkdtemp``, 0700), the file 0600 with a random name, opened with
``O_EXCL | O_NOFOLLOW | O_CLOEXEC``; nothing about a tensor is in a name, and the name and the
directory are gone before the first write. The descriptor is emptied and closed on ``close()``,
when this object is collected, and at interpreter exit (``weakref.finalize``). A ``spill_dir``
that did not exist is made (0700) when the first spill needs it, and what was made goes at
``close()``, where it is empty then: nothing is left behind that was not there before (a killed
process may leave such an empty ``spill_dir``, never a byte of a tensor).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import shutil
import sys
import threading
import weakref
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .host import Host, Jobs
from .pending import FromFuture, Pending, failed
from .ranges import ALIGN_BYTES, FreeRanges, round_up

__all__ = ["ALIGN_BYTES", "Extent", "SpillFile"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
"""Bytes per pwrite/pread through a worker's bounce buffer: large enough to run at disk speed,
small enough that each worker's buffer costs little RAM."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the OS has none
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _aligned_buffer(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + ALIGN_BYTES, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN_BYTES
    return raw[start : start + nbytes]


@dataclasses.dataclass(frozen=True, slots=True)
class Extent:
    """Where one spilled copy lives: ``nbytes`` of data at ``offset`` (``size`` reserved, aligned)."""

    offset: int
    size: int
    nbytes: int


def _remove_tree(path: str) -> None:
    """Remove the private directory; if the OS refuses (a read-only or re-permissioned parent),
    say so once, naming the directory (never what was in it)."""
    refused: list = []

    def note(_function: object, _path: str, error: object) -> None:
        # Its message only: a traceback would hold the frames of a failed open, a forward and its tensors.
        refused.append(str(error[1] if isinstance(error, tuple) else error))

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=note)
    else:
        shutil.rmtree(path, onerror=note)
    if refused:
        log.warning(
            "offload: could not remove the spill directory %s (%s); no tensor data is left in it, remove it by hand",
            path,
            refused[0],
        )


class _File:
    """The open spill file and how it is written: direct, or buffered and dropped from the cache.
    Reached through its descriptor only (See Note: [the spill file has no name])."""

    def __init__(self, host: Host, fd: int, direct: bool) -> None:
        self.host, self.fd, self.direct = host, fd, direct
        self._local = threading.local()

    def _bounce(self) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = _aligned_buffer(CHUNK_BYTES)
        return buf

    def write(self, extent: Extent, data: torch.Tensor) -> None:
        src = data.numpy()
        bounce = self._bounce()
        done = 0
        while done < extent.nbytes:
            n = min(CHUNK_BYTES, extent.nbytes - done)
            bounce[:n] = src[done : done + n]
            padded = round_up(n)
            if padded > n:
                bounce[n:padded] = 0
            self._pwrite_all(bounce[:padded].data, extent.offset + done)
            done += n
        if not self.direct:
            self.host.sync(self.fd)
            self.host.drop_cache(self.fd, extent.offset, extent.size)

    def _pwrite_all(self, view: memoryview, offset: int) -> None:
        written = 0
        while written < len(view):
            written += self.host.pwrite(self.fd, view[written:], offset + written)

    def read(self, extent: Extent, out: torch.Tensor) -> None:
        # Returns nothing: a future's result lives as long as the future, which the store keeps as
        # a reader of the disk copy (See Note: [a pending does not hold its destination] in ``transfer``).
        dst = out.numpy()
        bounce = self._bounce()
        done = 0
        while done < extent.nbytes:
            n = min(CHUNK_BYTES, extent.nbytes - done)
            padded = round_up(n)
            got = 0
            while got < n:
                count = self.host.preadv(self.fd, [bounce[got:padded].data], extent.offset + done + got)
                if count == 0:  # an OSError, like every other I/O failure the store turns into OffloadError
                    raise OSError(
                        errno.EIO, f"the spill file ended after {done + got} of {extent.nbytes} bytes of a tensor"
                    )
                got += count
            dst[done : done + n] = bounce[:n]
            done += n
        if not self.direct:
            self.host.drop_cache(self.fd, extent.offset, extent.size)


def _open_file(host: Host, directory: str) -> _File:
    """The spill file, made in the private ``directory`` and then unlinked, with the directory.

    Note: [the spill file has no name]
    Once open, the file's name and its private directory are removed, before any byte is written:
    the descriptor is the one way to the data, so the kernel frees it when the process ends, even
    by SIGKILL, and ``spill_dir`` never shows it. Nothing may open the file by its path again; every
    write and read goes through ``fd``. A name that cannot be removed fails the open (the caller
    removes what is left), so no spilled byte ever has a name on disk.
    """
    path = os.path.join(directory, host.file_name())
    file: Optional[_File] = None
    if _O_DIRECT and host.direct_io:
        try:
            file = _File(host, host.open(path, _OPEN_FLAGS | _O_DIRECT, 0o600), direct=True)
        except OSError as error:
            if error.errno != errno.EINVAL:  # EINVAL: this filesystem has no direct I/O
                raise
    if file is None:
        file = _File(host, host.open(path, _OPEN_FLAGS, 0o600), direct=False)
    try:
        os.unlink(path)
        os.rmdir(directory)
        if not file.direct:
            host.no_readahead(file.fd)
    except OSError:
        os.close(file.fd)
        raise
    return file


class SpillFile:
    """One private spill file and the jobs that write and read it (``host.jobs(workers)``); opened
    lazily, through ``host``."""

    def __init__(self, parent: Optional[Path], workers: int, host: Optional[Host] = None) -> None:
        self._parent = parent
        self._host = host if host is not None else Host()
        self._jobs: Jobs = self._host.jobs(workers)
        self._file: Optional[_File] = None
        self._extents = FreeRanges()
        self._finalizer: Optional[weakref.finalize] = None
        self._closed = False

    # ------------------------------------------------------------------ state readers

    @property
    def files(self) -> int:
        """Spill files open now (on disk, without a name): 1 once the first spill opened it, 0 before
        and after close."""
        return 0 if self._file is None else 1

    @property
    def used_bytes(self) -> int:
        """Bytes of extents holding spilled copies now (aligned sizes)."""
        return self._extents.used_bytes

    @property
    def direct(self) -> Optional[bool]:
        """Whether writes bypass the page cache (None before the file exists)."""
        return None if self._file is None else self._file.direct

    # ------------------------------------------------------------------ I/O

    def _ensure_open(self) -> _File:
        if self._file is not None:
            return self._file
        if self._closed:
            raise FileNotFoundError(errno.ENOENT, "the engine was closed; its spill file is gone")
        made, directory = _make_private_directory(self._host, self._parent)
        try:
            os.chmod(directory, 0o700)
            on_tmpfs = self._host.filesystem_type(Path(directory)) == "tmpfs"
            file = _open_file(self._host, directory)
        except OSError:
            if os.path.lexists(directory):
                _remove_tree(directory)
            _remove_empty(made)
            raise
        if on_tmpfs:
            log.warning(
                "offload spill directory %s is on tmpfs: spilled tensors stay in RAM; "
                "pass spill_dir= on a real disk to take them out of memory",
                os.path.dirname(directory),
            )
        self._file = file
        self._finalizer = weakref.finalize(self, _close_file, file.fd, made)
        return file

    def write(self, data: torch.Tensor) -> tuple[Extent, Pending]:
        """Start writing a contiguous CPU uint8 tensor; returns (extent, pending).

        The caller keeps ``data`` alive until the pending is done (See Note: [keep-alive until the
        copy event] in ``transfer``). A file that cannot be made fails this write like any other.
        """
        nbytes = data.numel()
        try:
            file = self._ensure_open()
        except OSError as error:
            # No directory or file to spill into (its parent is full, unwritable or gone): this
            # write fails like any other, so the caller keeps the tensor.
            error.__traceback__ = None  # its frames (pack, the forward) would hold the graph
            return Extent(0, 0, nbytes), failed(error)
        size = round_up(nbytes)
        offset = self._extents.take(size)
        assert offset is not None  # the file grows as needed: its ranges have no limit
        extent = Extent(offset, size, nbytes)
        job = functools.partial(file.write, extent, data)
        return extent, FromFuture(self._jobs.submit(job, reads=data, writes=None))

    def read(self, extent: Extent, out: torch.Tensor) -> Pending:
        """Start reading a spilled copy into the CPU uint8 tensor ``out``."""
        if self._file is None:
            why = "the spill file was removed by close(); run backward before closing the engine"
            return failed(FileNotFoundError(errno.ENOENT, why))
        return FromFuture(self._jobs.submit(functools.partial(self._file.read, extent, out), reads=None, writes=out))

    def free(self, extent: Extent) -> None:
        """The extent's copy is no longer needed (no write or read of it in flight)."""
        if extent.size:
            self._extents.give(extent.offset, extent.size)

    def close(self) -> None:
        """Wait for I/O in flight, then close and remove the file and its directory."""
        self._closed = True
        self._jobs.shutdown()
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._file = None
        self._extents = FreeRanges()


_MAKE_TRIES = 3
"""Tries at making the private directory where another engine's close may remove an empty parent
this one just found (two engines sharing a spill_dir that did not exist)."""


def _make_private_directory(host: Host, parent: Optional[Path]) -> tuple[list[str], str]:
    """The directories made for ``parent`` (missing ones, deepest last) and the private one inside."""
    if parent is None:
        return [], host.make_directory(None)
    for attempt in range(_MAKE_TRIES):
        made = _make_parents(parent)
        try:
            return made, host.make_directory(str(parent))
        except FileNotFoundError:  # an empty parent went with another engine's close: make it again
            _remove_empty(made)
            if attempt == _MAKE_TRIES - 1:
                raise
        except OSError:
            _remove_empty(made)
            raise
    raise AssertionError("unreachable: the last try returns or raises")


def _make_parents(path: Path) -> list[str]:
    """Make ``path`` and its missing parents (0700); the directories made, deepest last. One that
    fails leaves none of those made behind."""
    missing: list[str] = []
    for parent in (path, *path.parents):
        if parent.exists():
            break
        missing.append(str(parent))
    made: list[str] = []
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # another engine made it meanwhile: not ours to remove
            continue
        except OSError:
            _remove_empty(made)
            raise
        made.append(directory)
    return made


def _remove_empty(made: list[str]) -> None:
    """Remove the directories ``_make_parents`` made, deepest first, where they are empty."""
    for directory in reversed(made):
        try:
            os.rmdir(directory)
        except OSError:  # not empty (another engine's files, the user's), or gone: leave it
            return


def _close_file(fd: int, made: list[str]) -> None:
    """Empty and close the nameless file (See Note: [the spill file has no name]); remove the
    ``spill_dir`` directories made for it, where empty."""
    try:
        os.ftruncate(fd, 0)  # its blocks go now, not when the last descriptor (a fork's) closes
    except OSError:
        pass
    try:
        os.close(fd)
    except OSError:
        pass
    _remove_empty(made)
