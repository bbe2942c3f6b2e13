"""offload.predict's table and the plans users run: units, budgets, partial checkpointing, op-level rules.

Oracles: the planner's own price of the same decisions (``offload._predict`` composes it), and
byte counts taken from the prediction's own regions (the table must add them up as the regions do).
"""

from __future__ import annotations

import pytest
import torch

import offload
from offload.models import GPTConfig, MiniGPT

MIB = 1 << 20


def _model(n_layer: int = 4, seq: int = 1024) -> tuple[torch.nn.Module, torch.Tensor]:
    with torch.device("meta"):
        model = MiniGPT(GPTConfig(n_layer=n_layer, n_embd=512, n_head=8, seq_len=seq)).to(torch.bfloat16)
    return model, torch.zeros(2, seq, dtype=torch.long, device="meta")


@pytest.fixture(scope="module")
def small():
    return _model()


# -- item 5: reading the table -----------------------------------------------------------------


def test_every_memory_figure_of_the_printout_is_in_mib(small):
    model, tokens = small
    text = str(offload.predict(model, tokens, tokens, machine="h100-sxm"))
    assert " MB" not in text and "MB " not in text
    header = text.splitlines()[text.splitlines().index("") + 1]
    assert header.split()[:9] == ["policy", "budget", "budget", "MiB", "peak", "MiB", "held", "MiB", "step"]


def test_a_policy_whose_peak_exceeds_a_budget_is_marked_instead_of_priced(small):
    model, tokens = small
    prediction = offload.predict(model, tokens, tokens, machine="h100-sxm")
    rows = {(line.split()[0], line.split()[1]): line for line in prediction.table().splitlines()[2:]}
    none_half = next(p for p in prediction.points if p.policy == "none" and p.budget_fraction == 0.5)
    assert not none_half.fits
    assert rows[("none", "50%")].endswith("does not meet this budget")
    assert f"{none_half.step_ms:.2f}" not in rows[("none", "50%")]
    assert "does not meet" not in rows[("none", "100%")]


def test_auto_takes_a_plan_that_fits_the_device_where_one_does(small):
    """Without the device in its choice, auto at 100 % keeps everything (the fastest plan in
    budget); with the device too small for that, it takes a fitting plan of the table."""
    model, tokens = small
    roomy = offload.predict(model, tokens, tokens, machine="h100-sxm")
    auto_full = next(p for p in roomy.points if p.policy == "auto" and p.budget_fraction == 1.0)
    fitting = [p for p in roomy.points if p.policy != "auto" and p.policy not in ("none", "checkpoint") and p.fits]
    smaller = min(p.device_bytes for p in fitting)
    assert smaller < auto_full.device_bytes
    memory = (smaller + auto_full.device_bytes) // 2  # the keep-all plan no longer fits; another does
    tight = offload.predict(model, tokens, tokens, machine="h100-sxm", memory_bytes=memory)
    for fraction in (1.0, 0.5, 0.25, 0.1):
        auto = next(p for p in tight.points if p.policy == "auto" and p.budget_fraction == fraction)
        others = [
            p
            for p in tight.points
            if p.policy in ("offload", "recompute", "selective") and p.budget_fraction == fraction and p.fits
        ]
        if any(p.fits_device for p in others):
            assert auto.fits and auto.fits_device, (fraction, auto)
    auto_full_tight = next(p for p in tight.points if p.policy == "auto" and p.budget_fraction == 1.0)
    assert auto_full_tight.step_ms >= auto_full.step_ms  # it gave up speed for the device, not budget
