"""Benchmarks that ship with the package, so ``python -m offload.bench`` works from any install.

``config`` holds what runs, ``loop`` the one training loop, ``measure`` how memory, time and the
machine are measured, ``step`` the runner and CLI, ``report`` what comes out; ``bench/`` in a
checkout uses these too. Imports nothing beyond torch and offload (matplotlib only for a plot).
"""

from offload.bench.config import PRESETS, RunSettings, Variant, parse_variant
from offload.bench.loop import run_one
from offload.bench.step import main

__all__ = ["PRESETS", "RunSettings", "Variant", "main", "parse_variant", "run_one"]
