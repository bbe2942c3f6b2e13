"""Mutation testing of the lines a change touched: cosmic-ray's mutants, each run against the test files that cover it.

`make mutants` runs this, then `bench/mutants.py` (the named guards, kept as the seed list). For each
module of `bench/mutants.toml` that changed between BASE and HEAD, cosmic-ray makes every one-edit
mutant of the module (a comparison flipped, a constant changed, a `not` added, a loop run zero
times, ...), `cr-filter-git` keeps those on lines changed since BASE, and each kept mutant runs the
module's test files (`pytest -x -q -p no:xdist`): killed when they fail, survived when they pass.

    python bench/mutate.py [--base REV] [--module PATH ...] [--every K --seed S] [--report-only]

Where it runs: a clone of HEAD under `out/mutants/<base>-<digest>[-kK-sS]/tree` (cosmic-ray edits the
file in place; the working tree is neither read nor touched: commit first); the digest is that of
HEAD's `offload/` and `tests/` and of the map. Each module's session is a cosmic-ray database beside
it, so a run stopped (Ctrl-C, a closed terminal) goes on where it stopped when the same command runs
again, also after commits that change neither the code, the tests nor the map; `--report-only` prints
a run's table while it goes on in the background (`nohup make mutants &`).

Before a module's mutants, its test files run once unmutated: a failing baseline would read as
every mutant killed, so that module is refused. A run past the timeout (a mutant that loops) is
counted apart, not as killed. `--every K` keeps every K-th of the filtered mutants (in file, line,
operator order, from an offset drawn with `--seed`) and marks the rest skipped, for a run that must
fit in the time there is. Prints a table, the survivors, and last one JSON line with the kill rate
(killed / (killed + survived)).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: cosmic-ray's own dependency reads TOML the same way
    import toml as tomllib

REPO = Path(__file__).resolve().parents[1]
MAP = REPO / "bench" / "mutants.toml"
OUT = REPO / "out" / "mutants"
PYTEST_ARGS = "-x -q -p no:xdist -p no:cacheprovider"
"""One process, first failure ends the run: a mutant needs one failing test, not the whole file's report."""
TIMEOUT_FACTOR = 4
TIMEOUT_FLOOR_S = 60.0
"""A mutant's tests may take TIMEOUT_FACTOR × the unmutated run (and at least this long) before it is
called a timeout: the 2-core machines run at loads of 4-8, so one run's time can double."""
SAMPLED_OUT = "sampled out (--every)"


def load_map(path: Path = MAP) -> dict[str, list[str]]:
    """The module → test files mapping: `[modules]` of bench/mutants.toml."""
    return dict(tomllib.loads(path.read_text())["modules"])


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def resolve_base(base: str | None) -> str:
    """BASE as a commit: --base, else $MUTANTS_BASE, else origin/main where there is one, else HEAD~1."""
    for rev in (base, os.environ.get("MUTANTS_BASE") or None, "origin/main", "HEAD~1"):
        if rev is None:
            continue
        found = subprocess.run(
            ["git", "rev-parse", "--verify", "-q", f"{rev}^{{commit}}"], cwd=REPO, capture_output=True, text=True
        )
        if found.returncode == 0:
            return found.stdout.strip()
        if rev in (base, os.environ.get("MUTANTS_BASE")):
            sys.exit(f"mutate: the base {rev!r} is no commit of this checkout; give one with --base or MUTANTS_BASE")
    sys.exit("mutate: no base commit (no origin/main, no HEAD~1); give one with --base or MUTANTS_BASE")


def session_name(base: str, head: str, every: int, seed: int) -> str:
    """One session per base, code under test, tests and map: a commit that changes none of them (docs,
    bench/) resumes the same run; one that changes any starts a new one."""
    code = git("rev-parse", f"{head}:offload", f"{head}:tests").split()
    digest = hashlib.sha1(" ".join([*code, MAP.read_text()]).encode()).hexdigest()[:12]
    return f"{base[:12]}-{digest}" + (f"-k{every}-s{seed}" if every > 1 else "")


