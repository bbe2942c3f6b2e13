"""What the step benchmark reports: one row per configuration, the verdicts, the files, the plot.

Works on the records the runs emitted (``step`` rows, one ``summary`` per configuration and
repeat, plain dicts), so it never touches a device; matplotlib is imported only inside ``plot``.

    records ──▶ summarize() ──▶ rows ──▶ tables, verdicts() ──▶ table.md, summary.json, stdout
            └─▶ metrics.csv (one row per step)        └─▶ plot(): memory vs time, Pareto front

``LEGEND`` defines each column as the tables print it; ``READER_LEGEND`` the columns of the short
table a reader of ``--demo`` sees (``reader_table``). Auto is judged against the best fixed policy
by step-time ratios paired within each repeat: "within noise" when those ratios fall on both sides
of 1 and their median is within 5 % of it (``noise_verdict``).
"""

from __future__ import annotations

import csv
import dataclasses
import statistics
from pathlib import Path
from typing import Any, Optional

from offload import MachineProfile
from offload.bench.config import MB, REFERENCE, Kind, RunSettings, Variant
from offload.bench.measure import Column, describe_machine, median, records_table, write_json, write_text

__all__ = ["CSV_COLUMNS", "Report", "failures", "pareto_front", "plot", "summarize", "verdicts"]

AUTO_SLOWER_LIMIT = 1.05  # auto may be at most 5% slower than the best fixed policy that holds the budget
PREDICTION_TOLERANCE = 0.15  # the planner's predicted step time should be within 15% of the measured one

_BOUNDED_KINDS = (Kind.NONE.value, Kind.CHECKPOINT.value, Kind.ENGINE.value)
"""Kinds the cost-model bound covers (save_on_cpu and torchtune move bytes it does not count)."""
_STAT_FIELDS = (
    *"saved_bytes offloaded_bytes reloaded_bytes spilled_bytes recomputed_regions prefetch_hits".split(),
    *"prefetch_misses reload_wait_ms evict_wait_ms d2h_busy_ms h2d_busy_ms".split(),
)
"""The engine's counters in each step record: metrics.csv columns, and medians in the rows (bytes as MB)."""
_PEAKS = ("peak", "act_peak", "opt_peak")
"""Memory peaks of each step record (``<peak>_bytes``), reported in MB (``<peak>_mb``)."""
CSV_COLUMNS = (
    *"config repeat step warmup loss loss_match step_ms fwd_bwd_ms opt_ms cpu_ms peak_mb act_peak_mb".split(),
    *"opt_peak_mb budget_mb block_forward_ms resident_bytes peak_resident_bytes host_bytes".split(),
    *_STAT_FIELDS,
)
"""metrics.csv, one row per step, configuration and repeat. Engine columns are empty without an engine."""


def _mb(value: Optional[float]) -> Optional[float]:
    return None if value is None else value / MB


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _gbps(moved_bytes: Optional[float], busy_ms: Optional[float]) -> Optional[float]:
    return moved_bytes / (busy_ms * 1e-3) / 1e9 if moved_bytes and busy_ms else None


def _paired(numerators: list, denominators: list) -> Optional[float]:
    """Median of the ratios paired by repeat (None where either side is missing in every pair)."""
    return median([a / b for a, b in zip(numerators, denominators, strict=False) if a is not None and b])


def _measured(runs: list[dict]) -> list[dict]:
    """The timed steps of ``runs`` (warm-up steps are recorded, not timed)."""
    return [s for r in runs for s in r.get("steps", []) if not s["warmup"]]


def _peak_mb(steps: list[dict], key: str, empty: Optional[int] = None) -> Optional[float]:
    return _mb(max((s.get(key) or 0 for s in steps), default=empty))


def _grads_verdict(check: Optional[dict], reference: Optional[dict]) -> str:
    if check is None:
        return "-"
    if "error" in check:
        return f"check failed: {check['error']}"
    if reference is None or "error" in reference:
        return "reference check failed"
    ours, theirs = check["checksums"], reference["checksums"]
    differ = [n for n in theirs if ours.get(n) != theirs[n]]
    loss = "" if check.get("loss") == reference.get("loss") else f"loss {check.get('loss')} vs {reference.get('loss')}"
    if not differ:
        return f"differs: {loss}" if loss else "equal"
    worst = max(
        (abs(ours[n][1] - theirs[n][1]) / (theirs[n][1] or 1.0) for n in differ if ours.get(n) and theirs[n]),
        default=float("nan"),
    )
    return f"differs {len(differ)}/{len(theirs)} (norm {worst:.1g})" + (f", {loss}" if loss else "")


