"""The recompute tier: ``offload.checkpoint`` against the region run plainly and against
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

Oracles: the same block (same weights, RNG reseeded before each forward so dropout masks match)
without checkpointing, and torch's own non-reentrant checkpoint. On the CPU in fp32 the math is
identical op for op, so outputs and gradients must be bitwise equal (``torch.equal``). The cost
bound is counted with ``FlopCounterMode``: a recomputed region costs at most one extra forward per
backward pass, never two. Where a test counts what a step leaves behind, or which phase a
region's re-run is in mid-backward, it reads the recompute frames themselves
(``offload._regions.recompute.Frame``), white-box: no public reading shows them.
"""

from __future__ import annotations

import copy
import gc
import time
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import offload
from offload._regions import recompute as _recompute

SEED = 1234
"""Seed set right before each forward, so every variant draws the same dropout masks."""

WIDTH = 128
ROWS = 256
"""Inputs are (ROWS, WIDTH) fp32 = 128 KiB: above the engine's default ``min_offload_bytes``."""

SETTLE_TIMEOUT_S = 5.0
"""How long spill writes still in flight may take to land before 'nothing left behind' fails."""


class DropBlock(nn.Module):
    """Linear -> GELU -> dropout -> Linear, plus a residual: a region with RNG inside."""

    def __init__(self, width: int = WIDTH, p: float = 0.25) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, scale: float = 1.0, *, bias=None, gate: bool = True) -> torch.Tensor:
        h = self.drop(F.gelu(self.fc1(x)))
        if gate:
            h = h * torch.sigmoid(h)
        out = self.fc2(h) * scale
        if bias is not None:
            out = out + bias
        return x + out


class Flaky(nn.Module):
    """Branches on a call counter held in a list, state the re-run is not given back (only buffers
    and plain-number attributes are: tests/test_module_state.py): its recompute saves other
    tensors than its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.calls = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[0] += 1
        y = self.fc(x)
        if self.calls[0] % 2 == 1:
            return y.tanh()  # saves its output
        return y * 2.0  # saves nothing


def make_block(seed: int = 0, **kw) -> DropBlock:
    torch.manual_seed(seed)
    return DropBlock(**kw)


def make_input(requires_grad: bool = True, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, WIDTH, generator=g).requires_grad_(requires_grad)


def plain(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def offload_ckpt(fn, *args, **kwargs):
    return offload.checkpoint(fn, *args, **kwargs)


def torch_ckpt(fn, *args, **kwargs):
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


VARIANTS = {"plain": plain, "offload": offload_ckpt, "torch": torch_ckpt}


def fresh(block: nn.Module, x: torch.Tensor, requires_grad: bool = True):
    """A copy of the block and a new leaf input, with the RNG reseeded: every variant starts alike."""
    block = copy.deepcopy(block)
    x = x.detach().clone().requires_grad_(requires_grad)
    torch.manual_seed(SEED)
    return block, x


def step(run, block: nn.Module, x: torch.Tensor, *args, **kwargs):
    """One forward (reseeded) and backward; returns the output, the input's grad and the params' grads."""
    block, x = fresh(block, x, x.requires_grad)
    out = run(block, x, *args, **kwargs)
    out.square().mean().backward()
    return out.detach(), x.grad, [p.grad for p in block.parameters()]


def bf16_step(run, block: nn.Module, x: torch.Tensor, *, in_forward: bool, in_backward: bool):
    """``step`` with CPU bf16 autocast on in the forward, in the backward, or both; the loss in
    fp32 whatever the output's dtype."""
    block, x = fresh(block, x)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=in_forward):
        out = run(block, x)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=in_backward):
        out.float().square().mean().backward()
    return out.detach(), x.grad, [p.grad for p in block.parameters()]


def assert_same(got, want, what: str) -> None:
    out_g, xg_g, pg_g = got
    out_w, xg_w, pg_w = want
    assert torch.equal(out_g, out_w), f"{what}: outputs differ"
    if xg_w is None:
        assert xg_g is None, f"{what}: input got a grad it should not have"
    else:
        assert torch.equal(xg_g, xg_w), f"{what}: input grads differ"
    for i, (a, b) in enumerate(zip(pg_g, pg_w, strict=True)):
        assert torch.equal(a, b), f"{what}: grad of parameter {i} differs"


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


