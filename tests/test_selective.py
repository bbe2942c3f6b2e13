"""Selective recompute: gradients bitwise equal to no engine, no matmul/attention FLOPs re-run.

The oracle everywhere is the same model without the engine (same seed, same RNG draws), compared
with ``torch.equal``. The FLOP bound is counted with ``FlopCounterMode``: a selective region's
backward re-runs its cheap ops only, so its FLOPs (matmul, attention, convolution) equal the
backward of the model without the engine; whole-region recompute adds one forward.

Many tests drive the selective machinery directly (``offload._regions.selective``: one region's
``selective_checkpoint``, its table of expensive ops, its profiling mode), white-box, to hold a
region's re-run against torch's own selective checkpoint op by op and to reach a failure inside
it; the tests of the engine use ``policy="selective"``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode

import offload
from links import link_named
from offload._regions.selective import EXPENSIVE_OPS, is_compiled, is_expensive, selective_checkpoint
from offload.models import GPTConfig, MiniGPT
from offload.models.gpt import Block
from zoo import GPTLoss, assert_same, run_step, wait_clean

SEED = 3
WIDTH, ROWS = 32, 8
FLOP_BOUND = 0.10
"""Selective's backward may exceed no engine's by at most this fraction of one forward's FLOPs."""


def gpt_config(attention: str = "sdpa", dropout: float = 0.1) -> GPTConfig:
    return GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, dropout=dropout, attention=attention)


def gpt(attention: str = "sdpa", dropout: float = 0.1) -> GPTLoss:
    torch.manual_seed(0)
    return GPTLoss(MiniGPT(gpt_config(attention, dropout)))


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 17))


def block(attention: str = "sdpa", dropout: float = 0.1) -> Block:
    """One transformer block: RMSNorm, rotary attention (SDPA or math), SwiGLU, dropout."""
    torch.manual_seed(0)
    return Block(gpt_config(attention, dropout))


def block_input() -> torch.Tensor:
    return torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(11))


def step(fn, module: nn.Module, x: torch.Tensor, *, selective=None, autocast=None):
    """One forward (reseeded) and backward of ``module`` on a fresh copy of ``x``: plainly
    (``selective`` None) or through ``selective_checkpoint``. Returns (output, input grad,
    parameter grads, backward FLOPs, the run record)."""
    module = copy.deepcopy(module)
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(SEED)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        if selective is None:
            out, run = fn(module, x), None
        else:
            out, run = selective_checkpoint(lambda t: fn(module, t), (x,), {}, "region", selective=selective)
        loss = out.float().square().mean()
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    return out.detach(), x.grad, [p.grad for p in module.parameters()], flops.get_total_flops(), run


def call(module, x):
    return module(x)


def assert_step_same(got, want, what: str) -> None:
    out_g, xg_g, pg_g = got[:3]
    out_w, xg_w, pg_w = want[:3]
    assert torch.equal(out_g, out_w), f"{what}: outputs differ"
    assert torch.equal(xg_g, xg_w), f"{what}: input grads differ"
    for i, (a, b) in enumerate(zip(pg_g, pg_w, strict=True)):
        assert (a is None and b is None) or torch.equal(a, b), f"{what}: grad of parameter {i} differs"


