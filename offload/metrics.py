"""Deprecated: the Prometheus exporter's one import path is ``offload.integrations.prometheus``.

``offload.metrics.PrometheusExporter`` (and the module's other names) still resolve for one
release, each with a ``DeprecationWarning`` naming that path. Importing this module does nothing
else: the warning comes when a name is read, and prometheus-client is imported only then.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names, for type checkers and linters; at run time __getattr__ warns, then loads them
    from .integrations.prometheus import WAIT_BUCKETS_S, PrometheusExporter, export_prometheus

__all__ = ["PrometheusExporter", "WAIT_BUCKETS_S", "export_prometheus"]

_ONE_PATH = "offload.integrations.prometheus"


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'offload.metrics' has no attribute {name!r}")
    warnings.warn(
        f"offload.metrics.{name} is deprecated and goes in the next release; import it from {_ONE_PATH} "
        f"(from {_ONE_PATH} import {name})",
        DeprecationWarning,
        stacklevel=2,
    )
    from .integrations import prometheus  # here, not at import: reading this module stays free

    return getattr(prometheus, name)
