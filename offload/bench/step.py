"""The step benchmark: train MiniGPT a few steps under each way of handling saved activations.

Every configuration trains the same model on the same batches with the same dropout masks
(``loop``); ``report`` tables, plots and judges what came out; bench/README.md says how to run it.
On the CPU each configuration runs in a fresh child process (``--one``, JSON lines back), so its
peak resident set is its own; on CUDA (or ``--in-process``) all run here, one after another.
``--repeats N`` runs everything N times, the order rotated each time.

    python -m offload.bench --demo | --preset h200|tiny|sweep [--out DIR] [--configs A,B] [--compile]

``--time-limit-s S`` skips the configurations that would not end within S seconds (judged by the
longest so far); SIGINT stops it with every finished configuration written.

Outputs in ``--out`` (default ``$OFFLOAD_BENCH_OUT``, else ``out/bench``; never the committed
``bench/results/`` without ``--overwrite-results``), rewritten as each configuration finishes (a
timeout keeps what ran):
``metrics.csv``, ``summary.json``, ``table.md``, ``step.png`` (with matplotlib); a table on
stdout and, last, one line of JSON. ``--demo`` (``make demo``), for a reader: the short table
with its legend, and the JSON goes to ``result.json`` under ``--out`` instead, as its last line says.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, get_args, get_type_hints

import torch

import offload
from offload._memory.arena import PinnedSlabs
from offload.bench import loop, measure, report
from offload.bench.config import DTYPES, PRESETS, REFERENCE, RunSettings, Variant, parse_variant
from offload.bench.measure import environment, write_json
from offload.models import load_corpus

__all__ = ["main"]


MALLOC_MMAP_THRESHOLD_BYTES = 128 * 1024
"""CPU children: glibc serves allocations at least this large with mmap and unmaps them on free.
glibc's default raises the threshold after each large free (up to 32 MiB), after which freed
activations stay in the heap and RSS stops tracking live memory. 128 KiB is glibc's own start."""

DEMO_JSON = "result.json"
"""``--demo``: the file under ``--out`` that takes the JSON line other presets print last."""

FINAL_WRITE_S = 5.0
"""Seconds ``--time-limit-s`` keeps for writing the outputs (the plot) after the last configuration."""

_JSON_PREFIX = "@offload-bench "  # marks a child's result lines: stray prints from libraries are never parsed
_STDERR_TAIL_CHARS = 4000  # how much of a crashed child's stderr its configuration's error keeps

Job = tuple[str, int]
"""One run of one configuration: (its name, the repeat)."""
Emit = Callable[[dict], None]
"""Where a job's records go: ``step`` and ``summary`` records (``loop.run_one``), or ``skipped`` or
``error``, each tagged with its job's ``config`` and ``repeat``."""


def _run_job(
    run: RunSettings,
    job: Job,
    data: torch.Tensor,
    activation_bytes: Optional[int],
    emit: Emit,
    slabs: Optional[PinnedSlabs] = None,
) -> None:
    """Run one job in this process (its engines' pinned memory shared through ``slabs``)."""
    name, repeat = job
    tag = {"config": name, "repeat": repeat}
    try:
        summary = loop.run_one(
            run,
            parse_variant(name),
            data,
            activation_bytes=activation_bytes,
            emit=lambda record: emit(record | tag),
            slabs=slabs,
        )
    except loop.Skipped as reason:
        emit({"type": "skipped", "skipped": str(reason)} | tag)
    except Exception as error:  # noqa: BLE001 - tabled as failed; the others still run
        emit({"type": "error", "error": f"{type(error).__name__}: {error}"} | tag)
        del error  # its traceback holds the failed configuration's model: free it before the next
        gc.collect()
    else:
        emit(summary | tag)


def _spawn(run: RunSettings, job: Job, activation_bytes: Optional[int], emit: Emit) -> tuple[int, str]:
    """Run one job in a fresh ``python -m offload.bench --one`` process; its exit code and stderr."""
    spec = {"run": dataclasses.asdict(run), "job": job, "activation_bytes": activation_bytes}
    package_root = str(Path(offload.__file__).resolve().parents[1])  # works without an install too
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MALLOC_MMAP_THRESHOLD_BYTES))
    with tempfile.TemporaryFile(mode="w+") as err:  # a pipe could fill up and stall the child
        command = [sys.executable, "-m", "offload.bench", "--one", json.dumps(spec)]
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as child:
            for line in child.stdout or ():
                if line.startswith(_JSON_PREFIX):
                    emit(json.loads(line[len(_JSON_PREFIX) :]))
        err.seek(0)
        return child.returncode, err.read()


