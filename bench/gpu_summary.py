"""The summary of a ``bench/gpu_check.sh`` run: ``python bench/gpu_summary.py OUTDIR [SECONDS]``.

Reads what the parts left in OUTDIR and writes ``summary.json`` and ``summary.md``, each to a
temporary file renamed into place. Their first lines (``verdict``) say which parts passed and, for
each that did not, why (a configuration's failure, the failed tests, the log's last line), so one
look decides the one rerun a GPU window allows; then every part's status and key figures,
hardware, versions, date. Standard library only, no torch: it must run even when torch does not import.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

PART_ORDER = ("env", "probe", "step", "predict", "tests", "sanitizer", "overhead", "layers")
DEADLINE_SKIP = "OFFLOAD_TEST_DEADLINE"
"""In the reason of a test skipped because its part's time was up (tests/conftest.py): a pytest part
with such skips did not check everything it was meant to, so it reads "incomplete", not passed."""
PASSED = ("ok", "no-tests")
"""Part statuses that pass (``no-tests``: pytest collected none, e.g. no CUDA test selected)."""
REASONS_SHOWN = 3
"""Reasons given per failed part in the verdict (the rest are counted; the sections list them all)."""
PART_KEYS = ("part", "status", "rc", "seconds", "limit_s", "output")  # of NAME.part.json; the parts table's columns
STEP_KEYS = (
    "config step_ms ratio act_peak_mb act_ratio opt_peak_mb offloaded_mb d2h_gb_per_s h2d_gb_per_s exposed_wait_ms "
    "bound_ms over_bound grads losses_match first_loss_match error skipped"
).split()
"""What summary.json keeps of each row of the step part's summary.json (offload.bench's records)."""


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _tests(path: Path):
    """Counts and failed test names of the JUnit XML pytest wrote; None without a readable one."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    if (suite := root if root.tag == "testsuite" else root.find("testsuite")) is None:
        return None
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [
        case for case in suite.iter("testcase") if case.find("failure") is not None or case.find("error") is not None
    ]
    skips = [case.find("skipped") for case in suite.iter("testcase")]
    not_run = sum(1 for skip in skips if skip is not None and DEADLINE_SKIP in (skip.get("message") or ""))
    return counts | {"failed": [f"{case.get('classname')}::{case.get('name')}" for case in failed], "not_run": not_run}


def _figures(out: Path) -> dict:
    """Each part's key figures; None for a part that left no readable output."""
    figures = dict.fromkeys(PART_ORDER[1:])  # every part but env, which the summary holds whole
    figures.update(
        probe=_load(out / "probe.json"),
        tests=_tests(out / "tests.xml"),
        sanitizer=_tests(out / "sanitizer.xml"),
        predict=_load(out / "predict.json"),
    )
    if step := _load(out / "step" / "summary.json"):
        figures["step"] = {
            "finished": step.get("finished"),
            "settings": step.get("settings"),
            "rows": [{key: row.get(key) for key in STEP_KEYS} for row in step.get("results", [])],
            "verdicts": step.get("verdicts"),
            "failures": step.get("failures"),
        }
    if over := _load(out / "overhead.json"):  # a section stopped by the time limit is None
        per_tensor, step_over = over.get("per_tensor") or {}, over.get("step") or {}
        figures["overhead"] = {
            "finished": over.get("finished", True),
            "per_tensor_us": {name: v["median_us"] for name, v in per_tensor.get("variants", {}).items()},
            "step_overhead_budget_none": step_over.get("overhead_budget_none"),
            "step_model": step_over.get("model"),
        }
    if layers := _load(out / "layers.json"):
        winners = {f"{row['layer']}-{row['size']}": row["winner"] for row in layers["rows"]}
        figures["layers"] = {
            "transfer_fit": layers.get("transfer_fit"),
            "winners": winners,
            "finished": layers.get("finished", True),
            "skipped": layers.get("skipped") or {},
        }
    return figures


