"""The integrations import their frameworks only when asked for, and say which extra is missing.

Each check runs in a fresh interpreter, so modules other tests imported do not hide an import.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning")


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )


def test_package_imports_no_framework():
    result = run(
        f"import sys, offload, offload.integrations\nprint(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "submodule, blocked, extra",
    [("hf", "transformers", "offload[hf]"), ("lightning", "lightning", "offload[lightning]")],
)
def test_missing_framework_names_the_extra(submodule, blocked, extra):
    # sys.modules[name] = None makes `import name` raise ImportError, as if it were not installed
    result = run(
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "try:\n"
        f"    import offload.integrations.{submodule}\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    assert result.returncode == 0, result.stderr
    assert extra in result.stdout, result.stdout
