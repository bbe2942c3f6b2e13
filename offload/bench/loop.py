"""The one training loop of the benchmarks: MiniGPT under one way of handling saved activations.

``Trainer`` builds the model (same seed, same weights everywhere), its optimizer and batches, and
trains one step under a context; ``run_one`` trains a configuration and returns what it saw;
``bench/overhead.py`` steps one ``Trainer`` under several engines, interleaved. One step::

    reset peak ─ fwd ─ bwd ─┬─ reset peak ─ optimizer.step ─ zero_grad
    │◀── fwd_bwd_ms ──────▶│ │◀───────── opt_ms ────────────────────▶│     step_ms = the sum
    act_peak = peak(fwd..bwd) − memory at the start;  opt_peak = peak(optimizer) − memory before it

The spill page cache is sampled at the end of forward, as the last block's backward starts and at
the end of backward, its sampling time kept out of the step's. ``_grad_check`` first runs one step
on the initial weights under strict determinism (no warn_only) and math attention, through an
engine of its own, so the timed engine's profiling steps see the real kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any, Iterator, Optional

import torch
import torch.utils.deterministic as deterministic_flags
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

import offload
from offload.bench.config import DTYPES, MB, PROBED_POLICIES, Kind, RunSettings, Variant
from offload.bench.measure import Memory, resolve_device, sync
from offload.models import MiniGPT, batches

__all__ = ["CUBLAS_WORKSPACE_CONFIG", "Skipped", "Trainer", "grad_checksums", "run_one"]

LEARNING_RATE = 1e-3  # AdamW: small enough that a few steps of bf16 training stay finite

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS workspace setting that ``torch.use_deterministic_algorithms`` requires on CUDA (read
when cuBLAS initializes, so the parent sets it for its children)."""

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a gradient's bits, summed
CHECK_SEED_OFFSET = 7  # the gradient check's batch comes from its own stream (seed + this)


class Skipped(Exception):
    """A configuration that cannot run here (an optional package missing, a device it needs)."""


def _torchtune_offload() -> type:
    """torchtune's OffloadActivations class, or Skipped saying why not."""
    try:
        return importlib.import_module("torchtune.training").OffloadActivations
    except (ImportError, AttributeError) as error:
        raise Skipped(f"torchtune's OffloadActivations is not importable ({error}); pip install torchtune") from error


