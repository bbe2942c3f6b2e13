"""The README's Python examples run as written, so the docs cannot drift from the code; every block
of Python is run by a test or says why not, and names what it uses that it does not define."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(_python_blocks()) >= 2


def test_readme_examples_run(tmp_path, monkeypatch, capsys):
    import offload

    # The auto-policy example would measure this machine; give it fixed figures so the test is
    # quick and does not write the user's cache.
    machine = offload.MachineProfile(device_type="cpu", disk_write_gb_per_s=2.0, disk_read_gb_per_s=4.0)
    real_engine = offload.engine
    monkeypatch.setattr(
        offload,
        "engine",
        lambda *a, **k: real_engine(*a, **{"machine": machine, **k}) if "regions" in k else real_engine(*a, **k),
    )
    namespace: dict = {}
    for block in _python_blocks():
        exec(compile(block, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "region" in out and "decision" in out  # the plan table printed
    assert "restarted profiling steps: 0" in out  # plan_cache: the restarted engine follows the saved plan


# ---------------------------------------------------------------------------------- every block

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
RUN_ELSEWHERE = ("## Trainers", "## Traces")
"""Sections whose ```py blocks other tests run, each with the names it supplies prepared:
tests/test_integrations_readme.py (Trainers) and tests/test_otel.py (Traces)."""
CONTINUES = re.compile(r"^# continues the examples? above \(([\w, ]+)\)\n")
SUPPLY = re.compile(r"^# supply: (.*)\n")


def _blocks() -> list[tuple[str, str, str]]:
    """(language, body, section heading) of every fenced block of the README, in order."""
    text = README.read_text()
    out = []
    for match in FENCE.finditer(text):
        headings = re.findall(r"^## .*$", text[: match.start()], flags=re.M)
        out.append((match.group(1), match.group(2), headings[-1] if headings else ""))
    return out


def _free_names(body: str) -> set[str]:
    """Names a block reads that it neither assigns, imports nor gets from builtins."""
    import ast
    import builtins

    tree = ast.parse(body)
    loaded, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return loaded - bound - set(dir(builtins))


def test_every_python_block_is_run_or_says_why_not():
    """```python blocks run above, ```py blocks in the sections other tests run; any other block
    that holds Python says it is not run, and why."""
    blocks = _blocks()
    assert sum(lang == "python" for lang, _, _ in blocks) == len(_python_blocks())
    for lang, body, section in blocks:
        if lang == "py":
            assert section in RUN_ELSEWHERE, f"a ```py block in {section!r} that no test runs:\n{body}"
        elif lang not in ("python", "bash") and ("offload." in body or "import " in body):
            assert lang == "text" and "Not run by the tests:" in body, f"Python no test runs, with no reason:\n{body}"


def test_every_block_says_what_it_uses():
    """Run as written: a block defines the names it reads, or its first line names them, either
    the earlier examples' (``# continues the example above (...)``, checked against what those
    define) or what the reader supplies (``# supply: ...``)."""
    defined: set[str] = set()
    for lang, body, _ in _blocks():
        if lang not in ("python", "py"):
            continue
        free = _free_names(body)
        continues, supply = CONTINUES.match(body), SUPPLY.match(body)
        if lang == "python" and free:
            assert continues, f"uses {sorted(free)} without saying where they come from:\n{body}"
            named = {n.strip() for n in continues.group(1).split(",")}
            assert free <= named <= defined, (sorted(free), sorted(named), sorted(defined))
        elif free:
            assert supply, f"uses {sorted(free)} without saying what to supply:\n{body}"
            missing = {n for n in free if not re.search(rf"\b{n}\b", supply.group(1))}
            assert not missing, f"uses {sorted(missing)}, which its '# supply:' line does not name:\n{body}"
        if lang == "python":
            defined |= _bound(body)


def _bound(body: str) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(body)):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names
