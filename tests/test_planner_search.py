"""The search of "auto" (issue 49) against exhaustive search, and what it costs as regions grow.

Oracles: every assignment of decisions priced by ``simulate`` (exhaustive, up to 8 regions), and
the number of regions the cost model walks (not a clock: no timing in unit tests; the times are in
``bench/scale.py``).

White-box: the planner's search is pure (numbers in, a plan out), and what is under test is its
own functions (``make_plan``, ``simulate``, the policies' classes) and how many regions its cost
model walks, which no public seam shows.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from offload._cost import MachineProfile, RegionProfile, Scope
from offload._plan import planner
from offload._plan.planner import Decision, allowed, link_usable, simulate
from offload._plan.policy import AutoPolicy, OffloadPolicy, make_plan

MB = 1 << 20
WITHIN = 0.02
"""Issue 49: the new plan's predicted step within 2 % of the best exhaustive search finds."""


def random_problem(rng: np.random.Generator, max_regions: int) -> tuple[list[RegionProfile], MachineProfile, int]:
    """Random regions (sizes, times, largest tensors, at most two with a selective run, sometimes
    the saves before and after the regions) on a random machine (a GPU, a CPU spilling on the
    compute's cores or beside them, a link of 0 to 340 GB/s) under a random budget."""
    regions = []
    if rng.random() < 0.2:
        regions.append(RegionProfile(name="before", scope=Scope.BEFORE, saved_bytes=int(rng.integers(0, 50 * MB))))
    selective_regions = 0
    for i in range(int(rng.integers(1, max_regions + 1))):
        saved = int(rng.integers(1 * MB, 400 * MB))
        cheap = int(saved * rng.uniform(0, 0.6))
        selective = selective_regions < 2 and rng.random() < 0.3
        selective_regions += selective
        forward_ms = float(rng.uniform(0.05, 10))
        regions.append(
            RegionProfile(
                name=f"r{i}",
                saved_bytes=saved,
                input_bytes=int(saved * rng.uniform(0, 0.3)),
                forward_ms=forward_ms,
                backward_ms=float(rng.choice([0.0, forward_ms * rng.uniform(0.5, 3)])),
                recompute_ms=float(rng.choice([0.0, forward_ms * rng.uniform(0.5, 1.0)])),
                num_tensors=int(rng.integers(1, 40)),
                largest_tensor_bytes=int(rng.choice([0, int(saved * rng.uniform(0.02, 0.6))])),
                cheap_bytes=cheap if selective else 0,
                expensive_bytes=saved - cheap if selective else 0,
                expensive_tensors=int(rng.integers(1, 10)) if selective else 0,
                selective_ms=float(forward_ms * rng.uniform(0.05, 0.5)) if selective else 0.0,
            )
        )
    if rng.random() < 0.3:
        regions.append(RegionProfile(name="after", scope=Scope.AFTER, saved_bytes=int(rng.integers(0, 300 * MB))))
    out = float(rng.choice([0.0, 1.0, 10.0, 50.0, 340.0]))
    kind = int(rng.integers(0, 3))
    if kind == 0:
        machine = MachineProfile(
            device_type="cuda", d2h_gb_per_s=out, h2d_gb_per_s=out * rng.uniform(0.5, 1.2),
            per_tensor_overhead_us=float(rng.uniform(0, 20)),
        )  # fmt: skip
    else:
        machine = MachineProfile(
            device_type="cpu", disk_write_gb_per_s=out, disk_read_gb_per_s=out * rng.uniform(0.5, 2),
            per_tensor_overhead_us=float(rng.uniform(0, 20)), spare_cores=kind - 1,
        )  # fmt: skip
    return regions, machine, int(sum(r.saved_bytes for r in regions) * rng.uniform(0, 1.1))


def exhaustive_best(regions: list[RegionProfile], machine: MachineProfile, budget_bytes: int) -> float | None:
    """The least predicted step over every assignment that fits, None where none fits."""
    usable = link_usable(machine)
    choices = [[d for d in Decision if allowed(r, d) and (usable or d not in planner.MOVES_BYTES)] for r in regions]
    best = None
    for decisions in itertools.product(*choices):
        step_ms, peak_bytes = simulate(regions, decisions, machine, budget_bytes)
        if peak_bytes <= budget_bytes and (best is None or step_ms < best):
            best = step_ms
    return best


def test_auto_lands_within_two_percent_of_exhaustive_search():
    """On 60 random problems of up to 8 regions, "auto"'s search alone (no stability margin) fits
    wherever some assignment fits, and predicts a step within 2 % of the fastest that fits. Where
    not: on 300 problems of this generator (seed 7) one plan lands 2.5 % above (problem 169: seven
    regions and the saves before and after them), against 11 more than 2 % above, up to 1.96 x, for
    the search before issue 49. Without the fill's last step replaced by the cheapest change that
    closes the gap, problem 3 here lands 37 % above."""
    rng = np.random.default_rng(7)
    compared = 0
    for _ in range(60):
        regions, machine, budget_bytes = random_problem(rng, max_regions=8)
        best_ms = exhaustive_best(regions, machine, budget_bytes)
        plan = make_plan(regions, machine, budget_bytes, AutoPolicy(stable_margin=0))
        if best_ms is None:
            continue
        compared += 1
        assert plan.fits_budget, (regions, machine, budget_bytes)
        assert plan.predicted_step_ms <= best_ms * (1 + WITHIN) + 1e-9, (plan.predicted_step_ms, best_ms, str(plan))
    assert compared >= 50, "the premise: most budgets here fit something"


