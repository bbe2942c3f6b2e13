"""The public seams (``offload.seams``): the module's own example runs as written, each seam the
engine takes is refused with a clear error when it is not one, and a stand-in host sees the
engine's traffic and nothing of pytest's. And the rule they serve: a test reaches the engine
through its public API and these seams, and a test file that reaches inside says so.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import offload
import offload.seams
from hosts import StandInHost
from offload.seams import Host
from zoo import assert_same, run_step, wait_clean


def _example() -> str:
    """The python block of ``offload.seams``'s docstring."""
    (block,) = re.findall(r"```python\n(.*?)```", offload.seams.__doc__, re.DOTALL)
    return block


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])


def _input():
    return torch.randn(256, 64)


def test_the_modules_example_keeps_tensors_in_memory_with_one_warning(spill_dir, caplog):
    """The docstring's full disk: every spill write fails, the step is exact, one warning says so."""
    scope: dict = {}
    exec(compile(_example(), "offload.seams example", "exec"), scope)  # noqa: S102 - our own docstring
    eng = scope["eng"]
    model = _model()
    ref = run_step(model, _input)
    with caplog.at_level(logging.WARNING, logger="offload"):
        for _ in range(2):
            assert_same(ref, run_step(model, _input, eng), "full disk")
    stats = wait_clean(eng)
    assert stats.spilled_bytes == stats.offloaded_bytes == 0 and stats.peak_resident_bytes > 0
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("offload") and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "No space left" in warned[0], warned
    eng.close()


def test_the_host_tier_leaves_a_tenth_of_ram_and_at_least_2_gib_free():
    """The reserve the host tier never takes (``Host.ram_reserve``): 10 % of RAM, at least 2 GiB."""
    gib = 1 << 30
    assert Host().ram_reserve(16 * gib) == 2 * gib, "1.6 GiB is under the floor"
    assert Host().ram_reserve(64 * gib) == int(6.4 * gib)
    assert Host().ram_reserve(0) == 2 * gib


def test_a_host_that_is_not_one_is_refused():
    with pytest.raises(TypeError, match=r"host=...\) must be an offload.seams.Host.*got str$"):
        offload.engine(0, seams=offload.Seams(host="/tmp"))


def test_every_seam_is_importable_from_the_public_module():
    for name in offload.seams.__all__:
        assert getattr(offload.seams, name).__doc__, f"offload.seams.{name} has no contract (docstring)"


def test_a_stand_in_host_sees_every_spill_write_and_read(spill_dir):
    """Each tensor spilled is one write, each read back one read: what the engine does there, and
    nothing else of the process, goes through the host."""
    host = StandInHost()
    model = _model()
    ref = run_step(model, _input)
    eng = offload.engine(0, min_offload_mb=0, spill_dir=spill_dir, host=host)
    assert_same(ref, run_step(model, _input, eng), "through a stand-in host")
    stats = wait_clean(eng, spill_dir)
    assert host.landed() == host.writes > 0 and len(host.created) == 1, "one spill file (O_DIRECT may take two opens)"
    assert stats.spilled_bytes > 0 and host.reads >= stats.reloaded_bytes // (256 * 64 * 4) > 0
    eng.close()


def _private_names_in_code(path: Path) -> set[str]:
    """The private ``offload`` modules ``path``'s code imports or names in a string (its docstrings
    and comments aside; ``offload.__main__``, the command line, is public)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("offload._") and not node.module.startswith("offload.__"):
                found.add(node.module)
            if node.module == "offload":
                found.update(f"offload.{a.name}" for a in node.names if a.name.startswith("_"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("offload._"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"offload\._[a-z][\w.]*", node.value):
                found.add(node.value)
    return found


def test_a_test_file_that_reaches_inside_says_so():
    """Tests reach the engine through ``offload``'s public names and ``offload.seams``; a file
    that imports a private module (a guard removed, a pure module tested with numbers, an
    invariant no seam shows) says "white-box" in its docstring, and why. The helpers every file
    shares (stand-in links, hosts, models) reach nothing private."""
    tests = Path(__file__).parent
    unsaid, helpers = [], []
    for path in sorted(tests.glob("*.py")):
        private = _private_names_in_code(path)
        if not private:
            continue
        if not path.name.startswith("test_"):
            helpers.append(f"{path.name}: {sorted(private)}")
        elif "white-box" not in (ast.get_docstring(ast.parse(path.read_text())) or "").lower():
            unsaid.append(f"{path.name}: {sorted(private)}")
    assert helpers == [], "helpers shared by every test reach inside offload"
    assert unsaid == [], "these files reach inside offload without saying why in their docstring"
