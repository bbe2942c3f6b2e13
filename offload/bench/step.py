"""The step benchmark: train MiniGPT a few steps under each way of handling saved activations.

Every configuration trains the same model (same seed, same weights, same batches, the RNG reseeded
before each step so dropout draws the same masks) and records, per step, the loss, the step time,
the peak memory and what the engine did. The engine never changes the math, so on a deterministic
device each configuration's losses must equal the reference's exactly; the table says whether they
do.

    configuration        what saved activations do
    ------------------   ------------------------------------------------------------------------
    none                 stay on the device (the reference)
    checkpoint           torch.utils.checkpoint(use_reentrant=False) on every block: only block
                         inputs are kept, each block's forward re-runs in backward
    save_on_cpu          torch.autograd.graph.save_on_cpu: every one copied to host memory (pinned
                         on CUDA) and back, synchronously
    offload-50%, -25%    offload.engine(policy="offload", regions=model.blocks) with a budget of
                         that share of the reference's saved bytes
    auto-50%, -25%       offload.engine(policy="auto", ...): keep, offload or recompute per block
    recompute            offload.engine(policy="recompute"): the engine's own checkpointing

How memory is measured, and why in a fresh process per configuration on the CPU::

    parent ──spawn──▶ child "none"   ──JSON lines (one per step, then a summary)──▶ parent
           ──spawn──▶ child "offload-25%" (budget from the reference's saved bytes) ──▶ parent
           ...        (CUDA: one child runs every configuration in turn)

- CUDA: ``torch.cuda.max_memory_allocated``, reset before each step. Configurations may share a
  process because the counter can be reset and the caching allocator's reserve is not counted.
- CPU: the process's peak resident set size. Before each step glibc hands freed heap back to the
  OS (``malloc_trim``) and the kernel's high-water mark (VmHWM) is reset through
  ``/proc/self/clear_refs``, where Linux allows it; elsewhere ``ru_maxrss``, which never goes
  down. Either way a configuration's figure must not inherit another's heap, so each runs in its
  own process, started with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_BYTES``) so
  that freed activations leave the RSS. Spill files land in the page cache, which RSS does not
  count.

Step time is the median over the measured steps, after warm-up steps that are trained and
recorded (their losses are compared too) but not timed: the engine's regions profile and plan on
the first steps (up to three for "auto"; any step that still profiles counts as warm-up). The configurations run one after another, not interleaved, so slow drift on a
shared machine shows up as noise between rows; rerun on a quiet machine before quoting numbers.

    python -m offload.bench --demo                      # CPU, under 3 minutes on 2 cores
    python -m offload.bench --preset h200 --out out/h200
    python -m offload.bench --layers 2 --hidden 64 --seq 64 --configs none,offload-25%

Outputs in ``--out``: ``metrics.csv`` (one row per step and configuration), ``summary.json``
(everything, including each engine's plan and a resident-bytes trace over one step),
``step.png`` when matplotlib is installed, a table on stdout and, last, one line of JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

import offload
from offload.bench import report
from offload.bench.config import DTYPES, MB, PRESETS, VARIANTS, Kind, RunSettings, Variant
from offload.models import MiniGPT, batches, load_corpus

__all__ = ["main", "run_one"]

DEFAULT_OUT = Path("out") / "bench"
"""Where outputs go without ``--out``, relative to the working directory."""

LEARNING_RATE = 1e-3
"""AdamW learning rate: small enough that a few steps of bf16 training stay finite."""

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS workspace setting that ``torch.use_deterministic_algorithms`` requires on CUDA."""

_JSON_PREFIX = "@offload-bench "
"""Marks a child's result lines on stdout, so stray prints from libraries are never parsed."""

MALLOC_MMAP_THRESHOLD_BYTES = 128 * 1024
"""CPU children: glibc serves allocations at least this large with mmap and unmaps them on free.
glibc's default raises the threshold after each large free (up to 32 MiB), after which freed
activations stay in the heap and RSS stops tracking live memory; fixing it (``MALLOC_MMAP_THRESHOLD_``)
makes peak RSS a measure of what was alive. 128 KiB is glibc's own starting value."""

_STDERR_TAIL_CHARS = 4000
"""How much of a failed child's stderr to show."""


# ---------------------------------------------------------------------------------------------
# one configuration, in this process


