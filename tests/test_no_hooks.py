"""Budget None without regions: after the counted first step the engine's hook pair stays off the
thread's saved-tensor hook stack and autograd saves natively (See Note: [no hooks where nothing
moves] in offload/_memory/session.py).

Oracles: the same model without the engine (outputs, gradients and buffers bitwise equal, via
``zoo.assert_same``); torch's own hook stack (``torch._C._autograd._top_saved_tensors_default_hooks``)
for what is installed; and for a user's own pair, what that pair is called with without the
engine's unhooked steps (the engine's first, counted step). Nothing is timed here: the cost is
bench/scale_saves.py's.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

import offload
from zoo import GPTLoss, assert_same, gpt, mlp, run_step

WIDTH = 32
ROWS = 8
VOCAB = 64


def _top():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _counted_then_unhooked(**options) -> offload.Engine:
    """An engine at budget None whose next step runs unhooked: its counted first step is spent."""
    eng = offload.engine(None, min_offload_mb=0, **options)
    with eng:
        pass
    return eng


def _input() -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(3))


def test_the_first_step_is_counted_and_later_ones_push_nothing():
    """Step 1 runs the hooks and counts exactly; steps 2 and 3 push no pair, count nothing and say
    so in ``uncounted_steps``; reset_stats makes the next step counted again, with the same count."""
    model, reference = mlp(width=WIDTH), mlp(width=WIDTH)
    eng = offload.engine(None, min_offload_mb=0)
    seen = []
    model.register_forward_hook(lambda m, a, o: seen.append(_top()))
    for step in range(3):
        assert_same(run_step(reference, _input), run_step(model, _input, eng), f"step {step}")
        stats = eng.stats
        if step == 0:
            first = stats
            assert first.saved_tensors > 0 and first.saved_bytes > 0 and first.uncounted_steps == 0
        else:
            assert (stats.saved_tensors, stats.saved_bytes) == (first.saved_tensors, first.saved_bytes)
            assert stats.uncounted_steps == step
    assert seen[0] == eng._session.hooks and seen[1:] == [None, None], "the pair is on the stack in step 1 only"
    eng.reset_stats()
    assert eng.stats.uncounted_steps == 0 and eng.stats.saved_tensors == 0
    assert_same(run_step(reference, _input), run_step(model, _input, eng), "after reset_stats")
    assert (eng.stats.saved_tensors, eng.stats.saved_bytes) == (first.saved_tensors, first.saved_bytes)
    assert eng.stats.uncounted_steps == 0
    assert seen[-1] == eng._session.hooks, "the step after reset_stats is counted, with the pair on"
    eng.close()


def test_a_budget_or_regions_keep_the_hooks_on_every_step(spill_dir):
    """Only budget None without regions skips the pair: a budget, "auto" and regions never do."""
    model = gpt(dropout=0.0)
    engines = [
        offload.engine(64, min_offload_mb=0, spill_dir=spill_dir),
        offload.engine("auto", min_offload_mb=0, spill_dir=spill_dir, memory=lambda: 1 << 40),
        offload.engine(None, policy="none", regions=model.blocks, model=model, min_offload_mb=0),
    ]
    for eng in engines:
        for _ in range(3):
            with eng:
                assert _top() == eng._session.hooks, eng
        assert eng.stats.uncounted_steps == 0
        eng.close()


def test_an_outer_pair_sees_nothing_saved_inside_the_engine():
    """A user's pair entered before the engine: only the innermost pair is called, so before this
    change it saw nothing saved inside ``with eng:``; an unhooked step must not expose those saves
    to it, so the engine pushes its pair there (and counts the step)."""
    model, reference = mlp(width=WIDTH), mlp(width=WIDTH)
    eng = _counted_then_unhooked()
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = run_step(model, _input, eng)
    assert packed == [], f"the outer pair saw saves made inside the engine: {packed}"
    assert eng.stats.saved_tensors > 0 and eng.stats.uncounted_steps == 0, "the engine took them itself"
    assert_same(run_step(reference, _input), got)
    eng.close()


def test_another_engine_outside_moves_nothing_saved_inside(spill_dir):
    """An engine at budget 0 around an unhooked one: the inner engine's saves stay where they were
    (they reach the inner engine's pair, as before), and the outer moves only its own."""
    outer = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    inner = _counted_then_unhooked()
    x = torch.randn(64, 64, requires_grad=True)
    with outer:
        y = torch.tanh(x * 2)  # two saves outside the inner engine: tanh's output, and none for x * 2
        with inner:
            z = torch.sin(y) * y
    z.sum().backward()
    assert outer.stats.saved_tensors == 1, outer.stats
    assert inner.stats.saved_tensors == 3, "sin's input and mul's two, all of y's storage or sin's"
    outer.close()
    inner.close()


def test_a_pair_inside_the_engine_sees_every_save_and_a_nested_entry_shadows_it():
    """A user's pair inside an unhooked step is innermost and sees every save, as before; the engine
    entered again inside that pair pushes its own, so the user's sees nothing from there, as before."""
    eng = _counted_then_unhooked()
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with eng:
        assert _top() is None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = torch.tanh(x)
            with eng:
                assert _top() == eng._session.hooks
                z = torch.sin(y)
        w = torch.cos(z)
    (w.sum() + y.sum()).backward()
    assert packed == [(ROWS, WIDTH)], packed  # tanh's output; sin's input went to the engine
    assert eng.stats.saved_tensors == 1 and eng.stats.uncounted_steps == 1
    x2 = x.detach().requires_grad_(True)
    y2 = torch.tanh(x2)
    (torch.cos(torch.sin(y2)).sum() + y2.sum()).backward()
    assert torch.equal(x.grad, x2.grad)
    eng.close()


def test_entering_while_hooks_are_disabled_raises_as_before():
    """Under ``disable_saved_tensors_hooks`` pushing a pair raises; an unhooked step raises too,
    rather than running with saves the engine would otherwise have taken."""
    eng = _counted_then_unhooked()
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        with pytest.raises(RuntimeError, match="no hooks here"):
            with eng:
                pass
    eng.close()


@pytest.mark.parametrize("inner", ["no_offload", "torch.utils.checkpoint", "offload.checkpoint"])
def test_no_offload_and_checkpoints_inside_an_unhooked_step(inner):
    model, reference = GPTLoss(gpt(dropout=0.1)), GPTLoss(gpt(dropout=0.1))
    blocks = model.model.blocks

    def wrapped(block):
        forward = block.forward

        def run(x, *args, **kwargs):
            if inner == "no_offload":
                with offload.no_offload():
                    return forward(x, *args, **kwargs)
            if inner == "torch.utils.checkpoint":
                return torch.utils.checkpoint.checkpoint(forward, x, *args, use_reentrant=False, **kwargs)
            return offload.checkpoint(forward, x, *args, **kwargs)

        return run

    for block in blocks:
        block.forward = wrapped(block)
    tokens = lambda: torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(5))  # noqa: E731
    eng = _counted_then_unhooked()
    for step in range(2):
        want = run_step(reference, tokens, input_grad=False)
        assert_same(want, run_step(model, tokens, eng, input_grad=False), f"{inner} step {step}")
    assert eng.stats.uncounted_steps == 2 and eng.stats.saved_tensors == 0
    eng.close()


