"""The public surface: argument checks, the three ways to apply an engine, stats, close, import.

Validation errors must name the argument and what was passed, so a user can fix the call from
the message alone. Every use of an engine is checked against the model without it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import offload
from zoo import assert_same, files_under, mlp, run_step, spill_files, wait_clean

REPO_ROOT = Path(__file__).resolve().parents[1]


def x_input():
    return torch.randn(16, 64)


# ---------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "bad, error",
    [
        (-1, ValueError),
        (-0.5, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (-math.inf, ValueError),
        (True, TypeError),
        (False, TypeError),
        ("512", ValueError),  # a string budget must be "auto" (issue 11)
        ("Auto", ValueError),
        ([512], TypeError),
    ],
    ids=repr,
)
def test_bad_budget_is_refused_by_name(bad, error):
    with pytest.raises(error, match="budget_mb") as info:
        offload.engine(budget_mb=bad)
    assert repr(bad) in str(info.value) or str(float(bad)) in str(info.value), "the message shows the value given"


@pytest.mark.parametrize("text, number", [("512", "512"), ("1.5", "1.5"), ("1e3", "1000")])
def test_a_budget_in_a_string_is_shown_as_the_number_it_should_be(text, number):
    with pytest.raises(ValueError, match=f"pass budget_mb={number} \\(a number, not a string\\)"):
        offload.engine(budget_mb=text)


@pytest.mark.parametrize("good", [None, 0, 0.25, 1, 512, 1e6])
def test_good_budgets_are_taken(good):
    eng = offload.engine(budget_mb=good)
    expected = None if good is None else int(good * (1 << 20))
    assert eng.config.budget_bytes == expected
    eng.close()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"host_budget_mb": -1}, "host_budget_mb"),
        ({"host_budget_mb": "1"}, "host_budget_mb"),
        ({"min_offload_bytes": -1}, "min_offload_bytes"),
        ({"min_offload_bytes": 1.5}, "min_offload_bytes"),
        ({"spill_workers": 0}, "spill_workers"),
        ({"prefetch": "yes"}, "prefetch"),
        ({"device": "not-a-device"}, "device"),
        ({"device": "meta"}, "device"),
        ({"spill_dir": 42}, "spill_dir"),
    ],
    ids=lambda v: repr(v),
)
def test_other_bad_arguments_are_refused_by_name(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        offload.engine(**kwargs)


def test_spill_dir_that_is_a_file_is_refused_with_its_path(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    with pytest.raises(ValueError, match="spill_dir") as info:
        offload.engine(0, spill_dir=path)
    assert str(path) in str(info.value)


def test_unwritable_spill_dir_is_refused_with_its_path(tmp_path):
    path = tmp_path / "read-only"
    path.mkdir()
    path.chmod(0o500)
    try:
        if os.access(path, os.W_OK):
            pytest.skip("this process ignores directory permissions (root)")
        with pytest.raises(ValueError, match="spill_dir") as info:
            offload.engine(0, spill_dir=path)
        assert str(path) in str(info.value)
    finally:
        path.chmod(0o700)


@pytest.mark.parametrize("under", [False, True], ids=["the-dir", "a-parent"])
def test_spill_dir_through_a_dangling_symlink_is_refused_with_its_path(under, tmp_path):
    """A symlink whose target is gone reads as missing, yet no spill could ever make it: refused at
    construction, naming the link, its target and the fix, whether it is spill_dir or a parent."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    path = link / "spill" if under else link
    with pytest.raises(ValueError, match="spill_dir") as info:
        offload.engine(0, spill_dir=path)
    message = str(info.value)
    assert str(path) in message and str(tmp_path / "gone") in message, message
    assert "symbolic link" in message and "create its target" in message, message
    # which path is the link: spill_dir itself, or the parent named as such
    assert (f"its parent {str(link)!r} is a symbolic link" in message) is under, message
    assert (f"{str(path)!r} is a symbolic link" in message) is not under, message
    assert not (tmp_path / "gone").exists(), "checking the settings made nothing"


def test_missing_spill_dir_is_created_private(tmp_path):
    """Made by the first spill (not by checking the settings), private, and gone with close():
    tests/test_spill_security.py::test_a_missing_spill_dir_is_made_when_needed_and_removed_at_close."""
    path = tmp_path / "new" / "spill"
    eng = offload.engine(0, min_offload_mb=0, spill_dir=path)
    run_step(mlp(), x_input, eng)
    assert path.is_dir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    eng.close()
    assert not path.parent.exists()


