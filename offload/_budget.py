"""A budget that follows free memory (``budget_mb="auto"``): the reading, its rule, and re-planning.

With a fixed ``budget_mb`` the user guesses how much of the device the activations may take.
With ``"auto"`` the engine asks the device instead, and keeps at least ``reserve_mb`` free:

    budget in force = resident + free - reserve        (never below 0)

``resident`` is what the engine holds on the device now and ``free`` what the device could
still hand out. Both are taken at the same instant, so what the engine itself saves or frees
between two readings changes neither side of the sum: a saved tensor is already allocated (not
free) when it reaches the store, and an evicted one goes back to free as it leaves resident.
What moves the budget is everything else on the device: a longer batch's temporaries, the
optimizer's state, another process. So short batches keep everything hot, and a spike moves
just enough to give the reserve back.

When it is read (a reading is a system call: ``cudaMemGetInfo`` or ``/proc/meminfo``)::

    engine entered (step start)  ─▶ read
    pack of a new storage        ─▶ read if REREAD_BYTES packed since the last reading,
                                    or REREAD_MS passed (``time.monotonic``, a vDSO call, no syscall)
    unpack that loads a copy     ─▶ the same rule, counting the bytes loaded

so a step that saves thousands of small tensors reads a handful of times, and a step of a few
huge ones reads about once per tensor (then each tensor's own cost dwarfs the reading).

What "free" is: on CUDA ``torch.cuda.mem_get_info(device)[0]`` (free to the driver) plus what
the caching allocator holds unused (reserved - allocated, from one ``memory_stats`` call), which
PyTorch hands out without asking the driver; on the CPU ``psutil.virtual_memory().available``,
or less where the process's memory cgroup (a container's limit, v1 or v2) leaves less: its
limit minus its usage, the usage less the inactive file cache the kernel reclaims first (what
the kubelet calls the working set). A container on a large host would otherwise see the host's
free memory, keep everything hot, and be OOM-killed at its own limit.

Regions plan against the budget in force when they plan; a plan made for a budget the reading
has since left by more than the hysteresis band (``replan_needed``) is made again from the same
measurements, with no new profiling step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Callable, Optional, Union

import psutil
import torch

from ._cost import MB

__all__ = [
    "DEFAULT_RESERVE_MB",
    "Budget",
    "FollowFree",
    "FreeMemory",
    "default_free_memory",
    "device_free_bytes",
    "make_budget",
    "cgroups_of",
    "memory_cgroups",
    "replan_needed",
]

DEFAULT_RESERVE_MB = 2048
"""MB kept free on the device with ``budget_mb="auto"`` when ``reserve_mb`` is not given.

The reading counts the caching allocator's unused blocks as free, but a fragmented cache cannot
always serve one large request from them; cuBLAS keeps a workspace per handle and stream (up
to tens of MB each), NCCL allocates its channel buffers lazily on the first collective (hundreds
of MB with many peers), and backward allocates what the engine never sees: the gradients of the
largest layer, an LM head's logits and their gradient (batch x sequence x vocabulary x 4 bytes:
1 GB for 8 x 4096 x 32000 in fp32). 2 GiB covers those for the common 7B-class shapes on one
GPU; raise it for long contexts or large vocabularies, lower it on small devices."""

REREAD_BYTES = 64 * MB
"""Bytes of new saves (or loads) after which free memory is read again within a step."""
REREAD_MS = 10.0
"""Milliseconds after which free memory is read again on the next pack or load, whatever was
saved: at most ~100 readings a second, so a reading (one system call) stays a small share of a
step however many tensors it saves (figures: ``bench/results/store-split-cpu.md``)."""

INFLIGHT_FRACTION = 0.25
"""Share of a fixed budget reserved for copies in flight. Eviction starts when hot bytes pass
(1 - this) x budget, so copies drain while compute goes on; pack blocks only at the full budget.
Not while a region plan is in force (``Budget.set_planned``): the plan already keeps its regions
within the budget and starts the copies of its offloaded regions at once, so early eviction
would only move tensors the plan keeps. A budget that follows free memory has its own window
(``INFLIGHT_FRACTION_OF_RESERVE``)."""

INFLIGHT_FRACTION_OF_RESERVE = 0.25
"""Eviction starts this fraction of the reserve before the budget in force (free memory below
1.25 x reserve), so copies drain while compute goes on; pack waits for them only at the budget
itself. A fixed budget's window is a fraction of the budget instead (``INFLIGHT_FRACTION``); here the
budget is most of the device, and a quarter of it would move far more than the spike needs."""

BATCH_SHARE_OF_WINDOW = 0.5
"""Share of the in-flight window (``INFLIGHT_FRACTION``, ``INFLIGHT_FRACTION_OF_RESERVE``) that hot
bytes may pass ``evict_at`` by before eviction starts: then everything over ``evict_at`` leaves
together, one batch (See Note: [moves in batches] in ``offload._memory.store``). Half: the other
half stays for copies in flight before a pack has to wait for them."""

REPLAN_BELOW = 0.8
"""A plan is made again when the budget in force falls below this fraction of its budget..."""
REPLAN_ABOVE = 1.25
"""...or rises above this multiple of it (and by at least ``REPLAN_MIN_GAIN_BYTES``): the gap
between the two is the hysteresis that keeps a budget wavering around one value from re-planning
every step."""
REPLAN_MIN_GAIN_BYTES = 16 * MB
"""A rise smaller than this never re-plans (a plan made at budget 0 would otherwise re-plan at
any byte of room)."""


def device_free_bytes(device: torch.device, cgroups: tuple[Path, ...] = ()) -> int:
    """Bytes the compute device could still hand out now (see the module docstring); on the CPU,
    no more than the memory cgroups in ``cgroups`` (``memory_cgroups()``) leave."""
    if device.type == "cuda":
        free_driver, _ = torch.cuda.mem_get_info(device)
        stats = torch.cuda.memory_stats(device)  # one snapshot: memory_reserved and _allocated each take one
        cached_unused = stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
        return int(free_driver + max(0, cached_unused))
    free = int(psutil.virtual_memory().available)
    for group in cgroups:
        left = _cgroup_left(group)
        if left is not None:
            free = min(free, left)
    return free


_CGROUP_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything above this is no limit."""


