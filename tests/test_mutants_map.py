"""``make mutants`` and the map it reads stay in step with the tree: no mutant is run here (too slow).

``bench/mutate.py`` runs cosmic-ray's mutants of each changed module against the test files
``bench/mutants.toml`` names for it. A module renamed or a test file split would make that run
mutate nothing or test nothing, silently, in a run nobody makes daily: each path must exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML with the standard library")

REPO_ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, list[str]]:
    return tomllib.loads((REPO_ROOT / "bench" / "mutants.toml").read_text())["modules"]


def _recipe(target: str) -> str:
    """The Makefile rule for ``target``: its line and the tab-indented lines under it."""
    text = (REPO_ROOT / "Makefile").read_text()
    found = re.search(rf"^{target}:.*\n((?:\t.*\n)*)", text, flags=re.MULTILINE)
    assert found is not None, f"the Makefile has no {target}: rule"
    return found.group(0)


def test_every_mapped_module_and_test_file_exists():
    modules = _modules()
    assert modules, "bench/mutants.toml maps no module"
    for module, tests in modules.items():
        assert module.startswith("offload/") and module.endswith(".py"), f"{module}: not a module of the package"
        assert (REPO_ROOT / module).is_file(), f"bench/mutants.toml names {module}, which is not in the tree"
        assert tests, f"{module}: no test file to run its mutants against"
        for test in tests:
            assert re.fullmatch(r"tests/test_\w+\.py", test), f"{module}: {test} is not a test file of tests/"
            assert (REPO_ROOT / test).is_file(), f"{module}: no {test}"
        assert len(set(tests)) == len(tests), f"{module}: a test file listed twice"


def test_make_mutants_runs_the_tool_on_the_map_then_the_seed_list():
    """The target runs bench/mutate.py (which reads bench/mutants.toml) with the base it was given,
    then bench/mutants.py's named guards; the extra it installs is the tool mutate.py imports."""
    recipe = _recipe("mutants")
    assert "bench/mutate.py" in recipe and "bench/mutants.py" in recipe
    assert recipe.index("bench/mutate.py") < recipe.index("bench/mutants.py")
    assert "MUTANTS_BASE" in recipe
    phony = re.search(r"^\.PHONY:(.*)$", (REPO_ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    assert phony is not None and "mutants" in phony.group(1).split()
    assert '"mutants.toml"' in (REPO_ROOT / "bench" / "mutate.py").read_text()
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("cosmic-ray") for req in extras["mutants"])
    assert "from cosmic_ray" in (REPO_ROOT / "bench" / "mutate.py").read_text()
