"""The engine gives the same numbers as no engine, on every kind of model and backward.

Oracle: the same model (same seed, deep-copied weights) without the engine; outputs, gradients
and buffers must be bitwise equal in fp32 (and in bf16 autocast, where the math is the same
kernels in the same order). Each model runs at three budgets:

- None: the engine only counts (nothing moves);
- 0: every managed tensor goes to the tier behind the budget (disk, on this CPU) and back;
- "some": about half the saved bytes may stay, so some tensors move and the newest stay.

``min_offload_mb=0`` makes every saved activation eligible, however small the model.
"""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch
from torch import nn

import offload
from links import ThreadedLink
from zoo import (
    GPTLoss,
    Recurrent,
    Tied,
    assert_same,
    budget_between,
    cnn,
    gpt,
    mlp,
    run_step,
    saved_bytes,
    wait_clean,
)

SOME = "some"
"""Budget marker: about half of the model's saved bytes (so some, but not all, tensors move)."""
SOME_FRACTION = 0.5
BUDGETS = (None, 0, SOME)


def make_engine(budget, total_bytes, spill_dir, **kwargs) -> offload.Engine:
    budget_mb = budget_between(total_bytes, SOME_FRACTION) if budget == SOME else budget
    return offload.engine(budget_mb, min_offload_mb=0, spill_dir=spill_dir, **kwargs)


_ENGINE_OPTIONS = ("link", "device", "host_budget_mb")
"""``check_zoo`` keyword arguments that go to the engine; the rest go to ``run_step``."""


def check_moved(stats: offload.Stats, budget) -> None:
    """The budget did what it says: nothing moved at None, everything at 0, part of it in between."""
    assert stats.saved_bytes > 0
    if budget is None:
        assert stats.offloaded_bytes == 0
    elif budget == 0:
        assert stats.offloaded_bytes == stats.saved_bytes
    else:
        assert 0 < stats.offloaded_bytes < stats.saved_bytes, stats


def check_zoo(model: nn.Module, make_input, spill_dir, budget, **kwargs) -> None:
    """``model`` under the engine at ``budget`` gives bitwise the reference step; nothing is left over."""
    engine_kwargs = {k: kwargs.pop(k) for k in _ENGINE_OPTIONS if k in kwargs}
    step_kwargs = kwargs
    ref = run_step(copy.deepcopy(model), make_input, **step_kwargs)
    total = saved_bytes(model, make_input, **step_kwargs)
    under = copy.deepcopy(model)
    eng = make_engine(budget, total, spill_dir, model=under, **engine_kwargs)
    got = run_step(under, make_input, eng, **step_kwargs)
    assert_same(ref, got, f"budget {budget}")
    check_moved(wait_clean(eng, spill_dir), budget)
    eng.close()


def randn(*shape):
    return lambda: torch.randn(*shape)


def randint(high, *shape):
    return lambda: torch.randint(high, shape)


ZOO = {
    "mlp": (lambda: mlp(), randn(32, 64), {}),
    "mlp_inplace_relu": (lambda: mlp(inplace=True), randn(32, 64), {}),
    "cnn_batchnorm": (lambda: cnn(), randn(4, 3, 12, 12), {}),
    "gpt_math_dropout": (lambda: GPTLoss(gpt(dropout=0.1, attention="math")), randint(256, 2, 17), {}),
    "gpt_sdpa_dropout": (lambda: GPTLoss(gpt(dropout=0.1, attention="sdpa")), randint(256, 2, 17), {}),
    "gru": (lambda: Recurrent("gru"), randn(4, 10, 16), {}),
    "lstm": (lambda: Recurrent("lstm"), randn(4, 10, 16), {}),
    "tied_embedding": (lambda: Tied(), randint(50, 4, 12), {}),
    "mlp_bf16_autocast": (lambda: mlp(), randn(32, 64), {"autocast": torch.bfloat16}),
    "gpt_bf16_autocast": (lambda: GPTLoss(gpt(dropout=0.1)), randint(256, 2, 17), {"autocast": torch.bfloat16}),
}


