"""The summary of a ``bench/gpu_check.sh`` run: ``python bench/gpu_summary.py OUTDIR [SECONDS]``.

Reads what the parts left in OUTDIR and writes ``summary.json`` and ``summary.md`` (every part's
status, its key figures, hardware, versions, date), each to a temporary file renamed into place.
Standard library only, no torch: it must run even when torch does not import.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

PART_ORDER = ("env", "probe", "step", "tests", "overhead", "layers")
STEP_KEYS = (
    "config",
    "step_ms",
    "ratio",
    "act_peak_mb",
    "act_ratio",
    "opt_peak_mb",
    "offloaded_mb",
    "d2h_gb_per_s",
    "h2d_gb_per_s",
    "exposed_wait_ms",
    "bound_ms",
    "over_bound",
    "grads",
    "losses_match",
    "error",
    "skipped",
)


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
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {
        "failed": [
            f"{c.get('classname')}::{c.get('name')}"
            for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None
        ]
    }


def summarize(out: Path, seconds) -> dict:
    parts = {p.name[: -len(".part.json")]: _load(p) for p in out.glob("*.part.json")}
    step, over, layers = (_load(out / name) for name in ("step/summary.json", "overhead.json", "layers.json"))
    env = _load(out / "env.json") or {}
    return {
        "cuda": bool(env.get("cuda")),
        "written_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "seconds": seconds,
        "gpu": (out / "gpu.csv").read_text().strip() if (out / "gpu.csv").exists() else None,
        "env": env,
        "parts": [parts.pop(n) for n in PART_ORDER if n in parts] + list(parts.values()),
        "figures": {
            "probe": _load(out / "probe.json"),
            "step": None
            if not step
            else {
                "finished": step.get("finished"),
                "settings": step.get("settings"),
                "rows": [{k: r.get(k) for k in STEP_KEYS} for r in step.get("results", [])],
                "verdicts": step.get("verdicts"),
            },
            "tests": _tests(out / "tests.xml"),
            "overhead": None
            if not over
            else {
                "per_tensor_us": {k: v["median_us"] for k, v in over["per_tensor"]["variants"].items()},
                "step_overhead_budget_none": over["step"]["overhead_budget_none"],
                "step_model": over["step"]["model"],
            },
            "layers": None
            if not layers
            else {
                "transfer_fit": layers.get("transfer_fit"),
                "winners": {f"{r['layer']}-{r['size']}": r["winner"] for r in layers["rows"]},
            },
        },
    }


def markdown(s: dict, out: Path) -> str:
    env, fig = s["env"], s["figures"]
    lines = [
        "# offload device check",
        "",
        f"- written (UTC): {s['written_utc']}; {s['seconds']} s so far; CUDA available: {s['cuda']}",
        f"- GPU (nvidia-smi name, memory, driver): {s['gpu'] or 'n/a'}",
        f"- host: {env.get('host_cpu', '?')}, {env.get('cpu_cores_logical', '?')} cores, "
        f"{env.get('ram_gb', '?')} GB RAM",
        f"- versions: python {env.get('python', '?')}, torch {env.get('torch', '?')} (CUDA {env.get('cuda_build')}), "
        f"offload {env.get('offload', '?')} at {env.get('git_commit', '?')}",
        "",
        "## Parts",
        "",
        "| part | status | rc | seconds | limit s | output |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p['part']} | {p['status']} | {p['rc']} | {p['seconds']} | {p['limit_s']} | {p['output']} |"
        for p in s["parts"]
        if p
    ]
    if fig["probe"]:
        lines += ["", "## Probe", ""] + [f"- {k}: {v}" for k, v in fig["probe"].items()]
    if (out / "step" / "table.md").exists():
        lines += [
            "",
            (out / "step" / "table.md").read_text().strip().replace("# Step benchmark", "## Step benchmark", 1),
        ]
    if t := fig["tests"]:
        lines += [
            "",
            "## CUDA tests",
            "",
            f"{t['tests']} tests, {t['failures']} failures, {t['errors']} errors, {t['skipped']} skipped",
        ] + [f"- FAILED {name}" for name in t["failed"]]
    if o := fig["overhead"]:
        lines += [
            "",
            "## Overhead",
            "",
            "per saved tensor, pack + unpack, median us: "
            + ", ".join(f"{k} {v}" for k, v in o["per_tensor_us"].items()),
            f"step overhead at budget None: {100 * o['step_overhead_budget_none']:+.2f}% ({o['step_model']})",
        ]
    if fig["layers"] and (f := fig["layers"]["transfer_fit"]):
        lines += [
            "",
            "## Layers",
            "",
            f"fit: transfer ms = {f['ms_per_mb']} x saved MB + {f['ms_per_tensor']} x saved "
            f"tensors (round trip {f['round_trip_gb_per_s']} GB/s)",
            "winners: " + ", ".join(f"{k} {v}" for k, v in fig["layers"]["winners"].items()),
        ]
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
