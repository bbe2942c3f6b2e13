"""The planner's selective decisions with numbers alone: cost model arithmetic, the fixed
"selective" policy, and "auto" choosing between keep, offload, recompute and both selectives.

No torch and no device; profiles are made up so every expected millisecond is written out.

White-box, on purpose: the planner and the policies (``offload._plan.planner``, ``_plan.policy``)
are pure, numbers in and plans out, so these tests call them directly rather than through the
engine; the engine's side is tested through its public API (test_selective.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest

from offload._cost import MachineProfile, RegionProfile
from offload._plan.planner import Decision, simulate
from offload._plan.policy import AutoPolicy, make_plan

KEEP, OFFLOAD, RECOMPUTE = Decision.KEEP, Decision.OFFLOAD, Decision.RECOMPUTE
SELECTIVE, SELECTIVE_OFFLOAD = Decision.SELECTIVE, Decision.SELECTIVE_OFFLOAD
ALL = (KEEP, OFFLOAD, RECOMPUTE, SELECTIVE, SELECTIVE_OFFLOAD)
MB = 10**6

NO_LINK = MachineProfile(device_type="cpu", device_name="no disk")


def cuda(gb_per_s: float, overhead_us: float = 0.0) -> MachineProfile:
    return MachineProfile(
        device_type="cuda", d2h_gb_per_s=gb_per_s, h2d_gb_per_s=gb_per_s, per_tensor_overhead_us=overhead_us
    )


def region(i: int = 0, *, selective_ms: float = 1.0, **kw) -> RegionProfile:
    """A block: 100 MB saved, 5 MB input; 60 MB from cheap ops, 40 MB from expensive ones; forward
    5 ms, backward 10 ms, whole recompute 5 ms, selective re-run ``selective_ms``."""
    fields = dict(
        name=f"blocks.{i}",
        saved_bytes=100 * MB,
        input_bytes=5 * MB,
        forward_ms=5.0,
        backward_ms=10.0,
        recompute_ms=5.0,
        num_tensors=20,
        cheap_bytes=60 * MB,
        expensive_bytes=40 * MB,
        expensive_tensors=4,
        selective_ms=selective_ms,
    )
    fields.update(kw)
    return RegionProfile(**fields)


def regions(n: int, **kw) -> list[RegionProfile]:
    return [region(i, **kw) for i in range(n)]


KEEP_STEP_MS = 15.0
"""One region's forward + backward."""


# -- cost model ------------------------------------------------------------------------------------


def test_selective_costs_its_rerun_and_keeps_inputs_plus_stash():
    step_ms, peak = simulate([region()], (SELECTIVE,), NO_LINK)
    assert step_ms == pytest.approx(KEEP_STEP_MS + 1.0)
    assert peak == 45 * MB
    step3, peak3 = simulate(regions(3), (SELECTIVE,) * 3, NO_LINK)
    assert step3 == pytest.approx(3 * KEEP_STEP_MS + 3 * 1.0)
    assert peak3 == 3 * 45 * MB


def test_selective_pays_its_dispatch_modes_per_op_in_forward_and_rerun_and_its_stash_per_tensor():
    """Under the stash mode in forward and the replay mode in its re-run, each op of a selective
    region costs ``dispatch_overhead_us``; its stash is held by the store (``held_tensor_overhead_us``)."""
    r = dataclasses.replace(region(), forward_dispatches=120, expensive_tensors=8)
    machine = dataclasses.replace(cuda(math.inf), held_tensor_overhead_us=15.0, dispatch_overhead_us=5.0)
    bare_ms, _ = simulate([r], (Decision.SELECTIVE,), machine.without_host_costs())
    step_ms, _ = simulate([r], (Decision.SELECTIVE,), machine)
    assert step_ms - bare_ms == pytest.approx(2 * 120 * 5.0 / 1000 + 8 * 15.0 / 1000)
    moved_ms, _ = simulate([r], (Decision.SELECTIVE_OFFLOAD,), machine)
    bare_moved_ms, _ = simulate([r], (Decision.SELECTIVE_OFFLOAD,), machine.without_host_costs())
    assert moved_ms - bare_moved_ms == pytest.approx(2 * 120 * 5.0 / 1000 + 8 * 15.0 / 1000)
    recompute_ms, _ = simulate([r], (Decision.RECOMPUTE,), machine)
    assert recompute_ms == simulate([r], (Decision.RECOMPUTE,), machine.without_host_costs())[0]  # no mode


