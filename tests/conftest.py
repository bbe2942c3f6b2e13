"""Shared fixtures for the engine tests (the helpers themselves live in ``zoo.py``)."""

from __future__ import annotations

import gc

import pytest


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
