"""The disk tier: a private spill directory and the threads that write and read it.

Owns files only. A spill is one file per storage, written from a CPU byte tensor and read back
into a CPU byte tensor on worker threads, so compute never waits on the disk unless the budget
forces it. The directory is private (0700), files are 0600 with random names (nothing about the
tensor is in a name), opened with O_EXCL | O_NOFOLLOW. Each file is removed as soon as its tensor
is no longer needed; the whole directory goes on ``close()``, when this object is collected,
and at interpreter exit (``weakref.finalize``).

    pack ──submit──▶ [worker] write(fd, bytes) ──▶ future done ──▶ source may be freed
    unpack ─submit─▶ [worker] readinto(buffer)  ──▶ future done ──▶ copy to the device
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import shutil
import stat
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Optional

import psutil
import torch

__all__ = ["SpillDir"]

log = logging.getLogger(__name__)

_MAX_IO_CHUNK = 1 << 30
"""Bytes per write/read syscall: Linux caps one call near 2 GiB; 1 GiB chunks stay well below."""

_OPEN_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_OPEN_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _filesystem_type(path: Path) -> str:
    """The type of the filesystem holding ``path`` ('' if unknown)."""
    best, fstype = "", ""
    resolved = str(path.resolve())
    try:
        for part in psutil.disk_partitions(all=True):
            mount = part.mountpoint
            if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, fstype = mount, part.fstype
    except (OSError, RuntimeError):  # psutil cannot read the mount table here
        return ""
    return fstype


def _write_file(path: str, data: torch.Tensor) -> None:
    view = memoryview(data.numpy()).cast("B")
    fd = os.open(path, _OPEN_WRITE_FLAGS, 0o600)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done : done + _MAX_IO_CHUNK])
    finally:
        os.close(fd)


def _read_file(path: str, out: torch.Tensor) -> torch.Tensor:
    view = memoryview(out.numpy()).cast("B")
    fd = os.open(path, _OPEN_READ_FLAGS)
    try:
        done = 0
        while done < len(view):
            got = os.readv(fd, [view[done : done + _MAX_IO_CHUNK]])
            if got == 0:  # an OSError, like every other I/O failure the store turns into OffloadError
                raise OSError(errno.EIO, f"spill file {path} ended after {done} of {len(view)} bytes")
            done += got
    finally:
        os.close(fd)
    return out


def _is_own_dir(path: str) -> bool:
    """``path`` is still a real directory (not a symlink) owned by this process's user."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class SpillDir:
    """A private directory of spill files plus a small pool of I/O threads; created lazily."""

    def __init__(self, parent: Optional[Path], workers: int) -> None:
        self._parent = parent
        self._workers = workers
        self._path: Optional[str] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._finalizer: Optional[weakref.finalize] = None
        self._warned_remove = False
        self.files = 0

    def _ensure_open(self) -> str:
        if self._path is None or not _is_own_dir(self._path):
            # First spill, or the directory was removed under us (a /tmp cleaner, a user): make a
            # fresh private one, so spilling resumes rather than every later tensor staying in memory.
            if self._finalizer is not None:
                self._finalizer.detach()  # nothing of ours is left there to remove
            path = tempfile.mkdtemp(prefix="offload-", dir=None if self._parent is None else str(self._parent))
            os.chmod(path, 0o700)
            if _filesystem_type(Path(path)) == "tmpfs":
                log.warning(
                    "offload spill directory %s is on tmpfs: spilled tensors stay in RAM; "
                    "pass spill_dir= on a real disk to take them out of memory", path,
                )
            self._path = path
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self._workers, thread_name_prefix="offload-spill")
            self._finalizer = weakref.finalize(self, _remove_tree, path)
        return self._path

    @property
    def path(self) -> Optional[str]:
        """The directory, once the first spill made it."""
        return self._path

    def write(self, data: torch.Tensor) -> tuple[str, concurrent.futures.Future]:
        """Start writing a contiguous CPU uint8 tensor; returns (file path, future).

        The caller keeps ``data`` alive until the future is done (See Note: [keep-alive until the copy event]).
        """
        self.files += 1
        try:
            directory = self._ensure_open()
        except OSError as error:
            # No directory to spill into (its parent is full, unwritable or gone): this write fails
            # like any other, so the caller keeps the tensor. The path names nothing that exists.
            error.__traceback__ = None  # its frames (pack, the forward) would hold the graph
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(error)
            return os.path.join(tempfile.gettempdir(), f"offload-{uuid.uuid4().hex}", uuid.uuid4().hex), failed
        path = os.path.join(directory, uuid.uuid4().hex)
        return path, self._executor.submit(_write_file, path, data)

    def read(self, path: str, out: torch.Tensor) -> concurrent.futures.Future:
        """Start reading a whole spill file into the CPU uint8 tensor ``out``; the future yields ``out``."""
        if self._executor is None:  # close() ran: the file is gone; fail like any read would (OSError)
            failed: concurrent.futures.Future = concurrent.futures.Future()
            why = "the spill directory was removed by close(); run backward before closing the engine"
            failed.set_exception(FileNotFoundError(errno.ENOENT, why, path))
            return failed
        return self._executor.submit(_read_file, path, out)

    def remove(self, path: str) -> None:
        """Delete one spill file now (missing is fine: a failed write may never have made it)."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            # The directory turned unwritable (chmod) or the disk is failing. Failing here would
            # fail the step (this runs in pack, unpack and autograd's release) for a file the
            # engine no longer needs: it is left to close(), which removes the whole directory.
            if not self._warned_remove:
                log.warning("offload: removing a spill file failed (%s); it stays until the engine closes", str(error))
                self._warned_remove = True
        self.files -= 1

    def close(self) -> None:
        """Wait for I/O in flight, then remove the directory and everything in it."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._path = None
        self.files = 0