def _last_line(out: Path, name: str) -> str:
    try:
        lines = [line.strip() for line in (out / f"{name}.log").read_text(errors="replace").splitlines()]
    except OSError:
        return "no log"
    return next((line for line in reversed(lines) if line), "empty log")[:200]


def _reasons(part: dict, figures: dict, out: Path) -> list[str]:
    """Why ``part`` did not pass, most telling first: what the part itself said failed, else its
    log's last line."""
    name = part["part"]
    reasons: list[str] = []
    if name == "step" and figures.get("step"):
        reasons = list(figures["step"].get("failures") or [])
    elif name in ("tests", "sanitizer") and figures.get(name):
        tests = figures[name]
        reasons = [f"{len(tests['failed'])} of {tests['tests']} failed"] + tests["failed"] if tests["failed"] else []
        if tests.get("not_run"):
            reasons.append(f"{tests['not_run']} of {tests['tests']} not run: past the part's time limit")
    reasons = reasons or [_last_line(out, name)]
    if part["status"] == "timeout":
        reasons.insert(0, f"timed out at its limit of {part['limit_s']} s")
    return reasons


def _status(part: dict, figures: dict) -> str:
    """The part's status as the verdict reads it: a pytest part that passed with tests left unrun
    for lack of time is "incomplete"."""
    tests = figures.get(part["part"]) if part["part"] in ("tests", "sanitizer") else None
    if part["status"] in PASSED and tests and tests.get("not_run"):
        return "incomplete"
    return part["status"]


def verdict(parts: list[dict], figures: dict, out: Path) -> dict:
    """Which parts passed, and why each other did not (``REASONS_SHOWN`` reasons each at most)."""
    passed = [p["part"] for p in parts if p and p["status"] in PASSED]
    skipped = {p["part"]: p["output"] for p in parts if p and p["status"] == "skipped"}
    failed = {
        p["part"]: {"status": p["status"], "why": _reasons(p, figures, out)}
        for p in parts
        if p and p["status"] not in PASSED and p["status"] != "skipped"
    }
    return {"passed": passed, "failed": failed, "skipped": skipped, "parts": len([p for p in parts if p])}


def verdict_lines(v: dict) -> list[str]:
    """The verdict as the first lines of summary.md."""
    failed, skipped = v["failed"], v["skipped"]
    head = f"**{'FAILED' if failed else 'PASSED'}: {len(v['passed'])} of {v['parts']} parts passed"
    head += f"; failed: {', '.join(failed)}" if failed else ""
    head += f"; skipped: {', '.join(skipped)}**" if skipped else "**"
    lines = [head]
    for name, f in failed.items():
        shown = f["why"][:REASONS_SHOWN]
        more = f" (and {len(f['why']) - len(shown)} more)" if len(f["why"]) > len(shown) else ""
        lines.append(f"- {name} {f['status']}: {'; '.join(shown)}{more}")
    if skipped:
        lines.append(f"- skipped: {next(iter(skipped.values()))}")
    return lines


def summarize(out: Path, seconds) -> dict:
    parts = {p.name.removesuffix(".part.json"): _load(p) for p in out.glob("*.part.json")}
    env = _load(out / "env.json") or {}
    ordered = [parts.pop(name) for name in PART_ORDER if name in parts] + list(parts.values())
    figures = _figures(out)
    ordered = [p if not p else p | {"status": _status(p, figures)} for p in ordered]  # "incomplete" everywhere
    return {
        "verdict": verdict(ordered, figures, out),
        "cuda": bool(env.get("cuda")),
        "written_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "seconds": seconds,
        "gpu": (out / "gpu.csv").read_text().strip() if (out / "gpu.csv").exists() else None,
        "env": env,
        "parts": ordered,
        "figures": figures,
    }


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"


PREDICT_HEADER = (
    "config",
    "predicted plan",
    "step ms pred",
    "step - optimizer ms meas",
    "held MB pred",
    "act peak MB meas",
)
"""The columns of the predict part's table: here in summary.md, and as ``bench/predict.py --part step`` prints it."""


