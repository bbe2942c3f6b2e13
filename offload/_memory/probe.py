"""Measure what moving activation bytes costs on this machine, once, and remember it.

The planner needs three kinds of numbers it must not guess (links differ between machines,
and host->device is often slower than device->host):

    compute device ──d2h──▶ pinned host ──write──▶ spill directory
                   ◀─h2d───             ◀─read───
    + a fixed cost per saved tensor (the saved_tensors_hooks round trip)

How each figure is taken:

- d2h / h2d (CUDA only): one pinned host buffer and one device buffer of ``size_mb``, allocated
  once; one warm-up copy each way; then ``repeats`` copies per direction on a side stream, timed
  with CUDA events; the median wins. 0 on the CPU, where there is no such link.
- disk write / read: ``size_mb`` of random bytes (so a compressing file system cannot flatter
  itself) written to and read back from a spill file in the spill directory exactly as the disk
  tier does it (``spill.SpillFile``: direct I/O where the filesystem allows, else buffered with
  fdatasync and the pages dropped); median of ``repeats``. The page cache cannot flatter either
  figure, which is what the engine sees whether or not the host has memory to spare.
- per-tensor overhead: the fixed cost of moving one saved tensor out and back through the engine
  itself (bookkeeping, events or a spill write and read and two thread hand-offs):
  a forward and backward through a chain of ops that each save one small (64 KiB) tensor on the
  device, under an engine that moves every save and one that only counts, run in ``repeats``
  interleaved pairs; the median of the pairs' differences per tensor, minus the tensor's byte
  time at the measured bandwidths, clamped at 0. The hook
  round trip alone is far smaller on the CPU, where the spill write and read dominate (16.83
  against 854.5 us per tensor on the 2-core Xeon VM of ``bench/results/cpu-xeon-2core.md``, then
  with a spill file per tensor); planning with it made small tensors look free to move.
- spare cores (CPU only): the whole cores this process may run on (its affinity, in physical
  cores on a host with hardware threads, capped by a cgroup CPU quota: ``usable_cores``) less
  torch's intra-op threads, read at the call and never cached. Where some are spare the planner
  lets spill writes and reads run beside the compute; where none are, it charges them to the step.
  The link key (and the plan cache's, which uses it) names the usable cores.

Each figure is a median of several readings, and each section says how spread its readings were
(``_plan.noise.Readings``: the interquartile range over the median). A section whose readings spread
wider than ``_plan.noise.MAX_SPREAD`` is used by the call that measured it but not cached: the next
engine measures again rather than plan for ever on one disturbed reading (``Figures.kept``).

Results are cached in a JSON file (``$XDG_CACHE_HOME/offload/probe.json``, else
``~/.cache/offload/probe.json``) so that a restarted job does not measure again. Link figures are
keyed by host name, device name and torch version; disk figures by host name and the spill
directory's real path. The host name is in both keys because a home directory (and so the cache)
is often shared by the nodes of a cluster whose disks and links are not. The file is replaced
atomically, so concurrent ranks can lose each other's entries but never corrupt the file; a file
that cannot be read or parsed is ignored with a warning. Each entry keeps when it was measured,
and a disk entry how its I/O went (``"direct"`` or ``"buffered, pages dropped"``); a disk entry
without that (written before the probe measured through the spill file) is measured again.
``probe_report`` says, per section, whether its figures were read from the cache or measured now,
and when; ``python -m offload probe`` prints it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from .._budget import cgroups_of
from .._config import Config, parse_device
from .._cost import MB, MachineProfile
from .._plan.noise import MAX_SPREAD, Readings
from .session import Session
from .spill import SpillFile

__all__ = [
    "Figures",
    "ProbeReport",
    "Source",
    "default_cache_path",
    "machine_key",
    "probe",
    "probe_report",
    "spare_cores",
]

log = logging.getLogger(__name__)

_CACHE_FORMAT = 2
"""Version of the cache file layout; a file with another version is ignored."""
_OVERHEAD_NUM_TENSORS = 200
"""Saved tensors per overhead run: at ~0.1-1 ms each, enough to dwarf timer noise, short enough to wait for."""
_OVERHEAD_TENSOR_BYTES = 64 * 1024
"""Bytes per tensor in the overhead run: the engine's default ``min_offload_bytes``, the smallest it moves."""
_BYTES_PER_GB = 1e9
_LINK_FIELDS = ("d2h_gb_per_s", "h2d_gb_per_s", "per_tensor_overhead_us")
_DISK_FIELDS = ("disk_write_gb_per_s", "disk_read_gb_per_s")
_DIRECT_IO = "direct"
_BUFFERED_IO = "buffered, pages dropped"
_DISK_IO_MODES = (_DIRECT_IO, _BUFFERED_IO)
"""How the spill file's I/O went when the disk was measured (``SpillFile.direct``)."""


