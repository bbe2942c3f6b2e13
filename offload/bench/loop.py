"""The one training loop of the benchmarks: MiniGPT under one way of handling saved activations.

``Trainer`` builds the model (same seed, same weights everywhere), its optimizer and batches, and
trains one step under a context; ``run_one`` trains a configuration and returns what it saw;
``bench/overhead.py`` steps one ``Trainer`` under several engines, interleaved. One step::

    reset peak ─ fwd ─ bwd ─┬─ reset peak ─ optimizer.step ─ zero_grad
    │◀── fwd_bwd_ms ──────▶│ │◀───────── opt_ms ────────────────────▶│     step_ms = the sum
    act_peak = peak(fwd..bwd) − memory at the start;  opt_peak = peak(optimizer) − memory before it

The spill page cache is sampled at the end of forward, as the last block's backward starts and at
the end of backward, its sampling time kept out of the step's. ``_grad_check`` first runs one step
on the initial weights under strict determinism (no warn_only), at the timed shape and on CUDA with
the timed attention kernel (``check_attention``), through an engine of its own, so the timed
engine's profiling steps see the real kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any, Iterator, Optional

import torch
import torch.utils.deterministic as deterministic_flags
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

import offload
from offload._memory.arena import PinnedSlabs
from offload._memory.transfer import CudaLink
from offload.bench.config import DTYPES, MB, PROBED_POLICIES, Kind, RunSettings, Variant
from offload.bench.measure import Memory, resolve_device, window
from offload.models import MiniGPT, batches

__all__ = ["CUBLAS_WORKSPACE_CONFIG", "Skipped", "Trainer", "grad_checksums", "run_one"]

LEARNING_RATE = 1e-3  # AdamW: small enough that a few steps of bf16 training stay finite

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS workspace setting that ``torch.use_deterministic_algorithms`` requires on CUDA (read
when cuBLAS initializes, so the parent sets it for its children)."""

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a gradient's bits, summed
CHECK_SEED_OFFSET = 7  # the gradient check's batch comes from its own stream (seed + this)


Context = Callable[[], contextlib.AbstractContextManager]
"""What a configuration trains under: a factory of the context manager each step enters."""


class Skipped(Exception):
    """A configuration that cannot run here (an optional package missing, a device it needs)."""


def _torchtune_offload() -> type:
    """torchtune's OffloadActivations class, or Skipped saying why not."""
    try:
        return importlib.import_module("torchtune.training").OffloadActivations
    except (ImportError, AttributeError) as error:
        raise Skipped(f"torchtune's OffloadActivations is not importable ({error}); pip install torchtune") from error


