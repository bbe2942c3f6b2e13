"""A noisy neighbour for a timing benchmark on a quiet machine: what a shared VM does to it.

Bursts of one core's work, each 2-20 s long and either arithmetic (the core) or 64 MB array
copies (memory bandwidth), with pauses of 2-20 s between them; seeded, so a rerun makes the
same noise. ``--workers N`` runs N such neighbours, each in a process of its own with its own
seed (seed, seed + 1, ...): ``--workers 2`` keeps both cores of a 2-core machine busy in their
bursts. Run it beside a benchmark (or ``make test``) and stop it after::

    python bench/noisy_neighbour.py --seed 1 --seconds 1500 &
    python bench/shapes.py derive --threads 1
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402


def neighbour(seed: int, seconds: float) -> None:
    """One core's bursts and pauses, seeded, for ``seconds``."""
    rng = random.Random(seed)
    source = np.ones(64 * 2**20 // 8)
    target = np.empty_like(source)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        burst_end = min(end, time.monotonic() + rng.uniform(2, 20))
        copies = rng.choice([True, False])
        while time.monotonic() < burst_end:
            if copies:
                np.copyto(target, source)
            else:
                x = 0
                for i in range(200_000):
                    x += i * i
        time.sleep(max(0.0, min(end - time.monotonic(), rng.uniform(2, 20))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=float("inf"), help="stop after this long")
    parser.add_argument("--workers", type=int, default=1, help="neighbours, one process (one core) each")
    args = parser.parse_args()
    if args.workers == 1:
        neighbour(args.seed, args.seconds)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # kill PID stops the workers too (finally below)
    workers = [
        multiprocessing.Process(target=neighbour, args=(args.seed + i, args.seconds), daemon=True)
        for i in range(args.workers)
    ]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.join()
    finally:
        for worker in workers:
            worker.terminate()


if __name__ == "__main__":
    main()