def forward_flops(module: nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as flops:
        module(x.detach().clone().requires_grad_(True))
    return flops.get_total_flops()


# ------------------------------------------------------------------------- equality, FLOPs


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_block_equals_plain_and_reruns_no_expensive_flops(attention):
    """RMSNorm + rotary attention + SwiGLU + dropout: exact gradients; selective's backward has
    the FLOPs of the plain backward, whole-region recompute one forward more."""
    b, x = block(attention), block_input()
    plain = step(call, b, x)
    selective = step(call, b, x, selective=True)
    whole = step(call, b, x, selective=False)
    assert_step_same(selective, plain, f"selective {attention}")
    assert_step_same(whole, plain, f"whole {attention}")
    assert selective[4].selective and selective[4].stash_bytes > 0
    fwd = forward_flops(b, x)
    assert fwd > 0
    extra_selective = (selective[3] - plain[3]) / fwd
    extra_whole = (whole[3] - plain[3]) / fwd
    assert extra_selective < FLOP_BOUND, f"selective re-ran {extra_selective:.1%} of a forward's FLOPs"
    assert extra_whole > 0.9, f"whole-region recompute re-ran only {extra_whole:.1%} of a forward (test premise)"


def test_bf16_autocast_replays_the_bf16_outputs():
    b, x = block(), block_input()
    plain = step(call, b, x, autocast=torch.bfloat16)
    selective = step(call, b, x, selective=True, autocast=torch.bfloat16)
    assert not torch.equal(plain[0], step(call, b, x)[0]), "autocast changed nothing: the test would prove nothing"
    assert_step_same(selective, plain, "selective under bf16 autocast")


def test_views_of_expensive_outputs():
    """Chunks and a transpose of one matmul output, saved by the cheap ops that use them."""
    torch.manual_seed(0)
    lin = nn.Linear(WIDTH, 2 * WIDTH)

    def fn(module, x):
        a, g = module(x).chunk(2, dim=-1)
        return (a.sigmoid() * g).t().contiguous().tanh()

    x = torch.randn(ROWS, WIDTH)
    assert_step_same(step(fn, lin, x, selective=True), step(fn, lin, x), "views")


def test_ops_without_tensor_output_and_a_custom_function():
    """``.item()`` (no tensor output) and a custom autograd Function with a matmul inside:
    the mode sees the Function's aten ops in both runs, its saves are placeholders."""

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            y = x @ w
            ctx.save_for_backward(y, w)
            return y * y

        @staticmethod
        def backward(ctx, grad):
            y, w = ctx.saved_tensors
            gy = 2 * y * grad
            return gy @ w.t(), None

    torch.manual_seed(0)
    lin = nn.Linear(WIDTH, WIDTH)

    def fn(module, x):
        h = module(x)
        scale = float(h.abs().max().item())
        return Square.apply(torch.relu(h) / scale, module.weight.detach()).sum(-1)

    x = torch.randn(ROWS, WIDTH)
    got = step(fn, lin, x, selective=True)
    assert_step_same(got, step(fn, lin, x), "item and custom Function")
    assert got[4].selective and got[4].stashed_tensors == 2  # the linear's and the Function's matmul


def test_region_called_twice_in_one_graph_and_retain_graph():
    torch.manual_seed(0)
    lin = nn.Linear(WIDTH, WIDTH)
    drop = nn.Dropout(0.2)

    def twice(module, x):
        return drop(module(drop(module(x).tanh())).sigmoid())

    def run(selective: bool | None):
        module, x = copy.deepcopy(lin), torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))
        x.requires_grad_(True)
        torch.manual_seed(SEED)
        fn = (
            (lambda t: twice(module, t))
            if selective is None
            else (
                lambda t: selective_checkpoint(lambda u: drop(module(u).tanh()), (t,), {}, "r", selective=selective)[0]
            )
        )
        if selective is None:
            out = fn(x)
        else:
            out = selective_checkpoint(lambda u: drop(module(fn(u)).sigmoid()), (x,), {}, "outer", selective=True)[0]
        out.square().sum().backward(retain_graph=True)
        first = [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]
        out.square().sum().backward()
        return first, [x.grad] + [p.grad for p in module.parameters()]

    want = run(None)
    got = run(True)
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert torch.equal(a, b)


def test_nested_checkpoint_inside_a_selective_region():
    b, x = block(), block_input()

    def fn(module, t):
        t = t + module.attn(module.attn_norm(t))
        return t + offload.checkpoint(lambda u: module.mlp(module.mlp_norm(u)), t, name="mlp")

    assert_step_same(step(fn, b, x, selective=True), step(fn, b, x), "nested checkpoint")