# ---------------------------------------------------------------------------------- ways to apply


def test_context_manager_and_backward_outside(spill_dir):
    model = mlp()
    ref = run_step(copy.deepcopy(model), x_input)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    got = run_step(model, x_input, eng)  # forward in `with eng`, backward after it
    assert_same(ref, got)
    assert eng.stats.offloaded_bytes > 0
    eng.close()


def test_decorated_function(spill_dir):
    model = mlp()
    ref = run_step(copy.deepcopy(model), x_input, loss_fn=torch.sum)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)

    @eng
    def forward(x):
        return model(x)

    assert forward.__name__ == "forward"
    got = run_step(_Call(forward, model), x_input, loss_fn=torch.sum)
    assert_same(ref, got)
    assert eng.stats.offloaded_bytes > 0
    eng.close()


class _Call(nn.Module):
    """Calls ``fn`` as its forward, owning ``model``'s parameters under the same names."""

    def __init__(self, fn, model):
        super().__init__()
        self.fn = fn
        for name, child in model.named_children():
            self.add_module(name, child)

    def forward(self, x):
        return self.fn(x)


def test_decorated_module(spill_dir):
    model = mlp()
    ref = run_step(copy.deepcopy(model), x_input, loss_fn=torch.sum)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    assert eng(model) is model
    got = run_step(model, x_input, loss_fn=torch.sum)  # no `with`: the module's forward enters it
    assert_same(ref, got)
    stats = eng.stats
    assert stats.offloaded_bytes > 0
    assert stats.saved_tensors > 0
    eng.close()


def test_decorated_forward_method(spill_dir):
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = mlp()

        @eng
        def forward(self, x):
            return self.body(x)

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = mlp()

        def forward(self, x):
            return self.body(x)

    ref = run_step(Plain(), x_input, loss_fn=torch.sum)
    got = run_step(Net(), x_input, loss_fn=torch.sum)
    assert_same(ref, got)
    assert eng.stats.offloaded_bytes > 0
    eng.close()


def test_the_decorator_form_gives_the_engine_back(spill_dir):
    """``model = offload.engine(...)(model)`` leaves no name for the engine: the module (and the
    wrapped function) carry it as ``offload_engine``, to read its stats and close it."""
    model = mlp()
    ref = run_step(copy.deepcopy(model), x_input, loss_fn=torch.sum)
    model = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)(model)
    eng = model.offload_engine
    assert isinstance(eng, offload.Engine)
    assert model.forward.offload_engine is eng
    got = run_step(model, x_input, loss_fn=torch.sum)
    assert_same(ref, got)
    assert eng.stats.offloaded_bytes > 0 and eng.stats.saved_tensors > 0
    assert not hasattr(copy.deepcopy(model), "offload_engine")  # a copy carries no engine: tests/test_copies.py
    assert "offload_engine" not in model.state_dict() and "offload_engine" not in dict(model.named_modules())
    eng.close()
    assert files_under(spill_dir) == []
    with pytest.raises(offload.OffloadError, match="closed"):  # what the engine cannot do, as backward after close
        model(x_input())


def test_a_decorated_function_gives_the_engine_back():
    eng = offload.engine(0)

    @eng
    def step(x):
        return x * 2

    assert step.offload_engine is eng
    eng.close()


def test_decorating_something_else_is_refused():
    eng = offload.engine(0)
    with pytest.raises(TypeError, match="offload engine"):
        eng(42)
    eng.close()


def test_engine_nests_and_reenters(spill_dir):
    """The same engine entered twice (nested) and then again: the hooks come off exactly once each."""
    model = mlp()
    ref = run_step(copy.deepcopy(model), x_input)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    with eng:
        got = run_step(model, x_input, eng)
    assert_same(ref, got)
    before = eng.stats.saved_tensors
    torch.tanh(torch.randn(64, 64, requires_grad=True) * 2).sum().backward()  # outside: not seen
    assert eng.stats.saved_tensors == before
    eng.close()


# ---------------------------------------------------------------------------------- stats


