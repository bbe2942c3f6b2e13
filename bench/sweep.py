"""Budget sweep on the CPU: disk tier versus recompute versus the planner, on the mini GPT.

What it answers: at a given activation budget, which of "offload" (spill the oldest activations
to the spill directory), "recompute" (checkpoint every block) and "auto" (the planner's mix) gives
the fastest step, whether "auto" is never more than 5% slower than the best fixed policy that
holds the budget, and how close the planner's predicted step time is to the measured one.

    parent:  --one none ─▶ activation bytes A (stats.saved_bytes at budget None)
             for budget in 100%, 50%, 25%, 10% of A:
                 for policy in offload, recompute, auto:  --one <policy> <budget MB>
             table + results/sweep-cpu.{md,json} + last-line JSON
    child:   fresh process ─▶ build model ─▶ first step (profiles, plans) ─▶ warm-up ─▶ timed steps
             ─▶ one JSON line: median step ms, peak RSS (VmHWM), engine stats, plan

Every configuration runs in a fresh process so its peak resident set size (``VmHWM``) is its
own: a process's high-water mark never goes down. The planner plans with the real machine
profile from ``offload.probe()`` (measured once, then cached on disk).

Run from the repo root::

    python bench/sweep.py                    # the sweep (~3 min on a quiet 2-core machine)
    python bench/sweep.py --steps 2 --fractions 0.5 --no-write   # a quick plumbing check
    python bench/sweep.py --one auto 120     # one configuration, one JSON line
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MB, RESULTS_DIR, describe_machine, environment  # noqa: E402

import offload  # noqa: E402
from offload.models.corpus import batches, load_corpus  # noqa: E402
from offload.models.gpt import GPTConfig, MiniGPT  # noqa: E402

POLICIES = ("offload", "recompute", "auto")
"""The policies compared at each budget; "none" (budget None) is the reference row."""
FRACTIONS = (1.0, 0.5, 0.25, 0.1)
"""Budgets as fractions of the activation bytes saved at budget None."""
AUTO_SLOWER_LIMIT = 1.05
"""auto may be at most 5% slower than the best fixed policy that holds the same budget."""
PREDICTION_TOLERANCE = 0.15
"""The planner's predicted step time should be within 15% of the measured one."""
SEED = 1234
LEARNING_RATE = 1e-3
CORPUS_BYTES = 1_000_000
"""Enough text that the few steps here never repeat a window; small enough to load at once."""
CHILD_TIMEOUT_S = 600

MMAP_NOTE = """\
Peak RSS and glibc: by default glibc serves the 2-8 MB activation buffers from its heap once a
few have been freed (its mmap threshold rises), and keeps freed heap memory mapped. The disk tier
frees and re-allocates those buffers in a different order than a plain step, so its heap
fragments and RSS stays ~100 MB above what the engine holds (measured at a 10% budget: steady RSS
~600 MB for offload vs ~500 MB for recompute, both with <= 42 MB engine-resident). With
--malloc-mmap-threshold 65536 every such buffer is its own mapping, returned on free: then offload
and recompute at 10% both sit near 270-320 MB. Either way is real; the flag shows which part is
the allocator's."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """Model and timing settings, the same in every child of one sweep."""

    n_layer: int = 6
    n_embd: int = 256
    n_head: int = 4
    seq: int = 256
    batch: int = 8
    dropout: float = 0.1
    attention: str = "sdpa"
    warmup: int = 1
    """Untimed steps after the engine's profiling steps (1 to 3, see offload._regions)."""
    steps: int = 4
    """Timed steps; the step time is their median."""

    def gpt(self) -> GPTConfig:
        return GPTConfig(
            n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, seq_len=self.seq,
            dropout=self.dropout, attention=self.attention,
        )


# ---------------------------------------------------------------------------------------------
# one configuration, in this (fresh) process



