"""Every benchmark writes under out/ (or $OFFLOAD_BENCH_OUT), never over bench/results/ by accident.

The committed results are figures a reader trusts; a run of ``make bench``, ``python -m
offload.bench`` or a script in bench/ with no path given must leave them alone, and one pointed
at them must say so and stop, unless ``--overwrite-results`` asks for it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from offload.bench import measure, step

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench" / "results"
TINY = "--layers 2 --hidden 32 --heads 2 --seq 16 --batch 2 --steps 1 --warmup 0 --dtype fp32 --no-progress".split()
TINY += ["--min-offload-bytes", "0"]


def _fingerprint() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(RESULTS.iterdir())}


def _bench_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", REPO_ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory of its own and no $OFFLOAD_BENCH_OUT; the results fingerprinted around it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(measure.OUT_ENV, raising=False)
    before = _fingerprint()
    yield tmp_path
    assert _fingerprint() == before


def test_the_results_dir_is_where_the_committed_results_are():
    assert measure.RESULTS_DIR == RESULTS and (RESULTS / "README.md").is_file()


@pytest.mark.slow  # runs the benchmark harness
def test_step_benchmark_defaults_to_out_then_the_env(elsewhere, monkeypatch):
    assert step.main(TINY + ["--device", "cpu", "--in-process", "--configs", "none"]) == 0
    assert (elsewhere / "out" / "bench" / "summary.json").is_file()
    monkeypatch.setenv(measure.OUT_ENV, str(elsewhere / "mine"))
    assert step.main(TINY + ["--device", "cpu", "--in-process", "--configs", "none"]) == 0
    assert (elsewhere / "mine" / "summary.json").is_file()


@pytest.mark.parametrize("where", ["flag", "env"])
def test_step_benchmark_refuses_the_committed_results(elsewhere, monkeypatch, capsys, where):
    target = RESULTS / "a-new-run"
    argv = TINY + ["--device", "cpu", "--in-process", "--configs", "none"]
    if where == "flag":
        argv += ["--out", str(target)]
    else:
        monkeypatch.setenv(measure.OUT_ENV, str(RESULTS))
        target = RESULTS
    assert step.main(argv) == 2
    assert "--overwrite-results" in capsys.readouterr().err
    assert not (RESULTS / "a-new-run").exists() and not (RESULTS / "summary.json").exists()


def test_overwrite_results_is_the_one_way_in(tmp_path):
    assert measure.check_out(RESULTS / "layers-cpu.json", overwrite_results=True) == RESULTS / "layers-cpu.json"
    with pytest.raises(ValueError, match="--overwrite-results"):
        measure.check_out(RESULTS / "sub" / ".." / "layers-cpu.json")
    assert measure.check_out(tmp_path / "x.json") == tmp_path / "x.json"


def test_layers_report_writes_under_out_by_default(elsewhere, monkeypatch):
    """What ``make bench`` (pytest bench) ends in: the layer table's JSON, formerly
    bench/results/layers-<device>.json for a complete run."""
    layers = _bench_script("layers")
    layers.report({}, torch.device("cpu"), "test", say=lambda line: None)
    assert (elsewhere / "out" / "bench" / "layers-cpu.json").is_file()
    monkeypatch.setenv(measure.OUT_ENV, str(elsewhere / "mine"))
    layers.report({}, torch.device("cpu"), "test", say=lambda line: None)
    assert (elsewhere / "mine" / "layers-cpu.json").is_file()
    monkeypatch.setenv(measure.OUT_ENV, str(RESULTS))
    with pytest.raises(ValueError, match="committed results"):
        layers.report({}, torch.device("cpu"), "test", say=lambda line: None)


@pytest.mark.parametrize("script, committed", [("layers", "layers-cpu.json"), ("overhead", "overhead-cpu.json")])
def test_scripts_refuse_a_json_out_in_the_results_before_measuring(elsewhere, capsys, script, committed):
    module = _bench_script(script)
    with pytest.raises(SystemExit) as info:
        module.main(["--json-out", str(RESULTS / committed)])
    assert info.value.code == 2
    assert "--overwrite-results" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["whole_step", "shapes"])
def test_part_scripts_write_under_the_env_and_refuse_the_results(elsewhere, monkeypatch, capsys, script):
    module = _bench_script(script)
    monkeypatch.setenv(measure.OUT_ENV, str(elsewhere / "mine"))
    module.emit("test", "table", {"rows": []})
    assert list((elsewhere / "mine").iterdir())
    monkeypatch.setenv(measure.OUT_ENV, str(RESULTS))
    with pytest.raises(ValueError, match="committed results"):
        module.emit("test", "table", {"rows": []})


def test_the_shape_cases_script_writes_under_the_env_and_refuses_the_results(elsewhere, monkeypatch):
    """bench/shape_cases.py runs on older packages too, so it guards the results itself."""
    module = _bench_script("shape_cases")
    monkeypatch.setenv(measure.OUT_ENV, str(elsewhere / "mine"))
    assert module.write_result({"rows": []}) == (elsewhere / "mine" / "shape-cases.json").resolve()
    monkeypatch.setenv(measure.OUT_ENV, str(RESULTS))
    with pytest.raises(ValueError, match="committed results"):
        module.write_result({"rows": []})


def _backed_names() -> list[str]:
    """The file names (or glob patterns) each row of bench/results/README.md's table backs a claim
    with: its first cell's names, a bare ``.json`` / ``.png`` standing for the row's first name's."""
    names = []
    for row in (RESULTS / "README.md").read_text().splitlines():
        if not row.startswith("| [`"):
            continue
        cell = row.split(" | ", 1)[0]
        named = re.findall(r"`([^`]+)`", cell)
        stem = named[0].rsplit(".", 1)[0]
        names += [stem + n if n.startswith(".") else n for n in named]
    return names


def test_every_committed_result_backs_a_claim_the_results_readme_names():
    """One file per claim that still stands: a file in bench/results/ that no row of its README
    names is a copy or a leftover (git keeps those), and a row naming no file is stale."""
    names = _backed_names()
    files = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md")
    unbacked = [f for f in files if not any(fnmatch.fnmatch(f, n) for n in names)]
    assert unbacked == [], "results no row of bench/results/README.md names"
    missing = [n for n in names if not any(fnmatch.fnmatch(f, n) for f in files)]
    assert missing == [], "rows of bench/results/README.md naming no file"


def test_every_mutant_still_edits_the_code_it_names():
    """``bench/mutants.py`` removes each guard by replacing one piece of source text: a guard whose
    line was rewritten would go unmutated and read as "not applied" in a run nobody makes daily.
    Each piece must stand once in its file, and the test file it names must exist. (Whether that
    file still holds the test that catches it is for a run of ``bench/mutants.py`` to say.)"""
    mutants = _bench_script("mutants")
    for mutant in mutants.MUTANTS:
        source = (REPO_ROOT / mutant.path).read_text()
        assert source.count(mutant.old) == 1, (
            f"{mutant.name}: {mutant.old!r} stands {source.count(mutant.old)} times in {mutant.path}"
        )
        assert (REPO_ROOT / mutant.tests).is_file(), f"{mutant.name}: no {mutant.tests}"