def predict_cells(row: dict) -> list[str]:
    """One row of predict.json under ``PREDICT_HEADER``."""
    figures = ("predicted_step_ms", "measured_fwd_bwd_ms", "predicted_held_mb", "measured_act_peak_mb")
    return [row["config"], row["predicted_plan"], *(_fmt(row[key]) for key in figures)]


def _row(cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown(summary: dict, out: Path) -> str:
    env, figures = collections.defaultdict(lambda: "?", summary["env"]), summary["figures"]
    header = [_row(key.replace("_", " ") for key in PART_KEYS), "|" + "---|" * len(PART_KEYS)]
    sections = {"Parts": header + [_row(part[key] for key in PART_KEYS) for part in summary["parts"] if part]}
    if probe := figures["probe"]:
        sections["Probe"] = [f"- {key}: {value}" for key, value in probe.items()]
    failed = [f"- FAILED {why}" for why in (figures["step"] or {}).get("failures") or []]
    if (step_table := out / "step" / "table.md").exists():  # offload.bench's own, under its own heading
        sections["Step benchmark"] = failed + [step_table.read_text().strip().removeprefix("# Step benchmark").strip()]
    elif failed:
        sections["Step benchmark"] = failed
    if predicted := figures["predict"]:
        sections["Predicted beside measured"] = [
            f"offload.predict on {predicted['machine']} (bench/predict.py --part step), the step part's configs:",
            "",
            _row(PREDICT_HEADER),
            "|" + "---|" * len(PREDICT_HEADER),
        ] + [_row(predict_cells(r)) for r in predicted.get("rows", [])]
    for part, heading in (("tests", "CUDA tests"), ("sanitizer", "CUDA tests under the sanitizer")):
        if tests := figures[part]:
            counts = ", ".join(f"{tests[key]} {key}" for key in ("tests", "failures", "errors", "skipped"))
            sections[heading] = [counts] + [f"- FAILED {name}" for name in tests["failed"]]
    if over := figures["overhead"]:
        per_tensor_us = ", ".join(f"{name} {us}" for name, us in over["per_tensor_us"].items())
        step_line = "not measured (stopped before the training steps)"
        if over["step_overhead_budget_none"] is not None:
            step_line = f"{100 * over['step_overhead_budget_none']:+.2f}% ({over['step_model']})"
        sections["Overhead"] = [
            f"per saved tensor, pack + unpack, median us: {per_tensor_us or 'not measured'}",
            f"step overhead at budget None: {step_line}",
        ]
    if figures["layers"] and (fit := figures["layers"]["transfer_fit"]):
        winners = ", ".join(f"{case} {winner}" for case, winner in figures["layers"]["winners"].items())
        sections["Layers"] = [
            f"fit: transfer ms = {fit['ms_per_mb']} x saved MB + {fit['ms_per_tensor']} x saved tensors "
            f"(round trip {fit['round_trip_gb_per_s']} GB/s)",
            f"winners: {winners}",
        ] + [f"not run (time limit): {', '.join(figures['layers']['skipped'])}"] * bool(figures["layers"]["skipped"])
    lines = [
        "# offload device check",
        "",
        *verdict_lines(summary["verdict"]),
        "",
        f"- written (UTC): {summary['written_utc']}; {summary['seconds']} s so far; CUDA available: {summary['cuda']}",
        f"- GPU (nvidia-smi name, memory, driver): {summary['gpu'] or 'n/a'}",
        f"- host: {env['host_cpu']}, {env['cpu_cores_logical']} cores, {env['ram_gb']} GB RAM",
        f"- versions: python {env['python']}, torch {env['torch']} (CUDA {env.get('cuda_build')}), "
        f"offload {env['offload']} at {env['git_commit']}",
    ]
    for heading, body in sections.items():
        lines += ["", f"## {heading}", "", *body]
    return "\n".join(lines + ["", "Logs: one `<part>.log` per part in this directory."]) + "\n"


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0])
    summary = summarize(out, int(args[1]) if len(args) > 1 else None)
    _write(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    _write(out / "summary.md", markdown(summary, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
