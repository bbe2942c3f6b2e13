"""The process's memory at rest, as ``bench/shapes.py`` and ``bench/shape_cases.py`` read it.

Imports nothing of ``offload``, so a script measuring an older version of the package can use it.
"""

from __future__ import annotations

import ctypes
import gc

import psutil


def rest_rss() -> int:
    """The resident set at rest: garbage collected, freed heap handed back to the OS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return psutil.Process().memory_info().rss
