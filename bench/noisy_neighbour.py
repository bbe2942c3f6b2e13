"""A noisy neighbour for a timing benchmark on a quiet machine: what a shared VM does to it.

Bursts of one core's work, each 2-20 s long and either arithmetic (the core) or 64 MB array
copies (memory bandwidth), with pauses of 2-20 s between them; seeded, so a rerun makes the
same noise. Run it beside a benchmark and stop it after::

    python bench/noisy_neighbour.py --seed 1 --seconds 1500 &
    python bench/shapes.py derive --threads 1
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=float("inf"), help="stop after this long")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    source = np.ones(64 * 2**20 // 8)
    target = np.empty_like(source)
    end = time.monotonic() + args.seconds
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


if __name__ == "__main__":
    main()
