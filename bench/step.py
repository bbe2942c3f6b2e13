"""The step benchmark from a checkout: ``python bench/step.py [--preset h200] [--out DIR] ...``.

A thin wrapper over ``python -m offload.bench`` (``offload/bench/step.py``), so that it runs
with or without the package installed (``bench/gpu_check.sh`` calls it this way).
"""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from offload.bench.step import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
