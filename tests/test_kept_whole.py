"""A step whose plan keeps everything runs without the engine's hooks from its first region on.
See Note: [a step kept whole runs unhooked] in ``offload._memory.session``.

Oracle: the same loop without the engine, exactly (``torch.equal``: losses, parameters after the
updates, buffers). What is counted says which steps ran unhooked (``Stats.uncounted_steps``); a
pair of the user's own around the engine counts what reaches it, which must stay nothing.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import offload
from test_region_calls import _assert_same

WIDTH = 32


class Net(nn.Module):
    """An embedding, three blocks and a head; ``bare``: the blocks alone, nothing saved around them."""

    def __init__(self, bare: bool = False) -> None:
        super().__init__()
        self.bare = bare
        torch.manual_seed(0)
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.GELU(), nn.Dropout(0.1)) for _ in range(3)
        )
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.bare:
            x = torch.tanh(self.embed(x))
        for block in self.blocks:
            x = block(x)
        return x.sum() if self.bare else self.head(x).sum()


def _loop(budget_mb, *, steps: int = 8, outer=None, bare: bool = False, **options):
    """Losses and the model's state after ``steps`` SGD steps at one shape; the engine (None: no
    engine); ``outer``: a pair of the user's around each ``with eng:``; ``bare``: ``Net(bare=True)``."""
    model = Net(bare)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eng = None
    if budget_mb != "none":
        eng = offload.engine(budget_mb, model=model, regions=model.blocks, min_offload_mb=0, **options)
    data = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randn(32, WIDTH, generator=data)
        torch.manual_seed(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if eng is None:
                loss = model(x)
            elif outer is not None:
                with torch.autograd.graph.saved_tensors_hooks(*outer):
                    with eng:
                        loss = model(x)
            else:
                with eng:
                    loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    state = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    return losses, state, eng


def _same(a, b) -> None:
    _assert_same(a, b, "against no engine")


@pytest.fixture(scope="module")
def reference():
    return _loop("none")


def test_a_plan_that_keeps_everything_runs_its_steps_unhooked(reference):
    losses, state, eng = _loop(64)
    _same(reference[0], losses)
    _same(reference[1], state)
    assert all(d is offload.Decision.KEEP for d in eng.plan.decisions), str(eng.plan)
    assert len(eng.recent_stages) == 8, "each entry a step of its own, unhooked ones included (nothing counted)"
    planned = sum(1 for s in eng.recent_stages if s is None)
    assert planned > 0, eng.recent_stages
    assert eng.stats.uncounted_steps == planned, (eng.stats.uncounted_steps, eng.recent_stages)
    eng.close()


def test_a_plan_that_moves_or_recomputes_keeps_the_hooks(reference):
    losses, state, eng = _loop(0, policy="offload")
    _same(reference[0], losses)
    _same(reference[1], state)
    assert eng.stats.uncounted_steps == 0
    eng.close()


def test_a_budget_following_free_memory_keeps_the_hooks(reference):
    losses, state, eng = _loop("auto", memory=lambda: 1 << 40)
    _same(reference[0], losses)
    assert eng.stats.uncounted_steps == 0
    eng.close()


def test_an_outer_pair_sees_nothing_saved_inside_a_step_kept_whole(reference):
    """The engine's pair is taken off only where it is alone on the stack: a pair of the user's
    below it would otherwise be called for every save of the step."""
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    losses, state, eng = _loop(64, outer=(pack, lambda t: t))
    _same(reference[0], losses)
    assert seen == [], f"{len(seen)} saves made inside the engine reached the pair outside it"
    assert eng.stats.uncounted_steps == 0
    eng.close()


def test_a_pair_inside_a_region_still_sees_its_saves():
    """A pair pushed inside the forward (``no_offload`` around a block, a user's own) is on top of
    the engine's while it runs: the engine leaves the stack as it is then, and the inner pair sees
    every save made under it."""
    model = Net()
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    inner = model.blocks[1].forward
    model.blocks[1].forward = lambda x: _under(pack, inner, x)
    eng = offload.engine(64, model=model, regions=model.blocks, min_offload_mb=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(8):
            with eng:
                loss = model(torch.randn(32, WIDTH))
            loss.backward()
    assert eng.stats.uncounted_steps > 0
    assert len(seen) >= 8 * 3, "the block's saves reached its own pair every step"
    eng.close()


def _under(pack, forward, x):
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return forward(x)


def test_a_pair_inside_the_engine_around_the_whole_forward_keeps_every_save():
    """``with eng:`` then a user's pair around the model: at the first region call the user's pair
    is on top, so the engine takes nothing off; the pair sees every save, every step."""
    model = Net()
    per_step = []

    def pack(t):
        per_step[-1] += 1
        return t

    eng = offload.engine(64, model=model, regions=model.blocks, min_offload_mb=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(8):
            per_step.append(0)
            with eng:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = model(torch.randn(32, WIDTH))
            loss.backward()
    assert per_step[0] > 0 and len(set(per_step)) == 1, per_step
    eng.close()


@offload.register_policy
class _KeepTheRegions(offload.Policy):
    """Keeps every region, and moves what is saved after them where ``after`` says so."""

    name = "test-kept-whole-keep-the-regions"
    after = offload.Decision.KEEP

    def plan(self, regions, machine, budget_bytes):
        return tuple(self.after if r.scope is offload.Scope.AFTER else offload.Decision.KEEP for r in regions)


@offload.register_policy
class _KeepAllButMoveTheHead(_KeepTheRegions):
    name = "test-kept-whole-move-the-head"
    after = offload.Decision.OFFLOAD


def test_a_plan_that_keeps_everything_over_the_budget_keeps_the_hooks(reference):
    """Decisions that keep more than the budget (nothing saved outside the regions, so the planner
    has nothing else to move): the store must move the excess, so it must see every save, and it
    holds the budget."""
    reference = _loop("none", bare=True)
    losses, state, eng = _loop(0.01, policy=_KeepTheRegions.name, bare=True)
    _same(reference[0], losses)
    _same(reference[1], state)
    plan = eng.plan
    assert not plan.fits_budget and all(r.decision is offload.Decision.KEEP for r in (*plan.regions, *plan.outside))
    assert eng.stats.uncounted_steps == 0
    assert eng.stats.peak_resident_bytes <= eng.stats.budget_bytes
    eng.close()


def test_a_plan_that_moves_what_follows_the_regions_keeps_the_hooks(reference):
    losses, state, eng = _loop(64, policy=_KeepAllButMoveTheHead.name)
    _same(reference[0], losses)
    assert eng.plan.decision_after() is offload.Decision.OFFLOAD, str(eng.plan)
    assert eng.stats.uncounted_steps == 0
    eng.close()


def test_a_derived_plan_keeps_the_hooks():
    """A plan derived from the fit at a shape never measured is checked against what its steps
    save, so those steps are counted, whatever it decides."""
    model = Net()
    eng = offload.engine(64, model=model, regions=model.blocks, min_offload_mb=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rows in (16, 48, 16, 48, 16, 48, 16, 48, 16, 48, 16, 48):
            with eng:
                loss = model(torch.randn(rows, WIDTH))
            loss.backward()
        assert not eng.profiling
        before = eng.stats.uncounted_steps
        with eng:
            loss = model(torch.randn(32, WIDTH))
        loss.backward()
    assert "derived" in eng.plan.origin, str(eng.plan)
    assert eng.stats.uncounted_steps == before
    eng.close()
