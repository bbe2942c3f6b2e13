"""The engine's settings as a user reads them (issue 51), and the ways kept for one release.

Every setting is a typed keyword of ``offload.engine`` that ``help()`` documents; a misspelt one
names the closest; sizes are in MiB; the test seams travel in one ``offload.Seams``; a named GPU
plans an engine on its datasheet figures and ``explain`` says so; and each older way (the seam
keywords, ``min_offload_bytes``, ``shared_inputs``, ``offload.Engine(config)``, ``Engine.watch``,
``offload.metrics``) still runs, with a ``DeprecationWarning`` that names the one way and points
at the caller's line. The oracle for behaviour is the same step without the engine (``zoo``),
compared exactly.
Two tests read where a seam went (``Engine._session._host``), white-box: an old keyword and the
new field must land in the same place, which nothing public shows.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

import offload
from hosts import StandInHost
from zoo import assert_same, run_step, wait_clean


def _blocks(n: int = 3, width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)])


def _input() -> torch.Tensor:
    return torch.randn(128, 64)


# ---------------------------------------------------------------------------- the signature


def test_every_setting_is_a_typed_documented_keyword():
    """``help(offload.engine)`` shows each setting with its type, and its docstring's Args name each."""
    parameters = inspect.signature(offload.engine).parameters
    assert not [p for p in parameters.values() if p.kind is p.VAR_KEYWORD], "no **options: every setting is named"
    untyped = [name for name, p in parameters.items() if p.annotation is inspect.Parameter.empty]
    assert not untyped, untyped
    doc = offload.engine.__doc__ or ""
    undocumented = [name for name in parameters if f"\n        {name}: " not in doc]
    assert not undocumented, undocumented
    for setting in ("policy", "spill_dir", "device", "prefetch", "plan_cache", "min_offload_mb", "seams"):
        assert setting in parameters, setting


def test_the_old_keywords_are_not_in_the_signature():
    """What a user, an IDE or mypy reads is the one way; the old names only run (with a warning)."""
    parameters = inspect.signature(offload.engine).parameters
    for old in ("link", "host", "memory", "min_offload_bytes", "shared_inputs", "options"):
        assert old not in parameters, old


def test_a_misspelt_setting_names_the_closest_and_lists_only_current_ones():
    with pytest.raises(TypeError, match=r"'spill_workrs' \(did you mean 'spill_workers'\?\)") as info:
        offload.engine(0, spill_workrs=2)
    listed = str(info.value).split("valid keywords: ", 1)[1].split(", ")
    assert listed == list(inspect.signature(offload.engine).parameters)


def test_the_defaults_are_the_documented_ones():
    """What the docstring and the README say each setting defaults to is what an engine gets."""
    config = offload.engine().config
    assert config.budget_bytes is None and config.reserve_bytes is None and config.host_budget_bytes is None
    assert config.prefetch is True
    assert config.spill_workers == 2
    assert config.min_offload_bytes == 64 * 1024
    assert config.policy == "offload" and config.device is None
    assert config.spill_dir is None and config.plan_cache is None


def test_budget_mb_by_position_and_by_name_make_the_same_engine():
    assert offload.engine(3).config == offload.engine(budget_mb=3).config


# ---------------------------------------------------------------------------- one unit


def test_min_offload_mb_is_the_byte_threshold_in_mib():
    assert offload.engine(0).config.min_offload_bytes == 64 * 1024, "the default: 0.0625 MiB"
    assert offload.engine(0, min_offload_mb=1).config.min_offload_bytes == 1 << 20
    assert offload.engine(0, min_offload_mb=0.5).config.min_offload_bytes == 1 << 19
    assert offload.engine(0, min_offload_mb=0).config.min_offload_bytes == 0


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf")])
def test_a_min_offload_mb_out_of_range_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"min_offload_mb must be a finite number >= 0 \(megabytes\)"):
        offload.engine(0, min_offload_mb=bad)


def test_a_min_offload_mb_of_another_type_is_refused_by_name():
    with pytest.raises(TypeError, match=r"min_offload_mb must be a number of megabytes.*got '1' of type str"):
        offload.engine(0, min_offload_mb="1")


def test_min_offload_bytes_still_works_with_a_warning_naming_min_offload_mb():
    with pytest.warns(DeprecationWarning, match=r"min_offload_bytes=\.\.\.\) is deprecated.*min_offload_mb= in MiB"):
        old = offload.engine(0, min_offload_bytes=4096)
    assert old.config == offload.engine(0, min_offload_mb=4096 / 2**20).config
    assert old.config.min_offload_bytes == 4096


