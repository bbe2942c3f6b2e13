"""Partial checkpointing in a prediction, white-box: the selection of blocks a prediction takes as
regions (``_predict.selection``, numbers only) and the "checkpoint-partial" policy over hand-made
region profiles (``_predict.table.partial_checkpoint``). White-box because the policy's choice (how
few regions re-run to meet a budget) is exact only on profiles whose sizes a test sets; the public
table shows its outcome on a model (``test_predict_plans``).
"""

from __future__ import annotations

import pytest

from offload import MachineProfile
from offload._cost import RegionProfile
from offload._plan.planner import Decision
from offload._predict.selection import Selection, is_selection
from offload._predict.table import partial_checkpoint, spread

MB = 1 << 20


@pytest.mark.parametrize(
    "text, count, chosen",
    [
        ("every:1", 4, (0, 1, 2, 3)),
        ("every:2", 8, (0, 2, 4, 6)),
        ("every:2:1", 8, (1, 3, 5, 7)),
        ("every:3", 8, (0, 3, 6)),
        ("first:3", 8, (0, 1, 2)),
        ("first:9", 4, (0, 1, 2, 3)),
        ("last:2", 8, (6, 7)),
        ("last:9", 3, (0, 1, 2)),
        ("5,0,3", 8, (0, 3, 5)),
        (" every:4 ", 8, (0, 4)),
    ],
)
def test_a_selection_picks_the_blocks_it_names(text, count, chosen):
    assert Selection.parse(text).pick_from(count) == chosen


@pytest.mark.parametrize(
    "text",
    ["every:0", "every:2:-1", "every:", "every:2:1:5", "first:0", "first:3:1", "last:-1", "a,b", "1,1", "-1", ""],
)
def test_a_bad_selection_names_the_forms_it_may_take(text):
    with pytest.raises(ValueError, match="every:K, every:K:S, first:N, last:N or a list of indices"):
        Selection.parse(text)


def test_a_selection_that_chooses_nothing_or_past_the_end_is_refused():
    with pytest.raises(ValueError, match=r"indices \[8\] are past the model's 8 blocks \(0\.\.7\)"):
        Selection.parse("0,8").pick_from(8)
    with pytest.raises(ValueError, match="chose none of the model's 2 blocks"):
        Selection.parse("every:2:5").pick_from(2)
    assert is_selection("every:2") and not is_selection("auto") and not is_selection(["block"])


@pytest.mark.parametrize("count, n", [(8, 1), (8, 2), (8, 3), (8, 4), (8, 8), (5, 5), (24, 6)])
def test_spread_takes_n_regions_evenly_from_the_first(count, n):
    picked = spread(count, n)
    assert len(picked) == n and picked[0] == 0 and picked[-1] < count
    if count % n == 0:
        assert picked == tuple(range(0, count, count // n))  # every k-th


def _profiles(count: int = 8) -> tuple[RegionProfile, ...]:
    return tuple(
        RegionProfile(name=f"blocks.{i}", saved_bytes=100 * MB, input_bytes=10 * MB, forward_ms=1.0, backward_ms=2.0)
        for i in range(count)
    )


@pytest.mark.parametrize("recomputed", [0, 1, 3, 5, 8])
def test_partial_checkpoint_re_runs_the_fewest_regions_the_budget_needs(recomputed):
    """8 regions of 100 MiB, each 10 MiB of inputs when re-run: keeping 8 - n costs
    (8 - n) x 100 + n x 10 MiB; a budget just above that for n re-runs exactly n, each one more
    forward (1 ms) in the step."""
    profiles, link = _profiles(), MachineProfile(device_type="cpu", device_name="numbers")
    keep = partial_checkpoint(profiles, link, None, 0.0)
    budget = ((8 - recomputed) * 100 + recomputed * 10) * MB
    plan = partial_checkpoint(profiles, link, budget, 0.0)
    assert plan.decisions.count(Decision.RECOMPUTE) == recomputed
    assert plan.fits_budget and plan.predicted_peak_bytes <= budget
    assert plan.predicted_step_ms == pytest.approx(keep.predicted_step_ms + recomputed * 1.0)
    if recomputed:
        fewer = partial_checkpoint(profiles, link, budget - 1, 0.0)
        assert fewer.decisions.count(Decision.RECOMPUTE) == recomputed + (recomputed < 8)
    assert plan.policy == "checkpoint-partial" and plan.budget_bytes == budget


def test_partial_checkpoint_without_a_budget_keeps_all_and_past_all_does_not_fit():
    profiles, link = _profiles(), MachineProfile(device_type="cpu", device_name="numbers")
    assert partial_checkpoint(profiles, link, None, 0.0).decisions.count(Decision.KEEP) == 8
    assert partial_checkpoint(profiles, link, 800 * MB, 0.0).decisions.count(Decision.KEEP) == 8
    short = partial_checkpoint(profiles, link, 79 * MB, 0.0)
    assert short.decisions.count(Decision.RECOMPUTE) == 8 and not short.fits_budget


def test_partial_checkpoint_reaches_every_region_of_an_odd_count():
    profiles, link = _profiles(5), MachineProfile(device_type="cpu", device_name="numbers")
    plan = partial_checkpoint(profiles, link, 50 * MB, 0.0)
    assert plan.decisions.count(Decision.RECOMPUTE) == 5 and plan.fits_budget