class BlockHooks:
    """Hooks on every block of an eager model (compiled code runs no Python hooks): each block's
    forward time while ``timing``; engine-resident bytes and memory in use after each block's
    forward and backward over the step after ``start_trace`` (the plot); and ``on_last_backward``
    as the last block's backward starts, when the spill files hold the most they will this step."""

    def __init__(self, blocks: torch.nn.ModuleList, device: torch.device, on_last_backward: Callable[[], None]) -> None:
        self.cuda, self.last, self.on_last_backward = device.type == "cuda", len(blocks) - 1, on_last_backward
        self.timing = False
        self.marks: list[list] = []
        self.trace: Optional[list[dict]] = None
        self._engine: Optional[offload.Engine] = None
        self._memory: Optional[Memory] = None
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(self._start)
            block.register_forward_hook(functools.partial(self._end, index))

    def start_trace(self, engine: Optional[offload.Engine], memory: Memory) -> None:
        self.trace, self._engine, self._memory = [], engine, memory

    def stop_trace(self) -> list[dict]:
        trace, self.trace = self.trace or [], None
        return trace

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        (event := torch.cuda.Event(enable_timing=True)).record()
        return event

    def _start(self, module: torch.nn.Module, args: tuple) -> None:
        if self.timing:
            self.marks.append([self._now(), None])

    def _sample(self, phase: str) -> None:
        assert self.trace is not None and self._memory is not None, "sampled only between start_trace and stop_trace"
        resident = None if self._engine is None else self._engine.stats.resident_bytes
        self.trace.append({"phase": phase, "resident_bytes": resident, "memory_bytes": self._memory.current()})

    def _end(self, index: int, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self.timing:
            self.marks[-1][1] = self._now()
        if self.trace is not None:
            self._sample(f"fwd{index}")
        if not (isinstance(output, torch.Tensor) and output.requires_grad):
            return
        if index == self.last:
            output.register_hook(lambda grad: self.on_last_backward())
        if self.trace is not None:
            output.register_hook(lambda grad: self._sample(f"bwd{index}"))

    def forward_ms(self) -> float:
        """Sum over the blocks of the last step (call after a device synchronization); then clear."""
        marks, self.marks = [m for m in self.marks if m[1] is not None], []
        return sum(s.elapsed_time(e) if self.cuda else (e - s) * 1e3 for s, e in marks)


class Trainer:
    """MiniGPT, AdamW and the batch stream for one configuration; ``step`` trains one step."""

    def __init__(self, run: RunSettings, variant: Variant, data: torch.Tensor, device: torch.device) -> None:
        self.run, self.variant, self.device = run, variant, device
        torch.manual_seed(run.seed)
        with torch.device(device):
            self.model = MiniGPT(run.gpt_config())
        self.model = self.model.to(DTYPES[run.dtype]).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE)
        self.data = data
        self.stream = batches(data, run.batch, run.seq, torch.Generator().manual_seed(run.seed))
        self._memory: Optional[Memory] = None
        self._paused_s = 0.0
        self.hooks = None if variant.compiled else BlockHooks(self.model.blocks, device, self._sample_cache)
        for block in self.model.blocks:
            if variant.kind is Kind.CHECKPOINT:
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
            if variant.compiled:
                block.compile()
        self.steps = 0

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next(self.stream)
        return x.to(self.device), y.to(self.device)

    def step(
        self,
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        memory: Optional[Memory] = None,
    ) -> dict:
        """One training step under ``context()``: its times, loss and (given ``memory``) memory."""
        x, y = self.batch()
        torch.manual_seed(self.run.seed + 1 + self.steps)  # same dropout masks in every configuration
        self.steps += 1
        self._memory, self._paused_s = memory, 0.0
        sync(self.device)
        if memory is not None:
            memory.reset()
        base = memory.current() if memory is not None else 0
        cpu0, start = time.process_time(), time.perf_counter()
        with context():
            _, loss = self.model(x, y)
        self._sample_cache()
        loss.backward()
        self._sample_cache()
        sync(self.device)
        fwd_bwd_ms = (time.perf_counter() - start - self._paused_s) * 1e3
        cpu_ms = (time.process_time() - cpu0) * 1e3
        record = {"loss": loss.item(), "fwd_bwd_ms": fwd_bwd_ms}
        if memory is not None:
            record.update(peak_bytes=memory.peak(), act_peak_bytes=memory.peak() - base)
            memory.reset()
            base = memory.current()
        cpu0, start = time.process_time(), time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync(self.device)
        opt_ms = (time.perf_counter() - start) * 1e3
        record.update(opt_ms=opt_ms, step_ms=fwd_bwd_ms + opt_ms, cpu_ms=cpu_ms + (time.process_time() - cpu0) * 1e3)
        if memory is not None:
            record["opt_peak_bytes"] = memory.peak() - base
        self._memory = None
        return record

    def _sample_cache(self) -> None:
        """Sample the spill page cache (``Memory.sample_cache``), its time kept out of the step's."""
        if self._memory is not None:
            start = time.perf_counter()
            self._memory.sample_cache()
            self._paused_s += time.perf_counter() - start

    def saved_bytes(self, engine_kwargs: dict) -> int:
        """Bytes of distinct saved storages one step leaves for backward (an engine that only counts)."""
        with contextlib.closing(offload.engine(budget_mb=None, model=self.model, **engine_kwargs)) as counter:
            x, y = self.batch()
            with counter:
                _, loss = self.model(x, y)
            loss.backward()
            self.model.zero_grad(set_to_none=True)
            return counter.stats.saved_bytes


def grad_checksums(model: torch.nn.Module) -> dict[str, Optional[list]]:
    """Per parameter: [sum of the gradient's bit patterns as int64, its norm in float64]. Two
    gradients with equal checksums are equal bit for bit but for a vanishing chance of collision."""
    out: dict[str, Optional[list]] = {}
    for name, p in model.named_parameters():
        g = None if p.grad is None else p.grad.detach().contiguous()
        out[name] = (
            None
            if g is None
            else [int(torch.sum(g.view(_INT_OF_SIZE[g.element_size()]), dtype=torch.int64)), float(g.double().norm())]
        )
    return out


@contextlib.contextmanager
def _determinism(strict: bool) -> Iterator[None]:
    """strict: deterministic kernels or an error, the math attention kernel, new memory NaN-filled
    (what ``torch.use_deterministic_algorithms(True)`` does). Else: deterministic kernels where
    torch has them, a warning elsewhere, and no NaN-filling (it would skew the timings)."""
    # fill_uninitialized_memory is a property of the class torch gives this module; stubs do not see it.
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        deterministic_flags.fill_uninitialized_memory,  # type: ignore[attr-defined]  # see above
    )
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    deterministic_flags.fill_uninitialized_memory = strict  # type: ignore[attr-defined]  # see above
    try:
        with sdpa_kernel(SDPBackend.MATH) if strict else contextlib.nullcontext():
            yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        deterministic_flags.fill_uninitialized_memory = saved[2]  # type: ignore[attr-defined]  # see above


def _make_context(
    trainer: Trainer, budget_mb: Optional[float], engine_kwargs: dict, machine: Optional[offload.MachineProfile]
) -> tuple[Callable[[], Any], Optional[offload.Engine]]:
    """(context factory, engine or None) for the trainer's configuration."""
    variant, device = trainer.variant, trainer.device
    if variant.kind is Kind.SAVE_ON_CPU:
        return functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=device.type == "cuda"), None
    if variant.kind is Kind.TORCHTUNE:
        hooks = _torchtune_offload()()  # one instance, reused every step as torchtune does
        return (lambda: hooks), None
    if variant.kind is not Kind.ENGINE:
        return contextlib.nullcontext, None
    engine = offload.engine(
        budget_mb,
        policy=variant.policy,
        regions=trainer.model.blocks,
        model=trainer.model,
        machine=machine,
        **engine_kwargs,
    )
    return (lambda: engine), engine


