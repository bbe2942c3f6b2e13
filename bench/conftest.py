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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import layers` (which finds offload itself)
import layers  # noqa: E402

_RESULTS = pytest.StashKey["LayerResults"]()


class LayerResults:
    """Medians and untimed facts per (layer, size), filled by the tests, read at session end."""

    def __init__(self) -> None:
        self.medians: dict[layers.Case, dict[str, float]] = {}
        self.transfer_ms: dict[layers.Case, float] = {}
        self.facts: dict[layers.Case, dict] = {}
        self.device = None

    def record(self, case: layers.Case, device, kind: str, median_ms: float,
               transfer_ms: float | None = None, facts: dict | None = None) -> None:
        self.device = device
        self.medians.setdefault(case, {})[kind] = median_ms
        if transfer_ms is not None:
            self.transfer_ms[case] = transfer_ms
        if facts:
            self.facts[case] = facts

    def rows(self) -> list[dict]:
        return [layers.layer_row(case, self.device, medians, self.transfer_ms.get(case), self.facts.get(case, {}))
                for case, medians in self.medians.items()]

    def complete(self) -> bool:
        return set(layers.cases(self.device)) <= set(self.medians) and all(
            len(m) == len(layers.KINDS) and not any(math.isnan(v) for v in m.values()) for m in self.medians.values())


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RESULTS] = LayerResults()


@pytest.fixture(scope="session")
def layer_results(request: pytest.FixtureRequest) -> LayerResults:
    return request.config.stash[_RESULTS]


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's own tables, so ours is the last word
def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    results = config.stash.get(_RESULTS, None)
    if results is None or not results.medians:
        return
    terminalreporter.write_line("")
    layers.report(results.rows(), results.device, "pytest bench (pytest-benchmark)",
                  write=results.complete() or bool(os.environ.get(layers.OUT_ENV)), say=terminalreporter.write_line)
