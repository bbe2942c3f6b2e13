"""The step benchmark's plumbing at a tiny size: outputs, columns, the last-line JSON, losses.

The benchmark's numbers are not checked here (bench/ is where timing lives); what is checked is
that every configuration trains the same model on the same batches, that the engine's losses equal
the reference's exactly in fp32, and that the files it promises are written.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload.bench import report, step

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--steps", "2",
        "--warmup", "1", "--dtype", "fp32", "--min-offload-bytes", "0", "--no-progress"]
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
    assert results["offload-25%"]["moved_mb"] > 0  # the budget made it move something
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
    assert "plan" in summary["runs"]["auto-25%"]["summary"]
    assert summary["runs"]["offload-25%"]["summary"]["trace"][0]["phase"] == "start"

    table = out[: out.rindex("{")]
    assert "config" in table and "offload-25%" in table and "equal" in table
    plot = tmp_path / "step.png"
    if importlib.util.find_spec("matplotlib") is not None:
        assert payload["plot"] == str(plot) and plot.stat().st_size > 0
    else:
        assert payload["plot"] is None and not plot.exists()


@pytest.mark.slow
def test_each_configuration_in_its_own_process(tmp_path):
    """The real path (CPU): bench/step.py spawns one child per configuration and collects JSON lines."""
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "step.py"), *TINY, "--device", "cpu",
         "--configs", "none,offload-50%", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = _last_json(proc.stdout)
    assert [r["losses_match"] for r in payload["results"]] == [None, True]
    assert payload["env"]["peak_source"]
    assert len(_read_csv(tmp_path / "metrics.csv")) == 2 * 3


def test_a_failing_configuration_is_tabled_and_the_rest_run(tmp_path, capsys, monkeypatch):
    real_run_one = step.run_one

    def run_one(run, variant, *args, **kwargs):
        if variant.name == "checkpoint":
            raise RuntimeError("injected failure")
        return real_run_one(run, variant, *args, **kwargs)

    monkeypatch.setattr(step, "run_one", run_one)
    code = step.main(TINY + ["--device", "cpu", "--in-process", "--configs", "none,checkpoint,save_on_cpu",
                             "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    results = {r["config"]: r for r in _last_json(out)["results"]}
    assert "injected failure" in results["checkpoint"]["error"]
    assert results["save_on_cpu"]["losses_match"] is True
    assert "FAILED: RuntimeError: injected failure" in out


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        step.main(["--help"])
    assert exit_info.value.code == 0
    assert "offload-25%" in capsys.readouterr().out


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert step.main(["--configs", "none,bogus", "--out", str(tmp_path)]) == 2
    assert "bogus" in capsys.readouterr().err
    assert step.main(["--hidden", "30", "--heads", "4", "--out", str(tmp_path)]) == 2


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
    code = step.main(TINY + ["--device", "cuda", "--deterministic", "--in-process", "--configs", ",".join(configs),
                             "--out", str(tmp_path)])
    payload = _last_json(capsys.readouterr().out)
    assert code == 0
    results = {r["config"]: r for r in payload["results"]}
    for name in configs[1:]:
        assert results[name]["losses_match"] is True, (name, results[name])
    assert results["offload-25%"]["moved_mb"] > 0
    assert payload["env"]["device_name"]
