"""The step benchmark's plumbing at a tiny size: outputs, columns, the last-line JSON, losses.

The benchmark's numbers are not checked here (bench/ is where timing lives); what is checked is
that every configuration trains the same model on the same batches, that the engine's losses equal
the reference's exactly in fp32, and that the files it promises are written.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload.bench import loop, measure, report, step
from offload.bench.config import parse_variant
from zoo import most_profiling_steps

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--seq",
    "16",
    "--batch",
    "2",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--dtype",
    "fp32",
    "--min-offload-bytes",
    "0",
    "--no-progress",
]
"""2 blocks of width 32: seconds per configuration. min_offload_bytes=0 so the engine moves the
tiny tensors instead of passing them through, and the losses comparison means something."""


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads, and on a busy machine idle-spinning OpenMP threads
    are what makes them slow; the benchmark proper keeps torch's default."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # runs the benchmark harness
def test_in_process_run_writes_everything(tmp_path, capsys):
    configs = ["none", "offload-25%", "auto-25%", "recompute"]
    code = step.main(TINY + ["--device", "cpu", "--in-process", "--configs", ",".join(configs), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0

    payload = _last_json(out)
    assert payload["benchmark"] == "step"
    assert {"date_utc", "torch", "python", "host_cpu", "offload"} <= set(payload["env"])
    results = {r["config"]: r for r in payload["results"]}
    assert list(results) == configs
    for name in configs[1:]:
        assert results[name]["losses_match"] is True, (name, results[name])
        assert results[name]["error"] is None
    assert results["none"]["losses_match"] is None
    assert results["offload-25%"]["offloaded_mb"] > 0  # the budget made it move something
    assert results["offload-25%"]["budget_mb"] == pytest.approx(0.25 * results["none"]["saved_mb"])
    assert results["recompute"]["recomputed_regions"] == 2

    rows = _read_csv(tmp_path / "metrics.csv")
    assert tuple(rows[0]) == report.CSV_COLUMNS
    assert len(rows) == len(configs) * 3  # (1 warm-up + 2 measured) per configuration
    assert [r["config"] for r in rows] == [c for c in configs for _ in range(3)]
    reference = [float(r["loss"]) for r in rows if r["config"] == "none"]
    for name in configs[1:]:
        assert [float(r["loss"]) for r in rows if r["config"] == name] == reference
        assert {r["loss_match"] for r in rows if r["config"] == name} == {"1"}
    assert all(float(r["peak_mb"]) > 0 and float(r["step_ms"]) > 0 for r in rows)

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "plan" in summary["runs"]["auto-25%"][0]["summary"]
    assert summary["runs"]["offload-25%"][0]["summary"]["trace"][0]["phase"] == "fwd0"
    assert (tmp_path / "table.md").read_text().startswith("# Step benchmark")

    table = out[: out.rindex("{")]
    assert "config" in table and "offload-25%" in table and "equal" in table
    plot = tmp_path / "step.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert payload["plot"] == str(plot) and plot.stat().st_size > 0
    else:
        assert payload["plot"] is None and not plot.exists()


@pytest.mark.slow
def test_each_configuration_in_its_own_process(tmp_path):
    """The real path (CPU): python -m offload.bench spawns one child per configuration and collects JSON lines."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "offload.bench",
            *TINY,
            "--device",
            "cpu",
            "--configs",
            "none,offload-50%",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = _last_json(proc.stdout)
    assert [r["losses_match"] for r in payload["results"]] == [None, True]
    assert payload["machine"]["device_type"] == "cpu"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "spill page cache" in summary["runs"]["offload-50%"][0]["summary"]["peak_source"]
    assert len(_read_csv(tmp_path / "metrics.csv")) == 2 * 3


