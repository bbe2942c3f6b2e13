"""offload.predict: named machines, predictions on meta tensors, and the predict command."""

from __future__ import annotations

import pytest

from offload import MachineProfile
from offload._machines import MACHINES, Assumptions, from_probe, get_machine, machine_names

# -- machines: plain numbers ------------------------------------------------------------------


def test_named_machines_carry_their_datasheet_figures():
    h100 = get_machine("h100-sxm")
    assert h100.peak_flops == 989e12
    assert h100.memory_gb_per_s == 3350
    assert h100.memory_bytes == 80 * 10**9
    assert (h100.link_out_gb_per_s, h100.link_back_gb_per_s, h100.link_both_gb_per_s) == (64, 64, 128)
    assert get_machine("gh200").link_out_gb_per_s == 450
    assert get_machine("h200").memory_bytes == 141 * 10**9
    assert get_machine("a100-80gb-sxm").peak_flops == 312e12
    assert set(machine_names()) == {"a100-80gb-sxm", "h100-sxm", "h100-pcie", "h200", "gh200"}
    for machine in MACHINES.values():
        assert "http" in machine.source  # every figure names where it comes from


def test_achieved_figures_are_peak_times_the_named_assumptions():
    h200 = get_machine("h200").with_assumptions(flops_fraction=0.5, memory_fraction=0.75, link_fraction=0.25)
    assert h200.achieved_flops() == 989e12 * 0.5
    assert h200.achieved_memory_gb_per_s() == 4800 * 0.75
    assert h200.achieved_link_gb_per_s() == (16.0, 16.0, 16.0)
    profile = h200.machine_profile()
    assert (profile.device_type, profile.d2h_gb_per_s, profile.h2d_gb_per_s) == ("cuda", 16.0, 16.0)
    assert get_machine("h200").assumptions == Assumptions()  # the named record is unchanged


def test_bad_assumptions_name_the_value_and_the_choices():
    with pytest.raises(ValueError, match="flops_fraction must be a number in"):
        get_machine("h100-sxm").with_assumptions(flops_fraction=1.5)
    with pytest.raises(ValueError, match="valid ones are: flops_fraction"):
        get_machine("h100-sxm").with_assumptions(flop_fraction=0.5)
    with pytest.raises(ValueError, match="named machines are: a100-80gb-sxm"):
        get_machine("h300")


def test_a_probe_becomes_a_machine_with_measured_figures():
    profile = MachineProfile(
        device_type="cpu", device_name="x", disk_write_gb_per_s=0.5, disk_read_gb_per_s=2.0, per_tensor_overhead_us=7
    )
    machine = from_probe(profile, flops=1e11, memory_gb_per_s=5.0, memory_bytes=24 * 10**9, op_overhead_us=3.0)
    assert machine.achieved_flops() == 1e11  # measured: fractions are 1
    assert machine.achieved_memory_gb_per_s() == 5.0
    assert machine.assumptions.op_overhead_us == 3.0
    back = machine.machine_profile()
    assert (back.device_type, back.disk_write_gb_per_s, back.disk_read_gb_per_s) == ("cpu", 0.5, 2.0)
    assert back.per_tensor_overhead_us == 7
    with pytest.raises(ValueError, match="unusable link"):
        from_probe(MachineProfile(device_type="cuda"), flops=1, memory_gb_per_s=1, memory_bytes=1, op_overhead_us=0)
