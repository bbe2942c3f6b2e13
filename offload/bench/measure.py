"""How the benchmarks measure (memory, time, the machine) and write what they measured, so each
figure means one thing in ``offload.bench`` and ``bench/`` alike: ``Memory`` (peak of a window),
``sync``, ``window`` and ``timed`` (synchronize before reading the clock; interleave the variants
compared), ``environment`` (what a committed result must name), ``table`` and ``records_table``
(the one table printer), ``write_text`` / ``write_json`` (whole or not at all), and where they
go: ``out_dir()`` (``$OFFLOAD_BENCH_OUT``, else ``out/bench``), never into the committed
``bench/results/`` unless a script's ``--overwrite-results`` says so (``check_out``).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import operator
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import torch

import offload
from offload._memory.probe import cpu_model
from offload.bench.pagecache import cached_bytes_under

__all__ = ["THREADS_ENV", "Column", "Memory", "describe_machine", "environment", "median", "paired_median"]
__all__ += ["OUT_ENV", "RESULTS_DIR", "check_out", "out_dir", "records_table"]
__all__ += ["resolve_device", "set_threads", "sync", "table", "timed", "window", "write_json", "write_text"]

THREADS_ENV = "OFFLOAD_BENCH_THREADS"  # torch intra-op threads of bench/'s scripts (default: torch's choice)
OUT_ENV = "OFFLOAD_BENCH_OUT"
"""The directory every benchmark writes under when given no path (default ``DEFAULT_OUT``)."""
DEFAULT_OUT = Path("out") / "bench"
"""Relative to the working directory; ``out/`` is not committed."""
RESULTS_DIR = Path(offload.__file__).resolve().parents[1] / "bench" / "results"
"""The committed results of a checkout: written only when a run is asked to (``check_out``)."""


def out_dir() -> Path:
    """Where a benchmark writes when given no path: ``$OFFLOAD_BENCH_OUT``, else ``out/bench``."""
    return Path(os.environ.get(OUT_ENV) or DEFAULT_OUT)


def check_out(path: Union[str, os.PathLike], overwrite_results: bool = False) -> Path:
    """``path`` (a file or directory to write), refused with ``ValueError`` when it lies in the
    committed ``bench/results/`` and ``overwrite_results`` is False: a benchmark run must not
    replace a committed figure by accident."""
    path = Path(path)
    resolved = path.resolve()
    if not overwrite_results and (resolved == RESULTS_DIR or RESULTS_DIR in resolved.parents):
        raise ValueError(
            f"{str(path)!r} is in the committed results ({RESULTS_DIR}); write under {DEFAULT_OUT}/ "
            f"(or ${OUT_ENV}), or pass --overwrite-results to replace committed results on purpose"
        )
    return path


def sync(device: torch.device) -> None:
    if device.type == "cuda":  # the host clock then reads real time
        torch.cuda.synchronize(device)


def resolve_device(name: Optional[str]) -> torch.device:
    """The device ``name`` (None: cuda when available, else cpu), with its index when it is CUDA
    (tensors report ``cuda:0``, and an engine given a bare ``cuda`` compares device objects)."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} asked for, but torch.cuda.is_available() is False here; use cpu")
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def set_threads(threads: Optional[int]) -> None:
    """Pin torch's intra-op threads (None: ``$OFFLOAD_BENCH_THREADS`` or torch's default). On a
    shared machine 1 thread avoids OpenMP spin-waits against other processes."""
    chosen = threads or int(os.environ.get(THREADS_ENV) or 0)
    if chosen:
        torch.set_num_threads(chosen)


def median(values: Iterable[Optional[float]]) -> Optional[float]:
    return statistics.median(values) if (values := [v for v in values if v is not None]) else None


def paired_median(
    after: Sequence[float], before: Sequence[float], compare: Callable[[float, float], float] = operator.sub
) -> Optional[float]:
    """Median over rounds of ``compare(after_i, before_i)``: the two ran back to back, so drift between
    rounds cancels. The noise-free check beside it is min - min: noise only ever adds time."""
    return median([compare(a, b) for a, b in zip(after, before, strict=True)])


