"""The pace a plan's step is read at: measured / predicted over the latest steps under plans.

No torch here: ratios are made up. The engine side (steps timed, evaluations left out) is in
test_shapes.py.

White-box, on purpose: ``offload._plan.pace`` is pure, numbers in and numbers out, so these tests
call it directly rather than through the engine.
"""

from __future__ import annotations

import math

import pytest

from offload._plan.cache import _decode_plan, _encode_plan
from offload._plan.pace import MIN_STEPS, WINDOW, StepPace
from offload._plan.policy import make_plan
from test_planner import cuda_machine, uniform_regions

MB = 10**6


def test_no_pace_before_enough_steps_were_timed():
    pace = StepPace()
    assert pace.factor() == 1.0
    for _ in range(MIN_STEPS - 1):
        pace.add(100.0, 300.0)
        assert pace.factor() == 1.0, "one step alone may be the disturbed one"
    pace.add(100.0, 300.0)
    assert pace.factor() == pytest.approx(3.0)


def test_the_pace_is_the_median_so_a_disturbed_step_does_not_move_it():
    pace = StepPace()
    for measured in (110.0, 120.0, 115.0, 5000.0, 118.0):  # one step also saved a checkpoint
        pace.add(100.0, measured)
    assert pace.factor() == pytest.approx(1.18)


def test_only_the_latest_window_counts():
    pace = StepPace()
    for _ in range(WINDOW):
        pace.add(100.0, 200.0)
    for _ in range(WINDOW // 2 + 1):
        pace.add(100.0, 100.0)  # the machine sped up
    assert pace.factor() == pytest.approx(1.0)
    assert pace.steps == WINDOW


@pytest.mark.parametrize(
    ("predicted", "measured"), [(math.inf, 100.0), (0.0, 100.0), (100.0, 0.0), (math.nan, 100.0), (100.0, math.inf)]
)
def test_a_step_with_no_finite_prediction_or_time_checks_nothing(predicted, measured):
    pace = StepPace()
    pace.add(predicted, measured)
    assert pace.steps == 0


def test_describe_names_the_factor_and_its_range():
    pace = StepPace()
    assert "x1" in pace.describe() and "0 of" in pace.describe()
    for measured in (150.0, 120.0, 130.0):
        pace.add(100.0, measured)
    text = pace.describe()
    assert "x1.3 " in text and "latest 3 steps" in text and "x1.2..x1.5" in text


def test_steps_that_disagree_make_the_times_uncertain_and_say_by_how_much():
    """Under load the steps under plans read x0.357..x11.5 their plans: explain must not print one
    confident figure from that (issue: explain's times under load)."""
    pace = StepPace()
    for measured in (120.0, 110.0, 115.0, 125.0):
        pace.add(100.0, measured)
    assert pace.steady() and pace.uncertainty() == ""
    noisy = StepPace()
    for measured in (35.7, 363.0, 1150.0, 90.0, 600.0):
        noisy.add(100.0, measured)
    assert not noisy.steady()
    note = noisy.uncertainty()
    assert "uncertain" in note and "x0.357..x11.5" in note and "latest 5 steps" in note


def test_a_paced_plan_scales_its_step_times_and_keeps_its_decisions():
    regions = tuple(uniform_regions(4, saved_bytes=100 * MB, forward_ms=5.0))
    plan = make_plan(regions, cuda_machine(10.0), 150 * MB, "auto", other_ms=7.0)
    assert plan.pace == 1.0
    paced = plan.paced(1.25)
    assert paced.decisions == plan.decisions
    assert paced.predicted_peak_bytes == plan.predicted_peak_bytes
    assert paced.predicted_step_ms == pytest.approx(1.25 * plan.predicted_step_ms)
    assert paced.baseline_step_ms == pytest.approx(1.25 * plan.baseline_step_ms)
    assert paced.predicted_overhead_ms == pytest.approx(1.25 * plan.predicted_overhead_ms)
    assert [r.forward_ms for r in paced.regions] == [r.forward_ms for r in plan.regions], "the regions stay the model's"
    again = paced.paced(1.0)
    assert again.predicted_step_ms == pytest.approx(plan.predicted_step_ms), (
        "paced from the model's own, not compounded"
    )
    assert paced.to_dict()["pace"] == 1.25
    assert "x1.25 the cost model's" in str(paced)
    assert "cost model's" not in str(plan)


def test_the_plan_cache_saves_the_cost_models_plan_not_the_pace():
    """The pace is a live reading of this process's steps: a saved plan carries the model's own
    times, and a stored pace (an older file, an edited one) is not read back."""
    plan = make_plan(tuple(uniform_regions(3)), cuda_machine(10.0), 150 * MB, "auto", other_ms=7.0)
    stored = _encode_plan(plan.paced(1.0))
    assert "pace" not in stored
    assert _decode_plan(stored, "plan") == plan
    assert _decode_plan(stored | {"pace": 0}, "plan") == plan
