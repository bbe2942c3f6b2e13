"""bench/gpu_check.sh on a machine without CUDA, and what it needs of the suite on the GPU machine.

The GPU window is short and drawn by chance, so the script must work the first time: here it is
run as CI would run it (no CUDA: exit 0 within a minute, summary.json says "cuda": false), with a
broken python (the summary is still whole JSON), and, marked slow, with every part on the CPU at
tiny sizes. The GPU machine lacks some optional extras; the suite's collection must not need them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def _load_script(name: str):
    """A script of bench/ (a directory of scripts, not a package) as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_summary = _load_script("gpu_summary")

SCRIPT = REPO_ROOT / "bench" / "gpu_check.sh"
PARTS = ["env", "probe", "step", "predict", "tests", "sanitizer", "overhead", "layers"]
FIT_SHARE = 0.6
"""Each part is designed to end within this share of its limit (FIT_PERCENT in the script)."""
DEADLINE_SHARE = 0.85
"""The pytest parts start no test past this share of their limit (DEADLINE_PERCENT in the script):
their tests take seconds, and a cold GPU machine spends much of the limit starting up."""
ABSENT_ON_THE_GPU_MACHINE = (
    "matplotlib",
    "hypothesis",
    "pytest_benchmark",
    "prometheus_client",
    "torchtune",
    "transformers",
)


def _run(out: Path, timeout: int, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=out.parent,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without CUDA")
def test_without_cuda_exits_0_within_a_minute_and_says_so(tmp_path):
    started = time.monotonic()
    proc = _run(tmp_path / "out", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - started < 60
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["cuda"] is False
    assert [p["part"] for p in summary["parts"]] == PARTS
    assert summary["parts"][0]["status"] == "ok" and {p["status"] for p in summary["parts"][1:]} == {"skipped"}
    assert summary["env"]["torch"] == torch.__version__ and summary["env"]["date_utc"]
    assert (tmp_path / "out" / "env.part.json").exists() and (tmp_path / "out" / "env.log").exists()
    markdown = (tmp_path / "out" / "summary.md").read_text()
    assert "CUDA available: False" in markdown
    assert markdown.splitlines()[2].startswith("**PASSED: 1 of 8 parts passed; skipped: probe, step,"), markdown


def test_a_broken_python_still_leaves_a_whole_summary(tmp_path):
    proc = _run(tmp_path / "out", timeout=60, PYTHON="false")
    assert proc.returncode == 1  # the env part failed
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["cuda"] is False
    assert {p["part"]: p["status"] for p in summary["parts"]}["env"] == "failed"


@pytest.mark.slow  # runs the benchmark harness or collects the suite in a subprocess
def test_collection_needs_no_optional_extra(tmp_path):
    """Collect the whole suite with the extras the GPU machine lacks made unimportable (and their
    pytest plugins, hypothesis's and pytest-benchmark's, not loaded: they are not installed there)."""
    blocker = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_ON_THE_GPU_MACHINE!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: absent on the GPU machine)")
sys.meta_path.insert(0, Block())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"]))
"""
    proc = subprocess.run(
        [sys.executable, "-c", blocker],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "error" not in proc.stdout.lower().split("\n")[-2], proc.stdout[-2000:]


def _collected_cuda_tests(paths: list[str]) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider", *paths],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return sorted(line for line in proc.stdout.splitlines() if "::" in line)


@pytest.mark.slow  # runs the benchmark harness or collects the suite in a subprocess
def test_the_tests_part_collects_every_cuda_test_and_only_their_files():
    """The tests part collects only the files the script's grep finds (collecting all of tests/
    imports transformers, lightning and dynamo): those must hold every cuda-marked test."""
    script = SCRIPT.read_text()
    grep = re.search(r"mapfile -t CUDA_TEST_FILES < <\((grep [^)]*)\)", script)
    assert grep is not None, "the tests part's file list"
    files = subprocess.run(["bash", "-c", grep.group(1)], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    paths = files.stdout.split()
    assert "tests/test_cuda.py" in paths and len(paths) < len(list((REPO_ROOT / "tests").glob("test_*.py"))) / 4
    assert _collected_cuda_tests(paths) == _collected_cuda_tests(["tests"])


DRY_RUN_LIMIT_SCALE = 20
"""The dry run's limits are the script's times this: they only catch a hang, so the test does not
depend on how busy the machine is (a load of 5-8 on 2 cores timed the predict part out)."""


@pytest.mark.slow
def test_every_part_runs_on_the_cpu_at_tiny_sizes(tmp_path):
    proc = _run(
        tmp_path / "out",
        timeout=3600,
        GPU_CHECK_DEVICE="cpu",
        GPU_CHECK_QUICK="1",
        OMP_NUM_THREADS="1",
        GPU_CHECK_LIMIT_SCALE=str(DRY_RUN_LIMIT_SCALE),
    )
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    statuses = {p["part"]: p["status"] for p in summary["parts"]}
    assert statuses == {p: "ok" for p in PARTS}, (statuses, proc.stdout[-3000:])
    assert proc.returncode == 0
    limits = _script_limits()
    assert {p["part"]: p["limit_s"] for p in summary["parts"]} == {
        part: DRY_RUN_LIMIT_SCALE * limits[part] for part in PARTS
    }, "every part runs under its limit times GPU_CHECK_LIMIT_SCALE"
    assert summary["verdict"]["passed"] == PARTS and summary["verdict"]["failed"] == {}
    step = summary["figures"]["step"]
    assert step["finished"] and {r["config"] for r in step["rows"]} >= {"none", "checkpoint", "save_on_cpu", "auto-10%"}
    assert summary["figures"]["overhead"]["per_tensor_us"] and summary["figures"]["probe"]
    assert "## Step benchmark" in (out / "summary.md").read_text()
    predicted = summary["figures"]["predict"]  # offload.predict beside the step part's measurements
    assert {r["config"] for r in predicted["rows"]} >= {"none", "checkpoint", "auto-10%"}
    assert all(r["predicted_step_ms"] > 0 for r in predicted["rows"])
    # beside each its measured figure: where the step part timed it (under load its time limit may
    # skip a configuration; the prediction then says None rather than inventing one)
    timed = {r["config"] for r in step["rows"] if r.get("step_ms") is not None}
    assert {"none", "checkpoint"} <= timed, step["rows"]
    assert {r["config"] for r in predicted["rows"] if r["measured_fwd_bwd_ms"]} == timed & {
        r["config"] for r in predicted["rows"]
    }, (predicted["rows"], step["rows"])
    assert "## Predicted beside measured" in (out / "summary.md").read_text()
    cache = json.loads((out / "cache" / "offload" / "probe.json").read_text())
    assert len(cache["link"]) == len(cache["disk"]) == 1, "the probe part measured; the step part read its figures"


def _script_limits() -> dict[str, int]:
    """Each part's limit, as the script sets it (``NAME_LIMIT_S=...``)."""
    return {m[0].lower(): int(m[1]) for m in re.findall(r"([A-Z]+)_LIMIT_S=(\d+)", SCRIPT.read_text())}


