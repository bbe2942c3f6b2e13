"""What the engine costs when it has nothing to do, what moving everything costs, and the disk tier.

    python bench/overhead.py [--device cpu|cuda] [--steps N] [--repeats R] [--json-out PATH] [--time-limit-s S]
    python bench/overhead.py --per-tensor-only [--old CHECKOUT] [--profile] [--repeats R] [--chain N]
    python bench/overhead.py --disk [--repeats 7] [--spill-dir DIR] [--json-out PATH]

Per saved tensor (a chain of tiny ``sin`` ops under each kind of hooks, minus no hooks, as a
ratio to a bare hook pair), per training step (``offload.bench.loop.Trainer`` under engines at
budget None, 25 % and 0, step by step interleaved) and, with ``--disk``, the disk tier;
bench/README.md defines every figure. ``--old CHECKOUT`` imports that checkout's package beside
this one (as ``offload_old``) and interleaves its engines with these, so old and new code are
compared in one process, round by round; ``--profile`` adds where each engine's time goes
(cProfile). A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import cProfile
import dataclasses
import gc
import importlib
import json
import operator
import os
import pstats
import shutil
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Optional

STARTED_S = time.perf_counter()
"""When this script started (before torch is imported): ``--time-limit-s`` counts from here."""

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `import offload` from a checkout
import offload  # noqa: E402
from offload._memory.arena import PinnedSlabs  # noqa: E402
from offload._memory.transfer import CudaLink  # noqa: E402
from offload.bench import measure  # noqa: E402
from offload.bench.config import MB, REFERENCE, RunSettings  # noqa: E402
from offload.bench.loop import Trainer  # noqa: E402
from offload.bench.pagecache import cached_bytes_under  # noqa: E402
from offload.models import load_corpus  # noqa: E402
from offload.models.gpt import GPTConfig, MiniGPT  # noqa: E402

CHAIN_LENGTH = 200
"""Saved tensors per chain run (issue 39's figure): a few hundred, as a layer stack saves per step;
a chain takes ~1-3 ms, far above the timer's resolution, and the paired medians of many rounds
see through the scheduler's noise."""
CHAIN_NUMEL = 64
"""fp32 elements per chained tensor (256 bytes): tiny, so the op itself costs next to nothing."""
CHAIN_REPEATS = 60
"""Interleaved rounds of the per-tensor chains (each variant once per round)."""
PROFILE_CHAINS = 30
"""--profile: chains run under cProfile per engine variant."""
PROFILE_ROWS = 12
"""--profile: functions listed per variant (the most internal time first)."""
OLD_PACKAGE = "offload_old"
"""The name ``--old`` imports the other checkout's package under (it imports itself relatively)."""
DISK_CHAINS = {"per_tensor": (16 * 1024, 300), "per_mb": (2 * 1024 * 1024, 24)}
"""--disk: (fp32 elements per saved tensor, chain length): 64 KiB tensors for the fixed cost per
tensor, 8 MiB ones for the cost per MB."""
DISK_WARMUP = 2
DISK_GPT_BUDGETS_MB = (0, 2)
STEP_TARGET_OVERHEAD = 0.03
"""Step-time overhead allowed at budget None (3 %)."""
PER_TENSOR_SHARE = 0.3
"""Share of ``--time-limit-s`` the per-tensor chains may use; the training steps take the rest."""
FINAL_WRITE_S = 3.0
"""Seconds ``--time-limit-s`` keeps for closing the engines, writing the JSON and exiting."""
PARTIAL_BUDGET_FRACTION = 0.25
"""The 'partial' variant's budget, as a share of one step's saved bytes."""

GPT_PRESETS = {
    # The defaults of GPTConfig: trains in a few tens of ms per step on a small CPU.
    "cpu": RunSettings(layers=4, heads=4, hidden=128, seq=128, batch=16, dropout=0.0, device="cpu"),
    # A GPU-sized small GPT (~100M parameters) in bf16.
    "cuda": RunSettings(layers=8, heads=16, hidden=1024, seq=1024, batch=8, dropout=0.0, dtype="bf16", device="cuda"),
}

TENSOR_COLUMNS: list[measure.Column] = [
    ("hooks", "name", ""),
    ("us per saved tensor (median)", "median_us", ".2f"),
    ("x bare pair", "x_bare", ".2f"),
    ("(min)", "min_us", ".2f"),
    ("(cpu time)", "cpu_us", ".2f"),
    ("moved per chain", lambda v: v.get("moved_per_chain"), ""),
    ("moved: us excl. copy", lambda v: v.get("moved_excl_copy_us"), ".2f"),
    ("(x bare)", lambda v: v.get("moved_excl_copy_x_bare"), ".2f"),
]
PROFILE_COLUMNS: list[measure.Column] = [
    ("function", "function", ""),
    ("calls/tensor", "calls_per_tensor", ".2f"),
    ("us/tensor (profiled)", "us_per_tensor", ".3f"),
    ("share", "share", ".1%"),
]
STEP_COLUMNS: list[measure.Column] = [
    ("variant", "name", ""),
    ("median ms", "median_ms", ".2f"),
    ("overhead", "overhead", "+.2%"),
    ("paired", "paired_overhead", "+.2%"),
    ("min ms", "min_ms", ".2f"),
    ("min ovh", "min_overhead", "+.2%"),
    ("cpu ms", "cpu_median_ms", ".2f"),
    ("cpu ovh", "cpu_overhead", "+.2%"),
    ("moved MB/step", lambda variant: variant.get("offloaded_mb_per_step"), ""),  # engines only
    ("peak resident MB", lambda variant: variant.get("peak_resident_mb"), ""),
]


def chain(x: torch.Tensor, length: int, make_context) -> None:
    x.grad = None
    with make_context():
        y = x.clone()  # a non-leaf, so the first sin's saved input is eligible too
        for _ in range(length):
            y = y.sin()
        y.sum().backward()


def time_chains(x: torch.Tensor, length: int, contexts: dict, *, repeats: int, warmup: int, deadline=None) -> tuple:
    """(wall ms, CPU ms) per context name, the chains interleaved (fewer rounds if ``deadline`` says so)."""
    fns = {name: (lambda context=context: chain(x, length, context)) for name, context in contexts.items()}
    return measure.timed(fns, rounds=repeats, warmup=warmup, device=x.device, deadline=deadline)


def moving_engine(budget_mb: float, device: torch.device, slabs, package: Any = offload, **kwargs) -> offload.Engine:
    """An engine that moves tensors; on CUDA its link shares ``slabs`` (pinned memory) with the others."""
    link = CudaLink(device, slabs=slabs) if device.type == "cuda" else None
    return package.engine(budget_mb=budget_mb, device=device, link=link, **kwargs)


def chain_stats(x: torch.Tensor, length: int, engine):
    engine.reset_stats()
    chain(x, length, lambda: engine)
    return engine.stats


class _Done:
    """A copy that has already landed (``offload._memory.pending.Pending``, duck-typed so either package takes it)."""

    blocks_host = False

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def error(self) -> None:
        return None

    def order_compute(self) -> None:
        return None


class CopyingLink:
    """A link to host memory on the CPU whose copies are synchronous ``copy_`` calls, timed: it runs
    the engine's host tier (evict, land, reload, rebuild) with no disk and no thread, so the time
    a moving engine takes less ``copy_s`` is the engine's own work. ``offload._memory.transfer.Link``."""

    def __init__(self) -> None:
        self.copy_s = 0.0
        self.copies = 0
        self._batch = contextlib.nullcontext()

    def batch(self):
        return self._batch

    def d2h(self, src_device: torch.Tensor, dst_host: torch.Tensor) -> _Done:
        start = time.perf_counter()
        dst_host[: src_device.numel()].copy_(src_device)
        self.copy_s += time.perf_counter() - start
        self.copies += 1
        return _DONE

    def d2h_all(self, srcs_device: list, dsts_host: list) -> _Done:
        start = time.perf_counter()
        torch._foreach_copy_([d[: s.numel()] for s, d in zip(srcs_device, dsts_host, strict=True)], srcs_device)
        self.copy_s += time.perf_counter() - start
        self.copies += len(srcs_device)
        return _DONE

    def h2d(self, src_host: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, _Done]:
        start = time.perf_counter()
        dst = torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src_host[:nbytes])
        self.copy_s += time.perf_counter() - start
        self.copies += 1
        return dst, _DONE

    def released(self, host: torch.Tensor) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def busy_ms(self) -> tuple[float, float, float]:
        return 0.0, 0.0, 0.0