class Source(enum.Enum):
    """Where a section's figures came from on this call."""

    MEASURED = "measured now"
    CACHED = "cached"


@dataclasses.dataclass(frozen=True)
class Figures:
    """Provenance of one section (link and per-tensor cost, or disk) of a probe's result."""

    source: Source
    measured_at: str
    """When they were measured (ISO 8601, local time with offset); "unknown" for an entry without it."""
    disk_io: str = ""
    """The disk section: "direct" or "buffered, pages dropped", as the spill tier's file went."""
    spread: float = 0.0
    """Measured now: the widest spread (``_plan.noise.Readings.spread``) of the section's readings; 0 for
    figures read from the cache (they were cached because their spread was within bounds)."""
    kept: bool = True
    """Measured now: whether the figures went into the cache (False: their readings spread wider
    than ``_plan.noise.MAX_SPREAD``, so the next call measures again)."""

    def describe(self) -> str:
        """In words, for ``python -m offload probe``."""
        if self.source is Source.CACHED:
            return f"cached, measured {self.measured_at}"
        kept = "cached" if self.kept else f"not cached: wider than {MAX_SPREAD:.0%} of their median"
        return f"measured now ({self.measured_at}); readings spread {self.spread:.0%} ({kept})"


@dataclasses.dataclass(frozen=True)
class ProbeReport:
    """A probe's figures and, per section, where they came from."""

    profile: MachineProfile
    link: Figures
    disk: Figures
    cache_file: Path


def probe(
    device: str | torch.device | None = None,
    *,
    spill_dir: str | os.PathLike[str] | None = None,
    refresh: bool = False,
    cache_path: str | os.PathLike[str] | None = None,
    size_mb: int = 64,
    repeats: int = 5,
) -> MachineProfile:
    """Measure (or read from the cache) the costs of moving activation bytes on this machine.

    The figures of :func:`probe_report`, which also says whether each was cached or measured now.

    Args:
        device: the compute device. ``None`` means ``"cuda"`` when CUDA is available, else
            ``"cpu"``. Link bandwidths are measured only for a CUDA device.
        spill_dir: where the engine will spill to disk; default ``tempfile.gettempdir()``.
            Must be an existing, writable directory.
        refresh: measure again even when the cache holds figures for this machine.
        cache_path: the cache file; default ``$XDG_CACHE_HOME/offload/probe.json`` or
            ``~/.cache/offload/probe.json``.
        size_mb: bytes per transfer, MiB. Larger is steadier and slower to measure.
        repeats: timed runs per figure (the median, or the best for the per-tensor overhead).

    Returns:
        A :class:`MachineProfile`. Disk figures are the spill tier's own: its file written and read
        with direct I/O where the filesystem allows it, else buffered with the pages dropped (see
        the module docstring), so the page cache does not flatter them.

    Raises:
        ValueError: an argument is out of range, the device is not ``cpu`` / ``cuda``, CUDA was
            asked for but is not available, or ``spill_dir`` is not a writable directory.
    """
    return probe_report(
        device, spill_dir=spill_dir, refresh=refresh, cache_path=cache_path, size_mb=size_mb, repeats=repeats
    ).profile