class BlockHooks:
    """Hooks on every block of an eager model (compiled code runs no Python hooks): while ``timing``,
    each block's forward time; between ``start_trace`` and ``stop_trace``, the engine's resident
    bytes and the memory in use after each block's forward and backward (the plot); and a page-cache
    sample of ``memory`` as the last block's backward starts, when the spill files hold the most
    they will this step."""

    def __init__(self, blocks: torch.nn.ModuleList, device: torch.device) -> None:
        self.cuda, self.last = device.type == "cuda", len(blocks) - 1
        self.timing = False
        self.trace: Optional[list[dict]] = None
        self.engine: Optional[offload.Engine] = None
        self.memory: Optional[Memory] = None  # set by Trainer.step for the step
        self._spans: list[tuple[Any, Any]] = []
        self._started: Any = None
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(self._start)
            block.register_forward_hook(functools.partial(self._end, index))

    def start_trace(self, engine: Optional[offload.Engine]) -> None:
        """Trace the steps from now on (the harness traces the last one, for the plot)."""
        self.trace, self.engine = [], engine

    def stop_trace(self) -> list[dict]:
        """The samples since ``start_trace``; tracing stops (later passes, e.g. a counting one, add none)."""
        trace, self.trace, self.engine = self.trace or [], None, None
        return trace

    def _now(self) -> Any:
        """The host clock, or on CUDA an event recorded now (read after a synchronization)."""
        if not self.cuda:
            return time.perf_counter()
        (event := torch.cuda.Event(enable_timing=True)).record()
        return event

    def _start(self, module: torch.nn.Module, args: tuple) -> None:
        if self.timing:
            self._started = self._now()

    def _end(self, index: int, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self.timing:
            self._spans.append((self._started, self._now()))
        self._sample("fwd", index)
        if isinstance(output, torch.Tensor) and output.requires_grad and (index == self.last or self.trace is not None):
            output.register_hook(lambda grad: self._backward(index))

    def _backward(self, index: int) -> None:
        if index == self.last and self.memory is not None:
            self.memory.sample_cache()
        self._sample("bwd", index)

    def _sample(self, phase: str, index: int) -> None:
        if self.trace is not None and self.memory is not None:
            resident = None if self.engine is None else self.engine.stats.resident_bytes
            sample = {"phase": f"{phase}{index}", "resident_bytes": resident, "memory_bytes": self.memory.current()}
            self.trace.append(sample)

    def forward_ms(self) -> float:
        """Sum of the blocks' forward times since the last call (call after a device synchronization)."""
        spans, self._spans = self._spans, []
        return sum(start.elapsed_time(end) if self.cuda else (end - start) * 1e3 for start, end in spans)


class Trainer:
    """MiniGPT, AdamW and the batch stream for one configuration; ``step`` trains one step."""

    def __init__(self, run: RunSettings, variant: Variant, data: torch.Tensor, device: torch.device) -> None:
        self.run, self.variant, self.data, self.device = run, variant, data, device
        self.steps = 0
        torch.manual_seed(run.seed)
        with torch.device(device):
            self.model = MiniGPT(run.gpt_config()).to(DTYPES[run.dtype]).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE)
        self.stream = batches(data, run.batch, run.seq, torch.Generator().manual_seed(run.seed))
        self.hooks = None if variant.compiled else BlockHooks(self.model.blocks, device)
        for block in self.model.blocks:
            if variant.kind is Kind.CHECKPOINT:
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
            if variant.compiled:
                block.compile()

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next(self.stream)
        return x.to(self.device), y.to(self.device)

    def step(self, context: Context = contextlib.nullcontext, memory: Optional[Memory] = None) -> dict:
        """One training step under ``context()``: its times, loss and (given ``memory``) memory."""
        x, y = self.batch()
        torch.manual_seed(self.run.seed + 1 + self.steps)  # same dropout masks in every configuration
        self.steps += 1
        sample_cache = (lambda: None) if memory is None else memory.sample_cache
        if self.hooks is not None:
            self.hooks.memory = memory  # sampled by the hooks during this step only
        try:
            with window(self.device, memory) as fwd_bwd:
                with context():
                    _, loss = self.model(x, y)
                sample_cache()
                loss.backward()
                sample_cache()
        finally:
            if self.hooks is not None:
                self.hooks.memory = None
        with window(self.device, memory) as opt, _one_thread_on_cpu(self.device):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        record = dict(loss=loss.item(), fwd_bwd_ms=fwd_bwd["ms"], opt_ms=opt["ms"], step_ms=fwd_bwd["ms"] + opt["ms"])
        record["cpu_ms"] = fwd_bwd["cpu_ms"] + opt["cpu_ms"]
        if memory is not None:
            record.update(peak_bytes=fwd_bwd["peak"], act_peak_bytes=fwd_bwd["rise"], opt_peak_bytes=opt["rise"])
        return record

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
    checksums: dict[str, Optional[list]] = {}
    for name, param in model.named_parameters():
        if (grad := param.grad) is None:
            checksums[name] = None
        else:
            bits = grad.detach().contiguous().view(_INT_OF_SIZE[grad.element_size()])
            checksums[name] = [int(bits.sum(dtype=torch.int64)), float(grad.double().norm())]
    return checksums


