"""Module state under re-runs: See Note: [a re-run leaves module state as the forward left it].

A recomputed region (whole or selective) and a "recompute" profiling trial run a region's forward
more than once per step. The model's buffers (BatchNorm's running statistics and
``num_batches_tracked``, a spectral norm's power-iteration vectors, counters) and its plain-number
attributes must end each step exactly as the run without the engine leaves them, and a module whose
output depends on state its forward updates must get the same gradients. The oracle is the same
model without the engine, compared with ``torch.equal`` every step, at a batch size that changes
every step. ``torch.utils.checkpoint`` is shown to count BatchNorm's batches twice, which is what
this goes beyond. One test removes the guard (``ForwardStart.rerun``, monkeypatched) to show the
comparisons fail without it: white-box by nature.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import offload
from offload._regions import module_state as _module_state
from zoo import assert_same, cnn, run_step

STEPS = 8
POLICIES = ("recompute", "selective", "auto")
"""Every policy that re-runs a region ("auto" profiles with a "recompute" trial first)."""


def _batches():
    """A batch size that changes every step, as a last partial batch or a curriculum does."""
    return [2 + step % 3 for step in range(STEPS)]


def _cnn_input(batch: int):
    return lambda: torch.randn(batch, 3, 12, 12)


def _engine(model: nn.Module, regions, policy: str) -> offload.Engine:
    return offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions=regions, policy=policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_batchnorm_counts_one_batch_per_step(policy, spill_dir):
    base = cnn(blocks=3)
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    eng = _engine(model, list(model)[1:4], policy)
    for step, batch in enumerate(_batches()):
        assert_same(run_step(reference, _cnn_input(batch)), run_step(model, _cnn_input(batch), eng), f"step {step}")
    assert model[1].bn1.num_batches_tracked.item() == STEPS
    assert eng.stats.recomputed_regions > 0
    eng.close()


def test_torch_checkpoint_counts_two(spill_dir):
    """What the engine goes beyond: torch's own checkpoint updates BatchNorm in its re-run too."""
    block = cnn(blocks=1)[1]
    x = torch.randn(2, 8, 12, 12, requires_grad=True)
    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
    assert block.bn1.num_batches_tracked.item() == 2
    mine = cnn(blocks=1)[1]
    offload.checkpoint(mine, x).sum().backward()
    assert mine.bn1.num_batches_tracked.item() == 1


class Normalizer(nn.Module):
    """Updates running statistics and a call counter, then computes with them: a re-run that saw
    the state the forward left would compute something else (an RL observation normalizer)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.seen = 0  # a plain Python counter
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
            self.calls += 1
        self.seen += 1
        return torch.tanh(self.linear(x - self.mean) * (1.0 + 0.1 * self.calls + 0.01 * self.seen))


def _normalizers(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(Normalizer(16), Normalizer(16), nn.Linear(16, 1))


@pytest.mark.parametrize("policy", POLICIES)
def test_a_module_that_counts_its_calls(policy, spill_dir):
    base = _normalizers()
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    eng = _engine(model, [model[0], model[1]], policy)
    for step, batch in enumerate(_batches()):
        make = lambda batch=batch: torch.randn(batch, 16)  # noqa: E731
        assert_same(run_step(reference, make), run_step(model, make, eng), f"step {step}")
        assert [m.seen for m in model[:2]] == [m.seen for m in reference[:2]] == [step + 1] * 2
    eng.close()


class Branches(nn.Module):
    """Takes one path on odd calls and another on even ones, by a plain-number counter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.fc(x)
        return y.tanh() if self.calls % 2 else y.sigmoid() * 2.0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_forward_that_branches_on_its_counter_re_runs_its_branch(policy, spill_dir):
    """Under torch.utils.checkpoint this re-run takes the other branch (and saves other tensors)."""
    torch.manual_seed(0)
    base = nn.Sequential(Branches(), Branches(), nn.Linear(16, 1))
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    eng = _engine(model, [model[0], model[1]], policy)
    for step, batch in enumerate(_batches()):
        make = lambda batch=batch: torch.randn(batch, 16)  # noqa: E731
        assert_same(run_step(reference, make), run_step(model, make, eng), f"step {step}")
    assert model[0].calls == STEPS
    eng.close()


