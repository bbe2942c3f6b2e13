"""What the disk tier costs and whether it really frees RAM, on the CPU (the disk is the tier there).

    python bench/disk_tier.py [--repeats 7] [--out bench/results/disk-tier-cpu.json]

Four figures, each from one process, configurations interleaved per repeat:

- per tensor: a chain of ops each saving one 64 KiB tensor, budget 0 (every tensor to disk and
  back) minus budget None (hooks only), per saved tensor, median of paired repeats;
- per MB: a chain saving 8 MiB tensors, the same difference per MB moved;
- page cache: bytes of the engine's spill files resident in the page cache (mincore) at the end of
  a MiniGPT forward at budget 0, as a share of the bytes spilled;
- reads per byte: reloaded / offloaded bytes for that MiniGPT step at budget 0 and at 2 MB.

It prints a table and ends with one JSON line. Run the old and new code in one session
(``PYTHONPATH=<checkout>``) to compare them as ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time

import torch

import offload
from offload._pagecache import cached_bytes_under
from offload.models.gpt import GPTConfig, MiniGPT

SMALL_NUMEL = 16 * 1024  # 64 KiB of fp32 per saved tensor
SMALL_CHAIN = 300
LARGE_NUMEL = 2 * 1024 * 1024  # 8 MiB per saved tensor
LARGE_CHAIN = 24


def _chain(x: torch.Tensor, length: int) -> None:
    y = x.clone()
    for _ in range(length):
        y = y.sin()
    y.sum().backward()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def chain_cost(numel: int, length: int, repeats: int, spill_dir: str) -> dict:
    x = torch.ones(numel, requires_grad=True)
    counting = offload.engine(budget_mb=None, min_offload_bytes=0)
    moving = offload.engine(budget_mb=0, min_offload_bytes=0, spill_dir=spill_dir)

    def run(eng):
        def fn():
            x.grad = None
            with eng:
                _chain(x, length)
        return fn

    base, moved = [], []
    for _ in range(2):
        run(counting)(), run(moving)()
    for _ in range(repeats):
        base.append(_timed(run(counting)))
        moved.append(_timed(run(moving)))
    moving.reset_stats()
    run(moving)()
    stats = moving.stats
    counting.close()
    moving.close()
    diffs = [m - b for m, b in zip(moved, base)]
    mb = stats.offloaded_bytes / 2**20
    return {
        "tensors": length,
        "tensor_bytes": numel * 4,
        "base_ms": round(statistics.median(base), 3),
        "moved_ms": round(statistics.median(moved), 3),
        "per_tensor_us": round(statistics.median(diffs) * 1e3 / length, 1),
        "per_mb_ms": round(statistics.median(diffs) / mb, 3) if mb else None,
        "offloaded_mb": round(mb, 2),
    }


def gpt_step(budget_mb: float, spill_dir: str) -> dict:
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(n_layer=4, n_embd=256, n_head=4, seq_len=256))
    idx = torch.randint(0, 256, (8, 256))
    eng = offload.engine(budget_mb=budget_mb, spill_dir=spill_dir, model=model)
    for _ in range(2):
        with eng:
            _, loss = model(idx, idx)
        loss.backward()
    eng.reset_stats()
    with eng:
        _, loss = model(idx, idx)
    cached = cached_bytes_under(spill_dir)
    spilled = eng.stats.spilled_bytes
    loss.backward()
    stats = eng.stats
    eng.close()
    return {
        "budget_mb": budget_mb,
        "offloaded_mb": round(stats.offloaded_bytes / 2**20, 2),
        "reloaded_mb": round(stats.reloaded_bytes / 2**20, 2),
        "reload_ratio": round(stats.reloaded_bytes / stats.offloaded_bytes, 3) if stats.offloaded_bytes else None,
        "spilled_at_forward_end_mb": round(spilled / 2**20, 2),
        "page_cache_at_forward_end_mb": None if cached is None else round(cached / 2**20, 2),
        "page_cache_share": None if not (cached is not None and spilled) else round(cached / spilled, 3),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--spill-dir", default=None, help="parent of the spill directory (default: the temp dir)")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.spill_dir) as spill_dir:
        small = chain_cost(SMALL_NUMEL, SMALL_CHAIN, args.repeats, spill_dir)
        large = chain_cost(LARGE_NUMEL, LARGE_CHAIN, args.repeats, spill_dir)
        steps = [gpt_step(0, spill_dir), gpt_step(2, spill_dir)]
    result = {
        "bench": "disk_tier",
        "offload_file": offload.__file__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "per_tensor": small,
        "per_mb": large,
        "gpt_steps": steps,
    }
    print(f"per tensor (64 KiB): {small['per_tensor_us']} us   per MB (8 MiB tensors): {large['per_mb_ms']} ms")
    for s in steps:
        print(
            f"MiniGPT budget {s['budget_mb']} MB: reloaded/offloaded {s['reload_ratio']}, "
            f"page cache {s['page_cache_at_forward_end_mb']} of {s['spilled_at_forward_end_mb']} MB spilled"
        )
    line = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