@pytest.mark.slow  # runs the benchmark harness
def test_a_failing_configuration_is_tabled_and_the_rest_run(tmp_path, capsys, monkeypatch):
    real_run_one = loop.run_one

    def run_one(run, variant, *args, **kwargs):
        if variant.name == "checkpoint":
            raise RuntimeError("injected failure")
        return real_run_one(run, variant, *args, **kwargs)

    monkeypatch.setattr(loop, "run_one", run_one)
    code = step.main(
        TINY + ["--device", "cpu", "--in-process", "--configs", "none,checkpoint,save_on_cpu", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 1
    results = {r["config"]: r for r in _last_json(out)["results"]}
    assert "injected failure" in results["checkpoint"]["error"]
    assert results["save_on_cpu"]["losses_match"] is True
    assert "FAILED: RuntimeError: injected failure" in out


class _JobClock:
    """``step``'s clock, made to stand still except while a configuration runs, which takes
    ``job_s``: what the time limit decides then depends on these numbers, not on the machine's load."""

    def __init__(self, job_s: float) -> None:
        self.now_s, self.job_s = 0.0, job_s

    def perf_counter(self) -> float:
        return self.now_s


@pytest.mark.slow  # runs the benchmark harness
def test_a_time_limit_skips_what_would_not_fit_and_still_reports(tmp_path, capsys, monkeypatch):
    """--time-limit-s: the first configuration runs; one that would end past the limit (judged by
    the longest so far) is skipped with the rest, tabled as such; the run still writes and reports."""
    clock = _JobClock(job_s=10.0)
    real_run_job = step._run_job

    def run_job(*args, **kwargs):
        clock.now_s += clock.job_s
        return real_run_job(*args, **kwargs)

    monkeypatch.setattr(step, "time", clock)
    monkeypatch.setattr(step, "_run_job", run_job)
    limit_s = step.FINAL_WRITE_S + 1.5 * clock.job_s  # room for the first configuration, not for a second
    argv = TINY + ["--device", "cpu", "--in-process", "--configs", "none,checkpoint,save_on_cpu"]
    code = step.main(argv + ["--time-limit-s", str(limit_s), "--out", str(tmp_path)])
    payload = _last_json(capsys.readouterr().out)
    assert code == 0 and payload["finished"] and payload["failures"] == []
    results = {r["config"]: r for r in payload["results"]}
    assert results["none"]["measured_steps"] > 0 and results["none"]["skipped"] is None
    for name in ("checkpoint", "save_on_cpu"):
        assert "time limit" in results[name]["skipped"], results[name]
    assert json.loads((tmp_path / "summary.json").read_text())["finished"]


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        step.main(["--help"])
    assert exit_info.value.code == 0
    assert "offload-25%" in capsys.readouterr().out


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert step.main(["--configs", "none,bogus", "--out", str(tmp_path)]) == 2
    assert "bogus" in capsys.readouterr().err
    assert step.main(["--hidden", "30", "--heads", "4", "--out", str(tmp_path)]) == 2
    capsys.readouterr()
    names_nothing = ["--preset", "tiny", "--in-process", "--configs", ",", "--out", str(tmp_path / "none")]
    assert step.main(names_nothing) == 2  # an error, not the preset's whole set
    assert "names no configuration" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()  # nothing ran


def test_bool_settings_are_switches():
    with pytest.raises(SystemExit) as exit_info:
        step.main(["--deterministic", "False"])  # a switch: "False" is not read as a truthy string
    assert exit_info.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_cuda_preset_skips_cleanly_without_cuda(tmp_path, capsys):
    assert step.main(["--preset", "h200", "--out", str(tmp_path)]) == 0
    assert "skipped" in _last_json(capsys.readouterr().out)


def test_import_leaves_matplotlib_alone():
    code = "import sys, offload.bench; assert 'matplotlib' not in sys.modules, 'offload.bench imported matplotlib'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tiny_run_losses_match(tmp_path, capsys):
    configs = ["none", "checkpoint", "save_on_cpu", "offload-25%", "recompute"]
    code = step.main(
        TINY
        + [
            "--device",
            "cuda",
            "--deterministic",
            "--in-process",
            "--configs",
            ",".join(configs),
            "--out",
            str(tmp_path),
        ]
    )
    payload = _last_json(capsys.readouterr().out)
    assert code == 0
    results = {r["config"]: r for r in payload["results"]}
    for name in configs[1:]:
        assert results[name]["losses_match"] is True, (name, results[name])
    assert results["offload-25%"]["offloaded_mb"] > 0
    assert results["offload-25%"]["grads"] == "equal"
    assert payload["env"]["gpu"]


@pytest.mark.slow  # runs the benchmark harness
def test_tiny_preset_runs_every_h200_configuration(tmp_path, capsys):
    """The h200 preset's configuration list at a tiny shape: every code path the GPU run takes, as
    far as the CPU allows; gradients of the first step equal the reference's in every one.

    Only what cannot depend on timing or on the machine's load is asserted: a memory peak read in
    process can read 0 on a busy machine (so its ratio None), and figures are bench/'s business;
    how the ratios are computed is checked with made-up numbers below."""
    # As many warm-up steps as auto may profile (its trials a second round where their noise
    # decides the plan): every budget then has a timed auto step to judge.
    warmup = ["--warmup", str(most_profiling_steps("auto"))]
    code = step.main(["--preset", "tiny", "--in-process", "--out", str(tmp_path), *warmup])
    payload = _last_json(capsys.readouterr().out)
    assert code == 0
    results = {r["config"]: r for r in payload["results"]}
    expected = {"none", "checkpoint", "save_on_cpu", "torchtune"} | {
        f"{p}-{b}%" for p in ("offload", "recompute", "auto") for b in (100, 50, 25, 10)
    }
    assert expected <= set(results)
    assert results["torchtune"]["skipped"] and results["torchtune"]["error"] is None  # not importable, or no CUDA
    for name, r in results.items():
        if name not in ("none", "torchtune"):
            assert r["error"] is None and r["grads"] == "equal" and r["losses_match"] is True, (name, r)
    assert results["offload-10%"]["link_ms"] > 0 and results["offload-10%"]["bound_ms"] > 0
    assert results["checkpoint"]["recompute_ms"] > 0  # every block re-runs: the bound charges it
    assert results["offload-10%"]["d2h_gb_per_s"] is None  # no side-stream busy time on the CPU
    assert [v["fraction"] for v in payload["verdicts"]["verdicts"]] == [1.0, 0.5, 0.25, 0.1]


def test_selective_joins_the_comparison_once_registered(monkeypatch):
    from offload.bench import config

    assert any(v.policy == "selective" for v in config.engine_variants())  # registered since issue #10
    monkeypatch.setattr(config.offload, "policies", lambda: ("auto", "none", "offload", "recompute", "selective"))
    assert {v.name for v in config.engine_variants() if v.policy == "selective"} == {
        "selective-100%",
        "selective-50%",
        "selective-25%",
        "selective-10%",
    }
    assert config.parse_variant("selective-25%").policy == "selective"


def test_variant_names_round_trip():
    for name in (
        "none",
        "checkpoint",
        "save_on_cpu",
        "torchtune",
        "count",
        "recompute",
        "offload-25%",
        "auto-10%+compile",
        "none+compile",
    ):
        assert parse_variant(name).name == name
    with pytest.raises(ValueError, match="bogus.*valid"):
        parse_variant("bogus-25%")


def test_grad_checksums_see_one_ulp():
    a = torch.nn.Linear(4, 4)
    a.weight.grad = torch.ones(4, 4)
    reference = loop.grad_checksums(a)
    a.weight.grad[2, 3] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    changed = loop.grad_checksums(a)
    assert changed["weight"] != reference["weight"] and changed["bias"] == reference["bias"] is None
    assert report._grads_verdict({"checksums": reference}, {"checksums": reference}) == "equal"
    assert report._grads_verdict({"checksums": changed}, {"checksums": reference}).startswith("differs 1/2")
    assert (
        report._grads_verdict({"error": "RuntimeError: x"}, {"checksums": reference}) == "check failed: RuntimeError: x"
    )


def test_memory_counts_the_spill_files_page_cache(tmp_path):
    """A byte parked in the spill directory's page cache is still memory: the figure counts it."""
    from offload.bench.pagecache import cached_bytes_under

    memory = measure.Memory(torch.device("cpu"), str(tmp_path))
    memory.reset()
    (tmp_path / "spill.bin").write_bytes(b"x" * (8 << 20))
    cached = cached_bytes_under(str(tmp_path))
    if not cached:
        pytest.skip("no page-cache reading on this platform (or the file was not cached)")
    before = memory.peak()
    memory.sample_cache()
    assert memory.peak() - before == cached
    assert memory.current() >= cached


def test_pareto_front():
    points = [
        (10.0, 100.0, "none"),
        (20.0, 50.0, "a"),
        (15.0, 120.0, "worse"),
        (30.0, 50.0, "same-slower"),
        (40.0, 10.0, "b"),
    ]
    assert [p[2] for p in report.pareto_front(points)] == ["none", "a", "b"]


def _step(**fields) -> dict:
    base = {
        "type": "step",
        "warmup": False,
        "loss": 1.0,
        "step_ms": 10.0,
        "cpu_ms": 10.0,
        "opt_ms": 1.0,
        "peak_bytes": 100 * MB,
        "act_peak_bytes": 40 * MB,
        "opt_peak_bytes": 2 * MB,
    }
    return base | fields


MB = 1 << 20


def test_link_rates_and_the_bound_from_the_engine_stats():
    """Achieved GB/s come from Stats.d2h_busy_ms / h2d_busy_ms when the engine reports them (else
    '-'); the bound is max(compute + recomputed blocks x forward per block, bytes / probed GB/s)."""
    from offload.bench.config import RunSettings

    run = RunSettings(layers=4, device="cuda")
    machine = __import__("offload").MachineProfile(device_type="cuda", d2h_gb_per_s=10.0, h2d_gb_per_s=20.0)
    ref = _step(step_ms=100.0, block_forward_ms=20.0)
    moved = dict(offloaded_bytes=2 * 10**9, reloaded_bytes=2 * 10**9, reload_wait_ms=3.0, evict_wait_ms=1.0)
    results = {
        "none": [{"steps": [ref], "summary": {"activation_bytes": 400 * MB}, "error": None, "skipped": None}],
        "offload-25%": [
            {
                "steps": [_step(step_ms=350.0, recomputed_regions=0, d2h_busy_ms=250.0, h2d_busy_ms=100.0, **moved)],
                "summary": {"budget_mb": 100.0},
                "error": None,
                "skipped": None,
            }
        ],
        "auto-25%": [
            {
                "steps": [_step(step_ms=150.0, recomputed_regions=2, offloaded_bytes=0, reloaded_bytes=0)],
                "summary": {"budget_mb": 100.0},
                "error": None,
                "skipped": None,
            }
        ],
    }
    rows = {r["config"]: r for r in report.summarize(run, [parse_variant(n) for n in results], results, machine)}
    offloaded = rows["offload-25%"]
    assert offloaded["d2h_gb_per_s"] == pytest.approx(8.0) and offloaded["h2d_gb_per_s"] == pytest.approx(20.0)
    assert offloaded["link_ms"] == pytest.approx(200.0 + 100.0) and offloaded["bound_ms"] == pytest.approx(300.0)
    assert offloaded["exposed_wait_ms"] == pytest.approx(4.0) and offloaded["over_bound"] == pytest.approx(350 / 300)
    assert rows["auto-25%"]["bound_ms"] == pytest.approx(100.0 + 2 * 20.0 / 4)
    assert rows["auto-25%"]["d2h_gb_per_s"] is None  # no busy time reported: the table prints '-'
    assert rows["offload-25%"]["act_ratio"] == pytest.approx(1.0)  # 40 MB of activations each
    results["none"][0]["steps"] = [_step(step_ms=100.0, block_forward_ms=20.0, act_peak_bytes=0)]
    rows = {r["config"]: r for r in report.summarize(run, [parse_variant(n) for n in results], results, machine)}
    assert rows["offload-25%"]["act_ratio"] is None, "a reference peak that read 0 gives no ratio, not a failure"
    assert rows["offload-25%"]["bound_ms"] == pytest.approx(300.0), "the rest of the row stands"
    assert "-" in report.main_table(list(rows.values()), "cuda")


def test_every_repeat_is_held_to_the_reference():
    """Each repeat runs in a process of its own: one that trained differently fails the run, not
    only the first (the demo once tabled "equal" over a second repeat whose every loss differed)."""
    from offload.bench.config import RunSettings

    run = RunSettings(layers=4, repeats=3)
    same = {"checksums": {"w": [1, 2.0]}}
    other = {"checksums": {"w": [1, 2.000001]}}

    def repeat(loss: float, check: dict) -> dict:
        return {
            "steps": [_step(loss=1.0), _step(loss=loss)],
            "summary": {"grad_check": check},
            "error": None,
            "skipped": None,
        }

    results = {
        "none": [repeat(0.5, same) for _ in range(3)],
        "offload-25%": [repeat(0.5, same), repeat(0.5 + 2**-20, other), repeat(0.5, same)],
        "auto-25%": [repeat(0.5, same) for _ in range(3)],
    }
    rows = {r["config"]: r for r in report.summarize(run, [parse_variant(n) for n in results], results, None)}
    assert rows["auto-25%"]["losses_match"] is True and rows["auto-25%"]["grads"] == "equal"
    assert rows["offload-25%"]["losses_match"] is False and rows["offload-25%"]["max_loss_diff"] == 2**-20
    assert rows["offload-25%"]["grads"].startswith("differs 1/1")
    assert rows["none"]["losses_match"] is None and rows["none"]["grads"] == "ref"
    assert report.failures(list(rows.values())) == [
        f"offload-25%: first-step gradients: {rows['offload-25%']['grads']}"
    ]
    # the reference's own repeats are held to its first
    results["none"][2] = repeat(0.5 + 2**-20, other)
    rows = {r["config"]: r for r in report.summarize(run, [parse_variant(n) for n in results], results, None)}
    assert rows["none"]["losses_match"] is False and rows["none"]["grads"].startswith("repeats differ: differs")
    assert any(
        line.startswith("none: first-step gradients: repeats differ") for line in report.failures(list(rows.values()))
    )


def test_the_optimizer_steps_on_one_thread_on_the_cpu(monkeypatch):
    """Configurations are compared loss for loss across processes, and a two-thread AdamW update
    parted between processes: the bench steps the optimizer on one thread, then gives the rest back."""
    from offload.bench.config import RunSettings

    torch.set_num_threads(2)  # what the demo runs with (the autouse fixture restores it)
    seen = []
    real = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    run = RunSettings(layers=2, hidden=32, heads=2, seq=16, batch=2, steps=1, warmup=0, dtype="fp32", device="cpu")
    trainer = loop.Trainer(run, parse_variant("none"), torch.randint(0, 256, (4096,)), torch.device("cpu"))
    trainer.step()
    assert seen == [1] and torch.get_num_threads() == 2


@pytest.mark.slow  # runs the benchmark harness
def test_the_gradient_check_sees_a_wrong_reload(tmp_path, capsys, monkeypatch):
    """A context that hands back saved tensors slightly changed must read "differs", not "equal"."""
    real = loop._make_context

    def corrupting(trainer, *args):
        context, engine = real(trainer, *args)
        if trainer.variant.kind.value != "engine":
            return context, engine

        def scaled(t):
            return t * 1.001 if t.is_floating_point() else t

        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, scaled)
        return (lambda: _both(context(), hooks)), engine

    monkeypatch.setattr(loop, "_make_context", corrupting)
    code = step.main(
        TINY + ["--device", "cpu", "--in-process", "--configs", "none,offload-25%", "--out", str(tmp_path)]
    )
    captured = capsys.readouterr()
    payload = _last_json(captured.out)
    (offloaded,) = [r for r in payload["results"] if r["config"] == "offload-25%"]
    assert offloaded["grads"].startswith("differs") and offloaded["losses_match"] is False
    assert code == 1, "a gradient mismatch fails the run"
    assert payload["failures"] == [f"offload-25%: first-step gradients: {offloaded['grads']}"]
    assert json.loads((tmp_path / "summary.json").read_text())["failures"] == payload["failures"]
    assert "FAILED offload-25%: first-step gradients: differs" in captured.err


@pytest.mark.slow  # runs the benchmark harness
def test_a_gradient_check_that_raised_fails_the_run(tmp_path, capsys, monkeypatch):
    """A check that raised (strict determinism refusing a kernel, CUDA out of memory) is no pass."""
    real, calls = loop.grad_checksums, []

    def out_of_memory_after_the_reference(model):
        calls.append(1)
        if len(calls) > 1:  # the reference's check ran first
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model)

    monkeypatch.setattr(loop, "grad_checksums", out_of_memory_after_the_reference)
    code = step.main(
        TINY + ["--device", "cpu", "--in-process", "--configs", "none,offload-25%", "--out", str(tmp_path)]
    )
    payload = _last_json(capsys.readouterr().out)
    assert code == 1
    assert payload["failures"] == [
        "offload-25%: first-step gradients: check failed: OutOfMemoryError: CUDA out of memory. "
        "Tried to allocate 2.00 GiB"
    ]


