"""Builds of one setup beside a noisy neighbour (``_plan.profiler``'s Note: [a plan that holds still]).

A neighbour that takes the CPU in bursts (a thread here, seeded: bursts and pauses of a few ms)
disturbs whichever profiling step it meets; each build meets it at other steps, so its trials may
run a second round, read an uncertain link, plan otherwise. What must hold whatever it does is
asserted here; oracle: the model without the engine, bitwise. The mechanisms are tested with
numbers in ``test_profiler.py``; the ten-build proof at the demo's size, beside
``bench/noisy_neighbour.py``, is ``bench/whole_step.py builds`` (results in ``bench/results/``).
"""

from __future__ import annotations

import random
import re
import threading
import time

import torch

import offload
from test_regions import activation_bytes, assert_same_history, make_model, train
from zoo import auto_trials, most_profiling_steps, stage_letters

BUILDS = 3
DISK = offload.MachineProfile(
    device_type="cpu",
    device_name="a 2-core VM's disk tier",
    disk_write_gb_per_s=2.0,
    disk_read_gb_per_s=2.0,
    per_tensor_overhead_us=300.0,
)
"""Fixed figures (no probe: every build plans from the same ones, as builds sharing a cached probe
do), of the order ``offload.probe()`` reads on the 2-core VM this was written on: 2 GB/s each way,
300 us a tensor. Far from the link a step sees, they are what an uncertain reading falls back to."""
STEPS = most_profiling_steps("auto") + 1
"""Each build profiles (as many steps as it may legitimately take) and plans."""


class Neighbour:
    """A thread that takes a core in bursts of 1-20 ms, with pauses as long: matrix products,
    which release the GIL as another process's work would not hold it. Seeded, so a rerun makes
    the same pattern of noise (if not the same steps under it)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
        while not self._stop.is_set():
            end = time.perf_counter() + self._rng.uniform(0.001, 0.02)
            while time.perf_counter() < end:
                a = torch.tanh(a @ a)
            time.sleep(self._rng.uniform(0.001, 0.02))

    def __enter__(self) -> Neighbour:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_builds_beside_a_noisy_neighbour_stay_exact_and_end_their_profiling(spill_dir):
    """Whatever the neighbour does to the trials' figures (and so to how many rounds they take and
    which plan they lead to), every build trains exactly as the model without the engine, leaves
    profiling within the steps ``_plan.profiler``'s rules allow, and plans within its budget. Whether the
    builds' plans agree is a statistical claim about the noise, measured in ``bench/whole_step.py
    builds`` (ten builds at the demo's size, beside ``bench/noisy_neighbour.py``), not asserted here."""
    budget_mb = 0.25 * activation_bytes() / 2**20  # a quarter of what the blocks save, as in the bench
    reference = train(make_model(), steps=STEPS)
    with Neighbour(seed=38):
        for _ in range(BUILDS):
            model = make_model()
            eng = offload.engine(budget_mb, regions=model.blocks, model=model, machine=DISK, spill_dir=spill_dir)
            assert_same_history(train(model, eng, steps=STEPS), reference, "a build beside the neighbour")
            stages = stage_letters(eng.recent_stages)
            assert re.fullmatch("M" + auto_trials() + r"\.+", stages), stages
            assert not eng.profiling and eng.plan.fits_budget, str(eng.plan)
            eng.close()