def _reference_grads(check: Optional[dict]) -> str:
    return f"check failed: {check['error']}" if check is not None and "error" in check else "ref"


def _grads_of_repeats(is_reference: bool, checks: list[Optional[dict]], reference: Optional[dict]) -> str:
    """The verdict on every repeat's first-step gradients (each repeat its own process): the first
    that does not pass, else the first repeat's. The reference's later repeats are held to its first."""
    if is_reference:
        own = _reference_grads(reference)
        later = [_grads_verdict(c, reference) for c in checks[1:] if c is not None]
        failed = next((x for x in later if x not in GRADS_PASSED), None)
        return own if own != "ref" or failed is None else f"repeats differ: {failed}"
    verdicts = [_grads_verdict(c, reference) for c in checks if c is not None] or ["-"]
    return next((x for x in verdicts if x not in GRADS_PASSED), verdicts[0])


GRADS_PASSED = ("ref", "equal", "-")
"""Gradient verdicts that pass: the reference's own, equal to it, or not checked (compiled, or the
configuration did not run: its row says why)."""


def failures(rows: list[dict]) -> list[str]:
    """Why a run must not read as passed, one line per configuration: it raised, its gradient check
    failed (its loss or gradients differ, it raised, CUDA out of memory included, or its reference
    did), or its first step's loss differs from the reference's: that step's forward is the same
    computation in every configuration, on every device, whatever the kernels' determinism."""
    out = []
    for r in rows:
        if r["error"]:
            out.append(f"{r['config']}: {r['error'].splitlines()[0][:200]}")
        elif r["grads"] not in GRADS_PASSED:
            out.append(f"{r['config']}: first-step gradients: {r['grads']}")
        elif r.get("first_loss_match") is False:
            out.append(f"{r['config']}: the first step's loss differs from the reference's")
    return out


