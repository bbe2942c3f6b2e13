"""What the step benchmark reports: per-configuration summaries, metrics.csv, the table, the plot.

Works on the records the runs emitted (``step`` rows and one ``summary`` per configuration, as
plain dicts), so it never touches a device. matplotlib is imported only inside ``plot``.

    step rows ──▶ summarize() ──▶ one row per configuration ──▶ format_table(), summary JSON
              └─▶ write_csv()  (one row per step)              └─▶ plot()  (peak vs time, resident trace)
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Optional

import torch

from .._probe import cpu_model

import offload
from offload.bench.config import MB, REFERENCE, VARIANTS, Kind, RunSettings

__all__ = ["CSV_COLUMNS", "cpu_model", "environment", "format_table", "plot", "summarize", "write_csv"]


def _median(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(run: RunSettings, names: list[str], results: dict[str, dict]) -> list[dict]:
    """One row per configuration: medians over measured steps, peak, losses against the reference."""
    reference = [r["loss"] for r in results.get(REFERENCE, {}).get("steps", [])]
    reference_ms = None
    rows = []
    for name in names:
        result = results[name]
        steps = result["steps"]
        measured = [s for s in steps if not s["warmup"]]
        summary = result["summary"] or {}
        losses = [s["loss"] for s in steps]
        match, diff = None, None
        if name != REFERENCE and reference and len(losses) == len(reference):
            match = losses == reference
            diff = max(abs(a - b) for a, b in zip(losses, reference))
        step_ms = _median(s["step_ms"] for s in measured)
        if name == REFERENCE:
            reference_ms = step_ms
        peak = max((s["peak_bytes"] for s in measured), default=None)
        row = {
            "config": name,
            "kind": VARIANTS[name].kind.value,
            "policy": VARIANTS[name].policy,
            "budget_mb": summary.get("budget_mb"),
            "measured_steps": len(measured),
            "step_ms_median": step_ms,
            "peak_mb": None if peak is None else peak / MB,
            "saved_mb": _bytes_mb(_median(s.get("saved_bytes") for s in measured)),
            "moved_mb": _bytes_mb(_median(s.get("offloaded_bytes") for s in measured)),
            "spilled_mb": _bytes_mb(_median(s.get("spilled_bytes") for s in measured)),
            "reloaded_mb": _bytes_mb(_median(s.get("reloaded_bytes") for s in measured)),
            "peak_resident_mb": _bytes_mb(_median(s.get("peak_resident_bytes") for s in measured)),
            "recomputed_regions": _median(s.get("recomputed_regions") for s in measured),
            "prefetch_hits": _median(s.get("prefetch_hits") for s in measured),
            "prefetch_misses": _median(s.get("prefetch_misses") for s in measured),
            "reload_wait_ms": _median(s.get("reload_wait_ms") for s in measured),
            "evict_wait_ms": _median(s.get("evict_wait_ms") for s in measured),
            "losses": losses,
            "losses_match": match,
            "max_loss_diff": diff,
            "error": result["error"],
        }
        if name == REFERENCE and summary.get("activation_bytes") is not None:
            row["saved_mb"] = summary["activation_bytes"] / MB
        rows.append(row)
    for row in rows:
        ms = row["step_ms_median"]
        row["ratio_vs_none"] = ms / reference_ms if ms is not None and reference_ms else None
    return rows


def _bytes_mb(value) -> Optional[float]:
    return None if value is None else value / MB


CSV_COLUMNS = (
    "config", "step", "warmup", "loss", "loss_match", "step_ms", "peak_mb", "budget_mb",
    "saved_bytes", "resident_bytes", "peak_resident_bytes", "offloaded_bytes", "reloaded_bytes",
    "spilled_bytes", "host_bytes", "recomputed_regions", "prefetch_hits", "prefetch_misses",
    "reload_wait_ms", "evict_wait_ms",
)
"""metrics.csv, one row per step and configuration. Engine columns are empty without an engine;
``peak_mb`` is CUDA max allocated, or peak RSS on the CPU (see ``peak_source`` in summary.json)."""


def write_csv(path: Path, names: list[str], results: dict[str, dict]) -> None:
    reference = {s["step"]: s["loss"] for s in results.get(REFERENCE, {}).get("steps", [])}
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for name in names:
            for s in results[name]["steps"]:
                row = dict(s)
                row["warmup"] = int(s["warmup"])
                row["peak_mb"] = round(s["peak_bytes"] / MB, 3)
                row["loss"] = repr(s["loss"])
                row["loss_match"] = "" if name == REFERENCE or s["step"] not in reference else int(
                    s["loss"] == reference[s["step"]])
                writer.writerow(row)


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    """The human table: one line per configuration."""
    header = ("config", "ms/step", "x none", "peak MB", "saved MB", "moved MB", "recomp", "wait ms", "losses")
    lines = [header]
    for r in rows:
        if r["error"] is not None:
            first = r["error"].splitlines()[0] if r["error"] else "failed"
            lines.append((r["config"], "FAILED", first[:60], "", "", "", "", "", ""))
            continue
        match = {None: "ref" if r["config"] == REFERENCE else "-", True: "equal", False: "DIFFER"}[r["losses_match"]]
        if r["losses_match"] is False:
            match += f" ({r['max_loss_diff']:.2g})"
        lines.append((
            r["config"],
            _fmt(r["step_ms_median"], ".1f"),
            _fmt(r["ratio_vs_none"], ".2f"),
            _fmt(r["peak_mb"], ".1f"),
            _fmt(r["saved_mb"], ".1f"),
            _fmt(r["moved_mb"], ".1f"),
            _fmt(r["recomputed_regions"], "g"),
            _fmt(r["reload_wait_ms"], ".1f"),
            match,
        ))
    widths = [max(len(line[i]) for line in lines if line[1] != "FAILED" or i < 2) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        if line[1] == "FAILED":
            out.append(f"{line[0].ljust(widths[0])}  FAILED: {line[2]}")
        else:
            out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def plot(path: Path, rows: list[dict], results: dict[str, dict], run: RunSettings) -> Optional[Path]:
    """Peak memory vs step time per configuration, and resident bytes over one step; None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(12, 4.8))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    memory_label = "peak CUDA allocated, MB" if run.device == "cuda" else "peak RSS of the process, MB"
    plotted = [r for r in rows if r["step_ms_median"] is not None and r["peak_mb"] is not None]
    for i, r in enumerate(plotted):
        left.scatter(r["step_ms_median"], r["peak_mb"], s=36)
        # Alternate labels above and below their points: configurations often land close together.
        left.annotate(r["config"], (r["step_ms_median"], r["peak_mb"]), textcoords="offset points",
                      xytext=(5, 5 if i % 2 == 0 else -12), fontsize=8)
    left.set_xlabel("step time, ms (median)")
    left.set_ylabel(memory_label)
    left.set_title("memory vs time per configuration")
    left.grid(alpha=0.3)

    traced = [r for r in rows if r["kind"] == Kind.ENGINE.value and r["budget_mb"] is not None
              and results[r["config"]]["summary"] and results[r["config"]]["summary"]["trace"]]
    if traced:
        smallest = min(r["budget_mb"] for r in traced)
        phases = None
        for r in traced:
            if r["budget_mb"] != smallest:
                continue
            samples = results[r["config"]]["summary"]["trace"]
            phases = [s["phase"] for s in samples]
            right.plot(range(len(samples)), [s["resident_bytes"] / MB for s in samples], marker="o", ms=3,
                       label=r["config"])
        right.axhline(smallest, color="gray", ls="--", lw=1, label=f"budget {smallest:.3g} MB")
        right.set_xticks(range(len(phases)), phases, rotation=60, fontsize=7)
        right.set_ylabel("engine resident bytes, MB")
        right.set_title("resident activations over the last step")
        right.legend(fontsize=8)
        right.grid(alpha=0.3)
    else:
        right.set_axis_off()
        right.text(0.5, 0.5, "no engine configuration with a budget", ha="center", va="center")
    fig.suptitle(f"MiniGPT {run.layers}x{run.hidden}, seq {run.seq}, batch {run.batch}, {run.dtype} on {run.device}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(offload.__file__).resolve().parents[1],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(results: dict[str, dict]) -> dict:
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host_cpu": cpu_model(),
        "cpu_cores_logical": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "offload": offload.__version__,
        "git_commit": _git_commit(),
    }
    try:
        import psutil

        env["ram_gb"] = round(psutil.virtual_memory().total / 1e9, 1)
    except ImportError:
        pass
    for result in results.values():
        summary = result["summary"]
        if summary and summary.get("malloc_mmap_threshold"):
            env["malloc_mmap_threshold"] = summary["malloc_mmap_threshold"]
        if summary:
            env.update({k: summary[k] for k in ("device_name", "device_memory_gb", "cuda") if k in summary})
            if summary.get("machine"):
                env["machine_profile"] = summary["machine"]
            env["peak_source"] = summary["peak_source"]
    return env
