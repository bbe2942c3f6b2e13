"""What the engine does is visible from outside: profiler ranges, and the optional Prometheus export.

Every movement and recompute runs inside a ``record_function`` range (offload::spill, ::read,
::wait_reload, ::recompute, ...), so a torch.profiler trace shows where a step's time went. The
Prometheus exporter (``offload.integrations.prometheus``, extra ``metrics``) turns ``eng.stats`` windows into
counters, gauges and histograms; its tests skip when prometheus-client is not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import offload
from offload.integrations import prometheus
from offload.models import GPTConfig, MiniGPT

N_LAYER = 2


def _model_and_batch():
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(n_layer=N_LAYER, n_head=2, n_embd=64, seq_len=32, attention="math"))
    x = torch.randint(0, 256, (2, 32))
    y = torch.randint(0, 256, (2, 32))
    return model, x, y


def _step(model, eng, x, y) -> torch.Tensor:
    with eng:
        _, loss = model(x, y)
    loss.backward()
    return loss


def test_profiler_shows_spill_read_and_recompute(spill_dir, tmp_path):
    model, x, y = _model_and_batch()
    # Budget 0 spills everything the engine takes (recomputed regions' inputs included);
    # policy "recompute" re-runs every block in backward.
    eng = offload.engine(
        budget_mb=0, policy="recompute", regions=model.blocks, model=model, min_offload_mb=0, spill_dir=spill_dir
    )
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(model, eng, x, y)
        stats = eng.stats
    finally:
        eng.close()

    names = [e.name for e in prof.events()]
    assert "offload::spill" in names
    assert "offload::read" in names or "offload::wait_reload" in names
    assert names.count("offload::recompute") == N_LAYER == stats.recomputed_regions  # once per region, not twice
    # Every spilled byte comes back; at budget 0 a storage shared by several saves may be read twice.
    assert stats.spilled_bytes > 0 and stats.reloaded_bytes >= stats.spilled_bytes

    trace = tmp_path / "trace.json"  # what a user opens in Perfetto / chrome://tracing
    prof.export_chrome_trace(str(trace))
    traced = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"offload::spill", "offload::recompute"} <= traced


def test_profiler_quiet_without_a_budget():
    """No budget, no region: the engine only counts, and the trace has no movement ranges."""
    model, x, y = _model_and_batch()
    eng = offload.engine(budget_mb=None, min_offload_mb=0)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(model, eng, x, y)
    finally:
        eng.close()
    assert not [e.name for e in prof.events() if e.name.startswith("offload::")]


# ------------------------------------------------------------------------------ Prometheus


def test_import_does_not_need_prometheus():
    code = "import sys, offload, offload.integrations.prometheus; assert 'prometheus_client' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_prometheus_names_the_extra(monkeypatch):
    eng = offload.engine(budget_mb=None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"pip install offload\[metrics\]"):
        prometheus.PrometheusExporter(eng)
    eng.close()


def test_exporter_counts_every_window(spill_dir):
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()
    model, x, y = _model_and_batch()
    eng = offload.engine(budget_mb=0, min_offload_mb=0, spill_dir=spill_dir, model=model)
    exporter = prometheus.PrometheusExporter(eng, registry=registry, prefix="test_offload")
    windows = []
    try:
        for _ in range(3):
            _step(model, eng, x, y)
            windows.append(exporter.update())
            assert eng.stats.saved_bytes == 0  # update() started a new window
    finally:
        eng.close()

    def sample(name, **labels):
        return registry.get_sample_value(f"test_offload_{name}", labels)

    assert windows[0].spilled_bytes > 0
    for movement in ("offloaded", "reloaded", "spilled"):
        assert sample("moved_bytes_total", movement=movement) == sum(getattr(w, f"{movement}_bytes") for w in windows)
    assert sample("saved_bytes_total") == sum(w.saved_bytes for w in windows)
    assert sample("prefetch_total", result="hit") == sum(w.prefetch_hits for w in windows)
    assert sample("prefetch_total", result="miss") == sum(w.prefetch_misses for w in windows)
    assert sample("updates_total") == 3
    assert sample("resident_bytes") == windows[-1].resident_bytes == 0  # backward released everything
    assert sample("peak_resident_bytes") == windows[-1].peak_resident_bytes
    assert sample("reload_wait_seconds_count") == 3
    assert sample("reload_wait_seconds_sum") == pytest.approx(sum(w.reload_wait_ms for w in windows) / 1e3)
    assert exporter.last is windows[-1]


def test_exporter_recompute_counter():
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()
    model, x, y = _model_and_batch()
    eng = offload.engine(policy="recompute", regions=model.blocks, model=model)
    exporter = prometheus.export_prometheus(eng, registry=registry)
    try:
        _step(model, eng, x, y)
        exporter.update()
    finally:
        eng.close()
    assert registry.get_sample_value("offload_recomputed_regions_total") == N_LAYER


def test_exporter_rejects_bad_arguments():
    prom = pytest.importorskip("prometheus_client")
    eng = offload.engine(budget_mb=None)
    with pytest.raises(TypeError, match="offload Engine"):
        prometheus.PrometheusExporter(object(), registry=prom.CollectorRegistry())
    with pytest.raises(ValueError, match="prefix"):
        prometheus.PrometheusExporter(eng, registry=prom.CollectorRegistry(), prefix="bad-name")
    registry = prom.CollectorRegistry()
    prometheus.PrometheusExporter(eng, registry=registry, prefix="a")
    prometheus.PrometheusExporter(eng, registry=registry, prefix="b")  # distinct prefixes share a registry
    eng.close()


def test_exporter_recompute_latency_histogram():
    """One observation per region recompute, fed as backward runs; none when turned off."""
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()
    model, x, y = _model_and_batch()
    eng = offload.engine(policy="recompute", regions=model.blocks, model=model)
    timed = prometheus.PrometheusExporter(eng, registry=registry)
    prometheus.PrometheusExporter(eng, registry=registry, prefix="untimed", recompute_latency=False)
    steps = 3
    try:
        for _ in range(steps):
            _step(model, eng, x, y)
            assert timed.update().recomputed_regions == N_LAYER
        timed.close()
        _step(model, eng, x, y)  # closed: this step's recomputes are not observed
    finally:
        eng.close()
    assert registry.get_sample_value("offload_recompute_seconds_count") == steps * N_LAYER
    assert registry.get_sample_value("offload_recompute_seconds_sum") > 0
    assert registry.get_sample_value("offload_recompute_seconds_bucket", {"le": "+Inf"}) == steps * N_LAYER
    assert registry.get_sample_value("untimed_recompute_seconds_count") == 0