@contextlib.contextmanager
def _both(outer, inner):
    with outer, inner:
        yield


def test_a_loss_that_differs_fails_the_run():
    """The gradient check's loss is held to the reference's as its gradients are, and so is the
    first timed step's loss (the same forward in every configuration): either differing fails."""
    from offload.bench.config import RunSettings

    run = RunSettings(layers=4)
    check = {"checksums": {"w": [1, 2.0]}, "loss": 3.5}

    def one(first_loss: float, check: dict) -> list[dict]:
        steps = [_step(loss=first_loss), _step(loss=0.5)]
        return [{"steps": steps, "summary": {"grad_check": check}, "error": None, "skipped": None}]

    results = {
        "none": one(1.0, check),
        "offload-25%": one(1.0, check | {"loss": 3.5 + 2**-20}),
        "auto-25%": one(1.0 + 2**-20, check),
        "recompute-25%": one(1.0, check),
    }
    rows = {r["config"]: r for r in report.summarize(run, [parse_variant(n) for n in results], results, None)}
    assert rows["offload-25%"]["grads"] == f"differs: loss {3.5 + 2**-20} vs 3.5"
    assert rows["auto-25%"]["first_loss_match"] is False and rows["recompute-25%"]["first_loss_match"] is True
    assert report.failures(list(rows.values())) == [
        f"offload-25%: first-step gradients: differs: loss {3.5 + 2**-20} vs 3.5",
        "auto-25%: the first step's loss differs from the reference's",
    ]


def test_the_h200_gradient_check_runs_at_the_timed_shape_with_the_timed_kernel():
    """The h200 preset checks gradients at the shape it times (no shorter check batch), and on CUDA
    with flash attention, the kernel its timed steps run (deterministic under strict determinism)."""
    from torch.nn.attention import SDPBackend

    from offload.bench.config import PRESETS, RunSettings

    settings = RunSettings(**PRESETS["h200"].settings)
    assert settings.check_grads and settings.check_seq is None and settings.attention == "sdpa"
    assert loop.check_attention(torch.device("cuda"))[0] is SDPBackend.FLASH_ATTENTION
    assert loop.check_attention(torch.device("cpu")) == [SDPBackend.MATH]