def probe_report(
    device: str | torch.device | None = None,
    *,
    spill_dir: str | os.PathLike[str] | None = None,
    refresh: bool = False,
    cache_path: str | os.PathLike[str] | None = None,
    size_mb: int = 64,
    repeats: int = 5,
) -> ProbeReport:
    """:func:`probe`'s figures, with where each section came from (cached or measured now) and when."""
    if isinstance(size_mb, bool) or not isinstance(size_mb, int) or size_mb <= 0:
        raise ValueError(f"size_mb={size_mb!r}: must be an integer > 0 (MiB per transfer), e.g. 64")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: must be an integer >= 1, e.g. 5")
    device = _resolve_device(device)
    spill_dir = _resolve_spill_dir(spill_dir)
    cache_file = Path(cache_path) if cache_path is not None else default_cache_path()
    nbytes = size_mb * MB

    device_name = _device_name(device)
    host = platform.node()
    cores = usable_cores() if device.type == "cpu" else 0
    link_key = _link_key(device, spill_dir, cores)
    disk_key = f"{host}|{spill_dir}"

    cache = {} if refresh else _read_cache(cache_file)
    link_entry = cache.get("link", {}).get(link_key)
    disk_entry = cache.get("disk", {}).get(disk_key)
    link = _valid_entry(link_entry, _LINK_FIELDS)
    disk = _valid_entry(disk_entry, _DISK_FIELDS)
    if disk is not None and disk_entry.get("disk_io") not in _DISK_IO_MODES:
        log.info("probe: the cached disk figures do not say how their I/O went; measuring the spill file again")
        disk = None
    now = _now()
    disk_figures = (
        Figures(Source.MEASURED, now)
        if disk is None
        else Figures(Source.CACHED, str(disk_entry.get("measured_at", "unknown")), disk_entry["disk_io"])
    )
    link_figures = (
        Figures(Source.MEASURED, now)
        if link is None
        else Figures(Source.CACHED, str(link_entry.get("measured_at", "unknown")))
    )
    measured: dict[tuple[str, str], dict[str, object]] = {}
    if disk is None:
        write, read, direct, disk_spread = _measure_disk(spill_dir, nbytes, repeats)
        disk = {"disk_write_gb_per_s": write, "disk_read_gb_per_s": read}
        disk_io = _DIRECT_IO if direct else _BUFFERED_IO
        disk_figures = dataclasses.replace(
            disk_figures, disk_io=disk_io, spread=disk_spread, kept=disk_spread <= MAX_SPREAD
        )
        if disk_figures.kept:
            measured["disk", disk_key] = {**disk, "disk_io": disk_io}
    if link is None:
        d2h, h2d, link_spread = _measure_link(device, nbytes, repeats) if device.type == "cuda" else (0.0, 0.0, 0.0)
        out_gbps, back_gbps = (
            (d2h, h2d) if device.type == "cuda" else (disk["disk_write_gb_per_s"], disk["disk_read_gb_per_s"])
        )
        overhead_us, overhead_spread = _measure_per_tensor_overhead_us(device, spill_dir, repeats, out_gbps, back_gbps)
        link = {"d2h_gb_per_s": d2h, "h2d_gb_per_s": h2d, "per_tensor_overhead_us": overhead_us}
        spread = max(link_spread, overhead_spread)
        link_figures = dataclasses.replace(link_figures, spread=spread, kept=spread <= MAX_SPREAD)
        if link_figures.kept:
            measured["link", link_key] = dict(link)
    for name, figures in (("disk", disk_figures), ("link and per-tensor", link_figures)):
        if not figures.kept:
            log.warning(
                "probe: the %s readings spread %.0f%% of their median (a busy machine?); using their median now, "
                "not caching it, so the next engine measures again",
                name,
                100 * figures.spread,
            )
    if measured:
        _write_cache(cache_file, measured, size_mb=size_mb, measured_at=now)
    else:
        log.debug("probe: using cached figures from %s", cache_file)

    spare = max(0, cores - torch.get_num_threads()) if device.type == "cpu" else 0
    profile = MachineProfile(device_type=device.type, device_name=device_name, spare_cores=spare, **link, **disk)
    return ProbeReport(profile, link_figures, disk_figures, cache_file)


