"""``plan_cache=PATH``: final region plans survive a restart; a bad file is never trusted.

Oracle for the restart: two real processes run the same job (``plan_cache_worker.py``); the
second does no profiling and follows the first one's plan exactly, and both train bitwise like
the model without the engine. The bad-file cases run in this process on the MiniGPT of
``test_regions`` (same oracle there: ``assert_same_history``). The bad files are made by hand
from the file's format (``offload._plan.cache``: its version, fingerprint and per-rank paths),
white-box: a file the engine would never write is the case under test.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload
from offload._plan.cache import FORMAT, VERSION, PlanCache, rank_path, regions_fingerprint
from test_regions import MACHINE, assert_same_history, make_model, train

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("plan_cache_worker.py")
BUDGET_MB = 0.3
"""Below the blocks' saved bytes, so the plan moves something."""
PROFILE_STEPS = offload.limits.profile_steps
"""policy "offload" profiles this many "measure" steps per input signature."""


PACED = ("baseline_step_ms", "predicted_step_ms", "predicted_overhead_ms")
"""A plan's fields read at the pace of the latest steps under plans (``Plan.pace``): a live
reading of this process's steps, not part of what is saved."""


def assert_same_model_plan(plan: dict, saved: dict) -> None:
    """``plan`` is the ``saved`` plan exactly, its step times compared at the cost model's own
    pace (divided by each one's pace: equal to rounding)."""
    assert {k: v for k, v in plan.items() if k not in (*PACED, "pace")} == {
        k: v for k, v in saved.items() if k not in (*PACED, "pace")
    }
    for k in PACED:
        assert plan[k] / plan["pace"] == pytest.approx(saved[k] / saved["pace"], rel=1e-12), k