class PeakMemory:
    """Peak memory of a step: CUDA allocated bytes, or this process's peak resident set size."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.source = "cuda.max_memory_allocated"
        elif _reset_hwm():
            self.source = "VmHWM (malloc_trim, then reset per step)"
        else:
            self.source = "ru_maxrss (whole process)"

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.source.startswith("VmHWM"):
            _release_free_heap()
            _reset_hwm()

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.source.startswith("VmHWM"):
            return _proc_status_bytes("VmHWM")
        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def current_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        rss = _proc_status_bytes("VmRSS")
        return rss if rss else self.peak_bytes()


def _release_free_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), so RSS counts live memory.

    Without it glibc keeps the previous step's freed activations mapped, and every step's peak
    starts from the largest heap any earlier step reached.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_hwm() -> bool:
    """Reset this process's peak-RSS mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _proc_status_bytes("VmHWM") > 0


def _proc_status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return 0
    return int(match.group(1)) * 1024 if match else 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ResidentTrace:
    """Engine resident bytes and device memory at the block boundaries of one step.

    A forward hook on each block samples after its forward; a hook on the block's output gradient
    samples just before its backward. Reading ``eng.stats`` retires completed copies a little
    earlier than the engine would on its own; the trace is taken on the last step only, and its
    2 x layers + 3 samples add well under a millisecond to that step's time.
    """

    def __init__(self, blocks, engine, memory: PeakMemory) -> None:
        self.engine, self.memory = engine, memory
        self.samples: list[dict] = []
        self._handles = [
            block.register_forward_hook(functools.partial(self._after_forward, i)) for i, block in enumerate(blocks)
        ]

    def sample(self, phase: str) -> None:
        resident = self.engine.stats.resident_bytes if self.engine is not None else None
        self.samples.append({"phase": phase, "resident_bytes": resident, "memory_bytes": self.memory.current_bytes()})

    def _after_forward(self, index: int, module, args, output) -> None:
        self.sample(f"fwd{index}")
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self.sample(f"bwd{index}"))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _checkpoint_blocks(model: MiniGPT) -> None:
    """Every block's forward through ``torch.utils.checkpoint`` (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def _build(run: RunSettings, device: torch.device):
    torch.manual_seed(run.seed)
    with torch.device(device):
        model = MiniGPT(run.gpt_config())
    model = model.to(DTYPES[run.dtype]).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    return model, optimizer


def _measure_saved_bytes(model: MiniGPT, x: torch.Tensor, y: torch.Tensor, run: RunSettings) -> int:
    """Bytes of distinct saved storages one forward leaves for backward (an engine that only counts)."""
    counter = offload.engine(budget_mb=None, model=model, **_engine_kwargs(run))
    try:
        with counter:
            _, loss = model(x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return counter.stats.saved_bytes
    finally:
        counter.close()


def _engine_kwargs(run: RunSettings) -> dict:
    kwargs = {}
    if run.min_offload_bytes is not None:
        kwargs["min_offload_bytes"] = run.min_offload_bytes
    if run.spill_dir is not None:
        kwargs["spill_dir"] = run.spill_dir
    return kwargs


def run_one(
    run: RunSettings,
    variant: Variant,
    data: torch.Tensor,
    *,
    activation_bytes: Optional[int] = None,
    emit: Callable[[dict], None] = lambda record: None,
) -> dict:
    """Train ``run.total_steps`` steps under ``variant`` in this process; return its summary.

    Each step is passed to ``emit`` as it finishes. ``activation_bytes`` (the reference's saved
    bytes) sizes budgets; measured here when a budget needs it and it is None.
    """
    device = torch.device(run.device)
    model, optimizer = _build(run, device)
    stream = batches(data, run.batch, run.seq, torch.Generator().manual_seed(run.seed))
    memory = PeakMemory(device)
    engine, machine, budget_mb = None, None, None
    forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    if variant.budget_fraction is not None and activation_bytes is None:
        x, y = next(batches(data, run.batch, run.seq, torch.Generator().manual_seed(run.seed)))
        activation_bytes = _measure_saved_bytes(model, x.to(device), y.to(device), run)
    if variant.kind is Kind.CHECKPOINT:
        _checkpoint_blocks(model)
    elif variant.kind is Kind.SAVE_ON_CPU:
        forward_context = functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=device.type == "cuda")
    elif variant.kind is Kind.ENGINE:
        if variant.budget_fraction is not None:
            budget_mb = variant.budget_fraction * activation_bytes / MB
        if variant.policy in ("auto", "offload"):
            machine = offload.probe(device, spill_dir=run.spill_dir)  # cached on disk after the first
        engine = offload.engine(
            budget_mb, policy=variant.policy, regions=model.blocks, model=model, machine=machine,
            **_engine_kwargs(run),
        )
        forward_context = lambda: engine  # noqa: E731 - the engine is its own context manager

    trace = None
    try:
        for step, (x, y) in zip(range(run.total_steps), stream):
            x, y = x.to(device), y.to(device)
            last = step == run.total_steps - 1
            if last:
                trace = ResidentTrace(model.blocks, engine, memory)
            torch.manual_seed(run.seed + 1 + step)  # same dropout masks in every configuration
            profiling = engine is not None and engine.profiling  # a profiling step is never timed
            if engine is not None:
                engine.reset_stats()
            _sync(device)
            memory.reset()
            if trace is not None:
                trace.sample("start")
            start = time.perf_counter()
            with forward_context():
                _, loss = model(x, y)
            if trace is not None:
                trace.sample("loss")
            loss.backward()
            if trace is not None:
                trace.sample("backward")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            step_ms = (time.perf_counter() - start) * 1e3
            row = {
                "type": "step",
                "config": variant.name,
                "step": step,
                "warmup": step < run.warmup or profiling,
                "loss": loss.item(),
                "step_ms": step_ms,
                "peak_bytes": memory.peak_bytes(),
                "budget_mb": budget_mb,
            }
            if engine is not None:
                row.update(engine.stats.to_dict())
            emit(row)
            del loss
        if trace is not None:
            trace.remove()
        if variant.kind is Kind.NONE:
            x, y = next(stream)
            activation_bytes = _measure_saved_bytes(model, x.to(device), y.to(device), run)
        summary = {
            "type": "summary",
            "config": variant.name,
            "activation_bytes": activation_bytes,
            "budget_mb": budget_mb,
            "peak_source": memory.source,
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "plan": None if engine is None or engine.plan is None else str(engine.plan),
            "machine": None if machine is None else dataclasses.asdict(machine),
            "trace": trace.samples if trace is not None else [],
            **_device_facts(device),
        }
        return summary
    finally:
        if engine is not None:
            engine.close()
        del model, optimizer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _device_facts(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"device_name": report.cpu_model()}
    props = torch.cuda.get_device_properties(device)
    return {
        "device_name": props.name,
        "device_memory_gb": round(props.total_memory / 1e9, 1),
        "cuda": torch.version.cuda,
    }


@contextlib.contextmanager
def _determinism(run: RunSettings):
    """Deterministic kernels where torch has them (a warning where it has not), restored on exit.

    New tensors are not NaN-filled (a debugging aid of deterministic mode): that would add a fill
    to every reload buffer and skew the timings.
    """
    if not run.deterministic:
        yield
        return
    if run.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)  # read at cuBLAS init
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        import torch.utils.deterministic as fill_flag  # torch >= 2.1
    except ImportError:
        fill_flag = None
    fill = getattr(fill_flag, "fill_uninitialized_memory", None)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if fill_flag is not None:
        fill_flag.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        if fill_flag is not None:
            fill_flag.fill_uninitialized_memory = fill


def _child(spec_json: str) -> int:
    """``--one``: run the named configurations in this process, printing one JSON line per record."""
    spec = json.loads(spec_json)
    run = RunSettings(**spec["run"])
    activation_bytes = spec.get("activation_bytes")

    def emit(record: dict) -> None:
        sys.stdout.write(_JSON_PREFIX + json.dumps(record) + "\n")
        sys.stdout.flush()

    data = load_corpus()
    failed = False
    for name in spec["variants"]:
        try:
            with _determinism(run):
                summary = run_one(run, VARIANTS[name], data, activation_bytes=activation_bytes, emit=emit)
        except Exception as error:  # noqa: BLE001 - reported to the parent, which tables it as failed
            failed = True
            emit({"type": "error", "config": name, "error": f"{type(error).__name__}: {error}"})
            gc.collect()
            if run.device.startswith("cuda"):
                torch.cuda.empty_cache()
            continue
        if activation_bytes is None:
            activation_bytes = summary["activation_bytes"]
        emit(summary)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# the parent: spawn, collect, report


class _Progress:
    """A one-line progress bar on stderr (a line per configuration when stderr is not a terminal)."""

    WIDTH = 24

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = sys.stderr.isatty()

    def step(self, config: str, step: int, steps: int, step_ms: float) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.tty:
            filled = self.WIDTH * self.done // max(self.total, 1)
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            sys.stderr.write(f"\r[{bar}] {self.done}/{self.total}  {config:<12} step {step + 1}/{steps}  "
                             f"{step_ms:8.1f} ms ")
            sys.stderr.flush()
        elif step + 1 == steps:
            sys.stderr.write(f"bench: {config} done ({self.done}/{self.total} steps)\n")

    def finish(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def _spawn(run: RunSettings, names: list[str], activation_bytes, on_record: Callable[[dict], None]) -> tuple[int, str]:
    """Run configurations ``names`` in a fresh ``python -m offload.bench --one`` process."""
    spec = {"run": dataclasses.asdict(run), "variants": names, "activation_bytes": activation_bytes}
    env = dict(os.environ)
    package_root = str(Path(offload.__file__).resolve().parents[1])  # works without an install too
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    if run.deterministic:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    if run.device == "cpu":
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MALLOC_MMAP_THRESHOLD_BYTES))
    with _TempText() as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "offload.bench", "--one", json.dumps(spec)],
            stdout=subprocess.PIPE, stderr=err.file, text=True, env=env,
        )
        for line in proc.stdout:
            if line.startswith(_JSON_PREFIX):
                on_record(json.loads(line[len(_JSON_PREFIX):]))
        code = proc.wait()
        return code, err.read()


class _TempText:
    """A temporary file for a child's stderr (a pipe could fill up and stall the child)."""

    def __enter__(self):
        self.file = tempfile.TemporaryFile(mode="w+")
        return self

    def read(self) -> str:
        self.file.seek(0)
        return self.file.read()

    def __exit__(self, *exc) -> None:
        self.file.close()