def cgroups_of(
    controller: str, proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = _CGROUP_ROOT
) -> tuple[tuple[Path, bool], ...]:
    """(directory, is v2) of this process's cgroup and each ancestor, for ``controller`` ("memory",
    "cpu"): the v2 hierarchy, and v1's mount of that controller; () where there is none (not Linux)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return ()
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: "0::/path"
            base, v2 = root, True
        elif controller in controllers.split(","):  # v1: "4:memory:/path", "3:cpu,cpuacct:/path"
            base, v2 = root / ("memory" if controller == "memory" else controllers), False
        else:
            continue
        here = base / path.lstrip("/")
        if not here.is_dir():  # a cgroup namespace mounts the process's own group at the root
            here = base
        while True:
            found.append((here, v2))
            if here == base:
                break
            here = here.parent
    return tuple(found)


def memory_cgroups(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = _CGROUP_ROOT) -> tuple[Path, ...]:
    """The directories of this process's memory cgroup and its ancestors (v2, or v1's memory
    controller), each of which may set a limit; () where there are none (not Linux)."""
    found = [d for d, _ in cgroups_of("memory", proc_cgroup, root)]
    return tuple(d for d in found if (d / "memory.max").exists() or (d / "memory.limit_in_bytes").exists())


def _cgroup_left(group: Path) -> Optional[int]:
    """Bytes the cgroup ``group`` still allows (limit - working set); None: no limit, or unreadable."""
    v2 = (group / "memory.max").exists()
    try:
        limit_text = (group / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
            return None
        usage = int((group / ("memory.current" if v2 else "memory.usage_in_bytes")).read_text())
        inactive_key = "inactive_file" if v2 else "total_inactive_file"
        inactive = 0
        for line in (group / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
                break
    except (OSError, ValueError):
        return None
    return max(0, int(limit_text) - max(0, usage - inactive))


def default_free_memory(device: torch.device) -> "FreeMemory":
    """The engine's own reading for ``device``: the memory cgroups are found once, here."""
    cgroups = memory_cgroups() if device.type == "cpu" and os.name == "posix" else ()
    return FreeMemory(read=lambda: device_free_bytes(device, cgroups))


@dataclasses.dataclass(frozen=True)
class FreeMemory:
    """How an engine reads free memory: ``engine(budget_mb="auto", memory=...)``.

    ``read() -> int`` returns the bytes free on the compute device. A plain callable passed as
    ``memory=`` gets the default rule; tests pass ``reread_bytes=0`` to read on every pack.
    """

    read: Callable[[], int]
    reread_bytes: int = REREAD_BYTES
    reread_ms: float = REREAD_MS

    @classmethod
    def from_user(cls, memory: Union["FreeMemory", Callable[[], int], None]) -> Optional["FreeMemory"]:
        if memory is None or isinstance(memory, FreeMemory):
            return memory
        if not callable(memory):
            raise TypeError(
                f"memory= must be a callable returning the free bytes of the compute device "
                f"(or an offload._budget.FreeMemory), got {memory!r}"
            )
        return cls(read=memory)