def _peak_rss_bytes() -> int:
    """This process's own peak resident set (VmHWM). ``ru_maxrss`` is carried over from the parent
    across fork + exec on Linux, so a small configuration would report the parent's size."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def run_one(setup: Setup, policy: str, budget_mb: Optional[float]) -> dict:
    """Train under ``policy`` at ``budget_mb`` (None: no budget; policy 'plain': no engine)."""
    data = load_corpus(CORPUS_BYTES)
    torch.manual_seed(SEED)
    model = MiniGPT(setup.gpt()).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    stream = batches(data, setup.batch, setup.seq, torch.Generator().manual_seed(SEED))
    machine = offload.probe("cpu") if policy in ("auto", "offload") else None
    eng = None
    if policy != "plain":
        eng = offload.engine(budget_mb, policy=policy, regions=model.blocks, model=model, machine=machine)
    rss_before_bytes = _rss_bytes("VmRSS")

    steps_ms, cpu_ms, per_step = [], [], []
    profiling_steps, all_peaks = 0, []
    for step, (x, y) in enumerate(stream):
        if len(steps_ms) == setup.steps:
            break
        profiling = eng is not None and eng.profiling
        profiling_steps += profiling
        torch.manual_seed(SEED + 1 + step)
        if eng is not None:
            eng.reset_stats()
        start, start_cpu = time.perf_counter(), time.process_time()
        if eng is None:
            _, loss = model(x, y)
        else:
            with eng:
                _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_ms = (time.perf_counter() - start) * 1e3
        step_cpu_ms = (time.process_time() - start_cpu) * 1e3
        del loss
        if eng is not None:
            all_peaks.append(eng.stats.peak_resident_bytes)
        if not profiling and step >= max(profiling_steps, 1) + setup.warmup:
            steps_ms.append(step_ms)
            cpu_ms.append(step_cpu_ms)
            if eng is not None:
                per_step.append(eng.stats)

    row = {
        "policy": policy,
        "budget_mb": budget_mb,
        "step_ms": statistics.median(steps_ms),
        "steps_ms": [round(ms, 2) for ms in steps_ms],
        "cpu_ms": statistics.median(cpu_ms),
        "peak_rss_mb": _peak_rss_bytes() / MB,
        "rss_before_steps_mb": rss_before_bytes / MB,
        "torch_threads": torch.get_num_threads(),
        "profiling_steps": profiling_steps,
    }
    if eng is not None:
        row.update(
            saved_bytes=max(s.saved_bytes for s in per_step),
            engine_peak_resident_mb=max(all_peaks) / MB,  # every step: profiling and warm-up too
            recomputed_regions=per_step[-1].recomputed_regions,
            offloaded_mb=per_step[-1].offloaded_bytes / MB,
            evict_wait_ms=statistics.median(s.evict_wait_ms for s in per_step),
            reload_wait_ms=statistics.median(s.reload_wait_ms for s in per_step),
            budget_bytes=eng.config.budget_bytes,
        )
        plan = eng.plan
        if plan is not None:
            row.update(
                predicted_step_ms=plan.predicted_step_ms,
                baseline_step_ms=plan.baseline_step_ms,
                predicted_peak_mb=plan.predicted_peak_bytes / MB,
                decisions="".join(d.value[0].upper() for d in plan.decisions),
                plan=plan.to_dict(),
            )
        eng.close()
    if machine is not None:
        row["machine"] = dataclasses.asdict(machine)
    return row


# ---------------------------------------------------------------------------------------------
# the sweep (parent)


def _run_child(setup: Setup, policy: str, budget_mb: Optional[float], env: Optional[dict] = None) -> dict:
    cmd = [sys.executable, __file__, "--one", policy, "none" if budget_mb is None else repr(budget_mb)]
    cmd += ["--setup", json.dumps(dataclasses.asdict(setup))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{policy} at {budget_mb} MB failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def sweep(setup: Setup, fractions, repeats: int, mmap_threshold: Optional[int] = None) -> dict:
    offload.probe("cpu")  # measure once here, so children read the cache and time nothing extra
    env = None
    if mmap_threshold is not None:  # See MMAP_NOTE
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(mmap_threshold))
    child = functools.partial(_run_child, env=env)
    reference = child(setup, "none", None)
    activation_bytes = reference["saved_bytes"]
    rows = {("none", None): [reference]}
    for repeat in range(repeats):
        if repeats > 1 or ("plain", None) not in rows:
            rows.setdefault(("plain", None), []).append(child(setup, "plain", None))
        if repeats > 1 and len(rows[("none", None)]) < repeats:
            rows[("none", None)].append(child(setup, "none", None))
        for fraction in fractions:
            # Interleaved, and the order rotated each repeat: drift hits every policy alike.
            for policy in POLICIES[repeat % len(POLICIES):] + POLICIES[: repeat % len(POLICIES)]:
                budget_mb = fraction * activation_bytes / MB
                row = child(setup, policy, budget_mb)
                row["fraction"] = fraction
                rows.setdefault((policy, fraction), []).append(row)
                print(f"  {policy:>9} {fraction:>5.0%}: {row['step_ms']:8.1f} ms", file=sys.stderr, flush=True)
    return {"activation_bytes": activation_bytes, "rows": [_merge(runs) for runs in rows.values()]}


def _merge(runs: list[dict]) -> dict:
    """One row from repeated runs of a configuration: median step time, max peaks."""
    row = dict(runs[-1])
    row["step_ms"] = statistics.median(r["step_ms"] for r in runs)
    row["cpu_ms"] = statistics.median(r["cpu_ms"] for r in runs)
    row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    row["engine_peak_resident_mb"] = max((r.get("engine_peak_resident_mb") or 0.0) for r in runs) or None
    predicted = [r["predicted_step_ms"] for r in runs if r.get("predicted_step_ms") is not None]
    if predicted:  # each run plans from its own profiling steps
        row["predicted_step_ms"] = statistics.median(predicted)
    row["runs"] = len(runs)
    row["runs_step_ms"] = [r["step_ms"] for r in runs]  # in repeat order: paired with other policies'
    row["runs_predicted_ms"] = [r.get("predicted_step_ms") for r in runs]
    return row


def check(result: dict) -> dict:
    """Per budget: auto against the best fixed policy that holds the budget, and the planner's error."""
    rows = result["rows"]
    verdicts = []
    for fraction in sorted({r["fraction"] for r in rows if "fraction" in r}, reverse=True):
        at = {r["policy"]: r for r in rows if r.get("fraction") == fraction}
        auto = at.get("auto")
        if auto is None:
            continue
        held = {p: r for p, r in at.items() if r["engine_peak_resident_mb"] * MB <= r["budget_bytes"]}
        fixed = {p: r for p, r in held.items() if p != "auto"}
        best = min(fixed, key=lambda p: fixed[p]["step_ms"]) if fixed else None
        # Ratios within one repeat (the two ran minutes apart), then their median: drift between
        # repeats cancels. One repeat: the plain ratio.
        ratio = _median_ratio(auto["runs_step_ms"], fixed[best]["runs_step_ms"]) if best else None
        predicted_over_measured = _median_ratio(auto["runs_predicted_ms"], auto["runs_step_ms"])
        predicted = auto.get("predicted_step_ms")
        verdicts.append({
            "fraction": fraction,
            "auto_ms": auto["step_ms"],
            "best_fixed": best,
            "best_fixed_ms": fixed[best]["step_ms"] if best else None,
            "auto_over_best": ratio,
            "auto_within_5pct": ratio is not None and ratio <= AUTO_SLOWER_LIMIT,
            "auto_holds_budget": "auto" in held,
            "predicted_ms": predicted,
            "predicted_over_measured": predicted_over_measured,
            "prediction_within_15pct": predicted_over_measured is not None
            and abs(predicted_over_measured - 1) <= PREDICTION_TOLERANCE,
            "decisions": auto.get("decisions"),
        })
    return {
        "verdicts": verdicts,
        "auto_within_5pct_everywhere": all(v["auto_within_5pct"] for v in verdicts),
        "auto_holds_budget_everywhere": all(v["auto_holds_budget"] for v in verdicts),
        "prediction_within_15pct_everywhere": all(v["prediction_within_15pct"] for v in verdicts),
    }