def collect(
    run: RunSettings,
    variants: list[Variant],
    in_process: bool,
    on_done: Callable[[dict[str, list[dict]]], object] = lambda results: None,
    deadline: Optional[float] = None,
) -> dict[str, list[dict]]:
    """Run every configuration ``run.repeats`` times; per name, one record set per repeat:
    ``{"steps": [...], "summary", "error", "skipped"}``. ``on_done`` sees the results so far
    each time a configuration finishes. ``deadline`` (``time.perf_counter()`` seconds): a job that
    would end after it, judged by the longest job so far, is skipped, and so is every one after it
    (a part with a time limit measures what fits instead of being cut off mid-job)."""
    names = [v.name for v in variants]
    results: dict[str, list[dict[str, Any]]] = {
        n: [{"steps": [], "summary": None, "error": None, "skipped": None} for _ in range(run.repeats)] for n in names
    }
    head, rest = (names[:1], names[1:]) if names[0] == REFERENCE.name else ([], names)
    turns = [r % max(len(rest), 1) for r in range(run.repeats)]  # repeat r starts r places further into the rest
    jobs = [(n, r) for r, turn in enumerate(turns) for n in head + rest[turn:] + rest[:turn]]
    activation_bytes: Optional[int] = None  # the reference's, once measured: it sizes every budget

    def emit(record: dict) -> None:
        nonlocal activation_bytes
        measure.raise_if_interrupted()  # every step reports here (see measure.remember_sigint)
        result, kind = results[record["config"]][record["repeat"]], record["type"]
        if kind == "step":
            result["steps"].append(record)
            return
        if kind == "summary":
            result["summary"] = record
            activation_bytes = activation_bytes or record["activation_bytes"]
        else:
            result[kind] = record[kind]
        what = "done" if kind == "summary" else kind
        print(f"bench: {record['config']} (repeat {record['repeat'] + 1}/{run.repeats}) {what}", file=sys.stderr)
        on_done(results)

    longest_s = 0.0

    def fits() -> bool:
        return deadline is None or time.perf_counter() + longest_s <= deadline

    def skip_the_rest(index: int, why: str) -> None:
        for name, repeat in jobs[index:]:
            results[name][repeat]["skipped"] = why
        on_done(results)

    if in_process or run.device != "cpu":
        data = load_corpus()
        # One pool of pinned slabs for every engine here: each configuration takes the slabs the
        # one before it pinned instead of pinning (and unpinning) them again.
        slabs = PinnedSlabs() if run.device == "cuda" else None
        try:
            for index, job in enumerate(jobs):
                if not fits():
                    skip_the_rest(index, f"not run: it would pass the time limit (longest job {longest_s:.0f} s)")
                    break
                started = time.perf_counter()
                _run_job(run, job, data, activation_bytes, emit, slabs)
                longest_s = max(longest_s, time.perf_counter() - started)
        finally:
            if slabs is not None:
                slabs.clear(settle=torch.cuda.synchronize)
        return results
    for index, (name, repeat) in enumerate(
        jobs
    ):  # CPU: a fresh process per configuration (peak RSS must not inherit another's heap)
        if not fits():
            skip_the_rest(index, f"not run: it would pass the time limit (longest job {longest_s:.0f} s)")
            break
        started = time.perf_counter()
        code, stderr = _spawn(run, (name, repeat), activation_bytes, emit)
        longest_s = max(longest_s, time.perf_counter() - started)
        result = results[name][repeat]
        if all(result[k] is None for k in ("summary", "error", "skipped")):
            tail = stderr.strip()[-_STDERR_TAIL_CHARS:]
            result["error"] = f"child process exited with code {code}" + (f":\n{tail}" if tail else "")
            on_done(results)
    return results


_CHOICES = {"dtype": sorted(DTYPES), "device": ("cpu", "cuda"), "attention": ("sdpa", "math")}
_FLAG_HELP = {
    "deterministic": "timed steps under torch.use_deterministic_algorithms(True, warn_only=True)",
    "check_grads": "first-step gradients under strict determinism, compared with the reference's (default on)",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m offload.bench",
        description="Train MiniGPT a few steps under each way of handling activations; "
        "compare time, memory, gradients.",
    )
    for switch, switch_help in (
        ("--demo", "the short CPU demo (same as --preset demo)"),
        ("--compile", "each configuration also with torch.compile'd blocks"),
        ("--in-process", "run every configuration in this process (CUDA always does; CPU peak RSS then carries over)"),
        ("--no-progress", "accepted for compatibility: progress is one line per configuration"),
    ):
        p.add_argument(switch, action="store_true", help=switch_help)
    presets = "; ".join(f"{k}: {v.help}" for k, v in PRESETS.items())
    p.add_argument("--preset", choices=sorted(PRESETS), help=presets.replace("%", "%%"))
    hints = get_type_hints(RunSettings)
    for field in dataclasses.fields(RunSettings):  # a flag per setting; one not given stays None: the preset's
        flag, flag_help = "--" + field.name.replace("_", "-"), _FLAG_HELP.get(field.name)
        # The annotated type, Optional[X] read as X.
        kind = next(t for t in get_args(hints[field.name]) or (hints[field.name],) if t is not type(None))
        if field.name in _CHOICES:
            p.add_argument(flag, choices=_CHOICES[field.name], help=flag_help)
        elif kind is bool:  # --x / --no-x: type=bool would read "--x False" as True
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=flag_help)
        else:
            p.add_argument(flag, type=kind, help=flag_help)
    examples = ", ".join(v.name for v in PRESETS["tiny"].variants)
    p.add_argument(
        "--configs",
        help=f"comma-separated configuration names, e.g. {examples} (default: the preset's)".replace("%", "%%"),
    )
    p.add_argument(
        "--out", type=Path, help=f"output directory (default: ${measure.OUT_ENV}, else {measure.DEFAULT_OUT})"
    )
    p.add_argument("--overwrite-results", action="store_true", help="let --out write into the committed bench/results/")
    p.add_argument(
        "--time-limit-s",
        type=float,
        help="seconds from the first configuration on: one that would end later (by the longest so far) "
        "is skipped, and the rest with it, and the run still reports (default: no limit)",
    )
    p.add_argument("--one", metavar="SPEC", help=argparse.SUPPRESS)  # internal: a child process
    return p