# ------------------------------------------------------------------------- guards


class AddInPlace(nn.Module):
    def forward(self, x):
        return x.add_(1.0)


@pytest.mark.parametrize("inplace", [nn.ReLU(inplace=True), AddInPlace()], ids=["relu_", "add_"])
def test_inplace_write_into_an_expensive_output_in_forward_falls_back_to_whole_recompute(inplace):
    """Linear then an in-place op on its output: the replay would hand back the written value (and
    write it again), so the frame drops its stash and recomputes the region whole; gradients stay
    exact. (``relu_`` twice equals once; ``add_`` shows the difference.)"""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(WIDTH, WIDTH), inplace, nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    x = torch.randn(ROWS, WIDTH)
    got = step(call, mlp, x, selective=True)
    assert_step_same(got, step(call, mlp, x), f"in-place {inplace} after a matmul")
    assert not got[4].selective and "in place" in got[4].why_not
    assert got[4].stash_bytes == 0


@pytest.mark.parametrize("inside_engine", [False, True])
def test_inplace_change_of_a_stashed_output_after_forward_raises(inside_engine, spill_dir):
    torch.manual_seed(0)
    lin = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    eng = offload.engine(None, min_offload_mb=0, spill_dir=spill_dir) if inside_engine else None

    def fn(t):
        y = lin(t)
        return y, y.tanh()

    if eng is not None:
        with eng:
            (y, z), _ = selective_checkpoint(fn, (x,), {}, "blocks.0")
    else:
        (y, z), _ = selective_checkpoint(fn, (x,), {}, "blocks.0")
    with torch.no_grad():
        y.add_(1.0)  # the stash is y itself: a replay would hand back y + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    if eng is not None:
        eng.close()


def test_different_expensive_ops_on_the_rerun_raise_naming_the_region():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(WIDTH, WIDTH))
    calls = []

    def flip(x):
        calls.append(1)
        if len(calls) == 1:
            return (x @ w).tanh()
        return torch.matmul(x.unsqueeze(0), w.unsqueeze(0)).squeeze(0).tanh()  # bmm this time

    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    out, run = selective_checkpoint(flip, (x,), {}, "blocks.7")
    assert run.selective
    with pytest.raises(offload.OffloadError, match=r"region 'blocks\.7'.*aten\.bmm"):
        out.sum().backward()