def run_worker(plan_cache: Path, spill_dir: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(plan_cache), str(spill_dir)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two worker processes
def test_a_restarted_process_runs_its_first_step_under_the_saved_plan(tmp_path, spill_dir):
    path = tmp_path / "cache" / "plans.json"
    first = run_worker(path, spill_dir)
    assert path.exists(), "a missing file (and its directory) is created"
    assert first["stages"][:3] == ["measure", "recompute", "offload"] and first["profiling"][0]
    assert first["losses"] == first["reference"]
    second = run_worker(path, spill_dir)
    assert second["stages"] == [None] * len(second["stages"]), "no profiling step after the restart"
    assert second["profiling"] == [False] * len(second["profiling"]), "eng.profiling False from the first step"
    assert_same_model_plan(second["plan"], first["plan"])
    assert any(r["decision"] != "keep" for r in second["plan"]["regions"]), "the budget is below what the blocks save"
    assert second["losses"] == second["reference"] == first["reference"]
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 1, "the second run found its entry and wrote none beside it"


# ------------------------------------------------------------------------------- in one process


def engine(model, path, budget_mb=BUDGET_MB, spill_dir=None):
    return offload.engine(
        budget_mb,
        regions=model.blocks,
        model=model,
        machine=MACHINE,
        policy="offload",
        plan_cache=path,
        spill_dir=spill_dir,
    )


def warnings_from(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("offload.") and r.name.endswith(".cache") and r.levelno >= logging.WARNING
    ]


def profile_and_save(path: Path, spill_dir, budget_mb=BUDGET_MB) -> offload.Plan:
    model = make_model()
    eng = engine(model, path, budget_mb, spill_dir)
    train(model, eng, steps=PROFILE_STEPS + 1)
    assert not eng.profiling
    plan = eng.plan
    eng.close()
    return plan


def assert_profiles_and_rewrites(path: Path, spill_dir, reference, caplog, why: str) -> None:
    """An engine over ``path`` warns once (``why`` in the message), profiles as if there were no
    file, trains exactly like the model without it, and leaves a good file for the next run."""
    model = make_model()
    eng = engine(model, path, spill_dir=spill_dir)
    history = train(model, eng, steps=PROFILE_STEPS + 1)
    assert list(eng.recent_stages) == ["measure"] * PROFILE_STEPS + [None], "the file was not trusted"
    assert_same_history(history, reference, why)
    warnings = warnings_from(caplog)
    assert len(warnings) == 1 and why in warnings[0] and str(path) in warnings[0], warnings
    eng.close()
    caplog.clear()
    model = make_model()
    eng = engine(model, path, spill_dir=spill_dir)
    train(model, eng, steps=1)
    assert list(eng.recent_stages) == [None], "rewritten after profiling: the next run trusts it"
    assert warnings_from(caplog) == []
    eng.close()


@pytest.fixture(scope="module")
def reference():
    return train(make_model(), steps=PROFILE_STEPS + 1)


def test_same_process_restart_follows_the_saved_plan(tmp_path, spill_dir, reference, caplog):
    path = tmp_path / "plans.json"
    saved = profile_and_save(path, spill_dir)
    model = make_model()
    eng = engine(model, path, spill_dir=spill_dir)
    history = train(model, eng, steps=PROFILE_STEPS + 1)
    assert list(eng.recent_stages) == [None] * (PROFILE_STEPS + 1)
    assert_same_model_plan(eng.plan.to_dict(), saved.to_dict())
    assert offload.Decision.OFFLOAD in saved.decisions and eng.stats.offloaded_bytes > 0
    assert_same_history(history, reference, "under the saved plan")
    assert warnings_from(caplog) == []
    eng.close()


def test_a_corrupt_file_is_ignored_with_one_warning(tmp_path, spill_dir, reference, caplog):
    path = tmp_path / "plans.json"
    path.write_bytes(b"\x00\xffnot json at all")
    assert_profiles_and_rewrites(path, spill_dir, reference, caplog, "corrupt")


def test_a_truncated_file_is_ignored_with_one_warning(tmp_path, spill_dir, reference, caplog):
    path = tmp_path / "plans.json"
    profile_and_save(path, spill_dir)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    assert_profiles_and_rewrites(path, spill_dir, reference, caplog, "corrupt or truncated")


@pytest.mark.parametrize(
    "foreign",
    [{"hello": "world"}, [1, 2, 3], {"format": FORMAT, "version": VERSION + 1, "entries": {}}],
    ids=["other-json", "a-list", "other-version"],
)
def test_a_foreign_file_is_ignored_with_one_warning(foreign, tmp_path, spill_dir, reference, caplog):
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(foreign))
    why = (
        "layout version"
        if isinstance(foreign, dict) and foreign.get("format") == FORMAT
        else "not an offload plan cache"
    )
    assert_profiles_and_rewrites(path, spill_dir, reference, caplog, why)


def test_a_file_for_another_budget_is_ignored_with_one_warning(tmp_path, spill_dir, reference, caplog):
    path = tmp_path / "plans.json"
    profile_and_save(path, spill_dir, budget_mb=BUDGET_MB * 2)
    assert_profiles_and_rewrites(path, spill_dir, reference, caplog, "differ in: budget")
    assert len(json.loads(path.read_text())["entries"]) == 2, "the other budget's entry is kept beside"


def test_a_file_for_another_model_is_ignored_with_one_warning(tmp_path, spill_dir, reference, caplog):
    path = tmp_path / "plans.json"
    saved = profile_and_save(path, spill_dir)
    # The profiled plan is a real one: a decision per block, some of them moving their tensors.
    assert len(saved.decisions) == len(make_model().blocks) and offload.Decision.OFFLOAD in saved.decisions
    data = json.loads(path.read_text())
    (entry,) = data["entries"].values()
    entry["key"]["regions"] = "0" * 64  # as if the blocks had other shapes
    data["entries"] = {"0" * 64: entry}
    path.write_text(json.dumps(data))
    assert_profiles_and_rewrites(path, spill_dir, reference, caplog, "differ in: regions")


