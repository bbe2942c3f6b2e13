"""The budget sweep's verdicts (``offload.bench.report.verdicts``, ``--preset sweep``) from made-up
rows: paired ratios, the budget filter, the tolerances."""

from __future__ import annotations

import pytest

from offload.bench import report


@pytest.fixture(scope="module")
def sweep():
    return report


def row(policy, runs_ms, *, peak_mb=10.0, budget_mb=20.0, predicted=None):
    return {
        "config": f"{policy}-50%",
        "policy": policy,
        "budget_fraction": 0.5,
        "compiled": False,
        "step_ms": sorted(runs_ms)[len(runs_ms) // 2],
        "runs_step_ms": list(runs_ms),
        "runs_predicted_ms": list(predicted or [None] * len(runs_ms)),
        "predicted_ms": None if predicted is None else sorted(predicted)[len(predicted) // 2],
        "engine_peak_mb": peak_mb,
        "budget_mb": budget_mb,
    }


def test_auto_is_judged_by_ratios_paired_within_each_repeat(sweep):
    # The machine drifts 2x slower over the repeats; auto is 4% slower than recompute in each.
    recompute = row("recompute", [100.0, 150.0, 200.0])
    auto = row("auto", [104.0, 156.0, 208.0], predicted=[110.0, 150.0, 200.0])
    checked = sweep.verdicts([recompute, auto, row("offload", [300.0, 300.0, 300.0])])
    (verdict,) = checked["verdicts"]
    assert verdict["best_fixed"] == "recompute"
    assert verdict["auto_over_best"] == pytest.approx(1.04)
    assert verdict["auto_within_5pct"] and checked["auto_within_5pct_everywhere"]
    # predicted / measured per repeat: 1.0577, 0.9615, 0.9615 -> median 0.9615
    assert verdict["predicted_over_measured"] == pytest.approx(150.0 / 156.0)
    assert verdict["prediction_within_15pct"]


def test_a_policy_over_budget_is_not_the_reference_and_misses_fail(sweep):
    fast_but_over = row("offload", [50.0], peak_mb=30.0)
    recompute = row("recompute", [100.0])
    auto = row("auto", [110.0], predicted=[140.0])
    checked = sweep.verdicts([fast_but_over, recompute, auto])
    (verdict,) = checked["verdicts"]
    assert verdict["best_fixed"] == "recompute"
    assert verdict["auto_over_best"] == pytest.approx(1.1)
    assert not verdict["auto_within_5pct"] and not checked["auto_within_5pct_everywhere"]
    assert not verdict["prediction_within_15pct"]  # 140 / 110 = 1.27
    over = row("auto", [90.0], peak_mb=25.0)
    assert not sweep.verdicts([recompute, over])["auto_holds_budget_everywhere"]