_DONE = _Done()


class FloorPair:
    """The cheapest pure-Python hook pair that keeps what the engine keeps when it only counts: a
    detached alias and its version (the in-place check; no cycle through a node saving its own
    output), each storage counted once under a lock (dedup, resident bytes and their peak), and
    its release when autograd drops the last save of it. No eligibility test, no store, no tiers:
    a reference for how far above a bare pair a correct Python pair must sit, not a design."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.storages: dict[int, list] = {}  # key -> [saves alive, nbytes]
        self.resident_bytes = self.peak_bytes = self.saved_tensors = 0

    def context(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, _floor_unpack)

    def pack(self, t: torch.Tensor) -> _FloorSave:
        storage = t.untyped_storage()
        key = storage._cdata
        save = _FloorSave(self, key, t.detach(), t._version)
        with self.lock:
            record = self.storages.get(key)
            if record is None:
                record = self.storages[key] = [0, storage.nbytes()]
                self.resident_bytes += record[1]
                self.peak_bytes = max(self.peak_bytes, self.resident_bytes)
            record[0] += 1
            self.saved_tensors += 1
        return save

    def release(self, key: int) -> None:
        with self.lock:
            record = self.storages[key]
            record[0] -= 1
            if record[0] == 0:
                del self.storages[key]
                self.resident_bytes -= record[1]


class _FloorSave:
    __slots__ = ("pair", "key", "alias", "version")

    def __init__(self, pair: FloorPair, key: int, alias: torch.Tensor, version: int) -> None:
        self.pair, self.key, self.alias, self.version = pair, key, alias, version

    def __del__(self) -> None:
        self.pair.release(self.key)


def _floor_unpack(save: _FloorSave) -> torch.Tensor:
    alias = save.alias
    if alias._version != save.version:
        raise RuntimeError("a saved tensor was modified in place")
    return alias


def _floor_passed_pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The least a pass-through save can be: a size read of the storage (a small view of a large
    storage is not small), then a detached alias and its version (no cycle through a node saving
    its own output; the in-place check). Every save here is small, so the test always passes."""
    if t.untyped_storage().nbytes() < FLOOR_MIN_BYTES:
        return (t.detach(), t._version)
    raise AssertionError("the pass-through floor saw a large save")