class Memory:
    """Memory in use and its peak since ``reset``, on one device. CUDA: allocated bytes (the caching
    allocator's reserve not counted). CPU: the resident set and its high-water mark (``VmHWM``, reset
    through ``/proc/self/clear_refs`` after ``malloc_trim``; elsewhere ``ru_maxrss``, which never goes
    down), plus the page cache of the files under ``spill_dir`` as ``sample_cache`` last saw it: a
    byte parked in the spill files' page cache is still RAM, so no configuration looks better by it.
    ``sample_ms`` is the time ``sample_cache`` took since ``reset``, for a timed window to leave out.
    """

    def __init__(self, device: torch.device, spill_dir: Optional[str] = None) -> None:
        self.device, self.spill_dir, self.cache_peak, self.sample_ms = device, spill_dir, 0, 0.0
        self.cuda = device.type == "cuda"
        self.hwm = not self.cuda and _reset_hwm()
        if self.cuda:
            self.source = "cuda.max_memory_allocated"
        elif self.hwm:
            self.source = "VmHWM (malloc_trim, then reset per window) + spill page cache"
        else:
            self.source = "ru_maxrss (whole process) + spill page cache"

    def reset(self) -> None:
        self.cache_peak, self.sample_ms = 0, 0.0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.hwm:
            try:  # hand freed heap pages back to the OS, so the resident set counts live memory
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):
                pass
            _reset_hwm()

    def sample_cache(self) -> None:
        if not self.cuda and self.spill_dir is not None:
            start = time.perf_counter()
            self.cache_peak = max(self.cache_peak, cached_bytes_under(self.spill_dir) or 0)
            self.sample_ms += (time.perf_counter() - start) * 1e3

    def peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device)
        if self.hwm:
            return _proc_status_bytes("VmHWM") + self.cache_peak
        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale + self.cache_peak

    def current(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        # The page cache first: reading it allocates, and a window's base must count that.
        cache = (cached_bytes_under(self.spill_dir) or 0) if self.spill_dir else 0
        return _proc_status_bytes("VmRSS") + cache


def _reset_hwm() -> bool:
    """Reset this process's peak-RSS mark (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _proc_status_bytes("VmHWM") > 0


def _proc_status_bytes(field: str) -> int:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return 0
    return int(match.group(1)) * 1024 if match else 0


@contextlib.contextmanager
def window(device: torch.device, memory: Optional[Memory] = None) -> Iterator[dict]:
    """A measured window between device synchronizations. The dict it yields holds on exit ``ms``
    (wall time, less the page-cache sampling of ``memory`` in it), ``cpu_ms`` (process CPU time:
    the window's cost when other tenants steal the wall clock; it misses disk and device waits) and,
    given ``memory``, ``peak`` and ``rise`` (the peak less the memory in use at the start)."""
    sync(device)
    if memory is not None:
        memory.reset()
    base = 0 if memory is None else memory.current()
    figures: dict = {}
    cpu_start, start = time.process_time(), time.perf_counter()
    yield figures
    sync(device)
    figures["ms"] = (time.perf_counter() - start) * 1e3 - (0 if memory is None else memory.sample_ms)
    figures["cpu_ms"] = (time.process_time() - cpu_start) * 1e3
    if memory is not None:
        figures.update(peak=memory.peak(), rise=memory.peak() - base)


Times = dict[str, list[float]]  # per name, one figure per call


_SIGINT_SEEN = threading.Event()


def remember_sigint() -> None:
    """Make a SIGINT (a part's time limit) stop the run however the process was started.

    A process started from a background job (``cmd &`` in a script, ``nohup``) inherits SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler: the run went on to its full
    length (a suite run in the background hung in the interrupt tests). The handler set here
    raises it whatever was inherited, and remembers it: ``timed`` (and ``raise_if_interrupted``,
    for loops of their own) raises it again should a ``__del__`` have swallowed the first."""

    def handler(signum: int, frame: object) -> None:
        _SIGINT_SEEN.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt of a SIGINT that ``remember_sigint`` saw and a finalizer dropped."""
    if _SIGINT_SEEN.is_set():
        raise KeyboardInterrupt


def timed(
    fns: dict[str, Callable[[], None]],
    *,
    rounds: int,
    warmup: int,
    device: torch.device,
    deadline: Optional[float] = None,
) -> tuple[Times, Times]:
    """Time each function ``rounds`` times, interleaved (A B C A B C ...), after ``warmup`` rounds,
    each call a ``window``: (wall ms, process CPU ms) per call, per name. ``deadline``
    (``time.perf_counter()`` seconds): after the first timed round, stop before a round that would
    end past it (judged by the one before), so every name has the same number of rounds."""
    wall: Times = {name: [] for name in fns}
    cpu: Times = {name: [] for name in fns}
    round_s = 0.0
    for round_index in range(warmup + rounds):
        raise_if_interrupted()
        measured = round_index > warmup  # at least one timed round, whatever the deadline
        if deadline is not None and measured and time.perf_counter() + round_s > deadline:
            break
        started = time.perf_counter()
        for name, fn in fns.items():
            with window(device) as figures:
                fn()
            if round_index >= warmup:
                wall[name].append(figures["ms"])
                cpu[name].append(figures["cpu_ms"])
        round_s = time.perf_counter() - started
    return wall, cpu


def _git_commit() -> Optional[str]:
    checkout = Path(offload.__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(device: torch.device) -> dict:
    """Hardware, versions and date: what a committed result must name. Never initializes CUDA
    unless ``device`` is a CUDA device."""
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host_cpu": cpu_model(),
        "cpu_cores_logical": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2),  # > cores: something else shared the machine
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "offload": offload.__version__,
        "git_commit": _git_commit(),
        "device": str(device),
    }
    try:
        import psutil  # optional: RAM size only

        env["ram_gb"] = round(psutil.virtual_memory().total / 1e9, 1)
    except ImportError:
        pass
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 1e9, 1))
    return env