def _walked_regions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Regions walked by the cost model, one entry per whole timeline run."""
    walked: list[int] = []
    run = planner._run_timeline

    def counting(regions, *args, **kwargs):
        walked.append(len(regions))
        return run(regions, *args, **kwargs)

    monkeypatch.setattr(planner, "_run_timeline", counting)
    return walked


def _stack(n: int) -> list[RegionProfile]:
    """A stack of one block and of three kinds alternating, the shapes of ``bench/scale.py``."""
    kinds = (
        dict(saved_bytes=12 * MB, input_bytes=MB, forward_ms=0.8, num_tensors=9, cheap_bytes=5 * MB,
             expensive_bytes=7 * MB, expensive_tensors=4, selective_ms=0.15),
        dict(saved_bytes=16 * MB, input_bytes=MB, forward_ms=2.0, num_tensors=6),
        dict(saved_bytes=2 * MB, input_bytes=MB, forward_ms=0.05, num_tensors=2),
    )  # fmt: skip
    return [RegionProfile(name=f"r.{i}", **kinds[i % 3]) for i in range(n)]  # type: ignore[arg-type]


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_the_search_walks_regions_linearly_in_their_number(monkeypatch, device_type):
    """Issue 49: the search before priced each candidate on the whole timeline, O(n^2) timelines
    a move (about 24,000 a step at 60 regions). Now a bounded number of timelines, each O(n), and
    the polish a fixed amount of work: the regions walked per region planned stay bounded from 100
    regions to 800 (the search before: 75,000 at 100 regions, 1,000 a region planned)."""
    machine = MachineProfile(
        device_type=device_type, d2h_gb_per_s=16.0, h2d_gb_per_s=16.0, disk_write_gb_per_s=1.0,
        disk_read_gb_per_s=1.0, per_tensor_overhead_us=5.0,
    )  # fmt: skip
    per_region = {}
    for n in (100, 800):
        regions = _stack(n)
        walked = _walked_regions(monkeypatch)
        plan = make_plan(regions, machine, sum(r.saved_bytes for r in regions) // 4, "auto")
        assert plan.fits_budget
        per_region[n] = sum(walked) / n
        monkeypatch.undo()
    assert per_region[800] <= 100 and per_region[100] <= 300, per_region


def test_the_offload_policy_bisects_to_the_longest_hot_suffix_that_fits():
    """The offload policy finds the most regions kept hot by bisection (the peak never falls as more
    stay hot); every suffix priced in turn, as before, finds the same."""
    rng = np.random.default_rng(3)
    checked = 0
    for _ in range(60):
        regions, machine, budget_bytes = random_problem(rng, max_regions=8)
        if not link_usable(machine):
            continue
        n = len(regions)
        keep_all = (Decision.KEEP,) * n
        if simulate(regions, keep_all, machine, budget_bytes)[1] <= budget_bytes:
            continue
        candidates = [
            planner.coerce(regions, (Decision.OFFLOAD,) * (n - kept) + (Decision.KEEP,) * kept) for kept in range(n)
        ]
        peaks = [simulate(regions, d, machine, budget_bytes)[1] for d in candidates]
        fitting = [d for d, peak in zip(candidates, peaks, strict=True) if peak <= budget_bytes]
        expected = fitting[-1] if fitting else candidates[peaks.index(min(peaks))]
        assert OffloadPolicy().plan(regions, machine, budget_bytes) == expected
        checked += 1
    assert checked >= 20


def test_on_a_cpu_without_a_spare_core_a_move_costs_its_serial_transfer_from_the_start():
    """Where the spill takes the compute's cores every move costs exactly its write and read, so
    the table is exact from the start: 400 regions alternating a norm-like one (recompute 0.1 ms)
    and a matmul-like one (recompute 20 ms), each 100 MB at 20 GB/s each way (10 ms out and back),
    at budget 0: recompute the norms, move the matmuls, with no learning and too little polish to
    repair 200 wrong decisions one by one (the fill priced every move as hidden on this machine
    before it kept the serial cost: every region moved, 2x the best step)."""
    machine = MachineProfile(device_type="cpu", disk_write_gb_per_s=20.0, disk_read_gb_per_s=20.0)
    regions = []
    for i in range(200):
        regions.append(RegionProfile(name=f"norm.{i}", saved_bytes=100 * 10**6, forward_ms=0.1))
        regions.append(RegionProfile(name=f"mlp.{i}", saved_bytes=100 * 10**6, forward_ms=20.0))
    plan = make_plan(regions, machine, 0, AutoPolicy(stable_margin=0))
    best_ms = simulate(regions, (Decision.RECOMPUTE, Decision.OFFLOAD) * 200, machine, 0)[0]
    assert plan.fits_budget
    assert plan.predicted_step_ms == pytest.approx(best_ms)