def settle(eng) -> offload.Stats:
    """Stats once every spill write and release has landed (or the timeout passed)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        gc.collect()
        stats = eng.stats
        if (stats.resident_bytes == 0 and stats.spill_bytes == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


# ------------------------------------------------------------------------------- equality


def test_dropout_block_equals_plain_and_torch_checkpoint():
    block, x = make_block(), make_input()
    results = {name: step(run, block, x) for name, run in VARIANTS.items()}
    assert_same(results["offload"], results["plain"], "offload.checkpoint vs plain")
    assert_same(results["offload"], results["torch"], "offload.checkpoint vs torch checkpoint")
    # The masks really are random: another seed gives another output.
    torch.manual_seed(SEED + 1)
    assert not torch.equal(block(x).detach(), results["plain"][0])


def test_kwargs_and_non_tensor_args():
    block, x = make_block(), make_input()
    bias = torch.randn(WIDTH, requires_grad=True)
    results = {}
    for name, run in VARIANTS.items():
        b = bias.detach().clone().requires_grad_()
        out, xg, pg = step(run, block, x, 0.5, bias=b, gate=False)
        results[name] = (out, xg, pg + [b.grad])
    assert_same(results["offload"], results["plain"], "kwargs: offload vs plain")
    assert_same(results["offload"], results["torch"], "kwargs: offload vs torch")
    assert results["offload"][2][-1] is not None  # the keyword tensor got its gradient


def test_inputs_that_do_not_require_grad():
    block, x = make_block(), make_input(requires_grad=False)
    results = {name: step(run, block, x) for name, run in VARIANTS.items()}
    assert results["offload"][1] is None
    assert_same(results["offload"], results["plain"], "no-grad input: offload vs plain")
    assert_same(results["offload"], results["torch"], "no-grad input: offload vs torch")


def test_no_grad_anywhere_runs_plainly():
    block, x = make_block(), make_input(requires_grad=False)
    with torch.no_grad():
        torch.manual_seed(SEED)
        got = offload.checkpoint(block, x)
        torch.manual_seed(SEED)
        want = block(x)
    assert torch.equal(got, want)
    assert frames_alive() == 0


def test_bf16_autocast_state_is_restored_in_recompute():
    """Forward under CPU bf16 autocast, backward outside it: the recompute must run under the
    forward's autocast (else it saves fp32 tensors and raises), and match torch's checkpoint."""
    block, x = make_block(), make_input()
    results = {name: bf16_step(run, block, x, in_forward=True, in_backward=False) for name, run in VARIANTS.items()}
    assert_same(results["offload"], results["torch"], "bf16 autocast: offload vs torch")
    assert_same(results["offload"], results["plain"], "bf16 autocast: offload vs plain")


def test_recompute_under_a_different_autocast_than_forward():
    """Forward in fp32, backward inside a bf16 autocast region: the recompute uses the forward's (off)."""
    block, x = make_block(), make_input()
    results = {name: bf16_step(run, block, x, in_forward=False, in_backward=True) for name, run in VARIANTS.items()}
    assert_same(results["offload"], results["plain"], "autocast only in backward: offload vs plain")


def test_retain_graph_backward_twice():
    block, x = make_block(), make_input()
    results = {}
    for name, run in VARIANTS.items():
        b, xi = fresh(block, x)
        loss = run(b, xi).square().mean()
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in b.parameters()]
        loss.backward()
        results[name] = (loss.detach(), xi.grad, first + [p.grad for p in b.parameters()])
    assert_same(results["offload"], results["plain"], "retain_graph: offload vs plain")
    assert_same(results["offload"], results["torch"], "retain_graph: offload vs torch")
    assert frames_alive() == 0


def test_create_graph_double_backward_gradient_penalty():
    block, x = make_block(), make_input()
    results = {}
    for name, run in (("plain", plain), ("offload", offload_ckpt)):
        b, xi = fresh(block, x)
        out = run(b, xi)
        (grad_x,) = torch.autograd.grad(out.square().sum(), xi, create_graph=True)
        penalty = grad_x.square().sum() + out.mean()
        penalty.backward()
        results[name] = (grad_x.detach(), xi.grad, [p.grad for p in b.parameters()])
    assert all(g is not None for g in results["offload"][2]), "second-order grads reached every parameter"
    assert_same(results["offload"], results["plain"], "gradient penalty: offload vs plain")


def test_autograd_grad_on_a_subset_of_inputs():
    block, x = make_block(), make_input()
    bias = torch.randn(WIDTH)
    results = {}
    for name, run in VARIANTS.items():
        bi = bias.clone().requires_grad_()
        b, xi = fresh(block, x)
        out = run(b, xi, bias=bi)
        (gx,) = torch.autograd.grad(out.square().mean(), [xi])
        results[name] = (out.detach(), gx, [p.grad for p in b.parameters()] + [bi.grad])
    for name in ("offload", "torch"):
        assert all(g is None for g in results[name][2]), f"{name}: autograd.grad must not fill .grad"
    assert torch.equal(results["offload"][1], results["plain"][1])
    assert torch.equal(results["offload"][1], results["torch"][1])
    assert frames_alive() == 0


# ------------------------------------------------------------------------------- cost bound


