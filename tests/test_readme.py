"""The README's and the docs pages' Python examples run as written, so the docs cannot drift from
the code: every block of Python is run by a test or says why not, and names what it uses that it
does not define. Each page runs in a namespace of its own. The README's table of settings is the
engine's signature, its deprecated table names every keyword the engine takes outside it (read
from ``offload._engine``, white-box: the signature cannot list them), and the API page names every
public name. A page that registers a policy has
it undone after the page by restoring the registry (``offload._plan.policy``), white-box: a
test's isolation, not the engine's behaviour."""

from __future__ import annotations

import ast
import builtins
import inspect
import re

import pytest

from doc_blocks import ROOT, RUN_ELSEWHERE, blocks, pages, python_blocks, text

EXPECTED_OUTPUT = {
    "README.md": ("region", "decision"),  # the plan table printed
    "docs/budget.md": ("restarted profiling steps: 0",),  # plan_cache: the restarted engine follows the saved plan
    "docs/regions.md": ("region", "decision", "recompute-the-last"),
    "docs/shapes.md": ("region", "decision"),
    "docs/troubleshooting.md": ("did you mean 'budget_mb'", "unknown policy 'fastest'"),
}
"""What each page's examples print, in part: enough to see that they ran to their end."""

README_MAX_LINES = 250
"""The README is read in five minutes; the rest lives in docs/."""


def _pages_with_examples() -> list[str]:
    return [page for page in pages() if python_blocks(page)]


def test_the_readme_and_docs_have_examples():
    assert len(python_blocks("README.md")) >= 2
    assert set(EXPECTED_OUTPUT) <= set(_pages_with_examples())


@pytest.mark.parametrize("page", _pages_with_examples())
def test_examples_run(page, monkeypatch, capsys):
    import offload
    from offload._plan import policy as _policy

    monkeypatch.setattr(_policy, "_REGISTRY", dict(_policy._REGISTRY))  # a page's policies go with the test
    # An engine with regions would measure this machine; give it fixed figures so the test is
    # quick and does not write the user's cache.
    machine = offload.MachineProfile(device_type="cpu", disk_write_gb_per_s=2.0, disk_read_gb_per_s=4.0)
    real_engine = offload.engine
    monkeypatch.setattr(
        offload,
        "engine",
        lambda *a, **k: real_engine(*a, **{"machine": machine, **k}) if "regions" in k else real_engine(*a, **k),
    )
    namespace: dict = {}
    for block in python_blocks(page):
        exec(compile(block, str(ROOT / page), "exec"), namespace)
    out = capsys.readouterr().out
    for expected in EXPECTED_OUTPUT.get(page, ()):
        assert expected in out, f"{page}: {expected!r} not in what its examples printed:\n{out}"


# ---------------------------------------------------------------------------------- every block

CONTINUES = re.compile(r"^# continues the examples? above \(([\w, ]+)\)\n")
SUPPLY = re.compile(r"^# supply: (.*)\n")


def _free_names(body: str) -> set[str]:
    """Names a block reads that it neither assigns, imports nor gets from builtins."""
    tree = ast.parse(body)
    loaded, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound - set(dir(builtins))


def _bound(body: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(body)):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


@pytest.mark.parametrize("page", pages())
def test_every_python_block_is_run_or_says_why_not(page):
    """```python blocks run above, ```py blocks in the sections other tests run; any other block
    that holds Python says it is not run, and why."""
    for lang, body, section in blocks(page):
        if lang == "py":
            where = f"{page}: a ```py block in {section!r}"
            assert section in RUN_ELSEWHERE.get(page, ()), f"{where} that no test runs:\n{body}"
        elif lang not in ("python", "bash") and ("offload." in body or "import " in body):
            assert lang == "text" and "Not run by the tests:" in body, (
                f"{page}: Python no test runs, with no reason:\n{body}"
            )


@pytest.mark.parametrize("page", pages())
def test_every_block_says_what_it_uses(page):
    """Run as written: a block defines the names it reads, or its first line names them, either
    the page's earlier examples' (``# continues the example above (...)``, checked against what
    those define) or what the reader supplies (``# supply: ...``)."""
    defined: set[str] = set()
    for lang, body, _ in blocks(page):
        if lang not in ("python", "py"):
            continue
        free = _free_names(body)
        continues, supply = CONTINUES.match(body), SUPPLY.match(body)
        if lang == "python" and free:
            assert continues, f"{page}: uses {sorted(free)} without saying where they come from:\n{body}"
            named = {n.strip() for n in continues.group(1).split(",")}
            assert free <= named <= defined, (page, sorted(free), sorted(named), sorted(defined))
        elif free:
            assert supply, f"{page}: uses {sorted(free)} without saying what to supply:\n{body}"
            missing = {n for n in free if not re.search(rf"\b{n}\b", supply.group(1))}
            assert not missing, f"{page}: uses {sorted(missing)}, which its '# supply:' line does not name:\n{body}"
        if lang == "python":
            defined |= _bound(body)


# ------------------------------------------------------------------------ the README's promises


def test_the_readme_is_short():
    lines = text("README.md").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the detail to docs/"


def _settings_table() -> dict[str, str]:
    """The README's table of settings: name -> its default cell."""
    section = text("README.md").split("## Settings", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \| .* \|$", section, flags=re.M)
    return dict(rows)


def test_the_settings_table_is_the_engines_signature():
    """Every keyword ``offload.engine`` takes, no other, in order, each with its default as the code has it."""
    import offload

    parameters = inspect.signature(offload.engine).parameters
    table = _settings_table()
    assert list(table) == list(parameters), "the README's settings are not offload.engine's keywords, in order"
    for name, cell in table.items():
        code = parameters[name].default
        assert cell.startswith(f"`{code!r}`"), f"{name}: the README says {cell!r}, the code {code!r}"


def test_the_deprecated_table_names_every_deprecated_keyword():
    """The README's deprecated table has a row for each keyword ``offload.engine`` still takes
    outside its signature (white-box: ``offload._api._DEPRECATED_KEYWORDS`` is that list)."""
    from offload._api import _DEPRECATED_KEYWORDS

    section = text("README.md").split("## Settings", 1)[1].split("\n## ", 1)[0].split("Deprecated", 1)[1]
    for name in _DEPRECATED_KEYWORDS:
        assert f"{name}=" in section, f"the README's deprecated table leaves out {name}="


def test_the_api_page_names_every_public_name():
    import offload

    documented = set(re.findall(r"^::: offload\.(\w+)$", text("docs/api.md"), flags=re.M))
    assert set(offload.__all__) <= documented, sorted(set(offload.__all__) - documented)


def test_every_docs_page_is_in_the_nav():
    nav = text("mkdocs.yml")
    for page in pages()[1:]:
        assert f": {page.removeprefix('docs/')}\n" in nav, f"{page} is not in mkdocs.yml's nav"