def test_min_offload_bytes_and_min_offload_mb_together_are_refused():
    with pytest.raises(ValueError, match="both min_offload_bytes= and min_offload_mb="):
        offload.engine(0, min_offload_bytes=0, min_offload_mb=0)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_min_offload_bytes_is_still_refused_by_name(bad):
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"min_offload_bytes must be an int >= 0"):
        offload.engine(0, min_offload_bytes=bad)


# ---------------------------------------------------------------------------- seams


def test_a_stand_in_host_through_seams_sees_the_engines_spill_traffic(spill_dir):
    """The seam in one place: the step is exact and the stand-in saw the spill file's writes."""
    host = StandInHost()
    model = _blocks()
    ref = run_step(model, _input)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, seams=offload.Seams(host=host))
    assert_same(ref, run_step(model, _input, eng), "seams=Seams(host=...)")
    stats = wait_clean(eng)
    eng.close()
    assert stats.spilled_bytes > 0
    assert host.writes > 0 and host.reads > 0, "the stand-in host saw none of the engine's traffic"


@pytest.mark.parametrize("old", ["link", "host", "memory"])
def test_each_old_seam_keyword_warns_naming_seams(old):
    value = {"link": None, "host": StandInHost(), "memory": lambda: 1 << 30}[old]
    budget = "auto" if old == "memory" else 0
    with pytest.warns(DeprecationWarning, match=rf"engine\({old}=\.\.\.\) is deprecated.*seams=offload\.Seams\({old}="):
        eng = offload.engine(budget, **{old: value})
    eng.close()


def test_the_old_seam_keywords_fill_the_same_fields_as_seams():
    host = StandInHost()
    with pytest.warns(DeprecationWarning):
        eng = offload.engine(0, host=host)
    assert eng._session._host is host  # white-box: where the seam went (the Session holds it)
    eng.close()


def test_a_seam_named_both_ways_is_refused():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="host both as a keyword and in seams="):
        offload.engine(0, host=StandInHost(), seams=offload.Seams(host=StandInHost()))


def test_an_old_seam_keyword_adds_to_the_other_seams_given():
    host = StandInHost()
    with pytest.warns(DeprecationWarning):
        eng = offload.engine("auto", memory=lambda: 1 << 30, seams=offload.Seams(host=host))
    assert eng._session._host is host  # white-box, as above
    eng.close()


def test_seams_that_are_not_seams_are_refused_with_a_short_name():
    with pytest.raises(TypeError, match=r"^seams must be an offload.Seams, got dict$"):
        offload.engine(0, seams={"host": None})
    with pytest.raises(TypeError, match=r"memory= must be a callable"):
        offload.Seams(memory=3)


def test_a_free_memory_reading_with_a_fixed_budget_is_refused():
    with pytest.raises(ValueError, match=r"Seams\(memory=\.\.\.\) reads free memory for budget_mb='auto'"):
        offload.engine(0, seams=offload.Seams(memory=lambda: 1 << 30))


def test_seams_are_frozen():
    """A bundle given to one engine cannot change under it afterwards."""
    import dataclasses

    seams = offload.Seams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        seams.host = StandInHost()  # type: ignore[misc]  # the assignment is the test


def test_seams_repr_names_the_types_given_only():
    assert repr(offload.Seams(host=StandInHost())) == "Seams(host=StandInHost)"
    assert repr(offload.Seams()) == "Seams()"


# ---------------------------------------------------------------------------- one machine type


def test_a_named_gpu_plans_an_engine_and_explain_says_datasheet():
    model = _blocks(4)
    ref = run_step(model, _input)
    eng = offload.engine(0, model=model, regions=list(model), machine=offload.machine("h100-sxm"), min_offload_mb=0)
    for _ in range(3):
        assert_same(ref, run_step(model, _input, eng), "planned on h100-sxm's figures")
    assert eng.plan is not None
    text = offload.explain(eng)
    assert "machine: planned on a named machine's datasheet figures, not measured on this one (h100-sxm:" in text
    assert offload.machine("h100-sxm").source in text
    eng.close()


