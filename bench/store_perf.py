"""The store's cost, old code against new, interleaved in one driver: the hook pair and a step.

    python bench/store_perf.py --old /path/to/old/checkout [--new .] [--rounds 7] [--json-out PATH]
    python bench/store_perf.py --old /path/to/old/checkout [--new .] --in-process

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

``--in-process``: both checkouts in ONE worker, each package imported under its own name
(``offload_old``, ``offload_new``: the package imports itself relatively), timed sample by sample
in alternating order with the garbage collector held off. On a shared VM two processes of
identical code differ by up to ~20 % (where the process lands: its memory layout, its core), more
than the effect to be seen; within one process that falls on both sides. Reports new/old as the
median of the per-sample ratios, with their quartiles, for the hook pair and the three steps.
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
from typing import Optional

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


def _minigpt_step():
    """One MiniGPT training step (forward, backward) under a given engine, on fixed inputs."""
    import torch

    from offload.models.gpt import GPTConfig, MiniGPT  # the model only: no engine code of either side

    model = MiniGPT(GPTConfig(n_layer=4, n_embd=128, seq_len=128))
    idx = torch.randint(0, 256, (4, 128))
    targets = torch.randint(0, 256, (4, 128))

    def step(eng) -> None:
        model.zero_grad(set_to_none=True)
        with eng:
            _, loss = model(idx, targets)
        loss.backward()

    return step


def _worker(steps: bool) -> dict:
    import torch

    import offload

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

    step = _minigpt_step()

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


IN_PROCESS_SAMPLES = 200
"""--in-process: alternating samples per side for the hook pair (a chain of CHAIN_LENGTH // 2)."""
IN_PROCESS_STEPS = 30
"""--in-process: alternating samples per side for each step figure."""


def _ab_worker(sides: tuple[str, str]) -> dict:
    """The hook pair and the steps of two packages in this process, sample by sample (see ``--in-process``)."""
    import gc
    import importlib

    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    packages = {side: importlib.import_module(side) for side in sides}
    length = CHAIN_LENGTH // 2
    x = torch.ones(16, requires_grad=True)

    def chain(eng) -> None:
        with eng:
            y = x
            for _ in range(length):
                y = y.sin()
        y.sum().backward()

    step = _minigpt_step()

    def held_off(fn) -> tuple[float, float]:
        gc.collect()
        gc.disable()
        try:
            return _timed(fn)
        finally:
            gc.enable()

    result: dict = {}
    with tempfile.TemporaryDirectory() as spill_dir:
        counting = packages[sides[0]].engine(None, device="cpu")
        step(counting)
        saved_mb = counting.stats.saved_bytes / 2**20
        counting.close()
        budgets = {
            "hook_pair_us": None,
            "step_none_ms": None,
            "step_0_ms": 0,
            "step_small_ms": SMALL_BUDGET_FRACTION * saved_mb,
        }
        for figure, budget in budgets.items():
            hook = figure == "hook_pair_us"
            engines = {
                side: package.engine(budget, device="cpu", spill_dir=spill_dir, min_offload_bytes=0)
                if hook
                else package.engine(budget, device="cpu", spill_dir=spill_dir)
                for side, package in packages.items()
            }
            run = chain if hook else step
            samples: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
            count = IN_PROCESS_SAMPLES if hook else IN_PROCESS_STEPS
            for i in range(WARMUP + count):
                for side in sides if i % 2 == 0 else sides[::-1]:
                    sample = held_off(lambda eng=engines[side], run=run: run(eng))
                    if i >= WARMUP:
                        samples[side].append(sample)
            scale = 1e6 / length if hook else 1e3
            old, new = samples[sides[0]], samples[sides[1]]
            for kind, at in (("", 0), ("_cpu", 1)):
                ratios = [n[at] / o[at] for o, n in zip(old, new, strict=True)]
                result[figure + kind] = {
                    "old": round(statistics.median(o[at] for o in old) * scale, 3),
                    "new": round(statistics.median(n[at] for n in new) * scale, 3),
                    "ratio": round(statistics.median(ratios), 4),
                    "ratio_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)],
                }
            for eng in engines.values():
                eng.close()
    return result


def _run_in_process(old: Path, new: Path) -> dict:
    with tempfile.TemporaryDirectory() as packages:
        for name, checkout in (("offload_old", old), ("offload_new", new)):
            os.symlink(checkout.resolve() / "offload", Path(packages) / name)
        env = dict(os.environ, PYTHONPATH=packages, OMP_NUM_THREADS="1")
        out = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--ab-worker"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    parser.add_argument(
        "--in-process", action="store_true", help="both checkouts in one process, sample by sample (see above)"
    )
    parser.add_argument("--ab-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(steps=not args.hook_pair_only)))
        return
    if args.ab_worker:
        print(json.dumps(_ab_worker(("offload_old", "offload_new"))))
        return
    if args.old is None:
        parser.error("--old is required: the checkout to compare against (e.g. a worktree of main)")
    if args.in_process:
        load = [os.getloadavg()[0]]
        figures = _run_in_process(args.old, args.new)
        load.append(os.getloadavg()[0])
        print(f"{'figure':<20}{'old':>10}{'new':>10}{'new/old':>9}  quartiles   (one process, per-sample ratios)")
        for figure, row in figures.items():
            low, _, high = row["ratio_quartiles"]
            print(f"{figure:<20}{row['old']:>10.3f}{row['new']:>10.3f}{row['ratio']:>9.4f}  {low:.3f}..{high:.3f}")
        _report({"in_process": True}, load, figures, args.json_out)
        return
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
    _report({"rounds": args.rounds}, load, rows, args.json_out)


def _report(how: dict, load: list[float], figures: dict, json_out: Optional[Path]) -> None:
    """The load line, then the JSON line (also written to ``json_out``)."""
    summary = {**how, "load_1min": [round(v, 2) for v in load], "cpus": os.cpu_count(), "figures": figures}
    print(f"load average (1 min) over the run: {min(load):.2f} .. {max(load):.2f}")
    if json_out is not None:
        json_out.write_text(json.dumps(summary) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
