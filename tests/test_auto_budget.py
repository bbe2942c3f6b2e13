"""``budget_mb="auto"``: a budget that follows free memory, keeping ``reserve_mb`` free.

Oracle: the same model without the engine; the engine only changes where saved tensors live, so
gradients are bitwise equal (``torch.equal``) whatever the budget did. Pressure is simulated
through the seam ``engine(memory=FreeMemory(read=...))``: the test sets what "free" reads from
forward hooks, mid-step. One real-machine test each way uses the device's own reading.
``test_budget_internals.py`` tests the rules behind it (the default reading, when to re-plan) and
the store meeting a falling budget in backward, white-box.
"""

from __future__ import annotations

import math

import pytest
import torch

import offload
from links import DeferredLink, LandsOnCue
from offload.seams import FreeMemory
from zoo import MB

LAYERS = 12
WIDTH = 256
ROWS = 1024
"""Each layer saves one 1 MiB fp32 tensor (its tanh output, which is also the next Linear's input)."""
DEFAULT_RESERVE_MB = 2048
"""``reserve_mb``'s default with ``budget_mb="auto"``, as the README's settings table gives it."""
PLENTY = 1 << 40
"""A free-memory reading far above any reserve in these tests."""


def chain() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(LAYERS)]
    )


def x_input() -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))


