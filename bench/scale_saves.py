"""The engine's cost per saved tensor and per step as saves per step grow (issue 48).

    python bench/scale_saves.py [--old CHECKOUT] [--steps 20] [--saves 100,1000,10000] [--json-out PATH]

A step is a chain of N saving ops (``sin``, each saving its input) and its backward, timed in
this thread's CPU time (``time.thread_time``: the launch thread's own work, not another
engineer's process on the same cores). Per round every variant runs one step, in one process,
interleaved, so drift hits all alike; the figures are means over ``--steps`` rounds after
``WARMUP_ROUNDS`` (an engine at budget None counts its first step with its hooks on, so the
warm-up spends it: the table is the steady state; ``counted_step`` in the JSON is that first step).

Variants: ``bare`` (``saved_tensors_hooks(lambda t: t, lambda t: t)``), then per engine
(``new`` = this checkout, ``old`` = ``--old``'s): budget None; ``keep`` (a budget far above the
step: the store keeps all); ``half`` (half the step's bytes: the older half moves); ``zero``
(budget 0: everything moves; to disk on the CPU); ``half host`` and ``zero host`` (the same into a
host tier over ``overhead.CopyingLink``: copies in-thread, no disk, so the engine's own work shows).
Per saved tensor: (variant - no hooks) / N, and
that over the bare pair's. Tensors: ``tiny`` (64 fp32) and ``real`` (16 Ki fp32, 64 KiB: a
small layer's activation); moved variants run up to ``MOVED_MAX_SAVES`` and ``MOVED_MAX_BYTES`` a step.

Then the chain cut into ``REGIONS`` blocks passed as ``regions=``, under a budget far above the
step, timed once the final plan keeps every block (new: unhooked from the first region; old: every
save through the hooks). Then ``LAYERS`` tiny ``nn.Linear`` layers, forward and backward, at
budget None against no engine (issue 48's goal: at most 1.03 x). A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `import offload` from a checkout
import offload  # noqa: E402
from overhead import CopyingLink  # noqa: E402  # bench/ is this script's own directory

TINY_NUMEL = 64
"""fp32 elements of a tiny save (256 bytes): the op costs next to nothing, the hooks show."""
REAL_NUMEL = 16 * 1024
"""fp32 elements of a realistic save (64 KiB)."""
MOVED_MAX_BYTES = 80 * 2**20
MOVED_MAX_SAVES = 1000
"""Moved variants (half, zero) run only where a step saves at most this many tensors and bytes: on
the CPU every move is a spill-file write, 0.4-0.6 ms a save on the loaded 2-vCPU VM, so 10,000
moves a step for 22 rounds of two engines would take many minutes."""
HOST_MAX_BYTES = 256 * 2**20
"""Host-tier variants (``half host``, ``zero host``) run where a step saves at most this many bytes:
their host slabs hold the moved half or all of it."""
WARMUP_ROUNDS = 2
LAYERS = 1500
LAYER_WIDTH = 8
LAYER_ROWS = 4
OLD_PACKAGE = "offload_old"
GOALS = {"none_per_save_x_bare": 1.5, "layers_step_x_no_engine": 1.03}
"""Issue 48's goals for budget None."""


def import_old(checkout: str) -> Any:
    """``CHECKOUT/offload`` imported as ``OLD_PACKAGE`` beside this checkout's package."""
    package_dir = Path(checkout).resolve() / "offload"
    if not (package_dir / "__init__.py").is_file():
        raise ValueError(f"--old {checkout!r} holds no offload package; pass a checkout")
    holder = Path(tempfile.mkdtemp(prefix="offload-old-"))
    atexit.register(shutil.rmtree, holder, ignore_errors=True)
    os.symlink(package_dir, holder / OLD_PACKAGE)
    sys.path.insert(0, str(holder))
    return importlib.import_module(OLD_PACKAGE)


def chain_step(n: int, numel: int, ctx: Optional[Any]) -> float:
    """Thread CPU seconds of one forward of ``n`` saves under ``ctx`` and its backward."""
    x = torch.randn(numel, requires_grad=True)
    start = time.thread_time()
    if ctx is None:
        y = x
        for _ in range(n):
            y = y.sin()
    else:
        with ctx:
            y = x
            for _ in range(n):
                y = y.sin()
    y.sum().backward()
    return time.thread_time() - start