def _floor_passed_unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    alias, version = packed
    if alias._version != version:
        raise RuntimeError("a saved tensor was modified in place")
    return alias


FLOOR_MIN_BYTES = 1 << 16
"""The pass-through floor's size threshold: the engine's default ``min_offload_bytes``."""


def import_old(checkout: str) -> Any:
    """The package of another checkout (``CHECKOUT/offload``), imported as ``OLD_PACKAGE`` beside this one."""
    package_dir = Path(checkout).resolve() / "offload"
    if not (package_dir / "__init__.py").is_file():
        raise ValueError(f"--old {checkout!r} holds no offload package (no {package_dir}/__init__.py); pass a checkout")
    holder = Path(tempfile.mkdtemp(prefix="offload-old-"))
    atexit.register(shutil.rmtree, holder, ignore_errors=True)  # only a link lives there; the import is done by then
    os.symlink(package_dir, holder / OLD_PACKAGE)
    sys.path.insert(0, str(holder))
    return importlib.import_module(OLD_PACKAGE)


def torchtune_offload() -> tuple[Optional[Any], Optional[str]]:
    """torchtune's ``OffloadActivations`` context class, or None and why not."""
    try:
        from torchtune.training import OffloadActivations  # type: ignore[import-not-found]
    except Exception as error:  # noqa: BLE001 - any failure to import means the row is skipped, and why
        return None, f"torchtune does not import here ({type(error).__name__}: {error})"
    return OffloadActivations, None


