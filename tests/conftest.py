"""Shared fixtures for the engine tests (the helpers themselves live in ``zoo.py``)."""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

INTRA_OP_THREADS = 1
"""The tests' ops are tiny: on a 2-core machine torch's intra-op pool spends far longer spinning for
cores than computing (a 300-step soak: ~80 s with 2 threads under load, ~4 s with 1). Reference and
engine runs share the setting, so exact comparisons are unaffected. Benchmarks (bench/) set their own."""


CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS reads this when it starts: strict determinism on CUDA (the CUDA tests compare bitwise
under ``torch.use_deterministic_algorithms(True)``) needs it set before the process's first matmul."""


def pytest_configure(config):
    torch.set_num_threads(INTRA_OP_THREADS)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)


# Note: [a sweep's quick cases]
# A test marked ``@pytest.mark.sweep`` is a cross product of parameters (kinds x budgets x tiers,
# models x policies). ``make test`` runs every case. The quick loop (``-m "not slow"``) runs a
# covering subset: in collection order, a case stays quick when it brings a parameter value no
# earlier quick case of the same test had, and every other case is marked ``slow``. So the quick
# loop still meets every value of every axis (every kind, every budget, every tier), just not
# every combination. Values are keyed by name, not by address, so that each xdist worker picks the
# same cases.


def _value_key(value: object) -> str:
    name = getattr(value, "__qualname__", None)
    return f"{getattr(value, '__module__', '')}.{name}" if name else repr(value)


def _quick_already(item) -> bool:
    """Whether the case would run in the quick loop as it is: not slow, not skipped (a case that
    will not run covers no value)."""
    if item.get_closest_marker("slow") is not None or item.get_closest_marker("skip") is not None:
        return False
    for mark in item.iter_markers("skipif"):
        condition = mark.args[0] if mark.args else mark.kwargs.get("condition", False)
        if not isinstance(condition, str) and condition:
            return False
    return True


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the marks added here must count
def pytest_collection_modifyitems(config, items):
    covered: dict = {}
    for item in items:
        if item.get_closest_marker("sweep") is None or not hasattr(item, "callspec") or not _quick_already(item):
            continue
        seen = covered.setdefault((item.parent.nodeid, item.originalname), set())
        values = {(name, _value_key(value)) for name, value in item.callspec.params.items()}
        if values <= seen:
            item.add_marker(pytest.mark.slow)
        seen |= values


DEADLINE_ENV = "OFFLOAD_TEST_DEADLINE"
"""Unix time after which no further test starts (each is skipped, saying why): bench/gpu_check.sh
sets it so a part of CUDA tests ends within its share of the part's limit, with its XML whole."""


def pytest_runtest_setup(item):
    deadline = os.environ.get(DEADLINE_ENV)
    if deadline and time.time() > float(deadline):
        pytest.skip(f"not run: past the part's time limit ({DEADLINE_ENV})")


@pytest.fixture
def spill_dir(tmp_path):
    """A fresh parent directory for spill files; tests check it is empty afterwards."""
    path = tmp_path / "spill"
    path.mkdir()
    return path


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, transformers, the test modules: ~200k objects) out
    of the collector's sight: the per-test ``gc.collect()`` below then walks only what tests made
    since, ~35 ms a test less (~40 s a suite). Nothing frozen was garbage: a module's objects live
    as long as the process does."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _collect():
    """Collect the heap after each test, so one test's graphs (and their handles) never reach the next."""
    yield
    gc.collect()
