"""Quickstart: train the built-in MiniGPT for a few steps with and without the engine.

    python examples/quickstart.py [--steps 5] [--budget-mb 8] [--batch-size 8]

Both runs start from the same seed, so they build the same weights and see the same
batches; the engine only moves saved activations, never changes the math, so the
losses must match exactly. The table shows each step's time side by side and what the
engine moved in that step. On the CPU the tier behind the budget is the spill
directory (a private temp dir here); on CUDA it is pinned host memory.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import offload
from offload.models import GPTConfig, MiniGPT, batches, load_corpus

SEED = 1234
MB = 1 << 20
LEARNING_RATE = 3e-3

# "math" attention: every op has a deterministic kernel, so the two runs can be compared bitwise.
CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=128, seq_len=128, attention="math")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(data: torch.Tensor, *, steps: int, batch_size: int, device: torch.device, engine=None) -> list[dict]:
    """Run ``steps`` training steps from ``SEED``; one row per step (ms, loss, and engine stats)."""
    torch.manual_seed(SEED)
    model = MiniGPT(CONFIG).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    stream = batches(data, batch_size, CONFIG.seq_len, torch.Generator().manual_seed(SEED))
    rows = []
    for _, (x, y) in zip(range(steps), stream, strict=False):
        x, y = x.to(device), y.to(device)
        if engine is not None:
            engine.reset_stats()
        synchronize(device)
        start = time.perf_counter()
        with engine if engine is not None else contextlib.nullcontext():
            _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        rows.append(
            {
                "ms": (time.perf_counter() - start) * 1e3,
                "loss": loss.item(),
                "stats": engine.stats if engine is not None else None,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget-mb", type=float, default=8.0, help="device bytes the engine may keep, MB")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = load_corpus()
    print(
        f"MiniGPT {CONFIG.n_layer}x{CONFIG.n_embd}, batch {args.batch_size}x{CONFIG.seq_len}, "
        f"on {device}; engine budget {args.budget_mb:g} MB"
    )

    run = dict(steps=args.steps, batch_size=args.batch_size, device=device)
    train(data, **run | {"steps": 1})  # warm-up: first-call costs (allocator, kernels) land in neither column
    baseline = train(data, **run)
    engine = offload.engine(budget_mb=args.budget_mb, spill_dir=None)
    try:
        managed = train(data, **run, engine=engine)
    finally:
        engine.close()

    header = (
        f"{'step':>4} | {'ms plain':>9} {'ms engine':>9} | {'loss plain':>10} {'loss engine':>11} | "
        f"{'saved MB':>8} {'moved MB':>8} {'peak MB':>7}"
    )
    print(header)
    print("-" * len(header))
    for step, (plain, ours) in enumerate(zip(baseline, managed, strict=True)):
        stats = ours["stats"]
        print(
            f"{step:>4} | {plain['ms']:>9.1f} {ours['ms']:>9.1f} | {plain['loss']:>10.6f} {ours['loss']:>11.6f} | "
            f"{stats.saved_bytes / MB:>8.2f} {stats.offloaded_bytes / MB:>8.2f} "
            f"{stats.peak_resident_bytes / MB:>7.2f}"
        )

    match = all(plain["loss"] == ours["loss"] for plain, ours in zip(baseline, managed, strict=True))
    print(f"losses match exactly: {'yes' if match else 'NO'}")
    print("engine stats, last step:")
    for name, value in managed[-1]["stats"].to_dict().items():
        print(f"  {name:<22} {value:,.2f}" if isinstance(value, float) else f"  {name:<22} {value:,}")


if __name__ == "__main__":
    main()
