"""The public seams (``offload.seams``): the module's own example runs as written, each seam the
engine takes is refused with a clear error when it is not one, and a stand-in host sees the
engine's traffic and nothing of pytest's.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

import offload
import offload.seams
from hosts import StandInHost
from zoo import assert_same, run_step, wait_clean


def _example() -> str:
    """The python block of ``offload.seams``'s docstring."""
    (block,) = re.findall(r"```python\n(.*?)```", offload.seams.__doc__, re.DOTALL)
    return block


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])


def _input():
    return torch.randn(256, 64)


def test_the_modules_example_keeps_tensors_in_memory_with_one_warning(spill_dir, caplog):
    """The docstring's full disk: every spill write fails, the step is exact, one warning says so."""
    scope: dict = {}
    exec(compile(_example(), "offload.seams example", "exec"), scope)  # noqa: S102 - our own docstring
    eng = scope["eng"]
    model = _model()
    ref = run_step(model, _input)
    with caplog.at_level(logging.WARNING, logger="offload"):
        for _ in range(2):
            assert_same(ref, run_step(model, _input, eng), "full disk")
    stats = wait_clean(eng)
    assert stats.spilled_bytes == stats.offloaded_bytes == 0 and stats.peak_resident_bytes > 0
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("offload") and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "No space left" in warned[0], warned
    eng.close()


def test_a_host_that_is_not_one_is_refused():
    with pytest.raises(TypeError, match=r"host must be an offload.seams.Host.*got '/tmp'"):
        offload.engine(0, host="/tmp")


def test_every_seam_is_importable_from_the_public_module():
    for name in offload.seams.__all__:
        assert getattr(offload.seams, name).__doc__, f"offload.seams.{name} has no contract (docstring)"


def test_a_stand_in_host_sees_every_spill_write_and_read(spill_dir):
    """Each tensor spilled is one write, each read back one read: what the engine does there, and
    nothing else of the process, goes through the host."""
    host = StandInHost()
    model = _model()
    ref = run_step(model, _input)
    eng = offload.engine(0, min_offload_bytes=0, spill_dir=spill_dir, host=host)
    assert_same(ref, run_step(model, _input, eng), "through a stand-in host")
    stats = wait_clean(eng, spill_dir)
    assert host.landed() == host.writes > 0 and host.opens == 1
    assert stats.spilled_bytes > 0 and host.reads >= stats.reloaded_bytes // (256 * 64 * 4) > 0
    eng.close()