def slug(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


@dataclasses.dataclass
class Counts:
    module: str
    mutants: int = 0
    """Made by cosmic-ray on the changed lines (after cr-filter-git), before any sampling."""
    run: int = 0
    killed: int = 0
    survived: int = 0
    timeout: int = 0
    other: int = 0
    """Neither killed nor survived: the mutation could not be applied, or pytest could not start."""
    pending: int = 0
    survivors: list[dict] = dataclasses.field(default_factory=list)

    @property
    def kill_rate(self) -> float | None:
        judged = self.killed + self.survived
        return round(self.killed / judged, 3) if judged else None


def prepare_tree(session: Path, head: str) -> Path:
    """A clone of HEAD to mutate in place, made once per session and put back to HEAD on every start (a
    run killed mid-mutant leaves its edit in the file)."""
    tree = session / "tree"
    if not (tree / ".git").is_dir():
        session.mkdir(parents=True, exist_ok=True)
        git("clone", "-q", "--no-checkout", str(REPO), str(tree))
    git("checkout", "-q", "--detach", head, cwd=tree)
    git("reset", "-q", "--hard", head, cwd=tree)
    return tree


def test_env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return env | {"PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}


def baseline(session: Path, tree: Path, module: str, tests: list[str]) -> float | None:
    """The module's test files once, unmutated: their time, or None when they fail (kept for a resumed run)."""
    record = session / f"{slug(module)}.baseline.json"
    if record.exists():
        return json.loads(record.read_text())["seconds"]
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *PYTEST_ARGS.split(), *tests],
        cwd=tree,
        env=test_env(tree),
        capture_output=True,
        text=True,
    )
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        print(
            f"mutate: {module}: its tests fail unmutated, so every mutant would read as killed; "
            f"fix them first:\n{(proc.stdout + proc.stderr).strip()[-800:]}",
            file=sys.stderr,
        )
        return None
    record.write_text(json.dumps({"seconds": seconds}) + "\n")
    return seconds


def init_session(
    session: Path, tree: Path, module: str, tests: list[str], base: str, seconds: float, every: int, seed: int
) -> Path:
    """cosmic-ray's config and session for one module, made once: init, cr-filter-git, the sample."""
    db = session / f"{slug(module)}.sqlite"
    if db.exists():
        return db
    config = session / f"{slug(module)}.toml"
    timeout = max(TIMEOUT_FLOOR_S, TIMEOUT_FACTOR * seconds)
    command = f"{sys.executable} -m pytest {PYTEST_ARGS} {' '.join(tests)}"
    config.write_text(
        "[cosmic-ray]\n"
        f'module-path = "{module}"\n'
        f"timeout = {timeout}\n"
        "excluded-modules = []\n"
        f'test-command = "{command}"\n\n'
        "[cosmic-ray.distributor]\n"
        'name = "local"\n\n'
        "[cosmic-ray.filters.git-filter]\n"
        f'branch = "{base}"\n'
    )
    bin_dir = Path(sys.executable).parent
    partial = db.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    for tool, args in (
        ("cosmic-ray", ["init", str(config), str(partial)]),
        ("cr-filter-git", ["--config", str(config), str(partial)]),
    ):
        subprocess.run([str(bin_dir / tool), *args], cwd=tree, check=True, env=test_env(tree))
    if every > 1:
        with use_db(str(partial), WorkDB.Mode.open) as work_db:
            items = sorted(
                work_db.pending_work_items,
                key=lambda w: [
                    (str(m.module_path), m.start_pos, m.end_pos, m.operator_name, m.occurrence) for m in w.mutations
                ],
            )
            offset = random.Random(seed).randrange(every)
            dropped = [w.job_id for i, w in enumerate(items) if (i - offset) % every != 0]
            if dropped:
                work_db.set_multiple_results(
                    dropped, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=SAMPLED_OUT)
                )
    partial.rename(db)  # only a finished init counts: an interrupted one is made again
    return db


