"""Regions and policies in the engine, on the built-in MiniGPT.

Oracle: the same model from the same seed without the engine, the RNG reseeded before every
step so dropout masks match. Every policy changes only where saved activations live, or re-runs
a block's forward with its RNG state restored, so on the CPU in fp32 the gradients must be
bitwise equal (``torch.equal``), step after step. The machine profile is fixed numbers, so no
probe runs and the plans do not depend on this machine. Two tests are white-box: they price
plans for the CPU's disk tier against a CUDA link straight through the planner's pure functions
(``offload._plan``), with numbers alone.
"""

from __future__ import annotations

import re
import time
from typing import Optional

import pytest
import torch

import offload
from offload.models.gpt import Block, GPTConfig, MiniGPT
from zoo import auto_trials, most_profiling_steps, stage_letters

CONFIG = GPTConfig(n_layer=3, n_head=2, n_embd=64, seq_len=64, dropout=0.1, attention="math")
BATCH = 4
STEPS = most_profiling_steps("auto") + 2
"""Enough for "auto" to profile (as many steps as it may legitimately take at one shape) and then
follow its plan twice."""
LR = 0.1
SEED = 1234
"""Seed set before each step's forward: the dropout masks of every run match."""
RERUNS = (offload.Decision.RECOMPUTE, offload.Decision.SELECTIVE, offload.Decision.SELECTIVE_OFFLOAD)
"""Decisions whose regions re-run in backward, each counted in ``Stats.recomputed_regions``."""

MACHINE = offload.MachineProfile(
    device_type="cpu",
    device_name="test machine",
    disk_write_gb_per_s=1.0,
    disk_read_gb_per_s=2.0,
    per_tensor_overhead_us=2.0,
)
"""Fixed costs: no probe, and the same plans on any machine."""

BUDGET_FRACTIONS = {"medium": 0.5, "small": 0.1}
"""Budgets as a fraction of the activation bytes the model saves at budget None."""

SETTLE_TIMEOUT_S = 5.0


def make_model() -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(CONFIG)


