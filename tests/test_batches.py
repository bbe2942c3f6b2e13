"""Copies out in batches (See Note: [moves in batches] in ``offload._memory.store``).

Under a fixed budget without a region plan, eviction waits until what is hot passes the point where
it starts by half the in-flight window, then moves everything over that point as one batch: one
block per tensor side by side in one range of a pinned slab, and one copy call (``d2h_all``: on
CUDA one fence, one submission, one event). Driven on the CPU through ``CudaLink`` itself over
emulated streams (``tests/hb.py``'s detector: no race, no source let go early), gradients and
losses compared with ``torch.equal`` against the model without the engine, many steps, the batch
size changing every step. One test drives the arena directly, white-box, to see a batch's blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import offload
import offload._memory.arena
from hb import Schedule, detecting
from zoo import MB

WIDTH, DEPTH = 64, 8


def _mlp(depth: int = DEPTH) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 1))


def _step(model: nn.Module, x: torch.Tensor, eng=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with eng if eng is not None else torch.enable_grad():
        loss = model(x).square().sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _saved_bytes(model: nn.Module, rows: int) -> int:
    """What one step saves (each Linear's input and each Tanh's output, fp32), as the engine counts it."""
    return (2 * DEPTH + 1) * rows * WIDTH * 4


@pytest.mark.parametrize("schedule", ["timed0", "adversarial3-0"])
def test_copies_out_go_in_batches_and_gradients_stay_exact(schedule, spill_dir):
    """At half a step's budget the copies out go several tensors a submission; every step's loss and
    gradients equal the model's without the engine, the budget held, the detector silent."""
    model = _mlp()
    rows = [48, 64, 40, 64, 56, 32]
    budget_mb = _saved_bytes(model, max(rows)) / 2 / MB
    with detecting(Schedule.named(schedule)) as link:
        eng = offload.engine(
            budget_mb, device="cpu", min_offload_mb=0, seams=offload.Seams(link=link), spill_dir=spill_dir
        )
        for step, n in enumerate(rows):
            torch.manual_seed(step)
            x = torch.randn(n, WIDTH)
            want_loss, want = _step(model, x)
            got_loss, got = _step(model, x, eng)
            assert torch.equal(got_loss, want_loss), f"step {step}: loss differs"
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), f"step {step}: gradients differ"
        stats = eng.stats
        eng.close()
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0, "the premise: tensors moved"
    assert link.d2h_batches > 0, "no copy out went as a batch"
    assert link.d2h_count > link.d2h_batches, "each batch held one tensor: nothing was batched"
    assert stats.peak_over_budget_bytes == 0, f"{stats.peak_over_budget_bytes} bytes over the budget"


def test_a_batch_the_host_cannot_hold_moves_one_by_one(spill_dir):
    """The host tier is capped at three and a half tensors: once a batch of three is in host
    memory, the next batch cannot have a block for each of its tensors, so it takes none and its
    tensors move one by one instead, making room below as a single eviction does (host copies
    spill to disk). Gradients exact, the budget held."""
    model = _mlp(depth=16)  # 33 saves of 16 KiB a step
    rows = 64
    act = rows * WIDTH * 4
    budget_mb = 16 * act / MB  # eviction starts at 12 saves' worth; a batch forms past 14: three go
    with detecting() as link:
        eng = offload.engine(
            budget_mb,
            device="cpu",
            min_offload_mb=0,
            seams=offload.Seams(link=link),
            spill_dir=spill_dir,
            host_budget_mb=3.5 * act / MB,
        )
        for step in range(3):
            torch.manual_seed(step)
            x = torch.randn(rows, WIDTH)
            want_loss, want = _step(model, x)
            got_loss, got = _step(model, x, eng)
            assert torch.equal(got_loss, want_loss) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        stats = eng.stats
        eng.close()
    assert link.d2h_batches > 0, "the premise: a batch went out while the host had room"
    assert link.d2h_singles > 0, "no batch fell back to one by one although the host could not hold it"
    assert stats.spilled_bytes > 0, "room was made below (host copies spilled)"
    assert stats.peak_over_budget_bytes == 0, f"{stats.peak_over_budget_bytes} bytes kept over the budget"


def test_a_region_plan_moves_each_tensor_alone():
    """A budget with a region plan in force evicts at the budget itself: no window, so no batch
    (``Budget.batch_bytes`` is 0), and a budget without one batches half its window."""
    from offload._budget import make_budget  # white-box: the budget's own figures

    budget = make_budget(100 * MB, None, None)
    assert budget.batch_bytes == (budget.bytes - budget.evict_at) // 2 > 0
    budget.set_planned(True)
    assert budget.evict_at == budget.bytes and budget.batch_bytes == 0
    budget.set_planned(False)
    assert budget.batch_bytes > 0