def spare_cores() -> int:
    """Cores this process may run on beyond torch's intra-op threads, now (``MachineProfile.spare_cores``):
    ``usable_cores()`` less ``torch.get_num_threads()``, read at each call, since
    ``torch.set_num_threads`` may change it at any time."""
    return max(0, usable_cores() - torch.get_num_threads())


def usable_cores(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int:
    """Whole cores this process can run on: its CPU affinity, counted in physical cores where the
    host runs two or more hardware threads per core (torch's default thread count is the physical
    cores: a sibling thread is no free core), and no more than a cgroup CPU quota allows (a
    container limited to 2 CPUs on a 64-CPU host has 2)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    logical, physical = psutil.cpu_count(logical=True), psutil.cpu_count(logical=False)
    if logical and physical and physical < logical:
        cpus = max(1, cpus * physical // logical)
    quota = cpu_quota(proc_cgroup, root)
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def cpu_quota(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the tightest CPU quota of this process's cgroup and its ancestors allows (v2 ``cpu.max``,
    v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``); None where none is set or none can be read."""
    quotas = [_quota_of(group, v2) for group, v2 in cgroups_of("cpu", proc_cgroup, root)]
    set_quotas = [q for q in quotas if q is not None]
    return min(set_quotas) if set_quotas else None


def _quota_of(group: Path, v2: bool) -> float | None:
    try:
        if v2:
            limit, _, period = (group / "cpu.max").read_text().partition(" ")
            return None if limit == "max" else int(limit) / int(period)
        limit_us = int((group / "cpu.cfs_quota_us").read_text())
        return None if limit_us < 0 else limit_us / int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def machine_key(device: str | torch.device | None = None, spill_dir: str | os.PathLike[str] | None = None) -> str:
    """The key the probe's cached link figures are filed under: host, device, torch version,
    spill directory and intra-op threads (``offload._plan.cache`` files plans under it too)."""
    resolved = _resolve_device(device)
    return _link_key(resolved, _resolve_spill_dir(spill_dir), usable_cores() if resolved.type == "cpu" else 0)


def _link_key(device: torch.device, spill_dir: str, cores: int) -> str:
    # The per-tensor overhead is measured through the tier behind the device, which on the CPU is
    # the spill directory: the link key names it too, and the intra-op thread count, since torch's
    # spinning pool competes with the spill threads for the same cores.
    # On the CPU the cores usable too: with the same thread count, a process given more of them
    # has spare ones its spill threads run on, which changes what a plan made here costs.
    host = platform.node()
    threads = torch.get_num_threads()
    key = f"{host}|{device.type}:{_device_name(device)}|torch {torch.__version__}|{spill_dir}|threads {threads}"
    return key + (f"|cores {cores}" if device.type == "cpu" else "")


def default_cache_path() -> Path:
    """``$XDG_CACHE_HOME/offload/probe.json``, else ``~/.cache/offload/probe.json``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says a relative value is invalid and must be ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "offload" / "probe.json"


# ---------------------------------------------------------------------------------------------
# Arguments


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        # is_available() asks the driver for a device count; it does not initialize CUDA.
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = parse_device(device)
    assert resolved is not None  # parse_device keeps only None as None
    if resolved.type == "cuda" and resolved.index is None:  # parse_device checked it is here
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _resolve_spill_dir(spill_dir: str | os.PathLike[str] | None) -> str:
    path = tempfile.gettempdir() if spill_dir is None else os.fspath(spill_dir)
    if not os.path.isdir(path):
        raise ValueError(f"spill_dir={path!r}: not an existing directory; create it or pass another")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"spill_dir={path!r}: not writable by this user; pass a directory you can write to")
    return os.path.realpath(path)


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: fall back to what platform knows
    return platform.processor() or platform.machine() or "cpu"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


# ---------------------------------------------------------------------------------------------
# Measurements


def _measure_link(device: torch.device, nbytes: int, repeats: int) -> tuple[float, float, float]:
    """(d2h, h2d) GB/s between pinned host memory and ``device``, medians of ``repeats`` copies, and
    the wider spread of the two directions' readings."""
    # Pinning is slow and may synchronize the device: allocate once, reuse for every copy.
    x_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    x_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # x_device's memory may still be in use there
    with torch.cuda.device(device), torch.cuda.stream(stream):
        x_host.copy_(x_device, non_blocking=True)  # warm-up: first copies pay for lazy setup
        x_device.copy_(x_host, non_blocking=True)
        stream.synchronize()

        def readings_ms(dst: torch.Tensor, src: torch.Tensor) -> Readings:
            times_ms = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
                end.synchronize()
                times_ms.append(start.elapsed_time(end))
            return Readings(times_ms)

        d2h_ms = readings_ms(x_host, x_device)
        h2d_ms = readings_ms(x_device, x_host)
    d2h, h2d = _gb_per_s(nbytes, d2h_ms.median / 1e3), _gb_per_s(nbytes, h2d_ms.median / 1e3)
    log.info("probe %s: d2h %.2f GB/s, h2d %.2f GB/s (pinned, %d MiB)", device, d2h, h2d, nbytes // MB)
    return d2h, h2d, max(d2h_ms.spread, h2d_ms.spread)


def _measure_disk(spill_dir: str, nbytes: int, repeats: int) -> tuple[float, float, bool, float]:
    """(write, read) GB/s of the spill file in ``spill_dir``, as the disk tier does its I/O: medians of
    ``repeats`` writes and reads of ``nbytes`` random bytes (direct I/O where the filesystem has it,
    else buffered with the pages dropped, so the page cache cannot flatter either figure); whether
    the I/O was direct; and the wider spread of the writes' and the reads' readings."""
    data = torch.from_numpy(np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype=np.uint8).copy())
    back = torch.empty(nbytes, dtype=torch.uint8)
    write_s, read_s = [], []
    spill = SpillFile(Path(spill_dir), workers=1)
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            extent, written = spill.write(data)
            written.wait()
            t1 = time.perf_counter()
            spill.read(extent, back).wait()
            t2 = time.perf_counter()
            spill.free(extent)
            write_s.append(t1 - t0)
            read_s.append(t2 - t1)
        direct = bool(spill.direct)  # written through above, so the file exists
    finally:
        spill.close()
    if not torch.equal(data, back):
        raise OSError(f"probe: the bytes read back from {spill_dir!r} differ from what was written")
    writes, reads = Readings(write_s), Readings(read_s)
    write, read = _gb_per_s(nbytes, writes.median), _gb_per_s(nbytes, reads.median)
    log.info(
        "probe %s: write %.2f GB/s, read %.2f GB/s (%s)",
        spill_dir,
        write,
        read,
        "direct I/O" if direct else "buffered, pages dropped",
    )
    return write, read, direct, max(writes.spread, reads.spread)


def _measure_per_tensor_overhead_us(
    device: torch.device, spill_dir: str, repeats: int, out_gb_per_s: float, back_gb_per_s: float
) -> tuple[float, float]:
    """Fixed cost of moving one saved tensor out and back through the engine, microseconds, >= 0,
    and the spread of the readings it is the median of."""
    x = torch.ones(_OVERHEAD_TENSOR_BYTES // 4, device=device, requires_grad=True)
    # As a region planned OFFLOAD runs: every save starts its copy out at once, nothing waits for
    # a budget, and backward prefetches. That is the cost the planner charges per moved tensor.
    moving = Session(Config.from_user(None, min_offload_bytes=0, spill_dir=spill_dir, device=device))
    counting = Session(Config.from_user(None, min_offload_bytes=0, device=device))

    def chain(session: Session) -> None:
        session.enter()
        try:
            with session.eagerly() if session is moving else contextlib.nullcontext():
                y = x
                for _ in range(_OVERHEAD_NUM_TENSORS):
                    y = y.sin()  # saves its input: one pack in forward, one unpack in backward
                loss = y.sum()
        finally:
            session.exit(None, None, None)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed_s(session: Session) -> float:
        t0 = time.perf_counter()
        chain(session)
        return time.perf_counter() - t0

    byte_s = sum(_OVERHEAD_TENSOR_BYTES / (gbps * _BYTES_PER_GB) for gbps in (out_gb_per_s, back_gb_per_s) if gbps > 0)
    try:
        chain(counting)  # warm-up: the first runs pay for lazy setup (the spill file, threads)
        chain(moving)
        # Interleaved pairs, so a machine whose speed drifts slows both runs of a pair alike.
        pairs = [(timed_s(moving), timed_s(counting)) for _ in range(repeats)]
    finally:
        for session in (moving, counting):
            if session.store is not None:
                session.store.close()
    per_tensor_us = Readings([((m - c) / _OVERHEAD_NUM_TENSORS - byte_s) * 1e6 for m, c in pairs])
    # Its spread is judged against a moved tensor's whole time, not against the difference itself:
    # near zero a difference of two timings spreads without bound, and it is the whole round trip
    # whose readings must agree for the figure to mean anything.
    moved_us = Readings([m / _OVERHEAD_NUM_TENSORS * 1e6 for m, _ in pairs]).median
    return max(0.0, per_tensor_us.median), per_tensor_us.iqr / moved_us


def _gb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / _BYTES_PER_GB


# ---------------------------------------------------------------------------------------------
# Cache


def _read_cache(cache_file: Path) -> dict:
    """The parsed cache, or ``{}`` when it is missing, unreadable or not in our format."""
    try:
        text = cache_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        log.warning("probe: ignoring unreadable cache %s (%s); measuring again", cache_file, e)
        return {}
    try:
        cache = json.loads(text)
    except ValueError as e:
        log.warning("probe: ignoring corrupt cache %s (%s); measuring again", cache_file, e)
        return {}
    if (
        not isinstance(cache, dict)
        or cache.get("format") != _CACHE_FORMAT
        or not isinstance(cache.get("link", {}), dict)
        or not isinstance(cache.get("disk", {}), dict)
    ):
        log.warning("probe: ignoring cache %s: not in format %d; measuring again", cache_file, _CACHE_FORMAT)
        return {}
    return cache


def _valid_entry(entry: object, fields: tuple[str, ...]) -> dict[str, float] | None:
    """The entry's figures, or None when it is missing or any figure is not a finite number >= 0."""
    if not isinstance(entry, dict):
        return None
    figures = {}
    for field in fields:
        value = entry.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            log.warning("probe: ignoring cached entry with %s=%r; measuring again", field, value)
            return None
        figures[field] = float(value)
    return figures


def _write_cache(
    cache_file: Path, measured: dict[tuple[str, str], dict[str, object]], *, size_mb: int, measured_at: str
) -> None:
    """Merge fresh ``(section, key) -> figures`` into the cache file, replacing it atomically.

    A failure to write only warns: the cache saves time, the figures are still right.
    """
    cache = _read_cache(cache_file) or {"format": _CACHE_FORMAT}
    stamp = {"size_mb": size_mb, "measured_at": measured_at}
    for (section, key), figures in measured.items():
        cache.setdefault(section, {})[key] = {**figures, **stamp}
    tmp_path = None
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_path = tempfile.mkstemp(prefix=".probe-", suffix=".json", dir=cache_file.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(cache, f, indent=2, sort_keys=True)
        os.replace(tmp_path, cache_file)  # readers see the old file or the new, never half of one
        tmp_path = None
    except OSError as e:
        log.warning("probe: could not write cache %s (%s); the next run will measure again", cache_file, e)
    finally:
        if tmp_path is not None:
            try:
                os.unlink(tmp_path)
            except OSError:
                pass