@pytest.mark.parametrize("tamper", ["decision", "regions", "fit", "fit-value", "digest", "link_scale"])
def test_an_entry_that_does_not_hold_up_is_ignored_with_one_warning(tamper, tmp_path, spill_dir, reference, caplog):
    path = tmp_path / "plans.json"
    profile_and_save(path, spill_dir)
    data = json.loads(path.read_text())
    (digest, entry) = next(iter(data["entries"].items()))
    if tamper == "decision":
        entry["plans"][0]["plan"]["regions"][0]["decision"] = "sideways"
    elif tamper == "regions":
        entry["plans"][0]["plan"]["regions"] = entry["plans"][0]["plan"]["regions"][:-1]
    elif tamper == "fit":
        entry["fit"]["regions"] = entry["fit"]["regions"][:-1]
    elif tamper == "fit-value":
        entry["fit"]["regions"][0]["fields"]["saved_bytes"][0][3] = -5
    elif tamper == "digest":
        entry["key"]["budget"] = 1  # the key no longer hashes to the digest it is filed under
    else:
        entry["link_scale"] = -1.0
    path.write_text(json.dumps(data))
    if tamper == "digest":  # filed under this run's digest but keyed otherwise: the key itself is checked
        assert digest in data["entries"]
    assert_profiles_and_rewrites(path, spill_dir, reference, caplog, "unusable")


def _plan(entry):
    return entry["plans"][0]["plan"]


def _profile(entry):
    return entry["plans"][0]["profiles"][1]  # the first block's (the saves before the regions come first)


WRONG_FIELDS = {
    # A number stored as a string: trusted before, then a TypeError in the first forward or in explain.
    "budget_bytes-as-string": (
        "plan.budget_bytes '314572'",
        lambda e: _plan(e).update(budget_bytes=str(_plan(e)["budget_bytes"])),
    ),
    "baseline_step_ms-as-string": (
        "plan.baseline_step_ms '962.1'",
        lambda e: _plan(e).update(baseline_step_ms="962.1"),
    ),
    "region-saved_bytes-as-string": (
        "plan.regions[0].saved_bytes '1900544'",
        lambda e: _plan(e)["regions"][0].update(saved_bytes="1900544"),
    ),
    "region-exposed_ms-as-string": (
        "plan.regions[1].exposed_ms '2.9'",
        lambda e: _plan(e)["regions"][1].update(exposed_ms="2.9"),
    ),
    "profile-saved_bytes-as-string": (
        "profiles[1].saved_bytes '1900544'",
        lambda e: _profile(e).update(saved_bytes="1900544"),
    ),
    "other_ms-as-string": ("other_ms '89.0'", lambda e: e["plans"][0].update(other_ms="89.0")),
    # A bool is not a number, a float is not a count, a number is not a flag or a name.
    "region-saved_bytes-as-bool": (
        "regions[0].saved_bytes True",
        lambda e: _plan(e)["regions"][0].update(saved_bytes=True),
    ),
    "predicted_peak_bytes-as-float": (
        "plan.predicted_peak_bytes 1.5",
        lambda e: _plan(e).update(predicted_peak_bytes=1.5),
    ),
    "fits_budget-as-string": ("plan.fits_budget 'true'", lambda e: _plan(e).update(fits_budget="true")),
    "policy-as-number": ("plan.policy 7", lambda e: _plan(e).update(policy=7)),
    "region-note-as-number": ("regions[0].note 5", lambda e: _plan(e)["regions"][0].update(note=5)),
    "inputs-as-number": ("plans[0].inputs 5", lambda e: e["plans"][0].update(inputs=5)),
    # Out of range: NaN anywhere, infinity where no time can be infinite, a negative count or budget.
    "profile-forward_ms-nan": ("profiles[1].forward_ms nan", lambda e: _profile(e).update(forward_ms=math.nan)),
    "region-exposed_ms-infinite": (
        "regions[0].exposed_ms inf",
        lambda e: _plan(e)["regions"][0].update(exposed_ms=math.inf),
    ),
    "region-transfer_ms-nan": (
        "regions[0].transfer_ms nan",
        lambda e: _plan(e)["regions"][0].update(transfer_ms=math.nan),
    ),
    "overhead-infinite": ("plan.predicted_overhead_ms inf", lambda e: _plan(e).update(predicted_overhead_ms=math.inf)),
    "budget_bytes-negative": ("plan.budget_bytes -1", lambda e: _plan(e).update(budget_bytes=-1)),
    "outside-resident_bytes-negative": (
        "outside[0].resident_bytes -1",
        lambda e: _plan(e)["outside"][0].update(resident_bytes=-1),
    ),
    # The fit's shapes and notes.
    "fit-dims-as-strings": (
        "bad shape [16384, 64, ['4', '64', '64']]",
        lambda e: e["fit"]["measured"][0].__setitem__(2, ["4", "64", "64"]),
    ),
    "fit-note-as-number": ("note 5 is not a string", lambda e: e["fit"]["regions"][1].update(note=5)),
}