@pytest.mark.parametrize("selective", [True, False], ids=["selective", "whole"])
def test_a_forward_that_raises_leaves_nothing_alive(selective):
    """A caught error in a region's forward (an OOM retried with a smaller batch) must not leak
    its matmul outputs: the stash holds them in a cycle through their autograd nodes that only
    the end of the forward used to break."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(WIDTH, WIDTH))
    seen = []

    def fails(x):
        y = x @ w
        seen.append(weakref.ref(y))
        y.relu()  # saves y for backward
        raise RuntimeError("out of memory (simulated)")

    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with pytest.raises(RuntimeError, match="simulated"):
        selective_checkpoint(fails, (x,), {}, "blocks.0", selective=selective)
    gc.collect()
    assert seen and seen[0]() is None, "the failed forward's matmul output is still alive"


def test_expensive_table_names_the_kernels_this_torch_runs():
    names = {str(op) for op in EXPENSIVE_OPS}
    for name in (
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.convolution",
        "aten._scaled_dot_product_flash_attention_for_cpu",
    ):
        assert name in names, f"{name} missing from EXPENSIVE_OPS"
    assert "aten.mul" not in names and "aten.native_dropout" not in names
    aten = torch.ops.aten
    assert is_expensive(aten.mm.default) and is_expensive(aten.addmm.default)
    assert not is_expensive(aten.mm.out), "an out= overload's write would read as an in-place write into the stash"
    assert not is_expensive(aten.mul.Tensor)


# ------------------------------------------------------------------------- inside the engine


def selective_engine(model: GPTLoss, budget_mb, spill_dir, link=None, **kw) -> offload.Engine:
    return offload.engine(
        budget_mb,
        policy="selective",
        regions=model.model.blocks,
        model=model,
        min_offload_mb=0,
        spill_dir=spill_dir,
        link=link,
        **kw,
    )


STEPS = 4
"""Steps per engine run: "measure", "recompute" (profiles), then two that follow the selective plan."""


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("budget_mb", [None, 0])
def test_minigpt_with_dropout_equals_no_engine(attention, budget_mb, spill_dir):
    model = gpt(attention)
    reference = copy.deepcopy(model)
    eng = selective_engine(model, budget_mb, spill_dir)
    for i in range(STEPS):
        got = run_step(model, tokens, eng, input_grad=False)
        want = run_step(reference, tokens, input_grad=False)
        assert_same(want, got, f"{attention} budget {budget_mb} step {i}")
    assert list(eng.recent_stages) == ["measure", "recompute", None, None]
    assert set(eng.plan.decisions) == {offload.Decision.SELECTIVE}, str(eng.plan)
    assert all(r.dropped_bytes > 0 for r in eng.plan.regions), str(eng.plan)
    stats = wait_clean(eng, spill_dir)
    assert stats.recomputed_bytes > 0
    if budget_mb == 0:
        assert stats.offloaded_bytes > 0 and stats.peak_resident_bytes == 0
    eng.close()


@pytest.mark.parametrize("link", ["deferred-3", "threaded", "emulated", "emulated-adversarial3-0"])
def test_budget_0_moves_the_stash_through_the_host_tier(link, spill_dir):
    model = gpt()
    reference = copy.deepcopy(model)
    with link_named(link) as made:
        eng = selective_engine(model, 0, spill_dir, link=made)
        for i in range(STEPS):
            assert_same(
                run_step(reference, tokens, input_grad=False),
                run_step(model, tokens, eng, input_grad=False),
                f"{link} step {i}",
            )
        stats = wait_clean(eng, spill_dir)
        eng.close()
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0


def test_autocast_inside_the_engine(spill_dir):
    model = gpt()
    reference = copy.deepcopy(model)
    eng = selective_engine(model, 0, spill_dir)
    for i in range(STEPS):
        want = run_step(reference, tokens, input_grad=False, autocast=torch.bfloat16)
        got = run_step(model, tokens, eng, input_grad=False, autocast=torch.bfloat16)
        assert_same(want, got, f"bf16 step {i}")
    wait_clean(eng, spill_dir)
    eng.close()


class TwoMatmuls(nn.Module):
    """``tanh(x @ w1) @ w2``: the one save to drop is the tanh output (h = x @ w1 is stashed)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.w2 = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x):
        return torch.tanh(x @ self.w1) @ self.w2


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TwoMatmuls() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("policy", ["recompute", "selective"])
def test_recomputed_bytes_is_the_dropped_tanh_outputs(policy, spill_dir):
    """Each block saves x (its input: kept), w1, w2 (parameters) and tanh's output g (once for
    tanh, once for the second matmul: one storage). Recompute and selective both drop g only."""
    torch.manual_seed(0)
    model = Stack()
    eng = offload.engine(None, policy=policy, regions=model.blocks, model=model, min_offload_mb=0, spill_dir=spill_dir)
    per_step = []
    for _ in range(3):
        eng.reset_stats()
        run_step(model, lambda: torch.randn(ROWS, WIDTH), eng)
        per_step.append(eng.stats.recomputed_bytes)
    g_bytes = ROWS * WIDTH * 4
    expected = [0, 2 * g_bytes, 2 * g_bytes] if policy == "selective" else [2 * g_bytes] * 3
    assert per_step == expected
    eng.close()