def chain_engines(package: Any, prefix: str, device: torch.device, half_mb: float, slabs) -> tuple[dict, dict]:
    """The engine variants of one package: {name: engine}, and {name: CopyingLink} of the moving ones (CPU)."""
    link = CudaLink(device, slabs=slabs) if device.type == "cuda" else CopyingLink()
    engines = {
        f"{prefix}engine budget None": package.engine(budget_mb=None, min_offload_bytes=0, device=device),
        f"{prefix}engine pass-through": package.engine(budget_mb=0, device=device),  # 256 B < min_offload_bytes
        f"{prefix}engine budget half": package.engine(budget_mb=half_mb, min_offload_bytes=0, device=device, link=link),
    }
    links = {f"{prefix}engine budget half": link} if isinstance(link, CopyingLink) else {}
    return engines, links


def profile_engines(x: torch.Tensor, length: int, engines: dict, saved: int) -> dict:
    """Where each engine's time goes: cProfile over ``PROFILE_CHAINS`` chains, the functions with the
    most internal time, per saved tensor (times inflated by the profiler itself: read them as shares),
    with the garbage collector held off (the timed chains run with it on)."""
    profiles = {}
    for name, engine in engines.items():
        gc.collect()
        gc.disable()  # cProfile's own allocations would set off collections that land on whatever allocates next
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            for _ in range(PROFILE_CHAINS):
                chain(x, length, lambda engine=engine: engine)
        finally:
            profiler.disable()
            gc.enable()
        stats = pstats.Stats(profiler)
        per = PROFILE_CHAINS * saved
        rows = []
        total = sum(tottime for _, _, tottime, _, _ in stats.stats.values())  # type: ignore[attr-defined]
        ordered = sorted(stats.stats.items(), key=lambda item: -item[1][2])  # type: ignore[attr-defined]
        for (filename, line, function), (_, ncalls, tottime, _, _) in ordered[:PROFILE_ROWS]:
            where = f"{Path(filename).parent.name}/{Path(filename).name}:{line}" if line else filename
            rows.append(
                {
                    "function": f"{where}({function})" if line else function,
                    "calls_per_tensor": round(ncalls / per, 2),
                    "us_per_tensor": round(tottime * 1e6 / per, 3),
                    "share": round(tottime / total, 3),
                }
            )
        profiles[name] = {"total_us_per_tensor": round(total * 1e6 / per, 3), "rows": rows}
    return profiles


