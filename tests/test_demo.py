"""What a reader of ``make demo`` sees: the short table and its legend, the JSON in a file, the plot,
and auto's verdict from paired repeats ("within noise" when their spread says so).

The demo itself is slow on a small CPU; here its preset runs at a tiny shape, in process.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from offload.bench import report, step
from zoo import most_profiling_steps

TINY_SHAPE = "--layers 2 --hidden 32 --heads 2 --seq 16 --batch 2 --steps 2 --min-offload-bytes 0".split() + [
    "--warmup",
    str(most_profiling_steps("auto")),
]
"""As many warm-up steps as auto may profile at one shape: a step that still profiles is not timed,
and on a loaded machine auto's calibration can take a step more than its usual three, its trials
a round more (then a verdict needs a timed step left)."""


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "ratios, verdict",
    [
        ([0.98, 1.03, 1.01], "within noise"),
        ([1.225, 0.97, 1.01], "within noise"),  # one slow repeat (the 1.225) is not a verdict
        ([0.995, 1.364, 1.571], "auto slower in 2 of 3 repeats"),  # one below 1 is not noise beside two far above
        ([1.02, 0.80, 0.85], "auto faster in 2 of 3 repeats"),
        ([0.90, 0.95, 0.97], "auto faster"),
        ([1.01, 1.02, 1.04], "auto slower, within 5 %"),
        ([1.20, 1.25, 1.22], "auto slower"),
        ([1.225], "one repeat: no spread to judge by (--repeats 3)"),
        ([], "-"),
    ],
)
def test_noise_verdict(ratios, verdict):
    assert report.noise_verdict(ratios) == verdict


def _row(policy, runs_ms, decisions):
    return {
        "config": f"{policy}-25%",
        "policy": policy,
        "budget_fraction": 0.25,
        "compiled": False,
        "step_ms": sorted(runs_ms)[len(runs_ms) // 2],
        "runs_step_ms": list(runs_ms),
        "runs_predicted_ms": [None] * len(runs_ms),
        "predicted_ms": None,
        "engine_peak_mb": 10.0,
        "budget_mb": 20.0,
        "decisions": decisions,
    }


def test_the_verdict_pairs_repeats_and_shows_both_plans():
    """The issue's demo: auto and offload made the same plan (OOOK), one run measured 808 against
    660 ms. Paired over three repeats whose ratios straddle 1, that is noise, and the row says so."""
    offload = _row("offload", [660.0, 700.0, 690.0], "OOOK")
    auto = _row("auto", [808.0, 680.0, 670.0], "OOOK")
    (verdict,) = report.verdicts([offload, auto])["verdicts"]
    assert verdict["best_fixed"] == "offload"
    assert verdict["auto_over_best_runs"] == pytest.approx([808 / 660, 680 / 700, 670 / 690])
    assert verdict["verdict"] == "within noise"
    text = report.records_table(report._VERDICT_COLUMNS, [verdict])
    assert "within noise" in text and "OOOK / OOOK" in text and "1.224 0.971 0.971" in text
    assert "NO" not in text.replace("holds budget", "")  # no bare "NO" a reader takes for auto failing


@pytest.mark.slow  # runs the benchmark harness
def test_demo_prints_a_reader_table_and_writes_its_json_to_a_file(tmp_path, capsys, monkeypatch):
    figures = []
    if importlib.util.find_spec("matplotlib") is not None:
        from matplotlib.figure import Figure

        save = Figure.savefig
        monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), save(self, *a, **k))[1])
    code = step.main(["--demo", *TINY_SHAPE, "--in-process", "--no-progress", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    last = out.strip().splitlines()[-1]
    assert last == (
        f"The run's JSON: {tmp_path / step.DEMO_JSON}; every column: {tmp_path / 'table.md'}"
        + (f", the plot {tmp_path / 'step.png'}." if figures else ".")
    )
    payload = json.loads((tmp_path / step.DEMO_JSON).read_text())
    assert payload["benchmark"] == "step" and payload["settings"]["repeats"] == 3
    assert "{" not in out  # no JSON on the terminal

    # The short table: what a reader compares, each column in the legend; the rest is in table.md.
    table = out.split(report.READER_LEGEND.splitlines()[0])[0]
    header = next(line for line in table.splitlines() if line.lstrip().startswith("config"))
    for name in ("ms/step", "x none", "act MB", "moved MB", "wait ms", "grads step 0", "losses"):
        assert name in header and name in report.READER_LEGEND
    for dropped in ("bound ms", "/bound", "opt MB", "D2H GB/s", "peak RSS+cache MB"):
        assert dropped not in header
    full = (tmp_path / "table.md").read_text()
    assert "bound ms" in full and "opt MB" in full
    assert "D2H GB/s" not in full  # no link on the CPU: the empty column is left out

    auto = next(r for r in payload["results"] if r["config"] == "auto-25%")
    assert auto["measured_steps"] > 0, f"auto was still profiling after the warm-up: {auto}"
    (verdict,) = payload["verdicts"]["verdicts"]
    assert len(verdict["auto_over_best_runs"]) == 3  # paired, one ratio per repeat
    assert verdict["verdict"] == report.noise_verdict(verdict["auto_over_best_runs"])
    assert verdict["verdict"] in out

    if figures:
        (fig,) = figures
        left = fig.axes[0]
        assert not left.texts, "configuration names go in the legend, not beside points where they overlap"
        labels = [t.get_text() for t in left.get_legend().get_texts()]
        assert {r["config"] for r in payload["results"]} <= set(labels)
        assert "no engine: time" in labels and "no engine: peak" in labels
        none = next(r for r in payload["results"] if r["config"] == "none")
        assert [line.get_xdata()[0] for line in left.lines if line.get_label() == "no engine: time"] == [
            none["step_ms"]
        ]
        right = fig.axes[1]
        assert len(right.get_xticklabels()) <= report._MAX_PHASE_TICKS