@pytest.mark.sweep
@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"budget={b}")
@pytest.mark.parametrize("name", ZOO)
def test_zoo_bitwise_equal(name, budget, spill_dir):
    build, make_input, step_kwargs = ZOO[name]
    check_zoo(build(), make_input, spill_dir, budget, **step_kwargs)


@pytest.mark.sweep
@pytest.mark.parametrize("budget", [0, SOME], ids=lambda b: f"budget={b}")
@pytest.mark.parametrize("name", ZOO)
def test_zoo_bitwise_equal_on_the_host_tier(name, budget, spill_dir):
    """The CUDA path's tiers (host memory, then disk past a small cap), with copies that land on a
    background thread after a delay and a link that poisons what the engine lets go too early."""
    build, make_input, step_kwargs = ZOO[name]
    link = ThreadedLink(delay_s=0.001)
    try:
        check_zoo(build(), make_input, spill_dir, budget, link=link, device="cpu", host_budget_mb=0.25, **step_kwargs)
    finally:
        link.close()
    assert link.d2h_count > 0 and link.sources_gone == 0


def test_batchnorm_running_stats_are_compared():
    """The CNN's running stats change in a step, so ``assert_same`` really compares them."""
    model = cnn()
    before = {n: b.clone() for n, b in model.named_buffers()}
    after = run_step(model, randn(4, 3, 12, 12)).buffers
    assert any(not torch.equal(before[n], after[n]) for n in before if "running" in n)


# ---------------------------------------------------------------------------------- saved views


class SaveViews(torch.autograd.Function):
    """Saves four views of one input and checks in backward that each comes back exact.

    Views: a strided slice, an offset view, a transpose and a stride-0 expansion. Backward asserts
    size, stride, storage offset and values against what forward saw, and returns a gradient that
    depends on every view's values, so a wrong element also shows in the gradient.
    """

    @staticmethod
    def forward(ctx, x):
        views = (x[:, ::2], x[3:], x.t(), x[:1].expand(5, -1))
        ctx.expected = [(v.size(), v.stride(), v.storage_offset(), v.detach().clone()) for v in views]
        ctx.save_for_backward(*views)
        return x.sum().reshape(1)

    @staticmethod
    def backward(ctx, grad):
        views = ctx.saved_tensors
        for i, (v, (size, stride, offset, values)) in enumerate(zip(views, ctx.expected, strict=True)):
            assert (v.size(), v.stride(), v.storage_offset()) == (size, stride, offset), f"view {i} layout"
            assert torch.equal(v, values), f"view {i} values"
        strided, offset_view, transposed, expanded = views
        gx = transposed.t().clone()
        gx[:, ::2] += strided
        gx[3:] += offset_view
        gx[:1] += expanded.sum(0, keepdim=True)
        return gx * grad


@pytest.mark.parametrize("budget", [None, 0], ids=lambda b: f"budget={b}")
def test_saved_views_come_back_exact_and_storage_moves_once(budget, spill_dir):
    torch.manual_seed(0)
    a = torch.randn(8, 16, requires_grad=True)
    eng = offload.engine(budget, min_offload_mb=0, spill_dir=spill_dir)
    with eng:
        x = a * 2  # an activation (not a leaf), so the engine manages its storage
        out = SaveViews.apply(x)
    out.backward()
    ref_a = a.detach().clone().requires_grad_(True)
    SaveViews.apply(ref_a * 2).backward()
    assert torch.equal(a.grad, ref_a.grad)
    stats = wait_clean(eng, spill_dir)
    assert stats.saved_tensors == 4
    assert stats.saved_bytes == x.untyped_storage().nbytes(), "one storage saved four times counts once"
    if budget == 0:
        assert stats.offloaded_bytes == x.untyped_storage().nbytes()
        assert stats.spilled_bytes == x.untyped_storage().nbytes(), "moved once, not once per view"