def per_tensor(
    device: torch.device,
    repeats: int,
    warmup: int,
    length: int = CHAIN_LENGTH,
    deadline=None,
    slabs=None,
    old: Any = None,
    profile: bool = False,
) -> dict:
    x = torch.ones(CHAIN_NUMEL, device=device, requires_grad=True)
    tensor_bytes = CHAIN_NUMEL * x.element_size()
    half_mb = length * tensor_bytes / 2 / MB
    engines, links = chain_engines(offload, "", device, half_mb, slabs)
    if old is not None:
        old_engines, old_links = chain_engines(old, "old ", device, half_mb, slabs)
        engines |= old_engines
        links |= old_links
    OffloadActivations, torchtune_skipped = torchtune_offload()
    contexts = {
        "no hooks": contextlib.nullcontext,
        "bare pair": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        "detach pair": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t),
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"),
        "floor: minimal counting pair": FloorPair().context,
        "floor: minimal pass-through pair": lambda: torch.autograd.graph.saved_tensors_hooks(
            _floor_passed_pack, _floor_passed_unpack
        ),
    }
    skipped = {}
    if OffloadActivations is not None:
        try:
            chain(x, 2, OffloadActivations)
            contexts["torchtune OffloadActivations"] = OffloadActivations
        except Exception as error:  # noqa: BLE001 - a reference that fails here is reported, not fatal
            skipped["torchtune OffloadActivations"] = f"fails on {device} ({type(error).__name__}: {error})"
    else:
        skipped["torchtune OffloadActivations"] = torchtune_skipped
    contexts |= {name: (lambda e=engine: e) for name, engine in engines.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pass-through engine says once that every save was small
        times, cpu = time_chains(x, length, contexts, repeats=repeats, warmup=warmup, deadline=deadline)
        calls = warmup + len(times["no hooks"])
        copy_ms = {name: link.copy_s * 1e3 / calls for name, link in links.items()}  # per chain
        stats = {name: chain_stats(x, length, engine) for name, engine in engines.items()}
        profiles = profile_engines(x, length, engines, length) if profile else None
    for engine in engines.values():
        engine.close()
    saved = stats["engine budget None"].saved_tensors
    if saved != length:  # each sin saves its input
        raise RuntimeError(f"expected the engine to take {length} saved tensors, it took {saved}")
    base, base_cpu = times.pop("no hooks"), cpu["no hooks"]
    us_per_tensor = 1e3 / saved  # a chain's ms -> us per saved tensor
    variants = {
        name: {
            "median_us": round(us_per_tensor * measure.paired_median(ms, base), 3),
            "min_us": round(us_per_tensor * (min(ms) - min(base)), 3),
            "cpu_us": round(us_per_tensor * measure.paired_median(cpu[name], base_cpu), 3),
        }
        for name, ms in times.items()
    }
    bare_us = variants["bare pair"]["median_us"]
    for row in variants.values():
        row["x_bare"] = round(row["median_us"] / bare_us, 2) if bare_us > 0 else None
    for prefix in ("", "old ") if old is not None else ("",):
        moving, counting = f"{prefix}engine budget half", f"{prefix}engine budget None"
        moved = stats[moving].offloaded_bytes // tensor_bytes
        row = variants[moving]
        row["moved_per_chain"] = moved
        if moved and moving in copy_ms:
            # a moved tensor's own cost: what every saved tensor pays (budget None), plus what moving
            # adds, spread over the moved ones, less the copies themselves
            extra_ms = measure.paired_median(times[moving], times[counting]) - copy_ms[moving]
            row["copy_us_per_moved"] = round(copy_ms[moving] * 1e3 / moved, 3)
            row["moved_excl_copy_us"] = round(variants[counting]["median_us"] + extra_ms * 1e3 / moved, 3)
            row["moved_excl_copy_x_bare"] = round(row["moved_excl_copy_us"] / bare_us, 2) if bare_us > 0 else None
    return {
        "chain_length": length,
        "numel": CHAIN_NUMEL,
        "tensor_bytes": tensor_bytes,
        "saved_per_chain": saved,
        "repeats": len(base),
        "no_hooks_ms": round(measure.median(base), 3),
        "bare_pair_us": bare_us,
        "engine_budget_none_us": variants["engine budget None"]["median_us"],
        "variants": variants,
        "skipped": skipped,
        "old": None if old is None else str(Path(old.__file__).resolve().parent),
        "profiles": profiles,
    }


def disk_chain(numel: int, length: int, repeats: int, spill_dir: str) -> dict:
    """Budget 0 (every tensor to the spill files and back) against budget None, on the CPU."""
    x = torch.ones(numel, requires_grad=True)
    counting = offload.engine(budget_mb=None, min_offload_bytes=0)
    moving = offload.engine(budget_mb=0, min_offload_bytes=0, spill_dir=spill_dir)
    contexts = {"base": lambda: counting, "moved": lambda: moving}
    times, _ = time_chains(x, length, contexts, repeats=repeats, warmup=DISK_WARMUP)
    moved_mb = chain_stats(x, length, moving).offloaded_bytes / MB
    counting.close()
    moving.close()
    moved_ms = measure.paired_median(times["moved"], times["base"])
    return {
        "tensors": length,
        "tensor_bytes": numel * 4,
        "base_ms": round(measure.median(times["base"]), 3),
        "moved_ms": round(measure.median(times["moved"]), 3),
        "per_tensor_us": round(moved_ms * 1e3 / length, 1),
        "per_mb_ms": round(moved_ms / moved_mb, 3) if moved_mb else None,
        "offloaded_mb": round(moved_mb, 2),
    }


def step_overhead(
    device: torch.device,
    steps: int,
    warmup: int,
    batch=None,
    deadline=None,
    slabs=None,
    old: Any = None,
    moving: bool = True,
) -> dict:
    settings = GPT_PRESETS["cuda" if device.type == "cuda" else "cpu"]
    settings = dataclasses.replace(settings, batch=batch or settings.batch)
    trainer = Trainer(settings, REFERENCE, load_corpus(), device)
    counting = offload.engine(budget_mb=None, device=device, model=trainer.model)
    for _ in range(warmup):
        trainer.step(lambda: counting)
    measure.sync(device)
    counting.reset_stats()
    trainer.step(lambda: counting)
    saved = counting.stats
    partial_mb = PARTIAL_BUDGET_FRACTION * saved.saved_bytes / MB
    engines = {"budget None": counting}
    if moving:
        engines[f"budget {partial_mb:.1f} MB (25%)"] = moving_engine(partial_mb, device, slabs, model=trainer.model)
        engines["budget 0"] = moving_engine(0, device, slabs, model=trainer.model)
    if old is not None:  # the other checkout's engine at budget None, interleaved with these
        engines["old budget None"] = old.engine(budget_mb=None, device=device, model=trainer.model)
    for engine in engines.values():
        engine.reset_stats()
    fns = {"no engine": trainer.step} | {name: (lambda e=e: trainer.step(lambda: e)) for name, e in engines.items()}
    times, cpu = measure.timed(fns, rounds=steps, warmup=warmup, device=device, deadline=deadline)
    base, base_cpu = times["no engine"], cpu["no engine"]
    variants = {  # overheads are fractions of the no-engine step (bench/README.md)
        name: {
            "median_ms": round(measure.median(ms), 3),
            "min_ms": round(min(ms), 3),
            "cpu_median_ms": round(measure.median(cpu[name]), 3),
            "overhead": round(measure.median(ms) / measure.median(base) - 1, 4),
            "paired_overhead": round(measure.paired_median(ms, base, operator.truediv) - 1, 4),
            "min_overhead": round(min(ms) / min(base) - 1, 4),
            "cpu_overhead": round(measure.median(cpu[name]) / measure.median(base_cpu) - 1, 4),
        }
        for name, ms in times.items()
    }
    calls = warmup + len(base)
    for name, engine in engines.items():
        stats = engine.stats
        variants[name].update(
            offloaded_mb_per_step=round(stats.offloaded_bytes / calls / MB, 2),
            peak_resident_mb=round(stats.peak_resident_bytes / MB, 2),
            evict_wait_ms_per_step=round(stats.evict_wait_ms / calls, 3),
            reload_wait_ms_per_step=round(stats.reload_wait_ms / calls, 3),
        )
        engine.close()
    none_row = variants["budget None"]
    config = settings.gpt_config()
    model = {key: getattr(config, key) for key in ("n_layer", "n_embd", "n_head", "seq_len")}
    return {
        "model": model | {"batch": settings.batch, "dtype": settings.dtype, "params": trainer.model.num_params()},
        "steps": len(base),
        "warmup": warmup,
        "saved_bytes_per_step": saved.saved_bytes,
        "saved_tensors_per_step": saved.saved_tensors,
        "passthrough_tensors_per_step": saved.passthrough_tensors,
        "no_engine_ms": round(measure.median(base), 3),
        "no_engine_cpu_ms": round(measure.median(base_cpu), 3),
        "engine_none_ms": none_row["median_ms"],
        "overhead_budget_none": none_row["overhead"],
        "cpu_overhead_budget_none": none_row["cpu_overhead"],
        "target_overhead": STEP_TARGET_OVERHEAD,
        "within_target": none_row["overhead"] <= STEP_TARGET_OVERHEAD,
        "variants": variants,
    }


def disk_gpt_step(budget_mb: float, spill_dir: str) -> dict:
    """Page cache held by the spill files at the end of a MiniGPT 4 x 256 forward, and reads per byte."""
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(n_layer=4, n_embd=256, n_head=4, seq_len=256))
    idx = torch.randint(0, 256, (8, 256))
    engine = offload.engine(budget_mb=budget_mb, spill_dir=spill_dir, model=model)
    for _ in range(2):
        with engine:
            _, loss = model(idx, idx)
        loss.backward()
    engine.reset_stats()
    with engine:
        _, loss = model(idx, idx)
    cached, spilled = cached_bytes_under(spill_dir), engine.stats.spilled_bytes
    loss.backward()
    stats = engine.stats
    engine.close()
    return {
        "budget_mb": budget_mb,
        "offloaded_mb": round(stats.offloaded_bytes / MB, 2),
        "reloaded_mb": round(stats.reloaded_bytes / MB, 2),
        "reload_ratio": round(stats.reloaded_bytes / stats.offloaded_bytes, 3) if stats.offloaded_bytes else None,
        "spilled_at_forward_end_mb": round(spilled / MB, 2),
        "page_cache_at_forward_end_mb": None if cached is None else round(cached / MB, 2),
        "page_cache_share": None if not (cached is not None and spilled) else round(cached / spilled, 3),
    }