def test_autograd_grad_retain_graph_and_double_backward_unhooked():
    """A gradient penalty (double backward), autograd.grad on a subset and a second backward over a
    retained graph, all in an unhooked step: equal to no engine."""

    def step(model: nn.Module, eng):
        x = _input().requires_grad_(True)
        with eng if eng is not None else torch.enable_grad():
            out = model(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        penalty = gx.pow(2).sum()
        first = torch.autograd.grad(out.pow(2).sum(), list(model.parameters())[:2], retain_graph=True)
        (penalty + out.pow(2).sum()).backward(retain_graph=True)
        out.sum().backward()
        return [g.clone() for g in first] + [p.grad.clone() for p in model.parameters()]

    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Sigmoid())
    reference = copy.deepcopy(model)
    eng = _counted_then_unhooked()
    got, want = step(model, eng), step(reference, None)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert eng.stats.uncounted_steps == 1
    eng.close()


def test_the_hook_stack_is_per_thread():
    """While one thread runs the counted step (its pair on its own stack), another thread's step is
    unhooked and sees no pair; each thread's gradients equal no engine."""
    eng = offload.engine(None, min_offload_mb=0)
    both_inside = threading.Barrier(2, timeout=30)
    tops, grads, errors = {}, {}, []
    want = {}
    for name in ("a", "b"):
        x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(len(name) + ord(name)))
        want[name] = torch.autograd.grad(torch.tanh(torch.sin(x.requires_grad_(True))).sum(), x)[0]

    first_inside = threading.Event()  # thread a enters first, so its step is the counted one

    def run(name: str) -> None:
        try:
            if name == "b":
                first_inside.wait(30)
            x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(len(name) + ord(name)))
            x.requires_grad_(True)
            with eng:
                first_inside.set()
                both_inside.wait()
                tops[name] = _top()
                y = torch.tanh(torch.sin(x))
                both_inside.wait()
            grads[name] = torch.autograd.grad(y.sum(), x)[0]
        except BaseException as e:  # noqa: BLE001  (re-raised below, on the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(name,)) for name in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert tops == {"a": eng._session.hooks, "b": None}, tops
    assert all(torch.equal(grads[n], want[n]) for n in "ab")
    assert eng.stats.saved_tensors == 1, "tanh's output in thread a's step (sin's input is a leaf)"
    assert eng.stats.uncounted_steps == 1
    eng.close()


