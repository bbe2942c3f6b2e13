"""A policy registered with ``offload.register_policy`` is the engine's, end to end.

It used to be a name only ``make_plan`` knew: the engine compared ``policy`` with built-in names in
about fifteen places, so a registered one was never profiled, its ``plan()`` never called and
nothing recomputed. Now the profiler and the regions ask the policy what it needs (``Policy``'s
class attributes). Oracle: the model without the engine, bitwise, step by step.
"""

from __future__ import annotations

import copy
import itertools

import pytest

import offload
from offload import Decision, Policy
from zoo import GPTLoss, assert_same, gpt, run_step

_names = (f"second-block-test-{i}" for i in itertools.count())


def _register(**traits):
    """A policy recomputing the second block, under a fresh name, with ``traits`` set. It sees the
    saves outside the regions as rows too (``RegionProfile.scope``); it need not decide them."""
    calls: list = []

    class SecondBlock(Policy):
        name = next(_names)

        def plan(self, regions, machine, budget_bytes):
            calls.append([r.name for r in regions])
            return tuple(Decision.RECOMPUTE if r.name.endswith("blocks.1") else Decision.KEEP for r in regions)

    for key, value in traits.items():
        setattr(SecondBlock, key, value)
    offload.register_policy(SecondBlock)
    return SecondBlock.name, calls


def _tokens():
    import torch

    return torch.randint(0, 256, (2, 17))


@pytest.mark.parametrize("traits", [{}, {"times": False}, {"trial_always": True, "prices_link": False}])
def test_a_registered_policy_plans_and_runs(traits, spill_dir):
    name, calls = _register(**traits)
    base = GPTLoss(gpt(dropout=0.1))
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    eng = offload.engine(1, min_offload_mb=0, model=model, regions=model.model.blocks, policy=name, spill_dir=spill_dir)
    for step in range(6):
        assert_same(
            run_step(reference, _tokens, loss_fn=lambda loss: loss, input_grad=False),
            run_step(model, _tokens, eng, loss_fn=lambda loss: loss, input_grad=False),
            f"{name}, step {step}",
        )
    assert calls, "the policy's plan() was never called"
    assert calls[-1][1:-1] == ["model.blocks.0", "model.blocks.1"]
    assert eng.plan is not None and eng.plan.policy == name
    assert eng.plan.decisions == (Decision.KEEP, Decision.RECOMPUTE)
    assert eng.stats.recomputed_regions > 0 and not eng.profiling
    assert name in offload.explain(eng)
    eng.close()


def test_a_registered_policy_that_measures_nothing_runs_its_rule_from_the_first_step(spill_dir):
    name, calls = _register(measures=False, unplanned=Decision.RECOMPUTE)
    model = GPTLoss(gpt(dropout=0.0))
    eng = offload.engine(None, min_offload_mb=0, model=model, regions=model.model.blocks, policy=name)
    run_step(model, _tokens, eng, loss_fn=lambda loss: loss, input_grad=False)
    assert eng.stats.recomputed_regions == 2 and not eng.profiling and calls == []
    assert "measures nothing" in offload.explain(eng)
    eng.close()


def test_a_registered_policy_needs_regions_unless_it_says_otherwise():
    name, _ = _register()
    with pytest.raises(ValueError, match="needs regions="):
        offload.engine(0, policy=name)
    free, _ = _register(needs_regions=False)
    offload.engine(0, policy=free).close()
