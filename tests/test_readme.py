"""The README's Python examples run as written, so the docs cannot drift from the code."""

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