def test_a_measured_profile_plans_without_a_datasheet_note():
    model = _blocks(4)
    profile = offload.MachineProfile(device_type="cpu", disk_write_gb_per_s=1.0, disk_read_gb_per_s=1.0)
    eng = offload.engine(0, model=model, regions=list(model), machine=profile, min_offload_mb=0)
    for _ in range(3):
        run_step(model, _input, eng)
    assert eng.plan is not None
    assert "datasheet" not in offload.explain(eng)
    eng.close()


@pytest.mark.parametrize("bad", ["h100-sxm", {"device_type": "cuda"}, 3])
def test_a_machine_of_another_type_is_refused_with_a_short_name(bad):
    with pytest.raises(TypeError, match=rf"got {type(bad).__name__}$") as info:
        offload.engine(0, machine=bad)
    assert len(str(info.value)) < 200, "a type's name, not a repr"


# ---------------------------------------------------------------------------- one way per thing


def test_offload_engine_makes_an_engine_without_a_deprecation():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        eng = offload.engine(0)
    assert isinstance(eng, offload.Engine), "Engine stays the public type"
    eng.close()


def test_engine_from_a_config_warns_naming_offload_engine():
    config = offload.engine(0).config
    with pytest.warns(DeprecationWarning, match=r"offload\.Engine\(config, \.\.\.\) is deprecated.*offload\.engine\("):
        eng = offload.Engine(config)
    assert eng.config is config
    eng.close()


def test_watch_warns_naming_model_and_still_names_the_model(spill_dir):
    model = _blocks()
    eng = offload.engine(0, regions="auto", min_offload_mb=0, spill_dir=spill_dir)
    with pytest.warns(DeprecationWarning, match=r"Engine\.watch\(model\) is deprecated.*model=model"):
        assert eng.watch(model) is eng
    ref = run_step(_blocks(), _input)
    assert_same(ref, run_step(model, _input, eng), "regions='auto' found through watch")
    assert len(eng.regions) == 3
    eng.close()


def test_model_and_the_decorator_name_the_model_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        offload.engine(0, model=_blocks()).close()
        decorated = offload.engine(0)(_blocks())
        decorated.offload_engine.close()


def test_shared_inputs_warns_naming_offload_sharded():
    with pytest.warns(DeprecationWarning, match=r"shared_inputs=\.\.\.\) is deprecated.*offload\.sharded\(group\)"):
        with pytest.raises(ValueError, match="shared_inputs= declares the inputs of regions"):
            offload.engine(0, shared_inputs=object())


def test_shared_inputs_is_still_checked_while_deprecated():
    """The deprecated keyword keeps its checks for its release: regions, policy='recompute', a group."""
    regions = [nn.Linear(2, 2)]
    with pytest.warns(DeprecationWarning):
        with pytest.raises(ValueError, match="needs policy='recompute', got policy='auto'"):
            offload.engine(None, regions=regions, shared_inputs=object())
        with pytest.raises(TypeError, match="must be a torch.distributed process group, got True"):
            offload.engine(None, regions=regions, policy="recompute", shared_inputs=True)


def test_offload_metrics_warns_naming_the_one_path():
    import offload.integrations.prometheus as one_way
    import offload.metrics

    for name in offload.metrics.__all__:
        with pytest.warns(
            DeprecationWarning, match=rf"offload\.metrics\.{name} is deprecated.*integrations\.prometheus"
        ):
            assert getattr(offload.metrics, name) is getattr(one_way, name)
    with pytest.raises(AttributeError):
        offload.metrics.nothing  # noqa: B018 - the lookup is the test


def test_each_deprecation_points_at_the_callers_line():
    """The warning names the line to change: the caller's, not offload's (called directly here, so
    a stack level one too deep would name pytest's frame)."""
    import offload.metrics

    with pytest.warns(DeprecationWarning) as by_keyword:
        offload.engine(0, min_offload_bytes=0).close()
    with pytest.warns(DeprecationWarning) as by_seam:
        offload.engine(0, host=StandInHost()).close()
    eng = offload.engine(0)
    with pytest.warns(DeprecationWarning) as by_class:
        offload.Engine(eng.config).close()
    with pytest.warns(DeprecationWarning) as by_watch:
        eng.watch(_blocks())
    eng.close()
    with pytest.warns(DeprecationWarning) as by_module:
        offload.metrics.WAIT_BUCKETS_S  # noqa: B018 - the lookup is the test
    for caught in (by_keyword, by_seam, by_class, by_watch, by_module):
        assert [w.filename for w in caught] == [__file__], [str(w.message)[:40] for w in caught]