def test_selective_offload_on_a_copy_engine_hides_the_stash_behind_the_next_forward():
    """40 MB at 10 GB/s: 4 ms out, under the next region's 5 ms forward; the reload of region 0
    (4 ms) hides behind region 1's backward. Only the re-runs show, and region 1's own copy: it
    lands 4 ms after its forward, when backward would start, so its reload waits 4 + 4 ms."""
    step_ms, peak = simulate(regions(2), (SELECTIVE_OFFLOAD,) * 2, cuda(10.0))
    assert step_ms == pytest.approx(2 * KEEP_STEP_MS + 2 * 1.0 + 8.0)
    assert peak == 2 * 5 * MB  # the inputs only


def test_selective_offload_on_the_cpu_pays_its_copies_and_per_tensor_costs():
    """No copy engine: the stash's write and read run on the compute timeline, plus 4 tensors x 10 us."""
    machine = MachineProfile(
        device_type="cpu", disk_write_gb_per_s=1.0, disk_read_gb_per_s=2.0, per_tensor_overhead_us=10.0
    )
    step_ms, peak = simulate([region()], (SELECTIVE_OFFLOAD,), machine)
    out_ms, back_ms, overhead_ms = 40.0, 20.0, 4 * 10e-3
    assert step_ms == pytest.approx(KEEP_STEP_MS + 1.0 + out_ms + back_ms + overhead_ms)
    assert peak == 5 * MB


def test_selective_needs_a_measured_selective_run_and_offload_a_link():
    unmeasured = region(selective_ms=0.0, note="compiled")
    for decision in (SELECTIVE, SELECTIVE_OFFLOAD):
        with pytest.raises(ValueError, match=r"blocks\.0.*no selective run.*compiled"):
            simulate([unmeasured], (decision,), cuda(10.0))
    with pytest.raises(ValueError, match="cannot OFFLOAD over a link"):
        simulate([region()], (SELECTIVE_OFFLOAD,), NO_LINK)


@pytest.mark.parametrize(
    "field,value",
    [
        ("cheap_bytes", -1),
        ("expensive_bytes", -1),
        ("expensive_tensors", -1),
        ("selective_ms", math.nan),
        ("selective_ms", -1.0),
    ],
)
def test_bad_selective_numbers_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        make_plan([dataclasses.replace(region(), **{field: value})], NO_LINK, 10 * MB)


# -- policies ---------------------------------------------------------------------------------------


def test_selective_policy_runs_measured_regions_selectively_and_recomputes_the_rest():
    profiles = [region(0), region(1, selective_ms=0.0, note="compiled (torch.compile): cannot be split"), region(2)]
    plan = make_plan(profiles, NO_LINK, None, "selective")
    assert plan.decisions == (SELECTIVE, RECOMPUTE, SELECTIVE)
    assert [r.dropped_bytes for r in plan.regions] == [60 * MB, 100 * MB, 60 * MB]
    text = str(plan)
    assert "selective" in text and "drops MB" in text
    assert "note: blocks.1: compiled (torch.compile): cannot be split" in text


def test_auto_picks_selective_where_its_stash_fits_and_recompute_costs_more():
    """Budget: every region's inputs and stash (45 MB each), not their saves. No link: keep,
    recompute (+5 ms each) or selective (+1 ms each): selective everywhere."""
    profiles = regions(4)
    plan = make_plan(profiles, NO_LINK, 4 * 45 * MB, "auto")
    assert plan.decisions == (SELECTIVE,) * 4, str(plan)
    assert plan.predicted_step_ms == pytest.approx(4 * KEEP_STEP_MS + 4 * 1.0)
    assert plan.fits_budget