def _collect(run: RunSettings, names: list[str], in_process: bool, progress: _Progress) -> dict[str, dict]:
    """Run every configuration; return per name: its step rows, its summary, or its error."""
    results: dict[str, dict] = {name: {"steps": [], "summary": None, "error": None} for name in names}

    def on_record(record: dict) -> None:
        result = results[record["config"]]
        if record["type"] == "step":
            result["steps"].append(record)
            progress.step(record["config"], record["step"], run.total_steps, record["step_ms"])
        elif record["type"] == "summary":
            result["summary"] = record
        else:
            result["error"] = record["error"]

    activation_bytes = None
    if in_process:
        data = load_corpus()
        for name in names:
            try:
                with _determinism(run):
                    summary = run_one(run, VARIANTS[name], data, activation_bytes=activation_bytes, emit=on_record)
            except Exception as error:  # noqa: BLE001 - tabled as failed, the others still run
                on_record({"type": "error", "config": name, "error": f"{type(error).__name__}: {error}"})
                continue
            activation_bytes = activation_bytes or summary["activation_bytes"]
            on_record(summary)
        return results

    # CPU: a fresh process per configuration (peak RSS must not inherit another's heap).
    # CUDA: one process for all (the peak counter resets; start-up is paid once).
    groups = [[name] for name in names] if run.device == "cpu" else [names]
    for group in groups:
        code, stderr = _spawn(run, group, activation_bytes, on_record)
        for name in group:
            result = results[name]
            if result["summary"] is None and result["error"] is None:
                tail = stderr.strip()[-_STDERR_TAIL_CHARS:]
                result["error"] = f"child process exited with code {code}" + (f":\n{tail}" if tail else "")
            if activation_bytes is None and result["summary"] is not None:
                activation_bytes = result["summary"]["activation_bytes"]
    return results