def disk_tier(repeats: int, spill_parent) -> dict:
    with tempfile.TemporaryDirectory(dir=spill_parent) as spill_dir:
        chains = {name: disk_chain(numel, length, repeats, spill_dir) for name, (numel, length) in DISK_CHAINS.items()}
        steps = [disk_gpt_step(budget_mb, spill_dir) for budget_mb in DISK_GPT_BUDGETS_MB]
    print(
        f"per tensor (64 KiB): {chains['per_tensor']['per_tensor_us']} us   "
        f"per MB (8 MiB tensors): {chains['per_mb']['per_mb_ms']} ms"
    )
    for s in steps:
        print(
            f"MiniGPT budget {s['budget_mb']} MB: reloaded/offloaded {s['reload_ratio']}, "
            f"page cache {s['page_cache_at_forward_end_mb']} of {s['spilled_at_forward_end_mb']} MB spilled"
        )
    return {"benchmark": "disk_tier", "offload_file": offload.__file__, **chains, "gpt_steps": steps}


def print_overhead(tensor: Optional[dict], step: Optional[dict], env: dict) -> None:
    """The tables of what was measured (a section cut short by the time limit or SIGINT is absent)."""
    print(f"offload overhead on {measure.describe_machine(env)}\n")
    if tensor is not None:
        print(
            f"per saved tensor: chain of {tensor['chain_length']} sin ops on {CHAIN_NUMEL} floats "
            f"({tensor['saved_per_chain']} saves), no hooks {tensor['no_hooks_ms']:.2f} ms, median of "
            f"{tensor['repeats']} paired rounds, each variant's extra time per saved tensor and its ratio to a bare "
            f"pair; load average {env['load_avg_1m']} on {env['cpu_cores_logical']} cores"
        )
        print(measure.records_table(TENSOR_COLUMNS, [{"name": name, **v} for name, v in tensor["variants"].items()]))
        for name, why in tensor["skipped"].items():
            print(f"{name}: skipped, {why}")
        for name, profile in (tensor.get("profiles") or {}).items():
            print(
                f"\nwhere '{name}' spends its time: {profile['total_us_per_tensor']:.2f} us per saved tensor "
                "under cProfile"
            )
            print(measure.records_table(PROFILE_COLUMNS, profile["rows"]))
    if step is None:
        return
    m = step["model"]
    print(
        f"\nper step: MiniGPT n_layer={m['n_layer']} n_embd={m['n_embd']} seq_len={m['seq_len']} batch={m['batch']} "
        f"({m['params'] / 1e6:.1f}M params), {step['saved_tensors_per_step']} saved tensors "
        f"({step['saved_bytes_per_step'] / MB:.1f} MB) per step, median of {step['steps']} interleaved steps"
    )
    print(measure.records_table(STEP_COLUMNS, [{"name": name, **v} for name, v in step["variants"].items()]))
    print(
        f"\nbudget None overhead {step['overhead_budget_none']:+.2%} "
        f"({'within' if step['within_target'] else 'OVER'} the {STEP_TARGET_OVERHEAD:.0%} target); "
        f"by CPU time {step['cpu_overhead_budget_none']:+.2%}; "
        f"load average {env['load_avg_1m']} on {env['cpu_cores_logical']} cores"
    )


