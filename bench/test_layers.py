"""Per layer: the cost of moving its saved activations out and back, versus recomputing it.

    pytest bench -q                                  # CPU here; CUDA when available
    OFFLOAD_BENCH_DEVICE=cpu OFFLOAD_BENCH_SIZES=tiny pytest bench -q   # seconds, plumbing only

The measurements are ``layers.LayerBench``'s (see ``layers.py`` and bench/README.md for what each
figure means), timed here with pytest-benchmark in pedantic mode: ``keep``, ``offload`` and
``recompute`` per layer and size, adjacent so drift hits them alike. Before each timed offload
round a keep step runs and times itself (pytest-benchmark's untimed ``setup``), so ``transfer`` is
the median of paired differences. At the end ``conftest.py`` prints the table and writes the JSON.
Without pytest-benchmark this module is skipped; ``python bench/layers.py`` runs the same code.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is not installed; run python bench/layers.py")

import layers  # noqa: E402
import torch  # noqa: E402

layers.set_threads(None)  # $OFFLOAD_BENCH_THREADS, if set
if os.environ.get(layers.DEVICE_ENV, "").startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(f"{layers.DEVICE_ENV}={os.environ[layers.DEVICE_ENV]} but CUDA is not available", allow_module_level=True)
DEVICE = layers.parse_device(None)

PARAMS = [
    pytest.param(case, kind, id=f"{case.id}-{kind}")
    for case in layers.cases(DEVICE)
    for kind in layers.KINDS
]


@pytest.mark.parametrize(("case", "kind"), PARAMS)
def test_layer(benchmark, layer_results, case: layers.Case, kind: str) -> None:
    bench = layers.LayerBench(case, DEVICE)
    warmup, rounds = layers.layer_rounds(DEVICE)
    keep_before_ms: list[float] = []
    setup = bench.step("keep", keep_before_ms) if kind == "offload" else None  # the paired reference
    try:
        facts = bench.facts() if kind == "offload" else None
        benchmark.group = f"{case.layer} ({DEVICE.type})"
        benchmark.extra_info.update(layer=case.layer, size=case.size.name, kind=kind, **(facts or {}))
        benchmark.pedantic(bench.step(kind), setup=setup, rounds=rounds, warmup_rounds=warmup, iterations=1)
    finally:
        bench.close()
    if benchmark.stats is None:  # --benchmark-disable: nothing was timed
        return
    timed_ms = [s * 1e3 for s in benchmark.stats.stats.data]
    transfer_ms = None
    if kind == "offload":
        transfer_ms = layers.paired_difference_ms(timed_ms, keep_before_ms[warmup : warmup + rounds])
        benchmark.extra_info["transfer_ms"] = transfer_ms
    layer_results.record(case, DEVICE, kind, layers.median(timed_ms), transfer_ms, facts)
