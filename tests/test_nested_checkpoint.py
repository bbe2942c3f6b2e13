"""Regions that run a backward of their own, and regions inside regions.

A region may call ``torch.autograd.grad`` in its forward (a gradient penalty, forces from an
energy, an inner optimisation step), and a checkpoint may be called inside another checkpoint.
``torch.utils.checkpoint(use_reentrant=False)`` supports both; these tests hold
``offload.checkpoint`` to the same behaviour, written after the cases PyTorch tests for its own
checkpoint (nested checkpoints of two and three levels, two children, a backward inside the
forward with and without ``create_graph``, double backward, dropout), and under the engine with
``policy="recompute"`` and ``"auto"``.

Oracles: the same functions without any checkpoint, and torch's non-reentrant checkpoint. On the
CPU in fp32 the math is identical op for op, so every gradient must be bitwise equal
(``torch.equal``). The cost bound is counted with ``FlopCounterMode``: each recomputed region
costs at most one extra forward of itself per backward pass. What a step leaves behind is counted
on the recompute frames themselves (``offload._regions.recompute.Frame``), white-box: no public
reading shows them.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import offload
from offload._regions import recompute as _recompute
from test_recompute import settle
from test_regions import MACHINE, block_engine
from zoo import most_profiling_steps

SEED = 4321
"""Seed set before each forward, so dropout masks agree between variants."""

ROWS, WIDTH = 16, 8


def leaf(seed: int = 0, shape=(ROWS, WIDTH)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_()


def no_ckpt(fn):
    return fn


def offload_ckpt(fn):
    return lambda *args: offload.checkpoint(fn, *args)


def torch_ckpt(fn):
    return lambda *args: torch_checkpoint.checkpoint(fn, *args, use_reentrant=False)


WRAPPERS = {"plain": no_ckpt, "offload": offload_ckpt, "torch": torch_ckpt}


_FRAMES_BEFORE: set[int] = set()
"""Ids of the recompute frames alive when the running test began (another test's, e.g. one kept by
the cycle of Note: [a frame that cannot re-run holds nothing] through a changed argument)."""


def _live_frames() -> set[int]:
    gc.collect()
    return {id(o) for o in gc.get_objects() if type(o) is _recompute.Frame}


@pytest.fixture(autouse=True)
def _frames_before():
    _FRAMES_BEFORE.clear()
    _FRAMES_BEFORE.update(_live_frames())


def frames_alive() -> int:
    """Recompute frames made by the running test and still alive (a leaked frame's id is not reused)."""
    return len(_live_frames() - _FRAMES_BEFORE)


def grads_of(build, x: torch.Tensor, wrap) -> torch.Tensor:
    """d(sum of build(wrap)(x)) / dx for a fresh copy of the leaf, the RNG reseeded first."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(SEED)
    out = build(wrap)(x)
    out.sum().backward()
    return x.grad


def assert_all_equal(build, x: torch.Tensor, what: str) -> None:
    want = grads_of(build, x, no_ckpt)
    for name in ("torch", "offload"):
        got = grads_of(build, x, WRAPPERS[name])
        assert torch.equal(got, want), f"{what}: {name} checkpoint's gradient differs from no checkpoint"
    assert frames_alive() == 0, f"{what}: a frame outlived its backward"


# ------------------------------------------------------------------------ composable pieces
#
# Like PyTorch's own nested-checkpoint tests: small functions of x combined by "take the gradient
# inside" and "checkpoint this", in every order, each combination against the uncheckpointed one.


def f(x):
    return x.sin().exp() * x


def g(x):
    return (x * x).tanh().cos()


def grad_inside(fn):
    """x -> d(sum fn(x))/dx with create_graph: a backward run in the forward, differentiable."""

    def run(x):
        (gx,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
        return gx

    return run


def times_input(fn):
    return lambda x: fn(x) * x.cos()


COMPOSITIONS = {
    # name: build(wrap) -> function of x
    "c(f)": lambda c: c(f),
    "c(grad(f))": lambda c: c(grad_inside(f)),
    "c(grad(c(f)))": lambda c: c(grad_inside(c(f))),
    "grad(c(f))": lambda c: grad_inside(c(f)),
    "c(c(f))": lambda c: c(times_input(c(f))),
    "c(c(c(f)))": lambda c: c(times_input(c(times_input(c(f))))),
    "c(grad(c(grad(c(f)))))": lambda c: c(grad_inside(c(grad_inside(c(f))))),
    "c(c(f)+c(g))": lambda c: c(lambda x: c(f)(x) + c(g)(x)),
    "c(grad(c(f)+c(g)))": lambda c: c(grad_inside(lambda x: c(f)(x) * c(g)(x))),
    "c(grad(c(f))*c(g))": lambda c: c(lambda x: grad_inside(c(f))(x) * c(g)(x)),
}


@pytest.mark.sweep
@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_compositions_equal_no_checkpoint_and_torch(name):
    assert_all_equal(COMPOSITIONS[name], leaf(), name)


def test_issue_example_gradient_penalty_in_a_region():
    def region(x):
        y = x.sin().exp()
        (gy,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return gy * y

    assert_all_equal(lambda c: c(region), leaf(shape=(4,)), "issue 13 example")


def test_inner_backward_without_create_graph_frees_its_part_of_the_graph():
    """The inner grad (retain_graph=False) frees what it went through; only the rest is needed later."""

    def region(x):
        z = x.sin().cos()
        (gx,) = torch.autograd.grad(z.sum(), x)
        return x.cos() * gx

    assert_all_equal(lambda c: c(region), leaf(), "inner grad without create_graph")


def test_inner_backward_that_saves_tensors_of_its_own():
    """With create_graph the inner backward's own ops save tensors (cos of x, products of grads):
    they are part of the region's saves in forward and in the recompute, in the same order."""

    def region(x):
        y = (x.sin() * x).exp()
        (gy,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (ggy,) = torch.autograd.grad((gy * gy).sum(), x, create_graph=True)
        return ggy + gy * y

    saved_by_forward = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_by_forward.append(1) or t, lambda t: t):
        y = (leaf().sin() * leaf()).exp()
    saved_in_all = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_in_all.append(1) or t, lambda t: t):
        region(leaf())
    assert len(saved_in_all) > len(saved_by_forward) + 2, "the case must have an inner backward that saves"
    del y
    assert_all_equal(lambda c: c(region), leaf(), "inner backward that saves")