def _settings(args: argparse.Namespace) -> tuple[RunSettings, list[Variant]]:
    preset = PRESETS.get("demo" if args.demo else args.preset)
    values = dict(preset.settings) if preset else {}
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunSettings)}
    values |= {name: value for name, value in given.items() if value is not None}
    values.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    values.setdefault("dtype", "bf16" if values["device"] == "cuda" else "fp32")
    run = RunSettings(**values)
    run.gpt_config()  # validates the shape (ValueError names the field)
    if run.steps < 1 or run.warmup < 0 or run.repeats < 1:
        raise ValueError(
            f"--steps and --repeats must be >= 1 and --warmup >= 0, got {run.steps}, {run.repeats}, {run.warmup}"
        )
    names = [name.strip() for name in (args.configs or "").split(",") if name.strip()]
    if args.configs is not None and not names:
        raise ValueError(f"--configs {args.configs!r} names no configuration; e.g. --configs none,offload-25%")
    variants = [parse_variant(name) for name in names] if names else list((preset or PRESETS["demo"]).variants)
    if args.compile:
        variants = [w for v in variants for w in (v, dataclasses.replace(v, compiled=True)) if not v.compiled]
    # The reference runs first: it sizes the budgets.
    variants = sorted(dict.fromkeys(variants), key=lambda v: v != REFERENCE)
    return run, variants


def _to_parent(record: dict) -> None:
    print(_JSON_PREFIX + json.dumps(record), flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark; returns 0, or 1 when a configuration failed or its gradient check did (the
    payload's ``failures`` say which and why), 2 for bad arguments."""
    args = _parser().parse_args(argv)
    if args.one is not None:  # a child process (``_spawn``): its records go to stdout, one JSON line each
        spec = json.loads(args.one)
        name, repeat = spec["job"]
        _run_job(RunSettings(**spec["run"]), (name, repeat), load_corpus(), spec["activation_bytes"], _to_parent)
        return 0
    try:
        run, variants = _settings(args)
        args.out = measure.check_out(args.out or measure.out_dir(), args.overwrite_results)
    except ValueError as error:
        print(f"offload.bench: error: {error}", file=sys.stderr)
        return 2
    if run.device == "cuda" and not torch.cuda.is_available():
        reason = "device cuda asked for, but torch.cuda.is_available() is False here"
        print(f"offload.bench: skipped: {reason}", file=sys.stderr)
        print(json.dumps({"benchmark": "step", "skipped": reason}))
        return 0
    if run.device == "cuda":  # read when cuBLAS initializes: before this process's first matmul
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", loop.CUBLAS_WORKSPACE_CONFIG)

    args.out.mkdir(parents=True, exist_ok=True)
    measure.remember_sigint()
    started = time.perf_counter()
    device = torch.device(run.device)
    machine = offload.probe(device)  # measured once, cached on disk: children read the cache
    reporter = report.Report(args.out, run, variants, environment(device), machine)
    print(f"offload.bench: {reporter.title()}; configurations: {', '.join(v.name for v in variants)}", file=sys.stderr)
    # The margin: writing the plot and the files after the last job.
    deadline = None if args.time_limit_s is None else time.perf_counter() + args.time_limit_s - FINAL_WRITE_S
    try:
        results = collect(run, variants, args.in_process, on_done=reporter.write, deadline=deadline)
    except KeyboardInterrupt:  # a part's timeout (SIGINT): the files hold every job that finished
        print(f"offload.bench: interrupted; {args.out} holds every configuration that finished", file=sys.stderr)
        return 130
    payload = reporter.write(results, wall_s=time.perf_counter() - started)
    demo = args.demo or args.preset == "demo"
    print(reporter.text(reader=demo))
    for failure in payload["failures"]:
        print(f"offload.bench: FAILED {failure}", file=sys.stderr)
    if demo:  # a reader's terminal: the JSON line goes to a file, and the table says where
        path = write_json(args.out / DEMO_JSON, payload)
        plot = f", the plot {payload['plot']}" if payload["plot"] else ""
        print(f"\nThe run's JSON: {path}; every column: {args.out / 'table.md'}{plot}.")
    else:
        print(json.dumps(payload))
    return 1 if payload["failures"] else 0
