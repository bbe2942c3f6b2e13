"""``layers.LayerBench`` under pytest-benchmark (pedantic mode): keep, offload and recompute per
layer and size, adjacent so drift hits them alike. Before each timed offload round a keep step
runs and times itself (pytest-benchmark's untimed ``setup``): ``transfer`` is the median of the
paired differences. Skipped without pytest-benchmark; ``python bench/layers.py`` runs the same code.

    OFFLOAD_BENCH_DEVICE=cpu OFFLOAD_BENCH_SIZES=tiny pytest bench -q   # seconds, plumbing only
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is not installed; run python bench/layers.py")

import torch  # noqa: E402

import layers  # noqa: E402
from offload.bench.measure import median, paired_median, set_threads  # noqa: E402

set_threads(None)  # $OFFLOAD_BENCH_THREADS, if set
if os.environ.get(layers.DEVICE_ENV, "").startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(
        f"{layers.DEVICE_ENV}={os.environ[layers.DEVICE_ENV]} but CUDA is not available", allow_module_level=True
    )
DEVICE = layers.parse_device(None)

PARAMS = [pytest.param(case, kind, id=f"{case.id}-{kind}") for case in layers.cases(DEVICE) for kind in layers.KINDS]


@pytest.mark.parametrize(("case", "kind"), PARAMS)
def test_layer(benchmark, layer_results, case: layers.Case, kind: str) -> None:
    warmup, rounds = layers.layer_rounds(DEVICE)
    bench = layers.LayerBench(case, DEVICE)
    keep_before_ms: list[float] = []
    setup = bench.step("keep", keep_before_ms) if kind == "offload" else None  # the paired reference
    try:
        facts = bench.facts() if kind == "offload" else {}
        benchmark.group = f"{case.layer} ({DEVICE.type})"
        benchmark.extra_info.update(layer=case.layer, size=case.size.name, kind=kind, **facts)
        benchmark.pedantic(bench.step(kind), setup=setup, rounds=rounds, warmup_rounds=warmup, iterations=1)
    finally:
        bench.close()
    if benchmark.stats is None:  # --benchmark-disable: nothing was timed
        return
    timed_ms = [seconds * 1e3 for seconds in benchmark.stats.stats.data]
    result = layer_results.setdefault(case, {})
    result[kind] = median(timed_ms)
    if kind == "offload":
        transfer_ms = paired_median(timed_ms, keep_before_ms[warmup : warmup + rounds])
        result.update(transfer_ms=transfer_ms, facts=facts)
        benchmark.extra_info["transfer_ms"] = transfer_ms