def test_every_part_has_its_limit_and_a_share_of_it_to_end_within():
    """Every part runs under a named limit; those whose work grows with the GPU's speed (step,
    overhead, layers, the pytest parts) are given a time limit of their own, ``fit``: at most
    FIT_PERCENT of the part's limit. The fixed ones (env, probe, predict) are read against that share
    in the GPU window's summary (each part's seconds beside its limit), not in a timed test."""
    script = SCRIPT.read_text()
    limits = _script_limits()
    assert set(limits) == set(PARTS) and sum(limits.values()) <= 330, limits
    assert re.search(r"^FIT_PERCENT=(\d+)$", script, re.M).group(1) == str(round(100 * FIT_SHARE))
    for part in PARTS:
        assert re.search(rf'^run_part {part} "\${part.upper()}_LIMIT_S" ', script, re.M), f"{part} runs under its limit"
    own = dict(re.findall(r'^([A-Z]+)_TIME_LIMIT_S=\$\(fit "\$([A-Z]+)_LIMIT_S" \d+\)$', script, re.M))
    assert own == {"STEP": "STEP", "OVERHEAD": "OVERHEAD", "LAYERS": "LAYERS"}
    # The pytest parts: no test started past DEADLINE_PERCENT of the limit, every test's time printed.
    assert re.search(r"^DEADLINE_PERCENT=(\d+)$", script, re.M).group(1) == str(round(100 * DEADLINE_SHARE))
    deadlines = dict(
        re.findall(r"^([A-Z]+)_DEADLINE_S=\$\(\(([A-Z]+)_LIMIT_S \* DEADLINE_PERCENT / 100\)\)$", script, re.M)
    )
    assert deadlines == {"TESTS": "TESTS", "SANITIZER": "SANITIZER"}
    timed = re.findall(r"--durations=0 (?:\\\n    )?--junitxml", script)
    assert len(timed) == 2, "each pytest part prints every test's time"
    fit = subprocess.run(
        ["bash", "-c", "FIT_PERCENT=60; fit() { echo $(($1 * FIT_PERCENT / 100 - $2)); }; fit 120 12"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(fit.stdout) == 60


def test_the_summary_says_first_which_parts_failed_and_why(tmp_path):
    """One look decides the rerun: the first lines of summary.md (and summary.json's verdict) name
    the parts that passed, and for each other its status and why: the step part's own failures,
    the failed tests, a timeout and the log's last line."""
    out = tmp_path / "out"
    (out / "step").mkdir(parents=True)

    def part(name: str, status: str, rc: int, seconds: int = 5, limit: int = 60) -> None:
        record = {"part": name, "status": status, "rc": rc, "seconds": seconds, "limit_s": limit, "output": name}
        (out / f"{name}.part.json").write_text(json.dumps(record))

    for name in ("env", "probe", "predict", "tests", "overhead"):
        part(name, "ok", 0)
    part("step", "failed", 1)
    why = "offload-25%: the first step's loss differs from the reference's"
    (out / "step" / "summary.json").write_text(json.dumps({"finished": True, "results": [], "failures": [why]}))
    part("sanitizer", "failed", 1)
    (out / "sanitizer.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0">'
        '<testcase classname="tests.test_cuda" name="test_a"><failure message="CSAN"/></testcase>'
        '<testcase classname="tests.test_cuda" name="test_b"/><testcase classname="tests.test_cuda" name="test_c"/>'
        "</testsuite></testsuites>"
    )
    part("layers", "timeout", 124, seconds=30, limit=30)
    (out / "layers.log").write_text("  linear-S: keep 1.00 ms\nlayers: interrupted after 3 of 21 cases\n\n")
    assert gpu_summary.main([str(out), "99"]) == 0
    lines = (out / "summary.md").read_text().splitlines()
    assert lines[2] == "**FAILED: 5 of 8 parts passed; failed: step, sanitizer, layers**"
    assert lines[3] == f"- step failed: {why}"
    assert lines[4] == "- sanitizer failed: 1 of 3 failed; tests.test_cuda::test_a"
    assert lines[5] == "- layers timeout: timed out at its limit of 30 s; layers: interrupted after 3 of 21 cases"
    verdict = json.loads((out / "summary.json").read_text())["verdict"]
    assert verdict["passed"] == ["env", "probe", "predict", "tests", "overhead"]
    assert verdict["failed"]["step"] == {"status": "failed", "why": [why]}


@pytest.mark.slow  # runs the benchmark harness or collects the suite in a subprocess
def test_an_interrupted_or_time_limited_layers_run_keeps_what_it_measured(tmp_path):
    """The layers part writes its JSON after every case: a time limit skips the cases that would
    not fit and says which; a SIGINT (the part's timeout) keeps every case that finished."""
    out = tmp_path / "layers.json"
    command = [sys.executable, "bench/layers.py", "--device", "cpu", "--sizes", "cpu", "--json-out", str(out)]
    limited = subprocess.run(
        command + ["--time-limit-s", "4", "--only", "linear,rmsnorm,layernorm"],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert limited.returncode == 0, limited.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert payload["finished"] and payload["rows"] and payload["skipped"], payload["skipped"]
    assert all("time limit" in why for why in payload["skipped"].values())
    out.unlink()
    proc = _interrupt_once(command, out.exists)
    assert proc.returncode == 130, proc.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert payload["finished"] is False and payload["rows"], "the cases that finished"


def test_a_failed_gradient_check_is_named_in_the_summary(tmp_path):
    """The step part's failures (offload.bench's summary.json) head its section of summary.md and
    are kept in summary.json, so a part that failed says why."""
    out = tmp_path / "out"
    (out / "step").mkdir(parents=True)
    why = "offload-25%: first-step gradients: differs 3/40 (norm 1e-03)"
    (out / "step" / "summary.json").write_text(json.dumps({"finished": True, "results": [], "failures": [why]}))
    (out / "step" / "table.md").write_text("# Step benchmark\n\nthe table\n")
    part = {"part": "step", "status": "failed", "rc": 1, "seconds": 9, "limit_s": 110, "output": "step/"}
    (out / "step.part.json").write_text(json.dumps(part))
    assert gpu_summary.main([str(out), "9"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["figures"]["step"]["failures"] == [why]
    markdown = (out / "summary.md").read_text()
    assert f"## Step benchmark\n\n- FAILED {why}\nthe table" in markdown


def _interrupt_once(command: list[str], ready, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """Run ``command`` from the checkout, send it SIGINT (what a part's ``timeout -s INT`` sends)
    once ``ready()`` is true, and wait for it to end."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        deadline = time.monotonic() + timeout_s
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # it ignored the interrupt: fail (returncode -9), do not hang the suite
            proc.kill()
            out, err = proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.mark.slow  # runs the benchmark harness or collects the suite in a subprocess
def test_an_interrupted_overhead_run_keeps_what_it_measured(tmp_path):
    out = tmp_path / "overhead.json"
    command = [sys.executable, "bench/overhead.py", "--steps", "100000", "--repeats", "2", "--warmup", "1"]
    command += ["--chain", "100", "--batch", "2", "--json-out", str(out)]
    proc = _interrupt_once(command, out.exists)
    assert proc.returncode == 130, proc.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert payload["finished"] is False and payload["per_tensor"]["variants"], "the per-tensor section it measured"
    summary_dir = tmp_path / "summary"
    summary_dir.mkdir()
    (summary_dir / "overhead.json").write_text(out.read_text())
    assert gpu_summary.main([str(summary_dir)]) == 0  # a section stopped short is no error for the summary
    assert "not measured" in (summary_dir / "summary.md").read_text()


@pytest.mark.slow  # runs the benchmark harness or collects the suite in a subprocess
def test_an_interrupted_step_run_keeps_every_finished_configuration(tmp_path):
    summary = tmp_path / "step" / "summary.json"

    def one_finished() -> bool:
        try:
            return any(r["measured_steps"] for r in json.loads(summary.read_text())["results"])
        except (OSError, ValueError, KeyError):
            return False

    command = [sys.executable, "-m", "offload.bench", "--preset", "tiny", "--in-process", "--device", "cpu"]
    proc = _interrupt_once(command + ["--steps", "50", "--out", str(tmp_path / "step")], one_finished)
    assert proc.returncode == 130, proc.stderr[-2000:]
    payload = json.loads(summary.read_text())
    assert payload["finished"] is False
    assert payload["results"][0]["config"] == "none" and payload["results"][0]["measured_steps"] == 50


def test_a_pytest_part_with_tests_left_unrun_past_its_deadline_is_incomplete(tmp_path):
    """A test skipped because its part's time was up (OFFLOAD_TEST_DEADLINE) was not checked: the
    part exits 0, but the verdict reads it "incomplete" and says how many, not "passed"."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("env", "tests", "sanitizer"):
        record = {"part": name, "status": "ok", "rc": 0, "seconds": 5, "limit_s": 60, "output": name}
        (out / f"{name}.part.json").write_text(json.dumps(record))
    deadline = '<skipped type="pytest.skip" message="not run: past the part\'s time limit (OFFLOAD_TEST_DEADLINE)"/>'
    other = '<skipped type="pytest.skip" message="needs two CUDA devices"/>'
    (out / "tests.xml").write_text(
        '<testsuites><testsuite tests="3" failures="0" errors="0" skipped="2">'
        f'<testcase classname="tests.test_cuda" name="test_a"/>'
        f'<testcase classname="tests.test_cuda" name="test_b">{deadline}</testcase>'
        f'<testcase classname="tests.test_probe" name="test_c">{other}</testcase>'
        "</testsuite></testsuites>"
    )
    (out / "sanitizer.xml").write_text(
        '<testsuites><testsuite tests="2" failures="0" errors="0" skipped="1">'
        f'<testcase classname="tests.test_cuda" name="test_a"/>'
        f'<testcase classname="tests.test_cuda" name="test_b">{other}</testcase>'
        "</testsuite></testsuites>"
    )
    assert gpu_summary.main([str(out), "9"]) == 0
    verdict = json.loads((out / "summary.json").read_text())["verdict"]
    assert verdict["passed"] == ["env", "sanitizer"]
    assert verdict["failed"] == {
        "tests": {"status": "incomplete", "why": ["1 of 3 not run: past the part's time limit"]}
    }
    assert (out / "summary.md").read_text().splitlines()[2].startswith("**FAILED: 2 of 3 parts passed; failed: tests")
    parts = {p["part"]: p["status"] for p in json.loads((out / "summary.json").read_text())["parts"]}
    assert parts == {"env": "ok", "tests": "incomplete", "sanitizer": "ok"}
