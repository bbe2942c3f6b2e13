"""The engine around torch.compile'd blocks: gradients bitwise equal to the same compiled model.

A compiled block is one autograd Function to the engine: AOTAutograd's forward saves the
region's tensors with ``save_for_backward``, and its backward unpacks them all at once when it
starts. The engine's hooks see those real tensors at run time; while Dynamo and AOTAutograd
trace, torch (2.5+) defers saved-tensor hooks, and any fake or functional tensor that reaches
pack on an older torch is a subclass the engine passes through (checked directly below).

The reference is the same model, compiled with the same backend, without the engine: identical
graphs and kernels, so ``torch.equal``. "aot_eager" runs always; "inductor" needs a C++ compiler
and compiles for tens of seconds on a cold cache, so it is marked slow.

One test is white-box: the fallback of ``offload._memory.hooks.never_traced`` for a torch without
per-code frame strategies (before 2.6) cannot be reached on the torch installed here, so it sets
that module's optional name to None.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from zoo import MB, assert_same, run_step, saved_bytes, wait_clean

torch_dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

WIDTH, HEADS, SEQ, BATCH, DEPTH = 64, 4, 32, 4, 2
MIN_OFFLOAD_BYTES = 1024
"""Below the default 64 KiB so this tiny model's activations (4 x 32 x 64 fp32 = 32 KiB) move."""
STEPS = 2
LR = 0.05

_has_cxx = any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))
BACKENDS = [
    "aot_eager",
    pytest.param(
        "inductor",
        marks=[pytest.mark.slow, pytest.mark.skipif(not _has_cxx, reason="inductor on the CPU needs a C++ compiler")],
    ),
]