def test_compiled_blocks_unhooked_equal_no_engine():
    """torch.compile'd blocks: the counted step traces under the pair, later steps run without it
    (a recompile if Dynamo guards on it); every step equals the compiled model without the engine."""
    torch._dynamo.reset()
    try:
        base = mlp(width=WIDTH)
        model, reference = copy.deepcopy(base), copy.deepcopy(base)
        for m in (model, reference):
            for i, layer in enumerate(m):
                m[i] = torch.compile(layer, backend="aot_eager")
        eng = offload.engine(None, min_offload_mb=0)
        for step in range(3):
            assert_same(run_step(reference, _input), run_step(model, _input, eng), f"step {step}")
        assert eng.stats.uncounted_steps == 2
        eng.close()
    finally:
        torch._dynamo.reset()


def test_explain_says_which_steps_were_counted():
    eng = _counted_then_unhooked()
    for _ in range(2):
        with eng:
            pass
    text = offload.explain(eng)
    assert "counts the first step" in text and "uncounted steps since (run with no hooks): 2;" in text, text
    eng.close()


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo")
def test_saves_declared_shared_reach_the_engine_in_an_unhooked_step():
    """``offload.sharded`` slices a save in the engine's pack; in an unhooked step it pushes the
    engine's pair for its block, so the declaration still reaches the engine (and a declaration
    outside any engine, after one, pushes nothing)."""
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        eng = _counted_then_unhooked()
        x = torch.randn(64, 64, requires_grad=True)
        with eng:
            with offload.sharded():
                assert _top() == eng._session.hooks
                loss = torch.tanh(x * 2).sum()
            assert _top() is None
        loss.backward()
        assert eng.stats.saved_tensors == 1 and eng.stats.uncounted_steps == 1
        with offload.sharded():
            assert _top() is None, "outside the engine a declaration installs nothing"
        eng.close()
    finally:
        dist.destroy_process_group()


def test_count_next_step_counts_one_more_step_without_zeroing():
    """``count_next_step()`` puts the pair back for the next step only: its saves add to the counts."""
    model = mlp(width=WIDTH)
    eng = offload.engine(None, min_offload_mb=0)
    run_step(model, _input, eng)
    one = eng.stats.saved_tensors
    run_step(model, _input, eng)
    eng.count_next_step()
    run_step(model, _input, eng)
    run_step(model, _input, eng)
    assert eng.stats.saved_tensors == 2 * one and eng.stats.uncounted_steps == 2
    eng.close()
