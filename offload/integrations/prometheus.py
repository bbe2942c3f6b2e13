"""Prometheus export of an engine's stats: counters, gauges, per-step wait and per-recompute histograms.

Owns the mapping from ``Engine.stats`` to Prometheus metrics, nothing else. prometheus-client is
an optional extra (``pip install offload[metrics]``) imported only when an exporter is made, so
``import offload`` and ``import offload.integrations.prometheus`` never need it.

Counting windows. ``Engine.stats`` counts since the engine was made or since ``reset_stats()``;
Prometheus counters only go up. ``update()`` therefore owns the window: it adds what the engine
counted since the previous ``update()`` to the counters, sets the gauges, observes the window's
waits in the histograms, then calls ``engine.reset_stats()`` to start the next window::

    step k:  forward ─ backward ─ optimizer ─▶ exporter.update()   (export step k, reset)
    step k+1: ...                              ─▶ exporter.update()   (export step k+1, reset)

Call it once per step, after backward. Read ``eng.stats`` before it if you want the step's
figures yourself; resetting at the start of a step as well (``eng.reset_stats()``) loses nothing.

Metrics, with the default ``prefix="offload"``:

    offload_moved_bytes_total{movement="offloaded|reloaded|spilled"}  counter
    offload_saved_bytes_total                                           counter
    offload_prefetch_total{result="hit|miss"}                           counter
    offload_recomputed_regions_total                                    counter
    offload_recomputed_bytes_total                                      counter
    offload_updates_total                                               counter (steps exported)
    offload_resident_bytes, offload_peak_resident_bytes (in the window) gauges
    offload_host_bytes, offload_spill_files                             gauges
    offload_budget_bytes (in force; budget_mb="auto" follows free memory) gauge
    offload_reload_wait_seconds, offload_evict_wait_seconds             histograms, one
                                                                        observation per update
    offload_recompute_seconds                                           histogram, one observation
                                                                        per region recompute

The recompute histogram is fed as backward runs, not by ``update()``: the exporter observes the
engine (``offload._observe``), which then times each region's recompute. On CUDA that timing
synchronizes the device before and after each recompute; ``recompute_latency=False`` turns it off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .._observe import Observer

if TYPE_CHECKING:  # annotations only: importing offload.integrations.prometheus stays as light as it is
    from .._engine import Engine
    from .._stats import Stats

__all__ = ["PrometheusExporter", "WAIT_BUCKETS_S", "export_prometheus"]

WAIT_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Histogram buckets for the host time a step waits on copies, seconds: from a hidden transfer
(well under a millisecond) to a step stalled for seconds on the disk. The recompute histogram
uses them too: a region's re-run forward spans the same range, from a small block's tenth of a
millisecond to a large one's seconds on a CPU."""

_MOVEMENTS = ("offloaded", "reloaded", "spilled")
"""Label values of the moved-bytes counter; each names a ``Stats`` field ``<value>_bytes``."""

_MS_PER_S = 1e3


def _prometheus():
    try:
        import prometheus_client
    except ImportError as error:
        raise ImportError(
            "offload.integrations.prometheus needs the prometheus-client package, an optional extra of offload; "
            "install it with: pip install offload[metrics]  (or: pip install prometheus-client)"
        ) from error
    return prometheus_client


