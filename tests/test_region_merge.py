"""A region's figures over its calls in one step, white-box: the rule per field is the case under
test, with made-up figures and no model: a profiling step's profile
(``offload._regions.measurement.merged_profile``) and a planned step's record (``steps.Seen``). See
Note: [region calls] in ``offload._regions.regions``."""

from __future__ import annotations

import dataclasses

from offload import RegionProfile
from offload._regions.measurement import merged_profile


@dataclasses.dataclass
class _Call:
    figures: RegionProfile

    def profile(self) -> RegionProfile:
        return self.figures


def _call(saved: int, largest: int, selective_ms: float = 0.0, note: str = "") -> _Call:
    return _Call(
        RegionProfile(
            name="blocks.1",
            saved_bytes=saved,
            input_bytes=10,
            forward_ms=1.5,
            num_tensors=3,
            largest_tensor_bytes=largest,
            backward_ms=3.0,
            recompute_ms=1.0,
            cheap_bytes=saved // 2 if selective_ms else 0,
            expensive_bytes=saved // 2 if selective_ms else 0,
            expensive_tensors=1 if selective_ms else 0,
            selective_ms=selective_ms,
            forward_flops=1000,
            note=note,
        )
    )


def test_sizes_and_times_add_up_and_the_largest_storage_is_the_largest_calls():
    merged = merged_profile("blocks.1", [_call(100, 40, 0.5), _call(300, 90, 0.25)])
    assert (merged.saved_bytes, merged.input_bytes, merged.num_tensors) == (400, 20, 6)
    assert (merged.forward_ms, merged.backward_ms, merged.recompute_ms, merged.forward_flops) == (3.0, 6.0, 2.0, 2000)
    assert merged.largest_tensor_bytes == 90
    assert (merged.cheap_bytes, merged.expensive_bytes, merged.expensive_tensors) == (200, 200, 2)
    assert merged.selective_ms == 0.75


def test_a_call_that_cannot_run_selectively_makes_the_region_unsplittable():
    merged = merged_profile("blocks.1", [_call(100, 40, 0.5), _call(100, 40, 0.0, note="recomputed whole: why")])
    assert not merged.selective_measured()
    assert (merged.cheap_bytes, merged.expensive_bytes, merged.expensive_tensors) == (0, 0, 0)
    assert merged.note == "recomputed whole: why"


def test_a_region_that_did_not_run_saves_and_costs_nothing():
    merged = merged_profile("blocks.2", [])
    assert merged.name == "blocks.2" and merged.saved_bytes == 0 and merged.forward_ms == 0.0


def test_a_planned_steps_calls_of_one_region_add_up():
    """``steps.Seen`` over a region's calls on a step under a plan: sizes add up while every call
    saw them, and one call whose saves the store did not see leaves them unknown for good."""
    from offload._cost import Saved
    from offload._regions.steps import Seen

    seen = Seen(Saved(10, 1))
    seen.add(Saved(5, 2))
    seen.add(Saved(1, 1))
    assert seen.sizes == Saved(16, 4)
    seen.add(None)
    assert seen.sizes is None, "a call whose saves the store did not see leaves the sizes unknown"
    seen.add(Saved(3, 1))
    assert seen.sizes is None, "and nothing after it makes them known again"