def describe_machine(env: dict) -> str:
    """One line naming the hardware and versions, for table headers."""
    where = env.get("gpu") or f"{env['host_cpu']} ({env['cpu_cores_logical']} cores)"
    return f"{where}, torch {env['torch']}, python {env['python']}, {env['date_utc']}"


def table(header: Sequence[str], rows: Sequence[Sequence], *, markdown: bool = False, left: int = 1) -> str:
    """Rows under a header: aligned plain text (the first ``left`` columns left-aligned, the rest
    right-aligned), or a markdown table. None prints as '-'. A row shorter than the header (a
    name and a note, e.g. "skipped: ...") prints its note across the remaining columns."""
    lines = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in row] for row in rows]
    if markdown:
        cells = ["| " + " | ".join(line + [""] * (len(header) - len(line))) + " |" for line in lines]
        return "\n".join([cells[0], "|" + "---|" * len(header)] + cells[1:])
    widths = [max(len(line[i]) for line in lines if len(line) == len(header)) for i in range(len(header))]

    def render(line: list[str]) -> str:
        if len(line) < len(header):  # a name and a note
            return "  ".join([line[0].ljust(widths[0])] + line[1:])
        cells = zip(line, widths, strict=True)
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(cells))

    rendered = [render(line) for line in lines]
    return "\n".join([rendered[0], "  ".join("-" * w for w in widths)] + rendered[1:])


Column = tuple[str, Union[str, Callable[[dict], Any]], str]
"""A table column: (header, the record's key or a function of the record, format spec; '' for str)."""


def records_table(
    columns: Sequence[Column],
    records: Iterable[dict],
    *,
    markdown: bool = False,
    left: int = 1,
    note: Callable[[dict], Optional[str]] = lambda record: None,
) -> str:
    """``table`` of one row per record, each cell its column's value formatted by its spec (None
    prints as '-'); a record for which ``note`` returns a text prints its first cell and that text."""

    def cell(record: dict, column: Column) -> Any:
        _, key, spec = column
        value = record[key] if isinstance(key, str) else key(record)
        return value if value is None or not spec else format(value, spec)

    rows: list[Sequence] = []
    for record in records:
        text = note(record)
        rows.append([cell(record, columns[0]), text] if text else [cell(record, column) for column in columns])
    return table([header for header, _, _ in columns], rows, markdown=markdown, left=left)


def write_text(path: Union[str, os.PathLike], text: str) -> Path:
    """Write ``text`` whole or not at all (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_json(path: Union[str, os.PathLike], payload: Any) -> Path:
    return write_text(path, json.dumps(payload, indent=1, default=str) + "\n")
