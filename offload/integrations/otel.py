"""OpenTelemetry traces of an engine's steps: one span per step, with its recomputes and waits.

    from opentelemetry import trace
    from offload.integrations.otel import StepTracer   # pip install 'offload[otel]'

    StepTracer(eng)                                     # spans go to the global tracer provider
    with trace.get_tracer("train").start_as_current_span("train_step"):
        with eng:
            loss = model(batch)
        loss.backward()

A step (see ``offload._observe``: a forward under the engine and the backward that unpacks from
it) is traced only when its forward begins inside a recording span; its span is that span's
child. Outside a trace a step costs one ``get_current_span()`` call. Per traced step::

    offload.step            forward begin ─▶ backward end; the step's figures (attributes below);
    │                       events "offload.forward_end" (the outermost ``with eng:`` left) and
    │                       "offload.backward_begin" (the backward's first unpack from the engine)
    ├ offload.evict_wait    the forward's waits for evictions, summed: one span as long as their
    │                       sum, placed at the step's start (only when there were any)
    ├ offload.recompute     one per region recompute: its re-run forward, timed (attribute
    │                       offload.region, and offload.saved_bytes where a plan measured it)
    └ offload.reload_wait   the backward's waits for reloads, summed, placed at the backward's begin

Nothing is made per saved tensor: the figures come from ``eng.stats`` at the step's two ends.
The phases are events, not spans: on a small CPU step each SDK span costs tens of microseconds.
The spans are made when the step ends, with the times recorded as it ran (OpenTelemetry takes
explicit start and end times), so nothing here enters or leaves a context while the step runs,
and the backward may run on autograd's own threads.

Step attributes: ``offload.saved_bytes``, ``offload.offloaded_bytes``, ``offload.reloaded_bytes``,
``offload.spilled_bytes``, ``offload.saved_tensors``, ``offload.recomputed_regions`` (the step's
``Stats`` fields, counted from the step's start to its end), ``offload.recomputed_bytes`` (the
saved bytes the plan measured for each region recomputed; only with a plan), ``offload.reload_wait_ms``,
``offload.evict_wait_ms``, ``offload.policy``, ``offload.budget_bytes`` (absent: no budget),
``offload.stage`` (with regions: the profiling stage, or "planned"), ``offload.plan.regions`` and
``offload.plan.decisions`` (parallel lists), ``offload.plan.predicted_step_ms`` (read at the
pace of the latest steps under plans: ``Plan.pace``),
``offload.plan.fits_budget`` (on a step that followed a plan, not a profiling one),
``offload.backward`` (False: no backward unpacked from the engine before the next step began: an
evaluation forward with grad on, or a step whose saves all passed through the engine; such a
step's span ends with its forward).

Cost on a traced step: each recompute is timed, which on CUDA synchronizes the device before and
after it (see ``offload._observe``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import offload

from .._observe import Observer
from .._plan.planner import Plan
from .._stats import Stats

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
except ImportError as error:
    raise ImportError(
        "offload.integrations.otel needs opentelemetry-api: pip install 'offload[otel]' "
        "(or: pip install opentelemetry-api)"
    ) from error

__all__ = ["StepTracer", "TRACER_NAME"]

TRACER_NAME = "offload"
"""The instrumentation scope the spans are recorded under."""

_NS_PER_MS = 1_000_000

_STEP_FIELDS = (
    "saved_bytes",
    "offloaded_bytes",
    "reloaded_bytes",
    "spilled_bytes",
    "saved_tensors",
    "recomputed_regions",
    "reload_wait_ms",
    "evict_wait_ms",
)
"""``Stats`` counters a step span carries as ``offload.<field>``."""


@dataclasses.dataclass(kw_only=True)
class _Step:
    """One traced step, as it runs; its spans are made when it ends."""

    parent: otel_context.Context  # the OpenTelemetry context current when the forward began
    start_ns: int
    stats: Stats
    forward_end_ns: Optional[int] = None
    backward_start_ns: Optional[int] = None
    plan: Optional[Plan] = None
    stage: Optional[str] = None
    recomputes: list = dataclasses.field(default_factory=list)  # (region, ms, end_ns)


def _window(start: Stats, end: Stats) -> dict[str, Any]:
    """The counters' growth over a step; a counter that went down was reset mid-step
    (``reset_stats()``, a metrics exporter's ``update()``): then what it counted since."""
    out = {}
    for name in _STEP_FIELDS:
        a, b = getattr(start, name), getattr(end, name)
        out[name] = b - a if b >= a else b
    return out


class StepTracer(Observer):
    """Traces the steps of one engine that run inside an active OpenTelemetry trace.

    Args:
        engine: the ``offload.Engine`` whose steps to trace.
        tracer_provider: an ``opentelemetry.trace.TracerProvider``; None: the global one.

    ``close()`` stops tracing (a step in progress is ended as it stands).

    Raises:
        ImportError: opentelemetry-api is not installed (``pip install 'offload[otel]'``).
    """

    def __init__(self, engine: offload.Engine, *, tracer_provider: Optional[trace.TracerProvider] = None) -> None:
        if not isinstance(engine, offload.Engine):
            raise TypeError(f"StepTracer needs an offload Engine (from offload.engine(...)), got {engine!r}")
        self.engine = engine
        self._tracer = trace.get_tracer(TRACER_NAME, offload.__version__, tracer_provider=tracer_provider)
        self._step: Optional[_Step] = None
        engine.observers.add(self)

    def close(self) -> None:
        """Stop tracing this engine's steps. Idempotent."""
        self.engine.observers.remove(self)

    # ------------------------------------------------------------------ the observer

    def wants_recompute_times(self) -> bool:
        return trace.get_current_span().is_recording()

    def step_began(self, time_ns: int) -> None:
        if not trace.get_current_span().is_recording():
            self._step = None
            return
        # The whole current context (baggage included), so the step span is the current span's child.
        self._step = _Step(parent=otel_context.get_current(), start_ns=time_ns, stats=self.engine.stats)

    def forward_ended(self, time_ns: int) -> None:
        step = self._step
        if step is None:
            return
        step.forward_end_ns = time_ns
        step.plan = self.engine.plan  # the regions chose this step's plan as its first region ran
        stages = self.engine.recent_stages
        step.stage = stages[-1] if stages else None

    def backward_began(self, time_ns: int) -> None:
        if self._step is not None:
            self._step.backward_start_ns = time_ns

    def recomputed(self, region: str, ms: float, end_ns: int) -> None:
        if self._step is not None:
            self._step.recomputes.append((region, ms, end_ns))

    def step_ended(self, time_ns: int, backward: bool) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        figures = _window(step.stats, self.engine.stats)
        if not backward:
            passed = self.engine.stats.passthrough_tensors - step.stats.passthrough_tensors
            if figures["saved_tensors"] == 0 and passed == 0:
                return  # a forward that saved nothing (an evaluation, an optimizer step under the engine)
            time_ns = step.forward_end_ns or time_ns
        self._emit(step, figures, time_ns, backward)

    # ------------------------------------------------------------------ the spans

    def _emit(self, step: _Step, figures: dict[str, Any], end_ns: int, backward: bool) -> None:
        tracer = self._tracer
        saved_by_region = {} if step.plan is None else {r.name: r.saved_bytes for r in step.plan.regions}
        attributes = {f"offload.{name}": value for name, value in figures.items()}
        attributes["offload.backward"] = backward
        attributes["offload.policy"] = self.engine.config.policy
        if self.engine.config.budget_bytes is not None:
            attributes["offload.budget_bytes"] = self.engine.config.budget_bytes
        if self.engine.recent_stages:
            attributes["offload.stage"] = step.stage or "planned"
        if step.plan is not None:
            attributes["offload.recomputed_bytes"] = sum(saved_by_region.get(name, 0) for name, _, _ in step.recomputes)
            if step.stage is None:  # a profiling step runs its stage, not the provisional plan
                plan = step.plan
                attributes["offload.plan.regions"] = [r.name for r in plan.regions]
                attributes["offload.plan.decisions"] = [r.decision.value for r in plan.regions]
                attributes["offload.plan.predicted_step_ms"] = plan.predicted_step_ms
                attributes["offload.plan.fits_budget"] = plan.fits_budget

        step_span = tracer.start_span(
            "offload.step", context=step.parent, start_time=step.start_ns, attributes=attributes
        )
        if step.forward_end_ns is not None:
            step_span.add_event("offload.forward_end", timestamp=step.forward_end_ns)
        inside_step = trace.set_span_in_context(step_span)
        self._summed_wait(inside_step, "offload.evict_wait", figures["evict_wait_ms"], step.start_ns)
        if backward and step.backward_start_ns is not None:
            step_span.add_event("offload.backward_begin", timestamp=step.backward_start_ns)
            for region, ms, recompute_end_ns in step.recomputes:
                region_attributes = {"offload.region": region, "offload.recompute_ms": ms}
                if region in saved_by_region:
                    region_attributes["offload.saved_bytes"] = saved_by_region[region]
                span = tracer.start_span(
                    "offload.recompute",
                    context=inside_step,
                    start_time=recompute_end_ns - int(ms * _NS_PER_MS),
                    attributes=region_attributes,
                )
                span.end(end_time=recompute_end_ns)
            self._summed_wait(inside_step, "offload.reload_wait", figures["reload_wait_ms"], step.backward_start_ns)
        step_span.end(end_time=end_ns)

    def _summed_wait(self, inside_step: otel_context.Context, name: str, wait_ms: float, start_ns: int) -> None:
        """One span as long as a phase's summed waits, placed at the phase's start."""
        if wait_ms <= 0:
            return
        span = self._tracer.start_span(
            name,
            context=inside_step,
            start_time=start_ns,
            attributes={"offload.wait_ms": wait_ms, "offload.summed": True},
        )
        span.end(end_time=start_ns + int(wait_ms * _NS_PER_MS))

    def __repr__(self) -> str:
        return f"offload.integrations.otel.StepTracer({self.engine!r})"
