"""Benchmarks that ship with the package, so ``python -m offload.bench`` works from any install.

``step`` trains the built-in MiniGPT under each way of handling saved activations (nothing,
torch.utils.checkpoint, save_on_cpu, torchtune, the engine at several budgets and policies) and
compares step time, memory and gradients; see its module docstring. ``config`` holds what runs,
``loop`` the one training loop, ``measure`` how memory, time and the machine are measured, and
``report`` what comes out. ``bench/`` in a checkout uses these too (overhead, layers, gpu_check).
Importing this package imports nothing beyond torch and offload (matplotlib only for a plot).
"""

from offload.bench.config import PRESETS, RunSettings, Variant, parse_variant
from offload.bench.loop import run_one
from offload.bench.step import main

__all__ = ["PRESETS", "RunSettings", "Variant", "main", "parse_variant", "run_one"]
