"""Regions given wrong, refused or named at once: nested regions, another model's regions, and
one engine's regions run from two threads at the same time (See Note: [one forward at a time]).

Each of these used to be accepted and then fail later with a wrong diagnosis, or never say anything.

White-box, one test: two threads racing to enter are made to meet between one thread's check and its
entry, which no public seam can pause: it swaps the engine's entry lock for one that says when a
thread reaches it, and pauses inside the regions' check (``Engine._entering``,
``Regions.refuse_another_thread``).
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch

import offload
from zoo import GPTLoss, assert_same, gpt, run_step


def _net() -> torch.nn.Module:
    return GPTLoss(gpt(dropout=0.0))


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 17))


def _step(model, eng=None):
    return run_step(model, _tokens, eng, loss_fn=lambda loss: loss, input_grad=False)


# ---------------------------------------------------------------------------------- nesting


@pytest.mark.parametrize("order", ["outer-first", "inner-first"])
def test_nested_regions_are_refused_when_the_engine_is_built(order):
    model = _net()
    block = model.model.blocks[0]
    regions = [block, block.attn] if order == "outer-first" else [block.attn, block]
    with pytest.raises(ValueError, match=r"nests region 'model\.blocks\.0\.attn' inside region 'model\.blocks\.0'"):
        offload.engine(budget_mb=0, model=model, regions=regions)


def test_a_filter_that_picks_nested_modules_is_refused():
    model = _net()
    with pytest.raises(ValueError, match="nests region"):
        offload.engine(budget_mb=0, model=model, regions=lambda m, name: name.startswith("model.blocks.0"))


@pytest.mark.parametrize("order", ["outer-first", "inner-first"])
def test_a_region_two_levels_inside_another_is_refused(order):
    """A grandchild, not only a child: a block and a linear layer of its attention."""
    model = _net()
    block = model.model.blocks[0]
    inner = next(m for name, m in block.named_modules() if name.count(".") == 1)
    regions = [block, inner] if order == "outer-first" else [inner, block]
    with pytest.raises(ValueError, match=r"nests region 'model\.blocks\.0\.\w+\.\w+' inside region 'model\.blocks\.0'"):
        offload.engine(budget_mb=0, model=model, regions=regions)


def test_nested_regions_without_the_model_are_refused_too():
    model = _net()
    with pytest.raises(ValueError, match="nests region"):
        offload.engine(budget_mb=0, regions=[model.model.blocks[0], model.model.blocks[0].mlp])


# ---------------------------------------------------------------------------------- another model


def test_regions_of_a_copy_are_refused_with_the_model():
    model = _net()
    twin = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"item 0 .* is not a submodule of the model .* copy\.deepcopy"):
        offload.engine(budget_mb=0, model=model, regions=twin.model.blocks)


def test_regions_of_a_copy_are_refused_by_the_decorator():
    model = _net()
    twin = copy.deepcopy(model)
    eng = offload.engine(budget_mb=0, regions=twin.model.blocks)
    with pytest.raises(ValueError, match="not a submodule of the model"):
        eng(model)
    eng.close()


def test_a_step_that_runs_none_of_the_regions_says_so_once(spill_dir):
    model = _net()
    twin = copy.deepcopy(model)
    eng = offload.engine(budget_mb=0, min_offload_mb=0, regions=twin.model.blocks, policy="auto")
    with pytest.warns(UserWarning, match=r"ran none of the engine's 2 regions .*Engine\.profiling stays True"):
        _step(model, eng)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        _step(model, eng)
    assert eng.profiling
    eng.close()


def test_a_step_that_runs_the_regions_says_nothing(spill_dir):
    model = _net()
    eng = offload.engine(budget_mb=0, min_offload_mb=0, regions=model.model.blocks, policy="offload")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            _step(model, eng)
    eng.close()


# ---------------------------------------------------------------------------------- threads


def _two_threads(first, second):
    """Run ``first`` on a thread until it is inside the model's second block, then ``second`` on
    another thread, then let the first finish; returns each one's exception (or None)."""
    errors: dict[str, BaseException | None] = {"first": None, "second": None}
    inside, go_on = threading.Event(), threading.Event()

    def run(name, fn):
        try:
            fn(inside, go_on)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors[name] = e

    t1 = threading.Thread(target=run, args=("first", first))
    t1.start()
    assert inside.wait(30), "the first thread never reached the second block"
    t2 = threading.Thread(target=run, args=("second", second))
    t2.start()
    t2.join(60)
    go_on.set()
    t1.join(60)
    return errors


def test_one_engine_with_regions_refuses_a_second_thread_mid_forward(spill_dir):
    base = _net()
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    eng = offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions=model.model.blocks, policy="auto")
    block = model.model.blocks[1]
    original = block.mlp.forward

    def pausing(x):
        if threading.current_thread() is not threading.main_thread() and not pausing.paused:
            pausing.paused = True
            pausing.inside.set()
            pausing.go_on.wait(30)
        return original(x)

    pausing.paused = False
    block.mlp.forward = pausing

    results = {}

    def first(inside, go_on):
        pausing.inside, pausing.go_on = inside, go_on
        results["first"] = _step(model, eng)

    def second(inside, go_on):
        _step(model, eng)

    errors = _two_threads(first, second)
    assert isinstance(errors["second"], offload.OffloadError), errors
    assert "one forward at a time" in str(errors["second"]) and "one engine per thread" in str(errors["second"])
    assert errors["first"] is None, errors["first"]
    assert_same(_step(reference), results["first"], "the first thread's step")
    # One after another from two threads is fine, and the engine goes on planning.
    for _ in range(4):
        t = threading.Thread(target=lambda: results.update(last=_step(model, eng)))
        t.start()
        t.join(60)
        assert_same(_step(reference), results["last"], "a step from another thread")
    eng.close()


