"""A moved save's own work, copies excluded: this checkout against another, interleaved (issue 48).

    python bench/moved_save.py --old CHECKOUT [--saves 200,1000] [--rounds 30] [--json-out PATH]

A step is a chain of N tiny ``sin`` ops (64 fp32 each, each saving its input) under an engine at
half the step's bytes, moving into a host tier over ``overhead.CopyingLink`` (synchronous copies on
this thread, timed, no disk), and its backward, in this thread's CPU time. Per round each variant
runs once (no hooks, a bare pair, this checkout's engine, ``--old``'s), so drift hits all alike. A
moved save's own work = (engine step - no-hooks step - the link's copy time) / tensors moved, the
median over the rounds; × bare = over a bare ``saved_tensors_hooks(lambda t: t, lambda t: t)``
pair's extra per saved tensor. A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `import offload` from a checkout
import offload  # noqa: E402
from overhead import CopyingLink  # noqa: E402
from scale_saves import import_old, machine  # noqa: E402

NUMEL = 64
WARMUP_ROUNDS = 2


def step(n: int, ctx: Any) -> float:
    x = torch.ones(NUMEL, requires_grad=True)
    start = time.thread_time()
    with ctx:
        y = x.clone()
        for _ in range(n):
            y = y.sin()
    y.sum().backward()
    return time.thread_time() - start


def measure(packages: dict[str, Any], n: int, rounds: int) -> dict:
    links = {tag: CopyingLink() for tag in packages}
    engines = {
        tag: package.engine(n * NUMEL * 4 / 2 / 2**20, min_offload_bytes=0, device="cpu", link=links[tag])
        for tag, package in packages.items()
    }
    contexts = {
        "no hooks": contextlib.nullcontext,
        "bare": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        **{tag: (lambda e=eng: e) for tag, eng in engines.items()},
    }
    times: dict[str, list[float]] = {k: [] for k in contexts}
    copies: dict[str, list[float]] = {k: [] for k in engines}
    moved: dict[str, int] = {}
    for round_ in range(WARMUP_ROUNDS + rounds):
        for name, make in contexts.items():
            if name in engines:
                engines[name].reset_stats()
                copied = links[name].copy_s
            t = step(n, make())
            if round_ < WARMUP_ROUNDS:
                continue
            times[name].append(t)
            if name in engines:
                copies[name].append(links[name].copy_s - copied)
                moved[name] = engines[name].stats.offloaded_bytes // (NUMEL * 4)
    for eng in engines.values():
        eng.close()
    base = times["no hooks"]
    bare_us = statistics.median((b - t) / n * 1e6 for b, t in zip(times["bare"], base, strict=True))
    out = {"saves": n, "rounds": rounds, "no_hooks_ms": statistics.median(base) * 1e3, "bare_us": bare_us}
    for tag in engines:
        own = [(t - b - c) / moved[tag] * 1e6 for t, b, c in zip(times[tag], base, copies[tag], strict=True)]
        us = statistics.median(own)
        out[tag] = {
            "moved": moved[tag],
            "own_us_per_moved": us,
            "x_bare": us / bare_us if bare_us > 0 else float("nan"),
            "step_ms": statistics.median(times[tag]) * 1e3,
        }
    return out


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="another checkout, imported beside this one and interleaved with it")
    parser.add_argument("--saves", default="200,1000", help="saves per step, comma-separated")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="offload:")
    packages = {"new": offload}
    if args.old:
        packages["old"] = import_old(args.old)
    rows = [measure(packages, int(n), args.rounds) for n in args.saves.split(",")]
    print(f"{'saves':>6} {'engine':6} {'moved':>6} {'own us/moved':>13} {'x bare':>7} {'step ms':>8}")
    for row in rows:
        for tag in packages:
            r = row[tag]
            print(
                f"{row['saves']:>6} {tag:6} {r['moved']:>6} {r['own_us_per_moved']:13.1f} "
                f"{r['x_bare']:7.1f} {r['step_ms']:8.1f}"
            )
        print(f"{'':>6} bare pair {row['bare_us']:.2f} us per saved tensor; no hooks {row['no_hooks_ms']:.1f} ms")
    payload = {"bench": "moved_save", "machine": machine(), "old": args.old, "rows": rows}
    line = json.dumps(payload)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(line)
    return payload


if __name__ == "__main__":
    main()