def test_last_save_inside_the_inner_backward():
    """The region's last save is made by the inner backward: the early stop must not break it."""

    def region(x):
        y = x.exp()
        (gy,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
        return gy

    assert_all_equal(lambda c: c(region), leaf(), "last save in the inner backward")


def test_double_backward_through_a_region_with_an_inner_grad():
    def region(x):
        y = x.sin() * x.exp()
        (gy,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return gy * y

    def second_order(wrap):
        x = leaf().detach().clone().requires_grad_()
        torch.manual_seed(SEED)
        out = wrap(region)(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (ggx,) = torch.autograd.grad((gx * gx).sum(), x)
        return gx.detach(), ggx

    want = second_order(no_ckpt)
    for name in ("torch", "offload"):
        got = second_order(WRAPPERS[name])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{name}: double backward differs"
    assert frames_alive() == 0


def test_dropout_inside_a_region_with_an_inner_grad_is_replayed():
    torch.manual_seed(0)
    lin = nn.Linear(WIDTH, WIDTH)

    def region(x):
        h = F.dropout(lin(x).tanh(), p=0.5, training=True)
        (gh,) = torch.autograd.grad(h.square().sum(), x, create_graph=True)
        return F.dropout(gh, p=0.3, training=True) * h

    x = leaf()
    want = grads_of(lambda c: c(region), x, no_ckpt)
    assert (want != 0).any()
    for name in ("torch", "offload"):
        lin.zero_grad()
        assert torch.equal(grads_of(lambda c: c(region), x, WRAPPERS[name]), want), name


def test_parameter_grads_of_nested_regions_with_inner_grads():
    torch.manual_seed(0)
    inner, outer = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def build(c):
        def energy(x):
            return inner(x).tanh().square().sum(dim=1, keepdim=True)

        def block(x):
            e = c(energy)(x)
            (force,) = torch.autograd.grad(e.sum(), x, create_graph=True)
            return outer(x - 0.1 * force).sin()

        return c(block)

    def run(wrap):
        for p in (*inner.parameters(), *outer.parameters()):
            p.grad = None
        grads_of(build, leaf(), wrap)
        return [p.grad.clone() for p in (*inner.parameters(), *outer.parameters())]

    want = run(no_ckpt)
    for name in ("torch", "offload"):
        for i, (a, b) in enumerate(zip(run(WRAPPERS[name]), want, strict=True)):
            assert torch.equal(a, b), f"{name}: grad of parameter {i} differs"


def test_kwargs_and_non_tensor_outputs_in_nested_regions():
    def inner(x, *, scale):
        return {"y": x.sin() * scale, "note": "kept"}

    def outer(x, scale=2.0):
        got = offload.checkpoint(inner, x, scale=scale)
        assert got["note"] == "kept"
        (gx,) = torch.autograd.grad(got["y"].sum(), x, create_graph=True)
        return gx * got["y"]

    x = leaf()
    want = grads_of(lambda c: lambda t: outer(t), x, no_ckpt)
    got = grads_of(lambda c: lambda t: offload.checkpoint(outer, t, scale=2.0), x, no_ckpt)
    assert torch.equal(got, want)


class TwiceWithInnerGrad(torch.autograd.Function):
    """x -> 2x, whose backward runs a backward of its own (a reentrant one, during the outer backward)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)  # inside a region: a slot like any other save
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            y = x.detach().requires_grad_()
            (gy,) = torch.autograd.grad((y.sin() * y).sum(), y)
        return grad * gy


def test_custom_function_whose_backward_runs_a_backward():
    def region(x):
        h = TwiceWithInnerGrad.apply(x.exp())
        (gh,) = torch.autograd.grad(h.sum(), x, create_graph=True)
        return TwiceWithInnerGrad.apply(gh * h)

    assert_all_equal(lambda c: c(region), leaf(), "custom Function with a backward inside its backward")


def test_backward_into_parameters_inside_a_region_runs_again_as_under_torch():
    """A .backward() in the region accumulates into the parameters; the recompute runs it again
    (a side effect, as under torch's checkpoint: the README says side effects happen twice). The
    input's gradient, which flows only through the outer backward, equals the plain one."""
    torch.manual_seed(0)
    lin = nn.Linear(WIDTH, WIDTH)

    def region(x):
        y = lin(x).tanh()
        y.sum().backward(retain_graph=True, inputs=list(lin.parameters()))
        return y * x

    results = {}
    for name, wrap in WRAPPERS.items():
        lin.zero_grad(set_to_none=True)
        x_grad = grads_of(lambda c: c(region), leaf(), wrap)
        results[name] = (x_grad, lin.weight.grad.clone(), lin.bias.grad.clone())
    assert torch.equal(results["offload"][0], results["plain"][0])
    for a, b in zip(results["offload"], results["torch"], strict=True):
        assert torch.equal(a, b), "parameter grads differ from torch's checkpoint"


# ------------------------------------------------------------------------ what stays alive


def test_saved_values_are_not_held_after_the_forward():
    """While the forward runs the region holds what it saves (an inner grad may need it); once it
    returns, nothing of the inside is kept: an intermediate saved by a later op is gone."""
    seen = []

    def region(x):
        h = x.sin()  # saved by exp below, then only reachable through the graph
        seen.append(weakref.ref(h))
        y = h.exp()
        (gy,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return gy * x

    x = leaf()
    out = offload.checkpoint(region, x)
    gc.collect()
    assert seen[0]() is None, "an intermediate the region saved outlived its forward"
    frames = [o for o in gc.get_objects() if type(o) is _recompute.Frame and id(o) not in _FRAMES_BEFORE]
    assert len(frames) == 1 and frames[0].forward_values is None
    del frames
    out.sum().backward()
    del out
    assert frames_alive() == 0


def test_forward_that_raises_drops_its_saved_values():
    def region(x):
        y = x.sin().exp()
        torch.autograd.grad(y.sum(), x, create_graph=True)
        raise ValueError("stop here")

    with pytest.raises(ValueError, match="stop here"):
        offload.checkpoint(region, leaf())
    assert frames_alive() == 0


def test_inplace_change_of_a_saved_tensor_before_the_inner_grad_is_caught():
    """Without the engine autograd raises when the inner backward finds a saved tensor modified in
    place; inside a region the held value must not silently give other gradients."""

    def region(x):
        y = x * 2
        z = y.sin()  # saves y
        y.add_(1)
        (gz,) = torch.autograd.grad(z.sum(), x)
        return gz

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        region(leaf())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        offload.checkpoint(region, leaf())


# ------------------------------------------------------------------------ what cannot be done


def test_backward_past_the_region_inputs_raises_in_forward_naming_the_region():
    """The recompute starts from detached inputs, so an inner backward that goes through the graph
    that produced an input could not be replayed: that is refused at once, in forward."""
    w = leaf(1)

    def region(h):
        y = (h * h).sum()
        (gw,) = torch.autograd.grad(y, w, create_graph=True)  # through h's grad_fn, outside the region
        return h * gw

    h = w * 3.0
    region(h).sum().backward()  # fine without a checkpoint
    with pytest.raises(
        offload.OffloadError, match=r"region 'penalty'.*MulBackward0.*tensor input 0.*do not recompute this region"
    ):
        offload.checkpoint(region, w * 3.0, name="penalty")
    assert frames_alive() == 0


def test_inner_region_differentiating_past_its_input_into_the_outer_region_raises_in_forward():
    """Nested, the inner region's input is computed inside the outer one: a gradient with respect
    to the outer input goes past the inner input, and is refused naming the inner region."""

    def inner(h, x):
        (gx,) = torch.autograd.grad(h.square().sum(), x, create_graph=True)
        return gx * h

    def outer(x):
        return offload.checkpoint(inner, x.sin(), x, name="inner").cos()

    with pytest.raises(offload.OffloadError, match=r"region 'inner'.*tensor input 0"):
        offload.checkpoint(outer, leaf() * 1.0, name="outer")
    assert frames_alive() == 0


def test_inner_backward_may_reach_tensors_the_region_closes_over():
    """Tensors used from outside without being arguments are the same tensors in the recompute,
    with their graph: differentiating with respect to them is fine (and equals torch's)."""
    w = leaf(1)

    def build(wrap):
        c = w.tanh()  # not an argument of the region; a new graph for each run

        def region(x):
            y = (x * c).sin()
            (gc_,) = torch.autograd.grad(y.sum(), c, create_graph=True)
            return gc_ * x

        return wrap(region)

    want = grads_of(build, leaf(), no_ckpt)
    for name in ("torch", "offload"):
        assert torch.equal(grads_of(build, leaf(), WRAPPERS[name]), want), name


def test_graph_of_a_recompute_used_after_it_ended_raises_naming_the_region():
    """A region that hands a recomputed tensor to the outside (a cache passed as an argument) lets
    someone differentiate the recompute's graph later; its saved values are gone by then."""
    cache = []

    def region(x, cache):
        y = x.sin().exp()
        cache.append(y)
        return y * x  # saves after the append, so the recompute reaches it

    out = offload.checkpoint(region, leaf(), cache, name="cached")
    out.sum().backward()
    recomputed = cache[-1]
    assert len(cache) == 2
    with pytest.raises(offload.OffloadError, match=r"region 'cached'.*after the recompute ended"):
        recomputed.sum().backward()


# ------------------------------------------------------------------------ cost


def count_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_flops_nested_regions_at_most_one_extra_forward_each():
    """Recomputing outer re-runs inner's forward inside it; recomputing inner re-runs it once more.
    Each region costs at most one extra forward of itself: flops(outer) + flops(inner)."""
    torch.manual_seed(0)
    a, b = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
    x = leaf()

    def inner(h):
        return b(a(h).tanh())

    def outer_with(c):
        def outer(h):
            return (c(inner)(a(h).tanh() @ b.weight.T) * h).cos()

        return outer

    def backward_flops(wrap):
        return count_flops(lambda: wrap(outer_with(wrap))(x).sum().backward())

    with torch.no_grad():
        outer_forward = count_flops(lambda: outer_with(no_ckpt)(x))
        h_in = a(x).tanh() @ b.weight.T
        inner_forward = count_flops(lambda: inner(h_in))
    extra = backward_flops(offload_ckpt) - backward_flops(no_ckpt)
    assert 0 < extra <= outer_forward + inner_forward, (extra, outer_forward, inner_forward)
    assert extra <= backward_flops(torch_ckpt) - backward_flops(no_ckpt)


def test_flops_region_with_an_inner_grad_at_most_one_extra_forward():
    """The region's forward includes its inner backward; the recompute costs no more than it."""
    # A bare weight, not an nn.Linear: FlopCounterMode's module tracker does not support a
    # torch.autograd.grad inside a module's forward.
    weight = torch.randn(8 * WIDTH, WIDTH, generator=torch.Generator().manual_seed(0))

    def region(x):
        e = F.linear(x, weight).tanh().square().sum()
        (force,) = torch.autograd.grad(e, x, create_graph=True)
        return (F.linear(force, weight).sin() * 2).sum(dim=1)

    x = leaf()
    forward = count_flops(lambda: region(x))
    extra = count_flops(lambda: offload.checkpoint(region, x).sum().backward()) - count_flops(
        lambda: region(x).sum().backward()
    )
    assert 0 < extra <= forward, (extra, forward)


def test_flops_three_levels_at_most_one_extra_forward_each():
    weight = torch.randn(4 * WIDTH, WIDTH, generator=torch.Generator().manual_seed(0))

    def level(inner):
        return lambda h: inner(F.linear(h, weight).tanh() @ weight).sin()

    def innermost(h):
        return F.linear(h, weight).cos() @ weight

    def nest(c):
        return c(level(c(level(c(innermost)))))

    x = leaf()
    with torch.no_grad():
        h1 = F.linear(x, weight).tanh() @ weight
        h2 = F.linear(h1, weight).tanh() @ weight
        forwards = [
            count_flops(lambda: nest(no_ckpt)(x)),
            count_flops(lambda: level(innermost)(h1)),
            count_flops(lambda: innermost(h2)),
        ]
    plain = count_flops(lambda: nest(no_ckpt)(x).sum().backward())
    ours = count_flops(lambda: nest(offload_ckpt)(x).sum().backward())
    theirs = count_flops(lambda: nest(torch_ckpt)(x).sum().backward())
    assert 0 < ours - plain <= sum(forwards), (ours - plain, forwards)
    assert ours <= theirs
    assert torch.equal(grads_of(nest, x, offload_ckpt), grads_of(nest, x, no_ckpt))


def test_nested_regions_run_no_more_often_than_under_torch():
    """Per region and backward: the forward, once inside each enclosing region's recompute, and its
    own recompute; counted against torch's checkpoint on the same nesting."""

    def counted(runs):
        def inner(x):
            runs["inner"] += 1
            return x.sin().exp()

        def outer(c):
            def run(x):
                runs["outer"] += 1
                return (c(inner)(x.cos()) * x).tanh()

            return run

        return inner, outer

    counts = {}
    for name in ("offload", "torch"):
        runs = {"inner": 0, "outer": 0}
        _, outer = counted(runs)
        c = WRAPPERS[name]
        c(outer(c))(leaf()).sum().backward()
        counts[name] = runs
    assert counts["offload"] == {"outer": 2, "inner": 3}, counts
    assert all(counts["offload"][k] <= counts["torch"][k] for k in counts["torch"]), counts


def test_region_with_an_inner_grad_is_recomputed_once_per_pass():
    calls = []

    def region(x):
        calls.append(1)
        y = x.sin().exp()
        (gy,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return gy * y

    x = leaf()
    out = offload.checkpoint(region, x)
    assert len(calls) == 1
    out.sum().backward(retain_graph=True)
    assert len(calls) == 2
    out.sum().backward()
    assert len(calls) == 3


# ------------------------------------------------------------------------ under the engine


STEPS = most_profiling_steps("auto") + 2
"""Enough for "auto" to profile (as many steps as it may legitimately take at one shape) and then
follow its plan twice."""
N_BLOCKS = 3
MODEL_ROWS, MODEL_WIDTH = 64, 64
"""(64, 64) fp32 activations = 16 KiB: above the engine's default ``min_offload_bytes``? see below."""


class ForceBlock(nn.Module):
    """An energy from its input, the force (-dE/dx, create_graph) from it, dropout, a residual:
    a block whose forward runs a backward of its own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.energy = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, 1))
        self.mix = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.energy(x).sum()
        (force,) = torch.autograd.grad(e, x, create_graph=True)
        return x + self.drop(self.mix(-force).tanh())


class ForceModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(MODEL_WIDTH, MODEL_WIDTH)  # so the first block's input has a graph
        self.blocks = nn.ModuleList(ForceBlock(MODEL_WIDTH) for _ in range(N_BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h.square().mean()


def make_model() -> ForceModel:
    torch.manual_seed(0)
    return ForceModel()


def model_batch(step: int) -> torch.Tensor:
    return torch.randn(MODEL_ROWS, MODEL_WIDTH, generator=torch.Generator().manual_seed(100 + step))


def train(model: ForceModel, eng=None, steps: int = STEPS):
    history = []
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        if eng is not None:
            eng.reset_stats()
        torch.manual_seed(SEED + i)
        if eng is None:
            loss = model(model_batch(i))
        else:
            with eng:
                loss = model(model_batch(i))
        loss.backward()
        # The energy head's last bias gets no gradient: a force does not depend on it.
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        history.append((loss.detach(), grads, eng and eng.stats))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.05 * p.grad
    return history


@pytest.fixture(scope="module")
def reference():
    return train(make_model())


@pytest.fixture(scope="module")
def saved_bytes() -> int:
    model = make_model()
    eng = offload.engine(None, policy="none", regions=model.blocks, model=model, machine=MACHINE, min_offload_mb=0)
    with eng:
        loss = model(model_batch(0))
    nbytes = eng.stats.saved_bytes
    del loss
    eng.close()
    return nbytes


ENGINE_CASES = [(policy, budget) for policy in ("recompute", "auto") for budget in ("none", "small", "zero")]


@pytest.mark.parametrize("policy,budget", ENGINE_CASES, ids=[f"{p}-{b}" for p, b in ENGINE_CASES])
def test_engine_over_blocks_with_inner_grads_equals_no_engine(policy, budget, saved_bytes, reference, spill_dir):
    budget_mb = {"none": None, "small": saved_bytes * 0.1 / 2**20, "zero": 0}[budget]
    model = make_model()
    eng = block_engine(model, budget_mb, policy, spill_dir, min_offload_mb=0)
    history = train(model, eng)
    for step, ((loss_g, grads_g, _stats), (loss_w, grads_w, _)) in enumerate(zip(history, reference, strict=True)):
        assert torch.equal(loss_g, loss_w), f"{policy} at budget {budget}: loss differs at step {step}"
        for i, (a, b) in enumerate(zip(grads_g, grads_w, strict=True)):
            assert (a is None and b is None) or torch.equal(a, b), (
                f"{policy} at budget {budget}: grad of parameter {i} differs at step {step}"
            )
    if policy == "recompute":
        assert [s.recomputed_regions for _, _, s in history] == [N_BLOCKS] * STEPS
    else:
        stages = list(eng.recent_stages)
        assert stages[-1] is None, f"still profiling after {STEPS} steps: {stages}"
        if budget != "none":
            assert "recompute" in stages, f"auto never tried recomputing these blocks: {stages}"
    stats = settle(eng)
    assert stats.resident_bytes == 0 and stats.spill_bytes == 0
    eng.close()
    assert frames_alive() == 0
