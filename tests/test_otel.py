"""OpenTelemetry step traces (``offload.integrations.otel``) and the observer seam under them.

Spans are collected with the SDK's in-memory exporter; the tests skip without the SDK (it is a
test dependency, not the extra's: ``offload[otel]`` needs only the API). Every step is checked
against the engine's own ``Stats`` for that step, and gradients against the model without the engine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload
from offload.models import GPTConfig, MiniGPT

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF  # noqa: E402

from doc_blocks import py_blocks  # noqa: E402
from offload.integrations.otel import StepTracer  # noqa: E402
from zoo import most_profiling_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N_LAYER = 2
CPU_MACHINE = offload.MachineProfile(device_type="cpu", disk_write_gb_per_s=2.0, disk_read_gb_per_s=4.0)
"""Fixed figures for the auto policy, so the tests neither measure this machine nor write its cache."""
SLOW_DISK = offload.MachineProfile(
    device_type="cpu", device_name="slow disk", disk_write_gb_per_s=1e-4, disk_read_gb_per_s=1e-4
)
"""0.1 MB/s: a block's 0.3 MB takes 3 s to move, against ~3 ms to recompute. A calibration the
planner accepts (x0.01 or more) leaves it at 30 ms or more; one it rejects leaves the 3 s; either
way the plan recomputes. With ``CPU_MACHINE`` a loaded CI disk implied x158, the planner rejected
it as implausible, fell back to 2 GB/s and offloaded everything."""


@pytest.fixture
def spans():
    """(provider, exporter): a private tracer provider whose finished spans the exporter keeps."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


RERUN_DECISIONS = (offload.Decision.RECOMPUTE, offload.Decision.SELECTIVE, offload.Decision.SELECTIVE_OFFLOAD)
"""The decisions that re-run a region in the backward: each re-run is one ``offload.recompute`` span."""


def _model(n_layer: int = N_LAYER) -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=64, seq_len=32, attention="math"))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g)


def _step(model, eng, x, y):
    with eng:
        _, loss = model(x, y)
    loss.backward()
    return loss


def _traced_step(provider, model, eng, x, y):
    with provider.get_tracer("test").start_as_current_span("train_step"):
        return _step(model, eng, x, y)


