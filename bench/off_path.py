"""A ResNet-like CNN with BatchNorm, off the README's path: memory, time and model state per policy.

    python bench/off_path.py [--rounds 3] [--steps 8]

The model of the issue that found copies training the original and re-runs changing BatchNorm: a
stem convolution, six residual blocks (conv-BN-ReLU-conv-BN + skip) of 16 channels, batch 16 at
64 x 64, SGD. Each configuration runs in a fresh process per round, rounds interleaved (A B C A B C),
so drift hits every configuration alike. Per configuration:

- ms/step: the median step time (forward, backward, SGD) over the steps after profiling;
- peak MB: the most CPU tensor bytes allocated at once in one step (the profiler's memory events,
  in order: what the allocator held, not the resident set the OS reports), and its ratio to no
  engine's;
- batches: BatchNorm's ``num_batches_tracked`` after the steps, against the number of steps;
- equal: every step's loss and the final parameters and buffers bitwise equal to no engine's.

Configurations: none; torch.utils.checkpoint (non-reentrant) over the six blocks; the engine with
regions = the six blocks under "recompute" at budget None and at 0, "offload" and "selective" at a
quarter of what the step saves, "auto" at a tenth. Ends with one JSON line; the JSON goes to
``$OFFLOAD_BENCH_OUT/off-path-cpu.json`` (default ``out/bench``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, also when run by path

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint as torch_checkpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import offload  # noqa: E402
from offload.bench.measure import check_out, environment, out_dir, table, write_json  # noqa: E402

MB = 1 << 20
CHANNELS, BLOCKS, BATCH, SIDE = 16, 6, 16, 64
CONFIGS = ("none", "checkpoint", "recompute-none", "recompute-0", "offload-25%", "selective-25%", "auto-10%")
WARMUP_STEPS = 6
"""Steps before the measured ones, in every configuration: a profiling engine finishes within them."""


class ResBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(CHANNELS)
        self.conv2 = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(CHANNELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + x)


class Net(nn.Module):
    def __init__(self, torch_checkpoint_blocks: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, CHANNELS, 3, padding=1)
        self.blocks = nn.ModuleList(ResBlock() for _ in range(BLOCKS))
        self.head = nn.Linear(CHANNELS, 10)
        self.torch_checkpoint_blocks = torch_checkpoint_blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = torch_checkpoint.checkpoint(block, x, use_reentrant=False) if self.torch_checkpoint_blocks else block(x)
        return self.head(x.mean((2, 3)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 3, SIDE, SIDE, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _saved_bytes() -> int:
    """What one step saves, as the engine counts it (budget None, every block a region kept)."""
    model = Net()
    eng = offload.engine(None, model=model, min_offload_bytes=0)
    x, y = _batch(0)
    with eng:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    saved = eng.stats.saved_bytes
    eng.close()
    return saved


def _engine(config: str, model: Net, saved: int, spill_dir: str):
    if config in ("none", "checkpoint"):
        return None
    policy, _, budget = config.partition("-")
    budget_mb = {"none": None, "0": 0.0, "25%": saved * 0.25 / MB, "10%": saved * 0.10 / MB}[budget]
    return offload.engine(budget_mb, model=model, regions=model.blocks, policy=policy, spill_dir=spill_dir)


def _peak_allocated(step) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for _, nbytes in sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    ):
        live += nbytes
        peak = max(peak, live)
    return peak


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def worker(config: str, steps: int, saved: int) -> dict:
    torch.set_num_threads(1)
    model = Net(torch_checkpoint_blocks=config == "checkpoint")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with tempfile.TemporaryDirectory() as spill_dir:
        eng = _engine(config, model, saved, spill_dir)
        losses: list[float] = []

        def step(i: int) -> None:
            x, y = _batch(i)
            if eng is None:
                loss = F.cross_entropy(model(x), y)
            else:
                with eng:
                    loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())

        i = 0
        warm = None  # the steps a profiling engine took to finish profiling
        while i < WARMUP_STEPS:  # every configuration alike, so their states compare after the run
            step(i)
            i += 1
            if warm is None and (eng is None or not eng.profiling):
                warm = i
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step(i)
            times.append((time.perf_counter() - t0) * 1e3)
            i += 1
        peak = _peak_allocated(lambda: step(i))
        i += 1
        record = {
            "config": config,
            "warmup_steps": warm,
            "steps": i,
            "ms": statistics.median(times),
            "peak_bytes": peak,
            "batches_tracked": int(model.blocks[0].bn1.num_batches_tracked),
            "losses": losses,
            "state": _digest([*model.parameters(), *model.buffers()]),
        }
        if eng is not None:
            stats = eng.stats
            record.update(
                store_peak_bytes=stats.peak_resident_bytes,
                peak_held_bytes=stats.peak_held_bytes,
                plan=None if eng.plan is None else "".join(d.value[0].upper() for d in eng.plan.decisions),
            )
            eng.close()
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--saved", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.saved)))
        return 0
    saved = _saved_bytes()
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for round_ in range(args.rounds):
        for config in CONFIGS:
            cmd = [sys.executable, __file__, "--worker", config, "--steps", str(args.steps), "--saved", str(saved)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ})
            runs[config].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {round_ + 1}/{args.rounds}: {config} {runs[config][-1]['ms']:.1f} ms", file=sys.stderr)
    ref = runs["none"]
    rows, summary = [], {}
    for config in CONFIGS:
        ms = statistics.median(r["ms"] for r in runs[config])
        ratios = [r["ms"] / n["ms"] for r, n in zip(runs[config], ref, strict=True)]  # paired within a round
        peak = statistics.median(r["peak_bytes"] for r in runs[config])
        ref_peak = statistics.median(r["peak_bytes"] for r in ref)
        # Every configuration ran the same steps: its losses, step by step, and its final parameters
        # and buffers (BatchNorm's statistics) must be no engine's, bit for bit.
        equal = all(
            r["losses"] == n["losses"] and r["state"] == n["state"] for r, n in zip(runs[config], ref, strict=True)
        )
        last = runs[config][-1]
        summary[config] = {
            "ms": ms,
            "x_none": statistics.median(ratios),
            "x_none_per_round": ratios,
            "peak_mb": peak / MB,
            "peak_x_none": peak / ref_peak,
            "batches_tracked": last["batches_tracked"],
            "steps": last["steps"],
            "losses_equal_to_none": equal,
            "store_peak_mb": last.get("store_peak_bytes", 0) / MB if "store_peak_bytes" in last else None,
            "peak_held_mb": last.get("peak_held_bytes", 0) / MB if "peak_held_bytes" in last else None,
            "plan": last.get("plan"),
        }
        s = summary[config]
        rows.append(
            [
                config,
                f"{ms:.1f}",
                f"{s['x_none']:.3f}",
                " ".join(f"{r:.2f}" for r in ratios),
                f"{s['peak_mb']:.1f}",
                f"{s['peak_x_none']:.3f}",
                f"{s['batches_tracked']}/{s['steps']}",
                "yes" if equal else "NO",
                "-" if s["store_peak_mb"] is None else f"{s['store_peak_mb']:.1f}",
                "-" if s["plan"] is None else s["plan"],
            ]
        )
    header = [
        "config",
        "ms/step",
        "x none",
        "per round",
        "peak MB",
        "x none",
        "BN batches",
        "= none",
        "store MB",
        "plan",
    ]
    text = table(header, rows)
    payload = {
        "model": f"stem + {BLOCKS} residual blocks of {CHANNELS} channels, BatchNorm, batch {BATCH} at {SIDE}x{SIDE}",
        "saved_mb_per_step": saved / MB,
        "rounds": args.rounds,
        "steps": args.steps,
        "env": environment(torch.device("cpu")),
        "configs": summary,
    }
    print(text)
    print(f"(written to {write_json(check_out(out_dir() / 'off-path-cpu.json'), payload)})")
    print(json.dumps(payload, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
