"""The parts ``offload.predict`` composes, white-box: this CPU's compute calibrated on a timed
reference step (``_predict.this_cpu``), the dtype a measured CPU is priced in, and what a plan
holds once the store prefetches into its room (``_predict.predict.held_bytes``, a pure function).
Each is a number ``predict`` folds into its table where no public figure shows it alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import offload
from offload import MachineProfile, predict
from offload._predict.this_cpu import calibrate_compute, reference_step_ms
from test_predict import CPU, _tiny


def test_measured_compute_is_scaled_to_a_timed_reference_step():
    """A lone matmul's best run is not what a step gets from the CPU: the measured machine is
    scaled so that the roofline prices a real, timed reference step as long as it took."""
    for peak_flops, memory_gb_per_s, op_us, wrong in ((1e15, 1e5, 0.001, "fast"), (1e7, 1e-2, 1000.0, "slow")):
        machine = dataclasses.replace(CPU, peak_flops=peak_flops, memory_gb_per_s=memory_gb_per_s)
        machine = machine.with_assumptions(op_overhead_us=op_us)
        before, measured = reference_step_ms(machine)
        assert (before < 0.01 * measured) if wrong == "fast" else (before > 100 * measured), (wrong, before, measured)
        calibrated = calibrate_compute(machine)
        factor = calibrated.compute_scale
        assert calibrated.peak_flops == pytest.approx(machine.peak_flops * factor)
        assert calibrated.memory_gb_per_s == pytest.approx(machine.memory_gb_per_s * factor)
        assert calibrated.assumptions.op_overhead_us == pytest.approx(op_us / factor), "the op cost by the inverse"
        assert calibrated.assumptions.flops_fraction == 1.0, "measured figures: the fractions stay 1"
        assert "timed reference step" in calibrated.source
        with torch.no_grad():  # a training step is timed whatever the caller's grad mode
            after, measured_again = reference_step_ms(calibrated)
        assert after == pytest.approx(before / factor, rel=1e-6), "every term of the roofline scales by one factor"
        assert 0.25 < after / measured_again < 4.0, (wrong, after, measured_again)  # the step timed again: noise
    with pytest.raises(ValueError, match="times this CPU"):
        calibrate_compute(offload.machine("h100-sxm"))


def test_this_cpu_is_measured_in_the_models_dtype(monkeypatch):
    """A bf16 model on this CPU is priced on bf16 matmuls and a bf16 reference step."""
    import offload._predict.predict as predict_module

    seen = []

    def measured(profile, *, dtype=torch.float32):
        seen.append(dtype)
        return CPU

    monkeypatch.setattr(predict_module, "measure_machine", measured)
    model, x, y = _tiny()
    predict(model.to(torch.bfloat16), x, y, machine=CPU.machine_profile(), regions=model.blocks, budgets=(1.0,))
    assert seen == [torch.bfloat16]


def test_a_plan_that_moves_bytes_is_held_up_to_its_budget():
    from offload._plan.policy import make_plan
    from offload._predict.predict import held_bytes

    regions = [offload.RegionProfile(name=f"r{i}", saved_bytes=100 << 20, forward_ms=10.0) for i in range(4)]
    link = MachineProfile(device_type="cuda", d2h_gb_per_s=20.0, h2d_gb_per_s=20.0)
    keep = make_plan(regions, link, None, "none")
    moving = make_plan(regions, link, 150 << 20, "offload")
    assert moving.predicted_peak_bytes == 100 << 20  # one region kept hot: what the plan needs
    assert held_bytes(moving, keep.predicted_peak_bytes) == 150 << 20  # the store prefetches into the room left
    assert held_bytes(keep, keep.predicted_peak_bytes) == keep.predicted_peak_bytes
    recompute = make_plan(regions, link, 150 << 20, "recompute")
    assert held_bytes(recompute, keep.predicted_peak_bytes) == recompute.predicted_peak_bytes
