"""Remove one guard at a time and run the tests that should notice: does the suite catch each removal?

Each mutant is one exact edit of one file (a guard, a margin, a branch taken out). For each, the
checkout's last commit is cloned into a scratch directory (the working tree is neither read nor
touched: commit first), the edit applied,
and the test file named for it run; a mutant is caught when that run fails. The table names the
first failing test. The edits are text: one that no longer applies (the code moved on) fails the
run with its name, so the list must be kept beside the code it edits.

    python bench/mutants.py [--only NAME] [--json-out P]

Prints a table and, last, one JSON line. About 2 min for the list below on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600
"""A mutant's test file may take this long; past it the mutant is reported as neither caught nor not."""


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: str


MUTANTS = (
    Mutant(
        "the held-out margin a richer time basis must beat",
        "offload/_plan/fit.py",
        "if score is not None and (best is None or score < best[0] * HELD_OUT_MARGIN):",
        "if score is not None and (best is None or score < best[0]):",
        "tests/test_fit.py",
    ),
    Mutant(
        "the spread that makes a second shape a measured one",
        "offload/_plan/profiler.py",
        "return distance >= (SECOND_SHAPE_SPREAD if len(fam.fit.measured) == 1 else EXTRAPOLATION_LIMIT)",
        "return distance >= EXTRAPOLATION_LIMIT",
        "tests/test_profiler.py",
    ),
    Mutant(
        "a bucket's decisions reused under another budget",
        "offload/_plan/profiler.py",
        "            and not replan_needed(searched.budget_bytes, budget)\n",
        "",
        "tests/test_profiler.py",
    ),
    Mutant(
        "a bucket planned at the shape seen, not its largest",
        "offload/_plan/profiler.py",
        "top_profiles, top_other_ms = fam.fit.derive(top)",
        "top_profiles, top_other_ms = fam.fit.derive(shape)",
        "tests/test_profiler.py",
    ),
    Mutant(
        "derived plans kept after a refit",
        "offload/_plan/profiler.py",
        "            del self.plans[key]\n",
        "            pass\n",
        "tests/test_profiler.py",
    ),
    Mutant(
        "saves after the regions not sent out eagerly under offload",
        "offload/_regions/steps.py",
        "        return self.entry.plan.decision_after() is Decision.OFFLOAD",
        "        return False",
        "tests/test_whole_step.py",
    ),
    Mutant(
        "saves between two regions left out of the 'before' row",
        "offload/_regions/steps.py",
        "            self.between += saved - self.last_end",
        "            pass",
        "tests/test_whole_step.py",
    ),
    Mutant(
        "direct I/O never used",
        "offload/_memory/spill.py",
        "    if _O_DIRECT and host.direct_io:",
        "    if False:",
        "tests/test_disk_tier.py",
    ),
    Mutant(
        "cgroup v1's numeric 'no limit' read as a limit",
        "offload/_budget.py",
        'if limit_text == "max" or int(limit_text) >= _NO_LIMIT:',
        'if limit_text == "max":',
        "tests/test_budget_internals.py",
    ),
    Mutant(
        "the cgroup ancestor walk",
        "offload/_budget.py",
        "            here = here.parent",
        "            break",
        "tests/test_budget_internals.py",
    ),
    Mutant(
        "the fit's singular-pivot guard",
        "offload/_plan/fit.py",
        "        if abs(a[pivot][col]) < _SINGULAR:\n            return None\n",
        "",
        "tests/test_fit.py",
    ),
)


def run_one(mutant: Mutant, python: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="offload-mutant-") as scratch:
        tree = Path(scratch) / "tree"
        subprocess.run(["git", "clone", "-q", str(REPO), str(tree)], check=True)
        target = tree / mutant.path
        text = target.read_text()
        if text.count(mutant.old) != 1:
            return {"mutant": mutant.name, "caught": None, "why": f"the edit no longer applies to {mutant.path}"}
        target.write_text(text.replace(mutant.old, mutant.new))
        start = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"} | {"PYTHONPATH": str(tree)}
        row = {"mutant": mutant.name, "file": mutant.path}
        try:
            proc = subprocess.run(
                [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", mutant.tests],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return row | {"caught": None, "why": f"the tests ran past {TIMEOUT_S} s (a hang is not a failing assert)"}
        seconds = round(time.perf_counter() - start, 1)
        if proc.returncode not in (0, 1):  # 2-5: interrupted, internal or usage error, nothing collected
            why = f"pytest exited {proc.returncode}, not a test failing: {(proc.stdout + proc.stderr).strip()[-300:]}"
            return row | {"caught": None, "why": why, "seconds": seconds}
        failing = [line.split(" ")[1] for line in proc.stdout.splitlines() if line.startswith("FAILED")]
        return row | {"caught": proc.returncode == 1, "by": failing[0] if failing else None, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the mutants whose name contains this")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if args.only is None or args.only in m.name]
    if not mutants:
        parser.error(f"--only {args.only!r} names no mutant; the mutants: {', '.join(m.name for m in MUTANTS)}")
    rows = [run_one(m, sys.executable) for m in mutants]
    print("| removal | file | caught | by |")
    print("|---|---|---|---|")
    for r in rows:
        caught = {True: "yes", False: "**no**", None: f"not known: {r.get('why')}"}[r["caught"]]
        print(f"| {r['mutant']} | `{r.get('file', '')}` | {caught} | `{r.get('by')}` |")
    payload = {"mutants": rows, "caught": sum(r["caught"] is True for r in rows), "total": len(rows)}
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps(payload))
    return 0 if all(r["caught"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
