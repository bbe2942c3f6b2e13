"""A stand-in for the machine the engine runs on (``offload.seams.Host``): faults on demand, and a
record of the engine's calls there.

Passed as ``offload.engine(host=...)``, it sees every call the engine's host tier and spill file
make to the operating system and nothing else of the process, so pytest's own I/O is untouched.
Each fault is a field a test sets and clears while the engine runs:

- the disk: ``writes_ok`` (whole ``pwrite`` calls that succeed before ENOSPC; ``partial``: the
  failing one lands half its bytes first), ``open_error`` (errno for creating the spill file),
  ``read_error`` (errno for every read);
- host memory: ``pins_ok`` (slabs that may still be allocated before pinning is refused, as at
  the locked-memory limit), ``ram_reading`` (what free RAM reads, given the real reading);
- ``before_write``: called with each ``pwrite``'s index (from 0, in the order the spill
  threads reach it, which two threads may swap) and its file offset (the spill file's extents
  are taken in eviction order, so the offset names the tensor) before it runs; it may wait for
  the test or raise (a write that fails late);
- and a record: ``writes`` / ``opens`` / ``reads`` / ``pin_tries``, the paths it was asked to
  create, the slabs it handed out (weakly), and every spill write's job (``landed()`` waits for
  them).

A write is counted per ``pwrite``: the spill file writes a tensor in chunks of 8 MiB, so one
``pwrite`` is one tensor's write only for tensors of 8 MiB or less, as every test's here are. The
open that creates the spill file may come twice (``O_DIRECT`` refused with EINVAL, then buffered),
to one path (``created``).
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import threading
import weakref
from typing import Callable, Optional

import torch

from offload.seams import Host, Jobs


class _RecordedJobs:
    """The host's jobs, keeping each spill write's future (a job that reads a tensor writes the file)."""

    def __init__(self, inner: Jobs, writes: list) -> None:
        self._inner, self._writes = inner, writes

    def submit(self, run, *, reads, writes) -> concurrent.futures.Future:
        future = self._inner.submit(run, reads=reads, writes=writes)
        if reads is not None:
            self._writes.append(future)
        return future

    def shutdown(self) -> None:
        self._inner.shutdown()


class StandInHost(Host):
    """This machine, with the faults a test sets (See the module docstring)."""

    def __init__(self, base: Optional[Host] = None) -> None:
        self.base = base
        """The host this one stands over for where spill jobs run and pageable memory (an
        emulator's, which runs the jobs on its schedule); None: this machine."""
        self.writes_ok: Optional[int] = None
        """Whole writes (``pwrite`` calls) that succeed before the disk is full; None: it never fills."""
        self.partial = False
        """The failing write first lands half its bytes (a short ``pwrite``), then ENOSPC for the rest."""
        self.open_error: Optional[int] = None
        """errno for creating the spill file (EACCES: an unwritable directory)."""
        self.read_error: Optional[int] = None
        """errno for every read (EIO)."""
        self.pins_ok: Optional[int] = None
        """Slab allocations that may still succeed; None: no limit."""
        self.before_write: Optional[Callable[[int, int], None]] = None
        """Called with each write's index and file offset before it runs (it may wait, or raise an ``OSError``)."""
        self.ram_reading: Optional[Callable[[int, int], tuple[int, int]]] = None
        """(available, total) from the real reading; None: the real reading."""
        self.writes = self.opens = self.reads = self.failed_reads = self.pin_tries = 0
        self.created: set[str] = set()
        """Paths the engine tried to create (a retry without O_DIRECT reuses its path)."""
        self.slabs: weakref.WeakSet = weakref.WeakSet()
        """Slabs handed to the arena and still alive."""
        self.write_jobs: list[concurrent.futures.Future] = []
        self._lock = threading.Lock()
        self._short = threading.local()  # this worker's last pwrite landed short on purpose

    # ------------------------------------------------------------------ the disk

    def pwrite(self, fd, data, offset):
        if getattr(self._short, "pending", False):  # the rest of a write that landed short
            self._short.pending = False
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with self._lock:
            n, self.writes = self.writes, self.writes + 1
        if self.before_write is not None:
            self.before_write(n, offset)
        if self.writes_ok is not None and n >= self.writes_ok:
            if self.partial and len(data) > 1:
                self._short.pending = True
                return super().pwrite(fd, data[: len(data) // 2], offset)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwrite(fd, data, offset)

    def open(self, path, flags, mode):
        with self._lock:
            self.opens += 1
            self.created.add(path)
        if self.open_error is not None:
            raise OSError(self.open_error, os.strerror(self.open_error), path)
        return super().open(path, flags, mode)

    def preadv(self, fd, buffers, offset):
        with self._lock:
            self.reads += 1
            if self.read_error is not None:
                self.failed_reads += 1
        if self.read_error is not None:
            raise OSError(self.read_error, os.strerror(self.read_error))
        return super().preadv(fd, buffers, offset)

    def jobs(self, workers: int) -> Jobs:
        inner = super().jobs(workers) if self.base is None else self.base.jobs(workers)
        return _RecordedJobs(inner, self.write_jobs)

    def pageable(self, nbytes: int) -> torch.Tensor:
        return super().pageable(nbytes) if self.base is None else self.base.pageable(nbytes)

    @property
    def writes_started(self) -> int:
        return len(self.write_jobs)

    def landed(self) -> int:
        """Wait for every spill write started so far; returns how many there were. Reading
        ``eng.stats`` settles nothing, and a test that edits the spill file must not race a write
        still in flight (a late write would extend a truncated file again)."""
        started = list(self.write_jobs)
        for future in started:
            try:
                future.result()
            except OSError:
                pass  # a failed write: the store handles it
        return len(started)

    # ------------------------------------------------------------------ host memory

    def allocate(self, nbytes: int, pin: bool) -> torch.Tensor:
        self.pin_tries += 1
        if self.pins_ok is not None:
            if self.pins_ok <= 0:
                raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
            self.pins_ok -= 1
        slab = super().allocate(nbytes, pin)
        self.slabs.add(slab)
        return slab

    @property
    def held_bytes(self) -> int:
        """Bytes of the slabs handed out and still alive."""
        return sum(t.numel() for t in list(self.slabs))

    def ram(self) -> tuple[int, int]:
        available, total = super().ram()
        return (available, total) if self.ram_reading is None else self.ram_reading(available, total)
