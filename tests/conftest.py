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


@pytest.fixture(autouse=True)
def _collect():
    """Collect the heap after each test, so one test's graphs (and their handles) never reach the next."""
    yield
    gc.collect()