def summarize(
    run: RunSettings, variants: list[Variant], results: dict[str, list[dict]], machine: Optional[MachineProfile]
) -> list[dict]:
    """One row per configuration."""
    ref_runs = results.get(REFERENCE.name) or [{}]
    compiled_ref = results.get(dataclasses.replace(REFERENCE, compiled=True).name) or ref_runs
    # Compiled blocks run other kernels than eager ones: their losses compare with the compiled reference.
    ref_losses = {
        c: [s["loss"] for s in runs[0].get("steps", [])] for c, runs in ((False, ref_runs), (True, compiled_ref))
    }
    ref_grads = (ref_runs[0].get("summary") or {}).get("grad_check")
    ref_block_ms = median(s.get("block_forward_ms") for s in _measured(ref_runs[:1]))
    out_gbps, back_gbps = machine.offload_gb_per_s() if machine is not None else (0.0, 0.0)
    rows: list[dict[str, Any]] = []
    for v in variants:
        runs = results[v.name]
        steps = [s for r in runs for s in r["steps"]]
        measured = _measured(runs)
        summary = next((r["summary"] for r in runs if r["summary"]), None) or {}
        runs_ms = [median(s["step_ms"] for s in _measured([r])) for r in runs]
        runs_predicted_ms = [((r["summary"] or {}).get("plan") or {}).get("predicted_step_ms") for r in runs]
        stats = {f: median(s.get(f) for s in measured) for f in _STAT_FIELDS}
        reload_ms, evict_ms = stats["reload_wait_ms"], stats["evict_wait_ms"]
        recomputed = run.layers if v.kind is Kind.CHECKPOINT else (stats["recomputed_regions"] or 0)
        moved = [(stats["offloaded_bytes"], out_gbps), (stats["reloaded_bytes"], back_gbps)]
        # Every repeat against the reference's first: each runs in a process of its own, and a
        # repeat that trained differently must show (the reference's own later repeats included).
        reference = ref_losses[v.compiled]
        repeats = [[s["loss"] for s in r["steps"]] for r in runs if r["steps"]]
        if v.kind is Kind.NONE:
            repeats = repeats[1:]
        compared = bool(reference) and bool(repeats) and all(len(x) == len(reference) for x in repeats)
        loss_diffs = [abs(a - b) for x in repeats for a, b in zip(x, reference, strict=False)]
        losses_match = all(x == reference for x in repeats) if compared else None
        firsts = [x[0] for x in repeats if x]
        first_loss_match = all(x == reference[0] for x in firsts) if reference and firsts else None
        regions = (summary.get("plan") or {}).get("regions", [])
        ran = any(r["steps"] or r["summary"] or r["error"] for r in runs)
        rows.append(
            {
                "config": v.name,
                "kind": v.kind.value,
                "policy": v.policy,
                "budget_fraction": v.budget_fraction,
                "compiled": v.compiled,
                "budget_mb": summary.get("budget_mb"),
                "measured_steps": len(measured),
                "step_ms": median(runs_ms),
                "runs_step_ms": runs_ms,
                "cpu_ms": median(s["cpu_ms"] for s in measured),
                "opt_ms": median(s["opt_ms"] for s in measured),
                **{f"{peak}_mb": _peak_mb(measured, f"{peak}_bytes") for peak in _PEAKS},
                "engine_peak_mb": _peak_mb(steps, "peak_resident_bytes", empty=0) if v.kind is Kind.ENGINE else None,
                **{f.replace("_bytes", "_mb"): _mb(x) if f.endswith("_bytes") else x for f, x in stats.items()},
                # the reference: None while its repeats agree (its cell reads "ref")
                "losses_match": None if v.kind is Kind.NONE and losses_match else losses_match,
                "max_loss_diff": max(loss_diffs, default=None),
                "first_loss_match": first_loss_match,
                "grads": _grads_of_repeats(
                    v == REFERENCE, [(r["summary"] or {}).get("grad_check") for r in runs], ref_grads
                ),
                "runs_predicted_ms": runs_predicted_ms,
                "predicted_ms": median(runs_predicted_ms),
                "decisions": "".join(region["decision"][0].upper() for region in regions) or None,
                "error": next((r["error"] for r in runs if r["error"]), None),
                "skipped": next((r["skipped"] for r in runs if r["skipped"]), None if ran else "not run (yet)"),
                "exposed_wait_ms": None if reload_ms is None else reload_ms + (evict_ms or 0.0),
                "d2h_gb_per_s": _gbps(stats["offloaded_bytes"], stats["d2h_busy_ms"]),
                "h2d_gb_per_s": _gbps(stats["reloaded_bytes"], stats["h2d_busy_ms"]),
                "recompute_ms": None if ref_block_ms is None else recomputed * ref_block_ms / run.layers,
                "link_ms": sum(b / (g * 1e9) * 1e3 for b, g in moved if b and g) if v.kind is Kind.ENGINE else None,
            }
        )
        if v == REFERENCE and summary.get("activation_bytes") is not None:
            rows[-1]["saved_mb"] = _mb(summary["activation_bytes"])
    ref = rows[0] if rows and rows[0]["config"] == REFERENCE.name else {}
    for row in rows:
        row["ratio"] = _ratio(row["step_ms"], ref.get("step_ms"))
        row["act_ratio"] = _ratio(row["act_peak_mb"], ref.get("act_peak_mb"))
        compute = ref.get("step_ms")
        bounded = compute and row["recompute_ms"] is not None and row["kind"] in _BOUNDED_KINDS
        row["bound_ms"] = max(compute + row["recompute_ms"], row["link_ms"] or 0.0) if bounded else None
        row["over_bound"] = _ratio(row["step_ms"], row["bound_ms"])
    return rows


def _paired_ratios(numerators: list, denominators: list) -> list[float]:
    return [a / b for a, b in zip(numerators, denominators, strict=False) if a is not None and b]