def _named(exporter, name: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def _grads(model) -> list:
    return [p.grad.clone() for p in model.parameters()]


def _reference_grads(x, y) -> list:
    model = _model()
    _, loss = model(x, y)
    loss.backward()
    return _grads(model)


def test_import_needs_no_opentelemetry():
    code = (
        "import sys, offload, offload.integrations, offload.metrics\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_missing_api_names_the_extra():
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "try:\n"
        "    import offload.integrations.otel\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "offload[otel]" in result.stdout


def test_spans_only_inside_an_active_trace(spans, spill_dir):
    provider, exporter = spans
    model = _model()
    x, y = _batch()
    eng = offload.engine(budget_mb=0, model=model, min_offload_mb=0, spill_dir=spill_dir)
    tracer = StepTracer(eng, tracer_provider=provider)
    try:
        _step(model, eng, x, y)  # no span is current: nothing is recorded
        assert exporter.get_finished_spans() == ()
        _traced_step(provider, model, eng, x, y)
        _step(model, eng, x, y)
        unsampled = TracerProvider(sampler=ALWAYS_OFF)  # a current span that records nothing
        with unsampled.get_tracer("test").start_as_current_span("unsampled") as span:
            assert not span.is_recording()
            _step(model, eng, x, y)
    finally:
        tracer.close()
        eng.close()
    steps = _named(exporter, "offload.step")
    assert len(steps) == 1
    (parent,) = _named(exporter, "train_step")
    assert steps[0].parent.span_id == parent.context.span_id
    assert steps[0].context.trace_id == parent.context.trace_id


def test_one_span_per_step_with_a_recompute_child_per_region(spans, spill_dir):
    """Policy "recompute" at budget 0: every block re-runs in backward, everything else spills."""
    provider, exporter = spans
    model = _model()
    x, y = _batch()
    eng = offload.engine(
        budget_mb=0, policy="recompute", regions=model.blocks, model=model, min_offload_mb=0, spill_dir=spill_dir
    )
    tracer = StepTracer(eng, tracer_provider=provider)
    per_step = []
    try:
        for _ in range(3):
            exporter.clear()
            eng.reset_stats()
            _traced_step(provider, model, eng, x, y)
            per_step.append((eng.stats, exporter.get_finished_spans()))
            grads = _grads(model)
            model.zero_grad()
    finally:
        tracer.close()
        eng.close()
    for want, got in zip(grads, _reference_grads(x, y), strict=True):
        assert torch.equal(want, got)
    for stats, finished in per_step:
        by_name = {}
        for s in finished:
            by_name.setdefault(s.name, []).append(s)
        (step,) = by_name["offload.step"]
        events = {e.name: e.timestamp for e in step.events}
        forward_end, backward_begin = events["offload.forward_end"], events["offload.backward_begin"]
        a = step.attributes
        for field in ("saved_bytes", "offloaded_bytes", "reloaded_bytes", "spilled_bytes", "saved_tensors"):
            assert a[f"offload.{field}"] == getattr(stats, field), field
        assert stats.spilled_bytes > 0 and stats.reloaded_bytes > 0
        assert a["offload.recomputed_regions"] == stats.recomputed_regions == N_LAYER
        assert a["offload.reload_wait_ms"] == pytest.approx(stats.reload_wait_ms)
        assert a["offload.evict_wait_ms"] == pytest.approx(stats.evict_wait_ms)
        assert a["offload.policy"] == "recompute" and a["offload.budget_bytes"] == 0 and a["offload.backward"] is True
        assert step.start_time <= forward_end <= backward_begin <= step.end_time
        recomputes = by_name["offload.recompute"]
        assert sorted(r.attributes["offload.region"] for r in recomputes) == [f"blocks.{i}" for i in range(N_LAYER)]
        assert all(r.parent.span_id == step.context.span_id for r in recomputes)
        assert all(backward_begin <= r.start_time <= r.end_time <= step.end_time for r in recomputes)
        for name, start, wait_ms in (
            ("offload.reload_wait", backward_begin, stats.reload_wait_ms),
            ("offload.evict_wait", step.start_time, stats.evict_wait_ms),
        ):
            waits = by_name.get(name, [])
            assert len(waits) == (1 if wait_ms > 0 else 0)  # summed: one span, never one per tensor
            for w in waits:
                assert w.parent.span_id == step.context.span_id and w.start_time == start
                assert w.attributes["offload.wait_ms"] == pytest.approx(wait_ms)


def test_no_span_per_saved_tensor(spans, spill_dir):
    """A model that saves hundreds of tensors a step still makes a fixed handful of spans."""
    provider, exporter = spans
    model = _model(n_layer=8)
    x, y = _batch()
    eng = offload.engine(budget_mb=0, model=model, min_offload_mb=0, spill_dir=spill_dir)
    tracer = StepTracer(eng, tracer_provider=provider)
    try:
        _traced_step(provider, model, eng, x, y)
        stats = eng.stats
    finally:
        tracer.close()
        eng.close()
    ours = [s for s in exporter.get_finished_spans() if s.name.startswith("offload.")]
    assert stats.saved_tensors >= 200
    waits = (stats.reload_wait_ms > 0) + (stats.evict_wait_ms > 0)
    assert len(ours) == 1 + waits  # the step, and no recompute without regions
    assert {s.name for s in ours} <= {"offload.step", "offload.reload_wait", "offload.evict_wait"}


def test_planned_step_carries_the_plans_decisions(spans, spill_dir):
    """The step span and its recompute spans against the plan that step ran: read between its
    forward and its backward, as the regions chose it when the first region ran. ``eng.plan`` read
    after the step may already be another plan (the step's own measurements can move the plan).
    Every decision that re-runs a region has a recompute span: on a loaded machine the plan may
    choose "selective+offload" for a block where a quiet one chooses "recompute"."""
    provider, exporter = spans
    model = _model(n_layer=4)
    x, y = _batch()
    eng = offload.engine(
        budget_mb=0.05, regions=model.blocks, model=model, machine=SLOW_DISK, min_offload_mb=0, spill_dir=spill_dir
    )
    tracer = StepTracer(eng, tracer_provider=provider)
    stages = []
    try:
        for _ in range(most_profiling_steps("auto") + 1):
            exporter.clear()
            eng.reset_stats()
            with provider.get_tracer("test").start_as_current_span("train_step"):
                with eng:
                    _, loss = model(x, y)
                plan = eng.plan  # the plan this step runs; its backward may end with another in force
                loss.backward()
            (step,) = _named(exporter, "offload.step")
            stages.append(step.attributes["offload.stage"])
            model.zero_grad()
            if not eng.profiling and stages[-1] == "planned":
                break
        stats = eng.stats
    finally:
        tracer.close()
        eng.close()
    assert stages[0] == "measure" and stages[-1] == "planned", stages
    assert plan is not None
    a = step.attributes
    assert list(a["offload.plan.regions"]) == [r.name for r in plan.regions]
    assert list(a["offload.plan.decisions"]) == [d.value for d in plan.decisions]
    assert a["offload.plan.fits_budget"] == plan.fits_budget
    recomputed = [r for r in plan.regions if r.decision in RERUN_DECISIONS]
    assert recomputed, f"the test wants a plan that re-runs something:\n{plan}"
    spans_ = _named(exporter, "offload.recompute")
    assert sorted(s.attributes["offload.region"] for s in spans_) == sorted(r.name for r in recomputed)
    assert a["offload.recomputed_regions"] == stats.recomputed_regions == len(recomputed)
    assert a["offload.recomputed_bytes"] == sum(r.saved_bytes for r in recomputed)
    assert {s.attributes["offload.region"]: s.attributes["offload.saved_bytes"] for s in spans_} == {
        r.name: r.saved_bytes for r in recomputed
    }


def test_forward_without_backward_and_evaluation(spans, spill_dir):
    """A forward whose backward never runs is a step without a backward span, ended when the
    next step begins; a forward under no_grad is no step at all."""
    provider, exporter = spans
    model = _model()
    x, y = _batch()
    eng = offload.engine(budget_mb=0, model=model, min_offload_mb=0, spill_dir=spill_dir)
    tracer = StepTracer(eng, tracer_provider=provider)
    try:
        with provider.get_tracer("test").start_as_current_span("train_step"):
            with torch.no_grad(), eng:
                model(x, y)
            with eng:
                _, dropped = model(x, y)
            del dropped
            _step(model, eng, x, y)
            with eng:  # an optimizer step under the engine (Lightning re-enters after backward): saves nothing
                pass
            _step(model, eng, x, y)
    finally:
        tracer.close()
        eng.close()
    steps = _named(exporter, "offload.step")
    assert [s.attributes["offload.backward"] for s in steps] == [False, True, True]
    assert [sorted(e.name for e in s.events) for s in steps] == [
        ["offload.forward_end"],
        *[["offload.backward_begin", "offload.forward_end"]] * 2,
    ]
    assert steps[0].end_time == steps[0].events[0].timestamp  # ended where its forward did


def test_grad_inside_forward_does_not_end_the_step(spans, spill_dir):
    """A torch.autograd.grad inside the forward unpacks from the engine; the step's backward is
    still the one after the forward."""
    provider, exporter = spans
    eng = offload.engine(budget_mb=0, min_offload_mb=0, spill_dir=spill_dir)
    tracer = StepTracer(eng, tracer_provider=provider)
    w = torch.randn(64, 64, requires_grad=True)
    try:
        with provider.get_tracer("test").start_as_current_span("train_step"):
            with eng:
                h = torch.randn(8, 64).requires_grad_() @ w
                a = torch.tanh(h).sin()
                (g,) = torch.autograd.grad(a.sum(), h, create_graph=True)  # a gradient penalty
                loss = a.sum() + g.pow(2).sum()
            loss.backward()
    finally:
        tracer.close()
        eng.close()
    (step,) = _named(exporter, "offload.step")
    events = {e.name: e.timestamp for e in step.events}
    assert events["offload.forward_end"] <= events["offload.backward_begin"]
    assert step.attributes["offload.backward"] is True


def test_unpack_outside_a_backward_is_not_one(spans, spill_dir):
    """Reading a node's saved tensor by hand unpacks it from the engine outside any backward."""
    provider, exporter = spans
    eng = offload.engine(budget_mb=0, min_offload_mb=0, spill_dir=spill_dir)
    tracer = StepTracer(eng, tracer_provider=provider)
    h = torch.randn(8, 64, requires_grad=True)
    try:
        with provider.get_tracer("test").start_as_current_span("train_step"):
            with eng:
                a = torch.tanh(h * 2)
            assert torch.equal(a.grad_fn._saved_result, a)  # an unpack, no backward running
            a.sum().backward()
    finally:
        tracer.close()
        eng.close()
    (step,) = _named(exporter, "offload.step")
    assert step.attributes["offload.backward"] is True and "offload.backward_begin" in {e.name for e in step.events}


def test_closed_tracer_traces_nothing(spans, spill_dir):
    provider, exporter = spans
    model = _model()
    x, y = _batch()
    eng = offload.engine(budget_mb=0, model=model, min_offload_mb=0, spill_dir=spill_dir)
    tracer = StepTracer(eng, tracer_provider=provider)
    tracer.close()
    tracer.close()
    try:
        _traced_step(provider, model, eng, x, y)
    finally:
        eng.close()
    assert not _named(exporter, "offload.step")


def test_tracer_rejects_a_non_engine():
    with pytest.raises(TypeError, match="offload Engine"):
        StepTracer(object())


def test_docs_traces_example(spans, spill_dir):
    """docs/trainers.md's Traces example, as written, with the names its ``# supply:`` line assumes."""
    provider, exporter = spans
    (block,) = py_blocks("docs/trainers.md", section="## Traces")
    model = _model()
    x, y = _batch()
    eng = offload.engine(budget_mb=0, policy="recompute", regions=model.blocks, model=model, spill_dir=spill_dir)
    namespace = {"offload": offload, "eng": eng, "model": model, "batches": [(x, y)], "tracer_provider": provider}
    try:
        exec(compile(block, str(ROOT / "docs/trainers.md"), "exec"), namespace)
    finally:
        namespace["tracing"].close()
        eng.close()
    assert len(_named(exporter, "offload.step")) == 1
    assert len(_named(exporter, "offload.recompute")) == N_LAYER
