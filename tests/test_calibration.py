"""A calibration that cannot lie: an impossible link figure is measured again, never planned on.

The "offload" trial step scales the probe's transfer costs by what moving every region cost it.
Here the machine figures given to the engine say the disk moves 0.1 MB/s, while the real spill
directory moves far more: every trial implies transfer costs a thousandth of the figures', which
no step can show (the link cannot be much faster than measured alone), so the trial is run again,
then the given figures are kept, with a warning; the gradients stay exact throughout.
"""

from __future__ import annotations

import logging

import pytest

import offload
from test_regions import assert_same_history, make_model, train

SLOW_FIGURES = offload.MachineProfile(
    device_type="cpu",
    device_name="figures far slower than this disk",
    disk_write_gb_per_s=1e-4,
    disk_read_gb_per_s=1e-4,
)


def test_an_implausible_calibration_is_measured_again_then_the_probe_is_kept(spill_dir, caplog):
    model = make_model()
    reference = train(make_model(), steps=6)
    eng = offload.engine(0.2, regions=model.blocks, model=model, machine=SLOW_FIGURES, spill_dir=spill_dir)
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert_same_history(train(model, eng, steps=6), reference, "auto with implausible calibrations")
    stages = list(eng.recent_stages)
    assert stages[:3] == ["measure", "recompute", "offload"]
    assert stages.count("offload") == offload.limits.calibration_tries, stages
    assert stages[-1] is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("measuring it again" in w for w in warnings), warnings
    assert any("planning on the probe's own figures" in w for w in warnings), warnings
    transfer_ms = [r.transfer_ms for r in eng.plan.regions]
    expected = [2 * r.saved_bytes / 1e5 * 1e3 for r in eng.plan.regions]  # ms out and back at 0.1 MB/s, unscaled
    assert transfer_ms == pytest.approx(expected)
    text = offload.explain(eng)
    assert "transfers priced at: the probe's figures (every offload trial implausible; rejected as" in text, text
    eng.close()