def noise_verdict(ratios: list[float]) -> str:
    """What paired auto / best ratios (one per repeat) say: "within noise" when they fall on both
    sides of 1 with their median within ``AUTO_SLOWER_LIMIT`` of it; "auto slower in 2 of 3
    repeats" (or faster) when they fall on both sides but the median is farther; "auto faster" or
    "auto slower" when every repeat agrees (with "within 5 %" when the median is no worse than
    ``AUTO_SLOWER_LIMIT``); one ratio has no spread to judge by."""
    if not ratios:
        return "-"
    if len(ratios) < 2:
        return "one repeat: no spread to judge by (--repeats 3)"
    lo, hi, median = min(ratios), max(ratios), statistics.median(ratios)
    if lo <= 1.0 <= hi:
        if 1.0 / AUTO_SLOWER_LIMIT <= median <= AUTO_SLOWER_LIMIT:
            return "within noise"
        # Repeats on both sides of 1, but the median far from it: one repeat below 1 is not noise
        # when the others are far above (0.995, 1.364, 1.571).
        side = "slower" if median > 1.0 else "faster"
        agree = sum(r > 1.0 for r in ratios) if median > 1.0 else sum(r < 1.0 for r in ratios)
        return f"auto {side} in {agree} of {len(ratios)} repeats"
    if hi < 1.0:
        return "auto faster"
    return "auto slower, within 5 %" if median <= AUTO_SLOWER_LIMIT else "auto slower"


def verdicts(rows: list[dict]) -> dict:
    """Per budget: auto against the best fixed policy that holds the budget (engine peak <= budget),
    as the median of step-time ratios paired within each repeat, and the planner's error."""
    out = []
    timed = [r for r in rows if not r.get("compiled") and r.get("step_ms") is not None]
    for fraction in sorted({r["budget_fraction"] for r in rows if r.get("budget_fraction")}, reverse=True):
        at = {r["policy"]: r for r in timed if r.get("budget_fraction") == fraction}
        auto = at.get("auto")
        if auto is None:
            continue
        held = [p for p, r in at.items() if r["engine_peak_mb"] is not None and r["engine_peak_mb"] <= r["budget_mb"]]
        fixed = {p: at[p] for p in held if p != "auto"}  # in row order: a tie goes to the first
        best = min(fixed, key=lambda p: fixed[p]["step_ms"]) if fixed else None
        ratios = _paired_ratios(auto["runs_step_ms"], fixed[best]["runs_step_ms"]) if best else []
        ratio = median(ratios)
        predicted = _paired(auto["runs_predicted_ms"], auto["runs_step_ms"])
        out.append(
            {
                "fraction": fraction,
                "auto_ms": auto["step_ms"],
                "best_fixed": best,
                "best_fixed_ms": fixed[best]["step_ms"] if best else None,
                "auto_over_best": ratio,
                "auto_over_best_runs": ratios,
                "verdict": noise_verdict(ratios),
                "best_decisions": fixed[best].get("decisions") if best else None,
                "auto_within_5pct": ratio is not None and ratio <= AUTO_SLOWER_LIMIT,
                "auto_holds_budget": "auto" in held,
                "predicted_ms": auto.get("predicted_ms"),
                "predicted_over_measured": predicted,
                "prediction_within_15pct": predicted is not None and abs(predicted - 1) <= PREDICTION_TOLERANCE,
                "decisions": auto.get("decisions"),
            }
        )
    checks = ("auto_within_5pct", "auto_holds_budget", "prediction_within_15pct")
    return {"verdicts": out} | {f"{c}_everywhere": all(v[c] for v in out) for c in checks}


def _losses(r: dict) -> str:
    if r["kind"] == Kind.NONE.value and r["losses_match"] is not False:
        return "ref"
    if r["losses_match"] is None:
        return "-"
    return "equal" if r["losses_match"] else f"differ ({r['max_loss_diff']:.1g})"


def _failed(r: dict) -> Optional[str]:
    """The note that replaces a failed or skipped configuration's figures."""
    if r["error"]:
        return f"FAILED: {r['error'].splitlines()[0][:100]}"
    return f"skipped: {r['skipped'][:100]}" if r["skipped"] else None


def _shown(columns: list[Column], rows: list[dict]) -> list[Column]:
    """The columns with a value in some row that ran (a CPU run has no link GB/s, for one)."""
    ran = [r for r in rows if not _failed(r)]
    return [c for c in columns if not isinstance(c[1], str) or any(r.get(c[1]) is not None for r in ran)]


def reader_table(rows: list[dict], markdown: bool = False) -> str:
    """The columns a reader needs to compare the configurations (``READER_LEGEND``); table.md has all."""
    columns: list[Column] = [
        ("config", "config", ""),
        ("ms/step", "step_ms", ".1f"),
        ("x none", "ratio", ".2f"),
        ("act MB", "act_peak_mb", ".1f"),
        ("x none", "act_ratio", ".2f"),
        ("moved MB", "offloaded_mb", ".1f"),
        ("wait ms", "exposed_wait_ms", ".1f"),
        ("grads step 0", "grads", ""),
        ("losses", _losses, ""),
    ]
    return records_table(columns, rows, markdown=markdown, note=_failed)