def measure_overhead(args, json_out: Optional[str]) -> dict:
    """Both sections, the JSON rewritten after each (and on SIGINT), so a part stopped by its time
    limit keeps what it measured. ``--time-limit-s``: the per-tensor chains may take
    ``PER_TENSOR_SHARE`` of it, the steps the rest; each stops after a whole interleaved round."""
    device = measure.resolve_device(args.device)
    measure.set_threads(args.threads)
    payload: dict = {"benchmark": "overhead", "env": measure.environment(device), "finished": False}
    payload |= {"per_tensor": None, "step": None}
    deadline = per_tensor_deadline = None
    if args.time_limit_s is not None:  # from the script's start: imports and CUDA's set-up count too
        deadline = STARTED_S + args.time_limit_s - FINAL_WRITE_S
        now = time.perf_counter()
        per_tensor_deadline = now + PER_TENSOR_SHARE * (deadline - now)
    slabs = PinnedSlabs() if device.type == "cuda" else None  # the engines one after another pin once
    try:
        old = None if args.old is None else import_old(args.old)
        payload["per_tensor"] = per_tensor(
            device,
            args.chain_repeats,
            args.warmup,
            args.chain,
            deadline=per_tensor_deadline,
            slabs=slabs,
            old=old,
            profile=args.profile,
        )
        if json_out:
            measure.write_json(json_out, payload)
        if not args.per_tensor_only:
            payload["step"] = step_overhead(
                device,
                args.steps,
                args.warmup,
                args.batch,
                deadline=deadline,
                slabs=slabs,
                old=old,
                moving=not args.steps_none_only,
            )
        payload["finished"] = True
    except KeyboardInterrupt:
        print("overhead: interrupted; the JSON holds what was measured", file=sys.stderr)
    finally:
        if slabs is not None:
            slabs.clear(settle=torch.cuda.synchronize)
    print_overhead(payload["per_tensor"], payload["step"], payload["env"])
    return payload


