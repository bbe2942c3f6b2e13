"""Benchmarks that ship with the package, so ``python -m offload.bench`` works from any install.

``offload.bench.step`` trains the built-in MiniGPT under each way of handling saved activations
(nothing, torch.utils.checkpoint, save_on_cpu, the engine at several budgets and policies) and
compares step time, peak memory and losses; see its module docstring. ``config`` holds what runs
(configurations, settings, presets), ``report`` what comes out (CSV, table, plot). Importing this
package imports nothing beyond torch and offload (matplotlib only when a plot is written).
"""

from offload.bench.config import PRESETS, VARIANTS, RunSettings, Variant
from offload.bench.step import main, run_one

__all__ = ["PRESETS", "VARIANTS", "RunSettings", "Variant", "main", "run_one"]