def count_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def region_forward_flops(block: nn.Module, x: torch.Tensor) -> int:
    with torch.no_grad():
        return count_flops(lambda: block(x))


def test_flops_at_most_one_extra_forward_per_region():
    block, x = make_block(), make_input()
    forward_flops = region_forward_flops(block, x)
    assert forward_flops > 0

    def run(wrap):
        def go():
            torch.manual_seed(SEED)
            wrap(block, x).square().mean().backward()

        return count_flops(go)

    extra = run(offload_ckpt) - run(plain)
    assert 0 < extra <= forward_flops, f"recompute cost {extra} FLOPs; one forward is {forward_flops}"
    # Our recompute stops as soon as every saved tensor is back; torch's re-runs at least as much.
    assert extra <= run(torch_ckpt) - run(plain)


def test_flops_several_regions():
    torch.manual_seed(0)
    blocks = nn.ModuleList(DropBlock() for _ in range(4))
    x = make_input()
    forward_flops = sum(region_forward_flops(b, x) for b in blocks)

    def run(wrap):
        def go():
            torch.manual_seed(SEED)
            h = x
            for b in blocks:
                h = wrap(b, h)
            h.square().mean().backward()

        return count_flops(go)

    extra = run(offload_ckpt) - run(plain)
    assert 0 < extra <= forward_flops, f"4 regions recomputed for {extra} FLOPs; their forwards are {forward_flops}"
    # Every region was recomputed once: the blocks have equal shapes, so 4x one block's extra.
    block = blocks[0]

    def one(wrap):
        def go():
            torch.manual_seed(SEED)
            wrap(block, x).square().mean().backward()

        return count_flops(go)

    assert extra == 4 * (one(offload_ckpt) - one(plain))


def test_flops_retain_graph_one_extra_forward_per_pass():
    block, x = make_block(), make_input()
    forward_flops = region_forward_flops(block, x)

    def run(wrap, passes):
        def go():
            torch.manual_seed(SEED)
            loss = wrap(block, x).square().mean()
            for i in range(passes):
                loss.backward(retain_graph=i < passes - 1)

        return count_flops(go)

    one = run(offload_ckpt, 1) - run(plain, 1)
    three = run(offload_ckpt, 3) - run(plain, 3)
    assert 0 < one <= forward_flops
    assert three == 3 * one, f"3 passes cost {three} extra FLOPs; one pass costs {one}"


# ------------------------------------------------------------------------------- errors


def test_region_saving_other_tensors_on_recompute_raises_naming_it():
    torch.manual_seed(0)
    flaky = Flaky()
    x = make_input()
    out = offload.checkpoint(flaky, x, name="blocks.flaky")
    with pytest.raises(offload.OffloadError, match="blocks.flaky"):
        out.sum().backward()
    del out
    assert frames_alive() == 0


def test_default_region_name_is_the_function_name():
    torch.manual_seed(0)
    flaky = Flaky()
    x = make_input()
    out = offload.checkpoint(flaky.forward, x)
    with pytest.raises(offload.OffloadError, match="Flaky.forward"):
        out.sum().backward()


def test_non_callable_is_a_type_error():
    with pytest.raises(TypeError, match="callable"):
        offload.checkpoint(make_input(), 1)


# ------------------------------------------------------------------------------- with an engine


def test_inside_engine_budget_0_inputs_are_offloaded(spill_dir):
    block, x = make_block(), make_input()
    want = step(plain, block, x)

    b = copy.deepcopy(block)
    xi = x.detach().clone().requires_grad_()
    eng = offload.engine(0, spill_dir=spill_dir, model=b)
    torch.manual_seed(SEED)
    with eng:
        h = xi * 1.0  # a non-leaf input: leaves that require grad are never moved
        out = offload.checkpoint(b, h, name="block")
    during = eng.stats
    out.square().mean().backward()
    got = (out.detach(), xi.grad, [p.grad for p in b.parameters()])
    assert_same(got, want, "checkpoint inside engine(0) vs plain")

    input_nbytes = ROWS * WIDTH * 4
    assert during.saved_tensors == 1, "the engine sees only the region's input, nothing inside it"
    assert during.saved_bytes == input_nbytes
    assert during.offloaded_bytes == input_nbytes
    assert during.resident_bytes == 0
    after = eng.stats
    assert after.reloaded_bytes == input_nbytes
    del out, h
    stats = settle(eng)
    assert stats.resident_bytes == 0 and stats.spill_bytes == 0
    assert frames_alive() == 0
    eng.close()