@pytest.mark.parametrize("wrong", WRONG_FIELDS)
def test_a_field_of_the_wrong_type_or_range_is_ignored_with_one_warning(wrong, tmp_path, spill_dir, reference, caplog):
    """Every field is checked on load, by type and range (issue 47, item 3): a hand-edited or
    corrupt entry is one warning naming the field and its value (``why``), then profiling as if
    there were no file, and training bitwise equal to the model without the engine."""
    path = tmp_path / "plans.json"
    profile_and_save(path, spill_dir)
    data = json.loads(path.read_text())
    (entry,) = data["entries"].values()
    why, tamper = WRONG_FIELDS[wrong]
    tamper(entry)
    path.write_text(json.dumps(data))  # NaN and Infinity as Python's json writes and reads them
    assert_profiles_and_rewrites(path, spill_dir, reference, caplog, why)


def test_an_infinite_transfer_and_a_negative_overhead_read_back():
    """The ranges are the planner's own: a link that cannot carry the bytes prices a transfer at
    infinity, and a plan can predict a step a hair faster than the baseline; both load as written."""
    from offload._plan.cache import _decode_plan, _encode_plan
    from offload._plan.planner import Plan, RegionPlan

    region = RegionPlan(
        name="blocks.0",
        decision=offload.Decision.KEEP,
        saved_bytes=10,
        forward_ms=1.0,
        transfer_ms=math.inf,
        exposed_ms=0.0,
        resident_bytes=10,
    )
    plan = Plan(
        regions=(region,),
        policy="recompute",
        budget_bytes=None,
        baseline_step_ms=3.0,
        predicted_step_ms=3.0 - 1e-12,
        predicted_overhead_ms=-1e-12,
        predicted_peak_bytes=10,
        fits_budget=True,
    )
    assert _decode_plan(json.loads(json.dumps(_encode_plan(plan))), "plan") == plan


def test_a_restart_with_new_shapes_plans_them_from_the_saved_fit(tmp_path, spill_dir):
    """The file holds the family's fit, not only the measured shapes' plans: a restarted job whose
    batches come in shapes never seen runs every step under a plan derived from it, exactly."""
    path = tmp_path / "plans.json"
    profile_and_save(path, spill_dir)
    model, want = make_model(), make_model()
    eng = engine(model, path, spill_dir=spill_dir)
    for step, seq in enumerate([48, 40, 56]):
        got = train(model, eng, steps=1, seq=seq, first_step=step)
        assert_same_history(got, train(want, steps=1, seq=seq, first_step=step), f"step {step}, length {seq}")
        assert eng.plan.origin.startswith("derived"), eng.plan.origin
    assert list(eng.recent_stages) == [None] * 3, "no profiling step after the restart"
    eng.close()


def test_a_missing_file_is_created_without_a_warning(tmp_path, spill_dir, caplog):
    path = tmp_path / "new" / "dir" / "plans.json"
    profile_and_save(path, spill_dir)
    assert json.loads(path.read_text())["format"] == FORMAT
    assert warnings_from(caplog) == []
    assert [p.name for p in path.parent.iterdir()] == ["plans.json"], "no temporary file left"


