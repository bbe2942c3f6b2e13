"""The package's typing contract: ``py.typed`` ships (PEP 561), so users' type checkers read our
annotations, and every public callable is annotated, so what they read is complete.

mypy itself runs in ``make lint``, not here: it is a lint tool, not a test dependency. One test
is white-box: the private ``Counters`` record declares its computed slots for type checkers.
"""

from __future__ import annotations

import importlib.resources
import inspect
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import offload
import offload.integrations.prometheus
import offload.seams
from offload._stats import Counters

REPO_ROOT = Path(__file__).resolve().parents[1]

PUBLIC_MODULES = (offload, offload.integrations.prometheus, offload.seams)
"""Modules whose ``__all__`` is the public API."""

CHECKED_DUNDERS = ("__init__", "__call__", "__enter__", "__exit__")
"""Special methods users call (directly or through syntax), so their signatures are API too."""


def _missing(fn: Callable, where: str) -> list[str]:
    """What ``fn``'s signature leaves unannotated (self and cls excepted)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing of ours to check
        return []
    out = [
        f"{where}: parameter {p.name!r} has no annotation"
        for p in sig.parameters.values()
        if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty
    ]
    if sig.return_annotation is inspect.Signature.empty:
        out.append(f"{where}: no return annotation")
    return out


def _public_callables() -> Iterator[tuple[str, Callable]]:
    """(qualified name, function) for every public function, and every public method, property
    getter and checked dunder defined on a public class."""
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            where = f"{module.__name__}.{name}"
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr.startswith("_") and attr not in CHECKED_DUNDERS:
                        continue
                    if attr == "__init__" and getattr(obj, "_is_protocol", False):
                        continue  # typing's own stand-in: a protocol is implemented, never made
                    if isinstance(member, property) and member.fget is not None:
                        yield f"{where}.{attr}", member.fget
                    elif isinstance(member, (staticmethod, classmethod)):
                        yield f"{where}.{attr}", member.__func__
                    elif inspect.isfunction(member):
                        yield f"{where}.{attr}", member
            elif inspect.isfunction(obj):
                yield where, obj


def test_public_api_is_fully_annotated() -> None:
    checked = list(_public_callables())
    assert len(checked) > 20, f"the walk over the public API found only {[n for n, _ in checked]}"
    missing = [m for where, fn in checked for m in _missing(fn, where)]
    assert not missing, "annotate the public API (users' type checkers read it through py.typed):\n" + "\n".join(
        missing
    )


def test_annotation_check_sees_a_gap() -> None:
    """The check above fails on what it is meant to catch."""

    def half_typed(x: int, y):  # the case under test: y and the return unannotated
        return x

    assert _missing(half_typed, "f") == ["f: parameter 'y' has no annotation", "f: no return annotation"]


def test_py_typed_is_in_the_imported_package() -> None:
    marker = importlib.resources.files("offload").joinpath("py.typed")
    assert marker.is_file(), f"offload/py.typed is missing next to {offload.__file__}; PEP 561 needs it"


def test_py_typed_ships_in_the_wheel(tmp_path: Path) -> None:
    """Build a wheel from a copy of the source (the tree itself gets no build/ or egg-info) and
    look for the marker in it: package data that setuptools would leave out fails here."""
    pytest.importorskip("setuptools", reason="building a wheel without build isolation needs setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    shutil.copytree(REPO_ROOT / "offload", src / "offload", ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("offload-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert "offload/py.typed" in archive.namelist(), f"{wheel.name} lacks offload/py.typed"


def test_counters_declare_every_slot() -> None:
    """``Counters`` spells its names out for type checkers; they must be the computed slots."""
    assert sorted(Counters.__annotations__) == sorted(Counters.__slots__)
