"""The CUDA path's ordering, run on the CPU under the happens-before race detector (``tests/hb.py``).

``CudaLink`` itself runs over emulated streams, events, caching allocator and spill jobs; every
copy, spill job, host op on a reload, released host block and freed storage is checked by vector
clocks. Each scenario is a spill-heavy case the GPU path meets (host memory capped below the
working set, budgets 0, 25 % and 50 %, prefetch on, regions under recompute, selective and auto,
shapes that change between steps, a graph dropped or a backward failing with copies in flight,
work on two streams) and runs under several schedules (``hb.Schedule``). Oracles: no race, no copy
whose source was gone, and gradients bitwise equal to the model without the engine.

The detector proves itself in ``test_race_guards.py`` (white-box): each guard the protocol rests
on is removed there, and some scenario of this file that reaches it must then show a race or a
source gone within its schedules, while the same runs without the removal show none. Here the
engine is reached through its public seams only: the link (``hb.EmulatedCudaLink``) and the host
it carries.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Callable, Optional

import pytest
import torch
from torch import nn

import offload
from hb import FAST_SCHEDULES, SLOW_SCHEDULES, EmulatedCudaLink, EmulatedStreams, Schedule, detecting
from offload.models.gpt import GPTConfig, MiniGPT
from test_regions import MACHINE
from zoo import MB

WIDTH, ROWS, DEPTH = 128, 64, 6
ACT_BYTES = ROWS * WIDTH * 4
"""One saved activation of the MLP scenarios (32 KiB)."""


@dataclasses.dataclass
class Outcome:
    """What one run under the detector showed."""

    equal: bool
    races: list
    sources_gone: int
    moved: bool
    """The run moved tensors off the device and back (or, without backward, off): it reached the link."""
    error: Optional[str] = None
    """What the scenario raised, if it did (a removed guard can break the engine outright)."""

    @property
    def caught(self) -> bool:
        return bool(self.races) or self.sources_gone > 0


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 1))


def _grads(model: nn.Module, x: torch.Tensor, eng=None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with eng if eng is not None else torch.enable_grad():
        loss = model(x).square().sum()
    loss.backward()
    return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]


def _same(want, got) -> bool:
    return all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def _engine(link, budget_mb, spill_dir, **options):
    return offload.engine(budget_mb, device="cpu", min_offload_mb=0, link=link, spill_dir=spill_dir, **options)


# ---------------------------------------------------------------------------------- scenarios
#
# Each runs the model without the engine and with it over ``link`` and says whether the results
# are bitwise equal and whether tensors moved; the detector's verdict is read by the caller.


def mlp_steps(link, spill_dir, *, budget_fraction: float, host_budget_mb=None, steps: int = 2) -> tuple[bool, bool]:
    """The MLP at a budget of ``budget_fraction`` of what it saves, a fresh input each step."""
    model = _mlp()
    budget_mb = budget_fraction * (2 * DEPTH + 1) * ACT_BYTES / MB
    eng = _engine(link, budget_mb, spill_dir, host_budget_mb=host_budget_mb)
    equal = True
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(ROWS, WIDTH)
        want = _grads(model, x)
        equal = _same(want, _grads(model, x, eng)) and equal
    stats = eng.stats
    eng.close()
    return equal, stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0


def host_capped(link, spill_dir) -> tuple[bool, bool]:
    """Host memory capped below the working set: device -> host -> disk and back, budget 0."""
    return mlp_steps(link, spill_dir, budget_fraction=0.0, host_budget_mb=4 * ACT_BYTES / MB)


def forward_without_backward(link, spill_dir, budget_acts: float = 6) -> tuple[bool, bool]:
    """The graph is dropped right after forward, with copies out (and spill writes) in flight. At
    6 activations' budget the copies out go in batches (See Note: [moves in batches] in
    ``offload._memory.store``); at 2.5 each goes alone (one activation passes the batch's room)."""
    model = _mlp()
    eng = _engine(link, budget_acts * ACT_BYTES / MB, spill_dir, host_budget_mb=4 * ACT_BYTES / MB)
    for step in range(2):
        torch.manual_seed(100 + step)
        with eng:
            loss = model(torch.randn(ROWS, WIDTH)).square().sum()
        del loss
        gc.collect()
    moved = eng.stats.offloaded_bytes > 0
    eng.close()
    return True, moved


def dropped_one_by_one(link, spill_dir) -> tuple[bool, bool]:
    """``forward_without_backward`` at 2.5 activations' budget: every copy out is one tensor's, and
    one is still in flight as the graph goes (at budget 0 each pack waits for its own)."""
    return forward_without_backward(link, spill_dir, budget_acts=2.5)


def backward_fails(link, spill_dir) -> tuple[bool, bool]:
    """Backward raises half-way, with reloads (prefetches) in flight; then a whole step."""
    model = _mlp()
    eng = _engine(link, 3 * ACT_BYTES / MB, spill_dir)
    torch.manual_seed(100)
    x = torch.randn(ROWS, WIDTH)

    def fail(grad):
        raise ValueError("raised on purpose in backward")

    with eng:
        h = model[: 2 * DEPTH - 4](x)
        h.register_hook(fail)
        loss = model[2 * DEPTH - 4 :](h).square().sum()
    with pytest.raises(ValueError):
        loss.backward()
    del loss, h
    gc.collect()
    reloaded = eng.stats.reloaded_bytes > 0
    equal = _same(_grads(model, x), _grads(model, x, eng))
    eng.close()
    return equal, reloaded


GPT = GPTConfig(n_layer=3, n_head=2, n_embd=32, seq_len=24, dropout=0.1, attention="math")


def _gpt_steps(link, spill_dir, policy: str, seqs: list[int], budget_mb: float, host_budget_mb) -> tuple[bool, bool]:
    torch.manual_seed(0)
    model = MiniGPT(GPT)
    torch.manual_seed(0)
    reference = MiniGPT(GPT)
    eng = offload.engine(
        budget_mb,
        policy=policy,
        regions=model.blocks,
        model=model,
        machine=MACHINE,
        device="cpu",
        min_offload_mb=0,
        link=link,
        spill_dir=spill_dir,
        host_budget_mb=host_budget_mb,
    )
    equal = True
    for step, seq in enumerate(seqs):
        g = torch.Generator().manual_seed(100 + step)
        idx = torch.randint(0, GPT.vocab_size, (2, seq + 1), generator=g)
        results = []
        for m, e in ((reference, None), (model, eng)):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(7 + step)
            with e if e is not None else torch.enable_grad():
                _, loss = m(idx[:, :-1], idx[:, 1:])
            loss.backward()
            results.append([loss.detach()] + [p.grad.clone() for p in m.parameters()])
        equal = _same(*results) and equal
    stats = eng.stats
    eng.close()
    return equal, stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0


def regions(policy: str) -> Callable:
    """MiniGPT's blocks under ``policy``, budget 0, host capped: profiling steps, then the plan."""

    def scenario(link, spill_dir):
        return _gpt_steps(link, spill_dir, policy, [GPT.seq_len] * 4, 0.0, 0.25)

    scenario.__name__ = f"regions_{policy}"
    return scenario


def changing_shapes(link, spill_dir) -> tuple[bool, bool]:
    """Sequence lengths change every step (policy auto, a small budget, host capped)."""
    return _gpt_steps(link, spill_dir, "auto", [24, 9, 17, 24, 12, 20], 0.02, 0.25)


# Two streams (the multi-stream cases of test_stream_order, as scenarios).


class TanhOn(torch.autograd.Function):
    """tanh(x), forward and backward on ``stream`` (autograd runs a node's backward on its
    forward's stream)."""

    @staticmethod
    def forward(ctx, x, stream, streams: EmulatedStreams):
        with streams.using(stream):
            y = torch.tanh(x)
            ctx.save_for_backward(y)
        ctx.stream, ctx.streams = stream, streams
        return y

    @staticmethod
    def backward(ctx, grad):
        with ctx.streams.using(ctx.stream):
            (y,) = ctx.saved_tensors
            return grad * (1 - y * y), None, None


class MulOn(torch.autograd.Function):
    """x * w with its backward on ``stream``: saves both, so a tanh output is used on two streams."""

    @staticmethod
    def forward(ctx, x, w, stream, streams: EmulatedStreams):
        with streams.using(stream):
            ctx.save_for_backward(x, w)
        ctx.stream, ctx.streams = stream, streams
        return x * w

    @staticmethod
    def backward(ctx, grad):
        with ctx.streams.using(ctx.stream):
            x, w = ctx.saved_tensors
            return grad * w, grad * x, None, None


def two_streams(link, spill_dir, prefetch: bool = False) -> tuple[bool, bool]:
    """Layers alternate between the compute stream and a side stream, so reloads allocated on one
    are used on the other (See Note: [a reload used on another stream]); with ``prefetch`` a reload
    started by one stream's node is first used by the other's."""
    streams = link.emulated
    side = streams.new_stream()
    x = torch.randn(ROWS * WIDTH)
    weights = [torch.full((ROWS * WIDTH,), 0.5 + 0.1 * i) for i in range(6)]

    def step(eng=None):
        xi = x.clone().requires_grad_(True)
        with eng if eng is not None else torch.enable_grad():
            h = xi * 1.0
            for i, w in enumerate(weights):
                first, second = (streams.compute, side) if i % 2 == 0 else (side, streams.compute)
                h = MulOn.apply(TanhOn.apply(h, first, streams), w, second, streams)
            loss = h.sum()
        loss.backward()
        return [xi.grad.clone()]

    eng = _engine(link, 3 * ACT_BYTES / MB, spill_dir, prefetch=prefetch)
    equal = _same(step(), step(eng))
    stats = eng.stats
    eng.close()
    return equal, stats.reloaded_bytes > 0


def two_streams_prefetch(link, spill_dir) -> tuple[bool, bool]:
    return two_streams(link, spill_dir, prefetch=True)


class ProducedOn(torch.autograd.Function):
    """sin(x), its output written on the current (side) stream, late, as a kernel there would."""

    @staticmethod
    def forward(ctx, x, streams: EmulatedStreams):
        out = torch.full_like(x, float("nan"))
        values, raw = x.sin(), out.data
        streams.write_on(streams.current(), raw, lambda: raw.copy_(values), "the producer's write", duration_ms=5.0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * (1 - out.square()).sqrt(), None


def produced_on_a_side_stream(link, spill_dir) -> tuple[bool, bool]:
    """A tensor produced and saved on a side stream is evicted later, while the compute stream is
    current: its copy out must wait for the side stream (See Note: [fences before a copy])."""
    streams = link.emulated
    side = streams.new_stream()
    x = torch.rand(ROWS * WIDTH) - 0.5

    def step(eng=None):
        xi = x.clone().requires_grad_(True)
        with eng if eng is not None else torch.enable_grad():
            with streams.using(side):
                y = ProducedOn.apply(xi, streams)
            z = torch.tanh(xi * 2)
            w = torch.tanh(z * 3)
            streams.compute.wait_stream(side)
            loss = (y * w).sum()
        loss.backward()
        return [xi.grad.clone()]

    eng = _engine(link, 2 * ACT_BYTES / MB, spill_dir)
    equal = _same(step(), step(eng))
    stats = eng.stats
    eng.close()
    return equal, stats.offloaded_bytes > 0


def budget(fraction: float) -> Callable:
    def scenario(link, spill_dir):
        return mlp_steps(link, spill_dir, budget_fraction=fraction)

    scenario.__name__ = f"budget_{int(fraction * 100)}"
    return scenario


SCENARIOS = {
    s.__name__: s
    for s in (
        budget(0.0),
        budget(0.25),
        budget(0.5),
        host_capped,
        forward_without_backward,
        dropped_one_by_one,
        backward_fails,
        regions("recompute"),
        regions("selective"),
        regions("auto"),
        changing_shapes,
        two_streams,
        two_streams_prefetch,
        produced_on_a_side_stream,
    )
}


def run_scenario(name: str, schedule: Schedule, spill_dir) -> Outcome:
    """``name`` under the detector with ``schedule``; what the detector saw is returned, not raised.
    A scenario that raises (a removed guard can break the engine outright) counts as not equal."""
    link = EmulatedCudaLink(schedule=schedule)
    equal = moved = False
    error = None
    try:
        with link.emulated.watching():
            equal, moved = SCENARIOS[name](link, spill_dir)
    except Exception as raised:  # noqa: BLE001 - reported, not raised: the detector's verdict is what counts
        error = f"{type(raised).__name__}: {raised}"
    finally:
        link.close()
    gc.collect()
    return Outcome(equal, list(link.races), link.sources_gone, moved, error)


def _params(schedules) -> list:
    return [(name, schedule) for name in SCENARIOS for schedule in schedules]


@pytest.mark.sweep
@pytest.mark.parametrize("name, schedule", _params(FAST_SCHEDULES))
def test_no_race_on_the_engine_as_it_is(name, schedule, spill_dir):
    with detecting(Schedule.named(schedule)) as link:
        equal, moved = SCENARIOS[name](link, spill_dir)
    assert moved, f"{name} moved tensors (the path under test)"
    assert equal, f"{name} under {schedule}: gradients differ from the model without the engine"


@pytest.mark.slow
@pytest.mark.parametrize("name, schedule", _params(SLOW_SCHEDULES))
def test_no_race_on_the_engine_as_it_is_more_seeds(name, schedule, spill_dir):
    test_no_race_on_the_engine_as_it_is(name, schedule, spill_dir)
