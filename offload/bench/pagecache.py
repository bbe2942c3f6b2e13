"""How many bytes of a set of files sit in the kernel's page cache right now (Linux ``mincore``).

A file's pages stay in the page cache after a buffered write (dirty until written back, clean until
the kernel needs the memory), and a container's memory limit counts them. So "the spill tier took
these bytes out of RAM" is only true when the spill files' pages are not cached. This module is
the measurement, shared by the disk tier's tests and the benchmarks' memory column.

Each file is mapped read-only (``mmap`` does not read it), ``mincore`` reports one byte per page
whose low bit says "resident", and the mapping is dropped. Unsupported platforms report None.

The engine's spill file has no name once open (``offload._memory.spill``, Note: [the spill file
has no name]), so a directory's files include those this process holds open there without a name,
found through ``/proc/self/fd`` and read through a duplicate of the descriptor, never by a path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from collections.abc import Iterable
from typing import Optional

__all__ = ["cached_bytes", "cached_bytes_under"]

_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux"):
        return None
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return lib


def _file_cached_bytes(lib: ctypes.CDLL, path: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return 0  # removed meanwhile (the engine frees files as backward goes), or unreadable
    return _fd_cached_bytes(lib, fd)


def _open_unlinked_cached_bytes(lib: ctypes.CDLL, fd: int) -> int:
    try:
        own = os.dup(fd)  # a descriptor of our own: the engine may close its one meanwhile
    except OSError:
        return 0
    return _fd_cached_bytes(lib, own)


def _fd_cached_bytes(lib: ctypes.CDLL, fd: int) -> int:
    """Page-cache-resident bytes of the file open as ``fd``, which this closes."""
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = lib.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            return 0
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if lib.mincore(addr, size, vec) != 0:
                return 0
            resident = sum(1 for b in vec if b & 1)
        finally:
            lib.munmap(addr, size)
    finally:
        os.close(fd)
    return min(resident * mmap.PAGESIZE, size)


def cached_bytes(paths: Iterable[str]) -> Optional[int]:
    """Page-cache-resident bytes of these files (missing files count 0); None off Linux."""
    lib = _libc()
    if lib is None:
        return None
    return sum(_file_cached_bytes(lib, p) for p in paths)


def cached_bytes_under(directory: str) -> Optional[int]:
    """Page-cache-resident bytes of every regular file under ``directory`` (0 if it is gone), and of
    every file this process holds open there without a name (the spill file); None off Linux."""
    lib = _libc()
    if lib is None:
        return None
    paths: list[str] = []
    for root, _dirs, files in os.walk(directory):
        paths.extend(os.path.join(root, name) for name in files)
    named = sum(_file_cached_bytes(lib, p) for p in paths)
    return named + sum(_open_unlinked_cached_bytes(lib, fd) for fd in _open_unlinked_under(directory))


def _open_unlinked_under(directory: str) -> list[int]:
    """This process's descriptors of files made under ``directory`` and unlinked since."""
    prefix = os.path.realpath(directory) + os.sep  # as the kernel names it: symlinks resolved
    found = []
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor among them)
        if target.startswith(prefix) and target.endswith(" (deleted)"):
            found.append(int(entry))
    return found
