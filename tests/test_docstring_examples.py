"""The examples in the public docstrings run as written (doctest), so the API reference the docs
site builds from them cannot drift from the code."""

from __future__ import annotations

import doctest

import pytest

import offload


@pytest.mark.parametrize("name", ["Engine", "checkpoint", "predict"])
def test_docstring_examples_run(name):
    obj = getattr(offload, name)
    tests = doctest.DocTestFinder(recurse=False).find(obj, f"offload.{name}", globs={})
    assert tests and tests[0].examples, f"offload.{name}'s docstring has no example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