class SaveDtypeViews(torch.autograd.Function):
    """Saves views that reinterpret the bytes (int32, int16 of an offset slice): not autograd views
    (``_base`` is None), yet the same storage; each must come back bit for bit."""

    @staticmethod
    def forward(ctx, x):
        views = (x.view(torch.int32), x[2:].view(torch.int16), x[1:, 3:].view(torch.uint8))
        ctx.expected = [(v.size(), v.stride(), v.storage_offset(), v.clone()) for v in views]
        ctx.save_for_backward(*views)
        return x.sum().reshape(1)

    @staticmethod
    def backward(ctx, grad):
        for i, (v, (size, stride, offset, values)) in enumerate(zip(ctx.saved_tensors, ctx.expected, strict=True)):
            assert (v.size(), v.stride(), v.storage_offset()) == (size, stride, offset), f"view {i} layout"
            assert torch.equal(v, values), f"view {i} bits"
        return grad.expand(8, 16).clone()


@pytest.mark.parametrize("budget", [None, 0], ids=lambda b: f"budget={b}")
def test_dtype_views_come_back_bit_exact(budget, spill_dir):
    a = torch.randn(8, 16, requires_grad=True)
    eng = offload.engine(budget, min_offload_mb=0, spill_dir=spill_dir)
    with eng:
        out = SaveDtypeViews.apply(a * 2)
    out.backward()
    assert torch.equal(a.grad, torch.full((8, 16), 2.0))
    stats = wait_clean(eng, spill_dir)
    assert stats.saved_tensors == 3
    eng.close()


@pytest.mark.parametrize("budget", [None, 0], ids=lambda b: f"budget={b}")
def test_zero_size_tensors(budget, spill_dir):
    """An empty batch: every saved storage has 0 bytes (empty spill files, empty reads)."""
    model = mlp()
    ref = run_step(copy.deepcopy(model), randn(0, 64))
    eng = offload.engine(budget, min_offload_mb=0, spill_dir=spill_dir)
    got = run_step(model, randn(0, 64), eng)
    assert_same(ref, got)
    stats = wait_clean(eng, spill_dir)
    assert stats.saved_tensors > 0 and stats.saved_bytes == 0
    eng.close()


@pytest.mark.parametrize("budget", [None, 0], ids=lambda b: f"budget={b}")
def test_integer_indices_move_and_come_back(budget, spill_dir):
    """Embedding saves only its int64 indices: they are the one managed tensor, moved at budget 0."""
    torch.manual_seed(0)
    embed = nn.Embedding(1000, 16)
    idx = torch.randint(1000, (4096,))
    weights = torch.linspace(-1, 1, 4096 * 16).view(4096, 16)
    ref = copy.deepcopy(embed)
    (ref(idx) * weights).sum().backward()
    eng = offload.engine(budget, min_offload_mb=0, spill_dir=spill_dir, model=embed)
    with eng:
        loss = (embed(idx.clone()) * weights).sum()  # a clone: nothing else holds the indices
    stats = eng.stats
    assert stats.saved_bytes == idx.nbytes + weights.nbytes, "the indices and the loss's constant"
    loss.backward()
    assert torch.equal(embed.weight.grad, ref.weight.grad)
    stats = wait_clean(eng, spill_dir)
    assert stats.reloaded_bytes == (0 if budget is None else idx.nbytes + weights.nbytes)
    eng.close()


# ---------------------------------------------------------------------------------- many steps


def sgd_step(model: nn.Module, lr: float = 0.1) -> None:
    """Plain SGD by hand (torch.optim imports dynamo: seconds of test time for nothing)."""
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