def grads(model: torch.nn.Module, eng=None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if eng is None:
        loss = model(x_input()).square().sum()
    else:
        with eng:
            loss = model(x_input()).square().sum()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"gradient of parameter {i} differs"


class Pressure:
    """What free memory reads, set by the test, and how often it was read."""

    def __init__(self, free_bytes: int = PLENTY) -> None:
        self.free_bytes = free_bytes
        self.readings = 0

    def __call__(self) -> int:
        self.readings += 1
        return self.free_bytes


class Device:
    """A simulated device of ``capacity_bytes``: free is what neither the engine's saves nor the
    rest of the step (``other_bytes``, set by the test) hold, so an eviction frees as it would."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.other_bytes = 0
        self.engine = None

    def __call__(self) -> int:
        # Engine.stats takes no lock on the CPU (no link): safe to read from inside the engine.
        return max(0, self.capacity_bytes - self.other_bytes - self.engine.stats.resident_bytes)


# ------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", ["Auto", "512", "", "automatic"])
def test_a_string_budget_other_than_auto_is_refused(bad):
    with pytest.raises(ValueError, match="budget_mb") as info:
        offload.engine(budget_mb=bad)
    assert repr(bad) in str(info.value) and "'auto'" in str(info.value), "names the value and the valid string"


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, -math.inf])
def test_a_negative_or_nan_reserve_is_refused(bad):
    with pytest.raises(ValueError, match="reserve_mb") as info:
        offload.engine("auto", reserve_mb=bad)
    assert repr(bad) in str(info.value) and ">= 0" in str(info.value)


@pytest.mark.parametrize("bad", ["512", True, [1], 1j])
def test_a_reserve_of_the_wrong_type_is_refused(bad):
    with pytest.raises(TypeError, match="reserve_mb"):
        offload.engine("auto", reserve_mb=bad)


@pytest.mark.parametrize("budget", [0, 512, 0.5, None])
def test_a_reserve_without_auto_is_refused(budget):
    with pytest.raises(ValueError, match="reserve_mb") as info:
        offload.engine(budget, reserve_mb=100)
    assert "budget_mb='auto'" in str(info.value), "says the fix"


def test_auto_with_policy_none_is_refused():
    with pytest.raises(ValueError, match="policy='none'"):
        offload.engine("auto", policy="none")


def test_memory_without_auto_is_refused():
    with pytest.raises(ValueError, match="memory="):
        offload.engine(512, memory=lambda: 0)
    with pytest.raises(TypeError, match="memory="):
        offload.engine("auto", memory=1024)


@pytest.mark.parametrize("bad", [-1, 1.5, None, True])
def test_a_bad_reading_is_refused(bad, spill_dir):
    eng = offload.engine("auto", reserve_mb=1, memory=lambda: bad, spill_dir=spill_dir)
    with pytest.raises(TypeError, match="free-memory reading returned"):
        grads(chain(), eng)
    eng.close()


def test_the_config_holds_the_reserve():
    assert offload.engine("auto").config.reserve_bytes == DEFAULT_RESERVE_MB * MB, "the README's default"
    eng = offload.engine("auto", reserve_mb=0.5)
    assert eng.config.reserve_bytes == MB // 2 and eng.config.budget_bytes is None
    assert eng.config.follows_free_memory and not offload.engine(512).config.follows_free_memory
    assert offload.engine("auto", reserve_mb=math.inf).config.reserve_bytes > 1 << 70, "more than any machine"
    assert "auto, reserve 0.5 MB" in repr(eng)


# ------------------------------------------------------------------------------- pressure mid-step


def test_pressure_rising_and_falling_mid_step_moves_just_enough(spill_dir):
    """Free memory plentiful for layers 0-3 (nothing moves), below the reserve for layers 4-7
    (the oldest saves move), plentiful again for 8-11 (nothing more moves); gradients exact."""
    reserve_mb = 4
    device = Device(capacity_bytes=64 * MB)
    model = chain()
    want = grads(model)
    eng = device.engine = offload.engine(
        "auto", reserve_mb=reserve_mb, memory=FreeMemory(read=device, reread_bytes=0), spill_dir=spill_dir
    )
    seen: dict[int, offload.Stats] = {}

    def before(i):
        def hook(module, args):
            if i == 4:  # the rest of the step takes all but 2 MiB below the reserve
                free = (reserve_mb - 2) * MB
                device.other_bytes = device.capacity_bytes - eng.stats.resident_bytes - free
            elif i == 8:
                device.other_bytes = 0

        return hook

    def after(i):
        def hook(module, args, out):
            seen[i] = eng.stats

        return hook

    hooks = []
    for i, layer in enumerate(model):
        hooks += [layer.register_forward_pre_hook(before(i)), layer.register_forward_hook(after(i))]
    got = grads(model, eng)
    for hook in hooks:
        hook.remove()
    assert_same(got, want)
    assert all(seen[i].offloaded_bytes == 0 for i in range(4)), "plenty free: nothing moves"
    assert seen[3].budget_bytes == (64 - reserve_mb) * MB
    moved = seen[7].offloaded_bytes
    assert 2 * MB <= moved < seen[7].saved_bytes, "under pressure the oldest saves move, not all"
    assert seen[7].budget_bytes == seen[3].resident_bytes - 2 * MB, "the budget gives the reserve back"
    assert seen[7].resident_bytes <= seen[7].budget_bytes
    assert seen[LAYERS - 1].offloaded_bytes == moved, "pressure gone: nothing more moves"
    stats = eng.stats
    assert stats.reloaded_bytes == moved and stats.offloaded_bytes == moved
    # A second step under plenty: nothing moves at all, still exact.
    eng.reset_stats()
    assert_same(grads(model, eng), grads(model))
    assert eng.stats.offloaded_bytes == 0
    eng.close()


def test_free_memory_is_read_by_bytes_packed_not_per_tensor(spill_dir):
    """Rule: read at the store's first save, at each engine entry, then after every
    ``reread_bytes`` of new saves; never per tensor (here the time rule is off)."""
    pressure = Pressure()
    eng = offload.engine(
        "auto",
        reserve_mb=0,
        memory=FreeMemory(read=pressure, reread_bytes=4 * MB, reread_ms=math.inf),
        spill_dir=spill_dir,
    )
    model = chain()
    grads(model, eng)
    saved_mb = eng.stats.saved_bytes // MB
    assert saved_mb == LAYERS + 1 and eng.stats.saved_tensors == 2 * LAYERS + 1
    assert pressure.readings == 1 + saved_mb // 4, "first save, then every 4 MiB"
    before = pressure.readings
    grads(model, eng)
    assert pressure.readings - before == 1 + saved_mb // 4, "engine entry, then every 4 MiB"
    eng.close()


def test_free_memory_is_read_again_after_reread_ms(spill_dir):
    pressure = Pressure()
    eng = offload.engine(
        "auto",
        reserve_mb=0,
        memory=FreeMemory(read=pressure, reread_bytes=1 << 60, reread_ms=0.0),
        spill_dir=spill_dir,
    )
    grads(chain(), eng)
    new_storages = eng.stats.saved_bytes // MB
    assert eng.stats.saved_tensors > new_storages and eng.stats.offloaded_bytes == 0
    assert pressure.readings == 1 + new_storages, "each save of a new storage; unpacking a hot tensor never reads"
    eng.close()


# ------------------------------------------------------------------------------- the real machine


def test_real_machine_reserve_zero_moves_nothing(spill_dir):
    model = chain()
    want = grads(model)
    eng = offload.engine("auto", reserve_mb=0, spill_dir=spill_dir)
    assert_same(grads(model, eng), want)
    stats = eng.stats
    assert stats.saved_bytes > 0 and stats.offloaded_bytes == 0 and stats.spill_files == 0
    assert stats.budget_bytes > stats.saved_bytes, "this machine has more free than the chain saves"
    eng.close()


def test_real_machine_reserve_beyond_the_machine_moves_everything_eligible(spill_dir):
    model = chain()
    want = grads(model)
    eng = offload.engine("auto", reserve_mb=10**9, spill_dir=spill_dir)
    assert_same(grads(model, eng), want)
    stats = eng.stats
    assert stats.budget_bytes == 0
    assert stats.saved_bytes > 0 and stats.offloaded_bytes == stats.saved_bytes == stats.reloaded_bytes
    eng.close()


def test_stats_report_the_fixed_budget_too():
    assert offload.engine(2).stats.budget_bytes == 2 * MB
    assert offload.engine(None).stats.budget_bytes is None


def test_prometheus_exports_the_budget_in_force(spill_dir):
    prometheus_client = pytest.importorskip("prometheus_client")
    import offload.integrations.prometheus

    registry = prometheus_client.CollectorRegistry()
    eng = offload.engine("auto", reserve_mb=3, memory=lambda: 10 * MB, spill_dir=spill_dir)
    exporter = offload.integrations.prometheus.PrometheusExporter(eng, registry=registry)
    grads(chain(), eng)
    stats = exporter.update()
    assert registry.get_sample_value("offload_budget_bytes") == stats.budget_bytes > 0
    eng.close()


# ------------------------------------------------------------------------------- regions re-plan


def test_regions_plan_at_the_budget_in_force_and_replan_when_it_drops(spill_dir):
    """policy "offload" with regions: planned keep-all with plenty free; free memory falling to
    the reserve re-plans (regions offloaded, bytes move) without a profiling step; back up,
    keep-all again. Gradients exact at every step."""
    from test_regions import MACHINE, assert_same_history, make_model, train

    reserve_mb = 1
    pressure = Pressure()
    model = make_model()
    eng = offload.engine(
        "auto",
        reserve_mb=reserve_mb,
        memory=FreeMemory(read=pressure, reread_bytes=0),
        spill_dir=spill_dir,
        regions=model.blocks,
        model=model,
        machine=MACHINE,
        policy="offload",
    )
    reference = train(make_model(), steps=6)
    got = train(model, eng, steps=2)
    assert not eng.profiling
    plenty_plan = eng.plan
    assert plenty_plan.budget_bytes > 1 << 39 and set(plenty_plan.decisions) == {offload.Decision.KEEP}
    assert eng.stats.offloaded_bytes == 0
    pressure.free_bytes = 0  # the rest of the device took everything: budget in force < resident
    stages_before = len(eng.recent_stages)
    got += train(model, eng, steps=2, first_step=2)
    assert list(eng.recent_stages)[stages_before:] == [None, None], "re-planned, not profiled again"
    tight_plan = eng.plan
    assert tight_plan.budget_bytes < 0.8 * plenty_plan.budget_bytes
    assert offload.Decision.OFFLOAD in tight_plan.decisions
    assert eng.stats.offloaded_bytes > 0
    pressure.free_bytes = PLENTY
    got += train(model, eng, steps=2, first_step=4)
    assert set(eng.plan.decisions) == {offload.Decision.KEEP}, "room again: keep everything"
    assert eng.stats.offloaded_bytes == 0
    assert_same_history(got, reference, "auto budget with regions")
    eng.close()


# ------------------------------------------------------------------------------- containers


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("reserve_mb, moves", [(0, False), (10**9, True)])
def test_cuda_real_machine_each_way(reserve_mb, moves):
    model = chain().cuda()
    x = x_input().cuda()

    def step(eng=None):
        model.zero_grad(set_to_none=True)
        with eng if eng is not None else torch.enable_grad():
            loss = model(x).square().sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    want = step()
    eng = offload.engine("auto", reserve_mb=reserve_mb)
    assert_same(step(eng), want)
    stats = eng.stats
    assert stats.saved_bytes > 0
    assert stats.offloaded_bytes == (stats.saved_bytes if moves else 0)
    eng.close()


def test_peak_over_budget_counts_against_the_budget_in_force(spill_dir):
    """``Stats.peak_over_budget_bytes`` compares each instant with the budget in force then, so it
    says whether a budget that moves within a step (free memory falling as the step goes) was
    held at every instant: it must read 0 (and reads the excess with the store's eviction
    removed: shown once, by hand)."""
    free = {"bytes": 2 * MB}
    eng = offload.engine(
        "auto",
        reserve_mb=1,
        memory=FreeMemory(read=lambda: free["bytes"], reread_bytes=0),
        min_offload_mb=0,
        spill_dir=spill_dir,
    )
    x = torch.randn(256, 256, requires_grad=True)
    budgets = []
    for step in range(4):
        eng.reset_stats()
        with eng:
            h = x
            for _ in range(8):
                h = torch.tanh(h * 1.01)  # 256 KiB saved each
                free["bytes"] = max(0, free["bytes"] - 256 * 1024)  # someone else takes the device meanwhile
        h.sum().backward()
        budgets.append(eng.stats.budget_bytes)
        assert eng.stats.peak_over_budget_bytes == 0, f"step {step}: over the budget in force"
        assert eng.stats.offloaded_bytes > 0, "the premise: the budget fell below what the step saves"
        free["bytes"] = 2 * MB
    eng.close()


def test_a_leaving_tensor_backward_uses_as_the_budget_falls_is_not_over_it():
    """The budget falls between the last pack and backward (someone else took the device) while
    the newest moved tensor's copy out is still on its way: the first unpack is served from that
    tensor's original, the tensor autograd is using now, which exists with or without the engine.
    It is not the engine holding bytes over the budget (``Store._note_peak``'s ``in_use``). The
    link lands copies only on cue, so the copy is in flight as backward starts on every run (the
    timing that made the test above fail now and then on the spill threads)."""
    link = LandsOnCue()
    free = {"bytes": 2 * MB}
    eng = offload.engine(
        "auto",
        reserve_mb=1,
        memory=FreeMemory(read=lambda: free["bytes"], reread_bytes=0),
        min_offload_mb=0,
        device="cpu",
        link=link,
    )
    x = torch.randn(256, 256, requires_grad=True)
    h = x
    for _ in range(8):
        h = torch.tanh(h * 1.01)
    want = torch.autograd.grad(h.sum(), x)[0]
    with eng:
        h = x
        for _ in range(8):
            h = torch.tanh(h * 1.01)  # 256 KiB saved each
            free["bytes"] -= 256 * 1024  # the saves take free memory, as they do on a device
    leaving = [p for p in link.out if p._copy is not None]
    assert leaving, "a copy out in flight as backward starts (the path under test)"
    free["bytes"] = 0  # then someone else takes the rest
    got = torch.autograd.grad(h.sum(), x)[0]
    link.land()
    stats = eng.stats
    eng.close()
    assert torch.equal(got, want)
    assert stats.budget_bytes < stats.saved_bytes, "the premise: the budget fell below what the step saved"
    assert stats.peak_over_budget_bytes == 0


def _moved_under_falling_free_memory() -> tuple:
    """Twelve 256 KiB tanh saves under ``budget_mb="auto"`` whose free memory the saves take, so
    most move (into a host tier over ``DeferredLink``); then free memory is plentiful again. Returns
    (the engine, the free-memory cell, the saved outputs, the last output, x, the gradient without
    the engine)."""
    free = {"bytes": 2 * MB}
    reading = FreeMemory(read=lambda: free["bytes"], reread_bytes=0)  # reads no engine state: the link locks
    eng = offload.engine(
        "auto",
        reserve_mb=1,
        min_offload_mb=0,
        device="cpu",
        seams=offload.Seams(memory=reading, link=DeferredLink(delay=1)),
    )
    x = torch.randn(256, 256, requires_grad=True)
    h = x
    for _ in range(12):
        h = torch.tanh(h * 1.01)
    want = torch.autograd.grad(h.sum(), x)[0]
    hs: list[torch.Tensor] = []
    with eng:
        h = x
        for _ in range(12):
            h = torch.tanh(h * 1.01)  # 256 KiB saved each
            hs.append(h)
            free["bytes"] = max(0, free["bytes"] - 256 * 1024)  # the saves take free memory
    assert eng.stats.offloaded_bytes >= 2 * MB, "the premise: most saves moved"
    free["bytes"] = PLENTY  # backward starts with the device free: the moved saves are read back ahead
    return eng, free, hs, h, x, want


def test_loads_read_ahead_go_back_when_the_budget_falls_in_backward():
    """Backward starts with free memory plentiful, so the store reads the moved saves back ahead
    of their users; partway through, someone else takes the device. The loads no user has read yet
    must go back (the ones needed last first) so the engine holds no more than the budget now in
    force; they are read again when their turn comes. Gradients exact. (With the give-back
    removed, the loads stay and the peak over the budget is most of them: shown once, by hand.)"""
    eng, free, hs, h, x, want = _moved_under_falling_free_memory()

    def someone_takes_the_device(grad: torch.Tensor) -> None:
        free["bytes"] = 0

    hs[8].register_hook(someone_takes_the_device)
    got = torch.autograd.grad(h.sum(), x)[0]
    stats = eng.stats
    eng.close()
    assert torch.equal(got, want)
    assert stats.reloaded_bytes > stats.offloaded_bytes, "the premise: some loads went back and were read again"
    assert stats.peak_over_budget_bytes == 0, f"{stats.peak_over_budget_bytes} bytes over the budget in force"


def test_loads_given_back_are_read_ahead_again_when_room_returns():
    """As above, but the device frees up again before backward reaches the loads that went back:
    the prefetch must read them ahead again, not leave each to a miss at its unpack. The prefetch
    walks past loads it has started (See Note: [the prefetch walk] in ``offload._memory.store``);
    a load given back must send it back over them. Gradients exact."""
    eng, free, hs, h, x, want = _moved_under_falling_free_memory()

    def someone_takes_the_device(grad: torch.Tensor) -> None:
        free["bytes"] = 0

    def and_gives_it_back(grad: torch.Tensor) -> None:
        free["bytes"] = PLENTY

    hs[9].register_hook(someone_takes_the_device)
    hs[8].register_hook(and_gives_it_back)
    got = torch.autograd.grad(h.sum(), x)[0]
    stats = eng.stats
    eng.close()
    assert torch.equal(got, want)
    assert stats.reloaded_bytes > stats.offloaded_bytes, "the premise: some loads went back and were read again"
    assert stats.prefetch_misses <= 1, f"{stats.prefetch_misses} misses: the loads given back were not read ahead again"