def test_stats_snapshot_to_dict_and_reset(spill_dir):
    model = mlp()
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    run_step(model, x_input, eng)
    stats = eng.stats
    assert isinstance(stats, offload.Stats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.saved_bytes = 0
    as_dict = stats.to_dict()
    assert as_dict == {f.name: getattr(stats, f.name) for f in dataclasses.fields(offload.Stats)}
    assert as_dict["saved_bytes"] > 0 and as_dict["offloaded_bytes"] == as_dict["saved_bytes"]
    # Budget 0: every pack waits for its tensor's write to land, and the first reload is a miss
    # that waits for its read; both waits are timed.
    assert stats.evict_wait_ms > 0 and stats.reload_wait_ms > 0 and stats.prefetch_misses > 0
    eng.reset_stats()
    after = eng.stats
    assert after.saved_bytes == after.offloaded_bytes == after.saved_tensors == 0
    assert after.peak_resident_bytes == after.resident_bytes == 0
    run_step(model, x_input, eng)
    assert eng.stats.saved_bytes == stats.saved_bytes, "a second step counts the same bytes from zero"
    eng.close()


def test_reset_stats_keeps_current_gauges(spill_dir):
    eng = offload.engine(None, min_offload_mb=0, spill_dir=spill_dir)
    w = torch.randn(64, 64, requires_grad=True)
    with eng:
        y = torch.tanh(w * 2)  # tanh's output stays saved while y's graph lives
    resident = eng.stats.resident_bytes
    assert resident == 64 * 64 * 4
    eng.reset_stats()
    stats = eng.stats
    assert stats.resident_bytes == resident and stats.peak_resident_bytes == resident
    assert stats.saved_bytes == 0
    del y
    wait_clean(eng)
    eng.close()


def test_repr_names_budget():
    eng = offload.engine(2)
    assert "2 MB" in repr(eng)
    eng.close()


# ---------------------------------------------------------------------------------- close


def test_close_removes_the_spill_file(spill_dir):
    """Changed with the nameless spill file (issue 47, item 4): nothing is in spill_dir while the
    engine spills; close() closes the file, which the disk then frees."""
    model = mlp()
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    with eng:
        loss = model(torch.randn(16, 64)).sum()
    assert spill_files(spill_dir), "budget 0: the activations are in the spill file now"
    assert list(spill_dir.iterdir()) == [], "the file has no name there"
    eng.close()
    assert spill_files(spill_dir) == [], "close() closes the spill file"
    eng.close()  # idempotent
    with pytest.raises(offload.OffloadError, match="closed"):
        with eng:
            pass
    del loss
    assert list(spill_dir.iterdir()) == []


def test_engine_collected_removes_the_spill_file(spill_dir):
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    with eng:
        loss = mlp()(torch.randn(16, 64)).sum()
    assert spill_files(spill_dir) and files_under(spill_dir) == []
    del loss, eng
    import gc

    gc.collect()
    assert spill_files(spill_dir) == [] and files_under(spill_dir) == []


# ---------------------------------------------------------------------------------- import


def _python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with this checkout importable."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_import_does_not_initialize_cuda():
    code = "import offload, torch; assert not torch.cuda.is_initialized(), 'import offload initialized CUDA'"
    done = _python(code)
    assert done.returncode == 0, done.stderr


def test_making_and_using_a_cpu_engine_does_not_initialize_cuda():
    code = (
        "import offload, torch\n"
        "eng = offload.engine(0, min_offload_mb=0)\n"
        "w = torch.randn(64, 64, requires_grad=True)\n"
        "with eng:\n"
        "    loss = torch.tanh(w * 2).sum()\n"
        "loss.backward()\n"
        "print(eng.stats.offloaded_bytes)\n"
        "eng.close()\n"
        "assert not torch.cuda.is_initialized(), 'a CPU engine initialized CUDA'\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) > 0


def test_unknown_keyword_lists_every_valid_one_and_the_closest():
    """The list is every keyword engine() takes, its own (budget_mb, model, regions, machine, link,
    memory) and Config's options, read from the signatures; the closest match is named."""
    import inspect

    with pytest.raises(TypeError) as info:
        offload.engine(budget_mb=1, regoins="auto")
    message = str(info.value)
    assert "'regoins' (did you mean 'regions'?)" in message
    expected = list(inspect.signature(offload.engine).parameters)
    assert {"budget_mb", "model", "regions", "machine", "seams", "policy", "reserve_mb"} <= set(expected)
    listed = message.split("valid keywords: ", 1)[1].split(", ")
    assert sorted(listed) == sorted(expected)


def test_unknown_keyword_to_the_decorator_form_names_the_closest():
    with pytest.raises(TypeError, match=r"'min_offload_m' \(did you mean 'min_offload_mb'\?\)"):
        offload.engine(budget_mb=1, min_offload_m=0)(torch.nn.Linear(2, 2))


def test_unknown_keyword_far_from_any_names_none():
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) 'zzz'; valid keywords: budget_mb, "):
        offload.engine(zzz=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is missing")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_on_a_machine_without_it_is_refused(device):
    """Not an engine that passes every save through and manages nothing: the error names what is
    here and the fix."""
    with pytest.raises(
        ValueError, match=r"no CUDA device .*this machine has cpu: pass one of them \(e\.g\. device='cpu'\)"
    ):
        offload.engine(0, device=device)
    assert not torch.cuda.is_initialized()


def test_a_cuda_index_past_the_last_device_is_refused(monkeypatch):
    """cuda:3 on a one-GPU machine (the driver's count stood in for on this CPU box)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(
        ValueError, match=r"device='cuda:3': there is no CUDA device 3; this machine has cpu, cuda:0: pass"
    ):
        offload.engine(0, device="cuda:3")
    offload.engine(0, device="cuda:0").close()  # the one that is there is taken


def test_an_unsupported_device_type_names_what_is_here():
    with pytest.raises(ValueError, match=r"device='mps': type 'mps' is not supported.*this machine has cpu"):
        offload.engine(0, device="mps")


def test_a_step_whose_saves_are_all_small_says_so_once(spill_dir):
    """Every save under min_offload_mb (64 KiB by default): the engine manages nothing; a
    warning names the option once per engine, and explain() says so while it holds."""
    import warnings

    model = mlp(width=16)
    ref = run_step(copy.deepcopy(model), lambda: torch.randn(4, 16))
    eng = offload.engine(0, spill_dir=spill_dir)
    with pytest.warns(
        UserWarning, match=r"every one under min_offload_mb=0.0625 MiB \(65536 bytes\).*min_offload_mb=0"
    ):
        got = run_step(model, lambda: torch.randn(4, 16), eng)
    assert_same(ref, got)
    assert eng.stats.saved_tensors == 0
    assert "under min_offload_mb=0.0625 MiB" in offload.explain(eng)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_step(model, lambda: torch.randn(4, 16), eng)  # once per engine: no second warning
    eng.close()


def test_a_step_with_managed_saves_does_not_warn(spill_dir):
    import warnings

    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_step(mlp(width=16), lambda: torch.randn(4, 16), eng)
    assert eng.stats.saved_tensors > 0
    assert "min_offload_mb" not in offload.explain(eng)
    eng.close()


def test_explain_without_regions_says_what_the_engine_does(spill_dir):
    """Not "no plan yet" for ever: an engine without regions decides per saved tensor, and says so
    with its figures so far."""
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir)
    run_step(mlp(), x_input, eng)
    text = offload.explain(eng)
    assert "no regions=" in text and "no plan yet" not in text
    stats = eng.stats
    assert f"{stats.saved_tensors} tensors" in text and f"{stats.offloaded_bytes / 2**20:.1f} MB moved" in text
    assert "budget of 0 MB" in text and "regions='auto'" in text
    eng.close()


def test_explain_of_a_policy_that_measures_nothing(spill_dir):
    model = mlp()
    eng = offload.engine(None, model=model, regions=[model[0], model[2]], policy="recompute", spill_dir=spill_dir)
    run_step(model, x_input, eng)
    text = offload.explain(eng)
    assert "policy 'recompute' measures nothing" in text and "2 regions is recomputed" in text
    eng.close()


def test_a_bad_host_cap_names_what_none_and_0_mean_for_it():
    """Not the budget's meanings: for the host cap 0 sends everything past the device to disk."""
    with pytest.raises(ValueError, match=r"host_budget_mb must be .*got -5.0; use None for no cap .* 0 to send every"):
        offload.engine(0, host_budget_mb=-5)
    with pytest.raises(ValueError, match=r"budget_mb must be .*got -1.0; use None for no limit or 0 to move every"):
        offload.engine(-1)