def test_a_thread_that_raised_mid_forward_holds_nothing_up(spill_dir):
    model = _net()
    eng = offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions=model.model.blocks, policy="offload")
    block = model.model.blocks[1]
    original = block.forward

    def raising(*args, **kwargs):
        raise RuntimeError("a bad batch")

    block.forward = raising
    t = threading.Thread(target=lambda: pytest.raises(RuntimeError, _step, model, eng))
    t.start()
    t.join(60)
    block.forward = original
    _step(model, eng)  # on this thread: no error
    eng.close()


def test_two_threads_entering_together_one_is_refused_or_they_take_turns(spill_dir):
    """Threads released together: the check and the entry happen under one lock, so each trial
    either takes turns or refuses one thread before it saved anything; nothing else ever fails."""
    import sys

    base = _net()
    reference = _step(copy.deepcopy(base))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for trial in range(10):
            model = copy.deepcopy(base)
            eng = offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions=model.model.blocks)
            barrier = threading.Barrier(2)
            outcomes: list = []

            def run(model=model, eng=eng, barrier=barrier, outcomes=outcomes):
                barrier.wait()
                try:
                    outcomes.append(_step(model, eng))
                except offload.OffloadError as e:
                    outcomes.append(e)
                except BaseException as e:  # noqa: BLE001 - reported below
                    outcomes.append(("unexpected", e))

            threads = [threading.Thread(target=run) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not [o for o in outcomes if isinstance(o, tuple)], (trial, outcomes)
            done = [o for o in outcomes if not isinstance(o, offload.OffloadError)]
            assert done, (trial, outcomes)
            assert_same(reference, done[0], f"trial {trial}: the first step")
            eng.close()
    finally:
        sys.setswitchinterval(switch)


def test_a_profiling_step_overtaken_before_its_backward_is_measured_again(spill_dir):
    """Thread A's profiling step waits in its backward while thread B runs a whole step: A's step
    is not planned from (its backward was not measured alone), and every step's gradients hold."""
    base = _net()
    model = copy.deepcopy(base)
    eng = offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions=model.model.blocks, policy="auto")
    in_backward, go_on = threading.Event(), threading.Event()
    results = {}

    def first():
        torch.manual_seed(0)
        with eng:
            loss = model(_tokens())
        loss.register_hook(lambda g: (in_backward.set(), go_on.wait(30), g)[-1])
        loss.backward()
        results["first"] = True

    t = threading.Thread(target=first)
    t.start()
    assert in_backward.wait(30)
    assert eng.recent_stages[-1] == "measure"
    results["second"] = _step(model, eng)  # another thread's whole step, while A's backward waits
    go_on.set()
    t.join(60)
    assert results.get("first")
    for _ in range(6):
        _step(model, eng)
    assert all(p.span_ms is not None for p in eng.profiled_steps), [p.span_ms for p in eng.profiled_steps]
    assert list(eng.recent_stages)[:2] == ["measure", "measure"], "the overtaken stage ran again"
    eng.close()


class _SignallingLock:
    """A lock that sets ``arrived`` when a thread other than ``owner`` comes to take it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.arrived = threading.Event()
        self.owner: int | None = None

    def __enter__(self):
        if threading.get_ident() != self.owner:
            self.arrived.set()
        self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()
        return False

    def locked(self) -> bool:
        return self._lock.locked()


def test_a_second_thread_waits_for_the_first_to_enter_then_is_refused(spill_dir):
    """Thread A pauses between its check (no one else inside) and its entry until thread B has come
    to enter; B must wait for A's entry (the check and the entry are under one lock), then see A
    inside and be refused. Without the lock B would check while A is paused, find no one inside,
    and run its step beside A's."""
    base = _net()
    reference = _step(copy.deepcopy(base))
    model = copy.deepcopy(base)
    eng = offload.engine(budget_mb=0, min_offload_mb=0, model=model, regions=model.model.blocks, policy="offload")
    lock = _SignallingLock()
    eng._entering = lock
    regions = eng._regions
    check = regions.refuse_another_thread
    a_checking, b_done = threading.Event(), threading.Event()
    held_while_checking = []

    def pausing_check():
        check()
        if threading.get_ident() == lock.owner:
            held_while_checking.append(lock.locked())
            a_checking.set()
            assert lock.arrived.wait(30), "thread B never came to enter"
        else:
            lock.arrived.set()  # without the lock, B checks at once

    regions.refuse_another_thread = pausing_check
    block = model.model.blocks[1]
    original = block.forward

    def waits_for_b(*args, **kwargs):  # A stays inside the engine until B is done
        if threading.get_ident() == lock.owner:
            assert b_done.wait(30), "thread B never ended"
        return original(*args, **kwargs)

    block.forward = waits_for_b
    results: dict = {}

    def a():
        lock.owner = threading.get_ident()
        try:
            results["a"] = _step(model, eng)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            results["a"] = e

    def b():
        try:
            results["b"] = _step(model, eng)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            results["b"] = e
        finally:
            b_done.set()

    thread_a = threading.Thread(target=a)
    thread_a.start()
    assert a_checking.wait(30), "thread A never reached its check"
    thread_b = threading.Thread(target=b)
    thread_b.start()
    thread_b.join(60)
    thread_a.join(60)
    block.forward = original
    assert isinstance(results["b"], offload.OffloadError), results["b"]
    assert "one forward at a time" in str(results["b"])
    assert held_while_checking == [True]
    assert_same(reference, results["a"], "thread A's step")
    eng.close()