def test_one_engine_many_steps_changing_shapes(spill_dir):
    """One engine, six SGD steps with different batch sizes; each step matches the reference."""
    model = mlp(depth=3, width=32)
    ref_model, eng_model = copy.deepcopy(model), copy.deepcopy(model)
    eng = offload.engine(budget_between(32 * 64 * 4 * 4, 0.5), min_offload_mb=0, spill_dir=spill_dir)
    for step, batch in enumerate([8, 64, 3, 33, 1, 64]):
        ref = run_step(ref_model, randn(batch, 32))
        got = run_step(eng_model, randn(batch, 32), eng)
        assert_same(ref, got, f"step {step} (batch {batch})")
        sgd_step(ref_model)
        sgd_step(eng_model)
        wait_clean(eng, spill_dir)
    assert eng.stats.offloaded_bytes > 0
    eng.close()


# ---------------------------------------------------------------------------------- backward variants


def _forward_mlp(model, x, eng):
    with eng:
        return default_loss_of(model(x))


def default_loss_of(out):
    return (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()


@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"budget={b}")
def test_retain_graph_backward_twice(budget, spill_dir):
    model = mlp(depth=4, width=64)
    x = torch.randn(16, 64)
    ref = copy.deepcopy(model)
    loss_ref = default_loss_of(ref(x))
    loss_ref.backward(retain_graph=True)
    loss_ref.backward()
    total = saved_bytes(model, lambda: x.clone())
    eng = make_engine(budget, total, spill_dir)
    loss = _forward_mlp(model, x, eng)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    loss.backward()
    for p, p_ref, g1 in zip(model.parameters(), ref.parameters(), first, strict=True):
        assert torch.equal(p.grad, p_ref.grad)
        assert torch.equal(p.grad, 2 * g1)
    del loss
    wait_clean(eng, spill_dir)
    eng.close()


@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"budget={b}")
def test_autograd_grad_on_a_subset_of_inputs(budget, spill_dir):
    """grad() w.r.t. only the first layer's weight (then the rest): partial backward, then full."""
    model = mlp(depth=4, width=64)
    x = torch.randn(16, 64)
    ref = copy.deepcopy(model)
    loss_ref = default_loss_of(ref(x))
    (g_first_ref,) = torch.autograd.grad(loss_ref, [ref[0].weight], retain_graph=True)
    g_last_ref = torch.autograd.grad(loss_ref, [ref[-1].weight, ref[-1].bias])
    total = saved_bytes(model, lambda: x.clone())
    eng = make_engine(budget, total, spill_dir)
    loss = _forward_mlp(model, x, eng)
    (g_first,) = torch.autograd.grad(loss, [model[0].weight], retain_graph=True)
    g_last = torch.autograd.grad(loss, [model[-1].weight, model[-1].bias])
    assert torch.equal(g_first, g_first_ref)
    assert all(torch.equal(a, b) for a, b in zip(g_last, g_last_ref, strict=True))
    del loss
    wait_clean(eng, spill_dir)
    eng.close()


def _gradient_penalty_step(model, x, eng=None, *, backward_inside=False):
    """WGAN-GP style: loss + ||d out / d x||^2, backward through the first backward (create_graph).

    ``backward_inside``: both backwards run inside the engine too, so the double-backward graph's
    own saves (some of them tensors the engine just handed back) go through the engine as well.
    """
    x = x.clone().requires_grad_(True)
    with contextlib.ExitStack() as stack:
        if eng is not None:
            stack.enter_context(eng)
        out = model(x)
        if not backward_inside:
            stack.close()
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = out.pow(2).mean() + gx.pow(2).sum()
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"budget={b}")
@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward_outside", "backward_inside"])
def test_double_backward_gradient_penalty(budget, backward_inside, spill_dir):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Softplus(), nn.Linear(64, 1))
    x = torch.randn(16, 32)
    ref_grads = _gradient_penalty_step(copy.deepcopy(model), x)
    total = saved_bytes(model, lambda: x.clone())
    eng = make_engine(budget, total, spill_dir)
    grads = _gradient_penalty_step(model, x, eng, backward_inside=backward_inside)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    wait_clean(eng, spill_dir)
    eng.close()