def main_table(rows: list[dict], device: str, markdown: bool = False) -> str:
    columns: list[Column] = [
        ("config", "config", ""),
        ("ms/step", "step_ms", ".1f"),
        ("x none", "ratio", ".2f"),
        (f"peak {'alloc' if device == 'cuda' else 'RSS+cache'} MB", "peak_mb", ".1f"),
        ("act MB", "act_peak_mb", ".1f"),
        ("x none", "act_ratio", ".2f"),
        ("opt MB", "opt_peak_mb", ".1f"),
        ("moved MB", "offloaded_mb", ".1f"),
        ("D2H GB/s", "d2h_gb_per_s", ".1f"),
        ("H2D GB/s", "h2d_gb_per_s", ".1f"),
        ("wait ms", "exposed_wait_ms", ".1f"),
        ("bound ms", "bound_ms", ".1f"),
        ("/bound", "over_bound", ".2f"),
        ("grads step 0", "grads", ""),
        ("losses", _losses, ""),
    ]
    return records_table(_shown(columns, rows), rows, markdown=markdown, note=_failed)


_ENGINE_COLUMNS: list[Column] = [
    ("config", "config", ""),
    ("budget MB", "budget_mb", ".1f"),
    ("CPU ms", "cpu_ms", ".0f"),
    ("engine peak MB", "engine_peak_mb", ".1f"),
    ("recomputed", "recomputed_regions", "g"),
    ("decisions", "decisions", ""),
    ("predicted ms", "predicted_ms", ".1f"),
    ("predicted / measured", lambda r: _paired(r["runs_predicted_ms"], r["runs_step_ms"]), ".2f"),
]
_YES = {True: "yes", False: "NO"}
_VERDICT_COLUMNS: list[Column] = [
    ("budget %", lambda v: 100 * v["fraction"], ".0f"),
    ("auto ms", "auto_ms", ".1f"),
    ("best fixed", "best_fixed", ""),
    ("its ms", "best_fixed_ms", ".1f"),
    ("auto / best", "auto_over_best", ".3f"),
    ("per repeat", lambda v: " ".join(f"{r:.3f}" for r in v["auto_over_best_runs"]) or None, ""),
    ("verdict", "verdict", ""),
    ("holds budget", lambda v: _YES[v["auto_holds_budget"]], ""),
    ("predicted / measured", "predicted_over_measured", ".2f"),
    ("decisions", lambda v: f"{v['decisions']} / {v['best_decisions'] or '-'}" if v["decisions"] else None, ""),
]

LEGEND = """\
ms/step: median over measured steps (then over repeats) of forward + backward + AdamW step.
peak: CUDA max allocated, or on the CPU the process's peak RSS plus the page cache of the spill
files (sampled at the end of forward, as the last block's backward starts and at the end of
backward). act: that peak from the start of forward to the end of backward minus the memory in use
at the start (weight gradients included, alike everywhere); opt: the optimizer step's own peak.
moved: bytes offloaded per step. D2H / H2D GB/s: bytes over the side streams' busy time, where the
engine reports it. wait: reload + evict wait on the compute stream. bound: max(reference step +
recomputed blocks x reference forward ms per block, bytes out / probed out GB/s + bytes back /
probed back GB/s). grads step 0: the loss and gradients of one step on the initial weights at the
timed shape under strict determinism (CUDA: flash attention; CPU: math) against the reference's;
losses: every step's against the reference's (a compiled configuration's against none+compile);
the first step's must be equal (its forward is the same computation everywhere). engine peak: most engine-resident
bytes at once over every step, profiling included. decisions: one letter per block (Keep, Offload,
Recompute, Selective with its stash kept or moved). auto / best: the median over repeats of auto's
step time over the best fixed policy's (the fastest that held the budget) in the same repeat; per
repeat: those ratios; verdict: "within noise" when they fall on both sides of 1 with their median
within 5 % of it, else faster or slower (in every repeat, or in how many). decisions: auto's plan /
the best fixed policy's."""

