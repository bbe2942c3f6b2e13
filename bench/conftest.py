"""pytest configuration of bench/: ``pytest bench`` collects only this directory (``make test`` runs
``pytest tests`` and never sees it). The layer measurements of ``test_layers.py`` are collected per
case and, at the session's end, tabled and written by ``layers.report`` as ``bench/layers.py`` does.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import layers` (which finds offload itself)
import layers  # noqa: E402

_RESULTS = pytest.StashKey[dict]()
"""case -> {kind: median ms, "transfer_ms": paired estimate, "facts": untimed figures}."""


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RESULTS] = {}


@pytest.fixture(scope="session")
def layer_results(request: pytest.FixtureRequest) -> dict:
    return request.config.stash[_RESULTS]


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's own tables, so ours is the last word
def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    results = config.stash.get(_RESULTS, None)
    if not results:
        return
    device = layers.parse_device(None)
    rows = [layers.layer_row(case, device, r, r.get("transfer_ms"), r.get("facts", {})) for case, r in results.items()]
    complete = set(layers.cases(device)) <= set(results) and all(
        not math.isnan(r.get(kind, math.nan)) for r in results.values() for kind in layers.KINDS
    )
    terminalreporter.write_line("")
    write = complete or bool(os.environ.get(layers.OUT_ENV))
    layers.report(rows, device, "pytest bench (pytest-benchmark)", write=write, say=terminalreporter.write_line)