def _two_chains(eng):
    """Two independent chains saved in order 1, 2 and backpropagated in order 1, 2: the reverse
    of what prefetch guesses (it reloads the newest-saved first), so its guesses are wrong."""
    first, second = mlp(depth=6, width=64, seed=1), mlp(depth=6, width=64, seed=2)
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    with eng if eng is not None else contextlib.nullcontext():
        loss_first = first(x).pow(2).sum()
        loss_second = second(x).pow(2).sum()
    loss_first.backward()
    loss_second.backward()
    return [p.grad.clone() for p in [*first.parameters(), *second.parameters()]]


@pytest.mark.parametrize("budget_mb", [0, 0.03, 0.1])
def test_backward_in_save_order_prefetch_guesses_wrong(budget_mb, spill_dir):
    ref = _two_chains(None)
    eng = offload.engine(budget_mb, min_offload_mb=0, spill_dir=spill_dir)
    got = _two_chains(eng)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    stats = wait_clean(eng, spill_dir)
    assert stats.offloaded_bytes > 0 and stats.prefetch_misses > 0
    if budget_mb:
        assert stats.peak_resident_bytes <= eng.config.budget_bytes, stats
    eng.close()


# ---------------------------------------------------------------------------------- what is never moved


class BufferScale(nn.Module):
    """Multiplies by a large buffer: ``mul`` saves the buffer (not the input) for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 64 * 1024).view(256, 256))
        self.weight = nn.Parameter(torch.randn(256, 256))

    def forward(self, x):
        return (x * self.scale) @ self.weight.t()


def test_parameters_buffers_and_their_views_are_never_moved(spill_dir):
    torch.manual_seed(0)
    model = BufferScale()
    x = torch.randn(256, 256, requires_grad=True)  # a leaf that requires grad: the user holds it
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, model=model)
    with eng:
        loss = model(x).sum()
    stats = eng.stats
    # Saved: scale (buffer), weight.t() (view of a parameter), x (a leaf requiring grad), and the
    # product x * scale, the one activation. Only the activation is the engine's.
    product_bytes = 256 * 256 * 4
    assert stats.saved_bytes == product_bytes, stats
    assert stats.passthrough_tensors >= 2
    loss.backward()
    ref = copy.deepcopy(model)
    x_ref = x.detach().clone().requires_grad_(True)
    ref(x_ref).sum().backward()
    assert torch.equal(model.weight.grad, ref.weight.grad)
    assert torch.equal(x.grad, x_ref.grad)
    wait_clean(eng, spill_dir)
    eng.close()


class SaveEach(torch.autograd.Function):
    """Saves its input; backward returns the saved values, so the gradient shows what came back."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        return (x * w).sum().reshape(1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return None, (x * grad).sum().reshape(1)


@pytest.mark.parametrize("budget", [None, 0, 0.5], ids=lambda b: f"budget={b}")
def test_no_aliasing_through_reused_addresses(budget, spill_dir):
    """Save, drop and reallocate same-size tensors, so the allocator hands out freed addresses.

    Each saved tensor holds a distinct constant; the gradient of ``w`` sums them, and every saved
    tensor's own contribution is checked through a separate weight.
    """
    n, numel = 12, 64 * 1024  # 256 KiB each: the 0.5 MB budget keeps two, the rest go to disk
    weights = [torch.ones(1, requires_grad=True) for _ in range(n)]
    eng = offload.engine(budget, min_offload_mb=0, spill_dir=spill_dir)
    outs = []
    with eng:
        for i in range(n):
            t = torch.full((numel,), float(i + 1))
            outs.append(SaveEach.apply(t, weights[i]))
            del t  # the storage dies with nothing but the engine's entry holding it
    torch.stack(outs).sum().backward()
    for i, w in enumerate(weights):
        assert w.grad.item() == float(i + 1) * numel, f"tensor {i} came back with another tensor's data"
    del outs
    wait_clean(eng, spill_dir)
    eng.close()


# ---------------------------------------------------------------------------------- nothing left behind