def _median_ratio(numerators: list, denominators: list) -> Optional[float]:
    """Median of the paired ratios (None where either side is missing in every pair)."""
    ratios = [a / b for a, b in zip(numerators, denominators) if a is not None and b]
    return statistics.median(ratios) if ratios else None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


LEGEND = """\
step ms: median wall time of the timed steps (forward, backward, SGD step). CPU ms: process CPU time
per step, all threads (compute and spill I/O); unlike wall time it barely moves when other processes
share the cores. peak RSS: VmHWM of the configuration's own fresh process. engine peak: the most
engine-managed activation bytes resident at once (stats.peak_resident_bytes), over every step
including the profiling steps. decisions: the plan,
one letter per block (K keep, O offload, R recompute). predicted ms: the plan's predicted_step_ms.
With several repeats: step ms, CPU ms and predicted ms are medians over the repeats (each repeat
a fresh process per configuration, the policies' order rotated), peaks are maxima, and
"predicted / measured" and "auto / best" are medians of the ratios within each repeat.
plain: no engine at all; none: the engine only counting (policy "none")."""


def table(result: dict) -> str:
    rows = result["rows"]
    none_ms = next(r["step_ms"] for r in rows if r["policy"] == "none")
    header = (
        "| policy | budget % | budget MB | step ms | / none | CPU ms | peak RSS MB | engine peak MB "
        "| recomputed | decisions | predicted ms | predicted / measured |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    order = {p: i for i, p in enumerate(("plain", "none") + POLICIES)}
    for r in sorted(rows, key=lambda r: (-r.get("fraction", 2.0), order[r["policy"]])):
        predicted = r.get("predicted_step_ms")
        accuracy = _median_ratio(r.get("runs_predicted_ms", []), r.get("runs_step_ms", []))
        lines.append(
            f"| {r['policy']} | {_fmt(r.get('fraction') and 100 * r['fraction'], '.0f')} "
            f"| {_fmt(r['budget_mb'], '.1f')} | {r['step_ms']:.1f} | {r['step_ms'] / none_ms:.2f} | {r['cpu_ms']:.0f} "
            f"| {r['peak_rss_mb']:.0f} | {_fmt(r.get('engine_peak_resident_mb'), '.1f')} "
            f"| {_fmt(r.get('recomputed_regions'), 'd')} | {r.get('decisions', '-')} "
            f"| {_fmt(predicted, '.1f')} | {_fmt(accuracy, '.2f')} |"
        )
    return "\n".join(lines)


def verdict_table(checked: dict) -> str:
    lines = [
        "| budget % | auto ms | best fixed | its ms | auto / best | <= 1.05 | holds budget | predicted / measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in checked["verdicts"]:
        lines.append(
            f"| {100 * v['fraction']:.0f} | {v['auto_ms']:.1f} | {v['best_fixed'] or '-'} "
            f"| {_fmt(v['best_fixed_ms'], '.1f')} | {_fmt(v['auto_over_best'], '.3f')} "
            f"| {'yes' if v['auto_within_5pct'] else 'NO'} | {'yes' if v['auto_holds_budget'] else 'NO'} "
            f"| {_fmt(v['predicted_over_measured'], '.2f')} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", nargs=2, metavar=("POLICY", "BUDGET_MB"),
                        help="run one configuration in this process and print one JSON line")
    parser.add_argument("--setup", default=None, help="JSON of Setup fields (children get the parent's)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration")
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS),
                        help="budgets as fractions of the activation bytes, comma-separated")
    parser.add_argument("--repeats", type=int, default=1, help="run the whole sweep this many times (medians)")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="run children with MALLOC_MMAP_THRESHOLD_=BYTES (e.g. 65536); see MMAP_NOTE")
    parser.add_argument("--no-write", action="store_true", help="do not write results/sweep-cpu.{md,json}")
    args = parser.parse_args(argv)

    setup = Setup(**json.loads(args.setup)) if args.setup else Setup()
    if args.steps is not None:
        setup = dataclasses.replace(setup, steps=args.steps)
    if args.one:
        policy, budget = args.one
        row = run_one(setup, policy, None if budget == "none" else float(budget))
        print(json.dumps(row))
        return 0

    env = environment(torch.device("cpu"))
    started = time.perf_counter()
    result = sweep(setup, [float(f) for f in args.fractions.split(",")], args.repeats, args.malloc_mmap_threshold)
    env["malloc_mmap_threshold"] = args.malloc_mmap_threshold
    checked = check(result)
    env["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    # The sweep's own children load the machine, so only the load before it started says whether
    # something else was running.
    shared = env["load_avg_1m"] > 0.5 * (env["cpu_cores_logical"] or 1)
    payload = {
        "bench": "sweep",
        "env": env,
        "machine_shared": shared,
        "setup": dataclasses.asdict(setup),
        "activation_mb": result["activation_bytes"] / MB,
        "rows": result["rows"],
        "check": checked,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    title = (
        f"MiniGPT n_layer={setup.n_layer} n_embd={setup.n_embd} seq={setup.seq} batch={setup.batch} "
        f"attention={setup.attention} dropout={setup.dropout}, fp32; activations at budget None: "
        f"{payload['activation_mb']:.1f} MB"
    )
    print(describe_machine(env))
    print(title)
    print(table(result))
    print()
    print(verdict_table(checked))
    if not args.no_write:
        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / "sweep-cpu.json").write_text(json.dumps(payload, indent=1) + "\n")
        note = (
            f"The machine was shared when this started (1-minute load average {env['load_avg_1m']} on "
            f"{env['cpu_cores_logical']} cores): timings are noisy."
            if shared else
            f"Nothing else was running when this started (1-minute load average {env['load_avg_1m']}; "
            f"{env['load_avg_1m_end']} at the end, the sweep's own processes included)."
        )
        (RESULTS_DIR / "sweep-cpu.md").write_text(
            f"# Budget sweep on the CPU (bench/sweep.py)\n\n{describe_machine(env)}\n\n{title}\n\n{note}\n\n"
            f"{table(result)}\n\n{LEGEND}\n\n{verdict_table(checked)}\n\n{MMAP_NOTE}\n"
        )
    summary = {
        "bench": "sweep",
        "hardware": f"{env['host_cpu']} ({env['cpu_cores_logical']} cores)",
        "torch": env["torch"],
        "date_utc": env["date_utc"],
        "machine_shared": shared,
        "activation_mb": round(payload["activation_mb"], 1),
        "auto_within_5pct_everywhere": checked["auto_within_5pct_everywhere"],
        "auto_holds_budget_everywhere": checked["auto_holds_budget_everywhere"],
        "prediction_within_15pct_everywhere": checked["prediction_within_15pct_everywhere"],
        "auto_over_best": {f"{100 * v['fraction']:.0f}%": _round(v["auto_over_best"]) for v in checked["verdicts"]},
        "predicted_over_measured": {
            f"{100 * v['fraction']:.0f}%": _round(v["predicted_over_measured"]) for v in checked["verdicts"]
        },
    }
    print(json.dumps(summary))
    return 0


def _round(value):
    return None if value is None else round(value, 3)


if __name__ == "__main__":
    sys.exit(main())
