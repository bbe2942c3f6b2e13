"""Optional metrics export: ``offload.metrics.PrometheusExporter(engine)``, then ``update()`` per step.

Needs the ``metrics`` extra (``pip install offload[metrics]``, i.e. prometheus-client), imported
only when an exporter is made. What is exported and how the engine's counting window is handled
is described in ``offload.integrations.prometheus``.
"""

from .integrations.prometheus import WAIT_BUCKETS_S, PrometheusExporter, export_prometheus

__all__ = ["PrometheusExporter", "WAIT_BUCKETS_S", "export_prometheus"]