def test_compiled_blocks_are_recomputed_whole_with_a_note(spill_dir):
    pytest.importorskip("torch._dynamo")
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = Stack()
    model = copy.deepcopy(base)
    for i, b in enumerate(model.blocks):
        model.blocks[i] = torch.compile(b, backend="aot_eager")
    reference = copy.deepcopy(base)
    for i, b in enumerate(reference.blocks):
        reference.blocks[i] = torch.compile(b, backend="aot_eager")
    assert all(is_compiled(b) for b in model.blocks) and not any(is_compiled(b) for b in base.blocks)
    eng = offload.engine(
        None, policy="selective", regions=model.blocks, model=model, min_offload_mb=0, spill_dir=spill_dir
    )

    def make() -> torch.Tensor:
        return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(5))

    for i in range(3):
        assert_same(run_step(reference, make), run_step(model, make, eng), f"compiled step {i}")
    assert set(eng.plan.decisions) == {offload.Decision.RECOMPUTE}, str(eng.plan)
    assert "compiled (torch.compile)" in offload.explain(eng)
    eng.close()
    torch._dynamo.reset()


def test_auto_uses_selective_where_it_is_cheapest(spill_dir):
    """On a machine with no link, a tight budget leaves keep, recompute and selective; the
    selective re-run of a block measured cheaper than its whole recompute wins where its stash fits."""
    model = gpt(dropout=0.0)
    reference = copy.deepcopy(model)
    no_disk = offload.MachineProfile(device_type="cpu", device_name="no disk")
    eng0 = offload.engine(None, min_offload_mb=0)
    run_step(copy.deepcopy(model), tokens, eng0, input_grad=False)
    total_mb = eng0.stats.saved_bytes / 2**20
    eng0.close()
    eng = offload.engine(
        0.6 * total_mb,
        policy="auto",
        regions=model.model.blocks,
        model=model,
        machine=no_disk,
        min_offload_mb=0,
        spill_dir=spill_dir,
    )
    for i in range(STEPS):
        assert_same(
            run_step(reference, tokens, input_grad=False),
            run_step(model, tokens, eng, input_grad=False),
            f"auto step {i}",
        )
    profiles = eng.profiled_steps[-1].regions
    assert all(p.selective_ms > 0 and p.cheap_bytes > 0 and p.expensive_bytes > 0 for p in profiles), profiles
    assert offload.Decision.OFFLOAD not in eng.plan.decisions
    eng.close()


