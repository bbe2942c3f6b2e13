"""Per layer: the cost of moving its saved activations out and back, versus recomputing it.

    pytest bench -q                                  # CPU here; CUDA when available
    OFFLOAD_BENCH_DEVICE=cpu OFFLOAD_BENCH_SIZES=tiny pytest bench -q   # seconds, plumbing only

For each typical layer (Linear, SwiGLU MLP, causal SDPA attention with its projections, RMSNorm,
LayerNorm, Conv2d+BatchNorm+ReLU, a whole GPT block) at two or three sizes, three functions are
timed with pytest-benchmark (pedantic mode, warm-up rounds, device synchronized inside the timed
function), adjacent to each other so drift hits them alike:

- ``keep``: forward + backward without the engine: the reference step.
- ``offload``: the same step under ``offload.engine(budget_mb=0, min_offload_bytes=0)``. At a
  zero budget every saved storage leaves the device the moment it is saved, pack waits for the
  copy to land, and every unpack in backward is a reload the layer waits for (there is no room
  to prefetch into). Before each timed round a keep step runs and times itself (pytest-benchmark's
  ``setup``, untimed by it), so ``transfer`` = median over rounds of (offload_i - keep_i): the
  whole round trip of the layer's saved bytes to the tier and back, through the engine's real
  code path (hooks, bookkeeping, copies), with nothing hidden behind compute, and with drift
  between rounds cancelled by the pairing. On the CPU the tier is the spill directory (disk,
  through the page cache); on CUDA it is pinned host memory over the side stream. In a whole
  model part of this hides behind the next layer's compute; this is the exposed upper bound that
  the planner weighs against recompute, and the figure the cost model (bytes / bandwidth + a
  fixed cost per tensor) should predict.
- ``recompute``: one forward with grad enabled, graph built and dropped: the extra work a
  recompute of the layer does in backward (torch.utils.checkpoint re-runs the forward with grad
  enabled to rebuild the saved tensors).

Untimed, once per layer: saved bytes (``stats.saved_bytes`` of an engine at budget None:
distinct storages, parameters excluded), forward FLOPs (FlopCounterMode), and the stats of one
offload step. Why a difference of medians rather than timing pack and unpack alone: only the
whole step includes what the tier really costs (waiting on the copy, the reload, the allocator),
and it is the quantity a user pays.

At the end of the session ``conftest.py`` prints the comparison table (layer, size, saved MB,
transfer ms, recompute ms, winner) and writes ``bench/results/layers-<device>.json`` (or
``$OFFLOAD_BENCH_OUT``). Without pytest-benchmark this module is skipped; ``python bench/layers.py``
runs the same measurements in plain Python.
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
    for kind in layers.LayerBench.KINDS
]


@pytest.mark.parametrize(("case", "kind"), PARAMS)
def test_layer(benchmark, layer_results, case: layers.Case, kind: str) -> None:
    bench = layers.LayerBench(case, DEVICE)
    warmup, rounds = layers.layer_rounds(DEVICE)
    keep_before_ms: list[float] = []
    setup = bench.timed("keep", keep_before_ms) if kind == "offload" else None  # the paired reference
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
