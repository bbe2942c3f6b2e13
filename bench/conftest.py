"""pytest configuration of the benchmark suite: import paths, the result collector, the summary.

``pytest bench`` (from the repo root) collects only this directory; ``make test`` runs
``pytest tests`` and never sees it. At the end of the session the layer measurements gathered by
``test_layers.py`` are printed as one comparison table and written as JSON (``layers.report``).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent
for path in (BENCH_DIR, BENCH_DIR.parent):  # `import layers` and `import offload` without installing
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import layers  # noqa: E402

_RESULTS = pytest.StashKey["LayerResults"]()


class LayerResults:
    """Medians and untimed facts per (layer, size), filled by the tests, read at session end."""

    def __init__(self) -> None:
        self.cases: dict[str, tuple] = {}  # case id -> (case, medians by kind, transfer ms, facts)
        self.device = None

    def record(self, case: layers.Case, device, kind: str, median_ms: float,
               transfer_ms: float | None = None, facts: dict | None = None) -> None:
        self.device = device
        _, medians, transfer, known = self.cases.get(case.id, (case, {}, None, {}))
        medians[kind] = median_ms
        self.cases[case.id] = (case, medians, transfer if transfer_ms is None else transfer_ms, facts or known)

    def rows(self) -> list[dict]:
        return [layers.layer_row(case, self.device, medians, transfer, facts)
                for case, medians, transfer, facts in self.cases.values()]

    def complete(self) -> bool:
        expected = {case.id for case in layers.cases(self.device)}
        return expected <= set(self.cases) and all(
            len(m) == len(layers.LayerBench.KINDS) and not any(math.isnan(v) for v in m.values())
            for _, m, _, _ in self.cases.values())


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RESULTS] = LayerResults()


@pytest.fixture(scope="session")
def layer_results(request: pytest.FixtureRequest) -> LayerResults:
    return request.config.stash[_RESULTS]


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's own tables, so ours is the last word
def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    results = config.stash.get(_RESULTS, None)
    if results is None or not results.cases:
        return
    terminalreporter.write_line("")
    layers.report(results.rows(), results.device, "pytest bench (pytest-benchmark)",
                  write=results.complete() or bool(os.environ.get(layers.OUT_ENV)), say=terminalreporter.write_line)
