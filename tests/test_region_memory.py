"""What a recomputed or selective region holds itself, measured as the allocator sees it.

Oracle for memory: ``torch.utils.checkpoint`` over the same blocks, and the peak of CPU tensor
bytes allocated during one step (the profiler's memory events: allocations and frees in order,
not a clock, so a busy machine does not change it). A recomputed region keeps its re-run's values
only while its slot lives (Note: [a re-run's value goes with its slot]), so at
budget None the engine's step peaks where torch's checkpoint does; what the regions hold beside the
store is counted (``Stats.peak_region_bytes``, ``Stats.peak_held_bytes``) and ``explain`` shows it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.profiler import ProfilerActivity, profile

import offload
from zoo import ResBlock, assert_same, run_step

CHANNELS, BLOCKS = 8, 4


class Net(nn.Module):
    """A stem, residual blocks with BatchNorm, a head; ``torch_checkpoint`` wraps each block in torch's."""

    def __init__(self, torch_checkpoint_blocks: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, CHANNELS, 3, padding=1)
        self.blocks = nn.ModuleList(ResBlock(CHANNELS) for _ in range(BLOCKS))
        self.head = nn.Linear(CHANNELS, 10)
        self.torch_checkpoint_blocks = torch_checkpoint_blocks

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = torch_checkpoint.checkpoint(block, x, use_reentrant=False) if self.torch_checkpoint_blocks else block(x)
        return self.head(x.mean((2, 3)))


def _input():
    return torch.randn(8, 3, 32, 32)


def peak_allocated(step) -> int:
    """Peak CPU tensor bytes allocated during ``step()`` above its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def test_recompute_at_no_budget_peaks_where_torch_checkpoint_does(spill_dir):
    torch_checkpointed = Net(torch_checkpoint_blocks=True)
    model = Net()
    eng = offload.engine(None, min_offload_mb=0, model=model, regions=model.blocks, policy="recompute")
    assert_same(run_step(Net(), _input), run_step(model, _input, eng), "first step")
    theirs = peak_allocated(lambda: run_step(torch_checkpointed, _input))
    ours = peak_allocated(lambda: run_step(model, _input, eng))
    plain = peak_allocated(lambda: run_step(Net(), _input))
    assert theirs < plain, "the premise: checkpointing saves memory here"
    # The engine keeps, beside what torch keeps, the start of the buffers the blocks' forwards change
    # (See Note: [a re-run leaves module state as the forward left it]): BatchNorm's statistics.
    state_bytes = sum(b.untyped_storage().nbytes() for b in model.blocks.buffers())
    assert ours <= theirs + state_bytes, (
        f"engine {ours} bytes against torch.utils.checkpoint {theirs} + the blocks' buffers {state_bytes}"
    )
    eng.close()


def test_what_re_run_regions_hold_is_counted_and_shown(spill_dir):
    model = Net()
    budget_mb = 0.5
    eng = offload.engine(budget_mb, min_offload_mb=0, model=model, regions=model.blocks, policy="selective")
    for _ in range(4):
        run_step(model, _input, eng)
    eng.reset_stats()
    run_step(model, _input, eng)
    stats = eng.stats
    assert stats.peak_resident_bytes <= budget_mb * 2**20
    assert stats.peak_region_bytes > 0
    assert stats.peak_held_bytes > stats.peak_resident_bytes, "a region's own working set is beside the store"
    text = offload.explain(eng)
    assert "with what recomputed and selective regions held themselves" in text, text
    eng.close()


def test_what_is_held_counts_the_store_beside_the_region(spill_dir):
    """``peak_held_bytes`` is the store's resident bytes and a re-run region's own hold at one
    moment: above either peak alone (the store holds the earlier blocks' inputs while a block
    re-runs), never above both peaks added."""
    model = Net()
    eng = offload.engine(None, min_offload_mb=0, model=model, regions=model.blocks, policy="recompute")
    assert_same(run_step(Net(), _input), run_step(model, _input, eng), "first step")
    eng.reset_stats()
    run_step(model, _input, eng)
    stats = eng.stats
    assert stats.peak_region_bytes > 0 and stats.peak_resident_bytes > 0
    assert stats.peak_held_bytes > max(stats.peak_region_bytes, stats.peak_resident_bytes), stats
    assert stats.peak_held_bytes <= stats.peak_region_bytes + stats.peak_resident_bytes, stats
    eng.close()


def test_a_selective_regions_own_hold_is_what_it_drops_not_its_stash(spill_dir):
    """The stash is the store's (in ``resident_bytes``): a selective block's own hold, at the end of
    its forward and in its re-run, is what it drops and regenerates, counted once."""
    model = Net()
    eng = offload.engine(None, min_offload_mb=0, model=model, regions=model.blocks, policy="selective")
    while eng.profiling or eng.recent_stages[-1] is not None:
        run_step(model, _input, eng)
    assert all(d is offload.Decision.SELECTIVE for d in eng.plan.decisions), str(eng.plan)
    eng.reset_stats()
    run_step(model, _input, eng)
    stats = eng.stats
    per_block = stats.recomputed_bytes // BLOCKS  # the blocks are alike
    assert per_block > 0 and stats.peak_region_bytes == per_block, (stats.peak_region_bytes, per_block)
    eng.close()


def test_an_engine_without_re_runs_holds_nothing_beside_the_store(spill_dir):
    model = Net()
    eng = offload.engine(0.5, min_offload_mb=0, model=model, regions=model.blocks, policy="offload")
    for _ in range(3):
        run_step(model, _input, eng)
    stats = eng.stats
    assert stats.peak_region_bytes == 0 and stats.peak_held_bytes == stats.peak_resident_bytes
    assert "held themselves" not in offload.explain(eng)
    eng.close()


class _ReadsTwice(torch.autograd.Function):
    """Reads ``ctx.saved_tensors`` twice in backward (torch's checkpoint refuses that)."""

    @staticmethod
    def forward(ctx, x):
        y = x.tanh()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        (again,) = ctx.saved_tensors
        return grad * (1 - y * again)


class TwiceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.calls = [0]  # not a number attribute: module state puts those back (test_module_state.py)

    def forward(self, x):
        self.calls[0] += 1
        return _ReadsTwice.apply(self.fc(x)) * 2.0


def test_a_node_that_reads_its_saved_tensors_twice(spill_dir):
    torch.manual_seed(0)
    base = nn.Sequential(TwiceBlock(), TwiceBlock(), nn.Linear(16, 1))
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="already unpacked once"):  # the premise: torch refuses
        torch_checkpoint.checkpoint(base[0], x, use_reentrant=False).sum().backward()
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    for policy in ("recompute", "selective"):
        eng = offload.engine(None, min_offload_mb=0, model=model, regions=[model[0], model[1]], policy=policy)
        for step in range(4):
            make = lambda: torch.randn(4, 16)  # noqa: E731
            before = [m.calls[0] for m in model[:2]]
            assert_same(run_step(reference, make), run_step(model, make, eng), f"{policy}, step {step}")
            if not eng.profiling and eng.recent_stages[-1] is None:  # a step under a plan (or none to make)
                runs = [m.calls[0] - b for m, b in zip(model[:2], before, strict=True)]
                assert runs == [2, 2], f"{policy}, step {step}: {runs} forwards, not one re-run each"
        eng.close()