class PrometheusExporter:
    """Publishes one engine's stats as Prometheus metrics; call ``update()`` once per step.

    Args:
        engine: the ``offload.Engine`` to read. ``update()`` resets its stats (see the module note
            on counting windows).
        registry: a ``prometheus_client.CollectorRegistry``; None: prometheus-client's default
            registry (what ``start_http_server`` serves). Metric names must be unique in a
            registry: give a second exporter its own ``prefix`` or registry.
        prefix: the first part of every metric name.
        recompute_latency: observe each region recompute's wall time in ``<prefix>_recompute_seconds``
            (on CUDA this synchronizes the device around each recompute). ``close()`` stops it.

    Raises:
        ImportError: prometheus-client is not installed (``pip install offload[metrics]``).

    Example::

        from prometheus_client import start_http_server
        import offload, offload.integrations.prometheus

        eng = offload.engine(budget_mb=512)
        exporter = offload.integrations.prometheus.PrometheusExporter(eng)
        start_http_server(9100)
        for batch in data:
            with eng:
                loss = model(batch)
            loss.backward()
            exporter.update()
    """

    def __init__(
        self, engine: Engine, registry: Any = None, prefix: str = "offload", recompute_latency: bool = True
    ) -> None:
        prom = _prometheus()
        from .._engine import Engine

        if not isinstance(engine, Engine):
            raise TypeError(f"PrometheusExporter needs an offload Engine (from offload.engine(...)), got {engine!r}")
        if not isinstance(prefix, str) or not prefix.replace("_", "a").isalnum() or prefix[0].isdigit():
            raise ValueError(
                f"prefix={prefix!r}: a Prometheus metric name prefix must be letters, digits and '_', "
                f"not starting with a digit; e.g. 'offload' or 'offload_rank0'"
            )
        self.engine = engine
        self.registry = prom.REGISTRY if registry is None else registry
        kw = {"registry": self.registry}
        self.moved_bytes = prom.Counter(
            f"{prefix}_moved_bytes", "Activation bytes moved between tiers, by movement", ["movement"], **kw
        )
        self.saved_bytes = prom.Counter(
            f"{prefix}_saved_bytes", "Bytes of distinct saved storages the engine managed", **kw
        )
        self.prefetch = prom.Counter(
            f"{prefix}_prefetch", "Unpacks of moved tensors, by whether prefetch had started them", ["result"], **kw
        )
        self.recomputed_regions = prom.Counter(f"{prefix}_recomputed_regions", "Region forwards run as recompute", **kw)
        self.recomputed_bytes = prom.Counter(
            f"{prefix}_recomputed_bytes", "Saved bytes dropped and regenerated in backward", **kw
        )
        self.updates = prom.Counter(f"{prefix}_updates", "Calls of update() (steps exported)", **kw)
        self.resident_bytes = prom.Gauge(
            f"{prefix}_resident_bytes", "Engine-managed activation bytes on the compute device now", **kw
        )
        self.peak_resident_bytes = prom.Gauge(
            f"{prefix}_peak_resident_bytes", "Most resident bytes since the previous update()", **kw
        )
        self.host_bytes = prom.Gauge(
            f"{prefix}_host_bytes", "Host bytes the engine's host tier holds (pinned slabs)", **kw
        )
        self.spill_files = prom.Gauge(f"{prefix}_spill_files", "Spill files on disk now", **kw)
        self.spill_bytes = prom.Gauge(f"{prefix}_spill_bytes", "Bytes of the spill file holding copies now", **kw)
        self.budget_bytes = prom.Gauge(f"{prefix}_budget_bytes", "Byte budget in force (NaN: no limit)", **kw)
        self.reload_wait_seconds = prom.Histogram(
            f"{prefix}_reload_wait_seconds",
            "Time backward stalled for reloads (host waits; CUDA: compute-stream waits), per update()",
            buckets=WAIT_BUCKETS_S,
            **kw,
        )
        self.evict_wait_seconds = prom.Histogram(
            f"{prefix}_evict_wait_seconds",
            "Host time forward waited for evictions to drain, per update()",
            buckets=WAIT_BUCKETS_S,
            **kw,
        )
        self.recompute_seconds = prom.Histogram(
            f"{prefix}_recompute_seconds",
            "Wall time of each region's recompute in backward (one observation per recompute)",
            buckets=WAIT_BUCKETS_S,
            **kw,
        )
        self._recompute_observer: Observer | None = None
        if recompute_latency:
            self._recompute_observer = _RecomputeLatency(self.recompute_seconds)
            engine.observers.add(self._recompute_observer)
        for movement in _MOVEMENTS:  # the series exist (at 0) before the first update
            self.moved_bytes.labels(movement=movement)
        for result in ("hit", "miss"):
            self.prefetch.labels(result=result)
        self.last: Optional[Stats] = None
        """The ``Stats`` window the latest ``update()`` exported."""

    def update(self) -> Stats:
        """Export what the engine did since the previous update, then reset its stats.

        Returns the exported ``Stats`` snapshot (the window that just ended).
        """
        stats = self.engine.stats
        self.engine.reset_stats()
        for movement in _MOVEMENTS:
            self.moved_bytes.labels(movement=movement).inc(getattr(stats, f"{movement}_bytes"))
        self.saved_bytes.inc(stats.saved_bytes)
        self.prefetch.labels(result="hit").inc(stats.prefetch_hits)
        self.prefetch.labels(result="miss").inc(stats.prefetch_misses)
        self.recomputed_regions.inc(stats.recomputed_regions)
        self.recomputed_bytes.inc(stats.recomputed_bytes)
        self.updates.inc()
        self.resident_bytes.set(stats.resident_bytes)
        self.peak_resident_bytes.set(stats.peak_resident_bytes)
        self.host_bytes.set(stats.host_bytes)
        self.spill_files.set(stats.spill_files)
        self.spill_bytes.set(stats.spill_bytes)
        self.budget_bytes.set(float("nan") if stats.budget_bytes is None else stats.budget_bytes)
        self.reload_wait_seconds.observe(stats.reload_wait_ms / _MS_PER_S)
        self.evict_wait_seconds.observe(stats.evict_wait_ms / _MS_PER_S)
        self.last = stats
        return stats

    def close(self) -> None:
        """Stop observing the engine's recomputes (the metrics stay registered). Idempotent."""
        if self._recompute_observer is not None:
            self.engine.observers.remove(self._recompute_observer)
            self._recompute_observer = None

    def __repr__(self) -> str:
        return f"offload.integrations.prometheus.PrometheusExporter({self.engine!r})"


class _RecomputeLatency(Observer):
    """Observes each region recompute's wall time in a histogram, on every step."""

    def __init__(self, histogram: Any) -> None:  # a prometheus_client.Histogram
        self.histogram = histogram

    def wants_recompute_times(self) -> bool:
        return True

    def recomputed(self, region: str, ms: float, end_ns: int) -> None:
        self.histogram.observe(ms / _MS_PER_S)


def export_prometheus(
    engine: Engine, registry: Any = None, prefix: str = "offload", recompute_latency: bool = True
) -> PrometheusExporter:
    """Shorthand for ``PrometheusExporter(engine, registry, prefix, recompute_latency)``."""
    return PrometheusExporter(engine, registry=registry, prefix=prefix, recompute_latency=recompute_latency)