class FollowFree:
    """How one store's budget follows free memory: when to read it, and what a reading makes of
    it (the rule above). The budget itself is held by ``Budget``."""

    def __init__(self, reserve_bytes: int, memory: Optional[FreeMemory]) -> None:
        self.reserve_bytes = reserve_bytes
        self.memory = memory
        """How free memory is read; None until ``bind`` gives the device's own reading."""
        self.readings = 0
        """How many times free memory was read (for tests and the cost figure)."""
        self._since_bytes = 0
        self._read_at = -math.inf

    def evict_at(self, budget_bytes: int) -> int:
        """Hot bytes above which eviction starts under ``budget_bytes`` (``INFLIGHT_FRACTION_OF_RESERVE``)."""
        return max(0, budget_bytes - int(self.reserve_bytes * INFLIGHT_FRACTION_OF_RESERVE))

    def bind(self, device: torch.device) -> None:
        """The device this budget is for (known at the first save): its own reading, unless one was given."""
        if self.memory is None:
            self.memory = default_free_memory(device)

    def _memory(self) -> FreeMemory:
        if self.memory is None:
            raise RuntimeError("offload internal error: free memory read before the budget knew its device")
        return self.memory

    def read(self, resident_bytes: int) -> int:
        """Read free memory now; returns the new budget in force."""
        free = self._memory().read()
        if isinstance(free, bool) or not isinstance(free, int) or free < 0:
            raise TypeError(f"offload: the free-memory reading returned {free!r}; it must return an int >= 0 (bytes)")
        self.readings += 1
        self._since_bytes = 0
        self._read_at = time.monotonic()
        return max(0, resident_bytes + free - self.reserve_bytes)

    def due(self, nbytes: int) -> bool:
        """Count ``nbytes`` of new saves or loads; True when free memory is to be read again."""
        self._since_bytes += nbytes
        memory = self._memory()
        if self._since_bytes >= memory.reread_bytes:
            return True
        return (time.monotonic() - self._read_at) * 1e3 >= memory.reread_ms


class Budget:
    """The budget in force for one engine and the hot bytes at which eviction starts: the one owner
    of both, and of whether a region plan is in force. Made once per engine (``make_budget``), in
    one of three kinds: none (only count), fixed (``budget_mb``) or following free memory
    (``budget_mb="auto"``). ``Config.budget_bytes`` is what the user asked for; this is what holds
    now (with "auto", the latest reading); the store, the engine's stats and the regions read it."""

    __slots__ = ("bytes", "evict_at", "batch_bytes", "follows_free_memory", "planned", "_follow")

    def __init__(self, budget_bytes: Optional[int], follow: Optional[FollowFree]) -> None:
        self.bytes = budget_bytes
        """The budget in force, bytes (None: no limit)."""
        self.evict_at: Optional[int] = None
        """Hot plus loaded bytes above which eviction starts; None exactly when ``bytes`` is."""
        self.batch_bytes = 0
        """How far hot plus loaded bytes may pass ``evict_at`` before eviction starts, so what
        leaves, leaves in one batch (``BATCH_SHARE_OF_WINDOW``); 0 without an in-flight window (no
        budget, or a region plan in force: eviction then starts at the budget itself)."""
        self.follows_free_memory = follow is not None
        """The kind "follows free memory" (``budget_mb="auto"``): ``bytes`` moves with each reading."""
        self._follow = follow
        self.planned = False
        """A region plan is in force (``set_planned``): the one flag the engine keeps of it."""
        self.set_planned(False)

    def bind(self, device: torch.device) -> None:
        """The device the budget is for, known at the first save (a budget that follows free memory
        reads that device's, unless it was given a reading)."""
        if self._follow is not None:
            self._follow.bind(device)

    @property
    def readings(self) -> int:
        """How often free memory was read (0 with a fixed budget)."""
        return 0 if self._follow is None else self._follow.readings

    def set_planned(self, planned: bool) -> None:
        """Evict at the full budget (a region plan is in force) or keep the in-flight window."""
        self.planned = planned
        if self.bytes is None:
            return
        if planned:
            self.evict_at = self.bytes
        elif self._follow is not None:
            self.evict_at = self._follow.evict_at(self.bytes)
        else:
            self.evict_at = int(self.bytes * (1 - INFLIGHT_FRACTION))
        self.batch_bytes = int((self.bytes - self.evict_at) * BATCH_SHARE_OF_WINDOW)

    def read(self, resident_bytes: int) -> None:
        """Read free memory now (budget_mb="auto" only)."""
        assert self._follow is not None  # called only when follows_free_memory
        self.bytes = self._follow.read(resident_bytes)
        self.set_planned(self.planned)

    def due(self, nbytes: int) -> bool:
        """Count ``nbytes`` saved or loaded; True when free memory is to be read (never when fixed)."""
        return self._follow is not None and self._follow.due(nbytes)


def make_budget(budget_bytes: Optional[int], reserve_bytes: Optional[int], memory: Optional[FreeMemory]) -> Budget:
    """The one budget of an engine: none (``budget_bytes`` None, no reserve), fixed, or following
    free memory (``reserve_bytes`` set; ``memory`` None: the device's own reading, bound later)."""
    follow = None if reserve_bytes is None else FollowFree(reserve_bytes, memory)
    return Budget(budget_bytes, follow)


def replan_needed(planned_bytes: Optional[int], now_bytes: Optional[int]) -> bool:
    """True when a plan made for ``planned_bytes`` should be made again at ``now_bytes``."""
    if planned_bytes is None or now_bytes is None:
        return planned_bytes != now_bytes
    if now_bytes < planned_bytes * REPLAN_BELOW:
        return True
    return now_bytes > planned_bytes * REPLAN_ABOVE and now_bytes - planned_bytes >= REPLAN_MIN_GAIN_BYTES