@torch.library.custom_op("offload_test::noisy_matmul", mutates_args=())
def noisy_matmul(x: torch.Tensor, w: torch.Tensor, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x @ w)`` with a dropout mask drawn inside the kernel: a stand-in for CUDA's fused
    attention with dropout (which this CPU build cannot run)."""
    mask = (torch.rand(x.shape[0], w.shape[1]) >= dropout_p).to(x.dtype) / (1 - dropout_p)
    return (x @ w) * mask, mask


@noisy_matmul.register_fake
def _(x, w, dropout_p):
    return x.new_empty(x.shape[0], w.shape[1]), x.new_empty(x.shape[0], w.shape[1])


def _noisy_setup(ctx, inputs, output):
    x, w, _ = inputs
    ctx.save_for_backward(x, w, output[1])


def _noisy_backward(ctx, grad, grad_mask):
    x, w, mask = ctx.saved_tensors
    g = grad * mask
    return g @ w.t(), x.t() @ g, None


noisy_matmul.register_autograd(_noisy_backward, setup_context=_noisy_setup)


def test_an_expensive_op_that_draws_random_numbers_leaves_later_draws_alike(monkeypatch):
    """The replay skips the op, so it must put the generator where the op left it in forward:
    otherwise the dropout after it draws another mask. See Note: [expensive ops that draw random numbers]."""
    from offload._regions import selective as _selective

    monkeypatch.setattr(_selective, "EXPENSIVE_OPS", EXPENSIVE_OPS | {torch.ops.offload_test.noisy_matmul})
    torch.manual_seed(0)
    lin = nn.Linear(WIDTH, WIDTH)

    def fn(module, x):
        y, _ = noisy_matmul(x, module.weight, 0.5)
        return F.dropout(y.tanh(), 0.5)

    x = torch.randn(ROWS, WIDTH)
    got = step(fn, lin, x, selective=True)
    assert got[4].selective and got[4].stashed_tensors == 2
    assert_step_same(got, step(fn, lin, x), "an expensive op with dropout")


def test_minigpt_step_under_the_selective_plan_reruns_no_expensive_flops(spill_dir):
    """Once the selective plan is in force, a whole MiniGPT step's backward counts the FLOPs of
    the model's without the engine: nothing a block re-runs is a matmul or attention."""
    model = gpt()
    reference = copy.deepcopy(model)
    eng = selective_engine(model, None, spill_dir)
    for _ in range(2):  # "measure", "recompute": the profiling steps
        run_step(model, tokens, eng, input_grad=False)

    def backward_flops(m, engine):
        torch.manual_seed(1)
        idx = tokens()
        with engine if engine is not None else contextlib.nullcontext():
            loss = m(idx)
        with FlopCounterMode(display=False) as flops:
            loss.backward()
        return flops.get_total_flops()

    with FlopCounterMode(display=False) as forward:
        reference(tokens())
    reference.zero_grad(set_to_none=True)
    plain, selective = backward_flops(reference, None), backward_flops(model, eng)
    assert list(eng.recent_stages)[-1] is None and set(eng.plan.decisions) == {offload.Decision.SELECTIVE}
    assert (selective - plain) < FLOP_BOUND * forward.get_total_flops(), (selective, plain, forward.get_total_flops())
    eng.close()


def test_our_stash_reaches_outer_hooks_where_torch_sac_cache_does_not():
    """Why ``_regions.selective`` exists (its module docstring): torch's selective checkpoint keeps the
    outputs its policy saves in its own cache, out of reach of outer saved-tensor hooks (checked on
    this torch), while ours packs them through those hooks. x (8, 32) @ w (32, 64): the matmul
    output is the one (8, 64) tensor."""
    w = torch.randn(32, 64, requires_grad=True)
    x = torch.randn(8, 32, requires_grad=True)

    def fn(t):
        return torch.tanh(t @ w).sum()

    def must_save_mm(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def seen_by_outer_hooks(run) -> list:
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            out = run()
        out.backward()
        return shapes

    sac = functools.partial(create_selective_checkpoint_contexts, must_save_mm)
    torch_seen = seen_by_outer_hooks(lambda: checkpoint(fn, x, use_reentrant=False, context_fn=sac))
    ours_seen = seen_by_outer_hooks(lambda: selective_checkpoint(fn, (x,), {}, "r")[0])
    assert (8, 64) not in torch_seen and (8, 32) in torch_seen, torch_seen
    assert (8, 64) in ours_seen and (8, 32) in ours_seen, ours_seen


def test_a_region_that_fails_under_a_dispatch_mode_is_profiled_as_not_splittable(monkeypatch, spill_dir):
    """The "recompute" step's measuring re-run raising (here: forced) leaves that step's
    gradients exact and the region out of the selective choices, with the reason in explain()."""
    from offload._regions import selective as _selective

    def refuse(self, *args, **kwargs):
        raise RuntimeError("no Python modes here")

    monkeypatch.setattr(_selective._ProfileMode, "__torch_dispatch__", refuse)
    model = gpt()
    reference = copy.deepcopy(model)
    eng = selective_engine(model, None, spill_dir)
    for i in range(3):
        assert_same(
            run_step(reference, tokens, input_grad=False), run_step(model, tokens, eng, input_grad=False), f"step {i}"
        )
    assert set(eng.plan.decisions) == {offload.Decision.RECOMPUTE}, str(eng.plan)
    assert "no Python modes here" in offload.explain(eng)
    eng.close()