def check_attention(device: torch.device) -> list:
    """The attention kernels the gradient check may use. On CUDA flash attention, as the timed steps
    use it (its backward is deterministic under strict determinism: ATen's
    ``_flash_attention_backward`` reads the flag; the memory-efficient kernel's raises there and
    cuDNN's is not deterministic at all), with math where flash cannot run; on the CPU math (the CPU's
    fused kernel with dropout gave losses differing between processes)."""
    if device.type == "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.MATH]


@contextlib.contextmanager
def _determinism(strict: bool, attention: Optional[list] = None) -> Iterator[None]:
    """strict: deterministic kernels or an error, the ``attention`` kernels (default math), new
    memory NaN-filled (what ``torch.use_deterministic_algorithms(True)`` does). Else: deterministic
    kernels where torch has them, a warning elsewhere, and no NaN-filling (it would skew the timings)."""
    # fill_uninitialized_memory is a property of the class torch gives this module; stubs do not see it.
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = deterministic_flags.fill_uninitialized_memory  # type: ignore[attr-defined]  # see above
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    deterministic_flags.fill_uninitialized_memory = strict  # type: ignore[attr-defined]  # see above
    try:
        with sdpa_kernel(attention or [SDPBackend.MATH]) if strict else contextlib.nullcontext():
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        deterministic_flags.fill_uninitialized_memory = fill  # type: ignore[attr-defined]  # see above


