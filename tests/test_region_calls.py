"""Regions that do not run exactly once a step, in order: called twice, skipped, a varying number of
times, one engine over a GAN's two networks. See Note: [region calls] in ``offload._regions.regions``.

Oracle: the same loop without the engine, exactly (``torch.equal``): losses, parameters after the
updates and module buffers (BatchNorm's running statistics), under every policy, at a budget that
moves part of the saves and at budget 0, with the batch size changing between steps.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import offload

POLICIES = ("auto", "selective", "offload", "recompute", "none")
BUDGETS_MB = (0.02, 0.0)
WIDTH = 32
STEPS = 7
SIZES = (24, 32, 40)
"""Batch sizes, one per step in turn: the shapes change every step."""


class Block(nn.Module):
    """Saves a matmul output, a BatchNorm input, a GELU input and a dropout mask."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(nn.functional.gelu(self.norm(self.linear(x))))


class Net(nn.Module):
    """Four blocks and a head; ``form`` says which blocks a forward calls."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, 1)
        self.calls = 0

    def order(self) -> list[int]:
        self.calls += 1
        if self.form == "twice":
            return [0, 1, 2, 3, 1]  # a block reused, as shared or tied weights are
        if self.form == "skip":
            return [0, 1, 3]  # a block skipped by control flow
        if self.form == "first-twice":
            return [0, 0, 1, 2, 3]  # the first region called again: it must not begin a step
        return list(range(1 + self.calls % 4))  # "vary": an early exit after 1 to 4 blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = self.order()
        for j, i in enumerate(order):
            x = self.blocks[i](x)
            if j < len(order) - 1:
                x = torch.tanh(x)  # saved between two region calls: its output
        return self.head(x).sum()


FORMS = ("twice", "skip", "first-twice", "vary")


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def _assert_same(ref: list, got: list, what: str) -> None:
    assert len(ref) == len(got), what
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(a, b), f"{what}: item {i} differs"


def _train(form: str, policy: str, budget_mb: float | None, *, steps: int = STEPS):
    """The loop with (``policy``) or without (None) the engine: losses, then parameters and
    buffers after the last update; and the engine."""
    torch.manual_seed(0)
    model = Net(form)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eng = None
    if policy is not None:
        budget_mb = None if policy == "none" else budget_mb  # "none" keeps everything: it takes no budget
        eng = offload.engine(budget_mb, model=model, regions=model.blocks, policy=policy, min_offload_mb=0)
    data = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randn(SIZES[step % len(SIZES)], WIDTH, generator=data)
        torch.manual_seed(100 + step)
        if eng is None:
            loss = model(x)
        else:
            with eng:
                loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        model.eval()  # evaluation between steps, under no_grad and inference_mode
        with torch.no_grad():
            model(x[:4])
        with torch.inference_mode():
            model(x[:4])
        model.train()
    return losses, _state(model), eng


@pytest.fixture(scope="module")
def references():
    return {form: _train(form, None, None) for form in FORMS}


@pytest.mark.parametrize("budget", BUDGETS_MB, ids=["part", "zero"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("form", FORMS)
def test_every_policy_trains_regions_called_any_number_of_times(form, policy, budget, references):
    ref_losses, ref_state, _ = references[form]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the link readings' warnings on a loaded machine
        losses, state, eng = _train(form, policy, budget)
    _assert_same(ref_losses, losses, f"{form} under {policy!r}: losses")
    _assert_same(ref_state, state, f"{form} under {policy!r}: parameters and buffers")
    eng.close()


@pytest.mark.parametrize(
    "form,one,rows",
    [("twice", "blocks.2", {"blocks.1": 2, "blocks.3": 1}), ("skip", "blocks.1", {"blocks.2": 0, "blocks.3": 1})],
)
def test_a_regions_profile_is_the_sum_of_its_calls(form, one, rows):
    """A region called twice saves twice a block's bytes (``one``: a block called once whose input,
    too, was saved before it), one skipped saves nothing: each profiling step's rows, and the plan
    made from them."""
    torch.manual_seed(0)
    model = Net(form)
    eng = offload.engine(0.02, model=model, regions=model.blocks, policy="auto", min_offload_mb=0)
    x = torch.randn(32, WIDTH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(8):
            with eng:
                loss = model(x)
            loss.backward()
    assert eng.profiled_steps, "no profiling step was measured"
    for profiled in eng.profiled_steps:
        by_name = {p.name: p for p in profiled.regions}
        once = by_name[one].saved_bytes
        assert once > 0
        for name, times in rows.items():
            assert by_name[name].saved_bytes == times * once, (profiled.stage, name, by_name[name])
    assert not eng.profiling and eng.plan is not None, "the regions were never planned"
    eng.close()


def test_saves_between_region_calls_are_counted_once_each():
    """What is saved between two region calls (a tanh's output here, one per gap) is the step's
    own row, counted at every gap, the one after the first region's second call included."""
    torch.manual_seed(0)
    model = Net("first-twice")
    eng = offload.engine(0.02, model=model, regions=model.blocks, policy="auto", min_offload_mb=0)
    x = torch.randn(32, WIDTH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with eng:
            loss = model(x)
        loss.backward()
    (profiled,) = eng.profiled_steps
    before, _ = profiled.outside
    gaps = len(model.order()) - 1
    assert before.saved_bytes == gaps * x.numel() * x.element_size(), before
    eng.close()


def _gan(policy: str | None, steps: int = 5):
    """One engine over both networks of a GAN with BatchNorm, regions from both: the
    discriminator's step runs the discriminator alone (twice), the generator's runs both."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, WIDTH), Block(), Block())
    disc = nn.Sequential(Block(), Block(), nn.Linear(WIDTH, 1))
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.05)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.05)
    both = nn.ModuleDict({"gen": gen, "disc": disc})
    eng = None
    if policy is not None:
        regions = [gen[1], gen[2], disc[0], disc[1]]
        budget = None if policy == "none" else 0.02
        eng = offload.engine(budget, model=both, regions=regions, policy=policy, min_offload_mb=0)
    data = torch.Generator().manual_seed(2)
    losses = []

    def entered():
        return eng if eng is not None else torch.enable_grad()

    for step in range(steps):
        real = torch.randn(16 + 8 * (step % 2), WIDTH, generator=data)
        z = torch.randn(real.shape[0], 8, generator=data)
        torch.manual_seed(200 + step)
        with entered():
            fake = gen(z)
            d_loss = nn.functional.softplus(-disc(real)).mean() + nn.functional.softplus(disc(fake.detach())).mean()
        d_loss.backward()
        opt_d.step()
        opt_d.zero_grad(set_to_none=True)
        with entered():
            g_loss = nn.functional.softplus(-disc(fake)).mean()
        g_loss.backward()
        opt_g.step()
        opt_g.zero_grad(set_to_none=True)
        losses += [d_loss.detach(), g_loss.detach()]
    return losses, _state(both), eng


@pytest.mark.parametrize("policy", POLICIES)
def test_one_engine_over_a_gans_two_networks(policy):
    ref_losses, ref_state, _ = _gan(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses, state, eng = _gan(policy)
    _assert_same(ref_losses, losses, f"GAN under {policy!r}: losses")
    _assert_same(ref_state, state, f"GAN under {policy!r}: parameters and buffers")
    assert len(eng.recent_stages) == 2 * 5, "each network's step is a step of its own"
    eng.close()


def test_a_forward_that_raises_is_not_planned_from():
    """A profiling step whose forward raised after its regions ran (in the loss) runs its stage
    again: its measurements never reach the profiler."""
    torch.manual_seed(0)
    model = Net("skip")
    eng = offload.engine(0.02, model=model, regions=model.blocks, policy="auto", min_offload_mb=0)
    x = torch.randn(32, WIDTH)
    with pytest.raises(RuntimeError, match="a bad label"):
        with eng:
            model(x)
            raise RuntimeError("a bad label")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with eng:
            loss = model(x)
        loss.backward()
    assert eng.recent_stages[0] == eng.recent_stages[1] == "measure", eng.recent_stages
    assert len(eng.profiled_steps) == 1, "the step that raised was planned from"
    eng.close()


def test_one_entry_around_several_steps_still_counts_each_step():
    """``with eng:`` around the whole loop: each forward and backward is a step of its own (the
    first region begins one once the step before was measured), and gradients stay exact."""
    torch.manual_seed(0)
    ref_model, model = Net("twice"), Net("twice")
    model.load_state_dict(ref_model.state_dict())
    eng = offload.engine(0.02, model=model, regions=model.blocks, policy="auto", min_offload_mb=0)
    x = torch.randn(32, WIDTH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with eng:
            for step in range(4):
                for m in (ref_model, model):
                    torch.manual_seed(step)
                    m(x).backward()
    assert len(eng.profiled_steps) >= 3, eng.recent_stages
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    eng.close()


def _critic(policy: str | None, steps: int = 4):
    """WGAN-GP's critic step: the gradient penalty runs a backward through the regions inside the
    forward (``autograd.grad`` with ``create_graph``), and the second region is called again after
    it: that call runs unmeasured, and the step hands the profiler one measurement."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
    opt = torch.optim.SGD(critic.parameters(), lr=0.05)
    eng = None
    if policy is not None:
        budget = None if policy == "none" else 0.02
        regions = [critic[0], critic[2]]
        eng = offload.engine(budget, model=critic, regions=regions, policy=policy, min_offload_mb=0)
    data = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        real, fake = torch.randn(16, WIDTH, generator=data), torch.randn(16, WIDTH, generator=data)
        mix = (0.3 * real + 0.7 * fake).requires_grad_(True)
        with eng if eng is not None else torch.enable_grad():
            on_real = critic(real).mean()
            half_fake = critic[1](critic[0](fake))
            (grad,) = torch.autograd.grad(critic(mix).sum(), mix, create_graph=True)
            penalty = ((grad.norm(dim=1) - 1) ** 2).mean()
            on_fake = critic[4](critic[3](critic[2](half_fake))).mean()  # the second region alone, after it
            loss = on_fake - on_real + 10 * penalty
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, _state(critic), eng


@pytest.mark.parametrize("policy", ("auto", "offload", "recompute"))
def test_a_backward_inside_the_forward_ends_the_measurement_not_the_step(policy):
    ref_losses, ref_state, _ = _critic(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses, state, eng = _critic(policy)
    _assert_same(ref_losses, losses, f"WGAN-GP critic under {policy!r}: losses")
    _assert_same(ref_state, state, f"WGAN-GP critic under {policy!r}: parameters")
    assert len(eng.recent_stages) == 4, "a call of the second region after the penalty begins no step"
    if policy == "auto":
        assert all(len(p.regions) == 2 for p in eng.profiled_steps)
        assert len(eng.profiled_steps) == len([s for s in eng.recent_stages if s is not None]), eng.recent_stages
    eng.close()