def test_a_batch_takes_a_block_each_or_none():
    """White-box, the arena: ``acquire_all`` takes a block per size as ``acquire`` would (aligned,
    first fit: a batch fits the free ranges of a slab already pinned, no slab of its own), each
    released alone; under a cap that cannot hold the whole batch it returns None and keeps
    nothing, and a single block can still be had after."""
    arena = offload._memory.arena.HostArena(None, pin=False)
    blocks = arena.acquire_all([10, 5000, 4096])
    assert blocks is not None
    assert [b.size for b in blocks] == [4096, 8192, 4096]
    assert len({id(b.slab) for b in blocks}) == 1 and arena.held_bytes == offload._memory.arena.SLAB_BYTES
    assert arena.in_use_bytes == 16384
    for b in (blocks[1], blocks[0], blocks[2]):
        arena.release(b)
    assert arena.in_use_bytes == 0

    capped = offload._memory.arena.HostArena(3 * 4096, pin=False)  # room for three 4 KiB slabs
    assert capped.acquire_all([4096] * 4) is None, "four blocks do not fit a cap of three"
    assert capped.in_use_bytes == 0, "a batch that failed keeps nothing"
    assert capped.acquire_all([4096] * 3) is not None, "three do, the failed batch's blocks given back"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batches_on_cuda_keep_gradients_exact():
    """On a GPU, through ``torch._foreach_copy_`` on the d2h side stream into pinned blocks: at half
    a step's budget (batches of several tensors), losses and gradients bitwise as without the engine
    over steps whose batch size changes, and the budget held."""
    device = torch.device("cuda")
    model = _mlp(depth=16).to(device)
    rows = [256, 192, 256, 128]
    budget_mb = (2 * 16 + 1) * max(rows) * WIDTH * 4 / 2 / MB
    eng = offload.engine(budget_mb, device="cuda", min_offload_mb=0)
    for step, n in enumerate(rows):
        torch.manual_seed(step)
        x = torch.randn(n, WIDTH, device=device)
        want_loss, want = _step(model, x)
        got_loss, got = _step(model, x, eng)
        assert torch.equal(got_loss, want_loss) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    stats = eng.stats
    eng.close()
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0
    assert stats.peak_over_budget_bytes == 0


@pytest.mark.parametrize("delay", [0, 1, 6], ids=["landed-before-backward", "landing-in-backward", "landing-late"])
@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_backward_misses_only_its_first_reload(fraction, delay, spill_dir):
    """A chain of tanh whose saves move at a fraction of the step's bytes, into a host tier whose
    copies land when polled: backward's first unpack of a moved tensor is a miss, and the prefetch
    has every later one on its way before its turn (See Note: [the prefetch walk] in
    ``offload._memory.store``: the walk goes on from where it stopped, never past an entry it has
    not loaded, such as one save four times the others' size that did not fit when first reached).
    Gradients exact."""
    from links import DeferredLink

    n, depth = 64 * 64, 24
    budget_mb = fraction * depth * n * 4 / MB
    x0 = torch.randn(64, 64)

    def run(eng=None) -> torch.Tensor:
        x = x0.clone().requires_grad_(True)
        with eng if eng is not None else torch.enable_grad():
            h = x
            for i in range(depth):
                if i == depth // 3:  # one save four times the others: a walk reaching it may find no room
                    h = torch.tanh(h.repeat(2, 2) * 1.01)[:64, :64]
                else:
                    h = torch.tanh(h * 1.01)  # saves its output (64 KiB)
        h.sum().backward()
        return x.grad

    want = run()
    eng = offload.engine(
        budget_mb,
        device="cpu",
        min_offload_mb=0,
        seams=offload.Seams(link=DeferredLink(delay=delay)),
        spill_dir=spill_dir,
    )
    got = run(eng)
    stats = eng.stats
    eng.close()
    assert torch.equal(got, want)
    moved = stats.reloaded_bytes // (n * 4)
    assert moved >= depth // 3, f"the premise: many saves moved ({moved})"
    assert stats.prefetch_misses <= 1, f"{stats.prefetch_misses} misses of {moved} reloads"


def test_the_copy_call_pairs_each_destination_with_its_source():
    """``CudaStreams.copy_all`` itself (``torch._foreach_copy_``, on CPU tensors): each destination
    gets its own source's bytes, whatever their sizes (the emulated streams of the other tests
    reimplement it, so only this holds the real one's argument order)."""
    from offload.seams import CudaStreams

    srcs = [torch.arange(n, dtype=torch.uint8) + k for k, n in enumerate((3, 7, 1))]
    dsts = [torch.zeros(n, dtype=torch.uint8) for n in (3, 7, 1)]
    CudaStreams(torch.device("cpu")).copy_all(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def test_on_the_cpu_a_large_save_evicts_several_each_its_own_write(spill_dir):
    """A CPU device spills straight to disk, one write a tensor: there is no batch room, but a save
    four times the others' size puts several older ones over the point where eviction starts at
    once, and each goes as its own write (the disk tier has no batch call). Gradients exact."""
    small = 64 * 64
    x0 = torch.randn(64, 64)

    def run(eng=None) -> torch.Tensor:
        x = x0.clone().requires_grad_(True)
        with eng if eng is not None else torch.enable_grad():
            h = x
            for _ in range(4):
                h = torch.tanh(h * 1.01)  # 16 KiB saves
            big = torch.tanh(h.repeat(4, 4) * 1.01)  # one 256 KiB save: the older ones go together
            h = big[:64, :64] * 2
            for _ in range(2):
                h = torch.tanh(h * 1.01)
        h.sum().backward()
        return x.grad

    want = run()
    eng = offload.engine(8 * small * 4 / MB, device="cpu", min_offload_mb=0, spill_dir=spill_dir)
    got = run(eng)
    stats = eng.stats
    eng.close()
    assert torch.equal(got, want)
    assert stats.spilled_bytes >= 3 * small * 4, "several older saves went to disk"