def test_an_unwritable_path_warns_and_training_goes_on(tmp_path, spill_dir, reference, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = blocker / "plans.json"  # its parent is a file: nothing can be created there
    model = make_model()
    eng = engine(model, path, spill_dir=spill_dir)
    assert_same_history(train(model, eng, steps=PROFILE_STEPS + 1), reference, "unwritable plan cache")
    assert any("could not write the plan cache" in w for w in warnings_from(caplog))
    eng.close()


def test_bad_plan_cache_arguments(tmp_path):
    model = make_model()
    with pytest.raises(TypeError, match="plan_cache"):
        engine(model, 42)
    with pytest.raises(ValueError, match="is a directory"):
        engine(model, tmp_path)
    with pytest.raises(ValueError, match="needs regions="):
        offload.engine(1, plan_cache=tmp_path / "plans.json")


def test_each_rank_keeps_its_own_file():
    path = Path("/cache/plans.json")
    assert rank_path(path, {}) == path
    assert rank_path(path, {"WORLD_SIZE": "1", "RANK": "0"}) == path
    assert rank_path(path, {"WORLD_SIZE": "4", "RANK": "3"}) == Path("/cache/plans.rank3.json")
    host = socket.gethostname()  # LOCAL_RANK repeats on every node of a shared file system
    assert rank_path(path, {"WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == Path(f"/cache/plans.rank{host}.1.json")


def test_the_key_changes_with_what_changes_the_saves():
    """A frozen weight (LoRA) and another buffer save differently with the same shapes; so does
    the same model under bf16 autocast: none of them may reuse the other's plan."""
    model = make_model()
    regions = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    base = regions_fingerprint(regions)
    next(model.blocks[0].parameters()).requires_grad_(False)
    assert regions_fingerprint(regions) != base
    next(model.blocks[0].parameters()).requires_grad_(True)
    assert regions_fingerprint(regions) == base
    model.blocks[0].register_buffer("extra", torch.zeros(3))
    assert regions_fingerprint(regions) != base
    cache = PlanCache(Path("unused.json"), budget=None, policy="auto", machine_key=lambda d: "m")
    signature = (((2, 8), torch.int64, torch.device("cpu")),)
    plain = cache.key(signature, regions)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = cache.key(signature, regions)
    assert plain["autocast"] == "off" and autocast["autocast"] == "torch.bfloat16"
    assert plain["offload"] == offload.__version__


def test_one_warning_per_engine_however_many_inputs_miss(tmp_path, spill_dir, caplog):
    """Two input shapes alternate while the file is still corrupt: one warning, not one per shape."""
    path = tmp_path / "plans.json"
    path.write_text("{")
    model, want = make_model(), make_model()
    eng = engine(model, path, spill_dir=spill_dir)
    for step, seq in enumerate([64, 32, 64, 32]):
        got = train(model, eng, steps=1, seq=seq, first_step=step)
        assert_same_history(got, train(want, steps=1, seq=seq, first_step=step), f"step {step}")
    assert len(warnings_from(caplog)) == 1, warnings_from(caplog)
    eng.close()


def test_a_saved_plan_under_budget_auto_is_followed_then_replanned_without_profiling(tmp_path, spill_dir, reference):
    """budget "auto": the restarted engine follows the saved plan while free memory reads the
    same, and re-plans from the saved profiles (still no profiling step) once it falls."""
    from offload.seams import FreeMemory

    path = tmp_path / "plans.json"
    free = {"bytes": 1 << 40}

    def auto_engine(model):
        return offload.engine(
            "auto",
            reserve_mb=1,
            memory=FreeMemory(read=lambda: free["bytes"], reread_bytes=0),
            regions=model.blocks,
            model=model,
            machine=MACHINE,
            policy="offload",
            plan_cache=path,
            spill_dir=spill_dir,
        )

    model = make_model()
    eng = auto_engine(model)
    train(model, eng, steps=PROFILE_STEPS + 1)
    saved = eng.plan
    eng.close()
    model = make_model()
    eng = auto_engine(model)
    history = train(model, eng, steps=1)
    assert list(eng.recent_stages) == [None]
    assert_same_model_plan(eng.plan.to_dict(), saved.to_dict())
    free["bytes"] = 0
    history += train(model, eng, steps=PROFILE_STEPS, first_step=1)
    assert list(eng.recent_stages) == [None] * (PROFILE_STEPS + 1), "re-planned from the saved profiles"
    assert eng.plan != saved and offload.Decision.OFFLOAD in eng.plan.decisions
    assert_same_history(history, reference, "a saved plan under budget auto")
    eng.close()