def mutation_text(diff: str | None) -> str:
    """The mutant's edit, `old → new`, from cosmic-ray's unified diff."""
    if not diff:
        return ""
    old = [line[1:].strip() for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    new = [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return f"{' / '.join(old)} → {' / '.join(new)}"


def count(db: Path, module: str) -> Counts:
    counts = Counts(module)
    with use_db(str(db), WorkDB.Mode.open) as work_db:
        done = work_db.completed_work_items
        counts.pending = len(work_db.pending_work_items)
    for item, result in done:
        if result.output == "Filtered git":
            continue
        counts.mutants += 1
        if result.output == SAMPLED_OUT:
            continue
        counts.run += 1
        if result.worker_outcome is not WorkerOutcome.NORMAL or result.test_outcome is TestOutcome.INCOMPETENT:
            counts.other += 1
        elif result.output == "timeout":  # cosmic-ray's word for a run killed at its timeout
            counts.timeout += 1
        elif result.test_outcome is TestOutcome.KILLED:
            counts.killed += 1
        else:
            mutation = item.mutations[0]
            counts.survivors.append(
                {
                    "where": f"{mutation.module_path}:{mutation.start_pos[0]}",
                    "operator": mutation.operator_name.removeprefix("core/"),
                    "occurrence": mutation.occurrence,
                    "mutation": mutation_text(result.diff),
                }
            )
    counts.mutants += counts.pending
    counts.survived = len(counts.survivors)
    counts.survivors.sort(key=lambda s: (s["where"].split(":")[0], int(s["where"].split(":")[1])))
    return counts


def report(rows: list[Counts], meta: dict) -> dict:
    print(
        f"mutants of the lines changed {meta['base'][:12]}..{meta['head'][:12]}"
        + (f", a sample of 1 in {meta['every']} (seed {meta['seed']})" if meta["every"] > 1 else "")
    )
    print("| module | on changed lines | run | killed | survived | timeout | other | pending | kill rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in rows:
        rate = "" if c.kill_rate is None else f"{c.kill_rate:.0%}"
        print(
            f"| `{c.module}` | {c.mutants} | {c.run} | {c.killed} | {c.survived} | {c.timeout} | {c.other} "
            f"| {c.pending} | {rate} |"
        )
    killed, survived = sum(c.killed for c in rows), sum(c.survived for c in rows)
    total = Counts("all", killed=killed, survived=survived)
    print(
        f"| all | {sum(c.mutants for c in rows)} | {sum(c.run for c in rows)} | {killed} | {survived} "
        f"| {sum(c.timeout for c in rows)} | {sum(c.other for c in rows)} | {sum(c.pending for c in rows)} "
        f"| {'' if total.kill_rate is None else f'{total.kill_rate:.0%}'} |"
    )
    survivors = [s for c in rows for s in c.survivors]
    if survivors:
        print("\nsurvivors (no listed test fails with this edit):")
        for s in survivors:
            print(f"- {s['where']} {s['operator']}: {s['mutation']}")
    payload = meta | {
        "modules": {
            c.module: {k: v for k, v in dataclasses.asdict(c).items() if k not in ("module", "survivors")}
            | {"kill_rate": c.kill_rate}
            for c in rows
        },
        "killed": killed,
        "survived": survived,
        "kill_rate": total.kill_rate,
        "pending": sum(c.pending for c in rows),
        "survivors": survivors,
    }
    print(json.dumps(payload))
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the commit the change starts from (default $MUTANTS_BASE, origin/main, HEAD~1)")
    parser.add_argument("--module", action="append", help="only this module of bench/mutants.toml (repeatable)")
    parser.add_argument("--every", type=int, default=1, help="run every K-th mutant only (a seeded sample)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-only", action="store_true", help="print the sessions' results, run nothing")
    parser.add_argument(
        "--session",
        type=Path,
        help="the session folder to run or report (default: named by the "
        "base, the code and tests at HEAD, and the map, under out/mutants/)",
    )
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    if args.every < 1:
        parser.error(f"--every {args.every}: must be 1 (all mutants) or more")
    mapping = load_map()
    base, head = resolve_base(args.base), git("rev-parse", "HEAD")
    changed = git("diff", "--name-only", base, head, "--", "offload").splitlines()
    unmapped = sorted(p for p in changed if p.endswith(".py") and p not in mapping)
    if args.module:
        unknown = [m for m in args.module if m not in mapping]
        if unknown:
            parser.error(f"--module {unknown}: not in {MAP.relative_to(REPO)}; its modules: {', '.join(mapping)}")
        modules = [m for m in args.module if m in changed]
    else:
        modules = [m for m in mapping if m in changed]
    if unmapped and not args.module:
        print(
            f"mutate: changed but not in {MAP.relative_to(REPO)} (no mutants run): {', '.join(unmapped)}",
            file=sys.stderr,
        )
    session = (args.session or OUT / session_name(base, head, args.every, args.seed)).resolve()
    refused = []
    if not modules:
        print(f"mutate: no module of {MAP.relative_to(REPO)} changed since {base[:12]}: no mutants to run")
    elif not args.report_only:
        tree = prepare_tree(session, head)
        for module in modules:
            seconds = baseline(session, tree, module, mapping[module])
            if seconds is None:
                refused.append(module)
                continue
            db = init_session(session, tree, module, mapping[module], base, seconds, args.every, args.seed)
            left = count(db, module).pending
            print(f"mutate: {module}: {left} mutants to run (tests {seconds} s unmutated)", flush=True)
            if left:
                subprocess.run(
                    [str(Path(sys.executable).parent / "cosmic-ray"), "exec", f"{db.with_suffix('.toml')}", str(db)],
                    cwd=tree,
                    check=True,
                    env=test_env(tree),
                )
    rows = [count(session / f"{slug(m)}.sqlite", m) for m in modules if (session / f"{slug(m)}.sqlite").exists()]
    if (session / "tree" / ".git").is_dir():
        head = git("rev-parse", "HEAD", cwd=session / "tree")  # the commit the session's mutants ran on
    meta = {
        "base": base,
        "head": head,
        "every": args.every,
        "seed": args.seed,
        "session": str(session),
        "unmapped": unmapped,
        "refused": refused,
    }
    payload = report(rows, meta)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(payload, indent=1) + "\n")
    return 1 if refused or payload["pending"] else 0


if __name__ == "__main__":
    sys.exit(main())