class Block(nn.Module):
    """Pre-norm attention + GELU MLP, with dropout so RNG replay is covered too."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, c // HEADS).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(a))
        return x + self.drop(self.down(F.gelu(self.up(self.norm2(x)))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_input() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, WIDTH)


def compiled(base: Net, backend) -> Net:
    """A copy of ``base`` whose blocks are compiled one by one (the head stays eager)."""
    model = copy.deepcopy(base)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=backend)
    return model


def train(model: Net, eng=None) -> list:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    results = []
    for _ in range(STEPS):
        results.append(run_step(model, make_input, eng))
        optimizer.step()
    return results


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()  # the first trace of each test happens under the engine
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_blocks_equal_no_engine(backend, fresh_dynamo, spill_dir):
    torch.manual_seed(0)
    base = Net()
    counter = CompileCounterWithBackend(backend)

    # Budget None first: Dynamo and AOTAutograd trace the blocks here, inside the engine.
    eng = offload.engine(None, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir)
    runs = {None: train(compiled(base, counter), eng)}
    assert counter.frame_count >= 1, "nothing was compiled; the test would prove nothing"
    stats = wait_clean(eng, spill_dir)
    eng.close()
    assert stats.saved_tensors > 0 and stats.offloaded_bytes == 0
    # Budget None counts its first step only; the later ones run with no hooks (See Note: [no hooks
    # where nothing moves] in offload/_memory/session.py). The steps here are alike (same shapes,
    # same graphs), and the budgets below count every one of theirs.
    assert stats.uncounted_steps == STEPS - 1
    saved_tensors = stats.saved_tensors * STEPS
    small_mb = 0.3 * stats.saved_bytes / MB  # a block's saves exceed it; a step's are ~3x it

    for budget in (0, small_mb):
        eng = offload.engine(budget, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir)
        runs[budget] = train(compiled(base, counter), eng)
        stats = wait_clean(eng, spill_dir)
        eng.close()
        # Not saved_bytes: a compiled forward hands back aliases of one storage (q, k, v of one
        # qkv buffer) as separate tensors with their own version counters, and the store moves a
        # storage again for a tensor on another counter once the first copy has left the device.
        assert stats.saved_tensors == saved_tensors
        if budget == 0:
            assert stats.offloaded_bytes == stats.saved_bytes and stats.peak_resident_bytes == 0
        else:
            assert 0 < stats.offloaded_bytes < stats.saved_bytes
            assert stats.peak_resident_bytes <= budget * MB

    reference = train(compiled(base, counter))
    for budget, results in runs.items():
        for step, (want, got) in enumerate(zip(reference, results, strict=True)):
            assert_same(want, got, f"{backend} budget {budget} step {step}")


def test_compiled_blocks_as_recompute_regions(fresh_dynamo, spill_dir):
    """policy="recompute" over compiled blocks: offload.checkpoint re-runs the compiled forward."""
    torch.manual_seed(0)
    base = Net()
    model = compiled(base, "aot_eager")
    eng = offload.engine(
        0,
        regions=model.blocks,
        policy="recompute",
        model=model,
        min_offload_bytes=MIN_OFFLOAD_BYTES,
        spill_dir=spill_dir,
    )
    results = train(model, eng)
    stats = wait_clean(eng, spill_dir)
    eng.close()
    assert stats.recomputed_regions == DEPTH * STEPS
    reference = train(compiled(base, "aot_eager"))
    for step, (want, got) in enumerate(zip(reference, results, strict=True)):
        assert_same(want, got, f"recompute step {step}")


def compiled_in_place(base: Net, backend) -> Net:
    """A copy of ``base`` whose blocks are compiled with ``block.compile()``: no wrapper module."""
    model = copy.deepcopy(base)
    for block in model.blocks:
        block.compile(backend=backend)
    return model


@pytest.mark.parametrize("compile_after_engine", [False, True], ids=["compiled-first", "compiled-after"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_blocks_compiled_in_place_as_regions(policy, compile_after_engine, fresh_dynamo, spill_dir):
    """``block.compile()`` then regions (or the other way round): the region wraps the compiled
    call, so its recompute re-runs the compiled forward (See Note: [a block compiled in place]).
    Wrapped on ``forward`` instead, Dynamo traced the region's own wrapper and the eager re-run
    saved other tensors than the compiled forward: OffloadError."""
    torch.manual_seed(0)
    base = Net()
    model = copy.deepcopy(base) if compile_after_engine else compiled_in_place(base, "aot_eager")
    eng = offload.engine(
        0, regions=model.blocks, policy=policy, model=model, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir
    )
    if compile_after_engine:
        for block in model.blocks:
            block.compile(backend="aot_eager")
    steps = 4 if policy == "auto" else STEPS  # auto: profiling steps first, then its plan
    lr = LR / 20  # at LR this model's loss reaches NaN by step 4, and NaN never equals NaN
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    results = []
    for _ in range(steps):
        results.append(run_step(model, make_input, eng))
        optimizer.step()
    stats = wait_clean(eng, spill_dir)
    eng.close()
    assert stats.recomputed_regions >= DEPTH
    reference_model = compiled_in_place(base, "aot_eager")
    optimizer = torch.optim.SGD(reference_model.parameters(), lr=lr)
    for step, got in enumerate(results):
        want = run_step(reference_model, make_input)
        optimizer.step()
        assert_same(want, got, f"{policy} step {step}")


def test_fake_tensors_pass_through():
    """Autograd on fake tensors (what tracing runs) under the engine: nothing taken, no error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    eng = offload.engine(0, min_offload_mb=0)
    with FakeTensorMode():
        x = torch.randn(64, 64, requires_grad=True)
        w = torch.randn(64, 64, requires_grad=True)
        with eng:
            loss = torch.tanh(torch.sigmoid(x @ w)).sum()
        loss.backward()
        assert type(w.grad).__name__ == "FakeTensor"
    stats = eng.stats
    eng.close()
    assert stats.saved_tensors == 0 and stats.passthrough_tensors >= 3
    assert stats.resident_bytes == 0 and stats.spill_bytes == 0


# ------------------------------------------------------------------ a whole model compiled, its blocks regions

