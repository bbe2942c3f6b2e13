"""What the engine asks of the machine outside its device: host memory for the host tier, and the
filesystem calls and I/O threads of the disk tier's spill file.

``offload.engine(host=...)`` takes one (public as ``offload.seams.Host``); the default is this
machine. What the arena (``arena``) and the spill file (``spill``) ask of the machine while a step
runs goes through it, and nothing else of the process does, so a stand-in sees exactly the
engine's traffic there and pytest's own I/O is untouched:

    HostArena ── allocate / pageable / ram / ram_reserve / return_pinned ──▶ Host ──▶ torch (pinned), psutil
    SpillFile ── make_directory / file_name / filesystem_type / open / no_readahead
                 / pwrite / preadv / sync / drop_cache / jobs ──▶ Host ──▶ os, psutil

Not through it: the spill file's clean-up (``chmod`` of the new directory, the unlink of the
file and of its directory once it is open, making a missing ``spill_dir``'s parents, and at close
the file's truncate and close), which also runs from a finalizer at interpreter exit, so a
stand-in's open must return a real descriptor of a real file at that path, and its
``make_directory`` a real directory; and ``PinnedSlabs.clear``, which belongs
to no engine. A stand-in that fails those uses the OS itself (a read-only directory).

A stand-in subclasses ``Host``, overrides the calls it changes and calls ``super()`` for the real
ones: a disk that fills after N writes, a driver that refuses to pin, RAM that runs low, a name an
attacker predicted. It must keep each call's contract (the docstrings below); the engine's answer
to a failure is the same whichever layer raised it. A host given to the engine replaces the one
a link may carry (an emulator's, whose spill jobs run on its schedule): a stand-in meant to run
over an emulator delegates ``jobs`` and ``pageable`` to it (``tests/hosts.py``'s ``base``).
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Optional, Protocol, Sequence

import psutil
import torch

__all__ = ["HOST_RESERVE_FRACTION", "HOST_RESERVE_MIN_BYTES", "Host", "Jobs", "WorkerThreads", "empty_host_cache"]

HOST_RESERVE_FRACTION = 0.10
"""Share of total RAM the host tier always leaves free for the rest of the process and the OS."""
HOST_RESERVE_MIN_BYTES = 2 << 30
"""Floor of that reserve: at least 2 GiB stay free, whatever the machine."""


def empty_host_cache() -> None:
    """Give the caching host allocator's idle pinned blocks back to the OS (where torch can)."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None
    )
    if empty is not None:
        empty()


class Jobs(Protocol):
    """Where the spill file's writes and reads run. ``submit`` starts ``run`` (it raises the
    ``OSError`` of a failed write or read) and returns its future; ``reads`` / ``writes`` name the
    memory the job reads (a write's source) or writes (a read's destination)."""

    def submit(
        self, run: Callable[[], object], *, reads: Optional[torch.Tensor], writes: Optional[torch.Tensor]
    ) -> concurrent.futures.Future: ...

    def shutdown(self) -> None:
        """Wait for every job submitted (the spill file is closing)."""


class WorkerThreads:
    """``Jobs`` on a pool of worker threads, started with the first job."""

    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def submit(
        self, run: Callable[[], object], *, reads: Optional[torch.Tensor], writes: Optional[torch.Tensor]
    ) -> concurrent.futures.Future:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(self._workers, thread_name_prefix="offload-spill")
        return self._executor.submit(run)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class Host:
    """This machine, as the engine's host tier and spill file use it. Subclass to stand in for one."""

    direct_io: bool = True
    """Whether the spill file is opened with ``O_DIRECT`` where the filesystem allows it (False:
    buffered, each write synced and dropped from the page cache)."""

    # ------------------------------------------------------------------ host memory

    def allocate(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A new uint8 host tensor of ``nbytes`` for the arena's slabs, pinned when ``pin``. Raises
        ``RuntimeError`` where pinning is refused (a locked-memory limit, the driver)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def pageable(self, nbytes: int) -> torch.Tensor:
        """A new uint8 host tensor of ``nbytes`` that is not pinned: the host tier's destination for
        a read back from disk when its pinned arena is full."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def ram(self) -> tuple[int, int]:
        """(available, total) bytes of host RAM now."""
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    def ram_reserve(self, total: int) -> int:
        """Bytes of RAM the host tier never takes, of ``total``: 10 %, at least 2 GiB."""
        return max(int(total * HOST_RESERVE_FRACTION), HOST_RESERVE_MIN_BYTES)

    def return_pinned(self) -> None:
        """Give the pinned pages of slabs the arena dropped back to the OS. Synchronizes the device."""
        empty_host_cache()

    # ------------------------------------------------------------------ the spill file

    def make_directory(self, parent: Optional[str]) -> str:
        """Make a new private (0700) directory inside ``parent`` (None: the system's temporary
        directory), named ``offload-`` and a random suffix; returns its path."""
        return tempfile.mkdtemp(prefix="offload-", dir=parent)

    def file_name(self) -> str:
        """A name for the spill file that says nothing and cannot be guessed."""
        return uuid.uuid4().hex

    def filesystem_type(self, path: Path) -> str:
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

    def open(self, path: str, flags: int, mode: int) -> int:
        """``os.open``: the spill file is created once, with ``O_CREAT | O_EXCL`` (and ``O_DIRECT``
        first, then without it where the filesystem answers EINVAL)."""
        return os.open(path, flags, mode)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        """``os.pwrite``: bytes written, which may be fewer than asked (the caller writes the rest)."""
        return os.pwrite(fd, data, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        """``os.preadv``: bytes read, 0 at the end of the file."""
        return os.preadv(fd, buffers, offset)

    def sync(self, fd: int) -> None:
        """Make written data durable before its pages are dropped (buffered files only)."""
        os.fdatasync(fd)

    def drop_cache(self, fd: int, offset: int, length: int) -> None:
        """Drop a range of a buffered file from the page cache."""
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def no_readahead(self, fd: int) -> None:
        """Turn readahead off for a buffered file: it would cache pages nobody asked for."""
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    def jobs(self, workers: int) -> Jobs:
        """Where the spill file's writes and reads run: ``workers`` threads, started with the first."""
        return WorkerThreads(workers)
