"""Benchmarks that ship with the package, so ``python -m offload.bench`` works from any install.

``offload.bench.step`` trains the built-in MiniGPT under each way of handling saved activations
(nothing, torch.utils.checkpoint, save_on_cpu, the engine at several budgets and policies) and
compares step time, peak memory and losses; see its module docstring. Importing this package
imports nothing beyond torch and offload (matplotlib only when a plot is written).
"""

from offload.bench.step import PRESETS, VARIANTS, RunSettings, Variant, main, run_one

__all__ = ["PRESETS", "VARIANTS", "RunSettings", "Variant", "main", "run_one"]