@contextlib.contextmanager
def _one_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """The optimizer step on one thread on the CPU: configurations run in processes of their own
    are compared loss for loss, and AdamW's update of the same gradients and moments on two
    threads gave other parameters in 3 of 12 processes (torch 2.13.0+cpu; 0 of 12 on one thread;
    the same in the demo for torch's own save_on_cpu). Every configuration pays it alike."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _make_context(
    trainer: Trainer,
    budget_mb: Optional[float],
    engine_kwargs: dict,
    machine: Optional[offload.MachineProfile],
    slabs: Optional[PinnedSlabs] = None,
) -> tuple[Context, Optional[offload.Engine]]:
    """(context factory, engine or None) for the trainer's configuration; an engine on CUDA gets a
    link of its own that shares ``slabs`` (pinned memory) with the engines before and after it."""
    kind, model = trainer.variant.kind, trainer.model
    if kind is Kind.SAVE_ON_CPU:
        return functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=trainer.device.type == "cuda"), None
    if kind is Kind.TORCHTUNE:
        hooks = _torchtune_offload()()  # one instance, reused every step as torchtune does
        return (lambda: hooks), None
    if kind is not Kind.ENGINE:
        return contextlib.nullcontext, None
    link = CudaLink(trainer.device, slabs=slabs) if slabs is not None and trainer.device.type == "cuda" else None
    engine = offload.engine(
        budget_mb,
        policy=trainer.variant.policy,
        regions=model.blocks,
        model=model,
        machine=machine,
        seams=offload.Seams(link=link),
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
    slabs: Optional[PinnedSlabs] = None,
) -> dict:
    """Train ``run.total_steps`` steps of ``variant`` here, passing each step's record to ``emit``;
    return the summary record. ``activation_bytes`` (the reference's saved bytes) sizes budgets;
    measured here when a budget needs it and it is None. ``slabs``: pinned memory the engines
    share with other configurations' (CUDA; see ``offload._memory.arena.PinnedSlabs``)."""
    device = resolve_device(run.device)
    if variant.kind is Kind.TORCHTUNE and _torchtune_offload() and device.type != "cuda":
        raise Skipped("torchtune's OffloadActivations needs CUDA streams")
    spill = tempfile.TemporaryDirectory(prefix="offload-bench-", dir=run.spill_dir, ignore_cleanup_errors=True)
    engine_kwargs: dict[str, Any] = {"spill_dir": spill.name}
    if run.min_offload_bytes is not None:
        engine_kwargs["min_offload_mb"] = run.min_offload_bytes / MB
    trainer = Trainer(run, variant, data, device)
    memory, hooks = Memory(device, spill.name), trainer.hooks
    machine = offload.probe(device) if variant.policy in PROBED_POLICIES else None  # cached after the first
    engine: Optional[offload.Engine] = None
    summary: dict[str, Any] = {"type": "summary", "config": variant.name}
    try:
        budget_mb = None
        if variant.budget_fraction is not None:
            if activation_bytes is None:
                activation_bytes = Trainer(run, variant, data, device).saved_bytes(engine_kwargs)
            budget_mb = variant.budget_fraction * activation_bytes / MB
        if run.check_grads and not variant.compiled:
            # A shorter check batch saves proportionally less: its budget shrinks alike, so it moves what a step would.
            scale = (run.check_seq or run.seq) / run.seq
            check_mb = budget_mb and budget_mb * scale
            summary["grad_check"] = _grad_check(trainer, check_mb, engine_kwargs, machine, slabs)
        context, engine = _make_context(trainer, budget_mb, engine_kwargs, machine, slabs)
        if hooks is not None:
            hooks.timing = variant.kind is Kind.NONE
        with _determinism(strict=False) if run.deterministic else contextlib.nullcontext():
            for step in range(run.total_steps):
                if hooks is not None and step == run.total_steps - 1:
                    hooks.start_trace(engine)
                profiling = engine is not None and engine.profiling  # a profiling step is never timed
                if engine is not None:
                    engine.reset_stats()
                record = trainer.step(context, memory)
                record |= dict(type="step", config=variant.name, step=step, budget_mb=budget_mb)
                record["warmup"] = step < run.warmup or profiling
                if hooks is not None and hooks.timing:
                    record["block_forward_ms"] = hooks.forward_ms()
                if engine is not None:
                    record.update(engine.stats.to_dict())
                emit(record)
        trace = [] if hooks is None else hooks.stop_trace()
        if variant.kind is Kind.NONE:
            activation_bytes = trainer.saved_bytes(engine_kwargs)
        # the cost model's own step (pace 1): a plan read at the pace of these very steps would
        # grade the prediction against itself
        plan = None if engine is None else engine.plan
        plan = None if plan is None else plan.paced(1.0)
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
        spill.cleanup()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _grad_check(
    trainer: Trainer,
    budget_mb: Optional[float],
    engine_kwargs: dict,
    machine: Optional[offload.MachineProfile],
    slabs: Optional[PinnedSlabs] = None,
) -> dict:
    """One step on the initial weights under strict determinism, through its own context (an
    engine of its own); its loss and the gradients' checksums, or the error strict determinism raised."""
    context, engine = _make_context(trainer, budget_mb, engine_kwargs, machine, slabs)
    run = trainer.run  # a batch of its own: the timed steps see the same batches whether or not a check ran
    generator = torch.Generator().manual_seed(run.seed + CHECK_SEED_OFFSET)
    x, y = (t.to(trainer.device) for t in next(batches(trainer.data, run.batch, run.check_seq or run.seq, generator)))
    torch.manual_seed(run.seed)
    try:
        with _determinism(strict=True, attention=check_attention(trainer.device)):
            with context():
                logits, _ = trainer.model(x)
                # Cross-entropy from ops with deterministic CUDA kernels: strict mode raises on F.cross_entropy
                # on CUDA (torch.use_deterministic_algorithms lists NLLLoss among the ops without one).
                loss = -logits.float().log_softmax(-1).gather(-1, y.unsqueeze(-1)).mean()
            loss.backward()
        return {"checksums": grad_checksums(trainer.model), "loss": loss.item()}
    except RuntimeError as error:
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    finally:
        trainer.model.zero_grad(set_to_none=True)
        if engine is not None:
            engine.close()