def test_unused_branch_leaves_nothing(spill_dir):
    model = mlp(depth=3, width=64)
    branch = mlp(depth=3, width=64, seed=1)
    eng = offload.engine(0.02, min_offload_mb=0, spill_dir=spill_dir)
    x = torch.randn(32, 64)
    with eng:
        loss = default_loss_of(model(x))
        unused = branch(x)  # saved for a backward that never comes
    del unused
    loss.backward()
    del loss
    stats = wait_clean(eng, spill_dir)
    assert stats.saved_bytes > 0 and stats.spilled_bytes > 0
    eng.close()


@pytest.mark.parametrize("budget", [None, 0, 0.02], ids=lambda b: f"budget={b}")
def test_forward_without_backward_leaves_nothing(budget, spill_dir):
    model = mlp(depth=4, width=64)
    eng = offload.engine(budget, min_offload_mb=0, spill_dir=spill_dir)
    with eng:
        loss = default_loss_of(model(torch.randn(32, 64)))
    assert eng.stats.resident_bytes > 0 or eng.stats.offloaded_bytes > 0
    del loss
    wait_clean(eng, spill_dir)
    eng.close()


class Boom(Exception):
    pass


class FailsHalfway(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = mlp(depth=4, width=64)

    def forward(self, x):
        self.first(x)
        raise Boom("the forward failed after saving tensors")


@pytest.mark.parametrize("budget", [None, 0, 0.02], ids=lambda b: f"budget={b}")
def test_exception_mid_forward_leaves_nothing(budget, spill_dir):
    model = FailsHalfway()
    eng = offload.engine(budget, min_offload_mb=0, spill_dir=spill_dir)
    try:
        with eng:
            model(torch.randn(32, 64))
    except Boom:
        pass  # the traceback (and the frames holding the graph) dies with this block
    assert eng.stats.saved_bytes > 0
    wait_clean(eng, spill_dir)
    # The hooks are gone with the `with`: a later forward saves nothing through the engine.
    before = eng.stats.saved_tensors
    model.first(torch.randn(4, 64)).sum().backward()
    assert eng.stats.saved_tensors == before
    eng.close()


# ---------------------------------------------------------------------------------- in-place after save


@pytest.mark.parametrize("budget", [None, 0], ids=lambda b: f"budget={b}")
@pytest.mark.parametrize("saved", ["tensor", "view"])
def test_inplace_after_save_raises_pytorchs_error(budget, saved, spill_dir):
    """PyTorch raises; so does the engine, at every budget (tests/test_inplace.py covers the tiers)."""

    def step(eng):
        torch.manual_seed(0)
        a = torch.randn(64, 64, requires_grad=True)
        x = a * 1
        with eng if eng is not None else contextlib.nullcontext():
            y = x.sin() if saved == "tensor" else x[:, 1:40].sin()
        with torch.no_grad():
            x.add_(1)
        y.sum().backward()
        return a

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step(None)
    eng = offload.engine(budget, min_offload_mb=0, spill_dir=spill_dir)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step(eng)
    wait_clean(eng, spill_dir)
    eng.close()


# ---------------------------------------------------------------------------------- pass-through


def test_other_device_passes_through(monkeypatch):
    """engine(device='cuda') on CPU tensors manages nothing (and initializes no CUDA). Without a
    GPU, the driver is made to report one: an absent device is refused (see test_api.py)."""
    real_gpu = torch.cuda.is_available()
    if not real_gpu:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    model = mlp()
    ref = run_step(copy.deepcopy(model), randn(32, 64))
    eng = offload.engine(0, min_offload_mb=0, device="cuda")
    got = run_step(model, randn(32, 64), eng)
    assert_same(ref, got)
    stats = eng.stats
    assert stats.saved_bytes == 0 and stats.saved_tensors == 0
    assert stats.passthrough_tensors > 0
    if not real_gpu:
        assert not torch.cuda.is_initialized()
    eng.close()


def test_tiny_tensors_pass_through(spill_dir):
    model = mlp(width=16)
    ref = run_step(copy.deepcopy(model), randn(4, 16))
    eng = offload.engine(0, spill_dir=spill_dir)  # default min_offload_bytes (64 KiB) >> these
    got = run_step(model, randn(4, 16), eng)
    assert_same(ref, got)
    stats = eng.stats
    assert stats.saved_tensors == 0 and stats.saved_bytes == 0 and stats.passthrough_tensors > 0
    eng.close()


def test_fake_tensors_pass_through():
    """Tracing with fake tensors under the engine: the pack hook sees FakeTensors and lets them be."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    eng = offload.engine(0, min_offload_mb=0)
    with FakeTensorMode():
        w = torch.randn(64, 64, requires_grad=True)
        x = torch.randn(64, 64)
        with eng:
            loss = torch.tanh(x @ w).sum()
        loss.backward()
        assert w.grad is not None and w.grad.shape == (64, 64)
    stats = eng.stats
    assert stats.passthrough_tensors > 0
    assert stats.saved_tensors == 0 and stats.saved_bytes == 0
    eng.close()


def test_make_fx_trace_under_engine():
    """make_fx of a forward+backward function under the engine traces and still runs correctly."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(w, x):
        loss = torch.tanh(x @ w).sum()
        return torch.autograd.grad(loss, w)[0]

    torch.manual_seed(0)
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(32, 32)
    eng = offload.engine(0, min_offload_mb=0)
    with eng:
        graph = make_fx(f, tracing_mode="fake")(w, x)
    assert eng.stats.saved_bytes == 0
    assert torch.equal(graph(w, x), f(w, x))
    eng.close()


class NoOffload(nn.Module):
    """Runs ``inner`` under ``offload.no_offload()``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with offload.no_offload():
            return self.inner(x)


def test_no_offload_inside_engine(spill_dir):
    model = NoOffload(mlp())
    ref = run_step(copy.deepcopy(model), randn(32, 64), loss_fn=torch.sum)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    w = torch.randn(32, 64, requires_grad=True)
    with eng:
        managed = torch.tanh(w * 2)  # tanh saves its output: the engine takes this one
    assert eng.stats.saved_tensors == 1
    got = run_step(model, randn(32, 64), eng, loss_fn=torch.sum)  # sum saves nothing
    assert_same(ref, got)
    stats = eng.stats
    assert stats.saved_tensors == 1, "a tensor saved under no_offload reached the engine"
    assert stats.passthrough_tensors == 0, "no_offload's hooks are innermost: the engine sees nothing"
    del managed
    wait_clean(eng, spill_dir)
    eng.close()


# ---------------------------------------------------------------------------------- threads


def test_engines_in_two_threads(tmp_path):
    """Two threads, each with its own engine and model, train at once; both match the reference.

    Models and inputs are made up front: torch's RNG is global, so threads must not draw from it.
    """
    steps = 3
    cases = {
        "mlp": (mlp(depth=4, width=64), torch.randn(32, 64), 0),
        "cnn": (cnn(), torch.randn(4, 3, 12, 12), 0.05),
    }
    refs = {}
    for name, (model, x, _) in cases.items():
        ref_model = copy.deepcopy(model)
        refs[name] = [run_step(ref_model, x.clone) for _ in range(steps)]  # BN stats advance per step
    results, errors = {}, []

    def train(name):
        try:
            model, x, budget = cases[name]
            spill = tmp_path / name
            spill.mkdir()
            eng = offload.engine(budget, min_offload_mb=0, spill_dir=spill, model=model)
            results[name] = [run_step(model, x.clone, eng) for _ in range(steps)]
            assert eng.stats.offloaded_bytes > 0
            wait_clean(eng, spill)
            eng.close()
        except BaseException as error:  # noqa: BLE001 - re-raised by the main thread
            errors.append(error)

    threads = [threading.Thread(target=train, args=(name,)) for name in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for name in cases:
        for step, (ref, got) in enumerate(zip(refs[name], results[name], strict=True)):
            assert_same(ref, got, f"{name} step {step}")