def test_a_region_called_twice_in_one_forward(spill_dir):
    """One module run twice per forward (shared layers): each call's re-run sees its own start."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = Normalizer(16)

        def forward(self, x):
            return self.norm(self.norm(x))

    torch.manual_seed(0)
    base = Twice()
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    eng = _engine(model, [model.norm], "recompute")
    for step, batch in enumerate(_batches()):
        make = lambda batch=batch: torch.randn(batch, 16)  # noqa: E731
        assert_same(run_step(reference, make), run_step(model, make, eng), f"step {step}")
    assert model.norm.seen == 2 * STEPS
    eng.close()


def test_spectral_norm_power_iteration(spill_dir):
    """A parametrized spectral norm updates its vectors ``u``/``v`` in every training forward."""
    torch.manual_seed(0)
    sn = nn.utils.parametrizations.spectral_norm
    base = nn.Sequential(sn(nn.Linear(16, 16)), nn.Tanh(), sn(nn.Linear(16, 16)), nn.Tanh(), nn.Linear(16, 1))
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    eng = _engine(model, [model[0], model[2]], "recompute")
    for step, batch in enumerate(_batches()):
        make = lambda batch=batch: torch.randn(batch, 16)  # noqa: E731
        assert_same(run_step(reference, make), run_step(model, make, eng), f"step {step}")
    eng.close()


def test_public_checkpoint_of_a_module(spill_dir):
    base = _normalizers()
    reference, model = copy.deepcopy(base), copy.deepcopy(base)

    class Checkpointed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            x = offload.checkpoint(self.inner[0], x)  # a module
            x = offload.checkpoint(self.inner[1].forward, x)  # a module's bound method
            return self.inner[2](x)

    wrapped = Checkpointed(model)
    for step, batch in enumerate(_batches()):
        make = lambda batch=batch: torch.randn(batch, 16)  # noqa: E731
        ref = run_step(reference, make)
        got = run_step(wrapped, make)
        got.grads = {k.removeprefix("inner."): v for k, v in got.grads.items()}
        got.buffers = {k.removeprefix("inner."): v for k, v in got.buffers.items()}
        assert_same(ref, got, f"step {step}")


class LateWriter(nn.Module):
    """Adds to a buffer only once ``writing`` is switched on: through ``.data`` (no version bump,
    as BatchNorm's own writes) or under ``no_grad`` (a bump)."""

    def __init__(self, bump: bool) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(16))
        self.linear = nn.Linear(16, 16)
        self.writing = False
        self.bump = bump

    def forward(self, x):
        if self.writing:
            if self.bump:
                with torch.no_grad():
                    self.total.add_(x.sum(0))
            else:
                self.total.data.add_(x.detach().sum(0))
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("bump", [True, False], ids=["version-bump", "no-bump"])
def test_a_buffer_first_changed_later_is_still_left_exact(bump, spill_dir):
    torch.manual_seed(0)
    base = nn.Sequential(LateWriter(bump), nn.Linear(16, 1))
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    eng = _engine(model, [model[0]], "recompute")
    caught = []
    for step, batch in enumerate(_batches()):
        if step == 3:
            reference[0].writing = model[0].writing = True
        make = lambda batch=batch: torch.randn(batch, 16)  # noqa: E731
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = run_step(model, make, eng)
        caught += [w for w in seen if "for the first time" in str(w.message)]
        assert_same(run_step(reference, make), got, f"step {step}")
    # A change that bumps a version is seen (the warning, once); one that bumps nothing is not,
    # and the state is exact either way.
    assert len(caught) == (1 if bump else 0)
    eng.close()


class FirstCallOfAStep(nn.Module):
    """Adds a plain-number attribute in its forward, and computes by whether it was there: the
    loop deletes it after each step (a flag an optimizer hook clears). A re-run that saw the
    attribute the forward added would take the other scale."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        scale = 0.5 if "stepped" in self.__dict__ else 2.0
        self.stepped = True
        return torch.tanh(self.fc(x) * scale)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_number_attribute_the_forward_adds(policy, spill_dir):
    torch.manual_seed(0)
    base = nn.Sequential(FirstCallOfAStep(), FirstCallOfAStep(), nn.Linear(16, 1))
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    eng = _engine(model, [model[0], model[1]], policy)
    for step, batch in enumerate(_batches()):
        make = lambda batch=batch: torch.randn(batch, 16)  # noqa: E731
        assert_same(run_step(reference, make), run_step(model, make, eng), f"step {step}")
        assert [m.__dict__.get("stepped") for m in model[:2]] == [True, True]
        for m in (*model[:2], *reference[:2]):
            del m.stepped
    assert eng.stats.recomputed_regions > 0
    eng.close()


class TrainingNormalizer(nn.Module):
    """Updates its running mean only in training (as BatchNorm does), then computes with it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return torch.tanh(self.linear(x - self.mean))