WHOLE_SEQS = (SEQ, SEQ // 2, SEQ, SEQ // 2, SEQ, SEQ // 2)
"""Sequence lengths step by step: the shape changes every step, so Dynamo recompiles (dynamic) and
each shape is profiled and planned on its own."""
WHOLE_FORMS = ("compiled-wrapper", "compiled-original", "in-place")
"""``torch.compile(model)`` with the engine given the wrapper or the original as model=, and
``model.compile()``."""


def compiled_whole(base: Net, form: str) -> tuple[nn.Module, Net]:
    """A copy of ``base`` compiled whole in ``form``: (what the loop calls, what the engine is given)."""
    model = copy.deepcopy(base)
    if form == "in-place":
        model.compile(backend="aot_eager")
        return model, model
    wrapper = torch.compile(model, backend="aot_eager")
    return wrapper, wrapper if form == "compiled-wrapper" else model


def train_whole(model: nn.Module, eng=None) -> list:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR / 20)  # at LR the loss reaches NaN in a few steps
    results = []
    for seq in WHOLE_SEQS:
        results.append(run_step(model, lambda seq=seq: torch.randn(BATCH, seq, WIDTH), eng))
        optimizer.step()
    return results


WHOLE_CASES = [(form, "zero") for form in WHOLE_FORMS] + [("compiled-original", "mid")]
"""Every form at budget 0 (everything leaves or is re-run); one form at a budget that keeps some."""


@pytest.mark.parametrize(("form", "budget"), WHOLE_CASES)
@pytest.mark.parametrize("policy", ["auto", "offload", "selective", "recompute"])
def test_whole_model_compiled_with_regions_equal_no_engine(policy, form, budget, fresh_dynamo, spill_dir):
    """``torch.compile(model)`` (or ``model.compile()``) with regions=model.blocks trains bitwise as
    the same compiled model without the engine. Dynamo breaks the graph at each region (its wrapper
    is ``torch.compiler.disable``d: See Note: [a region is a graph break]) and, the break being in
    a loop, runs the model's forward eagerly; the saved-tensor hooks then start outside any graph
    (See Note: [Dynamo never traces the hooks]). "aot_eager" runs eager kernels, so the reference,
    compiled whole, is bitwise comparable."""
    torch.manual_seed(0)
    base = Net()
    reference = train_whole(compiled_whole(base, form)[0])
    torch._dynamo.reset()  # the engine's run compiles afresh
    budget_mb = 0 if budget == "zero" else 0.4 * saved_bytes(base, make_input) / MB
    model, given = compiled_whole(base, form)
    eng = offload.engine(
        budget_mb,
        regions=given.blocks,
        policy=policy,
        model=given,
        min_offload_bytes=MIN_OFFLOAD_BYTES,
        spill_dir=spill_dir,
    )
    results = train_whole(model, eng)
    stats = wait_clean(eng, spill_dir)
    assert len(eng.recent_stages) == len(WHOLE_SEQS), "the regions did not run under the engine"
    eng.close()
    if policy == "recompute":
        assert stats.recomputed_regions == DEPTH * len(WHOLE_SEQS)
    if budget == "zero":
        assert stats.peak_resident_bytes == 0
    for step, (want, got) in enumerate(zip(reference, results, strict=True)):
        assert_same(want, got, f"{policy} {form} budget {budget} step {step}")


def test_hooks_never_traced_on_a_torch_without_frame_strategies(monkeypatch):
    """Where torch has no per-code frame strategy (before 2.6), ``never_traced`` falls back to
    ``torch.compiler.disable``: Dynamo then skips the call (and what it calls) by the wrapper."""
    from offload._memory import hooks
    from offload._memory.hooks import never_traced

    monkeypatch.setattr(hooks, "_set_code_exec_strategy", None)

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    wrapped = never_traced(pack)
    assert wrapped is not pack and getattr(wrapped, "_torchdynamo_disable", False)
    t = torch.ones(2)
    assert wrapped(t) is t
