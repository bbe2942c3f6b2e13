"""pytest configuration of bench/: ``pytest bench`` collects only this directory (``make test`` runs
``pytest tests`` and never sees it). ``test_layers.py`` collects one result per case; at the
session's end ``layers.report`` tables and writes them, as ``bench/layers.py`` does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import layers` (which finds offload itself)
import layers  # noqa: E402

_RESULTS = pytest.StashKey[dict]()
"""case -> {kind: median ms, "transfer_ms": paired estimate, "facts": untimed figures}."""


@pytest.fixture(scope="session")
def layer_results(pytestconfig: pytest.Config) -> dict:
    return pytestconfig.stash.setdefault(_RESULTS, {})


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's own tables, so ours is the last word
def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if results := config.stash.get(_RESULTS, None):
        terminalreporter.write_line("")
        runner, device = "pytest bench (pytest-benchmark)", layers.parse_device(None)
        layers.report(results, device, runner, say=terminalreporter.write_line)
