"""The store's cost, old code against new, interleaved in one driver: the hook pair and a step.

    python bench/store_perf.py --old /path/to/old/checkout [--new .] [--rounds 7] [--json-out PATH]

Each round runs one worker process per checkout (``PYTHONPATH`` pointing at it), alternating
which goes first, so load that drifts over the run falls on both. A worker measures, on the CPU:

- ``hook_pair_us``: forward and backward of a chain of tiny ``sin`` ops under an engine at budget
  None, per saved tensor (pack and unpack of each, plus the op itself, which both sides share);
- ``step_none_ms``, ``step_0_ms``, ``step_small_ms``: one MiniGPT training step (forward, backward)
  under an engine at budget None, at 0 (everything to the spill file and back) and at a small
  budget (``SMALL_BUDGET_FRACTION`` of one step's saved bytes).

Each figure is a worker's median over its repetitions, in wall time and in CPU time (this
process's threads: less disturbed by other load on a shared machine); the table gives the median
over rounds per checkout, and new/old as the median of the rounds' ratios. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHAIN_LENGTH = 2000
"""Saved tensors per chain: enough that a few us per tensor dwarfs the timer's noise."""
CHAIN_REPEATS = 15
STEP_REPEATS = 9
WARMUP = 2
SMALL_BUDGET_FRACTION = 0.25
"""The small budget, as a share of one step's saved bytes."""
FIGURES = ("hook_pair_us", "step_none_ms", "step_0_ms", "step_small_ms")


def _timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of ``fn()``; CPU time counts this process's threads (the spill workers too)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _medians(samples: list[tuple[float, float]], scale: float) -> tuple[float, float]:
    return statistics.median(w for w, _ in samples) * scale, statistics.median(c for _, c in samples) * scale


def _worker(steps: bool) -> dict:
    import torch

    import offload
    from offload.models.gpt import GPTConfig, MiniGPT

    torch.manual_seed(0)
    torch.set_num_threads(1)
    result: dict = {"offload": os.path.dirname(offload.__file__)}

    x = torch.ones(16, requires_grad=True)
    counting = offload.engine(None, device="cpu", min_offload_bytes=0)

    def chain() -> None:
        with counting:
            y = x
            for _ in range(CHAIN_LENGTH):
                y = y.sin()
        y.sum().backward()

    for _ in range(WARMUP):
        chain()
    samples = [_timed(chain) for _ in range(CHAIN_REPEATS)]
    result["hook_pair_us"], result["hook_pair_us_cpu"] = _medians(samples, 1e6 / CHAIN_LENGTH)
    counting.close()
    if not steps:
        return result

    model = MiniGPT(GPTConfig(n_layer=4, n_embd=128, seq_len=128))
    idx = torch.randint(0, 256, (4, 128))
    targets = torch.randint(0, 256, (4, 128))

    def step(eng) -> None:
        model.zero_grad(set_to_none=True)
        with eng:
            _, loss = model(idx, targets)
        loss.backward()

    with tempfile.TemporaryDirectory() as spill_dir:
        probe = offload.engine(None, device="cpu")
        step(probe)
        saved_mb = probe.stats.saved_bytes / 2**20
        probe.close()
        budgets = {"step_none_ms": None, "step_0_ms": 0, "step_small_ms": SMALL_BUDGET_FRACTION * saved_mb}
        engines = {name: offload.engine(b, device="cpu", spill_dir=spill_dir) for name, b in budgets.items()}
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in budgets}
        for i in range(WARMUP + STEP_REPEATS):
            for name, eng in engines.items():  # interleaved within the worker too
                sample = _timed(lambda eng=eng: step(eng))
                if i >= WARMUP:
                    times[name].append(sample)
        for name, eng in engines.items():
            result[name], result[name + "_cpu"] = _medians(times[name], 1e3)
            eng.close()
    return result


def _run_worker(checkout: Path, steps: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", *([] if steps else ["--hook-pair-only"])],
        env=env,
        cwd=str(checkout),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--old", type=Path, help="checkout of the old code")
    parser.add_argument(
        "--new", type=Path, default=Path(__file__).resolve().parents[1], help="checkout of the new code"
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hook-pair-only", action="store_true", help="measure the hook pair alone (quicker rounds)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(steps=not args.hook_pair_only)))
        return
    if args.old is None:
        parser.error("--old is required: the checkout to compare against (e.g. a worktree of main)")
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for side in order:
            runs[side].append(_run_worker(args.old if side == "old" else args.new, steps=not args.hook_pair_only))
        load.append(os.getloadavg()[0])
    rows = {}
    print(f"{'figure':<20}{'old':>10}{'new':>10}{'new/old':>9}   (new/old: median over rounds of each round's ratio)")
    figures = FIGURES[:1] if args.hook_pair_only else FIGURES
    for figure in [f + kind for f in figures for kind in ("", "_cpu")]:
        old = statistics.median(run[figure] for run in runs["old"])
        new = statistics.median(run[figure] for run in runs["new"])
        ratio = statistics.median(n[figure] / o[figure] for o, n in zip(runs["old"], runs["new"], strict=True))
        rows[figure] = {"old": round(old, 3), "new": round(new, 3), "ratio": round(ratio, 4)}
        print(f"{figure:<20}{old:>10.3f}{new:>10.3f}{ratio:>9.4f}")
    summary = {
        "rounds": args.rounds,
        "load_1min": [round(v, 2) for v in load],
        "cpus": os.cpu_count(),
        "figures": rows,
    }
    print(f"load average (1 min) over the run: {min(load):.2f} .. {max(load):.2f}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(summary) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