def engines(package: Any, saves: int, step_bytes: int, spill_dir: str) -> dict[str, Any]:
    """budget None, keep-all, half moved, zero: engines of ``package`` for a step of ``step_bytes``;
    the moved ones once to disk (this CPU's tier) and once to a host tier over ``CopyingLink``
    (synchronous in-thread copies, no disk: the engine's own work, as on a GPU's host tier)."""
    mb = step_bytes / 2**20
    made = {"none": package.engine(None, min_offload_bytes=0)}
    made["keep"] = package.engine(100 * mb + 1, min_offload_bytes=0, spill_dir=spill_dir)
    if step_bytes <= MOVED_MAX_BYTES and saves <= MOVED_MAX_SAVES:
        made["half"] = package.engine(mb / 2, min_offload_bytes=0, spill_dir=spill_dir)
        made["zero"] = package.engine(0, min_offload_bytes=0, spill_dir=spill_dir)
    if step_bytes <= HOST_MAX_BYTES:
        made["half host"] = package.engine(mb / 2, min_offload_bytes=0, device="cpu", link=CopyingLink())
        made["zero host"] = package.engine(0, min_offload_bytes=0, device="cpu", link=CopyingLink())
    return made


def chain_rows(packages: dict[str, Any], saves: list[int], steps: int, spill_dir: str) -> list[dict]:
    rows = []
    for size, numel in (("tiny", TINY_NUMEL), ("real", REAL_NUMEL)):
        for n in saves:
            step_bytes = n * numel * 4
            variants: dict[str, Optional[Any]] = {
                "no hooks": None,
                "bare": "bare",
            }
            for tag, package in packages.items():
                for name, eng in engines(package, n, step_bytes, spill_dir).items():
                    variants[f"{tag} {name}"] = eng
            times: dict[str, list[float]] = {k: [] for k in variants}
            counted: dict[str, float] = {}
            for round_ in range(WARMUP_ROUNDS + steps):
                for name, ctx in variants.items():
                    if ctx == "bare":
                        ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
                    t = chain_step(n, numel, ctx)
                    if round_ == 0:
                        counted[name] = t
                    if round_ >= WARMUP_ROUNDS:
                        times[name].append(t)
            for row in per_save_rows(size, n, times):
                rows.append(row | {"counted_step_ms": counted[row["variant"]] * 1e3})
            for eng in variants.values():
                if eng is not None and eng != "bare":
                    eng.close()
            for r in rows[-len(variants) :]:
                print(row_line(r), flush=True)
    return rows


def per_save_rows(size: str, n: int, times: dict[str, list[float]]) -> list[dict]:
    """One row per variant: its mean step, and its cost per save over "no hooks", also as a share of
    the bare pair's (nan where the bare pair's own cost is lost in the noise)."""
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    base = mean["no hooks"]
    bare_us = (mean["bare"] - base) / n * 1e6
    rows = []
    for name, step_s in mean.items():
        per_us = (step_s - base) / n * 1e6
        rows.append(
            {
                "tensors": size,
                "saves": n,
                "variant": name,
                "step_ms": step_s * 1e3,
                "per_save_us": per_us,
                "x_bare": per_us / bare_us if bare_us > 0 else float("nan"),
            }
        )
    return rows


def row_line(r: dict) -> str:
    return (
        f"{r['tensors']:7} {r['saves']:>6} {r['variant']:14} {r['step_ms']:9.3f} "
        f"{r['per_save_us']:8.3f} {r['x_bare']:7.2f} {r['counted_step_ms']:9.3f}"
    )


def layers_rows(packages: dict[str, Any], steps: int) -> list[dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(LAYER_WIDTH, LAYER_WIDTH) for _ in range(LAYERS)])
    x = torch.randn(LAYER_ROWS, LAYER_WIDTH)

    def step(ctx: Optional[Any]) -> float:
        model.zero_grad(set_to_none=True)
        start = time.thread_time()
        if ctx is None:
            loss = model(x).sum()
        else:
            with ctx:
                loss = model(x).sum()
        loss.backward()
        return time.thread_time() - start

    variants: dict[str, Optional[Any]] = {"no engine": None}
    for tag, package in packages.items():
        variants[f"{tag} none"] = package.engine(None)  # as a new user makes it: the defaults
    times: dict[str, list[float]] = {k: [] for k in variants}
    for round_ in range(WARMUP_ROUNDS + steps):
        for name, ctx in variants.items():
            t = step(ctx)
            if round_ >= WARMUP_ROUNDS:
                times[name].append(t)
    base = statistics.fmean(times["no engine"])
    rows = []
    for name, ts in times.items():
        mean = statistics.fmean(ts)
        rows.append({"variant": name, "step_ms": mean * 1e3, "x_no_engine": mean / base})
    for eng in variants.values():
        if eng is not None:
            eng.close()
    return rows