def batch(seq: int = CONFIG.seq_len, step: int = 0, size: int = BATCH, vocab: int = CONFIG.vocab_size):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, vocab, (size, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def train(model: MiniGPT, eng=None, steps: int = STEPS, seq: int = CONFIG.seq_len, on_step=None, first_step: int = 0):
    """``steps`` SGD steps at ``seq`` from step ``first_step`` (its batch and seed), the engine's
    stats reset before each; returns every step's loss and gradients. ``on_step(eng)`` after each."""
    return train_lengths(model, [seq] * steps, eng, on_step=on_step, first_step=first_step, reset_stats=True)


def train_lengths(
    model: MiniGPT,
    seqs: list[int],
    eng=None,
    *,
    size: int | list[int] = BATCH,
    on_step=None,
    first_step: int = 0,
    reset_stats: bool,
):
    """One SGD step per length in ``seqs``, step ``i`` from ``first_step`` on drawing batch ``i`` of
    ``size`` rows (a list: each step's own) and seeding ``SEED + i``; ``reset_stats``: the engine's
    stats reset before each step. Returns every step's loss and gradients. ``on_step(eng)`` after
    each, before the update."""
    history = []
    for i, seq in enumerate(seqs, start=first_step):
        rows = size if isinstance(size, int) else size[i - first_step]
        x, y = batch(seq, i, rows, model.config.vocab_size)
        model.zero_grad(set_to_none=True)
        if eng is not None and reset_stats:
            eng.reset_stats()
        torch.manual_seed(SEED + i)
        if eng is None:
            _, loss = model(x, y)
        else:
            with eng:
                _, loss = model(x, y)
        loss.backward()
        history.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        if on_step is not None:
            on_step(eng)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return history


def assert_same_history(got, want, what: str) -> None:
    for step, ((loss_g, grads_g), (loss_w, grads_w)) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(loss_g, loss_w), f"{what}: loss differs at step {step}"
        for i, (a, b) in enumerate(zip(grads_g, grads_w, strict=True)):
            assert torch.equal(a, b), f"{what}: grad of parameter {i} differs at step {step}"


def activation_bytes() -> int:
    model = make_model()
    eng = offload.engine(None, policy="none", regions=model.blocks, model=model, machine=MACHINE)
    x, y = batch()
    with eng:
        _, loss = model(x, y)
    nbytes = eng.stats.saved_bytes
    del loss
    eng.close()
    return nbytes


@pytest.fixture(scope="module")
def saved_bytes() -> int:
    return activation_bytes()


@pytest.fixture(scope="module")
def reference():
    return train(make_model())


def budget_mb(saved_bytes: int, name: str):
    return None if name == "none" else saved_bytes * BUDGET_FRACTIONS[name] / 2**20


def block_engine(model, budget: Optional[float], policy: str, spill_dir, machine=MACHINE, **options) -> offload.Engine:
    """The engine most tests here use: the model's blocks as regions, a fixed machine profile;
    ``options``: the engine's others (``min_offload_bytes``...)."""
    return offload.engine(
        budget, policy=policy, regions=model.blocks, model=model, machine=machine, spill_dir=spill_dir, **options
    )


def expected_recomputes(eng) -> list[int]:
    """Recomputed regions per step as the engine's stages say: every block on the "recompute"
    trial, none on "measure" and "offload" steps, the plan's re-running regions once it is in force."""
    planned = sum(d in RERUNS for d in eng.plan.decisions)
    per_stage = {"measure": 0, "offload": 0, "recompute": CONFIG.n_layer, None: planned}
    stages = list(eng.recent_stages)
    assert stages[-1] is None, f"still profiling after {len(stages)} steps: {stages}"
    return [per_stage[stage] for stage in stages]


def settle(eng) -> offload.Stats:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        stats = eng.stats
        if (stats.resident_bytes == 0 and stats.spill_bytes == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


# ------------------------------------------------------------------------------- equality


CASES = [("none", "none")] + [
    (policy, budget) for policy in ("offload", "recompute", "auto") for budget in ("none", "medium", "small")
]


@pytest.mark.sweep
@pytest.mark.parametrize("policy,budget", CASES, ids=[f"{p}-{b}" for p, b in CASES])
def test_policy_gradients_equal_no_engine(policy, budget, saved_bytes, reference, spill_dir):
    model = make_model()
    eng = block_engine(model, budget_mb(saved_bytes, budget), policy, spill_dir)
    recomputed = []
    history = train(model, eng, on_step=lambda e: recomputed.append(e.stats.recomputed_regions))
    assert_same_history(history, reference, f"policy {policy!r} at budget {budget}")
    if policy == "recompute":
        assert recomputed == [CONFIG.n_layer] * STEPS, "policy 'recompute' must checkpoint every block, every step"
    elif policy in ("none", "offload") or budget == "none":
        assert recomputed == [0] * STEPS
    if policy in ("auto", "offload"):
        assert eng.plan is not None
        assert len(eng.plan.regions) == CONFIG.n_layer
        assert recomputed == expected_recomputes(eng)
    stats = settle(eng)
    assert stats.resident_bytes == 0 and stats.spill_bytes == 0
    eng.close()


SLOW_DISK = offload.MachineProfile(
    device_type="cpu", device_name="slow disk", disk_write_gb_per_s=5e-4, disk_read_gb_per_s=5e-4
)
"""0.5 MB/s: moving a block's activations takes seconds, far longer than recomputing it."""
NO_DISK = offload.MachineProfile(device_type="cpu", device_name="no disk")
"""0 GB/s: offload is impossible, only keep and recompute are left."""


@pytest.mark.parametrize("machine", [SLOW_DISK, NO_DISK], ids=["slow-disk", "no-disk"])
@pytest.mark.parametrize("budget", ["medium", "small"])
def test_auto_recomputes_when_moving_costs_more(machine, budget, saved_bytes, reference, spill_dir):
    model = make_model()
    eng = block_engine(model, budget_mb(saved_bytes, budget), "auto", spill_dir, machine=machine)
    recomputed = []
    history = train(model, eng, on_step=lambda e: recomputed.append(e.stats.recomputed_regions))
    assert_same_history(history, reference, f"auto on a {machine.device_name} at budget {budget}")
    decisions = eng.plan.decisions
    assert offload.Decision.OFFLOAD not in decisions, str(eng.plan)
    assert offload.Decision.SELECTIVE_OFFLOAD not in decisions, str(eng.plan)
    assert {offload.Decision.RECOMPUTE, offload.Decision.SELECTIVE} & set(decisions), str(eng.plan)
    assert recomputed == expected_recomputes(eng)
    eng.close()


def test_recompute_policy_saves_only_block_inputs(saved_bytes, spill_dir):
    """With every block recomputed the engine sees each block's input, not what is inside it."""
    model = make_model()
    eng = offload.engine(None, policy="recompute", regions=model.blocks, model=model, machine=MACHINE)
    x, y = batch()
    torch.manual_seed(SEED)
    with eng:
        _, loss = model(x, y)
    assert eng.stats.saved_bytes < saved_bytes / 2
    loss.backward()
    eng.close()


# ------------------------------------------------------------------------------- arguments


def test_unknown_policy_lists_the_valid_ones():
    model = make_model()
    with pytest.raises(ValueError) as info:
        offload.engine(10, policy="fastest", regions=model.blocks, model=model, machine=MACHINE)
    message = str(info.value)
    assert "fastest" in message
    for name in ("none", "offload", "recompute", "auto"):
        assert name in message
    assert set(offload.policies()) >= {"none", "offload", "recompute", "auto"}


def test_policy_none_with_a_budget_is_refused():
    model = make_model()
    with pytest.raises(ValueError, match="none"):
        offload.engine(10, policy="none", regions=model.blocks, model=model, machine=MACHINE)


@pytest.mark.parametrize("policy", ["auto", "recompute"])
def test_region_policies_need_regions(policy):
    with pytest.raises(ValueError, match="regions"):
        offload.engine(10, policy=policy)


def test_regions_as_a_filter_with_model(saved_bytes, reference, spill_dir):
    model = make_model()
    eng = offload.engine(
        saved_bytes * 0.1 / 2**20,
        policy="auto",
        regions=lambda module, name: isinstance(module, Block),
        model=model,
        machine=MACHINE,
        spill_dir=spill_dir,
    )
    history = train(model, eng)
    assert_same_history(history, reference, "regions given as a filter")
    assert [r.name for r in eng.plan.regions] == [f"blocks.{i}" for i in range(CONFIG.n_layer)]
    eng.close()


def test_regions_filter_without_model_is_refused():
    with pytest.raises(ValueError, match="model="):
        offload.engine(10, policy="auto", regions=lambda module, name: isinstance(module, Block), machine=MACHINE)


def test_regions_filter_selecting_nothing_is_refused():
    model = make_model()
    with pytest.raises(ValueError, match="no module"):
        offload.engine(10, regions=lambda module, name: False, model=model, machine=MACHINE)


# ------------------------------------------------------------------------------- plans


def test_plan_after_first_step_keyed_by_shape(saved_bytes, spill_dir):
    model = make_model()
    eng = block_engine(model, saved_bytes * 0.1 / 2**20, "auto", spill_dir)
    assert eng.plan is None and eng.plans == {}
    assert "no plan yet" in offload.explain(eng)
    assert eng.profiling
    train(model, eng, steps=1)
    provisional = eng.plan
    assert provisional is not None and len(eng.plans) == 1, "a plan exists after the first step"
    assert eng.profiling, "a 10% budget must move blocks, so 'auto' measures the trials next"
    assert "provisional" in offload.explain(eng)
    train(model, eng, steps=1)  # every block recomputed: compute times free of transfers
    timed = eng.plan
    assert timed is not provisional and len(eng.plans) == 1
    train(model, eng, steps=1)  # every block offloaded: calibrates the transfer costs
    for _ in range(most_profiling_steps("auto")):  # an implausible reading again; the round where the noise decides
        if not eng.profiling:
            break
        train(model, eng, steps=1)
    first = eng.plan
    assert first is not timed and not eng.profiling
    assert re.fullmatch("M" + auto_trials(), stage_letters(eng.recent_stages)), list(eng.recent_stages)
    train(model, eng, steps=2)
    # the same plan (its regions the very same; only its step times read at the latest pace)
    assert eng.plan.regions is first.regions and len(eng.plans) == 1, "same shapes must reuse the plan"
    assert list(eng.recent_stages)[-2:] == [None, None]

    # A new sequence length: one "recompute" step measures it (a fit needs a second shape for
    # its fixed costs); the link was calibrated on the first shapes, so no offload trial.
    train(model, eng, steps=3, seq=CONFIG.seq_len // 2)
    assert len(eng.plans) == 2
    assert eng.plan.regions is not first.regions and not eng.profiling
    assert list(eng.recent_stages)[-3:] == ["recompute", None, None]
    assert eng.plan.origin == "measured"
    assert sum(r.saved_bytes for r in eng.plan.regions) < sum(r.saved_bytes for r in first.regions)
    train(model, eng, steps=1)
    assert eng.plan.regions is first.regions and len(eng.plans) == 2
    assert not eng.profiling, "shapes seen before are not profiled again"

    # A length between the two measured ones: planned from the fit, no profiling step.
    train(model, eng, steps=2, seq=CONFIG.seq_len * 3 // 4)
    assert list(eng.recent_stages)[-2:] == [None, None] and not eng.profiling
    assert eng.plan.origin.startswith("derived") and "measured at" in eng.plan.origin, eng.plan.origin
    assert f"{(BATCH, CONFIG.seq_len, CONFIG.n_embd)}" in offload.explain(eng)
    assert len(eng.plans) == 3
    derived = eng.plan
    train(model, eng, steps=1)
    assert eng.plan.regions is first.regions

    text, explained = str(eng.plan), offload.explain(eng)
    # The plan's own lines may carry a note that its step times are uncertain where the steps under
    # it ran far apart (a busy machine: test_pace.py); the lines after the plan come in this order.
    plan_part, after = explained.split(f"\nregions: the {CONFIG.n_layer} modules passed as regions=\n")
    assert plan_part == text or plan_part.startswith(f"{text}\nnote: these step times are uncertain"), plan_part
    link, pace, *held = after.split("\n")
    assert link.startswith("transfers priced at: "), link  # the offload trial's reading (test_shapes.py)
    assert pace.startswith("step times: x"), pace  # the steps under plans so far (test_pace.py)
    # What re-run regions held, where any re-ran (the trials): test_region_memory.py says when it shows.
    assert len(held) <= 1 and all(h.startswith("measured: the store held at most") for h in held), held
    assert derived.regions != first.regions
    for i in range(CONFIG.n_layer):
        assert f"blocks.{i}" in text
    for decision in eng.plan.decisions:
        assert decision.value in text
    assert "predicted" in text and "budget" in text
    assert any(d is not offload.Decision.KEEP for d in eng.plan.decisions), "a 10% budget cannot keep everything"
    assert offload.explain(eng.plan) == text
    eng.close()


def test_close_restores_the_modules_forward(spill_dir):
    model = make_model()
    eng = offload.engine(1, policy="auto", regions=model.blocks, model=model, machine=MACHINE, spill_dir=spill_dir)
    for block in model.blocks:
        assert getattr(block.forward, "__wrapped__", None) is not None
    train(model, eng, steps=1)
    eng.close()
    for block in model.blocks:
        assert "forward" not in vars(block)
        assert block.forward.__func__ is Block.forward
    with pytest.raises(RuntimeError, match="closed"):
        with eng:
            pass


def test_regions_run_plainly_outside_the_engine(reference, spill_dir):
    """The wrapped forwards do nothing outside ``with eng`` (e.g. an eval pass between steps)."""
    model = make_model()
    eng = offload.engine(0, policy="recompute", regions=model.blocks, model=model, machine=MACHINE, spill_dir=spill_dir)
    history = train(model, None)
    assert eng.stats.recomputed_regions == 0 and eng.stats.saved_tensors == 0
    assert_same_history(history, reference, "outside the engine")
    eng.close()


# ------------------------------------------------------------------------------- budget


@pytest.mark.parametrize("budget", ["medium", "small"])
@pytest.mark.parametrize("policy", ["auto", "offload", "recompute"])
def test_budget_is_respected(policy, budget, saved_bytes, spill_dir):
    """The engine-managed bytes on the device never exceed the budget, in forward or backward."""
    model = make_model()
    eng = block_engine(model, budget_mb(saved_bytes, budget), policy, spill_dir)
    budget_bytes = eng.config.budget_bytes
    peaks = []
    train(model, eng, on_step=lambda e: peaks.append(e.stats.peak_resident_bytes))
    assert all(0 < peak <= budget_bytes for peak in peaks), f"peaks {peaks} vs budget {budget_bytes}"
    eng.close()


# ------------------------------------------------------------------------------- the CPU tier in the planner


def _block(name: str, forward_ms: float, saved_mb: float = 100.0) -> offload.RegionProfile:
    return offload.RegionProfile(
        name=name,
        saved_bytes=int(saved_mb * 1e6),
        input_bytes=int(saved_mb * 1e4),
        forward_ms=forward_ms,
        num_tensors=10,
    )


CPU_DISK = offload.MachineProfile(device_type="cpu", disk_write_gb_per_s=2.0, disk_read_gb_per_s=1.0)
"""100 MB out in 50 ms, back in 100 ms: on the CPU both run on the compute's cores (``spare_cores``
is 0, as the probe reports with torch on every core)."""
CUDA_LINK = offload.MachineProfile(device_type="cuda", d2h_gb_per_s=2.0, h2d_gb_per_s=1.0)
"""The same figures behind a copy engine: they can hide behind compute."""


def test_cpu_disk_tier_is_paid_on_the_compute_timeline():
    from offload._plan.planner import simulate

    regions = [_block(f"blocks.{i}", forward_ms=200.0) for i in range(4)]
    decisions = [offload.Decision.OFFLOAD] * 3 + [offload.Decision.KEEP]
    baseline_ms = 3 * 4 * 200.0
    cpu_step_ms, _ = simulate(regions, decisions, CPU_DISK)
    assert cpu_step_ms == pytest.approx(baseline_ms + 3 * (50.0 + 100.0))
    cuda_step_ms, _ = simulate(regions, decisions, CUDA_LINK)
    assert cuda_step_ms == pytest.approx(baseline_ms)  # 200 ms of compute hides each 150 ms round trip


@pytest.mark.parametrize("forward_ms,expected", [(100.0, "recompute"), (200.0, "offload")])
def test_auto_on_the_cpu_weighs_the_round_trip_against_one_forward(forward_ms, expected):
    """Round trip 150 ms per block: a 100 ms forward is cheaper to re-run, a 200 ms one to move."""
    from offload._plan.policy import make_plan

    regions = [_block(f"blocks.{i}", forward_ms=forward_ms) for i in range(4)]
    plan = make_plan(regions, CPU_DISK, budget_bytes=int(50e6), policy="auto")
    assert plan.fits_budget
    assert {d.value for d in plan.decisions} == {expected}, str(plan)
    # Behind a copy engine the same transfers hide behind the next block's compute, so moving
    # wins at either forward time (but for the newest block, which has nothing left to hide behind).
    plan_cuda = make_plan(regions, CUDA_LINK, budget_bytes=int(50e6), policy="auto")
    assert plan_cuda.decisions[:-1] == (offload.Decision.OFFLOAD,) * 3, str(plan_cuda)


# ------------------------------------------------------------------------------- profiling stages


STAGE_CASES = {
    # "auto" with something to move: sizes, then a step recomputing every block, then one
    # offloading every block (to calibrate the transfer costs), then the plan; a reading the
    # probe's figures rule out is measured again, and where the noise of the trials decides the
    # plan the round runs once more (``auto_trials``: how often depends on the machine's load).
    "auto-small": ("auto", "small", MACHINE, "M" + auto_trials() + r"\.+"),
    # No link: nothing to calibrate, so no offload trial.
    "auto-small-no-disk": ("auto", "small", NO_DISK, "M" + auto_trials(link=False) + r"\.+"),
    # Nothing to move: two plain measurements (the first pays warm-up costs).
    "auto-none": ("auto", "none", MACHINE, r"MM\.+"),
    # "offload" never recomputes, not even to measure.
    "offload-small": ("offload", "small", MACHINE, r"MM\.+"),
    "recompute-small": ("recompute", "small", MACHINE, r"\.+"),
}


@pytest.mark.parametrize("case", list(STAGE_CASES))
def test_profiling_stages(case, saved_bytes, spill_dir):
    policy, budget, machine, expected = STAGE_CASES[case]
    model = make_model()
    eng = block_engine(model, budget_mb(saved_bytes, budget), policy, spill_dir, machine=machine)
    train(model, eng)
    assert re.fullmatch(expected, stage_letters(eng.recent_stages)), list(eng.recent_stages)
    assert not eng.profiling
    eng.close()


def test_auto_plans_from_the_trial_timings(saved_bytes, spill_dir):
    """The final plan's regions carry the sizes of the "measure" step and the times of the
    "recompute" step: a measured recompute and a backward without it."""
    model = make_model()
    eng = block_engine(model, budget_mb(saved_bytes, "small"), "auto", spill_dir)
    train(model, eng, steps=3)
    steps = {step.stage: step for step in eng.profiled_steps}
    sizes, timed, span_ms = steps["measure"].regions, steps["recompute"].regions, steps["recompute"].span_ms
    assert steps["measure"].inputs == steps["recompute"].inputs
    assert span_ms is not None and span_ms > 0
    for size, region, planned in zip(sizes, timed, eng.plan.regions, strict=True):
        assert region.saved_bytes == size.saved_bytes == planned.saved_bytes > 0
        assert region.num_tensors == size.num_tensors > 0
        assert region.recompute_ms > 0 and region.backward_ms > 0 and region.forward_ms > 0
        assert planned.forward_ms == region.forward_ms
    eng.close()


def test_a_plan_in_force_does_not_spill_what_it_keeps(saved_bytes, spill_dir):
    """The store's early eviction (its in-flight window) is off while a plan is in force: the
    plan already fits the budget, so the blocks it keeps stay on the device. Policy "offload" (sizes
    only: it keeps the newest blocks that fit, whatever the machine's speed); "auto" may take a fixed
    policy's plan that keeps none where the trials' noise leaves it as good (``_plan.profiler``'s Note:
    [a plan that holds still]), and the store is the same under either."""
    model = make_model()
    eng = block_engine(model, budget_mb(saved_bytes, "medium"), "offload", spill_dir)
    offloaded = []
    train(model, eng, on_step=lambda e: offloaded.append(e.stats.offloaded_bytes))
    plan = eng.plan
    assert offload.Decision.KEEP in plan.decisions and plan.fits_budget, str(plan)
    planned_out = sum(r.saved_bytes for r in plan.regions if r.decision is offload.Decision.OFFLOAD)
    stages = list(eng.recent_stages)
    for stage, nbytes in zip(stages, offloaded, strict=True):
        if stage is None:
            assert nbytes <= planned_out, f"{nbytes} bytes moved; the plan moves {planned_out}\n{plan}"
    eng.close()


def test_a_budget_that_fits_everything_is_measured_without_spilling(saved_bytes, spill_dir):
    """At a budget that holds every activation, the first step (with the store's in-flight
    window) may spill; once the provisional plan keeps everything, nothing is moved, not even on
    the second measured step whose times the final plan predicts with."""
    model = make_model()
    eng = block_engine(model, saved_bytes * 1.02 / 2**20, "auto", spill_dir)
    offloaded = []
    train(model, eng, on_step=lambda e: offloaded.append(e.stats.offloaded_bytes))
    assert list(eng.recent_stages) == ["measure", "measure"] + [None] * (STEPS - 2)
    assert set(eng.plan.decisions) == {offload.Decision.KEEP}
    assert offloaded[0] > 0, "the first step holds the budget with the in-flight window (this test's premise)"
    assert offloaded[1:] == [0] * (STEPS - 1), offloaded
    eng.close()


class _Boom(Exception):
    pass


def test_a_profiling_step_that_raises_is_measured_again(saved_bytes, reference, spill_dir):
    """An exception in the middle of the "recompute" trial leaves half a measurement: that stage
    runs again on the next step, and the engine still ends with a plan and exact gradients."""
    model = make_model()
    eng = block_engine(model, budget_mb(saved_bytes, "small"), "auto", spill_dir)
    history = train(model, eng, steps=1)  # "measure"

    def fail(module, args):
        raise _Boom("inside block 1")

    handle = model.blocks[1].mlp.register_forward_pre_hook(fail)
    x, y = batch(step=1)
    try:
        with pytest.raises(_Boom):
            with eng:
                model(x, y)
    finally:
        handle.remove()
    assert list(eng.recent_stages) == ["measure", "recompute"]
    # The same batch again, from the same parameters: the rest of the run is the reference's.
    model.zero_grad(set_to_none=True)
    history += train(model, eng, steps=STEPS - 1, first_step=1)
    assert_same_history(history, reference, "auto after a failed profiling step")
    assert re.fullmatch("MR" + auto_trials() + r"\.+", stage_letters(eng.recent_stages)), list(eng.recent_stages)
    assert not eng.profiling
    stats = settle(eng)
    assert stats.resident_bytes == 0 and stats.spill_bytes == 0
    eng.close()