READER_LEGEND = """ms/step: median step time (forward + backward + AdamW) over the measured steps and repeats; x none:
over no engine's. act MB: the activation peak, from the start of forward to the end of backward
(on the CPU: resident memory plus the page cache of the engine's spill files, so bytes moved into
the page cache still count). moved MB: bytes the engine moved off the compute device per step.
wait ms: time backward waited for bytes to come back plus time forward waited for room.
grads step 0 / losses: the first step's gradients and every step's loss against no engine's, exactly.
Engine table: the budget, the most bytes the engine held at once (profiling steps included), the
plan (one letter per block: Keep, Offload, Recompute, Selective) and the planner's predicted step
time. Verdict table: auto / best is auto's step time over the best fixed policy's in the same
repeat (median over repeats; per repeat listed); "within noise" when those ratios fall on both
sides of 1 with their median within 5 % of it. table.md has every column (peak RSS, optimizer
peak, link GB/s, the cost-model bound)."""


_MARKERS = "osD^v<>pP*Xh"
"""One marker per configuration in the memory-vs-time panel (colours repeat after ten)."""
_MAX_PHASE_TICKS = 16
"""Phase labels under the resident-bytes panel: more than this at fontsize 7 run into each other."""


def pareto_front(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The (time, memory, name) points no other point beats on both time and memory, by time."""
    front, best = [], float("inf")
    for point in sorted(points):
        if point[1] < best:
            front.append(point)
            best = point[1]
    return front


def plot(path: Path, rows: list[dict], results: dict, run: RunSettings) -> Optional[Path]:
    """Activation peak vs step time (every configuration a point named in the legend, not beside
    it, so no two names overlap; no engine's time and peak as dotted lines; the Pareto front
    drawn), and engine-resident bytes over one step at the smallest budget; None without matplotlib."""
    try:
        from matplotlib.figure import Figure  # a Figure made directly draws through Agg, with no pyplot state
    except ImportError:
        return None
    fig = Figure(figsize=(14, 5.2))
    left, right = fig.subplots(1, 2)
    measured = [r for r in rows if r["step_ms"] is not None and r["act_peak_mb"] is not None]
    points = [(r["step_ms"], r["act_peak_mb"], r["config"]) for r in measured]
    for i, (ms, mb, name) in enumerate(points):
        left.scatter(ms, mb, s=40, marker=_MARKERS[i % len(_MARKERS)], label=name, zorder=3)
    reference = next((r for r in measured if r["config"] == REFERENCE.name), None)
    if reference is not None:
        left.axvline(reference["step_ms"], color="black", ls=":", lw=1, label="no engine: time")
        left.axhline(reference["act_peak_mb"], color="black", ls="-.", lw=1, label="no engine: peak")
    front = pareto_front(points)
    left.step(
        [p[0] for p in front], [p[1] for p in front], where="post", color="gray", lw=1, ls="--", label="Pareto front"
    )
    memory = " (RSS + spill page cache)" if run.device == "cpu" else " (allocated)"
    left.set(xlabel="step time, ms (median)", ylabel="activation peak, MB" + memory)
    left.set_title("memory vs time per configuration")
    engine_rows = [r for r in rows if r["kind"] == Kind.ENGINE.value and r["budget_mb"] is not None]
    traced = [(r, trace) for r in engine_rows if (trace := (results[r["config"]][0]["summary"] or {}).get("trace"))]
    if traced:
        smallest = min(r["budget_mb"] for r, _ in traced)
        for r, samples in traced:
            if r["budget_mb"] == smallest:
                resident_mb = [(s["resident_bytes"] or 0) / MB for s in samples]
                right.plot(range(len(samples)), resident_mb, marker="o", ms=3, label=r["config"])
                every = max(1, -(-len(samples) // _MAX_PHASE_TICKS))  # at most that many labels: none overlap
                ticks = range(0, len(samples), every)
                right.set_xticks(list(ticks), [samples[i]["phase"] for i in ticks], rotation=60, fontsize=7)
        right.axhline(smallest, color="gray", ls="--", lw=1, label=f"budget {smallest:.3g} MB")
        right.set(ylabel="engine resident bytes, MB", title="resident activations over the last step")
    else:
        right.set_axis_off()
    left.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    left.grid(alpha=0.3)
    if traced:  # an empty right panel has no legend or grid
        right.legend(fontsize=7)
        right.grid(alpha=0.3)
    fig.suptitle(
        f"MiniGPT {run.layers}x{run.hidden}, seq {run.seq}, batch {run.batch}, {run.dtype} on {run.device}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _write_csv(path: Path, results: dict[str, list[dict]]) -> None:
    reference = {s["step"]: s["loss"] for s in (results.get(REFERENCE.name) or [{"steps": []}])[0]["steps"]}
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for name, runs in results.items():
            for s in (s for r in runs for s in r["steps"]):
                compared = name != REFERENCE.name and s["step"] in reference
                writer.writerow(
                    s
                    | {f"{peak}_mb": round(s[f"{peak}_bytes"] / MB, 3) for peak in _PEAKS}
                    | {"warmup": int(s["warmup"]), "loss": repr(s["loss"])}
                    | {"loss_match": int(s["loss"] == reference[s["step"]]) if compared else ""}
                )


_ATOMICS_NOTE = (
    "note: without --deterministic, CUDA backward kernels may use atomics; losses can differ "
    "after step 0 (the step-0 gradient check and the first step's loss are exact either way)"
)


@dataclasses.dataclass
class Report:
    """The outputs of one benchmark run, rewritten whole each time ``write`` is called."""

    out: Path
    run: RunSettings
    variants: list[Variant]
    env: dict
    machine: Optional[MachineProfile]
    rows: list[dict] = dataclasses.field(default_factory=list)
    checked: dict = dataclasses.field(default_factory=lambda: {"verdicts": []})

    def write(self, results: dict[str, list[dict]], wall_s: Optional[float] = None) -> dict:
        """Write metrics.csv, summary.json, table.md (and the plot, once ``wall_s`` is given); return
        the payload of the last JSON line."""
        self.rows = summarize(self.run, self.variants, results, self.machine)
        self.checked = verdicts(self.rows)
        _write_csv(self.out / "metrics.csv", results)
        plot_path = plot(self.out / "step.png", self.rows, results, self.run) if wall_s is not None else None
        payload = {
            "benchmark": "step",
            "settings": dataclasses.asdict(self.run),
            "env": self.env,
            "machine": None if self.machine is None else dataclasses.asdict(self.machine),
            "finished": wall_s is not None,
            "wall_s": None if wall_s is None else round(wall_s, 1),
            "results": self.rows,
            "verdicts": self.checked,
            "failures": failures(self.rows),
            "csv": str(self.out / "metrics.csv"),
            "plot": None if plot_path is None else str(plot_path),
        }
        runs = {
            name: [
                {k: r[k] for k in ("summary", "error", "skipped")} | {"losses": [s["loss"] for s in r["steps"]]}
                for r in repeats
            ]
            for name, repeats in results.items()
        }
        write_json(self.out / "summary.json", payload | {"runs": runs})
        write_text(self.out / "table.md", self.text(markdown=True) + "\n")
        return payload

    def title(self) -> str:
        run = self.run
        return (
            f"MiniGPT {run.layers} x {run.hidden} (heads {run.heads}), seq {run.seq}, batch {run.batch}, "
            f"{run.dtype}, attention {run.attention}, dropout {run.dropout}; {run.warmup} warm-up + {run.steps} "
            f"measured steps x {run.repeats} repeats; {describe_machine(self.env)}"
        )

    def text(self, markdown: bool = False, reader: bool = False) -> str:
        """The tables and the legend; ``reader``: the short table and its legend (``--demo``)."""
        parts = [
            ("# Step benchmark\n\n" if markdown else "") + self.title(),
            reader_table(self.rows, markdown) if reader else main_table(self.rows, self.run.device, markdown),
        ]
        if any(r["kind"] == Kind.ENGINE.value for r in self.rows):
            engine_rows = [r for r in self.rows if r["kind"] == Kind.ENGINE.value and not _failed(r)]
            parts.append(records_table(_ENGINE_COLUMNS, engine_rows, markdown=markdown))
        if self.checked["verdicts"]:
            parts.append(records_table(_VERDICT_COLUMNS, self.checked["verdicts"], markdown=markdown))
        parts.append(READER_LEGEND if reader else LEGEND)
        nondeterministic = self.run.device == "cuda" and not self.run.deterministic
        if nondeterministic and any(r["losses_match"] is False for r in self.rows):
            parts.append(_ATOMICS_NOTE)
        return "\n\n".join(parts)