# ---------------------------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m offload.bench",
        description="Train MiniGPT a few steps under each way of handling activations; compare time, memory, losses.",
    )
    p.add_argument("--demo", action="store_true", help="the short CPU demo (same as --preset demo)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="; ".join(f"{k}: {v.help}" for k, v in PRESETS.items()))
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--steps", type=int, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, help="untimed steps first (trained, recorded, losses compared)")
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--device", choices=("cpu", "cuda"))
    p.add_argument("--attention", choices=("sdpa", "math"))
    p.add_argument("--dropout", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--min-offload-bytes", type=int, help="engine min_offload_bytes (default: the engine's)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.use_deterministic_algorithms(True, warn_only=True) in every configuration")
    p.add_argument("--spill-dir", help="engine spill directory (default: a private temp dir)")
    p.add_argument("--configs", help=f"comma-separated, from: {', '.join(VARIANTS)} (default: the preset's, or all)"
                   .replace("%", "%%"))  # argparse formats help with %
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    p.add_argument("--in-process", action="store_true",
                   help="run every configuration in this process (faster; CPU peak RSS then carries over)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--one", metavar="SPEC", help=argparse.SUPPRESS)  # internal: a child process
    return p


def _settings(args: argparse.Namespace) -> tuple[RunSettings, list[str]]:
    preset = PRESETS["demo" if args.demo else args.preset] if (args.demo or args.preset) else None
    values = dict(preset.settings) if preset else {}
    for field in dataclasses.fields(RunSettings):
        given = getattr(args, field.name, None)
        if given is not None:
            values[field.name] = given
    if "device" not in values:
        values["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if "dtype" not in values:
        values["dtype"] = "bf16" if values["device"] == "cuda" else "fp32"
    run = RunSettings(**values)
    run.gpt_config()  # validates the shape (ValueError names the field)
    if run.steps < 1 or run.warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {run.steps} and {run.warmup}")
    if args.configs:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown configuration(s) {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
    else:
        names = list(preset.variants) if preset else list(VARIANTS)
    names = sorted(set(names), key=list(VARIANTS).index)  # the reference runs first: it sizes the budgets
    return run, names


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark; returns 0, or 1 when a configuration failed (2 for bad arguments)."""
    args = _parser().parse_args(argv)
    if args.one is not None:
        return _child(args.one)
    try:
        run, names = _settings(args)
    except ValueError as error:
        print(f"offload.bench: error: {error}", file=sys.stderr)
        return 2
    if run.device == "cuda" and not torch.cuda.is_available():
        reason = "device cuda asked for, but torch.cuda.is_available() is False here"
        print(f"offload.bench: skipped: {reason}", file=sys.stderr)
        print(json.dumps({"benchmark": "step", "skipped": reason}))
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"offload.bench: MiniGPT {run.layers} layers x {run.hidden} (heads {run.heads}), seq {run.seq}, "
          f"batch {run.batch}, {run.dtype} on {run.device}; {run.warmup} warm-up + {run.steps} measured steps; "
          f"configurations: {', '.join(names)}", file=sys.stderr)
    progress = _Progress(len(names) * run.total_steps, enabled=not args.no_progress)
    started = time.perf_counter()
    try:
        results = _collect(run, names, args.in_process, progress)
    finally:
        progress.finish()
    rows = report.summarize(run, names, results)

    csv_path, summary_path = out / "metrics.csv", out / "summary.json"
    report.write_csv(csv_path, names, results)
    plot_path = report.plot(out / "step.png", rows, results, run)
    env = report.environment(results)
    payload = {
        "benchmark": "step",
        "settings": dataclasses.asdict(run),
        "env": env,
        "wall_s": round(time.perf_counter() - started, 1),
        "results": [{k: v for k, v in r.items() if k != "losses"} for r in rows],
        "csv": str(csv_path),
        "plot": None if plot_path is None else str(plot_path),
    }
    summary_path.write_text(json.dumps(
        payload | {"runs": {n: {"summary": results[n]["summary"], "error": results[n]["error"],
                                "losses": [s["loss"] for s in results[n]["steps"]]} for n in names}},
        indent=1) + "\n")

    where = env.get("device_name", run.device)
    print(f"MiniGPT {run.layers}x{run.hidden}, seq {run.seq}, batch {run.batch}, {run.dtype}, "
          f"{run.steps} measured steps; {where}; torch {env['torch']}; {env['date_utc']}")
    print(report.format_table(rows))
    if any(r["losses_match"] is False for r in rows) and run.device == "cuda" and not run.deterministic:
        print("note: without --deterministic, CUDA backward kernels may use atomics; losses can differ after step 0")
    print(f"metrics: {csv_path}\nsummary: {summary_path}")
    print(f"plot:    {plot_path}" if plot_path else "plot:    (matplotlib not installed: pip install offload[plot])")
    print(json.dumps(payload))
    return 1 if any(r["error"] is not None for r in rows) else 0