REGIONS = 10
"""Blocks the chain is cut into for the regions rows: a plan per block, every one kept."""
PROFILE_STEPS_MAX = 30
"""Steps an engine with regions gets to finish profiling before the regions rows time it."""


class _Sines(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            y = y.sin()
        return y


def region_rows(packages: dict[str, Any], saves: list[int], steps: int, spill_dir: str) -> list[dict]:
    """The chain cut into ``REGIONS`` blocks passed as ``regions=``, under a budget far above the
    step, once the plan is final: every block kept (issue 48's "regions all kept by the plan")."""
    rows = []
    for size, numel in (("tiny", TINY_NUMEL), ("real", REAL_NUMEL)):
        for n in saves:
            blocks = torch.nn.ModuleList(_Sines(n // REGIONS) for _ in range(REGIONS))
            model = torch.nn.Sequential(*blocks)
            mb = n * numel * 4 / 2**20
            variants: dict[str, Optional[Any]] = {"no hooks": None, "bare": "bare"}
            for tag, package in packages.items():
                eng = package.engine(
                    100 * mb + 1, regions=blocks, model=model, min_offload_bytes=0, spill_dir=spill_dir
                )
                for _ in range(PROFILE_STEPS_MAX):
                    region_step(model, numel, eng)
                    if not eng.profiling:
                        break
                variants[f"{tag} regions keep"] = eng
            times: dict[str, list[float]] = {k: [] for k in variants}
            for round_ in range(WARMUP_ROUNDS + steps):
                for name, ctx in variants.items():
                    if ctx == "bare":
                        ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
                    t = region_step(model, numel, ctx)
                    if round_ >= WARMUP_ROUNDS:
                        times[name].append(t)
            for row in per_save_rows(size, n, times):
                ctx = variants[row["variant"]]
                decisions = None
                if ctx is not None and ctx != "bare" and ctx.plan is not None:
                    decisions = sorted({d.value for d in ctx.plan.decisions})
                rows.append(row | {"counted_step_ms": float("nan"), "decisions": decisions})
                print(row_line(rows[-1]), flush=True)
            for eng in variants.values():
                if eng is not None and eng != "bare":
                    eng.close()
    return rows


def region_step(model: torch.nn.Module, numel: int, ctx: Optional[Any]) -> float:
    """Thread CPU seconds of one forward of ``model`` under ``ctx`` and its backward."""
    x = torch.randn(numel, requires_grad=True)
    start = time.thread_time()
    if ctx is None:
        y = model(x)
    else:
        with ctx:
            y = model(x)
    y.sum().backward()
    return time.thread_time() - start


def machine() -> dict:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="another checkout, imported beside this one and interleaved with it")
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (after the warm-up)")
    parser.add_argument("--saves", default="100,1000,10000", help="saves per step, comma-separated")
    parser.add_argument("--layers-steps", type=int, default=30, help="timed rounds of the layer stack")
    parser.add_argument("--json-out", help="also write the JSON line here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="offload: the latest step saved")  # the layers' saves are small
    packages = {"new": offload}
    if args.old:
        packages["old"] = import_old(args.old)
    saves = [int(s) for s in args.saves.split(",")]
    spill_dir = tempfile.mkdtemp(prefix="scale-saves-")
    atexit.register(shutil.rmtree, spill_dir, ignore_errors=True)
    header = f"{'tensors':7} {'saves':>6} {'variant':14} {'step ms':>9} {'us/save':>8} {'x bare':>7} {'1st ms':>9}"
    print(header, flush=True)
    chains = chain_rows(packages, saves, args.steps, spill_dir)
    regions = region_rows(packages, saves, args.steps, spill_dir)
    layers = layers_rows(packages, args.layers_steps)

    print(f"\n{header}")
    for r in chains:
        print(row_line(r))
    print(f"\nthe chain cut into {REGIONS} regions, every one kept by the final plan:")
    for r in regions:
        print(row_line(r), r["decisions"])
    print(f"\n{LAYERS} Linear({LAYER_WIDTH}, {LAYER_WIDTH}) layers, batch {LAYER_ROWS}, forward + backward:")
    for r in layers:
        print(f"  {r['variant']:12} {r['step_ms']:9.3f} ms  {r['x_no_engine']:.3f} x no engine")
    payload = {
        "bench": "scale_saves",
        "machine": machine(),
        "steps": args.steps,
        "goals": GOALS,
        "chains": chains,
        "regions": regions,
        "layers": layers,
        "old": args.old,
    }
    line = json.dumps(payload)
    print(line)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    return payload


if __name__ == "__main__":
    main()