def test_auto_recomputes_where_the_selective_rerun_is_not_cheaper():
    profiles = regions(3, selective_ms=6.0)  # slower than the 5 ms whole recompute (a made-up case)
    plan = make_plan(profiles, NO_LINK, 3 * 45 * MB, "auto")
    assert SELECTIVE not in plan.decisions and RECOMPUTE in plan.decisions, str(plan)


def test_auto_never_picks_selective_for_an_unmeasured_region():
    profiles = [region(0, selective_ms=0.0), region(1)]
    plan = make_plan(profiles, NO_LINK, 2 * 45 * MB, "auto")
    assert plan.decisions[0] is RECOMPUTE and plan.decisions[1] is SELECTIVE, str(plan)


def test_auto_moves_the_stash_when_only_the_inputs_fit():
    """Budget: the inputs and one region's stash. Moving whole regions (100 MB: 10 ms at 10 GB/s,
    longer than a forward) shows; moving a stash (40 MB: 4 ms) hides behind the next forward."""
    profiles = regions(4)
    machine = cuda(10.0)
    budget = 4 * 5 * MB + 40 * MB
    plan = make_plan(profiles, machine, budget, "auto")
    assert plan.fits_budget, str(plan)
    assert SELECTIVE_OFFLOAD in plan.decisions, str(plan)
    best_fixed = min(
        simulate(profiles, decisions, machine)[0]
        for decisions in [(RECOMPUTE,) * 4, (SELECTIVE,) * 4, (OFFLOAD,) * 4]
        if simulate(profiles, decisions, machine)[1] <= budget
    )
    assert plan.predicted_step_ms < best_fixed


@pytest.mark.parametrize("gb_per_s", [2.0, 10.0, 50.0])
@pytest.mark.parametrize("budget_mb", [20, 60, 150, 250])
def test_auto_finds_the_fastest_assignment_that_fits_three_regions(gb_per_s, budget_mb):
    """Against every one of the 5^3 assignments, on a copy engine at three link speeds."""
    profiles = [
        region(0, selective_ms=1.0),
        region(1, selective_ms=2.5, expensive_bytes=70 * MB, cheap_bytes=30 * MB),
        region(2, selective_ms=0.5),
    ]
    machine = cuda(gb_per_s)
    budget = budget_mb * MB
    plan = make_plan(profiles, machine, budget, AutoPolicy(stable_margin=0))  # the search alone
    default = make_plan(profiles, machine, budget, "auto")  # rule 6: within its margin of the fastest
    fitting = [
        simulate(profiles, d, machine, budget)[0]
        for d in itertools.product(ALL, repeat=3)
        if simulate(profiles, d, machine, budget)[1] <= budget
    ]
    assert fitting, "every budget here fits something (the test's premise)"
    assert plan.fits_budget, str(plan)
    assert plan.predicted_step_ms == pytest.approx(min(fitting)), str(plan)
    assert default.fits_budget and default.predicted_step_ms <= min(fitting) * (1 + AutoPolicy.stable_margin) + 1e-9


def test_to_dict_carries_dropped_bytes_and_notes():
    plan = make_plan([region(0), region(1, selective_ms=0.0, note="why not")], NO_LINK, None, "selective")
    data = plan.to_dict()
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert [r["decision"] for r in data["regions"]] == ["selective", "recompute"]
    assert [r["dropped_bytes"] for r in data["regions"]] == [60 * MB, 100 * MB]
    assert data["regions"][1]["note"] == "why not"


def test_a_peak_over_the_budget_is_over_it_only_where_nothing_can_move():
    """Selective decisions whatever the budget: over a link the store moves what is beyond the
    budget and holds it (the text says so); with no link it cannot, and the text says OVER BUDGET."""
    profiles = regions(3)
    over_a_link = make_plan(profiles, cuda(10.0), 10 * MB, "selective")
    over_no_link = make_plan(profiles, NO_LINK, 10 * MB, "selective")
    for plan in (over_a_link, over_no_link):
        assert not plan.fits_budget and set(plan.decisions) == {SELECTIVE}, str(plan)
    assert "OVER BUDGET" not in str(over_a_link) and "holds the budget" in str(over_a_link), str(over_a_link)
    assert "OVER BUDGET by" in str(over_no_link) and "no link" in str(over_no_link), str(over_no_link)