def run_one(
    run: RunSettings,
    variant: Variant,
    data: torch.Tensor,
    *,
    activation_bytes: Optional[int] = None,
    emit: Callable[[dict], None] = lambda record: None,
) -> dict:
    """Train ``run.total_steps`` steps of ``variant`` here, passing each step's record to ``emit``;
    return the summary record. ``activation_bytes`` (the reference's saved bytes) sizes budgets;
    measured here when a budget needs it and it is None."""
    device = resolve_device(run.device)
    if variant.kind is Kind.TORCHTUNE and _torchtune_offload() and device.type != "cuda":
        raise Skipped("torchtune's OffloadActivations needs CUDA streams")
    spill_dir = tempfile.mkdtemp(prefix="offload-bench-", dir=run.spill_dir)
    engine_kwargs: dict[str, Any] = {"spill_dir": spill_dir}
    if run.min_offload_bytes is not None:
        engine_kwargs["min_offload_bytes"] = run.min_offload_bytes
    trainer = Trainer(run, variant, data, device)
    memory = Memory(device, spill_dir)
    machine = offload.probe(device) if variant.policy in PROBED_POLICIES else None  # cached after the first
    engine: Optional[offload.Engine] = None
    summary: dict[str, Any] = {"type": "summary", "config": variant.name}
    hooks = trainer.hooks
    try:
        if variant.budget_fraction is not None and activation_bytes is None:
            activation_bytes = Trainer(run, variant, data, device).saved_bytes(engine_kwargs)
        budget_mb = None
        if variant.budget_fraction is not None:
            assert activation_bytes is not None  # measured just above
            budget_mb = variant.budget_fraction * activation_bytes / MB
        if run.check_grads and not variant.compiled:
            # A shorter check batch saves proportionally less: its budget shrinks alike, so it moves what a step would.
            scale = (run.check_seq or run.seq) / run.seq
            summary["grad_check"] = _grad_check(trainer, budget_mb and budget_mb * scale, engine_kwargs, machine)
        context, engine = _make_context(trainer, budget_mb, engine_kwargs, machine)
        if hooks is not None:
            hooks.timing = variant.kind is Kind.NONE
        with _determinism(strict=False) if run.deterministic else contextlib.nullcontext():
            for step in range(run.total_steps):
                if step == run.total_steps - 1 and hooks is not None:
                    hooks.start_trace(engine, memory)
                profiling = engine is not None and engine.profiling  # a profiling step is never timed
                if engine is not None:
                    engine.reset_stats()
                record = trainer.step(context, memory)
                record.update(
                    type="step",
                    config=variant.name,
                    step=step,
                    budget_mb=budget_mb,
                    warmup=step < run.warmup or profiling,
                )
                if hooks is not None and hooks.timing:
                    record["block_forward_ms"] = hooks.forward_ms()
                if engine is not None:
                    record.update(engine.stats.to_dict())
                emit(record)
        trace = [] if hooks is None else hooks.stop_trace()
        if variant.kind is Kind.NONE:
            activation_bytes = trainer.saved_bytes(engine_kwargs)
        plan = None if engine is None else engine.plan
        return summary | dict(
            activation_bytes=activation_bytes,
            budget_mb=budget_mb,
            peak_source=memory.source,
            malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            plan=None if plan is None else plan.to_dict(),
            plan_text=None if plan is None else str(plan),
            machine=None if machine is None else dataclasses.asdict(machine),
            trace=trace,
        )
    finally:
        if engine is not None:
            engine.close()
        del trainer
        gc.collect()
        shutil.rmtree(spill_dir, ignore_errors=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _check_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy from ops with deterministic CUDA kernels (log_softmax, gather): strict mode
    raises on ``F.cross_entropy`` on CUDA (``torch.use_deterministic_algorithms`` lists NLLLoss among
    the CUDA ops without a deterministic implementation)."""
    return -logits.float().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).mean()


def _grad_check(
    trainer: Trainer, budget_mb: Optional[float], engine_kwargs: dict, machine: Optional[offload.MachineProfile]
) -> dict:
    """One step on the initial weights under strict determinism, through its own context (an
    engine of its own); the gradients' checksums, or the error strict determinism raised."""
    context, engine = _make_context(trainer, budget_mb, engine_kwargs, machine)
    run = trainer.run  # a batch of its own: the timed steps see the same batches whether or not a check ran
    check_batches = batches(
        trainer.data, run.batch, run.check_seq or run.seq, torch.Generator().manual_seed(run.seed + CHECK_SEED_OFFSET)
    )
    x, y = (t.to(trainer.device) for t in next(check_batches))
    torch.manual_seed(run.seed)
    try:
        with _determinism(strict=True):
            with context():
                logits, _ = trainer.model(x)
                loss = _check_loss(logits, y)
            loss.backward()
        return {"checksums": grad_checksums(trainer.model)}
    except RuntimeError as error:
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    finally:
        trainer.model.zero_grad(set_to_none=True)
        if engine is not None:
            engine.close()