def main(argv=None) -> int:
    measure.remember_sigint()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (default: 30)")
    parser.add_argument(
        "--repeats", type=int, help=f"timed chain runs per variant (default: {CHAIN_REPEATS}; --disk 7)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="warm-up runs per variant (default: 3)")
    parser.add_argument(
        "--chain", type=int, default=CHAIN_LENGTH, help=f"saved tensors per chain (default: {CHAIN_LENGTH})"
    )
    parser.add_argument("--batch", type=int, help="the step's batch size (default: the device's preset)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice; --disk 1)")
    parser.add_argument("--disk", action="store_true", help="the disk tier's figures instead (CPU)")
    parser.add_argument("--spill-dir", help="--disk: parent of the spill directory (default: the temp dir)")
    parser.add_argument("--per-tensor-only", action="store_true", help="the per-tensor section alone (no steps)")
    parser.add_argument(
        "--steps-none-only",
        action="store_true",
        help="steps without the engine and at budget None only (the moving engines' disk writes, landing in the "
        "background, fall on the next round's first step)",
    )
    parser.add_argument(
        "--old", help="a checkout whose offload package is timed beside this one, interleaved, in this process"
    )
    parser.add_argument("--profile", action="store_true", help="cProfile each engine variant's chains (a table each)")
    parser.add_argument("--json-out", help="also write the JSON object to this file")
    parser.add_argument(
        "--overwrite-results", action="store_true", help="let --json-out replace a committed file in bench/results/"
    )
    parser.add_argument(
        "--time-limit-s",
        type=float,
        help="seconds from the script's start to finish in: fewer interleaved rounds when they would not fit "
        "(default: no limit)",
    )
    args = parser.parse_args(argv)
    args.chain_repeats = args.repeats or CHAIN_REPEATS
    args.repeats = args.repeats or (7 if args.disk else 15)
    if args.json_out:
        try:
            measure.check_out(args.json_out, args.overwrite_results)
        except ValueError as error:
            parser.error(str(error))
    for name in ("steps", "repeats", "chain"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.disk:
        measure.set_threads(args.threads or 1)
        payload = disk_tier(args.repeats, args.spill_dir) | {"env": measure.environment(torch.device("cpu"))}
    else:
        payload = measure_overhead(args, args.json_out)
    if args.json_out:
        print(f"wrote {measure.write_json(args.json_out, payload)}")
    print(json.dumps(payload))
    return 0 if payload.get("finished", True) else 130


if __name__ == "__main__":
    sys.exit(main())