@pytest.mark.parametrize("policy", POLICIES)
def test_a_switch_between_eval_and_train_under_one_engine(policy, spill_dir):
    """An evaluation step with gradients (its regions re-run, changing nothing) before training:
    what a region's forwards change is learned per train/eval setting, so the training forwards
    are not taken to change nothing, and their re-runs start from the mean the forward found."""
    torch.manual_seed(0)
    base = nn.Sequential(TrainingNormalizer(16), TrainingNormalizer(16), nn.Linear(16, 1))
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    eng = _engine(model, [model[0], model[1]], policy)
    for step, batch in enumerate(_batches()):
        training = step % 4 != 0  # eval at steps 0 and 4
        reference.train(training)
        model.train(training)
        make = lambda batch=batch: torch.randn(batch, 16)  # noqa: E731
        assert_same(run_step(reference, make), run_step(model, make, eng), f"step {step} (training {training})")
    assert not torch.equal(model[0].mean, torch.zeros(16))
    assert eng.stats.recomputed_regions > 0
    eng.close()


class Accumulates(nn.Module):
    """Assigns its buffer anew each forward (``self.total = ...``, not in place), then computes with it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(16))
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        self.total = self.total * 0.5 + x.detach().mean(0)
        return torch.tanh(self.fc(x) + self.total)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_buffer_the_forward_assigns_anew(policy, spill_dir):
    """The re-run starts from the tensor the forward replaced, and the module ends the step
    holding the tensor the forward made."""
    torch.manual_seed(0)
    base = nn.Sequential(Accumulates(), Accumulates(), nn.Linear(16, 1))
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    eng = _engine(model, [model[0], model[1]], policy)
    for step, batch in enumerate(_batches()):
        made: list = []
        hook = model[0].register_forward_hook(lambda m, args, out, made=made: made.append(m.total))
        make = lambda batch=batch: torch.randn(batch, 16)  # noqa: E731
        assert_same(run_step(reference, make), run_step(model, make, eng), f"step {step}")
        hook.remove()
        assert model[0].total is made[0], f"step {step}: the buffer is not the tensor the forward made"
    assert eng.stats.recomputed_regions > 0
    eng.close()


def test_without_the_guard_batchnorm_counts_twice(monkeypatch, spill_dir):
    """The test above can fail: with the re-run's guard removed, the buffers part from the reference."""
    monkeypatch.setattr(_module_state.ForwardStart, "rerun", lambda self: _null())
    base = cnn(blocks=3)
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    eng = _engine(model, list(model)[1:4], "recompute")
    run_step(reference, _cnn_input(2))
    run_step(model, _cnn_input(2), eng)
    assert model[1].bn1.num_batches_tracked.item() == 2
    assert not torch.equal(model[1].bn1.running_mean, reference[1].bn1.running_mean)
    eng.close()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the comparison ops the module-state bookkeeping would run (a device synchronization
    each time their result is read on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.compares = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.ne, torch.ops.aten.equal):
            self.compares += 1
        return func(*args, **(kwargs or {}))


def test_public_checkpoint_compares_no_buffer(spill_dir):
    """``offload.checkpoint`` makes a frame per call, with nothing to learn from: it keeps every
    buffer and compares none (on CUDA each compare read back is a synchronization)."""
    block = cnn(blocks=1)[1]
    x = torch.randn(2, 8, 12, 12, requires_grad=True)
    counter = _CountOps()
    with counter:
        out = offload.checkpoint(block, x)
    assert counter.compares == 0
    out.sum().backward()
    assert block.bn1.num_batches_tracked.item() == 1


def test_a_region_compares_its_buffers_once_per_setting(spill_dir):
    model = cnn(blocks=2)
    eng = _engine(model, list(model)[1:3], "recompute")
    counts = []
    for _ in range(3):
        counter = _CountOps()
        with counter:
            run_step(model, _cnn_input(2), eng)
        counts.append(counter.compares)
    assert counts[0] > 0 and counts[1:] == [0, 0], counts
    eng.close()


def test_predict_runs_offload_checkpoint_of_a_module_with_buffers():
    """On the meta device a buffer has no values to compare: it counts as changed, and the
    prediction runs (a value compare would raise: aten::equal has no meta kernel)."""

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = cnn(blocks=2)

        def forward(self, x):
            x = self.net[0](x)
            for block in list(self.net)[1:3]:
                x = offload.checkpoint(block, x)
            return self.net[3:](x)

    prediction = offload.predict(Checkpointed(), torch.randn(4, 3, 12, 12), machine="h100-sxm")
    blocks = [r for r in prediction.regions if r.name in ("net.1", "net.2")]
    assert len(blocks) == 2 and all(r.forward_flops > 0 for r in blocks), prediction.regions
    assert [r.name for r in prediction.plan.regions] == ["net.1", "net.2"]