def test_inside_engine_several_regions_equal_plain(spill_dir):
    torch.manual_seed(0)
    blocks = nn.ModuleList(DropBlock() for _ in range(3))
    x = make_input()

    def run(use_engine):
        bs = copy.deepcopy(blocks)
        xi = x.detach().clone().requires_grad_()
        eng = offload.engine(0, spill_dir=spill_dir, model=bs) if use_engine else None
        torch.manual_seed(SEED)
        h = xi * 1.0
        if eng is not None:
            with eng:
                for i, b in enumerate(bs):
                    h = offload.checkpoint(b, h, name=f"blocks.{i}")
        else:
            for b in bs:
                h = b(h)
        h.square().mean().backward()
        return (h.detach(), xi.grad, [p.grad for p in bs.parameters()]), eng

    want, _ = run(False)
    got, eng = run(True)
    assert_same(got, want, "3 checkpointed regions in engine(0) vs plain")
    stats = settle(eng)
    assert stats.offloaded_bytes == 3 * ROWS * WIDTH * 4
    assert stats.resident_bytes == 0 and stats.spill_bytes == 0
    eng.close()


def test_forward_without_backward_releases_everything(spill_dir):
    block, x = make_block(), make_input()
    eng = offload.engine(0, spill_dir=spill_dir, model=block)
    with eng:
        h = x * 1.0
        out = offload.checkpoint(block, h)
    assert eng.stats.offloaded_bytes > 0
    assert frames_alive() == 1
    del out, h
    stats = settle(eng)
    assert stats.resident_bytes == 0, "the region's input handle was not released"
    assert stats.spill_bytes == 0
    assert frames_alive() == 0
    eng.close()


def test_backward_releases_frames_and_values():
    block, x = make_block(), make_input()
    out = offload.checkpoint(block, x)
    out.sum().backward()
    del out
    assert frames_alive() == 0


def test_frame_phases_through_forward_and_backward():
    """FORWARD while fn runs (its saves held), WAITING once it returned (nothing held but the
    inputs), RECOMPUTED from the first unpack of a pass until every live slot was served, then
    WAITING again with the re-run's values dropped."""
    seen: dict = {}

    def region(x):
        gc.collect()
        (frame,) = [o for o in gc.get_objects() if type(o) is _recompute.Frame and id(o) not in _FRAMES_BEFORE]
        seen["frame"] = weakref.ref(frame)
        seen["forward"] = (frame.phase, frame.forward_values is not None)
        h = x.sin()  # saved by sin (x) and by exp (its result)
        h.register_hook(note_middle)
        return h.exp()

    def note_middle(grad: torch.Tensor) -> None:
        seen["middle"] = (frame_now().phase, len(frame_now().recomputed))

    def frame_now() -> _recompute.Frame:
        frame = seen["frame"]()
        assert frame is not None
        return frame

    x = torch.randn(4, 4, requires_grad=True)
    out = offload.checkpoint(region, x)
    assert seen["forward"] == (_recompute.FramePhase.FORWARD, True)
    assert frame_now().phase is _recompute.FramePhase.WAITING
    assert frame_now().forward_values is None and frame_now().forward_saves.values == []
    assert frame_now().recomputed == []
    out.sum().backward(retain_graph=True)
    assert seen["middle"] == (_recompute.FramePhase.RECOMPUTED, 2), "exp's save served, sin's still to come"
    assert frame_now().phase is _recompute.FramePhase.WAITING and frame_now().recomputed == []
    del out
    assert frames_alive() == 0


@pytest.mark.parametrize("budget", [None, 0, "outside"])
def test_inplace_change_of_an_input_after_forward_is_caught(budget, spill_dir):
    """Plain autograd and torch's checkpoint raise; recomputing from the changed input would
    silently give wrong gradients. The engine raises PyTorch's error too, at every budget, whether
    the input is kept or its copy has landed (its version watch: See Note: [version watch])."""
    block, x = make_block(), make_input()
    b = copy.deepcopy(block)
    xi = x.detach().clone().requires_grad_()
    torch.manual_seed(SEED)
    h = xi * 1.0
    if budget == "outside":
        out = offload.checkpoint(b, h)
    else:
        with offload.engine(budget, spill_dir=spill_dir, model=b):
            out = offload.checkpoint(b, h)
    with torch.no_grad():
        h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.square().mean().backward()


def test_leaf_inputs_that_require_grad_are_not_moved(spill_dir):
    """The caller holds a leaf anyway: copying it off the device would free nothing."""
    block, x = make_block(), make_input()
    want = step(plain, block, x)
    b = copy.deepcopy(block)
    xi = x.detach().clone().requires_grad_()
    eng = offload.engine(0, spill_dir=spill_dir, model=b)
    torch.manual_seed(SEED)
    with eng:
        out = offload.checkpoint(b, xi)
    stats = eng.stats
    assert stats.saved_tensors == 0 and stats.offloaded_bytes == 0
    assert stats.passthrough_tensors == 1
    out.square().mean().backward()
    assert_same((out.detach(), xi.grad, [p.grad for p in b.parameters()]), want, "leaf input in engine(0)")
    eng.close()
