"""``OffloadCallback`` for Hugging Face's ``transformers.Trainer``: its training forwards under one engine.

    trainer = Trainer(model, args, train_dataset=data, callbacks=[OffloadCallback(budget_mb=4096)])
    trainer.train()

The seam is the model's ``forward``. The Trainer calls ``model(**inputs)`` (through DDP, FSDP or
accelerate's wrappers, which all end in the module's ``forward``) inside ``training_step``, which a
callback cannot wrap; at ``on_train_begin`` the callback puts a wrapper in ``model.forward`` (the
instance attribute, ``functools.wraps``-ed so the Trainer still reads the model's signature), and at
``on_train_end`` it puts the previous one back. The wrapper enters the engine only for a training
forward: the model in train mode *and* grad enabled. Evaluation (eval mode, ``no_grad``) and
``generate`` (``no_grad``) pass straight through; without grad nothing is saved anyway.

    on_train_begin   engine made, model.forward wrapped
    training_step    model.train(); forward under the engine; backward after it (the engine's unpacks)
      ... gradient accumulation: one forward per micro-batch, each under the engine
    evaluate         model.eval(), no_grad: the wrapper passes through
    on_log           the engine's figures since the previous entry are added to the entry
    on_train_end     model.forward restored, engine closed (spill files gone); .engine stays readable

The model's own gradient checkpointing (``gradient_checkpointing=True``) runs inside the forward:
``torch.utils.checkpoint`` installs its own hooks per layer, so the engine then manages what lies
between the layers (their inputs under reentrant checkpointing, the embeddings and the head).
With ``regions=`` the regions then see only their inputs; the engine warns at the first step, and
``explain`` says so, naming the two ways out (the model's checkpointing off, or the regions gone).

With ``torch_compile=True`` the compiled module calls this wrapper, so the engine would be entered
inside compiled code, which it does not support (compile blocks and keep the engine outside, as
the README says); that combination is not tested.

A ``train()`` that raises never reaches ``on_train_end``: the engine stays open and the wrapper in
place until the next ``train()`` replaces them (or the engine is collected).

Log entries: the Trainer hands its callbacks the entry after it has appended a copy to
``state.log_history``; this callback adds its figures to both. Reporters named in ``report_to``
are callbacks too, called before the ones passed in ``callbacks=``, so they log the entry
without these figures; callbacks after this one (the progress bar, the printer) see them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Optional

import torch

import offload

from .._api import check_keywords
from .._attach import attach, detach
from ._figures import log_figures

try:
    import transformers
except ImportError as error:
    raise ImportError(
        "offload.integrations.hf needs transformers (and accelerate, which its Trainer needs): "
        "pip install 'offload[hf]'"
    ) from error

__all__ = ["OffloadCallback"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Run:
    """One ``train()`` call: its engine, the model whose ``forward`` is wrapped, the log bookkeeping."""

    engine: offload.Engine
    model: torch.nn.Module
    logged: offload.Stats
    """The engine's stats at the previous log entry (or at train begin)."""
    previous_forward: Any = None
    """What the instance attribute ``forward`` held before (accelerate's autocast wrapper, ...), as
    ``_attach.attach`` returned it (it stands for "none" too)."""
    wrapper: Any = None
    forwards_since_log: int = 0

    def restore_forward(self) -> None:
        if self.model.__dict__.get("forward") is not self.wrapper:
            # Something wrapped our wrapper since; leave the chain alone (ours passes through now).
            logger.debug("model.forward was wrapped again after train begin; leaving it in place")
        else:
            detach(self.model, "forward", self.previous_forward)


class OffloadCallback(transformers.TrainerCallback):
    """Run every training forward of a ``transformers.Trainer`` under one offload engine.

    Takes the keyword arguments of :func:`offload.engine` (``budget_mb``, ``spill_dir``,
    ``regions``, ``policy``, ...); they are checked here, so a bad one raises the engine's own
    ``ValueError`` / ``TypeError`` now rather than when training starts. The engine is made at
    train begin (the Trainer's model is watched: its buffers never move) and closed at train end;
    ``callback.engine`` and its ``stats`` stay readable afterwards. Each ``train()`` call gets a
    fresh engine.
    """

    def __init__(self, **engine_kwargs: Any) -> None:
        check_keywords(engine_kwargs, where="OffloadCallback()")
        offload.engine(**engine_kwargs).close()  # the engine's own checks, at construction
        self._engine_kwargs = engine_kwargs
        self.engine: Optional[offload.Engine] = None
        """The engine of the latest ``train()`` (closed once it ended); None before the first."""
        self._run: Optional[_Run] = None

    # ------------------------------------------------------------------ Trainer events

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise TypeError("OffloadCallback needs the Trainer's model; the Trainer passes it to every callback event")
        self._finish()  # a previous train() that raised never reached on_train_end
        # The model it holds names the regions (and regions="auto" searches it).
        self.engine = offload.engine(**({"model": model} | self._engine_kwargs))
        run = _Run(self.engine, model, logged=self.engine.stats)
        run.wrapper = self._wrap(run, model.forward)
        run.previous_forward = attach(model, "forward", run.wrapper)  # See Note: [a copy carries no engine]
        self._run = run

    def on_log(self, args, state, control, logs=None, **kwargs):
        run = self._run
        if run is None or run.forwards_since_log == 0 or logs is None:
            return  # an entry with no training forward behind it (evaluation, the final summary)
        now = run.engine.stats
        figures = log_figures(run.logged, now)
        logs.update(figures)
        if state.log_history:
            state.log_history[-1].update(figures)  # the Trainer appended this entry's copy just before
        run.logged = now
        run.forwards_since_log = 0

    def on_train_end(self, args, state, control, **kwargs):
        self._finish()

    # ------------------------------------------------------------------ the forward seam

    def _wrap(self, run: _Run, forward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(forward)
        def training_forward(*args, **kwargs):
            if run is not self._run or not (run.model.training and torch.is_grad_enabled()):
                return forward(*args, **kwargs)
            run.forwards_since_log += 1
            with run.engine:
                return forward(*args, **kwargs)

        return training_forward

    def _finish(self) -> None:
        """Put the model's forward back and close the engine (idempotent)."""
        run, self._run = self._run, None
        if run is not None:
            run.restore_forward()
            run.engine.close()
