"""The quick loop (``-m "not slow"``) keeps a covering subset of every sweep: See Note: [a sweep's
quick cases] in ``tests/conftest.py``. Collection only, in a subprocess: nothing here runs a test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SWEEP = "tests/test_inplace.py::test_modified_after_save_raises_like_pytorch"


def _collected(*args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # an outer -m must not reach it
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", SWEEP, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in proc.stdout.splitlines() if line.startswith(SWEEP + "[")]


def _id_parts(ids: list[str]) -> set[str]:
    return {part for i in ids for part in re.search(r"\[(.*)\]", i).group(1).split("-")}


def test_the_quick_loop_meets_every_value_of_a_sweep_in_fewer_cases():
    full = _collected()
    quick = _collected("-m", "not slow")
    assert set(quick) < set(full), "the quick loop keeps a strict subset of the sweep's cases"
    # Every value (settle, tier, budget, kind: the id's parts) that a full case has, a quick case has too.
    assert _id_parts(quick) == _id_parts(full)
    # Four axes (settle 2, tier 2, budget 3, kind 6): one case per new value needs at most 6 + 3 + 2 + 2 - 3
    # cases; the product is 72.
    assert len(full) == 72 and len(quick) <= 10, (len(full), len(quick))
